// The scalar reference, checked against hand-derived cases, the OCP fp8 tables,
// an independent nearest-value oracle in double arithmetic, and round trips of
// every f16 and bf16 pattern.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "mixprec/mixprec.hpp"
#include "support.hpp"

namespace mixprec {
namespace {

using test::hex;
using test::hexf;

constexpr EncodeMode kIeee{Overflow::ieee, Subnormals::keep};
constexpr EncodeMode kSat{Overflow::saturate, Subnormals::keep};
constexpr EncodeMode kFtz{Overflow::ieee, Subnormals::flush};

float f(std::uint32_t bits) { return std::bit_cast<float>(bits); }

struct Case {
  std::uint32_t in;   // fp32 bits
  EncodeMode mode;
  std::uint32_t out;  // expected code
  const char* why;
};

template <class T>
void check_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    const auto got = encode<T>(f(c.in), c.mode).bits();
    EXPECT_EQ(got, c.out) << format_traits<T>::name << " " << c.why << ": input " << hex(c.in, 8)
                          << " gave " << hex(got, 4) << ", expected " << hex(c.out, 4);
  }
}

TEST(ScalarEncode, F16HandDerived) {
  check_cases<f16>({
      {0x3f800000, kIeee, 0x3c00, "one"},
      {0x00000000, kIeee, 0x0000, "+0"},
      {0x80000000, kIeee, 0x8000, "-0 keeps its sign"},
      {0x3f801000, kIeee, 0x3c00, "1+2^-11 ties to even (down)"},
      {0x3f803000, kIeee, 0x3c02, "1+3*2^-11 ties to even (up)"},
      {0x3f801001, kIeee, 0x3c01, "just above a tie rounds up"},
      {0x477fe000, kIeee, 0x7bff, "65504 is max finite"},
      {0x477fefff, kIeee, 0x7bff, "just below the overflow midpoint"},
      {0x477ff000, kIeee, 0x7c00, "65520: tie with odd max rounds to inf"},
      {0x477ff000, kSat, 0x7bff, "65520 saturates to max"},
      {0x7f800000, kIeee, 0x7c00, "+inf"},
      {0xff800000, kIeee, 0xfc00, "-inf"},
      {0x7f800000, kSat, 0x7bff, "+inf saturates to max"},
      {0xff800000, kSat, 0xfbff, "-inf saturates to -max"},
      {0x33800000, kIeee, 0x0001, "2^-24, smallest subnormal"},
      {0x33000000, kIeee, 0x0000, "2^-25, half the smallest subnormal, ties to zero"},
      {0x33000001, kIeee, 0x0001, "just above 2^-25 rounds up"},
      {0xb3000000, kIeee, 0x8000, "-2^-25 ties to -0"},
      {0x33c00000, kIeee, 0x0002, "1.5*2^-24 ties to even (2)"},
      {0x38800000, kIeee, 0x0400, "2^-14, smallest normal"},
      {0x387fe000, kIeee, 0x0400, "2^-14-2^-25 ties up (0x3ff is odd) to the smallest normal"},
      {0x387fc000, kIeee, 0x03ff, "2^-14-2^-24 is the largest subnormal"},
      {0x387f8000, kIeee, 0x03fe, "largest-but-one subnormal"},
      {0x00000001, kIeee, 0x0000, "fp32 subnormal underflows"},
      {0x33800000, kFtz, 0x0000, "flush: a subnormal result becomes zero"},
      {0xb3800000, kFtz, 0x8000, "flush keeps the sign"},
      {0x387fe000, kFtz, 0x0400, "flush: rounding up to min normal is kept"},
      {0x387fc000, kFtz, 0x0000, "flush: the largest subnormal becomes zero"},
      {0x7fc00000, kIeee, 0x7e00, "quiet NaN"},
      {0x7f800001, kIeee, 0x7e00, "signalling NaN becomes quiet"},
      {0xffffffff, kIeee, 0xffff, "NaN keeps sign and top payload"},
      {0x7fc00000, kSat, 0x7e00, "NaN stays NaN when saturating"},
  });
}

TEST(ScalarEncode, BF16HandDerived) {
  check_cases<bf16>({
      {0x3f800000, kIeee, 0x3f80, "one"},
      {0x80000000, kIeee, 0x8000, "-0"},
      {0x3f808000, kIeee, 0x3f80, "tie rounds to even (down)"},
      {0x3f818000, kIeee, 0x3f82, "tie rounds to even (up)"},
      {0x3f808001, kIeee, 0x3f81, "above the tie rounds up"},
      {0x7f7f0000, kIeee, 0x7f7f, "max finite"},
      {0x7f7f7fff, kIeee, 0x7f7f, "just below the overflow midpoint"},
      {0x7f7f8000, kIeee, 0x7f80, "midpoint above max rounds to inf"},
      {0x7f7f8000, kSat, 0x7f7f, "saturates to max"},
      {0x7f7fffff, kSat, 0x7f7f, "FLT_MAX saturates"},
      {0x00010000, kIeee, 0x0001, "2^-133, smallest subnormal"},
      {0x00008000, kIeee, 0x0000, "2^-134 ties to zero"},
      {0x00008001, kIeee, 0x0001, "above half the smallest subnormal"},
      {0x00018000, kIeee, 0x0002, "1.5*2^-133 ties to even"},
      {0x00000001, kIeee, 0x0000, "smallest fp32 subnormal"},
      {0x007fffff, kIeee, 0x0080, "largest fp32 subnormal rounds to min normal"},
      {0x00010000, kFtz, 0x0000, "flush a subnormal result"},
      {0x007fffff, kFtz, 0x0080, "flush keeps a result that rounded to normal"},
      {0x7f800000, kIeee, 0x7f80, "+inf"},
      {0xff800000, kSat, 0xff7f, "-inf saturates"},
      {0x7f800001, kIeee, 0x7fc0, "signalling NaN quieted"},
      {0xffc12345, kIeee, 0xffc1, "NaN keeps sign and payload top bits"},
  });
}

TEST(ScalarEncode, E4M3HandDerived) {
  check_cases<f8e4m3>({
      {0x3f800000, kIeee, 0x38, "one"},
      {0x80000000, kIeee, 0x80, "-0"},
      {0x43e00000, kIeee, 0x7e, "448 is max finite"},
      {0x43e80000, kIeee, 0x7e, "464: tie with even max rounds down to max"},
      {0x43e80001, kIeee, 0x7f, "just above 464 overflows to NaN"},
      {0x43e80001, kSat, 0x7e, "saturates to 448"},
      {0x43f00000, kIeee, 0x7f, "480 has no code: NaN"},
      {0x7f800000, kIeee, 0x7f, "+inf has no code: NaN"},
      {0xff800000, kIeee, 0xff, "-inf: negative NaN"},
      {0x7f800000, kSat, 0x7e, "+inf saturates to 448"},
      {0x3b000000, kIeee, 0x01, "2^-9, smallest subnormal"},
      {0x3a800000, kIeee, 0x00, "2^-10 ties to zero"},
      {0x3a800001, kIeee, 0x01, "just above half rounds up"},
      {0x3b400000, kIeee, 0x02, "1.5*2^-9 ties to even"},
      {0x3c800000, kIeee, 0x08, "2^-6, smallest normal"},
      {0x3f880000, kIeee, 0x38, "1+2^-4 ties to even (down)"},
      {0x3f980000, kIeee, 0x3a, "1+3*2^-4 ties to even (up)"},
      {0x3b000000, kFtz, 0x00, "flush a subnormal"},
      {0x7fc00000, kIeee, 0x7f, "NaN"},
      {0xff800001, kIeee, 0xff, "negative NaN"},
  });
}

TEST(ScalarEncode, E5M2HandDerived) {
  check_cases<f8e5m2>({
      {0x3f800000, kIeee, 0x3c, "one"},
      {0x47600000, kIeee, 0x7b, "57344 is max finite"},
      {0x476fffff, kIeee, 0x7b, "just below the overflow midpoint"},
      {0x47700000, kIeee, 0x7c, "61440: tie with odd max rounds to inf"},
      {0x47700000, kSat, 0x7b, "saturates"},
      {0xff800000, kIeee, 0xfc, "-inf"},
      {0x37800000, kIeee, 0x01, "2^-16, smallest subnormal"},
      {0x37000000, kIeee, 0x00, "2^-17 ties to zero"},
      {0x37c00000, kIeee, 0x02, "1.5*2^-16 ties to even"},
      {0x38800000, kIeee, 0x04, "2^-14 smallest normal"},
      {0x37800000, kFtz, 0x00, "flush a subnormal"},
      {0x7fc00000, kIeee, 0x7e, "quiet NaN"},
      {0x7fe00000, kIeee, 0x7f, "NaN payload bit kept"},
      {0x7f800001, kIeee, 0x7e, "signalling NaN quieted"},
  });
}

// ---- decode: the OCP fp8 tables ----------------------------------------------

// Value of an fp8 code straight from the OCP definition, in double.
double ocp_value(std::uint8_t code, int ebits, int mbits, int bias, bool e4m3) {
  const int s = code >> 7;
  const int e = (code >> mbits) & ((1 << ebits) - 1);
  const int m = code & ((1 << mbits) - 1);
  const double sign = s ? -1.0 : 1.0;
  const int emax_field = (1 << ebits) - 1;
  if (e4m3 && e == emax_field && m == (1 << mbits) - 1) return std::numeric_limits<double>::quiet_NaN();
  if (!e4m3 && e == emax_field) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(m / double(1 << mbits), 1 - bias);
  return sign * std::ldexp(1.0 + m / double(1 << mbits), e - bias);
}

template <class T>
void check_fp8_table(int ebits, int mbits, int bias, bool e4m3) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const double want = ocp_value(code, ebits, mbits, bias, e4m3);
    const float got = decode(T::from_bits(code));
    if (std::isnan(want)) {
      ++nans;
      EXPECT_TRUE(std::isnan(got)) << "code " << hex(code, 2) << " should be NaN, got " << hexf(got);
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "NaN sign of " << hex(code, 2);
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << hex(code, 2) << " decoded to " << hexf(got);
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "sign of " << hex(code, 2);
    }
  }
  EXPECT_EQ(nans, e4m3 ? 2 : 6);
}

TEST(ScalarDecode, E4M3MatchesOcpTable) {
  check_fp8_table<f8e4m3>(4, 3, 7, true);
  // Landmarks from the OCP table.
  EXPECT_EQ(decode(f8e4m3::from_bits(0x7e)), 448.0f);
  EXPECT_EQ(decode(f8e4m3::from_bits(0x77)), 240.0f);
  EXPECT_EQ(decode(f8e4m3::from_bits(0x78)), 256.0f);
  EXPECT_EQ(decode(f8e4m3::from_bits(0x08)), 0x1p-6f);
  EXPECT_EQ(decode(f8e4m3::from_bits(0x01)), 0x1p-9f);
  EXPECT_EQ(decode(f8e4m3::from_bits(0x07)), 0x1.cp-7f);
  EXPECT_EQ(decode(f8e4m3::from_bits(0xfe)), -448.0f);
}

TEST(ScalarDecode, E5M2MatchesOcpTable) {
  check_fp8_table<f8e5m2>(5, 2, 15, false);
  EXPECT_EQ(decode(f8e5m2::from_bits(0x7b)), 57344.0f);
  EXPECT_TRUE(std::isinf(decode(f8e5m2::from_bits(0x7c))));
  EXPECT_EQ(decode(f8e5m2::from_bits(0x01)), 0x1p-16f);
  EXPECT_EQ(decode(f8e5m2::from_bits(0x04)), 0x1p-14f);
  EXPECT_EQ(decode(f8e5m2::from_bits(0x3c)), 1.0f);
}

TEST(ScalarDecode, FlushTreatsSubnormalInputsAsZero) {
  EXPECT_EQ(std::bit_cast<std::uint32_t>(decode(f16::from_bits(0x8001), Subnormals::flush)), 0x80000000u);
  EXPECT_EQ(decode(f16::from_bits(0x0400), Subnormals::flush), 0x1p-14f);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(decode(bf16::from_bits(0x007f), Subnormals::flush)), 0u);
  EXPECT_EQ(decode(f8e4m3::from_bits(0x07), Subnormals::flush), 0.0f);
  EXPECT_EQ(decode(f8e5m2::from_bits(0x03), Subnormals::flush), 0.0f);
}

// Every f16 / bf16 pattern to f32 and back: identity, NaNs stay NaN with their
// sign and payload (the quiet bit set).
template <class T>
void check_round_trip(std::uint16_t quiet_bit, int expected_nans) {
  int nans = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto in = static_cast<std::uint16_t>(b);
    const float x = static_cast<float>(T::from_bits(in));
    const std::uint16_t out = T(x).bits();
    if (std::isnan(x)) {
      ++nans;
      ASSERT_EQ(out, in | quiet_bit) << format_traits<T>::name << " NaN " << hex(in, 4) << " came back as "
                                     << hex(out, 4) << " via " << hexf(x);
    } else {
      ASSERT_EQ(out, in) << format_traits<T>::name << " " << hex(in, 4) << " -> " << hexf(x) << " -> "
                         << hex(out, 4);
    }
  }
  EXPECT_EQ(nans, expected_nans);
}

TEST(ScalarRoundTrip, EveryF16Pattern) { check_round_trip<f16>(0x0200, 2 * 1023); }
TEST(ScalarRoundTrip, EveryBF16Pattern) { check_round_trip<bf16>(0x0040, 2 * 127); }

TEST(ScalarRoundTrip, EveryFp8Code) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float x4 = decode(f8e4m3::from_bits(code));
    const float x5 = decode(f8e5m2::from_bits(code));
    EXPECT_EQ(f8e4m3(x4).bits(), code) << "e4m3 " << hex(code, 2) << " via " << hexf(x4);
    const std::uint8_t want5 = std::isnan(x5) ? static_cast<std::uint8_t>(code | 0x02) : code;
    EXPECT_EQ(f8e5m2(x5).bits(), want5) << "e5m2 " << hex(code, 2) << " via " << hexf(x5);
  }
}

// ---- an independent oracle: nearest representable value, in double ----------

// Finite non-negative values of a format in code order, and the value one step
// past max (where the next code would be), for the overflow tie.
template <class T>
struct Table {
  std::vector<double> values;
  double beyond;
};

template <class T>
Table<T> make_table() {
  Table<T> t;
  const std::uint32_t max_code = detail::spec_of<T>().max_code;
  for (std::uint32_t c = 0; c <= max_code; ++c) {
    t.values.push_back(static_cast<double>(static_cast<float>(T::from_bits(static_cast<typename T::storage_type>(c)))));
  }
  const double top = t.values[max_code];
  t.beyond = top + (top - t.values[max_code - 1]);
  return t;
}

// Round-to-nearest-even by search; returns the magnitude code, or max_code + 1
// for overflow.
template <class T>
std::uint32_t oracle_magnitude(const Table<T>& t, double ax) {
  const auto& v = t.values;
  const std::uint32_t max_code = static_cast<std::uint32_t>(v.size() - 1);
  if (ax >= t.beyond) return max_code + 1;
  if (ax > v.back()) {
    const double mid = (v.back() + t.beyond) / 2;
    if (ax < mid) return max_code;
    if (ax > mid) return max_code + 1;
    return (max_code & 1u) ? max_code + 1 : max_code;
  }
  const auto it = std::lower_bound(v.begin(), v.end(), ax);
  const auto hi = static_cast<std::uint32_t>(it - v.begin());
  if (v[hi] == ax || hi == 0) return hi;
  const std::uint32_t lo = hi - 1;
  const double dlo = ax - v[lo], dhi = v[hi] - ax;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) ? hi : lo;
}

template <class T>
void check_against_oracle() {
  const Table<T> table = make_table<T>();
  const auto& spec = detail::spec_of<T>();
  std::vector<float> inputs;
  // Every code's value, the midpoints between neighbours, and one fp32 ulp either side.
  for (std::size_t i = 0; i + 1 < table.values.size(); ++i) {
    for (double v : {table.values[i], (table.values[i] + table.values[i + 1]) / 2}) {
      const float fv = static_cast<float>(v);
      inputs.push_back(fv);
      inputs.push_back(std::nextafter(fv, 0.0f));
      inputs.push_back(std::nextafter(fv, INFINITY));
    }
  }
  const float mid_top = static_cast<float>((table.values.back() + table.beyond) / 2);
  for (float fv : {mid_top, std::nextafter(mid_top, 0.0f), std::nextafter(mid_top, INFINITY),
                   static_cast<float>(table.beyond), 0x1p-149f, 3.0e38f}) {
    inputs.push_back(fv);
  }
  std::mt19937 rng(12345);
  for (int i = 0; i < 200000; ++i) inputs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng()) & 0x7f7fffffu));

  for (float x : inputs) {
    for (float sx : {x, -x}) {
      std::uint32_t mag = oracle_magnitude(table, std::fabs(static_cast<double>(sx)));
      const std::uint32_t sign = std::signbit(sx) ? (1u << (spec.bits - 1)) : 0u;
      const std::uint32_t want = sign | (mag > spec.max_code ? spec.overflow_code : mag);
      const auto got = encode<T>(sx).bits();
      ASSERT_EQ(got, want) << format_traits<T>::name << " input " << hexf(sx) << " gave " << hex(got, 4)
                           << ", oracle says " << hex(want, 4);
    }
  }
}

TEST(ScalarOracle, F16) { check_against_oracle<f16>(); }
TEST(ScalarOracle, BF16) { check_against_oracle<bf16>(); }
TEST(ScalarOracle, E4M3) { check_against_oracle<f8e4m3>(); }
TEST(ScalarOracle, E5M2) { check_against_oracle<f8e5m2>(); }

// ---- stochastic rounding -------------------------------------------------------

TEST(ScalarStochastic, ExactValuesNeverMove) {
  for (std::uint32_t r : {0u, 1u, 0x80000000u, 0xffffffffu}) {
    EXPECT_EQ(encode_stochastic<bf16>(1.0f, r).bits(), 0x3f80);
    EXPECT_EQ(encode_stochastic<f16>(-2.0f, r).bits(), 0xc000);
    EXPECT_EQ(encode_stochastic<f8e4m3>(448.0f, r).bits(), 0x7e);
  }
}

TEST(ScalarStochastic, RoundsUpWithProbabilityOfTheDistance) {
  // 1 + 0.25 ulp of bf16: up with probability 1/4 (random word >= 0.75 * 2^32).
  const float x = std::bit_cast<float>(0x3f804000u);
  EXPECT_EQ(encode_stochastic<bf16>(x, 0xbfffffffu).bits(), 0x3f80);
  EXPECT_EQ(encode_stochastic<bf16>(x, 0xc0000000u).bits(), 0x3f81);
  std::mt19937 rng(7);
  int up = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) up += encode_stochastic<bf16>(x, static_cast<std::uint32_t>(rng())).bits() == 0x3f81;
  EXPECT_NEAR(up / double(n), 0.25, 0.005);
  // The mean of many stochastic roundings of a subnormal f16 value is the value.
  const float tiny = 0x1.8p-25f;  // 0.75 of the smallest f16 subnormal
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += static_cast<double>(decode(encode_stochastic<f16>(tiny, static_cast<std::uint32_t>(rng()))));
  EXPECT_NEAR(sum / n / static_cast<double>(tiny), 1.0, 0.01);
  // Overflow under stochastic rounding follows the overflow mode.
  EXPECT_EQ(encode_stochastic<f16>(65535.0f, 0xffffffffu).bits(), 0x7c00);
  EXPECT_EQ(encode_stochastic<f16>(65535.0f, 0xffffffffu, kSat).bits(), 0x7bff);
}

// ---- traits and E8M0 -----------------------------------------------------------

TEST(Traits, MatchTheReferenceTable) {
  EXPECT_EQ(format_traits<f16>::max_finite, 65504.0f);
  EXPECT_EQ(format_traits<f16>::min_normal, std::ldexp(1.0f, -14));
  EXPECT_EQ(format_traits<f16>::min_subnormal, std::ldexp(1.0f, -24));
  EXPECT_EQ(format_traits<bf16>::max_finite, decode(bf16::from_bits(0x7f7f)));
  EXPECT_EQ(format_traits<bf16>::min_subnormal, decode(bf16::from_bits(0x0001)));
  EXPECT_EQ(format_traits<f8e4m3>::max_finite, 448.0f);
  EXPECT_FALSE(format_traits<f8e4m3>::has_infinity);
  EXPECT_EQ(format_traits<f8e5m2>::max_finite, 57344.0f);
  EXPECT_EQ(format_traits<f8e5m2>::min_subnormal, std::ldexp(1.0f, -16));
  // Each trait equals the value its code decodes to.
  EXPECT_EQ(format_traits<f8e4m3>::min_subnormal, decode(f8e4m3::from_bits(0x01)));
  EXPECT_EQ(format_traits<f8e4m3>::min_normal, decode(f8e4m3::from_bits(0x08)));
  EXPECT_EQ(1.0f + format_traits<f8e4m3>::epsilon, decode(f8e4m3::from_bits(0x39)));
  EXPECT_EQ(1.0f + format_traits<f8e5m2>::epsilon, decode(f8e5m2::from_bits(0x3d)));
  EXPECT_EQ(1.0f + format_traits<f16>::epsilon, decode(f16::from_bits(0x3c01)));
  EXPECT_EQ(1.0f + format_traits<bf16>::epsilon, decode(bf16::from_bits(0x3f81)));
  EXPECT_EQ(format_traits<e8m0>::max_finite, static_cast<float>(e8m0::from_bits(0xfe)));
  EXPECT_EQ(format_traits<e8m0>::min_normal, static_cast<float>(e8m0::from_bits(0x00)));
}

TEST(E8M0, EveryCode) {
  for (int c = 0; c < 255; ++c) {
    const float v = static_cast<float>(e8m0::from_bits(static_cast<std::uint8_t>(c)));
    EXPECT_EQ(v, std::ldexp(1.0f, c - 127)) << "code " << hex(c, 2);
    EXPECT_EQ(e8m0(v).bits(), c) << "round trip of " << hex(c, 2);
    EXPECT_EQ(e8m0::from_exponent(c - 127).bits(), c);
  }
  EXPECT_TRUE(std::isnan(static_cast<float>(e8m0::from_bits(0xff))));
}

TEST(E8M0, NearestPowerOfTwo) {
  EXPECT_EQ(e8m0(1.49f).exponent(), 0);
  EXPECT_EQ(e8m0(1.5f).exponent(), 1);  // the midpoint rounds up
  EXPECT_EQ(e8m0(0.75f).exponent(), 0);
  EXPECT_EQ(e8m0(0.7f).exponent(), -1);
  EXPECT_EQ(e8m0(1e-45f).bits(), 0);  // below 2^-127: the smallest scale
  EXPECT_EQ(e8m0(0x1.8p-127f).bits(), 1);
  EXPECT_EQ(e8m0(0x1.7ffffcp127f).bits(), 0xfe);
  EXPECT_EQ(e8m0(0x1.8p127f).bits(), 0xff);  // overflow: NaN
  EXPECT_EQ(detail::e8m0_encode(0x1.8p127f, Overflow::saturate), 0xfe);
  EXPECT_EQ(e8m0(0.0f).bits(), 0xff);
  EXPECT_EQ(e8m0(-1.0f).bits(), 0xff);
  EXPECT_EQ(e8m0(NAN).bits(), 0xff);
}

// The value types are usable in constant expressions.
static_assert(f16(1.0f).bits() == 0x3c00);
static_assert(static_cast<float>(bf16::from_bits(0x4049)) == 3.140625f);
static_assert(detail::overflow_threshold_bits(detail::kF16Spec) == 0x477ff000u);
static_assert(detail::overflow_threshold_bits(detail::kE4M3Spec) == 0x43e80001u);
static_assert(detail::overflow_threshold_bits(detail::kE5M2Spec) == 0x47700000u);
static_assert(detail::overflow_threshold_bits(detail::kBF16Spec) == 0x7f7f8000u);

}  // namespace
}  // namespace mixprec
