"""mixprec.torch.Telemetry(optimizer=): the optimizer state's quantization error and lost updates
at sampled steps (optimizer.jsonl), its formats, bytes per parameter and totals in summary.json,
and the report's "Optimizer state" section; each number against what the test computes from the
optimizer's own state and weights."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")

import mixprec  # noqa: E402
from mixprec.torch import GradScaler, Telemetry  # noqa: E402
from mixprec.torch import optim as optim_module  # noqa: E402
from mixprec.torch.optim import AdamW  # noqa: E402

torch.set_num_threads(1)

B1, B2, WD = 0.9, 0.999, 0.01


def model_of(dtype):
    torch.manual_seed(0)
    # 64 x 128 = 8192 weights: the blocked formats quantize them; the 64 biases stay fp32.
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dtype)


def batches(n, dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 128, generator=g).to(dtype) for _ in range(n)]


def lines(run: pathlib.Path):
    return [json.loads(x) for x in (run / "optimizer.jsonl").read_text().splitlines()]


def rel_error(stored, exact):
    s, e = stored.double(), exact.double()
    den = float((e * e).sum())
    return math.sqrt(float(((s - e) ** 2).sum()) / den) if den > 0 else 0.0


def test_recorded_errors_are_the_states_error_against_the_exact_moments(tmp_path):
    """At each sampled step, the recorded m and v errors are ||dequantized - exact|| / ||exact||:
    exact from torch.optim.AdamW's own formula over the state the step started from (at step 1, a
    torch.optim.AdamW run of the same step, whose fp32 moments are the exact ones)."""
    model = model_of(torch.float32)
    opt = AdamW(model.parameters(), lr=1e-3, betas=(B1, B2), weight_decay=WD, moments="8bit")
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", optimizer=opt, sample_every=2)
    ref_model = model_of(torch.float32)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, betas=(B1, B2), weight_decay=WD)
    w = model[0].weight
    expected = {}
    for step, x in enumerate(batches(4, torch.float32), start=1):
        loss = model(x).pow(2).mean()
        loss.backward()
        before = opt.dequantized_moments(w) if step > 1 else (torch.zeros_like(w), torch.zeros_like(w))
        g = w.grad.detach().clone()
        opt.step()
        m, v = opt.dequantized_moments(w)
        # torch.optim.AdamW's moment update, in fp32 from the stored (dequantized) moments.
        m_exact = before[0].lerp(g, 1 - B1)
        v_exact = before[1].mul(B2).addcmul_(g, g, value=1 - B2)
        if step == 1:
            ref_model(x).pow(2).mean().backward()
            ref.step()
            assert torch.equal(m_exact, ref.state[ref_model[0].weight]["exp_avg"])
            assert torch.equal(v_exact, ref.state[ref_model[0].weight]["exp_avg_sq"])
        expected[step] = (rel_error(m, m_exact), rel_error(v, v_exact))
        tel.record(loss=loss.item())
        opt.zero_grad()
    tel.close()
    got = lines(tmp_path / "run")
    assert [line["step"] for line in got] == [1, 3]  # sample_every=2: steps 1 and 3
    for line in got:
        row = next(r for r in line["params"] if r["name"] == "0.weight")
        m_err, v_err = expected[line["step"]]
        assert m_err > 1e-4 and v_err > 1e-4  # 8-bit moments: a real error
        # Step 1 starts from zero moments: the same exact values, the sums equal but for their order.
        # Later, the core's fp32 update may round an element 1 ulp apart from torch's lerp/addcmul:
        # the error moves by ~1e-8 of itself (a neighbouring step's differs by ~1e-2).
        tol = 1e-12 if line["step"] == 1 else 1e-6
        assert row["m_error"] == pytest.approx(m_err, rel=tol, abs=0)
        assert row["v_error"] == pytest.approx(v_err, rel=tol, abs=0)
        bias = next(r for r in line["params"] if r["name"] == "0.bias")
        assert bias["m_error"] == 0.0 and bias["v_error"] == 0.0  # 64 elements: fp32 moments, exact
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["optimizer_state"]
    row = next(r for r in summary["params"] if r["name"] == "0.weight")
    assert (row["m"], row["v"], row["steps"]) == ("8bit", "8bit", 2)
    assert row["m_error"] == pytest.approx((expected[1][0] + expected[3][0]) / 2, rel=1e-6)
    assert row["m_error_max"] == pytest.approx(max(expected[1][0], expected[3][0]), rel=1e-6)
    bias = next(r for r in summary["params"] if r["name"] == "0.bias")
    assert (bias["m"], bias["v"]) == ("fp32", "fp32")


def bf16_run(tmp_path, master, steps=6):
    """A bf16 model under AdamW(master=...), every step sampled; per step the fraction of the
    weights (all nonzero, weight decay on: every element is meant to move) whose bf16 value the
    step left as it was."""
    model = model_of(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-4, betas=(B1, B2), weight_decay=WD, master=master, moments="fp8")
    run = tmp_path / master
    tel = Telemetry(model, str(run), precision="bf16", optimizer=opt, sample_every=1)
    unchanged = []
    for x in batches(steps, torch.bfloat16):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        same = sum(int((b == p.detach()).sum()) for b, p in zip(before, model.parameters()))
        unchanged.append(same / sum(b.numel() for b in before))
        tel.record(loss=loss.item())
        opt.zero_grad()
    tel.close()
    return run, unchanged


def test_bf16_without_a_master_loses_updates_that_the_remainder_keeps(tmp_path):
    none_run, none_unchanged = bf16_run(tmp_path, "none")
    rem_run, _ = bf16_run(tmp_path, "remainder")
    none_lines, rem_lines = lines(none_run), lines(rem_run)
    # master="none": the recorded fraction is the fraction of bf16 weights the step did not move.
    for line, frac in zip(none_lines, none_unchanged):
        assert line["lost_update_fraction"] == pytest.approx(frac, rel=1e-12, abs=0)
    none_sum = json.loads((none_run / "summary.json").read_text())
    rem_sum = json.loads((rem_run / "summary.json").read_text())
    lost_none = none_sum["optimizer_state"]["lost_update_fraction"]
    lost_rem = rem_sum["optimizer_state"]["lost_update_fraction"]
    assert lost_none == pytest.approx(sum(none_unchanged) / len(none_unchanged), rel=1e-12)
    assert lost_none > 0.2  # lr 1e-4 against bf16's 8 bits: most steps are below half an ulp
    assert lost_rem < lost_none / 10  # the remainder's fp32 master keeps them
    assert all(line["lost_update_fraction"] <= lost_none for line in rem_lines)
    # The summary's own lost_update_fraction is the measured mean (the log's lines say 0).
    assert none_sum["lost_update_fraction"] == lost_none


def test_summary_holds_formats_bytes_and_totals_and_stats_only_at_sampled_steps(tmp_path, monkeypatch):
    asked = []
    step_fn = optim_module._core.adam_tensor_step

    def counting(*args):
        asked.append(bool(args[-2]))  # stats: the next-to-last argument (the thread count is last)
        return step_fn(*args)

    monkeypatch.setattr(optim_module._core, "adam_tensor_step", counting)
    model = model_of(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-3, master="remainder", moments=("fp8", "8bit"))
    run = tmp_path / "run"
    tel = Telemetry(model, str(run), precision="bf16", optimizer=opt)  # default sampling: every 4th step
    for x in batches(9, torch.bfloat16):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        tel.record(loss=loss.item())
        opt.zero_grad()
    tel.close()
    assert not opt.collect_stats  # closed: its steps stop measuring
    tensors = len(list(model.parameters()))
    assert asked == [k % 4 == 0 for k in range(9) for _ in range(tensors)]  # steps 1, 5, 9
    got = lines(run)
    assert [line["step"] for line in got] == [1, 5, 9]
    state = json.loads((run / "summary.json").read_text())["optimizer_state"]
    assert state["optimizer"] == "mixprec.torch.optim.AdamW"
    assert state["formats"] == [{"tensors": 4, "master": "remainder", "m": "fp8", "v": "8bit", "block": 0,
                                 "fp8_per_tensor": False, "rule": "torch", "stochastic_rounding": False}]
    measured = opt.state_bytes()
    n = sum(p.numel() for p in model.parameters())
    assert state["elements"] == n
    assert state["bytes"] == measured
    for part in ("params", "master", "m", "v"):
        assert state["bytes_per_param"][part] == measured[part] / n
    assert state["bytes_per_param"]["master"] == 2.0 and state["bytes_per_param"]["params"] == 2.0
    assert state["sampled_steps"] == 3
    assert state["lost_update_fraction"] == pytest.approx(sum(x["lost_update_fraction"] for x in got) / 3)
    names = [name for name, _ in model.named_parameters()]
    assert [r["name"] for r in state["params"]] == names
    for row in state["params"]:
        per_step = [next(r for r in x["params"] if r["name"] == row["name"]) for x in got]
        assert row["steps"] == 3
        assert row["m_error"] == pytest.approx(sum(r["m_error"] for r in per_step) / 3)
        assert row["v_error_max"] == max(r["v_error"] for r in per_step)
        assert row["meant"] == sum(r["meant"] for r in per_step)
    assert {r["name"]: (r["m"], r["v"]) for r in state["params"]}["0.weight"] == ("fp8", "8bit")


def test_a_skipped_step_records_nothing(tmp_path):
    model = model_of(torch.float32)
    opt = AdamW(model.parameters(), lr=1e-3, moments="8bit")
    scaler = GradScaler("cpu", preset="torch", init_scale=2.0 ** 8)
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp16", scaler=scaler, optimizer=opt, sample_every=1)
    for step, x in enumerate(batches(3, torch.float32), start=1):
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = math.inf
        outcome = scaler.step(opt)
        assert outcome.applied == (step != 2)
        tel.record(outcome, loss=loss.item())
        scaler.update()
        opt.zero_grad()
    tel.close()
    assert [line["step"] for line in lines(tmp_path / "run")] == [1, 3]


def test_the_report_shows_the_optimizer_state(tmp_path):
    run, _ = bf16_run(tmp_path, "none", steps=3)
    html = pathlib.Path(mixprec.report(str(run))).read_text()
    at = html.find('<section id="optimizer"><h2>Optimizer state</h2>')
    assert at >= 0
    section = html[at:html.find("</section>", at)]
    assert "master <b>none</b>, m <b>fp8</b>, v <b>fp8</b>" in section
    assert "Largest moment quantization error" in section and "Most lost updates" in section
    assert "<code>0.weight</code>" in section
    lost = json.loads((run / "summary.json").read_text())["optimizer_state"]["lost_update_fraction"]
    assert f"{lost * 100:.2f}%" in section


def test_only_a_mixprec_adamw_is_accepted(tmp_path):
    model = model_of(torch.float32)
    with pytest.raises(TypeError, match=r"optimizer: expected a mixprec\.torch\.optim\.AdamW .* or None, "
                                        r"found AdamW"):
        Telemetry(model, str(tmp_path / "run"), optimizer=torch.optim.AdamW(model.parameters()))
    assert not (tmp_path / "run").exists()  # refused before the folder is made
    with pytest.raises(TypeError, match="found str"):
        Telemetry(model, str(tmp_path / "run"), optimizer="adamw")
