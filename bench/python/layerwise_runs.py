"""Per-layer loss scaling against one scale, by training (docs/loss_scaling.md, "Results:
per-layer scaling against one scale"). Not a test: minutes of training.

Engine: `mixprec train` (the default GPT, fp16, `--accum 2` instead of 32, one thread) with an overflow injected into one layer's
weight gradient (h1.mlp.fc.weight) every `--every` steps, `--loss-scale dynamic` (one scale,
the mixprec preset) against `--loss-scale layerwise`, for each seed. PyTorch: the example GPT
(examples/pytorch/train_gpt.py: fp16 autocast, the last block's fc weight gradient set to inf
at the same steps), preset mixprec against preset layerwise. Each run's skipped steps, the
fraction of nonzero activation gradients flushed to zero (the run's summary.json), and the final
validation loss; the seeds' spread is the noise.

    build/py-venv/bin/python bench/python/layerwise_runs.py --mixprec build/release/tools/mixprec/mixprec \
        [--steps 120] [--accum 2] [--every 10] [--seeds 1,2,3] [--torch-steps 200] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]


def summary(run: pathlib.Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    # The Linear layers' output gradients (fp16 under autocast, stored as they are): the fraction
    # of their elements that are zero, i.e. flushed by the op that produced them (Telemetry's
    # underflow count sees only what fp16 would flush of fp32 gradients).
    zeros = elements = 0
    for line in (run / "log.jsonl").read_text().splitlines():
        for t in json.loads(line).get("act_grad_tensors", []):
            if re.fullmatch(r"blocks\.\d+\.(qkv|proj|fc|fcproj)", t["name"]):
                zeros += t["elements"] - t["nonzero"]
                elements += t["elements"]
    s["linear_zero_fraction"] = zeros / elements if elements else float("nan")
    # The last validation loss logged (a Telemetry run's summary leaves val_loss to the engine).
    vals = [v for v in (json.loads(line).get("val_loss") for line in (run / "log.jsonl").read_text().splitlines())
            if v is not None]
    s["val_loss"] = vals[-1] if vals else float("nan")
    return s


def engine(binary: str, scale: str, seed: int, steps: int, accum: int, at: str, out: pathlib.Path) -> dict:
    cmd = [binary, "train", "--precision", "fp16", "--loss-scale", scale, "--seed", str(seed), "--steps", str(steps),
           "--accum", str(accum), "--threads", "1",
           "--inject-overflow-at", at, "--inject-overflow-tensor", "h1.mlp.fc.weight", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return summary(out)


def pytorch(preset: str, seed: int, steps: int, at: str, out: pathlib.Path) -> dict:
    cmd = [sys.executable, str(REPO / "examples" / "pytorch" / "train_gpt.py"), "--steps", str(steps), "--preset",
           preset, "--seed", str(seed), "--inject-overflow-at", at, "--out", str(out), "--log-every", "1000",
           "--threads", "1"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return summary(out)


def fmt(v, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


def row(kind: str, scale: str, seed: int, s: dict) -> str:
    return (f"| {kind} | {scale} | {seed} | {s['steps']} | {s['skipped']} | {fmt(s['underflow_fraction'], '.3e')} | "
            f"{fmt(s['linear_zero_fraction'], '.3e')} | {fmt(s['val_loss'], '.4f')} | {s['final_scale']:g} |")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mixprec", default=str(REPO / "build" / "release" / "tools" / "mixprec" / "mixprec"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--accum", type=int, default=2, help="engine micro-batches per step (the default 32 takes hours "
                   "on a shared machine)")
    p.add_argument("--torch-steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--keep", default=None, help="keep the run folders under this (new) folder")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    print("| door | loss scale | seed | steps | skipped | flushed act. grads | zero Linear-output grads | val loss | "
          "final scale |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(a.keep or tmp)
        t.mkdir(parents=True, exist_ok=True)
        if not a.skip_engine:
            at = ",".join(str(s) for s in range(a.every, a.steps + 1, a.every))
            for seed in seeds:
                for scale in ("dynamic", "layerwise"):
                    print(row("engine", scale, seed, engine(a.mixprec, scale, seed, a.steps, a.accum, at,
                                                          t / f"e-{scale}-{seed}")),
                          flush=True)
        if not a.skip_torch:
            at = ",".join(str(s) for s in range(a.every, a.torch_steps + 1, a.every))
            for seed in seeds:
                for preset in ("mixprec", "layerwise"):
                    print(row("pytorch", preset, seed, pytorch(preset, seed, a.torch_steps, at, t / f"p-{preset}-{seed}")),
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
