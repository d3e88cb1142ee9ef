// Bulk conversions: every back end equals the scalar reference for random and
// edge-case arrays of awkward lengths in every mode; counting is exact;
// bad arguments are refused before anything is written.
#include <gtest/gtest.h>

#include <iostream>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "mixprec/mixprec.hpp"
#include "mixprec/nn/model.hpp"
#include "formats/backends.hpp"
#include "support.hpp"

namespace mixprec {
namespace {

using test::hex;
using test::hexf;

// Values that sit on the edges of some format: specials, extremes, ties.
std::vector<float> edge_values() {
  std::vector<std::uint32_t> bits = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0x7fa00000,
      0x7fffffff, 0x00000001, 0x007fffff, 0x00800000, 0x7f7fffff, 0x3f800000,
      0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001, 0x33800000, 0x33000000, 0x33000001, 0x387fc000,  // f16
      0x7f7f0000, 0x7f7f7fff, 0x7f7f8000, 0x00010000, 0x00008000, 0x00018000, 0x3f808000,              // bf16
      0x43e00000, 0x43e80000, 0x43e80001, 0x43f00000, 0x3b000000, 0x3a800000, 0x3b400000,              // e4m3
      0x47600000, 0x47700000, 0x476fffff, 0x37800000, 0x37000000, 0x37c00000,                          // e5m2
  };
  std::vector<float> v;
  for (std::uint32_t b : bits) {
    v.push_back(std::bit_cast<float>(b));
    v.push_back(std::bit_cast<float>(b ^ 0x80000000u));
  }
  return v;
}

std::vector<float> make_input(std::size_t n, std::uint32_t seed) {
  static const std::vector<float> edges = edge_values();
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (rng() % 4) {
      case 0: v[i] = edges[rng() % edges.size()]; break;
      case 1: v[i] = std::bit_cast<float>(static_cast<std::uint32_t>(rng())); break;
      default: {  // log-uniform magnitudes across every format's range, both signs
        const float mag = std::ldexp(1.0f + float(rng() % 1024) / 1024.0f, static_cast<int>(rng() % 80) - 40);
        v[i] = (rng() & 1) ? -mag : mag;
      }
    }
  }
  return v;
}

const std::vector<std::size_t> kLengths = {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4099};

std::vector<ConvertOptions> all_modes() {
  std::vector<ConvertOptions> modes;
  for (Overflow ov : {Overflow::ieee, Overflow::saturate}) {
    for (Subnormals sub : {Subnormals::keep, Subnormals::flush}) {
      for (float scale : {1.0f, 0.37f, 1024.0f, 0x1p-20f, 3.0e30f}) modes.push_back({ov, sub, scale});
    }
  }
  return modes;
}

std::string describe(const ConvertOptions& o) {
  return std::string(o.overflow == Overflow::ieee ? "ieee" : "saturate") + "/" +
         (o.subnormals == Subnormals::keep ? "keep" : "flush") + "/scale=" + hexf(o.scale);
}

// The SIMD back ends this CPU has (backends.hpp); those it lacks are named once.
std::vector<test::Backend> simd_tables() {
  std::string missing;
  std::vector<test::Backend> v = test::simd_backends(missing);
  static const bool noted = [&] {
    if (!missing.empty()) std::cout << "[ NOTE ] not available on this CPU, not tested here: " << missing << "\n";
    return true;
  }();
  (void)noted;
  return v;
}

template <class T>
class BulkTest : public ::testing::Test {};
using Formats = ::testing::Types<f16, bf16, f8e4m3, f8e5m2>;
TYPED_TEST_SUITE(BulkTest, Formats);

template <class T>
void expect_same_codes(const std::vector<T>& want, const std::vector<T>& got, const std::vector<float>& in,
                       const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].bits(), want[i].bits())
        << what << " element " << i << " of " << want.size() << ": input " << hexf(in[i]) << " gave "
        << hex(got[i].bits(), 4) << ", reference " << hex(want[i].bits(), 4);
  }
}

TYPED_TEST(BulkTest, EncodeMatchesScalarInEveryMode) {
  using T = TypeParam;
  const FormatKernels& ref = kernel_table(Isa::scalar)->get<T>();
  if (simd_tables().empty()) GTEST_SKIP() << "no SIMD back end on this CPU";
  for (const test::Backend& be : simd_tables()) {
    const FormatKernels& fast = be.table->get<T>();
    for (const ConvertOptions& o : all_modes()) {
      for (std::size_t n : kLengths) {
        const auto in = make_input(n, static_cast<std::uint32_t>(n * 7 + 1));
        std::vector<T> want(n), got(n), counted(n);
        ref.encode(in.data(), want.data(), n, o);
        fast.encode(in.data(), got.data(), n, o);
        const std::string what = be.name + " " + describe(o) + " n=" + std::to_string(n);
        expect_same_codes(want, got, in, what + " encode");

        const ConversionStats s_ref = ref.encode_counted(in.data(), want.data(), n, o);
        const ConversionStats s_fast = fast.encode_counted(in.data(), counted.data(), n, o);
        expect_same_codes(want, counted, in, what + " counted");
        EXPECT_EQ(s_ref, s_fast) << what << " counts differ: underflow " << s_ref.underflow << " vs "
                                 << s_fast.underflow << ", subnormal " << s_ref.subnormal << " vs "
                                 << s_fast.subnormal << ", overflow " << s_ref.overflow << " vs "
                                 << s_fast.overflow;
        EXPECT_EQ(s_ref.elements, n);

        std::vector<std::uint32_t> random(n);
        std::mt19937 rng(static_cast<std::uint32_t>(n));
        for (auto& r : random) r = static_cast<std::uint32_t>(rng());
        ref.encode_stochastic(in.data(), want.data(), random.data(), n, o);
        fast.encode_stochastic(in.data(), got.data(), random.data(), n, o);
        expect_same_codes(want, got, in, what + " stochastic");
      }
    }
  }
}

TYPED_TEST(BulkTest, DecodeMatchesScalarInEveryMode) {
  using T = TypeParam;
  using S = typename T::storage_type;
  const FormatKernels& ref = kernel_table(Isa::scalar)->get<T>();
  if (simd_tables().empty()) GTEST_SKIP() << "no SIMD back end on this CPU";
  for (const test::Backend& be : simd_tables()) {
    const FormatKernels& fast = be.table->get<T>();
    for (const ConvertOptions& o : all_modes()) {
      for (std::size_t n : kLengths) {
        std::vector<T> in(n);
        std::mt19937 rng(static_cast<std::uint32_t>(n + 3));
        for (auto& v : in) v = T::from_bits(static_cast<S>(rng()));
        std::vector<float> want(n), got(n);
        ref.decode(in.data(), want.data(), n, o);
        fast.decode(in.data(), got.data(), n, o);
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
              << be.name << " " << describe(o) << " n=" << n << " code " << hex(in[i].bits(), 4)
              << " decoded to " << hexf(got[i]) << ", reference " << hexf(want[i]);
        }
      }
    }
  }
}

// Arrays past kStreamingStoreBytes take the non-temporal-store path, with a
// scalar head up to the store alignment: check it at several misalignments.
TYPED_TEST(BulkTest, LargeArraysMatchScalar) {
  using T = TypeParam;
  using S = typename T::storage_type;
  const std::size_t n = kStreamingStoreBytes / (sizeof(float) + sizeof(T)) + 37;
  const auto in = make_input(n + 8, 4242);
  std::vector<T> want(n + 8), got(n + 8);
  std::vector<float> fwant(n + 8), fgot(n + 8);
  const FormatKernels& ref = kernel_table(Isa::scalar)->get<T>();
  const FormatKernels& fast = kernel_table(active_isa())->get<T>();
  for (std::size_t offset : {0, 1, 3}) {
    for (const ConvertOptions& o : {ConvertOptions{}, ConvertOptions{Overflow::saturate, Subnormals::flush, 8.0f}}) {
      const std::string what = std::string(isa_name(active_isa())) + " " + describe(o) + " offset " +
                               std::to_string(offset);
      ref.encode(in.data() + offset, want.data() + offset, n, o);
      fast.encode(in.data() + offset, got.data() + offset, n, o);
      expect_same_codes(want, got, in, what + " encode");
      const ConversionStats s_ref = ref.encode_counted(in.data() + offset, want.data() + offset, n, o);
      const ConversionStats s_fast = fast.encode_counted(in.data() + offset, got.data() + offset, n, o);
      expect_same_codes(want, got, in, what + " counted");
      EXPECT_EQ(s_ref, s_fast) << what;
      ref.decode(want.data() + offset, fwant.data() + offset, n, o);
      fast.decode(want.data() + offset, fgot.data() + offset, n, o);
      for (std::size_t i = 0; i < n + 8; ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(fgot[i]), std::bit_cast<std::uint32_t>(fwant[i]))
            << what << " decode element " << i << " code " << hex(static_cast<S>(want[i].bits()), 4);
      }
    }
  }
}

// Store and round, every back end (the reference included) against encode then decode
// of the reference, in every mode, at awkward lengths and misaligned starts: the codes,
// the rounded values, the counts and the input's amax bits, element by element in hex.
template <class T>
void check_encode_round(const FormatKernels& ref, const FormatKernels& k, const std::vector<float>& in,
                        std::size_t offset, std::size_t n, const ConvertOptions& o, const std::string& what) {
  const ConvertOptions back{o.overflow, o.subnormals, 1.0f / o.scale};
  std::vector<T> want(offset + n), got(offset + n), counted(offset + n);
  std::vector<float> want_v(offset + n), v(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(offset + n)), cv = v;
  const ConversionStats s_want = ref.encode_counted(in.data() + offset, want.data() + offset, n, o);
  ref.decode(want.data() + offset, want_v.data() + offset, n, back);
  std::uint32_t want_amax = 0;
  for (std::size_t i = offset; i < offset + n; ++i) {
    want_amax = std::max(want_amax, std::bit_cast<std::uint32_t>(in[i]) & 0x7fffffffu);
  }
  k.encode_round(v.data() + offset, got.data() + offset, n, o);
  std::uint32_t amax = 0xdeadbeef;
  const ConversionStats s_got = k.encode_round_counted(cv.data() + offset, counted.data() + offset, n, o, &amax);
  for (std::size_t i = offset; i < offset + n; ++i) {
    ASSERT_EQ(got[i].bits(), want[i].bits())
        << what << " encode_round element " << i << ": input " << hexf(in[i]) << " gave code "
        << hex(got[i].bits(), 4) << ", encode " << hex(want[i].bits(), 4);
    ASSERT_EQ(counted[i].bits(), want[i].bits())
        << what << " encode_round_counted element " << i << ": input " << hexf(in[i]) << " gave code "
        << hex(counted[i].bits(), 4) << ", encode " << hex(want[i].bits(), 4);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(v[i]), std::bit_cast<std::uint32_t>(want_v[i]))
        << what << " encode_round element " << i << ": input " << hexf(in[i]) << " code " << hex(want[i].bits(), 4)
        << " rounded to " << hexf(v[i]) << ", decode gives " << hexf(want_v[i]);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(cv[i]), std::bit_cast<std::uint32_t>(want_v[i]))
        << what << " encode_round_counted element " << i << ": input " << hexf(in[i]) << " code "
        << hex(want[i].bits(), 4) << " rounded to " << hexf(cv[i]) << ", decode gives " << hexf(want_v[i]);
  }
  for (std::size_t i = 0; i < offset; ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(v[i]), std::bit_cast<std::uint32_t>(in[i])) << what << " wrote before v";
    ASSERT_EQ(std::bit_cast<std::uint32_t>(cv[i]), std::bit_cast<std::uint32_t>(in[i])) << what << " wrote before v";
  }
  EXPECT_EQ(s_got, s_want) << what << " counts differ: underflow " << s_got.underflow << " vs " << s_want.underflow
                           << ", subnormal " << s_got.subnormal << " vs " << s_want.subnormal << ", overflow "
                           << s_got.overflow << " vs " << s_want.overflow;
  EXPECT_EQ(amax, want_amax) << what << " amax bits " << hex(amax, 8) << ", want " << hex(want_amax, 8);
}

std::vector<test::Backend> all_tables() {
  std::vector<test::Backend> v = {{"scalar", kernel_table(Isa::scalar)}};
  for (const test::Backend& be : simd_tables()) v.push_back(be);
  return v;
}

TYPED_TEST(BulkTest, EncodeAndRoundEqualsEncodeThenDecodeInEveryMode) {
  using T = TypeParam;
  const FormatKernels& ref = kernel_table(Isa::scalar)->get<T>();
  for (const test::Backend& be : all_tables()) {
    const FormatKernels& k = be.table->get<T>();
    for (const ConvertOptions& o : all_modes()) {
      for (std::size_t n : kLengths) {
        for (std::size_t offset : {0, 1, 5}) {
          const auto in = make_input(n + offset, static_cast<std::uint32_t>(n * 13 + offset + 5));
          check_encode_round<T>(ref, k, in, offset, n, o,
                                be.name + " " + describe(o) + " n=" + std::to_string(n) +
                                    " offset " + std::to_string(offset));
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

// Past kStreamingStoreBytes the codes are streamed after a scalar head up to their alignment.
TYPED_TEST(BulkTest, EncodeAndRoundLargeArrays) {
  using T = TypeParam;
  const std::size_t n = kStreamingStoreBytes / (sizeof(float) + sizeof(T)) + 37;
  const auto in = make_input(n + 3, 777);
  const FormatKernels& ref = kernel_table(Isa::scalar)->get<T>();
  const FormatKernels& fast = kernel_table(active_isa())->get<T>();
  for (std::size_t offset : {0, 3}) {
    for (const ConvertOptions& o : {ConvertOptions{}, ConvertOptions{Overflow::saturate, Subnormals::flush, 8.0f}}) {
      check_encode_round<T>(ref, fast, in, offset, n, o,
                            std::string(isa_name(active_isa())) + " " + describe(o) + " offset " +
                                std::to_string(offset));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// The public forms: the active back end, and the amax the engine's gradient commit
// needs: amax_of's value (NaN skipped), made +inf when any input is nonfinite.
TYPED_TEST(BulkTest, EncodeAndRoundPublicApi) {
  using T = TypeParam;
  for (std::size_t n : kLengths) {
    for (std::uint32_t seed : {1u, 2u, 3u}) {
      auto in = make_input(n, seed * 101 + static_cast<std::uint32_t>(n));
      if (seed == 3) {  // finite inputs only
        for (float& x : in) x = std::isfinite(x) ? x : 1.5f;
      }
      std::vector<T> want(n), got(n), counted(n);
      std::vector<float> want_v(n), v = in, cv = in;
      const ConversionStats s_want = convert_counted(std::span<const float>(in), std::span<T>(want));
      convert(std::span<const T>(want), std::span<float>(want_v));
      encode_and_round(std::span<float>(v), std::span<T>(got));
      const RoundedStats r = encode_and_round_counted(std::span<float>(cv), std::span<T>(counted));
      expect_same_codes(want, got, in, "encode_and_round n=" + std::to_string(n));
      expect_same_codes(want, counted, in, "encode_and_round_counted n=" + std::to_string(n));
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(v[i]), std::bit_cast<std::uint32_t>(want_v[i])) << "element " << i;
        ASSERT_EQ(std::bit_cast<std::uint32_t>(cv[i]), std::bit_cast<std::uint32_t>(want_v[i])) << "element " << i;
      }
      EXPECT_EQ(r.stats, s_want) << "n=" << n;
      const float engine_amax =
          s_want.nonfinite_input > 0 ? std::numeric_limits<float>::infinity() : nn::amax_of(in);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(r.amax), std::bit_cast<std::uint32_t>(engine_amax))
          << "n=" << n << " seed " << seed << ": amax " << hexf(r.amax) << ", want " << hexf(engine_amax);
    }
  }
}

TEST(BulkEncodeAndRound, AmaxByHand) {
  auto amax = [](std::vector<float> v, float scale = 1.0f) {
    std::vector<bf16> out(v.size());
    return encode_and_round_counted(std::span<float>(v), std::span<bf16>(out),
                                    {Overflow::ieee, Subnormals::keep, scale})
        .amax;
  };
  EXPECT_EQ(std::bit_cast<std::uint32_t>(amax({})), 0u);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(amax({-0.0f})), 0u) << "+0, as amax_of";
  EXPECT_EQ(amax({1.0f, -3.0f, 2.0f}), 3.0f);
  EXPECT_EQ(amax({1.0f, -3.0f, 2.0f}, 4.0f), 3.0f) << "of the input, before scaling";
  EXPECT_EQ(amax({1.0f, NAN, 2.0f}), INFINITY);
  EXPECT_EQ(amax({-INFINITY, 2.0f}), INFINITY);
  EXPECT_EQ(amax({1e38f, 3e38f}), 3e38f) << "finite, though past bf16's range after rounding";
}

TYPED_TEST(BulkTest, EncodeAndRoundRefusesBadArgumentsBeforeWriting) {
  using T = TypeParam;
  std::vector<float> v(16, 1.25f);
  std::vector<T> out(15, T::from_bits(0x5));
  EXPECT_THROW(encode_and_round(std::span<float>(v), std::span<T>(out)), std::invalid_argument);
  EXPECT_THROW(encode_and_round_counted(std::span<float>(v), std::span<T>(out)), std::invalid_argument);
  std::vector<T> out16(16, T::from_bits(0x5));
  EXPECT_THROW(encode_and_round(std::span<float>(v), std::span<T>(out16), {Overflow::ieee, Subnormals::keep, 0.0f}),
               std::invalid_argument);
  for (const T& c : out) ASSERT_EQ(c.bits(), 0x5);
  for (const T& c : out16) ASSERT_EQ(c.bits(), 0x5);
  for (float x : v) ASSERT_EQ(x, 1.25f);
}

// Every code of the format, decoded by the bulk path, in every subnormal mode.
TYPED_TEST(BulkTest, DecodeEveryCode) {
  using T = TypeParam;
  using S = typename T::storage_type;
  const std::size_t n = std::size_t{1} << format_traits<T>::bits;
  std::vector<T> in(n);
  for (std::size_t c = 0; c < n; ++c) in[c] = T::from_bits(static_cast<S>(c));
  for (Subnormals sub : {Subnormals::keep, Subnormals::flush}) {
    std::vector<float> got(n);
    convert(std::span<const T>(in), std::span<float>(got), {Overflow::ieee, sub, 1.0f});
    for (std::size_t c = 0; c < n; ++c) {
      const float want = decode(in[c], sub);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got[c]), std::bit_cast<std::uint32_t>(want))
          << "code " << hex(c, 4) << " via " << isa_name(active_isa());
    }
  }
}

TYPED_TEST(BulkTest, PublicApiUsesTheActiveBackEnd) {
  using T = TypeParam;
  const auto in = make_input(1000, 99);
  std::vector<T> want(in.size()), got(in.size());
  const ConvertOptions o{Overflow::saturate, Subnormals::flush, 2.0f};
  kernel_table(Isa::scalar)->get<T>().encode(in.data(), want.data(), in.size(), o);
  convert(std::span<const float>(in), std::span<T>(got), o);
  expect_same_codes(want, got, in, "public convert");
  std::vector<T> counted(in.size());
  const ConversionStats st = convert_counted(std::span<const float>(in), std::span<T>(counted), o);
  expect_same_codes(want, counted, in, "public convert_counted");
  EXPECT_EQ(st.elements, in.size());
}

TYPED_TEST(BulkTest, BadArgumentsAreRefusedBeforeWriting) {
  using T = TypeParam;
  std::vector<float> in(16, 1.0f);
  std::vector<T> out(15, T::from_bits(0x5));
  EXPECT_THROW(convert(std::span<const float>(in), std::span<T>(out)), std::invalid_argument);
  for (const T& v : out) ASSERT_EQ(v.bits(), 0x5);
  std::vector<T> out16(16, T::from_bits(0x5));
  for (float bad : {0.0f, -1.0f, INFINITY, NAN}) {
    EXPECT_THROW(convert(std::span<const float>(in), std::span<T>(out16), {Overflow::ieee, Subnormals::keep, bad}),
                 std::invalid_argument)
        << "scale " << bad;
  }
  for (const T& v : out16) ASSERT_EQ(v.bits(), 0x5);
  std::vector<std::uint32_t> random(3);
  EXPECT_THROW(convert_stochastic(std::span<const float>(in), std::span<T>(out16), std::span<const std::uint32_t>(random)),
               std::invalid_argument);
  try {
    convert(std::span<const float>(in), std::span<T>(out));
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("15"), std::string::npos) << e.what();
  }
}

// The counting reference itself, on inputs whose fate is known by hand.
TEST(BulkCounting, HandDerivedF16) {
  const std::vector<float> in = {1e-9f, 1e-6f, 1e5f, INFINITY, 0.0f, 1.0f, -1e-9f, NAN, -0.0f, 70000.0f};
  std::vector<f16> out(in.size());
  const ConversionStats st = convert_counted(std::span<const float>(in), std::span<f16>(out));
  EXPECT_EQ(st.elements, 10u);
  EXPECT_EQ(st.nonzero, 8u);          // all but the two zeros (NaN and inf count as nonzero)
  EXPECT_EQ(st.nonfinite_input, 2u);  // inf, NaN
  EXPECT_EQ(st.underflow, 2u);        // +-1e-9
  EXPECT_EQ(st.subnormal, 1u);        // 1e-6
  EXPECT_EQ(st.overflow, 2u);         // 1e5, 70000
  ConversionStats sat = convert_counted(std::span<const float>(in), std::span<f16>(out),
                                        {Overflow::saturate, Subnormals::flush, 1.0f});
  EXPECT_EQ(sat.overflow, 2u) << "saturated values still count as overflow";
  EXPECT_EQ(sat.underflow, 3u) << "flushed subnormal counts as underflow";
  EXPECT_EQ(sat.subnormal, 0u);
  EXPECT_EQ(out[2].bits(), 0x7bff);
}

TEST(BulkCounting, ScaleIsAppliedBeforeCounting) {
  const std::vector<float> in = {1e-9f, 1e-6f};
  std::vector<f16> out(2);
  const ConversionStats st = convert_counted(std::span<const float>(in), std::span<f16>(out),
                                             {Overflow::ieee, Subnormals::keep, 65536.0f});
  // 1e-9 alone underflows f16; times 2^16 it is 6.55e-5, just above f16's min normal 6.10e-5.
  EXPECT_EQ(st.underflow, 0u);
  EXPECT_EQ(st.subnormal, 0u);
  EXPECT_EQ(decode(out[0]), static_cast<float>(f16(1e-9f * 65536.0f)));
  EXPECT_EQ(decode(out[1]), static_cast<float>(f16(1e-6f * 65536.0f)));
}

}  // namespace
}  // namespace mixprec
