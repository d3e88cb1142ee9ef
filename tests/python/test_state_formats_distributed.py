"""mixprec.torch.optim.AdamW under FSDP2, torch.distributed.checkpoint and the training
frameworks (docs/python.md, "PyTorch: mixprec.torch.optim.AdamW").

- FSDP2 (`fully_shard`, 2 gloo processes on the CPU, a bf16 model with an unevenly split
  embedding): the gathered weights, and the gathered optimizer state (codes, scales, remainders),
  equal those of the same model trained unsharded by the same optimizer, bit for bit, for
  remainder + fp8, remainder + (8bit, 4bit) and stochastic rounding (master="none"). A
  parameter whose shards cannot all quantize keeps fp32 moments on every rank.
- torch.distributed.checkpoint: get_optimizer_state_dict / dcp.save, then dcp.load /
  set_optimizer_state_dict into a fresh model and optimizer (under FSDP2 and in one process,
  nested and flattened keys): the state after loading is the saved one bit for bit, and the
  training continues as the run that never stopped.
- The Hugging Face Trainer, Lightning and Accelerate save a checkpoint their own way and resume
  it: the optimizer state after resuming is the saved one bit for bit (codes and scales), and
  the resumed training equals the uninterrupted one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from integration_support import SKIP_REASON, run_ranks
from mixprec.torch.optim import AdamW


def raw(t):
    """A tensor's bytes (for a bitwise comparison whatever its dtype)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_state(a, b):
    """Two optimizer states ({param key: {name: tensor}}) equal bit for bit, dtype for dtype."""
    if a.keys() != b.keys():
        return False
    for k in a:
        if a[k].keys() != b[k].keys():
            return False
        for n in a[k]:
            x, y = a[k][n], b[k][n]
            if x.dtype != y.dtype or not torch.equal(raw(x), raw(y)):
                return False
    return True


def snapshot(opt):
    return {i: {n: x.detach().clone() for n, x in s.items()}
            for i, s in enumerate(opt.state[p] for g in opt.param_groups for p in g["params"])}


# ---- FSDP2: 2 processes, gloo, CPU ------------------------------------------------------------

RANK = r"""
import json, os, sys, torch, torch.distributed as dist
rank, store, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from mixprec.torch.optim import AdamW

mesh = init_device_mesh("cpu", (2,))

def raw(t):
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().contiguous().reshape(-1).view(torch.uint8)

class Net(torch.nn.Module):
    # Shards under Shard(0) on 2 ranks: emb 65 + 64 rows of 256 (uneven; 256-element blocks
    # whole in each, the 4-bit codes by rows), fc1.weight and fc2.weight 4096 + 4096 elements;
    # the biases stay under 4096 elements (fp32 moments) sharded or not.
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(129, 256)
        self.fc1 = torch.nn.Linear(256, 32)
        self.fc2 = torch.nn.Linear(32, 256)
        self.bfloat16()

    def forward(self, ids):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.emb(ids))))

def sharded(model):
    for m in (model.emb, model.fc1, model.fc2):
        fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)

def train(model, opt, steps):
    for s in steps:
        ids = torch.randint(0, 129, (8, 6), generator=torch.Generator().manual_seed(s))  # the same on both ranks
        model(ids).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

def local_state(opt):
    return {i: {n: x.detach().clone() for n, x in opt.state[p].items()}
            for i, p in enumerate(q for g in opt.param_groups for q in g["params"])}

def same_local(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(a[i][n].dtype == b[i][n].dtype and a[i][n].shape == b[i][n].shape
                                           and torch.equal(raw(a[i][n]), raw(b[i][n])) for n in a[i]) for i in a)

CASES = {"remainder-fp8": dict(master="remainder", moments="fp8"),
         "remainder-8bit-4bit": dict(master="remainder", moments=("8bit", "4bit")),
         "none-sr": dict(master="none", moments="bf16", stochastic_rounding=True, seed=7),
         "remainder-fp16": dict(master="remainder", moments="fp16")}   # one scale per shard: not unsharded's
result = {}
for name, formats in CASES.items():
    kw = dict(lr=1e-2, weight_decay=0.1, **formats)
    ref = Net(0)
    oref = AdamW(ref.parameters(), **kw)
    train(ref, oref, range(4))
    model = sharded(Net(0))
    opt = AdamW(model.parameters(), **kw)
    train(model, opt, range(2))
    options = StateDictOptions(flatten_optimizer_state_dict=name == "remainder-8bit-4bit")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)},
             checkpoint_id=ckpt + "-" + name)
    saved = local_state(opt)
    train(model, opt, range(2, 4))
    r = {"weights": [torch.equal(raw(p), raw(q)) for p, q in zip(model.parameters(), ref.parameters())]}
    # Each rank's state (as DTensor shards in the state dict) is its part of the unsharded
    # optimizer's, byte for byte; gathered (where the backend gathers every dtype: gloo has no
    # int16 for the remainders) it is the whole of it.
    shards = get_optimizer_state_dict(model, opt)["state"]
    whole = dict(zip([n for n, _ in ref.named_parameters()], [oref.state[p] for p in ref.parameters()]))
    def part(x, y):
        if not isinstance(x, DTensor):
            return x.dtype == y.dtype and torch.equal(raw(x), raw(y))
        mine = distribute_tensor(y.reshape(x.shape), mesh, x.placements, src_data_rank=None).to_local()
        return x.dtype == y.dtype and torch.equal(raw(x.to_local()), raw(mine))
    r["shards"] = {fqn: shards[fqn].keys() == whole[fqn].keys() and all(part(shards[fqn][k], whole[fqn][k])
                                                                      for k in whole[fqn]) for fqn in whole}
    if formats["master"] == "none":
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
        r["full"] = {fqn: all(full[fqn][k].dtype == whole[fqn][k].dtype
                              and torch.equal(raw(full[fqn][k]), raw(whole[fqn][k])) for k in whole[fqn])
                     for fqn in whole}
    r["dtypes"] = {fqn: str(whole[fqn]["exp_avg"].dtype) for fqn in whole}
    r["scales"] = {fqn: [list(shards[fqn]["exp_avg_scale"].shape), shards[fqn]["exp_avg_scale"].to_local().numel()]
                   for fqn in whole}
    # A fresh model and optimizer (other weights) from the checkpoint, then the same steps
    fresh = sharded(Net(1))
    ofresh = AdamW(fresh.parameters(), **kw)
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, ofresh, options=options)}
    dcp.load(state, checkpoint_id=ckpt + "-" + name)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, ofresh, state["optim"], options=options)
    r["loaded_state_equal"] = same_local(local_state(ofresh), saved)
    train(fresh, ofresh, range(2, 4))
    r["resumed"] = [torch.equal(raw(p), raw(q)) for p, q in zip(fresh.parameters(), model.parameters())]
    result[name] = r

# A parameter whose shards cannot all quantize: (31, 256) splits into 16 rows (4096 elements, fp8)
# and 15 (3840, under 4096): fp32 moments on both ranks; (192, 32) into 3072 + 3072: fp32 as any
# tensor under 4096 elements. Unsharded, both quantize.
head = torch.nn.Sequential(torch.nn.Linear(256, 31, bias=False), torch.nn.Linear(32, 192, bias=False)).bfloat16()
plain = [torch.nn.Parameter(q.detach().clone()) for q in head.parameters()]
unsharded = AdamW(plain, master="remainder", moments="fp8")
for p in plain:
    p.grad = torch.ones_like(p)
unsharded.step()
fully_shard(head, mesh=mesh)
ohead = AdamW(head.parameters(), master="remainder", moments="fp8")
for p in head.parameters():
    p.grad = distribute_tensor(torch.ones(p.shape, dtype=p.dtype), mesh, p.placements)
ohead.step()
result["fallback"] = {"unsharded": [str(unsharded.state[p]["exp_avg"].dtype) for p in plain],
                      "sharded": [[str(ohead.state[p][k].dtype) for k in ("exp_avg", "exp_avg_sq")]
                                  for p in head.parameters()],
                      "local_rows": [p.to_local().shape[0] for p in head.parameters()],
                      "state_dict": sorted(get_optimizer_state_dict(head, ohead)["state"])}
# Placements other than Shard and Replicate (here _StridedShard): state_dict() says its codes
# have no layout, where a plain tensor would be saved once by DCP, as if every rank held it
from torch.distributed.tensor.placement_types import _StridedShard
odd = torch.nn.Parameter(DTensor.from_local(torch.zeros(16, 256, dtype=torch.bfloat16), mesh,
                                            [_StridedShard(0, split_factor=2)], run_check=False))
oodd = AdamW([odd], master="remainder", moments="8bit")
odd.grad = DTensor.from_local(torch.ones(16, 256, dtype=torch.bfloat16), mesh, odd.placements, run_check=False)
oodd.step()
try:
    oodd.state_dict()
    result["strided"] = None
except ValueError as e:
    result["strided"] = str(e)
print(json.dumps(result), flush=True)
dist.barrier()
sys.stderr.flush()
os._exit(0)   # gloo's teardown at exit aborts now and then (test_torch_grad_scaler.py says why)
"""


def test_fsdp2_equals_unsharded_and_resumes_from_dcp_bit_for_bit(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) is not in this torch")
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    results = run_ranks(RANK, str(store), str(ckpt))
    names = ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for rank, r in enumerate(results):
        for case in ("remainder-fp8", "remainder-8bit-4bit", "none-sr", "remainder-fp16"):
            c = r[case]
            if case != "remainder-fp16":
                assert c["weights"] == [True] * 5, f"rank {rank}, {case}: FSDP2's weights differ from unsharded ones"
                assert c["shards"] == dict.fromkeys(names, True), f"rank {rank}, {case}: the shards' state differs"
            if case == "none-sr":
                assert c["full"] == dict.fromkeys(names, True), f"rank {rank}: the gathered state differs"
            assert c["loaded_state_equal"], f"rank {rank}, {case}: the state loaded by DCP is not the saved one"
            assert c["resumed"] == [True] * 5, f"rank {rank}, {case}: the resumed run differs"
        # the compact formats are really in use (the biases: under 4096 elements, fp32)
        assert r["remainder-fp8"]["dtypes"] == {"emb.weight": "torch.uint8", "fc1.weight": "torch.uint8",
                                                "fc1.bias": "torch.float32", "fc2.weight": "torch.uint8",
                                                "fc2.bias": "torch.float32"}
        # fp16 moments: one scale per shard (per tensor means per shard), two in the state dict
        assert r["remainder-fp16"]["scales"] == dict.fromkeys(names, [[2], 1])
        assert r["remainder-fp8"]["scales"]["emb.weight"] == [[129], 65 - rank]   # a scale per 256, split by rows
        assert r["strided"] == ("state_dict: state[0] (param_groups[0]['params'][0])['exp_avg']: expected a DTensor "
                                "parameter placed by Shard or Replicate (its state's layout over the mesh follows "
                                "from them), found placements (_StridedShard(dim=0, sf=2),)"), r["strided"]
        fb = r["fallback"]
        assert fb["unsharded"] == ["torch.uint8", "torch.uint8"]
        assert fb["sharded"] == [["torch.float32", "torch.float32"]] * 2, f"rank {rank}: {fb}"
        assert fb["state_dict"] == ["0.weight", "1.weight"]
    assert results[0]["fallback"]["local_rows"] == [16, 96] and results[1]["fallback"]["local_rows"] == [15, 96]


# ---- torch.distributed.checkpoint in one process ----------------------------------------------

def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).bfloat16()


def mlp_steps(model, opt, steps):
    for s in steps:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s)).bfloat16()
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("flatten", [False, True])
def test_dcp_in_one_process_resumes_bit_for_bit(tmp_path, flatten):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    kw = dict(lr=1e-2, master="remainder", moments=("fp8", "8bit"))
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    whole = mlp(0)
    ow = AdamW(whole.parameters(), **kw)
    mlp_steps(whole, ow, range(6))
    first = mlp(0)
    of = AdamW(first.parameters(), **kw)
    mlp_steps(first, of, range(3))
    dcp.save({"model": get_model_state_dict(first), "optim": get_optimizer_state_dict(first, of, options=options)},
             checkpoint_id=str(tmp_path / "ckpt"))
    saved = snapshot(of)
    fresh = mlp(1)
    ofresh = AdamW(fresh.parameters(), **kw)
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, ofresh, options=options)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, ofresh, state["optim"], options=options)
    assert same_state(snapshot(ofresh), saved)
    assert ofresh.state[fresh[0].weight]["exp_avg"].dtype == torch.uint8
    assert ofresh.param_groups[0]["moments"] == ("fp8", "8bit")
    mlp_steps(fresh, ofresh, range(3, 6))
    for a, b in zip(fresh.parameters(), whole.parameters()):
        assert torch.equal(raw(a), raw(b))


def test_shard_split_is_dtensors():
    # _chunk: the local sizes DTensor's Shard gives (torch.chunk's, empty pieces at the end)
    Shard = pytest.importorskip("torch.distributed.tensor").Shard
    from mixprec.torch.optim import _chunk
    for size in range(0, 40):
        for parts in range(1, 7):
            for i in range(parts):
                assert _chunk(size, parts, i) == Shard.local_shard_size_and_offset(size, parts, i)[0], (size, parts, i)


# ---- the integrations: each framework's own checkpoint ----------------------------------------

VOCAB, CONTEXT = 96, 8


class TinyLM(torch.nn.Module):
    """bf16, with weights of 6144, 8192 and 12288 elements (8-bit moments) and small biases (fp32)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, 64)
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, VOCAB)
        self.bfloat16()

    def forward(self, input_ids, labels=None):
        logits = self.fc2(torch.relu(self.fc1(self.embed(input_ids)))).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return {"loss": loss}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed=1):
        self.ids = torch.randint(0, VOCAB, (n, CONTEXT), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def integration(name):
    """The framework's module: skipped where it is not installed or MIXPREC_NO_INTEGRATIONS=1."""
    if os.environ.get("MIXPREC_NO_INTEGRATIONS") == "1":
        pytest.skip(SKIP_REASON)
    return pytest.importorskip(name)


def adamw(params):
    return AdamW(params, lr=3e-3, weight_decay=0.1, master="remainder", moments="8bit")


def assert_compact(state):
    dtypes = {s["exp_avg"].dtype for s in state.values()}
    assert dtypes == {torch.uint8, torch.float32}, dtypes  # 8-bit codes where the tensors are large
    assert any(s["exp_avg_scale"].numel() for s in state.values())


def test_hf_trainer_resumes_the_compact_state_bit_for_bit(tmp_path):
    transformers = integration("transformers")
    integration("accelerate")
    from accelerate.state import AcceleratorState

    class Seen(transformers.TrainerCallback):
        """The optimizer's state when the training begins (after the Trainer loaded its checkpoint)."""

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            self.at_begin = snapshot(optimizer)

        def on_save(self, args, state, control, optimizer=None, **kwargs):
            self.at_save = snapshot(optimizer)

    def trainer(model, out, steps, seen, save):
        AcceleratorState._reset_state(True)
        args = transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, max_steps=steps, per_device_train_batch_size=4, learning_rate=3e-3,
            lr_scheduler_type="constant", logging_steps=1, save_strategy="steps" if save else "no",
            save_steps=save or 500, report_to="none", seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
        return transformers.Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=[seen],
                                    optimizers=(adamw(model.parameters()), None))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = TinyLM()
        trainer(whole, tmp_path / "whole", 6, Seen(), None).train()
        first_seen = Seen()
        trainer(TinyLM(), tmp_path / "run", 3, first_seen, 3).train()
        resumed, seen = TinyLM(seed=1), Seen()
        t = trainer(resumed, tmp_path / "run", 6, seen, None)
        t.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    saved = torch.load(tmp_path / "run" / "checkpoint-3" / "optimizer.pt", weights_only=True)["state"]
    assert_compact(saved)
    assert same_state(seen.at_begin, saved) and same_state(seen.at_begin, first_seen.at_save)
    assert int(t.optimizer.state[resumed.fc1.weight]["step"]) == 6
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(raw(a), raw(b))
    AcceleratorState._reset_state(True)


def test_lightning_resumes_the_compact_state_bit_for_bit(tmp_path):
    L = integration("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(L.LightningModule):
        def __init__(self, seed=0):
            super().__init__()
            self.net = TinyLM(seed)
            self.at_start = None

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def on_train_start(self):
            self.at_start = snapshot(self.optimizers().optimizer)

        def configure_optimizers(self):
            return adamw(self.parameters())

    def fit(module, epochs, ckpt_path=None, callbacks=()):
        # 3 steps an epoch; Lightning's ModelCheckpoint saves at the end of each (a fit resumed
        # from the middle of an epoch restarts a plain DataLoader, so it would not continue the run)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=list(callbacks),
                            enable_checkpointing=bool(callbacks), default_root_dir=str(tmp_path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tiny run's own warnings (few workers, no logger)
            trainer.fit(module, torch.utils.data.DataLoader(Tokens(12), batch_size=4), ckpt_path=ckpt_path)
        return trainer

    whole = Module()
    fit(whole, 2)
    first = Module()
    trainer = fit(first, 1, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="first",
                                                       save_on_train_epoch_end=True)])
    saved_live = snapshot(trainer.optimizers[0])
    resumed = Module(seed=1)
    trainer = fit(resumed, 2, ckpt_path=str(tmp_path / "ckpt" / "first.ckpt"))
    saved = torch.load(tmp_path / "ckpt" / "first.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert_compact(saved)
    assert same_state(resumed.at_start, saved) and same_state(resumed.at_start, saved_live)
    assert int(trainer.optimizers[0].state[resumed.net.fc1.weight]["step"]) == 6
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(raw(a), raw(b))


def test_accelerate_resumes_the_compact_state_bit_for_bit(tmp_path):
    integration("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    def run(seed, steps, load=None, save=None):
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True)
        model = TinyLM(seed)
        model, opt = accelerator.prepare(model, adamw(model.parameters()))
        batches = Tokens(4 * 6).ids.view(6, 4, CONTEXT)
        first, at_load = 0, None
        if load is not None:
            accelerator.load_state(load)
            at_load = snapshot(opt.optimizer)
            first = 3
        for ids in batches[first:steps]:
            accelerator.backward(model(input_ids=ids, labels=ids)["loss"])
            opt.step()
            opt.zero_grad()
        if save is not None:
            accelerator.save_state(save)
        return accelerator.unwrap_model(model), opt.optimizer, at_load

    whole, _, _ = run(0, 6)
    _, first_opt, _ = run(0, 3, save=str(tmp_path / "state"))
    saved_live = snapshot(first_opt)
    resumed, opt, at_load = run(1, 6, load=str(tmp_path / "state"))
    saved = torch.load(tmp_path / "state" / "optimizer.bin", weights_only=True)["state"]
    assert_compact(saved)
    assert same_state(at_load, saved) and same_state(at_load, saved_live)
    assert int(opt.state[resumed.fc1.weight]["step"]) == 6
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(raw(a), raw(b))
    AcceleratorState._reset_state(True)
