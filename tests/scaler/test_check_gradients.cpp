// check_gradients (scaler/check_gradients.hpp) against a plain scalar reference: every fp16
// and bf16 code at the scales 2^-1 .. 2^-24 and at the edges (1, just below 1, 2^-126,
// 2^-127, 2^-128, 2^-149, 0, inf, 0.75, 3), one element at a time and as one large tensor
// (the vector loops), failures printed in hex.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/formats/types.hpp"
#include "mixprec/scaler/check_gradients.hpp"

namespace mixprec {
namespace {

std::vector<float> test_scales() {
  std::vector<float> s;
  for (int e = 1; e <= 24; ++e) s.push_back(std::ldexp(1.0f, -e));
  s.insert(s.end(), {1.0f, std::nextafter(1.0f, 0.0f), 0x1p-126f, 0x1p-127f, 0x1p-128f, 0x1p-149f, 0.0f,
                     std::numeric_limits<float>::infinity(), 0.75f, 3.0f});
  return s;
}

template <class T>
float decode(std::uint16_t code) {
  return static_cast<float>(std::bit_cast<T>(code));
}

template <class T>
std::uint16_t encode(float v) {
  return std::bit_cast<std::uint16_t>(T(v));
}

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, f16> ? DType::f16 : DType::bf16;
}

// The rule, one element: what check_gradients must find and write.
struct Expected {
  bool found_inf;
  bool written;          // the element is replaced by `value`
  std::uint16_t value;   // the unscaled code when written
  std::int64_t first;    // first_overflow: 0 when this element is at fault, else -1
};

template <class T>
Expected reference(std::uint16_t code, float scale) {
  const float inv = static_cast<float>(1.0 / static_cast<double>(scale));
  const float x = decode<T>(code);
  if (!(inv > 0.0f && inv <= std::numeric_limits<float>::max())) return {true, false, code, std::isfinite(x) ? -1 : 0};
  const float y = x * inv;
  if (!std::isfinite(x)) return {true, inv < 1.0f, encode<T>(y), 0};  // scale > 1: written, as torch does
  if (inv > 1.0f && !std::isfinite(static_cast<float>(T(y)))) return {true, false, code, 0};
  return {false, inv != 1.0f, encode<T>(y), -1};
}

std::string hex(std::uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%04x", v);
  return b;
}

template <class T>
void sweep() {
  int failures = 0;
  for (const float scale : test_scales()) {
    std::vector<std::uint16_t> clean;  // codes whose check is clean: one large tensor below
    for (std::uint32_t c = 0; c <= 0xffff; ++c) {
      const auto code = static_cast<std::uint16_t>(c);
      const Expected want = reference<T>(code, scale);
      std::uint16_t g = code;
      const GradTensor view{&g, 1, dtype_of<T>()};
      const GradientCheck got = check_gradients({&view, 1}, scale, true);
      const bool nan_in = std::isnan(decode<T>(code));
      const bool value_ok = want.written ? (nan_in ? std::isnan(decode<T>(g)) : g == want.value) : g == code;
      if (got.found_inf != want.found_inf || !value_ok || got.first_overflow != want.first) {
        if (++failures <= 20)
          ADD_FAILURE() << "code " << hex(code) << " scale " << scale << ": found_inf " << got.found_inf << " (want "
                        << want.found_inf << "), first_overflow " << got.first_overflow << ", stored " << hex(g)
                        << " (want " << hex(want.written ? want.value : code) << ")";
      }
      if (!got.found_inf) {
        const double y = static_cast<double>(decode<T>(code) * inv_scale_of(scale));
        if (got.sum_squares != y * y && ++failures <= 20)
          ADD_FAILURE() << "code " << hex(code) << " scale " << scale << ": sum_squares " << got.sum_squares
                        << " want " << y * y;
        clean.push_back(code);
      }
    }
    // The same clean codes as one tensor (the SIMD loops), then with one overflowing element
    // in a second tensor: nothing written in either.
    if (!can_unscale(inv_scale_of(scale))) {
      EXPECT_TRUE(clean.empty()) << "scale " << scale;
      continue;
    }
    std::vector<std::uint16_t> big = clean;
    GradTensor v{big.data(), big.size(), dtype_of<T>()};
    const GradientCheck all = check_gradients({&v, 1}, scale, true);
    EXPECT_FALSE(all.found_inf) << "scale " << scale;
    for (std::size_t i = 0; i < big.size(); ++i) {
      const Expected want = reference<T>(clean[i], scale);
      const std::uint16_t expect = want.written ? want.value : clean[i];
      if (big[i] != expect && ++failures <= 20)
        ADD_FAILURE() << "large tensor, code " << hex(clean[i]) << " scale " << scale << ": stored " << hex(big[i])
                      << " want " << hex(expect);
    }
    if (inv_scale_of(scale) > 1.0f && can_unscale(inv_scale_of(scale))) {
      big = clean;
      std::uint16_t bad = encode<T>(std::numeric_limits<float>::max() / 2);  // overflows when unscaled
      const GradTensor two[] = {{big.data(), big.size(), dtype_of<T>()}, {&bad, 1, dtype_of<T>()}};
      const std::uint16_t bad_before = bad;
      const GradientCheck g2 = check_gradients(two, scale, true);
      const bool overflows = !std::isfinite(static_cast<float>(T(decode<T>(bad_before) * inv_scale_of(scale))));
      EXPECT_EQ(g2.found_inf, overflows) << "scale " << scale;
      if (overflows) {
        EXPECT_EQ(g2.first_overflow, 1) << "scale " << scale;
        EXPECT_EQ(big, clean) << "scale " << scale << ": the clean tensor was written on an overflow step";
        EXPECT_EQ(bad, bad_before) << "scale " << scale;
        EXPECT_TRUE(std::isinf(g2.sum_squares));
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(CheckGradients, EveryF16CodeAtEveryScaleMatchesTheReference) { sweep<f16>(); }
TEST(CheckGradients, EveryBF16CodeAtEveryScaleMatchesTheReference) { sweep<bf16>(); }

TEST(CheckGradients, F32ProductOverflowAtAScaleBelowOneWritesNothing) {
  float g[3] = {1.0f, 3e38f, 2.0f};
  const GradTensor v{g, 3, DType::f32};
  const GradientCheck c = check_gradients({&v, 1}, 0.5f, true);
  EXPECT_TRUE(c.found_inf);
  EXPECT_EQ(c.first_overflow, 0);
  EXPECT_EQ(g[0], 1.0f);
  EXPECT_EQ(g[1], 3e38f);
}

TEST(CheckGradients, ReadOnlyCarriesTheInverseScale) {
  std::uint16_t g[2] = {encode<f16>(4.0f), encode<f16>(8.0f)};
  const GradTensor v{g, 2, DType::f16};
  const GradientCheck below = check_gradients({&v, 1}, 0.5f, false);
  EXPECT_FALSE(below.found_inf);
  EXPECT_EQ(below.carried_inv_scale, 2.0f);
  EXPECT_EQ(g[0], encode<f16>(4.0f));  // nothing written
  const GradientCheck above = check_gradients({&v, 1}, 4.0f, false);
  EXPECT_EQ(above.carried_inv_scale, 0.25f);
  EXPECT_EQ(above.sum_squares, 1.0 + 4.0);
  const GradientCheck written = check_gradients({&v, 1}, 4.0f, true);
  EXPECT_EQ(written.carried_inv_scale, 1.0f);
  EXPECT_EQ(g[1], encode<f16>(2.0f));
}

// amax_out: the |max| telemetry records, from the check's own pass, equal to a second pass
// over the tensors as the check left them (write) or as a write would leave them (read only).
TEST(CheckGradients, AmaxOutIsTheUnscaledMaxAsEachDtypeStoresIt) {
  std::vector<float> base(777);
  for (std::size_t i = 0; i < base.size(); ++i)
    base[i] = std::ldexp(static_cast<float>((i * 2654435761u) % 1000) / 999.0f - 0.5f, static_cast<int>(i % 30) - 12);
  int failures = 0;
  for (const float scale : test_scales()) {
    for (const bool write : {true, false}) {
      std::vector<float> f = base;
      std::vector<std::uint16_t> h(base.size()), b(base.size());
      for (std::size_t i = 0; i < base.size(); ++i) h[i] = encode<f16>(base[i]), b[i] = encode<bf16>(base[i]);
      const std::vector<std::uint16_t> h0 = h, b0 = b;
      const GradTensor views[] = {{f.data(), f.size(), DType::f32}, {h.data(), h.size(), DType::f16},
                                  {b.data(), b.size(), DType::bf16}};
      std::vector<float> amax(3, -1.0f);
      const GradientCheck c = check_gradients(views, scale, write, nullptr, amax);
      const float inv = inv_scale_of(scale);
      if (!can_unscale(inv)) {
        for (float a : amax) EXPECT_TRUE(std::isnan(a)) << "scale " << scale << ": nothing was unscaled";
        continue;
      }
      if (c.found_inf) continue;
      // The reference: every element unscaled and stored in its dtype, then the largest |value|.
      float want[3] = {0, 0, 0};
      for (std::size_t i = 0; i < base.size(); ++i) {
        want[0] = std::max(want[0], std::fabs(base[i] * inv));
        want[1] = std::max(want[1], std::fabs(static_cast<float>(f16(decode<f16>(h0[i]) * inv))));
        want[2] = std::max(want[2], std::fabs(static_cast<float>(bf16(decode<bf16>(b0[i]) * inv))));
      }
      for (int k = 0; k < 3; ++k)
        if (std::bit_cast<std::uint32_t>(amax[static_cast<std::size_t>(k)]) != std::bit_cast<std::uint32_t>(want[k]) &&
            ++failures <= 20)
          ADD_FAILURE() << "scale " << scale << " write " << write << " tensor " << k << ": amax "
                        << amax[static_cast<std::size_t>(k)] << " want " << want[k];
    }
  }
  EXPECT_EQ(failures, 0);
  float g = 1.0f;
  const GradTensor one{&g, 1, DType::f32};
  std::vector<float> wrong(2);
  EXPECT_THROW((void)check_gradients({&one, 1}, 1.0f, true, nullptr, wrong), std::invalid_argument);
  EXPECT_EQ(g, 1.0f);
}

TEST(CheckGradients, UnscalableScalesNameTheFirstNonFiniteTensor) {
  float a[2] = {1.0f, 2.0f};
  float b[2] = {std::numeric_limits<float>::quiet_NaN(), 2.0f};
  const GradTensor v[] = {{a, 2, DType::f32}, {b, 2, DType::f32}};
  for (const float s : {0.0f, std::numeric_limits<float>::infinity(), 0x1p-130f}) {
    const GradientCheck c = check_gradients(v, s, true);
    EXPECT_TRUE(c.found_inf) << s;
    EXPECT_EQ(c.first_overflow, 1) << s;
    EXPECT_TRUE(std::isnan(c.sum_squares)) << s;
    EXPECT_EQ(a[0], 1.0f);
  }
  EXPECT_FALSE(check_gradients({}, 2.0f, true).checked);
}

}  // namespace
}  // namespace mixprec
