"""Step guards in the Python door (docs/spike_guards.md): mixprec.torch.GradScaler's skip_*
keywords and mixprec.torch.StepGuard. Each reason skips exactly the bad step and leaves every
parameter, optimizer-state and scheduler byte unchanged; the z-scores equal a plain
transcription of llm.c's detector; the guards' windows survive state_dict and pickle; bad
arguments are refused before anything changes."""

import copy
import math
import pickle

import pytest
import torch

import mixprec.torch as mt


def llmc_update(det, v):
    """llm.c's update_detector (llmc/outlier_detector.h), transcribed plainly."""
    w = det["W"]
    if det["count"] < w:
        det["buf"][det["count"]] = v
        det["sum"] += v
        det["sum_sq"] += v * v
        det["count"] += 1
        return math.nan
    old = det["buf"][det["index"]]
    det["sum"] -= old
    det["sum_sq"] -= old * old
    det["buf"][det["index"]] = v
    det["sum"] += v
    det["sum_sq"] += v * v
    det["index"] = (det["index"] + 1) % w
    mean = det["sum"] / w
    var = det["sum_sq"] / w - mean * mean
    std = math.sqrt(var) if var >= 0 else math.nan
    if std == 0.0:
        return 0.0
    return (v - mean) / std


def model_and_opt(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
    return m, opt, sched


def state_bytes(m, opt, sched):
    """Every byte a skipped step must leave alone: parameters, AdamW's moments and step, the scheduler."""
    parts = [p.detach().clone() for p in m.parameters()]
    for st in opt.state.values():
        for v in st.values():
            parts.append(v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v)))
    parts.append(torch.tensor(float(sched.last_epoch)))
    parts.append(torch.tensor(float(opt.param_groups[0]["lr"])))
    return parts


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y)
                                    for x, y in zip(a, b))


BAD_STEP = 24


def train(guard, bad, steps=30, dtype=torch.float32, autocast=None, seed=0):
    """A small regression; step BAD_STEP gets `bad`. Returns outcomes and the bytes around the bad step."""
    m, opt, sched = model_and_opt(seed, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g).to(dtype)
    y = torch.randn(64, 1, generator=g).to(dtype)
    outcomes, around = [], None
    for step in range(steps):
        xb, yb = x, y
        if step == BAD_STEP and bad == "inputs_1e3":
            xb = x * 1e3
        if step == BAD_STEP and bad == "labels":
            yb = y[torch.randperm(64, generator=g)] * 50
        opt.zero_grad()
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                loss = torch.nn.functional.mse_loss(m(xb).float(), yb.float())
        else:
            loss = torch.nn.functional.mse_loss(m(xb), yb)
        guard.scale(loss).backward()
        if step == BAD_STEP and bad == "inf":
            next(m.parameters()).grad[0, 0] = math.inf
        before = state_bytes(m, opt, sched) if step == BAD_STEP else None
        out = guard.step(opt)
        guard.update()
        if out.applied:
            sched.step()
        if step == BAD_STEP:
            around = (before, state_bytes(m, opt, sched))
        outcomes.append(out)
    return outcomes, around


@pytest.mark.parametrize("bad,reason", [("inputs_1e3", "loss_spike"), ("labels", "loss_spike"),
                                        ("inf", "nonfinite_grad")])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_step_guard_skips_exactly_the_bad_step_and_touches_nothing(bad, reason, precision):
    guard = mt.StepGuard(skip_loss_z=3.5, skip_grad_z=3.5, skip_window=16)
    outcomes, (before, after) = train(guard, bad, autocast=torch.bfloat16 if precision == "bf16-autocast" else None)
    skipped = [(i, o.reason) for i, o in enumerate(outcomes) if not o.applied]
    assert skipped == [(BAD_STEP, reason)], skipped
    assert same(before, after), "a skipped step changed a parameter, a moment, the step count or the scheduler"


def test_fp16_scaler_with_guards_skips_spike_without_backoff_and_overflow_with_it():
    # Labels far off: a loss spike whose gradients fp16 still holds at this scale.
    scaler = mt.GradScaler("cpu", init_scale=256.0, growth_interval=1000, skip_loss_z=3.5, skip_window=16)
    outcomes, (before, after) = train(scaler, "labels", autocast=torch.float16)
    bad = outcomes[BAD_STEP]
    assert (bad.applied, bad.reason) == (False, "loss_spike")
    assert bad.loss_z > 3.5 and math.isfinite(bad.loss)
    assert same(before, after)
    assert scaler.get_scale() == 256.0, "a guarded skip must not back the scale off"
    scaler2 = mt.GradScaler("cpu", init_scale=256.0, growth_interval=1000, skip_loss_z=3.5, skip_window=16)
    outcomes2, _ = train(scaler2, "inf", autocast=torch.float16)
    assert outcomes2[BAD_STEP].reason == "nonfinite_grad"
    assert scaler2.get_scale() == 128.0, "an overflow backs off"


def test_without_guards_the_bad_step_is_applied_and_disabled_scaler_passes_through():
    outcomes, (before, after) = train(mt.GradScaler("cpu", enabled=False), "inputs_1e3")
    assert all(o.applied for o in outcomes)
    assert not same(before, after)
    # torch's pass-through stays the default of a disabled scaler: no check, no reason.
    assert outcomes[BAD_STEP].reason == "none" and math.isnan(outcomes[BAD_STEP].grad_norm)


def test_user_predicate_sees_the_view_and_skips():
    seen = []

    def skip_if(view):
        seen.append(view)
        return view.grad_norm > 1e3

    guard = mt.StepGuard(skip_if=skip_if)
    outcomes, (before, after) = train(guard, "inputs_1e3")
    assert [i for i, o in enumerate(outcomes) if not o.applied] == [BAD_STEP]
    assert outcomes[BAD_STEP].reason == "user"
    assert len(seen) == len(outcomes) and all(math.isfinite(v.loss) for v in seen)
    assert same(before, after)


def test_z_scores_equal_llmc_transcription():
    guard = mt.StepGuard(skip_loss_z=3.0, skip_grad_z=3.0, skip_window=16)
    outcomes, _ = train(guard, None, steps=40)
    ref_l = {"W": 16, "buf": [0.0] * 16, "count": 0, "index": 0, "sum": 0.0, "sum_sq": 0.0}
    ref_g = copy.deepcopy(ref_l)
    for o in outcomes:
        zl, zg = llmc_update(ref_l, o.loss), llmc_update(ref_g, o.grad_norm)
        for mine, ref in ((o.loss_z, zl), (o.grad_z, zg)):
            assert (math.isnan(mine) and math.isnan(ref)) or mine == ref, (mine, ref)


def test_guard_windows_survive_state_dict_and_pickle():
    guard = mt.StepGuard(skip_loss_z=2.5, skip_window=10)
    train(guard, None, steps=15)
    state = guard.state_dict()
    assert state["guard"]["config"]["skip_loss_z"] == 2.5 and state["guard"]["loss"]["count"] == 10
    fresh = mt.StepGuard()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert pickle.loads(pickle.dumps(guard)).state_dict() == state


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(skip_loss_z=-1.0), ValueError, "skip_loss_z: expected"),
    (dict(skip_grad_z=float("nan")), ValueError, "skip_grad_z: expected"),
    (dict(skip_window=1), ValueError, "skip_window: expected an integer in [2, 1000000]"),
    (dict(skip_loss_z=3.0, skip_window=8), ValueError, "below sqrt(skip_window - 1)"),
    (dict(skip_if=3), TypeError, "skip_if: expected a callable"),
])
def test_bad_guard_arguments_are_refused(kwargs, error, needle):
    with pytest.raises(error, match=None) as e:
        mt.StepGuard(**kwargs)
    assert needle in str(e.value)


def test_skip_nonfinite_false_with_a_scale_is_refused():
    with pytest.raises(ValueError, match="skip_nonfinite: expected True or None with a loss scale"):
        mt.GradScaler("cpu", skip_nonfinite=False)


def test_a_guarded_disabled_scaler_needs_update_between_steps():
    m, opt, _ = model_and_opt()
    guard = mt.StepGuard()
    loss = m(torch.randn(4, 8)).sum()
    guard.scale(loss).backward()
    guard.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last update"):
        guard.step(opt)


def test_a_guarded_disabled_scaler_checks_at_unscale_before_clipping():
    """unscale_() of a guarded disabled scaler checks: the gradient-norm guard sees the norm
    before clip_grad_norm_ clips it, as an enabled scaler's does."""
    m, opt, _ = model_and_opt()
    guard = mt.StepGuard(skip_grad_z=3.0, skip_window=16)
    norms = []
    for step in range(20):
        opt.zero_grad()
        x = torch.randn(64, 8) * (1e3 if step == 18 else 1.0)
        guard.scale(m(x).pow(2).mean()).backward()
        guard.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        out = guard.step(opt)
        guard.update()
        norms.append((out.grad_norm, out.reason))
    assert norms[18][1] == "grad_spike" and norms[18][0] > 1e3, norms[18]
    assert all(r == "none" for _, r in norms[:18])


def test_skip_if_alone_makes_a_disabled_scaler_check():
    m, opt, _ = model_and_opt()
    asked = []
    scaler = mt.GradScaler("cpu", enabled=False, skip_if=lambda v: asked.append(v) or True)
    scaler.scale(m(torch.randn(4, 8)).sum()).backward()
    out = scaler.step(opt)
    scaler.update()
    assert (out.applied, out.reason, len(asked)) == (False, "user", 1)
    for kw in (dict(skip_if=lambda v: True), dict(skip_loss_z=3.0), dict(skip_grad_z=3.0)):
        with pytest.raises(ValueError, match="skip_nonfinite: expected True or None with skip_if, skip_loss_z"):
            mt.GradScaler("cpu", enabled=False, skip_nonfinite=False, **kw)
    assert mt.GradScaler("cpu", enabled=False, skip_nonfinite=False).state_dict() == {}  # torch's pass-through
