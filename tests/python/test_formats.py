"""mixprec.encode / mixprec.decode against NumPy, ml_dtypes and the references of reference.py.

Inputs (docs/testing.md, "Python"): for every format, every fp32 value that an f16 code decodes
to; every rounding boundary of the format (the midpoint between each pair of neighbouring
codes, and the fp32 values one ulp either side), the overflow midpoint above max finite;
fp32 specials (zeros, infinities, quiet and signalling NaNs with payloads, subnormals); a
sample of every sign and fp32 exponent (1024 random mantissas each); 2^18 random bit patterns.
MIXPREC_PY_EXHAUSTIVE=1 also sweeps all 2^32 fp32 inputs (minutes per format).
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import mixprec
import reference as ref

FORMATS = ["f16", "bf16", "f8e4m3", "f8e5m2"]
MODES = [("ieee", "keep"), ("saturate", "keep"), ("ieee", "flush"), ("saturate", "flush")]

RNG_SEED = 20261130


def all_codes(fmt: str) -> np.ndarray:
    bits, *_rest, dtype = ref.SPECS[fmt]
    return np.arange(1 << bits, dtype=np.uint32).astype(dtype)


def f16_patterns_decoded() -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def boundaries(fmt: str) -> np.ndarray:
    """Midpoints between neighbouring finite codes (exact in fp32), one fp32 ulp either side,
    and the overflow midpoint above max finite; both signs."""
    _, _, _, max_code, dtype = ref.SPECS[fmt]
    codes = np.arange(0, max_code + 1, dtype=np.uint32).astype(dtype)
    vals = ref.decode_codes(fmt, codes).astype(np.float64)
    ulp_top = vals[-1] - vals[-2]
    upper = np.append(vals[1:], vals[-1] + ulp_top)
    mids = ((vals + upper) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (vals + upper) / 2), "midpoints must be exact in fp32"
    around = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    return np.concatenate([around, -around, vals.astype(np.float32), -vals.astype(np.float32)])


def specials() -> np.ndarray:
    patterns = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,                      # zeros, infinities
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF,  # NaNs
        0x7FC12345, 0xFFA00000, 0x7F812345,
        0x00000001, 0x80000001, 0x007FFFFF, 0x00400000, 0x00000800,          # fp32 subnormals
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000,          # min normal, max, +-1
    ]
    vals = [np.uint32(p).view(np.float32) for p in patterns]
    for fmt in FORMATS:  # each format's max, min normal, min subnormal and half of it
        _, man, _, max_code, dtype = ref.SPECS[fmt]
        c = np.array([max_code, 1 << man, 1], dtype=np.uint32).astype(dtype)
        v = ref.decode_codes(fmt, c)
        vals += list(v) + list(v / 2) + list(-v)
    return np.array(vals, dtype=np.float32)


def per_exponent_sample(per: int = 1024) -> np.ndarray:
    rng = np.random.default_rng(RNG_SEED)
    sign_exp = np.repeat(np.arange(512, dtype=np.uint32), per) << 23
    mant = rng.integers(0, 1 << 23, sign_exp.size, dtype=np.uint32)
    return (sign_exp | mant).view(np.float32)


def random_patterns(n: int = 1 << 18) -> np.ndarray:
    rng = np.random.default_rng(RNG_SEED + 1)
    return rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def inputs(fmt: str) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate(
        [f16_patterns_decoded(), boundaries(fmt), specials(), per_exponent_sample(), random_patterns()]))


@pytest.fixture(scope="module", params=FORMATS)
def fmt_inputs(request):
    return request.param, inputs(request.param)


def check_encode(fmt, x, overflow="ieee", subnormals="keep", scale=1.0):
    codes, stats = mixprec.encode(x, fmt, overflow=overflow, subnormals=subnormals, scale=scale)
    want = ref.expected_codes(fmt, x, overflow, subnormals, scale)
    assert codes.dtype == want.dtype and codes.shape == x.shape
    assert np.array_equal(codes, want), f"{fmt} {overflow}/{subnormals} scale {scale}\n" + ref.hex_mismatches(x, codes, want)
    assert mixprec.stats_dict(stats) == ref.expected_stats(fmt, x, overflow, subnormals, scale)


def test_installed_package_is_used():
    # make test-python runs pytest outside the repository: the package must be the installed one.
    here = pathlib.Path(__file__).resolve().parents[2]
    assert not pathlib.Path(mixprec.__file__).resolve().is_relative_to(here / "python"), mixprec.__file__
    assert mixprec.FORMATS == tuple(FORMATS)


def test_f16_equals_numpy_on_every_f16_value_and_boundary():
    # NumPy's astype(float16) directly (no reference code in between) for every non-NaN input;
    # NaN inputs: NumPy keeps signalling NaNs signalling, the core quiets them (docs/python.md).
    x = np.concatenate([f16_patterns_decoded(), boundaries("f16"), specials()])
    codes, _ = mixprec.encode(x, "f16")
    with np.errstate(all="ignore"):
        numpy_codes = x.astype(np.float16).view(np.uint16)
    keep = ~np.isnan(x)
    assert np.array_equal(codes[keep], numpy_codes[keep]), ref.hex_mismatches(x[keep], codes[keep], numpy_codes[keep])
    assert np.count_nonzero(keep) > 250_000
    nan = np.isnan(x)
    assert np.array_equal(codes[nan], ref.quiet_nan_code("f16", x[nan])), ref.hex_mismatches(
        x[nan], codes[nan], ref.quiet_nan_code("f16", x[nan]))
    # quiet NaNs agree with NumPy bit for bit too
    quiet = nan & ((ref.bits32(x) & 0x00400000) != 0)
    assert np.array_equal(codes[quiet], numpy_codes[quiet])


def test_bf16_matches_ml_dtypes_on_non_nan():
    if ref.ml_dtypes is None:
        pytest.skip("ml_dtypes not installed")
    x = inputs("bf16")
    codes, _ = mixprec.encode(x, "bf16")
    keep = ~np.isnan(x)
    with np.errstate(all="ignore"):
        want = x[keep].astype(ref.ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(codes[keep], want), ref.hex_mismatches(x[keep], codes[keep], want)


@pytest.mark.parametrize("overflow,subnormals", MODES)
def test_encode_every_input_class(fmt_inputs, overflow, subnormals):
    fmt, x = fmt_inputs
    check_encode(fmt, x, overflow, subnormals)


@pytest.mark.parametrize("scale", [2.0 ** -10, 3.0, 2.0 ** 20])
def test_encode_with_scale(fmt_inputs, scale):
    fmt, x = fmt_inputs
    check_encode(fmt, x, "ieee", "keep", scale)
    check_encode(fmt, x, "saturate", "flush", scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("subnormals", ["keep", "flush"])
def test_decode_every_code(fmt, subnormals):
    codes = all_codes(fmt)
    got = mixprec.decode(codes, fmt, subnormals=subnormals)
    want = ref.decode_codes(fmt, codes)
    if subnormals == "flush":
        sub = ref.is_subnormal_code(fmt, codes)
        want = np.where(sub, np.where(codes.astype(np.uint32) & ref.sign_mask(fmt), np.float32(-0.0), np.float32(0.0)),
                        want).astype(np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(ref.bits32(got), ref.bits32(want)), ref.hex_mismatches_f32(codes, got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_with_scale_and_round_trip(fmt):
    codes = all_codes(fmt)
    got = mixprec.decode(codes, fmt, scale=0.25)
    want = ref.decode_codes(fmt, codes) * np.float32(0.25)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite], want[finite])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    # every non-NaN code survives decode -> encode
    back, _ = mixprec.encode(mixprec.decode(codes, fmt), fmt)
    keep = ~ref.is_nan_code(fmt, codes)
    assert np.array_equal(back[keep], codes[keep]), ref.hex_mismatches(mixprec.decode(codes, fmt)[keep], back[keep], codes[keep])


def test_stats_on_a_known_array():
    # Hand-counted: 1e-8 underflows in f16, 6e-8 is subnormal, 7e4 overflows, NaN is non-finite.
    x = np.array([1e-8, 1.0, 7e4, np.nan, -0.0, 6e-8, 0.0, -np.inf], np.float32)
    _, s = mixprec.encode(x, "f16")
    assert (s.elements, s.nonzero, s.nonfinite_input, s.underflow, s.subnormal, s.overflow) == (8, 6, 2, 1, 1, 1)
    _, s = mixprec.encode(x, "f16", overflow="saturate", subnormals="flush")
    assert (s.underflow, s.subnormal, s.overflow) == (2, 0, 1)


@pytest.mark.skipif(os.environ.get("MIXPREC_PY_EXHAUSTIVE") != "1", reason="set MIXPREC_PY_EXHAUSTIVE=1 (minutes)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_exhaustive_fp32(fmt):
    chunk = 1 << 24
    for start in range(0, 1 << 32, chunk):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        codes, _ = mixprec.encode(x, fmt)
        want = ref.expected_codes(fmt, x)
        assert np.array_equal(codes, want), ref.hex_mismatches(x, codes, want)


# ---- stochastic rounding ----------------------------------------------------------------

def test_stochastic_extremes_truncate_or_round_away():
    # random = 0 keeps the lower magnitude, random = 2^32-1 takes the upper one (inexact values).
    x = per_exponent_sample(64)
    x = x[np.isfinite(x) & (np.abs(x) < 1e38)]
    low, s = mixprec.encode(x, "bf16", rounding="stochastic", random=np.zeros(x.size, np.uint32))
    assert s is None
    high, _ = mixprec.encode(x, "bf16", rounding="stochastic", random=np.full(x.size, 0xFFFFFFFF, np.uint32))
    trunc = (ref.bits32(x) >> 16).astype(np.uint16)
    exact = (ref.bits32(x) & 0xFFFF) == 0
    assert np.array_equal(low, trunc), ref.hex_mismatches(x, low, trunc)
    want_high = np.where(exact, trunc, trunc + 1).astype(np.uint16)
    assert np.array_equal(high, want_high), ref.hex_mismatches(x, high, want_high)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_is_unbiased(fmt):
    # 1 + a quarter of the gap above 1 rounds up with probability 1/4.
    _, man, *_ = ref.SPECS[fmt]
    n = 200_000
    x = np.full(n, 1.0 + 0.25 * 2.0 ** -man, np.float32)
    random = np.random.default_rng(RNG_SEED).integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    codes, _ = mixprec.encode(x, fmt, rounding="stochastic", random=random)
    one = ref.rne_codes(fmt, np.ones(1, np.float32))[0]
    assert set(np.unique(codes).tolist()) == {int(one), int(one) + 1}
    up = np.count_nonzero(codes == one + 1) / n
    assert abs(up - 0.25) < 0.01, up


def test_stochastic_misuse():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="random"):
        mixprec.encode(x, "f16", rounding="stochastic")
    with pytest.raises(TypeError, match="uint32"):
        mixprec.encode(x, "f16", rounding="stochastic", random=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="expected 4 elements"):
        mixprec.encode(x, "f16", rounding="stochastic", random=np.zeros(3, np.uint32))
    with pytest.raises(ValueError, match="random: only used"):
        mixprec.encode(x, "f16", random=np.zeros(4, np.uint32))
    with pytest.raises(ValueError, match="'nearest' or 'stochastic'"):
        mixprec.encode(x, "f16", rounding="up")


# ---- no copies, and clear errors -------------------------------------------------------------

def test_input_buffer_is_used_in_place():
    big = np.arange(100, dtype=np.float32)
    view = big[10:50]  # C-contiguous view at an offset
    assert mixprec._core.buffer_address(big) == big.ctypes.data
    assert mixprec._core.buffer_address(view) == big.ctypes.data + 40
    codes = np.arange(100, dtype=np.uint16).reshape(10, 10)
    assert mixprec._core.buffer_address(codes) == codes.ctypes.data


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_is_written_in_place(fmt):
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8)
    dtype = ref.SPECS[fmt][4]
    out = np.full(64, 0xAB, dtype)
    codes, stats = mixprec.encode(x, fmt, out=out)
    assert codes is out
    assert np.array_equal(out, ref.expected_codes(fmt, x).reshape(-1))
    assert stats.elements == 64
    back = np.full((8, 8), np.nan, np.float32)
    result = mixprec.decode(out, fmt, out=back)
    assert result is back
    assert np.array_equal(back, ref.decode_codes(fmt, out).reshape(8, 8))
    # a new array keeps the input's shape
    codes2, _ = mixprec.encode(x, fmt)
    assert codes2.shape == (8, 8) and codes2.dtype == dtype
    assert not np.shares_memory(codes2, x)


def test_f16_out_may_be_float16():
    x = np.array([1.5, 65504.0, 1e-6], np.float32)
    out = np.empty(3, np.float16)
    mixprec.encode(x, "f16", out=out)
    assert np.array_equal(out.view(np.uint16), x.astype(np.float16).view(np.uint16))
    assert np.array_equal(mixprec.decode(out, "f16"), out.astype(np.float32))


def test_read_only_input_is_accepted():
    x = np.array([1.0, 2.0], np.float32)
    x.flags.writeable = False
    codes, _ = mixprec.encode(x, "bf16")
    assert codes.tolist() == [0x3F80, 0x4000]


def test_empty_and_zero_dim():
    codes, s = mixprec.encode(np.zeros(0, np.float32), "f16")
    assert codes.shape == (0,) and s.elements == 0
    codes, s = mixprec.encode(np.array(2.0, np.float32), "f16")
    assert codes.shape == () and int(codes) == 0x4000


@pytest.mark.parametrize("bad,error,message", [
    (np.ones(4, np.float64), TypeError, "x: expected dtype float32, found float64"),
    (np.ones(4, np.float16), TypeError, "x: expected dtype float32, found float16"),
    (np.ones(4, np.int32), TypeError, "x: expected dtype float32, found int32"),
    (np.ones(8, np.float32)[::2], ValueError, "x: expected a C-contiguous array, found a strided view"),
    (np.ones((3, 4), np.float32).T, ValueError, "C-contiguous"),
    ([1.0, 2.0], TypeError, "x: expected a NumPy array .* of float32, found list"),
    (None, TypeError, "found NoneType"),
])
def test_bad_input_is_refused(bad, error, message):
    with pytest.raises(error, match=message):
        mixprec.encode(bad, "f16")


def test_bad_out_and_options_are_refused():
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="out: expected dtype uint16 or float16 .*found uint8"):
        mixprec.encode(x, "f16", out=np.zeros(4, np.uint8))
    with pytest.raises(TypeError, match=r"out: expected dtype uint8 \(f8e4m3 codes\), found uint16"):
        mixprec.encode(x, "f8e4m3", out=np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="out: expected 4 elements .*found 3"):
        mixprec.encode(x, "bf16", out=np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="C-contiguous"):
        mixprec.encode(x, "bf16", out=np.zeros(8, np.uint16)[::2])
    ro = np.zeros(4, np.uint16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        mixprec.encode(x, "bf16", out=ro)
    with pytest.raises(ValueError, match="format: expected one of f16, bf16, f8e4m3, f8e5m2, found 'fp8'"):
        mixprec.encode(x, "fp8")
    with pytest.raises(ValueError, match="overflow: expected 'ieee' or 'saturate', found 'clip'"):
        mixprec.encode(x, "f16", overflow="clip")
    with pytest.raises(ValueError, match="subnormals: expected 'keep' or 'flush'"):
        mixprec.encode(x, "f16", subnormals="ftz")
    for scale in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            mixprec.encode(x, "f16", scale=scale)
    with pytest.raises(TypeError, match="codes: expected dtype uint16 \\(bf16 codes\\), found float32"):
        mixprec.decode(x, "bf16")
    with pytest.raises(TypeError, match="out: expected dtype float32, found float64"):
        mixprec.decode(np.zeros(4, np.uint8), "f8e5m2", out=np.zeros(4, np.float64))
    # the core reads one buffer while writing the other: overlapping memory is refused
    buf = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="out: expected memory apart from x"):
        mixprec.encode(buf, "f16", out=buf.view(np.uint16)[:8])
    codes = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="out: expected memory apart from codes"):
        mixprec.decode(codes[:4], "bf16", out=codes.view(np.float32)[:4])
    bits = np.zeros(16, np.uint32)
    with pytest.raises(ValueError, match="out: expected memory apart from random"):
        mixprec.encode(np.ones(8, np.float32), "f8e5m2", rounding="stochastic", random=bits[:8],
                       out=bits.view(np.uint8)[28:36])  # the last word of random and the next one
    # nothing was written to out before the checks failed
    out = np.full(4, 7, np.uint16)
    with pytest.raises(ValueError):
        mixprec.encode(x, "f16", scale=0.0, out=out)
    assert out.tolist() == [7, 7, 7, 7]
