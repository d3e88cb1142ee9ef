"""Bad batches in a PyTorch loop, with and without mixprec's step guards (docs/spike_guards.md).

A small classifier (two hidden layers, synthetic clustered data) trains for 400 steps in bf16
autocast (no loss scaling: a plain loop, or mixprec.torch.StepGuard) and in fp16 autocast
(mixprec.torch.GradScaler, without or with skip_loss_z / skip_grad_z), seeds 1-3, three ways:
clean; bad batches at known steps (labels shuffled at 150, inputs x1e3 at 220, one gradient
element +inf at 300) without guards; the same with guards. Prints a Markdown table of the
final validation loss and the steps each run skipped. A benchmark, not a test:

    build/py-venv/bin/python bench/python/spike_guards_torch.py [--seeds 3] [--steps 400]
"""

import argparse
import math
import statistics

import torch

import mixprec.torch as mt

BAD = {150: "labels", 220: "inputs", 300: "inf"}
GUARDS = dict(skip_loss_z=5.0, skip_grad_z=5.0, skip_window=64)


def data(seed, n):
    g = torch.Generator().manual_seed(1000)  # the same task for every seed
    centers = torch.randn(10, 32, generator=g) * 0.35  # overlapping clusters: a loss near 1, never 0
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = centers[y] + torch.randn(n, 32, generator=g)
    return x, y


def run(precision, kind, seed, steps):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = data(seed, 64 * steps)
    xv, yv = data(10_000 + seed, 4096)
    guarded = kind == "guarded"
    if precision == "fp16":
        scaler = mt.GradScaler("cpu", **(GUARDS if guarded else {}))
        dtype = torch.float16
    else:
        scaler = mt.StepGuard(**GUARDS) if guarded else None
        dtype = torch.bfloat16
    skipped = []
    for step in range(1, steps + 1):
        xb, yb = x[64 * (step - 1):64 * step], y[64 * (step - 1):64 * step]
        bad = BAD.get(step) if kind != "clean" else None
        if bad == "labels":
            yb = yb[torch.randperm(64)]
        if bad == "inputs":
            xb = xb * 1e3
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(xb).float(), yb)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if bad == "inf":
            model[0].weight.grad[0, 0] = math.inf
        if scaler is None:
            opt.step()
            continue
        out = scaler.step(opt)
        scaler.update()
        if not out.applied:
            skipped.append(f"{step}:{out.reason}")
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        val = torch.nn.functional.cross_entropy(model(xv).float(), yv).item()
    return val, skipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| precision | run | validation loss per seed | mean | spread (max-min) | skipped steps (seed 1) |")
    print("|---|---|---|---|---|---|")
    for precision in ("bf16", "fp16"):
        for kind in ("clean", "bad", "guarded"):
            vals, skips = [], []
            for seed in range(1, a.seeds + 1):
                v, s = run(precision, kind, seed, a.steps)
                vals.append(v)
                skips.append(" ".join(s) or "none")
            finite = [v for v in vals if math.isfinite(v)]
            mean = f"{statistics.mean(vals):.4f}" if len(finite) == len(vals) else "nan"
            spread = f"{max(vals) - min(vals):.4f}" if len(finite) == len(vals) else "-"
            same = "" if len(set(skips)) == 1 else " (differs by seed: " + "; ".join(skips) + ")"
            print(f"| {precision} | {kind} | {', '.join(f'{v:.4f}' for v in vals)} | {mean} | {spread} | "
                  f"{skips[0]}{same} |", flush=True)


if __name__ == "__main__":
    main()
