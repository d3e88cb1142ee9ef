// The counting pass (mixprec/formats/count.hpp) against the counted conversion it stands
// for (convert_counted<f16> on the widened values, the scalar reference's classes): every
// 16-bit code of fp16 and bf16 alone and all together, fp32 words around every class bound
// and at random, on every back end this CPU has; SIMD back ends also against the scalar
// one on long arrays (the AVX2 counters' flush). The |max| pass (amax_*) is checked against
// the same expectations, and with the largest value at every position. Failures print the
// code in hex.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/count.hpp"

namespace mixprec {
namespace {

std::vector<Isa> backends() {
  std::vector<Isa> v;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (isa_available(isa)) v.push_back(isa);
  }
  return v;
}

std::string missing_backends() {
  std::string m;
  for (Isa isa : {Isa::avx2, Isa::avx512})
    if (!isa_available(isa)) m += std::string(m.empty() ? "" : ", ") + std::string(isa_name(isa));
  return m;
}

// What count.hpp promises, from the reference: convert_counted's stats and the largest |x|
// (inf when some x is inf or NaN; 0 when empty).
CountedTensor expected(const std::vector<float>& x) {
  CountedTensor e;
  std::vector<f16> out(x.size());
  e.stats = convert_counted(std::span<const float>(x), std::span<f16>(out));
  for (float v : x) {
    const float a = std::isfinite(v) ? std::fabs(v) : std::numeric_limits<float>::infinity();
    e.amax = std::max(e.amax, a);
  }
  return e;
}

std::string text(const CountedTensor& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "{elements %llu nonzero %llu nonfinite %llu underflow %llu subnormal %llu overflow %llu amax %a}",
                static_cast<unsigned long long>(c.stats.elements), static_cast<unsigned long long>(c.stats.nonzero),
                static_cast<unsigned long long>(c.stats.nonfinite_input),
                static_cast<unsigned long long>(c.stats.underflow), static_cast<unsigned long long>(c.stats.subnormal),
                static_cast<unsigned long long>(c.stats.overflow), static_cast<double>(c.amax));
  return buf;
}

}  // namespace

// gtest prints a CountedTensor this way (EXPECT_EQ's messages).
void PrintTo(const CountedTensor& c, std::ostream* os) { *os << text(c); }

namespace {

template <class T>
CountedTensor count(Isa isa, const std::vector<T>& v) {
  if constexpr (std::is_same_v<T, f16>) return count_f16_as_stored(isa, std::span<const f16>(v));
  else if constexpr (std::is_same_v<T, bf16>) return count_bf16_to_f16(isa, std::span<const bf16>(v));
  else return count_f32_to_f16(isa, std::span<const float>(v));
}

template <class T>
float amax(Isa isa, const std::vector<T>& v) {
  if constexpr (std::is_same_v<T, f16>) return amax_f16(isa, std::span<const f16>(v));
  else if constexpr (std::is_same_v<T, bf16>) return amax_bf16(isa, std::span<const bf16>(v));
  else return amax_f32(isa, std::span<const float>(v));
}

// The |max| pass must say what the counting pass says, bit for bit.
std::uint32_t bits(float x) { return std::bit_cast<std::uint32_t>(x); }

template <class T>
std::vector<float> widened(const std::vector<T>& v) {
  std::vector<float> x(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) x[i] = static_cast<float>(v[i]);
  return x;
}

template <class T>
void every_code_alone_and_together() {
  if (!missing_backends().empty()) std::printf("[  NOTE    ] not on this CPU, skipped: %s\n", missing_backends().c_str());
  std::vector<T> all;
  for (std::uint32_t c = 0; c < 65536; ++c) all.push_back(T::from_bits(static_cast<std::uint16_t>(c)));
  for (Isa isa : backends()) {
    int failures = 0;
    for (const T& code : all) {
      const std::vector<T> one{code};
      const CountedTensor got = count(isa, one), want = expected(widened(one));
      if (got != want && ++failures <= 8)
        ADD_FAILURE() << isa_name(isa) << ": code 0x" << std::hex << code.bits() << ": got " << text(got)
                      << ", want " << text(want);
      const float a = amax(isa, one);
      if (bits(a) != bits(want.amax) && ++failures <= 8)
        ADD_FAILURE() << isa_name(isa) << ": code 0x" << std::hex << code.bits() << ": amax got " << std::hexfloat
                      << a << ", want " << want.amax;
    }
    EXPECT_EQ(failures, 0) << isa_name(isa);
    // Together, in a shuffled order, and in pieces of every length up to 100 (the tails).
    std::vector<T> mixed = all;
    std::shuffle(mixed.begin(), mixed.end(), std::mt19937(7));
    EXPECT_EQ(count(isa, mixed), expected(widened(mixed))) << isa_name(isa);
    EXPECT_EQ(bits(amax(isa, mixed)), bits(expected(widened(mixed)).amax)) << isa_name(isa);
    std::size_t at = 0;
    for (std::size_t len = 0; len <= 100 && at + len <= mixed.size(); at += len, ++len) {
      const std::vector<T> piece(mixed.begin() + static_cast<std::ptrdiff_t>(at),
                                 mixed.begin() + static_cast<std::ptrdiff_t>(at + len));
      const CountedTensor want = expected(widened(piece));
      ASSERT_EQ(count(isa, piece), want) << isa_name(isa) << ": length " << len;
      ASSERT_EQ(bits(amax(isa, piece)), bits(want.amax)) << isa_name(isa) << ": amax, length " << len;
    }
  }
}

TEST(Count, EveryF16CodeAsStoredEqualsConvertCounted) { every_code_alone_and_together<f16>(); }
TEST(Count, EveryBF16CodeToF16EqualsConvertCounted) { every_code_alone_and_together<bf16>(); }

TEST(Count, F32WordsAroundEveryBoundAndAtRandomEqualConvertCounted) {
  // Every word within 2^12 of each class bound (both signs), the specials, and random words.
  std::vector<std::uint32_t> centres = {0u, 0x33000000u, 0x387fe000u, 0x38800000u, 0x477ff000u, 0x47800000u,
                                        0x7f800000u, 0x00000001u, 0x7f7fffffu};
  std::vector<float> x;
  for (std::uint32_t c : centres)
    for (std::int64_t d = -4096; d <= 4096; ++d) {
      const std::int64_t w = static_cast<std::int64_t>(c) + d;
      if (w < 0 || w > 0x7fffffff) continue;
      x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(w)));
      x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(w) | 0x80000000u));
    }
  std::mt19937 rng(3);
  for (int i = 0; i < (1 << 18); ++i) x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  for (Isa isa : backends()) {
    int failures = 0;
    for (float v : x) {
      const std::vector<float> one{v};
      const CountedTensor got = count(isa, one), want = expected(one);
      if (got != want && ++failures <= 8)
        ADD_FAILURE() << isa_name(isa) << ": word 0x" << std::hex << std::bit_cast<std::uint32_t>(v) << ": got "
                      << text(got) << ", want " << text(want);
      const float a = amax(isa, one);
      if (bits(a) != bits(want.amax) && ++failures <= 8)
        ADD_FAILURE() << isa_name(isa) << ": word 0x" << std::hex << std::bit_cast<std::uint32_t>(v)
                      << ": amax got " << std::hexfloat << a << ", want " << want.amax;
    }
    EXPECT_EQ(failures, 0) << isa_name(isa);
    EXPECT_EQ(count(isa, x), expected(x)) << isa_name(isa);
    EXPECT_EQ(bits(amax(isa, x)), bits(expected(x).amax)) << isa_name(isa);
    for (std::size_t len = 0; len <= 40; ++len) {
      const std::vector<float> piece(x.begin() + 1000, x.begin() + 1000 + static_cast<std::ptrdiff_t>(len));
      ASSERT_EQ(count(isa, piece), expected(piece)) << isa_name(isa) << ": length " << len;
      ASSERT_EQ(bits(amax(isa, piece)), bits(expected(piece).amax)) << isa_name(isa) << ": amax, length " << len;
    }
  }
}

// Long arrays: past the AVX2 16-bit counters' flush (32767 vectors of 16), every back end
// equal to the scalar reference; the public functions run the active one.
TEST(Count, LongArraysEqualTheScalarReference) {
  std::mt19937 rng(11);
  std::vector<bf16> b(1'300'003);
  std::vector<f16> h(b.size());
  std::vector<float> f(700'001);
  for (auto& v : b) v = bf16::from_bits(static_cast<std::uint16_t>(rng()));
  for (auto& v : h) v = f16::from_bits(static_cast<std::uint16_t>(rng()));
  for (auto& v : f) v = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
  const CountedTensor rb = count(Isa::scalar, b), rh = count(Isa::scalar, h), rf = count(Isa::scalar, f);
  EXPECT_EQ(rb, expected(widened(b)));
  EXPECT_EQ(rh, expected(widened(h)));
  for (Isa isa : backends()) {
    EXPECT_EQ(count(isa, b), rb) << isa_name(isa);
    EXPECT_EQ(count(isa, h), rh) << isa_name(isa);
    EXPECT_EQ(count(isa, f), rf) << isa_name(isa);
  }
  for (Isa isa : backends()) {
    EXPECT_EQ(bits(amax(isa, b)), bits(rb.amax)) << isa_name(isa);
    EXPECT_EQ(bits(amax(isa, h)), bits(rh.amax)) << isa_name(isa);
    EXPECT_EQ(bits(amax(isa, f)), bits(rf.amax)) << isa_name(isa);
  }
  EXPECT_EQ(bits(amax_bf16(std::span<const bf16>(b))), bits(rb.amax));
  EXPECT_EQ(count_bf16_to_f16(std::span<const bf16>(b)), rb);
  EXPECT_EQ(count_f16_as_stored(std::span<const f16>(h)), rh);
  EXPECT_EQ(count_f32_to_f16(std::span<const float>(f)), rf);
  // Finite values only: amax is the largest magnitude, not inf.
  std::vector<bf16> finite(100'000);
  for (auto& v : finite) v = bf16::from_bits(static_cast<std::uint16_t>(rng() % 0x7f80u));
  EXPECT_EQ(count_bf16_to_f16(std::span<const bf16>(finite)), expected(widened(finite)));
  EXPECT_TRUE(std::isfinite(count_bf16_to_f16(std::span<const bf16>(finite)).amax));
}

// The |max| pass's lanes and tails: the one largest value (finite, then inf, then NaN) at every
// position of arrays of every length to 300 (past two unrolled AVX-512 16-bit iterations)
// among smaller values of both signs, on every back end.
template <class T>
void largest_at_every_position() {
  std::mt19937 rng(5);
  for (Isa isa : backends()) {
    int failures = 0;
    for (std::size_t n = 1; n <= 300; ++n) {
      std::vector<T> v(n);
      for (auto& x : v) x = T(std::ldexp(static_cast<float>(rng() % 1000) / 1000.0f, -static_cast<int>(rng() % 8)) *
                              (rng() % 2 ? 1.0f : -1.0f));
      for (std::size_t at = 0; at < n; ++at) {
        for (float big : {-3.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
          std::vector<T> w = v;
          w[at] = T(big);
          const float want = expected(widened(w)).amax, got = amax(isa, w);
          if (bits(got) != bits(want) && ++failures <= 8)
            ADD_FAILURE() << isa_name(isa) << ": length " << n << ", largest " << big << " at " << at << ": got "
                          << std::hexfloat << got << ", want " << want;
        }
      }
    }
    EXPECT_EQ(failures, 0) << isa_name(isa);
  }
}

TEST(Count, AmaxFindsTheLargestAtEveryPositionF16) { largest_at_every_position<f16>(); }
TEST(Count, AmaxFindsTheLargestAtEveryPositionBF16) { largest_at_every_position<bf16>(); }
TEST(Count, AmaxFindsTheLargestAtEveryPositionF32) { largest_at_every_position<float>(); }

TEST(Count, EmptyAndUnavailableBackEnds) {
  const CountedTensor empty = count_f32_to_f16(std::span<const float>());
  EXPECT_EQ(empty, CountedTensor{});
  EXPECT_EQ(bits(amax_f32(std::span<const float>())), 0u);
  EXPECT_EQ(bits(amax_bf16(std::span<const bf16>())), 0u);
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (isa_available(isa)) continue;
    EXPECT_THROW((void)count_f32_to_f16(isa, std::span<const float>()), std::invalid_argument);
    EXPECT_THROW((void)amax_f16(isa, std::span<const f16>()), std::invalid_argument);
  }
}

}  // namespace
}  // namespace mixprec
