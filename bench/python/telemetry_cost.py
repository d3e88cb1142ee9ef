"""What mixprec.torch.Telemetry costs a PyTorch step (docs/performance.md, "Telemetry's cost").

The model (default: the transformers GPT-2 configuration of issue 31, 2 layers, 128 channels,
4 heads, the embedded corpus' 1024-word vocabulary, context 64; `--model example` is
examples/pytorch/train_gpt.py's GPT) trained by a plain loop: autocast (bf16 by default, or
fp16), 2 micro-batches, clipping at 1.0, AdamW; with `--scaler torch` mixprec's GradScaler
(preset torch) scales, unscales and steps (the default for fp16), with `--scaler none` the
optimizer steps directly (the default for bf16, as bf16 is usually trained).

Each round runs every variant for `--steps` steps (after one warm-up step): no Telemetry,
Telemetry at the default sampling (every 4th step), at every step, and (with `--device-path`) at
every step through the torch-operations path a GPU runs. By default (`--interleave step`) each
variant has its own model and their steps alternate, in an order rotated at every step, so that
the machine's drift (large on shared virtual machines) falls on all alike; `--interleave run`
runs each variant's steps back to back, the variants in an order rotated per round. A variant's step
time is its median over the steps of a round; its cost is the median over rounds of its ratio
to the no-Telemetry time of the same round (paired), printed with the lowest and highest round
ratio, as the machine's noise is of the size of the effect. With `--low-precision RECIPE` every
variant's model runs mixprec.torch.low_precision(model, RECIPE) (every Linear but the first and
the last) and the default-sampling variant is timed with the per-block statistics on and off
(`block_stats=False`), and with `--what-if R,...` once more with those what-ifs: the rows'
difference over the no-Telemetry step is what the statistics cost, taken from the rounds' mean step
times and Telemetry's own time (they are paid at the sampled steps only, which the median step
leaves out). Wall time and the process's CPU time
are both taken: on a machine whose cores other processes share, CPU time leaves out the time the
process waited for a core (it keeps their effect on the caches). "own ms" is the wall time
Telemetry itself measured in its hooks and record() per step (tel.seconds()). A benchmark, not a
test.

    build/py-venv/bin/python bench/python/telemetry_cost.py [--rounds 9] [--steps 12] [--threads 1]
        [--model gpt2|example] [--dtype bf16|fp16] [--scaler none|torch] [--device cpu|cuda]
        [--device-path] [--interleave step|run] [--low-precision mxfp8] [--what-if nvfp4]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import mixprec
import mixprec.torch

REPO = pathlib.Path(__file__).resolve().parents[2]


def example_model(vocab: int, args):
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "pytorch" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.Gpt(vocab, args.context, args.layers, args.channels, 4)
    return model, lambda x, y: F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def gpt2_model(vocab: int, args):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=vocab, n_positions=args.context, n_embd=args.channels, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    # Next-token loss on the batch's targets (the model's own shift would drop a position).
    return model, lambda x, y: F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten())


def variants(args):
    if args.low_precision:
        # The per-block statistics on and off at the default sampling (and the what-ifs).
        v = {"none": None, "default, block stats off": dict(block_stats=False), "default (sample every 4)": dict()}
        if args.what_if:
            v["default + what-if " + ",".join(args.what_if)] = dict(what_if=args.what_if)
        return v
    v = {"none": None, "default (sample every 4)": dict(), "every step": dict(sample_every=1)}
    if args.device_path:
        v["every step, torch ops path"] = dict(sample_every=1, counting="torch")
    return v


class Trainer:
    """One variant's model, optimizer, scaler and Telemetry, stepped one timed step at a time."""

    def __init__(self, kw, data, args, tmp) -> None:
        torch.manual_seed(0)
        self.rng = np.random.default_rng(0)
        self.data, self.args = data, args
        build = gpt2_model if args.model == "gpt2" else example_model
        self.model, self.loss_of = build(data.vocab_size, args)
        self.model.to(args.device)
        if args.low_precision:
            mixprec.torch.low_precision(self.model, args.low_precision)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.scaler = None
        if args.scaler == "torch":
            self.scaler = mixprec.torch.GradScaler(args.device, preset="torch")
            self.scaler.set_names(self.model)
        self.tel = None
        if kw is not None:
            self.tel = mixprec.torch.Telemetry(self.model, tempfile.mkdtemp(dir=tmp), precision=args.dtype,
                                               scaler=self.scaler, **kw)

    def step(self):
        """One step: (wall s, the process's CPU s, Telemetry's own s)."""
        args, scaler, tel = self.args, self.scaler, self.tel
        if args.device == "cuda":
            torch.cuda.synchronize()
        own0 = tel.seconds() if tel is not None else 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        loss_sum = 0.0
        for _ in range(2):
            x, y = (torch.from_numpy(v.astype(np.int64)).to(args.device)
                    for v in mixprec.data.batch(self.data.train, args.batch, args.context, self.rng))
            with torch.autocast(args.device, dtype=self.dtype, enabled=args.dtype != "fp32"):
                loss = self.loss_of(x, y) / 2
            (loss if scaler is None else scaler.scale(loss)).backward()
            loss_sum += loss.item()
        if scaler is not None:
            scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if scaler is not None:
            out = scaler.step(self.opt)
        else:
            self.opt.step()
            out = None
        if tel is not None:
            tel.record(out, loss=loss_sum)
        if scaler is not None:
            scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, cpu, (tel.seconds() if tel is not None else 0.0) - own0

    def close(self) -> None:
        if self.tel is not None:
            self.tel.close()


def round_of(table, order, data, args, tmp):
    """One round: per variant, the median wall and CPU time of its steps and its own time per step.
    --interleave step: every variant's trainer is made first, then their steps alternate (a
    variant's step follows the others' in rotated order, so the machine's drift falls on all
    alike); --interleave run: each variant runs its steps back to back."""
    times = {n: [] for n in order}
    if args.interleave == "step":
        trainers = {n: Trainer(table[n], data, args, tmp) for n in order}
        for n in order:  # one warm-up step each
            trainers[n].step()
        for i in range(args.steps):
            k = i % len(order)
            for n in order[k:] + order[:k]:
                times[n].append(trainers[n].step())
        for t in trainers.values():
            t.close()
    else:
        for n in order:
            t = Trainer(table[n], data, args, tmp)
            t.step()
            times[n] = [t.step() for _ in range(args.steps)]
            t.close()
    return {n: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), sum(x[2] for x in v) / len(v),
                sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v))
            for n, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", choices=("gpt2", "example"), default="gpt2")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="the autocast dtype (fp32: no autocast); a CPU without AVX512-BF16 runs bf16 GEMMs "
                        "emulated, 100x slower: there fp32 is the step of the same length")
    p.add_argument("--scaler", choices=("none", "torch"), default=None,
                   help="default: none for bf16, torch (mixprec.torch.GradScaler) for fp16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--device-path", action="store_true", help="also time counting='torch' (the GPU's path)")
    p.add_argument("--interleave", choices=("step", "run"), default="step",
                   help="step: the variants' steps alternate within a round (default); run: each variant's "
                        "steps back to back, the variants in rotated order")
    p.add_argument("--low-precision", default=None, metavar="RECIPE",
                   help="every variant's model through mixprec.torch.low_precision(model, RECIPE); the variants "
                        "are then the per-block statistics off and on at the default sampling")
    p.add_argument("--what-if", default="", help="with --low-precision: a variant with Telemetry(what_if=these)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--channels", type=int, default=128)
    args = p.parse_args()
    args.what_if = [r for r in args.what_if.split(",") if r]
    if args.scaler is None:
        args.scaler = "torch" if args.dtype == "fp16" else "none"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("telemetry_cost: --device cuda, but torch.cuda.is_available() is false", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    data = mixprec.data.corpus(tokens=200_000, context=args.context)
    table = variants(args)
    names = list(table)
    per = {n: [] for n in names}
    per_cpu = {n: [] for n in names}  # the process's CPU time per step (what other processes' load leaves alone)
    own = {n: [] for n in names}  # tel.seconds() per step: the hooks' and record()'s own time
    # Mean step times per round: a cost paid at the sampled steps only (1 in 4) is in the mean,
    # where the median step is an unsampled one.
    mean_wall = {n: [] for n in names}
    mean_cpu = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n, (step_s, cpu_s, tel_s, mwall, mcpu) in round_of(table, order, data, args, tmp).items():
                per[n].append(step_s)
                per_cpu[n].append(cpu_s)
                own[n].append(tel_s)
                mean_wall[n].append(mwall)
                mean_cpu[n].append(mcpu)
    print(f"model: {args.model}, {args.layers} layers, {args.channels} channels, context {args.context}, batch "
          f"{args.batch} x 2 micro-batches, {args.dtype} autocast on {args.device}, scaler {args.scaler}, "
          f"{args.threads} thread(s); {args.rounds} rounds of {args.steps} steps, interleaved by {args.interleave}"
          + (f"; low_precision {args.low_precision}" if args.low_precision else ""))
    print(f"{'variant':30s} {'wall ms':>8s} {'paired':>7s} {'min':>6s} {'max':>6s} {'cpu ms':>8s} {'paired':>7s} "
          f"{'min':>6s} {'max':>6s} {'own ms':>7s}")
    for n in names:
        wall = [a / b for a, b in zip(per[n], per["none"])]
        cpu = [a / b for a, b in zip(per_cpu[n], per_cpu["none"])]
        print(f"{n:30s} {1000 * statistics.median(per[n]):8.2f} {statistics.median(wall):7.3f} {min(wall):6.3f} "
              f"{max(wall):6.3f} {1000 * statistics.median(per_cpu[n]):8.2f} {statistics.median(cpu):7.3f} "
              f"{min(cpu):6.3f} {max(cpu):6.3f} {1000 * statistics.median(own[n]):7.3f}")
    if args.low_precision:
        # What the statistics add, as a share of the step without Telemetry, from the rounds' mean
        # step times (the statistics are paid at the sampled steps) and from Telemetry's own time
        # (record() computes them), each paired per round; median over rounds (lowest, highest).
        off = "default, block stats off"
        for n in names[2:]:
            for label, t in (("mean wall", mean_wall), ("mean cpu", mean_cpu), ("own", own)):
                base = mean_wall["none"] if label != "mean cpu" else mean_cpu["none"]
                extra = [(a - b) / c for a, b, c in zip(t[n], t[off], base)]
                print(f"{n} vs {off}: {label} +{100 * statistics.median(extra):.2f}% of the step "
                      f"({100 * min(extra):.2f}% .. {100 * max(extra):.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
