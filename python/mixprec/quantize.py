"""Low-precision recipes of Transformer Engine on any array (docs/low_precision.md).

    import numpy as np, mixprec
    q = mixprec.quantize(np.random.randn(64, 256).astype(np.float32), "nvfp4")
    q.codes, q.scales, q.tensor_scale, q.counts      # E2M1 pairs, E4M3 scales, S_enc, counts
    x_hat = mixprec.dequantize(q)

Every number is the C++ core's (``mixprec::lowp::quantize``): this module only names the
options. The input is read in place when it is a C-contiguous float32 NumPy array or CPU torch
tensor; a bfloat16 or float16 torch tensor is converted to float32 once (and, as Transformer
Engine does for such inputs, fp8-block's ``value_for_inf`` becomes that dtype's largest finite).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _args, _core

#: The recipe names, one table shared by every door (the core's ``lowp::recipe_table``).
RECIPES: Tuple[str, ...] = tuple(r["name"] for r in _core.recipe_table())

_FLT_MAX = float(np.finfo(np.float32).max)
_BF16_MAX = float.fromhex("0x1.fep127")
_F16_MAX = 65504.0


def recipe_table() -> list:
    """The recipe table: name, TE recipe, element format, block, tile rows, scale format."""
    return _core.recipe_table()


def _torch():
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except ImportError:  # pragma: no cover - torch is optional
        return None
    return torch


class QuantizedTensor:
    """What ``quantize`` returns. Codes and scales are views of the core's buffers (torch
    tensors when the input was a torch tensor, else NumPy arrays).

    codes         uint8 [code_rows, row_bytes]: fp8 one byte per element; fp4 two per byte,
                  the first element in the low nibble. Columnwise layouts hold the transpose.
    scales        float32 scale_inv (fp8 per tensor and fp8-block) or uint8 E8M0 / E4M3 codes,
                  [scale_rows, scale_cols] (``scale_format`` says which).
    tensor_scale  nvfp4: S_enc (flavour te) or torchao's per_tensor_scale; fp8 per tensor: the
                  scale used. tensor_amax: nvfp4's amax behind it.
    counts        elements, saturated, flushed, nonfinite, amax (docs/low_precision.md).
    """

    def __init__(self, core: Any, shape: Tuple[int, ...], as_torch: bool):
        self._q = core
        self.shape = tuple(shape)
        self._as_torch = as_torch

    def _wrap(self, a):
        if self._as_torch:
            return _torch().from_numpy(a)
        return a

    recipe = property(lambda self: self._q.recipe)
    element = property(lambda self: self._q.element)
    layout = property(lambda self: self._q.layout)
    flavour = property(lambda self: self._q.flavour)
    scale_format = property(lambda self: self._q.scale_format)
    code_shape = property(lambda self: tuple(self._q.code_shape))
    tensor_scale = property(lambda self: self._q.tensor_scale)
    tensor_amax = property(lambda self: self._q.tensor_amax)

    @property
    def codes(self):
        return self._wrap(self._q.codes)

    @property
    def scales(self):
        return self._wrap(self._q.scales)

    @property
    def counts(self) -> Dict[str, Any]:
        return self._q.counts

    def dequantize(self, out: Any = None):
        return dequantize(self, out=out)

    def __repr__(self) -> str:
        return (f"QuantizedTensor(recipe={self.recipe!r}, element={self.element!r}, layout={self.layout!r}, "
                f"shape={self.shape}, scale_format={self.scale_format!r}, counts={self.counts})")


def quantize(
    x: Any,
    recipe: str,
    *,
    element: Optional[str] = None,
    layout: str = "rowwise",
    tile_2d: bool = False,
    scale_rounding: str = "rceil",
    power_of_2_scales: Optional[bool] = None,
    amax_epsilon: float = 0.0,
    value_for_inf: Optional[float] = None,
    scale: float = 1.0,
    rht: bool = False,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
    random: Any = None,
    flavour: str = "te",
) -> QuantizedTensor:
    """Quantize ``x`` (rows = all but the last dimension, cols = the last) with ``recipe``.

    recipe             one of RECIPES: fp8-delayed (give ``scale``), fp8-current, mxfp8,
                       fp8-block, nvfp4, mxfp4.
    element            "e4m3" / "e5m2" for the fp8 recipes (default e4m3), "e2m1" for fp4.
    layout             "rowwise" (blocks along rows) or "columnwise" (the transpose: blocks
                       down the columns, codes and scales stored transposed, as TE's
                       columnwise copies).
    tile_2d            fp8-block 128x128 and nvfp4 16x16 tiles (TE's weights).
    scale_rounding     MX: "rceil" (TE, cuBLAS, torchao RCEIL) or "floor" (OCP MX).
    power_of_2_scales  fp8-current (default False), fp8-block (default True).
    amax_epsilon, value_for_inf   fp8-current / fp8-block (TE's compute_scale_from_amax).
                       amax_epsilon >= 0, value_for_inf and scale > 0, each taken as the
                       nearest float32 (as TE's float parameters take a Python float).
    rht                nvfp4: the 16-point random Hadamard transform first.
    stochastic_rounding, seed, random   nvfp4 / mxfp4: one uint32 random word per element,
                       given as ``random`` or drawn from numpy's default_rng(seed).
    flavour            "te" (default) or "torchao" (mxfp8, mxfp4, nvfp4): torchao's order of
                       operations (docs/low_precision.md lists the differences).
    """
    # Types first: the core's binding would answer a wrong one with its argument dump.
    recipe, layout, scale_rounding, flavour = (_args.word(n, v) for n, v in (
        ("recipe", recipe), ("layout", layout), ("scale_rounding", scale_rounding), ("flavour", flavour)))
    element = None if element is None else _args.word("element", element)
    tile_2d, rht, stochastic_rounding = (_args.flag(n, v) for n, v in (
        ("tile_2d", tile_2d), ("rht", rht), ("stochastic_rounding", stochastic_rounding)))
    power_of_2_scales = None if power_of_2_scales is None else _args.flag("power_of_2_scales", power_of_2_scales)
    seed = None if seed is None else _args.integer("seed", seed, 0, 2**63 - 1)
    torch = _torch()
    as_torch = torch is not None and isinstance(x, torch.Tensor)
    if not hasattr(x, "shape"):
        raise TypeError(f"x: expected a float32 NumPy array or a CPU torch tensor, found {type(x).__name__}")
    shape = tuple(x.shape)
    if as_torch:
        if x.device.type != "cpu":
            raise ValueError(f"x: expected a CPU tensor, found device {x.device}")
        # A view with the negative bit (.imag of a .conj()) holds its values negated in memory,
        # which the core would read as they lie: resolved to the values it shows (a copy).
        x = x.resolve_neg()
        if x.dtype in (torch.bfloat16, torch.float16):
            if value_for_inf is None and recipe == "fp8-block":
                value_for_inf = _BF16_MAX if x.dtype == torch.bfloat16 else _F16_MAX
            x = x.float()
        elif x.dtype != torch.float32:
            raise TypeError(f"x: expected a float32, bfloat16 or float16 tensor, found {x.dtype}")
        x = x.detach()
    amax_epsilon = _args.float32("amax_epsilon", amax_epsilon, positive=False)
    value_for_inf = _FLT_MAX if value_for_inf is None else _args.float32("value_for_inf", value_for_inf, positive=True)
    scale = _args.float32("scale", scale, positive=True)
    if stochastic_rounding:
        if random is None:
            if seed is None:
                raise ValueError("stochastic_rounding: give random (uint32, one per element) or seed")
            n = int(np.prod(shape)) if shape else 1
            random = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    elif random is not None or seed is not None:
        raise ValueError("random/seed: only used with stochastic_rounding=True")
    q = _core.quantize(x, recipe, element, layout, bool(tile_2d), scale_rounding, power_of_2_scales,
                       amax_epsilon, value_for_inf, scale, bool(rht), random, flavour)
    return QuantizedTensor(q, shape, as_torch)


def dequantize(q: QuantizedTensor, out: Any = None):
    """What the codes represent, in the input's shape (float32; a torch tensor when the input
    was one). With rht, the transformed values (the transform cancels in a GEMM over both
    operands). ``out``: an optional C-contiguous float32 array written in place."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q: expected the QuantizedTensor that mixprec.quantize returned, found {type(q).__name__}")
    torch = _torch()
    if out is not None and torch is not None and isinstance(out, torch.Tensor) and out.is_neg():
        # Written as the memory lies, it would read back negated.
        raise ValueError("out: expected a tensor without the negative bit, found a negative view (.imag of a "
                         ".conj()); pass a plain float32 tensor")
    arr = _core.dequantize(q._q, out)
    if out is not None:
        return out
    arr = arr.reshape(q.shape)
    return q._wrap(arr)
