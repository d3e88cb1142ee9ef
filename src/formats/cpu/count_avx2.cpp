// AVX2 back end of the counting pass (formats/count_kernels.hpp; entered only after
// isa_available(Isa::avx2) has checked the CPU). Magnitudes and bounds are below the sign
// bit, so the signed compares give the unsigned order. Each compare's -1 lanes are
// subtracted from per-lane counters: 16-bit lanes for the 16-bit codes, flushed to 64 bits
// every 32767 vectors (before a lane can wrap), 32-bit lanes for fp32 words, flushed every
// 2^30 vectors. Tails run the reference loop. Results equal the reference exactly.
#include "formats/count_kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX2_BEGIN

namespace mixprec::detail {
namespace {

void profile16_avx2(const std::uint16_t* src, std::size_t n, const std::uint16_t* bounds, MagnitudeProfile& out) {
  const __m256i mag = _mm256_set1_epi16(0x7fff);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i b[kCountBounds];
  for (int k = 0; k < kCountBounds; ++k) b[k] = _mm256_set1_epi16(static_cast<short>(bounds[k]));
  __m256i vmax = _mm256_setzero_si256();
  std::size_t i = 0;
  constexpr std::size_t kBlock = 32767;  // vectors per flush: a 16-bit lane counts at most this many
  while (i + 16 <= n) {
    __m256i acc[kCountBounds];
    for (auto& a : acc) a = _mm256_setzero_si256();
    const std::size_t vectors = (n - i) / 16 < kBlock ? (n - i) / 16 : kBlock;
    for (std::size_t v = 0; v < vectors; ++v, i += 16) {
      const __m256i m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), mag);
      vmax = _mm256_max_epu16(vmax, m);
      for (int k = 0; k < kCountBounds; ++k) acc[k] = _mm256_sub_epi16(acc[k], _mm256_cmpgt_epi16(m, b[k]));
    }
    for (int k = 0; k < kCountBounds; ++k) out.above[k] += simd::hsum_epu32(_mm256_madd_epi16(acc[k], ones));
  }
  const std::uint32_t m = simd::hmax_epu16(vmax);
  out.max = m > out.max ? m : out.max;
  profile_range(src + i, n - i, bounds, out);
}

void profile32_avx2(const std::uint32_t* src, std::size_t n, const std::uint32_t* bounds, MagnitudeProfile& out) {
  const __m256i mag = _mm256_set1_epi32(0x7fffffff);
  __m256i b[kCountBounds];
  for (int k = 0; k < kCountBounds; ++k) b[k] = _mm256_set1_epi32(static_cast<int>(bounds[k]));
  __m256i vmax = _mm256_setzero_si256();
  std::size_t i = 0;
  constexpr std::size_t kBlock = std::size_t{1} << 30;
  while (i + 8 <= n) {
    __m256i acc[kCountBounds];
    for (auto& a : acc) a = _mm256_setzero_si256();
    const std::size_t vectors = (n - i) / 8 < kBlock ? (n - i) / 8 : kBlock;
    for (std::size_t v = 0; v < vectors; ++v, i += 8) {
      const __m256i m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), mag);
      vmax = _mm256_max_epu32(vmax, m);
      for (int k = 0; k < kCountBounds; ++k) acc[k] = _mm256_sub_epi32(acc[k], _mm256_cmpgt_epi32(m, b[k]));
    }
    for (int k = 0; k < kCountBounds; ++k) out.above[k] += simd::hsum_epu32(acc[k]);
  }
  const std::uint32_t m = simd::hmax_epu32(vmax);
  out.max = m > out.max ? m : out.max;
  profile_range(src + i, n - i, bounds, out);
}

// The largest magnitude of 16-bit codes alone: four independent maxima (the loads, not the
// max chain, set the pace), the tail by the reference loop.
std::uint32_t max16_avx2(const std::uint16_t* src, std::size_t n) {
  const __m256i mag = _mm256_set1_epi16(0x7fff);
  auto at = [&](std::size_t i) {
    return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), mag);
  };
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    m0 = _mm256_max_epu16(m0, at(i));
    m1 = _mm256_max_epu16(m1, at(i + 16));
    m2 = _mm256_max_epu16(m2, at(i + 32));
    m3 = _mm256_max_epu16(m3, at(i + 48));
  }
  for (; i + 16 <= n; i += 16) m0 = _mm256_max_epu16(m0, at(i));
  const std::uint32_t m = simd::hmax_epu16(_mm256_max_epu16(_mm256_max_epu16(m0, m1), _mm256_max_epu16(m2, m3)));
  return max_range(src + i, n - i, m);
}

}  // namespace

const CountKernels* avx2_count_kernels() noexcept {
  static const CountKernels table{Isa::avx2, &profile16_avx2, &profile32_avx2, &max16_avx2};
  return &table;
}

}  // namespace mixprec::detail

MIXPREC_TARGET_END

#else  // not x86-64

namespace mixprec::detail {
const CountKernels* avx2_count_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
