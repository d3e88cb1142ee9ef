"""mixprec.torch.GradScaler: a drop-in for torch.amp.GradScaler over the core's LossScale.

    scaler = mixprec.torch.GradScaler("cpu", growth_interval=20)   # = torch.amp.GradScaler's rule
    scaler.set_names(model)                                        # names in step()'s outcome
    with torch.autocast("cpu", dtype=torch.float16):
        loss = criterion(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                                           # optional, e.g. to clip
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    outcome = scaler.step(opt)      # StepOutcome(applied, found_inf, first_overflow, grad_norm, scale, ...)
    scaler.update()
    if outcome.applied:
        scheduler.step()

What runs where (docs/python.md):
- the scale policy: the core mixprec::LossScale (mixprec.LossScale), every preset;
- CPU float32/float16/bfloat16 gradients: the core's fused unscale_and_check in place on the
  tensors' own memory (DLPack, no copy): check, unscale and the exact sum of squares in one
  pass, element for element what ATen's _amp_foreach_non_finite_check_and_unscale_ computes;
- gradients on other devices: ATen's own _amp_foreach_non_finite_check_and_unscale_.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import abc
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch

from .. import _core
from ..loss_scale import LossScale, preset_names

_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# torch.amp.GradScaler's constructor arguments and the core's config keys of the same meaning.
_TORCH_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


@dataclass(frozen=True)
class StepOutcome:
    """What GradScaler.step() did for one optimizer.

    bool(outcome) is outcome.applied. torch.amp.GradScaler.step returns the optimizer's own
    return value instead (None when skipped); here it is `result`.
    """

    applied: bool                        # optimizer.step() ran
    found_inf: bool                      # a gradient held inf/NaN: the step was skipped
    first_overflow: Optional[str]        # name of the first parameter holding inf/NaN (None if none)
    first_overflow_index: Optional[int]  # its index over the optimizer's parameters, groups in order
    grad_norm: float                     # L2 norm of the unscaled gradients (before any clipping); inf/NaN on overflow
    scale: float                         # the scale the gradients carried
    result: Any = None                   # optimizer.step()'s return value (None when skipped)

    def __bool__(self) -> bool:
        return self.applied


class _Record:
    __slots__ = ("stage", "checked", "found_inf", "first_index", "grad_norm", "scale")

    def __init__(self) -> None:
        self.stage = _READY
        self.checked = False    # an inf check was recorded (some parameter had a gradient)
        self.found_inf = False
        self.first_index: Optional[int] = None
        self.grad_norm = math.nan
        self.scale = math.nan


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
                 process_group: Any = None, **overrides: Any) -> None:
        self._device = device
        # None: MAX-reduce found_inf over the process group whenever torch.distributed is
        # initialized (sharded optimizers see different gradients on each rank).
        self._reduce = reduce_found_inf
        self._group = process_group
        self._enabled = bool(enabled)
        if self._enabled and device == "cuda" and not torch.cuda.is_available():
            # torch.amp.GradScaler does the same (and so silently runs unscaled); say it too.
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
            self._enabled = False
        self._preset = "torch" if preset is None else preset
        if not isinstance(self._preset, str):
            raise TypeError(f"preset: expected a str (one of {', '.join(preset_names())}), "
                            f"found {type(self._preset).__name__}")
        given = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                     growth_interval=growth_interval)
        self._overrides: Dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        for k, v in overrides.items():
            if k in self._overrides:
                raise TypeError(f"GradScaler: {k} given twice")
            self._overrides[k] = v
        self._ls = LossScale(self._preset, **self._overrides)  # validates (the core's messages)
        self._records: Dict[int, _Record] = {}
        self._acc_steps = 1   # the accumulation window (set_accumulation_steps), as the core scaler's
        self._acc_passes = 0
        self._names: Dict[int, Tuple[Any, str]] = {}  # id(param) -> (weakref to it, name)

    # ---- names -------------------------------------------------------------------------

    def set_names(self, named: Union[torch.nn.Module, Iterable[Tuple[str, torch.Tensor]],
                                     Dict[str, torch.Tensor]]) -> None:
        """Names for step()'s first_overflow: a module (its named_parameters()), a dict or
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
        return f"param[{index}]"

    def _name_at(self, optimizer: torch.optim.Optimizer, index: int) -> str:
        i = 0
        for group in optimizer.param_groups:
            for k, p in enumerate(group["params"]):
                if i == index:
                    return self._name(p, group, k, index)
                i += 1
        return f"param[{index}]"

    # ---- torch.amp.GradScaler's API ------------------------------------------------------

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]):
        """outputs * scale, with the scale as a 0-dim float32 tensor on each output's device
        (torch's own type promotion); tensors in nested lists/tuples (other iterables: a map
        object) as torch does. Disabled: outputs unchanged."""
        if not self._enabled:
            return outputs
        s = self._ls.scale

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
        """Check and unscale the optimizer's gradients in place (once per update())."""
        if not self._enabled:
            return
        r = self._records.setdefault(id(optimizer), _Record())
        if r.stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if r.stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._require_complete("unscale_()")
        self._check_unscale(optimizer, r)
        r.stage = _UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> StepOutcome:
        """unscale_ (unless done), then optimizer.step(*args, **kwargs) unless a gradient held
        inf/NaN. Returns a StepOutcome (torch returns the optimizer's return value: here
        outcome.result)."""
        if not self._enabled:
            return StepOutcome(True, False, None, None, math.nan, 1.0, optimizer.step(*args, **kwargs))
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        r = self._records.setdefault(id(optimizer), _Record())
        if r.stage == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self._require_complete("step()")
        if r.stage == _READY:
            self.unscale_(optimizer)
        if not r.checked:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        result = None
        if not r.found_inf:
            result = optimizer.step(*args, **kwargs)
        r.stage = _STEPPED
        name = None if r.first_index is None else self._name_at(optimizer, r.first_index)
        return StepOutcome(not r.found_inf, r.found_inf, name, r.first_index, r.grad_norm, r.scale, result)

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """The core LossScale's update(any optimizer found inf); or set the scale to new_scale.

        The mixprec preset raises mixprec.ScaleCollapseError when its scale collapsed (the
        step is over all the same; the scale stays as it was)."""
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                value = float(new_scale.detach().float().cpu().item())
            else:
                value = float(new_scale)
            self._set_scale(value)
            self._records = {}
            self._acc_passes = 0
            return
        self._require_complete("update()")
        checked = [r for r in self._records.values() if r.stage != _READY and r.checked]
        if not checked:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf = any(r.found_inf for r in checked)
        self._records = {}  # the step is over even if the update raises (as the core scaler)
        self._acc_passes = 0
        self._ls.update(found_inf)

    # ---- accumulation windows (the core scaler's rule; optional) ---------------------------

    def set_accumulation_steps(self, k: int) -> None:
        """k backward passes share one scale: call backward_done() after each; unscale_, step
        and update before the k-th raise. k = 1 (the default): no window, torch's behaviour."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"accumulation steps {k!r} is not allowed; it must be an int >= 1")
        if self._acc_passes != 0:
            raise RuntimeError(f"set_accumulation_steps() in the middle of an accumulation window "
                               f"({self._acc_passes} backward passes done)")
        self._acc_steps = k

    def get_accumulation_steps(self) -> int:
        return self._acc_steps

    def backward_done(self) -> None:
        """One backward pass of the window is done."""
        if not self._enabled:
            return
        if any(r.stage != _READY for r in self._records.values()):
            raise RuntimeError("backward_done() after unscale_() or step() and before update(): a new window "
                               "starts after update()")
        if self._acc_passes == self._acc_steps:
            raise RuntimeError(f"backward_done() called {self._acc_passes + 1} times in an accumulation window "
                               f"of {self._acc_steps}; call step() and update() at the window's end")
        self._acc_passes += 1

    def _require_complete(self, call: str) -> None:
        if self._acc_steps > 1 and self._acc_passes != self._acc_steps:
            raise RuntimeError(f"{call} after {self._acc_passes} of {self._acc_steps} backward passes of the "
                               "accumulation window: one scale holds for the whole window; unscale_, step and "
                               "update once, at its end")

    def get_scale(self) -> float:
        """The scale (float32 value) as a Python float; 1.0 when disabled."""
        return self._ls.scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def preset(self) -> str:
        return self._preset

    @property
    def loss_scale(self) -> LossScale:
        """The core LossScale behind the scaler (read it; change it through the scaler)."""
        return self._ls

    def get_growth_factor(self) -> float:
        return float(self._ls.config["growth_factor"])

    def set_growth_factor(self, new_factor: float) -> None:
        self._reconfigure(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return float(self._ls.config["backoff_factor"])

    def set_backoff_factor(self, new_factor: float) -> None:
        self._reconfigure(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return int(self._ls.config["growth_interval"])

    def set_growth_interval(self, new_interval: int) -> None:
        self._reconfigure(growth_interval=new_interval)

    def _get_growth_tracker(self) -> int:
        return int(self._ls.counters["growth_tracker"]) if self._enabled else 0

    def state_dict(self) -> Dict[str, Any]:
        """torch's keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker:
        torch.amp.GradScaler.load_state_dict takes this dict) plus "preset" and "mixprec",
        the core LossScale's full state. {} when disabled, as torch."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self.get_growth_factor(),
            "backoff_factor": self.get_backoff_factor(),
            "growth_interval": self.get_growth_interval(),
            "_growth_tracker": self._get_growth_tracker(),
            "preset": self._preset,
            "accumulation_steps": self._acc_steps,
            "mixprec": self._ls.state_dict(),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """A state_dict() of this class (same preset; the core validates all of it first), or
        one of torch.amp.GradScaler (preset torch only: its rule and numbers)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._require_between("load_state_dict()")
        if self._acc_passes != 0:
            raise RuntimeError("load_state_dict() in the middle of an accumulation window")
        if "mixprec" in state_dict:
            saved = state_dict.get("preset")
            if saved != self._preset:
                raise ValueError(f"load_state_dict: the state was saved by a GradScaler with preset {saved!r}; "
                                 f"this one has preset {self._preset!r} (build GradScaler(preset={saved!r}) to load it)")
            steps = state_dict.get("accumulation_steps", self._acc_steps)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise ValueError(f"load_state_dict: accumulation_steps {steps!r} is not allowed; it must be an int >= 1")
            fresh = LossScale(self._preset, **self._overrides)
            fresh.load_state_dict(state_dict["mixprec"])
            self._ls = fresh
            self._acc_steps = steps
            return
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state_dict]
        if missing:
            raise KeyError(f"load_state_dict: not a GradScaler state (torch.amp's or mixprec's): "
                           f"missing {', '.join(missing)}")
        if self._preset != "torch":
            raise ValueError(f"load_state_dict: a torch.amp.GradScaler state follows torch's rule; this "
                             f"GradScaler has preset {self._preset!r} (load it into GradScaler(preset='torch'))")
        overrides = dict(self._overrides)
        overrides.update(growth_factor=float(state_dict["growth_factor"]),
                         backoff_factor=float(state_dict["backoff_factor"]),
                         growth_interval=int(state_dict["growth_interval"]))
        fresh = LossScale("torch", **overrides)
        state = fresh.state_dict()
        state["scale"] = float(state_dict["scale"])
        state["counters"]["growth_tracker"] = int(state_dict["_growth_tracker"])
        fresh.load_state_dict(state)
        self._overrides = overrides
        self._ls = fresh

    def __getstate__(self) -> Dict[str, Any]:
        if self._records:
            raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                 "of an iteration, or at the end after scaler.update().")
        state = self.__dict__.copy()
        state["_ls"] = self._ls.state_dict()
        state["_names"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        saved = state["_ls"]
        self.__dict__.update(state)
        self._ls = LossScale(self._preset, **self._overrides)
        self._ls.load_state_dict(saved)

    def __repr__(self) -> str:
        return (f"GradScaler(preset={self._preset!r}, scale={self.get_scale()!r}, "
                f"enabled={self._enabled})")

    # ---- internals ---------------------------------------------------------------------

    def _require_between(self, what: str) -> None:
        for r in self._records.values():
            if r.stage != _READY:
                raise RuntimeError(f"{what} in the middle of a step: an optimizer is {r.stage}; "
                                   "call it before scale()/step() or after update()")

    def _reconfigure(self, **changes: Any) -> None:
        """A new core LossScale with the changed config and the old scale and counters."""
        overrides = dict(self._overrides)
        overrides.update(changes)
        fresh = LossScale(self._preset, **overrides)  # validates the new value
        state = fresh.state_dict()
        old = self._ls.state_dict()
        for k in old:
            if k != "config":
                state[k] = old[k]
        interval = state["config"].get("growth_interval")
        tracker = state["counters"].get("growth_tracker", 0)
        if isinstance(interval, int) and interval > 0 and tracker >= interval:
            # The core refuses a tracker past the interval (torch would never grow again).
            state["counters"]["growth_tracker"] = interval - 1
        fresh.load_state_dict(state)
        self._overrides = overrides
        self._ls = fresh

    def _scale_after_update(self, found_inf: bool) -> float:
        """The scale update() leaves (or left: when it has run since step()), without changing
        anything: what mixprec.torch.Telemetry records as the step's next scale."""
        if not self._enabled:
            return 1.0
        if not self._records:
            return self._ls.scale  # update() has run: its result is the scale now
        copy = LossScale(self._preset, **self._overrides)
        copy.load_state_dict(self._ls.state_dict())
        try:
            copy.update(bool(found_inf))
        except _core.ScaleCollapseError:
            pass  # update() will raise it; the scale stays
        return copy.scale

    def _set_scale(self, value: float) -> None:
        state = self._ls.state_dict()
        state["scale"] = value
        self._ls.load_state_dict(state)

    def _distributed(self) -> bool:
        if self._reduce is False:
            return False
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        if self._reduce and not ready:
            raise RuntimeError("GradScaler(reduce_found_inf=True): torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        return ready

    def _check_unscale(self, optimizer: torch.optim.Optimizer, r: _Record) -> None:
        """The local check and unscale, then (under torch.distributed) found_inf MAX-reduced
        over the process group: every rank skips the same steps."""
        device = self._local_check_unscale(optimizer, r)
        if self._distributed():
            dist = torch.distributed
            # gloo reduces CPU tensors; other backends (nccl) those on the gradients' device.
            if dist.get_backend(self._group) == "gloo":
                dev = torch.device("cpu")
            elif device is not None and device.type != "cpu":
                dev = device
            elif torch.cuda.is_available():
                dev = torch.device("cuda", torch.cuda.current_device())
            else:
                dev = torch.device("cpu")
            flags = torch.tensor([1.0 if r.found_inf else 0.0, 1.0 if r.checked else 0.0],
                                 dtype=torch.float32, device=dev)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            found, checked = flags.tolist()
            r.found_inf = r.found_inf or found != 0.0
            r.checked = r.checked or checked != 0.0

    def _local_check_unscale(self, optimizer: torch.optim.Optimizer, r: _Record) -> Optional[torch.device]:
        """Validate every gradient (nothing is touched before all are checked), then check and
        unscale them in place; record found_inf, the first overflowing index and the norm."""
        entries: List[Tuple[int, torch.Tensor]] = []
        index = 0
        first_device: Optional[Tuple[torch.device, int, Any, int]] = None
        for group in optimizer.param_groups:
            for k, p in enumerate(group["params"]):
                i = index
                index += 1
                g = p.grad
                if g is None:
                    continue  # took no part in the loss: skipped, as torch does

                def who(p=p, group=group, k=k, i=i) -> str:
                    return "the gradient of " + self._name(p, group, k, i)

                if g.is_sparse or g.layout != torch.strided:
                    raise ValueError(f"{who()} is sparse (layout {g.layout}); mixprec.torch.GradScaler "
                                     "needs dense gradients")
                if g.dtype not in _CPU_DTYPES:
                    raise TypeError(f"{who()} has dtype {g.dtype}; mixprec.torch.GradScaler accepts "
                                    "torch.float32, torch.float16 and torch.bfloat16 gradients")
                if not g.is_contiguous():
                    raise ValueError(f"{who()} is not contiguous (sizes {list(g.shape)}, strides "
                                     f"{list(g.stride())}); mixprec.torch.GradScaler unscales gradients in "
                                     "place and needs them contiguous (.contiguous() them before step)")
                if first_device is None:
                    first_device = (g.device, i, group, k)
                elif g.device != first_device[0]:
                    d, i0, g0, k0 = first_device
                    p0 = g0["params"][k0]
                    raise ValueError(f"gradients on more than one device: {self._name(p0, g0, k0, i0)} on {d}, "
                                     f"{self._name(p, group, k, i)} on {g.device}; use one GradScaler step "
                                     "per device's optimizer")
                entries.append((i, g))
        r.scale = self._ls.scale
        r.checked = bool(entries)
        r.found_inf, r.first_index, r.grad_norm = False, None, 0.0
        if not entries:
            return None
        inv_scale = float(np.float32(1.0 / float(r.scale))) if r.scale != 0 else math.inf
        grads = [g.detach() for _, g in entries]
        if not (0.0 < inv_scale <= float(np.finfo(np.float32).max)):
            # The scale is inf, 0 or below about 2^-128 (presets without floor or finite guard):
            # nothing can be unscaled. As the core scaler: an overflow step, nothing written.
            r.found_inf, r.grad_norm = True, math.nan
            for (i, _), g in zip(entries, grads):
                if not bool(torch.isfinite(g).all()):
                    r.first_index = i
                    break
            return first_device[0]
        device = first_device[0]
        if device.type == "cpu":
            # The core's fused pass over the tensors' own memory (DLPack views, no copy).
            found, first, sum_squares = _core.unscale_and_check(grads, inv_scale, True, True)
            r.grad_norm = math.sqrt(sum_squares) if sum_squares == sum_squares else math.nan
            r.found_inf = bool(found) or not math.isfinite(r.grad_norm)
            r.first_index = entries[first][0] if first >= 0 else None
            return device
        # Other devices: ATen's own kernel, the norm on the device, one copy of two floats.
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, torch.full((), inv_scale, dtype=torch.float32, device=device))
        norms = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads])
        host = torch.stack([found_inf, torch.linalg.vector_norm(norms, 2)]).cpu()
        r.grad_norm = float(host[1])
        r.found_inf = bool(host[0] != 0) or not math.isfinite(r.grad_norm)
        if bool(host[0] != 0):
            for (i, _), g in zip(entries, grads):
                if not bool(torch.isfinite(g).all()):
                    r.first_index = i
                    break
        return device
