"""Step guards through the integrations (issue 47; docs/spike_guards.md): a small regression on
the CPU, loss guard on (skip_loss_z 3.5 over a window of 16 losses), one bad batch (its labels
30 off) at step BAD. In each integration and precision: exactly that step is skipped, as a
loss_spike; the library's logs or metrics say why and count it by reason; the LR schedule, the
optimizer's own step count and a weight average move on the applied steps only. fp16 runs take
the guards on their mixprec.torch.GradScaler; bf16 and fp32 runs on a mixprec.torch.StepGuard
the integration builds from the same keywords."""

from __future__ import annotations

import csv
import logging
import warnings

import pytest
import torch

from integration_support import read_log, skip_without_integrations

skip_without_integrations()
import lightning as L  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

import mixprec.torch  # noqa: E402
from mixprec.integrations import lightning as mp_lightning  # noqa: E402
from mixprec.integrations.accelerate import MixprecAccelerate, install_scaler  # noqa: E402
from mixprec.integrations.transformers import MixprecCallback  # noqa: E402

STEPS, BAD, BATCH = 22, 19, 16     # the window (16 losses) is full from step 16 on
Z, WINDOW = 3.5, 16                # below sqrt(WINDOW - 1), the largest z a window allows
GUARD = dict(skip_loss_z=Z, skip_window=WINDOW)
FP16 = dict(init_scale=256.0)      # the bad batch's gradients stay finite in fp16 at this scale
LR, GAMMA = 1e-3, 0.9


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # GradientState too: a Trainer run that ends with its dataloader leaves end_of_dataloader set,
    # which makes a later Accelerate loop sync (step) on every micro-batch.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def data(n: int = STEPS * BATCH):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def applied_before(k: int) -> int:
    """The applied steps before step k (BAD is skipped)."""
    return k - 1 - (k > BAD)


def assert_one_loss_spike(log):
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [(r["step"], r["skip_reason"]) for r in log if r["skipped"]] == [(BAD, "loss_spike")]
    assert log[BAD - 1]["loss_z"] > Z and not log[BAD - 1]["found_inf"]
    return f"loss_spike (z {log[BAD - 1]['loss_z']:.1f}) at step {BAD}"


def assert_figures(figures, why):
    """What the library's log lines got: the skip, why, and the counts by reason."""
    assert [f["skipped_steps"] for f in figures] == [int(s == BAD) for s in range(1, len(figures) + 1)]
    assert figures[BAD - 1]["skip_reason"] == why
    assert all("skip_reason" not in f for i, f in enumerate(figures) if i != BAD - 1)
    assert all("overflow" not in f for f in figures)           # a guard's skip is no overflow
    assert [f["skipped_loss_spike_total"] for f in figures] == [int(s >= BAD) for s in range(1, len(figures) + 1)]
    last = figures[-1]
    assert last["skipped_steps_total"] == 1
    assert [last[f"skipped_{r}_total"] for r in ("nonfinite_grad", "nonfinite_loss", "grad_spike", "user")] == [0] * 4


# ---- Accelerate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp16", "bf16", "no"])
def test_accelerate_guard_skips_the_bad_batch_and_holds_the_schedule(tmp_path, precision):
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 made real on a CPU: said once per Accelerator
        mp = MixprecAccelerate(accelerator, out=str(tmp_path / "run"), report=False, **GUARD,
                               **(FP16 if precision == "fp16" else {}))
    assert isinstance(mp.scaler, mixprec.torch.StepGuard) == (precision != "fp16")
    assert accelerator.scaler is mp.scaler
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: GAMMA ** e)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x, y = data()
    figures = []
    for k in range(1, STEPS + 1):
        xb, yb = x[(k - 1) * BATCH:k * BATCH], y[(k - 1) * BATCH:k * BATCH]
        if k == BAD:
            yb = yb + 30.0                                         # the bad batch
        accelerator.backward(torch.nn.functional.mse_loss(model(xb).float(), yb))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        figures.append(mp.log_figures())
    mp.close()
    log = read_log(tmp_path / "run")
    why = assert_one_loss_spike(log)
    assert_figures(figures, why)
    # The schedule, the optimizer's own count: the applied steps only
    assert scheduler.scheduler.last_epoch == STEPS - 1
    assert [r["lr"] for r in log] == pytest.approx([LR * GAMMA ** applied_before(k) for k in range(1, STEPS + 1)])
    assert {int(s["step"]) for s in optimizer.optimizer.state.values()} == {STEPS - 1}
    if precision == "fp16":
        assert mp.scaler.get_scale() == 256.0                      # a guard's skip backs nothing off
    else:
        assert "loss_scale" not in figures[-1]


def test_accelerate_guard_refusals(tmp_path):
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match=r"growth_interval: GradScaler options, but the run is bf16"):
        MixprecAccelerate(acc, out=str(tmp_path / "x"), skip_loss_z=Z, growth_interval=3)
    with pytest.raises(ValueError, match=r"skip_loss_z"):          # the core's range: below sqrt(window - 1)
        MixprecAccelerate(acc, out=str(tmp_path / "x"), skip_loss_z=5.0, skip_window=WINDOW)
    with pytest.raises(ValueError, match=r"skip_nonfinite: expected True or None with skip_if"):
        MixprecAccelerate(acc, out=str(tmp_path / "x"), skip_nonfinite=False, skip_if=lambda view: True)
    assert acc.scaler is None and not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="a loss scaler is for fp16"):
        install_scaler(acc, torch.amp.GradScaler("cpu"))
    AcceleratorState._reset_state(True)
    fp16 = Accelerator(cpu=True, mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"expected a loss scaler for the fp16 run, found a step guard"):
        install_scaler(fp16, mixprec.torch.StepGuard(**GUARD))
    assert fp16.scaler is None


# ---- the Hugging Face Trainer ----------------------------------------------------------------------

class Regression(torch.nn.Module):
    """The Trainer's dict output; the labels of step BAD's batch 30 off (the Trainer's own count)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.now = 0

    def forward(self, x, y):
        if self.training and self.now == BAD:
            y = y + 30.0
        return {"loss": torch.nn.functional.mse_loss(self.net(x).float(), y.float())}


class Now(transformers.TrainerCallback):
    def __init__(self, model: Regression) -> None:
        self.model = model

    def on_train_begin(self, args, state, control, **kwargs):
        self.model.now = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        self.model.now = state.global_step + 1


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_trainer_guard_skips_the_bad_batch_and_holds_the_schedule(tmp_path, precision):
    model = Regression()
    cb = MixprecCallback(out=str(tmp_path / "run"), report=False, **GUARD, **(FP16 if precision == "fp16" else {}))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), use_cpu=True, fp16=precision == "fp16", bf16=precision == "bf16",
        max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Now(model), cb])
        trainer.train()
    assert isinstance(cb.scaler, mixprec.torch.StepGuard) == (precision != "fp16")
    log = read_log(tmp_path / "run")
    why = assert_one_loss_spike(log)
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h and "train_loss" not in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    assert_figures(logs, why)
    # The linear schedule: held at the skipped step (the Trainer's global_step counts every step)
    assert trainer.lr_scheduler.last_epoch == STEPS - 1 and trainer.state.global_step == STEPS
    assert [r["lr"] for r in log] == pytest.approx([LR * (1 - applied_before(k) / STEPS) for k in range(1, STEPS + 1)])
    assert {int(s["step"]) for s in trainer.optimizer.optimizer.state.values()} == {STEPS - 1}


# ---- Lightning ---------------------------------------------------------------------------------

class Module(L.LightningModule):
    """The labels of Lightning's step BAD (trainer.global_step + 1) 30 off; a step-interval schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step + 1 == BAD:
            y = y + 30.0
        return torch.nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: GAMMA ** e)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def lightning_fit(tmp_path, precision, callback):
    plugin = (MixedPrecision("16-mixed", "cpu", scaler=mixprec.torch.GradScaler(**FP16, **GUARD))
              if precision == "16-mixed" else MixedPrecision("bf16-mixed", "cpu") if precision == "bf16-mixed"
              else None)
    ema = EMAWeightAveraging(decay=0.5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, precision=None if plugin else precision,
                        plugins=[plugin] if plugin else None, callbacks=[ema, callback],
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    x, y = data()
    messages = Messages()
    logging.getLogger("mixprec").addHandler(messages)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tiny run's own warnings (few workers)
            trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH))
    finally:
        logging.getLogger("mixprec").removeHandler(messages)
    return trainer, ema, messages.lines


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_lightning_guard_skips_the_bad_batch_and_holds_the_schedule_and_ema(tmp_path, precision):
    # fp16: the guards on the plugin's scaler; bf16 and fp32: the callback's keywords (a StepGuard)
    callback = mp_lightning.MixprecCallback(out=str(tmp_path / "run"), report=False,
                                            **({} if precision == "16-mixed" else GUARD))
    trainer, ema, messages = lightning_fit(tmp_path, precision, callback)
    log = read_log(tmp_path / "run")
    why = assert_one_loss_spike(log)
    scale = "; scale 256 -> 256" if precision == "16-mixed" else ""
    assert messages == [f"mixprec: step {BAD} skipped: {why.split(' at step')[0]}{scale}"]
    # Lightning's logged metrics (CSVLogger's file): the skip at its step, counted by reason
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("mixprec/skipped")]
    assert [float(r["mixprec/skipped"]) for r in rows] == [float(s == BAD) for s in range(1, STEPS + 1)]
    assert [float(r["mixprec/skipped_loss_spike_total"]) for r in rows] == \
        [float(s >= BAD) for s in range(1, STEPS + 1)]
    assert float(rows[-1]["mixprec/skipped_nonfinite_grad_total"]) == 0.0
    assert trainer.logged_metrics["mixprec/skipped_loss_spike_total"] == 1.0
    # The schedule, the optimizer's count and the EMA: the applied steps only
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == STEPS - 1 and type(sched) is torch.optim.lr_scheduler.LambdaLR
    assert [r["lr"] for r in log] == pytest.approx([LR * GAMMA ** applied_before(k) for k in range(1, STEPS + 1)])
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {STEPS - 1}
    assert int(ema._average_model.n_averaged) == STEPS - 1
    assert trainer.global_step == STEPS
    assert plugin_is_restored(trainer)
    if precision != "16-mixed":
        # The guard's windows go into Lightning's checkpoint with the callback's state
        assert isinstance(callback.guard, mixprec.torch.StepGuard) and callback.scaler is None
        trainer.save_checkpoint(tmp_path / "last.ckpt")
        state = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["MixprecCallback"]["guard"]
        assert state == callback.guard.state_dict() and state["guard"]["loss"]["count"] == WINDOW
        restored = mp_lightning.MixprecCallback(out=str(tmp_path / "unused"), **GUARD)
        restored.load_state_dict({"guard": state})
        assert restored.guard.state_dict() == state


def plugin_is_restored(trainer) -> bool:
    """After the fit the plugin's own methods are back (the callback's wrappers are gone)."""
    plugin = trainer.precision_plugin
    return "optimizer_step" not in plugin.__dict__ and "pre_backward" not in plugin.__dict__


def test_lightning_guard_keywords_of_an_fp16_run_go_to_its_scaler(tmp_path):
    callback = mp_lightning.MixprecCallback(out=str(tmp_path / "run"), **GUARD)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[callback],
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=mixprec.torch.GradScaler())],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    x, y = data(BATCH)
    with pytest.raises(ValueError, match=r"skip_loss_z, skip_window: expected on the fp16 run's scaler"):
        trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"skip_loss_z"):
        mp_lightning.MixprecCallback(out=str(tmp_path / "run"), skip_loss_z=5.0, skip_window=WINDOW)
    with pytest.raises(TypeError, match=r"unknown Telemetry option 'skip_los_z'"):
        mp_lightning.MixprecCallback(out=str(tmp_path / "run"), skip_los_z=3.0)
