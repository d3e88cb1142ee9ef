"""Does switching the forward to bf16 late in an NVFP4 run close the gap to bf16? (docs/low_precision.md,
"Recipes in time: the NVFP4 late switch, at our scale").

The NVFP4 pretraining paper (arXiv 2509.25149, Appendix D) switched only the forward GEMMs to
BF16 shortly before learning-rate decay and cut the relative loss error from about 1.5% to
0.5% with about 6% of the compute in high precision; switching only the backward gave no
benefit. This script trains, from the same random init on the same batches (paired runs),
with a warm-up, stable, decay learning rate (the decay over the last --decay fraction):

    bf16          no Linear quantized (bf16 autocast on the CPU)
    bf16 batches+1   the same with another batch order: the run-to-run noise
    nvfp4         every nn.Linear NVFP4 (TE's recipe: 16x16 weight tiles, RHT on the wgrad
                  operands, stochastic rounding of dy), the LM head included
    nvfp4 fwd->bf16  the same recipe file with a schedule: from the start of the decay the
                  forward GEMM (fprop) of every Linear in high precision
    nvfp4 bwd->bf16  the same, the two backward GEMMs (dgrad, wgrad) instead

through mixprec.torch.low_precision and one recipe file per run (its "schedule"), advanced by
mixprec.torch.low_precision_step every step. The models: the GPT of examples/pytorch/train_gpt.py
and transformers' LlamaForCausalLM from a small config, both at random init. It prints the
validation loss of each run (the trained weights evaluated in bf16: the same evaluation for
every run) and its relative error against bf16, and the share of the GEMM FLOPs each run
spent in high precision. A benchmark, not a test.

    build/py-venv/bin/python bench/python/recipe_schedule_train.py [--steps 400] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import pathlib
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import mixprec
import mixprec.torch as mt

def _advise_train():
    """The two models of advise_train.py (the example GPT and a small transformers Llama)."""
    spec = importlib.util.spec_from_file_location("advise_train", pathlib.Path(__file__).with_name("advise_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe(switch: str | None, decay: float) -> dict:
    """All-NVFP4, with a late switch of one direction to high precision from the decay's start."""
    doc = {"format": "mixprec.low_precision", "version": 1, "default": "nvfp4", "modules": {}}
    if switch == "fwd":
        doc["schedule"] = [{"from_fraction": 1.0 - decay, "fprop": "bf16", "label": "forward to bf16"}]
    elif switch == "bwd":
        doc["schedule"] = [{"from_fraction": 1.0 - decay, "dgrad": "bf16", "wgrad": "bf16",
                            "label": "backward to bf16"}]
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--decay", type=float, default=0.2, help="the fraction of the run the learning rate decays over")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--val-windows", type=int, default=256, help="validation windows of --context tokens")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    data = mixprec.data.corpus(tokens=200_000, context=a.context)
    val = [(torch.from_numpy(data.validation[w:w + a.context].astype(np.int64))[None],
            torch.from_numpy(data.validation[w + 1:w + a.context + 1].astype(np.int64))[None])
           for w in range(0, a.val_windows * a.context, a.context)]
    models = _advise_train()
    build = {"gpt": models.example_gpt, "llama": models.Llama}
    warm, stable_end = 20, int(round(a.steps * (1.0 - a.decay)))

    def lr_at(s: int) -> float:  # warm-up, stable, linear decay to 0 (WSD)
        if s < warm:
            return (s + 1) / warm
        if s < stable_end:
            return 1.0
        return max(0.0, (a.steps - s) / (a.steps - stable_end))

    def evaluate(model: torch.nn.Module) -> float:
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item() for x, y in val]
        model.train()
        return float(np.mean(losses))

    results = {}
    runs = {"bf16": None, "bf16 batches+1": None, "nvfp4": "none", "nvfp4 fwd->bf16": "fwd", "nvfp4 bwd->bf16": "bwd"}
    # Share of the GEMM FLOPs in high precision: each of fprop, dgrad, wgrad is a third.
    high_share = {"bf16": 1.0, "bf16 batches+1": 1.0, "nvfp4": 0.0, "nvfp4 fwd->bf16": a.decay / 3, "nvfp4 bwd->bf16": 2 * a.decay / 3}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            results[name] = {}
            for seed in [int(s) for s in a.seeds.split(",")]:
                torch.manual_seed(seed)
                init = build[name](data.vocab_size, a)
                plain_state = copy.deepcopy(init.state_dict())
                rows = {}
                for label, switch in runs.items():
                    model = copy.deepcopy(init)
                    if switch is not None:
                        path = pathlib.Path(tmp) / f"{name}-{seed}-{switch}.json"
                        path.write_text(json.dumps(recipe(None if switch == "none" else switch, a.decay)))
                        mt.low_precision(model, path, total_steps=a.steps)
                    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
                    # "bf16 batches+1": another batch order, how far two equally good runs end apart.
                    rng = np.random.default_rng(seed + (1000 if label == "bf16 batches+1" else 0))
                    switches = []
                    t0 = time.perf_counter()
                    losses = []
                    for s in range(a.steps):
                        if switch is not None:
                            switches += [(s, sw["phase"]) for sw in mt.low_precision_step(model, s)]
                        for g in opt.param_groups:
                            g["lr"] = a.lr * lr_at(s)
                        x, y = [torch.from_numpy(v) for v in mixprec.data.batch(data.train, a.batch, a.context, rng)]
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        losses.append(loss.item())
                    seconds = time.perf_counter() - t0
                    # The trained weights in a plain model: every run evaluated alike (bf16 autocast).
                    plain = copy.deepcopy(init)
                    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain_state})
                    v = evaluate(plain)
                    first = sorted({s for s, _ in switches})
                    rows[label] = {"val_loss": v, "train_loss_last10": float(np.mean(losses[-10:])), "seconds": seconds,
                                   "switch_step": first[0] if first else None, "finite": all(map(math.isfinite, losses))}
                    rel = (v - rows["bf16"]["val_loss"]) / rows["bf16"]["val_loss"] * 100
                    print(f"{name} seed {seed} {label:16s} val {v:.4f} ({rel:+.2f}% vs bf16)  high-precision GEMM share "
                          f"{high_share[label]:.3f}  switch at step {rows[label]['switch_step']}  {seconds:.0f} s",
                          flush=True)
                results[name][seed] = rows
            for label in runs:
                rel = [(results[name][s][label]["val_loss"] - results[name][s]["bf16"]["val_loss"]) /
                       results[name][s]["bf16"]["val_loss"] * 100 for s in results[name]]
                print(f"{name} {label:16s} mean relative error vs bf16 {np.mean(rel):+.2f}% "
                      f"({', '.join(f'{r:+.2f}' for r in rel)})", flush=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
