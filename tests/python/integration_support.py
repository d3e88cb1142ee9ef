"""What the integration tests share (tests/python/test_integration_*.py): the tiny GPT-2 of the
Trainer, Accelerate and Lightning runs, random tokens, the injected overflow, bitwise comparison
of weights, the run folder's log and `mixprec report` on it.

The integration packages (transformers, accelerate, lightning, tensorboard) are pinned in
scripts/deps.sh and installed by `make test`; a missing one fails the import there.
MIXPREC_NO_INTEGRATIONS=1 skips these tests with a message (a venv without them).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

SKIP_REASON = "MIXPREC_NO_INTEGRATIONS=1: the integration packages are not installed in this venv"


def skip_without_integrations() -> None:
    if os.environ.get("MIXPREC_NO_INTEGRATIONS") == "1":
        pytest.skip(SKIP_REASON, allow_module_level=True)


VOCAB, CONTEXT = 96, 16
INJECT_STEP = 3                               # 1-based optimizer step whose gradient gets an inf
INJECT_PARAM = "transformer.h.1.mlp.c_fc.weight"


def gpt2(seed: int = 0):
    """GPT-2's architecture at toy size (2 layers, width 32), random init."""
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def random_tokens(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, CONTEXT), generator=g)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 1) -> None:
        self.ids = random_tokens(n, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Injector:
    """Writes inf into the gradient of one parameter during the backward pass(es) of one optimizer
    step (a tensor hook: the scaler sees it as a real overflow). step() advances the count."""

    def __init__(self, model: torch.nn.Module, name: str = INJECT_PARAM, at: int = INJECT_STEP) -> None:
        self.step = 1
        self.at = at
        param = dict(model.named_parameters())[name]
        self.handle = param.register_hook(lambda g: g * math.inf if self.step == self.at else g)


def assert_bitwise_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    differ = [n for n in pa if not torch.equal(pa[n].detach(), pb[n].detach())]
    assert not differ, f"{len(differ)} parameters differ, first {differ[0]}"


def read_log(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]


def assert_cli_report(run_dir: Path) -> None:
    """The C++ `mixprec report` renders the folder (MIXPREC_CLI, as make test-python sets it)."""
    cli = os.environ.get("MIXPREC_CLI")
    if not cli:
        pytest.skip("MIXPREC_CLI is not set (make test-python sets it to the built mixprec program)")
    out = Path(run_dir) / "cli-report.html"
    r = subprocess.run([cli, "report", str(run_dir), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert "<svg" in html and "skipped" in html


def run_ranks(script: str, *args: str, ranks: int = 2, timeout: float = 240) -> List[dict]:
    """Runs `python -c script RANK *args` for each rank at once (a gloo job: the script sets up
    its process group) and returns each rank's last stdout line, read as JSON, in rank order."""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(ranks)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
