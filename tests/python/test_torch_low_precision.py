"""mixprec.torch.low_precision: TE's per-GEMM quantization on any nn.Linear, checked against
the same GEMMs composed by hand from mixprec.quantize / mixprec.dequantize, the recipe file,
delayed scaling's state, and a short training run per recipe."""

import json
import math
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mixprec
import mixprec.torch as mt
from mixprec.torch.low_precision import LowPrecisionLinear

# One thread: two cores shared with builds make torch's thread team spin (as the other torch tests).
torch.set_num_threads(1)


def mlp(seed=0, width=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, 10))


def fq(t, recipe, element, layout, **kw):
    q = mixprec.quantize(t.detach().contiguous(), recipe, element=element, layout=layout, **kw)
    return mixprec.dequantize(q)


def test_default_swaps_all_but_first_and_last():
    m = mt.low_precision(mlp(), "fp8-current")
    kinds = [type(m[i]).__name__ for i in (0, 2, 4, 6)]
    assert kinds == ["Linear", "LowPrecisionLinear", "LowPrecisionLinear", "Linear"]
    assert set(mt.low_precision_modules(m)) == {"2", "4"}
    assert "2.weight" in m.state_dict() and "2.bias" in m.state_dict()
    m2 = mt.low_precision(mlp(), "mxfp8", modules=["0", "6"])
    assert set(mt.low_precision_modules(m2)) == {"0", "6"}
    m3 = mt.low_precision(mlp(), "nvfp4", modules=lambda name, mod: mod.out_features == 64)
    assert set(mt.low_precision_modules(m3)) == {"0", "2", "4"}


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8", "fp8-block", "nvfp4", "mxfp4"])
def test_gemms_are_te_quantized_products(recipe):
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 48)
    mod = LowPrecisionLinear(lin, mt.RecipeOptions(recipe), "lin", seed=3)
    o = mod.options
    x = torch.randn(32, 64, requires_grad=True)
    y = mod(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = lin.weight.detach()
    ex = {"nvfp4": "e2m1", "mxfp4": "e2m1"}.get(recipe, "e4m3")
    edy = {"fp8-current": "e5m2"}.get(recipe, ex)
    wk = {"tile_2d": True} if recipe in ("fp8-block", "nvfp4") else {}
    xq = fq(x, recipe, ex, "rowwise")
    wq = fq(w, recipe, ex, "rowwise", **wk)
    y_want = xq @ wq.t() + lin.bias.detach()
    assert torch.equal(y, y_want)
    sr = {}
    if recipe == "nvfp4":  # the module's random words: draw 0 for dy rowwise, 1 for columnwise
        sr = [dict(stochastic_rounding=True, random=np.random.default_rng([3, d]).integers(0, 2**32, dy.numel(), dtype=np.uint32))
              for d in (0, 1)]
    dyq = fq(dy, recipe, edy, "rowwise", **(sr[0] if sr else {}))
    per_tensor = recipe == "fp8-current"
    wc = fq(w, recipe, ex, "rowwise" if per_tensor else "columnwise", **wk)
    assert torch.equal(x.grad, dyq @ wc)
    rht = {"rht": True} if recipe == "nvfp4" else {}
    dyc = dyq if per_tensor else fq(dy, recipe, edy, "columnwise", **rht, **(sr[1] if sr else {}))
    xc = xq if per_tensor else fq(x, recipe, ex, "columnwise", **rht)
    assert torch.equal(lin.weight.grad, dyc.t() @ xc)
    assert torch.equal(lin.bias.grad, dy.sum(0))


def test_rht_cancels_in_wgrad():
    # With RHT on both wgrad operands, the product approximates dy^T x (the transform is orthogonal).
    torch.manual_seed(2)
    x = torch.randn(64, 32)
    dy = torch.randn(64, 16)
    a = fq(dy, "nvfp4", "e2m1", "columnwise", rht=True).t() @ fq(x, "nvfp4", "e2m1", "columnwise", rht=True)
    exact = dy.t() @ x
    assert float((a - exact).norm() / exact.norm()) < 0.2


def test_mixed_assignment_dict_and_file(tmp_path):
    m = mt.low_precision(mlp(), {"2": "nvfp4", "4": {"recipe": "fp8-delayed", "amax_history_len": 16}, "6": "bf16"})
    mods = mt.low_precision_modules(m)
    assert mods["2"].options.recipe == "nvfp4" and mods["4"].options.amax_history_len == 16
    assert "6" not in mods and "4.amax_history" in m.state_dict()
    path = tmp_path / "assignment.json"
    mt.save_assignment(path, {"0": "bf16", "2": "mxfp8", "4": {"recipe": "mxfp4", "scale_rounding": "floor"}},
                       default="nvfp4", notes="written by a test")
    doc = json.loads(path.read_text())
    assert doc["format"] == "mixprec.low_precision" and doc["version"] == 1
    m2 = mt.low_precision(mlp(), str(path))
    mods = mt.low_precision_modules(m2)
    assert {n: mm.options.recipe for n, mm in mods.items()} == {"2": "mxfp8", "4": "mxfp4", "6": "nvfp4"}
    assert mods["4"].options.scale_rounding == "floor"


def test_assignment_errors_change_nothing(tmp_path):
    base = mlp()
    with pytest.raises(ValueError, match="module '9': expected an nn.Linear of the model, found no such module"):
        mt.low_precision(base, {"2": "nvfp4", "9": "mxfp8"})
    with pytest.raises(ValueError, match="module '1': expected an nn.Linear of the model, found GELU"):
        mt.low_precision(base, {"1": "mxfp8"})
    with pytest.raises(ValueError, match="modules\\[\"2\"\\]: expected one of fp8-delayed, .*, \"bf16\" or a zoo name \\(.*\\), found \"fp4\""):
        mt.low_precision(base, {"2": "fp4"})
    with pytest.raises(ValueError, match="modules\\[\"2\"\\].rhtt: unknown option"):
        mt.low_precision(base, {"2": {"recipe": "nvfp4", "rhtt": True}})
    with pytest.raises(ValueError, match="options.amax_history_len: no module's recipe has this option"):
        mt.low_precision(base, {"2": "nvfp4"}, amax_history_len=16)
    with pytest.raises(ValueError, match="scale_rounding: only mxfp8 and mxfp4 have it"):
        mt.low_precision(base, "nvfp4", scale_rounding="floor")
    assert not mt.low_precision_modules(base)  # nothing was swapped
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "mixprec.low_precision", "version": 7, "modules": {}}))
    with pytest.raises(ValueError, match="version: expected 1, found 7"):
        mt.low_precision(base, str(bad))


def test_delayed_scaling_history_and_state_dict():
    torch.manual_seed(4)
    lin = torch.nn.Linear(16, 16)
    mod = LowPrecisionLinear(lin, mt.RecipeOptions("fp8-delayed", amax_history_len=2), "d")
    xs = [torch.randn(8, 16) * s for s in (1.0, 4.0, 0.5, 0.5)]
    scales = []
    for x in xs:
        mod(x).sum().backward()
        scales.append(float(mod.scale[0]))
    amax = [float(x.abs().max()) for x in xs]
    # TE: the window is the last 2 amaxes, this step's included; scale = 448 / max(window).
    want = [np.float32(448.0) / np.float32(max(amax[max(0, i - 1):i + 1])) for i in range(4)]
    assert scales == [float(v) for v in want]
    # The state saves and loads: a fresh module continues bit for bit.
    sd = mod.state_dict()
    mod2 = LowPrecisionLinear(torch.nn.Linear(16, 16), mt.RecipeOptions("fp8-delayed", amax_history_len=2), "d")
    mod2.load_state_dict(sd)
    x = torch.randn(8, 16) * 3
    assert torch.equal(mod(x), mod2(x))


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-current", "mxfp8", "fp8-block", "nvfp4", "mxfp4"])
def test_trains_and_reports(recipe):
    torch.manual_seed(5)
    x = torch.randn(256, 32)
    target = torch.randint(0, 10, (256,))
    m = mt.low_precision(mlp(6), recipe)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        if step % 10 == 0:
            mt.sample_quantization_error(m)
        loss = torch.nn.functional.cross_entropy(m(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    stats = mt.quantization_stats(m)
    assert set(stats) == {"2", "4"} and set(stats["2"]) == {"x", "w", "dy"}
    assert stats["2"]["x"]["amax"] > 0
    assert 0 <= stats["2"]["dy"]["flushed"] <= 1


def test_bf16_autocast_and_eval():
    m = mt.low_precision(mlp(), "nvfp4")
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m[2].weight.grad is not None and m[2].weight.grad.dtype == torch.float32
    m.eval()
    with torch.no_grad():
        assert torch.isfinite(m(x)).all()


def test_example_compares_recipes(capsys):
    """examples/pytorch/low_precision.py, loaded from its path as `python examples/...` runs it
    (no make, no package of its own), a few steps per row on both models: its table has every
    row asked for and a quantization error for each recipe row; bad flags exit 2 before any
    training. In-process: the models' imports (transformers: seconds) are paid once per run."""
    pytest.importorskip("transformers")
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "low_precision.py"
    spec = importlib.util.spec_from_file_location("mixprec_low_precision_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--model", "both", "--steps", "2", "--batch", "2", "--context", "16", "--sample-every", "1",
                         "--recipes", "bf16,fp8-delayed,nvfp4-all"]) == 0
    out = capsys.readouterr().out
    for model in ("gpt", "transformers"):
        table = out.split(f"\n{model}: ")[1].split("\n\n")[0].splitlines()
        rows = {ln.split()[0]: ln.split() for ln in table[2:] if ln.strip()}
        assert list(rows) == ["bf16", "fp8-delayed", "nvfp4-all"], table
        assert rows["bf16"][2] == "+0.00%" and rows["bf16"][3] == "-"
        for row in ("fp8-delayed", "nvfp4-all"):
            assert math.isfinite(float(rows[row][1])) and 0 < float(rows[row][3]) < 1, rows[row]
    with pytest.raises(SystemExit) as e:
        example.main(["--recipes", "bf16,fp4"])
    assert e.value.code == 2 and "--recipes: unknown ['fp4']" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8-delayed"])
def test_telemetry_records_the_quantized_tensors_at_sampled_steps(tmp_path, recipe):
    """Telemetry finds the low-precision modules itself: at its sampled steps (1, 5, 9 with
    sample_every=4) the log's fp8 array holds x, w and dy of each module, every micro-batch
    measured (two per step here), with the error of an independent quantize/dequantize."""
    torch.manual_seed(7)
    x = torch.randn(64, 32)
    target = torch.randint(0, 10, (64,))
    m = mt.low_precision(mlp(8), recipe)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    tel = mt.Telemetry(m, str(tmp_path / "run"), precision="fp32", sample_every=4, histogram_every=0)
    w_step1 = None
    for step in range(1, 10):
        if step == 1:
            w_step1 = m[2].weight.detach().clone()
        for xb, tb in ((x[:32], target[:32]), (x[32:], target[32:])):
            torch.nn.functional.cross_entropy(m(xb), tb).backward()
        opt.step()
        tel.record(loss=1.0)
        opt.zero_grad()
    tel.close()
    assert not any(mod._sample_step for mod in mt.low_precision_modules(m).values())
    lines = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    sampled = [l["step"] for l in lines if "fp8" in l]
    assert sampled == [1, 5, 9]
    entries = {t["name"]: t for t in lines[0]["fp8"]}
    assert sorted(entries) == sorted(f"{n}.{r}" for n in ("2", "4") for r in ("input", "weight", "grad_output"))
    fp4 = recipe == "nvfp4"
    for name, t in entries.items():
        assert t["recipe"] == recipe
        assert t["role"] == ("backward" if name.endswith("grad_output") else "forward")
        assert t["dtype"] == ("E2M1" if fp4 else ("E5M2" if name.endswith("grad_output") else "E4M3"))
        assert t["elements"] == (32 * 64 if not name.endswith("weight") else 64 * 64)
        assert 0 < t["rel_rms_error"] < (0.3 if fp4 else 0.1)
        assert 0 < t["nonzero"] <= t["elements"] and t["saturated"] + t["flushed"] <= t["elements"]
    # The weight's error at step 1, from mixprec.quantize / dequantize on the same weight.
    kw = dict(tile_2d=True) if fp4 else dict(element="e4m3", scale=float(np.float32(entries["2.weight"]["scale"])))
    wq = mixprec.dequantize(mixprec.quantize(w_step1.numpy(), recipe, **kw))
    want = float(np.linalg.norm((wq - w_step1.numpy()).astype(np.float64)) /
                 np.linalg.norm(w_step1.numpy().astype(np.float64)))
    assert entries["2.weight"]["rel_rms_error"] == pytest.approx(want, rel=1e-12)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["fp8_backward_flushed_fraction"] >= 0
    # The report draws a chart per role.
    html = tmp_path / "report.html"
    mixprec.report([str(tmp_path / "run")], out=str(html))
    text = html.read_text()
    for role in ("input", "weight", "grad_output"):
        assert f'data-chart="fp8-error-{role}-0"' in text
