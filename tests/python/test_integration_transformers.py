"""mixprec.integrations.transformers.MixprecCallback in a real transformers.Trainer run (GPT-2's
architecture at toy size, random init, random tokens, CPU, fp16): the one line added to the
Trainer, an overflow injected at step 3, the Trainer's own logs naming the skip and the
parameter, the run folder rendered by `mixprec report`, and the weights bit for bit those of the
same Trainer run on torch.amp.GradScaler. Also: fp16 on a CPU is real (float16 outputs inside the
model), where the Trainer alone trains in fp32 without saying so."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from integration_support import (INJECT_PARAM, INJECT_STEP, VOCAB, Injector, TokenDataset, assert_bitwise_equal,
                                 assert_cli_report, gpt2, read_log, skip_without_integrations)

skip_without_integrations()
import transformers  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from mixprec.integrations.accelerate import install_scaler  # noqa: E402
from mixprec.integrations.transformers import MixprecCallback  # noqa: E402

STEPS = 5


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)  # the Trainer's Accelerator is a process-wide singleton
    yield
    AcceleratorState._reset_state(True)


class StepCounter(transformers.TrainerCallback):
    """Advances the injector; notes the dtype a Conv1D of the model produced in training."""

    def __init__(self, injector: Injector, model: torch.nn.Module) -> None:
        self.injector = injector
        self.dtypes = set()
        model.transformer.h[0].mlp.c_fc.register_forward_hook(
            lambda m, i, o: self.dtypes.add(o.dtype) if torch.is_grad_enabled() else None)

    def on_step_end(self, args, state, control, **kwargs):
        self.injector.step += 1


def trainer_for(tmp_path, model, callbacks, steps=STEPS, fp16=True):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), use_cpu=True, fp16=fp16, max_steps=steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, optim="adamw_torch")
    return transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(64), callbacks=callbacks)


def run(tmp_path, mixprec: bool):
    model = gpt2()
    injector = Injector(model)
    counter = StepCounter(injector, model)
    callbacks = [counter]
    if mixprec:
        mp = MixprecCallback(out=str(tmp_path / "run"), growth_interval=2)    # what the user adds
        callbacks.append(mp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trainer_for(tmp_path, model, callbacks)
        if not mixprec:  # the control: torch's own scaler, put where the callback puts mixprec's
            install_scaler(trainer.accelerator, torch.amp.GradScaler("cpu", growth_interval=2))
        trainer.train()
    return trainer, model, counter, caught


def test_trainer_with_mixprec_callback_equals_torch_amp_bit_for_bit(tmp_path):
    trainer, model, counter, caught = run(tmp_path, mixprec=True)
    _, reference, _, _ = run(tmp_path / "torch", mixprec=False)
    assert_bitwise_equal(model, reference)
    assert trainer.accelerator.scaler.get_scale() == 2.0 ** 17   # one backoff, growth every 2 clean steps
    # fp16 was made real, and the user was told
    assert counter.dtypes == {torch.float16}
    assert any("fp16 was asked for on cpu" in str(w.message) for w in caught)

    # The Trainer's own logs: one entry per step, the skip and the parameter in the step's entry
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h and "train_loss" not in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    assert [h["skipped_steps"] for h in logs] == [int(s == INJECT_STEP) for s in range(1, STEPS + 1)]
    assert logs[INJECT_STEP - 1]["overflow"] == f"{INJECT_PARAM} (step {INJECT_STEP})"
    assert all("overflow" not in h for i, h in enumerate(logs) if i != INJECT_STEP - 1)
    assert logs[-1]["skipped_steps_total"] == 1
    assert [h["loss_scale"] for h in logs] == [2.0 ** 16, 2.0 ** 17, 2.0 ** 16, 2.0 ** 16, 2.0 ** 17]

    # The run folder: every optimizer step, the real outcome, the Trainer's loss; closed and rendered
    log = read_log(tmp_path / "run")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [r["skipped"] for r in log] == [s == INJECT_STEP for s in range(1, STEPS + 1)]
    assert log[INJECT_STEP - 1]["overflow_param"] == INJECT_PARAM
    for r, h in zip(log, logs):
        assert r["loss"] == pytest.approx(h["loss"], rel=1e-6)   # the step's mean loss, as the Trainer logs it
        assert r["tokens"] == 2 * 4 * 16                         # 2 micro-batches of 4 x 16 tokens
    assert (tmp_path / "run" / "summary.json").exists()
    assert (tmp_path / "run" / "report.html").exists()
    assert_cli_report(tmp_path / "run")
    with pytest.raises(RuntimeError, match="was closed when the previous train\\(\\) ended"):
        trainer.train()                                          # a second run is not appended to the first


def test_trainer_alone_trains_fp16_on_cpu_in_fp32(tmp_path):
    # The control for "made real": without the callback the same arguments run the model in fp32.
    model = gpt2()
    counter = StepCounter(Injector(model, at=0), model)
    trainer = trainer_for(tmp_path, model, [counter], steps=1)
    trainer.train()
    assert trainer.accelerator.scaler is None and not trainer.accelerator.native_amp
    assert counter.dtypes == {torch.float32}


def test_callback_added_after_init_is_refused(tmp_path):
    trainer = trainer_for(tmp_path, gpt2(), [], steps=1)
    trainer.add_callback(MixprecCallback(out=str(tmp_path / "late")))
    with pytest.raises(RuntimeError, match=r"must be given to Trainer\(callbacks=\[...\]\)"):
        trainer.train()
    assert not (tmp_path / "late").exists()


def test_bf16_trainer_records_without_a_scaler(tmp_path):
    model = gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "t"), use_cpu=True, bf16=True, max_steps=2, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)
    cb = MixprecCallback(out=str(tmp_path / "bf16"), report=False)
    transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(16), callbacks=[cb]).train()
    log = read_log(tmp_path / "bf16")
    assert [r["skipped"] for r in log] == [False, False] and cb.scaler is None
    with pytest.raises(ValueError, match="loss scaling is for fp16"):
        AcceleratorState._reset_state(True)
        transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(16),
                             callbacks=[MixprecCallback(out=str(tmp_path / "x"), preset="mixprec")])


# ---- issue 43: resumed runs, the layerwise preset, the LR schedule on skipped steps --------------

class InjectAt(transformers.TrainerCallback):
    """inf into one parameter's gradient at the given global steps (1-based, the Trainer's own
    count: a resumed run goes on from the checkpoint's)."""

    def __init__(self, model: torch.nn.Module, name: str, at) -> None:
        self.at, self.current = set(at), 0
        dict(model.named_parameters())[name].register_hook(
            lambda g: g * math.inf if self.current in self.at else g)

    def on_train_begin(self, args, state, control, **kwargs):
        self.current = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        self.current = state.global_step + 1


class LinearLM(torch.nn.Module):
    """Embedding and nn.Linear only (what a layerwise scaler watches), the Trainer's dict output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.fc2(torch.relu(self.fc1(self.embed(input_ids))))
        return {"loss": torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))}


def small_args(tmp_path, steps, **kw):
    base = dict(output_dir=str(tmp_path / "trainer"), use_cpu=True, fp16=True, max_steps=steps,
                per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1, save_strategy="no",
                report_to="none", seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def test_r4_resumed_trainer_continues_the_step_numbers(tmp_path):
    # 4 steps (a skip at 2) and a checkpoint; a fresh Trainer resumes it for 3 more (a skip at 6):
    # its run folder and its log lines number the steps 5-7, as the Trainer does.
    model = gpt2()
    cb = MixprecCallback(out=str(tmp_path / "first"), report=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=small_args(tmp_path, 4, save_strategy="steps", save_steps=4),
                             train_dataset=TokenDataset(64),
                             callbacks=[InjectAt(model, INJECT_PARAM, {2}), cb]).train()
        assert [(r["step"], r["skipped"]) for r in read_log(tmp_path / "first")] == \
            [(1, False), (2, True), (3, False), (4, False)]
        AcceleratorState._reset_state(True)
        model = gpt2(seed=1)
        resumed = MixprecCallback(out=str(tmp_path / "resumed"), report=False)
        trainer = transformers.Trainer(model=model, args=small_args(tmp_path, 7), train_dataset=TokenDataset(64),
                                       callbacks=[InjectAt(model, INJECT_PARAM, {6}), resumed])
        trainer.train(resume_from_checkpoint=str(tmp_path / "trainer" / "checkpoint-4"))
    log = read_log(tmp_path / "resumed")
    assert [(r["step"], r["skipped"]) for r in log] == [(5, False), (6, True), (7, False)]
    assert log[1]["overflow_param"] == INJECT_PARAM
    logs = {h["step"]: h for h in trainer.state.log_history if "skipped_steps" in h}
    assert logs[6]["overflow"] == f"{INJECT_PARAM} (step 6)"
    assert [logs[s]["skipped_steps"] for s in (5, 6, 7)] == [0, 1, 0]


def test_r4_layerwise_preset_watches_the_model(tmp_path):
    model = LinearLM()
    cb = MixprecCallback(out=str(tmp_path / "run"), preset="layerwise", report=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=small_args(tmp_path, 2), train_dataset=TokenDataset(16),
                             callbacks=[cb]).train()
    names = {d["name"] for d in cb.scaler.layer_scales()}
    assert {"fc1", "fc2"} <= names
    assert all({d["name"] for d in r["layers"]} >= {"fc1", "fc2"} for r in read_log(tmp_path / "run"))


def test_r4_fused_adamw_schedule_holds_on_a_skip_where_torch_amp_advances(tmp_path):
    # The Trainer's default optimizer (adamw_torch_fused) with the default linear schedule: without
    # a skip the two scalers give the same weights bit for bit; with one, torch.amp's scaler calls
    # the fused optimizer anyway (it skips inside), Accelerate sees no skip and the schedule
    # advances, where mixprec's holds it for the skipped step (docs/python.md, "Hugging Face Trainer").
    def run(where, scaler, skip_at):
        AcceleratorState._reset_state(True)
        model = LinearLM()
        callbacks = [InjectAt(model, "fc1.weight", skip_at)]
        if scaler == "mixprec":
            callbacks.append(MixprecCallback(out=str(where / "run"), report=False))
        args = small_args(where, 3)
        assert args.optim == transformers.training_args.OptimizerNames.ADAMW_TORCH_FUSED
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(16),
                                           callbacks=callbacks)
            if scaler == "torch":
                install_scaler(trainer.accelerator, torch.amp.GradScaler("cpu"))
            trainer.train()
        return model, trainer.lr_scheduler.last_epoch

    clean, clean_epoch = run(tmp_path / "m0", "mixprec", ())
    reference, reference_epoch = run(tmp_path / "t0", "torch", ())
    assert_bitwise_equal(clean, reference)
    assert clean_epoch == reference_epoch == 3
    _, held = run(tmp_path / "m1", "mixprec", {2})
    _, advanced = run(tmp_path / "t1", "torch", {2})
    assert (held, advanced) == (2, 3)
