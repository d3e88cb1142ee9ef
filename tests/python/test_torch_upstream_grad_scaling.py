"""PyTorch's own GradScaler tests, run on mixprec.torch.GradScaler.

Every case runs twice (`kind`): on the drop-in and on torch.amp.GradScaler, the control. The
scenario, its models, values and asserts are upstream's; a failure of the mixprec run alone is
therefore the drop-in's.

Sources. The tests were read with the project's search tools; their facts (what is asserted,
with which values) are carried over, the code here is this project's. The stored snapshots of
pytorch/pytorch predate the device-generic versions of these tests, so they were read in
ROCm/pytorch, the ROCm fork that tracks pytorch/pytorch main (the installed torch is 2.15.0):
  T = test/test_torch.py, class TestTorchDeviceType   (ROCm/pytorch 0e0637806e6d815b8995d62361803a922f27b013)
  C = test/test_cuda.py, class TestCudaOptims         (ROCm/pytorch 05ddebfcb8688846792d6d71fab12dd889a84537)
  M = test/test_cuda_multigpu.py, class TestCudaMultiGPU (ROCm/pytorch 10b22ea5c6a60ffa85520eb2d293affc48cea8ee)
  O = test/test_optim.py, class TestOptimRenewed      (ROCm/pytorch 10b22ea5c6a60ffa85520eb2d293affc48cea8ee)
Upstream's helpers run as the installed wheel has them (torch/testing/_internal/): common_cuda's
_create_scaling_models_optimizers and _create_scaling_case; common_optimizers' TensorTracker,
OptimizerInput, the optim_inputs_func of Adagrad/Adam/AdamW/SGD,
_get_optim_inputs_including_global_cliquey_kwargs, and each optimizer's supported_impls and
supports_fused_on read from its optim_db entry. They are loaded from the wheel's source by name
(`wheel`, below), not imported: importing those modules needs the `expecttest` package (not in
the venv) and pulls in common_methods_invocations (over a minute of imports on this machine).

Upstream test -> test here (all on the CPU):
  T test_pickle_gradscaler                       -> test_pickle_gradscaler
  T test_grad_scaling_unscale (float, double)    -> test_grad_scaling_unscale: upstream's cases
      (contiguous, transposed = dense non-overlapping, strided [:, :5], inf/NaN in either),
      mixed float/float16 and the "perfect storm", driven through each scaler instead of the bare
      kernel; plus a channels_last 4-d gradient (added here)
  T test_grad_scaling_update_scale               -> test_grad_scaling_update_scale (the kernel's
      sequence driven through the scaler: same scales, same trackers)
  T test_grad_scaling_unscale_sparse             -> test_grad_scaling_unscale_sparse
  T test_grad_scaling_state_dict                 -> test_grad_scaling_state_dict
  T test_grad_scaling_autocast (Adam, AdamW, SGD x for-loop, foreach, fused)
                                                 -> test_grad_scaling_autocast
  T test_params_invalidated_with_grads_invalidated_between_unscale_and_step
                                                 -> test_params_invalidated_with_grads_invalidated_between_unscale_and_step
  T test_grad_scale_will_not_overflow            -> test_grad_scale_will_not_overflow
  T test_grad_scaling_clipping, _clipping_separate_unscale, _penalty, _accumulation,
    _multiple                                    -> the tests of the same names
  T test_grad_scaler_pass_itself                 -> test_grad_scaler_pass_itself (different on purpose, below)
  C test_grad_scaling_autocast_fused_optimizers  -> test_grad_scaling_autocast_fused_optimizers
      (Adagrad, Adam, AdamW, SGD: the optimizers whose fused kernel runs on the CPU); plus
      test_fused_optimizers_bitwise_equal_to_torch_amp (added here: the same runs compared bit
      for bit across the two scalers)
  C test_grad_scaler_with_preset_grad_scale (onlyCUDA) -> test_grad_scaler_with_preset_grad_scale,
      on the CPU's fused kernels; plus test_preset_grad_scale_is_used_by_one_step_only (added here:
      torch.amp deletes optimizer.grad_scale after the step it was used in)
  C test_graph_grad_scaling (onlyCUDA, CUDA graph) -> test_graph_grad_scaling_without_the_graph:
      the captured region (fp16 product, scale, backward) run eagerly each step, same inputs,
      same expected gradients, scales and growth trackers
  M test_grad_scaling_scale (two GPUs)           -> test_grad_scaling_scale, every output on the CPU
  M test_grad_scaling_multigpu (two GPUs)        -> test_grad_scaling_multigpu_on_one_device: the
      second model on the same device, with upstream's found_inf-per-optimizer asserts
Not applicable:
  T test_params_invalidated_with_grads_invalidated_and_graph_partition: the same body as the test
      above under torch._inductor.config.patch("graph_partition"), which eager code never reads.
  T test_grad_scaler_deprecated_warning: the FutureWarning of the torch.cpu/cuda.amp.GradScaler
      aliases; the drop-in has no deprecated alias.
  C test_graph_scaling_fused_optimizers, test_graph_optims: CUDA graph capture and capturable
      kernels (not on the CPU; no GPU here).
  M test_grad_scaling_device_as_key: hashing of torch.device objects; no scaler involved.
  O test_fused_does_not_step_if_foundinf (onlyCUDA): sets optimizer.grad_scale/found_inf by hand
      and steps; no GradScaler involved (the drop-in skips a step itself and never hands
      found_inf to an optimizer). The rest of test_optim.py has no GradScaler.
  Multi-device lists (TEST_MULTIGPU branches in T test_grad_scaling_unscale): one device here.
Different on purpose (docs/python.md, "Differences from torch.amp.GradScaler"), tested for the
drop-in's documented behaviour:
  - float16 gradients: upstream reaches them through the private GradScaler._unscale_grads_(...,
    allow_fp16=True) because torch.amp's unscale_ refuses them; the drop-in's public unscale_
    takes them (test_grad_scaling_unscale, test_grad_scaling_unscale_sparse).
  - optimizers with _step_supports_amp_scaling (test_grad_scaler_pass_itself): torch.amp passes
    itself as grad_scaler= (FutureWarning) or sets optimizer.grad_scale/found_inf; the drop-in
    hands them unscaled gradients and calls a plain step(): no grad_scaler argument, no
    attributes set, no warning.
  - no upstream scenario reaches a scale below 1, where the drop-in writes nothing on an
    overflow step (torch.amp writes inf); that rule is tested in test_torch_grad_scaler_gradients.py.
How the private attributes upstream reads map to public ones (the torch.amp run asserts both):
  _scale / _growth_tracker / _init_growth_tracker -> get_scale() / _get_growth_tracker();
  the found_inf of one optimizer (_found_inf_per_device, _unscale_grads_'s dict) -> the
  StepOutcome of the drop-in's step(); _per_optimizer_states[new] == a fresh state -> an optimizer
  the scaler never saw can be unscaled and stepped.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import pathlib
import pickle
import types
import typing
import warnings
from itertools import chain

import pytest

torch = pytest.importorskip("torch", reason="mixprec.torch needs PyTorch")

import mixprec.torch  # noqa: E402
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices  # noqa: E402

torch.set_num_threads(1)

KINDS = ("torch.amp", "mixprec")
DEVICE = "cpu"


# ---- upstream's helpers, from the installed wheel --------------------------------------------

class WheelHelpers:
    """Top-level definitions of torch/testing/_internal/<file> executed unchanged, by name."""

    def __init__(self) -> None:
        self.ns: typing.Dict[str, typing.Any] = {
            "torch": torch, "Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "Any": typing.Any,
            "deepcopy": copy.deepcopy,
            "_get_foreach_kernels_supported_devices": _get_foreach_kernels_supported_devices,
        }
        self.root = pathlib.Path(torch.__file__).parent / "testing" / "_internal"
        self._trees: typing.Dict[str, ast.Module] = {}
        self._load("common_cuda.py", ["_create_scaling_models_optimizers", "_create_scaling_case"])
        self._load("common_optimizers.py", [
            "CUDA_CONFIG_GPUS", "OptimizerInput", "_get_device_type", "optim_inputs_func_adagrad",
            "optim_inputs_func_adam", "optim_inputs_func_adamw", "optim_inputs_func_sgd",
            "_get_optim_inputs_including_global_cliquey_kwargs", "TensorTracker"])
        self.optims = {name: self._optim_info(name) for name in ("Adagrad", "Adam", "AdamW", "SGD")}

    def __getattr__(self, name: str) -> typing.Any:
        try:
            return self.ns[name]
        except KeyError:
            raise AttributeError(name) from None

    def _tree(self, file: str) -> ast.Module:
        if file not in self._trees:
            path = self.root / file
            self._trees[file] = ast.parse(path.read_text(), filename=str(path))
        return self._trees[file]

    @staticmethod
    def _name(node: ast.stmt) -> typing.Optional[str]:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            return node.name
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        return target.id if isinstance(target, ast.Name) else None

    def _load(self, file: str, names: typing.List[str]) -> None:
        found = {self._name(n): n for n in self._tree(file).body if self._name(n) in names}
        missing = sorted(set(names) - set(found))
        if missing:
            raise ImportError(f"torch {torch.__version__}: {file} has no top-level {missing}")
        module = ast.Module(body=[found[n] for n in names], type_ignores=[])
        exec(compile(module, str(self.root / file), "exec"), self.ns)

    def _optim_info(self, cls_name: str) -> typing.Any:
        """optim_db's entry for torch.optim.<cls_name>: its optim_inputs_func, supported_impls and
        supports_fused_on (the OptimizerInfo defaults where the entry gives none)."""
        tree = self._tree("common_optimizers.py")
        defaults = {}
        info_cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OptimizerInfo")
        init = next(n for n in info_cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        for arg, default in zip(init.args.kwonlyargs, init.args.kw_defaults):
            if arg.arg in ("supported_impls", "supports_fused_on"):
                defaults[arg.arg] = ast.literal_eval(default)
        db = next(n for n in tree.body if self._name(n) == "optim_db")
        for call in db.value.elts:
            if isinstance(call.args[0], ast.Name) and call.args[0].id == cls_name:
                kw = {k.arg: k.value for k in call.keywords}
                fields = {k: ast.literal_eval(kw[k]) if k in kw else v for k, v in defaults.items()}
                return types.SimpleNamespace(optim_cls=getattr(torch.optim, cls_name),
                                             optim_inputs_func=self.ns[kw["optim_inputs_func"].id], **fields)
        raise ImportError(f"torch {torch.__version__}: optim_db has no entry for {cls_name}")


wheel = WheelHelpers()


# ---- unittest's asserts with torch's TestCase rule for tensors ------------------------------

def assert_equal(actual, expected, *, atol=None, rtol=None, msg=None) -> None:
    """TestCase.assertEqual as upstream uses it: tensors through torch.testing.assert_close (dtype,
    device and layout checked, NaN equal to NaN, the dtype's default tolerances unless given); a
    Python number against every element of a tensor."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, (int, float)):
        expected = torch.full_like(actual, expected)
    elif isinstance(expected, torch.Tensor) and isinstance(actual, (int, float)):
        actual = torch.full_like(expected, actual)
    if not isinstance(actual, torch.Tensor):
        assert actual == expected, msg
        return
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True, msg=msg)


class Case:
    """The unittest.TestCase methods TensorTracker calls."""

    def assertGreater(self, a, b, msg=None):  # noqa: N802 (unittest's names)
        assert a > b, msg

    def assertTrue(self, x, msg=None):  # noqa: N802
        assert x, msg

    def assertEqual(self, actual, expected, **kwargs):  # noqa: N802
        assert_equal(actual, expected, **kwargs)


# ---- the scaler under test --------------------------------------------------------------------

def scaler_class(kind: str):
    return torch.amp.GradScaler if kind == "torch.amp" else mixprec.torch.GradScaler


def make_scaler(kind: str, **kwargs):
    """upstream's GradScaler = partial(torch.GradScaler, device=device.type)."""
    return scaler_class(kind)(device=DEVICE, **kwargs)


def unscale_and_found_inf(kind: str, scaler, opt, inv_scale: torch.Tensor, allow_fp16: bool) -> float:
    """Unscale `opt`'s gradients by `inv_scale` and return found_inf as upstream sums it.
    torch.amp: upstream's own call, _unscale_grads_(opt, inv_scale, found_inf, allow_fp16), a
    found_inf per device. mixprec: its scale is 1/inv_scale; unscale_() (which takes float16
    gradients), then step(): StepOutcome.found_inf is what unscale_ found."""
    if kind == "torch.amp":
        found_inf = torch.full((1,), 0.0, dtype=torch.float)
        per_device = scaler._unscale_grads_(opt, inv_scale, found_inf, allow_fp16)
        return sum(v.item() for v in per_device.values())
    assert scaler.get_scale() * inv_scale.item() == 1.0
    scaler.unscale_(opt)
    return float(scaler.step(opt).found_inf)


def assert_scaler(kind, scaler, *, scale, growth_factor, backoff_factor, growth_interval, growth_tracker):
    """The scaler's state through its getters (and torch.amp's _init_growth_tracker, which
    upstream reads: the tracker before the first scale())."""
    assert scaler.get_scale() == scale
    assert scaler.get_growth_factor() == growth_factor
    assert scaler.get_backoff_factor() == backoff_factor
    assert scaler.get_growth_interval() == growth_interval
    assert scaler._get_growth_tracker() == growth_tracker
    if kind == "torch.amp":
        assert scaler._init_growth_tracker == growth_tracker


class ParamsOnly(torch.optim.SGD):
    """The optimizer of upstream's unscale tests, SGD(params, lr=1.0), which upstream never steps
    (it only groups the gradients for _unscale_grads_): its step() is a no-op, so that the
    drop-in's step() can report found_inf (SGD has no CPU update for float16 sparse parameters)."""

    def step(self, closure=None):
        return None


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)  # what torch's TestCase.setUp does (common_utils.SEED)


# ---- T: test_torch.py, TestTorchDeviceType ---------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_pickle_gradscaler(kind):
    for lazy_init_scale in (True, False):
        a = make_scaler(kind, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        assert a.is_enabled()
        if lazy_init_scale:
            out = a.scale(torch.tensor([4.0], dtype=torch.float32, device=DEVICE))
            assert out.device.type == DEVICE
            if kind == "torch.amp":
                assert a._scale.device.type == DEVICE
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() == a.is_enabled()
        assert_scaler(kind, b, scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2, growth_tracker=0)
        if kind == "torch.amp":
            assert b._per_optimizer_states["fdsa"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
        if lazy_init_scale:
            assert_equal(b.scale(torch.tensor([4.0], dtype=torch.float32, device=DEVICE)), 12.0)
        # An optimizer b never saw starts in a fresh state: unscale_ is taken, the step applies.
        p = torch.zeros(2, requires_grad=True)
        p.grad = torch.full((2,), 3.0)
        opt = torch.optim.SGD([p], lr=1.0)
        b.scale(torch.ones(()))
        b.unscale_(opt)
        b.step(opt)
        assert_equal(p.detach(), -1.0)


def unscale_case_params(grads):
    params = [torch.empty_like(g) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return params


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float, torch.double])
def test_grad_scaling_unscale(kind, dtype):
    inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=DEVICE)

    def unscale(grads, allow_fp16):
        # One scaler per call: the drop-in's unscale_ is once per update(); upstream's
        # _unscale_grads_ keeps no state, so a fresh torch.amp scaler changes nothing.
        scaler = make_scaler(kind, init_scale=4.0)
        opt = ParamsOnly(unscale_case_params(grads), lr=1.0)
        return unscale_and_found_inf(kind, scaler, opt, inv_scale, allow_fp16)

    size = 20
    g = torch.full((size, size), 4.0, dtype=dtype, device=DEVICE)
    ginf = g.clone()
    ginf[2, 2] = float("inf")
    gnan = g.clone()
    gnan[2, 2] = float("nan")
    g4 = torch.full((2, 3, 4, 5), 4.0, dtype=dtype, device=DEVICE)
    g4inf = g4.clone()
    g4inf[1, 2, 3, 4] = float("inf")
    cl = torch.channels_last
    cases = (
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
        # added here: a channels_last gradient (dense, not contiguous), clean and with an inf
        ([g.clone(), g4.contiguous(memory_format=cl)], False),
        ([g.clone()[:, :5], g4inf.contiguous(memory_format=cl)], True),
    )
    for grads, has_inf in cases:
        found_inf = unscale(grads, allow_fp16=False)
        if has_inf:
            assert found_inf == 1.0
        else:
            assert found_inf == 0.0
            for grad in grads:
                assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # Mixed dtypes (upstream: the raw kernel, falling back to its per-tensor loop).
    grads = [g.clone(), g.to(dtype=torch.float16)]
    unscale(grads, allow_fp16=True)
    for grad in grads:
        assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # The "perfect storm": dtypes and layouts mixed in one optimizer, an inf in each in turn.
    def perfect_storm_grads(inject_inf):
        grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf")
        return grads

    for inject_inf in range(-1, len(perfect_storm_grads(-1))):
        grads = perfect_storm_grads(inject_inf)
        found_inf = unscale(grads, allow_fp16=True)
        if inject_inf < 0:
            assert found_inf == 0
            for grad in grads:
                assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            assert found_inf == 1


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_update_scale(kind):
    # Upstream drives torch._amp_update_scale_ (growth 2, backoff 0.25, interval 2, scale 4)
    # directly; here the scaler does, through steps with a finite or an inf gradient.
    scaler = make_scaler(kind, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)

    def iteration(grad_value):
        scaler.scale(torch.ones(()))
        p.grad = torch.full((1,), grad_value)
        scaler.step(opt)
        scaler.update()

    iteration(1.0)  # 2 consecutive unskipped iterations
    assert scaler._get_growth_tracker() == 1
    assert scaler.get_scale() == 4.0
    iteration(1.0)
    assert scaler._get_growth_tracker() == 0
    assert scaler.get_scale() == 8.0
    iteration(float("inf"))  # a skipped iteration
    assert scaler._get_growth_tracker() == 0
    assert scaler.get_scale() == 2.0


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_unscale_sparse(kind):
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        grad_scaling_unscale_sparse(kind)


def grad_scaling_unscale_sparse(kind):
    dtype = torch.float
    inv_scale = torch.full((1,), 0.25, dtype=dtype, device=DEVICE)

    def found_inf_of(p, grad, allow_fp16):
        p.grad = grad
        scaler = make_scaler(kind, init_scale=4.0)  # unscale_ is once per update(), as above
        opt = ParamsOnly([p], lr=1.0)
        return unscale_and_found_inf(kind, scaler, opt, inv_scale, allow_fp16)

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=DEVICE, dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], device=DEVICE, dtype=torch.float)
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=dtype)

    p = s.clone()
    assert p.is_sparse
    assert found_inf_of(p, s.clone(), False) == 0.0
    assert_equal(p.grad.to_dense(), (s / 4).to_dense())

    v = torch.tensor([16.0, 32.0, float("inf")])
    assert found_inf_of(p, torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=dtype), False) == 1.0
    v = torch.tensor([16.0, 32.0, float("nan")])
    assert found_inf_of(p, torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=dtype), False) == 1.0

    p = s.clone().half()
    assert p.is_sparse
    assert found_inf_of(p, s.clone().half(), True) == 0.0
    assert_equal(p.grad.to_dense(), (s.half() / 4).to_dense())

    # float16 with duplicate indices: 64000 + 64000 overflows float16 once coalesced.
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    v = torch.tensor([64000.0, 32.0, 64000.0])
    grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=torch.float16)
    assert found_inf_of(p, grad, True) == 1.0


def clean_steps(scaler, n):
    """n steps whose gradient is finite (each adds one to the growth tracker)."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    for _ in range(n):
        scaler.scale(torch.ones(()))
        p.grad = torch.ones(1)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_state_dict(kind):
    for lazy_init_scale in (True, False):
        s0 = make_scaler(kind, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = make_scaler(kind, init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        # A growth tracker for load_state_dict to overwrite. Upstream writes 7 into torch.amp's
        # private _init_growth_tracker; the drop-in gets there through its public calls.
        if kind == "torch.amp":
            s1._init_growth_tracker = 7
        else:
            s1.set_growth_interval(10)
            clean_steps(s1, 7)
            assert s1._get_growth_tracker() == 7
        if lazy_init_scale:
            out = s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE))
            assert out.dtype == torch.float32 and out.device.type == DEVICE
            if kind == "torch.amp":
                assert isinstance(s1._scale, torch.FloatTensor)
        s1.load_state_dict(s0.state_dict())
        assert_scaler(kind, s1, scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2, growth_tracker=0)


def half_autocast_backward(model, input, target, loss_fn, scaler):
    """The forward under float16 autocast, then backward of the scaled loss; returns the loss."""
    with torch.autocast(device_type=DEVICE, dtype=torch.half):
        output = model(input)
        loss = loss_fn(output, target)
    scaler.scale(loss).backward()
    return loss


def inject_inf(model, scaler, i, skip_iter):
    """The scaled run's overflow: an inf in the second layer's weight gradient at skip_iter."""
    if i == skip_iter and scaler.is_enabled():
        model[1].weight.grad.data.fill_(float("inf"))


def control_step(optimizer, scaler, i, skip_iter):
    """The unscaled control steps wherever the scaled run does (not at skip_iter when enabled)."""
    if (not scaler.is_enabled()) or (i != skip_iter):
        optimizer.step()


def run_scaling_case(kind, run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Upstream's _run_scaling_case: the same model trained without scaling (control) and with it,
    enabled and disabled; the scale after len(data) steps and every gradient, optimizer state and
    parameter compared."""
    for enabled in (True, False):
        (mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter) = wheel._create_scaling_case(
            device=DEVICE, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs)
        # A modest initial scale and a large growth factor, to magnify growth-handling errors.
        scaler = make_scaler(kind, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(DEVICE, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(DEVICE, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * net_growth * net_backoff
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            assert_equal(c.grad, s.grad, atol=atol, rtol=1e-05)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                assert_equal(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)
            assert_equal(c, s, atol=atol, rtol=1e-05)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("foreach,fused", [(None, None), (True, None), (None, True)])
@pytest.mark.parametrize("optim", ["AdamW", "Adam", "SGD"])
def test_grad_scaling_autocast(kind, optim, foreach, fused):
    try_pickle = False

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.half, enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                inject_inf(model, scaler, i, skip_iter)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                control_step(optimizer, scaler, i, skip_iter)
        return scaler

    optimizer_ctor = wheel.optims[optim].optim_cls
    kwargs = {"foreach": foreach, "fused": fused}
    # Upstream expects pure fp32 against fp16 autocast to differ beyond atol 1e-3 with Adam(W)
    # (assertRaises(AssertionError)); here the failure must also be a comparison, not a misuse.
    expect_mismatch = optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW)
    with pytest.raises(AssertionError, match="not close") if expect_mismatch else contextlib.nullcontext():
        run_scaling_case(kind, run, unskipped=3, skipped=1, atol=1e-3, optimizer_ctor=optimizer_ctor,
                         optimizer_kwargs=kwargs)
        try_pickle = True  # picked up by run()
        run_scaling_case(kind, run, unskipped=3, skipped=1, atol=1e-3, optimizer_ctor=optimizer_ctor,
                         optimizer_kwargs=kwargs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("optim", ["AdamW", "Adam", "SGD"])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(kind, optim):
    # Gradients made non-finite after unscale_ (which found them finite) are stepped with:
    # the parameters become inf/NaN.
    optim_info = wheel.optims[optim]
    all_optim_inputs = wheel._get_optim_inputs_including_global_cliquey_kwargs(
        DEVICE, torch.float32, optim_info, skip=("differentiable",))
    assert all_optim_inputs
    for optim_input in all_optim_inputs:
        model, _, optimizer, _, data, loss_fn, _ = wheel._create_scaling_case(
            DEVICE, optimizer_ctor=optim_info.optim_cls, optimizer_kwargs=optim_input.kwargs)
        scaler = make_scaler(kind, init_scale=128.0)
        for input, target in data:
            optimizer.zero_grad()
            half_autocast_backward(model, input, target, loss_fn, scaler)
            scaler.unscale_(optimizer)
            for j, param in enumerate(model.parameters()):
                param.grad.copy_(torch.inf if j % 2 else torch.nan)
            scaler.step(optimizer)
            scaler.update()
        assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters()), optim_input.desc


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scale_will_not_overflow(kind):
    model = torch.nn.Linear(5, 1).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = make_scaler(kind, growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5).to(DEVICE)
    y = 1e-30 * torch.randn(1, 1).to(DEVICE)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scale = scaler.get_scale()
    assert scale != float("inf") and scale == scale, scale
    if kind == "torch.amp":
        assert scaler._scale != float("inf") and scaler._scale == scaler._scale


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_clipping(kind):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # a value that clips, from upstream's printouts of the gradients
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                inject_inf(model, scaler, i, skip_iter)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                control_step(optimizer, scaler, i, skip_iter)

    run_scaling_case(kind, run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_clipping_separate_unscale(kind):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                inject_inf(model, scaler, i, skip_iter)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                control_step(optimizer, scaler, i, skip_iter)

    run_scaling_case(kind, run, unskipped=3, skipped=1)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_penalty(kind):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                inject_inf(model, scaler, i, skip_iter)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                control_step(optimizer, scaler, i, skip_iter)

    run_scaling_case(kind, run, unskipped=3, skipped=1)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_accumulation(kind):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    run_scaling_case(kind, run, unskipped=2, skipped=0)


def two_models_two_optimizers(kind, check_found_inf):
    """Upstream's test_grad_scaling_multiple (and, with check_found_inf, test_grad_scaling_multigpu
    with its second model on the same device): two models, two optimizers, both fed by two losses;
    one optimizer unscaled separately; an inf in the second model at skip_iter."""
    for enabled in (True, False):
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = \
            wheel._create_scaling_case(DEVICE)
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = wheel._create_scaling_models_optimizers(DEVICE)
        scaler = make_scaler(kind, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
            for i, (input, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0 = model0(input)
                output1 = model1(input)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        model1[1].weight.grad.data.fill_(float("inf"))
                    scaler.unscale_(optimizer0)  # an additional stress: one optimizer unscaled apart
                    out0 = scaler.step(optimizer0)
                    out1 = scaler.step(optimizer1)
                    if check_found_inf and scaler.is_enabled():
                        # found_inf collected per optimizer (upstream: one entry per device)
                        if kind == "torch.amp":
                            assert len(scaler._found_inf_per_device(optimizer0)) == 1
                            assert len(scaler._found_inf_per_device(optimizer1)) == 1
                            assert scaler._found_inf_per_device(optimizer0)[torch.device(DEVICE)].item() == 0.0
                            assert scaler._found_inf_per_device(optimizer1)[torch.device(DEVICE)].item() == float(
                                i == skip_iter)
                        else:
                            assert float(out0.found_inf) == 0.0
                            assert float(out1.found_inf) == float(i == skip_iter)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
        # Grown 3 times, backed off once. (Upstream's assertTrue(a == b if enabled else 1.0)
        # asserts nothing when disabled; here the disabled scale must be 1.0.)
        if enabled:
            assert scaler.get_scale() == 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() ** 1
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(chain(mod_control0.parameters(), mod_control1.parameters()),
                        chain(mod_scaling0.parameters(), mod_scaling1.parameters())):
            assert_equal(c, s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_multiple(kind):
    two_models_two_optimizers(kind, check_found_inf=False)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_pass_itself(kind):
    seen = {}

    class PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params, defaults=None):
            super().__init__(params, defaults or {})
            self._step_supports_amp_scaling = True

    class Optimizer1(PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            seen["o1"] = (grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf"),
                          [p.grad.clone() for p in self.param_groups[0]["params"]])

    class Optimizer2(PlaceHolderOptimizer):
        def step(self, closure=None):
            seen["o2"] = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None),
                          [p.grad.clone() for p in self.param_groups[0]["params"]])

    x = torch.randn(4, 4).to(DEVICE)
    m = torch.nn.Linear(4, 1).to(DEVICE)
    o1 = Optimizer1(m.parameters())
    o2 = Optimizer2(m.parameters())
    scaler = make_scaler(kind, init_scale=2.0)
    with torch.autocast(device_type=DEVICE, dtype=torch.half):
        y = m(x)
        loss = y.mean()
    scaler.scale(loss).backward()
    scaled = [p.grad.clone() for p in m.parameters()]
    if kind == "torch.amp":
        with pytest.warns(FutureWarning):
            scaler.step(o1)
        scaler.step(o2)
        scaler.update()
        grad_scaler, has_grad_scale, has_found_inf, _ = seen["o1"]
        assert isinstance(grad_scaler, torch.amp.GradScaler)
        assert not has_grad_scale and not has_found_inf
        grad_scale, found_inf, _ = seen["o2"]
        assert isinstance(grad_scale, torch.Tensor)
        assert isinstance(found_inf, torch.Tensor)
        return
    # The drop-in (docs/python.md): such an optimizer gets unscaled gradients and a plain step(),
    # like any other: no grad_scaler argument, no grad_scale/found_inf attributes, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.step(o1)
        scaler.step(o2)
        scaler.update()
    grad_scaler, has_grad_scale, has_found_inf, grads1 = seen["o1"]
    assert grad_scaler is None and not has_grad_scale and not has_found_inf
    for g, g_scaled in zip(grads1, scaled):
        assert torch.equal(g, g_scaled / 2.0)
    grad_scale, found_inf, grads2 = seen["o2"]
    assert grad_scale is None and found_inf is None
    # o2 shares o1's parameters and unscale_ is per optimizer (torch.amp's rule for optimizers
    # without _step_supports_amp_scaling): its own check halves the gradients once more.
    for g, g1 in zip(grads2, grads1):
        assert torch.equal(g, g1 / 2.0)


# ---- C: test_cuda.py, TestCudaOptims ----------------------------------------------------------

FUSED_ON_CPU = [name for name, info in wheel.optims.items()
                if "fused" in info.supported_impls and DEVICE in info.supports_fused_on]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("optim", FUSED_ON_CPU)
def test_grad_scaling_autocast_fused_optimizers(kind, optim):
    # A fused optimizer against its for-loop version, both under autocast and loss scaling.
    optim_info = wheel.optims[optim]
    optim_cls = optim_info.optim_cls
    optim_inputs = optim_info.optim_inputs_func(device=DEVICE)
    assert optim_inputs
    for optim_input in optim_inputs:
        for separate_unscale in (True, False):
            kwargs = optim_input.kwargs
            kwargs["fused"] = True
            torch.manual_seed(20)
            (mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, _) = wheel._create_scaling_case(
                optimizer_ctor=optim_cls, optimizer_kwargs=kwargs, device=DEVICE)
            optimizer_kwargs = copy.deepcopy(kwargs)
            optimizer_kwargs["fused"] = False
            if "lr" not in kwargs:
                optimizer_kwargs["lr"] = 1.0  # what _create_scaling_case gives the fused one
            opt_control = optim_cls(mod_control.parameters(), **optimizer_kwargs)
            scaler_scaling = make_scaler(kind, init_scale=128.0)
            scaler_control = make_scaler(kind, init_scale=128.0)
            tracker = wheel.TensorTracker()
            # Wider tolerances for the parameters and (max_)exp_avg_sq when betas are floats
            # (double in the for-loop, float in the fused kernel).
            assert_eq_kwargs = {}
            if "betas" in opt_control.param_groups[0] and not torch.is_tensor(opt_control.param_groups[0]["betas"][0]):
                assert_eq_kwargs = {"atol": 2e-5, "rtol": 2e-5}
            for input, target in data:
                opt_control.zero_grad()
                loss_control = half_autocast_backward(mod_control, input, target, loss_fn, scaler_control)
                scaler_control.step(opt_control)
                scaler_control.update()

                opt_scaling.zero_grad()
                loss_scaling = half_autocast_backward(mod_scaling, input, target, loss_fn, scaler_scaling)
                if separate_unscale:
                    scaler_scaling.unscale_(opt_scaling)
                scaler_scaling.step(opt_scaling)
                scaler_scaling.update()

                tracker.add(loss_control)
                tracker.pop_check_set(loss_scaling, Case())
                for param_control, param_scaling in zip(mod_control.parameters(), mod_scaling.parameters()):
                    tracker.add(param_control.grad)
                    tracker.pop_check_set(param_scaling.grad, Case())
                    tracker.add(param_control)
                    tracker.pop_check_set(param_scaling, Case(), assert_eq_kwargs)
                    state_control = opt_control.state[param_control]
                    state_scaling = opt_scaling.state[param_scaling]
                    for k in state_control:
                        actual = state_scaling[k]
                        if k == "step":
                            actual = actual.squeeze()
                        tracker.add(state_control[k])
                        tracker.pop_check_set(actual, Case(),
                                              assert_eq_kwargs if k in ("exp_avg_sq", "max_exp_avg_sq") else {})
            assert tracker.all_popped()


@pytest.mark.parametrize("optim", FUSED_ON_CPU)
def test_fused_optimizers_bitwise_equal_to_torch_amp(optim):
    # Added here, from the case above: torch.amp hands a fused optimizer the scale (its kernel
    # divides), the drop-in unscales first and steps plainly. With power-of-two scales (torch's
    # rule from a power-of-two init_scale) the two are equal bit for bit: the scaled model after
    # every step (weights, gradients, optimizer state), for every CPU input of the optimizer, with
    # and without a separate unscale_, through an injected inf (skip and back-off) and growth.
    # One difference, on the skipped step only: the gradients left behind are unscaled by the
    # drop-in's check (as torch.amp's own check leaves them for any other optimizer), still
    # scaled by torch's fused kernel, which skips on found_inf without unscaling.
    optim_info = wheel.optims[optim]
    bits = {4: torch.int32, 8: torch.int64}

    def same(a, b):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.dtype == b.dtype and torch.equal(a.view(bits[a.element_size()]), b.view(bits[b.element_size()]))

    for optim_input in optim_info.optim_inputs_func(device=DEVICE):
        for separate_unscale in (False, True):
            runs = {}
            for kind in KINDS:
                torch.manual_seed(20)
                kwargs = dict(optim_input.kwargs, fused=True)
                _, model, _, opt, data, loss_fn, skip_iter = wheel._create_scaling_case(
                    device=DEVICE, optimizer_ctor=optim_info.optim_cls, optimizer_kwargs=kwargs)
                scaler = make_scaler(kind, init_scale=128.0, growth_interval=1)
                trace = []
                for i, (input, target) in enumerate(data):
                    opt.zero_grad()
                    half_autocast_backward(model, input, target, loss_fn, scaler)
                    inject_inf(model, scaler, i, skip_iter)
                    if separate_unscale:
                        scaler.unscale_(opt)
                    scale = scaler.get_scale()
                    scaler.step(opt)
                    scaler.update()
                    trace.append((scale, scaler.get_scale(), [(p.detach().clone(), p.grad.clone(), dict(opt.state[p]))
                                                              for p in model.parameters()]))
                runs[kind] = trace
            for step, (run_t, run_m) in enumerate(zip(runs["torch.amp"], runs["mixprec"])):
                where = f"{optim_input.desc}, separate_unscale={separate_unscale}, step {step}"
                (scale, next_t, params_t), (_, next_m, params_m) = run_t, run_m
                assert next_t == next_m, where
                for (w_t, g_t, st_t), (w_m, g_m, st_m) in zip(params_t, params_m):
                    left_scaled_by_torch = step == skip_iter and not separate_unscale
                    assert same(w_t, w_m), where
                    assert same(g_t * (1.0 / scale) if left_scaled_by_torch else g_t, g_m), where
                    assert st_t.keys() == st_m.keys() and all(same(st_t[k], st_m[k]) for k in st_t), where
            assert [next_scale for _, next_scale, _ in runs["mixprec"]] == [256.0, 512.0, 256.0, 512.0]


FUSED_ON_CUDA = [name for name, info in wheel.optims.items() if "cuda" in info.supports_fused_on]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_place_unscale", [False, True])
@pytest.mark.parametrize("optim", FUSED_ON_CUDA)
def test_grad_scaler_with_preset_grad_scale(kind, optim, in_place_unscale):
    # Upstream runs this on CUDA's fused kernels; the CPU's fused kernels take grad_scale too.
    weight = torch.ones((5, 5), device=DEVICE, requires_grad=True)
    weight.grad = torch.full_like(weight, fill_value=15)
    opt = wheel.optims[optim].optim_cls([weight], lr=0.1, fused=True)
    scaler = make_scaler(kind, init_scale=5)
    scaler.scale(torch.ones(5))  # a loss scaled
    if in_place_unscale:
        scaler.unscale_(opt)
        assert_equal(weight.grad, torch.full_like(weight, fill_value=3))  # divided in place
    # The user's grad_scale, to be fused with the optimizer step: the gradient is divided by 5 * 3.
    opt.grad_scale = torch.Tensor([3]).to(DEVICE)
    scaler.step(opt)
    assert_equal(weight.grad, torch.full_like(weight, fill_value=1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("optim", FUSED_ON_CUDA)
def test_preset_grad_scale_is_used_by_one_step_only(kind, optim):
    # Added here, from the case above: torch.amp deletes optimizer.grad_scale (and found_inf)
    # after the step it was given to, so the next step divides by the loss scale alone.
    weight = torch.ones((5, 5), device=DEVICE, requires_grad=True)
    opt = wheel.optims[optim].optim_cls([weight], lr=0.1, fused=True)
    scaler = make_scaler(kind, init_scale=5)
    for preset, expected in ((3.0, 1.0), (None, 3.0)):
        weight.grad = torch.full_like(weight, fill_value=15)
        scaler.scale(torch.ones(5))
        if preset is not None:
            opt.grad_scale = torch.Tensor([preset]).to(DEVICE)
        scaler.step(opt)
        scaler.update()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        assert_equal(weight.grad, torch.full_like(weight, fill_value=expected))


GRAPH_SCALING = [name for name, info in wheel.optims.items()
                 if "foreach" in info.supported_impls and "cuda" in info.supports_fused_on]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("foreach,fused", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("optim", GRAPH_SCALING)
def test_graph_grad_scaling_without_the_graph(kind, optim, foreach, fused):
    scaler = make_scaler(kind, init_scale=4.0)
    weight = torch.ones((100,), device=DEVICE, requires_grad=True)
    opt = wheel.optims[optim].optim_cls([weight], lr=0.1, foreach=foreach, fused=fused)
    static_input = torch.ones_like(weight)
    # the warmup upstream runs before capturing
    loss = (weight.half() * static_input).sum()
    scaler.scale(loss).backward()
    opt.zero_grad(set_to_none=True)
    input_vals = [5, 20000, 5, 40000]
    # Expected when the scale is updated properly: scale, growth tracker, gradient (scale * input
    # in float16: 4 * 20000 and 2 * 40000 overflow).
    expected_scales = [4, 2, 2, 1]
    expected_growth_trackers = [1, 0, 1, 0]
    expected_grad_vals = [5 * 4, float("inf"), 5 * 2, float("inf")]
    for data, scale, growth_tracker, grad_val in zip(input_vals, expected_scales, expected_growth_trackers,
                                                     expected_grad_vals):
        static_input.fill_(data)
        # the captured region, eagerly: a replay writes a fresh gradient
        weight.grad = None
        loss = (weight.half() * static_input).sum()
        scaler.scale(loss).backward()
        assert_equal(weight.grad, torch.full_like(weight.grad, grad_val))
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == scale
        assert scaler._get_growth_tracker() == growth_tracker
        if kind == "torch.amp":
            assert_equal(scaler._scale, float(scale))
            assert_equal(scaler._growth_tracker, growth_tracker)


# ---- M: test_cuda_multigpu.py, TestCudaMultiGPU -----------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_scale(kind):
    scaler = make_scaler(kind, init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE)
    t1 = torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE)
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)
    assert (outputs[0] == 8.0 and outputs[1][0] == 8.0 and outputs[1][1] == 8.0 and outputs[2][0] == 8.0
            and outputs[2][1][0] == 8.0 and outputs[2][1][1] == 8.0)
    assert isinstance(outputs, tuple) and isinstance(outputs[1], tuple) and isinstance(outputs[2], list)
    # upstream: torch.amp keeps its scale on the first output's device; the drop-in makes the
    # scale on each output's device
    assert all(o.device == t1.device for o in (outputs[0], outputs[1][0], outputs[2][1][1]))
    if kind == "torch.amp":
        assert scaler._scale.device == t1.device


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_multigpu_on_one_device(kind):
    two_models_two_optimizers(kind, check_found_inf=True)


def test_the_scenarios_are_upstreams():
    """The helpers ran as the wheel has them: the models, data and optimizer lists upstream uses."""
    mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = wheel._create_scaling_case(DEVICE)
    assert [type(m).__name__ for m in mod_control] == ["Linear", "Linear"] and skip_iter == 2 and len(data) == 4
    assert opt_scaling.param_groups[0]["lr"] == 1.0 and isinstance(loss_fn, torch.nn.MSELoss)
    assert sorted(FUSED_ON_CPU) == ["Adagrad", "Adam", "AdamW", "SGD"]
    assert sorted(GRAPH_SCALING) == ["Adagrad", "Adam", "AdamW", "SGD"]
    # Adam's 5 CPU inputs, each with fused off and on (foreach kernels are not the CPU's)
    configs = wheel._get_optim_inputs_including_global_cliquey_kwargs(
        DEVICE, torch.float32, wheel.optims["Adam"], skip=("differentiable",))
    assert [c.kwargs["fused"] for c in configs] == [False, True] * 5
