"""What the precision advisor's sampling pass costs the steps it watches (docs/advisor.md, "Cost of
sampling").

The model and loop of examples/pytorch/train_gpt.py (bf16 autocast on the CPU, AdamW, 2
micro-batches per step), in rounds; each round runs, in a rotated order, a step without the
advisor and a step with its sampler active on every nn.Linear (hooks keeping x and dy by
reference and copying w and dW, then take_held()). Each step is timed twice: the
process's CPU time (one torch thread: the work done, little moved by other processes on a shared
machine) and wall-clock time. Each variant's step time is the median over its rounds; the cost
is the median of the per-round ratios (paired, so a machine that slows down for a while slows
both). What runs once, after the steps, is timed apart: the held samples' conversion to
float32 arrays (to_arrays: gradients unscaled) and the core's measurement and choice. A
benchmark, not a test.

    build/py-venv/bin/python bench/python/advise_cost.py [--rounds 15] [--steps 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import mixprec
import mixprec.torch
from mixprec import _core
from mixprec.torch.advise import Sampler, config_json, to_arrays

REPO = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "pytorch" / "train_gpt.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--channels", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    data = mixprec.data.corpus(tokens=200_000, context=a.context)
    model = example.Gpt(data.vocab_size, a.context, a.layers, a.channels, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = Sampler(model)
    held = []

    def step(sampled: bool) -> tuple:
        t0, c0 = time.perf_counter(), time.process_time()
        sampler.active = sampled
        for _ in range(2):
            x, y = (torch.from_numpy(v) for v in mixprec.data.batch(data.train, a.batch, a.context, rng))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / 2
            loss.backward()
        sampler.active = False
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sampled:
            held.extend(sampler.take_held(len(held), 1.0))
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(3):  # warm-up
        step(False)
        step(True)
    held.clear()
    clocks = ("CPU", "wall")
    times = {c: {False: [], True: []} for c in clocks}
    ratios = {c: [] for c in clocks}
    for r in range(a.rounds):
        per = {c: {} for c in clocks}
        for sampled in ((False, True) if r % 2 == 0 else (True, False)):
            t = [step(sampled) for _ in range(a.steps)]
            for i, c in enumerate(("wall", "CPU")):
                per[c][sampled] = statistics.median(x[i] for x in t)
                times[c][sampled] += [x[i] for x in t]
        for c in clocks:
            ratios[c].append(per[c][True] / per[c][False])
    t0 = time.process_time()
    samples = to_arrays(held)
    t_convert = time.process_time() - t0
    held.clear()
    adv = _core.advise(samples, config_json())
    t_measure = time.process_time() - t0 - t_convert
    n_layers = len(sampler.layers)
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters, {n_layers} Linears, "
          f"{a.threads} thread(s), batch {a.batch} x {a.context} x 2 micro-batches, bf16 autocast")
    for c in clocks:
        base, with_s = statistics.median(times[c][False]), statistics.median(times[c][True])
        q = statistics.quantiles(ratios[c], n=4)
        print(f"{c:4s} step without the advisor: median {1000 * base:.2f} ms; with its sampler active: "
              f"{1000 * with_s:.2f} ms; sampling pass {100 * (statistics.median(ratios[c]) - 1):+.1f}% of the step "
              f"(median of {a.rounds} paired rounds; quartiles {100 * (q[0] - 1):+.1f}% .. {100 * (q[2] - 1):+.1f}%)")
    steps_sampled = len(times["CPU"][True])
    print(f"once, after the steps, for {len(samples)} samples of {steps_sampled} sampled steps: conversion to float32 "
          f"{t_convert:.2f} s CPU ({1000 * t_convert / max(1, steps_sampled):.1f} ms per sampled step); measurement and "
          f"choice {t_measure:.2f} s CPU ({1000 * t_measure / max(1, steps_sampled):.1f} ms per sampled step)")
    del adv


if __name__ == "__main__":
    main()
