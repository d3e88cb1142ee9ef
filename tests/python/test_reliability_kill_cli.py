"""SIGKILL at random moments of the CLI commands that replace their outputs (docs/reliability.md):
`mixprec advise` (recipe.json and advice.json, replaced together) and `mixprec export tensorboard`
(one event file, replaced under its name). After every kill a reader finds the old outputs or
the new ones: advise's OUT holds exactly recipe.json and advice.json of one run (advice.json's
per-layer choice is recipe.json's modules) and nothing else; the export's folder holds one file
whose name holds "tfevents" (TensorBoard loads every such file, hidden ones too), always the first
export's name, that TensorBoard's reader reads as one complete export, each step once. A clean
run afterwards succeeds and removes what the killed ones left beside or in the output.
The kill delays are seeded and spread over the measured time of a whole run."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import Dict

import pytest

CLI = os.environ.get("MIXPREC_CLI")
KILLS = 40
FIXTURES = Path(__file__).resolve().parents[1] / "cli" / "fixtures"


def cli() -> str:
    if not CLI:
        pytest.skip("MIXPREC_CLI is not set (make test-python sets it to the built mixprec program)")
    return CLI


def timed_run(args) -> float:
    """Seconds of one whole run of the command (started and waited for as the kills do)."""
    t0 = time.monotonic()
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    return elapsed


def kill_after(args, delay: float) -> int:
    """Starts the command, SIGKILLs it after `delay` seconds, waits; its exit status."""
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)  # a no-op when it has already exited (not yet waited for)
    return p.wait(timeout=60)


def dead_pid() -> int:
    """The id of a process that has exited (and was waited for)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# --- mixprec advise ------------------------------------------------------------------------------

def advisor_run(run: Path) -> None:
    """A run folder with advisor samples of two steps (as test_advise.py's
    test_run_folder_samples_and_the_cli_agree makes it), three small Linears."""
    torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch; make test-python installs it")
    import mixprec.torch as mt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 32, bias=False))
    scaler = mt.GradScaler("cpu", 256.0, preset="static")
    tel = mt.Telemetry(model, out=str(run), precision="fp32", scaler=scaler, advisor_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        (model(torch.randn(64, 64)).pow(2).mean() * scaler.get_scale()).backward()
        out = scaler.step(opt)
        tel.record(out, loss=0.0)
        scaler.update()
    tel.close()
    assert sorted(os.listdir(run / "samples")) == ["step-00000001", "step-00000002"]


def read_pair(out: Path) -> Dict[str, str]:
    """OUT's recipe.json and advice.json, checked to be one run's pair (docs/advisor.md: a layer
    whose choice is none, bf16 or fp16 is "bf16" in the recipe file); the recipe's modules."""
    entries = sorted(os.listdir(out))
    assert entries == ["advice.json", "recipe.json"], f"{out} holds {entries}"  # no temporary, no staging folder
    recipe = json.loads((out / "recipe.json").read_text())
    advice = json.loads((out / "advice.json").read_text())
    assert recipe["format"] == "mixprec.low_precision" and advice["format"] == "mixprec.advice"
    want = {l["layer"]: l["chosen"] if l["chosen"] not in (None, "bf16", "fp16") else "bf16"
            for l in advice["layers"]}
    assert recipe["modules"] == want, "recipe.json and advice.json are of different runs"
    return recipe["modules"]


STAGING = re.compile(r"\.advice\.tmp-\d+-\d+")


def test_kill_during_advise_leaves_one_consistent_pair(tmp_path):
    exe = cli()
    run = tmp_path / "run"
    advisor_run(run)
    out = run / "advice"  # the default OUT; its staging folders are run/.advice.tmp-PID-N
    cmd = {b: [exe, "advise", str(run), "--budget", b] for b in ("0", "1000")}
    # budget 0: no candidate is within it, every layer "bf16"; 1000: every layer its cheapest quantized format
    t = [timed_run(cmd["1000"])]
    big = read_pair(out)
    t.append(timed_run(cmd["0"]))
    tiny = read_pair(out)
    assert set(tiny.values()) == {"bf16"} and "bf16" not in big.values(), (tiny, big)
    t.append(timed_run(cmd["1000"]))
    assert read_pair(out) == big
    span = max(t)

    rng = random.Random(41)
    seen = {"pair kept": 0, "pair replaced": 0, "staging left": 0}  # what the kills hit, printed with -s
    current, staged = big, set()
    for i in range(KILLS):
        budget = "0" if i % 2 == 0 else "1000"
        kill_after(cmd[budget], rng.uniform(0, span))
        got = read_pair(out)
        assert got in (tiny, big)
        seen["pair kept" if got == current else "pair replaced"] += 1
        current = got
        beside = [n for n in os.listdir(run) if n.startswith(".advice")]
        for n in beside:  # killed runs' staging folders beside OUT (never read; the next run removes them)
            assert STAGING.fullmatch(n), f"{run} holds {n}"
        seen["staging left"] += bool(set(beside) - staged)
        staged |= set(beside)
    print(f"advise: {KILLS} kills over {span * 1e3:.0f} ms runs: {seen}")

    # A clean run: the new pair, and the staging folders of dead processes beside OUT removed;
    # one of a live process (a concurrent advise) is kept.
    dead = run / f".advice.tmp-{dead_pid()}-7"
    dead.mkdir(exist_ok=True)
    (dead / "recipe.json").write_text("{}")
    live = run / f".advice.tmp-{os.getpid()}-7"
    live.mkdir()
    r = subprocess.run(cmd["0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert read_pair(out) == tiny
    assert sorted(n for n in os.listdir(run) if n.startswith(".advice")) == [live.name]
    live.rmdir()


# --- mixprec export tensorboard ------------------------------------------------------------------

def tfrecords_whole(path: Path) -> int:
    """The number of TFRecord records of an event file whose framing ends exactly at its end."""
    data = path.read_bytes()
    pos = n = 0
    while pos < len(data):
        assert pos + 12 <= len(data), f"{path.name}: a record header cut at byte {pos}"
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 12 + length + 4
        assert pos <= len(data), f"{path.name}: a record cut short"
        n += 1
    return n


def read_scalars(logdir: Path) -> Dict[str, Dict[int, float]]:
    """Every scalar TensorBoard's reader finds in the folder (every file whose name holds
    "tfevents"): tag -> {step: value}, each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    got: Dict[str, Dict[int, float]] = {}
    for tag in ea.Tags()["scalars"]:
        events = ea.Scalars(tag)
        got[tag] = {e.step: e.value for e in events}
        assert len(got[tag]) == len(events), f"{tag}: a step read twice"
    return got


EXPORT_TEMPORARY = re.compile(r"\.mixprec-export\.tmp-\d+-\d+")


def test_kill_during_export_leaves_no_debris_tensorboard_loads(tmp_path):
    exe = cli()
    pytest.importorskip("tensorboard", reason="the integration packages are not installed")
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "simulate_run", run)  # a 6-step run folder
    log = run / "log.jsonl"
    tb = tmp_path / "tb"
    cmd = [exe, "export", "tensorboard", str(run), "--out", str(tb)]
    span = max(timed_run(cmd) for _ in range(3))
    (name,) = os.listdir(tb)
    assert "tfevents" in name
    want = read_scalars(tb)
    assert sorted(want["loss"]) == [1, 2, 3, 4, 5, 6]
    records = tfrecords_whole(tb / name)

    rng = random.Random(42)
    base = log.stat().st_mtime
    left = set()  # the temporaries the kills left (hidden, no "tfevents": TensorBoard skips them)
    for i in range(KILLS):
        # The log written anew (a run that goes on): its time, and so the run's start that an
        # export names its file after, moves; a re-export still replaces the one file it wrote.
        os.utime(log, (base + 100 * (i + 1), base + 100 * (i + 1)))
        kill_after(cmd, rng.uniform(0, span))
        entries = os.listdir(tb)
        events = [n for n in entries if "tfevents" in n]
        assert events == [name], f"after kill {i}: {entries}"
        for n in entries:
            assert n == name or EXPORT_TEMPORARY.fullmatch(n), f"after kill {i}: {tb} holds {n}"
        left |= set(entries) - {name}
        assert tfrecords_whole(tb / name) == records
        assert read_scalars(tb) == want, f"after kill {i}"

    print(f"export: {KILLS} kills over {span * 1e3:.0f} ms runs; {len(left)} left a temporary")

    # A clean export removes the temporaries of dead processes, an older mixprec's too (their
    # names held "tfevents"), and keeps a live process's (a concurrent export).
    pid = dead_pid()
    (tb / f".mixprec-export.tmp-{pid}-3").write_bytes(b"\0" * 10)
    (tb / f".{name}.tmp-{pid}-4").write_bytes((tb / name).read_bytes())
    live = tb / f".mixprec-export.tmp-{os.getpid()}-5"
    live.write_bytes(b"")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert str(tb / name) in r.stdout
    assert sorted(os.listdir(tb)) == sorted([live.name, name])
    live.unlink()
    assert read_scalars(tb) == want
