"""Optimizer state formats by training (docs/optimizers.md, "State formats: training"). Not a test:
minutes of training.

Two models with bfloat16 parameters, trained with mixprec.torch.optim.AdamW under each master and
moment format, paired (same seeds, data and initial weights) against fp32 master weights and fp32
moments: the example GPT (examples/pytorch/train_gpt.py's model) and a transformers GPT-2 config.
For each run: the final validation loss, and the lost-update fraction (of the weights the step
meant to move, those whose weights of record did not change; measured every 10 steps). The
contrast the seeds predict: bf16 weights without a master and with nearest rounding lose the
updates below half an ulp, and the loss is worse; stochastic rounding keeps them in expectation.

    build/py-venv/bin/python bench/python/state_formats_train.py [--steps 400] [--seeds 1,2,3] [--models gpt,gpt2]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import mixprec
from mixprec.torch.optim import AdamW
from state_formats_cost import cpu_name  # this folder's benchmark of the same formats

REPO = pathlib.Path(__file__).resolve().parents[2]

# (label, AdamW keyword arguments)
FORMATS = [
    ("fp32 master, fp32 moments", dict(master="fp32", moments="fp32")),
    ("remainder, fp32 moments", dict(master="remainder", moments="fp32")),
    ("remainder, bf16 moments", dict(master="remainder", moments="bf16")),
    ("remainder, fp8 moments", dict(master="remainder", moments="fp8")),
    ("remainder, 8bit moments", dict(master="remainder", moments="8bit")),
    ("remainder, 4bit moments", dict(master="remainder", moments="4bit")),
    ("fp32 master, fp16 moments (TE)", dict(master="fp32", moments="fp16")),
    ("no master, stochastic rounding", dict(master="none", moments="fp32", stochastic_rounding=True)),
    ("no master, nearest rounding", dict(master="none", moments="fp32")),
]


def example_gpt(vocab: int, context: int, seed: int) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples/pytorch/train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(seed)
    return mod.Gpt(vocab, context, layers=2, c=64, heads=4)


class Gpt2(torch.nn.Module):
    def __init__(self, vocab: int, context: int, seed: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(seed)
        cfg = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=64, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.m = GPT2LMHeadModel(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=idx).logits


def batches(tokens: np.ndarray, context: int, batch: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, tokens.size - context - 1, size=batch)
        x = np.stack([tokens[s:s + context] for s in starts])
        y = np.stack([tokens[s + 1:s + context + 1] for s in starts])
        yield torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))


def run(model_name: str, kw: dict, seed: int, steps: int, data) -> tuple:
    context, batch = 64, 8
    model = example_gpt(data.vocab_size, context, seed) if model_name == "gpt" else Gpt2(data.vocab_size, context, seed)
    model = model.to(torch.bfloat16)
    params = [p for p in model.parameters()]
    opt = AdamW(params, lr=3e-3, weight_decay=0.1, seed=seed, **kw)
    train = batches(np.asarray(data.train), context, batch, np.random.default_rng(seed))
    val_rng = np.random.default_rng(12345)
    val = [next(batches(np.asarray(data.validation), context, batch, val_rng)) for _ in range(8)]
    meant = lost = 0
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(train)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        measure = step % 10 == 0
        if measure:
            before = [opt.master_weights(p) if opt.state.get(p) else p.detach().float().clone() for p in params]
        opt.step()
        if measure:
            for p, b in zip(params, before):
                after = opt.master_weights(p)
                move = p.grad.float() != 0
                meant += int(move.sum())
                lost += int((move & (after == b)).sum())
    with torch.no_grad():
        vl = statistics.fmean(float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())) for x, y in val)
    return vl, lost / max(1, meant)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--models", default="gpt,gpt2")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    seeds = [int(s) for s in a.seeds.split(",")]
    data = mixprec.data.corpus(tokens=200_000, context=64)
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, "
          f"{a.threads} thread(s), {a.steps} steps, seeds {seeds}")
    for model_name in a.models.split(","):
        print(f"\n### {'example GPT' if model_name == 'gpt' else 'transformers GPT-2 config'} (bf16 parameters)\n")
        print("| state | val loss per seed | mean | vs fp32 master (mean of paired differences) | lost updates |")
        print("|---|---|---|---|---|")
        base = None
        for label, kw in FORMATS:
            t0 = time.time()
            res = [run(model_name, kw, s, a.steps, data) for s in seeds]
            losses = [r[0] for r in res]
            lost = statistics.fmean(r[1] for r in res)
            if base is None:
                base = losses
            diff = [x - b for x, b in zip(losses, base)]
            print(f"| {label} | {' / '.join(f'{x:.4f}' for x in losses)} | {statistics.fmean(losses):.4f} | "
                  f"{statistics.fmean(diff):+.4f} | {lost:.2%} |  ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
