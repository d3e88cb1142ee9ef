"""A small GPT trained in PyTorch with fp16 autocast on the CPU, with mixprec's GradScaler and
Telemetry, ending with `mixprec report` (docs/python.md, "examples/pytorch").

    python examples/pytorch/train_gpt.py --steps 200 --out runs/pytorch-gpt
    python examples/pytorch/train_gpt.py --scaler torch          # the same loop on torch.amp.GradScaler

The data is mixprec's embedded corpus (mixprec.data.corpus: the text, vocabulary and split of
`mixprec train`). The model: pre-norm GPT-2 blocks, tied embeddings, GELU (tanh). The loop is
PyTorch's AMP recipe; the mixprec lines are marked "mixprec:".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import mixprec
import mixprec.torch


class Block(nn.Module):
    def __init__(self, c: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.gelu, self.fcproj = nn.Linear(c, 4 * c), nn.GELU(approximate="tanh"), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (u.view(b, t, self.heads, c // self.heads).transpose(1, 2) for u in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fcproj(self.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab: int, context: int, layers: int, c: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(context, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.lnf(x))


def steps_list(text: str) -> list:
    try:
        return sorted({int(s) for s in text.split(",") if s})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers separated by commas, found {text!r}")


def positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {text!r}")
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive, default=200)
    p.add_argument("--out", default="runs/pytorch-gpt", help="the run folder (must not hold a run)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--scaler", choices=("mixprec", "torch"), default="mixprec",
                   help="mixprec.torch.GradScaler (with Telemetry) or torch.amp.GradScaler (without)")
    p.add_argument("--preset", default="torch", help="the mixprec loss-scale preset (mixprec.preset_names())")
    p.add_argument("--batch", type=positive, default=8)
    p.add_argument("--context", type=positive, default=64)
    p.add_argument("--accum", type=positive, default=2, help="micro-batches per optimizer step")
    p.add_argument("--layers", type=positive, default=2)
    p.add_argument("--channels", type=positive, default=64)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=positive, default=50)
    p.add_argument("--log-every", type=positive, default=10)
    p.add_argument("--sample-every", type=positive, default=4, help="Telemetry: count activation gradients every N steps")
    p.add_argument("--inject-overflow-at", type=steps_list, default=[],
                   help="steps whose fc gradient of the last block is set to inf (the scaler skips them)")
    p.add_argument("--threads", type=positive, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.channels % a.heads:
        p.error(f"--channels {a.channels} must be a multiple of --heads {a.heads}")
    if a.preset not in mixprec.preset_names():
        p.error(f"--preset {a.preset!r} is not a preset; allowed: {', '.join(mixprec.preset_names())}")
    if any(s < 1 or s > a.steps for s in a.inject_overflow_at):
        p.error(f"--inject-overflow-at: steps must lie in 1..{a.steps}")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)

    data = mixprec.data.corpus(tokens=200_000, context=a.context)
    model = Gpt(data.vocab_size, a.context, a.layers, a.channels, a.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[a.precision]
    scaling = a.precision == "fp16"

    if a.scaler == "torch":
        scaler = torch.amp.GradScaler("cpu", enabled=scaling)
        tel = None
    else:
        # mixprec: the one line that switches the scaler (same methods; step() says what it did).
        scaler = mixprec.torch.GradScaler("cpu", preset=a.preset, enabled=scaling)
        scaler.set_names(model)
        if a.preset == "layerwise" and scaling:
            scaler.watch(model)  # mixprec: per-layer loss scaling on the Linear layers (docs/loss_scaling.md)
        # mixprec: the run folder `mixprec report` reads.
        tel = mixprec.torch.Telemetry(model, out=a.out, precision=a.precision, scaler=scaler,
                                      sample_every=a.sample_every)
    print(f"data: {data.source}, vocabulary {data.vocab_size}, {data.train.size} training tokens")
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters; {a.precision} autocast, "
          f"scaler {a.scaler}" + (f" (preset {a.preset})" if a.scaler == "mixprec" else ""))

    def evaluate() -> float:
        model.eval()
        losses = []
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            for w in range(0, min(data.validation.size - a.context - 1, 8 * a.batch * a.context), a.context):
                x = torch.from_numpy(data.validation[w:w + a.context].astype(np.int64))[None]
                y = torch.from_numpy(data.validation[w + 1:w + a.context + 1].astype(np.int64))[None]
                losses.append(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item())
        model.train()
        return float(np.mean(losses))

    skipped, t_start = 0, time.perf_counter()
    step_ms = []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for _ in range(a.accum):
            x, y = (torch.from_numpy(v) for v in mixprec.data.batch(data.train, a.batch, a.context, rng))
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / a.accum
            scaler.scale(loss).backward()
            loss_sum += loss.item()
        if step in a.inject_overflow_at:
            with torch.no_grad():
                model.blocks[-1].fc.weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        clip_coef = min(1.0, a.clip / (float(norm) + 1e-6)) if math.isfinite(norm) else 1.0
        outcome = scaler.step(opt)
        lr = sched.get_last_lr()[0]
        ms = 1000 * (time.perf_counter() - t0)
        val = evaluate() if step % a.eval_every == 0 or step == a.steps else None
        if tel is not None:
            # mixprec: one log line (before update(): the scale the update leaves is computed here).
            tel.record(outcome, loss=loss_sum, lr=lr, tokens=a.accum * a.batch * a.context,
                       seconds=ms / 1000, val_loss=val, clip_coef=clip_coef)
        scale_before = scaler.get_scale()
        scaler.update()
        opt.zero_grad(set_to_none=True)
        # torch.amp.GradScaler.step() does not say whether it skipped; the usual guess is a scale
        # that went down. mixprec's step() says so.
        applied = outcome.applied if tel is not None else scaler.get_scale() >= scale_before
        if applied:
            sched.step()  # only after applied steps: no "lr_scheduler.step() before optimizer.step()"
        else:
            skipped += 1
        step_ms.append(ms)
        if tel is not None and not outcome.applied:
            print(f"step {step}: skipped, inf/NaN in the gradient of {outcome.first_overflow_name}; "
                  f"scale {outcome.scale:g} -> {scaler.get_scale():g}")
        if tel is not None and outcome.skipped_layers:
            print(f"step {step}: applied, except the layers {', '.join(outcome.skipped_layers)} (per-layer scaling)")
        if step % a.log_every == 0 or step == a.steps or val is not None:
            print(f"step {step:5d}  loss {loss_sum:.4f}" + (f"  val {val:.4f}" if val is not None else "")
                  + f"  scale {scaler.get_scale():g}  {ms:.1f} ms")
    total = time.perf_counter() - t_start
    median = float(np.median(step_ms))
    print(f"done: {a.steps} steps, {skipped} skipped, median step {median:.1f} ms, {total:.1f} s")
    if tel is not None:
        share = tel.seconds() / max(1e-9, sum(step_ms) / 1000)
        alerts = tel.close()
        print(f"telemetry: {1000 * tel.seconds() / a.steps:.2f} ms per step, {100 * share:.1f}% of the step "
              f"(sample every {a.sample_every})")
        for al in alerts:
            print(f"alert {al['id']} at step {al['step']}: {al['message']}")
        # mixprec: the report of the run (what `mixprec report RUN_DIR` writes).
        print(f"report: {mixprec.report(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
