"""Recipes per GEMM direction and in time (mixprec.torch.low_precision): each per-direction plan's
forward, dgrad and wgrad equal the GEMMs composed by hand from mixprec.quantize / mixprec.dequantize
with the named formats, bit for bit; TE's zoo names give TE's assignments; a recipe file's schedule
switches at its step and its evaluation plan runs in eval mode."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mixprec
import mixprec.torch as mt

torch.set_num_threads(1)


def fq(t, recipe, element, layout, **kw):
    q = mixprec.quantize(t.detach().contiguous(), recipe, element=element, layout=layout, **kw)
    return mixprec.dequantize(q)


def words(seed, draw, n):
    """The module's stochastic-rounding words: one stream per (seed, draw)."""
    return np.random.default_rng([seed, draw]).integers(0, 2**32, n, dtype=np.uint32)


def run(recipe, rows=32, seed=0, **kw):
    """One Linear swapped with `recipe` (a name, or an entry dict); its y, dx, dw, db and the
    inputs, for the hand-composed GEMMs."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    lin = model[0]
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    if isinstance(recipe, dict):
        mt.low_precision(model, {"0": recipe}, **kw)
    else:
        mt.low_precision(model, recipe, modules=["0"], **kw)
    x = torch.randn(rows, 64, requires_grad=True)
    y = model(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    return dict(y=y.detach(), dx=x.grad, dw=model[0].weight.grad, db=model[0].bias.grad, x=x.detach(), w=w, b=b, dy=dy,
                model=model)


def check(r, y, dx, dw):
    assert torch.equal(r["y"], y)
    assert torch.equal(r["dx"], dx)
    assert torch.equal(r["dw"], dw)
    assert torch.equal(r["db"], r["dy"].sum(0))


def test_mxfp8_fwd_nvfp4_bwd_is_te_zoo_assignment():
    r = run("mxfp8_fwd_nvfp4_bwd")
    x, w, b, dy = r["x"], r["w"], r["b"], r["dy"]
    xq, wq = fq(x, "mxfp8", "e4m3", "rowwise"), fq(w, "mxfp8", "e4m3", "rowwise")
    n = dy.numel()
    # dgrad: TE's NVFP4 dy (stochastic: draw 0), dgrad's w plain 1-D NVFP4 from fprop's MXFP8 w.
    dyq = fq(dy, "nvfp4", "e2m1", "rowwise", stochastic_rounding=True, random=words(0, 0, n))
    wc = fq(wq, "nvfp4", "e2m1", "columnwise")
    # wgrad: x from the original, RHT on both, dy stochastic (draw 1).
    xc = fq(x, "nvfp4", "e2m1", "columnwise", rht=True)
    dyc = fq(dy, "nvfp4", "e2m1", "columnwise", rht=True, stochastic_rounding=True, random=words(0, 1, n))
    check(r, xq @ wq.t() + b, dyq @ wc, dyc.t() @ xc)
    # Not the uniform recipes' numbers: the plan is used.
    assert not torch.equal(r["dx"], run("mxfp8")["dx"])


def test_high_precision_fwd_mxfp8_bwd():
    r = run("high_precision_fwd_mxfp8_bwd")
    x, w, b, dy = r["x"], r["w"], r["b"], r["dy"]
    dyq = fq(dy, "mxfp8", "e4m3", "rowwise")
    check(r, x @ w.t() + b, dyq @ fq(w, "mxfp8", "e4m3", "columnwise"),
          fq(dy, "mxfp8", "e4m3", "columnwise").t() @ fq(x, "mxfp8", "e4m3", "columnwise"))


def test_mxfp8_fwd_high_precision_bwd_uses_dequantized_operands():
    r = run("mxfp8_fwd_high_precision_bwd")
    x, w, b, dy = r["x"], r["w"], r["b"], r["dy"]
    xq, wq = fq(x, "mxfp8", "e4m3", "rowwise"), fq(w, "mxfp8", "e4m3", "rowwise")
    check(r, xq @ wq.t() + b, dy @ wq, dy.t() @ xq)


def test_nvfp4_1d_weight():
    r = run("nvfp4_1d_weight", rows=48)
    x, w, b, dy = r["x"], r["w"], r["b"], r["dy"]
    n = dy.numel()
    xq, wq = fq(x, "nvfp4", "e2m1", "rowwise"), fq(w, "nvfp4", "e2m1", "rowwise")  # w: no 2-D tiles
    dyq = fq(dy, "nvfp4", "e2m1", "rowwise", stochastic_rounding=True, random=words(0, 0, n))
    wc = fq(wq, "nvfp4", "e2m1", "columnwise")
    xc = fq(x, "nvfp4", "e2m1", "columnwise", rht=True)
    dyc = fq(dy, "nvfp4", "e2m1", "columnwise", rht=True, stochastic_rounding=True, random=words(0, 1, n))
    check(r, xq @ wq.t() + b, dyq @ wc, dyc.t() @ xc)


def test_backward_override_high_precision_and_per_operand_entries():
    r = run({"recipe": "fp8-current", "backward_override": "high_precision"})
    x, w, b, dy = r["x"], r["w"], r["b"], r["dy"]
    check(r, fq(x, "fp8-current", "e4m3", "rowwise") @ fq(w, "fp8-current", "e4m3", "rowwise").t() + b,
          dy @ w, dy.t() @ x)
    # Forward in high precision, NVFP4 backward without RHT, fp8-current wgrad x from the
    # original under the HYBRID format's E4M3, dy E5M2.
    r = run({"recipe": "nvfp4", "rht": False, "fprop": "bf16",
             "wgrad": {"recipe": "fp8-current"}})
    x, w, b, dy = r["x"], r["w"], r["b"], r["dy"]
    n = dy.numel()
    dyq = fq(dy, "nvfp4", "e2m1", "rowwise", stochastic_rounding=True, random=words(0, 0, n))
    wc = fq(w, "nvfp4", "e2m1", "columnwise", tile_2d=True)
    check(r, x @ w.t() + b, dyq @ wc,
          fq(dy, "fp8-current", "e5m2", "rowwise").t() @ fq(x, "fp8-current", "e4m3", "rowwise"))
    # The statistics name each tensor's recorded operand: dy from dgrad (nvfp4), x from wgrad.
    st = mt.low_precision_modules(r["model"])["0"].stats
    assert (st["x"].recipe, st["x"].element) == ("fp8-current", "e4m3")
    assert (st["dy"].recipe, st["dy"].element) == ("nvfp4", "e2m1")


def test_entry_dequantized_source_with_quantized_backward():
    # dgrad's w and wgrad's x both from the values an MXFP4 fprop multiplied, re-quantized with
    # MXFP8 (which keeps them: far from MXFP8 of the originals).
    r = run({"recipe": "mxfp4", "dgrad": {"w": "mxfp8"}, "wgrad": {"x": "mxfp8"}, "columnwise_source": "dequantized"})
    x, w, b, dy = r["x"], r["w"], r["b"], r["dy"]
    xq, wq = fq(x, "mxfp4", "e2m1", "rowwise"), fq(w, "mxfp4", "e2m1", "rowwise")
    check(r, xq @ wq.t() + b, fq(dy, "mxfp4", "e2m1", "rowwise") @ fq(wq, "mxfp8", "e4m3", "columnwise"),
          fq(dy, "mxfp4", "e2m1", "columnwise").t() @ fq(xq, "mxfp8", "e4m3", "columnwise"))
    original = run({"recipe": "mxfp4", "dgrad": {"w": "mxfp8"}, "wgrad": {"x": "mxfp8"}})
    assert not torch.equal(r["dx"], original["dx"]) and not torch.equal(r["dw"], original["dw"])


def test_rule_violations_are_refused_before_any_swap():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"wgrad: the Hadamard transform cancels only when both operands have it"):
        mt.low_precision(model, {"0": {"recipe": "nvfp4", "wgrad": {"dy": "mxfp8"}}})
    with pytest.raises(ValueError, match=r"a zoo name \(\"nvfp4_1d_weight\"\) takes no other fields"):
        mt.low_precision(model, "nvfp4_1d_weight", modules=["0"], margin=2)
    assert type(model[0]) is torch.nn.Linear


def schedule_file(tmp_path, **extra):
    doc = {"format": "mixprec.low_precision", "version": 1, "default": "bf16",
           "modules": {"0": "mxfp8", "2": "mxfp8"},
           "schedule": [{"from_step": 3, "fprop": "bf16", "modules": ["2"], "label": "forward to bf16"}], **extra}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def two_linears():
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def test_schedule_switches_at_its_step_and_evaluation_runs_its_plan(tmp_path):
    model = mt.low_precision(two_linears(), schedule_file(tmp_path, evaluation="bf16"))
    lin2 = model[2]
    x = torch.randn(8, 16)
    h = model[1](model[0](x)).detach()
    w, b = lin2.weight.detach(), lin2.bias.detach()
    mx = fq(h, "mxfp8", "e4m3", "rowwise") @ fq(w, "mxfp8", "e4m3", "rowwise").t() + b
    assert mt.low_precision_step(model, 2) == []
    assert torch.equal(lin2(h).detach(), mx)
    assert mt.low_precision_step(model, 3) == [{"module": "2", "phase": "forward to bf16"}]
    assert torch.equal(lin2(h).detach(), h @ w.t() + b)  # fprop in high precision from step 3
    assert mt.low_precision_step(model, 4) == []
    assert torch.equal(model[0](x).detach(), fq(x, "mxfp8", "e4m3", "rowwise") @ fq(model[0].weight.detach(), "mxfp8",
                                                                                      "e4m3", "rowwise").t() + model[0].bias.detach())
    # Evaluation: the file's evaluation plan (high precision) on every quantized Linear.
    model.eval()
    assert torch.equal(model[0](x).detach(), x @ model[0].weight.detach().t() + model[0].bias.detach())
    model.train()
    # Going back (a resumed run asks for its step): the step's plan again.
    assert mt.low_precision_step(model, 0) == [{"module": "2", "phase": ""}]
    assert torch.equal(lin2(h).detach(), mx)


def test_schedule_reaching_a_high_precision_module_swaps_it(tmp_path):
    doc = {"format": "mixprec.low_precision", "version": 1, "default": "bf16", "modules": {},
           "schedule": [{"from_fraction": 0.5, "modules": ["2"], "recipe": "mxfp8"}]}
    with pytest.raises(ValueError, match=r"from_fraction: the run's length is needed .*pass low_precision\(\.\.\., "
                                         r"total_steps=N\)"):
        mt.low_precision(two_linears(), doc)
    model = mt.low_precision(two_linears(), doc, total_steps=10)
    assert set(mt.low_precision_modules(model)) == {"2"}
    h = torch.randn(4, 16)
    w, b = model[2].weight.detach(), model[2].bias.detach()
    assert torch.equal(model[2](h).detach(), h @ w.t() + b)  # high precision until step 5
    assert mt.low_precision_step(model, 5) == [{"module": "2", "phase": "phase 1"}]
    assert torch.equal(model[2](h).detach(), fq(h, "mxfp8", "e4m3", "rowwise") @ fq(w, "mxfp8", "e4m3", "rowwise").t() + b)
    bad = dict(doc, schedule=[{"from_step": 1, "modules": ["h.*"], "recipe": "mxfp8"}])
    with pytest.raises(ValueError, match=r"schedule\[0\]\.modules: 'h\.\*' matches no linear module of the model"):
        mt.low_precision(two_linears(), bad)
    with pytest.raises(ValueError, match=r"step: expected an integer"):
        mt.low_precision_step(model, -1)


def test_telemetry_marks_the_switch_in_the_run_log_and_the_report(tmp_path):
    import subprocess
    import sys
    model = mt.low_precision(two_linears(), schedule_file(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = tmp_path / "run"
    tel = mt.Telemetry(model, out=str(run), precision="fp32", sample_every=4, histogram_every=0)
    torch.manual_seed(0)
    for step in range(6):
        mt.low_precision_step(model, step)
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        tel.record(loss=loss.item())
        opt.zero_grad()
    tel.close()
    lines = [json.loads(l) for l in (run / "log.jsonl").read_text().splitlines()]
    # low_precision_step(model, 3) switched before the 4th optimizer step: log step 4.
    assert [l.get("recipe_phase") for l in lines] == [None, None, None, "forward to bf16", None, None]
    r = subprocess.run([sys.executable, "-m", "mixprec", "report", str(run), "--out", str(tmp_path / "r.html")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "forward to bf16" in (tmp_path / "r.html").read_text()
