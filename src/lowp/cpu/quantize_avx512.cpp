// AVX-512 back end of lowp's kernel table: 16 elements per register.
//
// The codes are the SIMD back ends' minifloat encoder (formats/cpu/minifloat_simd.hpp) in 16
// lanes with mask registers. Round to nearest even uses its integer/fp32-add trick
// (finite_magnitude_code16; vectors with a non-finite |y| take encode16_rne, which adds the NaN
// codes). Stochastic rounding is the library's scalar encode_full (formats/scalar.hpp) in
// vector form (encode16): the fp32 significand shifted right by a per-lane distance (vpsrlvd)
// after adding the caller's random bits, then the format's exponent base, saturated with an
// unsigned min. Both equal the scalar rule bit for bit (tests/lowp). Counts are lane masks
// (popcount). Block maxima (magnitude bits; the float max derived from them) of 16 blocks
// share one transpose-reduction. The RHT is four in-register butterflies of one fma each.
// Heads and tails go through the scalar rules of lowp/kernels.hpp.
//
// Compiled for AVX-512 F/BW/DQ/VL per function (core/simd_target.hpp), called only after
// isa_available(Isa::avx512).
#include "lowp/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>

#include "core/simd_target.hpp"
#include "formats/cpu/minifloat_simd.hpp"

MIXPREC_TARGET_AVX512_FMA_BEGIN

namespace mixprec::lowp::detail {
namespace {

using mixprec::detail::MiniFloatSpec;

inline __m512i set1(std::uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
inline unsigned popcount16(__mmask16 m) { return static_cast<unsigned>(std::popcount(static_cast<unsigned>(m))); }

using mixprec::detail::avx512::encode16;
using mixprec::detail::avx512::encode16_rne;
using mixprec::detail::avx512::finite_magnitude_code16;
using mixprec::detail::avx512::normal_magnitude_code16;
using mixprec::detail::avx512::with_sign;

struct LaneCounts {
  std::uint64_t saturated = 0, flushed = 0, nonfinite = 0, zeros = 0;
};


template <const MiniFloatSpec& S>
inline void count16(__m512 x, __m512 y, __m512i code, float max_value, LaneCounts& c) {
  constexpr std::uint32_t kMag = (1u << (S.bits - 1)) - 1;
  const __m512i ax = _mm512_and_si512(_mm512_castps_si512(x), set1(0x7fffffffu));
  const __mmask16 nonfinite = _mm512_cmpge_epu32_mask(ax, set1(0x7f800000u));
  const __mmask16 finite = static_cast<__mmask16>(~nonfinite);
  const __m512 ay = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(y), set1(0x7fffffffu)));
  const __mmask16 sat = _mm512_mask_cmp_ps_mask(finite, ay, _mm512_set1_ps(max_value), _CMP_GT_OQ);
  const __mmask16 nonzero = _mm512_mask_test_epi32_mask(finite, ax, ax);
  const __mmask16 flushed = _mm512_mask_testn_epi32_mask(nonzero, code, set1(kMag));
  c.nonfinite += popcount16(nonfinite);
  c.saturated += popcount16(sat);
  c.flushed += popcount16(flushed);
  c.zeros += popcount16(_mm512_testn_epi32_mask(ax, ax));
}

template <const MiniFloatSpec& S, bool kStochastic, bool kAmax>
void encode_scaled_spec(const float* src, std::size_t n, std::size_t block, const float* factors, std::uint8_t* dst,
                        const std::uint32_t* random, float max_value, EncodeCounts* counts, std::uint32_t* max_bits) {
  LaneCounts lc;
  __m512i mb = _mm512_setzero_si512();  // kAmax: the magnitude bits' max, lane by lane
  std::size_t i = 0;
  // A vector of 16 never straddles two blocks: blocks of 16 * 2^k (16, 32, 128) or the whole
  // run. Vector v's factor is factors[v >> shift]: a 64-bit division per vector would cost
  // more than the encode. Other block lengths take the scalar rule throughout.
  int shift = -1;
  if (block >= n) shift = 63;  // every v < 2^63: v >> 63 == 0
  else if (block % 16 == 0 && std::has_single_bit(block / 16)) shift = std::countr_zero(block / 16);
  // Round to nearest even on an fp8 vector whose |y| are all normals of the format, none above
  // its largest finite (the common vector of a scaled tensor): the normal formula alone,
  // nothing to count (no saturation; a normal code is never a flush). Not for E2M1, whose
  // normals start at 1 of at most 6: most scaled values are below. On a vector whose |y| are all
  // finite (then every x is finite, the factors being positive or NaN): no NaN fix-up and no
  // non-finite count; saturated and flushed (a zero magnitude from a nonzero x) are mask
  // popcounts, which run on the scalar ports (measured faster than masked adds into lane
  // counters). Other vectors: encode16.
  const __m512i min_normal = set1(static_cast<std::uint32_t>(mixprec::detail::min_normal_f32_exponent(S)) << 23);
  const __m512i max_finite = set1(std::bit_cast<std::uint32_t>(max_value));
  for (; shift >= 0 && i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    if constexpr (kAmax) mb = _mm512_max_epu32(mb, _mm512_and_si512(_mm512_castps_si512(x), set1(0x7fffffffu)));
    const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(factors[(i / 16) >> shift]));
    __m512i code;
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), set1(0x7fffffffu));
    if (!kStochastic && S.bits == 8 &&
        _mm512_mask_cmple_epu32_mask(_mm512_cmpge_epu32_mask(a, min_normal), a, max_finite) == 0xFFFF) {
      code = with_sign<S>(normal_magnitude_code16<S>(a), y);
    } else if (!kStochastic && _mm512_cmpgt_epu32_mask(a, set1(0x7f7fffffu)) == 0) {
      const __m512i mag = finite_magnitude_code16<S>(a, set1(S.max_code));
      code = with_sign<S>(mag, y);
      const __mmask16 sat = _mm512_cmp_ps_mask(_mm512_castsi512_ps(a), _mm512_set1_ps(max_value), _CMP_GT_OQ);
      const __mmask16 nonzero_x = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ);
      const __mmask16 flushed = _mm512_mask_testn_epi32_mask(nonzero_x, mag, mag);
      lc.saturated += popcount16(sat);
      lc.flushed += popcount16(flushed);
      lc.zeros += 16 - popcount16(nonzero_x);  // every x finite here
    } else {
      const __m512i r = kStochastic ? _mm512_loadu_si512(random + i) : _mm512_setzero_si512();
      code = kStochastic ? encode16<S, true>(y, r) : encode16_rne<S>(y, set1(S.max_code));
      count16<S>(x, y, code, max_value, lc);
    }
    if constexpr (S.bits == 4) {
      const __m512i pairs = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i / 2), _mm512_cvtepi64_epi8(pairs));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(code));
    }
  }
  // The all-normal vectors count nothing: |x * factor| >= the smallest normal needs x != 0.
  EncodeCounts c{.saturated = lc.saturated, .flushed = lc.flushed, .nonfinite = lc.nonfinite, .zeros = lc.zeros};
  std::uint32_t tail_bits = 0;
  encode_elements<S, kStochastic, kAmax>(src, i, n, block, factors, dst, random, max_value, c, tail_bits);
  *counts += c;
  if constexpr (kAmax)
    *max_bits = std::max({*max_bits, tail_bits, static_cast<std::uint32_t>(_mm512_reduce_max_epu32(mb))});
}

void encode_scaled_avx512(Element e, const float* src, std::size_t n, std::size_t block, const float* factors,
                          std::uint8_t* dst, const std::uint32_t* random, EncodeCounts* counts, std::uint32_t* max_bits) {
  const auto run = [&](auto spec, auto stochastic, auto amax, float max_value) {
    encode_scaled_spec<decltype(spec)::value, decltype(stochastic)::value, decltype(amax)::value>(
        src, n, block, factors, dst, random, max_value, counts, max_bits);
  };
  with_element_options(e, random != nullptr, max_bits != nullptr, run);
}

// Block maxima: 16 lanes of |x| bits (unsigned max: a NaN, above inf, wins).
inline __m512 max_u32(__m512 x, __m512 y) {
  return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
}

// Lane j of the result: the max over the lanes of v[j], for 16 vectors: two horizontal-max
// steps within 128-bit lanes on pairs of vectors, then two across them.
inline __m512 pair_max(__m512 a, __m512 b) {
  return max_u32(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 lane_pair_max(__m512 a, __m512 b) {
  return max_u32(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 transpose_max16(const __m512* v) {
  __m512 r[4];  // r[k], 128-bit lane L: lane L's max of v[4k..4k+3], one per 32-bit element
  for (int k = 0; k < 4; ++k) r[k] = pair_max(pair_max(v[4 * k], v[4 * k + 1]), pair_max(v[4 * k + 2], v[4 * k + 3]));
  return lane_pair_max(lane_pair_max(r[0], r[1]), lane_pair_max(r[2], r[3]));
}

// Up to sixteen whole blocks of kVecs vectors each (16, 32, 128 elements): the magnitude-bits
// max per block in lanes, then one transpose-reduction for all of them instead of a reduction
// each (the missing blocks' lanes are zero; their results are not stored).
template <std::size_t kVecs>
void block_bits16(const float* src, std::size_t count, std::uint32_t* bits) {
  const __m512i mag = set1(0x7fffffffu);
  __m512 vb[16];
  for (std::size_t j = count; j < 16; ++j) vb[j] = _mm512_setzero_ps();
  for (std::size_t j = 0; j < count; ++j) {
    const float* p = src + j * kVecs * 16;
    __m512i mb = _mm512_setzero_si512();
    for (std::size_t i = 0; i < kVecs; ++i) {
      mb = _mm512_max_epu32(mb, _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p + 16 * i)), mag));
    }
    vb[j] = _mm512_castsi512_ps(mb);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1u);
  _mm512_mask_storeu_epi32(bits, keep, _mm512_castps_si512(transpose_max16(vb)));
}

// The magnitude-bits max of every block; the float max (if asked for) from it.
void block_amax_avx512(const float* src, std::size_t n, std::size_t block, float* fmax, std::uint32_t* bits) {
  const __m512i mag = set1(0x7fffffffu);
  std::size_t b = 0;
  void (*sixteen)(const float*, std::size_t, std::uint32_t*) =
      block == 16 ? &block_bits16<1> : block == 32 ? &block_bits16<2> : block == 128 ? &block_bits16<8> : nullptr;
  const std::size_t whole = n / block;
  if (sixteen != nullptr && whole >= 2) {
    for (; b < whole; b += 16) sixteen(src + b * block, whole - b < 16 ? whole - b : 16, bits + b);
    b = whole;
  }
  for (; b * block < n; ++b) {
    const float* p = src + b * block;
    const std::size_t len = n - b * block < block ? n - b * block : block;
    __m512i mb = _mm512_setzero_si512();
    std::size_t i = 0;
    for (; i + 16 <= len; i += 16) mb = _mm512_max_epu32(mb, _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p + i)), mag));
    if (i < len) {
      const __mmask16 k = static_cast<__mmask16>((1u << (len - i)) - 1u);
      mb = _mm512_max_epu32(mb, _mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(k, p + i)), mag));
    }
    bits[b] = static_cast<std::uint32_t>(_mm512_reduce_max_epu32(mb));
  }
  if (fmax != nullptr) max_ignoring_nan_from_bits(src, n, block, bits, fmax);
}

// Exact decode of 16 E4M3 codes (NaN code 0x7F -> the quiet NaN).
inline __m512 decode_e4m3_16(__m512i c) {
  const __m512i e = _mm512_srli_epi32(c, 3), m = _mm512_and_si512(c, set1(7));
  const __m512 normal =
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, set1(120)), 23), _mm512_slli_epi32(m, 20)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-9f));
  __m512 v = _mm512_mask_mov_ps(sub, _mm512_test_epi32_mask(e, e), normal);
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(c, set1(0x7f)), _mm512_castsi512_ps(set1(0x7fc00000u)));
}

void nvfp4_scales_avx512(const float* amax, std::size_t nb, float s_enc_div6, float s_dec, std::uint8_t* codes,
                         float* factors) {
  std::size_t b = 0;
  const __m512 flt_max = _mm512_set1_ps(kFltMax);
  for (; b + 16 <= nb; b += 16) {
    // vminps(FLT_MAX, v) returns v when v is NaN: min_flt_max's rule.
    const __m512 v = _mm512_min_ps(flt_max, _mm512_mul_ps(_mm512_loadu_ps(amax + b), _mm512_set1_ps(s_enc_div6)));
    const __m512i code = encode16<mixprec::detail::kE4M3Spec, false>(v, _mm512_setzero_si512());
    const __m512 dec = decode_e4m3_16(code);
    const __m512 f = _mm512_min_ps(flt_max, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(dec, _mm512_set1_ps(s_dec))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b), _mm512_cvtepi32_epi8(code));
    _mm512_storeu_ps(factors + b, f);
  }
  for (; b < nb; ++b) nvfp4_scale_one(amax[b], s_enc_div6, s_dec, codes[b], factors[b]);
}

// One butterfly stage at distance h: lanes whose bit h is clear get a + b, the others a - b,
// as fma(v, +-1, p) with p the partner lane: v * +-1 is exact, so the one rounding is the
// add's or the subtract's (a - b == a + (-b) exactly, zero signs included).
template <int kImm, bool kCrossLane>
inline __m512 butterfly(__m512 v, __m512 plus_minus) {
  __m512 p;
  if constexpr (kCrossLane) p = _mm512_shuffle_f32x4(v, v, kImm);
  else p = _mm512_permute_ps(v, kImm);
  return _mm512_fmadd_ps(v, plus_minus, p);
}

// +1 in the lanes whose index has bit h clear, -1 where it is set (the second of each pair).
inline __m512 plus_minus_for_bit(int h) {
  alignas(64) float m[16];
  for (int j = 0; j < 16; ++j) m[j] = (j & h) != 0 ? -1.0f : 1.0f;
  return _mm512_load_ps(m);
}

void rht16_avx512(const float* src, float* v, std::size_t n) {
  const __m512i signs = _mm512_setr_epi32(0, 0, 0, INT32_MIN, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                                          INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, INT32_MIN);
  const __m512 s1 = plus_minus_for_bit(1), s2 = plus_minus_for_bit(2), s4 = plus_minus_for_bit(4), s8 = plus_minus_for_bit(8);
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    __m512 x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_loadu_ps(src + i)), signs));
    x = butterfly<_MM_SHUFFLE(2, 3, 0, 1), false>(x, s1);
    x = butterfly<_MM_SHUFFLE(1, 0, 3, 2), false>(x, s2);
    x = butterfly<_MM_SHUFFLE(2, 3, 0, 1), true>(x, s4);
    x = butterfly<_MM_SHUFFLE(1, 0, 3, 2), true>(x, s8);
    _mm512_storeu_ps(v + i, _mm512_mul_ps(x, _mm512_set1_ps(0.25f)));
  }
}

// 16 x 16 tiles through registers: 32-bit, 64-bit and two 128-bit interleaves.
void transpose_avx512(const float* src, std::size_t rows, std::size_t cols, float* dst) {
  const std::size_t R = rows / 16 * 16, C = cols / 16 * 16;
  for (std::size_t r0 = 0; r0 < R; r0 += 16) {
    for (std::size_t c0 = 0; c0 < C; c0 += 16) {
      __m512 v[16], t[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(src + (r0 + i) * cols + c0);
      for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {
        for (int j = 0; j < 2; ++j) {
          v[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
          v[i + j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
        }
      }
      for (int i = 0; i < 16; i += 8) {
        for (int j = 0; j < 4; ++j) {
          t[i + j] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], _MM_SHUFFLE(2, 0, 2, 0));
          t[i + j + 4] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], _MM_SHUFFLE(3, 1, 3, 1));
        }
      }
      for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], _MM_SHUFFLE(2, 0, 2, 0));
        v[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], _MM_SHUFFLE(3, 1, 3, 1));
      }
      // v[k] now holds column c0 + p(k) of the tile, p the order the interleaves leave.
      constexpr int kColumn[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
      for (int k = 0; k < 16; ++k) _mm512_storeu_ps(dst + (c0 + kColumn[k]) * rows + r0, v[k]);
    }
  }
  transpose_range(src, rows, cols, dst, 0, R, C, cols);
  transpose_range(src, rows, cols, dst, R, rows, 0, cols);
}

// Eight words a vector: the 64-bit products of splitmix64 in vpmullq (AVX512DQ).
void random_words_avx512(std::uint64_t seed, std::uint32_t* out, std::size_t n) {
  const __m512i golden = _mm512_set1_epi64(static_cast<long long>(0x9E3779B97F4A7C15ull));
  const __m512i m1 = _mm512_set1_epi64(static_cast<long long>(0xBF58476D1CE4E5B9ull));
  const __m512i m2 = _mm512_set1_epi64(static_cast<long long>(0x94D049BB133111EBull));
  __m512i idx = _mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8);  // i + 1
  const __m512i eight = _mm512_set1_epi64(8);
  const __m512i base = _mm512_set1_epi64(static_cast<long long>(seed));
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m512i z = _mm512_add_epi64(base, _mm512_mullo_epi64(idx, golden));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), m1);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), m2);
    z = _mm512_srli_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 31)), 32);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi64_epi32(z));
    idx = _mm512_add_epi64(idx, eight);
  }
  random_words_range(seed, out, i, n);
}

}  // namespace
}  // namespace mixprec::lowp::detail

MIXPREC_TARGET_END

namespace mixprec::lowp::detail {
namespace {
const LowpKernels kAvx512{Isa::avx512, &block_amax_avx512, &encode_scaled_avx512, &nvfp4_scales_avx512, &rht16_avx512,
                          &transpose_avx512, &random_words_avx512};
}  // namespace
const LowpKernels* avx512_kernels() noexcept { return &kAvx512; }
}  // namespace mixprec::lowp::detail

#else
namespace mixprec::lowp::detail {
const LowpKernels* avx512_kernels() noexcept { return nullptr; }
}  // namespace mixprec::lowp::detail
#endif
