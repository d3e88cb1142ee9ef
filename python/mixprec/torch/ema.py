"""mixprec.torch.EMA: an exponential moving average of a model's weights that follows only the
optimizer steps that were applied (docs/python.md, "mixprec.torch.EMA").

    scaler = mixprec.torch.GradScaler("cuda")
    ema = mixprec.torch.EMA(model, decay=0.999)
    for x, y in data:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(x), y)
        scaler.scale(loss).backward()
        outcome = scaler.step(opt)
        ema.update(outcome)          # a skipped step (overflow) leaves the average untouched
        scaler.update()
        opt.zero_grad()
    with ema.applied_to(model):      # evaluate with the averaged weights, restored afterwards
        evaluate(model)

The update, for every tracked tensor p with shadow s (float32; float64 for a float64 tensor):

    s <- s.lerp_(p.to(s.dtype), w),  w = 1 - d,  d = decay (or the warm-up's smaller value)

i.e. torch.lerp's formula, element by element: for w < 0.5, s + w * (p - s), the product and
the sum fused (one rounding, as torch's CPU and CUDA kernels compute it); for w >= 0.5
(d <= 0.5), p - (p - s) * (1 - w). For float32 shadows w = 1 - d in float32 arithmetic with d
rounded to float32 first (as `mixprec train --ema` computes its rate); for float64 ones in
float64. A shadow equal to its parameter stays bit for bit equal (no drift).

A step counts only when it was applied: update(outcome) with a StepOutcome whose `applied` is
False (mixprec.torch.GradScaler skipped it: inf/NaN gradients, or a skip guard) changes no
shadow byte and not num_updates. A step whose update the layerwise preset skipped for some
layers alone (outcome.skipped_layers) is applied: those layers' weights did not move, and
their shadows move towards those unchanged weights, as for any step.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import struct
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from .. import _args
from .grad_scaler import GradScaler, StepOutcome

_STATE_VERSION = 1
_STATE_KEYS = ("version", "decay", "warmup", "num_updates", "shadow")


def _decay(v: Any) -> float:
    if isinstance(v, (bool, str, bytes)) or v is None or not (
            isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1)):
        raise TypeError(f"decay: expected a number in [0, 1), found {_args._shown(v)}")
    d = _args.real("decay", v)
    if not (math.isfinite(d) and 0.0 <= d < 1.0):
        raise ValueError(f"decay: expected a number in [0, 1), found {d!r}")
    return d


def _f32(x: float) -> float:
    """x rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _shadow_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16/float32 (and fp8) tensors, float64 for float64, complex64/128
    for complex ones: never narrower than the tensor."""
    return torch.promote_types(dtype, torch.float32)


def _named_tensors(source: Any, buffers: bool) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs to follow, checked: a module's parameters (and its floating buffers
    when asked), or an iterable of (str, floating tensor) pairs with distinct names."""
    if isinstance(source, torch.nn.Module):
        named = list(source.named_parameters())
        if buffers:
            named += [(n, b) for n, b in source.named_buffers() if b.is_floating_point() or b.is_complex()]
    else:
        if buffers:
            raise TypeError("buffers: expected False when following (name, tensor) pairs (list the buffers among "
                            "the pairs), found True")
        if isinstance(source, (str, bytes, torch.Tensor)) or not isinstance(source, Iterable):
            raise TypeError("model_or_named_params: expected a torch.nn.Module or an iterable of (name, tensor) "
                            f"pairs (model.named_parameters()), found {_args._shown(source)}")
        named = []
        for item in source:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError("model_or_named_params: expected (name, tensor) pairs (model.named_parameters()), "
                                f"found {_args._shown(item)}")
            n, t = item
            if not isinstance(n, str):
                raise TypeError(f"model_or_named_params: expected names of type str, found {_args._shown(n)}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"model_or_named_params: '{n}': expected a tensor, found {type(t).__name__}")
            named.append((n, t))
    seen = set()
    for n, t in named:
        if n in seen:
            raise ValueError(f"model_or_named_params: '{n}' is given twice (each tensor is averaged once)")
        seen.add(n)
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"model_or_named_params: '{n}': expected a floating-point tensor, found {t.dtype}")
        if t.layout != torch.strided:
            raise TypeError(f"model_or_named_params: '{n}': expected a dense (strided) tensor, found {t.layout}")
        if t.is_meta:
            raise ValueError(f"model_or_named_params: '{n}': expected a tensor with values, found one on the meta "
                             "device (materialize the model first)")
    if not named:
        raise ValueError("model_or_named_params: expected at least one parameter to average, found none")
    return named


class EMA:
    """An exponential moving average of a model's weights over its applied optimizer steps.

    EMA(model_or_named_params, decay=0.999, *, warmup=False, buffers=False)

    model_or_named_params  a torch.nn.Module (its named_parameters()), or an iterable of
                           (name, tensor) pairs with distinct names (a subset, buffers too)
    decay                  d in [0, 1): each applied step moves the average (1 - d) of the way
                           to the weights
    warmup                 False: d at every step. True: min(decay, (1 + n) / (10 + n)) at the
                           n-th applied update (n = 1, 2, ...; TensorFlow's num_updates rule), so
                           that the first updates follow the fast-moving weights closely
    buffers                with a module: also average its floating-point buffers (BatchNorm's
                           running_mean/var) by the same rule; integer buffers
                           (num_batches_tracked) are never followed. Default False: parameters only

    The shadows start as float32 copies of the tensors as they are now (float64 for float64
    ones), on each tensor's device: make the EMA after moving the model to its device
    (update() refuses a tensor whose device or shape changed). update() reads the tensors it
    was given (the same Parameter objects; a parameter replaced by a new one is not followed).
    """

    def __init__(self, model_or_named_params: Union[torch.nn.Module, Iterable[Tuple[str, torch.Tensor]]],
                 decay: float = 0.999, *, warmup: bool = False, buffers: bool = False) -> None:
        decay = _decay(decay)
        warmup = _args.flag("warmup", warmup)
        buffers = _args.flag("buffers", buffers)
        named = _named_tensors(model_or_named_params, buffers)
        self._decay = decay
        self._warmup = warmup
        self._names: List[str] = [n for n, _ in named]
        self._sources: List[torch.Tensor] = [t for _, t in named]
        with torch.no_grad():
            self._shadows: List[torch.Tensor] = [
                t.detach().to(dtype=_shadow_dtype(t.dtype), copy=True)
                for t in self._sources]
        self._num_updates = 0
        self._last_outcome: Optional[StepOutcome] = None  # the StepOutcome the last update() took
        # Shadows by width: float64/complex128 ones (True) take w in float64, the others in float32.
        self._groups: Dict[bool, List[int]] = {}
        for i, sh in enumerate(self._shadows):
            self._groups.setdefault(sh.dtype in (torch.float64, torch.complex128), []).append(i)

    # ---- the average ---------------------------------------------------------------------

    @property
    def decay(self) -> float:
        return self._decay

    @property
    def warmup(self) -> bool:
        return self._warmup

    @property
    def num_updates(self) -> int:
        """Applied updates averaged so far (skipped steps are not counted)."""
        return self._num_updates

    @property
    def names(self) -> List[str]:
        return list(self._names)

    def current_decay(self) -> float:
        """The decay the next applied update() uses."""
        if not self._warmup:
            return self._decay
        n = self._num_updates + 1
        return min(self._decay, (1.0 + n) / (10.0 + n))

    def shadow(self, name: str) -> torch.Tensor:
        """The averaged tensor of `name` (the EMA's own: clone it to keep a copy)."""
        try:
            return self._shadows[self._names.index(name)]
        except ValueError:
            raise KeyError(f"shadow: {name!r} is not averaged here; the names are {self._preview()}") from None

    def _preview(self) -> str:
        return ", ".join(self._names[:8]) + (", ..." if len(self._names) > 8 else "")

    def _applied(self, outcome: Any) -> bool:
        """Whether `outcome` says the optimizer step was applied (see update())."""
        if outcome is None:
            return True
        if isinstance(outcome, bool) or type(outcome).__name__ == "bool_":
            return bool(outcome)
        if isinstance(outcome, GradScaler):
            last = outcome.last_outcome
            if last is None:
                raise RuntimeError("update(): the GradScaler has no step outcome yet (its step() has not run); call "
                                   "scaler.step(optimizer) before ema.update(scaler)")
            outcome = last
        if isinstance(outcome, StepOutcome):
            if outcome is self._last_outcome:
                # The same outcome twice: update() ran again without a new scaler.step() (e.g. once
                # per micro-batch): an applied step would be averaged twice.
                raise RuntimeError("update(): this StepOutcome was already taken by the previous update(); call "
                                   "ema.update() once per scaler.step() (a new outcome)")
            return bool(outcome.applied)
        if isinstance(outcome, torch.amp.GradScaler):
            raise TypeError("update(): outcome: torch.amp.GradScaler does not say whether its step was applied; "
                            "pass mixprec.torch.GradScaler (or its step()'s StepOutcome), or a bool")
        raise TypeError("update(): outcome: expected a mixprec.torch.StepOutcome, a mixprec.torch.GradScaler, a bool "
                        f"or None (applied), found {_args._shown(outcome)}")

    def update(self, outcome: Union[None, bool, StepOutcome, GradScaler] = None) -> bool:
        """Averages the tracked tensors in when the step was applied; returns whether it did.

        outcome: None (the step was applied: a loop without a scaler), a bool (applied or not),
        the StepOutcome of mixprec.torch.GradScaler.step(), or the GradScaler itself (its
        last_outcome: for loops where something else calls step()). A step not applied changes
        nothing (no shadow byte, not num_updates) and returns False. Refused, with nothing
        changed: other types (torch.amp.GradScaler's step() returns None even when it skipped:
        pass a bool there), a GradScaler before its first step(), the StepOutcome the previous
        update() took, a tensor whose shape or device changed since the EMA was made."""
        applied = self._applied(outcome)
        if applied:
            for name, s, p in zip(self._names, self._shadows, self._sources):
                if p.shape != s.shape or p.device != s.device:
                    raise RuntimeError(f"update(): '{name}' is now of shape {tuple(p.shape)} on {p.device}, its "
                                       f"average of shape {tuple(s.shape)} on {s.device}; make a new EMA after "
                                       "reshaping or moving the model")
        taken = outcome.last_outcome if isinstance(outcome, GradScaler) else outcome
        if isinstance(taken, StepOutcome):
            self._last_outcome = taken
        if not applied:
            return False
        d = self.current_decay()
        with torch.no_grad():
            for wide, idx in self._groups.items():
                w = 1.0 - d if wide else _f32(1.0 - _f32(d))  # float32 1 - d: the exact difference, rounded once
                shadows = [self._shadows[i] for i in idx]
                ends = [self._sources[i].detach() for i in idx]
                ends = [e if e.dtype == s.dtype else e.to(s.dtype) for s, e in zip(shadows, ends)]
                torch._foreach_lerp_(shadows, ends, w)
        self._num_updates += 1
        return True

    # ---- using the average -----------------------------------------------------------------

    def _targets(self, model: Optional[torch.nn.Module], what: str) -> List[torch.Tensor]:
        """The tensors of `model` the shadows go into, by name (the followed ones for None),
        each checked for its shape before anything is written."""
        if model is None:
            return list(self._sources)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{what}: model: expected a torch.nn.Module or None (the tensors this EMA follows), "
                            f"found {_args._shown(model)}")
        known: Dict[str, torch.Tensor] = dict(model.named_parameters())
        for n, b in model.named_buffers():
            known.setdefault(n, b)
        out = []
        for name, s in zip(self._names, self._shadows):
            t = known.get(name)
            if t is None:
                raise ValueError(f"{what}: model: it has no parameter or buffer '{name}' (this EMA averages "
                                 f"{self._preview()})")
            if t.shape != s.shape:
                raise ValueError(f"{what}: model: '{name}' has shape {tuple(t.shape)}; expected {tuple(s.shape)}, "
                                 "the average's")
            out.append(t)
        return out

    def copy_to(self, model: Optional[torch.nn.Module] = None) -> None:
        """Writes the averages into `model`'s tensors of the same names (rounded to each tensor's
        dtype), or into the followed tensors themselves when model is None."""
        targets = self._targets(model, "copy_to()")
        with torch.no_grad():
            for t, s in zip(targets, self._shadows):
                t.copy_(s)

    @contextlib.contextmanager
    def applied_to(self, model: Optional[torch.nn.Module] = None) -> Iterator[torch.nn.Module]:
        """with ema.applied_to(model): the averages are in model's tensors (the followed ones for
        None) inside the block; on leaving it, even by an exception, every tensor holds its
        own values again, bit for bit. For evaluation: an optimizer step inside the block is
        undone on leaving it."""
        targets = self._targets(model, "applied_to()")
        with torch.no_grad():
            saved = [t.detach().clone() for t in targets]
            try:
                for t, s in zip(targets, self._shadows):
                    t.copy_(s)
            except BaseException:
                for t, v in zip(targets, saved):
                    t.copy_(v)
                raise
        try:
            yield model
        finally:
            with torch.no_grad():
                for t, v in zip(targets, saved):
                    t.copy_(v)

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """{"version": 1, "decay", "warmup", "num_updates", "shadow": {name: tensor}}; the tensors
        are the EMA's own (as torch's state_dict() gives them): torch.save them, or clone them
        to keep a snapshot in memory."""
        return {"version": _STATE_VERSION, "decay": self._decay, "warmup": self._warmup,
                "num_updates": self._num_updates, "shadow": dict(zip(self._names, self._shadows))}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores num_updates and every average from state_dict()'s dict; this EMA keeps its own
        decay and warmup (a resumed run may change them; the saved ones are checked for their
        type only). Everything is checked before anything changes: the keys, the version, the
        names (none missing, none extra), each tensor's shape and dtype (the average's; values
        are copied onto the average's device)."""
        if not isinstance(state, dict):
            raise TypeError("load_state_dict(): state: expected a dict (EMA.state_dict()), found "
                            f"{_args._shown(state)}")
        missing = [k for k in _STATE_KEYS if k not in state]
        extra = [k for k in state if k not in _STATE_KEYS]
        if missing or extra:
            raise ValueError(f"load_state_dict(): state: expected the keys {', '.join(_STATE_KEYS)}, found "
                             f"{', '.join(map(str, state)) or 'none'}")
        if state["version"] != _STATE_VERSION or isinstance(state["version"], bool):
            raise ValueError(f"load_state_dict(): version: expected {_STATE_VERSION}, found {state['version']!r}")
        _decay(state["decay"])
        _args.flag("load_state_dict(): warmup", state["warmup"])
        num_updates = _args.integer("load_state_dict(): num_updates", state["num_updates"], 0, 2**63 - 1)
        shadow = state["shadow"]
        if not isinstance(shadow, dict):
            raise TypeError("load_state_dict(): shadow: expected a dict of name -> tensor, found "
                            f"{_args._shown(shadow)}")
        missing = [n for n in self._names if n not in shadow]
        extra = [n for n in shadow if n not in self._names]
        if missing or extra:
            parts = ([f"missing {', '.join(map(repr, missing[:8]))}"] if missing else []) + \
                    ([f"unexpected {', '.join(map(repr, extra[:8]))}"] if extra else [])
            raise ValueError(f"load_state_dict(): shadow: expected the names this EMA averages; {'; '.join(parts)}")
        for name, s in zip(self._names, self._shadows):
            t = shadow[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"load_state_dict(): shadow '{name}': expected a tensor, found {_args._shown(t)}")
            if t.shape != s.shape or t.dtype != s.dtype:
                raise ValueError(f"load_state_dict(): shadow '{name}': expected shape {tuple(s.shape)} and dtype "
                                 f"{s.dtype}, found shape {tuple(t.shape)} and dtype {t.dtype}")
            if t.layout != torch.strided or t.is_meta:
                raise ValueError(f"load_state_dict(): shadow '{name}': expected a dense tensor with values, found "
                                 f"{'a meta tensor' if t.is_meta else t.layout}")
        with torch.no_grad():
            for name, s in zip(self._names, self._shadows):
                t = shadow[name]
                if t is not s:
                    s.copy_(t)
        self._num_updates = num_updates
        self._last_outcome = None

    def __repr__(self) -> str:
        return (f"mixprec.torch.EMA({len(self._names)} tensors, decay={self._decay}, warmup={self._warmup}, "
                f"{self._num_updates} updates)")
