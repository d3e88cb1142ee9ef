"""What mixprec.torch.Telemetry costs a PyTorch step (docs/python.md, "Telemetry: cost").

The model and loop of examples/pytorch/train_gpt.py (fp16 autocast on the CPU, mixprec's
GradScaler, clipping, AdamW, 2 micro-batches), run in rounds; each round runs every variant for
`--steps` steps in a rotated order: no Telemetry, Telemetry at the default sampling (every 4th
step), every 8th step, at every step, and every step without the forward checks. Each variant's step time is the
median over its rounds; the cost is its ratio to the no-Telemetry median (paired per round too:
the median of the per-round ratios). A benchmark, not a test.

    build/py-venv/bin/python bench/python/telemetry_cost.py [--rounds 7] [--steps 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import tempfile
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

VARIANTS = {
    "none": None,
    "default (sample every 4)": dict(),
    "every 8th step": dict(sample_every=8),
    "every step": dict(sample_every=1),
    "every step, no forward check": dict(sample_every=1, check_forward=False),
}


def run(variant, kw, data, steps, args, tmp):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = example.Gpt(data.vocab_size, args.context, args.layers, args.channels, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = mixprec.torch.GradScaler("cpu", preset="torch")
    scaler.set_names(model)
    tel = None if kw is None else mixprec.torch.Telemetry(model, tempfile.mkdtemp(dir=tmp), scaler=scaler, **kw)
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for _ in range(2):
            x, y = (torch.from_numpy(v) for v in mixprec.data.batch(data.train, args.batch, args.context, rng))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / 2
            scaler.scale(loss).backward()
            loss_sum += loss.item()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out = scaler.step(opt)
        if tel is not None:
            tel.record(out, loss=loss_sum)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
    if tel is not None:
        tel.close()
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--channels", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = mixprec.data.corpus(tokens=200_000, context=args.context)
    names = list(VARIANTS)
    per = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                per[n].append(run(n, VARIANTS[n], data, args.steps, args, tmp))
    base = statistics.median(per["none"])
    print(f"model: {args.layers} layers, {args.channels} channels, context {args.context}, batch {args.batch} x 2 "
          f"micro-batches, fp16 autocast, {args.threads} thread(s); {args.rounds} rounds of {args.steps} steps")
    print(f"{'variant':32s} {'median ms':>10s} {'vs none':>8s} {'paired':>8s}")
    for n in names:
        med = statistics.median(per[n])
        paired = statistics.median(a / b for a, b in zip(per[n], per["none"]))
        print(f"{n:32s} {1000 * med:10.2f} {med / base:8.3f} {paired:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
