"""mixprec in a Lightning Trainer (the toy GPT-2, random tokens, CPU, fp16 through Lightning's own
MixedPrecision plugin given mixprec.torch.GradScaler, 2 batches per step, clipping at 1.0): an
overflow injected at step 3, the skip in Lightning's logged metrics (CSVLogger's file), the
parameter in the run folder, `mixprec report` on it, the weights bit for bit those of the same
fit with torch.amp.GradScaler in the plugin, and the scaler's state in Lightning's checkpoint."""

from __future__ import annotations

import csv
import logging

import pytest
import torch

from integration_support import (INJECT_PARAM, INJECT_STEP, Injector, TokenDataset, assert_bitwise_equal,
                                 assert_cli_report, gpt2, read_log, skip_without_integrations)

skip_without_integrations()
import lightning as L  # noqa: E402
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
