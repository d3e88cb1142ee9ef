"""mixprec.torch.GradScaler against torch.amp.GradScaler under Hypothesis: random call
sequences (gradients of any magnitude, inf and NaN among them, unscale_ or not, state
round trips, setters) leave both with the same scale, the same skipped steps and bitwise the
same weights; random constructor arguments end as the same acceptance (numpy scalars and
integral floats as torch takes them) or a refusal naming the argument. Profiles:
tests/python/hypothesis_profiles.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (scripts/deps.sh)")
from hypothesis import example, given, strategies as st  # noqa: E402

import hypothesis_profiles  # noqa: E402,F401
from hypothesis_profiles import ci_examples, clean_refusal  # noqa: E402

torch = pytest.importorskip("torch")
from mixprec.torch import GradScaler  # noqa: E402

torch.set_num_threads(1)

# One step: the gradient values of two parameters (scaled), whether to unscale_ first, and a
# state round trip or a setter after the update.
magnitudes = st.one_of(st.floats(-1e4, 1e4, width=32), st.sampled_from([math.inf, -math.inf, math.nan, 0.0, 1e-30]))
step = st.tuples(st.lists(magnitudes, min_size=3, max_size=3), st.lists(magnitudes, min_size=2, max_size=2),
                 st.booleans(), st.sampled_from(["none", "state", "growth_factor", "growth_interval"]))


def run(scaler, steps, init):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w, b], lr=0.01)
    scaler.scale(torch.ones(()))  # torch.amp makes its scale tensor here
    trace = []
    for gw, gb, unscale_first, extra in steps:
        w.grad = torch.tensor(gw, dtype=torch.float32) * scaler.get_scale()
        b.grad = torch.tensor(gb, dtype=torch.float32) * scaler.get_scale()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if extra == "state":
            scaler.load_state_dict(scaler.state_dict())
        elif extra == "growth_factor":
            scaler.set_growth_factor(3.0)
        elif extra == "growth_interval":
            scaler.set_growth_interval(2)
        trace.append((scaler.get_scale(), w.detach().clone(), b.detach().clone()))
        opt.zero_grad()
    return trace


@ci_examples(20)
@given(init=st.sampled_from([1.0, 2.0**8, 2.0**16, 2.0**24]), interval=st.integers(1, 4),
       steps=st.lists(step, min_size=1, max_size=6))
@example(init=1.0, interval=1, steps=[([math.inf, 0.0, 0.0], [0.0, 0.0], False, "none")] * 3)  # below scale 1
def test_random_sequences_equal_torch_amp(init, interval, steps):
    ours = run(GradScaler("cpu", init_scale=init, growth_interval=interval), steps, init)
    ref = run(torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval), steps, init)
    for k, ((s1, w1, b1), (s2, w2, b2)) in enumerate(zip(ours, ref)):
        assert s1 == s2, f"step {k + 1}: scale {s1} != torch's {s2}"
        assert torch.equal(w1, w2) and torch.equal(b1, b2), f"step {k + 1}: weights differ"


numbers = st.one_of(st.integers(-5, 2**20), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([np.float64(1024.0), np.float32(2.0), np.int64(20), 20.0, 2.9, "8", None]))


@given(init_scale=numbers, growth_factor=numbers, backoff_factor=numbers, growth_interval=numbers)
@example(init_scale=np.float64(1024.0), growth_factor=None, backoff_factor=None, growth_interval=20.0)
@example(init_scale=None, growth_factor=None, backoff_factor=None, growth_interval=2.9)
def test_constructor_arguments_are_taken_as_torch_takes_them_or_refused_by_name(init_scale, growth_factor,
                                                                               backoff_factor, growth_interval):
    kw = {k: v for k, v in dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                                growth_interval=growth_interval).items() if v is not None}
    try:
        s = GradScaler("cpu", **kw)
    except (TypeError, ValueError) as e:
        assert clean_refusal(e, *kw), str(e)
        return
    # Accepted: torch takes the same numbers, and both start at the same scale and interval.
    ref = torch.amp.GradScaler("cpu", **kw)
    assert s.get_scale() == ref.get_scale()
    assert s.get_growth_interval() == ref.get_growth_interval()
