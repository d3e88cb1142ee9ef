"""mixprec in a Lightning Trainer (the toy GPT-2, random tokens, CPU, fp16 through Lightning's own
MixedPrecision plugin given mixprec.torch.GradScaler, 2 batches per step, clipping at 1.0): an
overflow injected at step 3, the skip in Lightning's logged metrics (CSVLogger's file), the
parameter in the run folder, `mixprec report` on it, the weights bit for bit those of the same
fit with torch.amp.GradScaler in the plugin, and the scaler's state in Lightning's checkpoint."""

from __future__ import annotations

import csv
import logging
import math
import warnings

import pytest
import torch

from integration_support import (INJECT_PARAM, INJECT_STEP, Injector, TokenDataset, assert_bitwise_equal,
                                 assert_cli_report, gpt2, read_log, skip_without_integrations)

skip_without_integrations()
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

import mixprec.torch  # noqa: E402
from mixprec.integrations.lightning import MixprecCallback  # noqa: E402

STEPS, ACCUM = 5, 2


class GPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()
        self.injector = Injector(self.model)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % ACCUM == 0:
            self.injector.step += 1

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit(tmp_path, scaler, callbacks):
    torch.manual_seed(0)
    module = GPT()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=ACCUM,
                        gradient_clip_val=1.0, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                        callbacks=callbacks, logger=CSVLogger(str(tmp_path), name="csv", version=0),
                        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, deterministic=False)
    loader = torch.utils.data.DataLoader(TokenDataset(STEPS * ACCUM * 4), batch_size=4, shuffle=False)
    trainer.fit(module, loader)
    return trainer, module


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_lightning_fit_equals_torch_amp_bit_for_bit(tmp_path):
    messages = Messages()
    logging.getLogger("mixprec").addHandler(messages)
    callback = MixprecCallback(out=str(tmp_path / "run"))                               # added
    try:
        trainer, module = fit(tmp_path, mixprec.torch.GradScaler(growth_interval=2), [callback])  # scaler= changed
    finally:
        logging.getLogger("mixprec").removeHandler(messages)
    _, reference = fit(tmp_path / "torch", torch.amp.GradScaler("cpu", growth_interval=2), [])
    assert_bitwise_equal(module, reference)

    # Lightning's logged metrics, as its CSVLogger wrote them: the skip at its step
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("mixprec/skipped")]
    assert [float(r["mixprec/skipped"]) for r in rows] == [float(s == INJECT_STEP) for s in range(1, STEPS + 1)]
    assert float(rows[-1]["mixprec/skipped_steps_total"]) == 1.0
    assert trainer.logged_metrics["mixprec/skipped_steps_total"] == 1.0
    assert messages.lines == [f"mixprec: step {INJECT_STEP} skipped: inf/NaN in the gradient of model.{INJECT_PARAM}; "
                              "scale 131072 -> 65536"]

    log = read_log(tmp_path / "run")
    assert [r["skipped"] for r in log] == [s == INJECT_STEP for s in range(1, STEPS + 1)]
    assert log[INJECT_STEP - 1]["overflow_param"] == "model." + INJECT_PARAM
    assert (tmp_path / "run" / "report.html").exists() and callback.report_path.endswith("report.html")
    assert_cli_report(tmp_path / "run")

    # The scaler's state goes into Lightning's checkpoint through the plugin, and back
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["MixedPrecision"]
    assert state["scale"] == trainer.precision_plugin.scaler.get_scale() and state["preset"] == "torch"
    restored = mixprec.torch.GradScaler()
    MixedPrecision("16-mixed", "cpu", scaler=restored).load_state_dict(state)
    assert restored.state_dict() == trainer.precision_plugin.scaler.state_dict()


def test_torch_scaler_in_the_plugin_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"scaler is torch.amp.grad_scaler.GradScaler, not mixprec.torch.GradScaler"):
        fit(tmp_path, torch.amp.GradScaler("cpu"), [MixprecCallback(out=str(tmp_path / "r"))])
    assert not (tmp_path / "r").exists()


# ---- issue 43: resumed fits, skipped steps and the LR schedule / EMA, manual optimization -------

class Tiny(L.LightningModule):
    """Two Linear layers; inf into `inject`'s gradient at the given global steps (Lightning's count:
    trainer.global_step + 1 is the step being taken, in a resumed fit too)."""

    def __init__(self, at=(), inject="a.weight", scheduler=False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)
        self.at, self.scheduler = set(at), scheduler
        dict(self.named_parameters())[inject].register_hook(
            lambda g: g * math.inf if self.trainer.global_step + 1 in self.at else g)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.b(torch.relu(self.a(x))).float().pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def tiny_fit(tmp_path, module, steps, callbacks, ckpt_path=None):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=mixprec.torch.GradScaler())],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny run's own warnings (few workers, no logger)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def test_r4_resumed_fit_continues_the_step_numbers(tmp_path):
    messages = Messages()
    logging.getLogger("mixprec").addHandler(messages)
    try:
        trainer = tiny_fit(tmp_path, Tiny(at={2}), 4, [MixprecCallback(out=str(tmp_path / "first"), report=False)])
        trainer.save_checkpoint(tmp_path / "at4.ckpt")
        tiny_fit(tmp_path, Tiny(at={6}), 7, [MixprecCallback(out=str(tmp_path / "resumed"), report=False)],
                 ckpt_path=str(tmp_path / "at4.ckpt"))
    finally:
        logging.getLogger("mixprec").removeHandler(messages)
    assert [(r["step"], r["skipped"]) for r in read_log(tmp_path / "first")] == \
        [(1, False), (2, True), (3, False), (4, False)]
    assert [(r["step"], r["skipped"]) for r in read_log(tmp_path / "resumed")] == [(5, False), (6, True), (7, False)]
    assert [m.split(":")[1] for m in messages.lines] == [" step 2 skipped", " step 6 skipped"]


def test_r4_skipped_steps_hold_the_lr_scheduler_and_the_ema(tmp_path):
    # 6 steps, 2 and 4 skipped: the step-interval schedule and the EMA move on the 4 applied ones.
    module = Tiny(at={2, 4}, scheduler=True)
    ema = EMAWeightAveraging(decay=0.5)
    trainer = tiny_fit(tmp_path, module, 6, [ema, MixprecCallback(out=str(tmp_path / "run"), report=False)])
    log = read_log(tmp_path / "run")
    assert [r["skipped"] for r in log] == [False, True, False, True, False, False]
    # The LR each step used: 0.1 * 0.5 ** (applied steps before it)
    assert [r["lr"] for r in log] == [0.1 * 0.5 ** k for k in (0, 1, 1, 2, 2, 3)]
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 4 and type(sched) is torch.optim.lr_scheduler.LambdaLR  # its own class again
    assert int(ema._average_model.n_averaged) == 4


class TwoOptimizers(L.LightningModule):
    """Manual optimization, a GAN's pattern: each optimizer its own loss, backward and step; each a
    scheduler stepped by the module. inf into a's gradient at global step 3, b's at step 6."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        for name, at in (("a.weight", 3), ("b.weight", 6)):
            dict(self.named_parameters())[name].register_hook(
                lambda g, at=at: g * math.inf if self.trainer.global_step + 1 == at else g)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        for opt, sched, layer in zip(self.optimizers(), self.lr_schedulers(), (self.a, self.b)):
            self.manual_backward(layer(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
            sched.step()

    def configure_optimizers(self):
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.a, self.b)]
        return opts, [torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5 ** e) for o in opts]


def test_r4_manual_optimization_records_every_optimizer_step(tmp_path):
    trainer = tiny_fit(tmp_path, TwoOptimizers(), 6, [MixprecCallback(out=str(tmp_path / "run"), report=False)])
    log = read_log(tmp_path / "run")
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]           # 3 batches, 2 optimizers each
    assert [r["skipped"] for r in log] == [s in (3, 6) for s in range(1, 7)]
    assert [log[2]["overflow_param"], log[5]["overflow_param"]] == ["a.weight", "b.weight"]
    assert all(math.isfinite(r["loss"]) for r in log)              # each step its own loss
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [2, 2]   # 3 steps, 1 skipped each
