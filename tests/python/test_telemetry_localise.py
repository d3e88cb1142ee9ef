"""mixprec.torch.Telemetry(localise=...): which module a non-finite value began in (issue 47).

A NaN written into one module's output in the forward, or an inf into one module's output
gradient in the backward (a tensor hook, which runs before the gradient reaches that module),
must be named as that module: in a torch MLP and in a tiny Hugging Face GPT-2, at steps the
sampled checks do not cover, in the cheap default ("auto") and in "full". A clean step names
nothing, a finite tensor whose float32 sum would overflow is never named, and "off" adds no hook
and no work.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")

import mixprec.torch.telemetry as telemetry_module  # noqa: E402
from mixprec.torch import GradScaler, Telemetry  # noqa: E402

torch.set_num_threads(1)

NEVER = 10**9  # sample_every: the sampled checks run at step 1 only (the folder's first line)


class MLP(torch.nn.Module):
    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        layers = []
        for i in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.layers = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.layers(x))


def plant_forward(module: torch.nn.Module, at: dict, value: float = math.nan):
    """Writes `value` into one element of module's output while at["now"] is true. Registered
    first (prepend) so that every other forward hook, Telemetry's too, sees the planted output."""
    def hook(m, inputs, output):
        if not at["now"]:
            return None
        out = output.clone()
        out.view(-1)[1] = value
        return out
    return module.register_forward_hook(hook, prepend=True)


def plant_backward(module: torch.nn.Module, at: dict, value: float = math.inf):
    """While at["now"] is true, module's output gradient gets `value` in one element: a tensor hook
    on the output, which autograd runs before the gradient reaches the module's backward."""
    def hook(m, inputs, output):
        if at["now"] and output.requires_grad:
            def poison(grad):
                g = grad.clone()
                g.view(-1)[2] = value
                return g
            output.register_hook(poison)
    return module.register_forward_hook(hook)


def run_mlp(tmp_path, plant, module_name: str, *, localise="auto", steps=4, bad_step=3, micro=1, counting="auto",
            sample_every=NEVER):
    torch.manual_seed(0)
    model = MLP()
    target = dict(model.named_modules())[module_name]
    at = {"now": False}
    handle = plant(target, at)
    tel = Telemetry(model, str(tmp_path / f"run-{module_name}-{localise}-{counting}"), precision="fp32",
                    sample_every=sample_every, histogram_every=0, localise=localise, counting=counting)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    found, lines = [], []
    for step in range(1, steps + 1):
        for m in range(micro):
            at["now"] = step == bad_step and m == micro - 1
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
        at["now"] = False
        lines.append(tel.record(None, loss=loss.item()))
        found.append(tel.last_localisation)
        opt.zero_grad()
    reads = tel._host_reads
    tel.close()
    handle.remove()
    return found, lines, reads


@pytest.mark.parametrize("k", [0, 2, 4, 6])
@pytest.mark.parametrize("localise", ["auto", "full"])
def test_a_nan_in_the_forward_of_layer_k_is_named_in_forward_order(tmp_path, k, localise):
    name = f"layers.{k}"
    found, lines, _ = run_mlp(tmp_path, plant_forward, name, localise=localise)
    for step, (loc, line) in enumerate(zip(found, lines), 1):
        assert loc["step"] == step
        if step == 3:
            assert loc["nonfinite_forward"] == name
            assert line["forward_nonfinite"] == name  # the log names it too, at a step the sampled check skips
            assert not line["loss_finite"]
            # Everything downstream and its gradients are NaN: the backward names the module that
            # ran first in backward whose weights received it (the head).
            assert loc["nonfinite_backward"] == "head"
        else:
            assert loc["nonfinite_forward"] is None and loc["nonfinite_backward"] is None, step
            assert line["forward_nonfinite"] == ""


@pytest.mark.parametrize("j", [0, 2, 4, 6])
@pytest.mark.parametrize("localise", ["auto", "full"])
def test_an_inf_in_the_backward_of_layer_j_is_named_in_backward_order(tmp_path, j, localise):
    name = f"layers.{j}"
    found, lines, _ = run_mlp(tmp_path, plant_backward, name, localise=localise)
    for step, loc in enumerate(found, 1):
        if step == 3:
            assert loc["nonfinite_forward"] is None
            assert loc["nonfinite_backward"] == name
            if localise == "full":
                assert loc["nonfinite_output_grad"] == name
                # The planted element alone in its own gradient: exact counts.
                row = next(r for r in loc["backward"] if r[0] == name)
                assert row[1] == math.inf and row[2] == 1
                assert all(math.isfinite(r[1]) for r in loc["backward"][:loc["backward"].index(row)])
            assert [o[0] for o in loc["outliers"]] != []  # a spoiled step lists its outliers
        else:
            assert loc["nonfinite_backward"] is None and loc["nonfinite_forward"] is None
            assert loc.get("nonfinite_output_grad") is None
            if localise == "auto":
                assert loc["outliers"] == []  # a clean step reports nothing in the cheap mode


def test_the_second_micro_batch_and_the_torch_counting_path_name_the_same(tmp_path):
    found, _, reads = run_mlp(tmp_path, plant_forward, "layers.4", micro=2, counting="torch")
    assert found[2]["nonfinite_forward"] == "layers.4"
    assert reads == 4  # the localisation results join the device path's one host read per step
    found, _, reads = run_mlp(tmp_path, plant_backward, "layers.2", micro=2, counting="torch", localise="full")
    assert found[2]["nonfinite_backward"] == found[2]["nonfinite_output_grad"] == "layers.2"
    assert reads == 4


def test_sampled_steps_agree_with_the_sampled_check(tmp_path):
    found, lines, _ = run_mlp(tmp_path, plant_forward, "layers.2", sample_every=1)
    assert found[2]["nonfinite_forward"] == lines[2]["forward_nonfinite"] == "layers.2"


def test_full_mode_tables_count_exactly_and_list_outliers_every_step(tmp_path):
    torch.manual_seed(0)
    model = MLP(depth=2)
    with torch.no_grad():
        model.layers[2].weight.mul_(1000.0)  # layers.2's output: the largest |max|
    at = {"now": False}

    def three_nans(m, i, o):
        if at["now"]:
            o = o.clone()
            o.view(-1)[:3] = math.nan
            return o
    model.layers[0].register_forward_hook(three_nans, prepend=True)
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", sample_every=NEVER, localise="full")
    for step in (1, 2):
        at["now"] = step == 2
        out = model(torch.randn(4, 16))
        out.sum().backward()
        tel.record(None, loss=1.0)
        model.zero_grad()
        loc = tel.last_localisation
        names = [r[0] for r in loc["forward"]]
        assert names == ["layers.0", "layers.1", "layers.2", "layers.3", "head"]
        if step == 1:
            assert all(r[2] == 0 and math.isfinite(r[1]) for r in loc["forward"] + loc["backward"])
            assert loc["outliers"][0][0] == "layers.2"
            assert len(loc["outliers"]) == 3 and loc["outliers"][0][1] >= loc["outliers"][1][1] >= loc["outliers"][2][1]
        else:
            assert loc["forward"][0][2] == 3 and math.isnan(loc["forward"][0][1])
            assert loc["nonfinite_forward"] == "layers.0"
    tel.close()


def test_outlier_values_are_the_outputs_largest_magnitudes(tmp_path):
    torch.manual_seed(0)
    model = MLP(depth=1)
    seen = {}
    for n, m in model.named_modules():
        if n:
            m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, float(o.detach().abs().max())))
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", localise="full")
    model(torch.randn(4, 16) * 50).sum().backward()
    tel.record(None, loss=1.0)
    tel.close()
    expected = sorted(((n, seen[n]) for n in ("layers.0", "layers.1", "head")), key=lambda x: -x[1])
    assert tel.last_localisation["outliers"] == [[n, v] for n, v in expected]  # exact: |max| as float32


class Huge(torch.nn.Module):
    """Finite outputs whose sum overflows: float32 and bf16 values near their largest (the float32
    sum overflows), fp16 values near 65504 (a float16 sum overflows after two elements)."""

    def __init__(self, dtype, value) -> None:
        super().__init__()
        self.dtype, self.value = dtype, value
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.full((4096,), self.value, dtype=self.dtype) + h.sum().to(self.dtype) * 0


@pytest.mark.parametrize("dtype,value", [(torch.bfloat16, 3.0e38), (torch.float16, 65000.0),
                                         (torch.float32, 3.0e38)])
@pytest.mark.parametrize("localise", ["auto", "full"])
def test_a_finite_tensor_whose_sum_overflows_is_never_named(tmp_path, dtype, value, localise):
    model = torch.nn.Sequential(Huge(dtype, value))
    t = torch.full((4096,), value, dtype=dtype)
    assert not torch.isfinite(t.sum() if dtype == torch.float16 else t.sum(dtype=torch.float32))
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", sample_every=NEVER, localise=localise,
                    modules=lambda n, m: True)
    for _ in range(2):
        out = model(torch.randn(2, 4))
        (out.float() * 0).sum().backward()
        tel.record(None, loss=1.0)
        model.zero_grad()
        loc = tel.last_localisation
        assert loc["nonfinite_forward"] is None and loc["nonfinite_backward"] is None
    if localise == "full":
        assert loc["outliers"][0] == ["0", float(torch.tensor(value, dtype=dtype))]
    tel.close()


def test_off_installs_no_hook_and_does_no_work(tmp_path, monkeypatch):
    calls = {"reduced": 0, "on_gradient": 0}
    real_reduced, real_on_gradient = telemetry_module._reduced, telemetry_module._on_gradient

    def reduced(*a):
        calls["reduced"] += 1
        return real_reduced(*a)

    def on_gradient(*a):
        calls["on_gradient"] += 1
        return real_on_gradient(*a)
    monkeypatch.setattr(telemetry_module, "_reduced", reduced)
    monkeypatch.setattr(telemetry_module, "_on_gradient", on_gradient)
    hooks = {}
    for mode in ("off", "auto", "full"):
        model = MLP()
        calls.update(reduced=0, on_gradient=0)
        tel = Telemetry(model, str(tmp_path / mode), precision="fp32", sample_every=NEVER, localise=mode)
        hooks[mode] = sum(len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
                          + len(m._backward_pre_hooks) for m in model.modules())
        for _ in range(3):  # step 1 is sampled (the folder's first line), steps 2 and 3 are not
            model(torch.randn(4, 16)).sum().backward()
            tel.record(None, loss=1.0)
            model.zero_grad()
        if mode == "off":
            assert tel.last_localisation is None
            assert calls["reduced"] == 0
            assert calls["on_gradient"] == 9  # step 1's sampled counting only (9 watched modules)
        elif mode == "auto":
            assert calls["reduced"] == 3 * 9  # outputs only: the backward reads the weight gradients
            assert calls["on_gradient"] == 9
        else:
            assert calls["reduced"] == 3 * 9 * 2
            assert calls["on_gradient"] == 3 * 9
        tel.close()
    assert hooks["off"] == hooks["auto"] == hooks["full"] == 9  # the watched modules' one hook each, reused


def test_a_bad_localise_is_refused_before_anything_is_made(tmp_path):
    for bad in ("fast", None, 1):
        with pytest.raises(ValueError, match=r"localise: expected one of auto, full, off, found"):
            Telemetry(MLP(), str(tmp_path / "run"), localise=bad)
        assert not (tmp_path / "run").exists()


def test_fp16_autocast_with_the_grad_scaler_names_the_overflowing_layer(tmp_path):
    """A real skipped step: an inf written into layers.4's output gradient is caught by the
    scaler (the step is skipped) and named by Telemetry."""
    torch.manual_seed(0)
    model = MLP()
    at = {"now": False}
    plant_backward(model.layers[4], at)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp16", scaler=scaler, sample_every=NEVER)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(1, 4):
        at["now"] = step == 2
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
        scaler.scale(loss).backward()
        outcome = scaler.step(opt)
        line = tel.record(outcome, loss=loss.item())
        scaler.update()
        opt.zero_grad()
        assert line["skipped"] == (step == 2)
        assert tel.last_localisation["nonfinite_backward"] == ("layers.4" if step == 2 else None)
    tel.close()


# ---- a tiny Hugging Face GPT-2 ------------------------------------------------------------

def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def run_gpt2(tmp_path, plant, path: str, localise: str = "auto"):
    model = gpt2()
    module = model.get_submodule(path)
    at = {"now": False}
    plant(module, at)
    tel = Telemetry(model, str(tmp_path / f"{path}-{localise}-{plant.__name__}"), precision="fp32",
                    sample_every=NEVER, localise=localise)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    found = []
    for step in range(1, 4):
        at["now"] = step == 2
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        tel.record(None, loss=out.loss.item())
        found.append(tel.last_localisation)
        model.zero_grad()
    tel.close()
    return found


@pytest.mark.parametrize("path", ["transformer.h.1.mlp.c_fc", "transformer.h.0.attn.c_attn",
                                  "transformer.h.1.ln_2", "transformer.h.0.mlp.act", "transformer.wpe",
                                  "transformer.ln_f"])
def test_gpt2_forward_nan_is_named(tmp_path, path):
    # "full": the module itself; "auto": its transformer layer (a watched module outside the
    # layers, the embeddings, the final norm, itself), at a step the sampled checks skip.
    block = ".".join(path.split(".")[:3]) if path.startswith("transformer.h.") else path
    for localise, named in (("full", path), ("auto", block)):
        found = run_gpt2(tmp_path, plant_forward, path, localise)
        assert [f["nonfinite_forward"] for f in found] == [None, named, None], localise
    lines = [json.loads(s) for s in (tmp_path / f"{path}-auto-plant_forward" / "log.jsonl").read_text().splitlines()]
    assert [ln["forward_nonfinite"] for ln in lines] == ["", block, ""]


def test_gpt2_hooks_per_mode(tmp_path):
    counts = {}
    for mode in ("off", "auto", "full"):
        model = gpt2()
        tel = Telemetry(model, str(tmp_path / mode), precision="fp32", localise=mode)
        counts[mode] = {n: len(m._forward_hooks) for n, m in model.named_modules() if m._forward_hooks}
        tel.close()
        assert not any(m._forward_hooks for m in model.modules())
    assert counts["auto"] == {**counts["off"], "transformer.h.0": 1, "transformer.h.1": 1}  # the layers' own
    assert counts["full"] == counts["off"]
    assert set(counts["off"].values()) == {1}


@pytest.mark.parametrize("path", ["transformer.h.1.mlp.c_fc", "transformer.h.0.attn.c_proj", "transformer.h.1.ln_1"])
def test_gpt2_backward_inf_is_named(tmp_path, path):
    for localise in ("auto", "full"):
        found = run_gpt2(tmp_path, plant_backward, path, localise)
        assert [f["nonfinite_backward"] for f in found] == [None, path, None]
        assert [f["nonfinite_forward"] for f in found] == [None, None, None]
        if localise == "full":
            assert found[1]["nonfinite_output_grad"] == path
    # The log is valid and keeps its schema (forward_nonfinite empty: the forward was finite).
    lines = [json.loads(s) for s in (tmp_path / f"{path}-full-plant_backward" / "log.jsonl").read_text().splitlines()]
    assert [ln["forward_nonfinite"] for ln in lines] == ["", "", ""]


def test_gpt2_sampled_step_logs_the_module_and_localises_the_layer(tmp_path):
    model = gpt2()
    at = {"now": False}
    plant_forward(model.get_submodule("transformer.h.1.mlp.c_fc"), at)
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", sample_every=1)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    at["now"] = True
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    line = tel.record(None, loss=out.loss.item())
    tel.close()
    assert line["forward_nonfinite"] == "transformer.h.1.mlp.c_fc"  # the sampled check: the module itself
    assert tel.last_localisation["nonfinite_forward"] == "transformer.h.1"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_blocks_are_the_repeated_children_of_a_list():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Block(), Block(),
                                torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)] * 2)), Block())
    names = [n for n, _ in telemetry_module._blocks(model, "Sequential")]
    assert names == ["1", "2", "4"]  # leaves and a lone container are not blocks
    nested = torch.nn.ModuleList([torch.nn.Sequential(Block(), Block()), torch.nn.Sequential(Block(), Block())])
    assert [n for n, _ in telemetry_module._blocks(nested, "ModuleList")] == ["0", "1"]  # the outermost
