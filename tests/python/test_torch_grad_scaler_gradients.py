"""mixprec.torch.GradScaler takes every gradient torch.amp.GradScaler takes, with torch's
result: channels_last and other dense permutations (the core, on the tensor's memory),
strided and overlapping views, float64 (ATen's own kernel), sparse COO (its values); a
channels_last convnet trains bitwise equal to torch.amp; scales below 1 whose unscaled
values overflow are skipped (where torch writes inf); independent scalers on independent
threads; the one state format across the doors and torch.amp."""

from __future__ import annotations

import json
import math
import pathlib
import threading

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")

from mixprec.torch import GradScaler  # noqa: E402

torch.set_num_threads(1)
FIXTURES = pathlib.Path(__file__).parent.parent / "scaler" / "fixtures"


def aten_unscaled(g, scale):
    """What torch.amp's own kernel leaves in `g` (a copy; a sparse gradient: its values,
    coalesced first when float16, as torch's unscale_ does)."""
    if g.is_sparse:
        g = g.coalesce() if g.dtype == torch.float16 else g
        values = g._values().clone()
        torch._amp_foreach_non_finite_check_and_unscale_([values], torch.zeros(()), torch.full((), 1.0 / scale))
        return torch.sparse_coo_tensor(g._indices(), values, g.shape)
    copy = g.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([copy], torch.zeros(()), torch.full((), 1.0 / scale))
    return copy


def unscale_both(make_grads, scale=1024.0):
    """The same gradients unscaled by torch's kernel and by mixprec: (torch's, ours, ours' outcome).
    torch.amp.GradScaler itself refuses float16 gradients ("Attempting to unscale FP16
    gradients"), so its kernel is run directly, as its unscale_ runs it."""
    torch.manual_seed(0)
    theirs = [aten_unscaled(g, scale) for g in make_grads()]
    torch.manual_seed(0)
    grads = make_grads()
    params = [torch.zeros(g.shape, dtype=g.dtype, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = GradScaler(init_scale=scale)
    scaler.unscale_(opt)
    ours = [p.grad for p in params]
    return theirs, ours, scaler.step(opt)


@pytest.mark.parametrize("layout", ["channels_last", "permuted", "strided", "overlapping", "float64", "sparse",
                                    "sparse_f16_duplicates", "transposed_f16"])
def test_gradients_as_torch_takes_them(layout):
    def make():
        if layout == "channels_last":
            return [(torch.randn(4, 3, 5, 5) * 1024).contiguous(memory_format=torch.channels_last)]
        if layout == "permuted":
            return [(torch.randn(3, 4, 5) * 1024).permute(2, 0, 1), torch.randn(3) * 1024]
        if layout == "strided":
            return [(torch.randn(8, 6) * 1024)[:, :5]]
        if layout == "overlapping":
            return [(torch.randn(1, 5) * 1024).expand(3, 5)]
        if layout == "float64":
            return [torch.randn(7, dtype=torch.float64) * 1024, torch.randn(3) * 1024]
        if layout == "sparse":
            return [(torch.randn(5, 3) * 1024).to_sparse()]
        if layout == "sparse_f16_duplicates":  # coalescing sums the duplicates: 40000 + 40000 = inf in fp16
            i = torch.tensor([[0, 0, 2]])
            return [torch.sparse_coo_tensor(i, torch.tensor([40000.0, 40000.0, 1.0]), (4,)).to(torch.float16)]
        return [(torch.randn(5, 3) * 1024).to(torch.float16).t()]

    if layout == "overlapping":
        # torch's own kernel refuses to write one memory location through two elements: so do we.
        with pytest.raises(RuntimeError) as theirs:  # in place, as torch's unscale_ runs it
            torch._amp_foreach_non_finite_check_and_unscale_([make()[0]], torch.zeros(()), torch.full((), 1 / 1024))
        grads = make()
        p = torch.zeros(3, 5, requires_grad=True)
        p.grad = grads[0]
        with pytest.raises(RuntimeError) as ours:
            GradScaler(init_scale=1024.0).unscale_(torch.optim.SGD([p], lr=0.0))
        assert str(ours.value).split("\n")[0] == str(theirs.value).split("\n")[0]
        return
    strides = [g.stride() if not g.is_sparse else None for g in make()]
    theirs, ours, outcome = unscale_both(make)
    for t, o, stride in zip(theirs, ours, strides):
        if not t.is_sparse:
            assert o.stride() == stride, "unscaled in place: the layout is kept"
            assert torch.equal(t, o)
        else:
            assert torch.equal(t._indices(), o.coalesce()._indices() if not o.is_coalesced() else o._indices())
            assert torch.equal(t._values(), o._values())
    assert outcome.found_inf == (layout == "sparse_f16_duplicates")


def test_meta_and_mixed_device_gradients_are_refused_before_anything_is_touched():
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(3, device="meta", requires_grad=True)
    a.grad = torch.full((3,), 8.0)
    b.grad = torch.ones(3, device="meta")
    scaler = GradScaler(init_scale=8.0)
    with pytest.raises(ValueError, match="meta tensor"):
        scaler.step(torch.optim.SGD([a, b], lr=1.0))
    assert torch.equal(a.grad, torch.full((3,), 8.0)) and torch.equal(a, torch.zeros(3))


class Net(torch.nn.Module):
    """A small residual convnet (ResNet's block shape), trained channels_last."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.stem(x)))
        h = torch.relu(h + self.bn2(self.conv(h)))
        return self.head(h.mean((2, 3)))


def train_convnet(make_scaler, steps=30):
    torch.manual_seed(0)
    model = Net().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 4, (4,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step in (5, 17):
            model.conv.weight.grad[0, 0, 0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, scaler


def test_channels_last_convnet_trains_bitwise_equal_to_torch_amp():
    tm, ts = train_convnet(lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4))
    mm, ms = train_convnet(lambda: GradScaler(init_scale=2.0 ** 10, growth_interval=4))
    assert tm.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert ts.get_scale() == ms.get_scale() and ts._get_growth_tracker() == ms._get_growth_tracker()
    for (n, a), (_, b) in zip(tm.named_parameters(), mm.named_parameters()):
        assert torch.equal(a, b), f"{n} differs"


@pytest.mark.parametrize("dtype,big", [(torch.float32, 3e38), (torch.bfloat16, 3e38), (torch.float16, 40000.0)])
def test_scale_below_one_that_overflows_is_skipped_where_torch_writes_inf(dtype, big):
    def run(scaler):
        p = torch.zeros(2, dtype=dtype, requires_grad=True)
        p.grad = torch.tensor([big, 1.0], dtype=dtype)
        opt = torch.optim.SGD([p], lr=1.0)
        scaler.scale(torch.ones(()))
        out = scaler.step(opt)
        return p.detach().clone(), p.grad.clone(), out

    if dtype != torch.float16:  # torch.amp refuses fp16 gradients
        tp, tg, _ = run(torch.amp.GradScaler("cpu", init_scale=0.5))
        assert math.isinf(float(tp[0])), "torch applies the overflowed gradient"
    mp, mg, out = run(GradScaler(init_scale=0.5))
    assert not out.applied and out.found_inf and out.first_overflow == 0
    assert torch.equal(mp, torch.zeros(2, dtype=dtype))
    assert torch.equal(mg, torch.tensor([big, 1.0], dtype=dtype)), "nothing written"


def test_independent_scalers_on_four_threads():
    errors, finals = [], []

    def worker(seed):
        try:
            torch.manual_seed(seed)
            w = torch.zeros(1 << 20, requires_grad=True)  # large enough for the core to use its threads
            opt = torch.optim.SGD([w], lr=1e-3)
            scaler = GradScaler(init_scale=1024.0, growth_interval=50)
            for step in range(200):
                w.grad = torch.full_like(w, 1024.0)
                if step % 37 == 0:
                    w.grad[7] = math.nan
                out = scaler.step(opt)
                assert out.applied == (step % 37 != 0)
                scaler.update()
            finals.append(scaler.get_scale())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(finals) == 4 and len(set(finals)) == 1


def test_state_round_trips_torch_amp_mixprec_torch_amp():
    theirs = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=9)
    theirs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    theirs._growth_tracker.fill_(4)
    ours = GradScaler()
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == 4096.0 and ours._get_growth_tracker() == 4 and ours.get_growth_interval() == 9
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == theirs.state_dict()


def test_the_cores_state_files_load_here_and_in_torch_amp():
    for name in ("grad_scaler_state_v1.json", "grad_scaler_state_v2.json"):
        state = json.loads((FIXTURES / name).read_text())
        ours = GradScaler(preset="mixprec")
        ours.load_state_dict(state)
        assert ours.get_scale() == 2048.0 and ours._get_growth_tracker() == 3 and ours.get_growth_interval() == 7
        assert ours.state_dict()["loss_scale"] == json.loads((FIXTURES / "grad_scaler_state_v2.json").read_text())["loss_scale"]
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(json.loads((FIXTURES / "grad_scaler_state_v2.json").read_text()))
    assert theirs.get_scale() == 2048.0 and theirs._get_growth_tracker() == 3
