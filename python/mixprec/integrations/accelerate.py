"""mixprec in a Hugging Face Accelerate loop (docs/python.md, "Accelerate").

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    mp = MixprecAccelerate(accelerator, out="runs/acc")          # added: before prepare
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()                                         # recorded: the scaler's outcome
        optimizer.zero_grad()
    mp.close()                                                   # added: summary, report path

What it changes in the Accelerator, before prepare():
- fp16: its scaler is mixprec.torch.GradScaler (torch.amp.GradScaler's rule unless a preset is
  named; the step guards' keywords skip_loss_z, skip_grad_z, skip_window, skip_if, skip_nonfinite
  go to it too); on a CPU, where Accelerate turns fp16 into fp32 without saying so (no autocast,
  no scaler: `native_amp` False), autocast(cpu, float16) and the scaler are switched on, with a
  warning saying so. bf16 and fp32 runs keep their Accelerator as it is (no loss scaling), unless
  step-guard keywords are given: then mixprec.torch.StepGuard with them is the Accelerator's
  scaler (it scales nothing; it checks each step and skips a bad one: inf/NaN gradients, a loss
  or gradient-norm spike, skip_if). Its state goes into accelerator.save_state() as a scaler's.
- accelerator.backward(loss) hands each loss to the recorder (the step's loss is their sum:
  Accelerate divides by its accumulation steps).
- Once prepare() has given it one model and one optimizer, Telemetry watches the model (and a
  `layerwise` scaler watches it too, scaler.watch(model), unless the script watched it already)
  and each step of the optimizer that really steps (sync_gradients) is recorded.
- A step skipped for any reason (an overflow, a guard) is not applied: the scaler does not call
  the optimizer, so Accelerate's step_was_skipped is True and a prepared LR scheduler holds.
  log_figures() says why (skip_reason) and counts the skips by reason.
- Step numbers continue the training's: for fp16, the scaler's update count (its state is in
  accelerator.save_state()'s scaler.pt, so a loop resumed with load_state() goes on from there);
  mp.set_step(n) gives the loop's own count (bf16 and fp32 runs, or a checkpoint without the
  scaler's state).
"""

from __future__ import annotations

import functools
import json
import types
import warnings
from typing import Any, Callable, Dict, Optional

from .. import _args
from ..torch import GradScaler
from ._recorder import (StepRecorder, make_guard, make_scaler, precision_of, require, split_guard_options,
                        split_options)

_accelerate = require("accelerate", "accelerate", "mixprec.integrations.accelerate")
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["MixprecAccelerate", "install_scaler"]

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


def _step_guard_only(scaler: Any) -> bool:
    """mixprec.torch.StepGuard (or a disabled GradScaler with step guards): no loss scale."""
    return isinstance(scaler, GradScaler) and not scaler.is_enabled() and scaler._guarded()


def install_scaler(accelerator: Any, scaler: Any) -> bool:
    """Makes `scaler` (mixprec.torch.GradScaler, or torch.amp.GradScaler) the Accelerator's, before
    accelerator.prepare(). For fp16; a bf16 or fp32 Accelerator takes mixprec.torch.StepGuard
    (step guards without loss scaling: accelerator.backward() hands it the loss, the optimizer's
    step() asks it whether to step). Where Accelerate left fp16 off (a CPU: native_amp False,
    no scaler, fp32 outputs from autocast()), switches it on: prepare() then wraps the model's
    forward in autocast(device, float16) and gives the optimizer this scaler, as on a GPU.
    Returns True when fp16 was off and is now on."""
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError("install_scaler: call it before accelerator.prepare(...) (the prepared model and "
                           "optimizer keep the scaler and autocast they were prepared with)")
    guard_only = _step_guard_only(scaler)
    if accelerator.mixed_precision != "fp16" and not guard_only:
        raise ValueError(f"install_scaler: the Accelerator's mixed precision is {accelerator.mixed_precision!r}; "
                         "a loss scaler is for fp16 (Accelerator(mixed_precision=\"fp16\")); a bf16 or fp32 "
                         "run takes mixprec.torch.StepGuard(...) (step guards without loss scaling)")
    if accelerator.mixed_precision == "fp16" and guard_only:
        raise ValueError("install_scaler: scaler: expected a loss scaler for the fp16 run, found a step guard "
                         "without one; mixprec.torch.GradScaler(skip_loss_z=..., ...) scales and guards")
    if accelerator.distributed_type in _UNSUPPORTED:
        raise ValueError(f"install_scaler: {accelerator.distributed_type} brings its own loss scaling; "
                         "mixprec's GradScaler does not replace it")
    if guard_only:
        accelerator.scaler = scaler  # autocast stays as Accelerate set it (bf16) or off (fp32)
        return False
    was_off = not accelerator.native_amp
    accelerator.native_amp = True
    accelerator.scaler = scaler
    return was_off


def acc_ready(accelerator: Any) -> bool:
    return bool(accelerator._models) and bool(accelerator._optimizers)


def _fp16_off_message(device: Any) -> str:
    return (f"mixprec: fp16 was asked for on {device}, where Accelerate trains in fp32 without saying so "
            "(no autocast, no loss scaler); mixprec switches autocast(float16) and its GradScaler on")


class MixprecAccelerate:
    """mixprec.torch.GradScaler and Telemetry in an Accelerate loop.

    MixprecAccelerate(accelerator, out, preset=None, *, modules=None, sample_every=4, histogram_every=50,
                      check_forward=True, tensorboard=None, report=True, skip_nonfinite=None,
                      skip_loss_z=0.0, skip_grad_z=0.0, skip_window=128, skip_if=None, **overrides)

    accelerator  an accelerate.Accelerator, before prepare()
    out          the run folder (Telemetry's rules: new or empty); written by the main process
    preset       the scaler's policy (mixprec.preset_names()); None = torch.amp.GradScaler's rule
    overrides    GradScaler keywords (init_scale, growth_interval, the core's config keys)
    skip_*       the step guards (docs/spike_guards.md): fp16, GradScaler's keywords; bf16 and
                 fp32, a mixprec.torch.StepGuard with them becomes the Accelerator's scaler
    modules, sample_every, histogram_every, check_forward, tensorboard: Telemetry's
    report       render the report (report.html) when closing

    The run folder numbers the steps as the training does (set_step(); a resumed fp16 loop: the
    restored scaler's count), so that a folder recording a resumed run continues the numbers.
    """

    def __init__(self, accelerator: Any, out: str, preset: Optional[str] = None, *, report: bool = True,
                 **kwargs: Any) -> None:
        options = split_options(kwargs)
        precision = precision_of(accelerator.mixed_precision, "MixprecAccelerate")
        self.accelerator = accelerator
        self.scaler = None
        if precision == "fp16":
            self.scaler = make_scaler(preset, kwargs)  # the step guards' keywords included
            if install_scaler(accelerator, self.scaler):
                warnings.warn(_fp16_off_message(accelerator.device), stacklevel=2)
        else:
            guard = split_guard_options(kwargs)
            if preset is not None or kwargs:
                given = ", ".join((["preset"] if preset is not None else []) + list(kwargs))
                raise ValueError(f"MixprecAccelerate: {given}: GradScaler options, but the run is {precision} "
                                 "(loss scaling is for fp16; the step guards' skip_* keywords are for any run)")
            if accelerator._models or accelerator._optimizers:
                raise RuntimeError("MixprecAccelerate: create it before accelerator.prepare(...)")
            self.scaler = make_guard(guard)  # None without guard keywords: the Accelerator as it was
            if self.scaler is not None:
                install_scaler(accelerator, self.scaler)
        main = accelerator.is_main_process
        self.recorder = StepRecorder(out, precision, self.scaler, options, report=report,
                                     who="mixprec") if main else None
        self._started = False
        self._optimizer: Optional[AcceleratedOptimizer] = None
        self._last_step = 0            # the number of the last step recorded (or given by set_step)
        self._user_steps = False       # set_step() was called: the loop counts, not the scaler
        # The Hugging Face Trainer's door: the step being taken, from the Trainer's own state.
        self._step_of: Optional[Callable[[], int]] = None
        backward, prepare = accelerator.backward, accelerator.prepare

        @functools.wraps(prepare)
        def prepare_and_start(*args: Any, **kw: Any) -> Any:
            result = prepare(*args, **kw)
            if acc_ready(accelerator):
                self._start()
            return result

        @functools.wraps(backward)
        def recorded_backward(loss: Any, **kw: Any) -> Any:
            self._start()
            result = backward(loss, **kw)
            if self.recorder is not None:
                self.recorder.add_loss(loss / accelerator.gradient_accumulation_steps)
            return result

        accelerator.prepare = prepare_and_start  # this Accelerator only
        accelerator.backward = recorded_backward

    # ---- the prepared objects ------------------------------------------------------------------

    def _start(self) -> None:
        if self._started:
            return
        acc = self.accelerator
        models, optimizers = acc._models, acc._optimizers
        if len(models) != 1 or len(optimizers) != 1:
            raise RuntimeError(f"mixprec: accelerator.backward() with {len(models)} prepared models and "
                               f"{len(optimizers)} prepared optimizers; mixprec records one model and one "
                               "optimizer (prepare them before the first backward)")
        self._started = True
        self._hook(optimizers[0])
        # The module itself (not DDP's or torch.compile's wrapper): Telemetry's names are its own.
        model = acc.unwrap_model(models[0], keep_torch_compile=False)
        if self.scaler is not None and self.scaler.preset == "layerwise" and self.scaler._lw is None:
            # Without watch() a layerwise scaler is its base scale alone (every rank watches: the
            # per-layer scaling is in each rank's backward). A script's own watch() is kept.
            self.scaler.watch(model)
        if self.recorder is not None:
            self.recorder.start(model)

    def _hook(self, opt: AcceleratedOptimizer) -> None:
        if self.scaler is not None and opt.scaler is not self.scaler:
            raise RuntimeError("mixprec: the prepared optimizer has another scaler (prepared before MixprecAccelerate?)")
        step = opt.step

        def recorded_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            if optimizer.gradient_state.sync_gradients:
                self.on_step(optimizer)
            return result

        # A bound method, as torch's LR schedulers expect when they wrap step() in turn.
        opt.step = types.MethodType(functools.wraps(step.__func__)(recorded_step), opt)  # this optimizer only
        self._optimizer = opt

    def on_step(self, opt: Any) -> Optional[Dict[str, Any]]:
        """Records the optimizer step just taken (the Trainer integration calls this too)."""
        if self.recorder is None:
            return None
        outcome = self.scaler.last_outcome if self.scaler is not None else None
        line = self.recorder.record(opt.param_groups[0]["lr"], outcome, step=self._step_number())
        self._last_step = line["step"]
        return line

    def _step_number(self) -> int:
        """The number of the step just taken in the training (not in this folder)."""
        if self._step_of is not None:
            return self._step_of()
        if self._user_steps or self.scaler is None or not self.scaler.is_enabled():
            return self._last_step + 1
        # update() ran inside the optimizer's step: the count includes this step, and it comes
        # back with the scaler's state (accelerator.load_state). Never below the last recorded.
        updates = int(json.loads(self.scaler._p.loss_scale_json())["counters"]["steps"])
        return max(updates, self._last_step + 1)

    def set_step(self, step: int) -> None:
        """The optimizer steps the loop has taken (a resumed loop: the checkpoint's step): the
        next one recorded is step + 1, and so on from there. Without it an fp16 loop is numbered
        by its scaler's update count (restored by accelerator.load_state), other runs from 1."""
        step = _args.integer("MixprecAccelerate.set_step: step", step, 0, 2**63 - 1)
        if step < self._last_step:
            raise ValueError(f"MixprecAccelerate.set_step: step: expected an integer >= {self._last_step} "
                             f"(the last step recorded), found {step}")
        self._last_step = step
        self._user_steps = True

    # ---- what the loop reads -----------------------------------------------------------------

    @property
    def dir(self) -> str:
        return self.recorder.out if self.recorder is not None else ""

    def log_figures(self) -> Dict[str, Any]:
        """skipped_steps (since the last call), skipped_steps_total, skipped_<reason>_total for each
        reason (nonfinite_grad, nonfinite_loss, loss_spike, grad_spike, user), loss_scale (fp16)
        and, after a skip, skip_reason (why: "loss_spike (z 7.3) at step N", several joined by
        "; ") and, after an overflow, overflow ("<parameter> (step N)"), N the training's step
        number: for accelerator.log(...) or a progress line."""
        return self.recorder.log_figures() if self.recorder is not None else {}

    def close(self) -> Optional[str]:
        """Closes the run folder (summary, alerts), renders its report and prints its path."""
        return self.recorder.close() if self.recorder is not None else None

    def __enter__(self) -> "MixprecAccelerate":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
