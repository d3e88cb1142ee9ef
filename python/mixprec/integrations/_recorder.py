"""What every integration shares: the GradScaler it builds, the Telemetry of the run, the
step's loss and tokens as the library hands them over, one record per optimizer step with the
scaler's real outcome, the figures shown in the library's logs, and the end of the run."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Dict, List, Optional

import torch

from ..torch import GradScaler, StepOutcome, Telemetry

# The Telemetry options an integration passes on (Telemetry's keywords but what the
# integration itself decides: the model, the folder, the precision, the scaler).
TELEMETRY_OPTIONS = tuple(n for n in inspect.signature(Telemetry).parameters
                          if n not in ("model", "out", "precision", "loss_scale", "scaler"))


def require(module: str, extra: str, what: str):
    """import `module`, or ImportError naming the package and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the {module.split('.')[0]} package (import failed: {e}); "
                          f"pip install \"mixprec[{extra}]\" installs the tested version") from e


def make_scaler(preset: Optional[str], overrides: Dict[str, Any]) -> GradScaler:
    """The run's mixprec.torch.GradScaler: torch.amp.GradScaler's rule (the `torch` preset) unless
    a preset is named; overrides are GradScaler's keywords (the core's config keys)."""
    return GradScaler("cpu", preset=preset, **overrides)


def check_telemetry_options(options: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(options) - set(TELEMETRY_OPTIONS))
    if unknown:
        raise TypeError(f"unknown Telemetry option {unknown[0]!r}; expected {', '.join(TELEMETRY_OPTIONS)}")
    return dict(options)


def split_options(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Takes Telemetry's options out of kwargs (the rest are GradScaler's)."""
    return {k: kwargs.pop(k) for k in list(kwargs) if k in TELEMETRY_OPTIONS}


class StepRecorder:
    """One run folder: Telemetry on the model, one record per optimizer step.

    add_loss() takes each loss the library back-propagates (already divided by the accumulation
    steps, as the libraries do), so their sum over a step is the step's mean loss."""

    def __init__(self, out: str, precision: str, scaler: Optional[GradScaler], options: Dict[str, Any],
                 *, report: bool = True, who: str = "mixprec") -> None:
        self.out = out
        self.precision = precision
        self.scaler = scaler
        self.options = options
        self.report = report
        self.who = who
        self.telemetry: Optional[Telemetry] = None
        self._loss: Optional[torch.Tensor] = None
        self._shared: Optional[float] = None  # the last step's loss (shared_loss)
        self._tokens = 0
        self._hooks: List[Any] = []
        # For the library's logs: totals, and what happened since its last log line.
        self.steps = 0
        self.skipped = 0
        self.window_skipped = 0
        self.window_overflow: Optional[str] = None
        self.last: Optional[Dict[str, Any]] = None
        self.report_path: Optional[str] = None

    # ---- the run ---------------------------------------------------------------------------

    def start(self, model: torch.nn.Module) -> None:
        if self.telemetry is not None:
            return
        if self.scaler is not None:
            self.scaler.set_names(model)
        self.telemetry = Telemetry(model, out=self.out, precision=self.precision, scaler=self.scaler, **self.options)
        # Tokens: the input ids of each training forward (any integer tensor given first or as input_ids).
        self._hooks.append(model.register_forward_pre_hook(self._count_tokens, with_kwargs=True))

    def _count_tokens(self, module: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
            self._tokens += ids.numel()

    def add_loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            value = loss.detach().float().sum()
        else:
            value = torch.tensor(float(loss))
        self._loss = value if self._loss is None else self._loss + value

    def record(self, lr: float, outcome: Optional[StepOutcome], *, step: Optional[int] = None,
               shared_loss: bool = False) -> Dict[str, Any]:
        """One optimizer step (after it, before zero_grad). step: its number in the training
        (a resumed run continues the numbers of the one it resumes); None: the previous + 1.
        shared_loss: a step without a backward of its own (one backward, several optimizers)
        records the previous step's loss."""
        if self.telemetry is None:
            raise RuntimeError(f"{self.who}: an optimizer step before the run started (no model to watch yet)")
        if self._loss is None and not (shared_loss and self._shared is not None):
            raise RuntimeError(f"{self.who}: an optimizer step without a loss: back-propagate through the library "
                               "(accelerator.backward, the Trainer, Lightning) so that the step's loss is recorded")
        loss = float(self._loss.cpu()) if self._loss is not None else self._shared
        if self.scaler is None or not self.scaler.is_enabled():
            outcome = None
        line = self.telemetry.record(outcome, loss=loss, lr=float(lr), tokens=self._tokens, step=step)
        self._loss = None
        self._shared = loss
        self._tokens = 0
        self.steps += 1
        if line.get("skipped"):
            self.skipped += 1
            self.window_skipped += 1
            self.window_overflow = f"{line.get('overflow_param') or '(another rank)'} (step {line['step']})"
        self.last = line
        return line

    def log_figures(self) -> Dict[str, Any]:
        """What the library's next log line gets: the skips since the last one, the run's total,
        the scale the next step uses and, when a step was skipped, the parameter that overflowed."""
        figures: Dict[str, Any] = {"skipped_steps": self.window_skipped, "skipped_steps_total": self.skipped}
        if self.scaler is not None and self.scaler.is_enabled():
            figures["loss_scale"] = self.scaler.get_scale()
        if self.window_overflow is not None:
            figures["overflow"] = self.window_overflow
        self.window_skipped = 0
        self.window_overflow = None
        return figures

    def close(self) -> Optional[str]:
        """Summary, hooks off, the folder released; the report rendered when asked. Returns the
        report's path (or the folder's, without a report). Idempotent."""
        if self.telemetry is None:
            return self.report_path
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.telemetry.close()
        self.telemetry = None
        path = self.out
        if self.report:
            from ..report import report
            path = report([self.out])
        self.report_path = path
        print(f"{self.who}: run folder {self.out} ({self.steps} steps, {self.skipped} skipped); "
              f"{'report: ' + path if self.report else 'render it with: mixprec report ' + self.out}",
              file=sys.stderr)
        return path


def precision_of(name: str, who: str) -> str:
    """Telemetry's precision for a library's mixed-precision name."""
    table = {"no": "fp32", "fp32": "fp32", "32": "fp32", "32-true": "fp32", "fp16": "fp16", "16-mixed": "fp16",
             "bf16": "bf16", "bf16-mixed": "bf16"}
    if name not in table:
        raise ValueError(f"{who}: mixed precision {name!r} is not one mixprec records; "
                         "expected fp16, bf16 or no mixed precision")
    return table[name]
