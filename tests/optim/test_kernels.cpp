// The optimizer's update kernels (src/optim/update_impl.hpp), the AVX2 table against
// the scalar reference table, bit for bit: Adam/AdamW in every variant
// (L2, decoupled decay, both lerp forms), SGD in every variant, scale, and the
// stochastic-rounding words, on sizes around the vector widths and with special values.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mixprec/core/isa.hpp"
#include "optim/kernels.hpp"

namespace mixprec {
namespace {

using optim_detail::AdamScalars;
using optim_detail::SgdScalars;
using optim_detail::UpdateKernels;

std::vector<float> values(std::size_t n, std::uint32_t seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = normal(rng);
  if (n > 5) {  // what a gradient or a moment can also hold
    v[1] = 0.0f;
    v[2] = -0.0f;
    v[3] = 1e-42f;  // subnormal
    v[4] = -3e38f;
  }
  return v;
}

std::vector<float> positive(std::vector<float> v) {
  for (float& x : v) x = std::fabs(x);
  return v;
}

std::string hex(float x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", std::bit_cast<std::uint32_t>(x));
  return buf;
}

void expect_bitwise(const std::vector<float>& want, const std::vector<float>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(want[i]), std::bit_cast<std::uint32_t>(got[i]))
        << what << " [" << i << "]: " << hex(got[i]) << " (" << got[i] << "), the reference " << hex(want[i]) << " ("
        << want[i] << ")";
  }
}

std::vector<const UpdateKernels*> simd_tables(std::vector<std::string>& names) {
  std::vector<const UpdateKernels*> out;
  const std::pair<Isa, const UpdateKernels*> all[] = {{Isa::avx2, optim_detail::avx2_update_kernels()},
                                                      {Isa::avx512, optim_detail::avx512_update_kernels()}};
  for (const auto& [isa, table] : all) {
    if (!isa_available(isa) || table == nullptr) {
      std::printf("[  SKIP    ] back end %s: not available on this CPU or build\n", std::string(isa_name(isa)).c_str());
      continue;
    }
    out.push_back(table);
    names.emplace_back(isa_name(isa));
  }
  return out;
}

constexpr std::size_t kSizes[] = {1, 7, 15, 16, 17, 31, 33, 64, 1000, 1024, 4099};

// divide (the quotients x / d inside the steps and codecs, by FMAs in the vector back ends:
// optim/kernels.hpp's Divisor) gives the divider's bits, NaN payloads included. Every fp32
// significand (in [1, 2), both signs) against divisors including the all-ones significand and
// the Adam bias corrections; then every exponent of x, subnormals included, against divisors
// at the ends of the range, where the FMA path must step aside.
void expect_divide(const UpdateKernels& t, const std::string& name, const std::vector<float>& x, float d) {
  std::vector<float> q(x.size());
  t.divide(x.data(), q.data(), x.size(), d);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float want = x[i] / d;
    if (std::bit_cast<std::uint32_t>(q[i]) != std::bit_cast<std::uint32_t>(want)) {
      ADD_FAILURE() << name << ": " << hex(x[i]) << " / " << hex(d) << " = " << hex(q[i]) << ", the division "
                    << hex(want);
      return;
    }
  }
}

// The sanitizer build (MIXPREC_EXHAUSTIVE 0) takes every 61st significand.
TEST(UpdateKernels, DivideEqualsTheDivisionForEverySignificand) {
  std::vector<std::string> names;
  const auto tables = simd_tables(names);
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end on this CPU (the reference divides)";
  constexpr std::uint32_t kStride = MIXPREC_EXHAUSTIVE ? 1 : 61;
  std::vector<float> x;
  for (std::uint32_t i = 0; i < (1u << 23); i += kStride) {
    x.push_back(std::bit_cast<float>(0x3f800000u | i));
    x.push_back(-std::bit_cast<float>(0x3f800000u | (i ^ 0x2aaaaau)));
  }
  std::mt19937 rng(7);
  std::vector<float> divisors{std::bit_cast<float>(0x3fffffffu), std::bit_cast<float>(0x3f800001u), 1.0f, 3.0f,
                              std::sqrt(1.0f - 0.999f), 1.0f - 0.9f, 1e-12f / 448.0f, 0.3f};
  for (int k = 0; k < 4; ++k) divisors.push_back(std::bit_cast<float>(0x3f800000u | (static_cast<std::uint32_t>(rng()) & 0x7fffffu)));
  for (std::size_t t = 0; t < tables.size(); ++t)
    for (float d : divisors) expect_divide(*tables[t], names[t], x, d);
}

// torchao's E4M3 blocks (encode_fp8_blocks): the vector back ends' codes and scales equal the
// reference's, bit for bit, on blocks built to reach every path: absmax from below torchao's
// 1e-12 clip to 3e38; quotients within ulps of E4M3 rounding midpoints, around 2^-20 and 2^-10 (the
// zero threshold) and down to 2^-89, subnormals, signed zeros; a block holding an inf and one
// holding a NaN (the general path).
TEST(UpdateKernels, Fp8BlockCodesEqualTheReferenceAcrossTheRange) {
  std::vector<std::string> names;
  const auto tables = simd_tables(names);
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end on this CPU";
  const UpdateKernels& ref = optim_detail::scalar_update_kernels();
  constexpr std::size_t kBlock = 256;
  std::mt19937 rng(5);
  std::vector<float> x;
  // Quotients within 3 ulps of E4M3 rounding midpoints (the zero threshold 2^-10, the subnormals'
  // (k + 1/2) 2^-9, the normals' (1 + (2j + 1)/16) 2^e up to 448), under 64 random block scales
  // besides the fixed ones: where a quotient one ulp off rounds to another code, so that a quotient
  // not exactly the division's fails (checked: without the FMA correction, and with q0 kept up to
  // 2^-8, this test fails).
  std::vector<float> mids{0x1p-10f};
  for (int k = 0; k < 7; ++k) mids.push_back((static_cast<float>(k) + 0.5f) * 0x1p-9f);
  for (int e = -6; e <= 8; ++e)
    for (int j = 0; j < 8; ++j)
      if (const float m = std::ldexp(1.0f + (2.0f * static_cast<float>(j) + 1.0f) / 16.0f, e); m < 448.0f) mids.push_back(m);
  std::vector<float> amaxes;
  for (int k = 0; k < 64; ++k)
    amaxes.push_back(std::ldexp(1.0f + static_cast<float>(rng() & 0x7fffff) * 0x1p-23f, static_cast<int>(rng() % 60) - 30));
  for (const float amax : amaxes) {
    const float scale = amax / 448.0f;
    std::vector<float> near;
    for (const float m : mids)
      for (int off = -3; off <= 3; ++off) {
        const std::int32_t bits = static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(m * scale)) + off;
        near.push_back(((near.size() & 1) != 0 ? -1.0f : 1.0f) * std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
      }
    for (std::size_t k = 0; k < near.size(); k += kBlock - 1) {
      std::vector<float> b(kBlock, 0.0f);
      b[0] = amax;
      for (std::size_t i = 0; i + 1 < kBlock && k + i < near.size(); ++i) b[1 + i] = near[k + i];
      x.insert(x.end(), b.begin(), b.end());
    }
  }
  for (const float amax : {1e-13f, 1e-12f, 3e-9f, 1.0f, 448.0f, 7.5e20f, 3e38f}) {
    const float scale = (amax < 1e-12f ? 1e-12f : amax) / 448.0f;
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<float> b(kBlock);
      for (std::size_t i = 0; i < kBlock; ++i) {
        const float sign = (rng() & 1) != 0 ? -1.0f : 1.0f;
        float q;  // the intended quotient
        switch (kind) {
          case 0: q = std::ldexp(1.0f + static_cast<float>(rng() % 8) / 8.0f + 1.0f / 16.0f,  // midpoints
                                 static_cast<int>(rng() % 15) - 6); break;
          case 1: q = std::ldexp(1.0f + static_cast<float>(rng() & 0xffff) / 65536.0f,  // around 2^-20 and 2^-10
                                 (rng() & 1) != 0 ? -21 : -11); break;
          case 2: q = std::ldexp(1.0f, -static_cast<int>(rng() % 90)); break;  // down to 2^-89
          default: q = static_cast<float>(rng() % 1000) / 1000.0f * 448.0f; break;
        }
        b[i] = sign * q * scale;
      }
      b[0] = amax;  // the block's absmax
      b[1] = -0.0f;
      b[2] = std::numeric_limits<float>::denorm_min();
      b[3] = -1e-40f;
      x.insert(x.end(), b.begin(), b.end());
    }
  }
  std::vector<float> special(kBlock, 0.5f);
  special[7] = std::numeric_limits<float>::infinity();
  x.insert(x.end(), special.begin(), special.end());
  special[7] = std::bit_cast<float>(0xffc01234u);
  x.insert(x.end(), special.begin(), special.end());
  const std::size_t n = x.size();
  std::vector<std::uint8_t> want(n), got(n);
  std::vector<float> want_s(n / kBlock), got_s(n / kBlock);
  ref.encode_fp8_blocks(x.data(), want.data(), want_s.data(), n, kBlock);
  for (std::size_t t = 0; t < tables.size(); ++t) {
    tables[t]->encode_fp8_blocks(x.data(), got.data(), got_s.data(), n, kBlock);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], want[i]) << names[t] << ": element " << i << " " << hex(x[i]) << " (block scale "
                                 << hex(want_s[i / kBlock]) << "): code " << static_cast<int>(got[i])
                                 << ", the reference " << static_cast<int>(want[i]);
    expect_bitwise(want_s, got_s, names[t] + " scales");
  }
}

// torchao's 8bit and 4bit blocks (encode_map_blocks), signed and unsigned maps: the vector back
// ends' codes and scales equal the reference's on quotients within 3 ulps of every threshold of the
// map (where one ulp changes the code), around zero, and on blocks holding an inf or a NaN,
// under 16 random block scales (checked: keeping the product x * (1 / scale) up to 64 times the
// map's zero band fails this test).
TEST(UpdateKernels, MapBlockCodesEqualTheReferenceAcrossTheRange) {
  std::vector<std::string> names;
  const auto tables = simd_tables(names);
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end on this CPU";
  const UpdateKernels& ref = optim_detail::scalar_update_kernels();
  std::mt19937 rng(6);
  for (const bool eight : {true, false})
    for (const bool is_signed : {true, false}) {
      const optim_detail::CodeMap& map = optim_detail::code_map(eight, is_signed);
      const std::size_t block = eight ? 256 : 128;
      std::vector<float> targets{0.0f, map.zero_band / 2, map.zero_band, 4 * map.zero_band, 64 * map.zero_band};
      for (std::size_t k = 1; k < map.n; ++k) targets.push_back(map.thresholds[k]);
      std::vector<float> x;
      for (int sc = 0; sc < 16; ++sc) {
        const float amax = std::ldexp(1.0f + static_cast<float>(rng() & 0x7fffff) * 0x1p-23f, static_cast<int>(rng() % 60) - 30);
        std::vector<float> near;
        for (const float q : targets)
          for (int off = -3; off <= 3; ++off)
            for (const float sign : {1.0f, -1.0f}) {
              const float v = std::fabs(q) * amax;
              if (v == 0.0f || v >= amax) continue;
              const std::int32_t bits = static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(v)) + off;
              near.push_back(sign * std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
            }
        for (std::size_t k = 0; k < near.size(); k += block - 1) {
          std::vector<float> b(block, 0.0f);
          b[0] = amax;
          for (std::size_t i = 0; i + 1 < block && k + i < near.size(); ++i) b[1 + i] = near[k + i];
          x.insert(x.end(), b.begin(), b.end());
        }
      }
      std::vector<float> special(block, 0.25f);
      special[3] = std::numeric_limits<float>::infinity();
      x.insert(x.end(), special.begin(), special.end());
      special[3] = std::numeric_limits<float>::quiet_NaN();
      x.insert(x.end(), special.begin(), special.end());
      const std::size_t n = x.size(), bytes = eight ? n : n / 2;
      std::vector<std::uint8_t> want(bytes), got(bytes);
      std::vector<float> want_s(n / block), got_s(n / block);
      ref.encode_map_blocks(x.data(), want.data(), want_s.data(), n, block, map);
      for (std::size_t t = 0; t < tables.size(); ++t) {
        tables[t]->encode_map_blocks(x.data(), got.data(), got_s.data(), n, block, map);
        const std::string what = names[t] + (eight ? " 8bit" : " 4bit") + (is_signed ? " signed" : " unsigned");
        for (std::size_t i = 0; i < bytes; ++i)
          ASSERT_EQ(got[i], want[i]) << what << ": code byte " << i << " (element " << (eight ? i : 2 * i) << " "
                                     << hex(x[eight ? i : 2 * i]) << "): " << static_cast<int>(got[i]) << ", the reference "
                                     << static_cast<int>(want[i]);
        expect_bitwise(want_s, got_s, what + " scales");
      }
    }
}

TEST(UpdateKernels, DivideEqualsTheDivisionAtTheEndsOfTheRange) {
  std::vector<std::string> names{"scalar"};
  std::vector<const UpdateKernels*> tables{&optim_detail::scalar_update_kernels()};
  for (const UpdateKernels* t : simd_tables(names)) tables.push_back(t);
  std::mt19937 rng(11);
  std::vector<float> x;
  for (std::uint32_t e = 0; e < 255; ++e)  // every exponent, subnormals (e = 0) included
    for (int k = 0; k < 512; ++k) {
      const std::uint32_t bits = (e << 23) | (k < 2 ? (k == 0 ? 0u : 0x7fffffu) : (static_cast<std::uint32_t>(rng()) & 0x7fffffu));
      x.push_back(std::bit_cast<float>(bits | (k % 3 == 0 ? 0x80000000u : 0u)));
    }
  const float inf = std::numeric_limits<float>::infinity();
  for (float s : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0x7fa00001u),
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()})
    x.push_back(s);
  const std::vector<float> divisors{1.0f,      0.75f,     0x1p-100f, 0x1p100f,  0x1p-126f, 0x1.8p-127f,  // subnormal
                                    0x1p126f,  0x1p127f,  3e38f,     1e-12f / 448.0f, 0.0f, -2.5f, inf,
                                    std::numeric_limits<float>::quiet_NaN()};
  for (std::size_t t = 0; t < tables.size(); ++t)
    for (float d : divisors) expect_divide(*tables[t], names[t], x, d);
}

TEST(UpdateKernels, AdamEveryVariantEqualsTheReference) {
  std::vector<std::string> names;
  const auto tables = simd_tables(names);
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end on this CPU";
  const UpdateKernels& ref = optim_detail::scalar_update_kernels();
  int cases = 0;
  for (int k = 0; k < 8; ++k) {
    AdamScalars s{};
    s.lerp_low = (k & 1) != 0;
    s.weight = s.lerp_low ? 0.1f : 0.7f;
    s.one_minus_weight = 1.0f - s.weight;
    s.beta2 = 0.999f;
    s.one_minus_beta2 = 1.0f - s.beta2;
    s.eps = 1e-8f;
    s.decoupled = (k & 2) != 0;
    s.l2 = (k & 4) != 0;
    s.weight_decay = 0.01f;
    s.decay_mul = 1.0f - 3e-4f * 0.01f;
    s.neg_step_size = -3e-4f / (1.0f - 0.9f * 0.9f);
    s.bc2_sqrt = optim_detail::divisor(std::sqrt(1.0f - 0.999f * 0.999f));
    for (std::size_t n : kSizes) {
      const auto g = values(n, 1 + static_cast<std::uint32_t>(n), 4096.0f);
      const auto p0 = values(n, 2, 0.05f), m0 = values(n, 3, 1e-3f), v0 = positive(values(n, 4, 1e-6f));
      for (float pre : {1.0f / 4096.0f, 1.0f}) {
        for (float clip : {1.0f, 0.37f}) {
          std::vector<float> p = p0, m = m0, v = v0;
          ref.adam(p.data(), m.data(), v.data(), g.data(), n, pre, clip, s);
          for (std::size_t t = 0; t < tables.size(); ++t) {
            std::vector<float> pt = p0, mt = m0, vt = v0;
            tables[t]->adam(pt.data(), mt.data(), vt.data(), g.data(), n, pre, clip, s);
            const std::string what = names[t] + " adam variant " + std::to_string(k) + " n " + std::to_string(n);
            expect_bitwise(p, pt, what + " p");
            expect_bitwise(m, mt, what + " m");
            expect_bitwise(v, vt, what + " v");
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 0);
}

// bc2_sqrt == 1 (late steps: 1 - beta2^t rounds to 1) skips the division by it, and the vector
// back ends divide by any other bc2_sqrt with FMAs (or, below 2^-30, the divider): every back
// end, the reference included, gives the bits of the update written out with that division
// (by a value the compiler cannot see), NaN and inf states included.
TEST(UpdateKernels, AdamWithoutBiasCorrectionLeftEqualsTheDivision) {
  std::vector<std::string> names{"scalar"};
  std::vector<const UpdateKernels*> tables{&optim_detail::scalar_update_kernels()};
  for (const UpdateKernels* t : simd_tables(names)) tables.push_back(t);
  volatile float one = 1.0f;
  // 2^-31: below the FMA quotient's range for bc2_sqrt (update_impl.hpp's kByFma), the divider.
  for (const float bc2 : {static_cast<float>(one), std::sqrt(1.0f - 0.999f * 0.999f), 0x1p-31f}) {
    AdamScalars s{};
    s.weight = 0.1f;
    s.one_minus_weight = 0.9f;
    s.lerp_low = true;
    s.beta2 = 0.999f;
    s.one_minus_beta2 = 1.0f - s.beta2;
    s.eps = 1e-8f;
    s.decoupled = true;
    s.weight_decay = 0.01f;
    s.decay_mul = 1.0f - 3e-4f * 0.01f;
    s.neg_step_size = -3e-4f;
    s.bc2_sqrt = optim_detail::divisor(bc2);
    const std::size_t n = 1031;
    const auto g = values(n, 9, 1.0f), p0 = values(n, 10, 0.05f), m0 = values(n, 11, 1e-3f);
    auto v0 = positive(values(n, 12, 1e-6f));
    v0[5] = std::bit_cast<float>(0x7fc01234u);  // a NaN state keeps its payload through the quotient
    v0[6] = std::numeric_limits<float>::infinity();
    std::vector<float> p = p0, m = m0, v = v0;
    const float divisor = bc2;  // a runtime value: x / divisor is a division even when it is 1
    for (std::size_t i = 0; i < n; ++i) {
      const float gi = (g[i] * 0.5f) * 1.0f;
      float pi = p[i] * s.decay_mul;
      const float mi = m[i] + s.weight * (gi - m[i]);
      const float vi = v[i] * s.beta2 + (s.one_minus_beta2 * gi) * gi;
      const float denom = std::sqrt(vi) / divisor + s.eps;
      pi = pi + s.neg_step_size * (mi / denom);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
    }
    for (std::size_t t = 0; t < tables.size(); ++t) {
      std::vector<float> pt = p0, mt = m0, vt = v0;
      tables[t]->adam(pt.data(), mt.data(), vt.data(), g.data(), n, 0.5f, 1.0f, s);
      const std::string what = names[t] + " adamw, bc2_sqrt " + hex(bc2);
      expect_bitwise(p, pt, what + " p");
      expect_bitwise(m, mt, what + " m");
      expect_bitwise(v, vt, what + " v");
    }
  }
}

TEST(UpdateKernels, SgdEveryVariantEqualsTheReference) {
  std::vector<std::string> names;
  const auto tables = simd_tables(names);
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end on this CPU";
  const UpdateKernels& ref = optim_detail::scalar_update_kernels();
  for (int k = 0; k < 16; ++k) {
    SgdScalars s{};
    s.has_wd = (k & 1) != 0;
    s.has_momentum = (k & 2) != 0;
    s.first = (k & 4) != 0;
    s.nesterov = (k & 8) != 0;
    s.weight_decay = 1e-4f;
    s.momentum = 0.9f;
    s.one_minus_dampening = 0.9f;
    s.neg_lr = -0.05f;
    for (std::size_t n : kSizes) {
      const auto g = values(n, 5 + static_cast<std::uint32_t>(n), 300.0f);
      const auto p0 = values(n, 6, 0.05f), b0 = values(n, 7, 0.01f);
      std::vector<float> p = p0, b = b0;
      ref.sgd(p.data(), b.data(), g.data(), n, 1.0f / 512.0f, 0.5f, s);
      for (std::size_t t = 0; t < tables.size(); ++t) {
        std::vector<float> pt = p0, bt = b0;
        tables[t]->sgd(pt.data(), bt.data(), g.data(), n, 1.0f / 512.0f, 0.5f, s);
        const std::string what = names[t] + " sgd variant " + std::to_string(k) + " n " + std::to_string(n);
        expect_bitwise(p, pt, what + " p");
        expect_bitwise(b, bt, what + " buf");
      }
    }
  }
}

TEST(UpdateKernels, ScaleAndStochasticRoundingWordsEqualTheReference) {
  std::vector<std::string> names;
  const auto tables = simd_tables(names);
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end on this CPU";
  const UpdateKernels& ref = optim_detail::scalar_update_kernels();
  for (std::size_t n : kSizes) {
    const auto x = values(n, 9, 1000.0f);
    std::vector<float> want(n);
    ref.scale(x.data(), want.data(), n, 0.3f);
    std::vector<std::uint32_t> bits_want(n);
    ref.sr_bits(bits_want.data(), 12345, n, optim_detail::sr_key(7, 3));
    for (std::size_t t = 0; t < tables.size(); ++t) {
      std::vector<float> got(n);
      tables[t]->scale(x.data(), got.data(), n, 0.3f);
      expect_bitwise(want, got, names[t] + " scale n " + std::to_string(n));
      std::vector<float> inplace = x;  // dst may equal src
      tables[t]->scale(inplace.data(), inplace.data(), n, 0.3f);
      expect_bitwise(want, inplace, names[t] + " scale in place n " + std::to_string(n));
      std::vector<std::uint32_t> bits_got(n);
      tables[t]->sr_bits(bits_got.data(), 12345, n, optim_detail::sr_key(7, 3));
      EXPECT_TRUE(bits_got == bits_want) << names[t] << " sr_bits n " << n;
    }
  }
}

}  // namespace
}  // namespace mixprec
