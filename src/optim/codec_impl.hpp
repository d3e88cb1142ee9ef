// Private: the inner loops of the state formats' step (state_format.cpp): the remainder
// master's split and join, stochastic rounding to bf16, the moments-only update of the
// per-tensor first pass, torchao's blocked moment codecs (fp8, 8bit, 4bit) and TE's per-tensor
// E4M3 encode. Included by update_impl.hpp, so each back end
// (reference/update_scalar.cpp, cpu/update_avx2.cpp, cpu/update_avx512.cpp) compiles it in
// its own namespace; the vector back ends define MIXPREC_OPTIM_AVX2 or MIXPREC_OPTIM_AVX512
// and include <immintrin.h>, formats/cpu/minifloat_simd.hpp and core/simd_reduce.hpp before
// their ISA region (update_impl.hpp includes formats/kernels.hpp, which they include first too).
//
// The plain loops are the reference: the reference back end runs them as written, and the
// vector back ends fall back on them for blocks that are not a multiple of 32 (16: E4M3
// decode) and for tails. Each vector
// kernel computes the same values: the same fp32 quotients x / scale (torchao divides; the vector
// back ends reach its quotients by FMAs, update_impl.hpp's quotient_v), the
// same E4M3 encoder (minifloat_simd.hpp, equal to scalar.hpp bit for bit), and the code map's
// codes through CodeMap's thresholds, which give torchao's code for every fp32 value (the
// code never decreases as y grows: kernels.hpp).

namespace codec {

constexpr float kTorchaoMinAbsmax = 1e-12f;  // torchao: absmax.clip(1e-12)
using mixprec::optim_detail::kE4M3Max;

// max |x[i]| as magnitude bits compared as integers (a NaN wins, as torch's amax propagates
// it): the format kernels' scalar loop.
using mixprec::detail::amax_bits_range;

// torchao's block scale: max(absmax, 1e-12), / 448 for E4M3. A NaN absmax fails the compare and
// stays NaN.
inline float block_scale(std::uint32_t amax, bool fp8) noexcept {
  const float a = std::bit_cast<float>(amax);
  const float clipped = a < kTorchaoMinAbsmax ? kTorchaoMinAbsmax : a;
  return fp8 ? clipped / kE4M3Max : clipped;
}

// torchao's code of y: the largest code whose value is <= y (0 for NaN or below every value),
// then one up when y - value >= (next value - value) * 0.5. The search starts from the largest
// code at or below the lowest value y's top 16 bits can hold and walks up.
inline std::uint8_t map_code(float y, const mixprec::optim_detail::CodeMap& map) noexcept {
  std::size_t c = map.walk_start[std::bit_cast<std::uint32_t>(y) >> 16];
  while (c + 1 < map.n && map.values[c + 1] <= y) ++c;
  const std::size_t up = c + 1 < map.n ? c + 1 : c;
  if (y - map.values[c] >= (map.values[up] - map.values[c]) * 0.5f) c = up;
  return static_cast<std::uint8_t>(c);
}

inline void encode_fp8_plain(const float* x, std::uint8_t* codes, float* scales, std::size_t n,
                             std::size_t block) noexcept {
  constexpr mixprec::EncodeMode kIeee{mixprec::Overflow::ieee, mixprec::Subnormals::keep};
  for (std::size_t b = 0; b < n; b += block) {
    const float scale = block_scale(amax_bits_range(x + b, block), true);
    scales[b / block] = scale;
    for (std::size_t i = b; i < b + block; ++i)
      codes[i] = static_cast<std::uint8_t>(
          mixprec::detail::encode_full<mixprec::detail::kE4M3Spec>(x[i] / scale, kIeee, false, 0).code);
  }
}

inline void encode_fp8_scaled_plain(const float* x, std::uint8_t* codes, std::size_t n, float qscale) noexcept {
  constexpr mixprec::EncodeMode kSaturate{mixprec::Overflow::saturate, mixprec::Subnormals::keep};
  for (std::size_t i = 0; i < n; ++i)
    codes[i] = static_cast<std::uint8_t>(
        mixprec::detail::encode_full<mixprec::detail::kE4M3Spec>(x[i] * qscale, kSaturate, false, 0).code);
}

inline void encode_map_plain(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block,
                             const mixprec::optim_detail::CodeMap& map) noexcept {
  const bool four_bit = map.n == 16;
  for (std::size_t b = 0; b < n; b += block) {
    const float scale = block_scale(amax_bits_range(x + b, block), false);
    scales[b / block] = scale;
    for (std::size_t i = b; i < b + block; ++i) {
      const std::uint8_t c = map_code(x[i] / scale, map);
      if (!four_bit) codes[i] = c;
      else if (i % 2 == 0) codes[i / 2] = static_cast<std::uint8_t>(c << 4);  // the first of a pair: high nibble
      else codes[i / 2] = static_cast<std::uint8_t>(codes[i / 2] | c);
    }
  }
}

inline void decode_fp8_plain(const std::uint8_t* codes, const float* factors, float* x, std::size_t n,
                             std::size_t block) noexcept {
  for (std::size_t i = 0; i < n; ++i)
    x[i] = mixprec::detail::decode<mixprec::detail::kE4M3Spec>(codes[i], mixprec::Subnormals::keep) * factors[i / block];
}

inline void decode_map_plain(const std::uint8_t* codes, const float* scales, float* x, std::size_t n,
                             std::size_t block, const mixprec::optim_detail::CodeMap& map) noexcept {
  const bool four_bit = map.n == 16;
  for (std::size_t b = 0; b < n; b += block) {
    const float scale = scales[b / block];
    for (std::size_t i = b; i < b + block; ++i) {
      const unsigned c = four_bit ? (i % 2 == 0 ? codes[i / 2] >> 4 : codes[i / 2] & 0xFu) : codes[i];
      x[i] = map.values[c] * scale;
    }
  }
}

}  // namespace codec

// ---- the remainder master -------------------------------------------------------------------

void join_master(const std::uint16_t* __restrict bf16_bits, const std::int16_t* __restrict remainder,
                 float* __restrict master, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t hi = static_cast<std::uint32_t>(bf16_bits[i]) - (remainder[i] < 0 ? 1u : 0u);
    master[i] = std::bit_cast<float>(((hi & 0xFFFFu) << 16) | static_cast<std::uint16_t>(remainder[i]));
  }
}

void split_master(const float* __restrict master, std::uint16_t* __restrict bf16_bits,
                  std::int16_t* __restrict remainder, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t b = std::bit_cast<std::uint32_t>(master[i]);
    const auto rem = static_cast<std::int16_t>(static_cast<std::uint16_t>(b & 0xFFFFu));
    // TE: the top half rounded half away from zero (a negative remainder rounds the magnitude up).
    bf16_bits[i] = static_cast<std::uint16_t>((b >> 16) + (rem < 0 ? 1u : 0u));
    remainder[i] = rem;
  }
}

// ---- stochastic rounding to bf16 ---------------------------------------------------------------

namespace codec {
inline void round_bf16_stochastic_plain(const float* p, std::uint16_t* out, std::uint64_t first, std::size_t n,
                                        std::uint64_t key) noexcept {
  constexpr mixprec::EncodeMode kIeee{mixprec::Overflow::ieee, mixprec::Subnormals::keep};
  for (std::size_t i = 0; i < n; ++i)
    out[i] = static_cast<std::uint16_t>(
        mixprec::detail::encode_full<mixprec::detail::kBF16Spec>(p[i], kIeee, true, sr_word(first + i, key)).code);
}
}  // namespace codec

// With bf16's exponent range every step of encode_full reduces to one add: the code of |x| is
// (|x| bits + (word >> 16)) >> 16 (a carry out of the mantissa moves to the next binade, out
// of the largest finite to inf's code, which is IEEE overflow's), NaN keeps its sign and top
// payload bits with the quiet bit set.
#if defined(MIXPREC_OPTIM_AVX512)
inline __m512i fmix32_v(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}
void round_bf16_stochastic(const float* p, std::uint16_t* out, std::uint64_t first, std::size_t n,
                           std::uint64_t key) noexcept {
  const auto lo = static_cast<std::uint32_t>(first);
  if (static_cast<std::uint64_t>(lo) + n > (std::uint64_t{1} << 32))  // the high word changes inside
    return codec::round_bf16_stochastic_plain(p, out, first, n, key);
  const __m512i klo = _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(key)));
  const __m512i hk = _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(first >> 32) ^ static_cast<std::uint32_t>(key >> 32)));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i mag = _mm512_set1_epi32(0x7fffffff);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo + static_cast<std::uint32_t>(i))), iota);
    const __m512i word = fmix32_v(_mm512_xor_si512(fmix32_v(_mm512_xor_si512(idx, klo)), hk));
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(p + i));
    const __m512i a = _mm512_and_si512(u, mag);
    __m512i code = _mm512_srli_epi32(_mm512_add_epi32(a, _mm512_srli_epi32(word, 16)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
    code = _mm512_mask_or_epi32(code, nan, _mm512_srli_epi32(a, 16), _mm512_set1_epi32(0x40));
    code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(code));
  }
  codec::round_bf16_stochastic_plain(p + i, out + i, first + i, n - i, key);
}
#elif defined(MIXPREC_OPTIM_AVX2)
inline __m256i fmix32_v(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}
void round_bf16_stochastic(const float* p, std::uint16_t* out, std::uint64_t first, std::size_t n,
                           std::uint64_t key) noexcept {
  const auto lo = static_cast<std::uint32_t>(first);
  if (static_cast<std::uint64_t>(lo) + n > (std::uint64_t{1} << 32))  // the high word changes inside
    return codec::round_bf16_stochastic_plain(p, out, first, n, key);
  const __m256i klo = _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(key)));
  const __m256i hk = _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(first >> 32) ^ static_cast<std::uint32_t>(key >> 32)));
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mag = _mm256_set1_epi32(0x7fffffff);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i codes[2];
    for (int h = 0; h < 2; ++h) {
      const std::size_t j = i + 8 * static_cast<std::size_t>(h);
      const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo + static_cast<std::uint32_t>(j))), iota);
      const __m256i word = fmix32_v(_mm256_xor_si256(fmix32_v(_mm256_xor_si256(idx, klo)), hk));
      const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(p + j));
      const __m256i a = _mm256_and_si256(u, mag);
      __m256i code = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_srli_epi32(word, 16)), 16);
      const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));  // a < 2^31
      code = _mm256_blendv_epi8(code, _mm256_or_si256(_mm256_srli_epi32(a, 16), _mm256_set1_epi32(0x40)), nan);
      codes[h] = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)));
    }
    // 16 codes < 2^16 in 32-bit lanes -> 16 words in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(codes[0], codes[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  codec::round_bf16_stochastic_plain(p + i, out + i, first + i, n - i, key);
}
#else
void round_bf16_stochastic(const float* p, std::uint16_t* out, std::uint64_t first, std::size_t n,
                           std::uint64_t key) noexcept {
  codec::round_bf16_stochastic_plain(p, out, first, n, key);
}
#endif

// ---- the new moments alone (the first pass of per-tensor scales) ------------------------------
// The moments' lines of adam_element, adam_torchao and adam_te.

template <bool L2, bool LerpLow>
void adam_moments_loop(const float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                       std::size_t n, float pre, float clip, const AdamScalars& s) noexcept {
  const AdamScalars c = s;
  for (std::size_t i = 0; i < n; ++i) adam_moments_element<L2, LerpLow>((g[i] * pre) * clip, L2 ? p[i] : 0.0f, m[i], v[i], c);
}

void adam_moments(const float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
                  const AdamScalars& s) noexcept {
  if (s.l2) {
    if (s.lerp_low) adam_moments_loop<true, true>(p, m, v, g, n, pre, clip, s);
    else adam_moments_loop<true, false>(p, m, v, g, n, pre, clip, s);
  } else {
    if (s.lerp_low) adam_moments_loop<false, true>(p, m, v, g, n, pre, clip, s);
    else adam_moments_loop<false, false>(p, m, v, g, n, pre, clip, s);
  }
}

void adam_moments_torchao(const float* __restrict p, float* __restrict m, float* __restrict v,
                          const float* __restrict g, std::size_t n, float pre, float clip, const RuleScalars& s) noexcept {
  for (std::size_t i = 0; i < n; ++i) torchao_moments_element((g[i] * pre) * clip, s.l2 ? p[i] : 0.0f, m[i], v[i], s);
}

void adam_moments_te(const float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                     std::size_t n, float pre, float clip, const RuleScalars& s) noexcept {
  for (std::size_t i = 0; i < n; ++i) te_moments_element((g[i] * pre) * clip, s.l2 ? p[i] : 0.0f, m[i], v[i], s);
}

// ---- torchao's blocked moments --------------------------------------------------------------

#if defined(MIXPREC_OPTIM_AVX512) || defined(MIXPREC_OPTIM_AVX2)
namespace codec {
// 16 codes < 16 as bytes -> 8 bytes, two a byte, the first in the high nibble.
inline __m128i pack_nibbles(__m128i bytes) {
  const __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0xFF)), 4),
                                     _mm_srli_epi16(bytes, 8));
  return _mm_packus_epi16(pairs, pairs);
}
// 8 bytes of nibble pairs -> 16 codes as bytes, in element order.
inline __m128i unpack_nibbles(const std::uint8_t* src) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  return _mm_or_si128(_mm_srli_epi16(w, 4), _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0xF)), 8));
}
}  // namespace codec
#endif

#if defined(MIXPREC_OPTIM_AVX512)

namespace codec {

inline __m512i set1(std::uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }

// Blocks are a multiple of 32 here.
inline std::uint32_t amax_bits_v(const float* x, std::size_t n) {
  const __m512i mag = set1(0x7fffffffu);
  __m512i m0 = _mm512_setzero_si512(), m1 = m0;
  for (std::size_t i = 0; i < n; i += 32) {
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i)), mag));
    m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i + 16)), mag));
  }
  return static_cast<std::uint32_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1)));
}

// E4M3 codes of 16 lanes, as bytes, magnitudes at most max_code (IEEE overflow: the overflow
// code; saturate: the largest finite): minifloat_simd.hpp's 16-lane encoder.
inline __m128i e4m3_codes(__m512 y, std::uint32_t max_code) {
  return _mm512_cvtepi32_epi8(mixprec::detail::avx512::encode16_rne<mixprec::detail::kE4M3Spec>(y, set1(max_code)));
}

// The code map's codes of 16 lanes: the code of the lowest value of y's top-16-bit bucket, plus
// the thresholds above it that y reaches (at most map.steps).
inline __m512i map_codes_gather(__m512 y, const mixprec::optim_detail::CodeMap& map) {
  const __m512i u = _mm512_castps_si512(y);
  if (map.packed != nullptr) {  // one lookup: start, and the threshold inside the bucket
    const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(u, 16), map.packed, 4);
    const __m512i start = _mm512_and_si512(e, set1(0xFFu));
    const __m512i key = _mm512_and_si512(_mm512_xor_si512(u, _mm512_srai_epi32(u, 31)), set1(0xFFFFu));
    return _mm512_mask_add_epi32(start, _mm512_cmpge_epu32_mask(key, _mm512_srli_epi32(e, 8)), start, set1(1));
  }
  const __m512i bucket = _mm512_srli_epi32(u, 16);
  __m512i c = _mm512_and_si512(_mm512_i32gather_epi32(bucket, map.start, 1), set1(0xFFu));
  const __m512i one = set1(1);
  for (unsigned k = 0; k < map.steps; ++k) {
    const __m512 t = _mm512_i32gather_ps(_mm512_add_epi32(c, one), map.thresholds, 4);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(y, t, _CMP_GE_OQ), c, one);
  }
  return c;
}

// 4bit codes of 16 lanes: the number of the 15 thresholds <= y, by binary search in one
// register (lane j holds thresholds[j + 1]; NaN compares false everywhere: code 0).
inline __m512i map_codes_16(__m512 y, __m512 thresholds) {
  __m512i c = _mm512_setzero_si512();
  for (std::uint32_t step : {8u, 4u, 2u, 1u}) {
    const __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(c, set1(step - 1)), thresholds);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(y, t, _CMP_GE_OQ), c, set1(step));
  }
  return c;
}


}  // namespace codec

void encode_fp8_blocks(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block) noexcept {
  if (block % 32 != 0) return codec::encode_fp8_plain(x, codes, scales, n, block);
  const __m512i overflow = codec::set1(mixprec::detail::kE4M3Spec.overflow_code);
  for (std::size_t b = 0; b < n; b += block) {
    const float scale = codec::block_scale(codec::amax_bits_v(x + b, block), true);
    scales[b / block] = scale;
    const Divisor s = mixprec::optim_detail::divisor(scale);
    if (!s.by_fma) {  // a NaN or inf absmax (its scale is NaN or inf): the general quotient and encoder
      for (std::size_t i = b; i < b + block; i += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                         codec::e4m3_codes(quotient_v(_mm512_loadu_ps(x + i), s), mixprec::detail::kE4M3Spec.overflow_code));
      continue;
    }
    // A finite block, scale = max(absmax, 1e-12) / 448 >= 2^-48.7: every |x / scale| <= 448 (1 + 2^-22).
    // The FMA quotient is exact where |q0| >= 2^-20 (then |x| >= 2^-69, inside the FMAs' range), and
    // below 2^-20 both q0 and x / scale encode to the zero of x's sign: the quotient needs no range
    // test and the encoder no NaN lanes.
    const __m512 r = _mm512_set1_ps(s.r), d = _mm512_set1_ps(s.d), tiny = _mm512_set1_ps(0x1p-20f);
    for (std::size_t i = b; i < b + block; i += 16) {
      const __m512 y = quotient_above(_mm512_loadu_ps(x + i), r, d, tiny);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                       _mm512_cvtepi32_epi8(
                           mixprec::detail::avx512::encode16_rne_finite<mixprec::detail::kE4M3Spec>(y, overflow)));
    }
  }
}

void encode_fp8_scaled(const float* x, std::uint8_t* codes, std::size_t n, float qscale) noexcept {
  const __m512 q = _mm512_set1_ps(qscale);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     codec::e4m3_codes(_mm512_mul_ps(_mm512_loadu_ps(x + i), q), mixprec::detail::kE4M3Spec.max_code));
  codec::encode_fp8_scaled_plain(x + i, codes + i, n - i, qscale);
}

void encode_map_blocks(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block,
                       const mixprec::optim_detail::CodeMap& map) noexcept {
  if (block % 32 != 0) return codec::encode_map_plain(x, codes, scales, n, block, map);
  const __m512 thresholds = _mm512_loadu_ps(map.thresholds + 1);  // 4bit: lanes 0-14, then NaN
  // Quotients below half the map's zero band take the zero's code whatever their last bits: in a
  // finite block (scale = max(absmax, 1e-12), so |x / scale| <= 1 and |x| >= tiny * 2^-40) the
  // FMA quotient is exact at and above `tiny`, which needs no range test when tiny >= 2^-55.
  const float tiny = map.zero_band / 2;
  const bool by_band = tiny >= 0x1p-55f;
  for (std::size_t b = 0; b < n; b += block) {
    const float scale = codec::block_scale(codec::amax_bits_v(x + b, block), false);
    scales[b / block] = scale;
    const Divisor s = mixprec::optim_detail::divisor(scale);
    const bool fast = by_band && s.by_fma;  // a NaN or inf absmax gives a NaN or inf scale
    const __m512 r = _mm512_set1_ps(s.r), d = _mm512_set1_ps(s.d), t = _mm512_set1_ps(tiny);
    for (std::size_t i = b; i < b + block; i += 16) {
      const __m512 xv = _mm512_loadu_ps(x + i);
      const __m512 y = fast ? quotient_above(xv, r, d, t) : quotient_v(xv, s);
      if (map.n == 16) {
        const __m128i c = _mm512_cvtepi32_epi8(codec::map_codes_16(y, thresholds));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i / 2), codec::pack_nibbles(c));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(codec::map_codes_gather(y, map)));
      }
    }
  }
}

// E4M3 into f16 bits (the f16 value is 2^-8 of it: bias 15 against 7), NaN as f16's quiet NaN,
// then exact to fp32 and times 256: formats/cpu/bulk_avx2.cpp's decode in 16 lanes.
void decode_fp8_blocks(const std::uint8_t* codes, const float* factors, float* x, std::size_t n,
                       std::size_t block) noexcept {
  if (block % 16 != 0) return codec::decode_fp8_plain(codes, factors, x, n, block);
  const __m256i sign_bit = _mm256_set1_epi16(0x80), mag_mask = _mm256_set1_epi16(0x7f);
  for (std::size_t b = 0; b < n; b += block) {
    const __m512 f = _mm512_set1_ps(factors[b / block]);
    for (std::size_t i = b; i < b + block; i += 16) {
      const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
      const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, sign_bit), 8);
      const __m256i mag = _mm256_and_si256(c, mag_mask);
      const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, mag_mask);
      const __m256i h = _mm256_mask_mov_epi16(_mm256_or_si256(sign, _mm256_slli_epi16(mag, 7)), nan,
                                              _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00)));
      const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));  // exact; NaN stays
      _mm512_storeu_ps(x + i, _mm512_mul_ps(v, f));
    }
  }
}

void decode_map_blocks(const std::uint8_t* codes, const float* scales, float* x, std::size_t n, std::size_t block,
                       const mixprec::optim_detail::CodeMap& map) noexcept {
  if (block % 32 != 0) return codec::decode_map_plain(codes, scales, x, n, block, map);
  const __m512 values16 = _mm512_loadu_ps(map.values);  // the 4bit map: one register
  for (std::size_t b = 0; b < n; b += block) {
    const __m512 s = _mm512_set1_ps(scales[b / block]);
    for (std::size_t i = b; i < b + block; i += 16) {
      __m512 v;
      if (map.n == 16) {
        v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codec::unpack_nibbles(codes + i / 2)), values16);
      } else {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
        v = _mm512_i32gather_ps(c, map.values, 4);
      }
      _mm512_storeu_ps(x + i, _mm512_mul_ps(v, s));
    }
  }
}

#elif defined(MIXPREC_OPTIM_AVX2)

namespace codec {

inline __m256i set1(std::uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

inline std::uint32_t amax_bits_v(const float* x, std::size_t n) {
  const __m256i mag = set1(0x7fffffffu);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  for (std::size_t i = 0; i < n; i += 16) {
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + i)), mag));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + i + 8)), mag));
  }
  return mixprec::simd::hmax_epu32(_mm256_max_epu32(m0, m1));
}

// 8 + 8 codes (each < 256) in 32-bit lanes -> 16 bytes.
inline __m128i bytes_of(__m256i lo, __m256i hi) {
  const __m128i w0 = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  const __m128i w1 = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  return _mm_packus_epi16(w0, w1);
}

inline __m256i e4m3_codes(__m256 y, std::uint32_t max_code) {
  return mixprec::detail::avx2::encode8_rne<mixprec::detail::kE4M3Spec>(y, set1(max_code));
}

// As the AVX-512 form: start code of the bucket, then up to map.steps thresholds.
inline __m256i map_codes_gather(__m256 y, const mixprec::optim_detail::CodeMap& map) {
  const __m256i u = _mm256_castps_si256(y);
  if (map.packed != nullptr) {  // one lookup: start, and the threshold inside the bucket
    const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(map.packed), _mm256_srli_epi32(u, 16), 4);
    const __m256i start = _mm256_and_si256(e, set1(0xFFu));
    const __m256i key = _mm256_and_si256(_mm256_xor_si256(u, _mm256_srai_epi32(u, 31)), set1(0xFFFFu));
    const __m256i off = _mm256_srli_epi32(e, 8);  // <= 0x10000, key <= 0xFFFF: a signed compare is right
    const __m256i reached = _mm256_or_si256(_mm256_cmpgt_epi32(key, off), _mm256_cmpeq_epi32(key, off));
    return _mm256_sub_epi32(start, reached);  // true is -1
  }
  const __m256i bucket = _mm256_srli_epi32(u, 16);
  __m256i c = _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(map.start), bucket, 1), set1(0xFFu));
  for (unsigned k = 0; k < map.steps; ++k) {
    const __m256 t = _mm256_i32gather_ps(map.thresholds, _mm256_add_epi32(c, set1(1)), 4);
    c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(y, t, _CMP_GE_OQ)));  // true is -1
  }
  return c;
}


}  // namespace codec

void encode_fp8_blocks(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block) noexcept {
  if (block % 32 != 0) return codec::encode_fp8_plain(x, codes, scales, n, block);
  for (std::size_t b = 0; b < n; b += block) {
    const float scale = codec::block_scale(codec::amax_bits_v(x + b, block), true);
    scales[b / block] = scale;
    const Divisor s = mixprec::optim_detail::divisor(scale);
    for (std::size_t i = b; i < b + block; i += 16) {
      const std::uint32_t ovf = mixprec::detail::kE4M3Spec.overflow_code;
      const __m256i lo = codec::e4m3_codes(quotient_v(_mm256_loadu_ps(x + i), s), ovf);
      const __m256i hi = codec::e4m3_codes(quotient_v(_mm256_loadu_ps(x + i + 8), s), ovf);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), codec::bytes_of(lo, hi));
    }
  }
}

void encode_fp8_scaled(const float* x, std::uint8_t* codes, std::size_t n, float qscale) noexcept {
  const __m256 q = _mm256_set1_ps(qscale);
  const std::uint32_t max = mixprec::detail::kE4M3Spec.max_code;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = codec::e4m3_codes(_mm256_mul_ps(_mm256_loadu_ps(x + i), q), max);
    const __m256i hi = codec::e4m3_codes(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), q), max);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), codec::bytes_of(lo, hi));
  }
  codec::encode_fp8_scaled_plain(x + i, codes + i, n - i, qscale);
}

void encode_map_blocks(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block,
                       const mixprec::optim_detail::CodeMap& map) noexcept {
  if (block % 32 != 0) return codec::encode_map_plain(x, codes, scales, n, block, map);
  for (std::size_t b = 0; b < n; b += block) {
    const float scale = codec::block_scale(codec::amax_bits_v(x + b, block), false);
    scales[b / block] = scale;
    const Divisor s = mixprec::optim_detail::divisor(scale);
    for (std::size_t i = b; i < b + block; i += 16) {
      const __m256i lo = codec::map_codes_gather(quotient_v(_mm256_loadu_ps(x + i), s), map);
      const __m256i hi = codec::map_codes_gather(quotient_v(_mm256_loadu_ps(x + i + 8), s), map);
      const __m128i c = codec::bytes_of(lo, hi);
      if (map.n == 16) _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i / 2), codec::pack_nibbles(c));
      else _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), c);
    }
  }
}

void decode_fp8_blocks(const std::uint8_t* codes, const float* factors, float* x, std::size_t n,
                       std::size_t block) noexcept {
  if (block % 8 != 0) return codec::decode_fp8_plain(codes, factors, x, n, block);
  const __m128i sign_bit = _mm_set1_epi16(0x80), mag_mask = _mm_set1_epi16(0x7f);
  for (std::size_t b = 0; b < n; b += block) {
    const __m256 f = _mm256_set1_ps(factors[b / block]);
    for (std::size_t i = b; i < b + block; i += 8) {
      const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(c, sign_bit), 8);
      const __m128i mag = _mm_and_si128(c, mag_mask);
      const __m128i h = _mm_blendv_epi8(_mm_or_si128(sign, _mm_slli_epi16(mag, 7)), _mm_or_si128(sign, _mm_set1_epi16(0x7e00)),
                                        _mm_cmpeq_epi16(mag, mag_mask));
      const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));  // exact; NaN stays
      _mm256_storeu_ps(x + i, _mm256_mul_ps(v, f));
    }
  }
}

void decode_map_blocks(const std::uint8_t* codes, const float* scales, float* x, std::size_t n, std::size_t block,
                       const mixprec::optim_detail::CodeMap& map) noexcept {
  if (block % 32 != 0) return codec::decode_map_plain(codes, scales, x, n, block, map);
  for (std::size_t b = 0; b < n; b += block) {
    const __m256 s = _mm256_set1_ps(scales[b / block]);
    for (std::size_t i = b; i < b + block; i += 16) {
      const __m128i c = map.n == 16 ? codec::unpack_nibbles(codes + i / 2)
                                    : _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
      const __m256 lo = _mm256_i32gather_ps(map.values, _mm256_cvtepu8_epi32(c), 4);
      const __m256 hi = _mm256_i32gather_ps(map.values, _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)), 4);
      _mm256_storeu_ps(x + i, _mm256_mul_ps(lo, s));
      _mm256_storeu_ps(x + i + 8, _mm256_mul_ps(hi, s));
    }
  }
}

#else  // the reference back end: the plain loops

void encode_fp8_blocks(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block) noexcept {
  codec::encode_fp8_plain(x, codes, scales, n, block);
}
void encode_fp8_scaled(const float* x, std::uint8_t* codes, std::size_t n, float qscale) noexcept {
  codec::encode_fp8_scaled_plain(x, codes, n, qscale);
}
void encode_map_blocks(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block,
                       const mixprec::optim_detail::CodeMap& map) noexcept {
  codec::encode_map_plain(x, codes, scales, n, block, map);
}
void decode_fp8_blocks(const std::uint8_t* codes, const float* factors, float* x, std::size_t n,
                       std::size_t block) noexcept {
  codec::decode_fp8_plain(codes, factors, x, n, block);
}
void decode_map_blocks(const std::uint8_t* codes, const float* scales, float* x, std::size_t n, std::size_t block,
                       const mixprec::optim_detail::CodeMap& map) noexcept {
  codec::decode_map_plain(codes, scales, x, n, block, map);
}

#endif
