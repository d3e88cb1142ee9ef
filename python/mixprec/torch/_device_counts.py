"""Telemetry's counting with torch operations, on the device where the tensors lie (a GPU):
the numbers the core's counting pass computes from CPU memory (include/mixprec/formats/count.hpp),
without moving a tensor to the host. Every result stays on the device as a small int64 tensor;
mixprec.torch.Telemetry gathers them and reads them all at record() in one host copy per device,
then hands them to the core's recorder, which turns them into the log line's counts with the
same function as its own (counted_from_profile).

What is computed, per tensor (float32/float16/bfloat16; any other dtype counted as float32, as
the core path converts it):
- profile(t): for each of the core's five class bounds (count_bounds), how many magnitudes
  (the tensor's words with the sign bit cleared) lie above it, and the largest magnitude;
- nonfinite(t): 1 when t holds inf or NaN (a forward output's check);
- amax_bits(ts): each tensor's largest |value| as float32 magnitude bits (parameters: one
  multi-tensor reduction per dtype, torch._foreach_norm(inf); NaN lies above inf's bits);
- histogram(t, stride): the core's Log2Histogram of every stride-th value (bins, zeros, nonfinite).

The same code runs on CPU tensors when Telemetry(counting="torch"): the tests compare it there,
element class by element class, with the core (tests/python/test_telemetry_device_counts.py),
so the path a GPU user runs is tested on every machine.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .. import _core

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Per dtype: its integer view, the sign-cleared mask and the core's five class bounds.
_VIEW: Dict[torch.dtype, Tuple[torch.dtype, int, Tuple[int, ...]]] = {
    torch.float32: (torch.int32, 0x7FFFFFFF, tuple(_core.count_bounds("float32"))),
    torch.float16: (torch.int16, 0x7FFF, tuple(_core.count_bounds("float16"))),
    torch.bfloat16: (torch.int16, 0x7FFF, tuple(_core.count_bounds("bfloat16"))),
}
MIN_EXP, MAX_EXP, HISTOGRAM_STRIDE = _core.HISTOGRAM_LAYOUT
_BINS = MAX_EXP - MIN_EXP + 1
_F32_INF_BITS = 0x7F800000


def readable(t: torch.Tensor) -> torch.Tensor:
    """t detached, as real values in memory: a sparse tensor by its stored values (its implicit
    zeros change no |max|), a complex one by its magnitudes |z|, a view with the negative bit
    (x.conj().imag) with its sign resolved."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.coalesce().values() if t.layout == torch.sparse_coo else t.values()
    if t.is_complex():
        return t.abs()
    return t.resolve_neg() if t.is_neg() else t


def counted(t: torch.Tensor) -> torch.Tensor:
    """t as readable() gives it, in a dtype the counting reads (float32 for any other)."""
    t = readable(t)
    return t if t.dtype in _DTYPES else t.float()


def dtype_name(t: torch.Tensor) -> str:
    return _NAMES[t.dtype]


def _magnitudes(t: torch.Tensor) -> torch.Tensor:
    view, mask, _ = _VIEW[t.dtype]
    return t.view(view) & mask


def profile(t: torch.Tensor) -> torch.Tensor:
    """int64[6] on t's device: how many magnitudes lie above each class bound, then the largest
    magnitude (t as counted() gives it)."""
    if t.numel() == 0:
        return torch.zeros(6, dtype=torch.int64, device=t.device)
    m = _magnitudes(t)
    parts = [(m > b).sum() for b in _VIEW[t.dtype][2]]
    parts.append(m.max().to(torch.int64))
    return torch.stack(parts)


def nonfinite(t: torch.Tensor) -> torch.Tensor:
    """int64[1]: 1 when t (as counted() gives it) holds inf or NaN."""
    if t.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=t.device)
    return (_magnitudes(t) > _VIEW[t.dtype][2][4]).any().to(torch.int64).reshape(1)


def amax_bits(tensors: List[torch.Tensor]) -> Tuple[torch.Tensor, List[int]]:
    """(bits, order): int64 bits[j] is tensors[order[j]]'s largest |value| as float32 magnitude
    bits (above inf's when it holds NaN); empty tensors are left out (their |max| is 0). One
    torch._foreach_norm(inf) per dtype, nothing copied to the device."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            by_dtype.setdefault(t.dtype, []).append(i)
    parts, order = [], []
    for idx in by_dtype.values():
        norms = torch._foreach_norm([tensors[i] for i in idx], float("inf"))
        parts.append(torch.stack(norms).float().view(torch.int32).to(torch.int64) & 0x7FFFFFFF)
        order.extend(idx)
    if not parts:
        return torch.zeros(0, dtype=torch.int64), []
    return torch.cat(parts), order


def histogram(t: torch.Tensor, stride: int) -> torch.Tensor:
    """int64[bins + 2]: the core's Log2Histogram of every stride-th value of t (flattened):
    floor(log2|x|) clamped to [MIN_EXP, MAX_EXP], then zeros, then inf/NaN."""
    x = t.reshape(-1)[::stride].float()
    bits = x.view(torch.int32) & 0x7FFFFFFF
    zero = bits == 0
    bad = bits >= _F32_INF_BITS
    exponent = torch.frexp(x).exponent - 1  # floor(log2|x|) for finite nonzero x, subnormals too
    index = (exponent.clamp(MIN_EXP, MAX_EXP) - MIN_EXP).masked_fill(zero | bad, _BINS)
    bins = torch.bincount(index.reshape(-1), minlength=_BINS + 1)[:_BINS]
    return torch.cat([bins.to(torch.int64), zero.sum().reshape(1), bad.sum().reshape(1)])


def f32_from_bits(bits: int) -> float:
    """A float32 magnitude from its bits, inf for inf/NaN (the core's amax convention)."""
    if bits >= _F32_INF_BITS:
        return float("inf")
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()
