"""What every integration shares: the GradScaler it builds, the Telemetry of the run, the
step's loss and tokens as the library hands them over, one record per optimizer step with the
scaler's real outcome, the figures shown in the library's logs, and the end of the run."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Dict, List, Optional

import torch

from .. import _core
from ..torch import GradScaler, StepGuard, StepOutcome, Telemetry

# The Telemetry options an integration passes on (Telemetry's keywords but what the
# integration itself decides: the model, the folder, the precision, the scaler).
TELEMETRY_OPTIONS = tuple(n for n in inspect.signature(Telemetry).parameters
                          if n not in ("model", "out", "precision", "loss_scale", "scaler"))


# The step guards' keywords (GradScaler's and StepGuard's: the core's config keys and the
# predicate; docs/spike_guards.md), and why a step is skipped (the core's reasons but "none"),
# in the core's order.
GUARD_OPTIONS = tuple(_core.guard_config_keys()) + ("skip_if",)
SKIP_REASONS = tuple(r for r in _core.skip_reason_names() if r != "none")


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


def split_guard_options(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Takes the step guards' keywords out of kwargs."""
    return {k: kwargs.pop(k) for k in list(kwargs) if k in GUARD_OPTIONS}


def make_guard(options: Dict[str, Any]) -> Optional[GradScaler]:
    """A bf16 or fp32 run's step guards (no loss scaling): mixprec.torch.StepGuard with the given
    keywords. None when no keyword was given, or only skip_nonfinite=False (such a run keeps its
    library's plain optimizer step). The door validates every value (the core's messages;
    skip_nonfinite=False beside another guard is refused there)."""
    if not options:
        return None
    options = dict(options)
    nonfinite = options.pop("skip_nonfinite", None)
    if nonfinite is None or nonfinite is True:
        return StepGuard(**options)
    guard = GradScaler("cpu", enabled=False, skip_nonfinite=nonfinite, **options)  # refuses other guards
    return guard if guard._guarded() else None


def guarded(scaler: Optional[GradScaler]) -> bool:
    """The scaler checks the steps: a loss scale, or step guards without one (StepGuard)."""
    return scaler is not None and (scaler.is_enabled() or scaler._guarded())


def skip_why(outcome: StepOutcome, overflow_param: Optional[str] = None) -> str:
    """Why a skipped step was skipped, in words: its reason (StepOutcome.reason) and what the
    guard saw, e.g. "loss_spike (z 7.3)", "nonfinite_grad in h.0.weight"."""
    reason = outcome.reason if outcome.reason != "none" else "nonfinite_grad"
    if reason == "nonfinite_grad":
        return f"nonfinite_grad in {overflow_param or outcome.first_overflow_name or '(another rank)'}"
    if reason == "nonfinite_loss":
        return f"nonfinite_loss (loss {outcome.loss})"
    if reason == "loss_spike":
        return f"loss_spike (z {outcome.loss_z:.1f})"
    if reason == "grad_spike":
        return f"grad_spike (z {outcome.grad_z:.1f})"
    return f"{reason} (skip_if)"


def check_telemetry_options(options: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(options) - set(TELEMETRY_OPTIONS))
    if unknown:
        raise TypeError(f"unknown Telemetry option {unknown[0]!r}; expected {', '.join(TELEMETRY_OPTIONS)} "
                        f"(or a step guard's: {', '.join(GUARD_OPTIONS)})")
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
        self.skipped_by: Dict[str, int] = {r: 0 for r in SKIP_REASONS}  # the run's skips by reason
        self.window_skipped = 0
        self.window_overflow: Optional[str] = None
        self.window_why: List[str] = []  # each skip since the last log line: "<why> at step N"
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
        if not guarded(self.scaler):
            outcome = None  # a pass-through step: applied, nothing checked
        line = self.telemetry.record(outcome, loss=loss, lr=float(lr), tokens=self._tokens, step=step)
        self._loss = None
        self._shared = loss
        self._tokens = 0
        self.steps += 1
        if line.get("skipped"):
            self.skipped += 1
            self.window_skipped += 1
            reason = line.get("skip_reason", "nonfinite_grad")
            self.skipped_by[reason] = self.skipped_by.get(reason, 0) + 1
            if reason == "nonfinite_grad":  # an overflow: the parameter that held inf/NaN
                self.window_overflow = f"{line.get('overflow_param') or '(another rank)'} (step {line['step']})"
            self.window_why.append(f"{skip_why(outcome, line.get('overflow_param'))} at step {line['step']}")
        self.last = line
        return line

    def log_figures(self) -> Dict[str, Any]:
        """What the library's next log line gets: the skips since the last one, the run's total
        and its totals by reason (skipped_<reason>_total), the scale the next step uses and, when
        a step was skipped, why (skip_reason: "loss_spike (z 7.3) at step 12", several joined by
        "; ") and, for an overflow, the parameter that held inf/NaN (overflow)."""
        figures: Dict[str, Any] = {"skipped_steps": self.window_skipped, "skipped_steps_total": self.skipped}
        figures.update({f"skipped_{r}_total": n for r, n in self.skipped_by.items()})
        if self.scaler is not None and self.scaler.is_enabled():
            figures["loss_scale"] = self.scaler.get_scale()
        if self.window_overflow is not None:
            figures["overflow"] = self.window_overflow
        if self.window_why:
            figures["skip_reason"] = "; ".join(self.window_why)
        self.window_skipped = 0
        self.window_overflow = None
        self.window_why = []
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
        by = ", ".join(f"{r} {n}" for r, n in self.skipped_by.items() if n)
        skipped = f"{self.skipped} skipped" + (f": {by}" if by else "")
        print(f"{self.who}: run folder {self.out} ({self.steps} steps, {skipped}); "
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
