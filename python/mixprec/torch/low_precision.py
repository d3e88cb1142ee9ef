"""Transformer Engine's low-precision recipes on any PyTorch model, emulated exactly on the CPU
(docs/low_precision.md, "A low-precision Linear for any model").

    import mixprec.torch as mt
    mt.low_precision(model, "nvfp4")                    # every nn.Linear but the first and last
    mt.low_precision(model, {"h.0.mlp.fc": "mxfp8", "lm_head": "bf16"})   # a mixed assignment
    mt.low_precision(model, "assignment.json")          # the same, from a recipe file

Each chosen ``nn.Linear`` is replaced by a ``LowPrecisionLinear`` holding the same parameters,
whose autograd function quantizes per GEMM as TE does (every number through the C++ core's
``lowp::quantize``, then back to fp32; the GEMMs accumulate in fp32):

    fprop  y  = Q(x, rowwise) Q(w, rowwise)^T + b
    dgrad  dx = Q(dy, rowwise) Q(w, columnwise)          dy in E5M2 under the HYBRID format
    wgrad  dw = Q(dy, columnwise)^T Q(x, columnwise)     NVFP4: RHT on both, stochastic dy
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import numpy as np
import torch

from .. import _core
from ..quantize import RECIPES

#: The recipe file's format tag and the versions this reader accepts.
FILE_FORMAT = "mixprec.low_precision"
FILE_VERSIONS = (1,)
#: What keeps a module in higher precision in an assignment.
HIGH = "bf16"

_ROLES = ("x", "w", "dy")
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # the fp8_max of delayed scaling's update


_OPTION_FIELDS = ("fp8_format", "amax_history_len", "amax_compute_algo", "margin", "power_of_2_scales",
                  "scale_rounding", "weight_2d", "rht", "stochastic_rounding", "flavour")


def _plan(doc: Dict[str, Any]) -> Dict[str, Any]:
    """Check a recipe file (as a dict) and resolve every entry: the core's lowp::parse_assignment
    and lowp::resolve, the one definition of the format and of TE's defaults."""
    return _core.plan_assignment(json.dumps({"format": FILE_FORMAT, "version": FILE_VERSIONS[-1], **doc}))


@dataclass(frozen=True)
class RecipeOptions:
    """One module's recipe and options; None leaves an option to the recipe's TE default.

    fp8_format          "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3"; TE's defaults:
                        HYBRID for fp8-delayed and fp8-current, E4M3 for mxfp8 and fp8-block.
    amax_history_len, amax_compute_algo, margin   fp8-delayed (TE DelayedScaling: 1024, "max", 0).
    power_of_2_scales   fp8-current (False), fp8-block (True).
    scale_rounding      mxfp8, mxfp4: "rceil" or "floor".
    weight_2d           fp8-block 128x128 / nvfp4 16x16 weight tiles (TE: True).
    rht                 nvfp4: RHT on the wgrad copies of x and dy (TE: True).
    stochastic_rounding nvfp4: stochastic rounding of dy (TE: True); mxfp4 when asked.
    flavour             "te" or "torchao" (mxfp8, mxfp4, nvfp4).
    """

    recipe: str
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    margin: Optional[int] = None
    power_of_2_scales: Optional[bool] = None
    scale_rounding: Optional[str] = None
    weight_2d: Optional[bool] = None
    rht: Optional[bool] = None
    stochastic_rounding: Optional[bool] = None
    flavour: Optional[str] = None

    def entry(self) -> Dict[str, Any]:
        """The recipe-file entry: the recipe and the options that were set."""
        return {"recipe": self.recipe, **{k: getattr(self, k) for k in _OPTION_FIELDS if getattr(self, k) is not None}}

    def resolved(self) -> "RecipeOptions":
        """Every option decided (TE's defaults); ValueError names an option that does not fit."""
        plan = _plan({"modules": {"m": self.entry()}})
        r = plan["modules"][0][1]
        if r is None:
            raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}, found {HIGH!r} (use no LowPrecisionLinear)")
        return RecipeOptions(**r)

    def element(self, role: str) -> str:
        if self.recipe in ("nvfp4", "mxfp4"):
            return "e2m1"
        return "e5m2" if (role == "dy" and self.fp8_format == "hybrid") else "e4m3"


def load_assignment(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read a recipe file (docs/low_precision.md, "The recipe file"), checked whole by the core."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        _core.plan_assignment(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return json.loads(text)


def save_assignment(path: Union[str, os.PathLike], modules: Mapping[str, Any], *, default: str = HIGH,
                    options: Optional[Mapping[str, Any]] = None, notes: Optional[str] = None) -> None:
    """Write a recipe file (what the precision advisor writes), checked as load checks it."""
    doc: Dict[str, Any] = {"format": FILE_FORMAT, "version": FILE_VERSIONS[-1], "default": default,
                           "modules": dict(modules)}
    if options:
        doc["options"] = dict(options)
    if notes:
        doc["notes"] = notes
    _core.plan_assignment(json.dumps(doc))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


# ---- the quantized GEMMs -----------------------------------------------------------------

def _fake(t: torch.Tensor, opts: RecipeOptions, role: str, layout: str, *, scale: float = 1.0,
          tile_2d: bool = False, rht: bool = False, random: Optional[np.ndarray] = None):
    """Quantize a 2-D fp32 tensor and return (the dequantized fp32 tensor, the core's result)."""
    a = t.detach().contiguous().numpy()
    recipe = opts.recipe
    q = _core.quantize(a, recipe, opts.element(role), layout, bool(tile_2d), opts.scale_rounding or "rceil",
                       opts.power_of_2_scales, 0.0, float(np.finfo(np.float32).max),
                       float(scale) if recipe == "fp8-delayed" else 1.0, bool(rht), random, opts.flavour or "te")
    out = torch.empty(t.shape, dtype=torch.float32)
    _core.dequantize(q, out.numpy())
    return out, q


def _per_tensor(o: RecipeOptions) -> bool:
    return o.recipe in ("fp8-delayed", "fp8-current")


class _Stats:
    """What the last quantization of each role did (telemetry of quantized tensors)."""

    __slots__ = ("amax", "scale", "elements", "saturated", "flushed", "nonfinite", "rel_rms_error", "nonzero",
                 "measured")

    def __init__(self):
        self.amax = 0.0
        self.scale = 1.0
        self.elements = 0
        self.saturated = 0
        self.flushed = 0
        self.nonfinite = 0
        self.rel_rms_error: Optional[float] = None
        self.nonzero = 0          # nonzero (or NaN) inputs: counted when measured
        self.measured = False     # this quantization's error and nonzero count were measured

    def take(self, q: Any, scale: float, exact: Optional[torch.Tensor], approx: torch.Tensor) -> None:
        c = q.counts
        self.amax = float(c["amax"])
        self.scale = float(scale)
        self.elements = int(c["elements"])
        self.saturated = int(c["saturated"])
        self.flushed = int(c["flushed"])
        self.nonfinite = int(c["nonfinite"])
        self.measured = exact is not None
        if exact is None:
            self.rel_rms_error = None
        else:
            den = torch.linalg.vector_norm(exact.double())
            num = torch.linalg.vector_norm((approx - exact).double())
            self.rel_rms_error = float(num / den) if den > 0 else 0.0
            self.nonzero = int(torch.count_nonzero(exact))  # NaN != 0: counted, as the engine counts it

    def as_dict(self) -> Dict[str, Any]:
        n = max(self.elements, 1)
        return {"amax": self.amax, "scale": self.scale, "saturated": self.saturated / n,
                "flushed": self.flushed / n, "rel_rms_error": self.rel_rms_error}


class _LowPrecisionLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mod: "LowPrecisionLinear"):
        out_dtype = x.dtype
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        w = weight.detach().float()
        o = mod.options
        sample = mod._sample_error or mod._sample_step
        sx, sw = mod._scale("x"), mod._scale("w")
        xq, qx = _fake(x2, o, "x", "rowwise", scale=sx)
        wq, qw = _fake(w, o, "w", "rowwise", scale=sw, tile_2d=o.weight_2d)
        mod._record("x", qx, sx, x2 if sample else None, xq)
        mod._record("w", qw, sw, w if sample else None, wq)
        y = xq @ wq.t()
        if bias is not None:
            y = y + bias.detach().float()
        # The wgrad operand: x's columnwise copy (RHT along the batch for NVFP4), kept for
        # backward. Per-tensor scaling quantizes both layouts alike: the same values.
        rht_x = bool(o.rht) and x2.shape[0] % 16 == 0
        xc = xq if _per_tensor(o) else _fake(x2, o, "x", "columnwise", scale=sx, rht=rht_x)[0]
        ctx.save_for_backward(xc)
        ctx.mod = mod
        ctx.scales = (sw, rht_x)
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        return y.to(out_dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (xc,) = ctx.saved_tensors
        mod = ctx.mod
        o = mod.options
        sw, rht_x = ctx.scales
        dy2 = dy.detach().reshape(-1, dy.shape[-1]).float()
        w = mod.weight.detach().float()
        sdy = mod._scale("dy")
        n = dy2.shape[0]
        sr = bool(o.stochastic_rounding)
        random_row = mod._random(dy2.numel()) if sr else None
        dyq, qdy = _fake(dy2, o, "dy", "rowwise", scale=sdy, random=random_row)
        mod._record("dy", qdy, sdy, dy2 if mod._sample_error or mod._sample_step else None, dyq)
        # dgrad: w along its output dimension (W does not change between a forward and its
        # backward; a per-tensor scale quantizes both layouts alike).
        if _per_tensor(o):
            wc, _ = _fake(w, o, "w", "rowwise", scale=sw)
        else:
            wc, _ = _fake(w, o, "w", "columnwise", scale=sw, tile_2d=o.weight_2d)
        dx = (dyq @ wc).to(ctx.x_dtype).reshape(ctx.x_shape)
        # wgrad: both operands along the batch; RHT on both or on neither.
        rht = rht_x and n % 16 == 0
        random_col = mod._random(dy2.numel()) if sr and not _per_tensor(o) else None
        dyc = dyq if _per_tensor(o) else _fake(dy2, o, "dy", "columnwise", scale=sdy, rht=rht, random=random_col)[0]
        dw = (dyc.t() @ xc).to(ctx.w_dtype)
        db = dy2.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        mod._after_backward()
        return dx, dw, db, None


class LowPrecisionLinear(torch.nn.Module):
    """An ``nn.Linear`` whose GEMMs run on quantized operands (see the module docstring). It
    holds the original module's parameters; fp8-delayed adds the buffers ``amax_history``
    ([3, amax_history_len]: x, w, dy) and ``scale`` ([3]), saved in ``state_dict``."""

    def __init__(self, linear: torch.nn.Linear, options: RecipeOptions, name: str = "", seed: int = 0):
        super().__init__()
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"{name or 'module'}: expected an nn.Linear, found {type(linear).__name__}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.options = options.resolved()
        self.name = name
        self._seed = int(seed)
        self._draws = 0
        self._sample_error = False  # measure the next forward and backward (sample_quantization_error)
        self._sample_step = False   # measure every call until cleared (Telemetry's sampled steps)
        self.stats = {r: _Stats() for r in _ROLES}
        if self.options.recipe == "fp8-delayed":
            self.register_buffer("amax_history", torch.zeros(3, self.options.amax_history_len, dtype=torch.float32))
            self.register_buffer("scale", torch.ones(3, dtype=torch.float32))

    def _scale(self, role: str) -> float:
        if self.options.recipe != "fp8-delayed":
            return 1.0
        return float(self.scale[_ROLES.index(role)])

    def _record(self, role: str, q: Any, scale: float, exact: Optional[torch.Tensor], approx: torch.Tensor) -> None:
        self.stats[role].take(q, scale if self.options.recipe == "fp8-delayed" else q.tensor_scale, exact, approx)
        if self.options.recipe == "fp8-delayed" and self.training:
            # TE's delayed scaling: this step's amax enters the history; the next step's scale
            # comes from it (fold, roll, update: the core's fp8 rules).
            i = _ROLES.index(role)
            fp8_max = _FP8_MAX[self.options.element(role)]
            hist = self.amax_history[i].numpy()
            new = _core.delayed_update(hist, float(q.counts["amax"]), self.options.amax_compute_algo, fp8_max,
                                       self.options.margin, float(self.scale[i]))
            self.scale[i] = new

    def _random(self, n: int) -> np.ndarray:
        # Caller-supplied random words for stochastic rounding: a fixed stream per module.
        rng = np.random.default_rng([self._seed, self._draws])
        self._draws += 1
        return rng.integers(0, 2**32, n, dtype=np.uint32)

    def _after_backward(self) -> None:
        self._sample_error = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return _LowPrecisionLinearFn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.options.recipe}")


def _linear_names(model: torch.nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def low_precision(model: torch.nn.Module, recipe: Any, *, modules: Any = None, seed: int = 0,
                  **options: Any) -> torch.nn.Module:
    """Swap chosen ``nn.Linear`` modules of ``model`` (in place) for ``LowPrecisionLinear``.

    recipe   a recipe name (one of mixprec.RECIPES) for every chosen module; or a mixed
             assignment: a dict {module name: recipe name | "bf16" | {"recipe": ..., options}}
             or the path of a recipe file (docs/low_precision.md), in which case ``modules``
             must be None.
    modules  with a recipe name: None (every nn.Linear but the first and the last, in
             ``named_modules`` order, as the field keeps them in higher precision), a list of
             module names, or a callable (name, module) -> bool.
    options  RecipeOptions fields: with a recipe name, for every chosen module (each must fit
             the recipe); with an assignment, shared options that reach the recipes having them.
    Returns the model. Unknown or non-Linear module names, unknown recipes and options are
    errors (ValueError), raised before any module is swapped.
    """
    names = _linear_names(model)
    unknown = sorted(set(options) - set(_OPTION_FIELDS))
    if unknown:
        raise ValueError(f"options: unknown {unknown}; expected some of {list(_OPTION_FIELDS)}")
    if isinstance(recipe, (str, os.PathLike)) and (str(recipe).endswith(".json") or os.path.exists(str(recipe))):
        if modules is not None:
            raise ValueError("modules: a recipe file names its modules itself; pass modules=None")
        doc = load_assignment(recipe)
        doc.pop("format")
        doc.pop("version")
        if options:
            doc["options"] = {**doc.get("options", {}), **options}
        where = str(recipe)
    elif isinstance(recipe, Mapping):
        if modules is not None:
            raise ValueError("modules: a mixed assignment names its modules itself; pass modules=None")
        doc = {"default": HIGH, "modules": dict(recipe)}
        if options:
            doc["options"] = dict(options)
        where = "assignment"
    elif isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}, found {recipe!r}")
        if modules is None:
            chosen = names[1:-1]
        elif callable(modules):
            chosen = [n for n in names if modules(n, model.get_submodule(n))]
        elif isinstance(modules, Iterable):
            chosen = list(modules)
        else:
            raise ValueError(f"modules: expected None, a list of names or a callable, found {type(modules).__name__}")
        doc = {"default": HIGH, "modules": {n: {"recipe": recipe, **options} for n in chosen}}
        where = "recipe"
    else:
        raise ValueError(f"recipe: expected a recipe name, a dict or a recipe file path, found {type(recipe).__name__}")
    known = set(names)
    for name in doc["modules"]:
        if name not in known:
            found = type(model.get_submodule(name)).__name__ if _has_module(model, name) else "no such module"
            raise ValueError(f"{where}: module {name!r}: expected an nn.Linear of the model, found {found}")
    try:
        p = _plan(doc)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    plan: Dict[str, RecipeOptions] = {n: RecipeOptions(**r) for n, r in p["modules"] if r is not None}
    if p["default"] is not None:
        for n in names:
            if n not in doc["modules"]:
                plan[n] = RecipeOptions(**p["default"])
    for i, (name, o) in enumerate(plan.items()):
        _set_module(model, name, LowPrecisionLinear(model.get_submodule(name), o, name, seed=seed * 1000003 + i))
    return model


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def low_precision_modules(model: torch.nn.Module) -> Dict[str, LowPrecisionLinear]:
    """The LowPrecisionLinear modules of a model, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LowPrecisionLinear)}


def sample_quantization_error(model: torch.nn.Module) -> None:
    """Ask every LowPrecisionLinear to measure the relative RMS quantization error of x, w
    (next forward) and dy (next backward); a cost paid only at the sampled steps."""
    for m in low_precision_modules(model).values():
        m._sample_error = True


# The log's names of the three roles (mixprec train's fp8 tensors are named alike).
_ROLE_TENSOR = {"x": ("input", "forward"), "w": ("weight", "forward"), "dy": ("grad_output", "backward")}


def _sample_step(modules: Iterable["LowPrecisionLinear"], on: bool) -> None:
    """Telemetry's sampled steps: measure every quantization of the step (all micro-batches)."""
    for m in modules:
        m._sample_step = on


def _measured_tensors(modules: Mapping[str, "LowPrecisionLinear"]) -> List[tuple]:
    """The roles measured and not yet taken (_taken), as the telemetry recorder takes them: (name,
    role, recipe, element, scale, amax, elements, nonzero, saturated, flushed, rel_rms_error or None)."""
    out = []
    for name, m in modules.items():
        for role in _ROLES:
            st = m.stats[role]
            if not st.measured:
                continue
            suffix, direction = _ROLE_TENSOR[role]
            err = st.rel_rms_error if st.rel_rms_error is not None and np.isfinite(st.rel_rms_error) else None
            out.append((f"{name}.{suffix}", direction, m.options.recipe, m.options.element(role), float(st.scale),
                        float(st.amax), st.elements, st.nonzero, st.saturated, st.flushed, err))
    return out


def _taken(modules: Iterable["LowPrecisionLinear"]) -> None:
    """After a log line holds them: a later line does not repeat them."""
    for m in modules:
        for st in m.stats.values():
            st.measured = False


def quantization_stats(model: torch.nn.Module) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """{module name: {role: {amax, scale, saturated, flushed, rel_rms_error}}} of the last
    quantization of each role (saturated/flushed as fractions of the elements)."""
    return {n: {r: m.stats[r].as_dict() for r in _ROLES} for n, m in low_precision_modules(model).items()}
