"""mixprec.torch reads gradients as the core's routing decides (scaler/grad_route.hpp), the
libtorch door's decisions word for word: each kind of tensor torch has gets its route, the
refusals the core's messages, the dense-tensor helper the core's rule, and StepOutcome the
core's fields with their meanings."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")

from mixprec import _core  # noqa: E402
from mixprec.torch import GradScaler, StepOutcome  # noqa: E402
from mixprec.torch.grad_scaler import _core_block, _describe  # noqa: E402

torch.set_num_threads(1)


def route(t):
    return _core.route_gradient(_describe(t), False)


@pytest.mark.parametrize("make,expected", [
    (lambda: torch.randn(4, 3), ("core", False)),
    (lambda: torch.randn(4, 3).to(torch.float16), ("core", False)),
    (lambda: torch.randn(4, 3).to(torch.bfloat16), ("core", False)),
    (lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), ("core", False)),
    (lambda: torch.randn(3, 4, 5).permute(2, 0, 1), ("core", False)),
    (lambda: torch.randn(5, 3).to(torch.float16).t(), ("core", False)),
    (lambda: torch.randn(8, 6)[:, :5], ("aten", False)),
    (lambda: torch.randn(1, 5).expand(3, 5), ("aten", False)),
    (lambda: torch.randn(7, dtype=torch.float64), ("aten", False)),
    (lambda: torch.randn(7).to(torch.float8_e4m3fn), ("aten", False)),
    (lambda: torch.randn(5, 3).to_sparse(), ("sparse_values", False)),
    (lambda: torch.randn(5, 3).to(torch.float16).to_sparse(), ("sparse_values", True)),
    (lambda: torch.randn(5, 3).to(torch.bfloat16).to_sparse(), ("sparse_values", False)),
])
def test_each_kind_of_tensor_gets_its_route(make, expected):
    t = make()
    assert route(t) == expected
    if expected[0] == "core":
        assert _core.route_gradient(_describe(t), True) == ("aten", False), "aten_only"


@pytest.mark.parametrize("layout,name", [("sparse_csr", "SparseCsr"), ("sparse_csc", "SparseCsc"),
                                         ("sparse_bsr", "SparseBsr"), ("sparse_bsc", "SparseBsc")])
def test_other_layouts_are_refused_with_the_cores_message(layout, name):
    p = torch.zeros(2, 2, requires_grad=True)
    p.grad = torch.full((2, 2), 2.0)
    dense = torch.ones(2, 2)
    w = {"sparse_csr": dense.to_sparse_csr, "sparse_csc": dense.to_sparse_csc,
         "sparse_bsr": lambda: dense.to_sparse_bsr((1, 1)), "sparse_bsc": lambda: dense.to_sparse_bsc((1, 1))}[layout]()
    w.grad = w.clone()  # torch gives a parameter a gradient of its own layout only
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["params"].append(w)
    scaler = GradScaler()
    scaler.set_names({"p": p, "w": w})
    with pytest.raises(ValueError) as e:
        scaler.step(opt)
    assert str(e.value) == (f"the gradient of w has layout {name}; GradScaler takes strided and sparse COO "
                            "gradients, as torch.amp.GradScaler does")
    assert torch.equal(p.grad, torch.full((2, 2), 2.0)), "nothing touched"


def test_meta_and_non_floating_gradients_are_refused_with_the_cores_messages():
    d = _describe
    names = lambda i: ["p", "w"][i]  # noqa: E731
    good = d(torch.ones(3))
    with pytest.raises(ValueError) as e:
        _core.route_gradients([good, d(torch.ones(3, device="meta"))], [0, 1], False, names)
    assert str(e.value) == ("the gradient of w is a meta tensor (no values to check); GradScaler checks gradients "
                            "on the CPU, CUDA or another device with memory")
    for dtype, text in ((torch.int64, "int64"), (torch.complex64, "complex64"), (torch.bool, "bool")):
        with pytest.raises(TypeError) as e:
            _core.route_gradients([good, d(torch.ones(3, dtype=dtype))], [0, 1], False, names)
        assert str(e.value) == f"the gradient of w has dtype {text}; gradients must be floating point"
    # The door: an optimizer that holds an integer tensor with a gradient.
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), 2.0)
    q = torch.zeros(3, dtype=torch.int64)
    q.grad = torch.zeros(3, dtype=torch.int64)
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["params"].append(q)
    with pytest.raises(TypeError) as e:
        GradScaler().step(opt)
    assert str(e.value) == "the gradient of param[1] has dtype int64; gradients must be floating point"
    assert torch.equal(p.grad, torch.full((3,), 2.0)), "nothing touched"
    # Two devices: the core compares torch's device names.
    with pytest.raises(ValueError) as e:
        _core.route_gradients([good, ("torch.float32", True, "torch.strided", "cuda:0", (3,), (1,))], [0, 4],
                              False, lambda i: f"n{i}")
    assert str(e.value) == ("gradients on more than one device: n0 on cpu, n4 on cuda:0; use one GradScaler step "
                            "per device's optimizer")


def test_the_dense_tensor_helper_is_torchs_non_overlapping_and_dense():
    """_core_block (telemetry's weights, the scaler's route "core"): a view of the tensor's own
    memory exactly when torch calls it non-overlapping and dense, on CPU float32/16/bf16."""
    prims = pytest.importorskip("torch._prims_common")
    is_non_overlapping_and_dense = getattr(prims, "is_non_overlapping_and_dense_or_false", None)
    if is_non_overlapping_and_dense is None:
        pytest.skip("this torch has no torch._prims_common.is_non_overlapping_and_dense_or_false")
    base = torch.randn(4, 3, 5, 2)
    seen = 0
    for perm in itertools.permutations(range(4)):
        t = base.permute(perm)
        for view in (t, t[:, :2], t[::2], t.expand(2, *t.shape)[1], t.unsqueeze(1), t[:1]):
            block = _core_block(view)
            assert (block is not None) == is_non_overlapping_and_dense(view), (perm, view.shape, view.stride())
            if block is not None:
                seen += 1
                assert block.data_ptr() == view.data_ptr() and block.numel() == view.numel()
                assert torch.equal(block.reshape(-1).sort().values, view.flatten().sort().values)
    assert seen > 24
    assert _core_block(torch.randn(3, dtype=torch.float64)) is None
    assert _core_block(torch.randn(3, device="meta")) is None
    assert _core_block(torch.randn(3, 2).to_sparse()) is None
    assert _core_block(torch.randn(3).to(torch.bfloat16)) is not None


def test_two_readers_below_scale_one_write_nothing_on_an_overflow():
    """A float64 gradient (ATen) and a float16 one (the core) at scale 0.5: the float16 value
    40000 overflows when unscaled, so neither is written; without it both are unscaled."""
    for overflow in (True, False):
        a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
        a.grad = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        b.grad = torch.tensor([40000.0 if overflow else 4.0, 1.0], dtype=torch.float16)
        before = (a.grad.clone(), b.grad.clone())
        scaler = GradScaler(init_scale=0.5)
        scaler.set_names({"a": a, "b": b})
        out = scaler.step(torch.optim.SGD([a, b], lr=0.0))
        if overflow:
            assert (out.applied, out.found_inf, out.first_overflow, out.first_overflow_name) == (False, True, 1, "b")
            assert torch.equal(a.grad, before[0]) and torch.equal(b.grad, before[1]), "nothing written"
        else:
            assert (out.applied, out.found_inf, out.first_overflow, out.first_overflow_name) == (True, False, -1, "")
            assert torch.equal(a.grad, before[0] * 2) and torch.equal(b.grad, before[1] * 2)
            assert out.grad_norm == math.sqrt(4 + 16 + 36 + 64 + 4)  # (2, 4, 6) and (8, 2), exactly


def test_step_outcome_carries_the_cores_fields_with_their_meanings():
    fields = [f.name for f in dataclasses.fields(StepOutcome)]
    assert fields[:6] == ["applied", "found_inf", "first_overflow", "first_overflow_name", "grad_norm", "scale"]
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    model[1].weight.grad[0, 0] = math.inf
    out = scaler.step(opt)
    scaler.update()
    assert (out.first_overflow, out.first_overflow_name) == (2, "param[2]")  # no names: the core's default
    scaler.set_names(model)
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    model[0].bias.grad[1] = math.nan
    out = scaler.step(opt)
    assert isinstance(out.first_overflow, int) and (out.first_overflow, out.first_overflow_name) == (1, "0.bias")
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    out = scaler.step(opt)
    assert out.applied and (out.first_overflow, out.first_overflow_name) == (-1, "")
    disabled = GradScaler(enabled=False).step(opt)  # a pass-through: nothing checked, nothing named
    assert (disabled.first_overflow, disabled.first_overflow_name) == (-1, "")
