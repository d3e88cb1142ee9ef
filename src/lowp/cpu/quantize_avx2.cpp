// AVX2 back end of lowp's kernel table: 8 elements per register, the same steps as the
// AVX-512 back end (cpu/quantize_avx512.cpp: encode_full in vector form with per-lane
// shifts, counts from compare masks, in-register butterflies for the RHT; 16-element
// groups span two registers). Heads and tails go through the scalar rules.
//
// Compiled for AVX2+FMA per function (target pragma, no -m flags), called only after
// isa_available(Isa::avx2).
#include "lowp/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <bit>
#include <cstdint>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,popcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,popcnt")
#endif

namespace mixprec::lowp::detail {
namespace {

using mixprec::detail::MiniFloatSpec;

inline __m256i set1(std::uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
inline unsigned lanes(__m256i m) {
  return static_cast<unsigned>(std::popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(m)))));
}
// Unsigned a > b for 32-bit lanes.
inline __m256i cmpgt_epu32(__m256i a, __m256i b) {
  const __m256i flip = set1(0x80000000u);
  return _mm256_cmpgt_epi32(_mm256_xor_si256(a, flip), _mm256_xor_si256(b, flip));
}

template <const MiniFloatSpec& S, bool kStochastic>
inline __m256i encode8(__m256 y, __m256i random) {
  constexpr int M = S.man_bits;
  constexpr int kMinNormal = 128 - S.bias;
  const __m256i zero = _mm256_setzero_si256(), one = set1(1);
  const __m256i u = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(u, set1(0x7fffffffu));
  __m256i e32 = _mm256_srli_epi32(a, 23);
  __m256i sig = _mm256_and_si256(a, set1(0x7fffffu));
  const __m256i normal = _mm256_xor_si256(_mm256_cmpeq_epi32(e32, zero), set1(0xffffffffu));
  sig = _mm256_or_si256(sig, _mm256_and_si256(normal, set1(0x800000u)));
  e32 = _mm256_max_epi32(e32, one);
  __m256i shift = _mm256_add_epi32(set1(23 - M), _mm256_max_epi32(_mm256_sub_epi32(set1(kMinNormal), e32), zero));
  const __m256i base = _mm256_slli_epi32(_mm256_max_epi32(_mm256_sub_epi32(e32, set1(kMinNormal)), zero), M);
  const __m256i pre = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(shift, set1(31)), zero), set1(31));
  sig = _mm256_srlv_epi32(sig, pre);
  shift = _mm256_min_epi32(shift, set1(31));
  __m256i add;
  if constexpr (kStochastic) {
    add = _mm256_srlv_epi32(random, _mm256_sub_epi32(set1(32), shift));
  } else {
    add = _mm256_add_epi32(_mm256_sub_epi32(_mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one)), one),
                           _mm256_and_si256(_mm256_srlv_epi32(sig, shift), one));
  }
  __m256i code = _mm256_add_epi32(base, _mm256_srlv_epi32(_mm256_add_epi32(sig, add), shift));
  code = _mm256_min_epu32(code, set1(S.max_code));
  const __m256i nan = cmpgt_epu32(a, set1(0x7f800000u));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), S.bits - 1);
  if constexpr (S.bits == 4) {
    return _mm256_andnot_si256(nan, _mm256_or_si256(code, sign));  // E2M1: NaN -> 0
  } else if constexpr (S.has_inf) {
    const __m256i nan_code = _mm256_or_si256(set1(S.overflow_code | (1u << (M - 1))),
                                             _mm256_srli_epi32(_mm256_and_si256(a, set1(0x7fffffu)), 23 - M));
    return _mm256_or_si256(_mm256_blendv_epi8(code, nan_code, nan), sign);
  } else {
    return _mm256_or_si256(_mm256_blendv_epi8(code, set1(S.nan_code), nan), sign);
  }
}

struct LaneCounts {
  std::uint64_t saturated = 0, flushed = 0, nonfinite = 0;
};

template <const MiniFloatSpec& S>
inline void count8(__m256 x, __m256 y, __m256i code, float max_value, LaneCounts& c) {
  constexpr std::uint32_t kMag = (1u << (S.bits - 1)) - 1;
  const __m256i zero = _mm256_setzero_si256();
  const __m256i ax = _mm256_and_si256(_mm256_castps_si256(x), set1(0x7fffffffu));
  const __m256i nonfinite = cmpgt_epu32(ax, set1(0x7f7fffffu));
  const __m256 ay = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(y), set1(0x7fffffffu)));
  const __m256i sat = _mm256_andnot_si256(nonfinite, _mm256_castps_si256(_mm256_cmp_ps(ay, _mm256_set1_ps(max_value), _CMP_GT_OQ)));
  const __m256i zero_x = _mm256_cmpeq_epi32(ax, zero);
  const __m256i zero_code = _mm256_cmpeq_epi32(_mm256_and_si256(code, set1(kMag)), zero);
  const __m256i flushed = _mm256_andnot_si256(_mm256_or_si256(nonfinite, zero_x), zero_code);
  c.nonfinite += lanes(nonfinite);
  c.saturated += lanes(sat);
  c.flushed += lanes(flushed);
}

template <const MiniFloatSpec& S, bool kStochastic>
void encode_scaled_spec(const float* src, std::size_t n, std::size_t block, const float* factors, std::uint8_t* dst,
                        const std::uint32_t* random, float max_value, EncodeCounts* counts) {
  LaneCounts lc;
  std::size_t i = 0;
  // Byte 0 of every 32-bit lane (fp8) / of every 64-bit lane (e2m1 pairs), per 128-bit half.
  const __m256i gather32 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                                            -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i gather64 = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8, -1, -1,
                                            -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const bool vectors_in_blocks = block % 8 == 0 || block >= n;
  for (; vectors_in_blocks && i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(factors[i / block]));
    const __m256i r = kStochastic ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(random + i)) : _mm256_setzero_si256();
    const __m256i code = encode8<S, kStochastic>(y, r);
    count8<S>(x, y, code, max_value, lc);
    if constexpr (S.bits == 4) {
      const __m256i pairs = _mm256_shuffle_epi8(_mm256_or_si256(code, _mm256_srli_epi64(code, 28)), gather64);
      const std::uint32_t lo = static_cast<std::uint32_t>(_mm256_extract_epi16(pairs, 0));
      const std::uint32_t hi = static_cast<std::uint32_t>(_mm256_extract_epi16(pairs, 8));
      dst[i / 2] = static_cast<std::uint8_t>(lo);
      dst[i / 2 + 1] = static_cast<std::uint8_t>(lo >> 8);
      dst[i / 2 + 2] = static_cast<std::uint8_t>(hi);
      dst[i / 2 + 3] = static_cast<std::uint8_t>(hi >> 8);
    } else {
      const __m256i b = _mm256_shuffle_epi8(code, gather32);
      const std::uint64_t lo = static_cast<std::uint32_t>(_mm256_extract_epi32(b, 0));
      const std::uint64_t hi = static_cast<std::uint32_t>(_mm256_extract_epi32(b, 4));
      const std::uint64_t both = lo | (hi << 32);
      __builtin_memcpy(dst + i, &both, 8);
    }
  }
  EncodeCounts c{lc.saturated, lc.flushed, lc.nonfinite};
  for (; i < n; ++i) {
    const std::uint32_t code = encode_element<S>(src[i], factors[i / block], kStochastic, kStochastic ? random[i] : 0u,
                                                 max_value, c);
    if constexpr (S.bits == 4) {
      if (i % 2 == 0) dst[i / 2] = static_cast<std::uint8_t>(code);
      else dst[i / 2] = static_cast<std::uint8_t>(dst[i / 2] | (code << 4));
    } else {
      dst[i] = static_cast<std::uint8_t>(code);
    }
  }
  counts->saturated += c.saturated;
  counts->flushed += c.flushed;
  counts->nonfinite += c.nonfinite;
}

template <const MiniFloatSpec& S>
void encode_scaled_sr(const float* src, std::size_t n, std::size_t block, const float* factors, std::uint8_t* dst,
                      const std::uint32_t* random, float max_value, EncodeCounts* counts) {
  if (random != nullptr) encode_scaled_spec<S, true>(src, n, block, factors, dst, random, max_value, counts);
  else encode_scaled_spec<S, false>(src, n, block, factors, dst, random, max_value, counts);
}

void encode_scaled_avx2(Element e, const float* src, std::size_t n, std::size_t block, const float* factors,
                        std::uint8_t* dst, const std::uint32_t* random, EncodeCounts* counts) {
  switch (e) {
    case Element::e4m3:
      return encode_scaled_sr<mixprec::detail::kE4M3Spec>(src, n, block, factors, dst, random, 448.0f, counts);
    case Element::e5m2:
      return encode_scaled_sr<mixprec::detail::kE5M2Spec>(src, n, block, factors, dst, random, 57344.0f, counts);
    case Element::e2m1:
      return encode_scaled_sr<kE2M1Spec>(src, n, block, factors, dst, random, 6.0f, counts);
  }
}

inline std::uint32_t hmax_epu32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(m));
}
inline float hmax_ps(__m256 v) {  // no NaN lanes here
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(m);
}

void block_amax_avx2(const float* src, std::size_t n, std::size_t block, float* fmax, std::uint32_t* bits) {
  const __m256i mag = set1(0x7fffffffu);
  for (std::size_t b = 0; b * block < n; ++b) {
    const float* p = src + b * block;
    const std::size_t len = n - b * block < block ? n - b * block : block;
    __m256i mb = _mm256_setzero_si256();
    __m256 mf = _mm256_setzero_ps();
    std::size_t i = 0;
    for (; i + 8 <= len; i += 8) {
      const __m256i a = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p + i)), mag);
      mb = _mm256_max_epu32(mb, a);
      mf = _mm256_max_ps(_mm256_castsi256_ps(a), mf);  // NaN lane: mf kept
    }
    std::uint32_t bm = hmax_epu32(mb);
    float fm = hmax_ps(mf);
    for (; i < len; ++i) {
      const std::uint32_t a = std::bit_cast<std::uint32_t>(p[i]) & 0x7fffffffu;
      bm = a > bm ? a : bm;
      const float f = std::bit_cast<float>(a);
      fm = f > fm ? f : fm;
    }
    bits[b] = bm;
    fmax[b] = fm;
  }
}

inline __m256 decode_e4m3_8(__m256i c) {
  const __m256i e = _mm256_srli_epi32(c, 3), m = _mm256_and_si256(c, set1(7));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, set1(120)), 23), _mm256_slli_epi32(m, 20)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0x1p-9f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
  const __m256 v = _mm256_blendv_ps(normal, sub, is_sub);
  const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(c, set1(0x7f)));
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(set1(0x7fc00000u)), is_nan);
}

void nvfp4_scales_avx2(const float* amax, std::size_t nb, float s_enc_div6, float s_dec, std::uint8_t* codes,
                       float* factors) {
  std::size_t b = 0;
  const __m256 flt_max = _mm256_set1_ps(kFltMax);
  const __m256i gather32 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                                            -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (; b + 8 <= nb; b += 8) {
    const __m256 v = _mm256_min_ps(flt_max, _mm256_mul_ps(_mm256_loadu_ps(amax + b), _mm256_set1_ps(s_enc_div6)));
    const __m256i code = encode8<mixprec::detail::kE4M3Spec, false>(v, _mm256_setzero_si256());
    const __m256 dec = decode_e4m3_8(code);
    const __m256 f = _mm256_min_ps(flt_max, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(dec, _mm256_set1_ps(s_dec))));
    const __m256i by = _mm256_shuffle_epi8(code, gather32);
    const std::uint64_t both = static_cast<std::uint32_t>(_mm256_extract_epi32(by, 0)) |
                               (static_cast<std::uint64_t>(static_cast<std::uint32_t>(_mm256_extract_epi32(by, 4))) << 32);
    __builtin_memcpy(codes + b, &both, 8);
    _mm256_storeu_ps(factors + b, f);
  }
  for (; b < nb; ++b) nvfp4_scale_one(amax[b], s_enc_div6, s_dec, codes[b], factors[b]);
}

template <int kImm>
inline __m256 butterfly_in_lane(__m256 v, __m256i sub_lanes) {
  return _mm256_add_ps(_mm256_permute_ps(v, kImm), _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), sub_lanes)));
}

void rht16_avx2(float* v, std::size_t n) {
  const int s = INT32_MIN;
  const __m256i sign_lo = _mm256_setr_epi32(0, 0, 0, s, 0, s, s, s), sign_hi = _mm256_setr_epi32(s, s, s, 0, s, 0, s, s);
  const __m256i s1 = _mm256_setr_epi32(0, s, 0, s, 0, s, 0, s), s2 = _mm256_setr_epi32(0, 0, s, s, 0, 0, s, s);
  const __m256i s4 = _mm256_setr_epi32(0, 0, 0, 0, s, s, s, s);
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    __m256 lo = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_loadu_ps(v + i)), sign_lo));
    __m256 hi = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_loadu_ps(v + i + 8)), sign_hi));
    lo = butterfly_in_lane<_MM_SHUFFLE(2, 3, 0, 1)>(lo, s1);
    hi = butterfly_in_lane<_MM_SHUFFLE(2, 3, 0, 1)>(hi, s1);
    lo = butterfly_in_lane<_MM_SHUFFLE(1, 0, 3, 2)>(lo, s2);
    hi = butterfly_in_lane<_MM_SHUFFLE(1, 0, 3, 2)>(hi, s2);
    lo = _mm256_add_ps(_mm256_permute2f128_ps(lo, lo, 0x01), _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(lo), s4)));
    hi = _mm256_add_ps(_mm256_permute2f128_ps(hi, hi, 0x01), _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(hi), s4)));
    const __m256 a = _mm256_add_ps(lo, hi), b = _mm256_sub_ps(lo, hi);
    _mm256_storeu_ps(v + i, _mm256_mul_ps(a, _mm256_set1_ps(0.25f)));
    _mm256_storeu_ps(v + i + 8, _mm256_mul_ps(b, _mm256_set1_ps(0.25f)));
  }
}

}  // namespace
}  // namespace mixprec::lowp::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace mixprec::lowp::detail {
namespace {
const LowpKernels kAvx2{Isa::avx2, &block_amax_avx2, &encode_scaled_avx2, &nvfp4_scales_avx2, &rht16_avx2};
}  // namespace
const LowpKernels* avx2_kernels() noexcept { return &kAvx2; }
}  // namespace mixprec::lowp::detail

#else
namespace mixprec::lowp::detail {
const LowpKernels* avx2_kernels() noexcept { return nullptr; }
}  // namespace mixprec::lowp::detail
#endif
