"""What per-layer loss scaling (preset "layerwise") costs an fp16 step of the example GPT
(docs/loss_scaling.md, "Per-layer loss scaling (preset `layerwise`)", "Cost").

The model and loop of examples/pytorch/train_gpt.py (fp16 autocast on the CPU, mixprec's
GradScaler, clipping, AdamW, 2 micro-batches). Each round runs both variants for `--steps` steps,
in alternating order: preset "mixprec" (one scale) and preset "layerwise" with watch(model) (the
hooks: moments of every Linear's output gradient, the factors, the rescaling, the per-layer check).
A variant's step time is the median over its steps; the cost is the median over the rounds of
the per-round ratio layerwise / mixprec, with the spread of those ratios (the noise of a shared
machine). A benchmark, not a test.

    build/py-venv/bin/python bench/python/layerwise_cost.py [--rounds 9] [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import mixprec
import mixprec.torch

REPO = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "pytorch" / "train_gpt.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def run(preset, data, args):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = example.Gpt(data.vocab_size, args.context, args.layers, args.channels, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = mixprec.torch.GradScaler("cpu", preset=preset)
    if preset == "layerwise":
        scaler.watch(model)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        for _ in range(2):
            x, y = (torch.from_numpy(v) for v in mixprec.data.batch(data.train, args.batch, args.context, rng))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / 2
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if step:  # the first step warms up (and finds the links)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--channels", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = mixprec.data.corpus(tokens=200_000, context=args.context)
    base, layered = [], []
    for r in range(args.rounds):
        order = ["mixprec", "layerwise"] if r % 2 == 0 else ["layerwise", "mixprec"]
        got = {preset: run(preset, data, args) for preset in order}
        base.append(got["mixprec"])
        layered.append(got["layerwise"])
    ratios = sorted(a / b for a, b in zip(layered, base))
    print(f"model: {args.layers} layers, {args.channels} channels, context {args.context}, batch {args.batch} x 2 "
          f"micro-batches, fp16 autocast, {args.threads} thread(s); {args.rounds} rounds of {args.steps} steps")
    print(f"one scale (mixprec)   median step {1000 * statistics.median(base):8.2f} ms")
    print(f"layerwise (hooks)     median step {1000 * statistics.median(layered):8.2f} ms")
    print(f"paired ratio layerwise / one scale: median {statistics.median(ratios):.3f}, "
          f"range {ratios[0]:.3f} .. {ratios[-1]:.3f} over {len(ratios)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
