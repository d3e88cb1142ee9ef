"""Per-layer loss scaling in mixprec.torch (preset "layerwise", docs/loss_scaling.md):
the core's erfinv and approx_range rule against an independent computation in plain Python
(math only), the links the hooks find in a GPT block, bitwise equality with one scale where
nothing underflows, and one layer's overflow skipping that layer only; the true gradient of a
layer called twice, of models with frozen parameters and of GPT-2's Conv1D layers, no torch
warning, nothing leaked at exit."""

from __future__ import annotations

import copy
import json
import math
import random
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch (pip install torch); "
                                            "make test-python installs torch==2.15.0 into build/py-venv")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch  # noqa: E402
from mixprec import _core  # noqa: E402
from mixprec.torch import GradScaler  # noqa: E402

# Tiny tensors: one intra-op thread (ATen's OpenMP threads spin on a loaded two-core machine).
torch.set_num_threads(1)


def erfinv_bisect(x: float) -> float:
    lo, hi = 0.0, 7.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if math.erf(mid) < abs(x):
            lo = mid
        else:
            hi = mid
    return math.copysign((lo + hi) / 2, x)


def test_erfinv_against_bisection():
    rng = random.Random(3)
    for x in [1e-3, 0.5, 0.9, 0.999, -0.25] + [rng.uniform(-0.999, 0.999) for _ in range(200)]:
        assert _core.erfinv(x) == pytest.approx(erfinv_bisect(x), rel=1e-13, abs=1e-300)
    assert _core.erfinv(1.0) == math.inf and math.isnan(_core.erfinv(1.5))


def rule(g, w, fan_in, chain):
    """The issue's formula on plain lists (population moments, erfinv by bisection)."""
    def mv(xs):
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / len(xs), max(abs(x) for x in xs)
    mg, vg, ag = mv(g)
    mw, vw, aw = mv(w)
    sigma_o = math.sqrt((vg + mg * mg) * (vw + mw * mw)) * math.sqrt(0.5 * fan_in)
    s = max(1.0, 2.0 ** -24 / (erfinv_bisect(1e-3) * math.sqrt(2) * sigma_o))
    s = min(s, (65504.0 / fan_in) / (ag * aw))
    s = min(s, 1024.0 / chain, 16.0)
    return s


def test_rule_against_plain_python():
    rng = random.Random(9)
    checked = between = 0
    for k in range(200):
        sd = 2.0 ** rng.randint(-24, -6)
        g = [rng.gauss(0.0, sd) for _ in range(50)]
        w = [rng.gauss(0.0, 0.05) for _ in range(30)]
        fan_in, chain = 2 ** rng.randint(0, 10), 2.0 ** rng.randint(0, 11)
        tg = torch.tensor(g, dtype=torch.float32)
        g32 = tg.tolist()  # the float32 values the core reads
        raw = rule(g32, torch.tensor(w, dtype=torch.float32).tolist(), fan_in, chain)
        got = _core.approx_range_factor(_core.tensor_moments(tg), _core.tensor_moments(torch.tensor(w)), fan_in, chain)
        l2 = math.log2(raw)
        if raw == 2.0 ** round(l2):  # a cap (16, 1024 / chain) or the floor at 1: exact
            assert got == raw, (k, raw)
        elif abs(l2 - round(l2)) < 1e-9:  # within rounding of a power of two: either side
            assert got in (2.0 ** round(l2), 2.0 ** (round(l2) - 1)), (k, raw)
            continue
        else:
            assert got == 2.0 ** math.floor(l2), (k, raw)
            between += 1
        checked += 1
    assert checked > 190 and between > 25, (checked, between)


class Block(nn.Module):
    """The example GPT's block (examples/pytorch/train_gpt.py)."""

    def __init__(self, c: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.gelu, self.fcproj = nn.Linear(c, 4 * c), nn.GELU(approximate="tanh"), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (u.view(b, t, self.heads, c // self.heads).transpose(1, 2) for u in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fcproj(self.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab=50, context=8, layers=2, c=16, heads=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(context, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))


def data(steps, seed=0, batch=4, context=8, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, context), generator=g), torch.randint(0, vocab, (batch, context), generator=g))
            for _ in range(steps)]


def train(model, scaler, batches, autocast=None, inject=(), inject_param=None, clip=1.0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outcomes = []
    for step, (x, y) in enumerate(batches, 1):
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast is not None):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        if step in inject:
            with torch.no_grad():
                inject_param().grad[0, 0] = math.inf
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        outcomes.append(scaler.step(opt))
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return outcomes, opt


def test_links_in_a_gpt_block():
    torch.manual_seed(0)
    model = Gpt()
    scaler = GradScaler(preset="layerwise")
    scaler.watch(model)
    names = [layer.name for layer in scaler._lw.layers]
    assert "head" not in names  # tied to wte: stays at the base scale
    assert names == [f"blocks.{i}.{m}" for i in range(2) for m in ("qkv", "proj", "fc", "fcproj")]
    train(model, scaler, data(1))
    links = {layer.name: (layer.feeds.name if layer.feeds else None) for layer in scaler._lw.layers}
    for i in range(2):
        assert links[f"blocks.{i}.proj"] == f"blocks.{i}.qkv"      # through attention and its views
        assert links[f"blocks.{i}.fcproj"] == f"blocks.{i}.fc"     # through the GELU
        assert links[f"blocks.{i}.qkv"] is None                    # into a LayerNorm: back to the base
        assert links[f"blocks.{i}.fc"] is None


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("autocast", [None, "fp16"])
def test_equals_one_scale_bitwise(autocast):
    """fp32 (nothing underflows) at loss scale 2^-8, where the rule picks factors above 1 and
    chains of them through the links; fp16 autocast at 2^16, where it picks 1 everywhere: the
    weights equal one scale's bit for bit."""
    init = 2.0 ** -8 if autocast is None else 65536.0
    runs = []
    factors = []
    chained = []  # (chain, factor) of the layers fed by a linked layer
    for preset in ("mixprec", "layerwise"):
        torch.manual_seed(0)
        model = Gpt()
        scaler = GradScaler(preset=preset, init_scale=init, min_scale=min(init, 1.0))
        if preset == "layerwise":
            scaler.watch(model)
        opt_batches = data(4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in opt_batches:
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast is not None):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            scaler.scale(loss).backward()
            out = scaler.step(opt)
            assert out.applied
            if preset == "layerwise":
                scales = scaler.layer_scales()
                factors.extend(d["factor"] for d in scales)
                fed = {layer.feeds.index for layer in scaler._lw.layers if layer.feeds is not None}
                chained.extend((d["chain"], d["factor"]) for i, d in enumerate(scales) if i in fed)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        runs.append(weights(model))
    if autocast is None:
        assert max(factors) > 1, "the rule picked no factor above 1: the test would prove nothing"
        assert chained and all(c > f for c, f in chained), "no chain travelled through a link"
    else:
        assert set(factors) == {1.0}
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_one_layers_overflow_skips_that_layer_only():
    torch.manual_seed(0)
    model = Gpt()
    scaler = GradScaler(preset="layerwise")
    scaler.watch(model)
    scaler.set_names(model)
    target = model.blocks[1].fc
    before = {}

    def inject():
        before["w"] = target.weight.detach().clone()
        before["other"] = model.blocks[0].fc.weight.detach().clone()
        return target.weight

    outcomes, opt = train(model, scaler, data(6), autocast="fp16", inject=(2, 5), inject_param=inject)
    assert all(o.applied for o in outcomes)
    assert [o.skipped_layers for o in outcomes] == [(), ("blocks.1.fc",), (), (), ("blocks.1.fc",), ()]
    assert scaler.get_scale() == 65536.0  # the base scale did not back off
    # The skipped layer's Adam state advanced on the 4 applied steps only, the others' on all 6.
    assert int(opt.state[target.weight]["step"]) == 4
    assert int(opt.state[model.blocks[0].fc.weight]["step"]) == 6
    state = scaler.state_dict()
    layer = {d["name"]: d for d in state["layerwise"]["layers"]}
    assert layer["blocks.1.fc"]["backoff"] == 2 and layer["blocks.1.fc"]["overflows"] == 2
    assert layer["blocks.0.fc"]["backoff"] == 0
    # One scale skips both steps.
    torch.manual_seed(0)
    model = Gpt()
    glob = GradScaler(preset="mixprec")
    outcomes, _ = train(model, glob, data(6), autocast="fp16", inject=(2, 5),
                        inject_param=lambda: model.blocks[1].fc.weight)
    assert [o.applied for o in outcomes] == [True, False, True, True, False, True]
    assert glob.get_scale() == 65536.0 / 4


def test_skipped_layer_keeps_its_weights():
    torch.manual_seed(0)
    model = Gpt()
    scaler = GradScaler(preset="layerwise")
    scaler.watch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(data(3), 1):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        w = model.blocks[0].proj.weight.detach().clone()
        o = model.blocks[1].proj.weight.detach().clone()
        if step == 3:
            model.blocks[0].proj.bias.grad[0] = math.nan
        out = scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        assert torch.equal(model.blocks[0].proj.weight, w) == (step == 3)
        assert not torch.equal(model.blocks[1].proj.weight, o)
    assert out.skipped_layers == ("blocks.0.proj",)


def test_state_round_trip_and_errors():
    torch.manual_seed(0)
    model = Gpt()
    scaler = GradScaler(preset="layerwise")
    scaler.watch(model)
    train(model, scaler, data(2), inject=(1,), inject_param=lambda: model.blocks[0].qkv.weight)
    state = scaler.state_dict()
    assert state["preset"] == "layerwise" and "layerwise" in state
    fresh = GradScaler(preset="layerwise")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    bad = json.loads(json.dumps(state))
    bad["layerwise"]["layers"][0]["backoff"] = -1
    with pytest.raises(ValueError, match="backoff"):
        fresh.load_state_dict(bad)
    assert fresh.state_dict() == state
    with pytest.raises(ValueError, match="preset 'layerwise'"):
        GradScaler(preset="torch").watch(model)


def test_telemetry_logs_the_layers(tmp_path):
    torch.manual_seed(0)
    model = Gpt()
    scaler = GradScaler(preset="layerwise", init_scale=1.0)
    scaler.watch(model)
    tel = mixprec.torch.Telemetry(model, out=str(tmp_path / "run"), precision="fp16", scaler=scaler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in data(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        out = scaler.step(opt)
        line = tel.record(out, loss=loss.item())
        scaler.update()
        opt.zero_grad(set_to_none=True)
    tel.close()
    assert [d["name"] for d in line["layers"]] == [layer.name for layer in scaler._lw.layers]
    assert all(d["outcome"] == "applied" for d in line["layers"])
    assert max(d["factor"] for d in line["layers"]) > 1  # at loss scale 1 the rule scales up


def test_a_watched_model_alive_at_exit_leaks_no_core_object(tmp_path):
    # A loss that went through watched modules, alive when the interpreter exits: the layers'
    # cached core objects are dropped at exit, before the core's leak check would report them.
    script = tmp_path / "alive_at_exit.py"
    script.write_text(
        "import warnings, torch, mixprec.torch as mt\n"
        "warnings.simplefilter('ignore')\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n"
        "scaler = mt.GradScaler('cpu', preset='layerwise')\n"
        "scaler.watch(model)\n"
        "with torch.autocast('cpu', dtype=torch.float16):\n"
        "    loss = model(torch.randn(4, 8)).float().sum()\n"
        "scaler.scale(loss).backward()\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "leaked" not in r.stderr, r.stderr


# ---- issue 43: a layer called twice, frozen parameters, Conv1D, torch's warning, exit ----------

def _grads_equal(model, ref, what):
    """Every .grad of `model` (after unscale_) is the float64 reference's gradient of the
    unscaled loss, to float32's rounding."""
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: {n} has a gradient, the reference has none"
            continue
        assert p.grad is not None, f"{what}: {n} has no gradient"
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-5, atol=1e-5 * float(q.grad.abs().max()),
                                   msg=lambda m, n=n: f"{what}: {n}: {m}")


def _looped(seed=0):
    """The issue's model: one Linear called twice per forward (a weight-tied loop)."""
    torch.manual_seed(seed)
    lin = nn.Linear(16, 16)
    return nn.Sequential(nn.Linear(16, 16), lin, nn.GELU(), lin, nn.GELU(), nn.Linear(16, 4))


@pytest.mark.parametrize("loss_factor, init", [(1e-10, 65536.0), (1.0, 2.0 ** -8)])
def test_r4_a_layer_called_twice_gets_its_true_gradient(loss_factor, init):
    # Its weight gradient is the sum of both calls': it runs at the base scale that pass (a
    # warning names it) while the others keep their factors; every .grad is the true one.
    model = _looped()
    ref = _looped().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    (F.mse_loss(ref(x.double()), y.double()) * loss_factor).backward()
    scaler = GradScaler(preset="layerwise", init_scale=init, min_scale=min(init, 1.0))
    scaler.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.scale(F.mse_loss(model(x), y) * loss_factor).backward()
    scaler.unscale_(opt)
    _grads_equal(model, ref, "step 1")
    assert [str(w.message) for w in caught] == [
        "watch: module '1' (Linear) ran 2 times in the forward of one backward pass; its weight gradient is the sum "
        "of every call's, so it takes its gradients at the base scale (no per-layer factor)"]
    scales = {d["name"]: d for d in scaler.layer_scales()}
    assert (scales["1"]["calls"], scales["1"]["factor"], scales["1"]["chain"]) == (2, 1.0, 1.0)
    assert scales["5"]["factor"] > 1 and scales["0"]["factor"] > 1, scales  # the others are scaled
    assert scaler.step(opt).applied
    scaler.update()
    # The next step: the same, and the warning is not repeated.
    opt.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    (F.mse_loss(ref(x.double()), y.double()) * loss_factor).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(F.mse_loss(model(x), y) * loss_factor).backward()
    scaler.unscale_(opt)
    _grads_equal(model, ref, "step 2")


def test_r4_two_micro_batches_in_one_backward_get_their_true_gradient():
    # Two forwards summed into one loss: every layer's weight gradient sums two calls.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    # Gradients far apart in size: alone, the first micro-batch's layers would take factors
    # above 1 and the second's 1.
    (ref(x1.double()).square().mean() * 1e-12 + ref(x2.double()).square().mean() * 1e-3).backward()
    scaler = GradScaler(preset="layerwise")
    scaler.watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.scale(model(x1).square().mean() * 1e-12 + model(x2).square().mean() * 1e-3).backward()
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    _grads_equal(model, ref, "one backward of two forwards")
    assert sorted(str(w.message).split(" (")[0] for w in caught) == [f"watch: module '{i}'" for i in (0, 2, 4)]
    assert {d["calls"] for d in scaler.layer_scales()} == {2}


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


@pytest.mark.parametrize("frozen", ["first layer", "middle layer", "a bias"])
def test_r4_frozen_parameters_are_watched(frozen):
    # A frozen Linear (a LoRA base, partial fine-tuning) or a frozen bias: watch() takes the
    # model, frozen parameters get no hook and no gradient, layer_scales() names them, every
    # other .grad is the true one; a parameter unfrozen later gets its hook at the next forward.
    model, ref = _mlp(), _mlp().double()
    frozen_params = {"first layer": ["0.weight", "0.bias"], "middle layer": ["2.weight", "2.bias"],
                     "a bias": ["2.bias"]}[frozen]
    for m in (model, ref):
        named = dict(m.named_parameters())
        for n in frozen_params:
            named[n].requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    (F.mse_loss(ref(x.double()), y.double()) * 1e-10).backward()
    scaler = GradScaler(preset="layerwise")
    scaler.watch(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    scaler.scale(F.mse_loss(model(x), y) * 1e-10).backward()
    scaler.unscale_(opt)
    _grads_equal(model, ref, frozen)
    scales = {d["name"]: d for d in scaler.layer_scales()}
    layer = frozen_params[0].split(".")[0]
    assert scales[layer]["frozen"] == [n.split(".")[1] for n in frozen_params]
    assert max(d["factor"] for d in scales.values()) > 1
    assert scaler.step(opt).applied
    scaler.update()
    # Unfrozen: its gradient (at the next forward's hook) is the true one too.
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        m.requires_grad_(True)
    (F.mse_loss(ref(x.double()), y.double()) * 1e-10).backward()
    scaler.scale(F.mse_loss(model(x), y) * 1e-10).backward()
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    _grads_equal(model, ref, frozen + ", unfrozen")
    assert all(d["frozen"] == [] for d in scaler.layer_scales())


def test_r4_gpt2_conv1d_layers_are_watched():
    # transformers' GPT-2 projects with Conv1D (weight [in, out]), not nn.Linear: watched as
    # linear layers, linked as in the example GPT, every .grad the true one.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    ref(ids, labels=ids).loss.backward()
    scaler = GradScaler(preset="layerwise", init_scale=2.0 ** -8, min_scale=2.0 ** -8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.watch(model)
        scaler.scale(model(ids, labels=ids).loss).backward()
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    names = [f"transformer.h.{i}.{m}" for i in range(2)
             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    scales = scaler.layer_scales()
    assert [d["name"] for d in scales] == names
    assert [d["fan_in"] for d in scales] == [96, 32, 128, 32] * 2  # the output widths
    assert max(d["factor"] for d in scales) > 1
    links = {layer.name: (layer.feeds.name if layer.feeds else None) for layer in scaler._lw.layers}
    assert links["transformer.h.0.attn.c_proj"] == "transformer.h.0.attn.c_attn"
    assert links["transformer.h.0.mlp.c_proj"] == "transformer.h.0.mlp.c_fc"
    _grads_equal(model, ref, "GPT-2")


class _Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: self.b(F.gelu(t)), self.a(x), use_reentrant=self.reentrant)
        return self.c(F.gelu(h))


@pytest.mark.parametrize("reentrant", [False, True])
def test_r4_activation_checkpointing_gets_the_true_gradient(reentrant):
    # A recomputed forward is not a second call; reentrant checkpointing runs its segment's
    # backward (with a watched layer in it) inside a custom autograd Function: no link crosses it.
    model, ref = _Checkpointed(reentrant), _Checkpointed(reentrant).double()
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    (F.mse_loss(ref(x.double()), y.double()) * 1e-10).backward()
    scaler = GradScaler(preset="layerwise")
    scaler.watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.scale(F.mse_loss(model(x), y) * 1e-10).backward()
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    _grads_equal(model, ref, f"checkpoint (reentrant={reentrant})")
    assert not [w for w in caught if "ran 2 times" in str(w.message)]
    assert min(d["factor"] for d in scaler.layer_scales()) > 1


def test_r4_watch_warns_when_there_is_nothing_to_watch():
    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x)

    with pytest.warns(UserWarning, match="watch: nothing to watch in ConvNet: it has no torch.nn.Linear or "
                                         "transformers Conv1D module"):
        GradScaler(preset="layerwise").watch(ConvNet())
    tied = nn.Linear(4, 4)
    shared = nn.ModuleDict({"a": tied, "b": nn.Linear(4, 4)})
    shared["b"].weight = tied.weight
    with pytest.warns(UserWarning, match=r"nothing to watch in ModuleDict: its linear layers \('a', 'b'\) share"):
        GradScaler(preset="layerwise").watch(shared)


def test_r4_no_torch_warning_when_the_first_layers_input_needs_no_gradient():
    # torch's "Full backward hook is firing when gradients are computed with respect to module
    # outputs since no inputs require gradients": no full backward hook, no warning; the
    # results are one scale's, bit for bit (fp32 at 2^-8: factors above 1 and links).
    runs = []
    for preset in ("mixprec", "layerwise"):
        model = _mlp()
        scaler = GradScaler(preset=preset, init_scale=2.0 ** -8, min_scale=2.0 ** -8)
        if preset == "layerwise":
            scaler.watch(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
                scaler.scale(F.mse_loss(model(x), y)).backward()
                assert scaler.step(opt).applied
                scaler.update()
                opt.zero_grad(set_to_none=True)
        if preset == "layerwise":
            assert max(d["factor"] for d in scaler.layer_scales()) > 1
        runs.append(weights(model))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_r4_a_module_level_scaler_leaks_no_core_object(tmp_path):
    # A module-level scaler that watched a model and stepped, while each step's loss is still
    # alive at exit (its graph holds the layers' hooks), then watches again, is replaced by a new
    # scaler, is deleted: every layer's cached core object is dropped at exit, also of hooks
    # that were replaced or whose scaler is gone (each of the three leaked before).
    script = tmp_path / "module_level.py"
    script.write_text(
        "import torch, mixprec.torch as mt\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "losses = []\n"
        "def step():\n"
        "    losses.append(model(torch.randn(4, 8)).square().mean())\n"
        "    scaler.scale(losses[-1]).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "scaler = mt.GradScaler('cpu', preset='layerwise')\n"
        "scaler.watch(model)\n"
        "step()\n"
        "scaler.watch(model)\n"
        "step()\n"
        "scaler = mt.GradScaler('cpu', preset='layerwise')\n"
        "scaler.watch(model)\n"
        "step()\n"
        "del scaler\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "leaked" not in r.stderr, r.stderr
