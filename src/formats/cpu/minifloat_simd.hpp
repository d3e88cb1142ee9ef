// Private: the minifloat encoder of the SIMD back ends (fp32 lanes to fp8 or e2m1 codes in
// 32-bit lanes, subnormals kept), defined once. formats/cpu/bulk_avx2.cpp (the fp8 encodes)
// and lowp/cpu/quantize_avx2.cpp run its 8-lane AVX2 form below; lowp/cpu/quantize_avx512.cpp
// and the optimizer state's codecs (optim/codec_impl.hpp) its 16-lane AVX-512 form, the same
// steps with mask registers, from the same constants (RneTrick).
// Every form equals formats/scalar.hpp's encode_full bit for bit (tests/formats, tests/lowp).
//
// Round to nearest even without per-lane variable shifts: a normal result rounds with the
// integer (bits + half ulp - 1 + lsb) >> shift after rebiasing the exponent; a value below
// the format's min normal wraps around to a huge number there and takes its subnormal code
// from |y| + 2^k in fp32 instead (the fp32 add rounds to nearest even, MXCSR's default, at
// the smallest subnormal's ulp). The unsigned min of the two picks the right one, and a min
// with the largest allowed code applies the overflow rule (every finite value past max, and
// inf, gives a normal code above it). Stochastic rounding (encode8) is encode_full in lanes:
// the fp32 significand plus the random bits, shifted right by a per-lane distance.
//
// The AVX2 helpers sit in the narrowest region that holds them (core/simd_target.hpp), as
// core/simd_reduce.hpp's do: every back end that includes this header enables a superset,
// so they inline into its kernels. Include it before opening the back end's own region.
#pragma once

#include <cstdint>

#include "mixprec/formats/scalar.hpp"

namespace mixprec::detail {

// The constants of the round-to-nearest-even trick for format S, at every vector width.
template <const MiniFloatSpec& S>
struct RneTrick {
  // fp32 mantissa bits that a normal code drops.
  static constexpr int kShift = 23 - S.man_bits;
  // Subtracts the min-normal exponent (so that every value below it wraps around) and adds
  // half an ulp minus one, in one constant; the exponent field then counts binades above min
  // normal, so one binade (1 << man_bits) is added back after the shift.
  static constexpr std::uint32_t kBias =
      (1u << (kShift - 1)) - 1u - (static_cast<std::uint32_t>(min_normal_f32_exponent(S)) << 23);
  // kBias with that binade added before the shift, for |y| a normal of the format at most its
  // largest finite (then a + kNormalBias cannot wrap): one add fewer, and the code the same bits.
  static constexpr std::uint32_t kNormalBias = kBias + (1u << (S.man_bits + kShift));
  // Bits of 2^(23 + 1 - bias - man_bits), whose fp32 ulp is the format's smallest subnormal.
  static constexpr std::uint32_t kMagicBits = static_cast<std::uint32_t>(127 + 23 + 1 - S.bias - S.man_bits) << 23;
};

}  // namespace mixprec::detail

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX2_BEGIN
namespace mixprec::detail::avx2 {

inline __m256i set1(std::uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

// The sign bit of y (bits u) in its place in a code: bit 7 (fp8) or bit 3 (e2m1).
template <const MiniFloatSpec& S>
inline __m256i sign_bit8(__m256i u) {
  // Two shifts, not (u & 0x80000000) >> (32 - bits): no mask to hold in a register (measured:
  // fewer spills, faster encodes).
  return _mm256_slli_epi32(_mm256_srli_epi32(u, 31), S.bits - 1);
}

// The code of y (bits u, magnitude bits a) from its magnitude code: NaN lanes take the
// format's NaN code (E2M1 has none: 0), then the sign bit goes into place.
template <const MiniFloatSpec& S>
inline __m256i signed_code8(__m256i magnitude, __m256i u, __m256i a) {
  constexpr int M = S.man_bits;
  const __m256i max_inf = set1(0x7f800000u);  // a above it: NaN (a < 2^31: a signed compare)
  if constexpr (S.bits == 4) {
    const __m256i nan = _mm256_cmpgt_epi32(a, max_inf);
    return _mm256_andnot_si256(nan, _mm256_or_si256(magnitude, sign_bit8<S>(u)));  // NaN -> 0, sign too
  } else {
    __m256i nan_code = set1(S.nan_code);
    if constexpr (S.has_inf) {  // the quiet NaN with the top payload bits of y
      nan_code = _mm256_or_si256(set1(S.overflow_code | (1u << (M - 1))),
                                 _mm256_and_si256(_mm256_srli_epi32(a, 23 - M), set1((1u << M) - 1)));
    }
    const __m256i code = _mm256_blendv_epi8(magnitude, nan_code, _mm256_cmpgt_epi32(a, max_inf));
    return _mm256_or_si256(code, sign_bit8<S>(u));
  }
}

// Round to nearest even: the magnitude code of a = |y| <= inf, at most max_code (the
// format's largest finite to saturate; its overflow code for IEEE overflow).
template <const MiniFloatSpec& S>
inline __m256i finite_magnitude_code8(__m256i a, __m256i max_code) {
  using K = RneTrick<S>;
  const __m256i normal = _mm256_add_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, set1(K::kBias)),
                                         _mm256_and_si256(_mm256_srli_epi32(a, K::kShift), set1(1))),
                        K::kShift),
      set1(1u << S.man_bits));
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(set1(K::kMagicBits)))),
      set1(K::kMagicBits));
  return _mm256_min_epu32(_mm256_min_epu32(normal, sub), max_code);
}

// The magnitude code of lanes whose |y| (bits a) is a normal of the format, at most its
// largest finite: finite_magnitude_code8's normal formula alone, its two constant adds in one.
template <const MiniFloatSpec& S>
inline __m256i normal_magnitude_code8(__m256i a) {
  using K = RneTrick<S>;
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, set1(K::kNormalBias)),
                                            _mm256_and_si256(_mm256_srli_epi32(a, K::kShift), set1(1))),
                           K::kShift);
}

// The code of y, rounded to nearest even; magnitudes at most max_code.
template <const MiniFloatSpec& S>
inline __m256i encode8_rne(__m256 y, __m256i max_code) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(u, set1(0x7fffffffu));
  return signed_code8<S>(finite_magnitude_code8<S>(a, max_code), u, a);
}

// encode_full<S>(y, saturate, keep, kStochastic, random) for 8 lanes (formats/scalar.hpp's
// steps, per-lane shifts); round to nearest even where not kStochastic.
template <const MiniFloatSpec& S, bool kStochastic>
inline __m256i encode8(__m256 y, __m256i random) {
  constexpr int M = S.man_bits;
  constexpr int kMinNormal = min_normal_f32_exponent(S);
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
  return signed_code8<S>(code, u, a);
}

}  // namespace mixprec::detail::avx2
MIXPREC_TARGET_END

// The same encoder in 16 lanes with mask registers (lowp/cpu/quantize_avx512.cpp and the
// optimizer state's AVX-512 codecs, optim/codec_impl.hpp).
MIXPREC_TARGET_AVX512F_BW_BEGIN
namespace mixprec::detail::avx512 {

inline __m512i set1(std::uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }

// The sign bit of y in its place in a code: bit 7 (fp8) or bit 3 (e2m1).
template <const MiniFloatSpec& S>
inline __m512i with_sign(__m512i magnitude, __m512 y) {
  // magnitude | ((y >> (32 - bits)) & sign bit): one ternary-logic op (A | (B & C)).
  return _mm512_ternarylogic_epi32(magnitude, _mm512_srli_epi32(_mm512_castps_si512(y), 32 - S.bits),
                                   set1(1u << (S.bits - 1)), 0xF8);
}

// The code of y (magnitude bits a) from its magnitude code: the sign goes into place, and
// NaN lanes take the format's NaN code (E2M1 has none: 0).
template <const MiniFloatSpec& S>
inline __m512i signed_code16(__m512i magnitude, __m512 y, __m512i a) {
  constexpr int M = S.man_bits;
  const __m512i code = with_sign<S>(magnitude, y);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, set1(0x7f800000u));
  if constexpr (S.bits == 4) {
    return _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nan), code);  // E2M1: NaN -> 0
  } else if constexpr (S.has_inf) {
    const __m512i nan_code = _mm512_or_si512(set1(S.overflow_code | (1u << (M - 1))),
                                             _mm512_srli_epi32(_mm512_and_si512(a, set1(0x7fffffu)), 23 - M));
    return _mm512_mask_mov_epi32(code, nan, with_sign<S>(nan_code, y));
  } else {
    return _mm512_mask_mov_epi32(code, nan, with_sign<S>(set1(S.nan_code), y));
  }
}

// encode_full<S>(y, saturate, keep, sr, random) for 16 lanes (scalar.hpp's steps).
template <const MiniFloatSpec& S, bool kStochastic>
inline __m512i encode16(__m512 y, __m512i random) {
  constexpr int M = S.man_bits;
  constexpr int kMinNormal = min_normal_f32_exponent(S);
  const __m512i zero = _mm512_setzero_si512(), one = set1(1);
  const __m512i u = _mm512_castps_si512(y);
  const __m512i a = _mm512_and_si512(u, set1(0x7fffffffu));
  __m512i e32 = _mm512_srli_epi32(a, 23);
  __m512i sig = _mm512_and_si512(a, set1(0x7fffffu));
  sig = _mm512_mask_or_epi32(sig, _mm512_test_epi32_mask(e32, e32), sig, set1(0x800000u));
  e32 = _mm512_max_epi32(e32, one);
  __m512i shift = _mm512_add_epi32(set1(23 - M), _mm512_max_epi32(_mm512_sub_epi32(set1(kMinNormal), e32), zero));
  const __m512i base = _mm512_slli_epi32(_mm512_max_epi32(_mm512_sub_epi32(e32, set1(kMinNormal)), zero), M);
  const __m512i pre = _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(shift, set1(31)), zero), set1(31));
  sig = _mm512_srlv_epi32(sig, pre);
  shift = _mm512_min_epi32(shift, set1(31));
  __m512i add;
  if constexpr (kStochastic) {
    add = _mm512_srlv_epi32(random, _mm512_sub_epi32(set1(32), shift));
  } else {
    add = _mm512_add_epi32(_mm512_sub_epi32(_mm512_sllv_epi32(one, _mm512_sub_epi32(shift, one)), one),
                           _mm512_and_si512(_mm512_srlv_epi32(sig, shift), one));
  }
  __m512i code = _mm512_add_epi32(base, _mm512_srlv_epi32(_mm512_add_epi32(sig, add), shift));
  code = _mm512_min_epu32(code, set1(S.max_code));
  return signed_code16<S>(code, y, a);
}

// Round to nearest even without encode16's per-lane variable shifts: finite_magnitude_code8
// in 16 lanes, from the same constants. The magnitude code for a = |y| <= inf, at most
// max_code (the largest finite to saturate; the overflow code for IEEE overflow).
template <const MiniFloatSpec& S>
inline __m512i finite_magnitude_code16(__m512i a, __m512i max_code) {
  using K = RneTrick<S>;
  const __m512i normal = _mm512_add_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, set1(K::kBias)),
                                         _mm512_and_si512(_mm512_srli_epi32(a, K::kShift), set1(1))),
                        K::kShift),
      set1(1u << S.man_bits));
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(set1(K::kMagicBits)))),
      set1(K::kMagicBits));
  return _mm512_min_epu32(_mm512_min_epu32(normal, sub), max_code);
}

// The magnitude code of lanes whose |y| (bits a) is a normal of the format, at most its
// largest finite: finite_magnitude_code16's normal formula alone, its two constant adds in one.
template <const MiniFloatSpec& S>
inline __m512i normal_magnitude_code16(__m512i a) {
  using K = RneTrick<S>;
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, set1(K::kNormalBias)),
                                            _mm512_and_si512(_mm512_srli_epi32(a, K::kShift), set1(1))),
                           K::kShift);
}

// The code of y, rounded to nearest even, magnitudes at most max_code (encode16<S, false>
// where max_code is the largest finite); NaN lanes as encode16.
template <const MiniFloatSpec& S>
inline __m512i encode16_rne(__m512 y, __m512i max_code) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), set1(0x7fffffffu));
  return signed_code16<S>(finite_magnitude_code16<S>(a, max_code), y, a);
}

// encode16_rne for lanes the caller knows finite (no NaN lane to carry): the magnitude code and
// the sign alone.
template <const MiniFloatSpec& S>
inline __m512i encode16_rne_finite(__m512 y, __m512i max_code) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), set1(0x7fffffffu));
  return with_sign<S>(finite_magnitude_code16<S>(a, max_code), y);
}

}  // namespace mixprec::detail::avx512
MIXPREC_TARGET_END

#endif  // __x86_64__
