"""mixprec.torch.optim.AdamW: AdamW with its master weights and moments in fewer bytes, one fused
pass per tensor in the core (docs/python.md, "mixprec.torch.optim.AdamW"; the formats are
written out in docs/optimizers.md, "State formats").

    opt = mixprec.torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                    master="remainder", moments="fp8")     # 4 bytes a parameter
    scaler = torch.amp.GradScaler("cpu")          # or mixprec.torch.GradScaler
    scaler.scale(loss).backward()
    scaler.step(opt)                              # unscale inside the step; inf/NaN: skipped
    scaler.update()

master:  "fp32" (an fp32 copy of each 16-bit parameter), "remainder" (bf16 parameters plus
         16 bits that rebuild the fp32 master exactly: Transformer Engine's
         store_param_remainders) or "none" (the 16-bit parameters are the only copy; with
         stochastic_rounding=True rounded stochastically, repeatable by `seed`). float32
         parameters are their own master whatever `master` says.
moments: "fp32", "bf16", "fp16" (TE: one scale per tensor), "fp8" (E4M3, a scale per block of
         256: torchao AdamWFp8; fp8_per_tensor=True: TE's one scale per tensor), "8bit"
         (torchao AdamW8bit) or "4bit" (torchao AdamW4bit); a pair (m, v) picks each. The
         blocked formats keep fp32 moments for tensors under 4096 elements or of a size that is
         not a multiple of the block, as torchao does.
rule:    whose fp32 arithmetic the update follows: "torch" (torch.optim.AdamW, the default),
         "torchao" (torchao's single_param_adam) or "te" (TE FusedAdam's kernel).

A skipped step (a GradScaler found inf/NaN) writes nothing: not the weights, not the master, not
a moment code or scale, and the step count stays. With torch.amp.GradScaler the gradients are
unscaled inside the fused pass (the optimizer declares _step_supports_amp_scaling; the scaler
hands it grad_scale and found_inf); mixprec.torch.GradScaler unscales them in its own check.

state_dict() holds the compact state as it is stored (codes, scales, remainders), so a checkpoint
is as small as the state and resuming continues bit for bit; each parameter group records its
formats, and load_state_dict() refuses a state saved under other formats.

FSDP2 (DTensor parameters): each rank steps its local shard, and state_dict() gives that shard's
state as DTensor shards over the parameter's mesh, so torch.distributed.checkpoint saves every
rank's part (a plain tensor it would save once, as a replica). Under Shard(0) the step equals the
unsharded one bit for bit where every shard of a tensor quantizes (at least 4096 elements, a
multiple of the block): otherwise all its shards keep fp32 moments. Per-tensor scales (fp16,
fp8_per_tensor) are per shard. Stochastic rounding draws each element's bits from its index in
the whole parameter, so shards round as the unsharded tensor does and none repeats another's.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.utils.dlpack import to_dlpack

from .. import _args, _core

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = ()  # type: ignore[assignment]
    Shard = None  # type: ignore[assignment]

__all__ = ["AdamW"]

_PLAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FORMAT_KEYS = ("master", "moments", "block", "fp8_per_tensor", "rule", "stochastic_rounding", "seed")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if DTensor and isinstance(t, DTensor) else t


def _moments(v: Any) -> Tuple[str, str]:
    if isinstance(v, str):
        return v, v
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, str) for x in v):
        return v[0], v[1]
    raise TypeError(f"moments: expected a format name or a pair (m, v) of names ({_core.moment_format_names()}), "
                    f"found {_args._shown(v)}")


def _stored_format(fmt: str, codes: torch.Tensor) -> str:
    """The format a moment is stored in: fp32 codes are fp32 whatever the group's format (the
    blocked formats' fallback for small tensors, or a DTensor parameter's, see _Sharding)."""
    return "fp32" if codes.dtype == torch.float32 else fmt


# ---- DTensor (FSDP2) parameters ----------------------------------------------------------------

_Coord = Tuple[int, ...]
_Shape = Tuple[int, ...]
_View = Tuple[_Shape, Tuple[Any, ...], _Shape]  # global shape, placements, this rank's local shape


def _chunk(size: int, parts: int, index: int) -> int:
    """Length of piece `index` of `size` split into `parts` as DTensor's Shard splits it
    (torch.chunk: ceil(size / parts) each, the last pieces shorter or empty)."""
    full = -(-size // parts)
    start = min(full * index, size)
    return min(size, start + full) - start


def _shard_shapes(shape: _Shape, mesh_shape: _Shape, placements: Tuple[Any, ...]) -> Optional[Dict[_Coord, _Shape]]:
    """The local shape at every mesh coordinate of a DTensor of global `shape`; None where a
    placement is neither Shard nor Replicate (_StridedShard, Partial)."""
    out = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        local = list(shape)
        for i, pl in enumerate(placements):
            if type(pl) is Shard:
                local[pl.dim] = _chunk(local[pl.dim], mesh_shape[i], coord[i])
            elif not pl.is_replicate():
                return None
        out[coord] = tuple(local)
    return out


def _shard_key(coord: _Coord, placements: Tuple[Any, ...]) -> _Coord:
    """Which shard a coordinate holds: its indices on the sharded mesh dimensions (replicas share it)."""
    return tuple(c for c, pl in zip(coord, placements) if type(pl) is Shard)


def _contiguous_stride(shape: _Shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


class _Sharding:
    """How the state of one DTensor parameter lies over its mesh, worked out from its global shape
    and placements alone (no communication), the same on every rank:

    - formats: the moment formats its shards store. A blocked format (fp8, 8bit, 4bit) is kept
      only when every shard would quantize (at least 4096 elements, a multiple of the block) and
      its codes and scales split as DTensor shards; otherwise every shard keeps fp32 moments, so
      all ranks hold the same dtypes. Under Shard(0) the blocks then never straddle a shard
      boundary, and the state is the unsharded tensor's, split.
    - views: each state tensor's DTensor layout (global shape, placements, this rank's local
      shape), in which state_dict() presents it: torch.distributed.checkpoint saves a plain
      tensor once (as replicated), so every shard's state has to be a DTensor shard.
    - offset: the index of this shard's first element among the parameter's elements (the sum of
      the sizes of the shards before it): stochastic rounding draws element i's bits from
      (seed, step, index), so under Shard(0) a shard rounds as the unsharded tensor does and no two
      shards reuse bits; replicas share their shard's offset and stay equal.
    Placements other than Shard and Replicate (_StridedShard) leave `views` None."""

    def __init__(self, p: torch.Tensor, group: Dict[str, Any]) -> None:
        mesh = p.device_mesh
        self.mesh = mesh
        self.placements = tuple(p.placements)
        self.shape = tuple(p.shape)
        self.local_shape = tuple(p.to_local().shape)
        coord = mesh.get_coordinate()
        mesh_shape = tuple(mesh.shape)
        shapes = _shard_shapes(self.shape, mesh_shape, self.placements)
        self.formats = tuple(group["moments"])
        self.views: Optional[Dict[str, _View]] = None
        self.offset = 0
        if shapes is None or coord is None:
            return
        mine = tuple(coord)
        sizes: Dict[_Coord, int] = {}
        for c, s in shapes.items():
            sizes.setdefault(_shard_key(c, self.placements), math.prod(s))
        key = _shard_key(mine, self.placements)
        self.offset = sum(n for k, n in sizes.items() if k < key)
        views: Dict[str, _View] = {}
        formats: List[str] = []
        for name, fmt, signed in (("exp_avg", self.formats[0], True), ("exp_avg_sq", self.formats[1], False)):
            found = self._moment_views(name, fmt, signed, shapes, mesh_shape, mine, group)
            if found is None:
                fmt = "fp32"
                found = self._moment_views(name, fmt, signed, shapes, mesh_shape, mine, group)
            formats.append(fmt)
            views.update(found)
        for name in ("master", "master_remainder"):
            views[name] = (self.shape, self.placements, shapes[mine])
        self.formats = tuple(formats)
        self.views = views

    def _moment_views(self, name: str, fmt: str, signed: bool, shapes: Dict[_Coord, _Shape], mesh_shape: _Shape,
                      mine: _Coord, group: Dict[str, Any]) -> Optional[Dict[str, _View]]:
        codes: Dict[_Coord, _Shape] = {}
        scales: Dict[_Coord, _Shape] = {}
        stored = set()
        for c, s in shapes.items():
            kind, _, nbytes, nscales = _core.moment_layout(fmt, signed, math.prod(s), group["block"],
                                                           group["fp8_per_tensor"])
            stored.add(kind)
            codes[c] = s if kind in _PLAIN_DTYPES else (nbytes,)
            scales[c] = (nscales,)
        if len(stored) != 1:
            return None  # some shards would quantize, others fall back to fp32
        out = {}
        for key, local in ((name, codes), (name + "_scale", scales)):
            view = self._global_view(local, shapes, mesh_shape)
            if view is None:
                return None
            out[key] = view + (_shard_shapes(view[0], mesh_shape, view[1])[mine],)
        return out

    def _global_view(self, local: Dict[_Coord, _Shape], shapes: Dict[_Coord, _Shape],
                     mesh_shape: _Shape) -> Optional[Tuple[_Shape, Tuple[Any, ...]]]:
        """A global shape and placements whose local shapes hold, at every coordinate, as many
        elements as that coordinate's state tensor: laid out as the parameter (one value per
        element), flat (the shards' tensors one after another), or by rows of the parameter."""
        size = {c: math.prod(s) for c, s in local.items()}
        candidates = []
        if all(size[c] == math.prod(shapes[c]) for c in local):
            candidates.append((self.shape, self.placements))
        firsts: Dict[_Coord, int] = {}
        for c in local:
            firsts.setdefault(_shard_key(c, self.placements), size[c])
        candidates.append(((sum(firsts.values()),), tuple(Shard(0) if type(pl) is Shard else pl
                                                          for pl in self.placements)))
        if self.shape and all(type(pl) is not Shard or pl.dim == 0 for pl in self.placements):
            per_row = {size[c] // shapes[c][0] for c in local if shapes[c][0]}
            if len(per_row) == 1:
                candidates.append(((self.shape[0], per_row.pop()), self.placements))
        for shape, placements in candidates:
            split = _shard_shapes(shape, mesh_shape, placements)
            if all(math.prod(split[c]) == size[c] for c in local):
                return shape, placements
        return None

    def as_dtensor(self, key: str, x: torch.Tensor, where: str) -> torch.Tensor:
        """State tensor `x` (this rank's) as its DTensor shard, sharing its memory."""
        view = None if self.views is None else self.views.get(key)
        if view is None and tuple(x.shape) == self.local_shape:
            view = (self.shape, self.placements, self.local_shape)  # laid out as the parameter
        if view is None:
            raise ValueError(f"state_dict: {where}['{key}']: expected a DTensor parameter placed by Shard or "
                             f"Replicate (its state's layout over the mesh follows from them), found placements "
                             f"{self.placements}")
        shape, placements, local = view
        if x.numel() != math.prod(local):
            raise ValueError(f"state_dict: {where}['{key}']: expected {math.prod(local)} elements (this rank's shard "
                             f"of {shape}), found {x.numel()}")
        return DTensor.from_local(x.view(local), self.mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))


class AdamW(torch.optim.Optimizer):
    """AdamW (Adam with decoupled=False) over compact state; see the module docstring."""

    _step_supports_amp_scaling = True
    # Telemetry sets collect_stats on the steps it samples; the step then measures each tensor's
    # moment quantization error and lost updates in its pass: last_stats[p] = (m relative error,
    # v relative error, lost fraction, elements meant to move) of the last applied step.
    collect_stats: bool = False
    last_stats: Optional[Dict[torch.Tensor, Tuple[float, float, float, int]]] = None

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, master: str = "fp32",
                 moments: Union[str, Tuple[str, str]] = "fp32", block: int = 0, fp8_per_tensor: bool = False,
                 rule: str = "torch", stochastic_rounding: bool = False, seed: int = 0, decoupled: bool = True):
        lr = _args.real("lr", lr)
        eps = _args.real("eps", eps)
        weight_decay = _args.real("weight_decay", weight_decay)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr: expected a finite number >= 0, found {lr!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps: expected a finite number >= 0, found {eps!r}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay: expected a finite number >= 0, found {weight_decay!r}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise TypeError(f"betas: expected a pair of numbers in [0, 1), found {_args._shown(betas)}")
        betas = (_args.real("betas[0]", betas[0]), _args.real("betas[1]", betas[1]))
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]: expected a number in [0, 1), found {b!r}")
        m, v = _moments(moments)
        master = _args.word("master", master)
        rule = _args.word("rule", rule)
        if rule not in ("torch", "torchao", "te"):
            raise ValueError(f"rule: expected one of torch, torchao, te, found {rule!r}")
        block = _args.integer("block", block, 0, 1024)
        fp8_per_tensor = _args.flag("fp8_per_tensor", fp8_per_tensor)
        stochastic_rounding = _args.flag("stochastic_rounding", stochastic_rounding)
        seed = _args.uint64("seed", seed)
        _core.state_bytes_per_param(master, m, v, block, fp8_per_tensor)  # ValueError naming a bad format
        if stochastic_rounding and master != "none":
            raise ValueError(f"stochastic_rounding: expected master='none' (the 16-bit weights are the only copy), "
                             f"found master={master!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=bool(decoupled),
                        master=master, moments=(m, v), block=block, fp8_per_tensor=fp8_per_tensor, rule=rule,
                        stochastic_rounding=stochastic_rounding, seed=seed)
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                self._check_param(p, group, f"param_groups[{gi}]['params'][{pi}]")

    @staticmethod
    def _check_param(p: torch.Tensor, group: Dict[str, Any], where: str) -> None:
        t = _local(p)
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{where}: expected a float32, float16 or bfloat16 parameter, found {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"{where}: expected a CPU parameter (the fused step runs in the CPU core), found {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: expected a contiguous parameter (the step writes it in place)")
        if group["master"] == "remainder" and t.dtype == torch.float16:
            raise ValueError(f"{where}: master='remainder' expected bfloat16 (or float32) parameters, found float16")
        if group["stochastic_rounding"] and t.dtype == torch.float32:
            raise ValueError(f"{where}: stochastic_rounding expected 16-bit parameters, found float32")

    # ---- state --------------------------------------------------------------------------------

    def _master_kind(self, p: torch.Tensor, group: Dict[str, Any]) -> str:
        return "fp32" if p.dtype == torch.float32 else group["master"]

    def _moment_storage(self, t: torch.Tensor, fmt: str, signed: bool, group: Dict[str, Any]):
        stored, _, nbytes, nscales = _core.moment_layout(fmt, signed, t.numel(), group["block"], group["fp8_per_tensor"])
        if stored in _PLAIN_DTYPES:
            codes = torch.zeros(t.shape, dtype=_PLAIN_DTYPES[stored])
        else:
            codes = torch.zeros(nbytes, dtype=torch.uint8)
        return codes, torch.zeros(nscales, dtype=torch.float32)

    def _init_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        t = _local(p).detach()
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        m, v = self._sharding(p, group).formats if isinstance(p, DTensor) else group["moments"]
        state["exp_avg"], state["exp_avg_scale"] = self._moment_storage(t, m, True, group)
        state["exp_avg_sq"], state["exp_avg_sq_scale"] = self._moment_storage(t, v, False, group)
        kind = self._master_kind(t, group)
        if kind == "fp32" and t.dtype != torch.float32:
            state["master"] = t.float().contiguous()
        elif kind == "remainder":
            state["master_remainder"] = torch.zeros(t.shape, dtype=torch.int16)  # the bf16 weight exactly
        return state

    def _sharding(self, p: torch.Tensor, group: Dict[str, Any]) -> _Sharding:
        """The layout of DTensor parameter p's state over its mesh (_Sharding), worked out once."""
        cache = self.__dict__.setdefault("_shardings", {})
        found = cache.get(p)
        if found is None:
            found = cache[p] = _Sharding(p, group)
        return found

    def master_weights(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 weights of record of `p` (its master, rebuilt from the remainder, or the
        parameter itself), as a new tensor."""
        t = _local(p).detach()
        state = self.state.get(p, {})
        if "master" in state:
            return state["master"].clone()
        if "master_remainder" in state:
            out = torch.empty(t.shape, dtype=torch.float32)
            _core.join_master(to_dlpack(t), to_dlpack(state["master_remainder"]), to_dlpack(out))
            return out
        return t.float().clone()

    def dequantized_moments(self, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of `p` in float32, decoded from their stored formats."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        state = self.state[p]
        t = _local(p)
        out = []
        for key, fmt, signed in (("exp_avg", group["moments"][0], True), ("exp_avg_sq", group["moments"][1], False)):
            x = torch.empty(t.shape, dtype=torch.float32)
            fmt = _stored_format(fmt, state[key])
            _core.dequantize_moment(to_dlpack(x), fmt, signed, group["block"], group["fp8_per_tensor"],
                                    to_dlpack(state[key]), to_dlpack(state[key + "_scale"]))
            out.append(x)
        return out[0], out[1]

    def state_bytes(self) -> Dict[str, int]:
        """Bytes held by the optimizer state, measured from its tensors: master, m, v (codes and
        scales), and the parameters they belong to."""
        total = {"master": 0, "m": 0, "v": 0, "params": 0}
        for group in self.param_groups:
            for p in group["params"]:
                t = _local(p)
                total["params"] += t.numel() * t.element_size()
                s = self.state.get(p, {})
                for key, part in (("master", "master"), ("master_remainder", "master"), ("exp_avg", "m"),
                                  ("exp_avg_scale", "m"), ("exp_avg_sq", "v"), ("exp_avg_sq_scale", "v")):
                    if key in s:
                        total[part] += s[key].numel() * s[key].element_size()
        return total

    # ---- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            return loss  # skipped: nothing is written, the step count stays
        grad_scale = getattr(self, "grad_scale", None)
        # torch.amp.GradScaler's fused protocol: the kernel multiplies by 1 / scale (exact for
        # the powers of two a GradScaler uses).
        inv_scale = 1.0 if grad_scale is None else float(1.0 / grad_scale.double())
        first_index = 0
        stats: Dict[torch.Tensor, Tuple[float, float, float, int]] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            m, v = group["moments"]
            for p in group["params"]:
                t = _local(p)
                n = p.numel()  # a DTensor's: the whole parameter's
                if p.grad is None:
                    first_index += n
                    continue
                g = _local(p.grad)
                if g.is_sparse:
                    raise RuntimeError("mixprec.torch.optim.AdamW does not support sparse gradients")
                g = g.detach().contiguous()
                state = self.state[p] if len(self.state[p]) else self._init_state(p, group)
                master_buf = state.get("master", state.get("master_remainder"))
                step = int(state["step"].item()) + 1
                # The element index stochastic rounding draws from: the parameter's place among all
                # parameters' elements, plus this shard's among its own (_Sharding.offset).
                index = first_index + (self._sharding(p, group).offset if isinstance(p, DTensor) else 0)
                s = _core.adam_tensor_step(
                    to_dlpack(t.detach()), to_dlpack(g), self._master_kind(t, group),
                    None if master_buf is None else to_dlpack(master_buf),
                    _stored_format(m, state["exp_avg"]), to_dlpack(state["exp_avg"]), to_dlpack(state["exp_avg_scale"]),
                    _stored_format(v, state["exp_avg_sq"]), to_dlpack(state["exp_avg_sq"]),
                    to_dlpack(state["exp_avg_sq_scale"]),
                    group["block"], group["fp8_per_tensor"], group["rule"], float(group["lr"]), beta1, beta2,
                    group["eps"], group["weight_decay"], group["decoupled"], step, inv_scale, 1.0,
                    group["stochastic_rounding"], group["seed"], index, bool(self.collect_stats),
                    torch.get_num_threads())
                if s is not None:  # (m_err_sq, m_sq, v_err_sq, v_sq, meant, lost)
                    stats[p] = (math.sqrt(s[0] / s[1]) if s[1] > 0 else 0.0, math.sqrt(s[2] / s[3]) if s[3] > 0 else 0.0,
                                s[5] / s[4] if s[4] else 0.0, int(s[4]))
                state["step"] += 1
                first_index += n
        if self.collect_stats:
            self.last_stats = stats
        return loss

    # ---- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """torch's state_dict: the state tensors themselves, as stored. A DTensor (FSDP2)
        parameter's are DTensor shards over its mesh (_Sharding.views), as torch's AdamW state of
        a DTensor parameter is: torch.distributed.checkpoint saves a plain tensor once, taking it
        for a replica, where each rank holds another shard's state."""
        sd = super().state_dict()
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        where = [(gi, pi, p, group) for gi, group in enumerate(self.param_groups)
                 for pi, p in enumerate(group["params"])]
        for pid, (gi, pi, p, group) in zip(ids, where):
            if isinstance(p, DTensor) and pid in sd["state"]:
                sharding = self._sharding(p, group)
                sd["state"][pid] = {
                    key: (sharding.as_dtensor(key, x, f"state[{pid}] (param_groups[{gi}]['params'][{pi}])")
                          if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and key != "step" else x)
                    for key, x in sd["state"][pid].items()}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's load_state_dict, then the stored state tensors put back in their own dtypes
        (torch would cast floating state to the parameter's dtype). A state saved under other
        formats is refused before anything changes."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: expected {len(self.param_groups)} parameter groups, "
                             f"found {len(saved_groups)}")
        for i, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            for key in _FORMAT_KEYS:
                a, b = mine[key], saved.get(key)
                if (tuple(a) if isinstance(a, (list, tuple)) else a) != (tuple(b) if isinstance(b, (list, tuple)) else b):
                    raise ValueError(f"load_state_dict: param_groups[{i}]['{key}']: expected {a!r} (this optimizer's "
                                     f"formats), found {b!r}")
        saved_state = {k: {n: (x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x)) for n, x in s.items()}
                       for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            if pid in saved_state:
                # DTensor shards (state_dict()'s for a DTensor parameter, or what
                # torch.distributed.checkpoint loaded into them) go back to this rank's tensors in
                # the shapes the step keeps: codes and scales flat, the rest shaped as the parameter.
                self.state[p] = {key: self._stored(key, x, p) for key, x in saved_state[pid].items()}
        for group in self.param_groups:
            group["moments"] = tuple(group["moments"])

    @staticmethod
    def _stored(key: str, x: Any, p: torch.Tensor) -> Any:
        if not (DTensor and isinstance(x, DTensor)):
            return x
        x = x.to_local()
        flat = key.endswith("_scale") or (key in ("exp_avg", "exp_avg_sq") and x.dtype == torch.uint8)
        return x.reshape(-1) if flat else x.reshape(_local(p).shape)
