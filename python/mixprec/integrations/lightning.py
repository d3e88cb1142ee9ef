"""mixprec in Lightning (docs/python.md, "Lightning").

    import mixprec.torch
    from lightning.pytorch.plugins import MixedPrecision
    from mixprec.integrations.lightning import MixprecCallback

    trainer = L.Trainer(accelerator="cpu",
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=mixprec.torch.GradScaler())],
                        callbacks=[MixprecCallback(out="runs/pl")])

The scaler goes where Lightning takes one: its own MixedPrecision plugin, which calls scale(),
unscale_(), step() and update() and saves state_dict() in the checkpoints. (On a CPU
`precision="16-mixed"` alone makes Lightning switch to bf16, with a warning; the plugin given
explicitly keeps fp16, autocast(cpu, float16) included.) The callback attaches Telemetry to the
LightningModule, records every optimizer step with the scaler's outcome (step() is called by the
plugin; the outcome is the scaler's last_outcome), logs mixprec/skipped (this step, 0 or 1),
mixprec/skipped_steps_total and mixprec/loss_scale with the LightningModule's log() (so they are
in trainer.logged_metrics, the progress bar and every logger), logs each skip with the parameter
that overflowed to the `mixprec` logger, and closes the run folder when fitting ends (its
report's path printed). bf16 and fp32 runs are recorded without a scaler.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..torch import GradScaler
from ._recorder import StepRecorder, check_telemetry_options, precision_of, require

_lightning = require("lightning", "lightning", "mixprec.integrations.lightning")
from lightning.pytorch import Callback  # noqa: E402

__all__ = ["MixprecCallback"]

_log = logging.getLogger("mixprec")


class MixprecCallback(Callback):
    """Telemetry and the scaler's outcomes in a Lightning fit.

    MixprecCallback(out, *, modules=None, sample_every=4, histogram_every=50, check_forward=True,
                    tensorboard=None, report=True, log_metrics=True)

    out          the run folder (new or empty), written by global rank 0
    log_metrics  log mixprec/skipped, mixprec/skipped_steps_total, mixprec/loss_scale each step
    """

    def __init__(self, out: str, *, report: bool = True, log_metrics: bool = True, **telemetry: Any) -> None:
        if not isinstance(out, str) or not out:
            raise TypeError(f"MixprecCallback: out: expected a folder name, found {out!r}")
        self._out = out
        self._options = check_telemetry_options(telemetry)
        self._report = report
        self._log_metrics = log_metrics
        self.scaler: Optional[GradScaler] = None
        self.recorder: Optional[StepRecorder] = None
        self._last_step = 0
        self._skipped = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.recorder is not None:
            return
        plugin = trainer.precision_plugin
        precision = precision_of(str(getattr(plugin, "precision", "32-true")), "mixprec MixprecCallback")
        scaler = getattr(plugin, "scaler", None)
        if precision == "fp16":
            if not isinstance(scaler, GradScaler):
                kind = "none" if scaler is None else f"{type(scaler).__module__}.{type(scaler).__qualname__}"
                raise TypeError(f"mixprec MixprecCallback: the fp16 run's scaler is {kind}, not "
                                "mixprec.torch.GradScaler; give Lightning's plugin "
                                "mixprec's: plugins=[MixedPrecision(\"16-mixed\", device, "
                                "scaler=mixprec.torch.GradScaler())]")
            self.scaler = scaler
        if trainer.is_global_zero:
            self.recorder = StepRecorder(self._out, precision, self.scaler, self._options, report=self._report,
                                         who="mixprec")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.start(pl_module)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.recorder is not None and loss is not None:
            # training_step's loss; Lightning back-propagates it divided by the accumulation.
            self.recorder.add_loss(loss.detach() / trainer.accumulate_grad_batches)
        if trainer.global_step == self._last_step:
            return  # accumulating: no optimizer step this batch
        self._last_step = trainer.global_step
        outcome = self.scaler.last_outcome if self.scaler is not None else None
        if self.recorder is not None:
            line = self.recorder.record(trainer.optimizers[0].param_groups[0]["lr"], outcome)
            if line.get("skipped"):
                _log.warning("mixprec: step %d skipped: inf/NaN in the gradient of %s; scale %s -> %s", line["step"],
                             line.get("overflow_param") or "(another rank)", line.get("scale"), line.get("next_scale"))
        skipped = outcome is not None and not outcome.applied
        self._skipped += skipped
        if self._log_metrics:
            metrics = {"mixprec/skipped": float(skipped), "mixprec/skipped_steps_total": float(self._skipped)}
            if self.scaler is not None:
                metrics["mixprec/loss_scale"] = float(self.scaler.get_scale())
            # The same on every rank (the scaler's skips agree across ranks): no reduction.
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()

    @property
    def report_path(self) -> Optional[str]:
        return None if self.recorder is None else self.recorder.report_path
