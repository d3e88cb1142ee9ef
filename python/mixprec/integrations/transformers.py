"""mixprec in the Hugging Face Trainer (docs/python.md, "Hugging Face Trainer").

    from mixprec.integrations.transformers import MixprecCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[MixprecCallback(out="runs/hf")])       # the one line added
    trainer.train()

At the end of Trainer.__init__ (on_init_end) the callback gives the Trainer's Accelerator what
mixprec.integrations.accelerate.MixprecAccelerate gives any Accelerator: for fp16,
mixprec.torch.GradScaler as its scaler (so the Trainer's checkpoints save and resume its state,
scaler.pt) and, on a CPU, where `TrainingArguments(use_cpu=True, fp16=True)` trains in fp32
without saying so, autocast(cpu, float16) with the scaler (a warning says so); then Telemetry on
the model, one record per optimizer step with the scaler's outcome. Each of the Trainer's log
lines gets skipped_steps (since the previous line), skipped_steps_total, skipped_<reason>_total
(the run's skips by reason: nonfinite_grad, nonfinite_loss, loss_spike, grad_spike, user),
loss_scale (fp16) and, after a skip, skip_reason (why: "loss_spike (z 7.3) at step 12") and, after
an overflow, overflow ("<parameter> (step N)"); the callback goes first among the callbacks that
read the logs, so the progress bar, TensorBoard and the rest show them. The run folder numbers steps
as the Trainer does (state.global_step): a run resumed from a checkpoint at step 10 records steps
11, 12, ... With preset="layerwise" the scaler watches the model (scaler.watch). At the end of
training the run folder is closed and its report's path printed.

Step guards (docs/spike_guards.md): skip_loss_z, skip_grad_z, skip_window, skip_if and
skip_nonfinite go to the fp16 run's GradScaler; in a bf16 or fp32 run they make a
mixprec.torch.StepGuard the Accelerator's scaler (no loss scaling; its state is saved in the
checkpoints' scaler.pt and restored on resume, as a scaler's).

A skipped step, whatever the reason, advances no LR schedule (Accelerate's scheduler holds when
the optimizer's step was skipped, and mixprec's scaler or guard never calls the optimizer on a
skipped step). The Trainer's own count (state.global_step) counts every optimizer step, skipped
ones too, as it does with torch.amp's scaler. torch.amp's scaler
calls a fused optimizer (the Trainer's default adamw_torch_fused) on every step and lets it skip
inside, so there Accelerate sees no skip and the schedule advances: runs that skip a step then
differ from torch.amp's by the schedule, not by the scaling.

The Trainer does not hand its callbacks the Trainer itself: the callback finds the Trainer that
calls on_init_end on the call stack. Give it in `callbacks=[...]` (trainer.add_callback() comes
after on_init_end: the Accelerator is then prepared without the scaler; refused with a message).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from ._recorder import require

_transformers = require("transformers", "transformers", "mixprec.integrations.transformers")
from transformers import Trainer, TrainerCallback  # noqa: E402

from .accelerate import MixprecAccelerate  # noqa: E402

__all__ = ["MixprecCallback"]


def _calling_trainer() -> Optional[Trainer]:
    """The Trainer whose method is on the call stack (the one calling this callback)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


class MixprecCallback(TrainerCallback):
    """mixprec.torch.GradScaler and Telemetry in a transformers.Trainer run.

    MixprecCallback(out, preset=None, *, modules=None, sample_every=4, histogram_every=50,
                    check_forward=True, tensorboard=None, report=True, skip_nonfinite=None,
                    skip_loss_z=0.0, skip_grad_z=0.0, skip_window=128, skip_if=None, **overrides)

    out        the run folder (new or empty), written by the main process
    preset     the scaler's policy (mixprec.preset_names()); None = torch.amp.GradScaler's rule:
               the same scales and skips as torch.amp.GradScaler, the same weights bit for bit
               where the LR schedule does not tell them apart (module docstring)
    overrides  GradScaler keywords (init_scale, growth_interval, ..., the core's config keys)
    skip_*     the step guards: fp16, GradScaler's keywords; bf16 and fp32, a mixprec.torch.StepGuard's
    modules, sample_every, histogram_every, check_forward, tensorboard: Telemetry's
    report     render report.html when training ends
    """

    def __init__(self, out: str, preset: Optional[str] = None, **kwargs: Any) -> None:
        if not isinstance(out, str) or not out:
            raise TypeError(f"MixprecCallback: out: expected a folder name, found {out!r}")
        self._out = out
        self._preset = preset
        self._kwargs = kwargs
        self.mixprec: Optional[MixprecAccelerate] = None
        self.trainer: Optional[Trainer] = None

    # ---- the Trainer's events ----------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is None:
            raise RuntimeError("MixprecCallback: no Trainer on the call stack of on_init_end; "
                               "pass the callback to Trainer(callbacks=[...])")
        self.trainer = trainer
        self.mixprec = MixprecAccelerate(trainer.accelerator, self._out, self._preset, **self._kwargs)
        # The step being taken: the Trainer counts it (state.global_step) once the optimizer
        # stepped, and restores the count with a checkpoint.
        self.mixprec._step_of = lambda: trainer.state.global_step + 1
        # First among the callbacks that read logs (after the flow callback, which reads none).
        callbacks = trainer.callback_handler.callbacks
        callbacks.remove(self)
        flow = [i for i, c in enumerate(callbacks) if type(c).__name__ == "DefaultFlowCallback"]
        callbacks.insert(flow[0] + 1 if flow else 0, self)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.mixprec is None:
            raise RuntimeError("MixprecCallback: it must be given to Trainer(callbacks=[...]): added later "
                               "(trainer.add_callback), it comes after the Trainer built its Accelerator")
        rec = self.mixprec.recorder
        if rec is not None and rec.report_path is not None:
            raise RuntimeError(f"MixprecCallback: the run folder {rec.out} was closed when the previous train() "
                               "ended; record another run with a new Trainer and MixprecCallback")

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        if self.mixprec is None or logs is None or "loss" not in logs:
            return  # evaluation logs and the final train summary carry no step figures
        figures = self.mixprec.log_figures()
        logs.update(figures)
        # The Trainer appended a copy of these logs to its history before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.mixprec is not None:
            self.mixprec.close()

    # ---- what a script reads afterwards --------------------------------------------------------

    @property
    def scaler(self):
        return None if self.mixprec is None else self.mixprec.scaler

    @property
    def report_path(self) -> Optional[str]:
        rec = None if self.mixprec is None else self.mixprec.recorder
        return None if rec is None else rec.report_path
