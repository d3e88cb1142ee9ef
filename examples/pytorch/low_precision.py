"""Transformer Engine's low-precision recipes on PyTorch models, emulated on the CPU: the example
GPT (examples/pytorch/train_gpt.py) and one transformers model (a randomly initialised GPT-2
config), each trained with bf16 autocast and with every recipe of mixprec.torch.low_precision
on the embedded corpus, with the same data, initialisation and step count; the table compares
the final validation loss with bf16's (docs/low_precision.md, "Measured").

    python examples/pytorch/low_precision.py                       # both models, every recipe
    python examples/pytorch/low_precision.py --model gpt --steps 100 --recipes bf16,nvfp4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mixprec  # noqa: E402
import mixprec.torch as mt  # noqa: E402
from train_gpt import Gpt  # noqa: E402

# (row name, recipe, which Linears): "inner" = all but the first and the last (the default),
# "all" = every Linear, the LM head included.
ROWS = {
    "bf16": (None, None),
    "fp8-delayed": ("fp8-delayed", "inner"),
    "fp8-current": ("fp8-current", "inner"),
    "mxfp8": ("mxfp8", "inner"),
    "fp8-block": ("fp8-block", "inner"),
    "nvfp4": ("nvfp4", "inner"),
    "nvfp4-all": ("nvfp4", "all"),
    "mxfp4": ("mxfp4", "inner"),
}


class HfLm(torch.nn.Module):
    """transformers' GPT2LMHeadModel from a config, random weights, returning the logits."""

    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415 (optional)
        # bos/eos inside the vocabulary (GPT-2's 50256 is not): transformers checks them.
        cfg = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=64, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.lm = GPT2LMHeadModel(cfg)
        # GPT-2's Conv1D layers are Linears with a transposed weight: make them nn.Linear so that
        # low_precision sees them (the same function, the weight stored [out, in]).
        for name, mod in list(self.lm.named_modules()):
            if type(mod).__name__ == "Conv1D":
                lin = torch.nn.Linear(mod.weight.shape[0], mod.weight.shape[1])
                with torch.no_grad():
                    lin.weight.copy_(mod.weight.t())
                    lin.bias.copy_(mod.bias)
                parent, _, child = name.rpartition(".")
                setattr(self.lm.get_submodule(parent), child, lin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits


def build(model: str, vocab: int, context: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if model == "gpt":
        return Gpt(vocab, context, layers=2, c=64, heads=4)
    return HfLm(vocab, context)


def train(model_name: str, row: str, a, data) -> dict:
    recipe, which = ROWS[row]
    model = build(model_name, data.vocab_size, a.context, a.seed)
    if recipe is not None:
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        mt.low_precision(model, recipe, modules=names if which == "all" else None, seed=a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    rng = np.random.default_rng(a.seed)

    def evaluate() -> float:
        model.eval()
        losses = []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for w in range(0, min(data.validation.size - a.context - 1, 16 * a.batch * a.context), a.context):
                x = torch.from_numpy(data.validation[w:w + a.context].astype(np.int64))[None]
                y = torch.from_numpy(data.validation[w + 1:w + a.context + 1].astype(np.int64))[None]
                losses.append(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item())
        model.train()
        return float(np.mean(losses))

    step_ms, err = [], []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = (torch.from_numpy(v) for v in mixprec.data.batch(data.train, a.batch, a.context, rng))
        sampled = recipe is not None and (step - 1) % a.sample_every == 0
        if sampled:
            mt.sample_quantization_error(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step_ms.append(1000 * (time.perf_counter() - t0))
        if sampled:  # the stats hold the last quantization of each role: read them at once
            err += [s[r]["rel_rms_error"] for s in mt.quantization_stats(model).values() for r in ("x", "w", "dy")
                    if s[r]["rel_rms_error"] is not None]
    return {"val": evaluate(), "train": float(loss.item()), "ms": float(np.median(step_ms)),
            "rel_err": float(np.mean(err)) if err else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "transformers", "both"), default="both")
    p.add_argument("--recipes", default=",".join(ROWS), help=f"rows, from {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sample-every", type=int, default=25,
                   help="measure the quantization error (the table's mean rel err) every N steps")
    a = p.parse_args(argv)
    rows = [r for r in a.recipes.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        p.error(f"--recipes: unknown {bad}; expected some of {', '.join(ROWS)}")
    if a.steps < 1 or a.batch < 1 or a.context < 2 or a.sample_every < 1 or a.threads < 1:
        p.error("--steps, --batch, --sample-every, --threads must be >= 1 and --context >= 2")
    torch.set_num_threads(a.threads)
    data = mixprec.data.corpus(tokens=200_000, context=a.context)
    models = ["gpt", "transformers"] if a.model == "both" else [a.model]
    for m in models:
        print(f"\n{m}: {a.steps} steps of {a.batch} x {a.context} tokens, bf16 autocast, AdamW lr {a.lr}, seed {a.seed}")
        print(f"{'row':<12} {'val loss':>9} {'vs bf16':>8} {'rel err':>8} {'step ms':>8}")
        base = None
        for r in rows:
            res = train(m, r, a, data)
            if r == "bf16":
                base = res["val"]
            rel = f"{100 * (res['val'] / base - 1):+.2f}%" if base is not None else "-"
            err = f"{res['rel_err']:.3f}" if res["rel_err"] is not None else "-"
            print(f"{r:<12} {res['val']:9.4f} {rel:>8} {err:>8} {res['ms']:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
