// All 2^32 fp32 inputs, split across every core:
//  - f32 -> f16 from the scalar reference equals the x86 F16C instruction
//    (checked inside the f16 default-mode sweep, to run the reference once);
//  - for every format, the SIMD back ends (plain and counting: AVX2, and
//    AVX-512's own f16/bf16 encodes) equal the scalar reference, codes and
//    counts, in the default and the saturate + flush modes;
//  - for f16 and bf16, store and round (every back end, plain and counting)
//    equals encode then decode: codes, rounded values, counts and amax.
// The scalar reference costs ~5 ns an element here, so each sweep takes
// about 2^32 * 5 ns / cores: ~11 s on two cores.
// The sanitizer build sweeps a sample (every 251st chunk).
#include <gtest/gtest.h>

#include <bit>
#include <type_traits>
#include <string>
#include <iostream>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mixprec/mixprec.hpp"
#include "formats/backends.hpp"
#include "support.hpp"

namespace mixprec {
namespace {

using test::Failures;
using test::hex;

constexpr std::uint64_t kAll = std::uint64_t{1} << 32;
constexpr std::size_t kChunk = 1 << 16;
constexpr std::uint64_t kStride = MIXPREC_EXHAUSTIVE ? 1 : 251;

void fill_patterns(std::vector<float>& x, std::uint32_t first, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) x[i] = std::bit_cast<float>(first + static_cast<std::uint32_t>(i));
}

#if defined(__x86_64__)
__attribute__((target("f16c,avx"))) void f16c_convert(const float* x, std::uint16_t* h, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), 0));
  }
  for (; i < n; ++i) h[i] = static_cast<std::uint16_t>(_cvtss_sh(x[i], 0));
}
#endif

// The SIMD back ends to sweep for format T (backends.hpp): AVX2, and AVX-512 for the
// 16-bit formats (its table has its own f16/bf16 encodes; its fp8 kernels are AVX2's),
// both of its bf16 encodes where the CPU has AVX512-BF16. All of them are checked in the
// same pass, so the scalar reference runs once. Those this CPU lacks are named.
template <class T>
std::vector<test::Backend> sweep_tables(std::string& missing) {
  return test::simd_backends(missing, std::is_same_v<T, f16> || std::is_same_v<T, bf16>);
}

template <class T>
void sweep_back_end(const ConvertOptions& o, bool check_f16c = false) {
  using S = typename T::storage_type;
  std::string missing;
  const std::vector<test::Backend> tables = sweep_tables<T>(missing);
  if (!missing.empty()) std::cout << "[ NOTE ] not available on this CPU, not swept: " << missing << "\n";
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end here";
  const FormatKernels& ref = kernel_table(Isa::scalar)->get<T>();
  Failures failures;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  struct Buffers {
    std::vector<float> x = std::vector<float>(kChunk);
    std::vector<S> want = std::vector<S>(kChunk), got = std::vector<S>(kChunk), counted = std::vector<S>(kChunk);
    std::vector<std::uint16_t> hw = std::vector<std::uint16_t>(kChunk);
    ConversionStats ref_stats;
    std::vector<ConversionStats> fast_stats;
  };
  std::vector<Buffers> buf(threads);
  for (Buffers& b : buf) b.fast_stats.resize(tables.size());
  test::sweep_patterns(0, kAll, kChunk, kStride, [&](std::uint32_t first, std::size_t n, unsigned t) {
    Buffers& b = buf[t];
    fill_patterns(b.x, first, n);
    b.ref_stats += ref.encode_counted(b.x.data(), b.want.data(), n, o);
#if defined(__x86_64__)
    if (check_f16c) {
      f16c_convert(b.x.data(), b.hw.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        if (b.hw[i] != b.want[i]) {
          failures.add("input " + hex(first + i, 8) + ": reference " + hex(b.want[i], 4) + ", vcvtps2ph " +
                       hex(b.hw[i], 4));
        }
      }
    }
#endif
    for (std::size_t k = 0; k < tables.size(); ++k) {
      const FormatKernels& fast = tables[k].table->get<T>();
      b.fast_stats[k] += fast.encode_counted(b.x.data(), b.counted.data(), n, o);
      fast.encode(b.x.data(), b.got.data(), n, o);
      for (std::size_t i = 0; i < n; ++i) {
        if (b.got[i] != b.want[i] || b.counted[i] != b.want[i]) {
          failures.add("input " + hex(first + i, 8) + ": reference " + hex(b.want[i], 4) + ", " +
                       tables[k].name + " " + hex(b.got[i], 4) + " (counting pass " +
                       hex(b.counted[i], 4) + ")");
        }
      }
    }
  });
  ConversionStats ref_total;
  for (const Buffers& b : buf) ref_total += b.ref_stats;
  EXPECT_EQ(failures.count(), 0u) << format_traits<T>::name << ": " << failures.report();
  for (std::size_t k = 0; k < tables.size(); ++k) {
    ConversionStats fast_total;
    for (const Buffers& b : buf) fast_total += b.fast_stats[k];
    EXPECT_EQ(ref_total, fast_total) << tables[k].name << " counts differ: underflow " << ref_total.underflow
                                     << " vs " << fast_total.underflow << ", subnormal " << ref_total.subnormal
                                     << " vs " << fast_total.subnormal << ", overflow " << ref_total.overflow
                                     << " vs " << fast_total.overflow;
  }
  if (kStride == 1) {
    EXPECT_EQ(ref_total.elements, kAll);
    // Every pattern but the two zeros is nonzero; inf and NaN patterns: 2 * 2^23.
    EXPECT_EQ(ref_total.nonzero, kAll - 2);
    EXPECT_EQ(ref_total.nonfinite_input, std::uint64_t{2} << 23);
  }
}

constexpr ConvertOptions kDefault{};
constexpr ConvertOptions kSatFlush{Overflow::saturate, Subnormals::flush, 1.0f};

// Store and round (encode_round, encode_round_counted) over all 2^32 inputs, for the
// scalar reference and every SIMD back end (sweep_tables). The oracle is the first SIMD
// back end's plain encode and decode, which the sweeps above prove equal to the
// reference: one scalar pass a sweep instead of two.
template <class T>
void sweep_encode_round(const ConvertOptions& o) {
  using S = typename T::storage_type;
  std::string missing;
  const std::vector<test::Backend> tables = sweep_tables<T>(missing);
  if (!missing.empty()) std::cout << "[ NOTE ] not available on this CPU, not swept: " << missing << "\n";
  if (tables.empty()) GTEST_SKIP() << "no SIMD back end here";
  const FormatKernels& ref = kernel_table(Isa::scalar)->get<T>();
  const FormatKernels& oracle = tables.front().table->get<T>();
  const ConvertOptions back{o.overflow, o.subnormals, 1.0f / o.scale};
  Failures failures;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  struct Buffers {
    std::vector<float> x = std::vector<float>(kChunk), want_v = x, ref_v = x, fast_v = x, plain_v = x;
    std::vector<S> want = std::vector<S>(kChunk), ref_c = want, fast_c = want, plain_c = want;
    ConversionStats want_stats, ref_stats;
    std::vector<ConversionStats> fast_stats;
  };
  std::vector<Buffers> buf(threads);
  for (Buffers& b : buf) b.fast_stats.resize(tables.size());
  test::sweep_patterns(0, kAll, kChunk, kStride, [&](std::uint32_t first, std::size_t n, unsigned t) {
    Buffers& b = buf[t];
    fill_patterns(b.x, first, n);
    b.want_stats += oracle.encode_counted(b.x.data(), b.want.data(), n, o);
    oracle.decode(b.want.data(), b.want_v.data(), n, back);
    std::uint32_t want_amax = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t a = (first + static_cast<std::uint32_t>(i)) & 0x7fffffffu;
      want_amax = a > want_amax ? a : want_amax;
    }
    b.ref_v = b.x;
    std::uint32_t ref_amax = 0xdeadbeef;
    b.ref_stats += ref.encode_round_counted(b.ref_v.data(), b.ref_c.data(), n, o, &ref_amax);
    if (ref_amax != want_amax) {
      failures.add("chunk at " + hex(first, 8) + ": amax bits " + hex(want_amax, 8) + ", reference " +
                   hex(ref_amax, 8));
    }
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t w = std::bit_cast<std::uint32_t>(b.want_v[i]);
      const std::uint32_t r = std::bit_cast<std::uint32_t>(b.ref_v[i]);
      if (b.ref_c[i] != b.want[i] || r != w) {
        failures.add("input " + hex(first + i, 8) + ": want code " + hex(b.want[i], 4) + " value " + hex(w, 8) +
                     "; reference " + hex(b.ref_c[i], 4) + " " + hex(r, 8));
      }
    }
    for (std::size_t k = 0; k < tables.size(); ++k) {
      const FormatKernels& fast = tables[k].table->get<T>();
      const std::string name(tables[k].name);
      b.fast_v = b.x;
      b.plain_v = b.x;
      std::uint32_t fast_amax = 0xdeadbeef;
      b.fast_stats[k] += fast.encode_round_counted(b.fast_v.data(), b.fast_c.data(), n, o, &fast_amax);
      fast.encode_round(b.plain_v.data(), b.plain_c.data(), n, o);
      if (fast_amax != want_amax) {
        failures.add("chunk at " + hex(first, 8) + ": amax bits " + hex(want_amax, 8) + ", " + name + " " +
                     hex(fast_amax, 8));
      }
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint32_t w = std::bit_cast<std::uint32_t>(b.want_v[i]);
        const std::uint32_t f = std::bit_cast<std::uint32_t>(b.fast_v[i]);
        const std::uint32_t p = std::bit_cast<std::uint32_t>(b.plain_v[i]);
        if (b.fast_c[i] != b.want[i] || b.plain_c[i] != b.want[i] || f != w || p != w) {
          failures.add("input " + hex(first + i, 8) + ": want code " + hex(b.want[i], 4) + " value " + hex(w, 8) +
                       "; " + name + " counted " + hex(b.fast_c[i], 4) + " " + hex(f, 8) + ", plain " +
                       hex(b.plain_c[i], 4) + " " + hex(p, 8));
        }
      }
    }
  });
  ConversionStats want_total, ref_total;
  for (const Buffers& b : buf) {
    want_total += b.want_stats;
    ref_total += b.ref_stats;
  }
  EXPECT_EQ(failures.count(), 0u) << format_traits<T>::name << ": " << failures.report();
  EXPECT_EQ(want_total, ref_total) << "reference counts differ: underflow " << want_total.underflow << " vs "
                                   << ref_total.underflow << ", subnormal " << want_total.subnormal << " vs "
                                   << ref_total.subnormal << ", overflow " << want_total.overflow << " vs "
                                   << ref_total.overflow;
  for (std::size_t k = 0; k < tables.size(); ++k) {
    ConversionStats fast_total;
    for (const Buffers& b : buf) fast_total += b.fast_stats[k];
    EXPECT_EQ(want_total, fast_total) << tables[k].name << " counts differ: underflow " << want_total.underflow
                                      << " vs " << fast_total.underflow << ", subnormal " << want_total.subnormal
                                      << " vs " << fast_total.subnormal << ", overflow " << want_total.overflow
                                      << " vs " << fast_total.overflow;
  }
  if (kStride == 1) {
    EXPECT_EQ(ref_total.elements, kAll);
    EXPECT_EQ(ref_total.nonfinite_input, std::uint64_t{2} << 23);
  }
}

// SIMD: AVX2 for every format, and AVX-512 for f16 and bf16 (sweep_tables).
TEST(Exhaustive, F16ReferenceEqualsF16CAndSimd) {
#if defined(__x86_64__)
  const bool has_f16c = __builtin_cpu_supports("f16c");
#else
  const bool has_f16c = false;
#endif
  if (!has_f16c) std::printf("no F16C on this CPU: the hardware oracle is not checked\n");
  sweep_back_end<f16>(kDefault, has_f16c);
}
TEST(Exhaustive, BF16SimdEqualsReference) { sweep_back_end<bf16>(kDefault); }
TEST(Exhaustive, E4M3Avx2EqualsReference) { sweep_back_end<f8e4m3>(kDefault); }
TEST(Exhaustive, E5M2Avx2EqualsReference) { sweep_back_end<f8e5m2>(kDefault); }
TEST(Exhaustive, F16SimdEqualsReferenceSaturateFlush) { sweep_back_end<f16>(kSatFlush); }
TEST(Exhaustive, BF16SimdEqualsReferenceSaturateFlush) { sweep_back_end<bf16>(kSatFlush); }
TEST(Exhaustive, E4M3Avx2EqualsReferenceSaturateFlush) { sweep_back_end<f8e4m3>(kSatFlush); }
TEST(Exhaustive, E5M2Avx2EqualsReferenceSaturateFlush) { sweep_back_end<f8e5m2>(kSatFlush); }

TEST(Exhaustive, F16EncodeAndRoundEqualsEncodeThenDecode) { sweep_encode_round<f16>(kDefault); }
TEST(Exhaustive, BF16EncodeAndRoundEqualsEncodeThenDecode) { sweep_encode_round<bf16>(kDefault); }
TEST(Exhaustive, F16EncodeAndRoundEqualsEncodeThenDecodeSaturateFlush) { sweep_encode_round<f16>(kSatFlush); }
TEST(Exhaustive, BF16EncodeAndRoundEqualsEncodeThenDecodeSaturateFlush) { sweep_encode_round<bf16>(kSatFlush); }

}  // namespace
}  // namespace mixprec
