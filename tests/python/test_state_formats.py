"""mixprec.torch.optim.AdamW: the state formats against the systems that define them (torchao's
optimizers and quantizers, Transformer Engine's FusedAdam formulas), the remainder master against
the fp32 master, skipping, GradScaler protocols, checkpoints and the measured bytes."""

import io
import math

import numpy as np
import pytest
import torch

import mixprec._core as core
from mixprec.torch.optim import AdamW

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim import quant_utils  # noqa: E402
from torchao.optim import subclass_4bit, subclass_8bit, subclass_fp8  # noqa: E402

f32 = np.float32


def bits(t):
    return t.detach().contiguous().view(torch.int32) if t.dtype == torch.float32 else t.detach().view(torch.int16)


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def test_code_maps_are_torchaos():
    for fmt, mod in (("8bit", subclass_8bit), ("4bit", subclass_4bit)):
        for signed, table in ((True, mod.get_qmap_signed()), (False, mod.get_qmap_unsigned())):
            ours = torch.tensor(core.moment_code_map(fmt, signed), dtype=torch.float32)
            theirs = torch.tensor(table, dtype=torch.float32)
            assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), (fmt, signed)


# ---- torchao: the formula with IEEE sqrt, bit for bit; torchao itself, within torch's sqrt ------

def ieee_sqrt(t):
    """float32 sqrt correctly rounded (NumPy's); torch's CPU sqrt is not on every input."""
    return torch.from_numpy(np.sqrt(t.numpy()))


def torchao_state(fmt, shape):
    if fmt == "8bit":
        return (subclass_8bit.OptimState8bit.zeros(shape, True, 256), subclass_8bit.OptimState8bit.zeros(shape, False, 256))
    if fmt == "4bit":
        return (subclass_4bit.OptimState4bit.zeros(shape, True, 128), subclass_4bit.OptimState4bit.zeros(shape, False, 128))
    return subclass_fp8.OptimStateFp8.zeros(shape, 256), subclass_fp8.OptimStateFp8.zeros(shape, 256)


def torchao_formula_step(p, g, m_state, v_state, step, lr, b1, b2, eps, wd):
    """torchao's single_param_adam (AdamW), with torchao's own state tensors for the quantization
    and a correctly rounded sqrt."""
    lr_t = torch.tensor(lr, dtype=torch.float32)
    step_t = torch.tensor(float(step))
    p = p - lr_t * wd * p
    bc1 = 1 - b1 ** step_t
    bc2 = 1 - b2 ** step_t
    m = m_state.dequantize().lerp(g, 1 - b1)
    v = v_state.dequantize().lerp(g.square(), 1 - b2)
    m_state.copy_(m)
    v_state.copy_(v)
    denom = ieee_sqrt(v) / ieee_sqrt(bc2.reshape(1)).reshape(()) + eps
    return p - lr_t * (m / bc1) / denom


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
def test_torchao_rule_equals_torchaos_formula_bit_for_bit(fmt):
    torch.manual_seed(1)
    shape = (64, 128)
    p0 = torch.randn(shape)
    grads = [torch.randn(shape) * 10.0 ** (-k % 4) for k in range(6)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    p = torch.nn.Parameter(p0.clone())
    opt = AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, moments=fmt, rule="torchao")
    ref = p0.clone()
    m_state, v_state = torchao_state(fmt, shape)
    for step, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        ref = torchao_formula_step(ref, g, m_state, v_state, step, lr, b1, b2, eps, wd)
        assert same_bits(p, ref), f"{fmt} step {step}: parameters differ"
        m, v = opt.dequantized_moments(p)
        assert same_bits(m, m_state.dequantize()), f"{fmt} step {step}: exp_avg differs"
        assert same_bits(v, v_state.dequantize()), f"{fmt} step {step}: exp_avg_sq differs"


@pytest.mark.parametrize("fmt,cls", [("8bit", "AdamW8bit"), ("4bit", "AdamW4bit"), ("fp8", "AdamWFp8")])
def test_torchaos_optimizer_differs_only_by_torchs_sqrt(fmt, cls, monkeypatch):
    """torchao's optimizer itself (eager: torch.compile of its step takes a minute on a CPU). Its
    state after the first step is ours bit for bit; its parameters differ where torch's float32
    sqrt is not correctly rounded (1 ulp on under 1% of inputs), a difference of at most one
    rounding of the update."""
    import torchao.optim.adam as ao_adam
    monkeypatch.setattr(ao_adam.torch, "compile", lambda f, **k: f)
    torch.manual_seed(2)
    shape = (64, 128)
    p0, g = torch.randn(shape), torch.randn(shape) * 1e-2
    ours = torch.nn.Parameter(p0.clone())
    opt = AdamW([ours], lr=1e-2, weight_decay=0.1, moments=fmt, rule="torchao")
    ours.grad = g.clone()
    opt.step()
    theirs = torch.nn.Parameter(p0.clone())
    ao = getattr(torchao_optim, cls)([theirs], lr=1e-2, weight_decay=0.1)
    theirs.grad = g.clone()
    ao.step()
    m, v = opt.dequantized_moments(ours)
    assert same_bits(m, ao.state[theirs]["exp_avg"].dequantize())
    assert same_bits(v, ao.state[theirs]["exp_avg_sq"].dequantize())
    ulps = (bits(ours).long() - bits(theirs).long()).abs()
    assert int(ulps.max()) <= 1, "more than one float32 rounding apart"
    assert 0 < int((ulps > 0).sum()) < 0.05 * ulps.numel()
    # ... and only where torch's sqrt of the new exp_avg_sq is not the correctly rounded one.
    v_new = torch.zeros(shape).lerp(g.square(), 1 - 0.999)
    sqrt_differs = v_new.sqrt() != ieee_sqrt(v_new)
    assert not bool((ulps > 0)[~sqrt_differs].any())


# ---- Transformer Engine's fp16 and fp8 states ------------------------------------------------------

def te_quantize(x, fmt, scale_holder):
    """TE FusedAdam set_scaled_state: scale = absmax / max_range; fp16: x * (1 / scale) as half;
    fp8 (E4M3): quantizer scale 1 / scale, satfinite cast, dequantized with its reciprocal."""
    absmax = x.abs().max()
    scale = absmax / (32752.0 if fmt == "fp16" else 448.0)
    scale_holder[0] = scale
    if fmt == "fp16":
        r = torch.where(scale > 0, scale.reciprocal(), torch.zeros(()))
        return (x * r).half().float() * scale
    qs = torch.where(scale > 0, 1.0 / scale, torch.zeros(()))
    ds = torch.where(scale > 0, 1.0 / qs, torch.zeros(()))
    return (x * qs).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * ds


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_te_rule_equals_fused_adams_formula_bit_for_bit(fmt):
    torch.manual_seed(3)
    shape = (32, 160)
    p0 = torch.randn(shape)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.95, 1e-8, 0.05
    p = torch.nn.Parameter(p0.clone())
    opt = AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, moments=fmt, fp8_per_tensor=fmt == "fp8",
                rule="te")
    ref, m, v = p0.clone(), torch.zeros(shape), torch.zeros(shape)
    b1f, b2f = f32(b1), f32(b2)
    for step in range(1, 6):
        g = torch.randn(shape) * 1e-3
        p.grad = g.clone()
        opt.step()
        # TE's AdamFunctor (AdamW mode), in float32 without FMA.
        bc1 = torch.tensor(f32(1.0 - float(b1f) ** step))
        bc2 = torch.tensor(f32(1.0 - float(b2f) ** step))
        m = torch.tensor(b1f) * m + torch.tensor(f32(1) - b1f) * g
        v = torch.tensor(b2f) * v + (torch.tensor(f32(1) - b2f) * g) * g
        denom = ieee_sqrt(v / bc2) + f32(eps)
        update = (m / bc1) / denom + torch.tensor(f32(wd)) * ref
        ref = ref - torch.tensor(f32(lr)) * update
        holder = [None, None]
        m = te_quantize(m, fmt, holder)
        v = te_quantize(v, fmt, holder[1:])
        assert same_bits(p, ref), f"{fmt} step {step}: parameters differ"
        om, ov = opt.dequantized_moments(p)
        assert same_bits(om, m) and same_bits(ov, v), f"{fmt} step {step}: moments differ"


# ---- masters, skipping, scalers, checkpoints ------------------------------------------------------

def test_remainder_master_equals_the_fp32_master_bit_for_bit():
    torch.manual_seed(4)
    w = torch.randn(4096).bfloat16()
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    oa = AdamW([a], lr=3e-4, master="fp32", moments="bf16")
    ob = AdamW([b], lr=3e-4, master="remainder", moments="bf16")
    for _ in range(200):
        g = torch.randn(4096).bfloat16()
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert same_bits(oa.master_weights(a), ob.master_weights(b))
    tie = (bits(oa.master_weights(a)) & 0xFFFF) == 0x8000
    assert torch.equal(a.detach()[~tie], b.detach()[~tie])  # bf16 weights: equal except exact ties


def snapshot(opt, p):
    s = opt.state[p]
    return [p.detach().clone()] + [t.clone() for t in s.values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("moments", ["fp32", "fp8", "8bit"])
def test_a_skipped_step_writes_nothing_and_torch_grad_scaler_unscales_inside(moments):
    torch.manual_seed(5)
    w = torch.randn(64, 128)
    a, b = torch.nn.Parameter(w.bfloat16()), torch.nn.Parameter(w.bfloat16())
    oa = AdamW([a], lr=1e-3, master="remainder", moments=moments)
    ob = AdamW([b], lr=1e-3, master="remainder", moments=moments)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for step in range(4):
        g = torch.randn(64, 128)
        a.grad = g.bfloat16()
        oa.step()  # unscaled reference
        b.grad = (g.bfloat16().float() * 1024.0).bfloat16()
        before = snapshot(ob, b) if ob.state else None
        if step == 2:
            b.grad[3, 5] = float("inf")
        scaler.scale(torch.ones(()))  # torch's scaler starts its scale at the first scale() call
        scaler.step(ob)
        scaler.update()
        if step == 2:
            after = snapshot(ob, b)
            assert all(torch.equal(x, y) for x, y in zip(before, after)), "a skipped step changed the state"
            assert float(ob.state[b]["step"]) == 2
            a.grad = None  # keep the reference in step with the applied steps
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    assert float(ob.state[b]["step"]) == 3


def test_mixprec_grad_scaler_steps_it_and_skips_on_overflow():
    from mixprec.torch import GradScaler
    p = torch.nn.Parameter(torch.randn(4096).bfloat16())
    opt = AdamW([p], lr=1e-3, master="remainder", moments="fp8")
    scaler = GradScaler("cpu", init_scale=256.0)
    p.grad = torch.full((4096,), 1.0).bfloat16()
    assert scaler.step(opt).applied
    scaler.update()
    before = snapshot(opt, p)
    p.grad[0] = float("nan")
    assert not scaler.step(opt).applied
    assert all(torch.equal(x, y) for x, y in zip(before, snapshot(opt, p)))


def run_steps(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()


def test_state_dict_resumes_bit_for_bit_and_refuses_other_formats():
    torch.manual_seed(6)
    shapes = [(64, 64), (300,), (128, 32)]
    init = [torch.randn(s).bfloat16() for s in shapes]
    grads = [[torch.randn(s).bfloat16() for s in shapes] for _ in range(6)]
    kw = dict(lr=1e-2, master="remainder", moments=("fp8", "8bit"))
    full = [torch.nn.Parameter(x.clone()) for x in init]
    of = AdamW(full, **kw)
    run_steps(of, full, grads)
    half = [torch.nn.Parameter(x.clone()) for x in init]
    oh = AdamW(half, **kw)
    run_steps(oh, half, grads[:3])
    buf = io.BytesIO()
    torch.save(oh.state_dict(), buf)
    resumed = [torch.nn.Parameter(x.detach().clone()) for x in half]
    orr = AdamW(resumed, **kw)
    buf.seek(0)
    orr.load_state_dict(torch.load(buf))
    run_steps(orr, resumed, grads[3:])
    for a, b in zip(full, resumed):
        assert same_bits(a, b)
    assert orr.state[resumed[0]]["exp_avg"].dtype == torch.uint8
    other = AdamW([torch.nn.Parameter(x.clone()) for x in init], lr=1e-2, master="remainder", moments="bf16")
    buf.seek(0)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['moments'\]: expected \('bf16', 'bf16'\)"):
        other.load_state_dict(torch.load(buf))


def test_stochastic_rounding_repeats_by_seed():
    def run(seed):
        p = torch.nn.Parameter(torch.ones(8192).bfloat16())
        opt = AdamW([p], lr=1e-3, weight_decay=1.0, master="none", stochastic_rounding=True, seed=seed)
        p.grad = torch.zeros(8192).bfloat16()
        opt.step()
        return p.detach().clone()
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    up = float((a.float() > 0.999).float().mean())  # 1 * (1 - 1e-3) lies between two bf16 values
    assert 0.0 < up < 1.0


def test_measured_state_bytes_per_parameter():
    n = 1 << 16
    for master, moments, per_param in (("fp32", "fp32", 12.0), ("remainder", "bf16", 6.0),
                                       ("remainder", "fp8", 2 + 2 * (1 + 4 / 256)), ("none", "4bit", 2 * (0.5 + 4 / 128))):
        p = torch.nn.Parameter(torch.zeros(n).bfloat16())
        opt = AdamW([p], master=master, moments=moments)
        p.grad = torch.zeros(n).bfloat16()
        opt.step()
        b = opt.state_bytes()
        assert (b["master"] + b["m"] + b["v"]) / n == pytest.approx(per_param), (master, moments)
        assert sum(core.state_bytes_per_param(master, moments, moments)) == pytest.approx(per_param)


def test_bad_arguments_say_what_is_allowed():
    p = torch.nn.Parameter(torch.zeros(8).half())
    with pytest.raises(ValueError, match="moments \\(m\\): expected one of fp32, bf16, fp16, fp8, 8bit, 4bit, found 'int8'"):
        AdamW([p], moments="int8")
    with pytest.raises(ValueError, match="master='remainder' expected bfloat16"):
        AdamW([p], master="remainder")
    with pytest.raises(ValueError, match="stochastic_rounding: expected master='none'"):
        AdamW([p], stochastic_rounding=True)
    with pytest.raises(ValueError, match="block: expected 0 .* or a power of two in \\[32, 1024\\], found 100"):
        AdamW([p], moments="8bit", block=100)
    with pytest.raises(ValueError, match="betas\\[1\\]: expected a number in \\[0, 1\\)"):
        AdamW([p], betas=(0.9, 1.0))
