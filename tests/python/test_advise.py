"""mixprec.torch.advise (docs/advisor.md): three linear layers of one model whose x, w and dy are
built to need bf16, to be safe in FP8 and to be safe in NVFP4 get exactly those formats; every
measurement equals the error of mixprec.quantize / torch's casts computed here; gradients are
unscaled by the loop's loss scale; the recipe file, Telemetry's run-folder samples and
`mixprec advise RUN_DIR` agree; bad arguments are refused before any step runs."""

from __future__ import annotations

import json
import math
import os
import subprocess

import numpy as np
import pytest
import torch

import mixprec
import mixprec.torch as mt

T, IN, OUT = 64, 64, 32
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# A compute-bound cost model (the large layers a recipe is chosen for); these layers are tiny.
COMPUTE_BOUND = {"bandwidth_gbs": 1e9}


def make(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    sign = np.where(rng.integers(0, 2, (rows, cols)) == 1, -1.0, 1.0)
    if kind == "needs_bf16":  # magnitudes over 2^-40 .. 2^41: only bf16's range holds them
        v = np.ldexp(1.0 + rng.random((rows, cols)), rng.integers(-40, 41, (rows, cols)))
    elif kind == "fp8_safe":  # per 1x16 block one 2^s and 15 values of 2^s * [2^-7, 2^-4]
        s = ((r // 16) * 7 + (c // 16) * 3) % 9 - 4
        small = (1 / 128 + rng.random((rows, cols)) * (1 / 16 - 1 / 128))
        v = np.ldexp(np.where(c % 16 == r % 16, 1.0, small), s)
    else:  # nvfp4_safe: the E2M1 grid times 1.5 * 2^s per 16x16 tile, a 6 in every tile row
        s = np.where((c // 16) % 2 == 0, 3, -2)
        g = np.where(c % 16 == (r * 5) % 16, 6.0, GRID[rng.integers(0, 8, (rows, cols))])
        v = 1.5 * np.ldexp(g, s)
    return (sign * v).astype(np.float32)


KINDS = ("needs_bf16", "fp8_safe", "nvfp4_safe")


class Three(torch.nn.Module):
    """Three independent linear layers; loss = sum_i <layer_i(x_i), G_i>, so dy_i = G_i."""

    def __init__(self) -> None:
        super().__init__()
        self.needs_bf16 = torch.nn.Linear(IN, OUT, bias=False)
        self.fp8_safe = torch.nn.Linear(IN, OUT, bias=False)
        self.nvfp4_safe = torch.nn.Linear(IN, OUT, bias=False)
        with torch.no_grad():
            for i, k in enumerate(KINDS):
                getattr(self, k).weight.copy_(torch.from_numpy(make(k, OUT, IN, 100 + i)))
        self.xs = [torch.from_numpy(make(k, T, IN, 200 + i)) for i, k in enumerate(KINDS)]
        self.gs = [torch.from_numpy(make(k, T, OUT, 300 + i)) for i, k in enumerate(KINDS)]

    def loss(self, scale: float = 1.0) -> torch.Tensor:
        return sum((getattr(self, k)(x) * g).sum() for k, x, g in zip(KINDS, self.xs, self.gs)) * scale


def run_advise(model: Three, steps: int = 2, **kw) -> mt.Advice:
    scale = kw.pop("_scale", 1.0)  # what the loop multiplies the loss by

    def step():
        model.zero_grad(set_to_none=True)
        model.loss(scale).backward()
    kw.setdefault("cost", COMPUTE_BOUND)
    return mt.advise(model, step, steps=steps, **kw)


def test_each_layer_gets_the_format_it_was_built_for():
    a = run_advise(Three(), candidates=["bf16", "fp8-current", "nvfp4"])
    assert a.assignment == {"needs_bf16": "bf16", "fp8_safe": "fp8-current", "nvfp4_safe": "nvfp4"}, a.table()
    a = run_advise(Three())
    assert a.assignment == {"needs_bf16": "bf16", "fp8_safe": "fp8-delayed", "nvfp4_safe": "nvfp4"}, a.table()
    by = {l["layer"]: l for l in a.layers}
    assert by["nvfp4_safe"]["rejected"][0].startswith("mxfp4: ")
    assert by["fp8_safe"]["rejected"][0].startswith("mxfp4: ") and by["fp8_safe"]["rejected"][1].startswith("nvfp4: ")
    assert "the cheapest candidate within the budget" in by["nvfp4_safe"]["reason"]
    assert a.recipe["modules"] == {"needs_bf16": "bf16", "fp8_safe": "fp8-delayed", "nvfp4_safe": "nvfp4"}
    assert a.cost_ratio < 1.0


def _independent(x: np.ndarray, candidate: str, role: str, loss_scale: float, delayed_amax: float):
    """(err_sq, ref_sq, flushed, nonzero) of one tensor, computed here."""
    xd = x.astype(np.float64)
    if candidate == "bf16":
        q = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    elif candidate == "fp16":
        with np.errstate(over="ignore"):
            q = ((x * np.float32(loss_scale)).astype(np.float16).astype(np.float32) / np.float32(loss_scale))
    else:
        grad = role in ("dy", "dw")
        element = "e5m2" if grad and candidate in ("fp8-delayed", "fp8-current") else None
        kw = {"element": element, "tile_2d": role == "w" and candidate in ("fp8-block", "nvfp4")}
        if candidate == "fp8-delayed":
            fp8_max = 57344.0 if element == "e5m2" else 448.0
            kw["scale"] = float(np.float32(fp8_max) / np.float32(delayed_amax))
        q = mixprec.dequantize(mixprec.quantize(x, candidate, **kw))
    d = q.astype(np.float64) - xd
    return float((d * d).sum()), float((xd * xd).sum()), int(((x != 0) & (q == 0)).sum()), int((x != 0).sum())


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_measurements_equal_the_quantizers_errors_computed_here(loss_scale):
    model = Three()
    a = run_advise(model, scaler=None, loss_scale=loss_scale, _scale=loss_scale)
    tensors = {k: {"x": model.xs[i].numpy(), "w": getattr(model, k).weight.detach().numpy(),
                   "dy": model.gs[i].numpy(), "dw": (model.gs[i].T @ model.xs[i]).numpy()}
               for i, k in enumerate(KINDS)}
    checked = 0
    for layer in a.layers:
        for cand, per in layer["candidates"].items():
            for role in ("x", "w", "dy", "dw"):
                x = tensors[layer["layer"]][role]
                amax = float(np.abs(x).max())
                e, r, fl, nz = _independent(x, cand, role, loss_scale, amax)  # two equal steps
                m = per[role]
                assert m["samples"] == 2
                assert m["nonzero"] == 2 * nz and m["elements"] == 2 * x.size
                assert m["flushed"] == pytest.approx(fl / nz, rel=0, abs=0), (layer["layer"], cand, role)
                want = math.sqrt(e / r)
                if math.isinf(e):
                    assert m["rel_rms_error"] == "inf", (layer["layer"], cand, role)
                elif role == "dw":  # dW's sum order is torch's: equal to float32 rounding
                    assert m["rel_rms_error"] == pytest.approx(want, rel=1e-3, abs=1e-6), (layer["layer"], cand, role)
                else:
                    assert m["rel_rms_error"] == pytest.approx(want, rel=1e-12, abs=0), (layer["layer"], cand, role)
                checked += 1
    assert checked == 3 * 8 * 4


def test_gradients_are_unscaled_by_the_scalers_scale():
    model = Three()
    scaler = mt.GradScaler("cpu", 4096.0, preset="static")
    seen = {}
    sampler = mt.advise.__globals__["Sampler"](model)
    sampler.active = True
    (model.loss() * scaler.get_scale()).backward()
    for name, role, step, ls, total, v in sampler.take(1, scaler.get_scale()):
        seen[(name, role)] = (ls, total, v)
    sampler.remove()
    for i, k in enumerate(KINDS):
        ls, total, dy = seen[(k, "dy")]
        assert ls == 4096.0 and total == T
        np.testing.assert_array_equal(dy, model.gs[i].numpy())
        np.testing.assert_array_equal(seen[(k, "x")][2], model.xs[i].numpy())
    # Through advise(): the same measurements as an unscaled run.
    a1 = run_advise(Three(), candidates=["bf16", "nvfp4"])
    a2 = run_advise(Three(), candidates=["bf16", "nvfp4"], scaler=scaler, _scale=4096.0)
    for l1, l2 in zip(a1.layers, a2.layers):
        assert l1["candidates"]["nvfp4"]["dy"] == l2["candidates"]["nvfp4"]["dy"]


def test_rows_are_subsampled_evenly_and_tokens_kept():
    model = Three()
    a = run_advise(model, steps=1, max_rows=16, candidates=["bf16"])
    for l in a.layers:
        assert l["tokens"] == T
        assert l["candidates"]["bf16"]["x"]["elements"] == 16 * IN


def test_recipe_file_and_evidence_are_written(tmp_path):
    a = run_advise(Three(), out=tmp_path / "recipe.json", evidence=tmp_path / "advice.json")
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    assert recipe["format"] == "mixprec.low_precision" and recipe["version"] == 1 and recipe["default"] == "bf16"
    assert recipe["modules"] == {"needs_bf16": "bf16", "fp8_safe": "fp8-delayed", "nvfp4_safe": "nvfp4"}
    assert json.loads((tmp_path / "advice.json").read_text()) == a.data
    # The reader of the recipe file takes it as written: one format, checked by its own loader.
    assert mt.load_assignment(tmp_path / "recipe.json") == recipe
    m = mt.low_precision(Three(), recipe=str(tmp_path / "recipe.json"))
    swapped = {n: l.options.recipe for n, l in mt.low_precision_modules(m).items()}
    assert swapped == {"fp8_safe": "fp8-delayed", "nvfp4_safe": "nvfp4"}
    assert type(m.needs_bf16) is torch.nn.Linear


def test_run_folder_samples_and_the_cli_agree(tmp_path):
    model = Three()
    run = tmp_path / "run"
    scaler = mt.GradScaler("cpu", 256.0, preset="static")
    tel = mt.Telemetry(model, out=str(run), precision="fp32", scaler=scaler, advisor_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        (model.loss() * scaler.get_scale()).backward()
        out = scaler.step(opt)
        tel.record(out, loss=0.0)
        scaler.update()
    tel.close()
    steps = sorted(os.listdir(run / "samples"))
    assert steps == ["step-00000001", "step-00000002"]
    index = json.loads((run / "samples" / steps[0] / "index.json").read_text())
    assert index["format"] == "mixprec.advisor_samples" and index["loss_scale"] == 256.0
    from_run = mt.advise_run(run, cost=COMPUTE_BOUND)
    direct = run_advise(Three(), loss_scale=256.0, _scale=256.0)  # fp16 is measured at the run's scale
    assert from_run.assignment == direct.assignment
    for l1, l2 in zip(from_run.layers, direct.layers):
        assert l1["candidates"] == l2["candidates"]
    cli = os.environ.get("MIXPREC_CLI")
    if not cli:
        pytest.skip("MIXPREC_CLI is not set (make test-python sets it)")
    cfg = tmp_path / "cost.json"
    cfg.write_text(json.dumps({"cost": COMPUTE_BOUND}))
    r = subprocess.run([cli, "advise", str(run), "--config", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "advice" / "recipe.json").read_text()) == from_run.recipe
    assert json.loads((run / "advice" / "advice.json").read_text()) == from_run.data
    assert "nvfp4_safe" in r.stdout and "nvfp4" in r.stdout


@pytest.mark.parametrize("kw, match", [
    ({"candidates": ["fp6"]}, "candidates\\[0\\]: expected one of bf16, fp16"),
    ({"budget": -0.1}, "budget: expected a number in \\[0,"),
    ({"budget": {"max_flushed": 2}}, "budget.max_flushed: expected a number in \\[0, 1\\]"),
    ({"cost": {"bandwidth": 1}}, "cost: unknown key 'bandwidth'"),
    ({"steps": 0}, "steps: expected an int >= 1"),
    ({"every": True}, "every: expected an int >= 1"),
    ({"max_rows": 0}, "max_rows: expected an int >= 1"),
    ({"modules": ["nope"]}, "modules: 'nope' is not a module"),
    ({"loss_scale": -1.0}, "loss_scale: expected a finite number > 0"),
    ({"budget": float("nan")}, "advisor configuration"),
])
def test_bad_arguments_are_refused_before_any_step(kw, match):
    ran = []
    model = Three()
    with pytest.raises(ValueError, match=match):
        mt.advise(model, lambda: ran.append(1), **{"steps": 1, **kw})
    assert ran == []
    assert not model.needs_bf16._forward_hooks  # no hook left behind


def test_sampled_steps_hold_x_and_dy_by_reference_and_copy_what_may_change():
    # x and dy are views of the step's own tensors (nothing copied during the step); w, dW and an
    # x that autograd did not produce are copies, so a loop that refills its input buffer, the
    # optimizer's step and a scaler's in-place unscale do not change the samples.
    Sampler = mt.advise.__globals__["Sampler"]
    to_arrays = mt.advise.__globals__["to_arrays"]
    lin = torch.nn.Linear(IN, OUT, bias=False)
    model = torch.nn.Sequential(torch.nn.Linear(IN, IN, bias=False), lin)
    batch = torch.from_numpy(make("fp8_safe", T, IN, 7))
    seen = {}

    def watch(m, inputs, out):
        seen["x"] = inputs[0]
        out.register_hook(lambda g: seen.update(dy=g))
    lin.register_forward_hook(watch)
    sampler = Sampler(model)
    sampler.active = True
    model(batch).sum().backward()
    held = {(n, r): (t, v) for n, r, _, _, _, t, v in sampler.take_held(1, 1.0)}
    assert held[("1", "x")][0].data_ptr() == seen["x"].data_ptr()
    assert held[("1", "dy")][0].data_ptr() == seen["dy"].data_ptr()
    for copied in (("0", "x"), ("1", "w"), ("1", "dw")):
        assert held[copied][0].data_ptr() not in (batch.data_ptr(), lin.weight.data_ptr(), lin.weight.grad.data_ptr())
    want = {k: t.clone() for k, (t, _) in held.items()}
    batch.add_(1.0)              # the loop refills its input
    with torch.no_grad():
        lin.weight.mul_(2.0)     # the optimizer's step
        lin.weight.grad.mul_(0.5)  # an unscale in place
    arrays = to_arrays([(n, r, 1, 1.0, T, t, v) for (n, r), (t, v) in held.items()])
    for (n, r, _, _, _, values) in arrays:
        np.testing.assert_array_equal(values, want[(n, r)].float().numpy(), err_msg=f"{n}.{r}")
    # A held view written in place after the step is refused, naming the sample.
    t, v = held[("1", "x")]
    seen["x"].add_(1.0)
    with pytest.raises(RuntimeError, match=r"advisor sample 1\.x of step 1: the tensor was modified in place"):
        to_arrays([("1", "x", 1, 1.0, T, t, v)])
    sampler.remove()
    # Subsampled rows are copied: a view of a few rows would keep the whole tensor alive.
    few = Sampler(model, max_rows=4)
    few.active = True
    model(batch).sum().backward()
    for n, r, _, _, total, t, _ in few.take_held(1, 1.0):
        if r in ("x", "dy"):
            assert total == T and t.shape[0] == 4 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    few.remove()


def test_a_step_of_micro_batches_gives_one_sample_per_layer_and_role_the_first():
    # Gradient accumulation (or a recomputed forward): x, dy and dW of the first micro-batch only.
    Sampler = mt.advise.__globals__["Sampler"]
    model = Three()
    sampler = Sampler(model)
    sampler.active = True
    model.loss().backward()
    first_x = [x.clone() for x in model.xs]
    for x in model.xs:
        x.mul_(3.0)  # the second micro-batch: other inputs, other gradients
    model.loss(2.0).backward()
    got = sampler.take(1, 1.0)
    sampler.remove()
    assert sorted((n, r) for n, r, *_ in got) == sorted((k, r) for k in KINDS for r in ("x", "w", "dy", "dw"))
    for n, r, _, _, _, v in got:
        i = KINDS.index(n)
        if r == "x":
            np.testing.assert_array_equal(v, first_x[i].numpy())
        if r == "dy":
            np.testing.assert_array_equal(v, model.gs[i].numpy())  # the first loss's scale, 1
        if r == "dw":
            np.testing.assert_array_equal(v, (model.gs[i].T @ first_x[i]).numpy())


# ---- issue 43: samples without finite values, per-layer loss scaling, Conv1D -----------------

def _scaled_steps(model: Three, scales, scaler):
    """A step_fn whose i-th call multiplies the loss by scales[i] (inf: every gradient inf or
    NaN, the step the scaler skips) and steps through the scaler."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    outcomes = []

    def step():
        opt.zero_grad(set_to_none=True)
        (model.loss(scales[len(outcomes)]) * scaler.get_scale()).backward()
        outcomes.append(scaler.step(opt))
        scaler.update()
    return step, outcomes


def test_r4_a_step_whose_gradients_are_all_inf_is_not_measured(tmp_path):
    # The scaler skipped the sampled step (every dy and dW inf or NaN): that is no measurement,
    # not an error of 0. No recommendation until a step with finite values is sampled; then
    # the measurement is that step's alone.
    model = Three()
    scaler = mt.GradScaler("cpu", 256.0, preset="static")
    step, outcomes = _scaled_steps(model, [math.inf], scaler)
    a = mt.advise(model, step, steps=1, scaler=scaler, cost=COMPUTE_BOUND, out=tmp_path / "recipe.json",
                  evidence=tmp_path / "advice.json")
    assert outcomes[0].found_inf and not outcomes[0].applied
    assert a.assignment == {k: None for k in KINDS}, a.table()
    assert a.not_measured == {k: ["dy", "dw"] for k in KINDS}
    for l in a.layers:
        assert l["reason"] == ("no recommendation: not measured: dy (1 sample, every value inf or NaN); a sampled step "
                               "with finite values measures it")
        assert l["unmeasured_samples"] == {"dy": 1, "dw": 1}
        assert all("dy" not in per and "x" in per for per in l["candidates"].values())
    table = a.table()
    assert table.count("not measured  ") == 3
    assert "not measured: fp8_safe.dy (1 sample, every value inf or NaN)" in table
    assert json.loads((tmp_path / "advice.json").read_text())["layers"][1]["not_measured"] == ["dy", "dw"]
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    assert recipe["modules"] == {k: "bf16" for k in KINDS}
    assert "fp8_safe (not measured)" in recipe["notes"]
    # Then a step with finite values: its measurement alone, the layers chosen as without the
    # overflowed step.
    model = Three()
    scaler = mt.GradScaler("cpu", 256.0, preset="static")
    step, outcomes = _scaled_steps(model, [math.inf, 1.0], scaler)
    both = mt.advise(model, step, steps=2, scaler=scaler, cost=COMPUTE_BOUND)
    finite = run_advise(Three(), steps=1, loss_scale=256.0, _scale=256.0)
    assert [o.applied for o in outcomes] == [False, True]
    assert both.assignment == finite.assignment == {"needs_bf16": "bf16", "fp8_safe": "fp8-delayed",
                                                    "nvfp4_safe": "nvfp4"}, both.table()
    assert both.not_measured == {}
    for l1, l2 in zip(both.layers, finite.layers):
        assert l1["unmeasured_samples"] == {"dy": 1, "dw": 1}
        for cand in l1["candidates"]:
            assert l1["candidates"][cand]["dy"] == l2["candidates"][cand]["dy"], (l1["layer"], cand)
            assert l1["candidates"][cand]["dw"] == l2["candidates"][cand]["dw"], (l1["layer"], cand)


def test_r4_a_nan_weight_is_not_measured():
    model = Three()
    with torch.no_grad():
        model.fp8_safe.weight.fill_(math.nan)
    a = run_advise(model, steps=1)
    assert a.assignment == {"needs_bf16": "bf16", "fp8_safe": None, "nvfp4_safe": "nvfp4"}, a.table()
    assert a.not_measured == {"fp8_safe": ["w"]}
    fp8 = a.layers[1]
    assert fp8["reason"].startswith("no recommendation: not measured: w (1 sample, every value inf or NaN)")


def test_r4_some_inf_values_are_left_out_and_counted():
    # One overflowed dy value: the finite ones are measured, the count said.
    model = Three()
    model.gs[1][3, 5] = math.inf
    a = run_advise(model, steps=1)
    fp8 = a.layers[1]
    assert fp8["chosen"] == "fp8-delayed", a.table()
    assert fp8["candidates"]["fp8-delayed"]["dy"]["nonfinite"] == 1
    assert "; dy: 1 inf/NaN of 2048 values left out" in fp8["reason"], fp8["reason"]
    assert "left out: fp8_safe.dy, 1 inf/NaN of 2048 values" in a.table()


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(IN, IN)
        self.b = torch.nn.Linear(IN, IN)
        self.c = torch.nn.Linear(IN, OUT)

    def forward(self, x):
        return self.c(torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x)))))


@pytest.mark.parametrize("order", ["sampler, then watch", "watch, then sampler"])
def test_r4_samples_under_layerwise_scaling_are_the_unscaled_gradients(order):
    # A layerwise scaler multiplies each layer's output gradient by its factors (chained
    # through the links, up to 1024): the samples are the true gradients, whichever hooks came first.
    Sampler = mt.advise.__globals__["Sampler"]
    g = torch.Generator().manual_seed(6)
    x, target = torch.randn(T, IN, generator=g), torch.randn(T, OUT, generator=g)
    ref = Chain()
    want = {}

    def keep_dy(name):
        def hook(module, inputs, out):
            out.register_hook(lambda gr: want.__setitem__((name, "dy"), gr.clone()))
        return hook
    for name in ("a", "b", "c"):
        getattr(ref, name).register_forward_hook(keep_dy(name))
    (((ref(x) - target) ** 2).mean() * 1e-10).backward()
    for name in ("a", "b", "c"):
        want[(name, "dw")] = getattr(ref, name).weight.grad
    model = Chain()
    scaler = mt.GradScaler("cpu", preset="layerwise")
    if order == "sampler, then watch":
        sampler = Sampler(model)
        scaler.watch(model)
    else:
        scaler.watch(model)
        sampler = Sampler(model)
    sampler.active = True
    scaler.scale(((model(x) - target) ** 2).mean() * 1e-10).backward()
    got = {(n, r): v for n, r, _, _, _, v in sampler.take(1, scaler.get_scale())}
    sampler.remove()
    chains = [d["chain"] for d in scaler.layer_scales()]
    assert max(chains) >= 256, chains  # factors and links: the samples would be off by them
    for key, v in want.items():
        np.testing.assert_allclose(got[key], v.numpy(), rtol=1e-6, atol=0, err_msg=str(key))


def test_r4_advise_under_layerwise_scaling_measures_the_true_gradients():
    g = torch.Generator().manual_seed(7)
    x, target = torch.randn(T, IN, generator=g), torch.randn(T, OUT, generator=g)
    runs = []
    for scaler in (None, mt.GradScaler("cpu", preset="layerwise")):
        model = Chain()
        if scaler is not None:
            scaler.watch(model)

        def step(model=model, scaler=scaler):
            model.zero_grad(set_to_none=True)
            loss = ((model(x) - target) ** 2).mean() * 1e-10
            (loss if scaler is None else scaler.scale(loss)).backward()
        runs.append(mt.advise(model, step, steps=1, scaler=scaler, candidates=["bf16", "fp8-current", "nvfp4"]))
    for l1, l2 in zip(*(r.layers for r in runs)):
        for cand in ("bf16", "fp8-current", "nvfp4"):
            for role in ("dy", "dw"):
                m1, m2 = l1["candidates"][cand][role], l2["candidates"][cand][role]
                assert m1["amax"] == pytest.approx(m2["amax"], rel=1e-6), (l1["layer"], cand, role)
                assert m1["rel_rms_error"] == pytest.approx(m2["rel_rms_error"], rel=1e-4), (l1["layer"], cand, role)


def test_r4_gpt2_conv1d_layers_are_sampled_as_linear_layers():
    # transformers' Conv1D (GPT-2) keeps its weight as [in, out]: sampled like a Linear's, w and
    # dW as [out, in].
    transformers = pytest.importorskip("transformers")
    Sampler = mt.advise.__globals__["Sampler"]
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    names = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
             "transformer.h.0.mlp.c_proj"]
    sampler = Sampler(model)
    assert sampler.layers == names + ["lm_head"]
    sampler.active = True
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(8))
    model(ids, labels=ids).loss.backward()
    got = {(n, r): v for n, r, _, _, _, v in sampler.take(1, 1.0)}
    sampler.remove()
    modules = dict(model.named_modules())
    for n in names:
        w = modules[n].weight
        np.testing.assert_array_equal(got[(n, "w")], w.detach().t().numpy())
        np.testing.assert_array_equal(got[(n, "dw")], w.grad.t().numpy())
        assert got[(n, "x")].shape == (32, w.shape[0]) and got[(n, "dy")].shape == (32, w.shape[1])
    a = mt.advise(model, lambda: model(ids, labels=ids).loss.backward(), steps=1, candidates=["bf16", "mxfp8"])
    shapes = {l["layer"]: (l["tokens"], l["in"], l["out"]) for l in a.layers}
    assert shapes["transformer.h.0.attn.c_attn"] == (32, 32, 96)
    assert shapes["transformer.h.0.mlp.c_proj"] == (32, 128, 32)


def test_r4_a_frozen_layer_is_sampled_without_its_weight_gradient():
    # A frozen first Linear (a LoRA base, partial fine-tuning): no hook error; it has x and w,
    # no dW, and no dy either (nothing below it needs a gradient).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, IN), torch.nn.GELU(), torch.nn.Linear(IN, OUT))
    model[0].requires_grad_(False)
    x = torch.randn(T, IN)
    a = mt.advise(model, lambda: model(x).square().mean().backward(), steps=1, candidates=["bf16", "mxfp8"])
    roles = {l["layer"]: sorted(l["candidates"]["bf16"]) for l in a.layers}
    assert roles == {"0": ["cost", "w", "x"], "2": ["cost", "dw", "dy", "w", "x"]}
    assert a.assignment["0"] is None and "the budget requires dy, which had no samples" in a.layers[0]["reason"]


# ---- per GEMM direction and in time (docs/advisor.md, "Per GEMM direction and in time") ----

DT, DIN, DOUT = 256, 128, 128


def _heavy(rows: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian values, each group of 32 columns in its own binade (2^-24, 2^-8, 2^8, 2^24): only
    a per-32 scale (MXFP8) or bf16's range keeps them."""
    g = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return np.ldexp(g, np.array([-24, -8, 8, 24])[(np.arange(cols) // 32) % 4][None, :]).astype(np.float32)


def _gauss(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


class Planted(torch.nn.Module):
    """heavy_dy: x and w Gaussian, dy heavy (NVFP4 forward, MXFP8 backward); gauss: all Gaussian
    (NVFP4 both ways); loss = sum_i <layer_i(x_i), G_i>, so dy_i = G_i."""

    NAMES = ("heavy_dy", "gauss")

    def __init__(self) -> None:
        super().__init__()
        self.heavy_dy = torch.nn.Linear(DIN, DOUT, bias=False)
        self.gauss = torch.nn.Linear(DIN, DOUT, bias=False)
        with torch.no_grad():
            self.heavy_dy.weight.copy_(torch.from_numpy(_gauss(DOUT, DIN, 1)))
            self.gauss.weight.copy_(torch.from_numpy(_gauss(DOUT, DIN, 2)))
        self.xs = [torch.from_numpy(_gauss(DT, DIN, 3)), torch.from_numpy(_gauss(DT, DIN, 4))]
        self.gs = [torch.from_numpy(_heavy(DT, DOUT, 5)), torch.from_numpy(_gauss(DT, DOUT, 6))]

    def forward(self) -> torch.Tensor:
        return sum((getattr(self, k)(x) * g).sum() for k, x, g in zip(self.NAMES, self.xs, self.gs))


def _planted_step(model: Planted):
    def step():
        model.zero_grad(set_to_none=True)
        model().backward()
    return step


def test_directions_and_the_late_switch_are_exposed_and_the_file_runs(tmp_path):
    model = Planted()
    a = mt.advise(model, _planted_step(model), steps=1, cost=COMPUTE_BOUND, out=tmp_path / "recipe.json",
                  directions_out=tmp_path / "directions.json")
    # The single choice is unchanged (MXFP8 for dy); beside it, NVFP4 forward and MXFP8 backward.
    assert a.assignment == {"heavy_dy": "mxfp8", "gauss": "nvfp4"}, a.table()
    d = a.directions["heavy_dy"]
    assert (d["forward"], d["backward"]) == ("nvfp4", "mxfp8"), d
    assert d["saving"] > 0 and d["reason"].startswith("forward nvfp4 (x 0.09"), d
    assert d["rejected"][0].startswith("forward mxfp4: x error 0.11"), d["rejected"]
    assert (a.directions["gauss"]["forward"], a.directions["gauss"]["backward"]) == ("nvfp4", "nvfp4")
    assert a.cost_ratio_directional < a.cost_ratio
    # The late switch: both forwards are fp4, from 80% of the run, with its cost and evidence.
    assert set(a.late_forward_switch) == {"heavy_dy", "gauss"}
    ls = a.late_forward_switch["heavy_dy"]
    assert ls["from_fraction"] == 0.8 and ls["extra_cost"] > 0
    assert ls["reason"].startswith("fprop nvfp4 to bf16 from 80% of the run (when fp4: an fp4 forward; x error 0.09")
    table = a.table()
    assert "late forward switch" in table and "bf16 from 80% of the run: +" in table, table
    line = next(l for l in table.splitlines() if l.startswith("heavy_dy  nvfp4"))
    assert "mxfp8" in line, table
    # The file: as the Advice has it, read by the recipe file's loader and run by low_precision.
    doc = json.loads((tmp_path / "directions.json").read_text())
    assert doc == a.directional_recipe
    assert doc["modules"] == {"heavy_dy": {"recipe": "nvfp4", "dgrad": "mxfp8", "wgrad": "mxfp8"}, "gauss": "nvfp4"}
    assert doc["schedule"] == [{"from_fraction": 0.8, "modules": ["heavy_dy", "gauss"], "fprop": "bf16",
                                "label": "forward to bf16 (advisor)"}]
    assert mt.load_assignment(tmp_path / "directions.json") == doc
    assert json.loads((tmp_path / "recipe.json").read_text())["modules"] == {"heavy_dy": "mxfp8", "gauss": "nvfp4"}
    m = mt.low_precision(Planted(), str(tmp_path / "directions.json"), total_steps=10)
    lp = mt.low_precision_modules(m)
    recipes = lp["heavy_dy"].plan["recipes"]
    assert recipes["fprop.x"]["recipe"] == "nvfp4" and recipes["fprop.w"]["recipe"] == "nvfp4"
    for o in ("dgrad.dy", "dgrad.w", "wgrad.x", "wgrad.dy"):
        assert recipes[o]["recipe"] == "mxfp8", o
    assert mt.low_precision_step(m, 7) == []
    switched = mt.low_precision_step(m, 8)  # ceil(0.8 * 10)
    assert sorted(s["module"] for s in switched) == ["gauss", "heavy_dy"]
    assert {s["phase"] for s in switched} == {"forward to bf16 (advisor)"}
    after = lp["heavy_dy"].plan["recipes"]
    assert after["fprop.x"] is None and after["fprop.w"] is None and after["dgrad.dy"]["recipe"] == "mxfp8"
    m().backward()  # the switched plan runs
    # Off: the single choice in both directions, no switch.
    off = mt.advise(model, _planted_step(model), steps=1, cost=COMPUTE_BOUND, directions=False,
                    late_forward_switch={"when": "never"})
    assert off.directions["heavy_dy"]["forward"] == "mxfp8" and off.late_forward_switch == {}
    assert off.directional_recipe["modules"] == {"heavy_dy": "mxfp8", "gauss": "nvfp4"}
    assert "schedule" not in off.directional_recipe


@pytest.mark.parametrize("kw, match", [
    ({"directions": "yes"}, "directions: expected true or false"),
    ({"late_forward_switch": {"when": "sometimes"}}, "late_forward_switch.when: expected fp4, always, never or budget_share"),
    ({"late_forward_switch": {"from_fraction": 1.0}}, "late_forward_switch.from_fraction: expected a number in \\[0, 1\\)"),
    ({"late_forward_switch": {"budget_share": 0.3}}, "budget_share: applies only with when \"budget_share\""),
    ({"out": "same.json", "directions_out": "same.json"}, "directions_out: 'same.json' is also out"),
])
def test_bad_direction_arguments_are_refused_before_any_step(kw, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ran = []
    with pytest.raises(ValueError, match=match):
        mt.advise(Three(), lambda: ran.append(1), steps=1, **kw)
    assert ran == []
