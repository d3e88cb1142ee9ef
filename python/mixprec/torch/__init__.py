"""mixprec for PyTorch users (docs/python.md, "mixprec.torch.GradScaler").

    from mixprec.torch import GradScaler
    scaler = GradScaler("cpu", growth_interval=2000)       # torch.amp.GradScaler's rule, exactly
    scaler = GradScaler(preset="mixprec")                  # or any mixprec.preset_names()

Importing `mixprec` never imports torch; importing `mixprec.torch` does.
"""

try:
    import torch as _torch  # noqa: F401  (the subpackage needs it; say so clearly)
except ImportError as e:  # pragma: no cover - exercised by a test in a subprocess
    raise ImportError(
        "mixprec.torch needs PyTorch (import torch failed: " + str(e) + "); "
        "install torch in this environment, or use mixprec.LossScale without torch"
    ) from e

from .advise import Advice, advise, advise_run
from .ema import EMA
from .grad_scaler import GradScaler, GuardView, StepGuard, StepOutcome
from .low_precision import (OPERANDS, ZOO, LowPrecisionLinear, RecipeOptions, load_assignment, low_precision,
                            low_precision_modules, low_precision_step, quantization_stats, sample_quantization_error,
                            save_assignment)
from .telemetry import Telemetry
from . import optim  # mixprec.torch.optim.AdamW: optimizer state in fewer bytes

__all__ = ["Advice", "EMA", "GradScaler", "GuardView", "LowPrecisionLinear", "OPERANDS", "RecipeOptions", "StepGuard",
           "StepOutcome", "Telemetry", "ZOO", "advise",
           "advise_run", "load_assignment", "low_precision", "low_precision_modules", "low_precision_step",
           "quantization_stats", "sample_quantization_error", "save_assignment"]
