// The fp32 layers (include/mixprec/nn/layers.hpp) against independent
// double-precision re-implementations of each forward.
//
// Gradient checks: every backward (fp32) is compared with central finite
// differences of L = sum(dout * forward(x)) computed in DOUBLE on the double
// re-implementation, at the same (fp32-exact) inputs, step h = 1e-5. The numeric
// gradient's own error is ~h^2 |f'''| + 1e-16 |L| / h ~ 1e-10, so what is measured
// is the fp32 backward's rounding: sums of at most ~30 terms, error below
// ~30 * 2^-24 ~ 2e-6 of the magnitudes involved. Tolerance per element:
// |analytic - numeric| <= 2e-4 |numeric| + 2e-5 max|numeric| (over the tensor), i.e.
// 10-100x margin over rounding while any wrong term (a missing factor, a wrong index)
// is an O(1) relative error. Gradient buffers are pre-filled with random values
// to check that they accumulate (the check uses result - prefill), and the
// overwritten scratch (attention's datt/dpreatt) with NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/nn/layers.hpp"

namespace mixprec::nn {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;
using Fwd = std::function<DVec(const DVec&)>;

Vec random_vec(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

DVec to_double(const Vec& v) { return DVec(v.begin(), v.end()); }

std::vector<TokenId> random_ids(std::size_t n, std::size_t V, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<TokenId> ids(n);
  for (TokenId& id : ids) id = static_cast<TokenId>(gen() % V);
  return ids;
}

Gemm make_gemm() { return Gemm(GemmOptions{.threads = 1, .native_bf16 = true}); }

template <class F>
void expect_invalid(F&& f, const std::string& needle);

double dot(const DVec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * static_cast<double>(b[i]);
  return s;
}

// dL/dx of L = sum(dout * f(x)) by central differences in double.
DVec numeric_grad(const Fwd& f, const Vec& x0, const Vec& dout) {
  constexpr double h = 1e-5;
  DVec x = to_double(x0);
  DVec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    x[i] = xi + h;
    const double lp = dot(f(x), dout);
    x[i] = xi - h;
    const double lm = dot(f(x), dout);
    x[i] = xi;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

// analytic = result - prefill (accumulation contract), against numeric.
void expect_grad(const std::string& name, const Vec& result, const Vec& prefill, const DVec& numeric) {
  ASSERT_EQ(result.size(), numeric.size()) << name;
  double maxabs = 0;
  for (const double n : numeric) maxabs = std::max(maxabs, std::abs(n));
  ASSERT_GT(maxabs, 1e-3) << name << ": the check would be vacuous";
  int bad = 0;
  for (std::size_t i = 0; i < numeric.size(); ++i) {
    const double a = static_cast<double>(result[i]) - (prefill.empty() ? 0.0 : static_cast<double>(prefill[i]));
    const double tol = 2e-4 * std::abs(numeric[i]) + 2e-5 * maxabs;
    if (!(std::abs(a - numeric[i]) <= tol) && bad++ < 5) {
      ADD_FAILURE() << name << "[" << i << "]: analytic " << a << ", numeric " << numeric[i] << ", tol " << tol;
    }
  }
  EXPECT_EQ(bad, 0) << name;
}

void expect_forward(const std::string& name, const Vec& got, const DVec& ref, double rtol) {
  ASSERT_EQ(got.size(), ref.size()) << name;
  double maxabs = 0;
  for (const double r : ref) maxabs = std::max(maxabs, std::abs(r));
  for (std::size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(static_cast<double>(got[i]), ref[i], rtol * (std::abs(ref[i]) + maxabs)) << name << "[" << i << "]";
  }
}

// ---- double references ------------------------------------------------------------

DVec linear_ref(const DVec& x, const DVec& w, const DVec& b, std::size_t N, std::size_t C, std::size_t OC) {
  DVec y(N * OC);
  for (std::size_t n = 0; n < N; ++n) {
    for (std::size_t o = 0; o < OC; ++o) {
      double s = b.empty() ? 0.0 : b[o];
      for (std::size_t c = 0; c < C; ++c) s += x[n * C + c] * w[o * C + c];
      y[n * OC + o] = s;
    }
  }
  return y;
}

DVec layernorm_ref(const DVec& x, const DVec& w, const DVec& b, std::size_t N, std::size_t C, double eps) {
  DVec y(N * C);
  for (std::size_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (std::size_t i = 0; i < C; ++i) m += x[n * C + i];
    m /= static_cast<double>(C);
    for (std::size_t i = 0; i < C; ++i) v += (x[n * C + i] - m) * (x[n * C + i] - m);
    v /= static_cast<double>(C);
    const double s = 1 / std::sqrt(v + eps);
    for (std::size_t i = 0; i < C; ++i) y[n * C + i] = (x[n * C + i] - m) * s * w[i] + b[i];
  }
  return y;
}

DVec gelu_ref(const DVec& x) {
  DVec y(x.size());
  const double k = std::sqrt(2.0 / 3.14159265358979323846);
  for (std::size_t i = 0; i < x.size(); ++i) {
    y[i] = 0.5 * x[i] * (1 + std::tanh(k * (x[i] + 0.044715 * x[i] * x[i] * x[i])));
  }
  return y;
}

// Straightforward causal attention: per (b, h), scores for all t2 <= t, softmax, sum of v.
DVec attention_ref(const DVec& qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  const std::size_t hs = C / NH;
  DVec out(B * T * C, 0.0);
  auto at = [&](std::size_t b, std::size_t t, std::size_t part, std::size_t h, std::size_t i) {
    return qkv[(b * T + t) * 3 * C + part * C + h * hs + i];
  };
  for (std::size_t b = 0; b < B; ++b) {
    for (std::size_t h = 0; h < NH; ++h) {
      for (std::size_t t = 0; t < T; ++t) {
        DVec s(t + 1);
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          double d = 0;
          for (std::size_t i = 0; i < hs; ++i) d += at(b, t, 0, h, i) * at(b, t2, 1, h, i);
          s[t2] = d / std::sqrt(static_cast<double>(hs));
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double& v : s) z += (v = std::exp(v - mx));
        for (std::size_t i = 0; i < hs; ++i) {
          double o = 0;
          for (std::size_t t2 = 0; t2 <= t; ++t2) o += s[t2] / z * at(b, t2, 2, h, i);
          out[(b * T + t) * C + h * hs + i] = o;
        }
      }
    }
  }
  return out;
}

DVec crossentropy_ref(const DVec& logits, const std::vector<TokenId>& targets, std::size_t N, std::size_t V) {
  DVec losses(N);
  for (std::size_t n = 0; n < N; ++n) {
    double mx = logits[n * V];
    for (std::size_t i = 0; i < V; ++i) mx = std::max(mx, logits[n * V + i]);
    double z = 0;
    for (std::size_t i = 0; i < V; ++i) z += std::exp(logits[n * V + i] - mx);
    losses[n] = std::log(z) - (logits[n * V + targets[n]] - mx);
  }
  return losses;
}

// ---- linear ---------------------------------------------------------------------------

TEST(Linear, ForwardMatchesLoopWithinKDependentBound) {
  Gemm gemm = make_gemm();
  for (const bool with_bias : {true, false}) {
    const std::size_t N = 37, C = 129, OC = 33;
    const Vec x = random_vec(N * C, 1), w = random_vec(OC * C, 2), b = random_vec(OC, 3);
    Vec y(N * OC, std::numeric_limits<float>::quiet_NaN());  // beta = 0: never read
    linear_forward(gemm, y, x, w, with_bias ? std::span<const float>(b) : std::span<const float>(), N, C, OC);
    // Any summation order of K = C products plus the bias add, in fp32:
    // |err| <= (K + 2) u (sum |x w| + |b|), u = 2^-24.
    const double u = std::ldexp(1.0, -24);
    for (std::size_t n = 0; n < N; ++n) {
      for (std::size_t o = 0; o < OC; ++o) {
        double ref = with_bias ? static_cast<double>(b[o]) : 0.0;
        double mag = with_bias ? std::abs(static_cast<double>(b[o])) : 0.0;
        for (std::size_t c = 0; c < C; ++c) {
          const double p = static_cast<double>(x[n * C + c]) * static_cast<double>(w[o * C + c]);
          ref += p;
          mag += std::abs(p);
        }
        ASSERT_NEAR(static_cast<double>(y[n * OC + o]), ref, static_cast<double>(C + 2) * u * mag)
            << "bias " << with_bias << " at " << n << "," << o;
      }
    }
  }
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  Gemm gemm = make_gemm();
  const std::size_t N = 6, C = 8, OC = 5;
  const Vec x = random_vec(N * C, 10), w = random_vec(OC * C, 11), b = random_vec(OC, 12);
  const Vec dout = random_vec(N * OC, 13);
  Vec y(N * OC);
  linear_forward(gemm, y, x, w, b, N, C, OC);
  expect_forward("out", y, linear_ref(to_double(x), to_double(w), to_double(b), N, C, OC), 1e-6);

  const Vec p_dx = random_vec(N * C, 14), p_dw = random_vec(OC * C, 15), p_db = random_vec(OC, 16);
  Vec dx = p_dx, dw = p_dw, db = p_db;
  linear_backward(gemm, dx, dw, db, dout, x, w, N, C, OC);
  const DVec xd = to_double(x), wd = to_double(w), bd = to_double(b);
  expect_grad("dinp", dx, p_dx, numeric_grad([&](const DVec& v) { return linear_ref(v, wd, bd, N, C, OC); }, x, dout));
  expect_grad("dweight", dw, p_dw,
              numeric_grad([&](const DVec& v) { return linear_ref(xd, v, bd, N, C, OC); }, w, dout));
  expect_grad("dbias", db, p_db, numeric_grad([&](const DVec& v) { return linear_ref(xd, wd, v, N, C, OC); }, b, dout));

  // No bias and no dinp: only dweight changes.
  Vec dw2 = p_dw;
  linear_backward(gemm, {}, dw2, {}, dout, x, w, N, C, OC);
  for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_FLOAT_EQ(dw2[i], dw[i]) << i;
}

// ---- embedding --------------------------------------------------------------------------

TEST(Embedding, ForwardAndAccumulatingBackward) {
  const std::size_t B = 2, T = 3, C = 8, V = 11, maxT = 5;
  std::vector<TokenId> tok = {3, 7, 3, 0, 10, 3};  // repeated ids accumulate
  const Vec wte = random_vec(V * C, 20), wpe = random_vec(maxT * C, 21), dout = random_vec(B * T * C, 22);
  Vec out(B * T * C);
  embedding_forward(out, tok, wte, wpe, B, T, C, V);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < C; ++i)
        EXPECT_EQ(out[(b * T + t) * C + i], wte[tok[b * T + t] * C + i] + wpe[t * C + i]);

  auto ref = [&](const DVec& e, const DVec& p) {
    DVec o(B * T * C);
    for (std::size_t n = 0; n < B * T; ++n)
      for (std::size_t i = 0; i < C; ++i) o[n * C + i] = e[tok[n] * C + i] + p[(n % T) * C + i];
    return o;
  };
  const Vec p_dwte = random_vec(V * C, 23), p_dwpe = random_vec(maxT * C, 24);
  Vec dwte = p_dwte, dwpe = p_dwpe;
  embedding_backward(dwte, dwpe, dout, tok, B, T, C, V);
  const DVec wted = to_double(wte), wped = to_double(wpe);
  expect_grad("dwte", dwte, p_dwte, numeric_grad([&](const DVec& v) { return ref(v, wped); }, wte, dout));
  expect_grad("dwpe", dwpe, p_dwpe, numeric_grad([&](const DVec& v) { return ref(wted, v); }, wpe, dout));
  for (std::size_t i = T * C; i < maxT * C; ++i) EXPECT_EQ(dwpe[i], p_dwpe[i]) << "rows t >= T untouched";
}

// ---- layer norm ---------------------------------------------------------------------------

TEST(LayerNorm, ForwardSavesStatisticsAndBackwardMatchesFiniteDifferences) {
  const std::size_t N = 6, C = 8;
  const Vec x = random_vec(N * C, 30, -2.0f, 3.0f), w = random_vec(C, 31, 0.5f, 1.5f), b = random_vec(C, 32);
  const Vec dout = random_vec(N * C, 33);
  Vec y(N * C), mean(N), rstd(N);
  layernorm_forward(y, mean, rstd, x, w, b, N, C);
  const DVec xd = to_double(x), wd = to_double(w), bd = to_double(b);
  expect_forward("out", y, layernorm_ref(xd, wd, bd, N, C, 1e-5), 1e-6);
  for (std::size_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (std::size_t i = 0; i < C; ++i) m += xd[n * C + i];
    m /= C;
    for (std::size_t i = 0; i < C; ++i) v += (xd[n * C + i] - m) * (xd[n * C + i] - m);
    v /= C;
    EXPECT_NEAR(static_cast<double>(mean[n]), m, 1e-6 * (1 + std::abs(m)));
    EXPECT_NEAR(static_cast<double>(rstd[n]), 1 / std::sqrt(v + 1e-5), 1e-5 / std::sqrt(v + 1e-5));
  }

  const Vec p_dx = random_vec(N * C, 34), p_dw = random_vec(C, 35), p_db = random_vec(C, 36);
  Vec dx = p_dx, dw = p_dw, db = p_db;
  layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C);
  expect_grad("dinp", dx, p_dx,
              numeric_grad([&](const DVec& v) { return layernorm_ref(v, wd, bd, N, C, 1e-5); }, x, dout));
  expect_grad("dweight", dw, p_dw,
              numeric_grad([&](const DVec& v) { return layernorm_ref(xd, v, bd, N, C, 1e-5); }, w, dout));
  expect_grad("dbias", db, p_db,
              numeric_grad([&](const DVec& v) { return layernorm_ref(xd, wd, v, N, C, 1e-5); }, b, dout));
}

// ---- GELU and residual -------------------------------------------------------------------------

TEST(Gelu, ForwardAndBackward) {
  Vec x = random_vec(48, 40, -4.0f, 4.0f);
  x[0] = 0.0f;
  const Vec dout = random_vec(x.size(), 41);
  Vec y(x.size());
  gelu_forward(y, x);
  expect_forward("out", y, gelu_ref(to_double(x)), 1e-6);
  const Vec p_dx = random_vec(x.size(), 42);
  Vec dx = p_dx;
  gelu_backward(dx, x, dout);
  expect_grad("dinp", dx, p_dx, numeric_grad(gelu_ref, x, dout));
  // dinp may alias dout: dout + gelu'(x) dout, against the double derivative.
  Vec inplace = dout;
  gelu_backward(inplace, x, inplace);
  const DVec gd = numeric_grad(gelu_ref, x, Vec(x.size(), 1.0f));
  DVec want(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) want[i] = static_cast<double>(dout[i]) * (1.0 + gd[i]);
  expect_grad("dinp in place", inplace, {}, want);

  // In place, and large |x| stays finite (gelu'(x) -> 1 or 0).
  Vec big = {-1e4f, -50.0f, 50.0f, 1e4f};
  Vec dbig(4, 0.0f);
  gelu_backward(dbig, big, Vec(4, 1.0f));
  gelu_forward(big, big);
  EXPECT_EQ(big[0], -0.0f);
  EXPECT_EQ(big[3], 1e4f);
  EXPECT_EQ(dbig[0], 0.0f);
  EXPECT_EQ(dbig[3], 1.0f);
}

TEST(Residual, ForwardAndAccumulatingBackward) {
  const Vec a = random_vec(24, 50), b = random_vec(24, 51), dout = random_vec(24, 52);
  Vec out(24);
  residual_forward(out, a, b);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(out[i], a[i] + b[i]);
  const Vec p_da = random_vec(24, 53), p_db = random_vec(24, 54);
  Vec da = p_da, db = p_db;
  residual_backward(da, db, dout);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(da[i], p_da[i] + dout[i]);
    EXPECT_EQ(db[i], p_db[i] + dout[i]);
  }
}

// ---- attention ------------------------------------------------------------------------------------
//
// The tests below run both implementations: the fast path (GEMMs through oneDNN, a
// 1-thread Gemm as make_gemm builds) and the scalar reference (namespace reference);
// every assertion holds for each.

enum class Attn { fast, reference };
constexpr Attn kAttns[] = {Attn::fast, Attn::reference};
std::string attn_name(Attn a) { return a == Attn::fast ? "fast: " : "reference: "; }

void attn_forward(Attn impl, std::span<float> out, std::span<float> preatt, std::span<float> att,
                  std::span<const float> qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  if (impl == Attn::reference) return reference::attention_forward(out, preatt, att, qkv, B, T, C, NH);
  Gemm gemm = make_gemm();
  attention_forward(gemm, out, preatt, att, qkv, B, T, C, NH);
}

void attn_backward(Attn impl, std::span<float> dqkv, std::span<float> dpreatt, std::span<float> datt,
                   std::span<const float> dout, std::span<const float> qkv, std::span<const float> att, std::size_t B,
                   std::size_t T, std::size_t C, std::size_t NH) {
  if (impl == Attn::reference) return reference::attention_backward(dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH);
  Gemm gemm = make_gemm();
  attention_backward(gemm, dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH);
}

TEST(Attention, ForwardAndBackwardMatchReference) {
  for (const Attn impl : kAttns) {
  SCOPED_TRACE(attn_name(impl));
  const std::size_t B = 2, T = 3, C = 8, NH = 2;
  const Vec qkv = random_vec(B * T * 3 * C, 60, -1.5f, 1.5f), dout = random_vec(B * T * C, 61);
  Vec out(B * T * C), preatt(B * NH * T * T), att(B * NH * T * T);
  attn_forward(impl, out, preatt, att, qkv, B, T, C, NH);
  expect_forward("out", out, attention_ref(to_double(qkv), B, T, C, NH), 1e-6);
  for (std::size_t row = 0; row < B * NH * T; ++row) {
    const std::size_t t = row % T;
    float sum = 0;
    for (std::size_t t2 = 0; t2 < T; ++t2) {
      if (t2 > t) {
        EXPECT_EQ(att[row * T + t2], 0.0f);
        EXPECT_EQ(preatt[row * T + t2], 0.0f);
      }
      sum += att[row * T + t2];
    }
    EXPECT_NEAR(sum, 1.0f, 1e-6f);
  }

  const Vec p_dqkv = random_vec(qkv.size(), 62);
  Vec dqkv = p_dqkv;
  Vec dpreatt(att.size(), std::numeric_limits<float>::quiet_NaN()),
      datt(att.size(), std::numeric_limits<float>::quiet_NaN());
  attn_backward(impl, dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH);
  expect_grad("dqkv", dqkv, p_dqkv,
              numeric_grad([&](const DVec& v) { return attention_ref(v, B, T, C, NH); }, qkv, dout));
  for (std::size_t i = 0; i < att.size(); ++i) {
    EXPECT_TRUE(std::isfinite(datt[i]) && std::isfinite(dpreatt[i])) << "scratch overwritten in full, " << i;
    if (i % T > (i / T) % T) {
      EXPECT_TRUE(datt[i] == 0.0f && dpreatt[i] == 0.0f) << i;
    }
  }
  // Overwritten, not accumulated: a second call gives the same scratch.
  Vec dpreatt2 = dpreatt, datt2 = datt;
  attn_backward(impl, dqkv, dpreatt2, datt2, dout, qkv, att, B, T, C, NH);
  EXPECT_EQ(dpreatt2, dpreatt);
  EXPECT_EQ(datt2, datt);
  }
}

// out as a function of the scores preatt[B,NH,T,T] (the causal softmax of each row's
// entries t2 <= t, then the sum of v): the double reference for dL/dpreatt.
DVec attention_from_scores_ref(const DVec& pre, const DVec& qkv, std::size_t B, std::size_t T, std::size_t C,
                               std::size_t NH) {
  const std::size_t hs = C / NH;
  DVec out(B * T * C, 0.0);
  for (std::size_t b = 0; b < B; ++b) {
    for (std::size_t h = 0; h < NH; ++h) {
      for (std::size_t t = 0; t < T; ++t) {
        const double* row = &pre[((b * NH + h) * T + t) * T];
        const double mx = *std::max_element(row, row + t + 1);
        double z = 0;
        for (std::size_t t2 = 0; t2 <= t; ++t2) z += std::exp(row[t2] - mx);
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const double p = std::exp(row[t2] - mx) / z;
          for (std::size_t i = 0; i < hs; ++i) {
            out[(b * T + t) * C + h * hs + i] += p * qkv[(b * T + t2) * 3 * C + 2 * C + h * hs + i];
          }
        }
      }
    }
  }
  return out;
}

// A longer sequence, one and several heads, and the documented contents of the scratch:
// datt = dL/datt (exact in double: the v . dout of each visible pair) and
// dpreatt = dL/dpreatt (finite differences of the double softmax-then-sum of v).
TEST(Attention, BackwardScratchHoldsTheScoreGradients) {
  for (const Attn impl : kAttns)
  for (const std::size_t NH : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
    const std::size_t B = 2, T = 5, C = 8;
    const std::string tag = attn_name(impl) + "NH " + std::to_string(NH) + " ";
    const Vec qkv = random_vec(B * T * 3 * C, 90 + static_cast<std::uint32_t>(NH), -1.5f, 1.5f);
    const Vec dout = random_vec(B * T * C, 91);
    Vec out(B * T * C), preatt(B * NH * T * T), att(B * NH * T * T);
    attn_forward(impl, out, preatt, att, qkv, B, T, C, NH);
    expect_forward(tag + "out", out, attention_ref(to_double(qkv), B, T, C, NH), 1e-6);
    const Vec p_dqkv = random_vec(qkv.size(), 92);
    Vec dqkv = p_dqkv;
    Vec dpreatt(att.size(), std::numeric_limits<float>::quiet_NaN()),
        datt(att.size(), std::numeric_limits<float>::quiet_NaN());
    attn_backward(impl, dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH);
    expect_grad(tag + "dqkv", dqkv, p_dqkv,
                numeric_grad([&](const DVec& v) { return attention_ref(v, B, T, C, NH); }, qkv, dout));
    const std::size_t hs = C / NH;
    DVec datt_ref(att.size(), 0.0);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < NH; ++h)
        for (std::size_t t = 0; t < T; ++t)
          for (std::size_t t2 = 0; t2 <= t; ++t2)
            for (std::size_t i = 0; i < hs; ++i) {
              const double dy = static_cast<double>(dout[(b * T + t) * C + h * hs + i]);
              const double v = static_cast<double>(qkv[(b * T + t2) * 3 * C + 2 * C + h * hs + i]);
              datt_ref[((b * NH + h) * T + t) * T + t2] += dy * v;
            }
    expect_grad(tag + "datt", datt, {}, datt_ref);
    const DVec qkvd = to_double(qkv);
    expect_grad(tag + "dpreatt", dpreatt, {},
                numeric_grad([&](const DVec& p) { return attention_from_scores_ref(p, qkvd, B, T, C, NH); }, preatt,
                             dout));
  }
}

TEST(Attention, IsCausal) {
  for (const Attn impl : kAttns) {
  SCOPED_TRACE(attn_name(impl));
  const std::size_t B = 2, T = 5, C = 8, NH = 2;
  const Vec qkv = random_vec(B * T * 3 * C, 70);
  Vec out(B * T * C), preatt(B * NH * T * T), att(B * NH * T * T);
  attn_forward(impl, out, preatt, att, qkv, B, T, C, NH);
  for (std::size_t t = 0; t + 1 < T; ++t) {
    Vec changed = qkv;
    const Vec noise = random_vec(B * T * 3 * C, 71 + static_cast<std::uint32_t>(t), -5.0f, 5.0f);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t t2 = t + 1; t2 < T; ++t2)
        for (std::size_t i = 0; i < 3 * C; ++i) changed[(b * T + t2) * 3 * C + i] = noise[(b * T + t2) * 3 * C + i];
    Vec out2(out.size()), preatt2(preatt.size()), att2(att.size());
    attn_forward(impl, out2, preatt2, att2, changed, B, T, C, NH);
    bool later_changed = false;
    for (std::size_t b = 0; b < B; ++b) {
      for (std::size_t t1 = 0; t1 < T; ++t1) {
        for (std::size_t i = 0; i < C; ++i) {
          const std::size_t k = (b * T + t1) * C + i;
          if (t1 <= t) {
            ASSERT_EQ(out2[k], out[k]) << "output at " << t1 << " depends on inputs after " << t;
          } else {
            later_changed = later_changed || out2[k] != out[k];
          }
        }
      }
    }
    EXPECT_TRUE(later_changed) << "the perturbation after " << t << " did nothing";
  }
  }
}

// The fast path (GEMMs) against the scalar reference, on the same fp32 inputs, over
// shapes with T = 1, odd T / C / head sizes, one and several heads, and with q, k, v and
// dout stored in bf16 (the values rounded first, so both see the same numbers; the fast
// path multiplies the stored bf16, widened or on oneDNN's native bf16 path, the
// reference their fp32 values).
//
// Tolerance: the two differ only in the summation order of dot products of at most
// n = max(hs, T) terms (each product exact, or rounded once the same way), and the
// softmax and its backward are the same loops in both, differing only through their
// inputs. Reassociating a sum of n terms changes it by at most ~n u times the sum of the
// terms' magnitudes (u = 2^-24); with |q|, |k|, |v|, |dout| <= 1.5 and att rows summing
// to 1 that sum stays below 8 max(1, max|element| of the tensor), so per element
//     |fast - ref| <= 16 n u max(1, max|ref|)   (two sides, each n u * 8 M)
// (for T = 128: 1.2e-4 M; typical errors are ~sqrt(n) u, far below, while a wrong or
// missing term is O(1e-2) or more). Masked entries (t2 > t) must be exactly 0 in
// preatt, att, datt and dpreatt.
void expect_close(const std::string& name, const Vec& got, const Vec& ref, std::size_t n) {
  ASSERT_EQ(got.size(), ref.size()) << name;
  const double u = std::ldexp(1.0, -24);
  double maxabs = 1.0;
  for (const float r : ref) maxabs = std::max(maxabs, std::abs(static_cast<double>(r)));
  const double tol = 16.0 * static_cast<double>(n) * u * maxabs;
  int bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    if (!(d <= tol) && bad++ < 5) {
      ADD_FAILURE() << name << "[" << i << "]: fast " << got[i] << ", reference " << ref[i] << ", tol " << tol;
    }
  }
  EXPECT_EQ(bad, 0) << name;
}

void expect_masked_zero(const std::string& name, const Vec& v, std::size_t T) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i % T > (i / T) % T) {
      ASSERT_EQ(v[i], 0.0f) << name << "[" << i << "] is masked";
    }
  }
}

TEST(Attention, FastPathMatchesScalarReference) {
  struct Shape {
    std::size_t B, T, C, NH;
  };
  const Shape shapes[] = {{1, 1, 8, 2},  {2, 1, 6, 1},  {1, 7, 12, 3}, {2, 13, 20, 5},
                          {3, 5, 9, 1},  {1, 33, 24, 4}, {2, 64, 64, 2}, {1, 128, 128, 2}};
  enum class Storage { f32, bf16_widened, bf16_native };
  for (const Storage storage : {Storage::f32, Storage::bf16_widened, Storage::bf16_native}) {
    Gemm gemm({.threads = storage == Storage::bf16_native ? 2u : 1u,
               .native_bf16 = storage != Storage::bf16_widened});
    if (storage == Storage::bf16_native && gemm.path(DType::bf16, DType::bf16) != GemmPath::onednn_bf16) {
      std::cout << "[   INFO   ] no native bf16 matmul on this CPU: the bf16_native case runs widened\n";
    }
    for (const Shape& sh : shapes) {
      const auto [B, T, C, NH] = sh;
      const std::string tag = std::string(storage == Storage::f32 ? "f32" : storage == Storage::bf16_widened ? "bf16 widened" : "bf16 native") +
                              " B" + std::to_string(B) + " T" + std::to_string(T) + " C" + std::to_string(C) + " NH" +
                              std::to_string(NH) + " ";
      const std::uint32_t seed = static_cast<std::uint32_t>(B * 1000 + T * 10 + NH);
      Vec qkv = random_vec(B * T * 3 * C, seed, -1.5f, 1.5f), dout = random_vec(B * T * C, seed + 1, -1.5f, 1.5f);
      std::vector<bf16> qkv16(qkv.size()), dout16(dout.size());
      if (storage != Storage::f32) {
        for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>(qkv16[i] = bf16(qkv[i]));
        for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = static_cast<float>(dout16[i] = bf16(dout[i]));
      }
      const MatrixView qkv_op = storage == Storage::f32 ? view(qkv.data(), B * T, 3 * C) : view(qkv16.data(), B * T, 3 * C);
      const MatrixView dout_op = storage == Storage::f32 ? view(dout.data(), B * T, C) : view(dout16.data(), B * T, C);
      const std::size_t n = std::max(C / NH, T);

      Vec out(B * T * C, 7.0f), preatt(B * NH * T * T, 7.0f), att(preatt.size(), 7.0f);
      Vec rout(out.size()), rpreatt(preatt.size()), ratt(att.size());
      attention_forward(gemm, out, preatt, att, qkv_op, B, T, C, NH);
      reference::attention_forward(rout, rpreatt, ratt, qkv, B, T, C, NH);
      expect_close(tag + "preatt", preatt, rpreatt, n);
      expect_close(tag + "att", att, ratt, n);
      expect_close(tag + "out", out, rout, n);
      expect_masked_zero(tag + "preatt", preatt, T);
      expect_masked_zero(tag + "att", att, T);

      const Vec prefill = random_vec(qkv.size(), seed + 2);
      Vec dqkv = prefill, rdqkv = prefill;
      Vec dpre(att.size(), std::numeric_limits<float>::quiet_NaN()), da(att.size(), std::numeric_limits<float>::quiet_NaN());
      Vec rdpre(att.size()), rda(att.size());
      attention_backward(gemm, dqkv, dpre, da, dout_op, qkv_op, ratt, B, T, C, NH);
      reference::attention_backward(rdqkv, rdpre, rda, dout, qkv, ratt, B, T, C, NH);
      expect_close(tag + "datt", da, rda, n);
      expect_close(tag + "dpreatt", dpre, rdpre, n);
      expect_close(tag + "dqkv", dqkv, rdqkv, n);
      expect_masked_zero(tag + "datt", da, T);
      expect_masked_zero(tag + "dpreatt", dpre, T);
    }
  }
}

// One 1-thread Gemm per OpenMP thread (what the training engine passes): each (batch
// row, head) is computed by exactly the same 1-thread GEMMs whichever thread runs it, so
// the result equals a single 1-thread Gemm's bit for bit.
TEST(Attention, PerThreadGemmsGiveTheSameBitsAsOne) {
  const std::size_t B = 3, T = 33, C = 24, NH = 4;
  std::vector<Gemm> team;
  for (int i = 0; i < 3; ++i) team.emplace_back(GemmOptions{.threads = 1});
  Gemm one({.threads = 1});
  const Vec qkv = random_vec(B * T * 3 * C, 130, -1.5f, 1.5f), dout = random_vec(B * T * C, 131);
  Vec out1(B * T * C), pre1(B * NH * T * T), att1(pre1.size()), out2 = out1, pre2 = pre1, att2 = att1;
  attention_prepare(team, DType::f32, DType::f32, T, C, NH);
  attention_forward(team, out1, pre1, att1, view(qkv.data(), B * T, 3 * C), B, T, C, NH);
  attention_forward(one, out2, pre2, att2, qkv, B, T, C, NH);
  EXPECT_EQ(out1, out2);
  EXPECT_EQ(pre1, pre2);
  EXPECT_EQ(att1, att2);
  Vec d1(qkv.size(), 0.5f), d2 = d1, dp1(pre1.size()), da1(pre1.size()), dp2 = dp1, da2 = da1;
  attention_backward(team, d1, dp1, da1, view(dout.data(), B * T, C), view(qkv.data(), B * T, 3 * C), att1, B, T, C,
                     NH);
  attention_backward(one, d2, dp2, da2, dout, qkv, att1, B, T, C, NH);
  EXPECT_EQ(d1, d2);
  EXPECT_EQ(dp1, dp2);
  EXPECT_EQ(da1, da2);
  std::vector<Gemm> threaded;
  threaded.emplace_back(GemmOptions{.threads = 1});
  threaded.emplace_back(GemmOptions{.threads = 2});
  expect_invalid([&] { attention_forward(threaded, out1, pre1, att1, view(qkv.data(), B * T, 3 * C), B, T, C, NH); },
                 "attention_forward: gemms: expected 1-thread Gemms when there are 2, found one with 2 threads");
  expect_invalid([&] { attention_forward(std::span<Gemm>(), out1, pre1, att1, view(qkv.data(), B * T, 3 * C), B, T, C,
                                         NH); },
                 "gemms: expected at least one Gemm, found 0");
}

TEST(Attention, SoftmaxCausalRow) {
  Vec pre = {1.0f, 3.0f, -2.0f, 9.0f, -7.0f}, att(5, 5.0f);
  softmax_causal_row(pre.data(), att.data(), 3, 5);
  const double z = std::exp(1.0 - 3.0) + 1.0 + std::exp(-5.0);
  EXPECT_NEAR(att[0], std::exp(-2.0) / z, 1e-7);
  EXPECT_NEAR(att[1], 1.0 / z, 1e-7);
  EXPECT_NEAR(att[2], std::exp(-5.0) / z, 1e-7);
  EXPECT_EQ(att[3], 0.0f);
  EXPECT_EQ(att[4], 0.0f);
  EXPECT_EQ(pre[3], 0.0f);
  EXPECT_EQ(pre[4], 0.0f);
  Vec one = {-1e30f}, a1(1);
  softmax_causal_row(one.data(), a1.data(), 1, 1);
  EXPECT_EQ(a1[0], 1.0f);
}

// ---- softmax cross-entropy ---------------------------------------------------------------------

TEST(SoftmaxCrossEntropy, ProbabilitiesLossesAndBackward) {
  const std::size_t B = 2, T = 3, V = 11;
  const Vec logits = random_vec(B * T * V, 80, -3.0f, 3.0f), dl = random_vec(B * T, 81);
  const std::vector<TokenId> targets = random_ids(B * T, V, 82);
  Vec losses(B * T), probs(B * T * V);
  softmax_crossentropy_forward(losses, probs, logits, targets, B, T, V);
  for (std::size_t n = 0; n < B * T; ++n) {
    double sum = 0;
    for (std::size_t i = 0; i < V; ++i) {
      EXPECT_GT(probs[n * V + i], 0.0f);
      sum += static_cast<double>(probs[n * V + i]);
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
    EXPECT_NEAR(losses[n], -std::log(probs[n * V + targets[n]]), 1e-6f * (1.0f + losses[n]));
  }
  expect_forward("losses", losses, crossentropy_ref(to_double(logits), targets, B * T, V), 1e-6);
  EXPECT_NEAR(
      mean_loss(losses),
      [&] {
        double s = 0;
        for (const float l : losses) s += static_cast<double>(l);
        return static_cast<float>(s / static_cast<double>(losses.size()));
      }(),
      0.0f);

  const Vec p_d = random_vec(B * T * V, 83);
  Vec dlogits = p_d;
  crossentropy_softmax_backward(dlogits, dl, probs, targets, B, T, V);
  expect_grad("dlogits", dlogits, p_d,
              numeric_grad([&](const DVec& v) { return crossentropy_ref(v, targets, B * T, V); }, logits, dl));
}

TEST(SoftmaxCrossEntropy, ExtremeLogitsStayFinite) {
  const std::size_t V = 4;
  const Vec logits = {1e4f, -1e4f, 0.0f, 1e4f - 200.0f};
  const std::vector<TokenId> targets = {1};
  Vec losses(1), probs(V);
  softmax_crossentropy_forward(losses, probs, logits, targets, 1, 1, V);
  EXPECT_EQ(probs[0], 1.0f);
  EXPECT_EQ(probs[1], 0.0f);  // underflows, yet the loss is finite and exact
  EXPECT_FLOAT_EQ(losses[0], 2e4f);
  EXPECT_EQ(mean_loss({}), 0.0f);
}

// ---- large shapes: the OpenMP branches ---------------------------------------------------------
//
// The checks above use small shapes, which run on the calling thread (layers.cpp's
// parallel_worth_it: >= 2^16 elements); training shapes take the OpenMP branches. Here
// each layer at a shape past that threshold, against the same double references:
// forwards element by element; backwards element by element against exact double
// derivatives where they are cheap (GELU: central difference of the scalar double
// GELU; cross-entropy: double softmax minus one-hot), and attention's dqkv along 3
// random unit directions d (derivative of the double L = sum(dout * attention(qkv +
// s d)) by the 4-point stencil, h = 1e-3, exact to ~1e-11) with the relative
// tolerance 1e-4 |expected| + 64 u sum_i |g_i d_i| (u = 2^-24): the fp32 backward's
// error is ~1e-6 of that here, a wrong or racing term O(1).
void expect_directional(const std::string& name, const Vec& analytic, const Fwd& f, const Vec& x0, const Vec& dout,
                        std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  const double u = std::ldexp(1.0, -24), h = 1e-3;
  const DVec x = to_double(x0);
  for (int k = 0; k < 3; ++k) {
    DVec d(x.size());
    double norm = 0;
    for (double& v : d) {
      v = nd(gen);
      norm += v * v;
    }
    double found = 0, magnitude = 0;
    for (std::size_t i = 0; i < d.size(); ++i) {
      d[i] /= std::sqrt(norm);
      found += static_cast<double>(analytic[i]) * d[i];
      magnitude += std::abs(static_cast<double>(analytic[i]) * d[i]);
    }
    auto at = [&](double step) {
      DVec y(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] + step * d[i];
      return dot(f(y), dout);
    };
    const double expected = (8.0 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12.0 * h);
    EXPECT_LE(std::abs(found - expected), 1e-4 * std::abs(expected) + 64 * u * magnitude)
        << name << " direction " << k << ": expected (double) " << expected << ", found " << found;
  }
}

TEST(Layers, LargeShapesTakeTheParallelBranchesAndStayCorrect) {
  Gemm gemm = make_gemm();
  {  // GELU, 2^16 values
    const Vec x = random_vec(std::size_t{1} << 16, 100, -4.0f, 4.0f), dout = random_vec(x.size(), 101);
    Vec y(x.size());
    gelu_forward(y, x);
    expect_forward("gelu out", y, gelu_ref(to_double(x)), 1e-6);
    Vec dx(x.size(), 0.0f);
    gelu_backward(dx, x, dout);
    DVec want(x.size());
    constexpr double hg = 1e-5;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double xi = static_cast<double>(x[i]);
      want[i] = (gelu_ref({xi + hg})[0] - gelu_ref({xi - hg})[0]) / (2 * hg) * static_cast<double>(dout[i]);
    }
    expect_grad("gelu dinp", dx, {}, want);
  }
  {  // layer norm forward [512, 128]
    const std::size_t N = 512, C = 128;
    const Vec x = random_vec(N * C, 102, -2.0f, 3.0f), w = random_vec(C, 103, -1.5f, 1.5f), b = random_vec(C, 104);
    Vec y(N * C), mean(N), rstd(N);
    layernorm_forward(y, mean, rstd, x, w, b, N, C);
    expect_forward("layernorm out", y, layernorm_ref(to_double(x), to_double(w), to_double(b), N, C, 1e-5), 1e-6);
  }
  {  // linear forward with bias [256, 16] -> [256, 256]
    const std::size_t N = 256, C = 16, OC = 256;
    const Vec x = random_vec(N * C, 105), w = random_vec(OC * C, 106), b = random_vec(OC, 107);
    Vec y(N * OC);
    linear_forward(gemm, y, x, w, b, N, C, OC);
    expect_forward("linear out", y, linear_ref(to_double(x), to_double(w), to_double(b), N, C, OC), 1e-6);
  }
  {  // embedding forward [4, 32, 512]
    const std::size_t B = 4, T = 32, C = 512, V = 7;
    const std::vector<TokenId> tok = random_ids(B * T, V, 108);
    const Vec wte = random_vec(V * C, 109), wpe = random_vec(T * C, 110);
    Vec out(B * T * C);
    embedding_forward(out, tok, wte, wpe, B, T, C, V);
    for (std::size_t n = 0; n < B * T; ++n)
      for (std::size_t i = 0; i < C; ++i)
        ASSERT_EQ(out[n * C + i], wte[tok[n] * C + i] + wpe[(n % T) * C + i]) << n << "," << i;
  }
  {  // attention [2, 32, 64], 2 heads: B*NH*T*T*hs = 2^17
    const std::size_t B = 2, T = 32, C = 64, NH = 2;
    const Vec qkv = random_vec(B * T * 3 * C, 111, -1.5f, 1.5f), dout = random_vec(B * T * C, 112);
    for (const Attn impl : kAttns) {
    Vec out(B * T * C), preatt(B * NH * T * T), att(B * NH * T * T);
    attn_forward(impl, out, preatt, att, qkv, B, T, C, NH);
    expect_forward(attn_name(impl) + "attention out", out, attention_ref(to_double(qkv), B, T, C, NH), 1e-6);
    Vec dqkv(qkv.size(), 0.0f), dpreatt(att.size()), datt(att.size());
    attn_backward(impl, dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH);
    expect_directional(attn_name(impl) + "attention dqkv", dqkv, [&](const DVec& v) { return attention_ref(v, B, T, C, NH); }, qkv,
                       dout, 113);
    }
  }
  {  // softmax cross-entropy [4, 32, 512]
    const std::size_t B = 4, T = 32, V = 512, N = B * T;
    const Vec logits = random_vec(N * V, 114, -3.0f, 3.0f), dl = random_vec(N, 115);
    const std::vector<TokenId> targets = random_ids(N, V, 116);
    Vec losses(N), probs(N * V);
    softmax_crossentropy_forward(losses, probs, logits, targets, B, T, V);
    expect_forward("losses", losses, crossentropy_ref(to_double(logits), targets, N, V), 1e-6);
    Vec dlogits(N * V, 0.0f);
    crossentropy_softmax_backward(dlogits, dl, probs, targets, B, T, V);
    DVec want(N * V);
    for (std::size_t n = 0; n < N; ++n) {
      double mx = static_cast<double>(logits[n * V]), z = 0;
      for (std::size_t i = 0; i < V; ++i) mx = std::max(mx, static_cast<double>(logits[n * V + i]));
      for (std::size_t i = 0; i < V; ++i) z += std::exp(static_cast<double>(logits[n * V + i]) - mx);
      for (std::size_t i = 0; i < V; ++i) {
        const double p = std::exp(static_cast<double>(logits[n * V + i]) - mx) / z;
        want[n * V + i] = (p - (i == targets[n] ? 1.0 : 0.0)) * static_cast<double>(dl[n]);
      }
    }
    expect_grad("dlogits", dlogits, {}, want);
  }
}

// ---- shape validation ------------------------------------------------------------------------------

template <class F>
void expect_invalid(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no exception, expected one mentioning '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find("found"), std::string::npos) << msg;
  }
}

TEST(Layers, ShapeValidation) {
  Gemm gemm = make_gemm();
  Vec a(24, 1.0f), b(24, 2.0f), small(23), big(100);
  const Vec before = a;
  expect_invalid([&] { linear_forward(gemm, small, a, b, {}, 3, 8, 8); },
                 "linear_forward: out: expected 24 elements (N*OC), found 23");
  Vec out9(9);
  expect_invalid([&] { linear_forward(gemm, out9, a, small, {}, 3, 8, 3); },
                 "weight: expected 24 elements (OC*C), found 23");
  expect_invalid([&] { linear_forward(gemm, out9, a, b, small, 3, 8, 3); }, "bias: expected 3");
  expect_invalid([&] { linear_forward(gemm, a, a, b, {}, 0, 8, 8); }, "N: expected > 0");
  expect_invalid([&] { linear_backward(gemm, a, b, small, out9, a, b, 3, 8, 3); }, "dbias: expected 3");
  expect_invalid([&] { residual_forward(small, a, b); }, "residual_forward: out");
  expect_invalid([&] { residual_backward(a, small, b); }, "residual_backward: db");
  expect_invalid([&] { gelu_forward(small, a); }, "gelu_forward: out");
  expect_invalid([&] { gelu_backward(a, a, small); }, "gelu_backward: dout");
  Vec mean(3), rstd(2);
  expect_invalid([&] { layernorm_forward(b, mean, rstd, a, Vec(8), Vec(8), 3, 8); },
                 "rstd: expected 3 elements (N), found 2");
  expect_invalid([&] { layernorm_forward(b, mean, mean, a, Vec(8), Vec(8), 3, 8, 0.0f); }, "eps");
  std::vector<TokenId> tok = {0, 1, 11};
  expect_invalid([&] { embedding_forward(a, tok, Vec(11 * 8), Vec(8 * 8), 1, 3, 8, 11); },
                 "tokens[2]: expected an id < V = 11, found 11");
  tok[2] = 2;
  expect_invalid([&] { embedding_forward(a, tok, Vec(11 * 8), Vec(2 * 8), 1, 3, 8, 11); }, "wpe");
  Vec dwte(11 * 8), dwpe(3 * 8);
  expect_invalid([&] { embedding_backward(dwte, dwpe, small, tok, 1, 3, 8, 11); }, "dout");
  Vec att(1 * 3 * 3 * 3);
  Vec dqkv(72), dpre(18), datt(18);
  for (const Attn impl : kAttns) {
    SCOPED_TRACE(attn_name(impl));
    expect_invalid([&] { attn_forward(impl, a, att, att, Vec(3 * 24), 1, 3, 8, 3); },
                   "attention_forward: NH: expected a divisor of C = 8, found 3");
    expect_invalid([&] { attn_forward(impl, a, att, att, Vec(3 * 24), 1, 3, 8, 2); }, "preatt: expected 18");
    expect_invalid([&] { attn_backward(impl, dqkv, dpre, datt, a, Vec(71), Vec(18), 1, 3, 8, 2); }, "qkv");
  }
  {  // the stored-operand overloads
    const bf16 one(1.0f);
    std::vector<bf16> qkv16(72, one), dout16(24, one);
    expect_invalid([&] { attention_forward(gemm, a, dpre, datt, view(qkv16.data(), 3, 23), 1, 3, 8, 2); },
                   "attention_forward: qkv: expected a dense 3 x 24 (B*T x 3C) matrix, found 3 x 23");
    expect_invalid([&] { attention_backward(gemm, dqkv, dpre, datt, view(dout16.data(), 3, 8, 9),
                                            view(qkv16.data(), 3, 24), Vec(18), 1, 3, 8, 2); },
                   "dout: expected a dense 3 x 8");
    expect_invalid([&] { linear_forward(gemm, out9, view(qkv16.data(), 3, 8), view(dout16.data(), 2, 8), {}, 3, 8, 3); },
                   "linear_forward: weight: expected a dense 3 x 8 (OC x C) matrix, found 2 x 8");
    expect_invalid([&] { linear_backward(gemm, a, b, {}, out9, view(qkv16.data(), 3, 4), view(qkv16.data(), 3, 8),
                                         view(dout16.data(), 3, 8), 3, 8, 3); },
                   "dout_op: expected a dense 3 x 3");
  }
  Vec losses(3), probs(33);
  expect_invalid([&] { softmax_crossentropy_forward(losses, probs, Vec(33), {{0, 1, 11}}, 1, 3, 11); }, "targets[2]");
  expect_invalid(
      [&] {
        softmax_crossentropy_forward(losses, probs, Vec(32), {{0, 1, 2}}, 1, 3, 11);
      },
      "logits: expected 33");
  expect_invalid([&] { crossentropy_softmax_backward(probs, Vec(2), probs, {{0, 1, 2}}, 1, 3, 11); }, "dlosses");
  EXPECT_EQ(a, before) << "nothing written before the check";
}

}  // namespace
}  // namespace mixprec::nn
