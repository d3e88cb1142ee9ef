"""Transformer Engine's low-precision recipes on any PyTorch model, emulated exactly on the CPU
(docs/low_precision.md, "A low-precision Linear for any model").

    import mixprec.torch as mt
    mt.low_precision(model, "nvfp4")                    # every nn.Linear but the first and last
    mt.low_precision(model, {"h.0.mlp.fc": "mxfp8", "lm_head": "bf16"})   # a mixed assignment
    mt.low_precision(model, "assignment.json")          # the same, from a recipe file

    mt.low_precision(model, "mxfp8_fwd_nvfp4_bwd")      # a TE zoo name: a format per GEMM direction
    mt.low_precision(model, "plan.json", total_steps=N) # a recipe file with a schedule; then, each
    mt.low_precision_step(model, step)                  # step, the plan of that step

Each chosen ``nn.Linear`` is replaced by a ``LowPrecisionLinear`` holding the same parameters,
whose autograd function quantizes per GEMM as TE does (every number through the C++ core's
``lowp::quantize``, then back to fp32; the GEMMs accumulate in fp32):

    fprop  y  = Q(x, rowwise) Q(w, rowwise)^T + b
    dgrad  dx = Q(dy, rowwise) Q(w, columnwise)          dy in E5M2 under the HYBRID format
    wgrad  dw = Q(dy, columnwise)^T Q(x, columnwise)     NVFP4: RHT on both, stochastic dy

Each of the six operands may have its own recipe or stay in high precision (the core's
lowp::LinearPlan: "fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.x", "wgrad.dy"), and the
backward copies of x and w may be quantized from the values fprop multiplied (columnwise_source
"dequantized"). A high-precision operand is the fp32 value of the tensor as the module gets it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from .. import _args, _core
from ..quantize import RECIPES

#: The recipe file's format tag and the versions this reader accepts.
FILE_FORMAT = "mixprec.low_precision"
FILE_VERSIONS = (1,)
#: What keeps a module in higher precision in an assignment.
HIGH = "bf16"

_ROLES = ("x", "w", "dy")
#: The GEMM operands, as the core names them (lowp::Operand).
OPERANDS = ("fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.x", "wgrad.dy")
#: Transformer Engine's quantizer-factory zoo names a recipe may be given as (a format per direction).
ZOO = tuple(_core.zoo_names())


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

    def plan(self) -> Dict[str, Any]:
        """The uniform plan of this recipe: every operand's config (the core's LinearPlan)."""
        return _core.RecipeFile(json.dumps({"format": FILE_FORMAT, "version": FILE_VERSIONS[-1],
                                            "modules": {"m": self.entry()}})).plan("m")

    def element(self, role: str) -> str:
        if self.recipe in ("nvfp4", "mxfp4"):
            return "e2m1"
        return "e5m2" if (role == "dy" and self.fp8_format == "hybrid") else "e4m3"


def load_assignment(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read a recipe file (docs/low_precision.md, "The recipe file"), checked whole by the core."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"recipe file: {os.fspath(path)!r} does not exist")
    try:
        # The core's reader: a FIFO or a device is refused (open() would wait on a FIFO forever).
        raw = _core.read_json_text(os.fspath(path))
    except RuntimeError as e:
        raise ValueError(f"recipe file: {e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{os.fspath(path)}: recipe file: not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start}") from None
    try:
        _core.plan_assignment(text)  # depth, duplicate keys, UTF-8, every entry: before Python parses it
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None
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


class _FilePlans:
    """A checked recipe file (the core's lowp::Assignment) and the run's length: each module's
    plan at a step of the schedule, and for evaluation."""

    def __init__(self, text: str, total_steps: Optional[int], where: str):
        try:
            self.file = _core.RecipeFile(text)
            self.total_steps = 0 if total_steps is None else int(total_steps)
            self.starts = list(self.file.phase_starts(self.total_steps))
        except ValueError as e:
            msg = str(e).replace("give the door the number of steps", "pass low_precision(..., total_steps=N)")
            raise ValueError(f"{where}: {msg}") from None
        self.phases = self.file.phases

    def plan_at(self, name: str, step: int) -> Dict[str, Any]:
        return self.file.plan_at(name, step, self.total_steps)

    def evaluation_plan(self, name: str) -> Optional[Dict[str, Any]]:
        return self.file.evaluation_plan(name)

    def matching(self, i: int, name: str) -> bool:
        pats = self.phases[i]["modules"]
        return not pats or any(self.file.matches(p, name) for p in pats)

    def reachable(self, name: str) -> List[Dict[str, Any]]:
        """Every plan `name` can run: at step 0, at each phase's first step, for evaluation."""
        plans = [self.plan_at(name, 0)] + [self.plan_at(name, s) for s in self.starts]
        ev = self.evaluation_plan(name)
        return plans + ([ev] if ev is not None else [])

    def label_at(self, name: str, step: int) -> str:
        """The label of the latest phase that has begun at `step` and reaches `name` ("" before any)."""
        best = None
        for i, start in enumerate(self.starts):
            if start <= step and self.matching(i, name) and (best is None or start >= self.starts[best]):
                best = i
        return "" if best is None else self.phases[best]["label"]


# ---- the quantized GEMMs -----------------------------------------------------------------

def _per_tensor(o: RecipeOptions) -> bool:
    return o.recipe in ("fp8-delayed", "fp8-current")


def _quantize_operand(t: torch.Tensor, cfg: Dict[str, Any], *, scale: float = 1.0, rht: bool = False,
                      random: Optional[np.ndarray] = None):
    """Quantize a 2-D fp32 tensor with one operand's config (the core's LinearPlan::config) and
    return (the dequantized fp32 tensor, the core's result). A per-tensor recipe quantizes both
    layouts to the same values: it is quantized rowwise."""
    a = t.detach().resolve_neg().contiguous().numpy()
    recipe = cfg["recipe"]
    per_tensor = recipe in ("fp8-delayed", "fp8-current")
    q = _core.quantize(a, recipe, cfg["element"], "rowwise" if per_tensor else cfg["layout"], bool(cfg["tile_2d"]),
                       cfg["scale_rounding"], cfg["power_of_2_scales"], 0.0, float(np.finfo(np.float32).max),
                       float(scale) if recipe == "fp8-delayed" else 1.0, bool(rht), random, cfg["flavour"])
    out = torch.empty(t.shape, dtype=torch.float32)
    _core.dequantize(q, out.numpy())
    return out, q


def _same_values(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> bool:
    """Two operand configs that quantize a tensor to the same values: a per-tensor recipe with
    the same options (its layouts differ only in the grid's order)."""
    if a is None or b is None or a["recipe"] not in ("fp8-delayed", "fp8-current"):
        return False
    return {k: v for k, v in a.items() if k != "layout"} == {k: v for k, v in b.items() if k != "layout"}


class _Stats:
    """What the last quantization of each role did (telemetry of quantized tensors)."""

    __slots__ = ("amax", "scale", "elements", "saturated", "flushed", "nonfinite", "rel_rms_error", "nonzero",
                 "measured", "recipe", "element", "blocks", "kurtosis", "what_if", "pending")

    def __init__(self):
        self.recipe = ""          # the recipe and element of the operand recorded (per-direction plans differ)
        self.element = ""
        self.amax = 0.0
        self.scale = 1.0
        self.elements = 0
        self.saturated = 0
        self.flushed = 0
        self.nonfinite = 0
        self.rel_rms_error: Optional[float] = None
        self.nonzero = 0          # nonzero (or NaN) inputs: counted when measured
        self.measured = False     # this quantization's error and nonzero count were measured
        # At Telemetry's sampled steps: _core.block_stats of the quantization and its source, the
        # source's kurtosis, and the what-ifs Telemetry(what_if=...) asked for (_what_if's dicts),
        # computed by settle() from `pending` (q, a copy of the source, the operand, the what-if
        # recipes, whether to take block statistics) once the step is recorded: only the step's
        # last quantization of the role is paid for, not every micro-batch's.
        self.blocks: Optional[Dict[str, Any]] = None
        self.kurtosis: Optional[float] = None
        self.what_if: List[Dict[str, Any]] = []
        self.pending: Optional[Tuple[Any, torch.Tensor, str, Tuple[str, ...], bool]] = None

    def take(self, q: Any, scale: float, exact: Optional[torch.Tensor], approx: torch.Tensor) -> None:
        c = q.counts
        self.amax = float(c["amax"])
        self.scale = float(scale)
        self.elements = int(c["elements"])
        self.saturated = int(c["saturated"])
        self.flushed = int(c["flushed"])
        self.nonfinite = int(c["nonfinite"])
        self.measured = exact is not None
        self.blocks, self.kurtosis, self.what_if, self.pending = None, None, [], None
        if exact is None:
            self.rel_rms_error = None
        else:
            self.rel_rms_error = _rel_rms_error(exact, approx)
            self.nonzero = int(torch.count_nonzero(exact))  # NaN != 0: counted, as the engine counts it

    def settle(self) -> None:
        """The sampled statistics of the pending quantization (see __init__)."""
        if self.pending is None:
            return
        q, src, operand, what_if, blocks = self.pending
        self.pending = None
        values = src.numpy()
        if blocks:
            self.blocks = _core.block_stats(q, values)
            self.kurtosis = _core.kurtosis(values)
        self.what_if = [_what_if(r, operand, src, values) for r in what_if]

    def as_dict(self) -> Dict[str, Any]:
        n = max(self.elements, 1)
        return {"amax": self.amax, "scale": self.scale, "saturated": self.saturated / n,
                "flushed": self.flushed / n, "rel_rms_error": self.rel_rms_error}


def _rel_rms_error(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| in double (0 for an all-zero exact; NaN when it held inf/NaN)."""
    den = torch.linalg.vector_norm(exact.double())
    num = torch.linalg.vector_norm((approx - exact).double())
    return float(num / den) if den > 0 else 0.0


_UNIFORM: Dict[str, Dict[str, Any]] = {}


def _uniform_configs(recipe: str) -> Dict[str, Any]:
    """Every operand's config of the uniform plan of `recipe` with TE's defaults (cached)."""
    if recipe not in _UNIFORM:
        _UNIFORM[recipe] = RecipeOptions(recipe).plan()["configs"]
    return _UNIFORM[recipe]


#: The recipes a what-if may name: fp8-delayed is left out, as its scale comes from an amax
#: history of earlier steps that a what-if does not have (fp8-current is its scale of this step).
WHAT_IF_RECIPES = tuple(r for r in RECIPES if r != "fp8-delayed")


def _what_if(recipe: str, operand: str, src: torch.Tensor, values: np.ndarray) -> Dict[str, Any]:
    """What quantizing `src` (the values of a recorded quantization; `values` its array) with
    `recipe`'s config of the same operand would do (docs/low_precision.md, "Per-block
    statistics"): lowp's counts, the relative RMS error and a few block statistics. RHT as the
    door applies it (where the rows are a multiple of 16); rounding to nearest, as stochastic
    rounding would make the counts one draw's."""
    cfg = _uniform_configs(recipe)[operand]
    rht = bool(cfg["rht"]) and src.shape[0] % 16 == 0
    approx, q = _quantize_operand(src, cfg, rht=rht)
    c = q.counts
    b = _core.block_stats(q, values)
    err = _rel_rms_error(src, approx)
    return {"recipe": recipe, "element": cfg["element"], "elements": int(c["elements"]),
            "saturated": int(c["saturated"]), "flushed": int(c["flushed"]),
            "rel_rms_error": err if math.isfinite(err) else None, "blocks": b["blocks"],
            "far_blocks": b["far_blocks"], "log2_multiplier_std": b["log2_multiplier_std"],
            "log2_multiplier_p01": b["log2_multiplier_quantiles"]["p01"],
            "log2_multiplier_p99": b["log2_multiplier_quantiles"]["p99"]}


class _LowPrecisionLinearFn(torch.autograd.Function):
    # The plan's GEMMs (module docstring). Each tensor's statistics (and fp8-delayed's history)
    # come from its first quantized operand: x from fprop.x else wgrad.x, w from fprop.w else
    # dgrad.w, dy from dgrad.dy else wgrad.dy.
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mod: "LowPrecisionLinear"):
        out_dtype = x.dtype
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        w = mod._gemm_weight(weight.detach())
        plan = mod._active_plan()
        cfg = plan["configs"]
        sample = mod._sample_error or mod._sample_step
        sx, sw = mod._scale("x"), mod._scale("w")
        cx, cw, cxc = cfg["fprop.x"], cfg["fprop.w"], cfg["wgrad.x"]
        xq, wq = x2, w
        if cx is not None:
            xq, qx = _quantize_operand(x2, cx, scale=sx)
            mod._record("x", qx, sx, x2 if sample else None, xq, cx, "fprop.x")
        if cw is not None:
            wq, qw = _quantize_operand(w, cw, scale=sw)
            mod._record("w", qw, sw, w if sample else None, wq, cw, "fprop.w")
        y = xq @ wq.t()
        if bias is not None:
            y = y + bias.detach().float()
        # The wgrad operand: x's columnwise copy (RHT along the batch for NVFP4), kept for
        # backward; from the original x or from the values fprop multiplied.
        src = xq if plan["x_source"] == "dequantized" else x2
        rht = cxc is not None and bool(cxc["rht"]) and x2.shape[0] % 16 == 0
        if cxc is None:
            xc = src
        elif src is x2 and _same_values(cx, cxc):
            xc = xq
        else:
            xc, qxc = _quantize_operand(src, cxc, scale=sx, rht=rht)
            if cx is None:
                mod._record("x", qxc, sx, src if sample else None, xc, cxc, "wgrad.x")
        ctx.save_for_backward(xc)
        ctx.mod = mod
        ctx.plan = plan
        ctx.scales = (sw, rht)
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        return y.to(out_dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (xc,) = ctx.saved_tensors
        mod = ctx.mod
        plan = ctx.plan
        cfg = plan["configs"]
        sw, rht = ctx.scales
        dy2 = dy.detach().reshape(-1, dy.shape[-1]).float()
        w = mod._gemm_weight(mod.weight.detach())
        sdy = mod._scale("dy")
        sample = mod._sample_error or mod._sample_step
        cdy, cwd, cdc = cfg["dgrad.dy"], cfg["dgrad.w"], cfg["wgrad.dy"]
        dyq = dy2
        if cdy is not None:
            random_row = mod._random(dy2.numel()) if cdy["stochastic_rounding"] else None
            dyq, qdy = _quantize_operand(dy2, cdy, scale=sdy, random=random_row)
            mod._record("dy", qdy, sdy, dy2 if sample else None, dyq, cdy, "dgrad.dy")
        # dgrad: w along its output dimension (W does not change between a forward and its
        # backward), from the original or from the values fprop multiplied (re-quantized here).
        wsrc = w if plan["w_source"] == "original" else _quantize_operand(w, cfg["fprop.w"], scale=sw)[0]
        wc = wsrc
        if cwd is not None:
            wc, qwc = _quantize_operand(wsrc, cwd, scale=sw)
            if cfg["fprop.w"] is None:
                mod._record("w", qwc, sw, wsrc if sample else None, wc, cwd, "dgrad.w")
        dx = (dyq @ wc).to(ctx.x_dtype).reshape(ctx.x_shape)
        # wgrad: both operands along the batch; RHT on both or on neither.
        if cdc is None:
            dyc = dy2
        elif _same_values(cdy, cdc):
            dyc = dyq
        else:
            random_col = mod._random(dy2.numel()) if cdc["stochastic_rounding"] else None
            dyc, qdc = _quantize_operand(dy2, cdc, scale=sdy, rht=rht, random=random_col)
            if cdy is None:
                mod._record("dy", qdc, sdy, dy2 if sample else None, dyc, cdc, "wgrad.dy")
        dw = dyc.t() @ xc
        dw = (dw.t().contiguous() if mod.transposed else dw).to(ctx.w_dtype)
        db = dy2.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        mod._after_backward()
        return dx, dw, db, None


def _keep_called(module: torch.nn.Module, args: Any) -> None:
    """A no-op forward pre-hook (see LowPrecisionLinear.__init__)."""


class LowPrecisionLinear(torch.nn.Module):
    """An ``nn.Linear`` (or transformers ``Conv1D``) whose GEMMs run on quantized operands (see
    the module docstring). It holds the original module's parameters; fp8-delayed adds the
    buffers ``amax_history`` ([3, amax_history_len]: x, w, dy) and ``scale`` ([3]), and
    stochastic rounding the buffer ``sr_draws`` (the random streams drawn so far), all saved in
    ``state_dict``."""

    def __init__(self, linear: torch.nn.Module, options: Union[RecipeOptions, "_FilePlans"], name: str = "",
                 seed: int = 0):
        super().__init__()
        if not is_linear_like(linear):
            raise TypeError(f"{name or 'module'}: expected an nn.Linear or a transformers Conv1D, found "
                            f"{type(linear).__name__}")
        # transformers' Conv1D keeps its weight as [in, out] (y = x W + b): the GEMMs take Wᵀ, the
        # nn.Linear weight of the same function, and its gradient goes back transposed.
        self.transposed = not isinstance(linear, torch.nn.Linear)
        self.in_features, self.out_features = (tuple(linear.weight.shape) if self.transposed
                                               else (linear.in_features, linear.out_features))
        self.weight = linear.weight
        self.bias = linear.bias
        self.name = name
        if isinstance(options, _FilePlans):
            self._file: Optional[_FilePlans] = options
            self.plan = options.plan_at(name, 0)
            self._eval_plan = options.evaluation_plan(name)
            reachable = options.reachable(name)
        else:
            self._file = None
            self.plan = options.resolved().plan()
            self._eval_plan = None
            reachable = [self.plan]
        self._step = 0
        self._begun: Optional[tuple] = None  # the phases begun at the plan's step (low_precision_step)
        # The Linear's recipe as reported: the first quantized operand's over every plan it can
        # run (its entry, every phase, evaluation).
        self.options = next((RecipeOptions(**p["primary"]) for p in reachable if p["primary"] is not None), None)
        if self.options is None:
            raise ValueError(f"{name or 'LowPrecisionLinear'}: every operand stays in high precision in every plan of "
                             "the run (use no LowPrecisionLinear)")
        delayed = {json.dumps(r, sort_keys=True) for p in reachable for r in p["recipes"].values()
                   if r is not None and r["recipe"] == "fp8-delayed"}
        if len(delayed) > 1:
            raise ValueError(f"{name or 'LowPrecisionLinear'}: fp8-delayed with different options in different plans of "
                             "the run; its amax history is one per tensor: give every phase the same fp8-delayed options")
        self._delayed = RecipeOptions(**json.loads(delayed.pop())) if delayed else None
        self._seed = int(seed)
        self._sample_error = False  # measure the next forward and backward (sample_quantization_error)
        self._sample_step = False   # measure every call until cleared (Telemetry's sampled steps)
        self._what_if: Tuple[str, ...] = ()  # at those steps: Telemetry(what_if=...)'s recipes
        self._block_stats = False            # ... and the per-block statistics (Telemetry(block_stats=))
        self.stats = {r: _Stats() for r in _ROLES}
        if self._delayed is not None:
            self.register_buffer("amax_history", torch.zeros(3, self._delayed.amax_history_len, dtype=torch.float32))
            self.register_buffer("scale", torch.ones(3, dtype=torch.float32))
        if any(c is not None and c["stochastic_rounding"] for p in reachable for c in p["configs"].values()):
            # How many random streams stochastic rounding has drawn: saved in state_dict, so
            # that a resumed run draws the words the uninterrupted run would have drawn.
            self.register_buffer("sr_draws", torch.zeros((), dtype=torch.int64))
        # torch's TransformerEncoderLayer has an inference fast path (torch._transformer_encoder_layer_fwd)
        # that reads linear1's and linear2's weights and never calls them; it is not taken while a
        # submodule has a forward hook: this no-op one keeps the module called.
        self.register_forward_pre_hook(_keep_called)

    def _gemm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The [out, in] fp32 weight of the GEMMs."""
        w = weight.float()
        return w.t() if self.transposed else w

    def _active_plan(self) -> Dict[str, Any]:
        """The plan of this call: the recipe file's evaluation plan in eval mode, else the step's."""
        return self._eval_plan if (self._eval_plan is not None and not self.training) else self.plan

    def _scale(self, role: str) -> float:
        if self._delayed is None:
            return 1.0
        return float(self.scale[_ROLES.index(role)])

    def _record(self, role: str, q: Any, scale: float, exact: Optional[torch.Tensor], approx: torch.Tensor,
                cfg: Dict[str, Any], operand: str) -> None:
        delayed = cfg["recipe"] == "fp8-delayed"
        st = self.stats[role]
        st.take(q, scale if delayed else q.tensor_scale, exact, approx)
        st.recipe, st.element = cfg["recipe"], cfg["element"]
        if exact is not None and (self._block_stats or self._what_if):
            # The sampled statistics of this quantization, computed at record() (_Stats.settle),
            # from its source as it is now: the weight is copied, as optimizer.step() changes it in
            # place before record(); x stays as it is (a model cannot change an nn.Linear's input
            # in place before its backward, and does not after it), and dy is autograd's, handed
            # over once.
            src = exact.detach()
            src = src.clone(memory_format=torch.contiguous_format) if role == "w" else src.contiguous()
            st.pending = (q, src, operand, self._what_if, self._block_stats)
        if delayed and self.training:
            # TE's delayed scaling: this step's amax enters the history; the next step's scale
            # comes from it (fold, roll, update: the core's fp8 rules).
            i = _ROLES.index(role)
            hist = self.amax_history[i].numpy()
            new = _core.delayed_update(hist, float(q.counts["amax"]), self._delayed.amax_compute_algo,
                                       cfg["element"], self._delayed.margin, float(self.scale[i]))
            self.scale[i] = new

    def _random(self, n: int) -> np.ndarray:
        # Caller-supplied random words for stochastic rounding: a fixed stream per module.
        draws = int(self.sr_draws)
        if draws < 0:
            raise ValueError(f"{self.name or 'LowPrecisionLinear'}: sr_draws: expected an integer >= 0, found {draws} "
                             "(a state_dict edited by hand?)")
        rng = np.random.default_rng([self._seed, draws])
        self.sr_draws.fill_(draws + 1)
        return rng.integers(0, 2**32, n, dtype=np.uint32)

    def _after_backward(self) -> None:
        self._sample_error = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_nested:
            raise TypeError(f"{self.name or 'LowPrecisionLinear'}: expected a dense tensor, found a nested one "
                            "(the quantized GEMMs take [..., in_features] tensors)")
        with torch.autocast(device_type=x.device.type, enabled=False):
            return _LowPrecisionLinearFn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        conv1d = ", weight [in, out] (transformers Conv1D)" if self.transposed else ""
        p = self.plan
        if p["uniform"] is not None:
            what = f"recipe={p['uniform']['recipe']}"
        else:
            what = "operands=" + ", ".join(f"{o}:{(p['recipes'][o] or {'recipe': HIGH})['recipe']}" for o in OPERANDS)
            if p["x_source"] != "original" or p["w_source"] != "original":
                what += f", columnwise_source=x:{p['x_source']}/w:{p['w_source']}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{what}{conv1d}")


# ---- which modules ---------------------------------------------------------------------------

def _conv1d_class() -> Optional[type]:
    """transformers' Conv1D once transformers is loaded (a model holding one has loaded it),
    looked up without importing transformers (seconds)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def is_linear_like(module: Any) -> bool:
    """An ``nn.Linear`` (or a subclass), or transformers' ``Conv1D`` (GPT-2's layers: weight
    [in, out], y = x W + b, the Linear of weight Wᵀ): the modules low_precision can swap."""
    if isinstance(module, torch.nn.Linear):
        return True
    conv1d = _conv1d_class()
    return conv1d is not None and isinstance(module, conv1d)


def _linear_groups(model: torch.nn.Module) -> List[Tuple[torch.nn.Module, List[str]]]:
    """The linear-like modules in named_modules order, each once with every name it has (one
    object registered in two places, model.a is model.b, is one module with two names)."""
    groups: Dict[int, Tuple[torch.nn.Module, List[str]]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        if is_linear_like(m):
            groups.setdefault(id(m), (m, []))[1].append(n)
    return list(groups.values())


_MHA_OUT_PROJ = ("nn.MultiheadAttention reads out_proj.weight and out_proj.bias itself "
                 "(F.multi_head_attention_forward) and never calls out_proj, so a LowPrecisionLinear there "
                 "would never run")


def _not_swappable(model: torch.nn.Module, groups: List[Tuple[torch.nn.Module, List[str]]]) -> Dict[int, str]:
    """id(module) -> why a LowPrecisionLinear in its place would not compute what the model runs."""
    why: Dict[int, str] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention) and m.out_proj is not None:
            why[id(m.out_proj)] = _MHA_OUT_PROJ
    for m, names in groups:
        if id(m) in why:
            continue
        base = torch.nn.Linear if isinstance(m, torch.nn.Linear) else _conv1d_class()
        params = [m.weight] + ([] if m.bias is None else [m.bias])
        if "" in names:
            why[id(m)] = "it is the model itself (low_precision replaces submodules: wrap it, e.g. in nn.Sequential)"
        elif type(m).forward is not base.forward:
            why[id(m)] = (f"its class {type(m).__name__} has a forward of its own, which a LowPrecisionLinear "
                          "would not run")
        elif not all(isinstance(t, torch.nn.Parameter) for t in params):
            why[id(m)] = "its weight or bias is computed (a parametrization or weight_norm), not a parameter of its own"
        elif any(isinstance(t, torch.nn.parameter.UninitializedParameter) for t in params):
            why[id(m)] = "its weight is not initialized yet (a lazy module: run one forward first)"
        elif next(m.children(), None) is not None:
            why[id(m)] = "it holds submodules, which a LowPrecisionLinear would drop"
    return why


def _is_recipe_file(recipe: Any) -> bool:
    """A recipe name is always that recipe, whatever the working folder holds (a file called
    nvfp4 there changes nothing); a recipe file is an os.PathLike, or a str that ends in .json or
    holds a path separator ("./nvfp4")."""
    if isinstance(recipe, os.PathLike):
        return True
    if not isinstance(recipe, str) or recipe in RECIPES:
        return False
    return recipe.endswith(".json") or any(sep and sep in recipe for sep in (os.sep, os.altsep))


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def low_precision(model: torch.nn.Module, recipe: Any, *, modules: Any = None, seed: int = 0,
                  total_steps: Optional[int] = None, **options: Any) -> torch.nn.Module:
    """Swap chosen linear modules of ``model`` (in place) for ``LowPrecisionLinear``.

    The linear modules are ``nn.Linear`` and transformers' ``Conv1D`` (is_linear_like), but those
    a LowPrecisionLinear cannot stand in for (docs/low_precision.md): ``nn.MultiheadAttention``'s
    ``out_proj`` (the attention reads its weight and never calls it), classes with a forward of
    their own, computed (parametrized) weights, lazy or nested modules. A default or a predicate
    passes over those with a warning naming them; naming one is a ValueError.

    recipe   a recipe name (one of mixprec.RECIPES, or a TE zoo name of ZOO: a format per GEMM
             direction; always the recipe, never a file of that name) for every chosen module;
             or a mixed assignment: a dict {module name: recipe name | "bf16" | {"recipe": ...,
             options, per-direction fields}}, a whole recipe file as a dict (its "format" field
             set), or a recipe file (docs/low_precision.md): an os.PathLike, or a str ending in
             .json or holding a path separator; with an assignment ``modules`` must be None.
             A module the file switches in time (its "schedule") is swapped when any plan of the
             run quantizes it; low_precision_step(model, step) puts it on the step's plan.
    total_steps  the run's optimizer steps: needed when the schedule gives a phase as a
             fraction of the run (from_fraction).
    modules  with a recipe name: None (every linear module but the first and the last, in
             ``named_modules`` order, as the field keeps them in higher precision), a list of
             distinct module names (a str alone is refused), or a callable (name, module) -> bool.
    options  RecipeOptions fields: with a recipe name, for every chosen module (each must fit
             the recipe); with an assignment, shared options that reach the recipes having them.
    A module registered under several names is swapped everywhere by one LowPrecisionLinear and
    may be named by any one of them (naming two is an error). Returns the model. Unknown or
    non-linear module names, unknown recipes and options are errors (ValueError), raised before
    any module is swapped: a refused call leaves the model as it was.
    """
    unknown = sorted(set(options) - set(_OPTION_FIELDS))
    if unknown:
        raise ValueError(f"options: unknown {unknown}; expected some of {list(_OPTION_FIELDS)}")
    groups = _linear_groups(model)
    why = _not_swappable(model, groups)
    by_name = {n: m for m, names in groups for n in names}
    passed_over: List[str] = []  # not swappable, left out of a default or a predicate's choice: warned
    if _is_recipe_file(recipe):
        if modules is not None:
            raise ValueError("modules: a recipe file names its modules itself; pass modules=None")
        doc = load_assignment(recipe)
        if options:
            doc["options"] = {**doc.get("options", {}), **options}
        where = str(recipe)
    elif isinstance(recipe, Mapping):
        if modules is not None:
            raise ValueError("modules: a mixed assignment names its modules itself; pass modules=None")
        if "format" in recipe:  # a whole recipe file as a dict
            doc = dict(recipe)
            if options:
                doc["options"] = {**doc.get("options", {}), **options}
        else:
            doc = {"format": FILE_FORMAT, "version": FILE_VERSIONS[-1], "default": HIGH, "modules": dict(recipe)}
            if options:
                doc["options"] = dict(options)
        where = "assignment"
    elif isinstance(recipe, str):
        if recipe not in RECIPES and recipe not in ZOO:
            hint = (f" (a file of that name is in the working folder: give it as {os.path.join('.', recipe)!r})"
                    if os.path.exists(recipe) else "")
            raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}, a zoo name ({', '.join(ZOO)}), a dict "
                             f"or a recipe file path (ending in .json or holding a path separator), found {recipe!r}{hint}")
        if modules is None:
            swappable = [names[0] for m, names in groups if id(m) not in why]
            chosen = swappable[1:-1]
            passed_over = [names[0] for m, names in groups if id(m) in why]
        elif callable(modules):
            picked = [(m, names) for m, names in groups if any(modules(n, m) for n in names)]
            chosen = [names[0] for m, names in picked if id(m) not in why]
            passed_over = [names[0] for m, names in picked if id(m) in why]
        else:
            chosen = _args.module_names("modules", modules, "each module is swapped once")
        doc = {"format": FILE_FORMAT, "version": FILE_VERSIONS[-1], "default": HIGH,
               "modules": {n: {"recipe": recipe, **options} if options else recipe for n in chosen}}
        where = "recipe"
    else:
        raise ValueError(f"recipe: expected a recipe name, a dict or a recipe file path, found {type(recipe).__name__}")
    named_as: Dict[int, str] = {}
    for name in doc["modules"]:
        if name not in by_name:
            found = type(model.get_submodule(name)).__name__ if _has_module(model, name) else "no such module"
            raise ValueError(f"{where}: module {name!r}: expected an nn.Linear of the model, found {found}")
        first = named_as.setdefault(id(by_name[name]), name)
        if first != name:
            raise ValueError(f"{where}: modules {first!r} and {name!r} are one module (the same object registered "
                             "under both names): name it once")
    if total_steps is not None:
        total_steps = _args.integer("total_steps", total_steps, 1, 2**63 - 1)
    plans = _FilePlans(json.dumps(doc), total_steps, where)
    for i, ph in enumerate(plans.phases):
        for pat in ph["modules"]:
            if not any(plans.file.matches(pat, n) for n in by_name):
                raise ValueError(f"{where}: schedule[{i}].modules: {pat!r} matches no linear module of the model")

    def quantized(name: str) -> bool:
        return any(any(r is not None for r in p["recipes"].values()) for p in plans.reachable(name))

    chosen_names: List[str] = [n for n in doc["modules"] if quantized(n)]
    for name in chosen_names:
        if id(by_name[name]) in why:
            raise ValueError(f"{where}: module {name!r}: cannot run in low precision: {why[id(by_name[name])]}; "
                             "leave it out (it stays in higher precision)")
    for m, names in groups:
        if id(m) in named_as or not quantized(names[0]):
            continue
        if id(m) in why:
            passed_over.append(names[0])
        else:
            chosen_names.append(names[0])
    # Every replacement is built before the first is put in place: a refusal changes nothing.
    swaps = [(by_name[name], LowPrecisionLinear(by_name[name], plans, name, seed=seed * 1000003 + i))
             for i, name in enumerate(chosen_names)]
    all_names = {id(m): names for m, names in groups}
    for old, new in swaps:
        for name in all_names[id(old)]:
            _set_module(model, name, new)
    if swaps:
        # torch's TransformerEncoder runs its inference fast path on nested tensors, which the
        # quantized GEMMs do not take: off for the encoders holding a swapped module.
        for m in model.modules():
            if (isinstance(m, torch.nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False)
                    and any(isinstance(s, LowPrecisionLinear) for s in m.modules())):
                m.use_nested_tensor = False
    if passed_over:
        by_reason: Dict[str, List[str]] = {}
        for name in passed_over:
            by_reason.setdefault(why[id(by_name[name])], []).append(name)
        warnings.warn("low_precision: kept in higher precision, not swapped: " + "; ".join(
            f"{', '.join(repr(n) for n in names)}: {reason}" for reason, names in by_reason.items()), stacklevel=2)
    return model


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def low_precision_step(model: torch.nn.Module, step: int) -> List[Dict[str, Any]]:
    """Put every LowPrecisionLinear of ``model`` that a recipe file's schedule drives on the plan
    of optimizer step ``step`` (counted from 0, as the recipe file counts; call it before the
    step's first forward, and again after resuming). Returns the switches it made:
    [{"module": name, "phase": label}] (empty when nothing changed). Evaluation forwards
    (``model.eval()``) run the file's evaluation plan where it has one."""
    step = _args.integer("step", step, 0, 2**63 - 1)
    switched: List[Dict[str, Any]] = []
    for name, m in low_precision_modules(model).items():
        if m._file is None:
            continue
        # A plan changes only where a phase begins: the same phases begun, the same plan.
        begun = tuple(start <= step for start in m._file.starts)
        if begun == m._begun:
            m._step = step
            continue
        m._begun = begun
        new = m._file.plan_at(m.name, step)
        if new != m.plan:
            switched.append({"module": name, "phase": m._file.label_at(m.name, step)})
            m.plan = new
        m._step = step
    labels = list(dict.fromkeys(s["phase"] for s in switched if s["phase"]))
    if labels:
        # Telemetry's next record() marks the step in the run log ("recipe_phase").
        model._mixprec_recipe_phase = ", ".join(labels)
    return switched


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


def _sample_step(modules: Iterable["LowPrecisionLinear"], on: bool, what_if: Tuple[str, ...] = (),
                 block_stats: bool = True) -> None:
    """Telemetry's sampled steps: measure every quantization of the step (all micro-batches),
    with its per-block statistics (block_stats) and the what-ifs of the recipes `what_if` names."""
    for m in modules:
        m._sample_step = on
        m._what_if = tuple(what_if) if on else ()
        m._block_stats = on and block_stats


def _measured_tensors(modules: Mapping[str, "LowPrecisionLinear"]) -> List[tuple]:
    """The roles measured and not yet taken (_taken), as the telemetry recorder takes them: (name,
    role, recipe, element, scale, amax, elements, nonzero, saturated, flushed, rel_rms_error or None,
    block_stats dict or None, kurtosis or None, what-ifs)."""
    out = []
    for name, m in modules.items():
        for role in _ROLES:
            st = m.stats[role]
            if not st.measured:
                continue
            st.settle()
            suffix, direction = _ROLE_TENSOR[role]
            err = st.rel_rms_error if st.rel_rms_error is not None and np.isfinite(st.rel_rms_error) else None
            out.append((f"{name}.{suffix}", direction, st.recipe, st.element, float(st.scale),
                        float(st.amax), st.elements, st.nonzero, st.saturated, st.flushed, err, st.blocks,
                        st.kurtosis, st.what_if))
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
