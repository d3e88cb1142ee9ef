"""Counted conversions between float32 arrays and the low-precision formats (docs/python.md).

Every conversion is the C++ core's (``mixprec::convert_counted``, ``convert_stochastic``,
``convert``); this module only names the options. Arrays are passed without copies: the input
must be a C-contiguous float32 array (NumPy, or anything exporting the buffer protocol or
DLPack on the CPU); anything else raises ``TypeError`` (wrong type or dtype) or ``ValueError``
(strided view, read-only ``out``, wrong size), naming what was expected and what was found.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _core

ConversionStats = _core.ConversionStats

#: The formats ``encode``/``decode`` accept (the core's names).
FORMATS: Tuple[str, ...] = tuple(_core.FORMATS)

def encode(
    x: Any,
    format: str,
    *,
    overflow: str = "ieee",
    subnormals: str = "keep",
    scale: float = 1.0,
    rounding: str = "nearest",
    random: Any = None,
    out: Any = None,
):
    """Convert float32 ``x * scale`` to ``format`` codes.

    format      "f16", "bf16", "f8e4m3" or "f8e5m2".
    overflow    "ieee": past max finite gives +-inf (NaN for f8e4m3, which has no inf);
                "saturate": +-max finite, for +-inf inputs too.
    subnormals  "keep" (gradual underflow) or "flush" (a subnormal result becomes +-0).
    scale       finite > 0; the product is rounded to float32 first.
    rounding    "nearest" (ties to even) or "stochastic" (needs ``random``: one uint32 of
                random bits per element, C-contiguous, e.g.
                ``numpy.random.default_rng(seed).integers(0, 2**32, x.size, dtype=numpy.uint32)``).
    out         optional C-contiguous array of the codes' dtype (uint16 for f16/bf16, float16
                also for f16; uint8 for the fp8 formats) with x.size elements, written in place.

    Returns ``(codes, stats)``: the codes array (``out`` itself when given, else a new array
    shaped like ``x``) and the core's ``ConversionStats`` (elements, nonzero, nonfinite_input,
    underflow, subnormal, overflow). Stochastic rounding returns ``stats = None``: the core
    counts round-to-nearest-even conversions only.
    """
    if rounding == "nearest":
        if random is not None:
            raise ValueError("random: only used with rounding='stochastic', found rounding='nearest'")
        return _core.encode(x, format, overflow, subnormals, float(scale), out)
    if rounding == "stochastic":
        if random is None:
            raise ValueError(
                "random: rounding='stochastic' needs one uint32 of random bits per element, found None")
        codes = _core.encode_stochastic(x, format, random, overflow, subnormals, float(scale), out)
        return codes, None
    raise ValueError(f"rounding: expected 'nearest' or 'stochastic', found {rounding!r}")


def decode(codes: Any, format: str, *, subnormals: str = "keep", scale: float = 1.0, out: Any = None):
    """Convert ``format`` codes back to float32 (exact), times ``scale``.

    subnormals "flush" reads a subnormal code as +-0. ``out``: optional C-contiguous float32
    array with codes.size elements, written in place. Returns the float32 array.
    """
    return _core.decode(codes, format, subnormals, float(scale), out)


def stats_dict(stats: Optional[ConversionStats]) -> Optional[dict]:
    """A ConversionStats as a plain dict (None stays None)."""
    if stats is None:
        return None
    return {k: getattr(stats, k)
            for k in ("elements", "nonzero", "nonfinite_input", "underflow", "subnormal", "overflow")}
