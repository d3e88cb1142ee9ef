// fp8 Linear layers of the fp8 presets (src/nn/fp8_linear.hpp) against plain scalar
// references: the quantized operands bit for bit against fp8::quantize / dequantize /
// mx_quantize / mx_dequantize, the GEMMs against a naive triple loop in double, and the
// scales each recipe uses against hand computations.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "mixprec/fp8/quantize.hpp"
#include "mixprec/nn/gemm.hpp"
#include "nn/fp8_linear.hpp"

namespace mixprec::nn::detail {
namespace {

using fp8::Dtype;

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

template <fp8::Fp8Type T>
std::vector<float> reference_qdq(const std::vector<float>& x, float scale, float scale_inv) {
  std::vector<T> codes(x.size());
  std::vector<float> out(x.size());
  (void)fp8::quantize<T>(x, codes, scale);
  fp8::dequantize<T>(codes, out, scale_inv);
  return out;
}

std::vector<float> reference_qdq(Dtype d, const std::vector<float>& x, float scale, float scale_inv) {
  return d == Dtype::e4m3 ? reference_qdq<f8e4m3>(x, scale, scale_inv) : reference_qdq<f8e5m2>(x, scale, scale_inv);
}

// Rows of row_len values, each quantized and dequantized by the scalar MX references.
template <fp8::Fp8Type T>
std::vector<float> reference_mx(const std::vector<float>& x, std::size_t row_len, fp8::MxRounding r) {
  std::vector<float> out(x.size());
  for (std::size_t row = 0; row < x.size(); row += row_len) {
    const std::span<const float> src(x.data() + row, row_len);
    std::vector<T> codes(row_len);
    std::vector<e8m0> scales(fp8::mx_blocks(row_len));
    (void)fp8::mx_quantize<T>(src, codes, scales, r);
    fp8::mx_dequantize<T>(codes, scales, std::span<float>(out.data() + row, row_len));
  }
  return out;
}

std::vector<float> reference_mx(Dtype d, const std::vector<float>& x, std::size_t row_len, fp8::MxRounding r) {
  return d == Dtype::e4m3 ? reference_mx<f8e4m3>(x, row_len, r) : reference_mx<f8e5m2>(x, row_len, r);
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  std::size_t diffs = 0, first = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]) && diffs++ == 0) first = i;
  }
  EXPECT_EQ(diffs, 0u) << what << ": first difference at " << first << ": " << a[first] << " vs " << b[first];
}

TEST(Fp8FakeQuantize, PerTensorMatchesTheScalarReferencesAndCounts) {
  for (Dtype d : {Dtype::e4m3, Dtype::e5m2}) {
    for (float scale : {1.0f, 448.0f / 3.0f, 3.5e6f, 1.0f / 1024}) {
      std::vector<float> x = spread(4099, 7);
      x[5] = 1e30f;  // saturates at every scale
      x[6] = -1e30f;
      const float scale_inv = 1.0f / scale;
      std::vector<float> out(x.size());
      std::vector<std::uint8_t> codes(x.size());
      const ConversionStats s = fake_quantize(x, out, d, scale, scale_inv, codes);
      const std::vector<float> ref = reference_qdq(d, x, scale, scale_inv);
      expect_same_bits(out, ref, "fake_quantize");
      // Counted independently: flushed = nonzero inputs whose reference value is 0;
      // saturated = inputs whose scaled magnitude is past the largest finite value and
      // the midpoint to the next binade step (so they cannot round down to it).
      const float fmax = fp8::max_finite(d);
      std::uint64_t nonzero = 0, flushed = 0, saturated = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        if (x[i] == 0.0f) continue;
        ++nonzero;
        if (ref[i] == 0.0f) ++flushed;
        if (std::fabs(x[i] * scale) >= fmax * 1.25f) ++saturated;
      }
      EXPECT_EQ(s.elements, x.size());
      EXPECT_EQ(s.nonzero, nonzero);
      EXPECT_EQ(s.underflow, flushed);
      EXPECT_GE(s.overflow, saturated);
      EXPECT_GE(saturated, 2u);
      // In place (out aliasing x) gives the same values.
      fake_quantize(x, x, d, scale, scale_inv, codes);
      expect_same_bits(x, ref, "fake_quantize in place");
    }
  }
}

TEST(Fp8FakeQuantize, MxMatchesTheScalarReferencesOnEdgeBlocks) {
  constexpr std::size_t kRow = 80;  // blocks of 32, 32 and 16 per row
  for (Dtype d : {Dtype::e4m3, Dtype::e5m2}) {
    for (fp8::MxRounding r : {fp8::MxRounding::transformer_engine, fp8::MxRounding::ocp}) {
      std::vector<float> x = spread(kRow * 6, 11);
      for (std::size_t i = 0; i < 32; ++i) x[kRow + i] = 0.0f;                  // an all-zero block
      x[2 * kRow + 3] = std::numeric_limits<float>::infinity();                 // a block holding inf
      x[3 * kRow + 40] = std::numeric_limits<float>::quiet_NaN();               // one holding NaN
      for (std::size_t i = 0; i < 16; ++i) x[4 * kRow + 64 + i] = 1e-41f;       // subnormal-only tail block
      x[5 * kRow + 1] = 4.0f;                                                   // amax at a power of two
      std::vector<float> out(x.size());
      std::vector<std::uint8_t> codes(x.size());
      const MxFakeQuantized q = fake_quantize_mx(x, out, kRow, d, r, codes);
      expect_same_bits(out, reference_mx(d, x, kRow, r), "fake_quantize_mx");
      EXPECT_EQ(q.stats.elements, x.size());
      EXPECT_EQ(q.stats.nonfinite_input, 2u);
      EXPECT_GT(q.min_factor, 0.0f);
    }
  }
}

// TE's MX scale for a block whose amax is 1: E8M0 of 1/448 rounded up, 2^-8, so the
// factor applied before the cast is 2^8; OCP: floor(log2 1) - 8 = -8, the same.
TEST(Fp8FakeQuantize, MxBlockScalesByHand) {
  std::vector<float> x(64, 0.25f);
  x[7] = 1.0f;      // first block: amax 1 -> factor 256
  x[40] = 0.0625f;  // second block: amax 0.25 -> factor 1024
  for (fp8::MxRounding r : {fp8::MxRounding::transformer_engine, fp8::MxRounding::ocp}) {
    std::vector<float> out(x.size());
    std::vector<std::uint8_t> codes(x.size());
    const MxFakeQuantized q = fake_quantize_mx(x, out, 64, Dtype::e4m3, r, codes);
    EXPECT_EQ(q.min_factor, 256.0f) << fp8::mx_rounding_name(r);
    EXPECT_EQ(out[7], 1.0f);
    EXPECT_EQ(out[40], 0.0625f);
  }
  // Block amax 1.875: TE rounds 1.875 / 448 = 2^-7.9 up to 2^-7, factor 128, nothing
  // saturates; OCP floors, floor(log2 1.875) - 8 = -8, factor 256, and 1.875 * 256 = 480
  // saturates to 448 (so the value reads back as 1.75).
  x[7] = 1.875f;
  std::vector<float> out(x.size());
  std::vector<std::uint8_t> codes(x.size());
  const MxFakeQuantized te = fake_quantize_mx(x, out, 64, Dtype::e4m3, fp8::MxRounding::transformer_engine, codes);
  EXPECT_EQ(te.min_factor, 128.0f);
  EXPECT_EQ(te.stats.overflow, 0u);
  EXPECT_EQ(out[7], 1.875f);
  const MxFakeQuantized ocp = fake_quantize_mx(x, out, 64, Dtype::e4m3, fp8::MxRounding::ocp, codes);
  EXPECT_EQ(ocp.min_factor, 256.0f);
  EXPECT_EQ(ocp.stats.overflow, 1u);
  EXPECT_EQ(out[7], 1.75f);
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
  f.backward(g, 0, dx, dw, db, t.dy);
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
    Fp8Linears f(Fp8Recipe::noscale, {});
    f.add("l", kN, kC, kOC);
    f.finish();
    const auto xq = reference_qdq(Dtype::e4m3, t.x, 1, 1), wq = reference_qdq(Dtype::e4m3, t.w, 1, 1);
    const auto dyq = reference_qdq(Dtype::e5m2, t.dy, 1, 1);
    check_linear(f, t, xq, wq, dyq, wq, dyq, xq);
  }
  // fp8-current: scale = fp8_max / amax of each tensor, as fp8::quantize_current.
  for (bool pow2 : {false, true}) {
    Fp8Config cfg;
    cfg.power_of_2_scales = pow2;
    Fp8Linears f(Fp8Recipe::current, cfg);
    f.add("l", kN, kC, kOC);
    f.finish();
    auto current = [&](Dtype d, const std::vector<float>& v) {
      std::vector<float> out(v.size());
      if (d == Dtype::e4m3) {
        std::vector<f8e4m3> c(v.size());
        const fp8::CurrentQuantized q = fp8::quantize_current<f8e4m3>(v, c, pow2);
        fp8::dequantize<f8e4m3>(c, out, q.scale_inv);
      } else {
        std::vector<f8e5m2> c(v.size());
        const fp8::CurrentQuantized q = fp8::quantize_current<f8e5m2>(v, c, pow2);
        fp8::dequantize<f8e5m2>(c, out, q.scale_inv);
      }
      return out;
    };
    const auto xq = current(Dtype::e4m3, t.x), wq = current(Dtype::e4m3, t.w), dyq = current(Dtype::e5m2, t.dy);
    check_linear(f, t, xq, wq, dyq, wq, dyq, xq);
    // The scales the telemetry reports, by hand: 448 / amax (E4M3), 57344 / amax (E5M2).
    const std::span<const Fp8TensorStats> s = f.stats();
    ASSERT_EQ(s.size(), 3u);
    EXPECT_EQ(s[0].name, "l.input");
    EXPECT_EQ(s[2].name, "l.grad_output");
    EXPECT_EQ(s[2].dtype, Dtype::e5m2);
    const float ax = fp8::amax(t.x), ady = fp8::amax(t.dy);
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
  for (fp8::MxRounding r : {fp8::MxRounding::transformer_engine, fp8::MxRounding::ocp}) {
    Fp8Config cfg;
    cfg.mx_rounding = r;
    Fp8Linears f(Fp8Recipe::mx, cfg);
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

// Delayed scaling: quantize with the current scale, record the unscaled amax, update once
// per step. History length 2, algorithm max, margin 0 then 1; the input's amax is set to
// 2, 8, 0.5, 0.5 in four steps. TE's roll: the amax used is the max of the history after
// recording; scale = 448 * 2^-margin / amax.
TEST(Fp8Linear, DelayedScalingScaleSequenceByHand) {
  for (int margin : {0, 1}) {
    Fp8Config cfg;
    cfg.amax_history_len = 2;
    cfg.margin = margin;
    Fp8Linears f(Fp8Recipe::delayed, cfg);
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
    const float base = fp8::amax(t.x);
    for (int step = 0; step < 4; ++step) {
      std::vector<float> x = t.x;
      for (float& v : x) v *= 0.5f * amaxes[step] / base;
      x[0] = amaxes[step];  // exactly (scaling by a non-power of two rounds)
      f.reset_stats();
      f.forward(g, 0, y, x, t.w, t.b, kN);
      f.backward(g, 0, dx, dw, db, t.dy);
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
  Fp8Linears f(Fp8Recipe::delayed, {});
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
  EXPECT_THROW(f.backward(g, 0, dx, dw, db, t.dy), std::logic_error);  // not a full forward
}

}  // namespace
}  // namespace mixprec::nn::detail
