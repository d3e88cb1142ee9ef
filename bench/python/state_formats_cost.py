"""Optimizer state formats: bytes measured on a model of 124M parameters, and the step's speed next
to the optimizers users would pick (docs/optimizers.md, "State formats: bytes and speed").
Not a test: a benchmark, medians of paired rounds.

Bytes: a transformers GPT-2 small config (124M parameters, bfloat16), one step of
mixprec.torch.optim.AdamW per format; the bytes its state tensors hold (AdamW.state_bytes()).
Speed: one tensor of --numel parameters, --threads threads (1 by default: torch.set_num_threads, which
mixprec's step follows too), bfloat16 parameters and gradients for mixprec
(fp32 parameters for the peers, as users run them): mixprec's fused step per format, PyTorch's
AdamW (fused=True and foreach), and torchao's AdamW8bit, AdamW4bit and AdamWFp8 (torch.compile'd
as torchao runs them; the compile time is reported apart). Each round times every optimizer once,
in a rotating order; the table gives the median step and the parameters per second.

    build/py-venv/bin/python bench/python/state_formats_cost.py [--numel 16777216] [--rounds 7] [--threads 1]
        [--no-torchao] [--no-memory]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

from mixprec.torch.optim import AdamW

MIXPREC = [
    ("fp32 master, fp32 moments", dict(master="fp32", moments="fp32")),
    ("remainder, bf16 moments", dict(master="remainder", moments="bf16")),
    ("remainder, fp16 moments (TE)", dict(master="remainder", moments="fp16")),
    ("remainder, fp8 moments", dict(master="remainder", moments="fp8")),
    ("remainder, 8bit moments", dict(master="remainder", moments="8bit")),
    ("remainder, 4bit moments", dict(master="remainder", moments="4bit")),
    ("no master (stochastic), bf16 moments", dict(master="none", moments="bf16", stochastic_rounding=True)),
]


def cpu_name() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def memory_table() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).to(torch.bfloat16)  # GPT-2 small: 124M parameters
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    print(f"\n### Bytes of optimizer state, measured: GPT-2 small config, {n:,} parameters (bfloat16)\n")
    print("| master, moments | master B/P | m B/P | v B/P | state B/P | state GB |")
    print("|---|---|---|---|---|---|")
    for label, kw in [("fp32, fp32", dict(master="fp32", moments="fp32")),
                      ("remainder, bf16", dict(master="remainder", moments="bf16")),
                      ("remainder, fp8", dict(master="remainder", moments="fp8")),
                      ("remainder, 8bit", dict(master="remainder", moments="8bit")),
                      ("remainder, 4bit", dict(master="remainder", moments="4bit")),
                      ("none, 4bit", dict(master="none", moments="4bit"))]:
        opt = AdamW(params, lr=1e-6, **kw)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        b = opt.state_bytes()
        s = b["master"] + b["m"] + b["v"]
        print(f"| {label} | {b['master'] / n:.2f} | {b['m'] / n:.3f} | {b['v'] / n:.3f} | {s / n:.2f} | {s / 1e9:.3f} |",
              flush=True)
        del opt


def speed_table(numel: int, rounds: int, torchao: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(numel) * 0.02
    g = torch.randn(numel) * 1e-3
    cases = []  # (label, step function, parameters)

    def add_mixprec(label, kw):
        p = torch.nn.Parameter(w.bfloat16())
        p.grad = g.bfloat16()
        opt = AdamW([p], lr=1e-4, **kw)
        opt.step()  # state allocated outside the timing
        cases.append(("mixprec " + label, opt.step))

    for label, kw in MIXPREC:
        add_mixprec(label, kw)
    for label, kw in (("PyTorch AdamW fused=True (fp32)", dict(fused=True)),
                      ("PyTorch AdamW foreach (fp32)", dict(foreach=True))):
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        opt = torch.optim.AdamW([p], lr=1e-4, **kw)
        opt.step()
        cases.append((label, opt.step))
    if torchao:
        import torchao.optim as ao
        for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
            p = torch.nn.Parameter(w.clone())
            p.grad = g.clone()
            opt = getattr(ao, name)([p], lr=1e-4)
            t0 = time.perf_counter()
            for _ in range(3):
                opt.step()
            print(f"torchao {name}: first three steps (compiling) {time.perf_counter() - t0:.1f} s", flush=True)
            cases.append((f"torchao {name} (fp32, compiled)", opt.step))
    times = {label: [] for label, _ in cases}
    for r in range(rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        for label, step in order:
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
    base = statistics.median(times["PyTorch AdamW fused=True (fp32)"])
    threads = torch.get_num_threads()
    print(f"\n### One step of {numel:,} parameters, {threads} thread{'s' if threads > 1 else ''}, {cpu_name()}, "
          f"torch {torch.__version__}\n")
    print("| optimizer | median step (ms) | M params/s | vs PyTorch fused AdamW |")
    print("|---|---|---|---|")
    for label, _ in cases:
        t = statistics.median(times[label])
        print(f"| {label} | {t * 1e3:.1f} | {numel / t / 1e6:.0f} | {base / t:.2f}x |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    speed_table(a.numel, a.rounds, not a.no_torchao)
    if not a.no_memory:
        memory_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
