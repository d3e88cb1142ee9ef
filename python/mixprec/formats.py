"""Counted conversions between float32 arrays and the low-precision formats (docs/python.md).

Every conversion is the C++ core's (``mixprec::convert_counted``, ``convert_stochastic``,
``convert``); this module only names the options. Arrays are passed without copies: the input
must be a C-contiguous float32 array (NumPy, or anything exporting the buffer protocol or
DLPack on the CPU); anything else raises ``TypeError`` (wrong type or dtype) or ``ValueError``
(strided view, read-only ``out``, wrong size), naming what was expected and what was found.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np

from . import _args, _core

ConversionStats = _core.ConversionStats

#: The formats ``encode``/``decode`` accept (the core's names).
FORMATS: Tuple[str, ...] = tuple(_core.FORMATS)

def _input(name: str, x: Any) -> Any:
    """An input array as the core reads it (its memory, through DLPack or the buffer protocol):
    a torch view whose negative or conjugate bit is set (x.conj().imag) is resolved first, since
    its memory holds the values without that sign; a meta tensor is refused by name."""
    dt = getattr(x, "dtype", None)
    if getattr(dt, "isnative", True) is False:  # NumPy: big-endian on this machine
        raise TypeError(f"{name}: expected float32 in this machine's byte order, found {dt.str} (byte-swapped); "
                        f"convert it first: x.astype(numpy.float32)")
    if getattr(x, "is_meta", False):
        raise TypeError(f"{name}: a meta tensor has no values to convert; expected a CPU array")
    if callable(getattr(x, "is_neg", None)) and x.is_neg():
        x = x.resolve_neg()
    if callable(getattr(x, "is_conj", None)) and x.is_conj():
        x = x.resolve_conj()
    return x


def _scale(scale: Any) -> float:
    """The scale as the core takes it: a number whose float32 is finite and > 0 (the core rounds it
    to float32; the message names the value given, not the rounded one)."""
    v = _args.real("scale", scale)
    with np.errstate(over="ignore"):
        f32 = float(np.float32(v))
    if not (math.isfinite(v) and f32 > 0 and math.isfinite(f32)):
        raise ValueError(f"scale: expected a finite number > 0 that float32 holds (in [1.4e-45, 3.4028235e+38]), "
                         f"found {v!r}")
    return v


def _text(name: str, v: Any) -> str:
    """A choice argument (format, overflow, subnormals): a str, whose value the core checks."""
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected a str, found {type(v).__name__} {v!r}"[:200])
    return v


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
        return _core.encode(_input("x", x), _text("format", format), _text("overflow", overflow),
                            _text("subnormals", subnormals), _scale(scale), out)
    if rounding == "stochastic":
        if random is None:
            raise ValueError(
                "random: rounding='stochastic' needs one uint32 of random bits per element, found None")
        codes = _core.encode_stochastic(_input("x", x), _text("format", format), random, _text("overflow", overflow),
                                        _text("subnormals", subnormals), _scale(scale), out)
        return codes, None
    raise ValueError(f"rounding: expected 'nearest' or 'stochastic', found {rounding!r}"[:200])


def decode(codes: Any, format: str, *, subnormals: str = "keep", scale: float = 1.0, out: Any = None):
    """Convert ``format`` codes back to float32 (exact), times ``scale``.

    subnormals "flush" reads a subnormal code as +-0. ``out``: optional C-contiguous float32
    array with codes.size elements, written in place. Returns the float32 array.
    """
    return _core.decode(_input("codes", codes), _text("format", format), _text("subnormals", subnormals),
                        _scale(scale), out)


def stats_dict(stats: Optional[ConversionStats]) -> Optional[dict]:
    """A ConversionStats as a plain dict (None stays None)."""
    if stats is None:
        return None
    return {k: getattr(stats, k)
            for k in ("elements", "nonzero", "nonfinite_input", "underflow", "subnormal", "overflow")}
