#!/usr/bin/env python3
"""Bad batches at known steps, with and without the step guards (docs/spike_guards.md).

For each precision and seed, three runs of the engine's example GPT:
  clean    no bad batch;
  bad      bad batches at known steps: random labels, a loss gradient x1000, one +inf
           gradient element; the spike guards off (the engine still skips inf/NaN: it never
           writes them into the weights);
  guarded  the same bad batches, --skip-loss-z and --skip-grad-z on.
Prints one Markdown table: the steps each run skipped (and why) and its final validation
loss, then the mean and spread over the seeds. A long comparison: a benchmark, not a test.

    python3 bench/scripts/spike_guards.py [--cli build/release/tools/mixprec/mixprec] [--seeds 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

BAD = {"labels": 120, "scaled": 180}
INF = 240
COMMON = ["--steps", "300", "--accum", "4", "--warmup", "20", "--eval-every", "0", "--eval-windows", "128",
          "--histogram-every", "0"]
GUARDS = ["--skip-window", "64", "--skip-loss-z", "5", "--skip-grad-z", "5"]


def run(cli, out, precision, seed, kind):
    args = [cli, "train", "--precision", precision, "--seed", str(seed), "--out", out] + COMMON
    if kind != "clean":
        args += ["--inject-bad-batch-at", ",".join(str(s) for s in BAD.values()),
                 "--inject-bad-batch", ",".join(BAD.keys()), "--inject-overflow-at", str(INF)]
    if kind == "guarded":
        args += GUARDS
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    skips = []
    with open(os.path.join(out, "log.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["skipped"]:
                skips.append(f"{r['step']}:{r.get('skip_reason', '?')}")
    return summary["val_loss"], skips


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default="build/release/tools/mixprec/mixprec")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--precisions", default="bf16,fp16")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in a.precisions.split(","):
            for kind in ("clean", "bad", "guarded"):
                losses, skips = [], []
                for seed in range(1, a.seeds + 1):
                    v, s = run(a.cli, os.path.join(tmp, f"{precision}-{kind}-{seed}"), precision, seed, kind)
                    losses.append(v)
                    skips.append(" ".join(s) or "none")
                    print(f"{precision} {kind} seed {seed}: val {v:.4f} skipped {skips[-1]}", file=sys.stderr)
                rows.append((precision, kind, losses, skips))
    print("| precision | run | validation loss per seed | mean | spread (max-min) | skipped steps (seed 1; all seeds) |")
    print("|---|---|---|---|---|---|")
    for precision, kind, losses, skips in rows:
        same = "same on every seed" if len(set(skips)) == 1 else "; ".join(skips)
        print(f"| {precision} | {kind} | {', '.join(f'{v:.4f}' for v in losses)} | {statistics.mean(losses):.4f} | "
              f"{max(losses) - min(losses):.4f} | {skips[0]} ({same}) |")


if __name__ == "__main__":
    main()
