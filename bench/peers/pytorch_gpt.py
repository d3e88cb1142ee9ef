#!/usr/bin/env python3
"""Peer comparison: mixprec's `gpt` trained by `mixprec train` against the same model in
PyTorch eager mode on the CPU, on the same machine, interleaved in one run (`make
bench-peers`; docs/performance.md, "Against PyTorch").

Both sides train the same architecture (GPT-2 blocks, pre-norm, tied embeddings, GELU
tanh form, vocabulary 1024), the same batch and accumulation, with AdamW and clipping at
1.0. fp32 is plain; bf16 is `torch.autocast('cpu', torch.bfloat16)` against mixprec's
bf16 preset (no loss scaling on either side); fp16 is fp16 autocast with
`torch.amp.GradScaler('cpu')` against mixprec's fp16 preset (dynamic loss scaling). The
data differ (PyTorch gets random tokens; the step time does not depend on them).

    python3 bench/peers/pytorch_gpt.py [--mixprec build/release/tools/mixprec/mixprec]
        [--models default,3.45M] [--precisions fp32,bf16,fp16] [--threads 1,0] [--steps 6]
        [--rounds 2]

--threads 0 = all cores. Each (model, precision, threads) cell runs mixprec and PyTorch
alternately --rounds times; each run's figure is its median step time over --steps steps
after one warm-up step; the cell reports the median of each side's runs and their ratio
(mixprec / PyTorch: below 1 means mixprec is faster). A benchmark, not a test: it never
fails on the ratios.
"""
import argparse
import json
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
    sys.exit("pytorch_gpt.py: PyTorch is not importable here (make bench-peers runs it from build/py-venv, "
             "where scripts/deps.sh python installs torch); nothing to compare")

V = 1024
# name: (layers, channels, heads, context, batch, accum)
MODELS = {
    "default": (2, 64, 4, 64, 16, 4),
    "3.45M": (4, 256, 4, 128, 8, 2),
}


class Block(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.c, self.nh = c, nh
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fcproj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (u.view(b, t, self.nh, c // self.nh).transpose(1, 2) for u in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, c, nh, t):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, c), nn.Embedding(t, c)
        self.blocks = nn.ModuleList(Block(c, nh) for _ in range(layers))
        self.lnf = nn.LayerNorm(c)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.T
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


def torch_step_ms(model_name, precision, steps):
    layers, c, nh, t, batch, accum = MODELS[model_name]
    torch.manual_seed(0)
    model = Gpt(layers, c, nh, t)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    idx = torch.randint(0, V, (accum, batch, t))
    tgt = torch.randint(0, V, (accum, batch, t))
    times = []
    for s in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for k in range(accum):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(idx[k], tgt[k]) / accum
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if s > 0:  # the first step warms up
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def mixprec_step_ms(binary, model_name, precision, steps, threads):
    layers, c, nh, t, batch, accum = MODELS[model_name]
    loss_scale = "dynamic" if precision == "fp16" else "none"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "summary.json")
        cmd = [binary, "train", "--precision", precision, "--loss-scale", loss_scale,
               "--layers", str(layers), "--channels", str(c), "--heads", str(nh), "--context", str(t),
               "--batch", str(batch), "--accum", str(accum), "--steps", str(steps + 1), "--warmup", "0",
               "--corpus-tokens", "200000", "--eval-windows", "16", "--histogram-every", "0",
               "--threads", str(threads), "--json", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"pytorch_gpt.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["median_step_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mixprec", default="build/release/tools/mixprec/mixprec")
    ap.add_argument("--models", default="default,3.45M")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--threads", default="1,0", help="comma-separated; 0 = all cores")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    models = a.models.split(",")
    for m in models:
        if m not in MODELS:
            sys.exit(f"pytorch_gpt.py: --models: unknown model '{m}'; allowed: {', '.join(MODELS)}")
    precisions = a.precisions.split(",")
    for p in precisions:
        if p not in ("fp32", "bf16", "fp16"):
            sys.exit(f"pytorch_gpt.py: --precisions: unknown '{p}'; allowed: fp32, bf16, fp16")
    try:
        thread_counts = [int(x) for x in a.threads.split(",")]
    except ValueError:
        sys.exit(f"pytorch_gpt.py: --threads: expected comma-separated integers, found '{a.threads}'")
    if a.steps < 1 or a.rounds < 1 or any(t < 0 for t in thread_counts):
        sys.exit("pytorch_gpt.py: --steps and --rounds must be >= 1, --threads >= 0")
    if not os.access(a.mixprec, os.X_OK):
        sys.exit(f"pytorch_gpt.py: --mixprec: '{a.mixprec}' is not an executable (build it: make release)")
    cores = os.cpu_count() or 1
    print(f"PyTorch {torch.__version__} (eager, fused AdamW) vs mixprec train; {cores} cores; "
          f"median step of {a.steps} steps after 1 warm-up, {a.rounds} alternating runs per cell")
    print(f"{'model':8} {'threads':>7} {'precision':9} {'mixprec ms':>11} {'PyTorch ms':>11} {'mixprec/PyTorch':>16}")
    for m in models:
        for threads in thread_counts:
            n = threads or cores
            torch.set_num_threads(n)
            for p in precisions:
                ours, theirs = [], []
                for _ in range(a.rounds):
                    ours.append(mixprec_step_ms(a.mixprec, m, p, a.steps, n))
                    theirs.append(torch_step_ms(m, p, a.steps))
                o, t = statistics.median(ours), statistics.median(theirs)
                print(f"{m:8} {n:>7} {p:9} {o:11.1f} {t:11.1f} {o / t:16.2f}", flush=True)


if __name__ == "__main__":
    main()
