"""mixprec.torch.EMA: the average follows applied optimizer steps only (issue 47).

The formula is checked element by element against exact rational arithmetic (torch.lerp's
rule, the product and the sum rounded once); a skipped step, given as a StepOutcome, a bool or
the GradScaler itself, leaves every shadow byte and the counter as they were, also with a real
mixprec.torch.GradScaler in fp16 autocast whose step an injected inf made it skip.
"""

from __future__ import annotations

import copy
import io
import math
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")

from mixprec.torch import EMA, GradScaler, StepOutcome  # noqa: E402

torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({4: torch.int32, 8: torch.int64, 2: torch.int16}[t.element_size()]).clone()


def snapshot(ema: EMA):
    return ema.num_updates, {n: bits(ema.shadow(n)) for n in ema.names}


def same(a, b) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def outcome(applied: bool) -> StepOutcome:
    return StepOutcome(applied, not applied, -1, "", 1.0 if applied else math.inf, 1.0)


def round_f32(x: Fraction) -> np.float32:
    """x rounded to the nearest float32 (ties to even), from exact arithmetic."""
    f = np.float32(float(x))
    best = None
    for c in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        key = (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1)
        if best is None or key < best[0]:
            best = (key, c)
    return best[1]


def reference_lerp(s: np.ndarray, p: np.ndarray, d: float) -> np.ndarray:
    """The documented rule, one element at a time: w = 1 - d in float32 (d rounded first); for
    w < 0.5 s + w * (p - s), else p - (p - s) * (1 - w), with p - s and 1 - w rounded to
    float32 and the product and the sum rounded once."""
    wf = np.float32(1) - np.float32(d)
    out = np.empty_like(s)
    for i, (a, b) in enumerate(zip(s.reshape(-1), p.reshape(-1))):
        d = Fraction(float(np.float32(b - a)))
        if wf < 0.5:
            out.reshape(-1)[i] = round_f32(Fraction(float(a)) + Fraction(float(wf)) * d)
        else:
            out.reshape(-1)[i] = round_f32(Fraction(float(b)) - d * Fraction(float(np.float32(1) - wf)))
    return out


def reference_lerp64(s: np.ndarray, p: np.ndarray, d: float) -> np.ndarray:
    """The same rule for a float64 shadow: w = 1 - d in float64, one rounding to float64."""
    w = 1.0 - d
    out = np.empty_like(s)
    for i, (a, b) in enumerate(zip(s.reshape(-1).tolist(), p.reshape(-1).tolist())):
        diff = Fraction(b - a)
        x = Fraction(a) + Fraction(w) * diff if w < 0.5 else Fraction(b) - diff * Fraction(1.0 - w)
        out.reshape(-1)[i] = float(x)  # Fraction -> float rounds correctly
    return out


@pytest.mark.parametrize("decay,warmup", [(0.999, False), (0.9, False), (0.3, False), (0.0, False), (0.99, True)])
def test_update_is_the_documented_formula_element_by_element(decay, warmup):
    torch.manual_seed(0)
    params = [("a", torch.nn.Parameter(torch.randn(37))),
              ("b", torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float16))),
              ("c", torch.nn.Parameter(torch.randn(2, 9, dtype=torch.bfloat16))),
              ("d", torch.nn.Parameter(torch.randn(11, dtype=torch.float64)))]
    ema = EMA(params, decay=decay, warmup=warmup)
    ref = {n: p.detach().to(torch.float64 if n == "d" else torch.float32).numpy().copy() for n, p in params}
    for n, s in ((n, ema.shadow(n)) for n, _ in params):
        assert s.dtype == (torch.float64 if n == "d" else torch.float32)
    for step in range(1, 6):
        with torch.no_grad():
            for _, p in params:
                p.add_(torch.randn_like(p) * 0.5)
        d = min(decay, (1 + step) / (10 + step)) if warmup else decay
        assert ema.current_decay() == d
        assert ema.update() is True
        assert ema.num_updates == step
        for n, p in params:
            if n == "d":
                ref[n] = reference_lerp64(ref[n], p.detach().numpy(), d)
            else:
                ref[n] = reference_lerp(ref[n], p.detach().float().numpy(), d)
            got = ema.shadow(n).numpy()
            view = np.uint64 if n == "d" else np.uint32
            assert np.array_equal(got.view(view), ref[n].view(view)), (n, step)
    # A shadow equal to its parameter stays equal (lerp has no drift).
    ema2 = EMA(params, decay=decay)
    before = snapshot(ema2)
    ema2.update(True)
    assert torch.equal(before[1]["a"], snapshot(ema2)[1]["a"])


@pytest.mark.parametrize("skip", ["outcome", "bool", "scaler"])
def test_a_skipped_step_changes_no_shadow_byte_nor_the_counter(skip):
    torch.manual_seed(1)
    model = Net()
    ema = EMA(model, decay=0.9, buffers=True)
    assert "bn.running_mean" in ema.names and "bn.num_batches_tracked" not in ema.names
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert ema.update(outcome(True))
    before = snapshot(ema)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    scaler = GradScaler("cpu")
    if skip == "outcome":
        arg = outcome(False)
    elif skip == "bool":
        arg = False
    else:
        scaler.last_outcome = outcome(False)  # as a skipped step() leaves it
        arg = scaler
    assert ema.update(arg) is False
    assert same(before, snapshot(ema))
    assert ema.num_updates == 1


def test_real_grad_scaler_fp16_autocast_injected_inf_is_skipped_and_the_ema_holds():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    ema = EMA(model, decay=0.95)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    applied = []
    for step in range(1, 6):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == 3:
            model[2].weight.grad[1, 7] = math.inf  # after backward: the step must be skipped
        weights = [p.detach().clone() for p in model.parameters()]
        before = snapshot(ema)
        out = scaler.step(opt)
        applied.append(out.applied)
        took = ema.update(scaler if step % 2 else out)  # the scaler (its last_outcome) or the outcome
        scaler.update()
        opt.zero_grad()
        assert took == out.applied
        if step == 3:
            assert not out.applied and out.found_inf
            assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
            assert same(before, snapshot(ema))
        else:
            assert out.applied
            assert not same(before, snapshot(ema))
    assert applied == [True, True, False, True, True]
    assert ema.num_updates == 4
    # The same outcome twice is a second update() without a step: refused, nothing changed.
    before = snapshot(ema)
    with pytest.raises(RuntimeError, match="already taken by the previous update"):
        ema.update(scaler)
    assert same(before, snapshot(ema))


def test_state_dict_round_trip_is_bitwise():
    torch.manual_seed(3)
    model = Net()
    ema = EMA(model, decay=0.99, buffers=True)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
    buf = io.BytesIO()
    torch.save(ema.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    other = EMA(Net(), decay=0.5, buffers=True)
    other.load_state_dict(state)
    assert same(snapshot(ema), snapshot(other))
    assert other.num_updates == 3 and other.decay == 0.5  # the decay is this EMA's own
    assert set(state) == {"version", "decay", "warmup", "num_updates", "shadow"}
    assert state["decay"] == 0.99 and state["warmup"] is False


def test_copy_to_and_applied_to_restore_exactly_even_on_exception():
    torch.manual_seed(4)
    model = Net()
    model.fc1.half()  # a float16 layer: the fp32 averages are rounded into it and restored exactly
    ema = EMA(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update()
    originals = {n: bits(p) for n, p in model.named_parameters()}
    with pytest.raises(ZeroDivisionError):
        with ema.applied_to(model) as m:
            assert m is model
            for n, p in model.named_parameters():
                assert torch.equal(p, ema.shadow(n).to(p.dtype))
            1 / 0
    assert all(torch.equal(bits(p), originals[n]) for n, p in model.named_parameters())
    clone = copy.deepcopy(model)
    ema.copy_to(clone)
    for n, p in clone.named_parameters():
        assert torch.equal(p, ema.shadow(n).to(p.dtype))
    assert all(torch.equal(bits(p), originals[n]) for n, p in model.named_parameters())
    ema.copy_to()  # the followed tensors themselves
    for n, p in model.named_parameters():
        assert torch.equal(p, ema.shadow(n).to(p.dtype))


def test_bad_inputs_are_refused_with_clear_messages_and_change_nothing():
    model = Net()
    for bad in (1.0, -0.1, math.nan, math.inf, 2):
        with pytest.raises(ValueError, match=r"decay: expected a number in \[0, 1\), found"):
            EMA(model, decay=bad)
    for bad in ("0.9", None, True, [0.9]):
        with pytest.raises(TypeError, match=r"decay: expected a number in \[0, 1\), found"):
            EMA(model, decay=bad)
    with pytest.raises(TypeError, match="warmup: expected True or False, found 1"):
        EMA(model, warmup=1)
    with pytest.raises(TypeError, match="model_or_named_params: expected a torch.nn.Module or an iterable"):
        EMA(torch.zeros(3))
    with pytest.raises(ValueError, match="'w' is given twice"):
        EMA([("w", torch.zeros(2)), ("w", torch.ones(2))])
    with pytest.raises(TypeError, match="'i': expected a floating-point tensor, found torch.int64"):
        EMA([("i", torch.zeros(2, dtype=torch.int64))])
    with pytest.raises(ValueError, match="expected at least one parameter"):
        EMA(torch.nn.ReLU())
    with pytest.raises(TypeError, match="buffers: expected False"):
        EMA(list(model.named_parameters()), buffers=True)

    ema = EMA(model, decay=0.9)
    ema.update()
    before = snapshot(ema)
    with pytest.raises(TypeError, match="torch.amp.GradScaler does not say"):
        ema.update(torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="expected a mixprec.torch.StepOutcome, a mixprec.torch.GradScaler, a bool"):
        ema.update(1)
    with pytest.raises(RuntimeError, match="the GradScaler has no step outcome yet"):
        ema.update(GradScaler("cpu"))
    with pytest.raises(ValueError, match="model: it has no parameter or buffer 'fc1.weight'"):
        ema.copy_to(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'fc1.weight' has shape \(16, 9\); expected \(16, 8\)"):
        bad = Net()
        bad.fc1 = torch.nn.Linear(9, 16)
        with ema.applied_to(bad):
            pass
    good = ema.state_dict()
    cases = [
        ({**good, "extra": 1}, ValueError, "expected the keys version, decay, warmup, num_updates, shadow"),
        ({**good, "version": 2}, ValueError, "version: expected 1, found 2"),
        ({**good, "decay": 1.5}, ValueError, r"decay: expected a number in \[0, 1\), found 1.5"),
        ({**good, "num_updates": -1}, ValueError, "num_updates: expected an integer"),
        ({**good, "shadow": {k: v for k, v in good["shadow"].items() if k != "fc2.bias"}}, ValueError,
         "missing 'fc2.bias'"),
        ({**good, "shadow": {**good["shadow"], "zz": torch.zeros(1)}}, ValueError, "unexpected 'zz'"),
        ({**good, "shadow": {**{k: v.clone() for k, v in good["shadow"].items()},
                             "fc2.bias": torch.zeros(5)}}, ValueError,
         r"shadow 'fc2.bias': expected shape \(4,\) and dtype torch.float32, found shape \(5,\)"),
        ({**good, "shadow": {**{k: v.clone() for k, v in good["shadow"].items()},
                             "fc2.bias": torch.zeros(4, dtype=torch.float16)}}, ValueError,
         "found shape \\(4,\\) and dtype torch.float16"),
        ([1], TypeError, "state: expected a dict"),
    ]
    for state, exc, msg in cases:
        # Every other tensor in these states differs from the EMA's, so a partial load would show.
        if isinstance(state, dict) and isinstance(state.get("shadow"), dict):
            state = {**state, "shadow": {k: (v + 1 if v is good["shadow"].get(k) else v)
                                         for k, v in state["shadow"].items()}, "num_updates":
                     state["num_updates"] if state["num_updates"] == -1 else 7}
        with pytest.raises(exc, match=msg):
            ema.load_state_dict(state)
        assert same(before, snapshot(ema)), msg
    # A parameter reshaped under the EMA: refused before any shadow moves.
    with torch.no_grad():
        model.fc2.bias.data = torch.zeros(5)
    with pytest.raises(RuntimeError, match=r"'fc2.bias' is now of shape \(5,\)"):
        ema.update()
    assert same(before, snapshot(ema))
