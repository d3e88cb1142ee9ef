"""mixprec.torch.GradScaler under DDP and FSDP2 (`fully_shard`, DTensor gradients): 2 processes,
gloo, CPU, fp16 autocast, AdamW, clipping at 1.0. An overflow on one rank only: both ranks skip
the step and the weights are bit for bit those of the same run on torch.amp.GradScaler.
- DDP, step 2: an inf in rank 1's batch (its gradients are NaN; DDP's all-reduce carries that
  to rank 0, so torch's scaler skips there too);
- FSDP2, step 2 as DDP, and step 5: inf written into rank 0's own shard of a gradient after the
  reduce-scatter, which no other rank holds (torch.amp agrees through DTensor's found_inf
  all-reduce; mixprec through its rank hook, a MAX all-reduce of found_inf).
FSDP2's state goes through torch.distributed.checkpoint as Lightning's and Accelerate's FSDP2
paths save it (model and optimizer with get_*_state_dict, the scaler's state_dict beside them):
saved after step 4, loaded into a fresh model, optimizer and scaler, steps 5-8 again: the same
weights and scale as the run that never stopped. Rank 0's Telemetry of the FSDP2 run reads the
DTensor gradients and weights through its shards. One pair of processes runs every case."""

from __future__ import annotations

import json

import pytest
import torch

from integration_support import run_ranks, skip_without_integrations

skip_without_integrations()

RANK = r"""
import json, math, os, sys, torch, torch.distributed as dist
rank, store, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
import mixprec.torch

def build(kind, seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                              torch.nn.Linear(32, 4))
    if kind == "ddp":
        model = DistributedDataParallel(net)
    else:
        mesh = init_device_mesh("cpu", (2,))
        for i in (0, 2, 4):
            fully_shard(net[i], mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    return net, model, torch.optim.AdamW(model.parameters(), lr=1e-2)

def scaler_of(which):
    return mixprec.torch.GradScaler(growth_interval=3) if which == "mixprec" else \
        torch.amp.GradScaler("cpu", growth_interval=3)

def train(kind, net, model, opt, scaler, steps, tel=None):
    log = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 8, generator=g)
        if step == 2 and rank == 1:
            x[0, 0] = math.inf
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if kind == "fsdp2" and step == 5 and rank == 0:
            net[2].weight.grad.to_local()[1, 3] = math.inf      # this rank's shard only
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        outcome = scaler.step(opt)
        if tel is not None:
            tel.record(outcome, loss=loss.item())
        scaler.update()
        opt.zero_grad()
        log.append([step, scaler.get_scale() < before, scaler.get_scale()])
    return log

def weights(kind, net):
    return [p.full_tensor() if kind == "fsdp2" else p.detach().clone() for p in net.parameters()]

def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))

result = {}
for kind in ("ddp", "fsdp2"):
    runs = {}
    for which in ("mixprec", "torch"):
        net, model, opt = build(kind)
        scaler = scaler_of(which)
        if kind == "fsdp2" and which == "mixprec":
            scaler.set_names(net)
            # Telemetry on rank 0 (as the integrations write it): DTensor gradients and weights are
            # read through this rank's shards
            tel = mixprec.torch.Telemetry(net, out=ckpt + "-telemetry", scaler=scaler) if rank == 0 else None
            log = train(kind, net, model, opt, scaler, range(1, 5), tel)
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                     "scaler": scaler.state_dict()}
            dcp.save(state, checkpoint_id=ckpt)
            log += train(kind, net, model, opt, scaler, range(5, 9), tel)
            if tel is not None:
                tel.close()
        else:
            log = train(kind, net, model, opt, scaler, range(1, 9))
        runs[which] = (log, weights(kind, net), scaler)
    result[kind] = {"mixprec": runs["mixprec"][0], "torch": runs["torch"][0],
                    "equal": same(runs["mixprec"][1], runs["torch"][1])}
    if kind == "fsdp2":
        net, model, opt = build(kind, seed=1)                      # other weights: the load must replace them
        scaler = mixprec.torch.GradScaler(growth_interval=3)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                 "scaler": scaler.state_dict()}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        scaler.load_state_dict(state["scaler"])
        resumed = train(kind, net, model, opt, scaler, range(5, 9))
        result["resumed"] = {"log": resumed, "equal": same(weights(kind, net), runs["mixprec"][1]),
                             "scaler_state_equal": scaler.state_dict() == runs["mixprec"][2].state_dict()}
print(json.dumps(result), flush=True)
dist.barrier()
sys.stderr.flush()
os._exit(0)   # gloo's teardown at exit aborts now and then (test_torch_grad_scaler.py says why)
"""


def test_ddp_and_fsdp2_skip_together_and_equal_torch_amp(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    results = run_ranks(RANK, str(store), str(ckpt))
    r0, r1 = results
    for r in results:
        assert [s[1] for s in r["ddp"]["mixprec"]] == [s == 2 for s in range(1, 9)]
        assert [s[1] for s in r["fsdp2"]["mixprec"]] == [s in (2, 5) for s in range(1, 9)]
        for kind in ("ddp", "fsdp2"):
            assert r[kind]["mixprec"] == r[kind]["torch"], kind     # the same skips and scales
            assert r[kind]["equal"], f"{kind}: weights differ from torch.amp.GradScaler's run"
        assert r["resumed"]["log"] == r["fsdp2"]["mixprec"][4:]
        assert r["resumed"]["equal"] and r["resumed"]["scaler_state_equal"]
    assert r0["ddp"]["mixprec"] == r1["ddp"]["mixprec"] and r0["fsdp2"]["mixprec"] == r1["fsdp2"]["mixprec"]
    # rank 0's Telemetry of the FSDP2 run: both skips, its own shard named at step 5
    lines = [json.loads(line) for line in (tmp_path / "ckpt-telemetry" / "log.jsonl").read_text().splitlines()]
    assert [line["skipped"] for line in lines] == [s in (2, 5) for s in range(1, 9)]
    assert lines[4]["overflow_param"] == "2.weight"
    assert all(len(line["params"]) == 6 for line in lines)
