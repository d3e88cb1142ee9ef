// AVX-512 (F/BW) back end of the counting pass (formats/count_kernels.hpp; entered only
// after isa_available(Isa::avx512) has checked the CPU): 32 codes or 16 fp32 words a vector,
// one unsigned compare into a mask per bound, added into per-lane counters under that mask
// (16-bit lanes flushed every 32767 vectors, 32-bit lanes every 2^26): no trip of each mask
// through a general register and popcnt. The tail is one masked load: its cleared lanes
// read as +0, which lies above no bound and raises no max, so the tail is counted by the
// same instructions. Results equal the reference exactly.
#include "formats/count_kernels.hpp"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX512F_BW_BEGIN

namespace mixprec::detail {
namespace {

void profile16_avx512(const std::uint16_t* src, std::size_t n, const std::uint16_t* bounds, MagnitudeProfile& out) {
  const __m512i mag = _mm512_set1_epi16(0x7fff);
  const __m512i one = _mm512_set1_epi16(1);
  __m512i b[kCountBounds];
  for (int k = 0; k < kCountBounds; ++k) b[k] = _mm512_set1_epi16(static_cast<short>(bounds[k]));
  __m512i vmax = _mm512_setzero_si512();
  __m512i acc[kCountBounds];
  auto step = [&](__m512i v) {
    const __m512i m = _mm512_and_si512(v, mag);
    vmax = _mm512_max_epu16(vmax, m);
    for (int k = 0; k < kCountBounds; ++k)
      acc[k] = _mm512_mask_add_epi16(acc[k], _mm512_cmpgt_epu16_mask(m, b[k]), acc[k], one);
  };
  std::size_t i = 0;
  constexpr std::size_t kBlock = 32767;  // vectors per flush: a 16-bit lane counts at most this many
  while (i < n) {
    for (auto& a : acc) a = _mm512_setzero_si512();
    const std::size_t vectors = (n - i) / 32 < kBlock ? (n - i) / 32 : kBlock;
    for (std::size_t v = 0; v < vectors; ++v, i += 32) step(_mm512_loadu_si512(src + i));
    if (vectors < kBlock && i < n) {
      step(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << (n - i)) - 1u), src + i));
      i = n;
    }
    for (int k = 0; k < kCountBounds; ++k) out.above[k] += simd::hsum_epu16_below_2p15(acc[k]);
  }
  const std::uint32_t m = simd::hmax_epu16(vmax);
  out.max = m > out.max ? m : out.max;
}

void profile32_avx512(const std::uint32_t* src, std::size_t n, const std::uint32_t* bounds, MagnitudeProfile& out) {
  const __m512i mag = _mm512_set1_epi32(0x7fffffff);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i b[kCountBounds];
  for (int k = 0; k < kCountBounds; ++k) b[k] = _mm512_set1_epi32(static_cast<int>(bounds[k]));
  __m512i vmax = _mm512_setzero_si512();
  __m512i acc[kCountBounds];
  auto step = [&](__m512i v) {
    const __m512i m = _mm512_and_si512(v, mag);
    vmax = _mm512_max_epu32(vmax, m);
    for (int k = 0; k < kCountBounds; ++k)
      acc[k] = _mm512_mask_add_epi32(acc[k], _mm512_cmpgt_epu32_mask(m, b[k]), acc[k], one);
  };
  std::size_t i = 0;
  constexpr std::size_t kBlock = std::size_t{1} << 26;  // 16 lanes of at most 2^26: the sum fits 32 bits
  while (i < n) {
    for (auto& a : acc) a = _mm512_setzero_si512();
    const std::size_t vectors = (n - i) / 16 < kBlock ? (n - i) / 16 : kBlock;
    for (std::size_t v = 0; v < vectors; ++v, i += 16) step(_mm512_loadu_si512(src + i));
    if (vectors < kBlock && i < n) {
      step(_mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (n - i)) - 1u), src + i));
      i = n;
    }
    for (int k = 0; k < kCountBounds; ++k)
      out.above[k] += static_cast<std::uint32_t>(_mm512_reduce_add_epi32(acc[k]));
  }
  out.max = std::max(out.max, _mm512_reduce_max_epu32(vmax));
}

// The largest magnitude of 16-bit codes alone: four independent maxima, the tail one masked
// load (its cleared lanes read as +0, which raises no max).
std::uint32_t max16_avx512(const std::uint16_t* src, std::size_t n) {
  const __m512i mag = _mm512_set1_epi16(0x7fff);
  auto at = [&](std::size_t i) { return _mm512_and_si512(_mm512_loadu_si512(src + i), mag); };
  __m512i m0 = _mm512_setzero_si512(), m1 = m0, m2 = m0, m3 = m0;
  std::size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    m0 = _mm512_max_epu16(m0, at(i));
    m1 = _mm512_max_epu16(m1, at(i + 32));
    m2 = _mm512_max_epu16(m2, at(i + 64));
    m3 = _mm512_max_epu16(m3, at(i + 96));
  }
  for (; i + 32 <= n; i += 32) m0 = _mm512_max_epu16(m0, at(i));
  if (i < n) {
    const __m512i tail = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << (n - i)) - 1u), src + i);
    m1 = _mm512_max_epu16(m1, _mm512_and_si512(tail, mag));
  }
  return simd::hmax_epu16(_mm512_max_epu16(_mm512_max_epu16(m0, m1), _mm512_max_epu16(m2, m3)));
}

}  // namespace

const CountKernels* avx512_count_kernels() noexcept {
  static const CountKernels table{Isa::avx512, &profile16_avx512, &profile32_avx512, &max16_avx512};
  return &table;
}

}  // namespace mixprec::detail

MIXPREC_TARGET_END

#else  // not x86-64

namespace mixprec::detail {
const CountKernels* avx512_count_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
