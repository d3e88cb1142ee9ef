"""The path a GPU user runs, run here on CPU tensors: mixprec.torch.Telemetry's counting with
torch operations (mixprec/torch/_device_counts.py) against the core's counting pass, element
class by element class and over every 16-bit code; whole runs with counting="torch" against
counting="auto" (the log lines equal, histograms included); the GradScaler's gradient |max|
from its own pass against Telemetry's separate measurement; and the GradScaler's ATen path
(the one of CUDA gradients) forced on CPU gradients against the core's fused kernel, bitwise."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch; make test-python installs it")

from torch.utils.dlpack import to_dlpack  # noqa: E402

from mixprec import _core  # noqa: E402
from mixprec.torch import GradScaler, Telemetry  # noqa: E402
from mixprec.torch import _device_counts as dev  # noqa: E402

torch.set_num_threads(1)

FIELDS = ("elements", "nonzero", "nonfinite_input", "underflow", "subnormal", "overflow", "amax")


def core_counts(t: torch.Tensor):
    return dict(zip(FIELDS, _core.count_to_f16(to_dlpack(t.contiguous()))))


def torch_counts(t: torch.Tensor):
    """The device path's numbers, as the recorder turns them into counts."""
    c = dev.counted(t)
    p = dev.profile(c).tolist()
    return dict(zip(FIELDS, _core.count_from_profile(dev.dtype_name(c), c.numel(), p[:5], p[5])))


def classes_of(t: torch.Tensor):
    """Each element's class under the core's count (one element at a time): the class tensors."""
    names = []
    for x in t.reshape(-1):
        c = core_counts(x.reshape(1))
        if c["nonfinite_input"]:
            name = "nan" if bool(torch.isnan(x)) else "inf"
        elif not c["nonzero"]:
            name = "zero"
        elif c["underflow"]:
            name = "underflow"
        elif c["subnormal"]:
            name = "subnormal"
        elif c["overflow"]:
            name = "overflow"
        else:
            name = "normal"
        names.append(name)
    out = {}
    for name in sorted(set(names)):
        idx = torch.tensor([i for i, n in enumerate(names) if n == name])
        out[name] = t.reshape(-1)[idx]
    return out


def all_codes(dtype):
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16bit_code_counts_alike_on_both_paths(dtype):
    codes = all_codes(dtype)
    assert torch_counts(codes) == core_counts(codes)
    # Element class by element class: each class alone, both paths, every code of it.
    by_class = {}
    m = codes.view(torch.int16).to(torch.int32) & 0x7FFF
    b = _core.count_bounds(dev.dtype_name(codes))
    inf_bits = b[4] + 1
    masks = {"zero": m == 0, "underflow": (m > 0) & (m <= b[1]), "subnormal": (m > b[1]) & (m <= b[2]),
             "normal": (m > b[2]) & (m <= b[3]), "overflow": (m > b[3]) & (m <= b[4]), "inf": m == inf_bits,
             "nan": m > inf_bits}
    for name, mask in masks.items():
        part = codes[mask]
        by_class[name] = part.numel()
        if part.numel() == 0:
            continue
        got, want = torch_counts(part), core_counts(part)
        assert got == want, (name, got, want)
    # The classes as the core tells them apart, one element at a time, on a sample of each.
    sample = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(1))[:3000]]
    for name, part in classes_of(sample).items():
        assert torch_counts(part) == core_counts(part), name
    if dtype == torch.float16:
        assert by_class["underflow"] == 0 and by_class["overflow"] == 0  # fp16 as stored: nothing rounds
    else:
        assert min(by_class.values()) > 0  # every class is reached by some bf16 code


def test_float32_words_around_every_bound_and_at_random():
    bounds = _core.count_bounds("float32")
    words = [w + d for w in list(bounds) + [0x387FE000, 0x7F800000, 1] for d in range(-300, 301)]
    words = [w for w in words if 0 <= w <= 0x7FFFFFFF]
    rng = np.random.default_rng(5)
    words += rng.integers(0, 2 ** 31, 20000).tolist()
    x = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([x, -x])
    assert torch_counts(x) == core_counts(x)
    for name, part in classes_of(x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))[:4000]]).items():
        assert torch_counts(part) == core_counts(part), name
    # Other dtypes are counted as float32 on both paths (the core path converts them too).
    d = torch.tensor([1e-300, 1e-8, 1.0, 7e4, math.inf, -math.nan], dtype=torch.float64)
    assert torch_counts(d) == core_counts(d.float())
    # A strided view and an empty tensor.
    s = x[::7]
    assert torch_counts(s) == core_counts(s.contiguous())
    assert torch_counts(x[:0]) == core_counts(x[:0])


def test_histograms_and_nonfinite_and_amax_equal_the_cores():
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(5000) * np.exp2(rng.integers(-150, 120, 5000))).astype(np.float32)
    v[100:110] = np.float32(3e38)
    v[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45]
    x = torch.from_numpy(v)
    for t in (x, x.to(torch.float16), x.to(torch.bfloat16)):
        for stride in (1, dev.HISTOGRAM_STRIDE):
            got = dev.histogram(t, stride).tolist()
            want = _core.log2_histogram(to_dlpack(t), stride)
            assert got == want, (t.dtype, stride)
        assert dev.nonfinite(t).item() == 1
        assert dev.nonfinite(t[10:]).item() == int(not bool(torch.isfinite(t[10:].float()).all()))
    finite = x[6:]
    finite = finite[torch.isfinite(finite)]
    tensors = [finite, x, finite.to(torch.bfloat16), x[:0], finite.to(torch.float16)]
    bits, order = dev.amax_bits(tensors)
    got = {i: dev.f32_from_bits(b) for i, b in zip(order, bits.tolist())}
    assert 3 not in got  # empty: left out, its |max| is 0
    for i in (0, 1, 2, 4):
        assert got[i] == core_counts(tensors[i])["amax"], i


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 48)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(48, 8)
        self.poison_at = None
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.act(self.fc1(x))
        if self.calls == self.poison_at:
            h = h * math.inf
        return self.fc2(h)


def run_lines(tmp: pathlib.Path, counting: str, dtype, fused: bool = True, steps: int = 6, clip: bool = False):
    """A small training run recorded by Telemetry; returns its log lines without the timing."""
    torch.manual_seed(0)
    model = Net()
    model.poison_at = 5  # a forward overflow in step 3, a sampled one (two micro-batches a step)
    scaler = GradScaler("cpu", preset="torch", init_scale=2.0 ** 14, growth_interval=2,
                        enabled=dtype == torch.float16)
    tel = Telemetry(model, str(tmp / f"{counting}-{fused}-{clip}"), precision={torch.float16: "fp16",
                    torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype], scaler=scaler, sample_every=2,
                    histogram_every=3, counting=counting)
    if not fused:
        scaler._telemetry_amax = False
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(2):
            x = torch.randn(4, 16, generator=gen) * 3
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(x).float().pow(2).mean() * 1e-3
            scaler.scale(loss).backward()
        coef = 1.0
        if clip:
            scaler.unscale_(opt)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
            coef = min(1.0, 1e-3 / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        outcome = scaler.step(opt) if scaler.is_enabled() else (opt.step(), None)[1]
        tel.record(outcome, loss=loss.item(), seconds=0.5, clip_coef=coef if coef > 0 else 1.0)
        scaler.update()
        opt.zero_grad()
    reads = tel._host_reads
    tel.close()
    # The device path reads its results once per step; the core path never copies.
    assert reads == (steps if counting == "torch" else 0)
    return [json.loads(line) for line in (tmp / f"{counting}-{fused}-{clip}" / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_run_counted_by_torch_operations_logs_what_the_core_logs(tmp_path, dtype):
    core = run_lines(tmp_path, "auto", dtype)
    device = run_lines(tmp_path, "torch", dtype)
    assert len(core) == len(device) == 6
    assert any("histograms" in line for line in core)
    assert any(line["forward_nonfinite"] for line in core)
    assert any(line["act_grads"]["elements"] > 0 for line in core)
    for a, b in zip(core, device):
        assert a == b


def test_the_scalers_gradient_max_equals_telemetrys_own_measurement(tmp_path):
    fused = run_lines(tmp_path, "auto", torch.float16, fused=True)
    measured = run_lines(tmp_path, "auto", torch.float16, fused=False)
    assert any(line["skipped"] for line in fused)  # the overflow step is measured, as it always was
    assert fused == measured


def test_clipped_steps_record_the_unclipped_gradient_max(tmp_path):
    """With clipping, the scaler's pass gives the |max| before clipping exactly; Telemetry's own
    measurement divides the clipped one back (within a rounding of the clipped values)."""
    fused = run_lines(tmp_path, "auto", torch.float16, fused=True, clip=True)
    measured = run_lines(tmp_path, "auto", torch.float16, fused=False, clip=True)
    clipped = [i for i, line in enumerate(fused) if line["clip_coef"] < 1 and not line["skipped"]]
    assert clipped
    for i in clipped:
        for a, b in zip(fused[i]["params"], measured[i]["params"]):
            assert a["grad_amax"] == pytest.approx(b["grad_amax"], rel=2e-3), a["name"]


def grads_like(dtype, scale_exp: int):
    gen = torch.Generator().manual_seed(scale_exp + 100)
    shapes = [(33, 17), (5,), (4, 3, 2, 2)]
    out = []
    for s in shapes:
        g = torch.randn(s, generator=gen) * 2.0 ** torch.randint(-30, 30, s, generator=gen).float()
        out.append(g.to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [2.0 ** 16, 1.0, 0.25, 2.0 ** -140])
@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_the_aten_path_forced_on_cpu_equals_the_fused_kernel_bitwise(dtype, scale, poison, monkeypatch):
    from mixprec.torch import grad_scaler
    calls = []
    aten_check = grad_scaler._check_gradients_aten
    monkeypatch.setattr(grad_scaler, "_check_gradients_aten", lambda *a: calls.append(1) or aten_check(*a))
    results = []
    for aten in (False, True):
        params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32).to(dtype)) for g in grads_like(dtype, 0)]
        for p, g in zip(params, grads_like(dtype, 0)):
            p.grad = g.clone()
        if poison:
            params[1].grad[2] = math.inf if poison == "inf" else math.nan
        opt = torch.optim.SGD(params, lr=0.0)
        scaler = GradScaler("cpu", preset="torch")
        # torch.amp's state at this scale (2^-140: reached by backoffs, refused as a starting scale)
        scaler.load_state_dict(dict(scale=scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                                    _growth_tracker=0))
        scaler._aten_only = aten
        outcome = scaler.step(opt)
        assert bool(calls) == aten  # the forced run took ATen's path, the other the core's
        results.append((outcome, [p.grad.clone() for p in params]))
    (a, ga), (b, gb) = results
    assert (a.applied, a.found_inf, a.first_overflow) == (b.applied, b.found_inf, b.first_overflow)
    for x, y in zip(ga, gb):
        assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32))
    if a.found_inf:
        assert math.isinf(a.grad_norm) or math.isnan(a.grad_norm)
        assert not math.isfinite(b.grad_norm)
    else:
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)  # a norm in fp32 there, exact here
