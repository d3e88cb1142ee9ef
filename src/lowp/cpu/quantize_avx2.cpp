// AVX2 back end of lowp's kernel table: 8 elements per register, 32 per step (one 32-byte
// store of fp8 codes, 16 of e2m1 pairs). The codes come from the SIMD back ends' one
// minifloat encoder (formats/cpu/minifloat_simd.hpp): round to nearest even with its
// integer/fp32-add trick (encode8_rne, or its magnitude parts where a group of 32 needs no
// NaN fix-up), stochastic rounding with per-lane shifts (encode8). Counts accumulate in
// 32-bit lanes, summed once per call; block maxima (magnitude bits; the float max derived
// from them) of 8 blocks share one transpose-reduction; the RHT is in-register butterflies of
// one fma each (16-element groups span two registers). Heads and tails go through the scalar
// rules.
//
// Compiled for AVX2+FMA per function (core/simd_target.hpp), called only after
// isa_available(Isa::avx2).
#include "lowp/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"
#include "formats/cpu/minifloat_simd.hpp"

MIXPREC_TARGET_AVX2_FMA_BEGIN

namespace mixprec::lowp::detail {
namespace {

using mixprec::detail::MiniFloatSpec;
using mixprec::detail::avx2::encode8;
using mixprec::detail::avx2::encode8_rne;
using mixprec::detail::avx2::finite_magnitude_code8;
using mixprec::detail::avx2::normal_magnitude_code8;
using mixprec::detail::avx2::set1;

// Counts in 32-bit lanes (a compare mask is -1: subtracting it adds one), summed into
// EncodeCounts once per call instead of three movemask + popcount per vector.
struct LaneCounts {
  LaneCounts()
      : saturated(_mm256_setzero_si256()),
        flushed(_mm256_setzero_si256()),
        nonfinite(_mm256_setzero_si256()),
        zeros(_mm256_setzero_si256()) {}
  __m256i saturated, flushed, nonfinite, zeros;
  void spill(EncodeCounts& c) {
    c.saturated += simd::hsum_epu32(saturated);
    c.flushed += simd::hsum_epu32(flushed);
    c.nonfinite += simd::hsum_epu32(nonfinite);
    c.zeros += simd::hsum_epu32(zeros);
    saturated = flushed = nonfinite = zeros = _mm256_setzero_si256();
  }
};
// Lane counters are spilled before any can wrap (2^32 per lane).
constexpr std::size_t kSpillElements = std::size_t{1} << 34;

template <const MiniFloatSpec& S>
inline void count8(__m256 x, __m256 y, __m256i code, __m256 max_value, LaneCounts& c) {
  constexpr std::uint32_t kMag = (1u << (S.bits - 1)) - 1;
  const __m256i zero = _mm256_setzero_si256();
  const __m256i ax = _mm256_and_si256(_mm256_castps_si256(x), set1(0x7fffffffu));
  const __m256i nonfinite = _mm256_cmpgt_epi32(ax, set1(0x7f7fffffu));  // ax < 2^31
  const __m256 ay = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(y), set1(0x7fffffffu)));
  const __m256i sat = _mm256_andnot_si256(nonfinite, _mm256_castps_si256(_mm256_cmp_ps(ay, max_value, _CMP_GT_OQ)));
  const __m256i zero_x = _mm256_cmpeq_epi32(ax, zero);
  const __m256i zero_code = _mm256_cmpeq_epi32(_mm256_and_si256(code, set1(kMag)), zero);
  const __m256i flushed = _mm256_andnot_si256(_mm256_or_si256(nonfinite, zero_x), zero_code);
  c.nonfinite = _mm256_sub_epi32(c.nonfinite, nonfinite);
  c.saturated = _mm256_sub_epi32(c.saturated, sat);
  c.flushed = _mm256_sub_epi32(c.flushed, flushed);
  c.zeros = _mm256_sub_epi32(c.zeros, zero_x);
}

template <const MiniFloatSpec& S, bool kStochastic>
inline __m256i encode_any(__m256 y, const std::uint32_t* random) {
  if constexpr (kStochastic) return encode8<S, true>(y, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(random)));
  else return encode8_rne<S>(y, set1(S.max_code));
}

// One vector of 8: codes to dst (8 bytes, or 4 for e2m1), counts to lc.
template <const MiniFloatSpec& S, bool kStochastic>
inline void encode_one8(const float* src, float factor, std::uint8_t* dst, const std::uint32_t* random,
                        __m256 max_value, LaneCounts& lc) {
  const __m256 x = _mm256_loadu_ps(src);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(factor));
  const __m256i code = encode_any<S, kStochastic>(y, random);
  count8<S>(x, y, code, max_value, lc);
  if constexpr (S.bits == 4) {
    // Byte 0 of every 64-bit lane, per 128-bit half: the even element's nibble and the odd one's.
    const __m256i gather64 = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8, -1, -1,
                                              -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i pairs = _mm256_shuffle_epi8(_mm256_or_si256(code, _mm256_srli_epi64(code, 28)), gather64);
    const std::uint32_t v = static_cast<std::uint32_t>(_mm256_extract_epi16(pairs, 0)) |
                            (static_cast<std::uint32_t>(_mm256_extract_epi16(pairs, 8)) << 16);
    __builtin_memcpy(dst, &v, 4);
  } else {
    const __m256i gather32 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                                              -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(code, gather32);
    const std::uint64_t both = static_cast<std::uint32_t>(_mm256_extract_epi32(b, 0)) |
                               (static_cast<std::uint64_t>(static_cast<std::uint32_t>(_mm256_extract_epi32(b, 4))) << 32);
    __builtin_memcpy(dst, &both, 8);
  }
}

// Four vectors (32 elements) with factors f[0..3]: 32 fp8 bytes, or 16 e2m1 bytes, in one store.
// Round to nearest even: when every |y| of the 32 is finite (then every x is finite too, the
// factors being positive or NaN), the NaN fix-up and the non-finite count drop out, the signs
// come from packing y with signed saturation (which keeps each sign), and x == 0 implies a
// zero code, so flushed = zero codes - zero inputs. Other groups take encode8_rne and count8.
template <const MiniFloatSpec& S, bool kStochastic>
inline void encode_four8(const float* src, const float* f, std::uint8_t* dst, const std::uint32_t* random,
                         __m256 max_value, LaneCounts& lc) {
  __m256 x[4], y[4];
  __m256i a[4], c[4];
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm256_loadu_ps(src + 8 * k);
    y[k] = _mm256_mul_ps(x[k], _mm256_set1_ps(f[k]));
    a[k] = _mm256_and_si256(_mm256_castps_si256(y[k]), set1(0x7fffffffu));
  }
  const __m256i amax = _mm256_max_epi32(_mm256_max_epi32(a[0], a[1]), _mm256_max_epi32(a[2], a[3]));  // a < 2^31
  const bool all_finite = _mm256_testz_si256(_mm256_cmpgt_epi32(amax, set1(0x7f7fffffu)), set1(0xffffffffu));
  // fp8 only (E2M1's normals start at 1 of at most 6): every |y| a normal of the format, none
  // above its largest finite, takes the normal formula alone, with nothing to count (not even
  // zeros: |x * factor| >= the smallest normal needs x != 0).
  bool all_normal = false;
  if constexpr (!kStochastic && S.bits == 8) {
    const __m256i amin = _mm256_min_epi32(_mm256_min_epi32(a[0], a[1]), _mm256_min_epi32(a[2], a[3]));
    const __m256i lo = set1(static_cast<std::uint32_t>(mixprec::detail::min_normal_f32_exponent(S)) << 23);
    const __m256i hi = _mm256_castps_si256(max_value);
    all_normal = _mm256_testz_si256(_mm256_or_si256(_mm256_cmpgt_epi32(lo, amin), _mm256_cmpgt_epi32(amax, hi)),
                                    set1(0xffffffffu));
  }
  // packs work per 128-bit half: dword k of b holds 4 elements of vector k % 4, half k / 4.
  __m256i b;
  if (!kStochastic && all_finite) {
    for (int k = 0; k < 4; ++k) {
      if (all_normal) {
        c[k] = normal_magnitude_code8<S>(a[k]);
        continue;
      }
      c[k] = finite_magnitude_code8<S>(a[k], set1(S.max_code));
      const __m256i sat = _mm256_castps_si256(_mm256_cmp_ps(_mm256_castsi256_ps(a[k]), max_value, _CMP_GT_OQ));
      const __m256i zero_x = _mm256_castps_si256(_mm256_cmp_ps(x[k], _mm256_setzero_ps(), _CMP_EQ_OQ));
      const __m256i zero_code = _mm256_cmpeq_epi32(c[k], _mm256_setzero_si256());
      lc.saturated = _mm256_sub_epi32(lc.saturated, sat);
      lc.flushed = _mm256_add_epi32(_mm256_sub_epi32(lc.flushed, zero_code), zero_x);
      lc.zeros = _mm256_sub_epi32(lc.zeros, zero_x);
    }
    const __m256i signs = _mm256_and_si256(
        _mm256_packs_epi16(_mm256_packs_epi32(_mm256_castps_si256(y[0]), _mm256_castps_si256(y[1])),
                           _mm256_packs_epi32(_mm256_castps_si256(y[2]), _mm256_castps_si256(y[3]))),
        _mm256_set1_epi8(static_cast<char>(0x80)));
    b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    // The sign bit of a byte: 0x80 (fp8) or 0x08 (e2m1; the 16-bit shift keeps it in its byte).
    b = _mm256_or_si256(b, S.bits == 4 ? _mm256_srli_epi16(signs, 4) : signs);
  } else {
    for (int k = 0; k < 4; ++k) {
      c[k] = encode_any<S, kStochastic>(y[k], kStochastic ? random + 8 * k : nullptr);
      count8<S>(x[k], y[k], c[k], max_value, lc);
    }
    b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
  }
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // element order
  if constexpr (S.bits == 4) {
    // Each 16-bit lane (even code, odd code) -> its low byte even | odd << 4 (codes <= 0xF).
    const __m256i pairs = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)), _mm256_set1_epi16(0xff));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b);
  }
}

// Element i is scaled by factors[i / block]. Blocks of 8 * 2^k elements (16, 32, 128) or one
// block over the run: vector v's factor is factors[v >> shift], no division per vector; other
// block lengths take the scalar rule throughout (no recipe has them).
template <const MiniFloatSpec& S, bool kStochastic, bool kAmax>
void encode_scaled_spec(const float* src, std::size_t n, std::size_t block, const float* factors, std::uint8_t* dst,
                        const std::uint32_t* random, float max_value, EncodeCounts* counts, std::uint32_t* max_bits) {
  LaneCounts lc;
  // kAmax: the magnitude bits' max, lane by lane, from the vectors the encode reads (in L1).
  const __m256i mag = set1(0x7fffffffu);
  __m256i mb = _mm256_setzero_si256();
  const auto max_of = [&](const float* p) { mb = _mm256_max_epu32(mb, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p)), mag)); };
  EncodeCounts c;
  const __m256 maxv = _mm256_set1_ps(max_value);
  constexpr int kPerByte = S.bits == 4 ? 2 : 1;
  std::size_t i = 0;
  int shift = -1;
  if (block >= n) shift = 63;  // every vector v < 2^63: v >> 63 == 0
  else if (block % 8 == 0 && std::has_single_bit(block / 8)) shift = std::countr_zero(block / 8);
  if (shift >= 0) {
    while (i + 32 <= n) {
      const std::size_t end = n - i > kSpillElements ? i + kSpillElements : n;
      for (; i + 32 <= end; i += 32) {
        const std::size_t v = i / 8;
        const float f[4] = {factors[v >> shift], factors[(v + 1) >> shift], factors[(v + 2) >> shift],
                            factors[(v + 3) >> shift]};
        if constexpr (kAmax) {
          for (int k = 0; k < 4; ++k) max_of(src + i + 8 * k);
        }
        encode_four8<S, kStochastic>(src + i, f, dst + i / kPerByte, kStochastic ? random + i : nullptr, maxv, lc);
      }
      lc.spill(c);
    }
    for (; i + 8 <= n; i += 8) {
      if constexpr (kAmax) max_of(src + i);
      encode_one8<S, kStochastic>(src + i, factors[(i / 8) >> shift], dst + i / kPerByte,
                                  kStochastic ? random + i : nullptr, maxv, lc);
    }
    lc.spill(c);
  }
  std::uint32_t bits = kAmax ? simd::hmax_epu32(mb) : 0u;
  encode_elements<S, kStochastic, kAmax>(src, i, n, block, factors, dst, random, max_value, c, bits);
  *counts += c;
  if constexpr (kAmax) *max_bits = std::max(*max_bits, bits);
}

void encode_scaled_avx2(Element e, const float* src, std::size_t n, std::size_t block, const float* factors,
                        std::uint8_t* dst, const std::uint32_t* random, EncodeCounts* counts, std::uint32_t* max_bits) {
  const auto run = [&](auto spec, auto stochastic, auto amax, float max_value) {
    encode_scaled_spec<decltype(spec)::value, decltype(stochastic)::value, decltype(amax)::value>(
        src, n, block, factors, dst, random, max_value, counts, max_bits);
  };
  with_element_options(e, random != nullptr, max_bits != nullptr, run);
}

inline __m256 max_u32(__m256 x, __m256 y) {
  return _mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(x), _mm256_castps_si256(y)));
}

// Lane j of the result: the unsigned max over the lanes of v[j] (two horizontal-max steps
// within 128-bit halves on pairs of vectors, then the halves).
inline __m256 pair_max(__m256 a, __m256 b) {
  return max_u32(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m256 transpose_max8(const __m256* v) {
  const __m256 lo = pair_max(pair_max(v[0], v[1]), pair_max(v[2], v[3]));  // per half: v0..v3's
  const __m256 hi = pair_max(pair_max(v[4], v[5]), pair_max(v[6], v[7]));
  return max_u32(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// Eight whole blocks of kVecs vectors each (16, 32, 128 elements): the magnitude-bits max per
// block in lanes, then one transpose-reduction for the eight instead of a horizontal max each.
template <std::size_t kVecs>
void block_bits8(const float* src, std::uint32_t* bits) {
  const __m256i mag = set1(0x7fffffffu);
  __m256 vb[8];
  for (std::size_t j = 0; j < 8; ++j) {
    const float* p = src + j * kVecs * 8;
    __m256i mb = _mm256_setzero_si256();
    for (std::size_t i = 0; i < kVecs; ++i)
      mb = _mm256_max_epu32(mb, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p + 8 * i)), mag));
    vb[j] = _mm256_castsi256_ps(mb);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits), _mm256_castps_si256(transpose_max8(vb)));
}

// The magnitude-bits max of every block; the float max (if asked for) from it.
void block_amax_avx2(const float* src, std::size_t n, std::size_t block, float* fmax, std::uint32_t* bits) {
  const __m256i mag = set1(0x7fffffffu);
  std::size_t b = 0;
  void (*eight)(const float*, std::uint32_t*) =
      block == 16 ? &block_bits8<2> : block == 32 ? &block_bits8<4> : block == 128 ? &block_bits8<16> : nullptr;
  if (eight != nullptr) {
    for (; (b + 8) * block <= n; b += 8) eight(src + b * block, bits + b);
  }
  for (; b * block < n; ++b) {
    const float* p = src + b * block;
    const std::size_t len = n - b * block < block ? n - b * block : block;
    __m256i mb = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 8 <= len; i += 8) mb = _mm256_max_epu32(mb, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p + i)), mag));
    std::uint32_t bm = simd::hmax_epu32(mb);
    for (; i < len; ++i) bm = std::max(bm, std::bit_cast<std::uint32_t>(p[i]) & 0x7fffffffu);
    bits[b] = bm;
  }
  if (fmax != nullptr) max_ignoring_nan_from_bits(src, n, block, bits, fmax);
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

// One butterfly stage within 128-bit lanes: a + b in the first lane of each pair, a - b in
// the second, as fma(v, +-1, partner): v * +-1 is exact, so the one rounding is the add's or
// the subtract's (zero signs included).
template <int kImm>
inline __m256 butterfly_in_lane(__m256 v, __m256 plus_minus) {
  return _mm256_fmadd_ps(v, plus_minus, _mm256_permute_ps(v, kImm));
}

void rht16_avx2(const float* src, float* v, std::size_t n) {
  const int s = INT32_MIN;
  const __m256i sign_lo = _mm256_setr_epi32(0, 0, 0, s, 0, s, s, s), sign_hi = _mm256_setr_epi32(s, s, s, 0, s, 0, s, s);
  const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    __m256 lo = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_loadu_ps(src + i)), sign_lo));
    __m256 hi = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_loadu_ps(src + i + 8)), sign_hi));
    lo = butterfly_in_lane<_MM_SHUFFLE(2, 3, 0, 1)>(lo, s1);
    hi = butterfly_in_lane<_MM_SHUFFLE(2, 3, 0, 1)>(hi, s1);
    lo = butterfly_in_lane<_MM_SHUFFLE(1, 0, 3, 2)>(lo, s2);
    hi = butterfly_in_lane<_MM_SHUFFLE(1, 0, 3, 2)>(hi, s2);
    lo = _mm256_fmadd_ps(lo, s4, _mm256_permute2f128_ps(lo, lo, 0x01));
    hi = _mm256_fmadd_ps(hi, s4, _mm256_permute2f128_ps(hi, hi, 0x01));
    const __m256 a = _mm256_add_ps(lo, hi), b = _mm256_sub_ps(lo, hi);
    _mm256_storeu_ps(v + i, _mm256_mul_ps(a, _mm256_set1_ps(0.25f)));
    _mm256_storeu_ps(v + i + 8, _mm256_mul_ps(b, _mm256_set1_ps(0.25f)));
  }
}

// 8 x 8 tiles through registers: 32-bit and 64-bit interleaves, then the 128-bit halves.
void transpose_avx2(const float* src, std::size_t rows, std::size_t cols, float* dst) {
  const std::size_t R = rows / 8 * 8, C = cols / 8 * 8;
  for (std::size_t r0 = 0; r0 < R; r0 += 8) {
    for (std::size_t c0 = 0; c0 < C; c0 += 8) {
      __m256 v[8], t[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(src + (r0 + i) * cols + c0);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        for (int j = 0; j < 2; ++j) {
          v[i + j] = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t[i + j]), _mm256_castps_pd(t[i + j + 2])));
          v[i + j + 2] = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t[i + j]), _mm256_castps_pd(t[i + j + 2])));
        }
      }
      for (int j = 0; j < 4; ++j) {
        t[j] = _mm256_permute2f128_ps(v[j], v[j + 4], 0x20);
        t[j + 4] = _mm256_permute2f128_ps(v[j], v[j + 4], 0x31);
      }
      // t[k] now holds column c0 + p(k) of the tile, p the order the interleaves leave.
      constexpr int kColumn[8] = {0, 2, 1, 3, 4, 6, 5, 7};
      for (int k = 0; k < 8; ++k) _mm256_storeu_ps(dst + (c0 + kColumn[k]) * rows + r0, t[k]);
    }
  }
  transpose_range(src, rows, cols, dst, 0, R, C, cols);
  transpose_range(src, rows, cols, dst, R, rows, 0, cols);
}

}  // namespace
}  // namespace mixprec::lowp::detail

MIXPREC_TARGET_END

namespace mixprec::lowp::detail {
namespace {
// AVX2 has no 64-bit multiply: the scalar loop, whose 64-bit products the CPU does one a cycle.
void random_words_avx2(std::uint64_t seed, std::uint32_t* out, std::size_t n) { random_words_range(seed, out, 0, n); }

const LowpKernels kAvx2{Isa::avx2, &block_amax_avx2, &encode_scaled_avx2, &nvfp4_scales_avx2, &rht16_avx2,
                        &transpose_avx2, &random_words_avx2};
}  // namespace
const LowpKernels* avx2_kernels() noexcept { return &kAvx2; }
}  // namespace mixprec::lowp::detail

#else
namespace mixprec::lowp::detail {
const LowpKernels* avx2_kernels() noexcept { return nullptr; }
}  // namespace mixprec::lowp::detail
#endif
