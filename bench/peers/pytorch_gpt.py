#!/usr/bin/env python3
"""Peer comparison (optional, never run in CI): the default mixprec `gpt` trained in
PyTorch on the CPU, against `mixprec train` on the same machine, in the same run.

Both sides train the same architecture (GPT-2 blocks, pre-norm, tied embeddings,
GELU tanh form, 2 layers, 4 heads, 64 channels, context 64, vocab 1024, batch 16),
with AdamW, gradient accumulation and loss averaged over the effective batch. The
data differ (PyTorch gets random tokens; the step time does not depend on them).

    python3 bench/peers/pytorch_gpt.py [--mixprec build/release/tools/mixprec/mixprec]
        [--accum 4] [--steps 6] [--threads N]

Prints the median step time of each and mixprec's time over PyTorch's (below 1 means
mixprec is faster), for fp32 and for bf16 autocast vs mixprec's bf16 preset.
Needs `pip install torch` (CPU build). Exits with a message when torch is missing.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    sys.exit("pytorch_gpt.py: PyTorch is not installed (pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu); nothing to compare")

V, T, C, NH, L, B = 1024, 64, 64, 4, 2, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.lnf = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.T
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


def torch_step_ms(accum, steps, bf16):
    model = Gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, V, (accum, B, T))
    tgt = torch.randint(0, V, (accum, B, T))
    times = []
    for s in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for k in range(accum):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(idx[k], tgt[k]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if s > 0:  # the first step warms up
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def mixprec_step_ms(binary, accum, steps, precision):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "summary.json")
        subprocess.run([binary, "train", "--precision", precision, "--loss-scale", "none",
                        "--accum", str(accum), "--steps", str(steps + 1), "--warmup", "0",
                        "--corpus-tokens", "200000", "--eval-windows", "16", "--json", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["median_step_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mixprec", default="build/release/tools/mixprec/mixprec")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads; gpt {L}x{C}, T={T}, V={V}, "
          f"B={B}, {a.accum} micro-batches per step, median of {a.steps} steps")
    for precision, bf16 in (("fp32", False), ("bf16", True)):
        ours = mixprec_step_ms(a.mixprec, a.accum, a.steps, precision)
        theirs = torch_step_ms(a.accum, a.steps, bf16)
        print(f"{precision:5}: mixprec {ours:8.1f} ms/step, PyTorch {theirs:8.1f} ms/step, "
              f"mixprec/PyTorch = {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
