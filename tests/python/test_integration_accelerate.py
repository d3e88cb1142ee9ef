"""mixprec.integrations.accelerate in a plain Accelerate loop (the toy GPT-2, random tokens, CPU,
fp16, 2 micro-batches per step through accelerator.accumulate): the lines a user adds, an
overflow injected at step 3 recorded with its parameter, the loop's log figures, `mixprec
report` on the folder, and the weights bit for bit those of the same loop on torch.amp.GradScaler
(put into the Accelerator by install_scaler). Accelerate alone trains fp16 on a CPU in fp32
(no scaler, autocast() gives float32); with mixprec it is fp16 with a scaler."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

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


# ---- issue 43: a resumed loop's run folder continues the step numbers --------------------------

def tiny_loop(tmp_path, out, steps, inject_at, load=None, save=None, set_step=None, precision="fp16"):
    """A Linear model's loop: inf into 0.weight's gradient at the given (global) steps."""
    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 made real on a CPU: said once per Accelerator
        mp = MixprecAccelerate(accelerator, out=str(tmp_path / out), report=False)
    step = {"now": 0}
    net[0].weight.register_hook(lambda g: g * math.inf if step["now"] in inject_at else g)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    first = 1
    if load is not None:
        accelerator.load_state(load)
        done = int(Path(load).name.split("-")[1])  # the loop's own count
        first = done + 1
        if set_step:
            mp.set_step(done)
    figures = []
    for k in range(first, first + steps):
        step["now"] = k
        accelerator.backward(model(torch.randn(4, 4)).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        figures.append(mp.log_figures())
    if save is not None:
        accelerator.save_state(str(tmp_path / save))
    mp.close()
    return read_log(tmp_path / out), figures


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_r4_resumed_loop_continues_the_step_numbers(tmp_path, precision):
    # fp16: numbered by the scaler's update count, restored by load_state (nothing added to the
    # loop); bf16 (no scaler): by mp.set_step(the checkpoint's step).
    first, _ = tiny_loop(tmp_path, "first", 3, {2} if precision == "fp16" else set(), save="ckpt-3",
                         precision=precision)
    assert [r["step"] for r in first] == [1, 2, 3]
    log, figures = tiny_loop(tmp_path, "resumed", 3, {5} if precision == "fp16" else set(),
                             load=str(tmp_path / "ckpt-3"), set_step=precision == "bf16", precision=precision)
    assert [r["step"] for r in log] == [4, 5, 6]
    if precision == "fp16":
        assert [r["skipped"] for r in log] == [False, True, False]
        assert figures[1]["overflow"] == "0.weight (step 5)"


def test_r4_telemetry_record_takes_the_step_number(tmp_path):
    # What the doors use: record(step=N) numbers the line N (a resumed run's global step); a
    # number not above the previous one is refused before anything is written or consumed.
    import mixprec.torch

    net = torch.nn.Linear(2, 2)
    tel = mixprec.torch.Telemetry(net, out=str(tmp_path / "run"), precision="fp32")
    for step in (11, None, 14):
        net(torch.randn(3, 2)).sum().backward()
        tel.record(loss=1.0, step=step)
    for bad, error in ((14, ValueError), (0, ValueError), (True, TypeError)):
        with pytest.raises(error, match=r"step: expected"):
            tel.record(loss=1.0, step=bad)
    with pytest.raises(ValueError, match=r"step: expected a number above the previous step 14, found 13"):
        tel.record(loss=1.0, step=13)
    assert tel.steps == 14  # the last step's number
    tel.close()
    assert [r["step"] for r in read_log(tmp_path / "run")] == [11, 12, 14]
    mp = MixprecAccelerate(Accelerator(cpu=True), out=str(tmp_path / "acc"), report=False)
    for bad, error in ((-1, ValueError), (2.5, ValueError), (True, TypeError)):
        with pytest.raises(error, match=r"set_step: step: expected an integer in \[0, 2\*\*63\), found"):
            mp.set_step(bad)
