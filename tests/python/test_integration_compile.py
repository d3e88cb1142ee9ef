"""torch.compile with mixprec.torch.GradScaler and Telemetry (docs/python.md, "torch.compile"): a
compiled model trains as the eager one (bit for bit where torch.amp's own compiled run equals its
eager run, else within the documented tolerance), Telemetry's hooks on the compiled submodules
count what they count in eager mode, the scaler adds no graph break (as torch.amp.GradScaler adds
none) and Telemetry's hooks are counted: each is a break (they hand real tensors to the core).

The backend is aot_eager (Dynamo's graph capture and AOTAutograd, eager kernels: seconds to
compile); MIXPREC_COMPILE_BACKEND=inductor runs the same test on inductor (minutes to compile on
this machine the first time; torch.amp itself is not bitwise there, so the tolerance applies)."""

from __future__ import annotations

import math
import os
from typing import List, Tuple

import torch

from integration_support import skip_without_integrations

skip_without_integrations()
import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from mixprec.torch import GradScaler, Telemetry  # noqa: E402

BACKEND = os.environ.get("MIXPREC_COMPILE_BACKEND", "aot_eager")
STEPS, INJECT = 6, 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.act = torch.nn.GELU()
        self.ln = torch.nn.LayerNorm(64)
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(self.ln(self.act(self.fc1(x))))


def run(tmp_path, compiled: bool, scaler_kind: str, telemetry: bool):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = GradScaler(growth_interval=3) if scaler_kind == "mixprec" else torch.amp.GradScaler("cpu", growth_interval=3)
    if scaler_kind == "mixprec":
        scaler.set_names(net)
    tel = None
    if telemetry:
        name = f"run-{'compiled' if compiled else 'eager'}"
        tel = Telemetry(net, out=str(tmp_path / name), scaler=scaler, sample_every=1)   # the module, not the wrapper
    model = torch.compile(net, backend=BACKEND) if compiled else net
    lines = []
    for step in range(1, STEPS + 1):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == INJECT:
            net.fc2.weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        outcome = scaler.step(opt)
        if tel is not None:
            lines.append(tel.record(outcome, loss=loss.item()))
        scaler.update()
        opt.zero_grad()
    if tel is not None:
        tel.close()
    breaks = sum(counters["graph_break"].values())
    return [p.detach().clone() for p in net.parameters()], lines, breaks, scaler.get_scale()


def counts(lines: List[dict]) -> List[Tuple]:
    """What Telemetry counted, step by step (not the times)."""
    keys = ("elements", "nonzero", "underflow", "subnormal", "overflow", "nonfinite_input")
    return [(l["step"], l["skipped"], l["overflow_param"], tuple(l["act_grads"][k] for k in keys),
             tuple((t["name"],) + tuple(t[k] for k in keys) for t in l["act_grad_tensors"])) for l in lines]


def max_abs(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_compiled_equals_eager_and_telemetry_counts_the_same(tmp_path):
    eager_torch, _, _, _ = run(tmp_path, False, "torch", False)
    compiled_torch, _, torch_breaks, torch_scale = run(tmp_path, True, "torch", False)
    compiled_mixprec, _, mixprec_breaks, mixprec_scale = run(tmp_path, True, "mixprec", False)
    eager_tel, eager_lines, _, _ = run(tmp_path, False, "mixprec", True)
    compiled_tel, compiled_lines, tel_breaks, _ = run(tmp_path, True, "mixprec", True)

    # The scaler: no graph break (torch.amp's: none either); the same run as torch.amp's, compiled
    assert mixprec_breaks == torch_breaks == 0
    assert max_abs(compiled_mixprec, compiled_torch) == 0.0 and mixprec_scale == torch_scale
    assert max_abs(eager_tel, eager_torch) == 0.0                 # eager drop-in (with Telemetry's hooks)
    # Telemetry's hooks: each watched module's hook is a break (4 modules here); counted, bounded
    assert 0 < tel_breaks <= 3 * 4, tel_breaks
    assert [l["skipped"] for l in compiled_lines] == [s == INJECT for s in range(1, STEPS + 1)]
    assert compiled_lines[INJECT - 1]["overflow_param"] == "fc2.weight"
    assert all(len(l["act_grad_tensors"]) == 4 for l in compiled_lines)   # every hook ran, every step

    if max_abs(compiled_torch, eager_torch) == 0.0:
        # torch is bitwise here (aot_eager): so is mixprec with Telemetry, and so are the counts
        assert max_abs(compiled_tel, eager_tel) == 0.0
        assert counts(compiled_lines) == counts(eager_lines)
    else:
        # inductor: within twice torch.amp's own compiled-vs-eager difference; counts within 0.1%
        torch_diff = max_abs(compiled_torch, eager_torch)
        assert max_abs(compiled_tel, eager_tel) <= 2 * torch_diff
        for c, e in zip(counts(compiled_lines), counts(eager_lines)):
            assert c[:3] == e[:3]
            for ct, et in zip(c[4], e[4]):
                assert ct[:3] == et[:3]   # name, elements, nonzero
                assert all(abs(a - b) <= max(1, 0.001 * et[2]) for a, b in zip(ct[3:], et[3:]))
