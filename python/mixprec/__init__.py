"""mixprec: bit-exact number formats and loss-scale policies from the C++ core (docs/python.md).

    import numpy as np, mixprec
    codes, stats = mixprec.encode(np.array([1e-8, 1.0, 7e4], np.float32), "f16")
    mixprec.decode(codes, "f16")
    ls = mixprec.LossScale("mixprec"); ls.update(found_inf=False)
    mixprec.report("runs/x")                      # `mixprec report`: runs/x/report.html
    q = mixprec.quantize(x, "nvfp4"); mixprec.dequantize(q)   # TE's low-precision recipes
"""

from ._core import ConversionStats, ScaleCollapseError
from .formats import FORMATS, decode, encode, stats_dict
from .loss_scale import LossScale, ScaleUpdate, config_keys, preset_names
from .quantize import RECIPES, QuantizedTensor, dequantize, quantize, recipe_table
from .report import report
from . import data

__version__ = "0.1.0"

__all__ = [
    "FORMATS", "RECIPES", "ConversionStats", "LossScale", "QuantizedTensor", "ScaleCollapseError", "ScaleUpdate",
    "config_keys", "data", "decode", "dequantize", "encode", "preset_names", "quantize", "recipe_table", "report",
    "stats_dict",
]
