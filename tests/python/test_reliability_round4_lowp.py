"""Round 4 of the hostile review of the Python low-precision door (issue 43): low_precision on
attention and transformers' Conv1D, its `modules` and `recipe` arguments, modules registered
twice, refusals that change nothing, and mixprec.quantize's float options and negative-bit views.

"A listed layer runs quantized" is checked as a user sees it: with only that module swapped,
the model's output differs from the unswapped model's, and the module's own statistics show
that its forward ran, in training, in eval and in eval under no_grad (where torch's
TransformerEncoderLayer takes its fused fast path)."""

import contextlib
import copy
import os
import importlib
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mixprec
import mixprec.torch as mt
from mixprec.torch.low_precision import LowPrecisionLinear

# The module (mixprec.torch.low_precision is also the name of the function mixprec.torch exports).
lp = importlib.import_module("mixprec.torch.low_precision")

# One thread: two cores shared with builds make torch's thread team spin (as the other torch tests).
torch.set_num_threads(1)

nn = torch.nn
MODES = ("train", "eval", "eval-no-grad")


def run(model, args, mode):
    model.train(mode == "train")
    with torch.no_grad() if mode == "eval-no-grad" else contextlib.nullcontext():
        out = model(*args)
    return getattr(out, "logits", out)


def assert_each_runs_quantized(factory, args, names, recipe="nvfp4"):
    """For each name: with only that module swapped, the output differs from the base model's and
    the module's forward ran (its x statistics were taken), in every mode."""
    base = factory()
    for name in names:
        m = mt.low_precision(copy.deepcopy(base), recipe, modules=[name])
        (mod,) = mt.low_precision_modules(m).values()
        for mode in MODES:
            mod.stats["x"].elements = 0
            got, want = run(m, args, mode), run(base, args, mode)
            assert mod.stats["x"].elements > 0, f"{name} did not run ({mode})"
            assert not torch.equal(got, want), f"{name}: output unchanged ({mode})"


def snapshot(model):
    return ([(n, type(m), id(m)) for n, m in model.named_modules(remove_duplicate=False)],
            {k: v.clone() for k, v in model.state_dict().items()})


def assert_unchanged(model, before):
    mods, state = snapshot(model)
    assert mods == before[0]
    assert state.keys() == before[1].keys() and all(torch.equal(state[k], before[1][k]) for k in state)


def fq(t, recipe, layout="rowwise", **kw):
    q = mixprec.quantize(t.detach().contiguous(), recipe, layout=layout, **kw)
    return mixprec.dequantize(q)


# ---- 1. attention: out_proj is never called ----------------------------------------------------

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.out(torch.relu(self.mid(a)))


def encoder_layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32),
                         nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True),
                         nn.Linear(32, 8))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.t = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=64, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.t(x, x)


ATTENTION_MODELS = {
    "mha": (Attn, 16, ["attn.out_proj"], ["inp", "mid", "out"]),
    "encoder_layer": (encoder_layer, 16, ["1.self_attn.out_proj"], ["0", "1.linear1", "1.linear2", "2"]),
    "transformer": (Transformer, 32, ["t.encoder.layers.0.self_attn.out_proj", "t.decoder.layers.0.self_attn.out_proj",
                                      "t.decoder.layers.0.multihead_attn.out_proj"],
                    ["t.encoder.layers.0.linear1", "t.encoder.layers.0.linear2", "t.decoder.layers.0.linear1",
                     "t.decoder.layers.0.linear2"]),
}


@pytest.mark.parametrize("kind", list(ATTENTION_MODELS))
def test_r4_attention_out_proj_is_not_swapped_and_every_listed_layer_runs_quantized(kind):
    factory, width, out_projs, linears = ATTENTION_MODELS[kind]
    x = torch.randn(2, 5, width)
    with pytest.warns(UserWarning, match=r"not swapped: .*'" + out_projs[0].replace(".", r"\.") +
                      r"'.*nn\.MultiheadAttention reads out_proj\.weight and out_proj\.bias itself"):
        m = mt.low_precision(factory(), "nvfp4", modules=lambda name, mod: True)
    listed = mt.low_precision_modules(m)
    assert sorted(listed) == sorted(linears)
    for name in out_projs:
        assert type(m.get_submodule(name)).__name__ == "NonDynamicallyQuantizableLinear"
    # The default (all but the first and last linear) warns the same way and lists no out_proj.
    with pytest.warns(UserWarning, match="not swapped"):
        d = mt.low_precision(factory(), "nvfp4")
    assert not any(n.endswith("out_proj") for n in mt.low_precision_modules(d))
    assert_each_runs_quantized(factory, (x,), linears)
    # Named explicitly: refused, naming the module and why, before anything is swapped.
    base = factory()
    before = snapshot(base)
    with pytest.raises(ValueError, match=f"module '{out_projs[0]}': cannot run in low precision: "
                       r"nn\.MultiheadAttention reads out_proj\.weight"):
        mt.low_precision(base, "nvfp4", modules=[linears[1], out_projs[0]])
    with pytest.raises(ValueError, match=f"assignment: module '{out_projs[0]}': cannot run in low precision"):
        mt.low_precision(base, {out_projs[0]: "mxfp8"})
    assert_unchanged(base, before)
    mt.low_precision(base, {out_projs[0]: "bf16"})  # keeping it high is what happens anyway
    assert not mt.low_precision_modules(base)


def test_r4_attention_out_proj_in_a_recipe_file(tmp_path):
    path = tmp_path / "attn.json"
    mt.save_assignment(path, {"attn.out_proj": "nvfp4"})
    with pytest.raises(ValueError, match=f"{path}: module 'attn.out_proj': cannot run in low precision: "
                       r"nn\.MultiheadAttention"):
        mt.low_precision(Attn(), str(path))
    mt.save_assignment(path, {"inp": "bf16"}, default="mxfp8")  # a default passes over it, saying so
    with pytest.warns(UserWarning, match=r"'attn\.out_proj': nn\.MultiheadAttention"):
        m = mt.low_precision(Attn(), str(path))
    assert sorted(mt.low_precision_modules(m)) == ["mid", "out"]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_r4_transformer_encoder_nested_fast_path_runs_the_swapped_layers():
    """TransformerEncoder turns a padded batch into a nested tensor in eval (no_grad) and runs its
    layers' fused path on it: with a swapped layer it keeps dense tensors and calls the module."""

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

        def forward(self, x, pad):
            return self.enc(x, src_key_padding_mask=pad)

    assert Enc().enc.use_nested_tensor
    x = torch.randn(2, 6, 32)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    base = Enc()
    for name in ("enc.layers.0.linear1", "enc.layers.1.linear2"):
        m = mt.low_precision(copy.deepcopy(base), "nvfp4", modules=[name])
        mod = m.get_submodule(name)
        for mode in MODES:
            mod.stats["x"].elements = 0
            got, want = run(m, (x, pad), mode), run(base, (x, pad), mode)
            assert mod.stats["x"].elements > 0, (name, mode)
            assert not torch.equal(got[0], want[0]) and not torch.equal(got[1, :4], want[1, :4]), (name, mode)


# ---- 2. transformers' Conv1D ----------------------------------------------------------------

def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # training mode repeats
    return transformers.GPT2LMHeadModel(cfg)


def test_r4_conv1d_counts_as_linear_and_runs_quantized():
    base = tiny_gpt2()
    from transformers.pytorch_utils import Conv1D

    convs = [n for n, m in base.named_modules() if isinstance(m, Conv1D)]
    assert convs == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                     "transformer.h.0.mlp.c_proj"]
    assert all(lp.is_linear_like(base.get_submodule(n)) for n in convs) and lp.is_linear_like(base.lm_head)
    keys = list(base.state_dict())
    m = mt.low_precision(copy.deepcopy(base), "nvfp4")  # all but the first and the last (lm_head)
    assert sorted(mt.low_precision_modules(m)) == sorted(convs[1:])
    # The module's own keys are kept; stochastic rounding adds its draw counter (sr_draws).
    assert [k for k in m.state_dict() if not k.endswith(".sr_draws")] == keys
    assert sorted(k for k in m.state_dict() if k.endswith(".sr_draws")) == sorted(f"{n}.sr_draws" for n in convs[1:])
    ids = torch.randint(0, 64, (2, 12))
    assert_each_runs_quantized(tiny_gpt2, (ids,), convs + ["lm_head"])
    # A short training step runs through the swapped Conv1D modules (weights [in, out]).
    m.train()
    m(ids, labels=ids).loss.backward()
    fc = m.transformer.h[0].mlp.c_fc
    assert isinstance(fc, LowPrecisionLinear) and fc.weight.grad.shape == fc.weight.shape == (32, 128)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8-block", "nvfp4"])
def test_r4_conv1d_gemms_are_the_linear_of_the_transposed_weight(recipe):
    """A Conv1D (y = x W + b, W [in, out]) quantizes as the nn.Linear of weight Wᵀ: fprop, dgrad,
    wgrad and bias grad equal the GEMMs composed by hand, bit for bit, and the weight's
    gradient comes back in the Conv1D's [in, out] layout."""
    base = tiny_gpt2()
    conv = base.transformer.h[0].mlp.c_fc  # W: [32, 128]
    opts = mt.RecipeOptions(recipe, **({"stochastic_rounding": False, "rht": False} if recipe == "nvfp4" else {}))
    mod = LowPrecisionLinear(conv, opts, "c_fc", seed=3)
    assert (mod.in_features, mod.out_features) == (32, 128) and mod.weight is conv.weight
    torch.manual_seed(9)
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = mod(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    e = "e2m1" if recipe == "nvfp4" else "e4m3"
    wk = {"tile_2d": True} if recipe in ("fp8-block", "nvfp4") else {}
    x2, dy2 = x.detach().reshape(-1, 32), dy.reshape(-1, 128)
    w = conv.weight.detach().t()  # the Linear weight [out, in]
    xq = fq(x2, recipe, element=e)
    wq = fq(w, recipe, element=e, **wk)
    assert torch.equal(y.detach().reshape(-1, 128), xq @ wq.t() + conv.bias.detach())
    dyq = fq(dy2, recipe, element=e)
    assert torch.equal(x.grad.reshape(-1, 32), dyq @ fq(w, recipe, layout="columnwise", element=e, **wk))
    dw = fq(dy2, recipe, layout="columnwise", element=e).t() @ fq(x2, recipe, layout="columnwise", element=e)
    assert torch.equal(conv.weight.grad, dw.t())
    assert torch.equal(conv.bias.grad, dy2.sum(0))


# ---- 3. modules: a str, a name twice -----------------------------------------------------------

def fc_model():
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("f", nn.Linear(8, 8))
    m.add_module("c", nn.Linear(8, 8))
    m.add_module("fc", nn.Linear(8, 8))
    return m


def test_r4_modules_str_and_duplicates_refused():
    m = fc_model()
    before = snapshot(m)
    with pytest.raises(TypeError, match=r"^modules: expected an iterable of module names or a predicate, found the "
                       r"str 'fc' \(one module: \['fc'\]\)$"):
        mt.low_precision(m, "nvfp4", modules="fc")
    with pytest.raises(ValueError, match=r"^modules: 'fc' is given twice \(each module is swapped once\)$"):
        mt.low_precision(m, "nvfp4", modules=["fc", "fc"])
    with pytest.raises(TypeError, match=r"modules: expected module names \(str\), found int 2"):
        mt.low_precision(m, "nvfp4", modules=["fc", 2])
    with pytest.raises(TypeError, match="modules: expected None, an iterable of module names or a predicate"):
        mt.low_precision(m, "nvfp4", modules=3)
    assert_unchanged(m, before)
    mt.low_precision(m, "nvfp4", modules=["fc"])
    assert list(mt.low_precision_modules(m)) == ["fc"]


# ---- 4. one module under two names --------------------------------------------------------------

class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.a = nn.Linear(32, 32)
        self.b = self.a  # the same module, registered twice
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.b(torch.relu(self.a(self.inp(x)))))


def test_r4_module_registered_twice_is_swapped_everywhere():
    x = torch.randn(4, 16)
    for modules in (None, ["a"], ["b"], lambda name, mod: name == "b"):
        m = mt.low_precision(Shared(), "nvfp4", modules=modules)
        assert isinstance(m.a, LowPrecisionLinear) and m.b is m.a, modules
        assert list(mt.low_precision_modules(m)) == ["a"]  # one module, under its first name
        lin = Shared().a
        w = fq(lin.weight, "nvfp4", tile_2d=True)

        def q(t):
            return fq(t, "nvfp4") @ w.t() + lin.bias.detach()

        with torch.no_grad():
            want = m.out(q(torch.relu(q(m.inp(x)))))
            assert torch.equal(m(x), want)
    m = Shared()
    before = snapshot(m)
    with pytest.raises(ValueError, match="recipe: modules 'a' and 'b' are one module .* name it once"):
        mt.low_precision(m, "nvfp4", modules=["a", "b"])
    with pytest.raises(ValueError, match="assignment: modules 'a' and 'b' are one module"):
        mt.low_precision(m, {"a": "nvfp4", "b": "mxfp8"})
    assert_unchanged(m, before)


# ---- 5. a recipe name is never a file ----------------------------------------------------------

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 10))


def test_r4_recipe_name_is_never_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mt.save_assignment(tmp_path / "nvfp4", {"0": "mxfp8"})  # a file named like a recipe
    m = mt.low_precision(mlp(), "nvfp4")
    assert {n: mm.options.recipe for n, mm in mt.low_precision_modules(m).items()} == {"2": "nvfp4", "4": "nvfp4"}
    for path in ("./nvfp4", pathlib.Path("nvfp4"), str(tmp_path / "nvfp4")):
        m = mt.low_precision(mlp(), path)
        assert {n: mm.options.recipe for n, mm in mt.low_precision_modules(m).items()} == {"0": "mxfp8"}, path
    mt.save_assignment(tmp_path / "mine", {"0": "mxfp8"})
    with pytest.raises(ValueError, match=r"recipe: expected one of fp8-delayed, .*, mxfp4, a zoo name \(.*\), a dict or a recipe file "
                       r"path \(ending in \.json or holding a path separator\), found 'mine' \(a file of that name is "
                       r"in the working folder: give it as './mine'\)"):
        mt.low_precision(mlp(), "mine")
    with pytest.raises(ValueError, match=r"found 'nvfp5'$"):
        mt.low_precision(mlp(), "nvfp5")


# ---- 6. float options as given ----------------------------------------------------------------

def test_r4_float_options_are_taken_as_float32_and_shown_as_given():
    x = np.full((2, 32), 1e-13, np.float32)
    # amax < epsilon: amax = epsilon (TE's compute_scale_from_amax), epsilon the nearest float32.
    q = mixprec.quantize(x, "fp8-current", amax_epsilon=1e-12)
    assert q.tensor_scale == float(np.float32(448.0) / np.float32(1e-12))
    q = mixprec.quantize(np.ones((2, 32), np.float32), "fp8-delayed", scale=0.1)
    assert q.tensor_scale == float(np.float32(0.1))
    assert mixprec.quantize(np.ones((2, 128), np.float32), "fp8-block", value_for_inf=1e30).counts["elements"] == 256
    held = r"that float32 holds \(in \[1.4e-45, 3.4028235e\+38\]\), found "
    for kw, shown in [(dict(amax_epsilon=-1e-12), r"amax_epsilon: expected a finite number >= 0 that float32 holds "
                                                  r"\(in \[0, 3.4028235e\+38\]\), found -1e-12$"),
                      (dict(scale=-0.1), "scale: expected a finite number > 0 " + held + "-0.1$"),
                      (dict(scale=float("nan")), "scale: expected a finite number > 0 " + held + "nan$"),
                      (dict(scale=1e-50), "scale: expected a finite number > 0 " + held + "1e-50$"),
                      (dict(value_for_inf=1e39), "value_for_inf: expected a finite number > 0 " + held + r"1e\+39$")]:
        recipe = "fp8-delayed" if "scale" in kw else "fp8-current"
        with pytest.raises(ValueError, match=shown):
            mixprec.quantize(x, recipe, **kw)
    with pytest.raises(TypeError, match="amax_epsilon: expected a number, found str '1e-12'"):
        mixprec.quantize(x, "fp8-current", amax_epsilon="1e-12")


def test_r4_core_quantize_messages_show_floats_as_given():
    """The compiled core's own checks (its callers other than mixprec.quantize): a float option
    is the nearest float32, a value out of range is shown as given, never '0.000000'."""
    from mixprec import _core

    x = np.ones((2, 32), np.float32)
    flt_max = float(np.finfo(np.float32).max)

    def core(eps=0.0, vfi=flt_max, scale=1.0, recipe="fp8-current"):
        return _core.quantize(x, recipe, None, "rowwise", False, "rceil", None, eps, vfi, scale, False, None, "te")

    assert core(eps=1e-12).counts["elements"] == 64
    assert core(scale=0.1, recipe="fp8-delayed").tensor_scale == float(np.float32(0.1))
    with pytest.raises(ValueError, match=r"amax_epsilon: expected a finite number >= 0, found -1e-12$"):
        core(eps=-1e-12)
    with pytest.raises(ValueError, match=r"value_for_inf: expected a number within float32's range "
                                         r"\(\|x\| <= 3.40282347e\+38\), found 1e\+39$"):
        core(vfi=1e39)
    with pytest.raises(ValueError, match=r"scale: expected a finite number > 0, found -0.1$"):
        core(scale=-0.1, recipe="fp8-delayed")


# ---- 7. negative-bit views ----------------------------------------------------------------------

def test_r4_quantize_resolves_a_negative_bit_view():
    one = torch.tensor([1 + 2j]).conj().imag  # the example: -2, held as 2 with the negative bit
    assert one.is_neg() and float(one) == -2.0
    q = mixprec.quantize(one, "fp8-current")
    assert float(mixprec.dequantize(q)[0]) == -2.0
    torch.manual_seed(3)
    re, im = torch.randn(4, 32), torch.randn(4, 32)
    view = torch.complex(re, im).conj().imag
    assert view.is_neg()
    plain = -im
    for recipe, kw in (("fp8-current", {}), ("mxfp8", {}), ("nvfp4", {"tile_2d": True})):
        a, b = mixprec.quantize(view, recipe, **kw), mixprec.quantize(plain, recipe, **kw)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), recipe
        assert torch.equal(mixprec.dequantize(a), mixprec.dequantize(b))


def test_r4_dequantize_refuses_a_negative_bit_out():
    q = mixprec.quantize(torch.tensor([[3.0]]), "fp8-current")
    out = torch.tensor([0j]).conj().imag  # written as the memory lies, it would read back -3
    assert out.is_neg() and out.is_contiguous()
    with pytest.raises(ValueError, match=r"out: expected a tensor without the negative bit, found a negative view"):
        mixprec.dequantize(q, out=out)
    plain = torch.zeros(1)
    assert mixprec.dequantize(q, out=plain) is plain and float(plain[0]) == 3.0


def test_r4_low_precision_linear_takes_a_negative_bit_input():
    torch.manual_seed(4)
    mod = LowPrecisionLinear(nn.Linear(1, 16), mt.RecipeOptions("mxfp8"), "lin")
    view = torch.tensor([[1 + 2j]]).conj().imag  # [[-2]], contiguous, with the negative bit
    assert view.is_neg() and view.is_contiguous()
    with torch.no_grad():
        assert torch.equal(mod(view), mod(torch.tensor([[-2.0]])))


# ---- 8. a refused call changes nothing ---------------------------------------------------------

class LoRALinear(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o)
        self.lora = nn.Linear(i, o, bias=False)

    def forward(self, x):
        return super().forward(x) + self.lora(x)


def test_r4_refused_call_leaves_the_model_unchanged(tmp_path, monkeypatch):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), LoRALinear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    before = snapshot(m)
    # The outer module runs code of its own (and holds the inner one): refused by name, with nothing
    # swapped (the earlier code swapped "1", then failed on "1.lora").
    with pytest.raises(ValueError, match="module '1': cannot run in low precision: its class LoRALinear has a "
                                         "forward of its own"):
        mt.low_precision(m, "nvfp4", modules=["2", "1", "1.lora"])
    bad = [dict(modules="2"), dict(modules=["2", "2"]), dict(modules=["2", "9"]), dict(modules=["2", "1"]),
           dict(modules=["2"], rhtt=True), dict(modules=["2"], scale_rounding="floor")]
    for kw in bad:
        with pytest.raises((TypeError, ValueError)):
            mt.low_precision(m, "nvfp4", **kw)
        assert_unchanged(m, before)
    for recipe in ({"2": "nvfp4", "9": "mxfp8"}, {"2": "nvfp4", "1": "mxfp8"}, "nvfp5", 7):
        with pytest.raises(ValueError):
            mt.low_precision(m, recipe)
        assert_unchanged(m, before)
    # A failure while the replacements are built (after the checks): still nothing swapped.
    made = []

    class Failing(LowPrecisionLinear):
        def __init__(self, *a, **k):
            made.append(1)
            if len(made) == 2:
                raise RuntimeError("injected")
            super().__init__(*a, **k)

    monkeypatch.setattr(lp, "LowPrecisionLinear", Failing)
    with pytest.raises(RuntimeError, match="injected"):
        mt.low_precision(m, "nvfp4", modules=["2", "3"])
    assert_unchanged(m, before)


def test_r4_unswappable_linears_are_passed_over_or_refused():
    """Linear modules a LowPrecisionLinear would not stand in for: a class with its own forward,
    a parametrized (computed) weight, a lazy module, the model itself."""

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), LoRALinear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    torch.nn.utils.parametrize.register_parametrization(m[2], "weight", Double())
    x = torch.randn(3, 8)
    want = m(x)
    with pytest.warns(UserWarning) as rec:
        mt.low_precision(m, "nvfp4")
    (text,) = [str(w.message) for w in rec if "low_precision" in str(w.message)]
    assert "'1': its class LoRALinear has a forward of its own" in text
    assert "'2': its weight or bias is computed (a parametrization or weight_norm)" in text
    # All but the first and last of the others (0, 1.lora, 3, 4): the LoRA's inner Linear is called.
    assert sorted(mt.low_precision_modules(m)) == ["1.lora", "3"]
    assert isinstance(m[2].parametrizations.weight[0], Double)  # untouched: still trains its original
    assert not torch.equal(m(x), want)
    with pytest.raises(ValueError, match="module '2': cannot run in low precision: its weight or bias is computed"):
        mt.low_precision(m, "nvfp4", modules=["2"])
    lazy = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="module '1': cannot run in low precision: its weight is not initialized"):
        mt.low_precision(lazy, "nvfp4", modules=["1"])
    with pytest.warns(UserWarning, match="'': it is the model itself"):
        mt.low_precision(nn.Linear(4, 4), "nvfp4")


def test_r4_stochastic_rounding_resumes_exactly_from_a_state_dict():
    """nvfp4's stochastic rounding draws per module from (seed, draw): the draw count is in
    state_dict (sr_draws), so a run resumed from a checkpoint equals the uninterrupted run bit
    for bit (was: the count restarted at 0, so the resumed run drew other words)."""
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        mt.low_precision(m, "nvfp4", modules=["0", "2"])
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 32, generator=g) for _ in range(5)]

    def step(m, opt, x):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()

    m, opt = make()
    for x in batches[:3]:
        step(m, opt, x)
    assert int(m[0].sr_draws) > 0 and "0.sr_draws" in m.state_dict()
    saved = copy.deepcopy((m.state_dict(), opt.state_dict()))
    for x in batches[3:]:
        step(m, opt, x)
    m2, opt2 = make()
    m2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    for x in batches[3:]:
        step(m2, opt2, x)
    for (name, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), name
    # A run that restarts the draws (the old behaviour) differs: the test can tell.
    m3, opt3 = make()
    m3.load_state_dict(saved[0])
    opt3.load_state_dict(saved[1])
    for mod in (m3[0], m3[2]):
        mod.sr_draws.zero_()
    for x in batches[3:]:
        step(m3, opt3, x)
    assert not torch.equal(m3[0].weight, m[0].weight)


def _run_python(code: str, timeout: float = 120):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_r4_deep_recipe_text_is_refused_not_a_crash():
    """plan_assignment of 100,000-deep JSON (was: SIGSEGV, exit 139): run in a child so that a
    crash fails this test instead of the whole session."""
    r = _run_python("import mixprec._core as c\n"
                    "try:\n    c.plan_assignment('[' * 100000 + ']' * 100000)\n"
                    "except ValueError as e:\n    print('ValueError:', e)\n")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "ValueError: recipe file: JSON nested deeper than 256 levels" in r.stdout, r.stdout


@pytest.mark.parametrize("case", ["deep", "fifo", "device", "bom", "duplicate", "latin1", "huge_number", "folder"])
def test_r4_recipe_files_the_core_refuses(tmp_path, case):
    """Every hostile recipe file is a ValueError naming the file and the rule, never a crash or
    a hang (a FIFO hung open(); deep nesting crashed). Each runs in a child with a time limit."""
    path = tmp_path / "recipe.json"
    good = '{"format": "mixprec.low_precision", "version": 1, "modules": {"0": "nvfp4"}}'
    expect = {
        "deep": "JSON nested deeper than 256 levels",
        "fifo": "is a FIFO (named pipe), not a regular file",
        "device": "'/dev/zero' is a character device, not a regular file",
        "bom": "starts with a UTF-8 byte-order mark",
        "duplicate": "modules: key '0' is given twice",
        "latin1": "recipe file: not UTF-8 text: byte 0xe9 at offset",
        "huge_number": "malformed JSON",
        "folder": "is a folder, not a regular file",
    }[case]
    if case == "deep":
        path.write_text("[" * 100000 + "]" * 100000)
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "device":
        path = pathlib.Path("/dev/zero")
    elif case == "bom":
        path.write_bytes(b"\xef\xbb\xbf" + good.encode())
    elif case == "duplicate":
        path.write_text(good.replace('"0": "nvfp4"', '"0": "nvfp4", "0": "mxfp8"'))
    elif case == "latin1":
        path.write_bytes(good.replace('"nvfp4"}', '"nvfp4"}, "notes": "caf\xe9"').encode("latin-1"))
    elif case == "huge_number":
        path.write_text(good.replace('"version": 1', '"version": 1e400'))
    elif case == "folder":
        path = tmp_path
    r = _run_python("import torch, mixprec.torch as mt\n"
                    "m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))\n"
                    "try:\n"
                    f"    mt.low_precision(m, {str(path)!r})\n"
                    "except ValueError as e:\n    print('ValueError:', e)\n", timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "ValueError: " in r.stdout and expect in r.stdout, r.stdout
