"""SIGKILL at random moments of mixprec.torch.Telemetry's record() and finish() (docs/reliability.md,
"Killed while recording"; the libtorch Telemetry's twin is tests/reliability/kill_telemetry.sh):
a child process trains a small model and prints each line record() returned and each
finish(); it is killed at a random delay after a random number of returned calls, three times. Each time
the folder is read by mixprec.report (and `mixprec report` when MIXPREC_CLI is given), its log
begins with exactly the lines that returned (one more whole line may follow: a record()
killed after its write), and its steps are 1..N."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="mixprec.torch needs PyTorch; make test-python installs it")
import mixprec  # noqa: E402

CHILD = r"""
import json, sys, torch
from mixprec.torch import GradScaler, Telemetry
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
scaler = GradScaler("cpu", growth_interval=5)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tel = Telemetry(model, sys.argv[1], scaler=scaler, sample_every=1, histogram_every=3)
step = 0
while True:
    step += 1
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 32)).float().pow(2).mean()
    scaler.scale(loss).backward()
    outcome = scaler.step(opt)
    line = tel.record(outcome, loss=loss.item(), lr=0.01, tokens=16)
    sys.stdout.write("ok " + json.dumps(line) + "\n"); sys.stdout.flush()
    scaler.update()
    opt.zero_grad()
    if step % 2 == 0:
        tel.finish()
        sys.stdout.write("finished\n"); sys.stdout.flush()
"""


def test_sigkill_in_record_or_finish_leaves_every_returned_record_intact(tmp_path):
    rng = random.Random(30)
    for trial in range(3):
        run = tmp_path / f"run{trial}"
        out = tmp_path / f"out{trial}.txt"
        want, delay = rng.randint(1, 10), rng.uniform(0, 0.04)
        with open(out, "w") as f:
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(run)], stdout=f, stderr=subprocess.PIPE,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + 120
        while sum(line.startswith("ok ") for line in out.read_text().splitlines()) < want:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never recorded"
            time.sleep(0.01)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stderr.close()
        returned = [json.loads(line[3:]) for line in out.read_text().splitlines() if line.startswith("ok ")]
        mixprec.report(run, out=tmp_path / f"r{trial}.html")
        if os.environ.get("MIXPREC_CLI"):
            r = subprocess.run([os.environ["MIXPREC_CLI"], "report", str(run), "--out", str(tmp_path / "c.html")],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
        text = (run / "log.jsonl").read_text()
        whole = text.splitlines()[: text.count("\n")]  # a last line cut short by the kill is no record
        logged = [json.loads(line) for line in whole]
        assert logged[: len(returned)] == returned, f"trial {trial}: a returned record changed"
        assert len(logged) <= len(returned) + 1
        assert [r["step"] for r in logged] == list(range(1, len(logged) + 1))
