"""Loss-scale policies from Python: mixprec::LossScale through the core (docs/python.md).

    ls = mixprec.LossScale("torch", growth_interval=100)
    loss * ls.scale ... ls.update(found_inf)      # once per optimizer step

The presets, the override keys and every rule are the core's (docs/loss_scaling.md).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Union

import numpy as np

from . import _core

ScaleCollapseError = _core.ScaleCollapseError


def preset_names() -> List[str]:
    """The presets LossScale accepts, in the core's order."""
    return list(_core.loss_scale_preset_names())


def config_keys() -> List[str]:
    """The override keys LossScale accepts (the core's `--set` key table)."""
    return list(_core.loss_scale_config_keys())


def _value_text(key: str, value: Any) -> str:
    """An override as the text the core's set() parses; the core checks the range."""
    if value is None:
        return "none"
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return str(int(value))
    if isinstance(value, numbers.Real):  # float, numpy floats (whose repr is "np.float64(...)")
        value = float(value)
        if math.isinf(value) and value > 0:
            return "inf"
        if value.is_integer() and abs(value) < 2**63:
            return str(int(value))  # growth_interval=20.0 as torch.amp takes it; 2.9 reaches the core as 2.9
        return repr(value)
    if isinstance(value, str):
        return value
    raise TypeError(f"{key}: expected a number, bool, str or None, found {type(value).__name__}")


def _state_json(state: Any, what: str) -> str:
    """A state dict as the core's JSON: JSON has no inf, and the core writes an infinite scale
    as "inf" and an absent max_scale as null; any other non-finite number is refused by name
    (json.dumps would write Infinity, which no JSON reader takes)."""
    def fix(v: Any, path: str) -> Any:
        if isinstance(v, dict):
            return {k: fix(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, (bool, np.bool_)):
            return bool(v)
        if hasattr(v, "numel") and hasattr(v, "item") and v.numel() == 1:  # a 1-element tensor
            return fix(v.item(), path)
        if isinstance(v, numbers.Integral):
            return int(v)
        if isinstance(v, numbers.Real):
            f = float(v)
            if math.isfinite(f):
                return f
            key = path.rsplit(".", 1)[-1]
            if key == "scale" and f > 0:
                return "inf"
            if key == "max_scale" and f > 0:
                return None
            raise ValueError(f"{what}: {path}: expected a finite number, found {f}")
        return v
    return json.dumps(fix(state, ""), allow_nan=False, default=lambda v: _unknown(what, v))


def _unknown(what: str, v: Any) -> Any:
    raise TypeError(f"{what}: a value of type {type(v).__name__} is not part of a state")


@dataclass(frozen=True)
class ScaleUpdate:
    """What one update() did."""

    action: str            # "grew", "backed_off" (also at the floor) or "unchanged"
    previous_scale: float  # float32 value before
    scale: float           # float32 value after
    found_inf: bool        # True: this step was skipped


class LossScale:
    """A loss-scale policy: a preset of the core plus overrides of its config keys.

    Unknown preset or key, or a value out of range: ValueError with the core's message
    (which lists the presets or keys allowed).
    """

    def __init__(self, preset: str = "mixprec", **overrides: Any) -> None:
        if not isinstance(preset, str):
            raise TypeError(f"preset: expected a str (one of {', '.join(preset_names())}), "
                            f"found {type(preset).__name__}")
        pairs = [(k, _value_text(k, v)) for k, v in overrides.items()]
        self._preset = preset
        self._core = _core.LossScale(preset, pairs)

    @classmethod
    def _of_state(cls, preset: str, state: str) -> "LossScale":
        """A LossScale holding `state` (a state's JSON) under the name `preset`: a copy of
        another's (the static preset included, which has no scale of its own to start from)."""
        config = json.loads(state)["config"]  # the core holds a static and a dynamic scale apart
        copy = cls("static", init_scale=config["init_scale"]) if config["rule"] == "static" else cls("torch")
        copy._core.load_json(state)
        copy._preset = preset
        return copy

    @property
    def preset(self) -> str:
        return self._preset

    @property
    def scale(self) -> float:
        """The current scale as float32 (what multiplies the loss)."""
        return self._core.scale

    @property
    def exact_scale(self) -> float:
        """The scale as the rule holds it: a double for deepspeed and apex (which can exceed
        float32's range), else the same float32 value as `scale`."""
        return self._core.exact_scale

    @property
    def config(self) -> Dict[str, Any]:
        """The config in the core's JSON form (min_scale/max_scale None = no floor/cap)."""
        return self.state_dict()["config"]

    @property
    def counters(self) -> Dict[str, int]:
        return self.state_dict()["counters"]

    def update(self, found_inf: bool) -> ScaleUpdate:
        """One optimizer step: found_inf=True means the step was skipped.

        Raises ScaleCollapseError (the core's message) when the floor policy is "error" and
        the scale collapsed; the scale is then left as it was.
        """
        if not isinstance(found_inf, (bool, np.bool_)):
            raise TypeError(f"found_inf: expected a bool, found {type(found_inf).__name__}")
        action, before, after = self._core.update(bool(found_inf))
        return ScaleUpdate(action, before, after, bool(found_inf))

    def replay(self, overflows: Union[str, Iterable[Any]]) -> List[float]:
        """update() for each step (bools, or a "0110" string as `mixprec scaler replay`);
        returns the scale after each step."""
        if isinstance(overflows, str):
            bad = set(overflows) - {"0", "1"}
            if bad:
                raise ValueError(f"overflows: expected a string of 0 and 1, found {''.join(sorted(bad))!r}")
            steps = [c == "1" for c in overflows]
        else:
            steps = []
            for i, v in enumerate(overflows):
                if isinstance(v, (bool, np.bool_)):
                    steps.append(bool(v))
                else:
                    raise TypeError(f"overflows[{i}]: expected a bool, found {type(v).__name__}")
        return list(self._core.replay(steps))

    def state_dict(self) -> Dict[str, Any]:
        """The core's saved state (format mixprec.loss_scale, version 1) as a dict."""
        return json.loads(self._core.to_json())

    def load_state_dict(self, state: Union[Dict[str, Any], str]) -> None:
        """Restore a state_dict() (or its JSON text); the core validates all of it first. The
        state's config replaces this one's, as GradScaler.load_state_dict does; a state of another
        rule makes `preset` that rule's name."""
        text = state if isinstance(state, str) else _state_json(state, "load_state_dict")
        before = self.config["rule"]
        self._core.load_json(text)
        after = self.config["rule"]
        if after != before:  # the state's config replaced this one's (as every GradScaler's load): say so
            self._preset = after

    def describe(self) -> str:
        """One "key = value" line per config field, as the overrides accept them."""
        return self._core.describe()

    def __repr__(self) -> str:
        return f"LossScale(preset={self._preset!r}, scale={self.scale!r})"
