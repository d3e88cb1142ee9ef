// fp8 Linear layers of the fp8 presets (src/nn/fp8_linear.hpp) against plain scalar
// references: the quantized operands bit for bit against element loops written here from
// the format's encode/decode and lowp's scale rules (and lowp::quantize / dequantize for
// the block-scaled presets), the GEMMs against a naive triple loop in double, and the
// scales each recipe uses against hand computations.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mixprec/lowp/scaling.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/nn/layers.hpp"
#include "nn/fp8_linear.hpp"

namespace mixprec::nn::detail {
namespace {

using lowp::Element;
// The engine's presets' GEMM quantization (nn/precision.hpp's rows).
constexpr QuantizedGemms kNoscale{lowp::Recipe::fp8_delayed, true}, kDelayed{lowp::Recipe::fp8_delayed},
    kCurrent{lowp::Recipe::fp8_current}, kMx{lowp::Recipe::mxfp8}, kBlock{lowp::Recipe::fp8_block},
    kNvfp4{lowp::Recipe::nvfp4}, kMx4{lowp::Recipe::mxfp4};

// Values over many binades (2^-30 .. 2^6), signs mixed, a few exact zeros.
std::vector<float> spread(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-30, 6);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = (rng() % 2 ? -1.0f : 1.0f) * std::ldexp(mant(rng), ex(rng)) * scale;
    if (rng() % 37 == 0) v[i] = 0.0f;
  }
  return v;
}

std::vector<float> normal(std::size_t n, std::uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

using Dtype = lowp::Element;
constexpr EncodeMode kSaturate{Overflow::saturate, Subnormals::keep};

// Per tensor: decode(encode_sat(x * scale)) * scale_inv, one element at a time.
template <class T>
std::vector<float> reference_qdq(const std::vector<float>& x, float scale, float scale_inv) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(decode(encode<T>(x[i] * scale, kSaturate))) * scale_inv;
  return out;
}

std::vector<float> reference_qdq(Dtype d, const std::vector<float>& x, float scale, float scale_inv) {
  return d == Dtype::e4m3 ? reference_qdq<f8e4m3>(x, scale, scale_inv) : reference_qdq<f8e5m2>(x, scale, scale_inv);
}

// MX: rows of row_len values cut into blocks of 32 from each row's start. A block's amax is
// TE's (NaN ignored) for rceil and OCP's (NaN if the block holds one) for floor; its E8M0
// scale is lowp::mx_scale; a block whose scale is NaN reads as NaN throughout; else each
// value is decode(encode_sat(x * factor)) * 2^(scale exponent).
template <class T>
std::vector<float> reference_mx(const std::vector<float>& x, std::size_t row_len, lowp::ScaleRounding r) {
  constexpr Dtype d = std::is_same_v<T, f8e4m3> ? Dtype::e4m3 : Dtype::e5m2;
  std::vector<float> out(x.size());
  for (std::size_t row = 0; row < x.size(); row += row_len) {
    for (std::size_t b = 0; b < row_len; b += lowp::kMxBlock) {
      const std::size_t len = std::min(lowp::kMxBlock, row_len - b);
      const float* blk = x.data() + row + b;
      float amax = 0.0f;
      bool nan = false;
      for (std::size_t i = 0; i < len; ++i) {
        nan = nan || std::isnan(blk[i]);
        if (!std::isnan(blk[i])) amax = std::max(amax, std::fabs(blk[i]));
      }
      if (r == lowp::ScaleRounding::floor && nan) amax = std::numeric_limits<float>::quiet_NaN();
      const e8m0 scale = lowp::mx_scale(amax, d, r);
      const float factor = lowp::mx_quantize_factor(scale, r);
      for (std::size_t i = 0; i < len; ++i) {
        out[row + b + i] = scale.bits() == 0xFF ? std::numeric_limits<float>::quiet_NaN()
                                                : static_cast<float>(decode(encode<T>(blk[i] * factor, kSaturate))) *
                                                      static_cast<float>(scale);
      }
    }
  }
  return out;
}

std::vector<float> reference_mx(Dtype d, const std::vector<float>& x, std::size_t row_len, lowp::ScaleRounding r) {
  return d == Dtype::e4m3 ? reference_mx<f8e4m3>(x, row_len, r) : reference_mx<f8e5m2>(x, row_len, r);
}

// max |v| of finite values (the tests' tensors hold no inf or NaN).
float tensor_amax(const std::vector<float>& v) {
  float m = 0.0f;
  for (const float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// lowp::quantize's mxfp8 of x[rows, row_len] (rowwise), dequantized.
lowp::Quantized lowp_mx(Dtype d, const std::vector<float>& x, std::size_t row_len, lowp::ScaleRounding r) {
  lowp::QuantizeConfig c;
  c.recipe = lowp::Recipe::mxfp8;
  c.element = d;
  c.scale_rounding = r;
  return lowp::quantize(x, x.size() / row_len, row_len, c);
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  std::size_t diffs = 0, first = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]) && diffs++ == 0) first = i;
  }
  EXPECT_EQ(diffs, 0u) << what << ": first difference at " << first << ": " << a[first] << " vs " << b[first];
}

// The per-tensor presets run lowp::quantize (fp8-delayed at a given scale): against the
// element loop, and its counts against counts made here.
TEST(Fp8FakeQuantize, PerTensorMatchesTheScalarReferencesAndCounts) {
  for (Dtype d : {Dtype::e4m3, Dtype::e5m2}) {
    for (float scale : {1.0f, 448.0f / 3.0f, 3.5e6f, 1.0f / 1024}) {
      std::vector<float> x = spread(4099, 7);
      x[5] = 1e30f;  // saturates at every scale
      x[6] = -1e30f;
      lowp::QuantizeConfig c;
      c.recipe = lowp::Recipe::fp8_delayed;
      c.element = d;
      c.scale = scale;
      const lowp::Quantized q = lowp::quantize(x, 1, x.size(), c);
      const std::vector<float> ref = reference_qdq(d, x, scale, 1.0f / scale);
      expect_same_bits(lowp::dequantize(q), ref, "lowp fp8-delayed");
      // Counted independently: flushed = nonzero inputs whose reference value is 0;
      // saturated = inputs whose scaled magnitude is past the largest finite value.
      const float fmax = lowp::max_finite(d);
      std::uint64_t flushed = 0, saturated = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        if (x[i] == 0.0f) continue;
        if (ref[i] == 0.0f) ++flushed;
        if (std::fabs(x[i] * scale) > fmax) ++saturated;
      }
      EXPECT_EQ(q.counts.elements, x.size());
      EXPECT_EQ(q.counts.flushed, flushed);
      EXPECT_EQ(q.counts.saturated, saturated);
      EXPECT_GE(saturated, 2u);
    }
  }
}

// The engine's mxfp8 preset runs lowp::quantize: against the element loop on edge blocks
// (all zero, inf, NaN, subnormal only, a power-of-two amax, a short last block).
TEST(Fp8FakeQuantize, MxMatchesTheScalarReferencesOnEdgeBlocks) {
  constexpr std::size_t kRow = 80;  // blocks of 32, 32 and 16 per row
  for (Dtype d : {Dtype::e4m3, Dtype::e5m2}) {
    for (lowp::ScaleRounding r : {lowp::ScaleRounding::rceil, lowp::ScaleRounding::floor}) {
      std::vector<float> x = spread(kRow * 6, 11);
      for (std::size_t i = 0; i < 32; ++i) x[kRow + i] = 0.0f;                  // an all-zero block
      x[2 * kRow + 3] = std::numeric_limits<float>::infinity();                 // a block holding inf
      x[3 * kRow + 40] = std::numeric_limits<float>::quiet_NaN();               // one holding NaN
      for (std::size_t i = 0; i < 16; ++i) x[4 * kRow + 64 + i] = 1e-41f;       // subnormal-only tail block
      x[5 * kRow + 1] = 4.0f;                                                   // amax at a power of two
      const lowp::Quantized q = lowp_mx(d, x, kRow, r);
      expect_same_bits(lowp::dequantize(q), reference_mx(d, x, kRow, r), "lowp mxfp8");
      EXPECT_EQ(q.counts.elements, x.size());
      EXPECT_EQ(q.counts.nonfinite, 2u);
    }
  }
}

// TE's MX scale for a block whose amax is 1: E8M0 of 1/448 rounded up, 2^-8, so the
// factor applied before the cast is 2^8; OCP: floor(log2 1) - 8 = -8, the same.
TEST(Fp8FakeQuantize, MxBlockScalesByHand) {
  std::vector<float> x(64, 0.25f);
  x[7] = 1.0f;      // first block: amax 1 -> factor 256 (scale 2^-8)
  x[40] = 0.0625f;  // second block: amax 0.25 -> factor 1024 (scale 2^-10)
  for (lowp::ScaleRounding r : {lowp::ScaleRounding::rceil, lowp::ScaleRounding::floor}) {
    const lowp::Quantized q = lowp_mx(Dtype::e4m3, x, 64, r);
    ASSERT_EQ(q.scale_codes.size(), 2u);
    EXPECT_EQ(q.scale_codes[0], 127 - 8) << lowp::scale_rounding_name(r);
    EXPECT_EQ(q.scale_codes[1], 127 - 10);
    const std::vector<float> out = lowp::dequantize(q);
    EXPECT_EQ(out[7], 1.0f);
    EXPECT_EQ(out[40], 0.0625f);
  }
  // Block amax 1.875: TE rounds 1.875 / 448 = 2^-7.9 up to 2^-7, factor 128, nothing
  // saturates; OCP floors, floor(log2 1.875) - 8 = -8, factor 256, and 1.875 * 256 = 480
  // saturates to 448 (so the value reads back as 1.75).
  x[7] = 1.875f;
  const lowp::Quantized te = lowp_mx(Dtype::e4m3, x, 64, lowp::ScaleRounding::rceil);
  EXPECT_EQ(te.scale_codes[0], 127 - 7);
  EXPECT_EQ(te.counts.saturated, 0u);
  EXPECT_EQ(lowp::dequantize(te)[7], 1.875f);
  const lowp::Quantized ocp = lowp_mx(Dtype::e4m3, x, 64, lowp::ScaleRounding::floor);
  EXPECT_EQ(ocp.scale_codes[0], 127 - 8);
  EXPECT_EQ(ocp.counts.saturated, 1u);
  EXPECT_EQ(lowp::dequantize(ocp)[7], 1.75f);
}

// ---- Fp8Linears against a naive reference ---------------------------------------------

constexpr std::size_t kN = 64, kC = 48, kOC = 40;

// y[N,OC] = x[N,C] w[OC,C]^T (+ b), in double.
std::vector<double> naive_forward(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b) {
  std::vector<double> y(kN * kOC);
  for (std::size_t n = 0; n < kN; ++n)
    for (std::size_t o = 0; o < kOC; ++o) {
      double s = b.empty() ? 0.0 : static_cast<double>(b[o]);
      for (std::size_t c = 0; c < kC; ++c) s += static_cast<double>(x[n * kC + c]) * static_cast<double>(w[o * kC + c]);
      y[n * kOC + o] = s;
    }
  return y;
}

void expect_close(std::span<const float> got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(static_cast<double>(got[i]), want[i], 1e-5 * scale + 1e-30) << what << " element " << i;
  }
}

std::vector<float> transposed(const std::vector<float>& v, std::size_t rows, std::size_t cols) {
  std::vector<float> t(v.size());
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}

struct LinearCase {
  std::vector<float> x = normal(kN * kC, 1, 1.0f);
  std::vector<float> w = normal(kOC * kC, 2, 0.05f);
  std::vector<float> b = normal(kOC, 3, 0.1f);
  std::vector<float> dy = normal(kN * kOC, 4, 1e-4f);
};

// Runs forward and backward once and checks them against the references built from the
// given quantized operands: xq/wq (forward), dyq with wq_dgrad (dgrad), dyq_wgrad with
// xq_wgrad (wgrad).
void check_linear(Fp8Linears& f, const LinearCase& t, const std::vector<float>& xq, const std::vector<float>& wq,
                  const std::vector<float>& dyq, const std::vector<float>& wq_dgrad,
                  const std::vector<float>& dyq_wgrad, const std::vector<float>& xq_wgrad) {
  Gemm g;
  std::vector<float> y(kN * kOC), dx(kN * kC, 0.0f), dw(kOC * kC, 0.0f), db(kOC, 0.0f);
  f.forward(g, 0, y, t.x, t.w, t.b, kN);
  expect_close(y, naive_forward(xq, wq, t.b), "y");
  f.backward(g, 0, dx, dw, db, t.dy, t.w);
  std::vector<double> rdx(kN * kC, 0.0), rdw(kOC * kC, 0.0), rdb(kOC, 0.0);
  for (std::size_t n = 0; n < kN; ++n)
    for (std::size_t o = 0; o < kOC; ++o) {
      rdb[o] += static_cast<double>(t.dy[n * kOC + o]);
      for (std::size_t c = 0; c < kC; ++c) {
        rdx[n * kC + c] += static_cast<double>(dyq[n * kOC + o]) * static_cast<double>(wq_dgrad[o * kC + c]);
        rdw[o * kC + c] += static_cast<double>(dyq_wgrad[n * kOC + o]) * static_cast<double>(xq_wgrad[n * kC + c]);
      }
    }
  expect_close(dx, rdx, "dx");
  expect_close(dw, rdw, "dw");
  expect_close(db, rdb, "db (from the unquantized dY)");
}

TEST(Fp8Linear, PerTensorRecipesMatchTheNaiveReference) {
  const LinearCase t;
  // fp8-noscale: scale 1 everywhere.
  {
    Fp8Linears f(kNoscale, {});
    f.add("l", kN, kC, kOC);
    f.finish();
    const auto xq = reference_qdq(Dtype::e4m3, t.x, 1, 1), wq = reference_qdq(Dtype::e4m3, t.w, 1, 1);
    const auto dyq = reference_qdq(Dtype::e5m2, t.dy, 1, 1);
    check_linear(f, t, xq, wq, dyq, wq, dyq, xq);
  }
  // fp8-current: scale = fp8_max / amax of each tensor (lowp::current_scale).
  for (bool pow2 : {false, true}) {
    Fp8Config cfg;
    cfg.power_of_2_scales = pow2;
    Fp8Linears f(kCurrent, cfg);
    f.add("l", kN, kC, kOC);
    f.finish();
    auto current = [&](Dtype d, const std::vector<float>& v) {
      const float scale = lowp::current_scale(tensor_amax(v), lowp::max_finite(d), pow2, 0.0f);
      return reference_qdq(d, v, scale, 1.0f / scale);
    };
    const auto xq = current(Dtype::e4m3, t.x), wq = current(Dtype::e4m3, t.w), dyq = current(Dtype::e5m2, t.dy);
    check_linear(f, t, xq, wq, dyq, wq, dyq, xq);
    // The scales the telemetry reports, by hand: 448 / amax (E4M3), 57344 / amax (E5M2).
    const std::span<const Fp8TensorStats> s = f.stats();
    ASSERT_EQ(s.size(), 3u);
    EXPECT_EQ(s[0].name, "l.input");
    EXPECT_EQ(s[2].name, "l.grad_output");
    EXPECT_EQ(s[2].dtype, Dtype::e5m2);
    const float ax = tensor_amax(t.x), ady = tensor_amax(t.dy);
    EXPECT_EQ(s[0].amax, ax);
    EXPECT_EQ(s[2].amax, ady);
    if (!pow2) {
      EXPECT_EQ(s[0].scale, 448.0f / ax);
      EXPECT_EQ(s[2].scale, 57344.0f / ady);
    } else {
      EXPECT_EQ(s[0].scale, std::exp2(std::floor(std::log2(448.0f / ax))));
      EXPECT_EQ(s[2].scale, std::exp2(std::floor(std::log2(57344.0f / ady))));
    }
  }
}

// Rows (and for W, output channels) of very different magnitudes: blocks along the rows
// and along the columns then quantize differently (values far below their block's amax
// become E4M3/E5M2 subnormals or zero), so the test tells the two layouts apart.
TEST(Fp8Linear, MxQuantizesAlongEachGemmsReductionDimension) {
  LinearCase t;
  for (std::size_t n = 0; n < kN; ++n)
    for (std::size_t c = 0; c < kC; ++c) t.x[n * kC + c] *= std::ldexp(1.0f, static_cast<int>(n % 8) * 3 - 12);
  for (std::size_t n = 0; n < kN; ++n)
    for (std::size_t o = 0; o < kOC; ++o) t.dy[n * kOC + o] *= std::ldexp(1.0f, static_cast<int>(n % 8) * 5 - 10);  // E5M2 spans more
  for (std::size_t o = 0; o < kOC; ++o)
    for (std::size_t c = 0; c < kC; ++c) t.w[o * kC + c] *= std::ldexp(1.0f, static_cast<int>(o % 8) * 3 - 12);
  for (lowp::ScaleRounding r : {lowp::ScaleRounding::rceil, lowp::ScaleRounding::floor}) {
    Fp8Config cfg;
    cfg.mx_rounding = r;
    Fp8Linears f(kMx, cfg);
    f.add("l", kN, kC, kOC);
    f.finish();
    // Rowwise: blocks along C (x, w) and OC (dy); columnwise: along OC for w (dgrad), along
    // N for x and dy (wgrad), by transposing, quantizing rows, transposing back.
    const auto xq = reference_mx(Dtype::e4m3, t.x, kC, r), wq = reference_mx(Dtype::e4m3, t.w, kC, r);
    const auto dyq = reference_mx(Dtype::e5m2, t.dy, kOC, r);
    const auto wq_col = transposed(reference_mx(Dtype::e4m3, transposed(t.w, kOC, kC), kOC, r), kC, kOC);
    const auto xq_col = transposed(reference_mx(Dtype::e4m3, transposed(t.x, kN, kC), kN, r), kC, kN);
    const auto dyq_col = transposed(reference_mx(Dtype::e5m2, transposed(t.dy, kN, kOC), kN, r), kOC, kN);
    check_linear(f, t, xq, wq, dyq, wq_col, dyq_col, xq_col);
    // The columnwise copies differ from the rowwise ones (else the test would not tell).
    EXPECT_NE(xq, xq_col);
    EXPECT_NE(wq, wq_col);
    EXPECT_NE(dyq, dyq_col);
  }
}

// fp8-block, nvfp4 and mxfp4 (lowp): each GEMM's operands are lowp::quantize + dequantize
// in the layout TE uses (docs/low_precision.md), nvfp4 with RHT on the wgrad copies and the
// engine's stochastic-rounding stream for dY (draw 0 rowwise, draw 1 columnwise).
std::vector<float> lowp_fq(const std::vector<float>& v, std::size_t rows, std::size_t cols, lowp::QuantizeConfig c,
                           bool rht = false, std::uint64_t draw = ~0ull) {
  c.rht = rht;
  std::vector<std::uint32_t> words;
  if (draw != ~0ull) {
    c.stochastic_rounding = true;
    std::uint64_t state = 0x5EEDull * 0x100000001B3ull + draw;
    for (std::size_t i = 0; i < rows * cols; ++i) {
      std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      words.push_back(static_cast<std::uint32_t>((z ^ (z >> 31)) >> 32));
    }
  }
  return lowp::dequantize(lowp::quantize(v, rows, cols, c, words));
}

TEST(Fp8Linear, LowpRecipesQuantizeAsTe) {
  LinearCase t;
  for (std::size_t n = 0; n < kN; ++n)
    for (std::size_t c = 0; c < kC; ++c) t.x[n * kC + c] *= std::ldexp(1.0f, static_cast<int>(n % 8) * 3 - 12);
  const struct {
    QuantizedGemms recipe;
    lowp::Recipe lr;
  } cases[] = {{kBlock, lowp::Recipe::fp8_block}, {kNvfp4, lowp::Recipe::nvfp4},
               {kMx4, lowp::Recipe::mxfp4}};
  for (const auto& cs : cases) {
    Fp8Linears f(cs.recipe, {});
    f.add("l", kN, kC, kOC);
    f.finish();
    lowp::RecipeChoice choice = lowp::RecipeChoice::of(cs.lr);
    if (cs.lr == lowp::Recipe::fp8_block) choice.fp8_format = lowp::Format::hybrid;  // the engine's default
    const lowp::LinearRecipe r = *lowp::resolve(choice);
    const bool sr = r.stochastic_rounding;
    const auto xq = lowp_fq(t.x, kN, kC, r.config(false, false, lowp::Layout::rowwise));
    const auto wq = lowp_fq(t.w, kOC, kC, r.config(false, true, lowp::Layout::rowwise));
    const auto dyq = lowp_fq(t.dy, kN, kOC, r.config(true, false, lowp::Layout::rowwise), false, sr ? 0 : ~0ull);
    const auto wq_col = lowp_fq(t.w, kOC, kC, r.config(false, true, lowp::Layout::columnwise));
    const auto xq_col = lowp_fq(t.x, kN, kC, r.config(false, false, lowp::Layout::columnwise), r.rht);
    const auto dyq_col = lowp_fq(t.dy, kN, kOC, r.config(true, false, lowp::Layout::columnwise), r.rht, sr ? 1 : ~0ull);
    check_linear(f, t, xq, wq, dyq, wq_col, dyq_col, xq_col);
    EXPECT_NE(xq, xq_col) << lowp::recipe_name(cs.lr);
    EXPECT_EQ(f.stats()[0].elements, kN * kC);
    EXPECT_EQ(f.stats()[2].elements, kN * kOC);
    // The log names the recipe and each role's element format (E2M1 for the fp4 recipes).
    for (std::size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(f.stats()[k].recipe, lowp::recipe_name(cs.lr)) << f.stats()[k].name;
      EXPECT_EQ(f.stats()[k].element, r.config(k == 2, k == 1, lowp::Layout::rowwise).element) << f.stats()[k].name;
    }
    EXPECT_EQ(f.stats()[0].element, cs.lr == lowp::Recipe::fp8_block ? lowp::Element::e4m3 : lowp::Element::e2m1);
    EXPECT_GT(f.saved_bytes(), 0u);
    EXPECT_LT(f.saved_bytes(), kN * kC + kN * kC / 8);  // codes of X (fp4: half) and scales
  }
}

// Delayed scaling: quantize with the current scale, record the unscaled amax, update once
// per step. History length 2, algorithm max, margin 0 then 1; the input's amax is set to
// 2, 8, 0.5, 0.5 in four steps. TE's roll: the amax used is the max of the history after
// recording; scale = 448 * 2^-margin / amax.
TEST(Fp8Linear, DelayedScalingScaleSequenceByHand) {
  for (int margin : {0, 1}) {
    Fp8Config cfg;
    cfg.amax_history_len = 2;
    cfg.margin = margin;
    Fp8Linears f(kDelayed, cfg);
    f.add("l", kN, kC, kOC);
    f.finish();
    LinearCase t;
    const float m = std::ldexp(1.0f, -margin);
    // scale used during step k (1 before the first update), and after it.
    const float amaxes[] = {2.0f, 8.0f, 0.5f, 0.5f};
    const float used[] = {1.0f, 448.0f * m / 2.0f, 448.0f * m / 8.0f, 448.0f * m / 8.0f};
    const float after_last = 448.0f * m / 0.5f;
    Gemm g;
    std::vector<float> y(kN * kOC), dx(kN * kC), dw(kOC * kC), db(kOC);
    const float base = tensor_amax(t.x);
    for (int step = 0; step < 4; ++step) {
      std::vector<float> x = t.x;
      for (float& v : x) v *= 0.5f * amaxes[step] / base;
      x[0] = amaxes[step];  // exactly (scaling by a non-power of two rounds)
      f.reset_stats();
      f.forward(g, 0, y, x, t.w, t.b, kN);
      f.backward(g, 0, dx, dw, db, t.dy, t.w);
      const Fp8TensorStats& s = f.stats()[0];
      EXPECT_EQ(s.scale, used[step]) << "margin " << margin << ", step " << step + 1;
      EXPECT_EQ(s.amax, amaxes[step]);
      // The forward used exactly that scale: Xq = dequantize(quantize(x, scale), 1/scale).
      const auto xq = reference_qdq(Dtype::e4m3, x, used[step], f.delayed()->scale_inv(0));
      const auto wq = reference_qdq(Dtype::e4m3, t.w, f.delayed()->scale(1), f.delayed()->scale_inv(1));
      expect_close(y, naive_forward(xq, wq, t.b), "y");
      f.step_done();
    }
    EXPECT_EQ(f.delayed()->scale(0), after_last);
  }
}

// An evaluation forward (fewer rows, no backward) records nothing.
TEST(Fp8Linear, EvaluationForwardRecordsNothing) {
  Fp8Linears f(kDelayed, {});
  f.add("l", kN, kC, kOC);
  f.finish();
  const LinearCase t;
  Gemm g;
  std::vector<float> y(kN * kOC);
  f.forward(g, 0, std::span<float>(y).first(8 * kOC), std::span<const float>(t.x).first(8 * kC), t.w, t.b, 8);
  for (const Fp8TensorStats& s : f.stats()) EXPECT_EQ(s.elements, 0u) << s.name;
  f.step_done();
  EXPECT_EQ(f.delayed()->scale(0), 1.0f);  // amax 0 keeps the scale
  std::vector<float> dx(kN * kC), dw(kOC * kC), db(kOC);
  EXPECT_THROW(f.backward(g, 0, dx, dw, db, t.dy, t.w), std::logic_error);  // not a full forward
}

// ---- the backward from saved codes against the backward from fp32 copies ----------------

struct Shape {
  std::size_t n, c, oc;
};

void expect_same_bits(std::span<const float> a, std::span<const float> b, const std::string& what) {
  expect_same_bits(std::vector<float>(a.begin(), a.end()), std::vector<float>(b.begin(), b.end()), what.c_str());
}

// The fp32 copy mxfp8 made of x[rows, cols] quantized along its rows (columnwise): by
// transposing, quantizing rows of `rows` values and transposing back.
std::vector<float> columnwise(Dtype d, const std::vector<float>& x, std::size_t rows, std::size_t cols,
                              lowp::ScaleRounding r) {
  return transposed(reference_mx(d, transposed(x, rows, cols), rows, r), cols, rows);
}

// Per recipe and shape (N below one MX block, sizes not multiples of 32): Fp8Linears'
// forward output and backward gradients against the GEMMs on fp32 copies of the
// quantized operands, the way the backward computed them before it saved codes. Bit for
// bit: same operand values, same GEMM calls. fp8-delayed runs a second step, so that its
// scales are not 1; an evaluation forward of fewer rows comes before the training one.
TEST(Fp8SavedCodes, BackwardFromCodesEqualsBackwardFromFp32Copies) {
  const Shape shapes[] = {{64, 48, 40}, {20, 33, 70}, {37, 96, 5}, {1, 31, 3}};
  const QuantizedGemms recipes[] = {kNoscale, kDelayed, kCurrent, kMx};
  for (const Shape& sh : shapes) {
    const std::size_t N = sh.n, C = sh.c, OC = sh.oc;
    for (const QuantizedGemms& recipe : recipes) {
      for (int variant = 0; variant < 2; ++variant) {
        Fp8Config cfg;
        if (variant == 1) {
          cfg.format = lowp::Format::e4m3;
          cfg.power_of_2_scales = true;
          cfg.mx_rounding = lowp::ScaleRounding::floor;
        }
        const std::string what = "recipe " + std::string(lowp::recipe_name(recipe.recipe)) + (recipe.unit_scale ? " (unit scale)" : "") + ", variant " +
                                 std::to_string(variant) + ", N " + std::to_string(N) + " C " + std::to_string(C) +
                                 " OC " + std::to_string(OC);
        Fp8Linears f(recipe, cfg);
        f.add("l", N, C, OC);
        f.finish();
        Gemm g;
        const std::vector<float> x = spread(N * C, 21, 0.01f), w = normal(OC * C, 22, 0.05f);
        const std::vector<float> b = normal(OC, 23, 0.1f), dy = spread(N * OC, 24, 1e-6f);
        std::vector<float> y(N * OC), dx(N * C), dw(OC * C), db(OC);
        for (int step = 0; step < 2; ++step) {
          if (N > 1) f.forward(g, 0, std::span<float>(y).first(OC), std::span<const float>(x).first(C), w, b, 1);
          f.forward(g, 0, y, x, w, b, N);
          // The operands as the forward quantized them (its scales are still in force).
          const Dtype dx_t = f.stats()[0].dtype, dw_t = f.stats()[1].dtype, ddy = f.stats()[2].dtype;
          auto per_tensor = [&](std::size_t t, Dtype d, const std::vector<float>& v) {
            float scale = 1, inv = 1;
            if (recipe == kDelayed) {
              scale = f.delayed()->scale(t);
              inv = f.delayed()->scale_inv(t);
            } else if (recipe == kCurrent) {
              scale = lowp::current_scale(tensor_amax(v), lowp::max_finite(d), cfg.power_of_2_scales, cfg.amax_epsilon);
              inv = 1.0f / scale;
            }
            return reference_qdq(d, v, scale, inv);
          };
          std::vector<float> ry(N * OC);
          std::vector<float> rdx(N * C, 0.5f), rdw(OC * C, -0.25f), rdb(OC, 1.0f);
          std::fill(dx.begin(), dx.end(), 0.5f);
          std::fill(dw.begin(), dw.end(), -0.25f);
          std::fill(db.begin(), db.end(), 1.0f);
          if (recipe != kMx) {
            const auto xq = per_tensor(0, dx_t, x), wq = per_tensor(1, dw_t, w), dyq = per_tensor(2, ddy, dy);
            linear_forward(g, ry, xq, wq, b, N, C, OC);
            linear_backward(g, rdx, rdw, {}, dyq, xq, wq, N, C, OC);
          } else {
            const lowp::ScaleRounding r = cfg.mx_rounding;
            std::vector<float> xq(N * C), wq(OC * C), dyq(N * OC);
            xq = reference_mx(dx_t, x, C, r);
            wq = reference_mx(dw_t, w, C, r);
            dyq = reference_mx(ddy, dy, OC, r);
            const auto xq_col = columnwise(dx_t, x, N, C, r), wq_col = columnwise(dw_t, w, OC, C, r);
            const auto dyq_col = columnwise(ddy, dy, N, OC, r);
            linear_forward(g, ry, xq, wq, b, N, C, OC);
            g.run(view(dyq.data(), N, OC), view(wq_col.data(), OC, C), output(rdx.data(), N, C),
                  {.trans_a = Trans::no, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
            g.run(view(dyq_col.data(), N, OC), view(xq_col.data(), N, C), output(rdw.data(), OC, C),
                  {.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
          }
          for (std::size_t n = 0; n < N; ++n)
            for (std::size_t o = 0; o < OC; ++o) rdb[o] += dy[n * OC + o];
          f.backward(g, 0, dx, dw, db, dy, w);
          expect_same_bits(y, ry, what + ": y");
          expect_same_bits(dx, rdx, what + ": dx");
          expect_same_bits(dw, rdw, what + ": dw");
          expect_same_bits(db, rdb, what + ": db");
          f.step_done();
        }
      }
    }
  }
}

// The saved codes are 1 byte per input element (mxfp8: plus one E8M0 scale per 32), and
// the work memory a caller passes is used instead of the object's own.
TEST(Fp8SavedCodes, SavedBytesAndCallerWork) {
  Fp8Linears per_tensor(kCurrent, {});
  per_tensor.add("a", 20, 33, 70);
  per_tensor.add("b", 20, 70, 33);
  per_tensor.finish(false);
  EXPECT_EQ(per_tensor.saved_bytes(), 20u * 33 + 20u * 70 + 2 * sizeof(float));  // codes and a scale per Linear
  Fp8Linears mx(kMx, {});
  mx.add("a", 20, 33, 70);
  mx.finish(false);
  EXPECT_EQ(mx.saved_bytes(), 20u * 33 + 33u * ((20 + lowp::kMxBlock - 1) / lowp::kMxBlock));
  // Without own work memory, a call needs the caller's; too little is refused.
  const std::vector<float> x = normal(20 * 33, 1, 1.0f), w = normal(70 * 33, 2, 0.1f), b(70, 0.0f);
  std::vector<float> y(20 * 70), dx(20 * 33), dw(70 * 33), dy = normal(20 * 70, 3, 0.01f);
  Gemm g;
  EXPECT_THROW(per_tensor.forward(g, 0, y, x, w, b, 20), std::logic_error);
  std::vector<float> small(20 * 33 - 1), big(20 * 70 + 20 * 33);
  const std::span<float> too_small[] = {small};
  EXPECT_THROW(per_tensor.forward(g, 0, y, x, w, b, 20, too_small), std::logic_error);
  const std::span<float> enough[] = {small, big};
  per_tensor.forward(g, 0, y, x, w, b, 20, enough);
  per_tensor.backward(g, 0, dx, dw, {}, dy, w, enough);
  EXPECT_GT(per_tensor.stats()[2].elements, 0u);
}

// ---- recipe files: each operand's plan against the GEMMs composed by hand -----------------

// A recipe file whose default is `entry` (JSON), plus `rest` (more fields, with a leading comma).
std::shared_ptr<const lowp::Assignment> recipes_of(const std::string& entry, const std::string& rest = "") {
  return std::make_shared<const lowp::Assignment>(lowp::parse_assignment(
      R"({"format":"mixprec.low_precision","version":1,"default":)" + entry + R"(,"modules":{})" + rest + "}"));
}

// D(Q(v)) with plan p's config of operand o (RHT dropped on a batch of rows not a multiple of
// 16; stochastic rounding from the engine's stream at draw `draw`, counted up), or v itself
// for a high-precision operand.
std::vector<float> by_hand(const lowp::LinearPlan& p, lowp::Operand o, const std::vector<float>& v, std::size_t rows,
                           std::size_t cols, std::size_t batch, std::uint64_t& draw) {
  if (!p.at(o)) return v;
  lowp::QuantizeConfig c = p.config(o);
  if (batch % 16 != 0) c.rht = false;
  std::vector<std::uint32_t> words;
  if (c.stochastic_rounding) {
    std::uint64_t state = 0x5EEDull * 0x100000001B3ull + draw++;
    for (std::size_t i = 0; i < rows * cols; ++i) {
      std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      words.push_back(static_cast<std::uint32_t>((z ^ (z >> 31)) >> 32));
    }
  }
  return lowp::dequantize(lowp::quantize(v, rows, cols, c, words));
}

// The GEMMs of a plan composed from lowp::quantize / dequantize and the engine's fp32 GEMM
// (the header's formulas), against one Linear of a recipe file, bit for bit: the four zoo
// entries and per-direction entries, on a batch of 64 rows (RHT on) and of 40 (RHT off on
// both wgrad operands).
TEST(Fp8Recipes, EachPlanIsItsGemmsComposedByHand) {
  const std::string entries[] = {
      R"("high_precision_fwd_mxfp8_bwd")",
      R"("mxfp8_fwd_high_precision_bwd")",
      R"("mxfp8_fwd_nvfp4_bwd")",
      R"("nvfp4_1d_weight")",
      R"({"recipe":"nvfp4","fprop":"bf16"})",
      R"({"recipe":"mxfp8","backward_override":"high_precision"})",
      R"({"recipe":"fp8-current","wgrad":"bf16","dgrad":{"w":"fp8-block"}})",
      R"({"recipe":"bf16","dgrad":{"dy":"mxfp4"},"columnwise_source":{"x":"original"}})",
      R"({"recipe":"mxfp8","wgrad":{"x":"fp8-block"},"columnwise_source":{"x":"dequantized"}})",
  };
  using lowp::Operand;
  for (const std::size_t N : {std::size_t{64}, std::size_t{40}}) {
    for (const std::string& entry : entries) {
      SCOPED_TRACE(entry + ", " + std::to_string(N) + " rows");
      LinearCase t;
      t.x = normal(N * kC, 1, 1.0f);
      t.dy = normal(N * kOC, 4, 1e-4f);
      for (std::size_t n = 0; n < N; ++n)  // rows of different magnitudes: the layouts differ
        for (std::size_t c = 0; c < kC; ++c) t.x[n * kC + c] *= std::ldexp(1.0f, static_cast<int>(n % 8) * 3 - 12);
      const auto recipes = recipes_of(entry);
      const lowp::LinearPlan p = lowp::plan(recipes->default_choice, recipes->options);
      Fp8Linears f(recipes, 1);
      f.add("l", N, kC, kOC);
      f.finish();
      EXPECT_TRUE(f.plan(0) == p);
      Gemm g;
      std::vector<float> y(N * kOC), dx(N * kC, 0.5f), dw(kOC * kC, -0.25f), db(kOC, 1.0f);
      f.forward(g, 0, y, t.x, t.w, t.b, N);
      f.backward(g, 0, dx, dw, db, t.dy, t.w);

      std::uint64_t draw = 0;
      std::vector<float> ry(N * kOC), rdx(N * kC, 0.5f), rdw(kOC * kC, -0.25f), rdb(kOC, 1.0f);
      const std::vector<float> xf = by_hand(p, Operand::fprop_x, t.x, N, kC, N, draw);
      const std::vector<float> wf = by_hand(p, Operand::fprop_w, t.w, kOC, kC, N, draw);
      linear_forward(g, ry, xf, wf, t.b, N, kC, kOC);
      const std::vector<float> dyd = by_hand(p, Operand::dgrad_dy, t.dy, N, kOC, N, draw);
      const std::vector<float> wd = by_hand(p, Operand::dgrad_w, p.w_source == lowp::Source::dequantized ? wf : t.w,
                                            kOC, kC, N, draw);
      g.run(view(dyd.data(), N, kOC), view(wd.data(), kOC, kC), output(rdx.data(), N, kC),
            {.trans_a = Trans::no, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
      const std::vector<float> dyw = by_hand(p, Operand::wgrad_dy, t.dy, N, kOC, N, draw);
      const std::vector<float> xw = by_hand(p, Operand::wgrad_x, p.x_source == lowp::Source::dequantized ? xf : t.x,
                                            N, kC, N, draw);
      g.run(view(dyw.data(), N, kOC), view(xw.data(), N, kC), output(rdw.data(), kOC, kC),
            {.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
      for (std::size_t n = 0; n < N; ++n)
        for (std::size_t o = 0; o < kOC; ++o) rdb[o] += t.dy[n * kOC + o];
      expect_same_bits(y, ry, "y");
      expect_same_bits(dx, rdx, "dx");
      expect_same_bits(dw, rdw, "dw");
      expect_same_bits(db, rdb, "db");
      // The plan quantizes something different from fp32 on every entry (else the test would not tell).
      EXPECT_TRUE(xf != t.x || wf != t.w || dyd != t.dy || dyw != t.dy);
      // Each tensor's counts are its first quantized operand's: X fprop.x else wgrad.x, W
      // fprop.w else dgrad.w, dY dgrad.dy else wgrad.dy.
      const Operand first[3][2] = {{Operand::fprop_x, Operand::wgrad_x},
                                   {Operand::fprop_w, Operand::dgrad_w},
                                   {Operand::dgrad_dy, Operand::wgrad_dy}};
      for (std::size_t k = 0; k < 3; ++k) {
        const Operand o = p.at(first[k][0]) ? first[k][0] : first[k][1];
        const Fp8TensorStats& s = f.stats()[k];
        if (!p.at(o)) {
          EXPECT_EQ(s.elements, 0u) << s.name;
          EXPECT_EQ(s.recipe, "") << s.name;
          continue;
        }
        EXPECT_EQ(s.recipe, lowp::recipe_name(p.config(o).recipe)) << s.name;
        EXPECT_EQ(s.element, p.config(o).element) << s.name;
        EXPECT_EQ(s.elements, k == 1 ? kOC * kC : k == 0 ? N * kC : N * kOC) << s.name;
      }
    }
  }
}

// A preset and the recipe file that names the same recipe per operand run the same numbers:
// the preset is the uniform plan (fp8-current with HYBRID, the engine's default format).
TEST(Fp8Recipes, UniformPlanOfAPresetEqualsItsRecipeFile) {
  const LinearCase t;
  Fp8Linears preset(kCurrent, {});
  Fp8Linears file(recipes_of(R"({"recipe":"fp8-current","power_of_2_scales":false})"), 1);
  for (Fp8Linears* f : {&preset, &file}) {
    f->add("l", kN, kC, kOC);
    f->finish();
  }
  EXPECT_TRUE(preset.plan(0) == file.plan(0));
  Gemm g;
  std::vector<float> y1(kN * kOC), y2(kN * kOC), dx1(kN * kC), dx2(kN * kC), dw1(kOC * kC), dw2(kOC * kC), db1(kOC),
      db2(kOC);
  preset.forward(g, 0, y1, t.x, t.w, t.b, kN);
  preset.backward(g, 0, dx1, dw1, db1, t.dy, t.w);
  file.forward(g, 0, y2, t.x, t.w, t.b, kN);
  file.backward(g, 0, dx2, dw2, db2, t.dy, t.w);
  expect_same_bits(y1, y2, "y");
  expect_same_bits(dx1, dx2, "dx");
  expect_same_bits(dw1, dw2, "dw");
  EXPECT_EQ(preset.saved_bytes(), file.saved_bytes());
  // The preset's per-tensor log entries name no recipe; the file's do.
  EXPECT_EQ(preset.stats()[0].recipe, "");
  EXPECT_EQ(file.stats()[0].recipe, "fp8-current");
}

// A schedule switches each Linear's plan at its phase starts (from_fraction placed in the
// run's steps), the evaluation plan serves evaluation forwards of the quantized Linears only,
// and the memory covers every plan: a high-precision wgrad.x keeps X in fp32.
TEST(Fp8Recipes, ScheduleEvaluationAndMemory) {
  const auto recipes = recipes_of(
      R"("mxfp8")", R"(,"schedule":[{"from_step":3,"modules":["a"],"recipe":"nvfp4","label":"to nvfp4"},)"
                    R"({"from_fraction":0.5,"wgrad":"bf16","label":"hp wgrad"}],"evaluation":"bf16")");
  Fp8Linears f(recipes, 10);
  f.add("a", 32, 48, 40);
  f.add("b", 32, 48, 40);
  f.finish(false);
  const lowp::LinearPlan mx = lowp::plan(lowp::RecipeChoice::of(lowp::Recipe::mxfp8));
  EXPECT_TRUE(f.plan(0) == mx);
  EXPECT_FALSE(f.set_step(2));
  EXPECT_TRUE(f.set_step(3));
  EXPECT_TRUE(f.plan(0) == lowp::plan(lowp::RecipeChoice::of(lowp::Recipe::nvfp4)));
  EXPECT_TRUE(f.plan(1) == mx);
  EXPECT_EQ(f.stats()[0].recipe, "nvfp4");
  EXPECT_EQ(f.stats()[0].element, lowp::Element::e2m1);
  EXPECT_TRUE(f.set_step(5));  // ceil(0.5 * 10)
  EXPECT_FALSE(f.plan(1).at(lowp::Operand::wgrad_x).has_value());
  EXPECT_EQ(f.stats()[3].recipe, "mxfp8");  // b's X: fprop.x still mxfp8
  EXPECT_TRUE(f.set_step(0));               // back (a resume's first step) is a switch too
  EXPECT_TRUE(f.plan(1) == mx);
  // The most a reachable plan keeps: from step 5 both keep X in fp32 (before: mxfp8 codes
  // and scales, 48 * 32 + 48, and a's nvfp4 ones, 48 * 16 + 48 * 2).
  EXPECT_EQ(f.saved_bytes(), 2u * 32 * 48 * 4);
  // Evaluation: the plan of the evaluation entry ("bf16": y = x w^T + b in fp32).
  const std::vector<float> x = normal(32 * 48, 1, 1.0f), w = normal(40 * 48, 2, 0.05f), b = normal(40, 3, 0.1f);
  std::vector<float> y(32 * 40), ry(32 * 40), work(4 * 32 * 48);
  const std::span<float> spans[] = {work};
  Gemm g;
  f.set_evaluation(true);
  f.forward(g, 0, y, x, w, b, 32, spans);
  linear_forward(g, ry, x, w, b, 32, 48, 40);
  expect_same_bits(y, ry, "evaluation y");
  EXPECT_EQ(f.stats()[0].elements, 0u);
  std::vector<float> dx(32 * 48), dw(40 * 48), db(40), dy = normal(32 * 40, 4, 1e-3f);
  EXPECT_THROW(f.backward(g, 0, dx, dw, db, dy, w, spans), std::logic_error);  // nothing kept
  f.set_evaluation(false);
  f.forward(g, 0, y, x, w, b, 32, spans);
  EXPECT_NE(y, ry);  // mxfp8 again
  f.backward(g, 0, dx, dw, db, dy, w, spans);
  EXPECT_EQ(f.stats()[0].elements, 32u * 48);
}

// The evaluation plan serves the Linears that some plan of the run quantizes (q: bf16 until
// its phase brings nvfp4), not those the file keeps in bf16 throughout (h).
TEST(Fp8Recipes, EvaluationPlanOnTheLinearsTheRunQuantizes) {
  const auto recipes = std::make_shared<const lowp::Assignment>(lowp::parse_assignment(
      R"({"format":"mixprec.low_precision","version":1,"default":"bf16","modules":{},)"
      R"("schedule":[{"from_step":5,"modules":["q"],"recipe":"nvfp4"}],"evaluation":"mxfp8"})"));
  Fp8Linears f(recipes, 10);
  f.add("q", 32, 48, 40);
  f.add("h", 32, 48, 40);
  f.finish();
  EXPECT_FALSE(f.plan(0).any_quantized());
  const std::vector<float> x = normal(32 * 48, 1, 1.0f), w = normal(40 * 48, 2, 0.05f), b = normal(40, 3, 0.1f);
  Gemm g;
  std::vector<float> y(32 * 40), plain(32 * 40), mx(32 * 40);
  linear_forward(g, plain, x, w, b, 32, 48, 40);
  const lowp::LinearPlan e = lowp::plan(lowp::RecipeChoice::of(lowp::Recipe::mxfp8));
  std::uint64_t draw = 0;
  linear_forward(g, mx, by_hand(e, lowp::Operand::fprop_x, x, 32, 48, 32, draw),
                 by_hand(e, lowp::Operand::fprop_w, w, 40, 48, 32, draw), b, 32, 48, 40);
  f.set_evaluation(true);
  f.forward(g, 0, y, x, w, b, 32);
  expect_same_bits(y, mx, "q evaluated in mxfp8");
  f.forward(g, 1, y, x, w, b, 32);
  expect_same_bits(y, plain, "h evaluated in fp32");
  f.set_evaluation(false);
  f.forward(g, 0, y, x, w, b, 32);
  expect_same_bits(y, plain, "q trained in bf16 before step 5");
}

}  // namespace
}  // namespace mixprec::nn::detail
