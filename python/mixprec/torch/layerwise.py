"""Per-layer loss scaling for PyTorch models: the backward hooks of preset "layerwise".

    scaler = mixprec.torch.GradScaler("cpu", preset="layerwise")
    scaler.watch(model)                       # its nn.Linear modules (not those sharing weights)
    ... the usual loop: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()

The rule and every decision are the core's (mixprec::LayerwiseScales, docs/loss_scaling.md,
"Per-layer loss scaling"); this file moves tensors:

- a full backward pre-hook on each watched Linear multiplies its output gradient g by the
  layer's factor s (a power of two, from the moments of g, read in place by the core, and of
  the weight), so that its input gradient and its weight gradient are computed at S0 * chain * s;
- a hook on the layer's weight and bias multiplies their gradient (this backward pass's
  contribution, before it is accumulated into .grad) by 1 / (chain * s): .grad carries the
  base scale S0 only, as with one scale, and accumulation windows work unchanged;
- a full backward hook returns the layer's input gradient to S0 (in its own dtype), unless a
  link (found once, on the first step after watch()) says that it flows only into another
  watched layer's output through scale-transparent ops (GELU, attention, views): then the
  gradient keeps chain * s, and the next layer starts its chain there. A branch of the graph
  thus joins the others at the base scale, exactly (powers of two).
- before the scaler's check: a watched layer whose gradients hold inf/NaN while its incoming
  gradient was finite started the overflow (it backs off); when one did, every parameter whose
  gradient holds inf/NaN is skipped (its .grad set to None: torch's optimizers leave such a
  parameter, and its state, untouched) and the rest steps.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch

from .. import _core

_MAX_LINK_NODES = 512  # a link's path is short (GELU, attention and its views); longer ones are not followed


class _Layer:
    __slots__ = ("name", "module", "index", "params", "feeds", "entry_chain", "chain", "in_node", "out_node",
                 "w_version", "w_moments")

    def __init__(self, name: str, module: torch.nn.Linear, index: int) -> None:
        self.name = name
        self.module = module
        self.index = index
        self.params = [p for p in (module.weight, module.bias) if p is not None]
        self.feeds: Optional[_Layer] = None  # the watched layer its input gradient flows into, if linked
        self.entry_chain = 1.0  # the chain its incoming gradient carries this pass (set by the feeding layer)
        self.chain = 1.0        # chain * factor of this pass: what its weight gradient carries above S0
        self.in_node: Any = None
        self.out_node: Any = None
        self.w_version = -1
        self.w_moments: Any = None


def _select(model: torch.nn.Module, modules: Any) -> List[Tuple[str, torch.nn.Linear]]:
    named = [(n, m) for n, m in model.named_modules()]
    if modules is None:
        chosen = [(n, m) for n, m in named if isinstance(m, torch.nn.Linear)]
    elif callable(modules):
        chosen = [(n, m) for n, m in named if modules(n, m)]
    else:
        known = dict(named)
        wanted = list(modules)
        for w in wanted:
            if w not in known:
                raise ValueError(f"watch: {w!r} is not a module of the model")
        chosen = [(w, known[w]) for w in wanted]
    for n, m in chosen:
        if not isinstance(m, torch.nn.Linear):
            raise TypeError(f"watch: module {n!r} is a {type(m).__name__}; per-layer scaling watches "
                            "torch.nn.Linear modules")
    # A weight another module also uses (a tied LM head) takes gradients at two scales: such a
    # module stays at the base scale.
    uses: Dict[int, int] = {}
    for _, m in named:
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    return [(n, m) for n, m in chosen if all(uses.get(id(p), 0) == 1 for p in m.parameters(recurse=False))]


# The live hooks, so that their cached core objects (weight moments) and autograd nodes can be
# dropped at exit: a layer is reachable from its model's hooks, a cycle that the interpreter
# may collect only after nanobind's leak check, which then reports them as leaked.
_LIVE: "weakref.WeakSet[LayerwiseHooks]" = weakref.WeakSet()


@atexit.register
def _drop_core_objects() -> None:
    for hooks in list(_LIVE):
        for layer in hooks.layers:
            layer.w_moments = None
            layer.in_node = layer.out_node = None


class LayerwiseHooks:
    """The hooks of one watched model (GradScaler.watch makes it; GradScaler drives it)."""

    def __init__(self, scaler: Any, model: torch.nn.Module, modules: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch: expected a torch.nn.Module, found {type(model).__name__}")
        self._scaler = weakref.ref(scaler)
        self._model = model
        core = scaler._p.layerwise
        self.layers: List[_Layer] = []
        for name, m in _select(model, modules):
            self.layers.append(_Layer(name, m, core.add_layer(name, int(m.out_features))))
        self._by_out: Dict[Any, _Layer] = {}
        self._need_links = True
        self._handles: List[Any] = []
        ref = weakref.ref(self)
        _LIVE.add(self)
        for layer in self.layers:
            m = layer.module
            self._handles.append(m.register_forward_hook(self._forward_hook(ref, layer)))
            self._handles.append(m.register_full_backward_pre_hook(self._pre_hook(ref, layer)))
            self._handles.append(m.register_full_backward_hook(self._post_hook(ref, layer)))
            for p in layer.params:
                self._handles.append(p.register_hook(self._param_hook(layer)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def relink(self) -> None:
        """Find the links again on the next step (after the model's graph changed)."""
        self._need_links = True
        for layer in self.layers:
            layer.feeds = None

    # ---- forward: where each layer's input comes from (link steps only) ----------------------

    @staticmethod
    def _forward_hook(ref: "weakref.ref[LayerwiseHooks]", layer: _Layer):
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            self = ref()
            if self is None or not self._need_links or not torch.is_grad_enabled():
                return
            x = inputs[0] if inputs else None
            layer.in_node = x.grad_fn if isinstance(x, torch.Tensor) and x.requires_grad else None
            layer.out_node = output.grad_fn if isinstance(output, torch.Tensor) else None
        return hook

    def link(self, loss: Any) -> None:
        """Called by GradScaler.scale(loss) on the link step: which layer's input gradient flows
        only into which other watched layer's output gradient."""
        if not self._need_links:
            return
        roots = [t.grad_fn for t in _tensors(loss) if t.grad_fn is not None]
        if not roots or all(layer.out_node is None for layer in self.layers):
            return  # no graph recorded yet (a forward without grad): try on the next step
        consumers: Dict[Any, int] = {}  # node -> edges that point at it
        seen: Set[Any] = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            for nxt, _ in n.next_functions:
                if nxt is not None:
                    consumers[nxt] = consumers.get(nxt, 0) + 1
                    stack.append(nxt)
        by_out = {layer.out_node: layer for layer in self.layers if layer.out_node is not None}
        for layer in self.layers:
            layer.feeds = self._find_link(layer, by_out, consumers)
            layer.in_node = layer.out_node = None  # the graph goes with the step
        self._need_links = False

    @staticmethod
    def _find_link(layer: _Layer, by_out: Dict[Any, _Layer], consumers: Dict[Any, int]) -> Optional[_Layer]:
        start = layer.in_node
        if start is None or consumers.get(start, 0) != 1:
            return None  # an input without gradient, or one something else reads too
        found: Set[int] = set()
        target: Optional[_Layer] = None
        visited: Set[Any] = set()
        stack = [start]
        while stack:
            n = stack.pop()
            if n in visited:
                continue
            visited.add(n)
            if len(visited) > _MAX_LINK_NODES:
                return None
            if n in by_out:
                target = by_out[n]
                found.add(id(target))
                continue
            if hasattr(n, "variable"):
                return None  # a leaf (a parameter, an input) would take the chain's scale
            for nxt, _ in n.next_functions:
                if nxt is not None:
                    stack.append(nxt)
        if len(found) != 1 or target is None or target is layer:
            return None
        # Nothing outside the path reads what the path carries: each node's consumers are on it.
        counted: Dict[Any, int] = {}
        for n in visited:
            if n in by_out:
                continue
            for nxt, _ in n.next_functions:
                if nxt is not None:
                    counted[nxt] = counted.get(nxt, 0) + 1
        for n in visited:
            if n is start:
                continue
            if counted.get(n, 0) != consumers.get(n, 0):
                return None
        return target

    # ---- backward --------------------------------------------------------------------------

    def _weight_moments(self, layer: _Layer) -> Any:
        w = layer.module.weight
        v = w._version
        if layer.w_moments is None or layer.w_version != v:
            layer.w_moments = _core.tensor_moments(_readable(w), "the weight of " + layer.name)
            layer.w_version = v
        return layer.w_moments

    @staticmethod
    def _pre_hook(ref: "weakref.ref[LayerwiseHooks]", layer: _Layer):
        def hook(module: torch.nn.Module, grad_output: Tuple[Optional[torch.Tensor], ...]):
            self = ref()
            scaler = None if self is None else self._scaler()
            g = grad_output[0] if grad_output else None
            if scaler is None or g is None or not scaler._p.enabled:
                return None
            chain = layer.entry_chain
            layer.entry_chain = 1.0
            core = scaler._p.layerwise
            if core is None:
                return None
            f = core.decide(layer.index, _readable(g), self._weight_moments(layer), chain)
            layer.chain = chain * f
            if f == 1.0:
                return None
            return (g * f,) + tuple(grad_output[1:])
        return hook

    @staticmethod
    def _post_hook(ref: "weakref.ref[LayerwiseHooks]", layer: _Layer):
        def hook(module: torch.nn.Module, grad_input: Tuple[Optional[torch.Tensor], ...], grad_output: Any):
            c = layer.chain
            if layer.feeds is not None:
                layer.feeds.entry_chain = c  # the gradient goes on, at its chain, into that layer
                return None
            if c == 1.0:
                return None
            inv = 1.0 / c
            return tuple(None if gi is None else gi * inv for gi in grad_input)
        return hook

    @staticmethod
    def _param_hook(layer: _Layer):
        def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
            c = layer.chain
            return None if c == 1.0 else grad * (1.0 / c)
        return hook

    # ---- the step ----------------------------------------------------------------------------

    def finish(self) -> List[str]:
        """Before the scaler's check: each layer's outcome; when a layer started an overflow,
        every parameter of the model whose gradient holds inf/NaN loses its .grad (skipped).
        Returns the names of the skipped layers."""
        scaler = self._scaler()
        core = None if scaler is None else scaler._p.layerwise
        if core is None:
            return []
        finite: Dict[int, bool] = {}

        def ok(p: torch.Tensor) -> bool:
            if id(p) not in finite:
                finite[id(p)] = p.grad is None or bool(torch.isfinite(p.grad).all())
            return finite[id(p)]

        skipped: List[_Layer] = []
        for layer in self.layers:
            outcome = core.finish_layer(layer.index, all(ok(p) for p in layer.params))
            if outcome != "applied":
                skipped.append(layer)
        if not core.any_origin():
            return []  # nothing, or an overflow no layer explains: the scaler's check skips the whole step
        for layer in skipped:
            for p in layer.params:
                p.grad = None
        for p in self._model.parameters():
            if not ok(p):
                p.grad = None
        return [layer.name for layer in skipped]

    def scales(self) -> List[Dict[str, Any]]:
        """Per watched layer: name, factor, chain, backoff, outcome (this step, before update())."""
        scaler = self._scaler()
        core = None if scaler is None else scaler._p.layerwise
        if core is None:
            return []
        return [core.layer(layer.index) for layer in self.layers]


def _tensors(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _readable(t: torch.Tensor) -> torch.Tensor:
    """t as the core reads it: detached, contiguous, CPU, float32/float16/bfloat16."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()
