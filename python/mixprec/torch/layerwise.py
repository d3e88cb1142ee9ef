"""Per-layer loss scaling for PyTorch models: the backward hooks of preset "layerwise".

    scaler = mixprec.torch.GradScaler("cpu", preset="layerwise")
    scaler.watch(model)   # its nn.Linear and transformers Conv1D modules (not those sharing weights)
    ... the usual loop: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()

The rule and every decision are the core's (mixprec::LayerwiseScales, docs/loss_scaling.md,
"Per-layer loss scaling"); this file moves tensors:

- a full backward pre-hook on each watched layer multiplies its output gradient g by the
  layer's factor s (a power of two, from the moments of g, read in place by the core, and of
  the weight), so that its input gradient and its weight gradient are computed at S0 * chain * s;
- a hook on the layer's weight and bias multiplies their gradient (this backward pass's
  contribution, before it is accumulated into .grad) by 1 / (chain * s): .grad carries the
  base scale S0 only, as with one scale (the protocol's windows see nothing else). Parameters
  that do not require gradients (frozen) get no hook; one that begins to require them gets its
  hook at the next forward;
- an identity node in front of the layer's input (only where that input requires a gradient,
  so torch has no "no inputs require gradients" case to warn about) returns the layer's input
  gradient to S0 (in its own dtype), unless a link (found once, on the first step after
  watch()) says that it flows only into another watched layer's output through
  scale-transparent ops (GELU, attention, views): then the gradient keeps chain * s, and the
  next layer starts its chain there. A branch of the graph thus joins the others at the base
  scale, exactly (powers of two).
- a layer that ran more than once in the forward of one backward pass (a weight-tied loop,
  ALBERT-style sharing, two micro-batches in one backward) gets one weight gradient, the sum
  of every call's: that pass it takes its gradients at the base scale (factor 1, no chain in
  or out), with a warning naming it the first time;
- before the scaler's check: a watched layer whose gradients hold inf/NaN while its incoming
  gradient was finite started the overflow (it backs off); when one did, every parameter whose
  gradient holds inf/NaN is skipped (its .grad set to None: torch's optimizers leave such a
  parameter, and its state, untouched) and the rest steps.
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch

from .. import _core
from .low_precision import is_linear_like

_MAX_LINK_NODES = 512  # a link's path is short (GELU, attention and its views); longer ones are not followed


def _graph_task() -> int:
    """The id of the backward pass running in this thread, -1 outside backward."""
    return torch._C._current_graph_task_id()


def out_features(module: torch.nn.Module) -> int:
    """A linear layer's output width: nn.Linear's out_features, transformers Conv1D's nf (its
    weight is [in, out])."""
    if isinstance(module, torch.nn.Linear) or hasattr(module, "out_features"):
        return int(module.out_features)
    return int(module.weight.shape[1])


class _Layer:
    __slots__ = ("name", "module", "index", "params", "hooked", "feeds", "entry_chain", "chain", "in_node",
                 "out_node", "w_version", "w_moments", "calls", "task", "shared", "pass_calls", "warned", "__weakref__")

    def __init__(self, name: str, module: torch.nn.Module, index: int) -> None:
        self.name = name
        self.module = module
        self.index = index
        self.params = [(role, p) for role, p in (("weight", module.weight), ("bias", getattr(module, "bias", None)))
                       if isinstance(p, torch.Tensor)]
        self.hooked: Set[int] = set()  # id of each parameter whose gradient hook is registered
        self.feeds: Optional[_Layer] = None  # the watched layer its input gradient flows into, if linked
        self.entry_chain = 1.0  # the chain its incoming gradient carries this pass (set by the feeding layer)
        self.chain = 1.0        # chain * factor of this pass: what its weight gradient carries above S0
        self.in_node: Any = None
        self.out_node: Any = None
        self.w_version = -1
        self.w_moments: Any = None
        self.calls = 0          # forward calls (with a gradient) not yet consumed by a backward pass
        self.task = -1          # the backward pass that consumed them
        self.pass_calls = 0     # how many they were
        self.shared = False     # that pass: more than one call, so the base scale
        self.warned = False
        _LAYERS.add(self)

    def single_call(self) -> bool:
        """Whether the backward pass now running has one call of this layer to go through (its
        own pre-hook may not have run yet)."""
        return (not self.shared) if self.task == _graph_task() else self.calls <= 1


def _select(model: torch.nn.Module, modules: Any) -> Tuple[List[Tuple[str, torch.nn.Module]], List[str]]:
    """The watched layers and the names of those left at the base scale for sharing a weight."""
    named = [(n, m) for n, m in model.named_modules()]
    if modules is None:
        chosen = [(n, m) for n, m in named if is_linear_like(m)]
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
        if not is_linear_like(m):
            raise TypeError(f"watch: module {n!r} is a {type(m).__name__}; per-layer scaling watches "
                            "torch.nn.Linear and transformers Conv1D modules")
    # A weight another module also uses (a tied LM head) takes gradients at two scales: such a
    # module stays at the base scale.
    uses: Dict[int, int] = {}
    for _, m in named:
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    kept = [(n, m) for n, m in chosen if all(uses.get(id(p), 0) == 1 for p in m.parameters(recurse=False))]
    return kept, [n for n, m in chosen if (n, m) not in kept]


# Readers of a watched layer's weight gradient besides the optimizer (the advisor's sampler):
# the layer's weight hook hands them the gradient as it goes into .grad, at the base scale,
# whatever order the hooks were registered in. module -> {key: callable(grad)}.
_WEIGHT_GRAD_READERS: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[int, Callable[[torch.Tensor], None]]]" = \
    weakref.WeakKeyDictionary()
# Every watched module's hooks and its position in them, both weakly (a strong value would
# keep its key alive): module -> (weakref to the LayerwiseHooks, index into its layers).
_WATCHED: "weakref.WeakKeyDictionary[torch.nn.Module, Tuple[Any, int]]" = weakref.WeakKeyDictionary()


def add_weight_grad_reader(module: torch.nn.Module, key: int, fn: Callable[[torch.Tensor], None]) -> None:
    _WEIGHT_GRAD_READERS.setdefault(module, {})[key] = fn


def remove_weight_grad_reader(module: torch.nn.Module, key: int) -> None:
    readers = _WEIGHT_GRAD_READERS.get(module)
    if readers is not None:
        readers.pop(key, None)


def watched_layer(module: torch.nn.Module) -> Optional[_Layer]:
    """The layer state of a module a layerwise scaler watches now, else None."""
    entry = _WATCHED.get(module)
    if entry is None:
        return None
    hooks = entry[0]()
    return hooks.layers[entry[1]] if hooks is not None and hooks._handles else None


def gradient_factor(module: torch.nn.Module) -> float:
    """What the output gradient of `module` carries above the base loss scale where a hook after
    the layer's own pre-hook reads it (a tensor hook on its output): the layer's chain of the
    backward pass now running; 1 when no layerwise scaler watches it."""
    layer = watched_layer(module)
    return 1.0 if layer is None else layer.chain


# Every layer state, so that its cached core object (weight moments) and autograd nodes are
# dropped at exit. A layer is reachable from its model's hooks and from the autograd graph of
# any loss still alive (through the backward hooks of its calls), also after its hooks were
# removed (watch() again) or their scaler is gone; such cycles through autograd's C++ objects
# outlive the interpreter's last collection, and nanobind's leak check would report the core
# objects they hold as leaked.
_LAYERS: "weakref.WeakSet[_Layer]" = weakref.WeakSet()


@atexit.register
def _drop_core_objects() -> None:
    for layer in list(_LAYERS):
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
        chosen, tied = _select(model, modules)
        for name, m in chosen:
            self.layers.append(_Layer(name, m, core.add_layer(name, out_features(m))))
        if not self.layers:
            why = (f"its linear layers ({', '.join(repr(n) for n in tied)}) share their weights with other modules"
                   if tied else "it has no torch.nn.Linear or transformers Conv1D module" +
                   (" among those selected" if modules is not None else ""))
            warnings.warn(f"watch: nothing to watch in {type(model).__name__}: {why}; the scaler runs at its base "
                          "scale alone", stacklevel=3)
        self._need_links = True
        self._handles: List[Any] = []
        ref = weakref.ref(self)
        for i, layer in enumerate(self.layers):
            m = layer.module
            _WATCHED[m] = (ref, i)
            self._handles.append(m.register_forward_pre_hook(self._input_hook(ref, layer)))
            self._handles.append(m.register_forward_hook(self._forward_hook(ref, layer)))
            self._handles.append(m.register_full_backward_pre_hook(self._pre_hook(ref, layer)))
            self._hook_params(layer)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for layer in self.layers:
            layer.hooked.clear()
            entry = _WATCHED.get(layer.module)
            if entry is not None and entry[0]() is self:
                del _WATCHED[layer.module]

    def _hook_params(self, layer: _Layer) -> None:
        """A gradient hook on each parameter of the layer that requires gradients and has none
        yet: a frozen one (requires_grad=False) takes none, and gets it once it is trainable."""
        for role, p in layer.params:
            if p.requires_grad and id(p) not in layer.hooked:
                self._handles.append(p.register_hook(self._param_hook(layer, role)))
                layer.hooked.add(id(p))

    def relink(self) -> None:
        """Find the links again on the next step (after the model's graph changed)."""
        self._need_links = True
        for layer in self.layers:
            layer.feeds = None

    # ---- forward: the input's node, the calls, where each layer's input comes from -----------

    @staticmethod
    def _input_hook(ref: "weakref.ref[LayerwiseHooks]", layer: _Layer):
        def hook(module: torch.nn.Module, args: Any) -> Any:
            # Only an input that requires a gradient gets the node that returns it to the base
            # scale (or hands the chain on): a module whose inputs need none has nothing to return.
            if ref() is None or not torch.is_grad_enabled() or not args:
                return None
            x = args[0]
            if not isinstance(x, torch.Tensor) or not x.requires_grad:
                return None
            return (_InputGradient.apply(x, layer),) + tuple(args[1:])
        return hook

    @staticmethod
    def _forward_hook(ref: "weakref.ref[LayerwiseHooks]", layer: _Layer):
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            self = ref()
            if self is None or not torch.is_grad_enabled():
                return
            self._hook_params(layer)
            # A call whose output takes a gradient, outside backward (a forward recomputed there by
            # activation checkpointing is the same call again): counted until its backward pass.
            if isinstance(output, torch.Tensor) and output.requires_grad and _graph_task() == -1:
                layer.calls += 1
            if not self._need_links:
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
            if not _transparent(n):
                # A custom autograd Function's backward may run anything, watched layers
                # included (reentrant activation checkpointing recomputes and backpropagates
                # its segment there, out of sight of this graph): not a path a chain may take.
                return None
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
    def _begin_pass(layer: _Layer) -> None:
        """At the layer's first pre-hook of a backward pass: how many calls it goes through."""
        task = _graph_task()
        if layer.task == task:
            return
        layer.task, layer.pass_calls, layer.calls = task, layer.calls, 0
        layer.shared = layer.pass_calls > 1
        if layer.shared and not layer.warned:
            layer.warned = True
            warnings.warn(f"watch: module {layer.name!r} ({type(layer.module).__name__}) ran {layer.pass_calls} "
                          "times in the forward of one backward pass; its weight gradient is the sum of every "
                          "call's, so it takes its gradients at the base scale (no per-layer factor)", stacklevel=2)

    @staticmethod
    def _pre_hook(ref: "weakref.ref[LayerwiseHooks]", layer: _Layer):
        def hook(module: torch.nn.Module, grad_output: Tuple[Optional[torch.Tensor], ...]):
            self = ref()
            scaler = None if self is None else self._scaler()
            g = grad_output[0] if grad_output else None
            LayerwiseHooks._begin_pass(layer)
            if scaler is None or g is None or not scaler._p.enabled:
                return None
            chain = layer.entry_chain
            layer.entry_chain = 1.0
            core = scaler._p.layerwise
            if core is None:
                return None
            if layer.shared:
                # One common scale for every call: the base one (no chain is handed to such a
                # layer; one that came anyway is taken back off).
                core.keep(layer.index, bool(torch.isfinite(g).all()))
                layer.chain = 1.0
                return None if chain == 1.0 else (g * (1.0 / chain),) + tuple(grad_output[1:])
            f = core.decide(layer.index, _readable(g), self._weight_moments(layer), chain)
            layer.chain = chain * f
            if f == 1.0:
                return None
            return (g * f,) + tuple(grad_output[1:])
        return hook

    @staticmethod
    def _param_hook(layer: _Layer, role: str):
        def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
            c = layer.chain
            out = grad if c == 1.0 else grad * (1.0 / c)
            if role == "weight":
                readers = _WEIGHT_GRAD_READERS.get(layer.module)
                for fn in list(readers.values()) if readers else ():
                    fn(out)
            return None if c == 1.0 else out
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

        for layer in self.layers:
            layer.calls = 0  # a call whose output took no gradient this step is not the next step's
        skipped: List[_Layer] = []
        for layer in self.layers:
            outcome = core.finish_layer(layer.index, all(ok(p) for _, p in layer.params))
            if outcome != "applied":
                skipped.append(layer)
        if not core.any_origin():
            return []  # nothing, or an overflow no layer explains: the scaler's check skips the whole step
        for layer in skipped:
            for _, p in layer.params:
                p.grad = None
        for p in self._model.parameters():
            if not ok(p):
                p.grad = None
        return [layer.name for layer in skipped]

    def scales(self) -> List[Dict[str, Any]]:
        """Per watched layer: name, factor, chain, backoff, outcome (this step, before update()),
        calls (its forward calls in the last backward pass: more than one, and it ran at the base
        scale) and frozen (its parameters that require no gradient)."""
        scaler = self._scaler()
        core = None if scaler is None else scaler._p.layerwise
        if core is None:
            return []
        out = []
        for layer in self.layers:
            d = core.layer(layer.index)
            if layer.shared:
                d["factor"] = d["chain"] = 1.0
            d["calls"] = layer.pass_calls
            d["frozen"] = [role for role, p in layer.params if not p.requires_grad]
            out.append(d)
        return out


class _InputGradient(torch.autograd.Function):
    """The identity in front of a watched layer's input. In backward, the layer's input gradient
    (this layer's contribution only) carries the layer's chain: it goes on at that chain into
    the layer it is linked to (that layer's chain starts there), or back to the base scale."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        ctx.layer = layer
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        layer = ctx.layer
        c = layer.chain
        target = layer.feeds
        if target is not None and not layer.shared and target.single_call():
            target.entry_chain = c  # the gradient goes on, at its chain, into that layer
            return g, None
        return (g if c == 1.0 else g * (1.0 / c)), None


def _transparent(node: Any) -> bool:
    """Whether a link's path may cross this node: any built-in op, and of the custom autograd
    Functions only the hooks' own identities (the layers' input nodes, and torch's wrapping of a
    module's inputs and outputs for its backward hooks, torch.nn.modules._functions)."""
    fn = getattr(node, "_forward_cls", None)
    return fn is None or fn is _InputGradient or getattr(fn, "__name__", "") == "BackwardHookFunction"


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
