"""mixprec.integrations.accelerate in a plain Accelerate loop (the toy GPT-2, random tokens, CPU,
fp16, 2 micro-batches per step through accelerator.accumulate): the lines a user adds, an
overflow injected at step 3 recorded with its parameter, the loop's log figures, `mixprec
report` on the folder, and the weights bit for bit those of the same loop on torch.amp.GradScaler
(put into the Accelerator by install_scaler). Accelerate alone trains fp16 on a CPU in fp32
(no scaler, autocast() gives float32); with mixprec it is fp16 with a scaler."""

from __future__ import annotations

import warnings

import pytest
import torch

from integration_support import (INJECT_PARAM, INJECT_STEP, Injector, TokenDataset, assert_bitwise_equal,
                                 assert_cli_report, gpt2, read_log, skip_without_integrations)

skip_without_integrations()
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from mixprec.integrations.accelerate import MixprecAccelerate, install_scaler  # noqa: E402

STEPS, ACCUM = 5, 2


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def loop(tmp_path, scaler_kind: str):
    torch.manual_seed(0)
    model = gpt2()
    injector = Injector(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(TokenDataset(STEPS * ACCUM * 4), batch_size=4, shuffle=False)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=ACCUM)
    mp = None
    if scaler_kind == "mixprec":
        mp = MixprecAccelerate(accelerator, out=str(tmp_path / "run"), growth_interval=2)   # added
    else:
        install_scaler(accelerator, torch.amp.GradScaler("cpu", growth_interval=2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    figures = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            injector.step += 1
            if mp is not None:
                figures.append(mp.log_figures())                                          # added (optional)
    if mp is not None:
        mp.close()                                                                        # added
    return model, accelerator, mp, figures


def test_accelerate_loop_equals_torch_amp_bit_for_bit(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, accelerator, mp, figures = loop(tmp_path, "mixprec")
    assert any("fp16 was asked for on cpu" in str(w.message) for w in caught)
    reference, ref_acc, _, _ = loop(tmp_path, "torch")
    assert_bitwise_equal(accelerator.unwrap_model(model), ref_acc.unwrap_model(reference))
    assert mp.scaler.get_scale() == ref_acc.scaler.get_scale() == 2.0 ** 17

    assert [f["skipped_steps"] for f in figures] == [int(s == INJECT_STEP) for s in range(1, STEPS + 1)]
    assert figures[INJECT_STEP - 1]["overflow"] == f"{INJECT_PARAM} (step {INJECT_STEP})"
    assert figures[-1]["skipped_steps_total"] == 1
    log = read_log(tmp_path / "run")
    assert [r["skipped"] for r in log] == [s == INJECT_STEP for s in range(1, STEPS + 1)]
    assert log[INJECT_STEP - 1]["overflow_param"] == INJECT_PARAM
    assert all(r["tokens"] == ACCUM * 4 * 16 for r in log)
    assert_cli_report(tmp_path / "run")


def test_step_loss_is_the_mean_over_the_micro_batches(tmp_path):
    torch.manual_seed(0)
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)   # the weights stay: recompute the losses after
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=ACCUM)
    mp = MixprecAccelerate(accelerator, out=str(tmp_path / "run"), report=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = TokenDataset(8).ids.view(ACCUM, 4, 16)
    losses = []
    for ids in batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            losses.append(loss.item())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    mp.close()
    (line,) = read_log(tmp_path / "run")
    assert line["loss"] == pytest.approx(sum(losses) / ACCUM, rel=1e-6)


def test_refusals(tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = torch.nn.Linear(2, 2)
    accelerator.prepare(model)
    with pytest.raises(RuntimeError, match=r"before accelerator.prepare"):
        install_scaler(accelerator, torch.amp.GradScaler("cpu"))
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="a loss scaler is for fp16"):
        install_scaler(acc, torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="loss scaling is for fp16"):
        MixprecAccelerate(acc, out=str(tmp_path / "x"), growth_interval=3)
    with pytest.raises(ValueError, match="sample_evry: GradScaler options, but the run is bf16"):
        MixprecAccelerate(acc, out=str(tmp_path / "x"), sample_evry=3)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("how", ["accelerate", "script"])
def test_a_compiled_model_is_watched_under_its_own_names(tmp_path, how):
    # Compiled by Accelerator(dynamo_backend=...) or by the script before prepare(): Telemetry
    # watches the module inside torch.compile's wrapper, so names carry no "_orig_mod." and the
    # hooks still count every step.
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", dynamo_backend="aot_eager" if how == "accelerate" else "no")
    mp = MixprecAccelerate(accelerator, out=str(tmp_path / "run"), report=False, sample_every=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(net if how == "accelerate" else torch.compile(net, backend="aot_eager"),
                                           optimizer)
    assert type(model).__name__ == "OptimizedModule"
    for _ in range(2):
        accelerator.backward(model(torch.randn(4, 4)).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    mp.close()
    for line in read_log(tmp_path / "run"):
        assert [p["name"] for p in line["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert [t["name"] for t in line["act_grad_tensors"]] == ["2", "1", "0"]
