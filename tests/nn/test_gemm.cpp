// Gemm (oneDNN) against gemm_reference (double accumulation), for every input
// type pair, transpose pair, awkward shapes, leading dimensions, alpha/beta and
// the rounded low-precision output. Tolerances: docs/gemm.md ("Tests").
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/nn/gemm.hpp"
#include "support.hpp"

namespace mixprec::nn {
namespace {

constexpr DType kTypes[] = {DType::f32, DType::f16, DType::bf16};
constexpr Trans kTrans[] = {Trans::no, Trans::yes};

// A stored matrix of any input type, filled from floats that are exact in that type.
struct Stored {
  DType dtype;
  std::size_t rows, cols, ld;
  std::vector<float> f32;
  std::vector<f16> h;
  std::vector<bf16> b;

  Stored(DType t, std::size_t r, std::size_t c, std::size_t ld_)
      : dtype(t), rows(r), cols(c), ld(ld_ == 0 ? c : ld_), f32(std::max<std::size_t>(1, r * ld)),
        h(f32.size()), b(f32.size()) {}

  // value must already be representable in dtype
  void set(std::size_t r, std::size_t c, float v) {
    const std::size_t i = r * ld + c;
    f32[i] = v;
    h[i] = f16(v);
    b[i] = bf16(v);
  }
  MatrixView view() const {
    const void* p = dtype == DType::f32 ? static_cast<const void*>(f32.data())
                    : dtype == DType::f16 ? static_cast<const void*>(h.data())
                                          : static_cast<const void*>(b.data());
    return {p, dtype, rows, cols, ld};
  }
};

float representable(DType t, float v) {
  if (t == DType::f16) return static_cast<float>(f16(v));
  if (t == DType::bf16) return static_cast<float>(bf16(v));
  return v;
}

// Random normal values rounded to the type (so every type sees its own exact inputs);
// padding beyond cols is NaN, which must never be read.
Stored random_matrix(DType t, std::size_t rows, std::size_t cols, std::size_t ld, std::mt19937& rng) {
  Stored s(t, rows, cols, ld);
  std::fill(s.f32.begin(), s.f32.end(), std::numeric_limits<float>::quiet_NaN());
  for (std::size_t i = 0; i < s.f32.size(); ++i) {
    s.h[i] = f16(s.f32[i]);
    s.b[i] = bf16(s.f32[i]);
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) s.set(r, c, representable(t, normal(rng)));
  }
  return s;
}

// Small integers in [-4, 4]: every product and partial sum (|sum| <= 16 K < 2^24) is
// exact in fp32, in any order, so the fast path must match the reference bit for bit.
Stored integer_matrix(DType t, std::size_t rows, std::size_t cols, std::size_t ld, std::mt19937& rng) {
  Stored s(t, rows, cols, ld);
  std::uniform_int_distribution<int> d(-4, 4);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) s.set(r, c, static_cast<float>(d(rng)));
  }
  return s;
}

double value(const Stored& s, std::size_t r, std::size_t c) { return s.f32[r * s.ld + c]; }

// Error bound of an fp32 result against the exact value: every summation order of K
// exact-or-rounded products, then alpha * acc and + beta * C, stays within
// gamma_(K+2) * (|alpha| sum_k |a_ik b_kj| + |beta c_ij|), gamma_n = n u / (1 - n u),
// u = 2^-24. Products of f16/bf16 inputs are exact in fp32, products of f32 inputs
// round once, which is inside gamma_K as well. 2 * FLT_TRUE_MIN covers subnormal results.
double bound(std::size_t k, double abs_sum, float alpha, float beta, float c_before) {
  const double u = 0x1p-24;
  const double n = static_cast<double>(k) + 2.0;
  const double gamma = n * u / (1.0 - n * u);
  return gamma * (std::fabs(static_cast<double>(alpha)) * abs_sum +
                  std::fabs(static_cast<double>(beta) * static_cast<double>(c_before))) +
         2.0 * static_cast<double>(std::numeric_limits<float>::denorm_min());
}

struct Case {
  std::size_t m, n, k;
  DType ta_type, tb_type;
  Trans ta, tb;
  float alpha = 1.0f, beta = 0.0f;
  std::size_t pad = 0;  // extra leading-dimension columns on A, B and C
};

std::string describe(const Case& c) {
  return std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) + " " +
         std::string(dtype_name(c.ta_type)) + "*" + std::string(dtype_name(c.tb_type)) +
         (c.ta == Trans::yes ? " A^T" : " A") + (c.tb == Trans::yes ? " B^T" : " B") +
         " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta) + " pad=" + std::to_string(c.pad);
}

// Runs one case through `g` and the reference; checks the tolerance (or bitwise when
// `exact`), and that NaN padding was neither read nor written.
void check_case(Gemm& g, const Case& c, bool integers, std::mt19937& rng) {
  SCOPED_TRACE(describe(c));
  const std::size_t a_rows = c.ta == Trans::no ? c.m : c.k, a_cols = c.ta == Trans::no ? c.k : c.m;
  const std::size_t b_rows = c.tb == Trans::no ? c.k : c.n, b_cols = c.tb == Trans::no ? c.n : c.k;
  const std::size_t lda = a_cols + c.pad, ldb = b_cols + c.pad, ldc = c.n + c.pad;
  const Stored a = integers ? integer_matrix(c.ta_type, a_rows, a_cols, lda, rng)
                            : random_matrix(c.ta_type, a_rows, a_cols, lda, rng);
  const Stored b = integers ? integer_matrix(c.tb_type, b_rows, b_cols, ldb, rng)
                            : random_matrix(c.tb_type, b_rows, b_cols, ldb, rng);
  std::vector<float> c0(std::max<std::size_t>(1, c.m * ldc), std::numeric_limits<float>::quiet_NaN());
  std::uniform_int_distribution<int> d(-8, 8);
  for (std::size_t i = 0; i < c.m; ++i) {
    for (std::size_t j = 0; j < c.n; ++j) {
      // beta == 0: C holds NaN, which must not leak into the result.
      c0[i * ldc + j] = c.beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(d(rng));
    }
  }
  std::vector<float> fast = c0, ref = c0;
  const GemmArgs args{c.ta, c.tb, c.alpha, c.beta};
  g.run(a.view(), b.view(), {fast.data(), c.m, c.n, ldc}, args);
  gemm_reference(a.view(), b.view(), {ref.data(), c.m, c.n, ldc}, args);

  int failures = 0;
  for (std::size_t i = 0; i < c.m; ++i) {
    for (std::size_t j = 0; j < c.n; ++j) {
      const float got = fast[i * ldc + j], want = ref[i * ldc + j];
      bool ok;
      if (integers) {
        ok = std::memcmp(&got, &want, sizeof got) == 0;
      } else {
        double abs_sum = 0.0;
        for (std::size_t k = 0; k < c.k; ++k) {
          const double x = c.ta == Trans::no ? value(a, i, k) : value(a, k, i);
          const double y = c.tb == Trans::no ? value(b, k, j) : value(b, j, k);
          abs_sum += std::fabs(x * y);
        }
        const float before = c.beta == 0.0f ? 0.0f : c0[i * ldc + j];
        ok = std::fabs(static_cast<double>(got) - static_cast<double>(want)) <=
             bound(c.k, abs_sum, c.alpha, c.beta, before);
      }
      if (!ok && ++failures <= 5) {
        ADD_FAILURE() << "C[" << i << "," << j << "] = " << got << " (" << test::hexf(got) << "), reference "
                      << want << " (" << test::hexf(want) << ")";
      }
    }
    for (std::size_t j = c.n; j < ldc; ++j) {
      if (!std::isnan(fast[i * ldc + j]) && ++failures <= 5) ADD_FAILURE() << "padding of C row " << i << " written";
    }
  }
  EXPECT_EQ(failures, 0);
}

// ---- every type pair x transpose pair, random data, tolerance -----------------------
TEST(Gemm, AllTypesAndTransposesWithinBound) {
  Gemm g;
  std::mt19937 rng(1);
  const std::tuple<std::size_t, std::size_t, std::size_t> shapes[] = {
      {1, 1, 1}, {7, 13, 5}, {64, 64, 64}, {3, 2, 257}, {129, 1, 31}, {1, 97, 40}};
  for (auto [m, n, k] : shapes) {
    for (DType ta_type : kTypes) {
      for (DType tb_type : kTypes) {
        for (Trans ta : kTrans) {
          for (Trans tb : kTrans) check_case(g, {m, n, k, ta_type, tb_type, ta, tb}, false, rng);
        }
      }
    }
  }
}

// ---- bitwise where fp32 arithmetic is exact ------------------------------------------
TEST(Gemm, SmallIntegersAreBitwiseEqualToReference) {
  Gemm g;
  std::mt19937 rng(2);
  for (DType ta_type : kTypes) {
    for (DType tb_type : kTypes) {
      for (Trans ta : kTrans) {
        for (Trans tb : kTrans) {
          check_case(g, {7, 13, 5, ta_type, tb_type, ta, tb}, true, rng);
          check_case(g, {33, 17, 64, ta_type, tb_type, ta, tb, 2.0f, 0.5f}, true, rng);
          check_case(g, {16, 8, 24, ta_type, tb_type, ta, tb, -0.25f, 1.0f, 3}, true, rng);
        }
      }
    }
  }
}

TEST(Gemm, AlphaBetaAndLeadingDimensions) {
  Gemm g;
  std::mt19937 rng(3);
  const std::pair<float, float> ab[] = {{1.0f, 0.0f}, {1.0f, 1.0f}, {0.5f, -1.0f}, {-3.0f, 0.25f}, {0.0f, 2.0f}};
  for (auto [alpha, beta] : ab) {
    for (DType t : kTypes) {
      for (Trans ta : kTrans) {
        for (Trans tb : kTrans) {
          check_case(g, {19, 11, 23, t, t, ta, tb, alpha, beta, 5}, false, rng);
        }
      }
    }
  }
}

// Layer-like shapes: tall and skinny, wide, and the three products of a Linear layer.
TEST(Gemm, LayerShapes) {
  Gemm g;
  std::mt19937 rng(4);
  for (DType t : kTypes) {
    check_case(g, {1024, 3, 16, t, t, Trans::no, Trans::yes}, false, rng);        // Y = X W^T
    check_case(g, {2, 512, 48, t, t, Trans::no, Trans::no}, false, rng);          // dX = dY W
    check_case(g, {40, 24, 300, t, t, Trans::yes, Trans::no, 1.0f, 1.0f}, false, rng);  // dW += dY^T X
  }
}

// ---- the widened bf16/f16 paths and (where oneDNN has them) the native ones agree -----
TEST(Gemm, NativeAndWidenedLowPrecisionPathsAgreeWithReference) {
  Gemm widened({.native_bf16 = false, .native_f16 = false});
  Gemm native;
  const GemmBackendInfo& info = gemm_backend_info();
  EXPECT_EQ(widened.path(DType::bf16, DType::bf16), GemmPath::onednn_f32);
  EXPECT_EQ(widened.path(DType::f16, DType::f16), GemmPath::onednn_f32);
  EXPECT_EQ(native.path(DType::bf16, DType::bf16), info.bf16_native ? GemmPath::onednn_bf16 : GemmPath::onednn_f32);
  EXPECT_EQ(native.path(DType::f16, DType::f16), info.f16_native ? GemmPath::onednn_f16 : GemmPath::onednn_f32);
  EXPECT_EQ(native.path(DType::f16, DType::bf16), GemmPath::onednn_f32);
  EXPECT_EQ(native.path(DType::f32, DType::f32), GemmPath::onednn_f32);
  std::mt19937 rng(5);
  for (DType t : {DType::bf16, DType::f16}) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        check_case(widened, {31, 29, 67, t, t, ta, tb}, false, rng);
        check_case(native, {31, 29, 67, t, t, ta, tb}, false, rng);
        check_case(widened, {9, 10, 11, t, t, ta, tb, 2.0f, -1.0f}, true, rng);
        check_case(native, {9, 10, 11, t, t, ta, tb, 2.0f, -1.0f}, true, rng);
      }
    }
  }
}

// A bf16 signature stays native only where oneDNN picks the implementation of its dense
// 64x64x64 bf16 probe (gemm_backend_info().bf16_impl); layouts it would run on a slower
// kernel (strided per-head attention views) are widened, and stay correct.
TEST(Gemm, Bf16StaysNativeOnlyOnOneDnnsFastKernel) {
  const GemmBackendInfo& info = gemm_backend_info();
  Gemm g;
  std::vector<bf16> a(64 * 3 * 64, bf16(0.5f)), b(a.size(), bf16(0.25f));
  std::vector<float> c(64 * 64);
  const std::string dense = g.implementation(view(a.data(), 64, 64), view(b.data(), 64, 64), output(c.data(), 64, 64));
  EXPECT_EQ(g.implementation(view(a.data(), 0, 64), view(b.data(), 64, 64), output(c.data(), 0, 64)), "");
  const std::string widened_prefix = "widened f32: ";
  if (!info.bf16_native) {
    EXPECT_EQ(dense.rfind(widened_prefix, 0), 0u) << dense;
    GTEST_SKIP() << "no bf16 matmul in oneDNN on this CPU (" << info.cpu_isa << "): every bf16 GEMM is widened";
  }
  EXPECT_EQ(dense, info.bf16_impl);
  // The training engine's Linear layouts (Y = X W^T, dX = dY W, dW += dY^T X), dense.
  const std::string lin[] = {
      g.implementation(view(a.data(), 128, 64), view(b.data(), 96, 64), output(c.data(), 128, 96), {.trans_b = Trans::yes}),
      g.implementation(view(a.data(), 128, 96), view(b.data(), 96, 64), output(c.data(), 128, 64), {.beta = 1.0f}),
      g.implementation(view(a.data(), 128, 96), view(b.data(), 128, 64), output(c.data(), 96, 64),
                       {.trans_a = Trans::yes, .beta = 1.0f})};
  for (const std::string& impl : lin) {
    EXPECT_TRUE(impl == info.bf16_impl || impl.rfind(widened_prefix, 0) == 0) << impl;
  }
  // Attention's per-head view: 64 x 16 blocks with leading dimension 3 * 64.
  const std::string strided = g.implementation(view(a.data(), 64, 16, 192), view(b.data(), 64, 16, 192),
                                               output(c.data(), 64, 64), {.trans_b = Trans::yes});
  EXPECT_TRUE(strided == info.bf16_impl || strided.rfind(widened_prefix, 0) == 0) << strided;
  std::cout << "[   INFO   ] dense bf16: " << dense << "; linear layouts: " << lin[0] << " / " << lin[1] << " / "
            << lin[2] << "; strided per-head: " << strided << "\n";
  std::mt19937 rng(11);
  check_case(g, {64, 64, 16, DType::bf16, DType::bf16, Trans::no, Trans::yes, 0.25f, 0.0f, 176}, false, rng);
  check_case(g, {64, 16, 64, DType::bf16, DType::bf16, Trans::no, Trans::no, 1.0f, 1.0f, 176}, false, rng);
}

TEST(Gemm, ExplicitThreadCountsGiveResultsWithinBound) {
  for (unsigned threads : {1u, 2u}) {
    Gemm g({.threads = threads});
    EXPECT_EQ(g.options().threads, threads);
    std::mt19937 rng(6);
    check_case(g, {96, 80, 128, DType::f32, DType::f32, Trans::no, Trans::yes}, false, rng);
    check_case(g, {96, 80, 128, DType::f16, DType::f16, Trans::yes, Trans::no}, true, rng);
  }
}

// ---- rounded low-precision output ------------------------------------------------------
TEST(Gemm, LowOutputIsTheRoundedFp32Result) {
  Gemm g;
  std::mt19937 rng(7);
  for (DType in : kTypes) {
    for (DType out : {DType::f16, DType::bf16}) {
      const std::size_t m = 23, n = 17, k = 45, ldl = n + 3;
      const Stored a = random_matrix(in, m, k, 0, rng), b = random_matrix(in, k, n, 0, rng);
      std::vector<float> c(m * n), c_ref(m * n);
      std::vector<f16> h(m * ldl, f16::from_bits(0x7e00)), h_ref = h;
      std::vector<bf16> bh(m * ldl, bf16::from_bits(0x7fc0)), bh_ref = bh;
      const GemmArgs args{Trans::no, Trans::no, 4096.0f, 0.0f};  // some values overflow f16
      const LowOutputView low = out == DType::f16 ? low_output(h.data(), m, n, ldl) : low_output(bh.data(), m, n, ldl);
      const LowOutputView low_ref =
          out == DType::f16 ? low_output(h_ref.data(), m, n, ldl) : low_output(bh_ref.data(), m, n, ldl);
      const ConversionStats st = g.run(a.view(), b.view(), output(c.data(), m, n), low, args);
      const ConversionStats st_ref = gemm_reference(a.view(), b.view(), output(c_ref.data(), m, n), low_ref, args);
      EXPECT_EQ(st.elements, m * n);
      EXPECT_EQ(st_ref.elements, m * n);
      for (std::size_t i = 0; i < m; ++i) {
        for (std::size_t j = 0; j < n; ++j) {
          const float v = c[i * n + j];
          if (out == DType::f16) {
            ASSERT_EQ(h[i * ldl + j].bits(), f16(v).bits()) << i << "," << j;
          } else {
            ASSERT_EQ(bh[i * ldl + j].bits(), bf16(v).bits()) << i << "," << j;
          }
        }
        for (std::size_t j = n; j < ldl; ++j) {  // padding untouched
          ASSERT_EQ(h[i * ldl + j].bits(), 0x7e00);
          ASSERT_EQ(bh[i * ldl + j].bits(), 0x7fc0);
        }
      }
    }
  }
}

TEST(Gemm, LowOutputCountsWhatRoundingLost) {
  Gemm g;
  // 1 x 3 = [1e-9, 1, 1e6] * 1: underflow, exact, overflow in f16.
  const float a[3] = {1e-9f, 1.0f, 1e6f};
  const float b[1] = {1.0f};
  float c[3];
  f16 h[3];
  const ConversionStats st = g.run(view(a, 3, 1), view(b, 1, 1), output(c, 3, 1), low_output(h, 3, 1));
  EXPECT_EQ(st.elements, 3u);
  EXPECT_EQ(st.underflow, 1u);
  EXPECT_EQ(st.overflow, 1u);
  EXPECT_EQ(h[1].bits(), 0x3c00);
  EXPECT_EQ(h[2].bits(), 0x7c00);
}

// ---- degenerate shapes ----------------------------------------------------------------
TEST(Gemm, KZeroScalesC) {
  Gemm g;
  float c[6] = {1, 2, 3, 4, 5, 6}, c_ref[6] = {1, 2, 3, 4, 5, 6};
  const float dummy = 0.0f;
  g.run(view(&dummy, 2, 0), view(&dummy, 0, 3), output(c, 2, 3), {.beta = -2.0f});
  gemm_reference(view(&dummy, 2, 0), view(&dummy, 0, 3), output(c_ref, 2, 3), {.beta = -2.0f});
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(c[i], -2.0f * static_cast<float>(i + 1));
    EXPECT_EQ(c_ref[i], c[i]);
  }
  float nan_c[2] = {std::numeric_limits<float>::quiet_NaN(), 1.0f};
  g.run(view(static_cast<const float*>(nullptr), 1, 0), view(static_cast<const float*>(nullptr), 0, 2),
        output(nan_c, 1, 2));
  EXPECT_EQ(nan_c[0], 0.0f);
  EXPECT_EQ(nan_c[1], 0.0f);
  // M = 0 or N = 0: nothing to do, null pointers allowed.
  g.run(view(static_cast<const float*>(nullptr), 0, 4), view(&dummy, 4, 1, 1), output(nullptr, 0, 1));
  EXPECT_EQ(g.cached_primitives(), 0u);
}

// ---- argument checks -------------------------------------------------------------------
TEST(Gemm, RejectsMismatchedArguments) {
  Gemm g;
  std::vector<float> a(12, 1.0f), b(12, 1.0f), c(16, 7.0f);
  std::vector<float> before = c;
  auto expect_rejected = [&](auto&& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_EQ(c, before) << "written before the error: " << what;
  };
  expect_rejected([&] { g.run(view(a.data(), 3, 4), view(b.data(), 3, 4), output(c.data(), 3, 4)); },
                  "inner dimensions differ: op(A) is 3x4, op(B) is 3x4");
  expect_rejected([&] { g.run(view(a.data(), 3, 4), view(b.data(), 4, 3), output(c.data(), 4, 3)); },
                  "C is 4x3, expected 3x3");
  expect_rejected([&] { g.run(view(a.data(), 3, 4, 2), view(b.data(), 4, 3), output(c.data(), 3, 3)); },
                  "A: leading dimension 2 < columns 4");
  expect_rejected([&] { g.run(view(a.data(), 3, 4), view(static_cast<const float*>(nullptr), 4, 3), output(c.data(), 3, 3)); },
                  "B: null data for a 4x3 matrix");
  expect_rejected([&] {
                    LowOutputView low{c.data(), DType::f32, 3, 3, 0};
                    g.run(view(a.data(), 3, 4), view(b.data(), 4, 3), output(c.data(), 3, 3), low);
                  },
                  "must be f16 or bf16");
  f16 h[9];
  expect_rejected([&] { g.run(view(a.data(), 3, 4), view(b.data(), 4, 3), output(c.data(), 3, 3), low_output(h, 3, 2)); },
                  "rounded output is 3x2, expected 3x3");
  expect_rejected([&] { gemm_reference(view(a.data(), 4, 3), view(b.data(), 3, 4), output(c.data(), 4, 3), {.trans_b = Trans::yes}); },
                  "inner dimensions differ: op(A) is 4x3, op(B) is 4x3");
}

// ---- the cache: one primitive per signature, scratch sized once -------------------------
TEST(Gemm, CachesOnePrimitivePerSignature) {
  Gemm g({.native_bf16 = false});
  std::vector<f16> a(64 * 32, f16(1.0f)), b(32 * 16, f16(0.5f));
  std::vector<float> c(64 * 16);
  g.prepare(view(a.data(), 64, 32), view(b.data(), 32, 16), output(c.data(), 64, 16));
  EXPECT_EQ(g.cached_primitives(), 1u);
  const std::size_t scratch = g.scratch_bytes();
  EXPECT_GE(scratch, (64 * 32 + 32 * 16) * sizeof(float));
  for (int i = 0; i < 3; ++i) g.run(view(a.data(), 64, 32), view(b.data(), 32, 16), output(c.data(), 64, 16));
  EXPECT_EQ(g.cached_primitives(), 1u);
  EXPECT_EQ(g.scratch_bytes(), scratch);
  EXPECT_EQ(c[0], 16.0f);
  g.run(view(a.data(), 64, 32), view(b.data(), 32, 16), output(c.data(), 64, 16), {.beta = 1.0f});
  EXPECT_EQ(g.cached_primitives(), 2u);
  EXPECT_EQ(c[5], 32.0f);
  // A smaller shape reuses the scratch.
  g.run(view(a.data(), 8, 32), view(b.data(), 32, 16), output(c.data(), 8, 16));
  EXPECT_EQ(g.cached_primitives(), 3u);
  EXPECT_EQ(g.scratch_bytes(), scratch);
}

TEST(Gemm, BackendInfoIsConsistent) {
  const GemmBackendInfo& info = gemm_backend_info();
  EXPECT_FALSE(info.onednn_version.empty());
  EXPECT_FALSE(info.f32_impl.empty());
  EXPECT_EQ(info.bf16_native, !info.bf16_impl.empty());
  RecordProperty("onednn", info.onednn_version + " " + info.cpu_isa + " bf16_native=" + (info.bf16_native ? "yes" : "no"));
}

}  // namespace
}  // namespace mixprec::nn
