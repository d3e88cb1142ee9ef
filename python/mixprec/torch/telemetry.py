"""mixprec.torch.Telemetry: what loss scaling and low precision did to any PyTorch model, as a
run folder that `mixprec report`, the alerts and `mixprec scaler simulate` read.

    scaler = mixprec.torch.GradScaler("cpu", preset="torch")
    tel = mixprec.torch.Telemetry(model, out="runs/pytorch", precision="fp16", scaler=scaler)
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = criterion(model(x), y)
        scaler.scale(loss).backward()
        outcome = scaler.step(opt)
        tel.record(outcome, loss=loss.item(), lr=sched.get_last_lr()[0], tokens=x.numel())
        scaler.update()
        opt.zero_grad()
    tel.close()                       # summary.json with the run's alerts; mixprec.report(tel.dir)

Module hooks (docs/python.md, "Telemetry"):
- a forward hook on each watched module (by default every module without children): at sampled
  steps its output is checked for inf/NaN (the first one is named in the step's log line as
  forward_nonfinite), added to the activation histogram at histogram steps, and given a gradient
  hook (_on_gradient), so that backward hands its gradient over to be counted under the module's name;
- counting is the core's: what converting the gradient, as it is (scaled), to fp16 with
  mixprec's counted conversion would report: underflow, subnormal, overflow and inf/NaN
  counts, |max|; for an fp32 or bf16 gradient what fp16 would flush at the current scale, for
  an fp16 gradient its values as stored; one read-only pass over the tensor's own codes
  (formats/count.hpp; fp16 and bf16 are never widened);
- localisation (localise=, last_localisation): at every step, one torch.aminmax per output
  of the repeated blocks (transformer layers) and of the watched modules outside them, kept
  on the device as 0-dim tensors and read with record()'s other results (exact: a NaN makes
  min and max NaN, an inf makes |max| inf; a finite tensor never looks non-finite); the first
  that held inf/NaN is the log's forward_nonfinite at every step. The backward is localised
  from the parameter gradients record() measures anyway (no hook); localise="full" also hooks
  every watched output gradient and counts inf/NaN elements exactly (isfinite);
- record() adds per parameter the gradient |max| (unscaled, before clipping) and the weight
  |max|, then writes one log line, in one core call. The gradient |max| comes from the
  scaler's own unscale pass when it read the gradient (StepOutcome carries it: no second
  read), else from the core's multi-tensor kernel over the gradient as step() left it
  (divided back by clip_coef when you clipped). Weights are exported to the core once and
  read through that view at every step (again only when a parameter's data is replaced).

Tensors on a device other than the CPU are counted where they lie with torch operations
(_device_counts.py: the same numbers, one host read per step at record()); counting="torch"
runs that path on CPU tensors too, which is how the tests compare it with the core's.
The counting, the log line, the alerts and the summary are the C++ core's
train::TelemetryRecorder, the code behind the libtorch adapter's Telemetry too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.dlpack import to_dlpack

from .. import _args, _core
from . import _device_counts as dev
from .grad_scaler import GradScaler, StepOutcome, _core_block, _local
from .tensorboard import TensorBoardWriter, require_tensorboard
from .advise import Sampler as _AdvisorSampler, write_samples as _write_advisor_samples
from .low_precision import WHAT_IF_RECIPES, _measured_tensors, _sample_step, _taken, low_precision_modules
from .optim import AdamW as _AdamW

_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PRECISIONS = ("fp32", "fp16", "bf16")
_COUNTING = ("auto", "torch")
_LOCALISE = ("auto", "full", "off")
_OUTLIERS = 3  # module outputs with the largest |max| named in last_localisation["outliers"]
_ROUGH = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what torch.aminmax reads as it is
OPTIMIZER_LOG = "optimizer.jsonl"  # the optimizer state's measurements at sampled steps (optimizer=)


def _capsule(t: torch.Tensor):
    """t as the core reads it: a DLPack capsule of CPU, contiguous float32/float16/bfloat16
    memory (torch.utils.dlpack.to_dlpack: far cheaper to import than the tensor itself).
    Anything else is copied once (to float32 when its dtype is another)."""
    t = _local(t.detach() if t.requires_grad else t)  # a DTensor (FSDP2): this rank's shard
    if t.dtype not in _CPU_DTYPES:
        t = t.float()
    if not t.is_contiguous():
        t = t.contiguous()
    return to_dlpack(t)


def _record_values(loss: Any, lr: Any, tokens: Any, seconds: Any, val_loss: Any, clip_coef: Any):
    """record()'s numbers, each checked for its type by name (the core checks their ranges)."""
    return (_args.real("loss", loss), _args.real("lr", lr), _args.uint64("tokens", tokens),
            _args.optional_real("seconds", seconds), _args.optional_real("val_loss", val_loss),
            _args.real("clip_coef", clip_coef))


def _on_gradient(t: torch.Tensor, hook: Callable[[Optional[torch.Tensor]], None]) -> None:
    """Calls hook(gradient of t) in backward, once the gradient is summed over t's uses (None
    for an output of a multi-output node that received none): as a pre-hook of the autograd
    node that made t, at t's output index (one C++ call, where Tensor.register_hook costs
    several times as much in Python, once per watched output at sampled steps); through
    t.register_hook while Dynamo traces; for a tensor no node made (a leaf: a parameter a
    module returns as it is), which outlives the step, a tensor hook that removes itself once
    it ran (a node's pre-hook goes with its graph)."""
    if torch.compiler.is_compiling():
        t.register_hook(hook)
        return
    node = t.grad_fn
    if node is None:
        def once(grad: torch.Tensor) -> None:
            handle.remove()
            hook(grad)
        handle = t.register_hook(once)
        return
    index = t.output_nr
    node.register_prehook(lambda grads: hook(grads[index]))


def _reduced(t: torch.Tensor, full: bool) -> Optional[Tuple[torch.Tensor, ...]]:
    """What localisation keeps of one tensor, left on its device (no host read, no sync):
    torch.aminmax, one read-only pass whose min and max are NaN when any element is NaN, and
    give |max| = max(max, -min), inf when an element is inf: exact (a finite tensor never
    looks non-finite, as an fp32 sum of large bf16 values could). localise="full" adds the
    exact count of inf/NaN elements (torch.isfinite). None: nothing to check (no elements,
    not a dense tensor)."""
    d = _local(t.detach())
    if d.layout != torch.strided or d.numel() == 0:
        return None
    if d.dtype not in _ROUGH:
        d = d.float()  # fp8 and others: aminmax has no kernel for them everywhere
    if not full:
        return torch.aminmax(d)
    lo, hi = torch.aminmax(d)
    return lo, hi, torch.isfinite(d).logical_not_().sum()


def _what_if_names(v: Any) -> Tuple[str, ...]:
    """Telemetry's what_if: distinct recipe names of WHAT_IF_RECIPES (a str alone is refused)."""
    if isinstance(v, (str, bytes)):
        raise TypeError(f"what_if: expected a list of recipe names, found the str {v!r} (one recipe: [{v!r}])")
    try:
        names = list(v)
    except TypeError:
        raise TypeError(f"what_if: expected a list of recipe names, found {type(v).__name__}") from None
    seen = set()
    for n in names:
        if not isinstance(n, str) or n not in WHAT_IF_RECIPES:
            why = (" (its scale comes from an amax history of earlier steps, which a what-if does not have: "
                   "fp8-current is the scale of the step itself)" if n == "fp8-delayed" else "")
            raise ValueError(f"what_if: expected recipe names among {', '.join(WHAT_IF_RECIPES)}, found {n!r}{why}")
        if n in seen:
            raise ValueError(f"what_if: {n!r} is given twice")
        seen.add(n)
    return tuple(names)


def _finite(x: float) -> Optional[float]:
    """x for the JSON files; None (null) when not finite."""
    return x if math.isfinite(x) else None


def _decoded(values: List[int], n: int) -> Tuple[float, ...]:
    """The first n values, float32 bits (int64 values of an int32 view), as floats."""
    return struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *(v & 0xFFFFFFFF for v in values[:n])))


def _merged(entries: List[Tuple[str, str, float, int]]) -> List[List[Any]]:
    """[name, |max|, inf/NaN count] per module, in the order of its first entry: the largest
    |max| of its outputs and micro-batches (NaN when any held NaN, else inf when any held inf),
    the counts summed."""
    table: Dict[str, List[Any]] = {}
    for name, _, amax, count in entries:
        row = table.get(name)
        if row is None:
            table[name] = [name, amax, count]
            continue
        a = row[1]
        row[1] = a if math.isnan(a) else amax if math.isnan(amax) else max(a, amax)
        row[2] += count
    return list(table.values())


def _tensors_of(output: Any) -> List[torch.Tensor]:
    """The floating-point tensors of a module's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors_of(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors_of(o)]
    return []


def _blocks(model: torch.nn.Module, root_name: str) -> List[Tuple[str, torch.nn.Module]]:
    """The model's repeated blocks, outermost ones: the children of an nn.ModuleList or
    nn.Sequential that have children themselves and share their class with another child of
    it (transformer layers, ResNet blocks), in the order the model holds them."""
    found: List[Tuple[str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        kids = list(module.named_children())
        repeated: Dict[type, int] = {}
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            for _, m in kids:
                if any(True for _ in m.children()):
                    repeated[type(m)] = repeated.get(type(m), 0) + 1
        for n, m in kids:
            if repeated.get(type(m), 0) >= 2 and any(True for _ in m.children()):
                found.append((prefix + n, m))
            else:
                visit(prefix + n + ".", m)

    visit("", model)
    return [(_args.utf8_text(n or root_name), m) for n, m in found]


class Telemetry:
    """Writes a run folder (the schema of `mixprec train --out`) for a PyTorch training loop.

    model           the module whose submodules are watched and whose parameters are recorded
    out             the run folder (str or os.PathLike): it must not exist or be empty (a finished
                    run is never overwritten); its lock is held until close()
    precision       "fp32", "fp16" or "bf16": the autocast dtype of the run (config.json)
    loss_scale      the run's loss scale as `mixprec train --loss-scale` names it (a preset,
                    "static:S" or "none"); by default the scaler's preset ("none" without one or
                    when it is disabled)
    scaler          the mixprec.torch.GradScaler of the loop (for the scale after each update)
    modules         which submodules to watch: None = every module without children but loss
                    modules (torch.nn.modules.loss._Loss); or an iterable of distinct names from
                    model.named_modules(); or a predicate (name, module) -> bool. An output with no
                    dimension (a loss) is checked, but its gradient (the loss scale) is not counted
    sample_every    count activation gradients and check forward outputs at every N-th step
                    (1 = every step; the parameter |max| and the scaler's outcome are recorded
                    at every step); histogram steps are sampled too
    histogram_every log2 histograms at step 1 and every N steps (0 = never)
    check_forward   check the watched modules' outputs for inf/NaN at sampled steps
    tensorboard     a folder: each step's scalars also as TensorBoard event files (needs the
                    tensorboard package; the tags of `mixprec export tensorboard`)
    counting        "auto": the core counts CPU tensors, torch operations count tensors on other
                    devices where they lie; "torch": torch operations for every tensor (the GPU
                    path, run on the CPU: for comparisons and tests)
    advisor_every   0 (default) or N: at steps 1, 1 + N, ..., write x, w, dy and dW of every
                    nn.Linear (its first micro-batch of the step) into the run folder's
                    samples/ for `mixprec advise RUN_DIR` (docs/advisor.md)
    localise        where a non-finite value began, at every step (last_localisation):
                    "auto" (default, cheap): the outputs of the model's repeated blocks
                    (transformer layers) and of the watched modules outside them, each
                    reduced to its |max| on its device (one torch.aminmax, read with the step's
                    other results at record()); the backward from the parameter gradients
                    record() measures anyway, per watched module. "full" (debugging): every
                    watched module's output and output gradient, with the exact count of
                    inf/NaN elements and the whole table. "off": nothing
    optimizer       a mixprec.torch.optim.AdamW: at sampled steps its step measures, per
                    parameter, the moments' relative quantization error and the fraction of
                    lost updates (OPTIMIZER_LOG, one line per sampled step); summary.json's
                    "optimizer_state" holds its formats, bytes per parameter and the totals

    what_if         recipe names (mixprec.RECIPES but fp8-delayed): at the sampled steps each
                    quantized tensor of the low-precision modules is also quantized with each of
                    these recipes' config of the same GEMM operand, and the log's entry gets
                    "what_if": counts, error and block statistics per recipe (docs/low_precision.md,
                    "Per-block statistics")
    block_stats     the per-block statistics and the kurtosis of each quantized tensor at the
                    sampled steps (default True); False leaves them out of the log (and the
                    alerts kurtosis-rise and block-spread-rise have nothing to read)

    Low-precision Linear modules (mixprec.torch.low_precision) are found by themselves: at each
    sampled step they measure their quantization (x, w, dy: amax, scale, counts, relative RMS
    error, per-block statistics and kurtosis), which the log line holds in its "fp8" array
    (docs/telemetry.md); the alerts kurtosis-rise and block-spread-rise read them.
    """

    def __init__(self, model: torch.nn.Module, out: str, *, precision: str = "fp16",
                 loss_scale: Optional[str] = None, scaler: Optional[GradScaler] = None,
                 modules: Union[None, Iterable[str], Callable[[str, torch.nn.Module], bool]] = None,
                 sample_every: int = 4, histogram_every: int = 50, check_forward: bool = True,
                 tensorboard: Optional[str] = None, counting: str = "auto", advisor_every: int = 0,
                 localise: str = "auto", optimizer: Optional[_AdamW] = None, what_if: Sequence[str] = (),
                 block_stats: bool = True) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, found {type(model).__name__}")
        if not isinstance(precision, str) or precision not in _PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(_PRECISIONS)}, found {precision!r}")
        sample_every = _args.integer("sample_every", sample_every, 1, 2**63 - 1)
        histogram_every = _args.integer("histogram_every", histogram_every, 0, 2**63 - 1)
        advisor_every = _args.integer("advisor_every", advisor_every, 0, 2**63 - 1)
        if not isinstance(counting, str) or counting not in _COUNTING:
            raise ValueError(f"counting: expected one of {', '.join(_COUNTING)}, found {counting!r}")
        if not isinstance(localise, str) or localise not in _LOCALISE:
            raise ValueError(f"localise: expected one of {', '.join(_LOCALISE)}, found {localise!r}")
        what_if = _what_if_names(what_if)
        block_stats = _args.flag("block_stats", block_stats)
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError("scaler: expected a mixprec.torch.GradScaler (torch.amp.GradScaler does not say "
                            f"what its update will do), found {type(scaler).__name__}")
        if optimizer is not None and not isinstance(optimizer, _AdamW):
            raise TypeError("optimizer: expected a mixprec.torch.optim.AdamW (its step measures the state's "
                            f"quantization error and lost updates) or None, found {type(optimizer).__name__}")
        # The scaler's whole config (its overrides) goes to config.json when it is the run's.
        loss_scale_state = None
        if loss_scale is None:
            loss_scale = scaler._p.run_spec if scaler is not None else "none"  # every preset, static too
            if scaler is not None and scaler.is_enabled():
                loss_scale_state = scaler._p.loss_scale_json()
        elif not isinstance(loss_scale, str):
            raise TypeError(f"loss_scale: expected a str (a preset, 'static:S' or 'none'), found "
                            f"{type(loss_scale).__name__}")
        out = _args.path("out", out)
        watched = self._select(model, modules)  # before the folder exists: a bad name leaves nothing
        if tensorboard is not None:
            require_tensorboard(tensorboard)  # likewise: a missing package leaves nothing
        self._model = model
        self._watched = watched
        self._scaler = scaler
        self._optimizer = optimizer
        # Per parameter name over the sampled steps: [steps, sum and max of the m and v relative
        # errors, lost, meant]; and the sampled steps' whole-model lost fractions.
        self._opt_totals: Dict[str, List[float]] = {}
        self._opt_fractions: List[float] = []
        self._precision = precision
        self._what_if = what_if
        self._block_stats = block_stats
        self._sample_every = sample_every
        self._check_forward = check_forward
        self._localise = {"off": 0, "auto": 1, "full": 2}[localise]
        # The step's reductions (module name, label, _reduced()) in forward / backward order,
        # and those read already (name, label, |max|, inf/NaN count) of a step whose record()
        # failed to write (kept for the retry, as the core keeps its counts).
        self._loc_queue: Tuple[List[Any], List[Any]] = ([], [])
        self._loc_read: Tuple[List[Any], List[Any]] = ([], [])
        self._last_localisation: Optional[Dict[str, Any]] = None
        # The watched modules in the order their outputs appeared in the last sampled step's
        # forward (whose hooks run on all of them): the weight-gradient rule's backward order.
        self._order_now: List[str] = []
        self._forward_order: List[str] = []
        # What localise="auto" reduces: the repeated blocks and the watched modules outside them
        # (blocks that are not watched get a hook of their own); "full": the watched modules.
        blocks = _blocks(model, type(model).__name__) if self._localise == 1 else []
        inside = {id(m) for _, b in blocks for m in b.modules()}
        self._loc_units = {n for n, m in watched
                           if self._localise == 2 or (self._localise == 1 and id(m) not in inside)}
        watched_ids = {id(m) for _, m in watched}
        self._loc_blocks = [(n, m) for n, m in blocks if id(m) not in watched_ids]
        self._loc_units.update(n for n, m in blocks if id(m) in watched_ids)
        # The core creates the folder, takes its lock and checks precision and loss_scale
        # (ValueError / RuntimeError with its message) before anything else happens here.
        existed = {p: os.path.lexists(p) for p in (out, tensorboard) if p is not None}
        self._rec = _core.TelemetryRecorder(out, precision, loss_scale, histogram_every, loss_scale_state)
        self._dir = out
        self._advisor = None
        self._tb = None
        try:
            self._plan_next_step()
            # The advisor's sampler (mixprec.torch.advise): active on every advisor_every-th step
            # (after the folder exists: a refused folder leaves no hooks on the model).
            self._advisor = _AdvisorSampler(model) if advisor_every else None
            self._advisor_every = advisor_every
            self._tb = None if tensorboard is None else TensorBoardWriter(tensorboard)
            self._seconds = 0.0  # time in the hooks and in record(), the core's counting included
            self._last_record = time.perf_counter()
            self._torch_counting = counting == "torch"
            # Device results waiting for record()'s one host read: (kind, label, dtype, numel, tensor).
            self._pending: List[Tuple[str, Any, str, int, torch.Tensor]] = []
            self._host_reads = 0  # copies of device results to the host: one per record() and device
            self._weight_ptrs: List[int] = []  # each weight's data_ptr() when it was handed to the core
            self._on_torch: List[int] = []    # parameters counted by torch operations (other devices)
            self._set_params()
            if scaler is not None:
                scaler._telemetry_amax = True  # its unscale pass measures the gradient |max| for record()
            self._handles = []
            for name, module in watched:
                self._handles.append(module.register_forward_hook(self._forward_hook(name, name in self._loc_units)))
            self._loc_handles = [m.register_forward_hook(self._block_hook(n)) for n, m in self._loc_blocks]
            if self._advisor is not None:
                self._advisor.active = True  # steps 1, 1 + N, 1 + 2N, ...
        except BaseException:
            # Refused after the folder was made (no Linear for advisor_every, a tensorboard
            # folder that cannot be written): the folder goes again, so that the retry is not
            # refused as "exists and is not empty".
            self._abandon(existed)
            raise

    def _abandon(self, existed: Dict[str, bool]) -> None:
        """Undoes a construction that failed after the core made the run folder: hooks removed,
        the lock released, and what this Telemetry created removed (a folder that existed was
        empty, or the core would have refused it: it is emptied)."""
        for h in getattr(self, "_handles", []) + getattr(self, "_loc_handles", []):
            h.remove()
        if self._advisor is not None:
            self._advisor.remove()
        if self._tb is not None:
            self._tb.close()
        if self._scaler is not None:
            self._scaler._telemetry_amax = False
        if self._optimizer is not None:
            self._optimizer.collect_stats = False
        self._rec = None  # releases the lock
        for path, was_there in existed.items():
            if not was_there:
                shutil.rmtree(path, ignore_errors=True)
            elif path == self._dir and os.path.isdir(path) and not os.path.islink(path):
                for entry in os.listdir(path):
                    e = os.path.join(path, entry)
                    if os.path.isdir(e) and not os.path.islink(e):
                        shutil.rmtree(e, ignore_errors=True)
                    else:
                        os.remove(e)

    # ---- which modules ---------------------------------------------------------------------

    @staticmethod
    def _select(model: torch.nn.Module, modules: Any) -> List[Any]:
        named = [(n or type(model).__name__, m) for n, m in model.named_modules()]
        if modules is None:
            # Leaf modules, but losses: a loss module's output is the loss, whose gradient is the
            # loss scale itself (an fp16 "overflow" at every step at 2^16), not an activation's.
            chosen = [(n, m) for n, m in named if not any(True for _ in m.children())
                      and not isinstance(m, torch.nn.modules.loss._Loss)]
        elif callable(modules):
            chosen = [(n, m) for n, m in named if modules(n, m)]
        else:
            wanted = _args.module_names("modules", modules, "each module is watched once")
            known = dict(named)
            unknown = [w for w in wanted if w not in known]
            if unknown:
                raise ValueError(f"modules: {unknown[0]!r} is not a module of the model; "
                                 f"its modules are {', '.join(n for n, _ in named[:12])}"
                                 + (", ..." if len(named) > 12 else ""))
            chosen = [(w, known[w]) for w in wanted]
        if not chosen:
            raise ValueError("modules: no module of the model was selected")
        return [(_args.utf8_text(n), m) for n, m in chosen]

    # ---- hooks -----------------------------------------------------------------------------

    def _plan_next_step(self) -> None:
        """What the coming step's hooks do, decided once as the step begins (at construction and
        at the end of record()), not in every hook (under torch.compile each call into the core
        from a hook is a graph break). A histogram step (the core's rule) samples too: its
        activation histograms are counted only when sampled."""
        self._histogram_next = self._rec.histogram_step()
        self._sample_next = self._rec.steps % self._sample_every == 0 or self._histogram_next
        # Low-precision Linear modules (mixprec.torch.low_precision) measure their quantization
        # error at sampled steps only: looked up as such a step begins (a model converted after
        # the Telemetry was made is found too).
        self._lowp = low_precision_modules(self._model) if self._sample_next else {}
        _sample_step(self._lowp.values(), True, self._what_if, self._block_stats)
        if self._optimizer is not None:
            # Its step measures only when asked (the sampled steps): last_stats is None until an
            # applied step measured, so a skipped step records nothing.
            self._optimizer.collect_stats = self._sample_next
            self._optimizer.last_stats = None

    # The hooks hold the Telemetry through a weak reference: the model keeps its hooks, and a
    # strong one would make a cycle (model -> hook -> Telemetry -> model) that keeps the run
    # folder locked until the garbage collector runs.
    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether t is counted by torch operations where it lies (not by the core)."""
        return self._torch_counting or not t.is_cpu

    def _forward_hook(self, name: str, unit: bool):
        """The hook of a watched module: its sampled work, and localisation's reduction of its
        output at every step when it is one of localisation's units."""
        ref = weakref.ref(self)
        unit = unit and self._localise != 0

        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            tel = ref()
            if tel is None or tel._rec is None or not torch.is_grad_enabled():
                return  # gone, or evaluation: nothing to do
            sampled = tel._sample_next
            if not (sampled or unit):
                return  # a step that is not sampled, nothing localised here
            t0 = time.perf_counter()
            tensors = _tensors_of(output)
            histogram = tel._histogram_next
            full = tel._localise == 2
            if sampled:
                tel._order_now.append(name)
            for i, t in enumerate(tensors):
                label = name if len(tensors) == 1 else f"{name}[{i}]"
                if unit:
                    r = _reduced(t, full)
                    if r is not None:
                        tel._loc_queue[0].append((name, label, r))
                if not sampled:
                    if full and t.requires_grad and t.dim() > 0:
                        _on_gradient(t, Telemetry._grad_hook(ref, name, label, False))
                    continue
                if tel._check_forward or histogram:
                    if tel._on_device(t):
                        c = dev.counted(t)
                        tel._pending.append(("forward", label, "", 0, dev.nonfinite(c)))
                        if histogram:
                            tel._pending.append(("histogram", "activations", "", 0,
                                                 dev.histogram(c, dev.HISTOGRAM_STRIDE)))
                    else:
                        tel._rec.check_activation(label, _capsule(t))
                if t.requires_grad and t.dim() > 0:  # a 0-dim output is a loss: its gradient is the scale
                    _on_gradient(t, Telemetry._grad_hook(ref, name, label, True))
            tel._seconds += time.perf_counter() - t0
        return hook

    def _block_hook(self, name: str):
        """localise="auto"'s hook on a repeated block no watched module is: its outputs reduced."""
        ref = weakref.ref(self)

        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            tel = ref()
            if tel is None or tel._rec is None or not torch.is_grad_enabled():
                return
            t0 = time.perf_counter()
            tensors = _tensors_of(output)
            for i, t in enumerate(tensors):
                r = _reduced(t, False)
                if r is not None:
                    tel._loc_queue[0].append((name, name if len(tensors) == 1 else f"{name}[{i}]", r))
            tel._seconds += time.perf_counter() - t0
        return hook

    @staticmethod
    def _grad_hook(ref: "weakref.ref[Telemetry]", name: str, label: str, count: bool):
        """The hook of one watched output's gradient: counted at sampled steps (count), reduced
        for localise="full" (the gradient flowing into the module from the loss's side: the
        tensor overflow_activation names too)."""
        def hook(grad: Optional[torch.Tensor]) -> None:
            tel = ref()
            if tel is None or tel._rec is None or grad is None:  # None: this output received no gradient
                return
            t0 = time.perf_counter()
            if tel._localise == 2:
                r = _reduced(grad, True)
                if r is not None:
                    tel._loc_queue[1].append((name, label, r))  # list.append: atomic on autograd's device threads
            if count and tel._on_device(grad):
                # Autograd may run this on its device thread: list.append is atomic.
                g = dev.counted(grad)
                tel._pending.append(("grad", label, dev.dtype_name(g), g.numel(), dev.profile(g)))
                if tel._histogram_next:
                    tel._pending.append(("histogram", "activation_grads", "", 0,
                                         dev.histogram(g, dev.HISTOGRAM_STRIDE)))
            elif count:
                tel._rec.count_activation_grad(label, _capsule(grad))
            tel._seconds += time.perf_counter() - t0
        return hook

    # ---- parameters: weights handed to the core once, device results read once per step -----

    def _set_params(self) -> None:
        """The model's parameters as they are now, named for the core in record()'s order; their
        weights are handed over again at the next record()."""
        named = list(self._model.named_parameters())
        self._params = [p for _, p in named]
        self._param_ids = [id(p) for p in self._params]
        self._rec.set_params([_args.utf8_text(n) for n, _ in named])
        self._weight_ptrs = []
        self._owners = self._param_owners()

    def _param_owners(self) -> List[Optional[str]]:
        """For each parameter (record()'s order), the deepest watched module holding it, whose
        name localise's weight-gradient rule gives; None for one no watched module holds or
        one that two unrelated watched modules share (tied embeddings: its gradient sums both
        uses, so it says nothing about where the inf/NaN began)."""
        shared = object()
        owner: Dict[int, Any] = {}
        inside: Dict[str, set] = {}
        for name, module in self._watched:
            inside[name] = {id(m) for m in module.modules()}
            for p in module.parameters():
                prev = owner.get(id(p))
                if prev is None:
                    owner[id(p)] = (name, module)
                elif prev is shared or id(prev[1]) in inside[name]:
                    continue  # ambiguous already, or a deeper watched module holds it
                elif id(module) in inside[prev[0]]:
                    owner[id(p)] = (name, module)  # deeper than the previous holder
                else:
                    owner[id(p)] = shared
        return [None if o is None or o is shared else o[0] for o in (owner.get(id(p)) for p in self._params)]

    def _bind_weights(self, ptrs: List[int]) -> None:
        """Hands the core a view of each weight whose data changed (all of them at first): CPU
        weights it can read in place as a kept DLPack export, the others as counted by torch."""
        old = self._weight_ptrs
        on_torch = []
        for i, p in enumerate(self._params):
            w = _local(p.detach())  # a DTensor (FSDP2): this rank's shard
            flat = None if self._torch_counting else _core_block(w)
            if flat is None:
                on_torch.append(i)
            if i < len(old) and old[i] == ptrs[i]:
                continue
            self._rec.set_weight(i, None if flat is None else to_dlpack(flat), w.numel())
        self._on_torch = on_torch
        self._weight_ptrs = ptrs

    def _params_on_torch(self, histogram: bool) -> None:
        """The |max| of the gradients and weights counted by torch operations (and their
        histograms at histogram steps), queued for record()'s host read."""
        tensors, where = [], []
        for i in self._on_torch:
            p = self._params[i]
            if p.grad is not None:
                tensors.append(dev.counted(p.grad))
                where.append(("grad", i))
            tensors.append(dev.counted(p))
            where.append(("weight", i))
        bits, order = dev.amax_bits(tensors)
        if order:
            self._pending.append(("amax", [where[j] for j in order], "", 0, bits))
        if histogram:
            for kind, role in (("weight_grads", "grad"), ("weights", "weight")):
                hists = [dev.histogram(t, 1) for t, (r, _) in zip(tensors, where) if r == role]
                if hists:
                    self._pending.append(("histogram", kind, "", 0, torch.stack(hists).sum(0)))

    # ---- localisation: where a non-finite value began ---------------------------------------

    def _loc_collect(self) -> None:
        """The step's queued reductions, per direction and device, as one stacked tensor of
        (min, max) pairs (and with localise="full" one of inf/NaN counts): CPU ones read at once
        (no copy), the others (and all with counting="torch", the GPU's path run on the CPU)
        as float32 bits joining _flush's one host read per device."""
        full = self._localise == 2
        for direction, queue in enumerate(self._loc_queue):
            if not queue:
                continue
            base = len(self._loc_read[direction])
            self._loc_read[direction].extend([name, label, math.nan, 0] for name, label, _ in queue)
            by_device: Dict[Any, List[int]] = {}
            for k, (_, _, r) in enumerate(queue):
                by_device.setdefault(r[0].device, []).append(k)
            for device, ks in by_device.items():
                pairs = torch.stack([x for k in ks for x in queue[k][2][:2]])  # promoted: outputs of several dtypes
                counts = torch.stack([queue[k][2][2] for k in ks]) if full else None
                where = (direction, [base + k for k in ks], full)
                if device.type == "cpu" and not self._torch_counting:
                    self._loc_store(where, pairs.tolist() + (counts.tolist() if full else []))
                else:
                    bits = pairs.float().view(torch.int32).to(torch.int64)
                    self._pending.append(("loc", where, "", 0, bits if counts is None else torch.cat([bits, counts])))
            queue.clear()

    def _loc_store(self, where: Tuple[int, List[int], bool], values: List[Any]) -> None:
        """Entry i's |max| = max(-min, max) (NaN when either is: aminmax's NaN) and count."""
        direction, rows, full = where
        n = len(rows)
        read = self._loc_read[direction]
        for j, i in enumerate(rows):
            lo, hi = values[2 * j], values[2 * j + 1]
            read[i][2] = math.nan if lo != lo or hi != hi else max(-lo, hi)
            read[i][3] = int(values[2 * n + j]) if full else 0

    def _loc_feed(self) -> None:
        """The log's forward_nonfinite at every step: the first watched output, in forward
        order, that held inf/NaN (at a sampled step the check of the same outputs named it
        already: the core keeps the first name it is given)."""
        first = next((e for e in self._loc_read[0] if not math.isfinite(e[2])), None)
        if first is not None:
            self._rec.forward_nonfinite(first[1])

    def _loc_result(self, read: Tuple[List[Any], List[Any]], line: Dict[str, Any]) -> Dict[str, Any]:
        """last_localisation of the step just written (the property says what it holds)."""
        forward, backward = read
        full = self._localise == 2
        first_forward = next((e[0] for e in forward if not math.isfinite(e[2])), None)
        # Weight gradients, as the line measured them (null: inf/NaN), in backward order: the
        # reverse of the order in which their modules' outputs appeared in this step's forward.
        bad = {self._owners[i] for i, p in enumerate(line["params"])
               if p["grad_amax"] is None and i < len(self._owners)}
        bad.discard(None)
        first_backward = None
        if bad:
            seen = set(self._forward_order)
            order = self._forward_order + [n for n, _ in self._watched if n not in seen]  # never seen: as held
            first_backward = next((n for n in reversed(order) if n in bad), None)
        rows = _merged(forward)
        spoiled = first_forward is not None or first_backward is not None
        outliers = [[name, amax] for name, amax, _ in sorted((r for r in rows if math.isfinite(r[1])),
                                                             key=lambda r: -r[1])[:_OUTLIERS]]
        result: Dict[str, Any] = {
            "step": line["step"],
            "nonfinite_forward": first_forward,
            "nonfinite_backward": first_backward,
            "outliers": outliers if full or spoiled else []}
        if full:
            result["nonfinite_output_grad"] = next((e[0] for e in backward if not math.isfinite(e[2])), None)
            result["forward"] = rows
            result["backward"] = _merged(backward)
        return result

    def _flush(self, grad_amax: List[Optional[float]], weight_amax: List[Optional[float]]) -> None:
        """Reads every queued device result, one host copy per device, and hands them to the
        core in the order they were queued."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        host: Dict[Any, List[int]] = {}
        by_device: Dict[Any, List[torch.Tensor]] = {}
        for *_, t in pending:
            by_device.setdefault(t.device, []).append(t.reshape(-1))
        for device, ts in by_device.items():
            host[device] = torch.cat(ts).tolist()
            self._host_reads += 1
        at = {device: 0 for device in by_device}
        for kind, label, dtype, numel, t in pending:
            n = t.numel()
            values = host[t.device][at[t.device]:at[t.device] + n]
            at[t.device] += n
            if kind == "grad":
                self._rec.add_activation_grad_profile(label, dtype, numel, values[:5], values[5])
            elif kind == "forward":
                if values[0]:
                    self._rec.forward_nonfinite(label)
            elif kind == "histogram":
                self._rec.add_histogram(label, values)
            elif kind == "loc":
                pairs = 2 * len(label[1])
                self._loc_store(label, list(_decoded(values, pairs)) + values[pairs:])
            else:  # amax: (role, parameter) per value
                for (role, i), bits in zip(label, values):
                    (grad_amax if role == "grad" else weight_amax)[i] = dev.f32_from_bits(bits)

    # ---- one line per optimizer step ---------------------------------------------------------

    def record(self, outcome: Optional[StepOutcome] = None, *, loss: float, lr: float = 0.0, tokens: int = 0,
               seconds: Optional[float] = None, val_loss: Optional[float] = None,
               clip_coef: float = 1.0, step: Optional[int] = None) -> Dict[str, Any]:
        """One log line for this optimizer step: after scaler.step() (its StepOutcome), before
        optimizer.zero_grad(); before or after scaler.update(). Without a scaler, outcome may be
        None (an fp32 or bf16 run without loss scaling: every step applied, scale 1).
        seconds: the step's wall time (default: the time since the previous record()).
        clip_coef: the coefficient your clipping applied (max_norm / (norm + 1e-6), capped at 1),
        so that the recorded gradient |max| is the unclipped one.
        step: this step's number, above the previous record's: the training's global step when
        the folder records a resumed run (its first line is then that step, not 1); None: the
        previous record's + 1 (1 first). Sampling, histograms and advisor samples follow the
        numbers given. Returns the line as a dict."""
        if self._rec is None:
            raise RuntimeError(f"telemetry: the run folder '{self._dir}' is closed; record() after close() "
                               "would write to a finished run")
        loss, lr, tokens, seconds, val_loss, clip_coef = _record_values(loss, lr, tokens, seconds, val_loss, clip_coef)
        numbered: Dict[str, int] = {}  # the core numbers a step as the previous + 1 by itself
        if step is not None:
            number = _args.integer("step", step, 1, 2**64 - 1)
            if number <= self._rec.steps:  # before anything is consumed (the core checks it too)
                raise ValueError(f"record(): step: expected a number above the previous step {self._rec.steps}, "
                                 f"found {number}")
            if number != self._rec.steps + 1:
                numbered["step"] = number
        now = time.perf_counter()
        if seconds is None:
            seconds = now - self._last_record
        if outcome is None:
            if self._scaler is not None and self._scaler.is_enabled():
                raise ValueError("record(): pass the StepOutcome scaler.step() returned (the scaler is enabled)")
            scale = next_scale = 1.0
            found_inf, applied, grad_norm, first = False, True, math.nan, ""
            guard = {}
        else:
            if not isinstance(outcome, StepOutcome):
                raise TypeError(f"outcome: expected the StepOutcome of mixprec.torch.GradScaler.step(), "
                                f"found {type(outcome).__name__}")
            scale = outcome.scale if not math.isnan(outcome.scale) else 1.0
            found_inf, applied = outcome.found_inf, outcome.applied
            grad_norm = outcome.grad_norm
            # Why a step was skipped and the guards' z-scores (docs/spike_guards.md); a pass-through
            # outcome's "none" is an applied step's.
            guard = {"skip_reason": "" if outcome.reason == "none" else outcome.reason,
                     "loss_z": float(outcome.loss_z), "grad_z": float(outcome.grad_z)}
            first = _args.utf8_text(outcome.first_overflow_name)
            next_scale = self._scaler._next_scale() if self._scaler is not None else scale
        if [id(p) for p in self._model.parameters()] != self._param_ids:
            self._set_params()  # a parameter added (or replaced) since the last record()
        ptrs = [_local(p).data_ptr() for p in self._params]  # a DTensor's: its shard's
        if ptrs != self._weight_ptrs:
            self._bind_weights(ptrs)
        histogram = self._histogram_next
        n = len(self._params)
        unclipped: List[Optional[float]] = []
        grad_amax: List[Optional[float]] = []
        weight_amax: List[Optional[float]] = []
        if self._on_torch:
            grad_amax, weight_amax = [None] * n, [None] * n
            self._params_on_torch(histogram)
        if self._localise:
            self._loc_collect()
        self._flush(grad_amax, weight_amax)
        if self._localise:
            self._loc_feed()
        # The scaler's unscale pass measured the gradients it read (not on an overflow step:
        # there the gradients as step() left them are measured, as they always were).
        fused = None if outcome is None or outcome.found_inf else outcome._grad_amax
        if fused:
            unclipped = [fused.get(k) for k in self._param_ids]
        # The core reads a gradient itself when nothing measured it, and at histogram steps.
        torch_set = set(self._on_torch)
        every = histogram or not fused
        grads: List[Any] = []
        if every or any(a is None for a in unclipped):
            grads = [None if i in torch_set or p.grad is None or (not every and unclipped[i] is not None)
                     else _capsule(dev.readable(p.grad)) for i, p in enumerate(self._params)]
        layers = [] if self._scaler is None else [
            (d["name"], d["factor"], d["chain"], d["backoff"], d["outcome"]) for d in self._scaler._layer_record()]
        quantized = _measured_tensors(self._lowp)  # the step's last quantization of each role
        # A recipe-file phase low_precision_step switched to before this step (on the model, or
        # on the module a wrapper holds).
        holder = next((m for m in (self._model, getattr(self._model, "module", None))
                       if m is not None and getattr(m, "_mixprec_recipe_phase", "")), None)
        phase = holder._mixprec_recipe_phase if holder is not None else ""
        line = self._rec.record(loss, lr, tokens, float(seconds), val_loss, float(scale), float(next_scale),
                                bool(found_inf), bool(applied), float(grad_norm), clip_coef, first,
                                unclipped, grad_amax, grads, weight_amax, layers, quantized, **numbered, **guard,
                                recipe_phase=phase)
        if holder is not None:
            holder._mixprec_recipe_phase = ""  # recorded: the next line does not repeat it
        _taken(self._lowp.values())
        _sample_step(self._lowp.values(), False)
        measured = None
        if self._optimizer is not None and self._sample_next:
            measured = self._optimizer.last_stats  # None: no applied step measured since the plan
        read, self._loc_read = self._loc_read, ([], [])
        if self._order_now:
            self._forward_order, self._order_now = list(dict.fromkeys(self._order_now)), []
        self._last_record = now  # a record() that raised changed nothing: its time counts to the next
        self._plan_next_step()
        result = json.loads(line)
        self._last_localisation = self._loc_result(read, result) if self._localise else None
        if self._advisor is not None:
            if self._advisor.active:  # this step's tensors, unscaled by the scale its backward used
                _write_advisor_samples(self._dir, result["step"], float(scale), self._advisor.take(result["step"], float(scale)))
            self._advisor.active = self._rec.steps % self._advisor_every == 0
        if self._tb is not None:
            self._tb.write(line, result["step"])
        if measured:
            # Last: a failed append leaves the step recorded and the telemetry's state consistent.
            self._record_optimizer(result["step"], measured)
        self._seconds += time.perf_counter() - now
        return result

    # ---- the optimizer state (optimizer=) ------------------------------------------------------

    def _optimizer_params(self) -> List[Tuple[str, torch.Tensor, Dict[str, Any]]]:
        """(name, parameter, group) of each optimizer parameter, named as record() names the
        model's; one the model does not hold as "param_groups[G][I]"."""
        names = {id(p): _args.utf8_text(n) for n, p in self._model.named_parameters()}
        return [(names.get(id(p), f"param_groups[{g}][{i}]"), p, group)
                for g, group in enumerate(self._optimizer.param_groups) for i, p in enumerate(group["params"])]

    def _record_optimizer(self, step: int, measured: Dict[torch.Tensor, Tuple[float, float, float, int]]) -> None:
        """One line of OPTIMIZER_LOG for a sampled step, and the run's totals."""
        rows, lost_all, meant_all = [], 0, 0
        for name, p, _ in self._optimizer_params():
            s = measured.get(p)
            if s is None:
                continue  # no gradient this step
            m_err, v_err, fraction, meant = s
            lost = round(fraction * meant)
            lost_all += lost
            meant_all += meant
            t = self._opt_totals.setdefault(name, [0, 0.0, 0.0, 0.0, 0.0, 0, 0])
            t[0] += 1
            t[1] += m_err
            t[2] = max(t[2], m_err)
            t[3] += v_err
            t[4] = max(t[4], v_err)
            t[5] += lost
            t[6] += meant
            rows.append({"name": name, "m_error": _finite(m_err), "v_error": _finite(v_err),
                         "lost_fraction": fraction, "meant": meant})
        if not rows:
            return
        fraction = lost_all / meant_all if meant_all else 0.0
        self._opt_fractions.append(fraction)
        text = json.dumps({"step": step, "lost_update_fraction": fraction, "params": rows},
                          separators=(",", ":"), allow_nan=False) + "\n"
        fd = os.open(os.path.join(self._dir, OPTIMIZER_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, text.encode("utf-8"))  # one write: a reader sees whole lines
        finally:
            os.close(fd)

    def _optimizer_summary(self) -> Dict[str, Any]:
        """summary.json's "optimizer_state" (docs/telemetry.md)."""
        opt = self._optimizer
        params = self._optimizer_params()
        elements = sum(_local(p).numel() for _, p, _ in params)
        measured = opt.state_bytes()
        per = {k: (measured[k] / elements if elements else 0.0) for k in ("params", "master", "m", "v")}
        formats = [{"tensors": len(g["params"]), "master": g["master"], "m": g["moments"][0], "v": g["moments"][1],
                    "block": g["block"], "fp8_per_tensor": g["fp8_per_tensor"], "rule": g["rule"],
                    "stochastic_rounding": g["stochastic_rounding"]} for g in opt.param_groups]
        rows = []
        for name, p, g in params:
            t = _local(p)
            n = t.numel()
            state = opt.state.get(p, {})

            def stored(fmt: str, key: str, signed: bool) -> str:
                # As stored: fp32 codes are fp32 (a DTensor shard's fallback); else the core's
                # layout, which keeps fp32 for small tensors of the blocked formats.
                codes = state.get(key)
                if codes is not None and codes.dtype == torch.float32:
                    return "fp32"
                return _core.moment_layout(fmt, signed, n, g["block"], g["fp8_per_tensor"])[0]

            row: Dict[str, Any] = {
                "name": name, "elements": n, "master": "fp32" if t.dtype == torch.float32 else g["master"],
                "m": stored(g["moments"][0], "exp_avg", True), "v": stored(g["moments"][1], "exp_avg_sq", False)}
            tot = self._opt_totals.get(name)
            if tot is not None and tot[0]:
                row.update(steps=int(tot[0]), m_error=_finite(tot[1] / tot[0]), m_error_max=_finite(tot[2]),
                           v_error=_finite(tot[3] / tot[0]), v_error_max=_finite(tot[4]),
                           lost_fraction=tot[5] / tot[6] if tot[6] else 0.0, meant=int(tot[6]))
            rows.append(row)
        k = len(self._opt_fractions)
        return {"optimizer": "mixprec.torch.optim.AdamW", "formats": formats, "elements": elements,
                "bytes": {key: int(measured[key]) for key in ("params", "master", "m", "v")},
                "bytes_per_param": per, "sampled_steps": k,
                "lost_update_fraction": sum(self._opt_fractions) / k if k else None, "params": rows}

    def _write_optimizer_summary(self) -> None:
        """Adds "optimizer_state" to the summary.json the core just wrote, atomically (a
        temporary of the run folder's pattern, fsynced, renamed over it); with measured steps,
        the summary's lost_update_fraction is their mean (the log's lines say 0 at every step)."""
        path = os.path.join(self._dir, "summary.json")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        state = self._optimizer_summary()
        doc["optimizer_state"] = state
        if state["lost_update_fraction"] is not None:
            doc["lost_update_fraction"] = state["lost_update_fraction"]
        tmp = os.path.join(self._dir, f".summary.json.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.lexists(tmp):
                os.remove(tmp)
            raise

    # ---- the end --------------------------------------------------------------------------

    def finish(self) -> List[Dict[str, Any]]:
        """Writes summary.json (totals and alerts, as mixprec train's); records may follow and a
        later finish() rewrites it. Returns the alerts raised (id, step, message, advice, and
        tensor for kurtosis-rise and block-spread-rise)."""
        if self._rec is None:
            raise RuntimeError(f"telemetry: the run folder '{self._dir}' is closed")
        # The per-tensor kinds (kurtosis-rise, block-spread-rise) name their tensor too.
        alerts = [dict(id=i, step=s, message=m, advice=a, **({"tensor": t} if t else {}))
                  for i, s, m, a, t in self._rec.finish()]
        if self._optimizer is not None:
            self._write_optimizer_summary()
        return alerts

    def close(self) -> List[Dict[str, Any]]:
        """finish(), then removes the hooks and releases the run folder's lock. Idempotent."""
        if self._rec is None:
            return []
        alerts = self.finish()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for h in self._handles + self._loc_handles:
            h.remove()
        self._handles = []
        self._loc_handles = []
        if self._scaler is not None:
            self._scaler._telemetry_amax = False
        if self._optimizer is not None:
            self._optimizer.collect_stats = False  # its steps stop measuring
        if self._advisor is not None:
            self._advisor.remove()
        _sample_step(self._lowp.values(), False)  # low-precision modules stop measuring
        self._lowp = {}
        self._loc_queue = ([], [])
        self._loc_read = ([], [])
        self._order_now = []
        self._rec = None  # the core's recorder goes: its lock on the folder with it
        return alerts

    def __enter__(self) -> "Telemetry":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def dir(self) -> str:
        return self._dir

    @property
    def steps(self) -> int:
        """The number of the last step recorded (0 before the first): the count of records
        unless record() was given step numbers."""
        return 0 if self._rec is None else self._rec.steps

    @property
    def last_localisation(self) -> Optional[Dict[str, Any]]:
        """Where the last recorded step's non-finite values began (None before the first record()
        and with localise="off"); a new dict at each record(). Modules are named as
        model.named_modules() names them; "units" are what the mode reduces at every step
        (auto: the repeated blocks, e.g. transformer.h.3, and the watched modules outside
        them, e.g. the embeddings and the LM head; full: every watched module).

        step                   the step's number
        nonfinite_forward      the first unit, in forward order, whose output held inf/NaN
                               (None when none did); the log's forward_nonfinite names it too,
                               but at sampled steps, where the sampled check names the first
                               watched output itself (a module inside the block)
        nonfinite_backward     the first watched module, in backward order (the reverse of the
                               order its output appeared in the last sampled forward), whose
                               parameters' gradients, as record() measured them, held inf/NaN:
                               its output gradient held inf/NaN (it came from the backward of a
                               module that reads this output), or its weight-gradient product
                               overflowed. Parameters two unrelated watched modules share (tied
                               embeddings) are left out: their gradient sums both uses
        outliers               [[unit, |max|], ...]: the (up to 3) units whose outputs had the
                               largest finite |max| in the step, largest first; with "auto" only
                               at a step that held inf/NaN ([] otherwise), with "full" always
        nonfinite_output_grad  localise="full" only: the first watched module, in backward order,
                               whose output gradient held inf/NaN (the tensor overflow_activation
                               counts at sampled steps)
        forward, backward      localise="full" only: [module, |max|, inf/NaN elements] for every
                               watched module (output / output gradient) in the order it ran;
                               |max| is NaN when a value was NaN, inf when one was inf and none NaN

        Outputs and gradients of every micro-batch of the step are included; evaluation forwards
        (torch.no_grad()) are not."""
        return self._last_localisation

    def seconds(self) -> float:
        """Wall time spent in the telemetry so far (its hooks, the core's counting and record())."""
        return self._seconds

    def __repr__(self) -> str:
        state = "closed" if self._rec is None else f"{self.steps} steps"
        return f"mixprec.torch.Telemetry({self._dir!r}, {self._precision}, {len(self._handles)} modules, {state})"
