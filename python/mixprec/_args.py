"""Argument checks at the Python edge: each names the argument and the rule, so that no
nanobind argument dump or C++ exception text reaches a user (docs/bad_inputs.md).

Numbers are taken as torch.amp takes them: Python and NumPy numbers (np.float64, np.int32),
0-dim tensors through __float__/__index__, and integral floats where an integer is expected
(growth_interval=20.0, tokens=3.0); 2.9 for an integer is refused, never truncated. bool is
not a number here.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import struct
from typing import Any, Optional

_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1
_FLT_MAX = 3.4028234663852886e38


def _shown(v: Any) -> str:
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(v).__name__} {text}" if not isinstance(v, (int, float)) else text


def flag(name: str, v: Any) -> bool:
    """v as a bool: True or False (NumPy's bool_ too); TypeError naming `name` otherwise (1, "yes",
    None are not flags)."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return bool(v)
    raise TypeError(f"{name}: expected True or False, found {_shown(v)}")


def word(name: str, v: Any) -> str:
    """v as a str (a name from a list the core checks next); TypeError naming `name` otherwise."""
    if isinstance(v, str):
        return v
    raise TypeError(f"{name}: expected a str, found {_shown(v)}")


def real(name: str, v: Any) -> float:
    """v as a float: a real number (Python, NumPy, a 1-element tensor); TypeError naming `name`."""
    if type(v) is float:  # the common case first: record() checks several numbers every step
        return v
    if isinstance(v, (bool, str, bytes)) or v is None:
        raise TypeError(f"{name}: expected a number, found {_shown(v)}")
    if isinstance(v, numbers.Real):
        return float(v)
    if hasattr(v, "numel") and hasattr(v, "item"):  # a torch tensor: one element, real
        if v.numel() != 1 or v.is_complex():
            raise TypeError(f"{name}: expected a number or a 1-element real tensor, found a tensor of shape "
                            f"{tuple(v.shape)} and dtype {v.dtype}")
        return float(v.item())
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, found {_shown(v)}") from None


def integer(name: str, v: Any, low: int, high: int) -> int:
    """v as an int in [low, high]: an integer (Python, NumPy, a 1-element integer tensor) or a
    float with an integral value; ValueError/TypeError naming `name` and the range otherwise."""
    if type(v) is int and low <= v <= high:  # the common case first
        return v
    rng = f"[{low}, 2**{high.bit_length()})" if high in (_INT64_MAX, _UINT64_MAX) else f"[{low}, {high}]"
    if isinstance(v, (bool, str, bytes)) or v is None:
        raise TypeError(f"{name}: expected an integer in {rng}, found {_shown(v)}")
    if isinstance(v, numbers.Integral):
        i = int(v)
    elif isinstance(v, numbers.Real) or (hasattr(v, "numel") and hasattr(v, "item")):
        f = real(name, v)
        if not (math.isfinite(f) and f == math.floor(f)):
            raise ValueError(f"{name}: expected an integer in {rng}, found {f!r} (not truncated)")
        i = int(f)
    else:
        try:
            i = operator.index(v)
        except TypeError:
            raise TypeError(f"{name}: expected an integer in {rng}, found {_shown(v)}") from None
    if not low <= i <= high:
        raise ValueError(f"{name}: expected an integer in {rng}, found {i}")
    return i


def uint64(name: str, v: Any) -> int:
    return integer(name, v, 0, _UINT64_MAX)


def optional_real(name: str, v: Any) -> Optional[float]:
    return None if v is None else real(name, v)


def float32(name: str, v: Any, positive: bool) -> float:
    """v as a float32 parameter takes a Python float (TE's float parameters): the nearest float32
    (0.1, 1e-12). The rule (finite, > 0 or >= 0, within float32's range, and a positive value
    not rounding to 0) is checked on the value as given, and the message shows it as given."""
    f = real(name, v)
    ok = math.isfinite(f) and (f > 0 if positive else f >= 0) and f <= _FLT_MAX
    f32 = struct.unpack("f", struct.pack("f", f))[0] if ok else 0.0
    if not ok or (positive and f32 == 0.0):
        held = "[1.4e-45, 3.4028235e+38]" if positive else "[0, 3.4028235e+38]"
        raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'} that float32 holds "
                         f"(in {held}), found {f!r}")
    return f32


def module_names(name: str, v: Any, once: str) -> list:
    """v as a list of distinct module names: an iterable of str. A str alone is refused (iterating
    it would give its characters: modules="fc" is not ["f", "c"]), as are other items and a name
    given twice (`once` says why it must be unique). A predicate is the caller's to take first."""
    if isinstance(v, (str, bytes)):
        raise TypeError(f"{name}: expected an iterable of module names or a predicate, found the str "
                        f"{v!r} (one module: [{v!r}])")
    try:
        names = list(v)
    except TypeError:
        raise TypeError(f"{name}: expected None, an iterable of module names or a predicate (name, module) "
                        f"-> bool, found {type(v).__name__}") from None
    for w in names:
        if not isinstance(w, str):
            raise TypeError(f"{name}: expected module names (str), found {type(w).__name__} {w!r}")
    seen = set()
    for w in names:
        if w in seen:
            raise ValueError(f"{name}: {w!r} is given twice ({once})")
        seen.add(w)
    return names


def utf8_text(v: str) -> str:
    """A name as the run folder's UTF-8 JSON can hold it: lone surrogates (undecodable bytes
    of a file name, "bad\\udcff") written as backslash escapes instead of failing."""
    try:
        v.encode("utf-8")
        return v
    except UnicodeEncodeError:
        return v.encode("utf-8", "backslashreplace").decode("utf-8")


def path(name: str, v: Any) -> str:
    """A file or folder name: str or os.PathLike (pathlib.Path), non-empty, UTF-8 (the run
    folder's JSON files and messages hold UTF-8 names)."""
    if isinstance(v, (str, os.PathLike)):
        p = os.fspath(v)
    else:
        raise TypeError(f"{name}: expected a path (str or os.PathLike), found {_shown(v)}")
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if not p:
        raise ValueError(f"{name}: expected a path, found ''")
    if "\0" in p:
        raise ValueError(f"{name}: expected a path, found one with a NUL character: {p!r}")
    try:
        p.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name}: {p!r} is not valid UTF-8 (a name with undecodable bytes); mixprec's files and "
                         "messages hold UTF-8 names only: rename it, or give a link with a UTF-8 name") from None
    return p
