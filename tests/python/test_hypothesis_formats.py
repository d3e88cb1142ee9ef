"""Properties of mixprec.encode/decode (docs/python.md, "Formats") under Hypothesis: random
float32 arrays (every bit pattern, any shape, views with the negative bit) round-trip as the
peers' casts round (NumPy's float16, ml_dtypes' bfloat16 and float8), the counts match a
plain count, and random arguments end as a result or a refusal that names the argument
(never a nanobind dump). Profiles: tests/python/hypothesis_profiles.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (scripts/deps.sh)")
from hypothesis import example, given, strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

import hypothesis_profiles  # noqa: E402,F401  (loads the profile)
from hypothesis_profiles import clean_refusal  # noqa: E402
import mixprec  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes")

PEER = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f8e4m3": ml_dtypes.float8_e4m3fn,
        "f8e5m2": ml_dtypes.float8_e5m2}

# Every float32 bit pattern is possible (NaNs, infinities, subnormals, signed zeros).
f32_arrays = hnp.arrays(np.uint32, hnp.array_shapes(min_dims=0, max_dims=3, max_side=9),
                        elements=st.integers(0, 2**32 - 1)).map(lambda a: a.view(np.float32))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN equal to NaN, the sign of zero included."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


@given(x=f32_arrays, fmt=st.sampled_from(sorted(PEER)))
@example(x=np.array([65520.0, -65504.0, 6e-8, -0.0], np.float32), fmt="f16")  # the overflow and underflow edges
@example(x=np.array([448.0, 464.0, np.inf, np.nan], np.float32), fmt="f8e4m3")  # E4M3 has no inf: NaN
def test_round_trip_equals_the_peer_cast(x, fmt):
    codes, stats = mixprec.encode(x, fmt)
    back = mixprec.decode(codes, fmt)
    with np.errstate(over="ignore", invalid="ignore"):  # the peer's overflow to inf is the expected value
        peer = x.astype(PEER[fmt]).astype(np.float32)
    if fmt == "f8e4m3":
        # ml_dtypes' E4M3 cast saturates nothing and has no inf: inf and overflow become NaN, as ieee mode here.
        peer = np.where(np.isinf(x), np.float32(np.nan), peer)
    assert same(back, peer), (x, back, peer)
    assert stats.elements == x.size
    assert stats.nonzero == int(np.count_nonzero(x))
    assert stats.nonfinite_input == int(np.count_nonzero(~np.isfinite(x)))


@given(x=f32_arrays, fmt=st.sampled_from(sorted(PEER)))
def test_saturate_never_produces_inf_from_a_finite_input(x, fmt):
    codes, _ = mixprec.encode(x, fmt, overflow="saturate")
    back = mixprec.decode(codes, fmt)
    finite = np.isfinite(x)
    assert np.all(np.isfinite(back[finite]))


torch = pytest.importorskip("torch")


@given(values=hnp.arrays(np.float32, st.integers(1, 16), elements=st.floats(-1e4, 1e4, width=32)),
       fmt=st.sampled_from(sorted(PEER)))
def test_a_neg_bit_view_encodes_its_values(values, fmt):
    z = torch.complex(torch.zeros(len(values)), torch.from_numpy(values))
    view = z.conj().imag  # the values negated, through the negative bit
    codes, _ = mixprec.encode(view, fmt)
    expected, _ = mixprec.encode(-values, fmt)
    assert np.array_equal(codes, expected)


# Arguments of any kind: a result or a refusal naming the argument.
anything = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(), max_size=3),
                     st.sampled_from(["f16", "bf16", "f8e4m3", "f8e5m2", "ieee", "saturate", "keep", "flush"]))


@given(fmt=anything, overflow=anything, subnormals=anything, scale=anything)
@example(fmt="f16", overflow="ieee", subnormals="keep", scale=None)  # was "float() argument must be ..." unnamed
@example(fmt="f16", overflow="ieee", subnormals="keep", scale=2**70)
def test_random_arguments_end_as_a_result_or_a_named_refusal(fmt, overflow, subnormals, scale):
    x = np.array([1.0, -2.5, 3e-7], np.float32)
    try:
        codes, _ = mixprec.encode(x, fmt, overflow=overflow, subnormals=subnormals, scale=scale)
    except (TypeError, ValueError) as e:
        assert clean_refusal(e, "format", "overflow", "subnormals", "scale", "x"), str(e)
        return
    assert fmt in PEER and math.isfinite(float(scale)) and float(scale) > 0
    assert codes.shape == x.shape


@given(x=st.one_of(st.none(), st.integers(), st.text(max_size=4),
                   hnp.arrays(st.sampled_from([np.float64, np.int32, np.dtype(">f4"), np.float16]),
                              st.integers(0, 4))))
@example(x=np.zeros(3, np.dtype(">f4")))  # big-endian: "found ndarray" named neither dtype nor order
@example(x=None)                          # nanobind's argument dump
def test_arrays_of_the_wrong_kind_are_refused_by_name(x):
    with pytest.raises((TypeError, ValueError)) as e:
        mixprec.encode(x, "f16")
    assert clean_refusal(e.value, "x"), str(e.value)
