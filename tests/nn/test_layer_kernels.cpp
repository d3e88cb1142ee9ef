// The layer kernels' fast back ends (src/nn/layer_kernels.hpp) against the scalar
// reference, the plain definitions the layers always ran.
//
// Bounds (u = 2^-24, one fp32 ulp of 1; every error measured in double):
//   - add, add_to_both, crossentropy_backward_row: bit for bit (the same IEEE
//     operations in the same order; the back end is compiled with -ffp-contract=off).
//   - GELU forward: |fast - ref| <= 8 u (|ref| + |x|/2). The tanh form
//     0.5 x (1 + tanh) cancels for x << 0, so the error is relative to |x|/2, not to
//     the (tiny) result; the measured worst case is printed (about 1-2 u).
//   - GELU backward: |fast - ref| <= 16 u (1 + |x|/2 sqrt(2/pi) (1 + 3 0.044715 x^2)) |dout|
//     (+ 1 u |result| when accumulating): the second term of gelu' carries the
//     cancelled 1 - tanh^2.
//   - softmax_row: max bit for bit; every probability and the sum within
//     (16 + valid) u relative + 1e-44 absolute (exp within ~1 ulp of std::exp; both
//     sum in the same order, but summands that differ by an ulp may round each partial
//     sum differently, up to (valid - 1) u; subnormal probabilities may differ in their
//     last bits).
//   - layernorm rows: out within 64 u (|w| |norm| + |b|) + 64 u |w| (|mean|/sd) per
//     element (the mean and variance sums are reordered), mean and rstd within 64 u
//     relative; backward dx, dweight, dbias within 64 u of the sum of the magnitudes
//     of their terms.
//   NaN where the reference gives NaN (and only there), equal infinities; extreme
//   inputs (|x| up to FLT_MAX, inf, NaN, -inf logits) and every length 1..70 plus
//   long ones (tails of every size).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "nn/layer_kernels.hpp"

namespace mixprec::nn::detail {
namespace {

using Vec = std::vector<float>;
constexpr double kU = 1.0 / 16777216.0;  // 2^-24
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kGeluScale = 0.7978845608028654f;

std::vector<std::size_t> lengths() {
  std::vector<std::size_t> n;
  for (std::size_t i = 1; i <= 70; ++i) n.push_back(i);
  for (std::size_t i : {127u, 255u, 256u, 257u, 768u, 1000u, 4099u}) n.push_back(i);
  return n;
}

Vec random_vec(std::size_t n, std::uint32_t seed, float scale, float offset = 0.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  Vec v(n);
  for (float& x : v) x = offset + scale * d(gen);
  return v;
}

// The fast back ends this CPU has (AVX2; AVX-512 where the CPU has it).
std::vector<const LayerKernels*> fast_tables() {
  std::vector<const LayerKernels*> t;
  if (const LayerKernels* k = layer_kernels(Isa::avx2)) t.push_back(k);
  if (const LayerKernels* k = layer_kernels(Isa::avx512)) t.push_back(k);
  return t;
}

const LayerKernels& ref() { return scalar_layer_kernels(); }

double D(float f) { return static_cast<double>(f); }
double A(float f) { return std::fabs(static_cast<double>(f)); }

// Checks the NaN/inf agreement; returns false when the value check is to be skipped.
bool special_agree(float fast, float want, const std::string& what) {
  if (std::isnan(want) || std::isnan(fast)) {
    EXPECT_TRUE(std::isnan(want) && std::isnan(fast)) << what << ": fast " << fast << ", reference " << want;
    return false;
  }
  if (std::isinf(want) || std::isinf(fast)) {
    EXPECT_EQ(fast, want) << what;
    return false;
  }
  return true;
}

// Worst error / bound seen by a test (printed: how much room the bound leaves).
struct Worst {
  double ratio = 0;
  void see(double err, double bound) { ratio = std::max(ratio, bound > 0 ? err / bound : (err > 0 ? 1e9 : 0)); }
};

void within(float fast, float want, double bound, const std::string& what, Worst& w) {
  if (!special_agree(fast, want, what)) return;
  const double err = std::fabs(static_cast<double>(fast) - static_cast<double>(want));
  w.see(err, bound);
  EXPECT_LE(err, bound) << what << ": fast " << fast << ", reference " << want;
}

void bitwise(const Vec& fast, const Vec& want, const std::string& what) {
  ASSERT_EQ(fast.size(), want.size());
  for (std::size_t i = 0; i < fast.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(fast[i]), std::bit_cast<std::uint32_t>(want[i]))
        << what << " [" << i << "]: " << fast[i] << " vs " << want[i] << std::hex << " (0x"
        << std::bit_cast<std::uint32_t>(fast[i]) << " vs 0x" << std::bit_cast<std::uint32_t>(want[i]) << ")";
  }
}

// GELU inputs: a dense sweep, random values at two scales, and the extremes.
Vec gelu_inputs() {
  Vec x;
  for (int i = -24000; i <= 24000; ++i) x.push_back(static_cast<float>(i) * 5e-4f);  // [-12, 12]
  for (float v : random_vec(4000, 1, 3.0f)) x.push_back(v);
  for (float v : random_vec(4000, 2, 30.0f)) x.push_back(v);
  const float ext[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-45f, 3.0f, -3.0f, 9.0f, -9.0f, 10.0f, -10.0f, 15.0f, -15.0f,
                       20.0f, -20.0f, 50.0f, -50.0f, 1e4f, -1e4f, 4.4e12f, -4.4e12f, 1e13f, -1e13f, 1e19f, -1e19f,
                       2e19f, -2e19f, 1e30f, -1e30f, std::numeric_limits<float>::max(),
                       -std::numeric_limits<float>::max(), kInf, -kInf, kNaN};
  for (float v : ext) x.push_back(v);
  return x;
}

double gelu_fwd_bound(float x, float want) {
  return 8 * kU * (std::fabs(static_cast<double>(want)) + 0.5 * std::fabs(static_cast<double>(x)));
}

double gelu_local_scale(float x) {
  const double xd = std::fabs(static_cast<double>(x));
  return 1.0 + 0.5 * xd * D(kGeluScale) * (1.0 + 3.0 * 0.044715 * xd * xd);
}

TEST(LayerKernels, TablesAndDispatch) {
  EXPECT_EQ(scalar_layer_kernels().isa, Isa::scalar);
  EXPECT_EQ(layer_kernels(Isa::scalar), &scalar_layer_kernels());
  EXPECT_EQ(layer_kernels(active_isa()), &active_layer_kernels());
  if (isa_available(Isa::avx2)) {
    ASSERT_NE(layer_kernels(Isa::avx2), nullptr);
    EXPECT_EQ(layer_kernels(Isa::avx2)->isa, Isa::avx2);
  } else {
    EXPECT_EQ(layer_kernels(Isa::avx2), nullptr);
  }
  if (isa_available(Isa::avx512)) {
    ASSERT_NE(layer_kernels(Isa::avx512), nullptr);
    EXPECT_EQ(layer_kernels(Isa::avx512)->isa, Isa::avx512);
    // Its layer norm, adds and cross-entropy backward are AVX2's; GELU and softmax its own.
    EXPECT_EQ(layer_kernels(Isa::avx512)->layernorm_forward_row, layer_kernels(Isa::avx2)->layernorm_forward_row);
    EXPECT_NE(layer_kernels(Isa::avx512)->softmax_row, layer_kernels(Isa::avx2)->softmax_row);
  } else {
    EXPECT_EQ(layer_kernels(Isa::avx512), nullptr);
    std::cout << "[ NOTE ] no AVX-512 (F, BW, DQ, VL) on this CPU: its layer kernels are not tested here\n";
  }
}

// The documented softmax sum (layer_kernels.hpp) of std::exp(x - max) over a whole row,
// written out: sixteen lanes by index, then (l0 + l8) + (l4 + l12) .. as the fold.
double documented_lane_total(const Vec& in, std::size_t n) {
  float mx = in[0];
  for (std::size_t i = 1; i < n; ++i) mx = in[i] > mx ? in[i] : mx;
  double lanes[kSoftmaxSumLanes] = {};
  for (std::size_t i = 0; i < n; ++i) lanes[i % kSoftmaxSumLanes] += static_cast<double>(std::exp(in[i] - mx));
  double total = 0.0;
  for (std::size_t j = 0; j < 2; ++j) {
    double q[4];
    for (std::size_t k = 0; k < 4; ++k) q[k] = lanes[j + 2 * k] + lanes[j + 2 * k + 8];
    total += (q[0] + q[2]) + (q[1] + q[3]);
  }
  return total;
}

double running_double_sum(const Vec& in, std::size_t n) {
  float mx = in[0];
  for (std::size_t i = 1; i < n; ++i) mx = in[i] > mx ? in[i] : mx;
  double s = 0.0;
  for (std::size_t i = 0; i < n; ++i) s += static_cast<double>(std::exp(in[i] - mx));
  return s;
}

// The AVX-512 GELU and softmax row do AVX2's operations lane for lane (the softmax sum
// in the same sixteen double lanes): equal bit for bit (on top of the bounds against the
// reference, which every test above checks for both).
TEST(LayerKernels, Avx512EqualsAvx2Bitwise) {
  if (!isa_available(Isa::avx512)) GTEST_SKIP() << "no AVX-512 (F, BW, DQ, VL) on this CPU: its back end is not tested here";
  const LayerKernels& a = *layer_kernels(Isa::avx2);
  const LayerKernels& b = *layer_kernels(Isa::avx512);
  const Vec x = gelu_inputs();
  const Vec d = random_vec(x.size(), 8, 1.0f);
  for (std::size_t n : {x.size(), std::size_t{1}, std::size_t{15}, std::size_t{17}, std::size_t{31}}) {
    Vec fa(n), fb(n);
    a.gelu_forward(fa.data(), x.data(), n);
    b.gelu_forward(fb.data(), x.data(), n);
    bitwise(fb, fa, "gelu_forward n=" + std::to_string(n));
    for (bool acc : {false, true}) {
      Vec ga(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(n)), gb = ga;
      a.gelu_backward(ga.data(), x.data(), d.data(), n, acc);
      b.gelu_backward(gb.data(), x.data(), d.data(), n, acc);
      bitwise(gb, ga, "gelu_backward n=" + std::to_string(n));
    }
  }
  // Logits over 60 nats: the exps span 2^-86 to 1, so the double lane sums round and
  // lane_total shows the order in which each back end added them.
  int order_shows = 0;
  for (std::size_t n : lengths()) {
    Vec in(n);
    std::mt19937 gen(90 + static_cast<std::uint32_t>(n));
    std::uniform_real_distribution<float> logit(-60.0f, 0.0f);
    for (float& v : in) v = logit(gen);
    order_shows += documented_lane_total(in, n) != running_double_sum(in, n);
    if (n > 4) {
      in[n / 3] = -kInf;
      in[n - 2] = -95.0f;  // a subnormal probability
    }
    for (std::size_t valid : {std::size_t{1}, (n + 1) / 2, n}) {
      Vec pa(n), pb(n);
      const SoftmaxStats sa = a.softmax_row(pa.data(), in.data(), n, valid);
      const SoftmaxStats sb = b.softmax_row(pb.data(), in.data(), n, valid);
      const std::string what = "softmax_row n=" + std::to_string(n) + " valid=" + std::to_string(valid);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(sb.max), std::bit_cast<std::uint32_t>(sa.max)) << what << " max";
      EXPECT_EQ(std::bit_cast<std::uint32_t>(sb.sum), std::bit_cast<std::uint32_t>(sa.sum)) << what << " sum";
      EXPECT_EQ(std::bit_cast<std::uint64_t>(sb.lane_total), std::bit_cast<std::uint64_t>(sa.lane_total))
          << what << " lane_total " << sa.lane_total << " vs " << sb.lane_total;
      bitwise(pb, pa, what);
    }
  }
  EXPECT_GT(order_shows, 10) << "too few rows whose double sum depends on the order of the terms";
}

// The reference's softmax sum is the documented one (layer_kernels.hpp): exp(x - max)
// into sixteen double lanes by index, the lanes folded in halves, rounded once to float.
// Logits over 60 nats, so that the double sums round and the order shows (checked: it
// differs from a running double sum on some rows, and the float from a float running sum).
TEST(LayerKernels, SoftmaxSumIsTheDocumentedLaneSum) {
  int order_shows = 0, float_differs = 0;
  for (std::size_t n : {std::size_t{9}, std::size_t{100}, std::size_t{1024}, std::size_t{4099}}) {
    for (std::uint32_t seed = 0; seed < 8; ++seed) {
      Vec in(n);
      std::mt19937 gen(200 + seed + static_cast<std::uint32_t>(n));
      std::uniform_real_distribution<float> logit(-60.0f, 0.0f);
      for (float& v : in) v = logit(gen);
      Vec p(n);
      const SoftmaxStats st = ref().softmax_row(p.data(), in.data(), n, n);
      const double want = documented_lane_total(in, n);
      EXPECT_EQ(std::bit_cast<std::uint64_t>(st.lane_total), std::bit_cast<std::uint64_t>(want))
          << "n=" << n << " seed " << seed << std::hex << ": lane_total 0x" << std::bit_cast<std::uint64_t>(st.lane_total)
          << ", documented 0x" << std::bit_cast<std::uint64_t>(want);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(st.sum), std::bit_cast<std::uint32_t>(static_cast<float>(want)));
      order_shows += want != running_double_sum(in, n);
      float running = 0.0f;
      for (std::size_t i = 0; i < n; ++i) running += std::exp(in[i] - st.max);
      float_differs += running != st.sum;
    }
  }
  EXPECT_GT(order_shows, 0) << "no row tells the lane order from a running double sum";
  EXPECT_GT(float_differs, 0) << "no row tells the lane sum from a float running sum";
}

TEST(LayerKernels, GeluForwardWithinBoundOfReference) {
  const auto tables = fast_tables();
  if (tables.empty()) GTEST_SKIP() << "no AVX2 back end on this CPU: only the reference runs here";
  const Vec x = gelu_inputs();
  Vec want(x.size());
  ref().gelu_forward(want.data(), x.data(), x.size());
  for (const LayerKernels* k : tables) {
    Worst w;
    Vec got(x.size(), -7.0f);
    k->gelu_forward(got.data(), x.data(), x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      within(got[i], want[i], gelu_fwd_bound(x[i], want[i]), "gelu(" + std::to_string(x[i]) + ")", w);
    }
    // Every length (tails of every size) and in place; nothing beyond n is written.
    for (std::size_t n : lengths()) {
      Vec in = random_vec(n, static_cast<std::uint32_t>(n), 4.0f);
      Vec r(n), g(n + 9, -7.0f);
      ref().gelu_forward(r.data(), in.data(), n);
      k->gelu_forward(g.data(), in.data(), n);
      for (std::size_t i = 0; i < n; ++i) within(g[i], r[i], gelu_fwd_bound(in[i], r[i]), "n=" + std::to_string(n), w);
      for (std::size_t i = n; i < n + 9; ++i) ASSERT_EQ(g[i], -7.0f) << "wrote past n = " << n;
      Vec inplace = in;
      k->gelu_forward(inplace.data(), inplace.data(), n);
      bitwise(inplace, Vec(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(n)), "in place");
    }
    std::cout << "[ NOTE ] " << isa_name(k->isa) << " gelu_forward: worst error " << w.ratio
              << " of the bound 8u(|gelu|+|x|/2)\n";
  }
}

TEST(LayerKernels, GeluBackwardWithinBoundOfReference) {
  const auto tables = fast_tables();
  if (tables.empty()) GTEST_SKIP() << "no AVX2 back end on this CPU: only the reference runs here";
  const Vec x = gelu_inputs();
  const Vec dout = random_vec(x.size(), 3, 1.0f);
  const Vec prefill = random_vec(x.size(), 4, 1.0f);
  for (const LayerKernels* k : tables) {
    Worst w;
    for (bool acc : {false, true}) {
      Vec want = prefill, got = prefill;
      ref().gelu_backward(want.data(), x.data(), dout.data(), x.size(), acc);
      k->gelu_backward(got.data(), x.data(), dout.data(), x.size(), acc);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double b = 16 * kU * gelu_local_scale(x[i]) * std::fabs(static_cast<double>(dout[i])) +
                         (acc ? kU * std::fabs(static_cast<double>(want[i])) : 0.0);
        within(got[i], want[i], b, std::string(acc ? "+= " : "= ") + "gelu'(" + std::to_string(x[i]) + ")", w);
      }
    }
    for (std::size_t n : lengths()) {
      const Vec in = random_vec(n, static_cast<std::uint32_t>(n) + 100, 4.0f);
      const Vec d = random_vec(n, static_cast<std::uint32_t>(n) + 200, 1.0f);
      Vec r(n, 0.5f), g(n + 9, 0.5f);
      ref().gelu_backward(r.data(), in.data(), d.data(), n, true);
      k->gelu_backward(g.data(), in.data(), d.data(), n, true);
      for (std::size_t i = 0; i < n; ++i) {
        const double b = 16 * kU * gelu_local_scale(in[i]) * std::fabs(static_cast<double>(d[i])) +
                         kU * std::fabs(static_cast<double>(r[i]));
        within(g[i], r[i], b, "n=" + std::to_string(n), w);
      }
      for (std::size_t i = n; i < n + 9; ++i) ASSERT_EQ(g[i], 0.5f) << "wrote past n = " << n;
      // dinp may alias dout.
      Vec alias = d;
      k->gelu_backward(alias.data(), in.data(), alias.data(), n, true);
      Vec sep = d;
      k->gelu_backward(sep.data(), in.data(), d.data(), n, true);
      bitwise(alias, sep, "dinp aliasing dout");
    }
    std::cout << "[ NOTE ] " << isa_name(k->isa) << " gelu_backward: worst error " << w.ratio << " of the bound\n";
  }
}

// An element's result does not depend on its position (masked tails, no scalar loop):
// what keeps results independent of the OpenMP split.
TEST(LayerKernels, ElementwiseResultsDoNotDependOnPosition) {
  const Vec x = gelu_inputs();
  const Vec d = random_vec(x.size(), 5, 1.0f);
  for (const LayerKernels* k : {&ref(), layer_kernels(Isa::avx2)}) {
    if (k == nullptr) continue;
    Vec whole(x.size()), one(x.size());
    k->gelu_forward(whole.data(), x.data(), x.size());
    for (std::size_t i = 0; i < x.size(); i += 37) k->gelu_forward(&one[i], &x[i], std::min<std::size_t>(37, x.size() - i));
    bitwise(whole, one, std::string(isa_name(k->isa)) + " gelu_forward split");
    Vec bw(x.size()), bo(x.size());
    k->gelu_backward(bw.data(), x.data(), d.data(), x.size(), false);
    for (std::size_t i = 0; i < x.size(); i += 13) {
      k->gelu_backward(&bo[i], &x[i], &d[i], std::min<std::size_t>(13, x.size() - i), false);
    }
    bitwise(bw, bo, std::string(isa_name(k->isa)) + " gelu_backward split");
  }
}

// layernorm_backward splits dweight/dbias over the threads by column blocks: each column
// must get the same bits whichever columns a call covers (over many rows, so the row
// order of the sums is exercised too).
TEST(LayerKernels, LayerNormParamGradsDoNotDependOnTheColumnSplit) {
  const std::size_t rows = 37, C = 203;
  const Vec dy = random_vec(rows * C, 71, 1.0f), x = random_vec(rows * C, 72, 2.0f, 0.5f);
  const Vec mean = random_vec(rows, 73, 0.5f), rstd = random_vec(rows, 74, 0.5f, 1.0f);
  for (const LayerKernels* k : {&ref(), layer_kernels(Isa::avx2), layer_kernels(Isa::avx512)}) {
    if (k == nullptr) continue;
    Vec dw = random_vec(C, 75, 1.0f), db = random_vec(C, 76, 1.0f);
    Vec dw_split = dw, db_split = db;
    k->layernorm_backward_params(dw.data(), db.data(), dy.data(), x.data(), mean.data(), rstd.data(), rows, C, C);
    for (std::size_t c0 = 0; c0 < C;) {  // pieces of 13, 64, 3, 64, ... columns
      const std::size_t n = std::min<std::size_t>(c0 % 2 == 0 ? 13 : 64, C - c0);
      k->layernorm_backward_params(dw_split.data() + c0, db_split.data() + c0, dy.data() + c0, x.data() + c0,
                                   mean.data(), rstd.data(), rows, C, n);
      c0 += n;
    }
    bitwise(dw, dw_split, std::string(isa_name(k->isa)) + " layernorm dweight split");
    bitwise(db, db_split, std::string(isa_name(k->isa)) + " layernorm dbias split");
    // The rows in order: the same as one row at a time.
    Vec dw_rows = random_vec(C, 75, 1.0f), db_rows = random_vec(C, 76, 1.0f);
    for (std::size_t r = 0; r < rows; ++r) {
      k->layernorm_backward_params(dw_rows.data(), db_rows.data(), dy.data() + r * C, x.data() + r * C, &mean[r],
                                   &rstd[r], 1, C, C);
    }
    bitwise(dw, dw_rows, std::string(isa_name(k->isa)) + " layernorm dweight row by row");
    bitwise(db, db_rows, std::string(isa_name(k->isa)) + " layernorm dbias row by row");
  }
}

TEST(LayerKernels, AddAndCrossEntropyBackwardEqualReferenceBitwise) {
  const auto tables = fast_tables();
  if (tables.empty()) GTEST_SKIP() << "no AVX2 back end on this CPU: only the reference runs here";
  for (const LayerKernels* k : tables) {
    for (std::size_t n : lengths()) {
      Vec a = random_vec(n, 10 + static_cast<std::uint32_t>(n), 1.0f);
      Vec b = random_vec(n, 20 + static_cast<std::uint32_t>(n), 100.0f);
      if (n > 3) {
        a[1] = kInf;
        b[2] = kNaN;
        a[3] = -0.0f;
        b[3] = -0.0f;
      }
      Vec r(n), g(n + 9, -7.0f);
      ref().add(r.data(), a.data(), b.data(), n);
      k->add(g.data(), a.data(), b.data(), n);
      for (std::size_t i = n; i < n + 9; ++i) ASSERT_EQ(g[i], -7.0f);
      g.resize(n);
      bitwise(g, r, "add n=" + std::to_string(n));
      Vec ra = a, rb = b, ga = a, gb = b;
      const Vec d = random_vec(n, 30 + static_cast<std::uint32_t>(n), 0.01f);
      ref().add_to_both(ra.data(), rb.data(), d.data(), n);
      k->add_to_both(ga.data(), gb.data(), d.data(), n);
      bitwise(ga, ra, "add_to_both a");
      bitwise(gb, rb, "add_to_both b");
      for (bool acc : {false, true}) {
        for (std::size_t target : {std::size_t{0}, n / 2, n - 1}) {
          Vec pr = ra, pg = ra;
          ref().crossentropy_backward_row(pr.data(), a.data(), n, target, 0.125f, acc);
          k->crossentropy_backward_row(pg.data(), a.data(), n, target, 0.125f, acc);
          bitwise(pg, pr, "crossentropy_backward_row n=" + std::to_string(n) + " target " + std::to_string(target));
        }
      }
    }
  }
}

void check_softmax(const LayerKernels& k, const Vec& in, std::size_t valid, const std::string& what, Worst& w) {
  const std::size_t n = in.size();
  Vec r(n, -7.0f), g(n + 9, -7.0f);
  const SoftmaxStats sr = ref().softmax_row(r.data(), in.data(), n, valid);
  const SoftmaxStats sg = k.softmax_row(g.data(), in.data(), n, valid);
  if (std::isnan(sr.max)) EXPECT_TRUE(std::isnan(sg.max)) << what;
  else EXPECT_EQ(sg.max, sr.max) << what;
  // exp's ulp in every summand may round each partial sum differently (up to
  // (valid - 1) u of the sum), plus a few u for exp and the division.
  const double rel = (16.0 + static_cast<double>(valid)) * kU;
  within(sg.sum, sr.sum, rel * A(sr.sum), what + " sum", w);
  for (std::size_t i = 0; i < valid; ++i) {
    within(g[i], r[i], rel * A(r[i]) + 1e-44, what + " p[" + std::to_string(i) + "]", w);
  }
  for (std::size_t i = valid; i < n; ++i) ASSERT_EQ(std::bit_cast<std::uint32_t>(g[i]), 0u) << what << " masked " << i;
  for (std::size_t i = n; i < n + 9; ++i) ASSERT_EQ(g[i], -7.0f) << what << ": wrote past n";
  // In place gives the same.
  Vec inplace = in;
  k.softmax_row(inplace.data(), inplace.data(), n, valid);
  g.resize(n);
  bitwise(inplace, g, what + " in place");
}

TEST(LayerKernels, SoftmaxRowWithinBoundOfReference) {
  const auto tables = fast_tables();
  if (tables.empty()) GTEST_SKIP() << "no AVX2 back end on this CPU: only the reference runs here";
  for (const LayerKernels* k : tables) {
    Worst w;
    for (std::size_t n : lengths()) {
      for (float scale : {1.0f, 8.0f, 40.0f}) {
        const Vec in = random_vec(n, 40 + static_cast<std::uint32_t>(n), scale, 3.0f);
        for (std::size_t valid : {std::size_t{1}, (n + 1) / 2, n}) {
          check_softmax(*k, in, valid, "n=" + std::to_string(n) + " valid=" + std::to_string(valid) + " scale=" +
                                           std::to_string(scale), w);
        }
      }
      // Extremes: -inf logits (masked by hand), a huge spread (exp underflows to
      // subnormals and zero), a NaN after the first, and a NaN first.
      Vec e = random_vec(n, 50 + static_cast<std::uint32_t>(n), 1.0f);
      for (std::size_t i = 1; i < n; i += 3) e[i] = -kInf;
      check_softmax(*k, e, n, "-inf logits n=" + std::to_string(n), w);
      Vec s = random_vec(n, 60 + static_cast<std::uint32_t>(n), 1.0f);
      for (std::size_t i = 0; i < n; i += 2) s[i] = -90.0f - static_cast<float>(i % 30);
      check_softmax(*k, s, n, "subnormal probabilities n=" + std::to_string(n), w);
      Vec big = random_vec(n, 70 + static_cast<std::uint32_t>(n), 1e30f);
      check_softmax(*k, big, n, "huge logits n=" + std::to_string(n), w);
      if (n > 2) {
        Vec nan = e;
        nan[n - 1] = kNaN;
        check_softmax(*k, nan, n, "NaN logit n=" + std::to_string(n), w);
        nan[0] = kNaN;
        check_softmax(*k, nan, n, "NaN first n=" + std::to_string(n), w);
        Vec all = Vec(n, -kInf);
        check_softmax(*k, all, n, "all -inf n=" + std::to_string(n), w);
        Vec pinf = e;
        pinf[n / 2] = kInf;
        check_softmax(*k, pinf, n, "+inf logit n=" + std::to_string(n), w);
      }
    }
    std::cout << "[ NOTE ] " << isa_name(k->isa) << " softmax_row: worst error " << w.ratio << " of the bound\n";
  }
}

TEST(LayerKernels, LayerNormRowsWithinBoundOfReference) {
  const auto tables = fast_tables();
  if (tables.empty()) GTEST_SKIP() << "no AVX2 back end on this CPU: only the reference runs here";
  for (const LayerKernels* k : tables) {
    Worst w;
    for (std::size_t C : lengths()) {
      for (float offset : {0.0f, 5.0f}) {
        const std::string what = "C=" + std::to_string(C) + " offset " + std::to_string(offset);
        const auto seed = static_cast<std::uint32_t>(C * 7 + (offset > 0 ? 1 : 0));
        const Vec x = random_vec(C, seed, 1.0f, offset);
        const Vec wt = random_vec(C, seed + 1, 0.5f, 1.0f);
        const Vec bs = random_vec(C, seed + 2, 0.5f);
        Vec r(C), g(C + 9, -7.0f);
        float mr = 0, sr = 0, mg = 0, sg = 0;
        ref().layernorm_forward_row(r.data(), &mr, &sr, x.data(), wt.data(), bs.data(), C, 1e-5f);
        k->layernorm_forward_row(g.data(), &mg, &sg, x.data(), wt.data(), bs.data(), C, 1e-5f);
        within(mg, mr, 64 * kU * (A(mr) + 1.0), what + " mean", w);
        within(sg, sr, 64 * kU * D(sr), what + " rstd", w);
        for (std::size_t i = 0; i < C; ++i) {
          const double nrm = std::fabs((D(x[i]) - D(mr)) * D(sr));
          const double b = 64 * kU * (A(wt[i]) * (nrm + (A(mr) + 1.0) * D(sr)) + A(bs[i]));
          within(g[i], r[i], b, what + " out[" + std::to_string(i) + "]", w);
        }
        for (std::size_t i = C; i < C + 9; ++i) ASSERT_EQ(g[i], -7.0f) << what << ": wrote past C";
        // Backward from the reference's saved statistics.
        const Vec dy = random_vec(C, seed + 3, 1.0f);
        for (bool acc : {false, true}) {
          Vec dxr = random_vec(C, seed + 4, 1.0f), dxg = dxr;
          Vec dwr = random_vec(C, seed + 5, 1.0f), dwg = dwr;
          Vec dbr = random_vec(C, seed + 6, 1.0f), dbg = dbr;
          const Vec dx0 = dxr;
          ref().layernorm_backward_dx_row(dxr.data(), dy.data(), x.data(), wt.data(), mr, sr, C, acc);
          ref().layernorm_backward_params(dwr.data(), dbr.data(), dy.data(), x.data(), &mr, &sr, 1, C, C);
          k->layernorm_backward_dx_row(dxg.data(), dy.data(), x.data(), wt.data(), mr, sr, C, acc);
          k->layernorm_backward_params(dwg.data(), dbg.data(), dy.data(), x.data(), &mr, &sr, 1, C, C);
          // Magnitudes of the terms: sum |dnorm| / C and sum |dnorm norm| / C.
          double s1 = 0, s2 = 0;
          for (std::size_t i = 0; i < C; ++i) {
            const double nrm = std::fabs((D(x[i]) - D(mr)) * D(sr));
            s1 += A(wt[i] * dy[i]);
            s2 += A(wt[i] * dy[i]) * nrm;
          }
          s1 /= static_cast<double>(C);
          s2 /= static_cast<double>(C);
          for (std::size_t i = 0; i < C; ++i) {
            const double nrm = std::fabs((D(x[i]) - D(mr)) * D(sr));
            const double bx = 64 * kU *
                              ((A(wt[i] * dy[i]) + s1 + nrm * s2) * D(sr) + (acc ? A(dx0[i]) : 0.0));
            within(dxg[i], dxr[i], bx, what + " dx[" + std::to_string(i) + "]", w);
            within(dwg[i], dwr[i], 64 * kU * (A(dwr[i]) + nrm * A(dy[i])), what + " dweight", w);
            within(dbg[i], dbr[i], 64 * kU * (A(dbr[i]) + A(dy[i])), what + " dbias", w);
          }
        }
      }
    }
    std::cout << "[ NOTE ] " << isa_name(k->isa) << " layernorm rows: worst error " << w.ratio << " of the bound\n";
  }
}

}  // namespace
}  // namespace mixprec::nn::detail
