"""mixprec.torch.GradScaler: a drop-in for torch.amp.GradScaler over the core's LossScale.

    scaler = mixprec.torch.GradScaler("cpu", growth_interval=20)   # = torch.amp.GradScaler's rule
    scaler.set_names(model)                                        # names in step()'s outcome
    with torch.autocast("cpu", dtype=torch.float16):
        loss = criterion(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                                           # optional, e.g. to clip
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    outcome = scaler.step(opt)      # StepOutcome(applied, found_inf, first_overflow, first_overflow_name, ...)
    scaler.update()
    if outcome.applied:
        scheduler.step()

What runs where (docs/python.md):
- the protocol (stages, misuse messages with torch's words, windows, found_inf over tensors,
  optimizers and ranks, the skip decision, the next scale, the state format) and the scale
  policy: the core's mixprec::ScalerProtocol, torch dialect (mixprec._core.ScalerProtocol);
- where each gradient is read, what is refused with what message, and how the two readers'
  results make one check: the core's (scaler/grad_route.hpp: _core.route_gradients,
  _core.check_in_two_reads), from each gradient's description (_describe);
- this file: torch's API shape, carrying the routes out, the torch.distributed callback;
- route "core", CPU float32/float16/bfloat16 gradients in any dense layout (contiguous,
  channels_last, other permutations): the core's check_gradients in place on the tensors' own
  memory (DLPack, no copy): check, unscale and the exact sum of squares in one pass, element
  for element what ATen's _amp_foreach_non_finite_check_and_unscale_ computes;
- route "sparse_values", sparse COO gradients: their values (coalesced first when float16, as
  torch does), routed in turn;
- DTensor gradients (FSDP2, tensor parallelism): this rank's shard (the ranks agree on found_inf
  through the torch.distributed callback);
- route "aten", float64, strided or overlapping views and gradients on other devices: ATen's own
  _amp_foreach_non_finite_check_and_unscale_, the kernel torch runs;
- refused before anything is touched: meta tensors, other layouts, mixed devices.
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
import weakref
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from .. import _core
from ..loss_scale import LossScale, _state_json, _value_text, preset_names

_FLOAT_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class GuardView:
    """What a GradScaler's skip_if predicate is given, after the gradients were checked:
    the step's loss (the sum of its scale() inputs; NaN when not given), the unscaled
    gradient norm and both z-scores (NaN while a window fills or its guard is off)."""

    loss: float
    grad_norm: float
    loss_z: float
    grad_z: float


@dataclass(frozen=True)
class StepOutcome:
    """What GradScaler.step() did for one optimizer.

    bool(outcome) is outcome.applied. torch.amp.GradScaler.step returns the optimizer's own
    return value instead (None when skipped); here it is `result`. The fields it shares with
    the C++ doors' StepOutcome (include/mixprec/scaler/grad_scaler.hpp) mean what they mean there.
    """

    applied: bool                        # optimizer.step() ran
    found_inf: bool                      # a gradient held inf/NaN: the step was skipped
    # The first parameter whose gradient held inf/NaN: its index over the optimizer's parameters
    # (param groups in order), -1 if none (also on a rank that skipped for another rank's).
    first_overflow: int
    # Its name (set_names, else the optimizer's param_names, else "param[<index>]"); "" if none.
    first_overflow_name: str
    grad_norm: float                     # L2 norm of the unscaled gradients (before any clipping); inf/NaN on overflow
    scale: float                         # the scale the gradients carried
    result: Any = None                   # optimizer.step()'s return value (None when skipped)
    skipped_layers: Tuple[str, ...] = ()  # preset layerwise: watched layers whose update was skipped alone
    # Why the step was skipped (docs/spike_guards.md): "none" when applied, else
    # "nonfinite_grad", "nonfinite_loss", "loss_spike", "grad_spike" or "user".
    reason: str = "none"
    loss: float = math.nan      # the step's loss as the guards saw it (NaN: no loss guard asked for it)
    loss_z: float = math.nan    # z-scores over the guards' windows (NaN while they fill, or guards off)
    grad_z: float = math.nan
    # For mixprec.torch.Telemetry: id(parameter) -> its gradient's unscaled |max| as stored,
    # measured by the check's own pass (the core's; only when a Telemetry asked for it).
    _grad_amax: Optional[Dict[int, float]] = field(default=None, repr=False, compare=False)

    def __bool__(self) -> bool:
        return self.applied


class GradScaler:
    """A drop-in for torch.amp.GradScaler whose scale policy is a mixprec preset.

    GradScaler(device="cpu", init_scale=None, growth_factor=None, backoff_factor=None,
               growth_interval=None, enabled=True, *, preset=None, reduce_found_inf=None,
               process_group=None, **overrides)

    Without `preset`: the core's `torch` preset (init_scale 2^16, growth_factor 2,
    backoff_factor 0.5, growth_interval 2000), i.e. exactly torch.amp.GradScaler's rule; the
    four torch arguments override it as in torch. With `preset` (any mixprec.preset_names()),
    that preset; torch arguments given explicitly and `overrides` (the core's config keys,
    mixprec.config_keys()) override it. Unknown presets, keys or values out of range raise
    ValueError with the core's message.

    Under torch.distributed, found_inf is MAX-reduced over `process_group` (default: the
    default group) before the skip decision, so that every rank skips the same steps and keeps
    the same scale; reduce_found_inf=None does it whenever torch.distributed is initialized,
    True requires it, False never. Every rank must then call unscale_/step together.
    """

    def __init__(self, device: str = "cpu", init_scale: Optional[float] = None,
                 growth_factor: Optional[float] = None, backoff_factor: Optional[float] = None,
                 growth_interval: Optional[int] = None, enabled: bool = True, *,
                 preset: Optional[str] = None, reduce_found_inf: Optional[bool] = None,
                 process_group: Any = None, skip_nonfinite: Optional[bool] = None,
                 skip_loss_z: float = 0.0, skip_grad_z: float = 0.0, skip_window: int = 128,
                 skip_if: Optional[Callable[[GuardView], bool]] = None, **overrides: Any) -> None:
        self._device = device
        # None: MAX-reduce found_inf over the process group whenever torch.distributed is
        # initialized (sharded optimizers see different gradients on each rank).
        self._reduce = reduce_found_inf
        self._group = process_group
        enabled = bool(enabled)
        if enabled and device == "cuda" and not torch.cuda.is_available():
            # torch.amp.GradScaler does the same (and so silently runs unscaled); say it too.
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
            enabled = False
        preset = "torch" if preset is None else preset
        if not isinstance(preset, str):
            raise TypeError(f"preset: expected a str (one of {', '.join(preset_names())}), "
                            f"found {type(preset).__name__}")
        given = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                     growth_interval=growth_interval)
        chosen: Dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        for k, v in overrides.items():
            if k in chosen:
                raise TypeError(f"GradScaler: {k} given twice")
            chosen[k] = v
        pairs = [(k, _value_text(k, v)) for k, v in chosen.items()]
        if skip_if is not None and not callable(skip_if):
            raise TypeError(f"skip_if: expected a callable (GuardView -> bool), found {type(skip_if).__name__}")
        guard = [("skip_loss_z", _value_text("skip_loss_z", skip_loss_z)),
                 ("skip_grad_z", _value_text("skip_grad_z", skip_grad_z)),
                 ("skip_window", _value_text("skip_window", skip_window))]
        if skip_if is not None and not enabled and skip_nonfinite is None:
            skip_nonfinite = True  # a disabled scaler with a predicate checks its gradients to ask it
        if skip_nonfinite is False and (skip_if is not None or _positive(skip_loss_z) or _positive(skip_grad_z)):
            raise ValueError("skip_nonfinite: expected True or None with skip_if, skip_loss_z or skip_grad_z (a "
                             "scaler that checks its gradients for them always skips inf/NaN), found False")
        if skip_nonfinite is not None:
            if not isinstance(skip_nonfinite, bool):
                raise TypeError(f"skip_nonfinite: expected True, False or None, found {skip_nonfinite!r}")
            if enabled and not skip_nonfinite:
                raise ValueError("skip_nonfinite: expected True or None with a loss scale (an enabled scaler "
                                 "always skips a step whose gradients hold inf/NaN), found False")
            guard.append(("skip_nonfinite", "true" if skip_nonfinite else "false"))
        self._p = _core.ScalerProtocol(preset, pairs, enabled)  # validates (the core's messages)
        self._p.set_guard(guard)  # validates (the core's messages); nothing is kept on error
        self._refresh_guard()
        self._p.set_rank_agreement(_rank_hook(self))
        self._skip_if = skip_if
        self._losses: List[torch.Tensor] = []  # this step's scale() inputs, for the loss guards
        self._last_device: Optional[torch.device] = None  # of the last check (for the all-reduce)
        self._names: Dict[int, Tuple[Any, str]] = {}  # id(param) -> (weakref to it, name)
        # What the last step() returned: Accelerate and Lightning call step() and drop it.
        self.last_outcome: Optional[StepOutcome] = None
        # Set by mixprec.torch.Telemetry: the check measures each gradient's |max| in its pass,
        # handed on in the StepOutcome (per optimizer, from its check to its step()).
        self._telemetry_amax = False
        self._amax_by_opt: Dict[int, Dict[int, float]] = {}
        # Tests: every gradient through ATen's kernel, the path of other devices (CPU ones too).
        self._aten_only = False
        self._lw = None  # preset layerwise: the watched model's hooks (watch())
        self._lw_skipped: Optional[Tuple[str, ...]] = None  # this step's skipped layers, once finished
        self._lw_last: List[Dict[str, Any]] = []  # the layers of the last finished step (Telemetry)

    # ---- per-layer scaling (preset "layerwise") ------------------------------------------------

    def watch(self, model: torch.nn.Module, modules: Any = None) -> None:
        """Preset "layerwise": scale `model`'s torch.nn.Linear and transformers Conv1D modules per
        layer in backward (mixprec.torch.layerwise; docs/loss_scaling.md, "Per-layer loss
        scaling"). modules: None (every such module), names from model.named_modules(), or a
        predicate (name, module) -> bool. Modules whose weight another module shares (a tied LM
        head) stay at the base scale; so does, for that backward pass, a module called more than
        once in its forward (a warning names it). Frozen parameters (requires_grad=False) are
        left alone. A model with nothing to watch gets a warning naming its class. Without
        watch() a layerwise scaler is its base scale alone."""
        from .layerwise import LayerwiseHooks
        if self._p.layerwise is None:
            raise ValueError(f"watch: per-layer scaling needs preset 'layerwise', this scaler's preset is "
                             f"{self._p.preset!r}")
        if self._lw is not None:
            self._lw.remove()
        self._lw = LayerwiseHooks(self, model, modules)

    def layer_scales(self) -> List[Dict[str, Any]]:
        """Preset "layerwise": per watched layer this step's factor, chain (what its weight
        gradient carried above the base scale), backoff, outcome and counters; calls (its
        forward calls in the last backward pass: above 1, it ran at the base scale) and frozen
        (its parameters that require no gradient)."""
        return [] if self._lw is None else self._lw.scales()

    def _finish_layers(self) -> Tuple[str, ...]:
        if self._lw is None or self._p.layerwise is None:
            return ()
        if self._lw_skipped is None:
            self._lw_skipped = tuple(self._lw.finish())
            self._lw_last = self._lw.scales()
        return self._lw_skipped

    def _layer_record(self) -> List[Dict[str, Any]]:
        """The layers of the last finished step as Telemetry logs them (outcome, factor, ...)."""
        return [d for d in self._lw_last if d["outcome"] is not None]

    # ---- names -------------------------------------------------------------------------

    def set_names(self, named: Union[torch.nn.Module, Iterable[Tuple[str, torch.Tensor]],
                                     Dict[str, torch.Tensor]]) -> None:
        """Names for step()'s first_overflow_name: a module (its named_parameters()), a dict or
        (name, parameter) pairs. Without a name, an optimizer built from named_parameters()
        gives its own (param_groups[i]["param_names"]), else param[<index>]."""
        if isinstance(named, torch.nn.Module):
            items = named.named_parameters()
        elif isinstance(named, dict):
            items = named.items()
        else:
            items = named
        for name, p in items:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"set_names: {name!r}: expected a tensor, found {type(p).__name__}")
            self._names[id(p)] = (weakref.ref(p), str(name))

    def _name(self, p: torch.Tensor, group: Dict[str, Any], k: int, index: int) -> str:
        entry = self._names.get(id(p))
        if entry is not None and entry[0]() is p:
            return entry[1]
        names = group.get("param_names")
        if names is not None and k < len(names):
            return str(names[k])
        return _core.default_parameter_name(index)

    def _name_at(self, optimizer: torch.optim.Optimizer, index: int) -> str:
        i = 0
        for group in optimizer.param_groups:
            for k, p in enumerate(group["params"]):
                if i == index:
                    return self._name(p, group, k, index)
                i += 1
        return _core.default_parameter_name(index)

    # ---- torch.amp.GradScaler's API ------------------------------------------------------

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]):
        """outputs * scale, with the scale as a 0-dim float32 tensor on each output's device
        (torch's own type promotion); tensors in nested lists/tuples (other iterables: a map
        object) as torch does. Disabled: outputs unchanged."""
        if self._wants_loss():
            self._keep_loss(outputs)
        if not self._p.enabled:
            return outputs
        if self._lw is not None:
            self._lw.link(outputs)  # the first step after watch(): which layers chain into which
        s = self._p.scale

        def apply(val):
            if isinstance(val, torch.Tensor):
                return val * torch.full((), s, dtype=torch.float32, device=val.device)
            if isinstance(val, abc.Iterable):
                it = map(apply, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(it)
                return it
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Check and unscale the optimizer's gradients in place (once per update()). A disabled
        scaler does nothing, unless it has guards: then it checks them here (the gradient-norm
        guard sees the norm before any clipping that follows)."""
        if not self._p.enabled and not self._guarded():
            return
        self._p.begin_unscale(id(optimizer))
        self._finish_layers()
        self._p.record(id(optimizer), self._check(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> StepOutcome:
        """unscale_ (unless done), then optimizer.step(*args, **kwargs) unless a gradient held
        inf/NaN. Returns a StepOutcome (torch returns the optimizer's return value: here
        outcome.result), also kept as `last_outcome` for code that calls step() for you."""
        key = id(optimizer)
        plan = self._p.begin_step(key)
        if plan == "pass_through":
            self.last_outcome = StepOutcome(True, False, -1, "", math.nan, 1.0, optimizer.step(*args, **kwargs))
            return self.last_outcome
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if plan == "check":
            self._finish_layers()
            self._p.record(key, self._check(optimizer))
        if self._losses:
            # The loss guards' value: the sum of this step's scale() inputs (with the usual
            # loss / k per micro-batch, the window's mean; z-scores do not depend on the factor).
            self._p.observe_loss(float(sum(float(t.detach().float().sum()) for t in self._losses)))
            self._losses = []
        user_skip = False
        if self._skip_if is not None:
            loss, norm, loss_z, grad_z = self._p.guard_view(key)
            user_skip = bool(self._skip_if(GuardView(loss, norm, loss_z, grad_z)))
        apply, found_inf, scale, first, grad_norm, reason, (g_loss, loss_z, grad_z) = self._p.decide(key, user_skip)
        amax = self._amax_by_opt.pop(key, None)
        # If the optimizer raises, the stage stays "unscaled": a retry steps without unscaling again.
        result = optimizer.step(*args, **kwargs) if apply else None
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # A grad_scale (found_inf) the user set on a fused optimizer is its kernel's for this
            # step only: torch.amp deletes both after the step, so the next step is not divided again.
            for attr in ("grad_scale", "found_inf"):
                if hasattr(optimizer, attr):
                    delattr(optimizer, attr)
        self._p.step_done(key)
        name = self._name_at(optimizer, first) if first >= 0 else ""  # the outcome's name, derived here only
        self.last_outcome = StepOutcome(apply, found_inf, first, name, grad_norm, scale, result,
                                        self._lw_skipped or (), reason, g_loss, loss_z, grad_z, _grad_amax=amax)
        return self.last_outcome

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """The core's update (any optimizer found inf); or set the scale to new_scale.

        The mixprec preset raises mixprec.ScaleCollapseError when its scale collapsed (the
        step is over all the same; the scale stays as it was)."""
        if not self._p.enabled:
            self._p.update()  # a guarded disabled scaler ends its step (nothing to do otherwise)
            self._losses = []
            return
        self._lw_skipped = None
        self._losses = []
        if new_scale is None:
            self._p.update()
            return
        if isinstance(new_scale, torch.Tensor):
            reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                      "torch.FloatTensor with requires_grad=False.")
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise AssertionError(reason)
            value = float(new_scale.detach().float().cpu().item())
        else:
            value = _number("new_scale", new_scale)
        self._p.update_to(value)

    # ---- accumulation windows ---------------------------------------------------------------

    def set_accumulation_steps(self, k: int) -> None:
        """The core protocol's accumulation window of k backward passes, with its rules and errors
        (ScalerProtocol::set_accumulation_steps, include/mixprec/scaler/protocol.hpp);
        backward_done() marks each pass."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"accumulation steps: expected an int, found {type(k).__name__}")
        self._p.set_accumulation_steps(int(k))  # the protocol checks the range

    def get_accumulation_steps(self) -> int:
        return self._p.accumulation_steps

    def backward_done(self) -> None:
        """One backward pass of the window is done."""
        self._p.backward_done()

    def get_scale(self) -> float:
        """The scale (float32 value) as a Python float; 1.0 when disabled."""
        return self._p.scale

    def is_enabled(self) -> bool:
        return self._p.enabled

    @property
    def preset(self) -> str:
        return self._p.preset

    @property
    def loss_scale(self) -> LossScale:
        """A copy of the core LossScale behind the scaler (read it; change it through the scaler)."""
        return LossScale._of_state(self._p.preset if self._p.preset in preset_names() else "torch",
                                   self._p.loss_scale_json())

    def _config(self) -> Dict[str, Any]:
        return json.loads(self._p.loss_scale_json())["config"]

    def get_growth_factor(self) -> float:
        return float(self._config()["growth_factor"])

    def set_growth_factor(self, new_factor: float) -> None:
        self._p.reconfigure("growth_factor", _value_text("growth_factor", new_factor))

    def get_backoff_factor(self) -> float:
        return float(self._config()["backoff_factor"])

    def set_backoff_factor(self, new_factor: float) -> None:
        self._p.reconfigure("backoff_factor", _value_text("backoff_factor", new_factor))

    def get_growth_interval(self) -> int:
        return int(self._config()["growth_interval"])

    def set_growth_interval(self, new_interval: int) -> None:
        self._p.reconfigure("growth_interval", _value_text("growth_interval", new_interval))

    def _get_growth_tracker(self) -> int:
        if not self._p.enabled:
            return 0
        return int(json.loads(self._p.loss_scale_json())["counters"]["growth_tracker"])

    def state_dict(self) -> Dict[str, Any]:
        """The protocol's one state format as a dict: torch's keys (scale, growth_factor,
        backoff_factor, growth_interval, _growth_tracker: torch.amp.GradScaler.load_state_dict
        takes this dict) and mixprec's (format, version, enabled, preset, accumulation_steps,
        loss_scale: the exact scale, the config, every counter; with step guards, `guard`: their
        config and windows). {} when disabled without guards, as torch."""
        if not self._p.enabled and not self._guarded():
            return {}
        state = json.loads(self._p.state_json())
        if state["scale"] == "inf":
            state["scale"] = math.inf
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """A state_dict() of any mixprec door (Python, libtorch, the engine), or one of
        torch.amp.GradScaler (into a scaler whose rule is torch's). The core validates all of it
        first; on error nothing changes."""
        if not self._p.enabled and not self._guarded():
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: expected a dict, found {type(state_dict).__name__}")
        self._p.load_state_json(_state_json(state_dict, "load_state_dict"))
        self._refresh_guard()

    def __getstate__(self) -> Dict[str, Any]:
        if not self._p.between_steps():
            raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                 "of an iteration, or at the end after scaler.update().")
        state = self.__dict__.copy()
        state["_p"] = (self._p.preset, self._p.enabled, self._p.state_json())
        state["_names"] = {}
        state["_lw"] = None  # hooks stay with the model: watch() again after unpickling
        state["_lw_skipped"] = None
        state["_lw_last"] = []
        state["_losses"] = []
        state["_skip_if"] = None  # a function of the user's (often a lambda): give it again after unpickling
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        preset, enabled, saved = state["_p"]
        self.__dict__.update(state)
        self._p = _core.ScalerProtocol(preset, [], enabled)
        self._p.load_state_json(saved)  # the scale (when enabled) and the guards
        self._refresh_guard()
        self._p.set_rank_agreement(_rank_hook(self))

    def __repr__(self) -> str:
        if "_p" not in self.__dict__:  # a constructor that raised (a traceback shows the object)
            return "GradScaler(<not constructed>)"
        return (f"GradScaler(preset={self.preset!r}, scale={self.get_scale()!r}, "
                f"enabled={self.is_enabled()})")

    # ---- internals: the guards' loss, the next scale, the all-reduce, the gradients -------

    def _refresh_guard(self) -> None:
        """The guards' config as the core holds it (after construction and every load)."""
        self._guard = json.loads(self._p.guard_json())

    def _guarded(self) -> bool:
        g = self._guard
        return bool(g["skip_nonfinite"]) or g["skip_loss_z"] > 0 or g["skip_grad_z"] > 0

    def _wants_loss(self) -> bool:
        return self._skip_if is not None or self._guard["skip_loss_z"] > 0

    def _keep_loss(self, outputs: Any) -> None:
        if isinstance(outputs, torch.Tensor):
            self._losses.append(outputs.detach())
        elif isinstance(outputs, (list, tuple)):
            for o in outputs:
                self._keep_loss(o)

    def _next_scale(self) -> float:
        """The scale update() leaves (or left, when it has run since step()), changing nothing:
        what mixprec.torch.Telemetry records as the step's next scale."""
        return self._p.next_scale()

    def _distributed(self) -> bool:
        if self._reduce is False:
            return False
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        if self._reduce and not ready:
            raise RuntimeError("GradScaler(reduce_found_inf=True): torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        return ready

    def _agree_across_ranks(self, found_inf: bool, checked: bool) -> Tuple[bool, bool]:
        """The protocol's rank hook: (found_inf, checked) MAX-reduced over the process group, so
        that every rank skips the same steps; this rank's own flags when not distributed."""
        if not self._distributed():
            return found_inf, checked
        dist = torch.distributed
        # gloo reduces CPU tensors; other backends (nccl) those on the gradients' device.
        device = self._last_device
        if dist.get_backend(self._group) == "gloo":
            dev = torch.device("cpu")
        elif device is not None and device.type != "cpu":
            dev = device
        elif torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        flags = torch.tensor([1.0 if found_inf else 0.0, 1.0 if checked else 0.0], dtype=torch.float32, device=dev)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        found, any_checked = flags.tolist()
        return found != 0.0, any_checked != 0.0

    def _check(self, optimizer: torch.optim.Optimizer) -> Tuple[bool, bool, int, float, float]:
        """Route every gradient (the core validates all before anything is touched and raises
        its message for a refused one), then check and unscale them in place as routed: the
        core reads dense CPU float32/float16/bfloat16 memory, ATen the rest. Returns the
        protocol's GradientCheck as a tuple."""
        params: List[torch.Tensor] = []
        grads: List[torch.Tensor] = []  # what is read: the gradient, or a DTensor's shard
        index: List[int] = []
        i = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:  # else it took no part in the loss: skipped, as torch does
                    params.append(p)
                    grads.append(_local(p.grad.detach()))
                    index.append(i)
                i += 1
        routes = _core.route_gradients([_describe(g) for g in grads], index, self._aten_only,
                                       lambda j: self._name_at(optimizer, j))
        self._last_device = params[0].grad.device if params else None
        for k, (p, (_, coalesce)) in enumerate(zip(params, routes)):
            if coalesce:
                p.grad = p.grad.coalesce()
                grads[k] = _local(p.grad.detach())
        core: List[torch.Tensor] = []
        core_index: List[int] = []
        core_params: List[torch.Tensor] = []
        aten: List[torch.Tensor] = []
        aten_index: List[int] = []
        for p, g, i, (route, _) in zip(params, grads, index, routes):
            if route == "sparse_values":
                g = g._values()
                route = _core.route_gradient(_describe(g), self._aten_only)[0]
            if route == "core":
                core.append(_block(g))
                core_index.append(i)
                core_params.append(p)
            else:
                aten.append(g)
                aten_index.append(i)
        scale = self._p.scale
        self._amax_by_opt.pop(id(optimizer), None)
        amax_wanted = [self._telemetry_amax]  # measured by the core's first read

        def read(on_core: bool, write: bool) -> Tuple[bool, bool, int, float, float]:
            if not on_core:
                return _check_gradients_aten(aten, scale, write)
            # The core reads DLPack capsules (torch.utils.dlpack.to_dlpack, one per read): a
            # tenth of the cost of importing the tensors themselves, with the same checks.
            capsules = [to_dlpack(g) for g in core]
            if amax_wanted[0]:
                amax_wanted[0] = False
                *check, amax = _core.check_gradients(capsules, scale, write, amax=True)
                self._amax_by_opt[id(optimizer)] = {id(p): a for p, a in zip(core_params, amax)}
                return tuple(check)
            return _core.check_gradients(capsules, scale, write)

        return _core.check_in_two_reads(scale, core_index, aten_index, read)


class StepGuard(GradScaler):
    """Step guards without loss scaling (bf16, fp32): a GradScaler with enabled=False that
    still checks every gradient and skips the step on inf/NaN, on a loss or gradient-norm
    spike or when skip_if says so (docs/spike_guards.md). The same calls as a scaler:

        guard = mixprec.torch.StepGuard(skip_loss_z=6.0, skip_grad_z=6.0)
        guard.scale(loss).backward()     # the loss itself, kept for the loss guard
        outcome = guard.step(optimizer)  # outcome.applied, outcome.reason
        guard.update()                   # ends the step (required)
    """

    def __init__(self, *, skip_loss_z: float = 0.0, skip_grad_z: float = 0.0, skip_window: int = 128,
                 skip_if: Optional[Callable[[GuardView], bool]] = None, reduce_found_inf: Optional[bool] = None,
                 process_group: Any = None) -> None:
        super().__init__("cpu", enabled=False, reduce_found_inf=reduce_found_inf, process_group=process_group,
                         skip_nonfinite=True, skip_loss_z=skip_loss_z, skip_grad_z=skip_grad_z,
                         skip_window=skip_window, skip_if=skip_if)

    def __repr__(self) -> str:
        if "_guard" not in self.__dict__:
            return "StepGuard(<not constructed>)"
        g = self._guard
        return f"StepGuard(skip_loss_z={g['skip_loss_z']!r}, skip_grad_z={g['skip_grad_z']!r}, skip_window={g['skip_window']!r})"


def _positive(v: Any) -> bool:
    """A guard threshold that is on (the core checks its range; anything else reaches it as given)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0


def _rank_hook(scaler: "GradScaler"):
    """The protocol's rank callback, holding the scaler weakly: the C++ protocol owns the
    callback, and a strong reference back would be a cycle Python's collector cannot see."""
    ref = weakref.ref(scaler)

    def agree(found_inf: bool, checked: bool) -> Tuple[bool, bool]:
        s = ref()
        return (found_inf, checked) if s is None else s._agree_across_ranks(found_inf, checked)

    return agree


def _local(g: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient (FSDP2's fully_shard, tensor parallelism): this rank's shard, where its
    values live (checked and unscaled in place there). The ranks agree on found_inf through the
    rank hook; grad_norm is this rank's shards'."""
    if type(g) is torch.Tensor:
        return g
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed has no DTensor
        return g
    return g.to_local() if isinstance(g, DTensor) else g


def _number(what: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{what}: expected a number, found {type(v).__name__}")
    return float(v)


def _inv_scale(scale: float) -> float:
    """float(1 / double(scale)) as float32, torch's inverse; inf for scale 0 and for a scale
    backed off below 1/FLT_MAX (the step is then skipped: no warning, it is expected)."""
    if scale == 0:
        return math.inf
    with np.errstate(over="ignore"):
        return float(np.float32(1.0 / scale))


# (dtype, layout, device) -> their words in a description: a handful per process, and what
# costs most to write (str(device)), once each.
_WORDS: Dict[Tuple[Any, Any, Any], Tuple[str, bool, str, str]] = {}


def _describe(t: torch.Tensor) -> Tuple[Any, ...]:
    """t in the words of the core's gradient routing (scaler/grad_route.hpp): torch's names of
    its dtype, layout and device, whether its dtype is floating point, and a strided tensor's
    sizes and strides."""
    key = (t.dtype, t.layout, t.device)
    words = _WORDS.get(key)
    if words is None:
        words = _WORDS.setdefault(key, (str(t.dtype), t.dtype.is_floating_point, str(t.layout), str(t.device)))
    return words + ((t.shape, t.stride()) if key[1] == torch.strided else ((), ()))


def _block(t: torch.Tensor) -> torch.Tensor:
    """A tensor the core reads in place (route "core") as one block of its numel elements."""
    return t if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def _core_block(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A dense tensor the core can read: t's elements as one block of CPU float32, float16 or
    bfloat16 memory without a copy (any dense layout, through its storage: for reads whose
    order does not matter); None when the core cannot read t in place. The core decides (the
    route "core" of its gradient routing)."""
    if _core.route_gradient(_describe(t), False)[0] != "core":
        return None
    return _block(t)


def _first_nonfinite(grads: List[torch.Tensor]) -> int:
    for k, g in enumerate(grads):
        if not bool(torch.isfinite(g).all()):
            return k
    return -1


def _check_gradients_aten(grads: List[torch.Tensor], scale: float,
                          write: bool) -> Tuple[bool, bool, int, float, float]:
    """The core check_gradients' contract (scaler/check_gradients.hpp) through ATen's own
    unscale kernel: float64, strided or overlapping views, device tensors."""
    inv = _inv_scale(scale)
    if not (0.0 < inv <= _FLOAT_MAX):
        return True, True, _first_nonfinite(grads), math.nan, 1.0
    in_place = write and inv <= 1.0
    work = grads if in_place else [g.clone() for g in grads]
    device = grads[0].device
    found = torch.zeros((), dtype=torch.float32, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(work, found, torch.full((), inv, dtype=torch.float32,
                                                                             device=device))
    squares = [torch.linalg.vector_norm(w, 2, dtype=torch.float64 if w.dtype == torch.float64 else torch.float32)
               .double().square() for w in work]
    host = torch.stack([found.double(), torch.stack(squares).sum()]).cpu().tolist()
    found_inf, sum_squares, first = host[0] != 0.0, host[1], -1
    if inv > 1.0:
        first = _first_nonfinite(work)  # products that overflowed their dtype are inf, as inf inputs are
        found_inf = found_inf or first >= 0
    elif found_inf:
        first = _first_nonfinite(grads)
    if found_inf:
        return True, True, first, math.inf, 1.0
    if write and not in_place:
        for g, w in zip(grads, work):
            g.copy_(w)
    return True, False, -1, sum_squares, 1.0 if write else inv
