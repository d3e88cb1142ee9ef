// FP8 quantize / dequantize kernels (the formats' back ends behind fp8::quantize,
// dequantize, amax, mx_quantize, mx_dequantize) against the scalar references of
// fp8::reference, bit for bit: every back end this CPU has (scalar always, AVX2 when
// present), through the kernel tables and through the public functions. Inputs mix
// every class (zeros, subnormals, normals near the fp8 boundaries, huge, inf, NaN of
// both signs); lengths cover empty, tails, one SIMD block and its neighbours, several
// MX blocks and the streaming path (> 16 MiB moved) at misaligned starts.
// Failures print the element index and the values in hex.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mixprec/formats/kernel_table.hpp"
#include "mixprec/fp8/quantize.hpp"
#include "support.hpp"

namespace mixprec::fp8 {
namespace {

using test::hex;
using test::hexf;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

std::vector<Isa> isas() {
  std::vector<Isa> v;
  for (Isa i : {Isa::scalar, Isa::avx2}) {
    if (kernel_table(i) != nullptr) v.push_back(i);
  }
  return v;
}

// Values of every class, scaled so that some saturate and some flush at scale 1.
std::vector<float> mixed_values(std::size_t n, std::uint32_t seed, bool specials = true) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> exp2(-30.0f, 20.0f);
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<float> v(n);
  for (float& x : v) {
    const int k = pick(rng);
    if (specials && k == 0) x = kNaN;
    else if (specials && k == 1) x = -kNaN;
    else if (specials && k == 2) x = (rng() & 1) ? kInf : -kInf;
    else if (k < 6) x = (rng() & 1) ? 0.0f : -0.0f;
    else if (k < 9) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng() & 0x807fffffu));  // fp32 subnormal
    else if (k < 12) x = ((rng() & 1) ? 1.0f : -1.0f) * (448.0f + static_cast<float>(rng() % 64));  // E4M3 edge
    else x = ((rng() & 1) ? 1.0f : -1.0f) * std::exp2(exp2(rng));
  }
  return v;
}

template <class T>
std::vector<std::uint8_t> codes(const std::vector<T>& v) {
  std::vector<std::uint8_t> c(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) c[i] = v[i].bits();
  return c;
}

template <class T>
void expect_same_codes(const std::vector<T>& got, const std::vector<T>& want, const std::vector<float>& src,
                       std::size_t offset, const std::string& what) {
  test::Failures f;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (got[i].bits() != want[i].bits()) {
      f.add("[" + std::to_string(i) + "] x=" + hexf(src[offset + i]) + " got " + hex(got[i].bits(), 2) + " want " +
            hex(want[i].bits(), 2));
    }
  }
  EXPECT_EQ(f.count(), 0u) << what << ": " << f.report();
}

void expect_same_floats(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  test::Failures f;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (bits(got[i]) != bits(want[i])) {
      f.add("[" + std::to_string(i) + "] got " + hexf(got[i]) + " want " + hexf(want[i]));
    }
  }
  EXPECT_EQ(f.count(), 0u) << what << ": " << f.report();
}

const std::size_t kLengths[] = {0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 2048, 2049, 4099, 70000};
const float kScales[] = {1.0f, 0.001953125f, 3.0f, 448.0f / 1.5e-5f, 1e-30f};

template <class T>
void check_quantize_kernel(Isa isa) {
  const FormatKernels& k = kernel_table(isa)->get<T>();
  const std::vector<float> src = mixed_values(70000 + 3, 11);
  for (std::size_t n : kLengths) {
    for (std::size_t off : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {
      for (float scale : kScales) {
        const std::vector<float> x(src.begin() + static_cast<std::ptrdiff_t>(off),
                                   src.begin() + static_cast<std::ptrdiff_t>(off + n));
        std::vector<T> want(n), got(n);
        const float ref_amax = reference::quantize<T>(x, want, scale);
        const std::uint32_t m = k.encode_amax(x.data(), got.data(), n, {Overflow::saturate, Subnormals::keep, scale});
        const std::string what = std::string(isa_name(isa)) + " n=" + std::to_string(n) + " off=" +
                                 std::to_string(off) + " scale=" + hexf(scale);
        expect_same_codes(got, want, x, 0, what);
        const float amax = std::bit_cast<float>(m > 0x7f800000u ? 0x7fc00000u : m);
        EXPECT_EQ(bits(amax), bits(ref_amax)) << what << ": amax " << hexf(amax) << " want " << hexf(ref_amax);
      }
    }
  }
}

TEST(Fp8Kernels, QuantizeWithFusedAmaxMatchesReferenceE4M3) {
  for (Isa isa : isas()) check_quantize_kernel<f8e4m3>(isa);
}
TEST(Fp8Kernels, QuantizeWithFusedAmaxMatchesReferenceE5M2) {
  for (Isa isa : isas()) check_quantize_kernel<f8e5m2>(isa);
}

TEST(Fp8Kernels, AmaxMatchesReference) {
  for (Isa isa : isas()) {
    const AmaxKernels& k = kernel_table(isa)->amax;
    for (bool specials : {false, true}) {
      const std::vector<float> src = mixed_values(5000, 5, specials);
      for (std::size_t n : {0, 1, 31, 32, 33, 95, 96, 97, 4999}) {
        const std::span<const float> x(src.data(), n);
        const std::uint32_t m = k.amax_bits(x.data(), n);
        const float got = std::bit_cast<float>(m > 0x7f800000u ? 0x7fc00000u : m);
        EXPECT_EQ(bits(got), bits(reference::amax(x))) << isa_name(isa) << " n=" << n;
      }
    }
    // The classes of the contract: NaN wins over inf, inf over finite, -0 reads as 0.
    const std::vector<float> v = {-0.0f, 1.0f, -kInf, 2.0f};
    EXPECT_EQ(k.amax_bits(v.data(), 1), 0u);
    EXPECT_EQ(k.amax_bits(v.data(), v.size()), 0x7f800000u);
    const std::vector<float> w = {1.0f, -kNaN, -kInf, 3.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
    EXPECT_GT(k.amax_bits(w.data(), w.size()), 0x7f800000u);
  }
  EXPECT_EQ(bits(amax(std::vector<float>{1.0f, -kNaN})), 0x7fc00000u);
}

TEST(Fp8Kernels, BlockAmaxMatchesScalarLoops) {
  const std::vector<float> src = mixed_values(32 * 40 + 13, 9);
  for (Isa isa : isas()) {
    const AmaxKernels& k = kernel_table(isa)->amax;
    for (std::size_t block : {std::size_t{32}, std::size_t{16}, std::size_t{5}}) {
      const std::size_t nb = (src.size() + block - 1) / block;
      std::vector<std::uint32_t> b(nb);
      std::vector<float> f(nb);
      k.block_amax(src.data(), src.size(), block, b.data(), f.data());
      for (std::size_t i = 0; i < nb; ++i) {
        std::uint32_t want_bits = 0;
        float want_f = 0.0f;
        for (std::size_t j = i * block; j < std::min(src.size(), (i + 1) * block); ++j) {
          want_bits = std::max(want_bits, bits(src[j]) & 0x7fffffffu);
          want_f = std::fmax(want_f, std::fabs(src[j]));
        }
        EXPECT_EQ(b[i], want_bits) << isa_name(isa) << " block " << block << " #" << i;
        EXPECT_EQ(bits(f[i]), bits(want_f)) << isa_name(isa) << " block " << block << " #" << i;
      }
    }
  }
}

template <class T>
void check_dequantize_kernel(Isa isa) {
  const FormatKernels& k = kernel_table(isa)->get<T>();
  std::vector<T> all(256 * 3 + 5);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = T::from_bits(static_cast<std::uint8_t>(i * 7));
  for (float scale_inv : {1.0f, 0.125f, 1.0f / 3.0f, 1e30f, 1e-30f}) {
    for (std::size_t n : kLengths) {
      if (n > all.size()) continue;
      const std::vector<T> c(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n));
      std::vector<float> want(n), got(n);
      reference::dequantize<T>(c, want, scale_inv);
      k.decode(c.data(), got.data(), n, {Overflow::ieee, Subnormals::keep, scale_inv});
      expect_same_floats(got, want, std::string(isa_name(isa)) + " n=" + std::to_string(n));
    }
  }
}

TEST(Fp8Kernels, DequantizeMatchesReference) {
  for (Isa isa : isas()) {
    check_dequantize_kernel<f8e4m3>(isa);
    check_dequantize_kernel<f8e5m2>(isa);
  }
}

// Blocks of every kind the MX rules single out: all zero, holding inf, holding NaN,
// amax at a power of two, subnormal-only (fp32 and fp8 subnormal range), ordinary.
std::vector<float> mx_edge_blocks(std::size_t tail) {
  std::vector<float> v;
  auto block = [&](auto gen) {
    for (std::size_t i = 0; i < kMxBlock; ++i) v.push_back(gen(i));
  };
  block([](std::size_t) { return 0.0f; });
  block([](std::size_t i) { return i == 5 ? kInf : 1.0f + static_cast<float>(i); });
  block([](std::size_t i) { return i == 9 ? -kNaN : 0.5f * static_cast<float>(i); });
  block([](std::size_t i) { return i == 0 ? 256.0f : static_cast<float>(i); });
  block([](std::size_t i) { return std::bit_cast<float>(static_cast<std::uint32_t>(1 + i * 999)); });
  block([](std::size_t i) { return std::ldexp(1.0f + static_cast<float>(i) / 32.0f, -130); });
  const std::vector<float> r = mixed_values(kMxBlock * 37 + tail, 21, false);
  v.insert(v.end(), r.begin(), r.end());
  return v;
}

template <class T>
void check_mx(MxRounding rounding) {
  for (std::size_t tail : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{31}}) {
    const std::vector<float> x = mx_edge_blocks(tail);
    const std::size_t nb = mx_blocks(x.size());
    std::vector<T> want(x.size()), got(x.size());
    std::vector<e8m0> ws(nb), gs(nb);
    const float wa = reference::mx_quantize<T>(x, want, ws, rounding);
    const float ga = mx_quantize<T>(x, got, gs, rounding);
    const std::string what = std::string(mx_rounding_name(rounding)) + " tail=" + std::to_string(tail);
    expect_same_codes(got, want, x, 0, what);
    for (std::size_t b = 0; b < nb; ++b) EXPECT_EQ(gs[b].bits(), ws[b].bits()) << what << " block " << b;
    EXPECT_EQ(bits(ga), bits(wa)) << what;
    std::vector<float> wd(x.size()), gd(x.size());
    reference::mx_dequantize<T>(want, ws, wd);
    mx_dequantize<T>(got, gs, gd);
    expect_same_floats(gd, wd, what + " dequantize");
  }
}

TEST(Fp8Kernels, MxQuantizeAndDequantizeMatchReference) {
  for (MxRounding r : {MxRounding::transformer_engine, MxRounding::ocp}) {
    check_mx<f8e4m3>(r);
    check_mx<f8e5m2>(r);
  }
}

TEST(Fp8Kernels, BlockScaledKernelsMatchScalarLoops) {
  const std::vector<float> x = mixed_values(32 * 50 + 7, 33);
  std::vector<float> factors(x.size());
  for (std::size_t i = 0; i < factors.size(); ++i) factors[i] = std::ldexp(1.0f, static_cast<int>(i % 40) - 20);
  for (Isa isa : isas()) {
    for (std::size_t block : {std::size_t{32}, std::size_t{16}, std::size_t{24}}) {
      const FormatKernels& k = kernel_table(isa)->get<f8e4m3>();
      std::vector<f8e4m3> want(x.size()), got(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        want[i] = encode<f8e4m3>(x[i] * factors[i / block], EncodeMode{Overflow::saturate, Subnormals::keep});
      }
      k.encode_block_scaled(x.data(), got.data(), x.size(), block, factors.data(),
                            {Overflow::saturate, Subnormals::keep, 1.0f});
      expect_same_codes(got, want, x, 0, std::string(isa_name(isa)) + " block " + std::to_string(block));
      std::vector<float> wd(x.size()), gd(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) wd[i] = decode(want[i]) * factors[i / block];
      k.decode_block_scaled(want.data(), gd.data(), x.size(), block, factors.data(), {});
      expect_same_floats(gd, wd, std::string(isa_name(isa)) + " decode block " + std::to_string(block));
    }
  }
}

// The streaming path (source + destination >= 16 MiB: non-temporal stores after an
// aligning head) at three misalignments, through the public functions.
TEST(Fp8Kernels, LargeArraysTakeTheStreamingPathBitExact) {
  const std::size_t n = (std::size_t{16} << 20) / 5 + 4099;
  const std::vector<float> src = mixed_values(n + 3, 77);
  for (std::size_t off : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {
    const std::span<const float> x(src.data() + off, n);
    std::vector<f8e4m3> want(n), got(n);
    const float wa = reference::quantize<f8e4m3>(x, want, 2.0f);
    const float ga = quantize<f8e4m3>(x, got, 2.0f);
    EXPECT_EQ(bits(ga), bits(wa)) << "off " << off;
    EXPECT_EQ(codes(got), codes(want)) << "off " << off;
    std::vector<float> wd(n), gd(n);
    reference::dequantize<f8e4m3>(want, wd, 0.5f);
    dequantize<f8e4m3>(got, gd, 0.5f);
    EXPECT_EQ(std::memcmp(wd.data(), gd.data(), n * 4), 0) << "off " << off;
  }
}

TEST(Fp8Kernels, PublicFunctionsValidateBeforeWriting) {
  std::vector<float> x(40, 1.0f);
  std::vector<f8e4m3> q(40, f8e4m3::from_bits(0x11));
  EXPECT_THROW(quantize<f8e4m3>(x, std::span<f8e4m3>(q).first(39), 1.0f), std::invalid_argument);
  EXPECT_THROW(quantize<f8e4m3>(x, q, 0.0f), std::invalid_argument);
  EXPECT_THROW(quantize<f8e4m3>(x, q, kInf), std::invalid_argument);
  EXPECT_THROW(dequantize<f8e4m3>(q, x, -1.0f), std::invalid_argument);
  std::vector<e8m0> s(1);
  EXPECT_THROW(mx_quantize<f8e4m3>(x, q, s), std::invalid_argument);  // needs ceil(40/32) = 2 scales
  for (const f8e4m3& c : q) EXPECT_EQ(c.bits(), 0x11);
}

}  // namespace
}  // namespace mixprec::fp8
