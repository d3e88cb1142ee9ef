"""The CUDA paths of mixprec.torch, run by scripts/device-check.sh on a machine with an NVIDIA GPU:
the GradScaler against torch.amp.GradScaler on CUDA in fp16 and bf16 (weights, scales and skipped
steps equal), Telemetry's counts of CUDA tensors against the core's counts of the same
tensors copied to the CPU, and the advisor's samples of CUDA tensors brought to the CPU as
their step ends. Skipped where torch.cuda.is_available() is false, unless
MIXPREC_TEST_DEVICE=cpu (what `scripts/device-check.sh --cpu` sets): then the same tests run on
CPU tensors with Telemetry(counting="torch"), so the script's logic and these tests' own are
exercised on every machine."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch; make test-python installs it")

from torch.utils.dlpack import to_dlpack  # noqa: E402

from mixprec import _core  # noqa: E402
from mixprec.torch import GradScaler, Telemetry  # noqa: E402

DEVICE = os.environ.get("MIXPREC_TEST_DEVICE", "cuda")
FORCED_CPU = DEVICE == "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device (scripts/device-check.sh runs these on a GPU; "
                                       "MIXPREC_TEST_DEVICE=cpu runs them on the CPU)")
FIELDS = ("elements", "nonzero", "nonfinite_input", "underflow", "subnormal", "overflow")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_equals_torch_amp_on_the_device(dtype):
    """Both scalers drive the same model, data and injected overflows: every weight, every scale
    and every skipped step equal."""
    runs = []
    for which in ("torch", "mixprec"):
        torch.manual_seed(0)
        model = Net().to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if which == "torch":
            scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0 ** 16, growth_interval=3)
        else:
            scaler = GradScaler(DEVICE, init_scale=2.0 ** 16, growth_interval=3)
        gen = torch.Generator().manual_seed(1)
        scales, skipped = [], []
        for step in range(12):
            x = (torch.randn(8, 32, generator=gen) * 4).to(DEVICE)
            with torch.autocast(DEVICE, dtype=dtype):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step in (4, 9):
                model.fc1.weight.grad[0, 0] = math.inf if step == 4 else math.nan
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
            scaler.update()
            scales.append(float(scaler.get_scale()))
            opt.zero_grad()
        runs.append(([p.detach().cpu() for p in model.parameters()], scales, skipped))
    (wa, sa, ka), (wb, sb, kb) = runs
    assert sa == sb
    assert ka == kb and ka[4] and ka[9]
    for a, b in zip(wa, wb):
        assert torch.equal(a, b)


def core_counts(t: torch.Tensor):
    return dict(zip(FIELDS + ("amax",), _core.count_to_f16(to_dlpack(t.detach().cpu().contiguous()))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_telemetry_counts_on_the_device_equal_the_cores_on_the_same_tensors(tmp_path, dtype):
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    tel = Telemetry(model, str(tmp_path / "run"), precision=precision, sample_every=1, histogram_every=1,
                    counting="torch" if FORCED_CPU else "auto")
    seen = {}

    def capture(name):
        def hook(module, inputs, output):
            output.register_hook(lambda g: seen.setdefault(name, []).append(g.detach().cpu().clone()))
        return hook

    handles = [dict(model.named_modules())[n].register_forward_hook(capture(n)) for n in ("fc1", "act", "fc2")]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = (torch.randn(2, 16, 32) * 3).to(DEVICE)
    for micro in range(2):
        with torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x[micro]).float().pow(2).mean() * 1e-4  # small gradients: fp16 flushes some
        loss.backward()
    opt.step()
    line = tel.record(None, loss=loss.item())
    for h in handles:
        h.remove()
    by_name = {t["name"]: t for t in line["act_grad_tensors"]}
    for name, grads in seen.items():
        want = {k: 0 for k in FIELDS}
        amax = 0.0
        for g in grads:
            c = core_counts(g)
            for k in FIELDS:
                want[k] += c[k]
            amax = max(amax, c["amax"])
        assert {k: by_name[name][k] for k in FIELDS} == want, name
        assert np.float32(by_name[name]["amax"]) == np.float32(amax), name  # the log: float32's shortest form
    params = {p["name"]: p for p in line["params"]}
    for name, p in model.named_parameters():
        assert np.float32(params[name]["grad_amax"]) == np.float32(core_counts(p.grad)["amax"]), name
        assert np.float32(params[name]["weight_amax"]) == np.float32(core_counts(p)["amax"]), name
    # The histograms: the core's of the same values, read on the host.
    hist = line["histograms"]
    assert sum(hist["weights"]["counts"]) + hist["weights"]["zeros"] + hist["weights"]["nonfinite"] == \
        sum(p.numel() for p in model.parameters())
    tel.close()
    # Written and readable by the core's reader.
    log = [json.loads(s) for s in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[0]["act_grads"] == line["act_grads"]


def test_advisor_samples_on_the_device_come_to_the_cpu_as_their_step_ends():
    # The sampler holds x and dy by reference during the step; take_held() moves what lies on a
    # device to the CPU, so that no device memory outlives the step (docs/advisor.md).
    import mixprec.torch
    Sampler = mixprec.torch.advise.__globals__["Sampler"]
    torch.manual_seed(0)
    net = Net().to(DEVICE)
    sampler = Sampler(net)
    sampler.active = True
    x = torch.randn(8, 32, device=DEVICE)
    net(x).square().sum().backward()
    held = {(n, r): t for n, r, _, _, _, t, _ in sampler.take_held(1, 1.0)}
    sampler.remove()
    assert sorted(held) == sorted((n, r) for n in ("fc1", "fc2") for r in ("x", "w", "dy", "dw"))
    assert all(t.is_cpu for t in held.values())
    assert torch.equal(held[("fc1", "x")], x.cpu())
    for n in ("fc1", "fc2"):
        layer = getattr(net, n)
        assert torch.equal(held[(n, "w")], layer.weight.detach().cpu())
        assert torch.equal(held[(n, "dw")], layer.weight.grad.cpu())
