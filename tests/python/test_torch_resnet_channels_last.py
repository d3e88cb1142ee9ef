"""A channels_last ResNet-18 trains bitwise equal under mixprec.torch.GradScaler and
torch.amp.GradScaler.

torchvision's resnet18 (random init, 10 classes) in channels_last, inputs 2x3x64x64 in
channels_last, under CPU autocast: bfloat16 with SGD (momentum, weight decay) and float16 with
AdamW. Growth interval 1 and an inf written into a convolution's weight gradient (channels_last)
at the middle step of three: each run grows, skips with a back-off, and grows again. Two copies
of the model, one per scaler, step in lockstep; after every step the weights, the BatchNorm
buffers, the gradients (unscaled in place), the optimizer state and the scaler state (scale,
growth tracker, torch.amp's state_dict keys, skip or step) must be bitwise equal. (Three steps
because a step of this model costs 1.5-2 s of CPU here: torch runs bfloat16 and float16
convolutions on its slow reference path on this AVX2 CPU.)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")
import torchvision  # noqa: E402  (in the test venv, scripts/deps.sh: missing fails, it does not skip)

import mixprec.torch  # noqa: E402

torch.set_num_threads(1)

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def channels_last_resnet18():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    return model.to(memory_format=torch.channels_last).train()


def make_optimizer(name, model):
    if name == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def batches(steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(2, 3, 64, 64, generator=g).contiguous(memory_format=torch.channels_last)
        yield x, torch.randint(0, 10, (2,), generator=g)


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitwise(what, a, b):
    """Same dtype, shape, strides and bit patterns (NaN payloads included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.stride() == b.stride(), f"{what}: strides {a.stride()} vs {b.stride()}"
    bits = BITS[a.element_size()]
    assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), what


# dtype, optimizer, scaler arguments, steps, {step: parameter whose gradient gets an inf}.
# bfloat16 at torch's initial scale 2^16; float16 from 2^10, below where this model's float16
# gradients overflow by themselves (2^16 does at the first step), so that every skip is injected.
RUNS = {
    "bf16-sgd_momentum": (torch.bfloat16, "sgd_momentum", dict(growth_interval=1), 3,
                          {1: "layer1.0.conv1.weight"}),
    "fp16-adamw": (torch.float16, "adamw", dict(init_scale=2.0**10, growth_interval=1), 3,
                   {1: "conv1.weight"}),
}


@pytest.mark.parametrize("run", RUNS)
def test_channels_last_resnet18_trains_bitwise_equal_to_torch_amp(run):
    dtype, optimizer, scaler_args, steps, inject = RUNS[run]
    models = {"torch.amp": channels_last_resnet18(), "mixprec": channels_last_resnet18()}
    optimizers = {k: make_optimizer(optimizer, m) for k, m in models.items()}
    scalers = {"torch.amp": torch.amp.GradScaler("cpu", **scaler_args),
               "mixprec": mixprec.torch.GradScaler("cpu", **scaler_args)}
    scalers["mixprec"].set_names(models["mixprec"])
    conv = models["mixprec"].layer1[0].conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    events = []
    for step, (x, y) in enumerate(batches(steps)):
        skipped = {}
        for kind, model in models.items():
            opt, scaler = optimizers[kind], scalers[kind]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            grad = model.get_parameter("layer1.0.conv1.weight").grad
            # the layout under test: channels_last gradients, not contiguous ones
            assert grad.is_contiguous(memory_format=torch.channels_last) and not grad.is_contiguous()
            if step in inject:
                with torch.no_grad():
                    model.get_parameter(inject[step]).grad[3, 1, 0, 2] = float("inf")
            scale_before = scaler.get_scale()
            outcome = scaler.step(opt)
            if kind == "torch.amp":
                skipped[kind] = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
            else:
                skipped[kind] = not outcome.applied
                assert outcome.found_inf == skipped[kind]
                if step in inject:
                    assert outcome.first_overflow_name == inject[step]
            scaler.update()
            scale_after = scaler.get_scale()
            if kind == "mixprec":
                events.append("skip+backoff" if scale_after < scale_before else
                              "growth" if scale_after > scale_before else "step")
        assert skipped["torch.amp"] == skipped["mixprec"], f"step {step}: skip decisions differ: {skipped}"
        assert skipped["mixprec"] == (step in inject), f"step {step}: an overflow nobody injected (scale too high?)"
        a, b = models["torch.amp"], models["mixprec"]
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert_bitwise(f"step {step}: {name}", pa.detach(), pb.detach())
            assert_bitwise(f"step {step}: {name}.grad", pa.grad, pb.grad)
            sa, sb = optimizers["torch.amp"].state[pa], optimizers["mixprec"].state[pb]
            assert sa.keys() == sb.keys(), f"step {step}: {name}: optimizer state keys"
            for k in sa:
                assert_bitwise(f"step {step}: {name}: optimizer state {k}", sa[k], sb[k])
        for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers()):
            assert_bitwise(f"step {step}: buffer {name}", ba, bb)
        ta, tb = scalers["torch.amp"], scalers["mixprec"]
        assert ta.get_scale() == tb.get_scale(), f"step {step}: scale"
        assert ta._get_growth_tracker() == tb._get_growth_tracker(), f"step {step}: growth tracker"
        sda, sdb = ta.state_dict(), tb.state_dict()
        assert {k: sda[k] for k in TORCH_KEYS} == {k: sdb[k] for k in TORCH_KEYS}, f"step {step}: state_dict"
    # The run covered what it is meant to: growth, a skipped step with its back-off, growth.
    assert events == ["skip+backoff" if step in inject else "growth" for step in range(steps)], events
