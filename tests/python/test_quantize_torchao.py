"""mixprec.quantize against torchao (PyPI), run for real on the CPU.

Where torchao's formula equals the one mixprec follows (flavour="torchao"), the codes and the
scales are equal bit for bit on random and edge tensors. Where torchao and Transformer Engine
differ (docs/low_precision.md, "TE and torchao"), each difference is shown both ways: the TE
flavour (default) differs from torchao exactly there, and equals TE's formula written out in
torch ops here.
"""

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

import mixprec

torch.set_num_threads(1)

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MODES = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}


def random_tensor(rows, cols, seed, spread=30.0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2((torch.rand(rows, cols, generator=g) - 0.5) * spread)
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    x = (mag * sign).float()
    x[torch.rand(rows, cols, generator=g) < 0.03] = 0.0
    return x


def edge_tensor(cols=64, with_nonfinite=True):
    """One row per edge case, blocks of 32 and 16 aligned with the rows."""
    rows = []
    rows.append(torch.zeros(cols))                                          # all zero
    rows.append(torch.full((cols,), 2.0**-140))                             # fp32 subnormal amax
    rows.append(torch.linspace(-448.0, 448.0, cols))                        # amax = 448 exactly
    rows.append(torch.linspace(-1.0, 1.0, cols) * float(np.finfo(np.float32).max))  # amax at FLT_MAX
    r = torch.ones(cols); r[3] = 3.0e-39; rows.append(r)                    # a subnormal element
    r = torch.linspace(-6.0, 6.0, cols); rows.append(r)                     # E2M1 grid
    r = torch.arange(cols, dtype=torch.float32) * 0.25 - 7.9; rows.append(r)  # E2M1 ties
    if with_nonfinite:
        r = torch.ones(cols); r[5] = float("inf"); rows.append(r)          # a block with inf
        r = torch.ones(cols); r[7] = float("nan"); rows.append(r)          # a block with NaN
    return torch.stack(rows).float()


def codes_u8(t):
    return t.view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()


def e5m2_nan_as_one(c):
    """E5M2 has several NaN codes: torch writes S.11111.11, mixprec's encoder keeps the top
    payload bits (S.11111.10 for the default NaN). Both are NaN; compare them as one."""
    c = c.copy()
    nan = ((c & 0x7C) == 0x7C) & ((c & 0x03) != 0)
    c[nan] = (c[nan] & 0x80) | 0x7F
    return c


def exact_ceil_log2(d):
    """ceil(log2(d)) for float32 d > 0, exactly (what the rceil rule means)."""
    m, e = math.frexp(float(d))
    return e - 1 if m == 0.5 else e


def log2_mismatch_blocks(x, block, elem_max):
    """Blocks whose amax / elem_max lies where torch's float32 log2 rounds to the power of two
    below the exact one (torchao's RCEIL then takes the smaller exponent)."""
    amax = x.abs().reshape(x.shape[0], -1, block).amax(-1)
    d = (amax / elem_max).float()
    out = torch.zeros_like(d, dtype=torch.bool)
    for idx in torch.nonzero(torch.isfinite(d) & (d > 0)):
        v = d[tuple(idx)].item()
        out[tuple(idx)] = math.ceil(torch.log2(torch.tensor(v, dtype=torch.float32)).item()) != exact_ceil_log2(v)
    return out


# ---- MX (mxfp8 / mxfp4): torchao flavour bit for bit --------------------------------------

@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_mx_torchao_flavour_equals_torchao(mode, element):
    recipe = "mxfp4" if element == "e2m1" else "mxfp8"
    tdtype = torch.float4_e2m1fn_x2 if element == "e2m1" else FP8[element]
    elem_max = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}[element]
    cases = [random_tensor(16, 256, s) for s in range(3)] + [random_tensor(8, 64, 9, spread=200.0)]
    # E2M1 has no NaN: torchao's cast writes an undefined byte for NaN (its docstring says so).
    cases.append(edge_tensor(with_nonfinite=element != "e2m1"))
    for x in cases:
        s_ao, d_ao = to_mx(x, tdtype, 32, MODES[mode])
        q = mixprec.quantize(x, recipe, element=element, scale_rounding=mode, flavour="torchao")
        scales = codes_u8(q.scales)
        codes = codes_u8(q.codes)
        want_s = codes_u8(s_ao)
        want_c = codes_u8(d_ao)
        if element == "e5m2":
            codes, want_c = e5m2_nan_as_one(codes), e5m2_nan_as_one(want_c)
        if mode == "rceil":
            # The one named difference: torchao's float32 log2 (exact ceil here).
            bad = log2_mismatch_blocks(x, 32, elem_max).numpy()
            assert np.all(scales[bad] == want_s[bad] + 1)
            keep = ~bad
            np.testing.assert_array_equal(scales[keep], want_s[keep])
            per_block = codes.reshape(codes.shape[0], -1, 32 if element != "e2m1" else 16)
            want_block = want_c.reshape(per_block.shape)
            np.testing.assert_array_equal(per_block[keep], want_block[keep])
        else:
            np.testing.assert_array_equal(scales, want_s)
            np.testing.assert_array_equal(codes, want_c)


def test_rceil_log2_difference_is_real():
    # amax / 448 = 16 * (1 + 2^-23): torch's float32 log2 gives exactly 4, so torchao picks
    # exponent 4 and saturates; the exact rule (TE, cuBLAS, mixprec) picks 5.
    d = np.float32(16.0) * (np.float32(1.0) + np.float32(2.0**-23))
    x = torch.full((1, 32), float(d) * 448.0)
    s_ao, _ = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    q = mixprec.quantize(x, "mxfp8", flavour="torchao")
    assert codes_u8(s_ao)[0, 0] == 127 + 4
    assert codes_u8(q.scales)[0, 0] == 127 + 5
    assert codes_u8(mixprec.quantize(x, "mxfp8").scales)[0, 0] == 127 + 5


def test_mx_te_and_torchao_rceil_differ_only_where_named():
    # Named differences of TE's rceil from torchao's: (1) amax * float(1/max) against
    # amax / max, (2) a block holding inf (TE: factor 0, so inf -> NaN and the rest 0;
    # torchao: factor 2^-127), (3) NaN (TE ignores it for the scale; torchao: scale NaN).
    x = random_tensor(64, 256, 42)
    te = mixprec.quantize(x, "mxfp8")
    ao = mixprec.quantize(x, "mxfp8", flavour="torchao")
    amax = x.abs().reshape(64, -1, 32).amax(-1)
    mul = (amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)).numpy()
    div = (amax / 448.0).numpy()
    ceil_mul = np.array([[exact_ceil_log2(v) if v > 0 else -127 for v in r] for r in mul])
    ceil_div = np.array([[exact_ceil_log2(v) if v > 0 else -127 for v in r] for r in div])
    differ = ceil_mul != ceil_div
    np.testing.assert_array_equal(codes_u8(te.scales)[~differ], codes_u8(ao.scales)[~differ])
    # Edge blocks: inf and NaN.
    e = edge_tensor()
    te_e = mixprec.quantize(e, "mxfp8")
    ao_e = mixprec.quantize(e, "mxfp8", flavour="torchao")
    s_ao, d_ao = to_mx(e, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    inf_row, nan_row = 7, 8
    assert codes_u8(te_e.scales)[inf_row, 0] == 0xFE and codes_u8(s_ao)[inf_row, 0] == 0xFE
    assert codes_u8(te_e.codes)[inf_row, 5] & 0x7F == 0x7F          # TE: inf * 0 = NaN
    assert codes_u8(ao_e.codes)[inf_row, 5] == codes_u8(d_ao)[inf_row, 5] == 0x7E  # torchao: 448
    assert codes_u8(te_e.scales)[nan_row, 0] == 127 - 8              # from the other values' amax 1
    assert codes_u8(s_ao)[nan_row, 0] == 0xFF == codes_u8(ao_e.scales)[nan_row, 0]
    np.testing.assert_array_equal(codes_u8(te_e.scales)[:7], codes_u8(ao_e.scales)[:7])


def test_mx_floor_te_ocp_and_torchao_differ_only_where_named():
    # OCP floor (mixprec's scale_rounding="floor", flavour te) against torchao's FLOOR: a
    # block whose exponent clamps to code 0 is scaled by 2^127 (OCP) or 2^126 (torchao's
    # clamp to the smallest normal); inf gives scale NaN (OCP) or a finite one (torchao).
    x = random_tensor(32, 256, 5)
    np.testing.assert_array_equal(codes_u8(mixprec.quantize(x, "mxfp8", scale_rounding="floor").codes),
                                  codes_u8(to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)[1]))
    tiny = torch.full((1, 32), 2.0**-133)
    ocp = mixprec.quantize(tiny, "mxfp8", scale_rounding="floor")
    ao = mixprec.quantize(tiny, "mxfp8", scale_rounding="floor", flavour="torchao")
    s_ao, d_ao = to_mx(tiny, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    assert codes_u8(ocp.scales)[0, 0] == codes_u8(ao.scales)[0, 0] == codes_u8(s_ao)[0, 0] == 0
    assert codes_u8(ocp.codes)[0, 0] == 0x08      # 2^-133 * 2^127 = 2^-6 (E4M3 min normal)
    assert codes_u8(ao.codes)[0, 0] == codes_u8(d_ao)[0, 0] == 0x04  # * 2^126 = 2^-7 (subnormal)
    inf = torch.ones(1, 32); inf[0, 1] = float("inf")
    assert codes_u8(mixprec.quantize(inf, "mxfp8", scale_rounding="floor").scales)[0, 0] == 0xFF
    assert codes_u8(to_mx(inf, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)[0])[0, 0] == 127 + 120


# ---- NVFP4 ---------------------------------------------------------------------------------

def test_nvfp4_torchao_flavour_equals_torchao():
    cases = [random_tensor(32, 256, s) for s in range(3)]
    cases += [random_tensor(16, 64, 11, spread=60.0), edge_tensor(with_nonfinite=False)[1:]]
    for x in cases:
        pts = per_tensor_amax_to_scale(x.abs().max())
        s_ao, d_ao = nvfp4_quantize(x, 16, pts)
        q = mixprec.quantize(x, "nvfp4", flavour="torchao")
        assert np.float32(q.tensor_scale) == pts.item()
        np.testing.assert_array_equal(codes_u8(q.scales), codes_u8(s_ao))
        np.testing.assert_array_equal(codes_u8(q.codes), codes_u8(d_ao))


def te_nvfp4_reference(x):
    """TE's NVFP4 quantizer (quantization_ref_nvfp4.py's formula, 1x16 blocks) in torch ops."""
    m, n = x.shape
    amax = x.abs().max().float()
    s_enc = torch.minimum(torch.tensor(448.0 * 6.0) / amax, torch.tensor(np.finfo(np.float32).max))
    if s_enc.item() == 0.0 or amax.item() == 0.0:
        s_enc = torch.tensor(1.0)
    s_dec = torch.tensor(1.0) / s_enc
    blocks = x.reshape(m, n // 16, 16)
    vec_max = blocks.abs().amax(-1, keepdim=True)
    dec = torch.minimum(vec_max * (s_enc * torch.reciprocal(torch.tensor(6.0))), torch.tensor(np.finfo(np.float32).max))
    dec = torch.clamp(dec, -448.0, 448.0).to(torch.float8_e4m3fn)
    enc = torch.minimum(1.0 / (dec.float() * s_dec), torch.tensor(np.finfo(np.float32).max))
    y = torch.clamp(blocks * enc, -6.0, 6.0).reshape(m, n)
    # Round to nearest even on the E2M1 grid (TE's cast_to_fp4x2 thresholds), sign kept.
    a = y.abs()
    bounds = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    code = torch.zeros_like(a, dtype=torch.int32)
    for b, inclusive in bounds:
        code += (a >= b if inclusive else a > b).to(torch.int32)
    code |= torch.signbit(y).to(torch.int32) << 3
    packed = (code[:, ::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return dec.view(torch.uint8).reshape(m, n // 16).numpy(), packed.numpy(), s_enc.item()


def test_nvfp4_te_flavour_equals_te_formula_and_differs_from_torchao():
    for seed in range(3):
        x = random_tensor(32, 128, 100 + seed, spread=24.0)
        scales, packed, s_enc = te_nvfp4_reference(x)
        q = mixprec.quantize(x, "nvfp4")
        assert np.float32(q.tensor_scale) == np.float32(s_enc)
        np.testing.assert_array_equal(codes_u8(q.scales), scales)
        np.testing.assert_array_equal(codes_u8(q.codes), packed)
    # The two anchors disagree (torchao divides amax/6 by amax/2688 and clamps the block scale
    # at E4M3's smallest normal 2^-6): on a wide-range tensor some block scales differ.
    x = random_tensor(32, 128, 7, spread=40.0)
    te = codes_u8(mixprec.quantize(x, "nvfp4").scales)
    ao = codes_u8(mixprec.quantize(x, "nvfp4", flavour="torchao").scales)
    assert (te != ao).any()
    assert ((te < 8) & (ao == 8)).any() or (te != ao).sum() > 0  # the 2^-6 clamp: code 0x08


def test_nvfp4_dequantize_as_each_anchor():
    x = random_tensor(8, 64, 3, spread=10.0)
    q = mixprec.quantize(x, "nvfp4")
    # TE: e2m1 * (float(scale) * amax * float32(1 / 2688)).
    fp4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    c = codes_u8(q.codes)
    e = np.empty((8, 64), np.float32)
    e[:, 0::2] = fp4[c & 0xF]
    e[:, 1::2] = fp4[c >> 4]
    s = codes_u8(q.scales).view(np.uint8)
    sf = torch.from_numpy(s.copy()).view(torch.float8_e4m3fn).float().numpy()
    final = (sf * np.float32(q.tensor_amax)) * np.float32(1.0 / 2688.0)
    want = e * np.repeat(final, 16, axis=1)
    np.testing.assert_array_equal(mixprec.dequantize(q).numpy(), want)


# ---- the doors: arrays in place, errors -----------------------------------------------------

def test_numpy_and_torch_in_place_and_same_result():
    x = random_tensor(4, 64, 1)
    a = mixprec.quantize(x.numpy(), "fp8-current")
    b = mixprec.quantize(x, "fp8-current")
    assert isinstance(a.codes, np.ndarray) and isinstance(b.codes, torch.Tensor)
    np.testing.assert_array_equal(a.codes, b.codes.numpy())
    assert a.counts == b.counts
    assert mixprec.dequantize(b).shape == x.shape
    # bf16 input: converted once; fp8-block's value_for_inf is bf16's largest finite (TE's IType).
    y = torch.full((1, 128), 2.0**-130).bfloat16()  # a bf16 subnormal: 448 / amax overflows
    q = mixprec.quantize(y, "fp8-block", power_of_2_scales=False)
    assert q.scales[0, 0].item() == np.float32(1.0) / np.float32(float.fromhex("0x1.fep127"))


def test_errors_name_what_and_where():
    x = np.ones((2, 32), np.float32)
    with pytest.raises(ValueError, match="recipe: expected one of fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4, found 'fp4'"):
        mixprec.quantize(x, "fp4")
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        mixprec.quantize(x.astype(np.float64), "mxfp8")
    with pytest.raises(ValueError, match="C-contiguous"):
        mixprec.quantize(np.ones((32, 4), np.float32).T, "mxfp8")
    with pytest.raises(ValueError, match="element: expected e2m1, found e4m3"):
        mixprec.quantize(x, "nvfp4", element="e4m3")
    with pytest.raises(ValueError, match="stochastic_rounding: give random"):
        mixprec.quantize(x, "nvfp4", stochastic_rounding=True)
    assert mixprec.RECIPES == ("fp8-delayed", "fp8-current", "mxfp8", "fp8-block", "nvfp4", "mxfp4")


def test_stochastic_rounding_is_unbiased():
    x = np.full((1, 4096), 0.3, np.float32)
    x[0, 0] = 6.0  # amax 6: S_enc = 448, block scale 448 / 448... fixed grid
    q = mixprec.quantize(x, "nvfp4", stochastic_rounding=True, seed=1)
    mean = float(mixprec.dequantize(q)[0, 16:].mean())
    assert abs(mean - 0.3) < 0.01
    q2 = mixprec.quantize(x, "nvfp4", stochastic_rounding=True, seed=1)
    np.testing.assert_array_equal(q.codes, q2.codes)
