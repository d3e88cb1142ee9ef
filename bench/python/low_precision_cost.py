"""What mixprec.torch.low_precision costs a PyTorch step on the CPU (docs/low_precision.md,
"Cost of the emulation"): the same model trained with bf16 autocast, and with each recipe's
quantized Linears (TE's GEMM layouts emulated through lowp::quantize; all but the first and last
Linear, as low_precision's default, and nvfp4 on every Linear as `nvfp4-all`).

One trainer per row (model, AdamW, the same init and batches). Each round runs `--steps` steps of
every row after one warm-up step, the rows' steps interleaved in an order rotated at every step,
so that the machine's drift falls on all alike. A row's step time is its median over the round;
its ratio is that over the bf16 row's of the same round (paired), and the figure printed is the
median over rounds with the lowest and highest round. A benchmark, not a test.

    build/py-venv/bin/python bench/python/low_precision_cost.py [--model gpt|transformers]
        [--rounds 5] [--steps 4] [--threads 1] [--recipes bf16,fp8-delayed,...]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "pytorch"))

import mixprec  # noqa: E402
import mixprec.torch as mt  # noqa: E402
from low_precision import ROWS, build  # noqa: E402  (examples/pytorch/low_precision.py)


class Trainer:
    """One row's model and optimizer, stepped one timed step at a time on the shared batches."""

    def __init__(self, row: str, a, data) -> None:
        recipe, which = ROWS[row]
        self.model = build(a.model, data.vocab_size, a.context, 0)
        if recipe is not None:
            names = [n for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)]
            mt.low_precision(self.model, recipe, modules=names if which == "all" else None, seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "transformers"), default="gpt")
    p.add_argument("--recipes", default=",".join(ROWS), help=f"rows, from {', '.join(ROWS)} (bf16 is always run)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    rows = ["bf16"] + [r for r in a.recipes.split(",") if r and r != "bf16"]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        p.error(f"--recipes: unknown {bad}; expected some of {', '.join(ROWS)}")
    if min(a.rounds, a.steps, a.batch, a.threads) < 1 or a.context < 2:
        p.error("--rounds, --steps, --batch and --threads must be >= 1, --context >= 2")
    torch.set_num_threads(a.threads)
    data = mixprec.data.corpus(tokens=200_000, context=a.context)
    rng = np.random.default_rng(0)
    batches = [tuple(torch.from_numpy(v.astype(np.int64)) for v in mixprec.data.batch(data.train, a.batch, a.context, rng))
               for _ in range(a.steps + 1)]
    print(f"{a.model}: bf16 autocast, batch {a.batch} x {a.context}, torch threads {a.threads}, "
          f"{a.rounds} rounds of {a.steps} steps per row, steps interleaved")
    ratios = {r: [] for r in rows}
    medians = {r: [] for r in rows}
    for k in range(a.rounds):
        trainers = {r: Trainer(r, a, data) for r in rows}
        for r in rows:
            trainers[r].step(*batches[0])  # warm-up
        times = {r: [] for r in rows}
        for i in range(a.steps):
            j = (i + k) % len(rows)
            for r in rows[j:] + rows[:j]:
                times[r].append(trainers[r].step(*batches[i + 1]))
        base = statistics.median(times["bf16"])
        for r in rows:
            m = statistics.median(times[r])
            medians[r].append(m)
            ratios[r].append(m / base)
    print(f"{'row':<12} {'step ms':>9} {'vs bf16 (paired median)':>24} {'lowest':>8} {'highest':>8}")
    for r in rows:
        print(f"{r:<12} {1000 * statistics.median(medians[r]):>9.2f} {statistics.median(ratios[r]):>24.3f} "
              f"{min(ratios[r]):>8.3f} {max(ratios[r]):>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
