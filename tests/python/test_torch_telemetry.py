"""mixprec.torch.Telemetry (docs/python.md, "Telemetry"): its counts against mixprec's own counted
conversion on the very gradients backward produced, its log lines through `mixprec report` and
the alerts, and every refusal. The example (examples/pytorch/train_gpt.py) runs end to end and
its report is rendered in headless Chromium (tests/report/render_check.sh) when make test gives
the path of the `mixprec` program (MIXPREC_CLI)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch; make test-python installs it")

import mixprec  # noqa: E402
from mixprec import _core  # noqa: E402
from mixprec.torch import GradScaler, Telemetry  # noqa: E402

torch.set_num_threads(1)

REPO = pathlib.Path(__file__).resolve().parents[2]
CLI = os.environ.get("MIXPREC_CLI")


class Net(torch.nn.Module):
    """Three watched leaves (fc1, act, fc2); fc2 can be told to put NaN into its output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 48)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(48, 8)
        self.poison = False

    def forward(self, x):
        y = self.fc2(self.act(self.fc1(x)))
        return y * math.nan if self.poison else y


def log_lines(run: pathlib.Path):
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def captured_grads(model: torch.nn.Module, names):
    """What backward hands to each module's output: captured by hooks of the test's own."""
    seen = {}

    def fwd(name):
        def hook(module, inputs, output):
            output.register_hook(lambda g: seen.setdefault(name, []).append(g.detach().clone()))
        return hook

    handles = [dict(model.named_modules())[n].register_forward_hook(fwd(n)) for n in names]
    return seen, handles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_counts_equal_mixprecs_counted_conversion_on_the_same_gradients(tmp_path, dtype):
    torch.manual_seed(0)
    model = Net()
    scaler = GradScaler("cpu", preset="torch", init_scale=2.0 ** 20, enabled=dtype == torch.float16)
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    tel = Telemetry(model, str(tmp_path / "run"), precision=precision, scaler=scaler, sample_every=1)
    seen, handles = captured_grads(model, ["fc1", "act", "fc2"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 32, 16) * 3
    for micro in range(2):  # one optimizer step of two micro-batches: the counts add up
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x[micro]).float().pow(2).mean() * 1e-3  # small gradients: some underflow in fp16
        scaler.scale(loss).backward()
    outcome = scaler.step(opt)
    line = tel.record(outcome, loss=loss.item())
    for h in handles:
        h.remove()
    by_name = {t["name"]: t for t in line["act_grad_tensors"]}
    assert set(by_name) == {"fc1", "act", "fc2"}
    total_underflow = 0
    for name, grads in seen.items():
        assert len(grads) == 2
        want = {k: 0 for k in ("elements", "nonzero", "nonfinite_input", "underflow", "subnormal", "overflow")}
        amax = 0.0
        for g in grads:
            _, s = mixprec.encode(g.float().contiguous().numpy(), "f16")
            for k in want:
                want[k] += getattr(s, k)
            amax = max(amax, float(g.float().abs().max()))
        got = by_name[name]
        assert {k: got[k] for k in want} == want, name
        assert np.float32(got["amax"]) == np.float32(amax), name  # the log writes float32's shortest form
        total_underflow += want["underflow"]
    if dtype == torch.float16:
        assert total_underflow == 0  # an fp16 gradient has underflowed already: nothing more to count
    else:
        assert total_underflow > 0, "the test's gradients must reach fp16's underflow"
    assert line["act_grads"]["elements"] == sum(t["elements"] for t in by_name.values())
    # Per parameter: |max| of the gradient as step() left it, and of the weight.
    params = {p["name"]: p for p in line["params"]}
    for name, p in model.named_parameters():
        assert np.float32(params[name]["grad_amax"]) == np.float32(p.grad.float().abs().max()), name
        assert np.float32(params[name]["weight_amax"]) == np.float32(p.detach().abs().max()), name
    tel.close()


class Fork(torch.nn.Module):
    """Outputs whose gradients arrive in every way a hook can meet: two outputs of one autograd
    node (chunk), one of them receiving no gradient; one tensor output by two modules
    (Identity); a tensor no node made (a parameter returned as it is)."""

    class Split(torch.nn.Module):
        def forward(self, x):
            return x.chunk(2, dim=-1)

    class Leaf(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self):
            return self.w

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.split = Fork.Split()
        self.same = torch.nn.Identity()
        self.leaf = Fork.Leaf()

    def forward(self, x):
        a, _unused = self.split(self.fc(x))
        a = self.same(a)
        return (a * a).sum() * 1e-3 + (a + 1).mean() + self.leaf().pow(2).sum()


def test_gradient_hooks_see_what_tensor_hooks_see(tmp_path):
    """The gradient of each watched output, taken as a pre-hook of the node that made it, is
    what the output's own Tensor.register_hook receives: per output of a multi-output node, for
    a tensor two modules output, through the tensor itself for a leaf, and nothing for an output
    that received no gradient (where a tensor hook is called with None)."""
    torch.manual_seed(0)
    model = Fork()
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", sample_every=1)
    seen = {}

    def watch(t, label):
        def once(g):  # the leaf outlives the step: one hook per forward
            handle.remove()
            seen.setdefault(label, []).append(None if g is None else g.detach().clone())
        handle = t.register_hook(once)

    def fwd(name):
        def hook(module, inputs, output):
            outs = list(output) if isinstance(output, tuple) else [output]
            for i, t in enumerate(outs):
                watch(t, name if len(outs) == 1 else f"{name}[{i}]")
        return hook

    handles = [m.register_forward_hook(fwd(n)) for n, m in model.named_modules() if n]
    for _ in range(2):
        model(torch.randn(8, 16) * 3).backward()
    line = tel.record(loss=1.0)
    for h in handles:
        h.remove()
    tel.close()
    by_name = {t["name"]: t for t in line["act_grad_tensors"]}
    # Tensor hooks are called with None for an output of a multi-output node that received no
    # gradient (the hooks Telemetry used before failed there): nothing to count.
    assert seen.pop("split[1]") == [None, None]
    assert set(seen) == {"fc", "split[0]", "same", "leaf"}
    assert set(by_name) == set(seen)
    for name, grads in seen.items():
        assert len(grads) == 2, name
        want = {k: 0 for k in ("elements", "nonzero", "nonfinite_input", "underflow", "subnormal", "overflow")}
        for g in grads:
            _, s = mixprec.encode(g.float().contiguous().numpy(), "f16")
            for k in want:
                want[k] += getattr(s, k)
        assert {k: by_name[name][k] for k in want} == want, name
        amax = max(float(g.abs().max()) for g in grads)
        assert np.float32(by_name[name]["amax"]) == np.float32(amax), name


def test_skip_is_named_and_next_scale_is_what_update_left(tmp_path):
    torch.manual_seed(1)
    model = Net()
    scaler = GradScaler("cpu", preset="torch", init_scale=1024.0, growth_interval=3)
    scaler.set_names(model)
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp16", scaler=scaler, histogram_every=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 9):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == 4:
            model.fc1.bias.grad[3] = math.inf
        outcome = scaler.step(opt)
        after_first = step % 2 == 0  # record() before update() on odd steps, after it on even ones
        if after_first:
            scaler.update()
        line = tel.record(outcome, loss=loss.item(), lr=1e-3, tokens=8)
        if not after_first:
            scaler.update()
        opt.zero_grad()
        assert line["scale"] == outcome.scale
        assert line["next_scale"] == scaler.get_scale(), step
        assert line["skipped"] == (step == 4)
        assert line["overflow_param"] == ("fc1.bias" if step == 4 else "")
    lines = log_lines(tmp_path / "run")
    assert [ln["step"] for ln in lines] == list(range(1, 9))
    assert [ln["scale"] for ln in lines] == [1024, 1024, 1024, 2048, 1024, 1024, 1024, 2048]
    summary = tel.close()
    assert summary == [] or all("id" in a for a in summary)
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (s["steps"], s["skipped"], s["final_scale"]) == (8, 1, 2048)
    assert s["config"] == {"precision": "fp16", "loss-scale": "torch"}


def test_forward_nonfinite_output_is_named_by_module(tmp_path):
    model = Net()
    # Every module, the root too (named by its class): its leaves stay finite, its output does not.
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", sample_every=1, modules=lambda n, m: True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(1, 4):
        model.poison = step == 2
        loss = model(torch.randn(4, 16)).sum()
        loss.backward()
        line = tel.record(None, loss=loss.item())
        opt.zero_grad()
        if step == 2:
            assert line["forward_nonfinite"] == "Net"  # the root module's output; its leaves were finite
            assert not line["loss_finite"]
        else:
            assert line["forward_nonfinite"] == ""
    model.poison = False
    tel.close()
    model2 = Net()
    with torch.no_grad():
        model2.fc1.weight[0, 0] = math.inf
    tel2 = Telemetry(model2, str(tmp_path / "run2"), precision="fp32", sample_every=1)
    loss = model2(torch.randn(4, 16)).sum()
    loss.backward()
    assert tel2.record(None, loss=loss.item())["forward_nonfinite"] == "fc1"
    tel2.close()


def test_sampling_and_histograms(tmp_path):
    model = Net()
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", sample_every=3, histogram_every=4)
    for step in range(1, 10):
        loss = model(torch.randn(4, 16)).pow(2).sum()
        loss.backward()
        line = tel.record(None, loss=loss.item())
        model.zero_grad()
        counted = line["act_grads"]["elements"] > 0
        histogram = step == 1 or step % 4 == 0
        assert counted == ((step - 1) % 3 == 0 or histogram), step  # a histogram step is sampled too
        assert ("histograms" in line) == histogram, step
        assert len(line["params"]) == 4  # parameters at every step
    tel.close()


def test_every_step_is_counted_with_torch_no_grad_evaluation_left_out(tmp_path):
    model = Net()
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp32", sample_every=1, modules=["fc2"])
    with torch.no_grad():
        model(torch.randn(4, 16))  # evaluation: no hooks, no counts
    loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    line = tel.record(None, loss=loss.item())
    assert [t["name"] for t in line["act_grad_tensors"]] == ["fc2"]
    assert line["act_grads"]["elements"] == 4 * 8
    tel.close()


def test_bad_input_is_refused_clearly(tmp_path):
    model = Net()
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="precision: expected one of fp32, fp16, bf16, found 'fp8'"):
        Telemetry(model, str(run), precision="fp8")
    with pytest.raises(ValueError, match="loss-scale"):
        Telemetry(model, str(run), loss_scale="sometimes")
    with pytest.raises(TypeError, match="expected a mixprec.torch.GradScaler"):
        Telemetry(model, str(run), scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="'fc9' is not a module of the model"):
        Telemetry(model, str(run), modules=["fc1", "fc9"])
    with pytest.raises(ValueError, match=r"sample_every: expected an integer in \[1, 2\*\*63\), found 0"):
        Telemetry(model, str(run), sample_every=0)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        Telemetry("model", str(run))
    assert not run.exists(), "refused arguments leave nothing behind"

    tel = Telemetry(model, str(run), precision="fp32")
    with pytest.raises(RuntimeError, match="in use"):
        Telemetry(model, str(run), precision="fp32")  # a second writer of an open run folder
    scaler = GradScaler("cpu")
    with pytest.raises(TypeError, match="expected the StepOutcome"):
        tel.record("applied", loss=1.0)
    with pytest.raises(ValueError, match="clip_coef"):
        tel.record(None, loss=1.0, clip_coef=0.0)
    tel.record(None, loss=1.0)
    tel.close()
    tel.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        tel.record(None, loss=1.0)
    with pytest.raises(ValueError, match=r"exists and is not empty; choose a new folder \(a finished run is never"):
        Telemetry(model, str(run), precision="fp32")  # a finished run is never overwritten
    assert len(log_lines(run)) == 1
    enabled = Telemetry(model, str(tmp_path / "run2"), precision="fp16", scaler=scaler)
    with pytest.raises(ValueError, match="pass the StepOutcome"):
        enabled.record(None, loss=1.0)
    enabled.close()
    # The core's own check of a view it is handed (mixprec.torch passes contiguous copies).
    rec = _core.TelemetryRecorder(str(tmp_path / "run3"), "fp32", "none", 0)
    with pytest.raises(TypeError, match="expected dtype float32, float16 or bfloat16, found float64"):
        rec.count_activation_grad("x", np.zeros(4))
    with pytest.raises(ValueError, match="C-contiguous"):
        rec.check_activation("x", np.zeros((4, 4), np.float32)[:, ::2])


def test_report_and_python_m_mixprec_read_the_run_folder(tmp_path):
    model = Net()
    scaler = GradScaler("cpu", preset="torch", init_scale=256.0)
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp16", scaler=scaler)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(5):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
        scaler.scale(loss).backward()
        out = scaler.step(opt)
        tel.record(out, loss=loss.item(), val_loss=loss.item() if step == 4 else None)
        scaler.update()
        opt.zero_grad()
    tel.close()
    html = mixprec.report(str(tmp_path / "run"))
    assert html == str(tmp_path / "run" / "report.html")
    text = pathlib.Path(html).read_text()
    assert "<svg" in text and "mixprec report" in text
    r = subprocess.run([sys.executable, "-m", "mixprec", "report", str(tmp_path / "run"), "--out",
                        str(tmp_path / "again.html")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "again.html").stat().st_size > 1000
    r = subprocess.run([sys.executable, "-m", "mixprec", "report", str(tmp_path / "nothing")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "nothing" in r.stderr and not (tmp_path / "nothing").exists()
    with pytest.raises(ValueError, match="does not exist"):
        mixprec.report(str(tmp_path / "run"), str(tmp_path / "no" / "r.html"))
    if CLI:  # the C++ program reads the same folder: report and scaler simulate
        r = subprocess.run([CLI, "report", str(tmp_path / "run"), "--out", str(tmp_path / "cli.html")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([CLI, "scaler", "simulate", str(tmp_path / "run"), "--preset", "mixprec"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_corpus_is_mixprec_trains_data():
    d = mixprec.data.corpus(tokens=20_000, context=32)
    assert d.train.dtype == np.uint32 and d.validation.dtype == np.uint32
    assert d.vocab[0] == "<unk>" and d.vocab_size == len(d.vocab) <= 1024
    assert int(d.train.max()) < d.vocab_size
    assert d.validation.size == (d.train.size + d.validation.size) // 10
    assert "default corpus (seed 1" in d.source
    again = mixprec.data.corpus(tokens=20_000, context=32)
    assert np.array_equal(d.train, again.train)
    x, y = mixprec.data.batch(d.train, 4, 32, np.random.default_rng(0))
    assert x.shape == y.shape == (4, 32) and np.array_equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="word:"):
        mixprec.data.corpus(vocab="words")
    with pytest.raises(RuntimeError, match="too"):
        mixprec.data.from_text("a b c", context=64)


def test_encode_reads_a_cpu_tensor_where_it_lies():
    t = torch.randn(1000) * 1e-5
    codes, stats = mixprec.encode(t, "f16")
    assert _core.buffer_address(t) == t.data_ptr()
    _, want = mixprec.encode(t.numpy(), "f16")
    assert stats == want
    assert np.array_equal(codes, t.half().numpy().view(np.uint16))
    with pytest.raises(TypeError, match="found float64"):
        mixprec.encode(torch.zeros(3, dtype=torch.float64), "f16")
    with pytest.raises(ValueError, match="C-contiguous"):
        mixprec.encode(torch.zeros(4, 4)[:, ::2], "f16")


def test_example_trains_skips_names_and_reports(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, str(REPO / "examples" / "pytorch" / "train_gpt.py"), "--steps", "24",
                        "--out", str(run), "--eval-every", "6", "--inject-overflow-at", "5,17", "--log-every", "6",
                        "--threads", "1", "--sample-every", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 5: skipped, inf/NaN in the gradient of blocks.1.fc.weight" in r.stdout
    assert "step 17: skipped" in r.stdout and "done: 24 steps, 2 skipped" in r.stdout
    lines = log_lines(run)
    assert [ln["step"] for ln in lines if ln["skipped"]] == [5, 17]
    assert sum("val_loss" in ln and ln["val_loss"] is not None for ln in lines) == 4
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert (run / "report.html").exists()
    # Bad flags: exit 2 before anything is written.
    bad = subprocess.run([sys.executable, str(REPO / "examples" / "pytorch" / "train_gpt.py"), "--steps", "0",
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--steps" in bad.stderr and not (tmp_path / "bad").exists()
    if not CLI:
        pytest.skip("MIXPREC_CLI not set: the browser check of the report needs the mixprec program "
                    "(make test-python sets it)")
    render = subprocess.run(["bash", str(REPO / "tests" / "report" / "render_check.sh"), CLI,
                             str(tmp_path / "render"), str(run), "24"], capture_output=True, text=True)
    if render.returncode == 77:
        pytest.skip("chromium is not installed (scripts/deps.sh test installs it)")
    assert render.returncode == 0, render.stdout + render.stderr


@pytest.mark.parametrize("preset,spec", [("static", "static:128"), ("deepspeed", "deepspeed"), ("torch", "torch")])
def test_telemetry_takes_every_presets_scaler(tmp_path, preset, spec):
    """The run folder names the scaler as the protocol describes itself (the static preset
    with its scale, which `mixprec train --loss-scale` needs); it used to refuse preset static."""
    model = Net()
    scaler = GradScaler(preset=preset, init_scale=128.0)
    tel = Telemetry(model, str(tmp_path / "run"), precision="fp16", scaler=scaler)
    tel.close()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["loss-scale"] == spec
