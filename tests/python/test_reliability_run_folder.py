"""Issue 30 (docs/bad_inputs.md, "Run folders and the Python doors"): each finding of the
hostile-user round, through the Python package and, where MIXPREC_CLI names the `mixprec`
program (make test does), through the CLI around the folders Python writes. Every case ends
as a clear error naming the argument and the rule, or as a correct result; nothing written is
lost."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch; make test-python installs it")

import mixprec  # noqa: E402
from mixprec import _core  # noqa: E402
from mixprec.torch import GradScaler, Telemetry  # noqa: E402

torch.set_num_threads(1)
CLI = os.environ.get("MIXPREC_CLI")
needs_cli = pytest.mark.skipif(not CLI, reason="MIXPREC_CLI (the mixprec program) is not given; make test gives it")


def digest(folder: pathlib.Path):
    """Every file of a folder by name: its bytes' hash (what 'nothing changed' means here)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def lines(run: pathlib.Path):
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def telemetry_run(path: pathlib.Path, steps: int = 3, **kw) -> pathlib.Path:
    """A small finished Telemetry run folder (steps records, closed)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    scaler = GradScaler("cpu", growth_interval=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Telemetry(model, path, scaler=scaler, sample_every=1, **kw) as tel:
        for _ in range(steps):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            scaler.scale(loss).backward()
            outcome = scaler.step(opt)
            tel.record(outcome, loss=loss.item(), lr=0.1, tokens=3)
            scaler.update()
            opt.zero_grad()
    return path


def cli(*args: str):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


# ---- 1: the engine never resumes a front door's folder -------------------------------------

@needs_cli
def test_1_train_resume_refuses_a_telemetry_folder_and_changes_nothing(tmp_path):
    run = telemetry_run(tmp_path / "run")
    before = digest(run)
    config = json.loads((run / "config.json").read_text())
    assert config["run_folder_schema"] == 2 and config["writer"] == "python"
    r = cli("train", "--resume", str(run), "--steps", "3")
    assert r.returncode == 2, r.stderr
    assert "was written by mixprec.torch.Telemetry (Python), not by mixprec train" in r.stderr
    assert digest(run) == before
    # A version-1 folder of a front door (config.json with a few keys) is refused as well.
    (run / "config.json").write_text(json.dumps({"precision": "fp16", "loss-scale": "torch"}))
    before = digest(run)
    r = cli("train", "--resume", str(run), "--steps", "3")
    assert r.returncode == 2 and "a Telemetry (libtorch or Python)" in r.stderr, r.stderr
    assert digest(run) == before


def test_1_a_second_telemetry_is_told_what_fits_it(tmp_path):
    model = torch.nn.Linear(2, 2)
    with Telemetry(model, tmp_path / "run", precision="fp32"):
        with pytest.raises(RuntimeError) as e:
            Telemetry(model, tmp_path / "run", precision="fp32")
    # In this process: "another writer is still open"; the advice never recommends --resume.
    assert "--resume" not in str(e.value)
    with pytest.raises(ValueError) as e:
        Telemetry(model, tmp_path / "run", precision="fp32")
    assert "exists and is not empty; choose a new folder (a finished run is never overwritten)" in str(e.value)
    assert "--resume" not in str(e.value)


# ---- 2, 3, Low: outputs never land on inputs ---------------------------------------------------

def test_2_report_out_on_a_file_of_the_run_is_refused(tmp_path):
    run = telemetry_run(tmp_path / "run")
    before = digest(run)
    os.symlink(run / "log.jsonl", tmp_path / "link.html")
    os.link(run / "summary.json", tmp_path / "hard.html")
    for out in ["config.json", "log.jsonl", "summary.json", ".lock"]:
        with pytest.raises(ValueError, match=f"out: '.*{out}' is {out} of the run folder '.*'; an output never"):
            mixprec.report(run, out=run / out)
    with pytest.raises(ValueError, match="symbolic link"):  # the CLI's rule: never written through
        mixprec.report(run, out=tmp_path / "link.html")
    with pytest.raises(ValueError, match="is summary.json of the run folder"):
        mixprec.report(run, out=tmp_path / "hard.html")
    os.mkfifo(tmp_path / "fifo.html")
    with pytest.raises(ValueError, match="FIFO"):
        mixprec.report(run, out=tmp_path / "fifo.html")
    assert digest(run) == before
    assert mixprec.report(run) == str(run / "report.html")  # the default stays legal


@needs_cli
def test_2_3_cli_outputs_never_replace_a_file_of_the_run(tmp_path):
    run = telemetry_run(tmp_path / "run")
    before = digest(run)
    for name in ["log.jsonl", "config.json", "summary.json"]:
        r = cli("report", str(run), "--out", str(run / name))
        assert r.returncode == 1 and "of the run folder" in r.stderr, r.stderr
    tiny = ["--accum", "1", "--batch", "2", "--context", "16", "--layers", "1", "--heads", "2", "--channels", "16",
            "--corpus-tokens", "20000", "--vocab", "word:256", "--threads", "1", "--eval-windows", "8"]
    # Another run's file, too: a run folder's own names are never an output.
    r = cli("train", *tiny, "--steps", "2", "--out", str(tmp_path / "new"), "--json", str(run / "log.jsonl"))
    assert r.returncode == 2 and "json: " in r.stderr and "is log.jsonl of the run folder" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()
    assert digest(run) == before


# ---- 4: a record's values are checked at the call --------------------------------------------

@pytest.mark.parametrize("kw,message", [
    (dict(seconds=math.nan), "seconds: expected a finite number >= 0, found nan"),
    (dict(seconds=-1.0), "seconds: expected a finite number >= 0, found -1"),
    (dict(lr=-0.1), "lr: expected a finite number >= 0, found -0.1"),
    (dict(lr=math.inf), "lr: expected a finite number >= 0, found inf"),
    (dict(clip_coef=0.0), "clip_coef: expected a number in (0, 1], found 0"),
    (dict(clip_coef=1.5), "clip_coef: expected a number in (0, 1], found 1.5"),
])
def test_4_record_values_are_validated_and_nothing_is_written(tmp_path, kw, message):
    model = torch.nn.Linear(2, 2)
    with Telemetry(model, tmp_path / "run", precision="fp32") as tel:
        with pytest.raises(ValueError) as e:
            tel.record(loss=1.0, **kw)
        assert message in str(e.value)
        assert tel.steps == 0
        tel.record(loss=1.0, seconds=0.5)
    assert [line["step"] for line in lines(tmp_path / "run")] == [1]
    mixprec.report(tmp_path / "run")  # the folder stays readable


# ---- 5: a failed append leaves the log as it was ---------------------------------------------

def test_5_failed_appends_leave_whole_lines_and_later_records_follow(tmp_path):
    """RLIMIT_FSIZE: the kernel refuses the write part way (EFBIG), as a full disk does
    (tests/reliability/enospc.sh gives the real ENOSPC on a small tmpfs). In a child process, so
    that the limit stays there."""
    code = f"""
import resource, signal, sys, torch
from mixprec.torch import Telemetry
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
model = torch.nn.Linear(2, 2)
tel = Telemetry(model, {str(tmp_path / 'run')!r}, precision="fp32")
tel.record(loss=1.0, seconds=0.1)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (600, hard))
failed = 0
for _ in range(2):
    try:
        tel.record(loss=2.0, seconds=0.1)
    except RuntimeError as e:
        assert "the log is as it was before this record" in str(e), e
        failed += 1
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
for _ in range(8):
    tel.record(loss=3.0, seconds=0.1)
tel.close()
print(failed)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2"
    assert [line["step"] for line in lines(tmp_path / "run")] == list(range(1, 10))
    mixprec.report(tmp_path / "run")


# ---- 6: readers refuse FIFOs and devices before they block -----------------------------------

@pytest.mark.parametrize("name", ["log.jsonl", "config.json", "summary.json"])
def test_6_report_refuses_a_fifo_in_the_folder(tmp_path, name):
    run = telemetry_run(tmp_path / "run")
    (run / name).unlink()
    os.mkfifo(run / name)
    code = f"import mixprec; mixprec.report({str(run)!r}, out={str(tmp_path / 'r.html')!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is a FIFO (named pipe), not a regular file" in r.stderr, r.stderr


@needs_cli
def test_6_cli_readers_refuse_a_fifo_or_dev_zero(tmp_path):
    run = telemetry_run(tmp_path / "run")
    (run / "log.jsonl").unlink()
    os.symlink("/dev/zero", run / "log.jsonl")
    for args in (["report", str(run), "--out", str(tmp_path / "r.html")], ["scaler", "simulate", str(run)]):
        r = cli(*args)
        assert r.returncode == 1 and "is a character device, not a regular file" in r.stderr, r.stderr
    (run / "config.json").unlink()
    os.mkfifo(run / "config.json")
    r = cli("train", "--resume", str(run))
    assert r.returncode == 2 and "is a FIFO (named pipe), not a regular file" in r.stderr, r.stderr


# ---- 7, Low: sparse, complex and neg-bit tensors ----------------------------------------------

def test_7_sparse_gradients_are_recorded_by_their_values(tmp_path):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with Telemetry(emb, tmp_path / "run", precision="fp32") as tel:
        loss = emb(torch.tensor([1, 3, 3])).pow(2).sum() * 3
        loss.backward()
        expected = emb.weight.grad.coalesce().values().abs().max().item()
        opt.step()
        line = tel.record(loss=loss.item())
    (param,) = line["params"]
    assert param["grad_amax"] == pytest.approx(expected, rel=1e-6)


def test_low_complex_parameters_are_recorded_by_their_magnitude(tmp_path):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.tensor([3 + 4j, 0.5 - 0.5j], dtype=torch.complex64))
    with Telemetry(model, tmp_path / "run", precision="fp32") as tel:
        line = tel.record(loss=1.0)
    assert line["params"][0]["weight_amax"] == pytest.approx(5.0)


def test_14_a_neg_bit_view_is_encoded_with_its_sign():
    x = torch.tensor([1 + 2j, 3 - 4j]).conj().imag  # a view with the negative bit: [-2, 4]
    assert x.is_neg()
    codes, _ = mixprec.encode(x, "f16")
    assert np.array_equal(mixprec.decode(codes, "f16"), np.array([-2.0, 4.0], dtype=np.float32))


# ---- 8, 11, Low: numbers as torch.amp takes them; every refusal names the argument -------------

def test_8_numpy_scalars_and_integral_floats_are_accepted_as_torch_amp_accepts_them():
    a = GradScaler("cpu", init_scale=np.float64(1024.0), growth_factor=np.float32(2.0),
                   growth_interval=np.int64(20))
    b = GradScaler("cpu", init_scale=1024, growth_interval=20.0)
    ref = torch.amp.GradScaler("cpu", init_scale=np.float64(1024.0), growth_interval=20.0)
    for s in (a, b):
        assert s.get_scale() == ref.get_scale() == 1024.0
        assert s.get_growth_interval() == 20
    with pytest.raises(ValueError, match=r"growth_interval: expected an integer .*found '?2.9"):
        GradScaler("cpu", growth_interval=2.9)


@pytest.mark.parametrize("kw,error,message", [
    (dict(tokens=-5), ValueError, r"tokens: expected an integer in \[0, 2\*\*64\), found -5"),
    (dict(tokens=2**64), ValueError, r"tokens: expected an integer in \[0, 2\*\*64\), found 18446744073709551616"),
    (dict(tokens=2.9), ValueError, r"tokens: expected an integer in \[0, 2\*\*64\), found 2.9 \(not truncated\)"),
    (dict(tokens="3"), TypeError, r"tokens: expected an integer in \[0, 2\*\*64\), found str '3'"),
    (dict(loss="x"), TypeError, r"loss: expected a number, found str 'x'"),
    (dict(loss=None), TypeError, r"loss: expected a number, found NoneType None"),
    (dict(lr=[1]), TypeError, r"lr: expected a number, found list \[1\]"),
    (dict(seconds="1"), TypeError, r"seconds: expected a number, found str '1'"),
])
def test_11_and_low_record_refusals_name_the_argument_and_the_rule(tmp_path, kw, error, message):
    kw = dict(dict(loss=1.0), **kw)
    with Telemetry(torch.nn.Linear(2, 2), tmp_path / "run", precision="fp32") as tel:
        with pytest.raises(error, match=message) as e:
            tel.record(**kw)
        assert "incompatible function arguments" not in str(e.value)
        tel.record(loss=np.float32(1.5), tokens=np.int64(3), lr=np.float64(0.1), seconds=torch.tensor(0.25))
        tel.record(loss=torch.tensor(2.0), tokens=4.0)
    assert [(line["tokens"], line["loss"]) for line in lines(tmp_path / "run")] == [(3, 1.5), (4, 2.0)]


@pytest.mark.parametrize("kw,error,message", [
    (dict(histogram_every=2**64), ValueError, r"histogram_every: expected an integer in \[0, 2\*\*63\), found"),
    (dict(histogram_every=-1), ValueError, r"histogram_every: expected an integer in \[0, 2\*\*63\), found -1"),
    (dict(sample_every=0), ValueError, r"sample_every: expected an integer in \[1, 2\*\*63\), found 0"),
    (dict(sample_every=1.5), ValueError, r"sample_every: .*found 1.5 \(not truncated\)"),
    (dict(modules="0"), TypeError, r"modules: expected an iterable of module names or a predicate, found the str '0'"),
    (dict(modules=["0", "0"]), ValueError, r"modules: '0' is given twice"),
    (dict(modules=[0]), TypeError, r"modules: expected module names \(str\), found int 0"),
    (dict(loss_scale=3), TypeError, r"loss_scale: expected a str"),
])
def test_11_and_low_constructor_refusals_name_the_argument(tmp_path, kw, error, message):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(error, match=message):
        Telemetry(model, tmp_path / "run", precision="fp32", **kw)
    assert not (tmp_path / "run").exists()  # refused before the folder exists
    with Telemetry(model, tmp_path / "run2", precision="fp32", histogram_every=np.int64(2), sample_every=2.0):
        pass


def test_low_pathlib_paths_and_named_problems_with_out(tmp_path):
    model = torch.nn.Linear(2, 2)
    with Telemetry(model, pathlib.Path(tmp_path / "p"), precision="fp32") as tel:
        assert tel.dir == str(tmp_path / "p")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"out: '.*file' exists and is not a folder \(a file\); expected a new folder"):
        Telemetry(model, tmp_path / "file", precision="fp32")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(ValueError, match="is a symbolic link to '.*nowhere', which does not exist"):
        Telemetry(model, tmp_path / "dangling", precision="fp32")
    with pytest.raises(RuntimeError, match=r"cannot create run folder '.*file/run': Not a directory \('.*file' is not a "
                                           r"folder\)"):
        Telemetry(model, tmp_path / "file" / "run", precision="fp32")
    with pytest.raises(TypeError, match="out: expected a path"):
        Telemetry(model, 3, precision="fp32")


# ---- 9: non-finite scales in state paths --------------------------------------------------

def test_9_non_finite_scales_load_where_the_rule_reaches_them():
    s = GradScaler("cpu", preset="keras")  # keras 3: no finite guard, the scale may reach inf
    s.update(new_scale=math.inf)
    assert math.isinf(s.get_scale())
    state = s.state_dict()
    assert math.isinf(state["scale"]) and state["loss_scale"]["scale"] == "inf"
    s2 = GradScaler("cpu", preset="keras")
    s2.load_state_dict(state)
    assert math.isinf(s2.get_scale())
    state["loss_scale"]["scale"] = math.inf  # a float inf where the core writes "inf": the same
    s2.load_state_dict(state)
    ls = mixprec.LossScale("keras")
    loaded = ls.state_dict()
    loaded["scale"] = math.inf
    ls.load_state_dict(loaded)
    assert math.isinf(ls.exact_scale)
    # torch.amp's own state with scale inf: torch's rule never reaches inf; a clear refusal.
    ref = torch.amp.GradScaler("cpu").state_dict()
    ref["scale"] = math.inf
    with pytest.raises(ValueError) as e:
        GradScaler("cpu").load_state_dict(ref)
    assert "scale" in str(e.value) and "not valid JSON" not in str(e.value)
    with pytest.raises(ValueError, match=r"load_state_dict: loss_scale.config.growth_factor: expected a finite "
                                         r"number, found inf"):
        bad = GradScaler("cpu").state_dict()
        bad["loss_scale"]["config"]["growth_factor"] = math.inf
        GradScaler("cpu").load_state_dict(bad)


# ---- 10: strings that are not UTF-8 ------------------------------------------------------------

def test_10_a_parameter_name_that_is_not_utf8_is_recorded_escaped(tmp_path):
    model = torch.nn.Module()
    setattr(model, "bad\udcff", torch.nn.Linear(2, 2))
    with Telemetry(model, tmp_path / "run", precision="fp32") as tel:
        model.get_submodule("bad\udcff")(torch.randn(1, 2)).sum().backward()
        line = tel.record(loss=1.0)
    names = [p["name"] for p in line["params"]]
    assert names == ["bad\\udcff.weight", "bad\\udcff.bias"]
    mixprec.report(tmp_path / "run")


def test_10_an_out_path_that_is_not_utf8_is_refused_by_name(tmp_path):
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")
    with pytest.raises(ValueError, match="out: .* is not valid UTF-8"):
        Telemetry(torch.nn.Linear(2, 2), bad, precision="fp32")
    with pytest.raises(ValueError, match=r"runs\[0\]: .* is not valid UTF-8"):
        mixprec.report(bad)


# ---- 12: the schema version is checked ---------------------------------------------------------

def test_12_an_unknown_schema_version_is_refused(tmp_path):
    run = telemetry_run(tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config["run_folder_schema"] = 9
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="run_folder_schema: this mixprec reads run folders of schema versions "
                                           "1 to 2, found 9"):
        mixprec.report(run, out=tmp_path / "r.html")
    if CLI:
        for args in (["report", str(run), "--out", str(tmp_path / "r.html")], ["scaler", "simulate", str(run)]):
            r = cli(*args)
            assert r.returncode == 1 and "found 9" in r.stderr, r.stderr


# ---- 13: a scale that cannot be unscaled ---------------------------------------------------------

# ---- 15: alerts fit the run and its writer ------------------------------------------------------

def test_15_a_loss_module_is_not_counted_and_advice_names_the_recorded_lr(tmp_path):
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.crit = torch.nn.CrossEntropyLoss()

        def forward(self, x, y):
            return self.crit(self.fc(x), y)

    torch.manual_seed(0)
    model = WithLoss()
    scaler = GradScaler("cpu", init_scale=2.0**16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with Telemetry(model, tmp_path / "run", scaler=scaler, sample_every=1) as tel:
        for step in range(40):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 4), torch.tensor([0, 2]))
            if step >= 20:
                loss = loss * math.inf  # a persistent overflow after the warm-up
            scaler.scale(loss).backward()
            outcome = scaler.step(opt)
            tel.record(outcome, loss=loss.item(), lr=0.5)
            scaler.update()
            opt.zero_grad()
        alerts = tel.finish()
    first = lines(tmp_path / "run")[0]
    assert [t["name"] for t in first["act_grad_tensors"]] == ["fc"]  # not "crit": its gradient is the scale
    assert first["act_grads"]["overflow"] == 0
    advice = {a["id"]: a["advice"] for a in alerts}
    assert "lower the learning rate (peak 0.5; try 0.05)" in advice["persistent-overflow"]
    assert "clip_grad_norm_" in advice["persistent-overflow"] and "--clip" not in advice["persistent-overflow"]


# ---- 16: a histogram step samples ------------------------------------------------------------

def test_16_a_histogram_step_that_is_not_a_sampled_step_still_has_activations(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    with Telemetry(model, tmp_path / "run", precision="fp32", sample_every=4, histogram_every=6) as tel:
        for _ in range(6):
            model(torch.randn(2, 4)).sum().backward()
            tel.record(loss=1.0)
            model.zero_grad()
    step6 = lines(tmp_path / "run")[5]
    assert step6["step"] == 6 and "histograms" in step6
    assert sum(step6["histograms"]["activations"]["counts"]) > 0
    assert sum(step6["histograms"]["activation_grads"]["counts"]) > 0


# ---- Low: parameters added after construction -----------------------------------------------

def test_low_parameters_added_after_construction_are_recorded(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with Telemetry(model, tmp_path / "run", precision="fp32") as tel:
        tel.record(loss=1.0)
        model.append(torch.nn.Linear(2, 3))
        line = tel.record(loss=1.0)
    assert [p["name"] for p in line["params"]] == ["0.weight", "0.bias", "1.weight", "1.bias"]


# ---- 27 item 6: the scaler's whole config reaches the run folder and simulate ---------------

@needs_cli
def test_loss_scale_overrides_reach_the_folder_and_simulate(tmp_path):
    run = telemetry_run(tmp_path / "run", precision="fp16")
    config = json.loads((run / "config.json").read_text())
    assert config["loss-scale"] == "torch"
    assert config["loss-scale-config"]["growth_interval"] == 20
    r = cli("scaler", "simulate", str(run), "--preset", "run")
    assert r.returncode == 0, r.stderr
    assert "recorded policy (rule torch), written by mixprec.torch.Telemetry (Python): " in r.stdout and "growth_interval=20" in r.stdout
    assert "policy: preset run (rule torch):" in r.stdout


# ---- Low: states that disagree, presets without their scale, a rule switched by a load ---------

def test_low_torch_keys_and_mixprec_state_that_disagree_are_refused():
    s = GradScaler("cpu")
    state = s.state_dict()
    state["scale"] = 512.0  # torch's key edited, mixprec's loss_scale left as it was
    with pytest.raises(ValueError, match=r"field 'scale' is 512.0 but loss_scale says 65536.0: the torch keys and "
                                         r"mixprec's state disagree"):
        s.load_state_dict(state)
    state = s.state_dict()
    state["growth_interval"] = 7
    with pytest.raises(ValueError, match="field 'growth_interval' is 7 but loss_scale says 2000"):
        s.load_state_dict(state)
    s.load_state_dict({k: v for k, v in state.items() if k in ("scale", "growth_factor", "backoff_factor",
                                                                "growth_interval", "_growth_tracker")})
    assert s.get_growth_interval() == 7  # torch.amp's five keys alone: torch's own load


def test_low_the_static_preset_needs_its_scale():
    for make in (lambda: GradScaler("cpu", preset="static"), lambda: mixprec.LossScale("static")):
        with pytest.raises(ValueError, match="init_scale: the static preset needs its scale: give init_scale=S"):
            make()
    assert GradScaler("cpu", preset="static", init_scale=128.0).get_scale() == 128.0


def test_finding_13_a_starting_scale_whose_reciprocal_overflows_is_refused():
    """init_scale below 1/FLT_MAX (2.94e-39) would skip every step (1/S is inf in float32):
    refused as `--loss-scale static:S` refuses it; a state that backed off below it still loads."""
    msg = r"init_scale: expected a number > 0 whose reciprocal float32 holds \(the unscale .*found 1e-40"
    for make in (lambda: GradScaler("cpu", init_scale=1e-40), lambda: mixprec.LossScale("torch", init_scale=1e-40),
                 lambda: GradScaler("cpu", preset="static", init_scale=1e-40),
                 lambda: GradScaler("cpu", preset="keras", init_scale=1e-40)):
        with pytest.raises(ValueError, match=msg):
            make()
    assert GradScaler("cpu", init_scale=2.0**-127).get_scale() == 2.0**-127  # 1/S = 2^127: fine
    with pytest.raises(ValueError, match="found 2.9e-39"):
        GradScaler("cpu", init_scale=2.9e-39)
    s = GradScaler("cpu", init_scale=2.0**-127)
    state = {k: v for k, v in s.state_dict().items()
             if k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")}
    state["scale"] = 2.0**-140  # torch.amp's state after backoffs below it: loads
    s.load_state_dict(state)
    assert s.get_scale() == 2.0**-140


def test_low_a_loaded_state_of_another_rule_is_named():
    ls = mixprec.LossScale("torch")
    ls.load_state_dict(mixprec.LossScale("deepspeed").state_dict())
    assert ls.preset == "deepspeed" and ls.config["rule"] == "deepspeed"
    assert "deepspeed" in repr(ls)


def test_low_encode_refusals_name_the_argument_and_the_value_given():
    x = np.ones(3, np.float32)
    cases = [
        (dict(x=x, scale=None), TypeError, r"scale: expected a number, found NoneType None"),
        (dict(x=x, scale=1e-50), ValueError, r"scale: expected a finite number > 0 that float32 holds .*found 1e-50"),
        (dict(x=np.ones(3, np.dtype(">f4"))), TypeError, r"x: expected float32 in this machine's byte order, found "
                                                          r">f4 \(byte-swapped\)"),
        (dict(x=torch.zeros(3, device="meta")), TypeError, r"x: a meta tensor has no values to convert"),
        (dict(x=x, format=None), TypeError, r"format: expected a str, found NoneType None"),
    ]
    for kw, error, message in cases:
        kw = dict(dict(format="f16"), **kw)
        with pytest.raises(error, match=message):
            mixprec.encode(kw.pop("x"), kw.pop("format"), **kw)
