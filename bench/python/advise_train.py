"""Is the precision advisor right, by training? (docs/advisor.md, "Checked by training").

For each model (the GPT of examples/pytorch/train_gpt.py, and transformers' LlamaForCausalLM
from a small config, both at random init), the advisor samples --probe-steps steps of a bf16 run
after its first --probe-after steps (a short probe run, as one would before a long one) and
writes its recipe file; then the same steps from the same init on the same batches
are trained five ways, bf16 autocast on the CPU, quantized Linears through
mixprec.torch.low_precision (TE's NVFP4 recipe emulated by the core's kernels):

    bf16         no Linear quantized
    bf16 seed+1  the same, another batch order: the run-to-run noise of the validation loss
    nvfp4        every nn.Linear NVFP4, the LM head included
    static       Megatron's rule: the first and the last transformer block and the LM head in
                 bf16, every other Linear NVFP4
    advisor      the advisor's recipe file, as written (low_precision(model, recipe=FILE)):
                 every candidate, the default budget and cost model
    advisor b/n  the same with the static rule's menu only (candidates bf16, nvfp4): which
                 Linears it keeps in bf16

and the script prints the validation loss of each (the mean over --val-windows fixed validation
windows, consecutive from the split's start)
and two modeled costs against all-bf16: the advisor's default cost model at the shapes it
sampled (these layers are small: memory-bound), and the same rates compute-bound (FLOPs only:
what the ranking becomes for large layers). A benchmark, not a test: about five minutes of
CPU for both models.

    build/py-venv/bin/python bench/python/advise_train.py [--steps 100] [--models gpt,llama]
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

REPO = pathlib.Path(__file__).resolve().parents[2]


def example_gpt(vocab: int, a: argparse.Namespace) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "pytorch" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.Gpt(vocab, a.context, a.layers, a.channels, 4)


class Llama(torch.nn.Module):
    """transformers' LlamaForCausalLM at random init (untied LM head), returning the logits."""

    def __init__(self, vocab: int, a: argparse.Namespace) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=a.channels, intermediate_size=3 * a.channels,
                          num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=a.context, tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        self.m = LlamaForCausalLM(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=idx, use_cache=False).logits


def linears(model: torch.nn.Module) -> list:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def block_of(name: str) -> int | None:
    """The transformer block a Linear belongs to ("blocks.3.fc", "m.model.layers.3.mlp.up_proj")."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("blocks", "layers") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def static_rule(names: list, layers: int) -> dict:
    """Megatron's --first-last-layers-bf16 (one block at each end), the output layer in bf16."""
    out = {}
    for n in names:
        b = block_of(n)
        out[n] = "nvfp4" if b is not None and 0 < b < layers - 1 else "bf16"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--probe-steps", type=int, default=8, help="steps the advisor samples")
    p.add_argument("--probe-after", type=int, default=50, help="bf16 steps of the probe run before it samples")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-windows", type=int, default=32, help="validation windows of --context tokens")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    data = mixprec.data.corpus(tokens=200_000, context=a.context)
    # Fixed validation windows (the example's evaluate(): consecutive windows of the split).
    val = [(torch.from_numpy(data.validation[w:w + a.context].astype(np.int64))[None],
            torch.from_numpy(data.validation[w + 1:w + a.context + 1].astype(np.int64))[None])
           for w in range(0, a.val_windows * a.context, a.context)]
    build = {"gpt": example_gpt, "llama": Llama}
    results = {}
    for name in a.models.split(","):
        torch.manual_seed(a.seed)
        init = build[name](data.vocab_size, a)
        names = linears(init)

        def train(model: torch.nn.Module, steps: int, seed: int, after_step=None):
            opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
            rng = np.random.default_rng(seed)
            batches = iter(lambda: [torch.from_numpy(v) for v in mixprec.data.batch(data.train, a.batch, a.context, rng)],
                           None)

            def step() -> float:
                x, y = next(batches)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                return loss.item()
            return step

        def evaluate(model: torch.nn.Module) -> float:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                losses = [F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item() for x, y in val]
            model.train()
            return float(np.mean(losses))

        # The advisor: the first probe steps of a bf16 run, the default budget; every candidate,
        # and the static rule's menu (bf16, nvfp4).
        with tempfile.TemporaryDirectory() as tmp:
            print(f"== {name}: {sum(q.numel() for q in init.parameters())} parameters, {len(names)} Linears")
            recipe_paths, advices = {}, {}
            warm = copy.deepcopy(init)
            warm_step = train(warm, a.probe_after, a.seed + 100)
            for _ in range(a.probe_after):
                warm_step()
            for label, candidates in (("advisor", None), ("advisor b/n", ["bf16", "nvfp4"])):
                recipe_paths[label] = pathlib.Path(tmp) / f"recipe-{len(recipe_paths)}.json"
                probe = copy.deepcopy(warm)
                t0 = time.perf_counter()
                advices[label] = mt.advise(probe, train(probe, a.probe_steps, a.seed), steps=a.probe_steps,
                                           candidates=candidates, out=recipe_paths[label])
                print(f"{label}: {a.probe_steps} sampled bf16 steps after {a.probe_after}, "
                      f"{time.perf_counter() - t0:.1f} s")
                print(advices[label].table())
            advice = advices["advisor"]
            cost = {l["layer"]: {c: v["cost"] for c, v in l["candidates"].items()} for l in advice.layers}
            rates = {c: r["tflops"] for c, r in advice.data["config"]["cost"]["candidates"].items()}
            flops = {l["layer"]: 6.0 * l["tokens"] * l["in"] * l["out"] for l in advice.layers}

            assignments = {
                "bf16": ({n: "bf16" for n in names}, a.seed),
                "bf16 seed+1": ({n: "bf16" for n in names}, a.seed + 1),
                "nvfp4": ({n: "nvfp4" for n in names}, a.seed),
                "static": (static_rule(names, a.layers), a.seed),
                "advisor": ("advisor", a.seed),  # the file, read by low_precision
                "advisor b/n": ("advisor b/n", a.seed),
            }
            rows = {}
            for label, (assign, seed) in assignments.items():
                model = copy.deepcopy(init)
                if isinstance(assign, str):
                    path = recipe_paths[assign]
                    mt.low_precision(model, recipe=str(path))
                    recipe = json.loads(path.read_text())
                    assign = {n: recipe["modules"].get(n, recipe["default"]) for n in names}
                elif any(v != "bf16" for v in assign.values()):
                    mt.low_precision(model, assign)
                step = train(model, a.steps, seed)
                t0 = time.perf_counter()
                losses = [step() for _ in range(a.steps)]
                seconds = time.perf_counter() - t0
                modeled = sum(cost[n][assign[n]] for n in names) / sum(cost[n]["bf16"] for n in names)
                compute = (sum(flops[n] / rates[assign[n]] for n in names) /
                           sum(flops[n] / rates["bf16"] for n in names))
                v = evaluate(model)
                rows[label] = {"val_loss": v, "train_loss_last10": float(np.mean(losses[-10:])), "cost": modeled, "cost_compute_bound": compute,
                               "assignment": assign,
                               "quantized": sum(x != "bf16" for x in assign.values()), "seconds": seconds,
                               "finite": all(math.isfinite(x) for x in losses)}
                print(f"{label:12s} val {v:.4f}  ({v - rows['bf16']['val_loss']:+.4f} vs bf16)  modeled cost "
                      f"{modeled:.3f}x bf16 (compute-bound {compute:.3f}x)  {rows[label]['quantized']}/{len(names)} Linears quantized  "
                      f"{seconds:.0f} s", flush=True)
            results[name] = {"runs": rows}
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
