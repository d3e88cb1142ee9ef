// Private: the horizontal reductions of the SIMD back ends (one vector to one number), each
// defined once, in the narrowest ISA region that holds it (core/simd_target.hpp); every
// back end's region enables a superset, so they inline into its kernels. Integer results
// are exact whatever the order; the float ones keep a fixed order, which their callers'
// results depend on bit for bit.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX2_BEGIN
namespace mixprec::simd {

// Sum of the 8 lanes: (lanes 0-3 + lanes 4-7), then the halves of that, then its two lanes.
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// Max of the 8 lanes, in hsum's order (which matters for NaN: maxps returns its second
// operand when either is NaN).
inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}

// Unsigned max of the 8 32-bit lanes.
inline std::uint32_t hmax_epu32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(m));
}

// Unsigned max of the 16 16-bit lanes.
inline std::uint32_t hmax_epu16(__m256i v) {
  __m128i m = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0xb1));
  m = _mm_max_epu16(m, _mm_srli_epi32(m, 16));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(m)) & 0xffffu;
}

// Sum of the 8 32-bit lanes, each read as unsigned, in 64 bits (lane counters).
inline std::uint64_t hsum_epu32(__m256i v) {
  alignas(32) std::uint32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), v);
  std::uint64_t t = 0;
  for (std::uint32_t x : l) t += x;
  return t;
}

}  // namespace mixprec::simd
MIXPREC_TARGET_END

MIXPREC_TARGET_AVX512F_BW_BEGIN
namespace mixprec::simd {

// Sum of the 16 32-bit lanes, each read as unsigned, in 64 bits (lane counters).
inline std::uint64_t hsum_epu32(__m512i v) {
  return static_cast<std::uint64_t>(_mm512_reduce_add_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(v)))) +
         static_cast<std::uint64_t>(_mm512_reduce_add_epi64(_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}

// Sum of the 32 16-bit lanes, each below 2^15 (madd pairs them into 32 bits).
inline std::uint64_t hsum_epu16_below_2p15(__m512i v) {
  return static_cast<std::uint64_t>(_mm512_reduce_add_epi32(_mm512_madd_epi16(v, _mm512_set1_epi16(1))));
}

// Unsigned max of the 32 16-bit lanes.
inline std::uint32_t hmax_epu16(__m512i v) {
  alignas(64) std::uint16_t l[32];
  _mm512_store_si512(l, v);
  std::uint32_t m = 0;
  for (std::uint16_t x : l) m = x > m ? x : m;
  return m;
}

}  // namespace mixprec::simd
MIXPREC_TARGET_END

#endif  // __x86_64__
