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
LightningModule and records every optimizer step as the plugin takes it (its optimizer_step,
wrapped while fitting: step() is called by the plugin; the outcome is the scaler's last_outcome),
every optimizer of a manual optimization included, numbered as Lightning counts them
(trainer.global_step: a fit resumed from a checkpoint continues the numbers). It logs
mixprec/skipped (the steps of this batch skipped: 0 or 1 with one optimizer),
mixprec/skipped_steps_total, mixprec/skipped_<reason>_total (the fit's skips by reason:
nonfinite_grad, nonfinite_loss, loss_spike, grad_spike, user) and mixprec/loss_scale (fp16) with
the LightningModule's log() (so they are in trainer.logged_metrics, the progress bar and every
logger), logs each skip and why to the `mixprec` logger (the parameter that overflowed; a guard's
reason and z-score), and closes the run folder when fitting ends (its report's path printed).
bf16 and fp32 runs are recorded without a scaler (with the callback's step guards, if given).

Step guards (docs/spike_guards.md): an fp16 run's are its scaler's, given to the plugin
(mixprec.torch.GradScaler(skip_loss_z=..., ...)). A bf16 or fp32 run has no scaler: the
callback's skip_* keywords give it a mixprec.torch.StepGuard, which the callback puts into the
precision plugin's optimizer step (the loss from pre_backward; after the closure and its
clipping, the guard's step() steps the optimizer or skips), its state in the callback's state
in Lightning's checkpoints.

A skipped step (any reason) advances no LR scheduler and no weight average: Lightning steps its
"step" interval schedulers after every optimizer step, skipped or not, and WeightAveraging
(EMAWeightAveraging included) averages after every step. While fitting, the scheduler of an
optimizer whose step was skipped skips its next step() (the "step" interval ones Lightning
steps; in manual optimization every scheduler, stepped by the module), and a WeightAveraging
callback is not updated after a batch with a skipped step. trainer.global_step counts every
optimizer step, skipped ones too (Lightning's own count, as with torch.amp's scaler).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Set

import torch

from ..torch import GradScaler
from ._recorder import (SKIP_REASONS, StepRecorder, check_telemetry_options, make_guard, precision_of, require,
                        skip_why, split_guard_options)

_lightning = require("lightning", "lightning", "mixprec.integrations.lightning")
from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.callbacks import WeightAveraging  # noqa: E402

__all__ = ["MixprecCallback"]

_log = logging.getLogger("mixprec")


class MixprecCallback(Callback):
    """Telemetry and the scaler's outcomes in a Lightning fit.

    MixprecCallback(out, *, modules=None, sample_every=4, histogram_every=50, check_forward=True,
                    tensorboard=None, report=True, log_metrics=True, skip_nonfinite=None, skip_loss_z=0.0,
                    skip_grad_z=0.0, skip_window=128, skip_if=None)

    out          the run folder (new or empty), written by global rank 0
    log_metrics  log mixprec/skipped, mixprec/skipped_steps_total, mixprec/skipped_<reason>_total,
                 mixprec/loss_scale each step
    skip_*       a bf16 or fp32 run's step guards (mixprec.torch.StepGuard's keywords, the guard
                 then in `guard`); an fp16 run's are its scaler's (refused here)
    """

    def __init__(self, out: str, *, report: bool = True, log_metrics: bool = True, **telemetry: Any) -> None:
        if not isinstance(out, str) or not out:
            raise TypeError(f"MixprecCallback: out: expected a folder name, found {out!r}")
        self._out = out
        self._guard_options = split_guard_options(telemetry)
        self._options = check_telemetry_options(telemetry)
        self._report = report
        self._log_metrics = log_metrics
        self.scaler: Optional[GradScaler] = None   # the fp16 run's, from the plugin
        # A bf16 or fp32 run's step guards (built now: bad values are refused before the fit).
        self.guard: Optional[GradScaler] = make_guard(self._guard_options)
        self.recorder: Optional[StepRecorder] = None
        self._skipped = 0
        self._skipped_by: Dict[str, int] = {r: 0 for r in SKIP_REASONS}
        self._batch_steps = 0       # optimizer steps taken in this batch
        self._batch_skipped = 0     # ... and skipped
        # What the callback changed while fitting, undone in teardown: the plugin's methods,
        # the schedulers' classes, the weight averages' should_update.
        self._plugin: Any = None
        self._schedulers: Dict[int, Any] = {}      # id -> (scheduler, its own class)
        self._hold: Set[int] = set()               # schedulers whose next step() is held
        self._averages: List[Any] = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.recorder is None:
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
                if self._guard_options:
                    given = ", ".join(self._guard_options)
                    raise ValueError(f"mixprec MixprecCallback: {given}: expected on the fp16 run's scaler "
                                     "(plugins=[MixedPrecision(\"16-mixed\", device, scaler=mixprec.torch."
                                     f"GradScaler({given}=...))]), found on the callback (its step guards are "
                                     "for bf16 and fp32 runs, which have no scaler)")
                self.scaler = scaler
            elif scaler is not None and self.guard is not None:
                raise ValueError(f"mixprec MixprecCallback: the {precision} run's plugin has a scaler of its own "
                                 f"({type(scaler).__qualname__}); the callback's step guards need a plugin without one")
            if trainer.is_global_zero:
                self.recorder = StepRecorder(self._out, precision, self._stepper(), self._options,
                                             report=self._report, who="mixprec")
        self._wrap_plugin(trainer)
        for c in trainer.callbacks:
            if isinstance(c, WeightAveraging) and c not in self._averages:
                c.should_update = self._held_average(c.should_update)  # this instance only, until teardown
                self._averages.append(c)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.start(pl_module)
        elif self.guard is not None:
            self.guard.set_names(pl_module)  # other ranks: the outcome's parameter names

    def _stepper(self) -> Optional[GradScaler]:
        """What decides each step: the fp16 run's scaler, or the bf16 / fp32 run's guard."""
        return self.scaler if self.scaler is not None else self.guard

    # ---- the guard's state in Lightning's checkpoints --------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {"guard": self.guard.state_dict()} if self.guard is not None else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.guard is not None and "guard" in state_dict:
            self.guard.load_state_dict(state_dict["guard"])

    # ---- each optimizer step, as the precision plugin takes it --------------------------------

    def _wrap_plugin(self, trainer: Any) -> None:
        """Wraps this fit's precision plugin (every rank: the schedulers hold on each): its
        pre_backward hands over each loss, its optimizer_step records the step it took. With
        the callback's guard, the plugin's optimizer_step is the guard's (_guarded_step)."""
        plugin = trainer.precision_plugin
        if self._plugin is plugin:
            return
        self._plugin = plugin
        step, pre_backward = plugin.optimizer_step, plugin.pre_backward
        guard = self.guard if self.scaler is None else None
        if guard is not None:
            step = self._guarded_step(plugin, guard)
        scaler = self._stepper()

        def recorded_pre_backward(tensor: Any, module: Any) -> Any:
            # The loss as Lightning back-propagates it: divided by the accumulation (automatic
            # optimization), the module's own in manual_backward.
            if self.recorder is not None:
                self.recorder.add_loss(tensor)
            if guard is not None:
                tensor = guard.scale(tensor)  # the loss guard's value (the loss itself comes back)
            return pre_backward(tensor, module)

        def recorded_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = scaler.last_outcome if scaler is not None else None
            result = step(optimizer, *args, **kwargs)
            outcome = scaler.last_outcome if scaler is not None else None
            if scaler is not None and outcome is before:
                return result  # the scaler took no step (training_step returned None)
            self._stepped(trainer, optimizer, outcome)
            return result

        plugin.pre_backward = recorded_pre_backward  # this plugin only, until teardown
        plugin.optimizer_step = recorded_step

    @staticmethod
    def _guarded_step(plugin: Any, guard: GradScaler) -> Callable[..., Any]:
        """A bf16 or fp32 plugin's optimizer_step with the guard deciding: what Lightning's
        MixedPrecision does with a scaler (closure, then clipping and on_before_optimizer_step,
        then the scaler's step() and update()), the guard in the scaler's place."""

        def guarded_step(optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError("mixprec MixprecCallback: optimizer: expected one that steps without a closure, "
                                 "found LBFGS (the step guards check the gradients before the optimizer's step)")
            closure_result = closure()
            plugin._after_closure(model, optimizer)
            if closure_result is None and model.automatic_optimization:
                return None  # training_step returned None: no backward, no step (Lightning's rule)
            outcome = guard.step(optimizer, **kwargs)
            guard.update()
            return outcome

        return guarded_step

    def _stepped(self, trainer: Any, optimizer: Any, outcome: Any) -> None:
        skipped = outcome is not None and not outcome.applied  # any reason: the weights did not move
        self._hold_schedulers(trainer, optimizer, skipped)
        self._batch_steps += 1
        self._batch_skipped += skipped
        self._skipped += skipped
        if skipped:
            reason = outcome.reason if outcome.reason != "none" else "nonfinite_grad"
            self._skipped_by[reason] = self._skipped_by.get(reason, 0) + 1
        if self.recorder is None:
            return
        # Lightning counts the step once the plugin returns: this one is global_step + 1, in a
        # resumed fit too. The LR is the one the step used (the schedulers step after it).
        line = self.recorder.record(optimizer.param_groups[0]["lr"], outcome, step=trainer.global_step + 1,
                                    shared_loss=not trainer.lightning_module.automatic_optimization)
        if not line.get("skipped"):
            return
        scale = f"; scale {line.get('scale')} -> {line.get('next_scale')}" if self.scaler is not None else ""
        if line.get("skip_reason", "nonfinite_grad") == "nonfinite_grad":
            _log.warning("mixprec: step %d skipped: inf/NaN in the gradient of %s%s", line["step"],
                         line.get("overflow_param") or "(another rank)", scale)
        else:
            _log.warning("mixprec: step %d skipped: %s%s", line["step"], skip_why(outcome), scale)

    # ---- what a skipped step holds ------------------------------------------------------------

    def _hold_schedulers(self, trainer: Any, optimizer: Any, skipped: bool) -> None:
        """After a skipped step of `optimizer` its schedulers' next step() does nothing; an
        applied step drops a hold no step() used (a frequency above 1)."""
        manual = not trainer.lightning_module.automatic_optimization
        for config in trainer.lr_scheduler_configs:
            sched = config.scheduler
            # Automatic optimization: Lightning steps the "epoch" ones once an epoch, not per step.
            if getattr(sched, "optimizer", None) is not optimizer or not (manual or config.interval == "step"):
                continue
            self._holdable(sched)
            if skipped:
                self._hold.add(id(sched))
            else:
                self._hold.discard(id(sched))

    def _holdable(self, sched: Any) -> None:
        """Gives `sched` a subclass whose step() honours the hold, until teardown. A subclass,
        not an attribute: a scheduler's state_dict() is its __dict__ (checkpoints stay as they are)."""
        if id(sched) in self._schedulers:
            return
        own = type(sched)
        own_step = own.step
        hold = self._hold

        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            if id(scheduler) in hold:
                hold.discard(id(scheduler))
                return None  # the optimizer's step was skipped: the schedule holds
            return own_step(scheduler, *args, **kwargs)

        sched.__class__ = type(own.__name__, (own,), {"step": step, "__module__": own.__module__})
        self._schedulers[id(sched)] = (sched, own)

    def _held_average(self, should_update: Callable[..., bool]) -> Callable[..., bool]:
        def held(step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
            if step_idx is not None and self._batch_skipped:
                return False  # the weights did not move (all or part of them): no average of them
            return should_update(step_idx=step_idx, epoch_idx=epoch_idx)
        return held

    # ---- per batch: the logged metrics --------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch_steps = 0
        self._batch_skipped = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._batch_steps:
            return  # accumulating: no optimizer step this batch
        if self._log_metrics:
            metrics = {"mixprec/skipped": float(self._batch_skipped),
                       "mixprec/skipped_steps_total": float(self._skipped)}
            metrics.update({f"mixprec/skipped_{r}_total": float(n) for r, n in self._skipped_by.items()})
            if self.scaler is not None:
                metrics["mixprec/loss_scale"] = float(self.scaler.get_scale())
            # The same on every rank (the scaler's skips agree across ranks): no reduction.
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False)

    # ---- the end --------------------------------------------------------------------------------

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._undo()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._undo()  # Lightning calls no teardown hook after an exception

    def _undo(self) -> None:
        """The plugin, the schedulers and the weight averages as they were before the fit."""
        if self._plugin is not None:
            for name in ("optimizer_step", "pre_backward"):
                self._plugin.__dict__.pop(name, None)  # the class's methods again
            self._plugin = None
        for sched, own in self._schedulers.values():
            sched.__class__ = own
        self._schedulers.clear()
        self._hold.clear()
        for c in self._averages:
            c.__dict__.pop("should_update", None)
        self._averages = []

    @property
    def report_path(self) -> Optional[str]:
        return None if self.recorder is None else self.recorder.report_path
