"""Independent references for the Python tests: NumPy and ml_dtypes only, never mixprec.

Every function here computes what the core should produce from the formats' definitions
(docs/formats.md) or from another library's conversion, so that a wrong binding or a wrong
option fails the comparison.
"""

from __future__ import annotations

import numpy as np

try:  # E4M3/E5M2/bf16 cross-checks; the Makefile's venv installs it
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

# name: (total bits, mantissa bits, has inf, max finite magnitude code, code dtype)
SPECS = {
    "f16": (16, 10, True, 0x7BFF, np.uint16),
    "bf16": (16, 7, True, 0x7F7F, np.uint16),
    "f8e4m3": (8, 3, False, 0x7E, np.uint8),
    "f8e5m2": (8, 2, True, 0x7B, np.uint8),
}


def bits32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def sign_mask(fmt: str) -> int:
    return 1 << (SPECS[fmt][0] - 1)


def exp_mask(fmt: str) -> int:
    bits, man, _, _, _ = SPECS[fmt]
    return ((1 << (bits - 1 - man)) - 1) << man


def man_mask(fmt: str) -> int:
    return (1 << SPECS[fmt][1]) - 1


def is_subnormal_code(fmt: str, codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.uint32)
    return ((c & exp_mask(fmt)) == 0) & ((c & man_mask(fmt)) != 0)


def is_nan_code(fmt: str, codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.uint32) & (sign_mask(fmt) - 1)
    if fmt == "f8e4m3":
        return c == 0x7F
    return ((c & exp_mask(fmt)) == exp_mask(fmt)) & ((c & man_mask(fmt)) != 0)


def is_nonfinite_code(fmt: str, codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.uint32) & (sign_mask(fmt) - 1)
    if fmt == "f8e4m3":
        return c == 0x7F
    return (c & exp_mask(fmt)) == exp_mask(fmt)


def quiet_nan_code(fmt: str, x: np.ndarray) -> np.ndarray:
    """The NaN an IEEE-like format gets from fp32 NaN x: sign, the top payload bits, quiet bit
    set (the x86 F16C rule the core follows); E4M3 has a single NaN per sign."""
    bits, man, _, _, dtype = SPECS[fmt]
    b = bits32(x).astype(np.uint64)
    sign = (b >> 31) << (bits - 1)
    if fmt == "f8e4m3":
        return (sign | 0x7F).astype(dtype)
    payload = (b & 0x7FFFFF) >> (23 - man)
    return (sign | exp_mask(fmt) | (1 << (man - 1)) | payload).astype(dtype)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 round to nearest even on the bit pattern (IEEE overflow to inf)."""
    b = bits32(x).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    nan = np.isnan(x)
    return np.where(nan, quiet_nan_code("bf16", x), rounded).astype(np.uint16)


def rne_codes(fmt: str, x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even codes with IEEE overflow, from NumPy (f16), the bf16 rule above,
    or ml_dtypes (fp8); NaN inputs follow quiet_nan_code (see docs/python.md for why)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    with np.errstate(all="ignore"):
        if fmt == "f16":
            codes = x.astype(np.float16).view(np.uint16)
        elif fmt == "bf16":
            codes = bf16_rne(x)
        elif fmt == "f8e4m3":
            codes = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        elif fmt == "f8e5m2":
            codes = x.astype(ml_dtypes.float8_e5m2).view(np.uint8)
        else:
            raise AssertionError(fmt)
    nan = np.isnan(x)
    return np.where(nan, quiet_nan_code(fmt, x), codes).astype(SPECS[fmt][4])


def expected_codes(fmt: str, x: np.ndarray, overflow: str = "ieee", subnormals: str = "keep",
                   scale: float = 1.0) -> np.ndarray:
    """What encode() must give: the product rounded to fp32, then RNE, then the modes."""
    with np.errstate(all="ignore"):
        y = (np.asarray(x, np.float32) * np.float32(scale)).astype(np.float32)
    codes = rne_codes(fmt, y)
    bits, _, _, max_code, dtype = SPECS[fmt]
    sign = codes.astype(np.uint32) & sign_mask(fmt)
    if subnormals == "flush":
        codes = np.where(is_subnormal_code(fmt, codes), sign, codes).astype(dtype)
    if overflow == "saturate":
        past_max = is_nonfinite_code(fmt, codes) & ~np.isnan(y)
        codes = np.where(past_max, sign | max_code, codes).astype(dtype)
    return codes


def decode_codes(fmt: str, codes: np.ndarray) -> np.ndarray:
    """Exact float32 values of codes (NaN payloads kept, quiet bit set)."""
    bits, man, _, _, _ = SPECS[fmt]
    c = np.ascontiguousarray(codes)
    if fmt == "bf16":
        out = (c.astype(np.uint32) << 16)
        nan = is_nan_code(fmt, c)
        out = np.where(nan, out | 0x00400000, out).astype(np.uint32)
        return out.view(np.float32)
    if fmt == "f16":
        vals = c.view(np.float16).astype(np.float32)
    elif fmt == "f8e4m3":
        vals = c.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        vals = c.view(ml_dtypes.float8_e5m2).astype(np.float32)
    # NaN: sign, payload moved to the top of fp32's mantissa, quiet bit set.
    nan = is_nan_code(fmt, c)
    u = c.astype(np.uint32)
    sign = (u >> (bits - 1)) << 31
    if fmt == "f8e4m3":
        payload = np.zeros_like(u)  # one NaN per sign: 0x7f -> the canonical 0x7fc00000 with its sign
        nan_bits = sign | 0x7FC00000
    else:
        payload = (u & man_mask(fmt)) << (23 - man)
        nan_bits = sign | 0x7F800000 | payload | 0x00400000
    out = np.where(nan, nan_bits, vals.view(np.uint32)).astype(np.uint32)
    return out.view(np.float32)


def expected_stats(fmt: str, x: np.ndarray, overflow: str = "ieee", subnormals: str = "keep",
                   scale: float = 1.0) -> dict:
    """The counts, from the reference codes (ieee codes tell what went past max finite)."""
    x = np.asarray(x, np.float32)
    codes = expected_codes(fmt, x, overflow, subnormals, scale)
    ieee = expected_codes(fmt, x, "ieee", subnormals, scale)
    mag = codes.astype(np.uint32) & (sign_mask(fmt) - 1)
    nonzero = x != 0  # NaN != 0
    finite = np.isfinite(x)
    return {
        "elements": int(x.size),
        "nonzero": int(np.count_nonzero(nonzero)),
        "nonfinite_input": int(np.count_nonzero(~finite)),
        "underflow": int(np.count_nonzero(nonzero & (mag == 0))),
        "subnormal": int(np.count_nonzero(nonzero & is_subnormal_code(fmt, codes))),
        # a finite input only becomes inf (or E4M3's NaN) by rounding past max finite
        "overflow": int(np.count_nonzero(finite & is_nonfinite_code(fmt, ieee))),
    }


def hex_mismatches(x: np.ndarray, got: np.ndarray, want: np.ndarray, limit: int = 12) -> str:
    """The first mismatches as hex: input bits, got code, expected code."""
    bad = np.flatnonzero(got != want)
    width = 2 * got.dtype.itemsize
    lines = [f"{bad.size} of {got.size} codes differ; first {min(limit, bad.size)}:"]
    xb = bits32(x.reshape(-1))
    for i in bad[:limit]:
        lines.append(f"  x=0x{int(xb[i]):08x} ({float(x.reshape(-1)[i])!r}): got 0x{int(got.reshape(-1)[i]):0{width}x}"
                     f" expected 0x{int(want.reshape(-1)[i]):0{width}x}")
    return "\n".join(lines)


def hex_mismatches_f32(codes: np.ndarray, got: np.ndarray, want: np.ndarray, limit: int = 12) -> str:
    gb, wb = bits32(got).reshape(-1), bits32(want).reshape(-1)
    bad = np.flatnonzero(gb != wb)
    width = 2 * codes.dtype.itemsize
    lines = [f"{bad.size} of {gb.size} values differ; first {min(limit, bad.size)}:"]
    for i in bad[:limit]:
        lines.append(f"  code=0x{int(codes.reshape(-1)[i]):0{width}x}: got 0x{int(gb[i]):08x} expected 0x{int(wb[i]):08x}")
    return "\n".join(lines)
