"""Per-block statistics of the low-precision Linear modules at Telemetry's sampled steps
(docs/low_precision.md, "Per-block statistics"): each quantized tensor's entry in log.jsonl holds
the core's block_stats of the quantization the door recorded and the kurtosis of its values, equal
to those computed here from the tensor itself; Telemetry(what_if=[B]) adds what quantizing the same
tensor with recipe B's config of the same operand does, equal to quantizing it with B directly;
the alerts kurtosis-rise and block-spread-rise on a planted instability: one Linear's input grows a
heavy tail from a known step, the alert names that layer and role after that step and before the
loss spikes, and no other layer."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch

import mixprec
import mixprec.torch as mt
from mixprec import _core
from mixprec.torch.low_precision import WHAT_IF_RECIPES, _uniform_configs


def log_lines(run):
    with open(run / "log.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def block_entry(q, x):
    """_core.block_stats(q, x) as the log holds it: tensor_amax is a float32 (written as float32's
    shortest text), the rest doubles and integers written exactly."""
    d = _core.block_stats(q, x)
    d["tensor_amax"] = float(np.float32(d["tensor_amax"]))
    return d


def logged_blocks(t):
    d = dict(t["blocks"])
    d["tensor_amax"] = float(np.float32(d["tensor_amax"]))
    return d


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 64)
        self.fc1 = torch.nn.Linear(64, 64)
        self.fc2 = torch.nn.Linear(64, 48)
        self.out = torch.nn.Linear(48, 4)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(torch.relu(self.inp(x)))))))


def test_sampled_entries_carry_block_stats_kurtosis_and_what_ifs(tmp_path):
    torch.manual_seed(0)
    model = Net()
    mt.low_precision(model, "mxfp8")  # fc1 and fc2
    # The inputs, weights and output gradients the modules saw, per step (hooks of their own).
    seen = {}
    step = {"n": 0}

    def grab_x(name):
        def hook(mod, args):
            seen[(step["n"], f"{name}.input")] = args[0].detach().reshape(-1, args[0].shape[-1]).float().clone()
            seen[(step["n"], f"{name}.weight")] = mod.weight.detach().float().clone()
        return hook

    def grab_dy(name):
        def hook(mod, grad_in, grad_out):
            g = grad_out[0].detach()
            seen[(step["n"], f"{name}.grad_output")] = g.reshape(-1, g.shape[-1]).float().clone()
        return hook

    for name in ("fc1", "fc2"):
        getattr(model, name).register_forward_pre_hook(grab_x(name))
        getattr(model, name).register_full_backward_hook(grab_dy(name))
    tel = mt.Telemetry(model, out=str(tmp_path / "run"), precision="fp32", sample_every=2, histogram_every=0,
                       what_if=["nvfp4", "fp8-current", "mxfp4"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for n in range(1, 6):
        step["n"] = n
        loss = model(torch.randn(32, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        tel.record(None, loss=loss.item())
    tel.close()
    lines = log_lines(tmp_path / "run")
    sampled = [r for r in lines if r.get("fp8")]
    assert [r["step"] for r in sampled] == [1, 3, 5]  # sample_every=2 from the first step
    plan = mt.RecipeOptions("mxfp8").plan()["configs"]
    for r in sampled:
        by_name = {t["name"]: t for t in r["fp8"]}
        assert sorted(by_name) == sorted(f"{m}.{role}" for m in ("fc1", "fc2") for role in ("input", "weight", "grad_output"))
        for name, t in by_name.items():
            layer, role = name.rsplit(".", 1)
            operand = {"input": "fprop.x", "weight": "fprop.w", "grad_output": "dgrad.dy"}[role]
            v = seen[(r["step"], name)].contiguous()
            a = v.numpy()
            cfg = plan[operand]
            q = mixprec.quantize(v, "mxfp8", element=cfg["element"], scale_rounding=cfg["scale_rounding"])
            assert logged_blocks(t) == block_entry(q._q, a), name
            assert t["kurtosis"] == _core.kurtosis(a), name
            assert t["flushed"] == t["blocks"]["flushed"] and t["saturated"] == t["blocks"]["saturated"]
            # The what-ifs: each recipe's config of the same operand, quantized directly.
            assert [w["recipe"] for w in t["what_if"]] == ["nvfp4", "fp8-current", "mxfp4"]
            for w in t["what_if"]:
                b = _uniform_configs(w["recipe"])[operand]
                direct = mixprec.quantize(v, w["recipe"], element=b["element"], layout=b["layout"],
                                          tile_2d=b["tile_2d"], scale_rounding=b["scale_rounding"],
                                          power_of_2_scales=b["power_of_2_scales"], flavour=b["flavour"])
                stats = _core.block_stats(direct._q, a)
                counts = direct._q.counts
                assert (w["elements"], w["saturated"], w["flushed"]) == (
                    counts["elements"], counts["saturated"], counts["flushed"]), (name, w["recipe"])
                assert w["blocks"] == stats["blocks"] and w["far_blocks"] == stats["far_blocks"]
                assert w["log2_multiplier_std"] == stats["log2_multiplier_std"]
                assert w["log2_multiplier_p01"] == stats["log2_multiplier_quantiles"]["p01"]
                assert w["log2_multiplier_p99"] == stats["log2_multiplier_quantiles"]["p99"]
                approx = mixprec.dequantize(direct)
                err = float(torch.linalg.vector_norm((approx - v).double()) / torch.linalg.vector_norm(v.double()))
                assert w["rel_rms_error"] == pytest.approx(err, rel=1e-12)
                assert w["dtype"] == {"e4m3": "E4M3", "e5m2": "E5M2", "e2m1": "E2M1"}[b["element"]]
    # The recipes differ where they should: nvfp4's 16-value blocks are twice mxfp8's 32.
    t = {x["name"]: x for x in sampled[0]["fp8"]}["fc1.input"]
    assert t["what_if"][0]["blocks"] == 2 * t["blocks"]["blocks"]
    assert t["what_if"][1]["blocks"] == 1  # fp8-current: one scale per tensor


def test_what_if_refusals_name_the_argument(tmp_path):
    model = Net()
    with pytest.raises(ValueError, match=r"what_if: expected recipe names among fp8-current, .*found 'fp8-delayed' "
                                         r"\(its scale comes from an amax history"):
        mt.Telemetry(model, out=str(tmp_path / "a"), what_if=["fp8-delayed"])
    with pytest.raises(ValueError, match=r"what_if: expected recipe names among .*found 'nvfp5'"):
        mt.Telemetry(model, out=str(tmp_path / "b"), what_if=["nvfp5"])
    with pytest.raises(ValueError, match=r"what_if: 'nvfp4' is given twice"):
        mt.Telemetry(model, out=str(tmp_path / "c"), what_if=["nvfp4", "nvfp4"])
    with pytest.raises(TypeError, match=r"what_if: expected a list of recipe names, found the str 'nvfp4' "
                                        r"\(one recipe: \['nvfp4'\]\)"):
        mt.Telemetry(model, out=str(tmp_path / "d"), what_if="nvfp4")
    assert not any((tmp_path / d).exists() for d in "abcd")  # refused before the folder is made
    assert "fp8-delayed" not in WHAT_IF_RECIPES and "mxfp8" in WHAT_IF_RECIPES


def test_statistics_are_of_the_steps_last_micro_batch(tmp_path):
    """Two micro-batches: the entry's statistics are those of the second's quantization (as its
    counts are), of the values as they were then (the optimizer changes the weight in place
    before record())."""
    torch.manual_seed(0)
    model = Net()
    mt.low_precision(model, "mxfp8")
    seen = []
    model.fc1.register_forward_pre_hook(lambda mod, args: seen.append((args[0].detach().clone(),
                                                                       mod.weight.detach().clone())))
    tel = mt.Telemetry(model, out=str(tmp_path / "run"), precision="fp32", sample_every=1, histogram_every=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for micro in range(2):
        model(torch.randn(32, 16) * (1 + 10 * micro)).pow(2).mean().backward()
    opt.step()
    tel.record(None, loss=1.0)
    tel.close()
    t = {x["name"]: x for x in log_lines(tmp_path / "run")[0]["fp8"]}
    x2, w = seen[1][0].contiguous(), seen[1][1]
    assert t["fc1.input"]["kurtosis"] == _core.kurtosis(x2.numpy())
    assert logged_blocks(t["fc1.input"]) == block_entry(mixprec.quantize(x2, "mxfp8")._q, x2.numpy())
    assert t["fc1.weight"]["kurtosis"] == _core.kurtosis(w.numpy())
    assert not torch.equal(w, model.fc1.weight.detach())  # the step moved it


def test_block_stats_off_leaves_them_out(tmp_path):
    torch.manual_seed(0)
    model = Net()
    mt.low_precision(model, "nvfp4")
    with pytest.raises(TypeError, match=r"block_stats: expected True or False, found 1"):
        mt.Telemetry(model, out=str(tmp_path / "bad"), block_stats=1)
    tel = mt.Telemetry(model, out=str(tmp_path / "run"), precision="fp32", sample_every=1, histogram_every=0,
                       block_stats=False, what_if=["mxfp8"])
    for _ in range(2):
        model(torch.randn(32, 16)).pow(2).mean().backward()
        tel.record(None, loss=1.0)
    tel.close()
    entries = [t for r in log_lines(tmp_path / "run") for t in r["fp8"]]
    assert len(entries) == 12  # 2 steps x 2 modules x 3 roles, each measured
    assert all("blocks" not in t and "kurtosis" not in t and "rel_rms_error" in t for t in entries)
    assert all([w["recipe"] for w in t["what_if"]] == ["mxfp8"] for t in entries)


def test_the_recorder_checks_the_sampled_statistics(tmp_path):
    rec = _core.TelemetryRecorder(str(tmp_path / "run"), "fp32", "none", 0)
    rec.set_params([])
    a = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q = mixprec.quantize(a, "mxfp8")
    blocks = _core.block_stats(q._q, a)
    good = ("l.input", "forward", "mxfp8", "e4m3", 1.0, float(np.abs(a).max()), 256, 256, 0,
            blocks["flushed"], 0.01, blocks, 3.5, [])

    def record(item):
        return json.loads(rec.record(1.0, 0.0, 0, 0.0, None, 1.0, 1.0, False, True, 1.0, 1.0, "", [], [], [], [], [],
                                     [item]))

    bad = dict(blocks, far_blocks=blocks["blocks"] + 1)
    with pytest.raises(ValueError, match=r"quantized 'l.input': blocks.far_blocks: expected at most blocks - "
                                         r"zero_blocks, found 9"):
        record(good[:11] + (bad, 3.5, []))
    with pytest.raises(ValueError, match=r"quantized 'l.input': kurtosis: expected a finite number >= 0, found -1"):
        record(good[:12] + (-1.0, []))
    w = {"recipe": "nvfp4", "element": "e2m1", "elements": 256, "saturated": 0, "flushed": 300, "rel_rms_error": 0.1,
         "blocks": 16, "far_blocks": 0, "log2_multiplier_std": 0.5, "log2_multiplier_p01": -1.0,
         "log2_multiplier_p99": 1.0}
    with pytest.raises(ValueError, match=r"what_if\[0\].elements: expected at least saturated \+ flushed, found 256"):
        record(good[:13] + ([w],))
    with pytest.raises(ValueError, match=r"what_if\[0\].recipe: expected one of .*found 'nvfp9'"):
        record(good[:13] + ([dict(w, flushed=3, recipe="nvfp9")],))
    with pytest.raises(ValueError, match=r"quantized 'l.input': blocks.log2_multiplier_quantiles: missing"):
        record(good[:11] + ({k: v for k, v in blocks.items() if k != "log2_multiplier_quantiles"}, 3.5, []))
    with pytest.raises(ValueError, match=r"quantized: expected tuples of 11 fields \(14 with the sampled statistics\), "
                                         r"found 12"):
        record(good[:12])
    line = record(good[:13] + ([dict(w, flushed=3)],))
    (t,) = line["fp8"]
    assert t["kurtosis"] == 3.5 and t["blocks"]["blocks"] == blocks["blocks"] == 8
    assert t["what_if"] == [{"recipe": "nvfp4", "dtype": "E2M1", "elements": 256, "saturated": 0, "flushed": 3,
                             "rel_rms_error": 0.1, "blocks": 16, "far_blocks": 0, "log2_multiplier_std": 0.5,
                             "log2_multiplier_p01": -1, "log2_multiplier_p99": 1}]
    assert "kurtosis" not in record(good[:11])["fp8"][0]  # an unsampled tensor: no statistics


# ---- the planted instability ----------------------------------------------------------------

S = 8          # the step from which fc2's input grows a heavy tail
FEATURES = [5, 40]  # the features that grow: one in each of a row's two 32-value MX blocks


def test_planted_instability_is_named_before_the_loss_spikes(tmp_path):
    """fc2's input features 5 and 40 are multiplied by 2^(step - S + 1) from step S on (a forward
    pre-hook; the gradient passes unscaled), until the loss spikes; fc0 and fc1 upstream are
    quantized too (mxfp8) and stay calm; the head fc3 stays in high precision."""
    torch.manual_seed(0)
    D = 64
    teacher = torch.nn.Sequential(torch.nn.Linear(32, D), torch.nn.Tanh(), torch.nn.Linear(D, 10))
    model = torch.nn.Sequential()
    model.add_module("fc0", torch.nn.Linear(32, D))
    model.add_module("a0", torch.nn.GELU())
    model.add_module("fc1", torch.nn.Linear(D, D))
    model.add_module("a1", torch.nn.GELU())
    model.add_module("fc2", torch.nn.Linear(D, D))
    model.add_module("a2", torch.nn.GELU())
    model.add_module("fc3", torch.nn.Linear(D, 10))
    mt.low_precision(model, "mxfp8", modules=["fc0", "fc1", "fc2"])
    mask = torch.zeros(D)
    mask[FEATURES] = 1
    state = {"step": 0}

    def planted(mod, args):
        k = state["step"] - S
        if k < 0:
            return None
        (x,) = args
        return (x + mask * (2.0 ** (k + 1) - 1) * x.detach(),)

    model.fc2.register_forward_pre_hook(planted)
    tel = mt.Telemetry(model, out=str(tmp_path / "run"), precision="fp32", sample_every=1, histogram_every=0,
                       what_if=["nvfp4"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, spike = [], None
    for step in range(1, 30):
        state["step"] = step
        x = torch.randn(64, 32)
        with torch.no_grad():
            labels = teacher(x).argmax(-1)
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        tel.record(None, loss=loss.item(), step=step)
        # The spike: the first loss above 1.5x the median of the previous ones (from the 4th step).
        if len(losses) >= 3 and loss.item() > 1.5 * statistics.median(losses[-10:]):
            spike = step
            break
        losses.append(loss.item())
    alerts = tel.close()
    assert spike is not None and spike > S + 2, (spike, losses)
    mine = [a for a in alerts if a["id"] in ("kurtosis-rise", "block-spread-rise")]
    planted_alerts = [a for a in mine if a["tensor"] == "fc2.input"]
    assert planted_alerts, alerts
    first = min(a["step"] for a in planted_alerts)
    assert S <= first < spike, (first, spike, alerts)
    a = next(a for a in planted_alerts if a["step"] == first)
    assert "'fc2.input' (layer fc2, its input x (the activation))" in a["message"]
    assert "keep this layer's forward in bf16" in a["advice"] and "nvfp4 would flush" in a["advice"]
    # No other layer's tensors are alerted before the spike.
    others = [a for a in mine if not a["tensor"].startswith("fc2.") and a["step"] < spike]
    assert others == [], others
    # The log and the summary carry them.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert any(x["id"] == a["id"] and x.get("tensor") == "fc2.input" for x in summary["alerts"])
