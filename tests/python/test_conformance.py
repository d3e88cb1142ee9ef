"""The GradScaler conformance cases (tests/scaler/conformance/cases.json) against
mixprec.torch.GradScaler: the same list the core and libtorch doors run, with the same
outcomes, states and error classes (docs/loss_scaling.md, "Conformance")."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")

import mixprec  # noqa: E402
from mixprec.torch import GradScaler  # noqa: E402

torch.set_num_threads(1)

CASES = json.loads((pathlib.Path(__file__).parent.parent / "scaler" / "conformance" / "cases.json").read_text())["cases"]
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
ASSERTION_KINDS = {"step_without_checks", "update_without_checks"}  # torch raises AssertionError for these


class OptimizerRaised(RuntimeError):
    pass


class ThrowingSGD(torch.optim.SGD):
    """SGD that raises once when asked (an optimizer that throws mid-step)."""

    throw_once = False

    def step(self, closure=None):
        if self.throw_once:
            self.throw_once = False
            raise OptimizerRaised("the optimizer raised (as the case asked)")
        return super().step(closure)


def value(v):
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[v] if isinstance(v, str) else float(v)


def make_scaler(preset, overrides, enabled):
    return GradScaler(preset=preset, enabled=enabled, **overrides)


def error_class(e: BaseException) -> str:
    if hasattr(e, "kind"):
        want_base = AssertionError if e.kind in ASSERTION_KINDS else RuntimeError
        assert isinstance(e, want_base), f"{e.kind} raised as {type(e).__mro__}"
        return e.kind
    if isinstance(e, mixprec.ScaleCollapseError):
        return "scale_collapse"
    if isinstance(e, OptimizerRaised):
        return "optimizer_raised"
    if isinstance(e, (ValueError, KeyError, TypeError)):
        return "invalid_state"
    return f"unexpected: {type(e).__name__}: {e}"


@pytest.mark.parametrize("case", [c for c in CASES if "python" in c.get("doors", ["python"])], ids=lambda c: c["name"])
def test_case(case):
    preset, overrides, enabled = case["preset"], case.get("overrides", {}), case.get("enabled", True)
    scaler = make_scaler(preset, overrides, enabled)
    params, opts = [], []
    for dtypes in case["optimizers"]:
        ps = [(torch.arange(1, 5, dtype=torch.float32) * 0.25 + 0.125 * j).to(DTYPES[d]).requires_grad_(True)
              for j, d in enumerate(dtypes)]
        params.append(ps)
        opts.append(ThrowingSGD(ps, lr=1.0 / 16))
    snapshot = [None] * len(opts)
    saved = None
    for at, op in enumerate(case["ops"]):
        what = f"{case['name']} op {at} {op}"
        kind, i = op["op"], op.get("opt", 0)
        out = None
        try:
            if kind == "grads":
                for p, d, v in zip(params[i], case["optimizers"][i], op["values"]):
                    p.grad = None if v is None else torch.tensor([value(x) for x in v], dtype=torch.float64).to(DTYPES[d])
                snapshot[i] = [p.detach().clone() for p in params[i]]
            elif kind == "unscale":
                scaler.unscale_(opts[i])
            elif kind == "step":
                out = scaler.step(opts[i])
            elif kind == "update":
                scaler.update()
            elif kind == "backward_done":
                scaler.backward_done()
            elif kind == "set_accumulation_steps":
                scaler.set_accumulation_steps(op["k"])
            elif kind == "save":
                saved = scaler.state_dict()
            elif kind == "load_saved":
                scaler.load_state_dict(saved)
            elif kind == "load_json":
                scaler.load_state_dict(op["state"])
            elif kind == "fresh_scaler":
                scaler = make_scaler(op["preset"], {}, enabled) if "preset" in op else make_scaler(preset, overrides, enabled)
            elif kind == "reconfigure":
                setter = {"growth_factor": (scaler.set_growth_factor, float),
                          "backoff_factor": (scaler.set_backoff_factor, float),
                          "growth_interval": (scaler.set_growth_interval, int)}[op["key"]]
                setter[0](setter[1](op["value"]))
            elif kind == "throw_next_step":
                opts[i].throw_once = True
            elif kind in ("scale", "next_scale"):
                got = scaler.get_scale() if kind == "scale" else scaler._next_scale()
                assert got == value(op["value"]), what
            elif kind == "grads_are":
                got = [p.grad for p in params[i] if p.grad is not None]
                assert len(got) == len(op["values"]), what
                for g, d, want in zip(got, case["optimizers"][i], op["values"]):
                    expect = torch.tensor([value(x) for x in want], dtype=torch.float64).to(DTYPES[d])
                    assert torch.equal(g, expect), f"{what}: {g.tolist()} != {expect.tolist()}"
            elif kind == "weights":
                moved = any(not torch.equal(p.detach(), s) for p, s in zip(params[i], snapshot[i]))
                assert moved == op["moved"], what
            elif kind == "state":
                state = scaler.state_dict()
                for k, v in op["fields"].items():
                    assert k in state, f"{what}: no field {k} in {state}"
                    assert float(state[k]) == float(v), f"{what}: field {k} is {state[k]}"
            else:
                pytest.fail(f"{what}: unknown op")
        except AssertionError as e:
            if not hasattr(e, "kind"):
                raise
            error = e
        except Exception as e:  # noqa: BLE001
            error = e
        else:
            error = None
        if "error" in op:
            assert error is not None, f"{what}: expected error {op['error']}"
            assert error_class(error) == op["error"], f"{what}: {error!r}"
            continue
        assert error is None, f"{what}: unexpected error {error!r}"
        if kind == "step":
            expect = dict(op)
            expect.update(op.get("torch_dialect", {}))
            for k, got in (("applied", out.applied), ("found_inf", out.found_inf), ("first_overflow", out.first_overflow)):
                if k in expect:
                    assert got == expect[k], f"{what}: {k} {got}"


def test_the_list_has_at_least_forty_cases_and_python_runs_them_all():
    assert len(CASES) >= 40
    assert all("python" in c.get("doors", ["python"]) for c in CASES)
