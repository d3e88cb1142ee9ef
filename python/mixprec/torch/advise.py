"""mixprec.torch.advise: the precision advisor for any PyTorch model (docs/advisor.md).

    advice = mixprec.torch.advise(model, step_fn, steps=8, budget=0.1, out="recipe.json")
    print(advice.table())                     # layer, shape, choice, cost against bf16, errors
    advice.assignment                         # {"blocks.0.qkv": "nvfp4", "head": "bf16", ...}
    mixprec.torch.low_precision(model, "recipe.json")   # train with the assignment

    # Per GEMM direction and in time: a forward and a backward recipe per layer, and fprop
    # switched to bf16 for the last 20% of the run where the forward is fp4.
    advice = mixprec.torch.advise(model, step_fn, steps=8, directions_out="recipe-directions.json")
    advice.directions                         # {"blocks.0.qkv": {"forward": "nvfp4", "backward": "mxfp8", ...}}
    mixprec.torch.low_precision(model, "recipe-directions.json", total_steps=N)  # low_precision_step each step

``step_fn()`` runs one real training step (forward, backward, optimizer step) of your loop.
While it runs, hooks on every watched linear layer (``nn.Linear``, transformers ``Conv1D``)
keep its input x, its weight w, the gradient of its output dy and its weight gradient dW (of x
and dy at most ``max_rows`` evenly spaced rows): x and dy by reference, w and dW as copies;
after the steps they become float32 copies, gradients divided by the loss scale of their step
(and, under per-layer loss scaling, by the layer's own factors: every sample is the true
value). The measurement (each candidate quantized by the C++ core's own kernels), the cost
model and the choice are the core's (``mixprec::monitor::advisor``, the code behind ``mixprec
advise RUN_DIR`` too); this module only collects the tensors and hands them over.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _core
from . import layerwise as _layerwise
from .low_precision import is_linear_like

#: The candidates, in the core's table order.
CANDIDATES: Tuple[str, ...] = tuple(_core.advise_candidates())
_ROLES = ("x", "w", "dy", "dw")

Sample = Tuple[str, str, int, float, int, np.ndarray]


def _linear_like(m: torch.nn.Module) -> bool:
    """nn.Linear, transformers' Conv1D, or a module that stands for one (mixprec.torch.low_precision's
    Linear)."""
    if is_linear_like(m):
        return True
    w = getattr(m, "weight", None)
    return (isinstance(w, torch.nn.Parameter) and w.dim() == 2 and hasattr(m, "in_features")
            and hasattr(m, "out_features"))


def _weight_in_out(m: torch.nn.Module) -> bool:
    """The weight is stored [in, out] (transformers' Conv1D, y = x W + b, and a low_precision
    Linear made from one): its samples are transposed to the [out, in] of the others."""
    if isinstance(m, torch.nn.Linear):
        return False
    if is_linear_like(m):
        return True
    return getattr(m, "transposed", False) is True


def watched_modules(model: torch.nn.Module, modules: Any = None) -> List[Tuple[str, torch.nn.Module]]:
    """The linear layers to watch: None = every nn.Linear and transformers Conv1D of the model
    (named_modules order), a list of names, or a predicate (name, module) -> bool over the
    linear layers."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, found {type(model).__name__}")
    linears = [(n, m) for n, m in model.named_modules() if n and _linear_like(m)]
    if modules is None:
        chosen = linears
    elif callable(modules):
        chosen = [(n, m) for n, m in linears if modules(n, m)]
    elif isinstance(modules, Iterable) and not isinstance(modules, (str, bytes)):
        known = dict(model.named_modules())
        chosen = []
        for n in modules:
            if n not in known:
                raise ValueError(f"modules: {n!r} is not a module of the model")
            if not _linear_like(known[n]):
                raise ValueError(f"modules: {n!r} is a {type(known[n]).__name__}; expected an nn.Linear or a "
                                 "transformers Conv1D")
            chosen.append((n, known[n]))
    else:
        raise TypeError(f"modules: expected None, a list of names or a predicate, found {type(modules).__name__}")
    if not chosen:
        raise ValueError("modules: no linear layer of the model was selected")
    return chosen


def _rows(t: torch.Tensor, max_rows: int) -> Tuple[torch.Tensor, int]:
    """t as [rows, cols], at most max_rows evenly spaced rows of it: a view where torch can make
    one (no copy), detached from the graph."""
    t2 = t.detach().reshape(-1, t.shape[-1])
    total = t2.shape[0]
    if total > max_rows:
        t2 = t2[:: -(-total // max_rows)]
    return t2, total


#: A sample held by reference until it is handed over: (layer, role, step, loss_scale,
#: rows_total, tensor, the tensor's version when it was sampled).
Held = Tuple[str, str, int, float, int, torch.Tensor, int]


def _modified(name: str, role: str, step: int, version: int, now: int) -> str:
    return (f"advisor sample {name}.{role} of step {step}: the tensor was modified in place after it was sampled "
            f"(version {version}, now {now}); the sampler holds x and dy by reference until they are converted "
            f"(take(), or after the steps in advise())")


def to_arrays(held: Iterable[Held]) -> List[Sample]:
    """Held samples as the core takes them: float32 NumPy arrays on the CPU, gradients (dy, dw)
    divided by their step's loss scale. A tensor written in place after it was sampled is
    refused (its values are no longer the step's)."""
    out = []
    for name, role, step, loss_scale, total, t, version in held:
        if t._version != version:
            raise RuntimeError(_modified(name, role, step, version, t._version))
        values = t.to(device="cpu", dtype=torch.float32, copy=True).contiguous()
        if role in ("dy", "dw") and loss_scale != 1.0:
            values.div_(float(loss_scale))
        out.append((name, role, int(step), float(loss_scale), int(total), values.numpy()))
    return out


class Sampler:
    """Hooks that keep the tensors of the watched linear layers while ``active`` (docs/advisor.md,
    "What is sampled"): x and dy by reference (views: not copied during the step); the weight,
    dW and an x that autograd did not produce (an input batch a loop may refill) as copies.
    ``take(step, loss_scale)`` returns what was kept since the last take as float32 arrays, the
    gradients divided by loss_scale, as (layer, role, step, loss_scale, rows_total, values);
    ``take_held`` the same without converting (``to_arrays`` converts later). Under a layerwise
    GradScaler (watch()), dy and dW carry no layer factor: dy is divided by the chain its layer
    gave it, dW is read where the layer's hook hands it to .grad (at the base scale)."""

    def __init__(self, model: torch.nn.Module, modules: Any = None, *, max_rows: int = 4096) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows: expected an int >= 1, found {max_rows!r}")
        self._watched = watched_modules(model, modules)
        self.max_rows = max_rows
        self.active = False
        self._pending: List[Tuple[str, str, int, torch.Tensor, int]] = []
        self._seen: set = set()  # since the last take: layers whose forward and (layer, "dw") whose dW was taken
        self._handles = []
        self._weight_hooked: set = set()  # id of each weight with a gradient hook (frozen ones have none)
        ref = weakref.ref(self)
        for name, m in self._watched:
            self._handles.append(m.register_forward_hook(Sampler._forward_hook(ref, name)))
            self._hook_weight(name, m)
            _layerwise.add_weight_grad_reader(m, id(self), Sampler._layerwise_dw(ref, name, weakref.ref(m)))

    @property
    def layers(self) -> List[str]:
        return [n for n, _ in self._watched]

    def _hook_weight(self, name: str, m: torch.nn.Module) -> None:
        # A frozen weight (requires_grad=False) takes no hook and has no dW; it gets one once trainable.
        w = m.weight
        if w.requires_grad and id(w) not in self._weight_hooked:
            self._handles.append(w.register_hook(Sampler._grad_hook(weakref.ref(self), name, "dw", weakref.ref(m))))
            self._weight_hooked.add(id(w))

    def _keep(self, name: str, role: str, t: torch.Tensor, carried: float = 1.0) -> None:
        # x and dy may be subsampled by rows (tokens); w and dW are kept whole (their shape is
        # the layer's, and 2-D tiles need every row). Copied: the weight (the optimizer's step
        # writes it), dW (autograd may hand this very tensor to .grad, where a scaler unscales
        # it in place), an x autograd did not produce (a buffer the loop may refill) and
        # subsampled rows (their view would keep the whole tensor alive).
        values, total = _rows(t, self.max_rows if role in ("x", "dy") else t.shape[0])
        if carried != 1.0:
            # A gradient that carries a layer's factors above the loss scale (per-layer scaling):
            # divided out now, in float32 (exact: a power of two, and nothing underflows).
            values = values.to(torch.float32) * (1.0 / carried)
        elif role in ("w", "dw") or (role == "x" and t.grad_fn is None) or values.shape[0] < total:
            values = values.clone()
        self._pending.append((name, role, total, values, values._version))

    def _keep_dw(self, name: str, module: torch.nn.Module, grad: torch.Tensor) -> None:
        if (name, "dw") in self._seen:  # the first backward's (dy is taken from the first forward's output)
            return
        self._seen.add((name, "dw"))
        self._keep(name, "dw", grad.t() if _weight_in_out(module) else grad)

    @staticmethod
    def _forward_hook(ref: "weakref.ref[Sampler]", name: str):
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            s = ref()
            # One forward per layer and step: the first micro-batch's (a recomputed forward of
            # activation checkpointing, a second micro-batch or a second call are not taken).
            if s is None or not s.active or not torch.is_grad_enabled() or name in s._seen:
                return
            s._seen.add(name)
            s._hook_weight(name, module)
            if inputs and isinstance(inputs[0], torch.Tensor):
                s._keep(name, "x", inputs[0])
            s._keep(name, "w", module.weight.t() if _weight_in_out(module) else module.weight)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(Sampler._grad_hook(ref, name, "dy", weakref.ref(module)))
        return hook

    @staticmethod
    def _grad_hook(ref: "weakref.ref[Sampler]", name: str, role: str, mref: Any):
        def hook(grad: torch.Tensor) -> None:
            s = ref()
            module = mref()
            if s is None or not s.active or module is None:
                return
            if role == "dw":
                if _layerwise.watched_layer(module) is None:  # else the layer's own hook hands it over
                    s._keep_dw(name, module, grad)
                return
            # dy, read after the layer's pre-hook: it carries the layer's chain of this pass.
            s._keep(name, role, grad, _layerwise.gradient_factor(module))
        return hook

    @staticmethod
    def _layerwise_dw(ref: "weakref.ref[Sampler]", name: str, mref: Any):
        def read(grad: torch.Tensor) -> None:
            s = ref()
            module = mref()
            if s is not None and s.active and module is not None:
                s._keep_dw(name, module, grad)
        return read

    def take(self, step: int, loss_scale: float = 1.0) -> List[Sample]:
        """The samples kept since the last take as float32 arrays, gradients unscaled by loss_scale."""
        return to_arrays(self.take_held(step, loss_scale))

    def take_held(self, step: int, loss_scale: float = 1.0) -> List[Held]:
        """The samples kept since the last take, still held by reference (to_arrays converts);
        those on a device are copied to the CPU here, so that no device memory outlives the step."""
        if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale: expected a finite number > 0, found {loss_scale!r}")
        out = []
        for name, role, total, t, version in self._pending:
            if not t.is_cpu:
                if t._version != version:
                    raise RuntimeError(_modified(name, role, step, version, t._version))
                t = t.to("cpu")
                version = t._version
            out.append((name, role, int(step), float(loss_scale), int(total), t, version))
        self._pending = []
        self._seen = set()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._weight_hooked = set()
        for _, m in self._watched:
            _layerwise.remove_weight_grad_reader(m, id(self))
        self.active = False


class Advice:
    """What the advisor chose and every measurement behind it (the core's Advice).

    assignment  {layer: candidate name, or None where no candidate was within the budget or a
                required role was not measured}
    recipe      the recipe file (a dict) that mixprec.torch.low_precision reads
    layers      per layer: tokens, in, out, chosen, reason, rejected, not_measured (roles whose
                samples held no finite value), unmeasured_samples ({role: samples left out for
                holding no finite value}), directions and late_forward_switch (below), gemm_cost
                ({candidate: {fprop, dgrad, wgrad}}: the cost per GEMM), and per candidate its
                cost and per measured role
                rel_rms_error, worst_rel_rms_error, saturated, flushed, headroom_log2, amax,
                elements, nonzero, nonfinite (inf/NaN values left out), samples
    not_measured  {layer: [roles]} for the layers with a role not measured
    cost_ratio  modeled cost of the assignment / all-bf16
    directions  {layer: {forward, backward, cost_forward, cost_backward, saving, reason,
                rejected}}: per layer the forward candidate (fprop) and the backward one (dgrad,
                wgrad), the single choice in both where no split is cheaper; forward and
                backward None where there is no proposal (docs/advisor.md, "Per GEMM direction
                and in time")
    late_forward_switch  {layer: {from_fraction, extra_cost, reason}} for the layers whose
                forward the advisor switches to bf16 late in the run
    directional_recipe  the recipe file of the directional proposal (a dict), with the late
                switch as a schedule phase: low_precision(model, FILE, total_steps=N) runs it
    cost_ratio_directional  modeled cost of the directional proposal / all-bf16
    """

    def __init__(self, core: Any) -> None:
        self._core = core
        self.data: Dict[str, Any] = json.loads(core.json())

    @property
    def layers(self) -> List[Dict[str, Any]]:
        return self.data["layers"]

    @property
    def assignment(self) -> Dict[str, Optional[str]]:
        return {l["layer"]: l["chosen"] for l in self.data["layers"]}

    @property
    def not_measured(self) -> Dict[str, List[str]]:
        return {l["layer"]: list(l["not_measured"]) for l in self.data["layers"] if l.get("not_measured")}

    @property
    def recipe(self) -> Dict[str, Any]:
        return json.loads(self._core.recipe_file())

    @property
    def cost_ratio(self) -> float:
        d = self.data
        return d["cost_chosen"] / d["cost_bf16"] if d["cost_bf16"] > 0 else 1.0

    @property
    def directions(self) -> Dict[str, Dict[str, Any]]:
        return {l["layer"]: l["directions"] for l in self.data["layers"]}

    @property
    def late_forward_switch(self) -> Dict[str, Dict[str, Any]]:
        return {l["layer"]: l["late_forward_switch"] for l in self.data["layers"] if l.get("late_forward_switch")}

    @property
    def directional_recipe(self) -> Dict[str, Any]:
        return json.loads(self._core.directional_recipe_file())

    @property
    def cost_ratio_directional(self) -> float:
        d = self.data
        return d["cost_directional"] / d["cost_bf16"] if d["cost_bf16"] > 0 else 1.0

    def table(self) -> str:
        return self._core.table()

    def json(self) -> str:
        return self._core.json()

    def save(self, path: Union[None, str, os.PathLike], evidence: Union[None, str, os.PathLike] = None,
             directions: Union[None, str, os.PathLike] = None) -> None:
        """Writes the recipe file to ``path``, the evidence (advice.json, what `mixprec report`
        shows) to ``evidence`` and the recipe file of the directional proposal to
        ``directions``, each when given (a temporary file renamed over it)."""
        check_outputs(path, evidence, directions)
        core = self._core
        for p, make in ((path, lambda: core.recipe_file()), (evidence, lambda: core.json()),
                        (directions, lambda: core.directional_recipe_file())):
            if p is None:
                continue
            text = make()
            tmp = f"{os.fspath(p)}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, p)

    def __repr__(self) -> str:
        return f"Advice({len(self.layers)} layers, cost {self.cost_ratio:.3g}x all-bf16, {self.assignment})"


def check_outputs(out: Union[None, str, os.PathLike], evidence: Union[None, str, os.PathLike] = None,
                  directions_out: Union[None, str, os.PathLike] = None) -> None:
    """The outputs of advise()/save() checked before anything runs: a refused ``out`` after the
    sampled steps would lose them. ValueError naming the argument and the rule."""
    for what, p in (("out", out), ("evidence", evidence), ("directions_out", directions_out)):
        if p is None:
            continue
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"{what}: expected a file path (str or os.PathLike), found {type(p).__name__}")
        p = os.fspath(p)
        parent = os.path.dirname(p) or "."
        if not os.path.isdir(parent):
            raise ValueError(f"{what}: {p!r}: its folder {parent!r} does not exist")
        problem = _core.output_file_problem(p)  # the CLI's rule: a FIFO, a folder, a link refused
        if problem:
            raise ValueError(f"{what}: {problem}")
    if out is not None and evidence is not None and os.path.abspath(os.fspath(out)) == os.path.abspath(os.fspath(evidence)):
        raise ValueError(f"evidence: {os.fspath(evidence)!r} is also out; give the recipe file and the evidence two names")
    for what, other in (("out", out), ("evidence", evidence)):
        if (directions_out is not None and other is not None
                and os.path.abspath(os.fspath(directions_out)) == os.path.abspath(os.fspath(other))):
            raise ValueError(f"directions_out: {os.fspath(directions_out)!r} is also {what}; give each file its own name")


def config_json(candidates: Optional[Sequence[str]] = None, budget: Any = None, cost: Optional[Mapping[str, Any]] = None,
                amax_history_len: Optional[int] = None, margin: Optional[int] = None,
                directions: Optional[bool] = None, late_forward_switch: Optional[Mapping[str, Any]] = None) -> str:
    """The advisor's configuration as the JSON the core parses (and checks: ValueError naming the
    field). budget: a number (every role's relative RMS error bound) or a dict (x, w, dy, dw,
    max_rel_rms_error, max_saturated, max_flushed, roles); cost: {bandwidth_gbs, activation_bits,
    candidates: {name: {tflops, element_bits, scale_bits, weight_scale_bits, amax_pass,
    quantized}}}; directions: True / False; late_forward_switch: {from_fraction, when
    ("fp4", "always", "never", "budget_share"), budget_share}."""
    cfg: Dict[str, Any] = {}
    if candidates is not None:
        if isinstance(candidates, str):
            raise ValueError(f"candidates: expected a list of names, found the string {candidates!r}")
        cfg["candidates"] = list(candidates)
    if budget is not None:
        cfg["budget"] = dict(budget) if isinstance(budget, Mapping) else budget
    if cost is not None:
        cfg["cost"] = dict(cost)
    if amax_history_len is not None:
        cfg["amax_history_len"] = amax_history_len
    if margin is not None:
        cfg["margin"] = margin
    if directions is not None:
        cfg["directions"] = directions
    if late_forward_switch is not None:
        cfg["late_forward_switch"] = (dict(late_forward_switch) if isinstance(late_forward_switch, Mapping)
                                      else late_forward_switch)
    try:
        text = json.dumps(cfg, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"advisor configuration: {e}") from None
    _core.advise([], text)  # the core checks it now, before any step runs
    return text


def _scale_of(scaler: Any, loss_scale: Optional[float]) -> float:
    if scaler is not None:
        if not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())
    return 1.0 if loss_scale is None else float(loss_scale)


def advise(model: torch.nn.Module, step_fn: Callable[[], Any], steps: int = 1, *,
           candidates: Optional[Sequence[str]] = None, budget: Any = None, cost: Optional[Mapping[str, Any]] = None,
           modules: Any = None, every: int = 1, max_rows: int = 4096, scaler: Any = None,
           loss_scale: Optional[float] = None, out: Union[None, str, os.PathLike] = None,
           evidence: Union[None, str, os.PathLike] = None, amax_history_len: Optional[int] = None,
           margin: Optional[int] = None, directions: Optional[bool] = None,
           late_forward_switch: Optional[Mapping[str, Any]] = None,
           directions_out: Union[None, str, os.PathLike] = None) -> Advice:
    """Run ``steps`` real steps of ``step_fn()``, sampling every ``every``-th, and choose per
    linear layer the cheapest candidate within ``budget``.

    candidates  names from CANDIDATES (default: all): bf16, fp16 (at the run's loss scale),
                fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4
    budget      the bound (docs/advisor.md, "Budget"): a number (relative RMS error, every role)
                or a dict; default: x 0.1, w 0.125, dy 0.1, saturated <= 10%, flushed <= 25%
    cost        overrides of the cost model (docs/advisor.md, "Cost model")
    modules     which linear layers (default every nn.Linear); see watched_modules
    scaler      the loop's GradScaler (mixprec's or torch's): the loss scale of each step is
                read from it (gradients are unscaled by it; fp16 is measured at it); or give
                ``loss_scale`` (a number) for a static scale
    out         where to write the recipe file; ``evidence``: where to write advice.json
    directions  per layer a forward and a backward candidate besides the single choice (default
                True; docs/advisor.md, "Per GEMM direction and in time")
    late_forward_switch  {from_fraction (default 0.8), when ("fp4" default, "always", "never",
                "budget_share"), budget_share (0.5)}: which forwards switch to bf16 late in the run
    directions_out  where to write the recipe file of the directional proposal (a recipe per
                GEMM direction, the late switch as a schedule phase)
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn: expected a callable running one training step, found {type(step_fn).__name__}")
    for what, v in (("steps", steps), ("every", every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what}: expected an int >= 1, found {v!r}")
    if scaler is not None and loss_scale is not None:
        raise ValueError("loss_scale: give the scaler or a static loss_scale, not both")
    if scaler is not None and not (hasattr(scaler, "get_scale") and hasattr(scaler, "is_enabled")):
        raise TypeError(f"scaler: expected a GradScaler (get_scale, is_enabled), found {type(scaler).__name__}")
    if loss_scale is not None and not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale)
                                       and loss_scale > 0):
        raise ValueError(f"loss_scale: expected a finite number > 0, found {loss_scale!r}")
    cfg = config_json(candidates, budget, cost, amax_history_len, margin, directions, late_forward_switch)
    check_outputs(out, evidence, directions_out)  # before the steps: they are not run again for a bad path
    sampler = Sampler(model, modules, max_rows=max_rows)
    held: List[Held] = []
    try:
        for i in range(steps):
            sampled = i % every == 0
            scale = _scale_of(scaler, loss_scale)
            sampler.active = sampled
            step_fn()
            sampler.active = False
            if sampled:
                held.extend(sampler.take_held(i + 1, scale))
    finally:
        sampler.remove()
    # Converted after the steps, with the measurement: the sampled steps only kept references.
    samples = to_arrays(held)
    del held
    result = Advice(_core.advise(samples, cfg))
    result.save(out, evidence, directions_out)
    return result


def advise_run(run_dir: Union[str, os.PathLike], *, candidates: Optional[Sequence[str]] = None, budget: Any = None,
               cost: Optional[Mapping[str, Any]] = None, amax_history_len: Optional[int] = None,
               margin: Optional[int] = None, directions: Optional[bool] = None,
               late_forward_switch: Optional[Mapping[str, Any]] = None) -> Advice:
    """The advisor over the samples a run folder holds (what `mixprec advise RUN_DIR` does)."""
    cfg = config_json(candidates, budget, cost, amax_history_len, margin, directions, late_forward_switch)
    return Advice(_core.advise_run(os.fspath(run_dir), cfg))


def write_samples(run_dir: Union[str, os.PathLike], step: int, loss_scale: float, samples: List[Sample]) -> None:
    """Writes one step's samples into a run folder (docs/run_folder.md, "Advisor samples")."""
    _core.advise_write_samples(os.fspath(run_dir), int(step), float(loss_scale), samples)
