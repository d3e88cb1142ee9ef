"""TensorBoard: Telemetry(tensorboard=DIR) (through torch.utils.tensorboard) and `mixprec export
tensorboard RUN_DIR` (the C++ CLI's own event writer) read back with TensorBoard's own reader
(EventAccumulator): every scalar of every step is there, equal to the value this file derives
from log.jsonl by itself; the export of a Python run equals its live event file; an engine run
(`mixprec train`) exports too; a corrupted record is refused by TensorBoard's CRC check; a missing
tensorboard package gives a clear error before anything is written."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Dict

import numpy as np
import pytest
import torch

from integration_support import read_log, skip_without_integrations

skip_without_integrations()
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from mixprec.torch import GradScaler, Telemetry  # noqa: E402

CLI = os.environ.get("MIXPREC_CLI")


def read_back(logdir) -> Dict[str, Dict[int, float]]:
    """Every scalar TensorBoard's reader finds: tag -> {step: value}."""
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    out: Dict[str, Dict[int, float]] = {}
    for tag in ea.Tags()["scalars"]:
        events = ea.Scalars(tag)
        out[tag] = {e.step: e.value for e in events}
        assert len(out[tag]) == len(events), f"{tag}: a step written twice"
    return out


def expected_from_log(lines) -> Dict[str, Dict[int, float]]:
    """The scalars docs/telemetry.md promises, derived here from the log lines (float32 values;
    non-finite values left out)."""
    out: Dict[str, Dict[int, float]] = {}

    def put(tag, step, v):
        if v is not None and math.isfinite(v):
            out.setdefault(tag, {})[step] = float(np.float32(v))

    skips = 0
    for r in lines:
        s = r["step"]
        skips += bool(r["skipped"])
        if r["loss_finite"]:
            put("loss", s, r["loss"])
        put("val_loss", s, r.get("val_loss"))
        put("lr", s, r["lr"])
        put("grad_norm", s, r["grad_norm"])
        put("clip_coef", s, r["clip_coef"])
        put("loss_scale/scale", s, r["scale"])
        put("loss_scale/next_scale", s, r["next_scale"])
        put("loss_scale/skipped", s, float(r["skipped"]))
        put("loss_scale/skips", s, float(skips))
        a = r["act_grads"]
        if a["elements"] > 0:
            if a["nonzero"] > 0:
                put("act_grads/underflow_fraction", s, a["underflow"] / a["nonzero"])
                put("act_grads/subnormal_fraction", s, a["subnormal"] / a["nonzero"])
            put("act_grads/headroom_log2", s, r.get("headroom_log2"))
        for t in r.get("act_grad_tensors", []):
            if t["nonzero"] > 0:
                put("underflow/" + t["name"], s, t["underflow"] / t["nonzero"])
        for t in r.get("fp8", []):  # quantized tensors at their sampled steps
            tag = "lowp/" + t["name"] + "/"
            put(tag + "kurtosis", s, t.get("kurtosis"))
            b = t.get("blocks")
            if b is not None:
                put(tag + "log2_multiplier_std", s, b["log2_multiplier_std"])
                if b["blocks"] > 0:
                    put(tag + "far_block_fraction", s, b["far_blocks"] / b["blocks"])
                put(tag + "max_block_dynamic_range", s, b["max_block_dynamic_range"])
            for w in t.get("what_if", []):
                if t["nonzero"] > 0:
                    put(tag + "what_if/" + w["recipe"] + "/flushed", s, w["flushed"] / t["nonzero"])
                put(tag + "what_if/" + w["recipe"] + "/rel_rms_error", s, w.get("rel_rms_error"))
        put("time/step_seconds", s, r["seconds"])
    return out


def python_run(tmp_path, tensorboard=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler(growth_interval=3)
    tel = Telemetry(model, out=str(tmp_path / "run"), precision="bf16", scaler=scaler, sample_every=2,
                    tensorboard=str(tmp_path / "tb") if tensorboard else None)
    for step in range(1, 9):
        x = torch.randn(32, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 gradients: Telemetry counts what fp16 would flush
            loss = model(x).float().pow(2).mean() * 1e-9   # gradients small enough to underflow fp16
        scaler.scale(loss).backward()
        if step == 4:
            model[2].weight.grad[0, 0] = math.inf
        outcome = scaler.step(opt)
        tel.record(outcome, loss=loss.item(), lr=0.05, tokens=32, val_loss=1.5 if step == 6 else None)
        scaler.update()
        opt.zero_grad()
    tel.close()
    return tmp_path / "run"


def export(run_dir, *extra):
    if not CLI:
        pytest.skip("MIXPREC_CLI is not set (make test-python sets it to the built mixprec program)")
    return subprocess.run([CLI, "export", "tensorboard", str(run_dir), *extra], capture_output=True, text=True)


def test_telemetry_tensorboard_holds_every_scalar(tmp_path):
    run = python_run(tmp_path)
    lines = read_log(run)
    got, want = read_back(tmp_path / "tb"), expected_from_log(lines)
    assert got == want
    # what the issue names is among them: loss, scale, skips, grad norm, per-layer underflow
    assert got["loss_scale/skipped"][4] == 1.0 and got["loss_scale/skips"][8] == 1.0
    assert 4 not in got["grad_norm"] and len(got["grad_norm"]) == 7
    assert got["val_loss"] == {6: 1.5}
    per_layer = [t for t in got if t.startswith("underflow/")]
    assert sorted(per_layer) == ["underflow/0", "underflow/1", "underflow/2"]
    assert sorted(got["underflow/0"]) == [1, 3, 5, 7]              # the sampled steps
    assert max(got["act_grads/underflow_fraction"].values()) > 0  # the tiny loss does underflow


def test_low_precision_scalars_per_tensor(tmp_path):
    """A model with low-precision Linears and Telemetry(what_if=...): per quantized tensor, at the
    sampled steps, its kurtosis, the blocks' log2-multiplier std, the far-block fraction, the
    largest block dynamic range and each what-if's flushed fraction and error."""
    import mixprec.torch as mt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    mt.low_precision(model, "mxfp8")  # the middle Linear
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tel = Telemetry(model, out=str(tmp_path / "run"), precision="fp32", sample_every=2, histogram_every=0,
                    tensorboard=str(tmp_path / "tb"), what_if=["nvfp4"])
    for _ in range(5):
        loss = model(torch.randn(32, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        tel.record(None, loss=loss.item())
    tel.close()
    got, want = read_back(tmp_path / "tb"), expected_from_log(read_log(tmp_path / "run"))
    assert got == want
    for role in ("input", "weight", "grad_output"):
        tag = f"lowp/2.{role}/"
        assert sorted(got[tag + "kurtosis"]) == [1, 3, 5]  # the sampled steps
        for what in ("log2_multiplier_std", "far_block_fraction", "max_block_dynamic_range",
                     "what_if/nvfp4/flushed", "what_if/nvfp4/rel_rms_error"):
            assert sorted(got[tag + what]) == [1, 3, 5], tag + what
    assert got["lowp/2.input/what_if/nvfp4/rel_rms_error"][1] > 0
    if CLI:  # the export of the same run: the same scalars
        r = export(tmp_path / "run", "--out", str(tmp_path / "exported"))
        assert r.returncode == 0, r.stderr
        assert read_back(tmp_path / "exported") == got


def test_export_of_a_python_run_equals_the_live_file(tmp_path):
    run = python_run(tmp_path)
    r = export(run)
    assert r.returncode == 0, r.stderr
    assert "(8 steps, " in r.stdout and str(run / "tensorboard") in r.stdout
    assert read_back(run / "tensorboard") == read_back(tmp_path / "tb")
    # a second export replaces the first (the run may have grown): still one value per step
    r = export(run)
    assert r.returncode == 0, r.stderr
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert read_back(run / "tensorboard") == expected_from_log(read_log(run))


def test_export_of_an_engine_run(tmp_path):
    if not CLI:
        pytest.skip("MIXPREC_CLI is not set")
    run = tmp_path / "engine"
    r = subprocess.run([CLI, "train", "--steps", "4", "--layers", "1", "--channels", "32", "--heads", "2",
                        "--context", "16", "--batch", "4", "--accum", "1", "--corpus-tokens", "20000",
                        "--eval-every", "2", "--eval-windows", "4", "--inject-overflow-at", "2", "--out", str(run)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = export(run, "--out", str(tmp_path / "tb-engine"))
    assert r.returncode == 0, r.stderr
    got = read_back(tmp_path / "tb-engine")
    assert got == expected_from_log(read_log(run))
    assert got["loss_scale/skipped"][2] == 1.0 and got["val_loss"].keys() == {2, 4}
    assert any(t.startswith("underflow/h0.") for t in got)      # the engine's per-tensor counts


def test_export_refusals_and_corruption(tmp_path):
    run = python_run(tmp_path)
    r = export(run, "--out", str(tmp_path / "tb"))              # the live writer's folder
    assert r.returncode == 1 and "of another writer" in r.stderr and "choose another --out" in r.stderr
    r = export(tmp_path / "nothing")
    assert r.returncode == 1 and "does not exist" in r.stderr
    (tmp_path / "empty").mkdir()
    r = export(tmp_path / "empty")
    assert r.returncode == 1 and "has no log.jsonl" in r.stderr
    assert not (tmp_path / "empty" / "tensorboard").exists()
    # TensorBoard checks the CRCs: one flipped byte in the last record's data and it is not read
    r = export(run, "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    (path,) = (tmp_path / "c").iterdir()
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01
    path.write_bytes(bytes(data))
    assert 8 not in read_back(tmp_path / "c").get("loss", {})


def test_missing_tensorboard_is_a_clear_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)     # import tensorboard raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ImportError, match="needs the tensorboard package") as e:
        Telemetry(torch.nn.Linear(2, 2), out=str(tmp_path / "run"), tensorboard=str(tmp_path / "tb"))
    assert "mixprec export tensorboard RUN_DIR" in str(e.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()
