"""mixprec's loss-scale presets against the peers' OWN installed code, step by step.

Each peer below is the framework's real update code, installed in the test venv by
`scripts/deps.sh python` (pinned versions: docs/python.md):

  torch      torch._amp_update_scale_ (the kernel torch.amp.GradScaler.update calls), with
             torch.amp.GradScaler's defaults; and GradScaler itself, driven through
             scale/step/update with finite or inf gradients
  jmp        jmp.DynamicLossScale.adjust (jax on the CPU)
  keras      Keras 3 keras.optimizers.LossScaleOptimizer.apply, KERAS_BACKEND=torch
  deepspeed  deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler.update_scale, including its
             exception at the minimum scale (raise_error_at_min_scale)
  megatron   megatron.core.optimizer.grad_scaler.DynamicGradScaler.update

The same overflow flags go through `mixprec.LossScale(preset, **overrides)` and through the
peer, built from the peer's own defaults (read from its code: GradScaler's getters, the
defaults of Keras' and jmp's constructors, DeepSpeed's DeepSpeedFP16Config, Megatron's
OptimizerConfig) with the same overrides translated by PEER_ARGS. After every step the
scales must be equal (mixprec's exact scale: a double for deepspeed, float32 otherwise) and
so must the counters each peer keeps. On a mismatch the message names the first differing
step, its overflow flag and both scales (float and hex).

Sequences: seeded random regimes (long droughts, bursts, a normal rate) of several thousand
steps with the default and short growth intervals, and the edges: a collapse (overflows in a
row: below 1, to 0 where there is no floor, the floor or DeepSpeed's error where there is one)
and growth with growth interval 1 up to float32's maximum (torch, jmp: kept finite) or to inf
(Keras 3, Megatron; DeepSpeed's Python float goes on to double's inf).

Set MIXPREC_NO_PEERS=1 to skip this file where the peers are not installed; `make test`
installs them, and there a missing peer is an error (ImportError), never a skip.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import math
import os
import random
import warnings

import numpy as np
import pytest

if os.environ.get("MIXPREC_NO_PEERS") == "1":
    pytest.skip("MIXPREC_NO_PEERS=1: the peers (jmp, jax, keras, deepspeed, megatron-core) are not "
                "installed here; scripts/deps.sh python installs them", allow_module_level=True)

# Keras picks its backend at import: torch (the venv has it; Keras' default, TensorFlow, is
# not installed). Set before anything imports keras.
os.environ["KERAS_BACKEND"] = "torch"

# The peers' imports warn about what a CPU venv lacks (Megatron: Transformer Engine and Apex,
# falling back to torch; a deprecation inside megatron.core): silenced here, nothing else.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    import jax
    import jax.numpy as jnp
    import jmp
    import keras
    # DeepSpeed: the loss-scaler module and the fp16 config holding its defaults (importing
    # them imports the deepspeed package, which works on the CPU: no op is built at import).
    from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    # Megatron: the grad-scaler module and the optimizer config holding its defaults; both
    # import on the CPU.
    from megatron.core.optimizer import grad_scaler as mg_grad_scaler
    from megatron.core.optimizer.optimizer_config import OptimizerConfig as MegatronOptimizerConfig

import mixprec  # noqa: E402

assert keras.backend.backend() == "torch", \
    f"keras was imported before this file with backend {keras.backend.backend()}; run with KERAS_BACKEND=torch"

# The versions docs/python.md names and scripts/deps.sh installs.
PINNED = {"torch": "2.15.0", "jax": "0.10.2", "jaxlib": "0.10.2", "jmp": "0.0.4", "keras": "3.15.1",
          "deepspeed": "0.19.8", "megatron-core": "0.16.1"}


def test_the_pinned_peers_are_the_ones_installed():
    got = {name: importlib.metadata.version(name).split("+")[0] for name in PINNED}
    assert got == PINNED


# ---- the table: mixprec preset -> the peer's own constructor --------------------------------

# For each peer: the mixprec preset that follows it, and how each mixprec config key maps to
# the peer's constructor argument (a key the peer has no argument for cannot be overridden in
# a comparison, and must equal the peer's fixed value: test_preset_equals_the_peers_defaults).
PEER_ARGS = {
    "torch": ("torch", {"init_scale": "init_scale", "growth_factor": "growth_factor",
                        "backoff_factor": "backoff_factor", "growth_interval": "growth_interval"}),
    "jmp": ("jmp", {"init_scale": "loss_scale", "growth_interval": "period", "growth_factor": "factor",
                    "min_scale": "min_loss_scale"}),
    "keras": ("keras", {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"}),
    "deepspeed": ("deepspeed", {"init_scale": "init_scale", "growth_interval": "scale_window",
                                "min_scale": "min_scale", "hysteresis": "delayed_shift",
                                "consecutive_hysteresis": "consecutive_hysteresis",
                                "floor_policy": "raise_error_at_min_scale"}),
    "megatron": ("megatron", {"init_scale": "initial_scale", "min_scale": "min_scale",
                              "growth_factor": "growth_factor", "backoff_factor": "backoff_factor",
                              "growth_interval": "growth_interval", "hysteresis": "hysteresis"}),
}


def peer_defaults(peer):
    """The peer's default arguments, read from the peer's own code, plus the rules it hard-codes
    (in mixprec's key names: what the preset must equal)."""
    if peer == "torch":
        s = torch.amp.GradScaler("cpu")
        args = {"init_scale": s.get_scale(), "growth_factor": s.get_growth_factor(),
                "backoff_factor": s.get_backoff_factor(), "growth_interval": s.get_growth_interval()}
        fixed = {"min_scale": None, "max_scale": None, "hysteresis": 1, "refuse_nonfinite_growth": True}
    elif peer == "jmp":
        p = {f.name: f for f in jmp.DynamicLossScale.__dataclass_fields__.values()}
        args = {"loss_scale": 2.0 ** 15,  # required argument; 2^15 is jmp's documented start
                "period": p["period"].default, "factor": p["factor"].default,
                "min_loss_scale": float(p["min_loss_scale"].default_factory())}
        fixed = {"max_scale": None, "hysteresis": 1, "refuse_nonfinite_growth": True}  # first_finite
    elif peer == "keras":
        sig = inspect.signature(keras.optimizers.LossScaleOptimizer.__init__).parameters
        args = {"initial_scale": sig["initial_scale"].default,
                "dynamic_growth_steps": sig["dynamic_growth_steps"].default}
        # Keras 3 multiplies by 2.0 and 0.5, without floor or finite guard.
        fixed = {"growth_factor": 2.0, "backoff_factor": 0.5, "min_scale": None, "max_scale": None,
                 "hysteresis": 1, "refuse_nonfinite_growth": False}
    elif peer == "deepspeed":
        cfg = DeepSpeedFP16Config(enabled=True, loss_scale=0)  # loss_scale 0: dynamic
        a = cfg.dynamic_loss_scale_args()
        sig = inspect.signature(ds_loss_scaler.DynamicLossScaler.__init__).parameters
        args = {"init_scale": a[ds_loss_scaler.INITIAL_LOSS_SCALE], "scale_window": a[ds_loss_scaler.SCALE_WINDOW],
                "min_scale": a[ds_loss_scaler.MIN_LOSS_SCALE], "delayed_shift": a[ds_loss_scaler.DELAYED_SHIFT],
                "consecutive_hysteresis": a[ds_loss_scaler.CONSECUTIVE_HYSTERESIS],
                "raise_error_at_min_scale": sig["raise_error_at_min_scale"].default}
        # The constructor sets scale_factor (not an argument); it backs off by dividing by it.
        factor = ds_loss_scaler.DynamicLossScaler(**args).scale_factor
        fixed = {"growth_factor": factor, "backoff_factor": 1 / factor, "max_scale": None,
                 "refuse_nonfinite_growth": False,
                 "max_floor_overflows": 1 if args["raise_error_at_min_scale"] else None}
    elif peer == "megatron":
        c = MegatronOptimizerConfig()
        # get_megatron_optimizer builds DynamicGradScaler with growth 2.0 and backoff 0.5.
        args = {"initial_scale": c.initial_loss_scale, "min_scale": c.min_loss_scale, "growth_factor": 2.0,
                "backoff_factor": 0.5, "growth_interval": c.loss_scale_window, "hysteresis": c.hysteresis}
        fixed = {"max_scale": None, "consecutive_hysteresis": False, "refuse_nonfinite_growth": False,
                 "floor_policy": "continue"}
    else:
        raise AssertionError(peer)
    return args, fixed


def to_peer_value(key, value):
    if key == "floor_policy":  # DeepSpeed's raise_error_at_min_scale
        return value == "error"
    if key == "min_scale" and value is None:
        return 0.0
    return value


def peer_args(peer, overrides):
    """The peer's constructor arguments: its defaults, then the overrides through PEER_ARGS."""
    _, keys = PEER_ARGS[peer]
    args, _ = peer_defaults(peer)
    for key, value in overrides.items():
        assert key in keys, f"{peer} has no constructor argument for mixprec's {key}"
        args[keys[key]] = to_peer_value(key, value)
    return args


@pytest.mark.parametrize("peer", sorted(PEER_ARGS))
def test_preset_equals_the_peers_defaults(peer):
    preset, keys = PEER_ARGS[peer]
    cfg = mixprec.LossScale(preset).config
    args, fixed = peer_defaults(peer)
    for key, arg in keys.items():
        assert to_peer_value(key, cfg[key]) == args[arg], f"{preset}.{key} = {cfg[key]} but {peer}'s {arg} = {args[arg]}"
    for key, value in fixed.items():
        if key == "max_floor_overflows":
            if value is not None:
                assert cfg["floor_policy"] == "error" and cfg[key] == value
            continue
        assert cfg[key] == value, f"{preset}.{key} = {cfg[key]}, {peer} has {value}"


# ---- one replay driver per peer -------------------------------------------------------------
# Each: constructed from the peer's arguments; update(found_inf) calls the peer's own update
# (raising PeerCollapse where the peer raises at its floor); scale() as a Python float;
# counters() as mixprec counter names.

class PeerCollapse(Exception):
    pass


class TorchAmpDriver:
    """torch._amp_update_scale_ on CPU tensors, as torch.amp.GradScaler.update calls it."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        self.s = torch.full((), init_scale, dtype=torch.float32)
        self.tracker = torch.zeros((), dtype=torch.int32)
        self.args = (growth_factor, backoff_factor, growth_interval)

    def update(self, found_inf):
        torch._amp_update_scale_(self.s, self.tracker, torch.full((), float(found_inf)), *self.args)

    def scale(self):
        return self.s.item()

    def counters(self):
        return {"growth_tracker": int(self.tracker)}


class GradScalerDriver:
    """torch.amp.GradScaler itself: scale a loss, backward, step (SGD, lr 0), update. An
    overflow step gets an inf gradient; a clean one the scaled loss' finite gradient.
    Needs 1/scale finite in float32 (GradScaler unscales by it), so not for the collapse."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        self.gs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                       backoff_factor=backoff_factor, growth_interval=growth_interval)
        self.w = torch.zeros(1, requires_grad=True)
        self.opt = torch.optim.SGD([self.w], lr=0.0)

    def update(self, found_inf):
        self.opt.zero_grad()
        loss = (self.w + 1e-30).sum() * (float("inf") if found_inf else 1.0)
        self.gs.scale(loss).backward()
        self.gs.step(self.opt)
        self.gs.update()

    def scale(self):
        return self.gs.get_scale()

    def counters(self):
        return {"growth_tracker": self.gs.state_dict()["_growth_tracker"]}


@functools.partial(jax.jit, static_argnames=("period", "factor"))
def _jmp_adjust(loss_scale, counter, min_loss_scale, grads_finite, period, factor):
    # jmp's own adjust(), traced once and run compiled, as in a jitted train step. The state is
    # passed as arrays rather than as the DynamicLossScale pytree: jmp's tree_unflatten drops
    # min_loss_scale (back to its default 1), which would hide a min_scale override.
    ls = jmp.DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale).adjust(grads_finite)
    return ls.loss_scale, ls.counter


class JmpDriver:
    """jmp.DynamicLossScale.adjust on the CPU (float32 scale, int32 counter)."""

    def __init__(self, loss_scale, period, factor, min_loss_scale):
        self.ls = jmp.DynamicLossScale(jnp.asarray(loss_scale, jnp.float32), period=period,
                                       factor=int(factor) if float(factor).is_integer() else factor,
                                       min_loss_scale=jnp.asarray(min_loss_scale, jnp.float32))
        self.state = (self.ls.loss_scale, self.ls.counter)
        self.flags = (jnp.asarray(False), jnp.asarray(True))

    def update(self, found_inf):
        self.state = _jmp_adjust(*self.state, self.ls.min_loss_scale, self.flags[not found_inf],
                                 period=self.ls.period, factor=self.ls.factor)

    def scale(self):
        return float(self.state[0])

    def counters(self):
        return {"growth_tracker": int(self.state[1])}


class KerasDriver:
    """Keras 3 LossScaleOptimizer.apply with one gradient, [inf] on overflow steps, around
    SGD with learning rate 0; the scale and counter are the optimizer's own variables."""

    def __init__(self, initial_scale, dynamic_growth_steps):
        self.var = keras.Variable(np.zeros((1,), np.float32))
        self.opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.0),
                                                       initial_scale=initial_scale,
                                                       dynamic_growth_steps=dynamic_growth_steps)
        self.opt.build([self.var])
        self.grads = (keras.ops.convert_to_tensor(np.array([1.0], np.float32)),
                      keras.ops.convert_to_tensor(np.array([np.inf], np.float32)))

    def update(self, found_inf):
        self.opt.apply([self.grads[found_inf]], [self.var])

    def scale(self):
        return float(self.opt.dynamic_scale.value)  # the backend tensor (torch), float32

    def counters(self):
        return {"growth_tracker": int(self.opt.step_counter.value)}


class _RankOne:
    """update_scale asks deepspeed.comm for the rank only to decide whether to log (every rank
    updates its scale the same way). Rank 0's log message does int(cur_scale), which raises
    OverflowError once the scale is inf (reachable: DeepSpeed's growth has no finite guard), so
    the scaler runs as rank 1 of a group, without init_process_group."""

    @staticmethod
    def get_rank(group=None):
        return 1


class DeepSpeedDriver:
    """DeepSpeed's DynamicLossScaler.update_scale (Python float scale)."""

    def __init__(self, monkeypatch, **args):
        monkeypatch.setattr(ds_loss_scaler, "dist", _RankOne)
        self.ds = ds_loss_scaler.DynamicLossScaler(**args)

    def update(self, found_inf):
        try:
            self.ds.update_scale(found_inf)
        except Exception as e:  # DeepSpeed raises a bare Exception at the minimum scale
            if "already at minimum" in str(e):
                raise PeerCollapse(str(e)) from e
            raise

    def scale(self):
        return float(self.ds.cur_scale)

    def counters(self):
        return {"iteration": self.ds.cur_iter, "last_overflow_iter": self.ds.last_overflow_iter,
                "hysteresis_left": self.ds.cur_hysteresis}


class _CpuTensors:
    """The torch module as Megatron's grad_scaler sees it, with device='cuda' tensors made on
    the CPU (DynamicGradScaler allocates its float32 scale, factors and min on 'cuda'; float32
    multiply and max are the same IEEE operations on either device)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, **kw):
        if kw.get("device") == "cuda":
            kw["device"] = "cpu"
        return torch.tensor(data, **kw)


class MegatronDriver:
    """megatron-core's DynamicGradScaler.update (float32 tensors)."""

    def __init__(self, monkeypatch, **args):
        if not torch.cuda.is_available():
            monkeypatch.setattr(mg_grad_scaler, "torch", _CpuTensors())
        self.g = mg_grad_scaler.DynamicGradScaler(**args)

    def update(self, found_inf):
        self.g.update(found_inf)

    def scale(self):
        return self.g.scale.item()

    def counters(self):
        return {"growth_tracker": self.g._growth_tracker, "hysteresis_left": self.g._hysteresis_tracker}


DRIVERS = {"torch": TorchAmpDriver, "gradscaler": GradScalerDriver, "jmp": JmpDriver, "keras": KerasDriver,
           "deepspeed": DeepSpeedDriver, "megatron": MegatronDriver}


def make_driver(driver, monkeypatch, overrides):
    peer = "torch" if driver == "gradscaler" else driver
    args = peer_args(peer, overrides)
    cls = DRIVERS[driver]
    if "monkeypatch" in inspect.signature(cls.__init__).parameters:
        return cls(monkeypatch, **args)
    return cls(**args)


# ---- the replay -----------------------------------------------------------------------------

def _show(x):
    return f"{x!r} ({float(x).hex()})"


def replay_both(driver, monkeypatch, overrides, flags):
    """Every flag through mixprec and the peer; fails at the first step where the scales, the
    counters or a collapse error differ. Returns the scales, the steps that raised and mixprec's
    final counters, for the checks that the sequence reached what it was meant to."""
    peer = "torch" if driver == "gradscaler" else driver
    preset = PEER_ARGS[peer][0]
    ours = mixprec.LossScale(preset, **overrides)
    theirs = make_driver(driver, monkeypatch, overrides)
    assert ours.exact_scale == theirs.scale(), \
        f"{driver} {overrides}: initial scale mixprec {_show(ours.exact_scale)}, peer {_show(theirs.scale())}"
    scales, collapses = [], []
    for step, found_inf in enumerate(flags):
        peer_error = our_error = None
        try:
            theirs.update(found_inf)
        except PeerCollapse as e:
            peer_error = e
        try:
            ours.update(found_inf)
        except mixprec.ScaleCollapseError as e:
            our_error = e
        a, b = ours.exact_scale, theirs.scale()
        got, want = ours.counters, theirs.counters()
        got = {k: got[k] for k in want}
        same_error = (our_error is None) == (peer_error is None)
        if same_error and (a == b or (math.isnan(a) and math.isnan(b))) and got == want:
            if our_error is not None:
                collapses.append(step)
            scales.append(a)
            continue
        where = (f"{driver} vs mixprec preset {preset!r} {overrides}: first difference at step {step} "
                 f"(found_inf={found_inf}, {sum(flags[:step])} overflows before it)")
        raised = lambda e: f"raised {str(e)!r}" if e is not None else "did not raise"  # noqa: E731
        pytest.fail(f"{where}: scale mixprec {_show(a)}, peer {_show(b)}; counters mixprec {got}, peer {want}; "
                    f"mixprec {raised(our_error)}, the peer {raised(peer_error)}")
    return scales, collapses, ours.counters


def regimes(n, seed, p_normal=0.02, p_long_drought=0.3):
    """Seeded overflow flags: a drought (no overflow; now and then longer than the default
    growth intervals), a burst (most steps overflow), a stretch at a normal rate; again."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        out += [False] * (rng.randint(1000, 4500) if rng.random() < p_long_drought else rng.randint(1, 300))
        out += [rng.random() < 0.8 for _ in range(rng.randint(1, 60))]
        out += [rng.random() < p_normal for _ in range(rng.randint(10, 800))]
    return out[:n]


# growth_interval overrides for the random sequences: the preset's own and short ones.
INTERVALS = [None, 1, 2, 7, 50]
# Several thousand steps each; Keras' apply and GradScaler's step cost ~0.1-0.3 ms a step.
N_STEPS = 6000


@pytest.mark.parametrize("interval", INTERVALS, ids=lambda i: f"interval{i or 'default'}")
@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_random_bursts_and_droughts(driver, interval, monkeypatch):
    overrides = {} if interval is None else {"growth_interval": interval}
    seed = 1000 * sorted(DRIVERS).index(driver) + (interval or 0)
    flags = regimes(N_STEPS, seed)
    scales, _, counters = replay_both(driver, monkeypatch, overrides, flags)
    assert len(set(scales)) > 5, "the sequence should move the scale"
    assert counters["growths"] > 0 and counters["backoffs"] > 0, f"the sequence should grow and back off: {counters}"


EDGES = {
    # overflows in a row: 200 take any float32 scale from 2^32 through the subnormals to 0 (no
    # floor), or to the floor; then clean steps and overflows again
    "collapse": ([True] * 200 + [False] * 30 + [True] * 5 + [False] * 3, {"growth_interval": 1}),
    "collapse_default_interval": ([True] * 200 + [False] * 2100 + [True] * 3, {}),
    # growth interval 1: float32's maximum 2^127 after ~111 growths from 2^16 (torch and jmp
    # stay there, Keras 3 and Megatron go to inf); DeepSpeed's double reaches inf after ~1010
    "growth_to_max": ([False] * 1100 + [True] * 4 + [False] * 20 + [True] * 2, {"growth_interval": 1}),
}


@pytest.mark.parametrize("edge", sorted(EDGES))
@pytest.mark.parametrize("driver", sorted(d for d in DRIVERS if d != "gradscaler"))
def test_edges(driver, edge, monkeypatch):
    flags, overrides = EDGES[edge]
    scales, collapses, _ = replay_both(driver, monkeypatch, overrides, flags)
    cfg = mixprec.LossScale(PEER_ARGS[driver][0]).config
    if edge.startswith("collapse"):
        low = min(scales)
        if cfg["min_scale"] is None:
            assert low == 0.0, "without a floor 200 overflows reach 0"
        else:
            assert low == cfg["min_scale"]
        if cfg["floor_policy"] == "error":
            assert collapses, "the peer and mixprec should both have raised at the floor"
    else:
        top = max(scales)
        if cfg["refuse_nonfinite_growth"]:
            assert top == 2.0 ** 127, "float32's largest power of two, held there"
        else:
            assert top == math.inf


def test_gradscaler_growth_to_float_max_with_interval_one(monkeypatch):
    """GradScaler (interval 1) up to 2^127, held there; overflows and growth again."""
    flags = [False] * 150 + [True] * 3 + [False] * 10
    scales, _, _ = replay_both("gradscaler", monkeypatch, {"growth_interval": 1}, flags)
    assert max(scales) == 2.0 ** 127 and scales[149] == 2.0 ** 127


@pytest.mark.parametrize("overrides", [
    {"hysteresis": 1}, {"hysteresis": 3}, {"consecutive_hysteresis": True}, {"consecutive_hysteresis": True, "hysteresis": 4},
    {"floor_policy": "continue"}, {"min_scale": 64.0, "init_scale": 1024.0, "growth_interval": 5},
    {"min_scale": 0.25, "hysteresis": 1, "growth_interval": 3},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_deepspeed_overrides(overrides, monkeypatch):
    cfg = mixprec.LossScale("deepspeed", **overrides).config
    # a first drought of two windows and a step grows the scale twice (at the default window
    # too); then short droughts, so that the scale stays finite and the tail of overflows
    # reaches the floor
    flags = [False] * (2 * cfg["growth_interval"] + 2) + regimes(N_STEPS, 77, p_normal=0.1, p_long_drought=0.0) \
        + [True] * 1100 + [False] * 10 + [True] * 40
    scales, collapses, counters = replay_both("deepspeed", monkeypatch, overrides, flags)
    assert counters["growths"] > 0 and min(scales) == cfg["min_scale"], counters
    if cfg["floor_policy"] == "error":
        assert collapses  # each raised at the same steps, and the states went on identically


def test_deepspeed_error_at_the_minimum_scale(monkeypatch):
    """30 overflows from 2^16 with hysteresis 2: the first is tolerated, 16 back off to 1, the
    next raises in both (and keeps raising: neither changes its state when it raises)."""
    scales, collapses, _ = replay_both("deepspeed", monkeypatch, {}, [True] * 30)
    assert collapses == list(range(17, 30)) and scales[-1] == 1.0


@pytest.mark.parametrize("overrides", [
    {"hysteresis": 1}, {"hysteresis": 5}, {"growth_factor": 4.0, "backoff_factor": 0.125, "growth_interval": 3},
    {"min_scale": 2.0 ** -20, "init_scale": 1.0, "growth_interval": 4},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_megatron_overrides(overrides, monkeypatch):
    flags = regimes(N_STEPS, 78, p_normal=0.1) + [True] * 60
    replay_both("megatron", monkeypatch, overrides, flags)


@pytest.mark.parametrize("overrides", [
    {"growth_factor": 4.0, "growth_interval": 3}, {"min_scale": 2.0 ** -10, "init_scale": 4.0, "growth_interval": 2},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_jmp_overrides(overrides, monkeypatch):
    flags = regimes(3000, 79, p_normal=0.1) + [True] * 60
    replay_both("jmp", monkeypatch, overrides, flags)


@pytest.mark.parametrize("overrides", [
    {"growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 3}, {"init_scale": 2.0 ** -100, "growth_interval": 1},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_torch_overrides(overrides, monkeypatch):
    flags = regimes(N_STEPS, 80, p_normal=0.1) + [True] * 200
    replay_both("torch", monkeypatch, overrides, flags)


def test_keras_from_tiny_and_huge_initial_scales(monkeypatch):
    """Keras 3 starting near the subnormals and near float32's maximum (no floor, no guard)."""
    for init, seed in ((2.0 ** -120, 81), (2.0 ** 125, 82)):
        flags = regimes(3000, seed, p_normal=0.3)
        replay_both("keras", monkeypatch, {"init_scale": init, "growth_interval": 3}, flags)


def test_jax_runs_on_the_cpu():
    assert jax.default_backend() == "cpu"
