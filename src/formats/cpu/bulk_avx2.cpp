// AVX2 + F16C back end. Its kernels are compiled for AVX2, F16C and FMA (per function,
// core/simd_target.hpp) and only called after isa_available() has checked the CPU.
// Sixteen elements an iteration; heads and tails go through the scalar loops, so every
// element matches the reference bit for bit (the exhaustive tests sweep all 2^32 inputs).
//
// How each encode rounds to nearest even:
//   f16   vcvtps2ph, the hardware oracle;
//   bf16  the integer trick (bits + 0x7fff + lsb) >> 16;
//   fp8   the SIMD back ends' one minifloat encoder (formats/cpu/minifloat_simd.hpp):
//         normal results by the same integer trick after rebiasing the exponent,
//         subnormal results from |y| + 2^(23 + log2 min_subnormal) in fp32, whose
//         rounding (MXCSR default, round to nearest even) lands on the code.
// Stochastic rounding runs the reference algorithm in integer lanes.
// Saturation and flush-to-zero are applied to the 16-bit codes afterwards.
//
// Arrays too large to stay in cache are written with non-temporal stores:
// it saves the read-for-ownership of every destination line.
#include "formats/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"
#include "formats/cpu/minifloat_simd.hpp"

// Only the kernels are compiled for AVX2 (core/simd_target.hpp says why); avx2_kernels(),
// which only fills the table, is baseline code.
MIXPREC_TARGET_AVX2_F16C_FMA_BEGIN



namespace mixprec::detail {
namespace {

constexpr std::size_t kStreamBytes = kStreamingStoreBytes;
// Software prefetch distance for streamed sources (measured: +10-20% on one thread).
constexpr int kPrefetchBytes = 2048;

using avx2::set1;
inline __m256i set1_16(std::uint16_t v) { return _mm256_set1_epi16(static_cast<short>(v)); }
inline __m256i abs_bits(__m256 v) { return _mm256_and_si256(_mm256_castps_si256(v), set1(0x7fffffffu)); }

template <const MiniFloatSpec& S>
using StorageOf = std::conditional_t<S.bits == 16, std::uint16_t, std::uint8_t>;

// Layout equality (address comparison of the specs is not a constant
// expression under the sanitizers).
constexpr bool same_format(const MiniFloatSpec& a, const MiniFloatSpec& b) {
  return a.bits == b.bits && a.man_bits == b.man_bits && a.bias == b.bias && a.has_inf == b.has_inf;
}

// Two vectors of 8 codes in 32-bit lanes -> 16 codes in 16-bit lanes, in order.
inline __m256i pack_32_to_16(__m256i lo, __m256i hi) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
}

// ---- raw codes: round to nearest even, IEEE overflow, subnormals kept --------
// (E4M3, which has no infinity to recognise afterwards, takes its overflow
// code here: NaN, or max finite when saturating; the others their inf code.)

// Rounds 8 lanes; NaN lanes come out wrong and are fixed by bf16_nan_fix.
inline __m256i bf16_round8(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), set1(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(set1(0x7fffu), lsb)), 16);
}
inline __m256i bf16_nan_mask(__m256 y) { return _mm256_cmpgt_epi32(abs_bits(y), set1(0x7f800000u)); }
// NaN: keep sign and top payload bits, set the quiet bit.
inline __m256i bf16_nan_fix(__m256 y, __m256i r, __m256i nan) {
  const __m256i q = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 16), set1(0x40u));
  return _mm256_blendv_epi8(r, q, nan);
}

// 16 codes, in 16-bit lanes, for y0 (elements 0-7) and y1 (8-15).
template <const MiniFloatSpec& S>
inline __m256i raw_codes16(__m256 y0, __m256 y1, __m256i fp8_ovf_code) {
  if constexpr (same_format(S, kF16Spec)) {
    return _mm256_set_m128i(_mm256_cvtps_ph(y1, 0), _mm256_cvtps_ph(y0, 0));
  } else if constexpr (same_format(S, kBF16Spec)) {
    __m256i r0 = bf16_round8(y0), r1 = bf16_round8(y1);
    const __m256 any_nan = _mm256_cmp_ps(y0, y1, _CMP_UNORD_Q);  // a lane where y0 or y1 is NaN
    if (!_mm256_testz_ps(any_nan, any_nan)) {  // rare: fix NaN lanes only when a block has one
      r0 = bf16_nan_fix(y0, r0, bf16_nan_mask(y0));
      r1 = bf16_nan_fix(y1, r1, bf16_nan_mask(y1));
    }
    return pack_32_to_16(r0, r1);
  } else {
    const __m256i ovf = S.has_inf ? set1(S.overflow_code) : fp8_ovf_code;
    return pack_32_to_16(avx2::encode8_rne<S>(y0, ovf), avx2::encode8_rne<S>(y1, ovf));
  }
}

template <const MiniFloatSpec& S>
constexpr std::uint16_t mag_mask16() {
  return static_cast<std::uint16_t>((1u << (S.bits - 1)) - 1);
}

// Formats with infinity: +-inf codes become +-max (E4M3 saturates in encode8_rne).
template <const MiniFloatSpec& S>
inline __m256i saturate16(__m256i c) {
  const __m256i mag = _mm256_and_si256(c, set1_16(mag_mask16<S>()));
  const __m256i inf = _mm256_cmpeq_epi16(mag, set1_16(static_cast<std::uint16_t>(S.overflow_code)));
  const __m256i maxed = _mm256_or_si256(_mm256_andnot_si256(set1_16(mag_mask16<S>()), c),
                                        set1_16(static_cast<std::uint16_t>(S.max_code)));
  return _mm256_blendv_epi8(c, maxed, inf);
}

// Subnormal codes become zeros of the same sign.
template <const MiniFloatSpec& S>
inline __m256i flush16(__m256i c) {
  const __m256i magmask = set1_16(mag_mask16<S>());
  const __m256i small = _mm256_cmpgt_epi16(set1_16(1u << S.man_bits), _mm256_and_si256(c, magmask));
  return _mm256_andnot_si256(_mm256_and_si256(small, magmask), c);
}

// ---- counting ---------------------------------------------------------------
// Four 16-bit lane counters on the raw codes (before saturation and flush):
// zeros in, zero codes, codes below min normal, codes at or past the overflow
// code (inf/NaN). The stats follow, because only a finite input can give a code
// below min normal and every non-finite input lands at or past the overflow code:
//   underflow = zero codes (flush: codes below min normal) - zeros in
//   subnormal = codes below min normal - zero codes       (flush: none)
//   overflow  = codes past max - non-finite inputs
// Non-finite inputs are rare: a block with a code past max counts them in a
// scalar loop over its 16 inputs.
template <const MiniFloatSpec& S>
struct Counters {
  // Written out so that it is compiled inside the AVX2 region (an implicit one may not be).
  Counters()
      : zero_in(_mm256_setzero_si256()),
        zero_out(_mm256_setzero_si256()),
        small_out(_mm256_setzero_si256()),
        past_max(_mm256_setzero_si256()) {}
  __m256i zero_in, zero_out, small_out, past_max;
  std::uint64_t nonfinite = 0;
  std::uint64_t blocks = 0;
  ConversionStats total;

  // Adds the lane counts (each < 2^16) to the totals and clears them.
  void spill(bool flush) {
    auto sum = [](__m256i v) {
      return simd::hsum_epu32(
          _mm256_add_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(v, 16)));
    };
    const std::uint64_t elems = blocks * 16;
    const std::uint64_t zin = sum(zero_in), zout = sum(zero_out), small = sum(small_out), past = sum(past_max);
    total.elements += elems;
    total.nonzero += elems - zin;
    total.nonfinite_input += nonfinite;
    total.underflow += (flush ? small : zout) - zin;
    total.subnormal += flush ? 0 : small - zout;
    total.overflow += past - nonfinite;
    zero_in = zero_out = small_out = past_max = _mm256_setzero_si256();
    nonfinite = 0;
    blocks = 0;
  }

  // past: 16-bit lanes set where the value is at or past the overflow point.
  void add(__m256 x0, __m256 x1, __m256i raw, __m256i past) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256i zin = _mm256_packs_epi32(_mm256_castps_si256(_mm256_cmp_ps(x0, zero, _CMP_EQ_OQ)),
                                           _mm256_castps_si256(_mm256_cmp_ps(x1, zero, _CMP_EQ_OQ)));
    const __m256i mag = _mm256_and_si256(raw, set1_16(mag_mask16<S>()));
    zero_in = _mm256_sub_epi16(zero_in, zin);
    zero_out = _mm256_sub_epi16(zero_out, _mm256_cmpeq_epi16(mag, _mm256_setzero_si256()));
    small_out = _mm256_sub_epi16(small_out, _mm256_cmpgt_epi16(set1_16(1u << S.man_bits), mag));
    past_max = _mm256_sub_epi16(past_max, past);
    if (!_mm256_testz_si256(past, past)) {
      alignas(32) std::uint32_t b[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(b), abs_bits(x0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(b + 8), abs_bits(x1));
      for (std::uint32_t v : b) nonfinite += v >= 0x7f800000u;
    }
    ++blocks;
  }

  // Lanes at or past the overflow point, from raw codes.
  static __m256i past_from_codes(__m256i raw) {
    const __m256i mag = _mm256_and_si256(raw, set1_16(mag_mask16<S>()));
    return _mm256_cmpgt_epi16(mag, set1_16(static_cast<std::uint16_t>(S.overflow_code - 1)));
  }
  // The same from the scaled inputs (E4M3 saturating: its raw codes hide overflow).
  static __m256i past_from_values(__m256 y0, __m256 y1) {
    const __m256i threshold = set1(overflow_threshold_bits(S) - 1);
    return _mm256_packs_epi32(_mm256_cmpgt_epi32(abs_bits(y0), threshold), _mm256_cmpgt_epi32(abs_bits(y1), threshold));
  }
};

// ---- stores -------------------------------------------------------------------
template <bool kStream>
inline void store16(std::uint16_t* d, __m256i c) {
  if constexpr (kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(d), c);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), c);
}
template <bool kStream>
inline void store16(std::uint8_t* d, __m256i c) {
  const __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  if constexpr (kStream) _mm_stream_si128(reinterpret_cast<__m128i*>(d), b);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(d), b);
}
template <bool kStream>
inline void store8f(float* d, __m256 v) {
  if constexpr (kStream) _mm256_stream_ps(d, v);
  else _mm256_storeu_ps(d, v);
}

// Elements before dst reaches `align` bytes (at most n).
template <class T>
std::size_t head_to_align(const T* dst, std::size_t align, std::size_t n) {
  const auto mis = reinterpret_cast<std::uintptr_t>(dst) % align;
  if (mis == 0) return 0;
  const std::size_t head = (align - mis) / sizeof(T);
  return head < n ? head : n;
}

// ---- encode ---------------------------------------------------------------------
template <const MiniFloatSpec& S>
inline void decode_codes16(__m256i h, bool flush, __m256& lo, __m256& hi);

// kAmax: also folds max |x| (magnitude bits, unsigned) into *amax.
// kRound: also writes the codes decoded back, times 1 / o.scale, to back[0, n) (store and
// round; back may be src: each block is loaded before it is overwritten).
template <const MiniFloatSpec& S, bool kCount, bool kStream, bool kAmax = false, bool kRound = false>
std::size_t encode_blocks(const float* src, StorageOf<S>* dst, std::size_t n, const ConvertOptions& o,
                          Counters<S>& counters, __m256i* amax = nullptr, float* back = nullptr) {
  __m256i amax_acc = _mm256_setzero_si256();
  [[maybe_unused]] const __m256 unscale = _mm256_set1_ps(1.0f / o.scale);
  const bool saturate = o.overflow == Overflow::saturate;
  const bool flush = o.subnormals == Subnormals::flush;
  const __m256 scale = _mm256_set1_ps(o.scale);
  const bool scaled = o.scale != 1.0f;
  const __m256i fp8_ovf = set1(saturate ? S.max_code : S.overflow_code);
  constexpr std::size_t kSpillEvery = std::size_t{16} << 15;  // 16-bit lane counters must not wrap
  std::size_t i = 0;
  while (i + 16 <= n) {
    const std::size_t end = (kCount && n - i > kSpillEvery) ? i + kSpillEvery : n;
    for (; i + 16 <= end; i += 16) {
      if constexpr (kStream) _mm_prefetch(reinterpret_cast<const char*>(src + i) + kPrefetchBytes, _MM_HINT_T0);
      const __m256 x0 = _mm256_loadu_ps(src + i);
      const __m256 x1 = _mm256_loadu_ps(src + i + 8);
      if constexpr (kAmax) amax_acc = _mm256_max_epu32(amax_acc, _mm256_max_epu32(abs_bits(x0), abs_bits(x1)));
      const __m256 y0 = scaled ? _mm256_mul_ps(x0, scale) : x0;  // x * 1 == x, bit for bit, after rounding
      const __m256 y1 = scaled ? _mm256_mul_ps(x1, scale) : x1;
      __m256i c = raw_codes16<S>(y0, y1, fp8_ovf);
      if constexpr (kCount) {
        const __m256i past = (!S.has_inf && saturate) ? Counters<S>::past_from_values(y0, y1)
                                                      : Counters<S>::past_from_codes(c);
        counters.add(x0, x1, c, past);
      }
      if constexpr (S.has_inf) {
        if (saturate) c = saturate16<S>(c);
      }
      if (flush) c = flush16<S>(c);
      store16<kStream>(dst + i, c);
      if constexpr (kRound) {
        // Regular stores: v's lines were just read, so they are in cache already.
        __m256 lo, hi;
        decode_codes16<S>(c, flush, lo, hi);
        if (scaled) {
          lo = _mm256_mul_ps(lo, unscale);
          hi = _mm256_mul_ps(hi, unscale);
        }
        _mm256_storeu_ps(back + i, lo);
        _mm256_storeu_ps(back + i + 8, hi);
      }
    }
    if constexpr (kCount) counters.spill(flush);
  }
  if constexpr (kAmax) *amax = _mm256_max_epu32(*amax, amax_acc);
  return i;
}

template <const MiniFloatSpec& S, bool kCount>
ConversionStats encode_kernel(const float* src, void* dst_v, std::size_t n, const ConvertOptions& o) {
  using Storage = StorageOf<S>;
  auto* dst = static_cast<Storage*>(dst_v);
  Counters<S> counters;
  ConversionStats head_tail;
  std::size_t i = 0;
  if (n * (sizeof(float) + sizeof(Storage)) >= kStreamBytes) {
    i = head_to_align(dst, S.bits == 16 ? 32 : 16, n);
    if constexpr (kCount) encode_counted_range<S>(src, dst, i, o, head_tail);
    else encode_range<S>(src, dst, i, o);
    i += encode_blocks<S, kCount, true>(src + i, dst + i, n - i, o, counters);
    _mm_sfence();
  } else {
    i = encode_blocks<S, kCount, false>(src, dst, n, o, counters);
  }
  if constexpr (kCount) {
    encode_counted_range<S>(src + i, dst + i, n - i, o, head_tail);
    counters.total += head_tail;
  } else {
    encode_range<S>(src + i, dst + i, n - i, o);
  }
  return counters.total;
}

// encode + amax in one pass (FP8 quantize with a fused amax): the same codes as encode_kernel.
template <const MiniFloatSpec& S>
std::uint32_t encode_amax_kernel(const float* src, void* dst_v, std::size_t n, const ConvertOptions& o) {
  using Storage = StorageOf<S>;
  auto* dst = static_cast<Storage*>(dst_v);
  Counters<S> unused;
  __m256i amax = _mm256_setzero_si256();
  std::uint32_t m = 0;
  std::size_t i = 0;
  if (n * (sizeof(float) + sizeof(Storage)) >= kStreamBytes) {
    i = head_to_align(dst, S.bits == 16 ? 32 : 16, n);
    m = encode_amax_range<S>(src, dst, i, o);
    i += encode_blocks<S, false, true, true>(src + i, dst + i, n - i, o, unused, &amax);
    _mm_sfence();
  } else {
    i = encode_blocks<S, false, false, true>(src, dst, n, o, unused, &amax);
  }
  const std::uint32_t tail = encode_amax_range<S>(src + i, dst + i, n - i, o);
  const std::uint32_t body = simd::hmax_epu32(amax);
  m = m > tail ? m : tail;
  return m > body ? m : body;
}

// Store and round in one pass: the codes of encode_kernel, then v decoded back from
// them; kCount adds encode_counted's stats and the input's amax bits.
template <const MiniFloatSpec& S, bool kCount>
ConversionStats encode_round_kernel(float* v, void* dst_v, std::size_t n, const ConvertOptions& o,
                                    std::uint32_t* amax_bits) {
  using Storage = StorageOf<S>;
  auto* dst = static_cast<Storage*>(dst_v);
  Counters<S> counters;
  ConversionStats head_tail;
  __m256i amax = _mm256_setzero_si256();
  std::uint32_t m = 0;
  std::size_t i = 0;
  if (n * (sizeof(float) + sizeof(Storage)) >= kStreamBytes) {
    i = head_to_align(dst, S.bits == 16 ? 32 : 16, n);
    if constexpr (kCount) encode_round_counted_range<S>(v, dst, i, o, head_tail, m);
    else encode_round_range<S>(v, dst, i, o);
    i += encode_blocks<S, kCount, true, kCount, true>(v + i, dst + i, n - i, o, counters, &amax, v + i);
    _mm_sfence();
  } else {
    i = encode_blocks<S, kCount, false, kCount, true>(v, dst, n, o, counters, &amax, v);
  }
  if constexpr (kCount) {
    encode_round_counted_range<S>(v + i, dst + i, n - i, o, head_tail, m);
    counters.total += head_tail;
    const std::uint32_t body = simd::hmax_epu32(amax);
    *amax_bits = m > body ? m : body;
  } else {
    encode_round_range<S>(v + i, dst + i, n - i, o);
  }
  return counters.total;
}

// Block-scaled encode (MX): blocks whose length is a multiple of 16 run 16 lanes at a
// time with the block's factor broadcast; anything else goes through the scalar loop.
template <const MiniFloatSpec& S>
void encode_block_scaled_kernel(const float* src, void* dst_v, std::size_t n, std::size_t block,
                                const float* factors, const ConvertOptions& o) {
  using Storage = StorageOf<S>;
  auto* dst = static_cast<Storage*>(dst_v);
  if (block % 16 != 0) {
    encode_block_scaled_range<S>(src, dst, 0, n, block, factors, o);
    return;
  }
  const bool saturate = o.overflow == Overflow::saturate;
  const bool flush = o.subnormals == Subnormals::flush;
  const __m256i fp8_ovf = set1(saturate ? S.max_code : S.overflow_code);
  const std::size_t full = n / block * block;
  for (std::size_t b = 0; b * block < full; ++b) {
    const __m256 f = _mm256_set1_ps(factors[b]);
    for (std::size_t i = b * block; i < (b + 1) * block; i += 16) {
      const __m256 y0 = _mm256_mul_ps(_mm256_loadu_ps(src + i), f);
      const __m256 y1 = _mm256_mul_ps(_mm256_loadu_ps(src + i + 8), f);
      __m256i c = raw_codes16<S>(y0, y1, fp8_ovf);
      if constexpr (S.has_inf) {
        if (saturate) c = saturate16<S>(c);
      }
      if (flush) c = flush16<S>(c);
      store16<false>(dst + i, c);
    }
  }
  encode_block_scaled_range<S>(src, dst, full, n - full, block, factors, o);
}

// ---- amax reductions ----------------------------------------------------------
std::uint32_t amax_bits_kernel(const float* src, std::size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_max_epu32(a0, abs_bits(_mm256_loadu_ps(src + i)));
    a1 = _mm256_max_epu32(a1, abs_bits(_mm256_loadu_ps(src + i + 8)));
    a2 = _mm256_max_epu32(a2, abs_bits(_mm256_loadu_ps(src + i + 16)));
    a3 = _mm256_max_epu32(a3, abs_bits(_mm256_loadu_ps(src + i + 24)));
  }
  const std::uint32_t body = simd::hmax_epu32(_mm256_max_epu32(_mm256_max_epu32(a0, a1), _mm256_max_epu32(a2, a3)));
  const std::uint32_t tail = amax_bits_range(src + i, n - i);
  return body > tail ? body : tail;
}

// Blocks whose length is a multiple of 8 run 8 lanes at a time. maxps(|x|, m) returns m
// when |x| is NaN, which is fmaxf's NaN-ignoring rule.
void block_amax_kernel(const float* src, std::size_t n, std::size_t block, std::uint32_t* bits,
                       float* max_ignoring_nan) {
  if (block % 8 != 0) {
    block_amax_range(src, n, block, bits, max_ignoring_nan);
    return;
  }
  const std::size_t full = n / block;
  for (std::size_t b = 0; b < full; ++b) {
    __m256i m = _mm256_setzero_si256();
    __m256 f = _mm256_setzero_ps();
    for (std::size_t i = b * block; i < (b + 1) * block; i += 8) {
      const __m256i a = abs_bits(_mm256_loadu_ps(src + i));
      m = _mm256_max_epu32(m, a);
      f = _mm256_max_ps(_mm256_castsi256_ps(a), f);
    }
    // Lane maxima in registers: halves, then pairs, then neighbours. No lane of f is NaN.
    __m256i mb = _mm256_max_epu32(m, _mm256_permute2x128_si256(m, m, 1));
    mb = _mm256_max_epu32(mb, _mm256_shuffle_epi32(mb, 0x4e));
    mb = _mm256_max_epu32(mb, _mm256_shuffle_epi32(mb, 0xb1));
    bits[b] = static_cast<std::uint32_t>(_mm256_cvtsi256_si32(mb));
    __m256 mf = _mm256_max_ps(f, _mm256_permute2f128_ps(f, f, 1));
    mf = _mm256_max_ps(mf, _mm256_shuffle_ps(mf, mf, 0x4e));
    mf = _mm256_max_ps(mf, _mm256_shuffle_ps(mf, mf, 0xb1));
    max_ignoring_nan[b] = _mm256_cvtss_f32(mf);
  }
  if (full * block < n) block_amax_range(src + full * block, n - full * block, block, bits + full, max_ignoring_nan + full);
}

// ---- stochastic rounding: the reference algorithm, eight integer lanes --------
template <const MiniFloatSpec& S>
inline __m256i encode8_stochastic(__m256 y, __m256i rnd, __m256i ovf_code, bool flush) {
  constexpr int M = S.man_bits;
  constexpr int kMinE = min_normal_f32_exponent(S);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i u = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(u, set1(0x7fffffffu));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), S.bits - 1);
  const __m256i mant = _mm256_and_si256(a, set1(0x7fffffu));
  __m256i e32 = _mm256_srli_epi32(a, 23);
  __m256i sig = _mm256_or_si256(mant, _mm256_and_si256(_mm256_cmpgt_epi32(e32, zero), set1(0x800000u)));
  e32 = _mm256_max_epi32(e32, set1(1));
  const __m256i diff = _mm256_sub_epi32(e32, set1(static_cast<std::uint32_t>(kMinE)));
  const __m256i target_normal = _mm256_cmpgt_epi32(diff, set1(0xffffffffu));  // diff >= 0
  const __m256i base = _mm256_and_si256(target_normal, _mm256_slli_epi32(diff, M));
  __m256i shift = _mm256_add_epi32(set1(23 - M), _mm256_max_epi32(_mm256_sub_epi32(zero, diff), zero));
  const __m256i pre = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(shift, set1(31)), zero), set1(31));
  sig = _mm256_srlv_epi32(sig, pre);
  shift = _mm256_min_epi32(shift, set1(31));
  const __m256i add = _mm256_srlv_epi32(rnd, _mm256_sub_epi32(set1(32), shift));
  __m256i code = _mm256_add_epi32(base, _mm256_srlv_epi32(_mm256_add_epi32(sig, add), shift));
  code = _mm256_blendv_epi8(code, ovf_code, _mm256_cmpgt_epi32(code, set1(S.max_code)));
  if (flush) code = _mm256_andnot_si256(_mm256_cmpgt_epi32(set1(1u << M), code), code);
  __m256i nan_code;
  if constexpr (S.has_inf) {
    nan_code = _mm256_or_si256(set1(S.overflow_code | (1u << (M - 1))), _mm256_srli_epi32(mant, 23 - M));
  } else {
    nan_code = set1(S.nan_code);
  }
  code = _mm256_blendv_epi8(code, nan_code, _mm256_cmpgt_epi32(a, set1(0x7f800000u)));
  return _mm256_or_si256(code, sign);
}

template <const MiniFloatSpec& S>
void encode_stochastic_kernel(const float* src, void* dst_v, const std::uint32_t* random, std::size_t n,
                              const ConvertOptions& o) {
  auto* dst = static_cast<StorageOf<S>*>(dst_v);
  const bool flush = o.subnormals == Subnormals::flush;
  const __m256 scale = _mm256_set1_ps(o.scale);
  const __m256i ovf_code = set1(o.overflow == Overflow::saturate ? S.max_code : S.overflow_code);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const auto* r = reinterpret_cast<const __m256i*>(random + i);
    const __m256i c0 = encode8_stochastic<S>(_mm256_mul_ps(_mm256_loadu_ps(src + i), scale),
                                             _mm256_loadu_si256(r), ovf_code, flush);
    const __m256i c1 = encode8_stochastic<S>(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8), scale),
                                             _mm256_loadu_si256(r + 1), ovf_code, flush);
    store16<false>(dst + i, pack_32_to_16(c0, c1));
  }
  encode_stochastic_range<S>(src + i, dst + i, random + i, n - i, o);
}

// ---- decode ----------------------------------------------------------------------
// Subnormal f16 patterns (exponent field 0) become zeros of the same sign.
inline __m256i flush_f16_16(__m256i h) {
  const __m256i sub = _mm256_cmpeq_epi16(_mm256_and_si256(h, set1_16(0x7c00)), _mm256_setzero_si256());
  return _mm256_andnot_si256(_mm256_and_si256(sub, set1_16(0x7fff)), h);
}

inline void f16x16_to_f32(__m256i h, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 16 codes, one in each 16-bit lane of h (fp8: in the low byte) -> 16 floats
// (lo: elements 0-7, hi: 8-15), unscaled. Store and round decodes its codes
// straight from the register that encode made; decode16 loads them first.
template <const MiniFloatSpec& S>
inline void decode_codes16(__m256i h, bool flush, __m256& lo, __m256& hi) {
  if constexpr (same_format(S, kF16Spec)) {
    if (flush) h = flush_f16_16(h);
    f16x16_to_f32(h, lo, hi);
  } else if constexpr (same_format(S, kBF16Spec)) {
    const __m256i nan = _mm256_cmpgt_epi16(_mm256_and_si256(h, set1_16(0x7fff)), set1_16(0x7f80));
    h = _mm256_or_si256(h, _mm256_and_si256(nan, set1_16(0x0040)));  // quiet
    if (flush) {
      const __m256i sub = _mm256_cmpeq_epi16(_mm256_and_si256(h, set1_16(0x7f80)), _mm256_setzero_si256());
      h = _mm256_andnot_si256(_mm256_and_si256(sub, set1_16(0x7fff)), h);
    }
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
  } else if constexpr (same_format(S, kE5M2Spec)) {
    // E5M2 is the top byte of an f16.
    h = _mm256_slli_epi16(h, 8);
    if (flush) h = flush_f16_16(h);
    f16x16_to_f32(h, lo, hi);
  } else {
    // E4M3 into an f16 (bias 15 vs 7: the f16 value is 2^-8 of it), NaN as f16 NaN.
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, set1_16(0x80)), 8);
    __m256i mag = _mm256_and_si256(h, set1_16(0x7f));
    const __m256i nan = _mm256_cmpeq_epi16(mag, set1_16(0x7f));
    if (flush) {
      mag = _mm256_andnot_si256(_mm256_cmpeq_epi16(_mm256_and_si256(mag, set1_16(0x78)), _mm256_setzero_si256()),
                                mag);
    }
    __m256i f = _mm256_or_si256(sign, _mm256_slli_epi16(mag, 7));
    f = _mm256_blendv_epi8(f, _mm256_or_si256(sign, set1_16(0x7e00)), nan);
    f16x16_to_f32(f, lo, hi);
    const __m256 k256 = _mm256_set1_ps(256.0f);  // exact; NaN passes unchanged
    lo = _mm256_mul_ps(lo, k256);
    hi = _mm256_mul_ps(hi, k256);
  }
}

// 16 codes at src -> 16 floats, unscaled.
template <const MiniFloatSpec& S>
inline void decode16(const StorageOf<S>* src, bool flush, __m256& lo, __m256& hi) {
  if constexpr (S.bits == 16) {
    decode_codes16<S>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), flush, lo, hi);
  } else {
    decode_codes16<S>(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), flush, lo, hi);
  }
}

template <const MiniFloatSpec& S, bool kStream>
std::size_t decode_blocks(const StorageOf<S>* src, float* dst, std::size_t n, const ConvertOptions& o) {
  const bool flush = o.subnormals == Subnormals::flush;
  const __m256 scale = _mm256_set1_ps(o.scale);
  const bool scaled = o.scale != 1.0f;  // a decoded value times 1 is itself
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 lo, hi;
    decode16<S>(src + i, flush, lo, hi);
    if (scaled) {
      lo = _mm256_mul_ps(lo, scale);
      hi = _mm256_mul_ps(hi, scale);
    }
    store8f<kStream>(dst + i, lo);
    store8f<kStream>(dst + i + 8, hi);
  }
  return i;
}

template <const MiniFloatSpec& S>
void decode_kernel(const void* src_v, float* dst, std::size_t n, const ConvertOptions& o) {
  using Storage = StorageOf<S>;
  const auto* src = static_cast<const Storage*>(src_v);
  std::size_t i = 0;
  if (n * (sizeof(float) + sizeof(Storage)) >= kStreamBytes) {
    i = head_to_align(dst, 32, n);
    decode_range<S>(src, dst, i, o);
    i += decode_blocks<S, true>(src + i, dst + i, n - i, o);
    _mm_sfence();
  } else {
    i = decode_blocks<S, false>(src, dst, n, o);
  }
  decode_range<S>(src + i, dst + i, n - i, o);
}

template <const MiniFloatSpec& S>
void decode_block_scaled_kernel(const void* src_v, float* dst, std::size_t n, std::size_t block, const float* factors,
                                const ConvertOptions& o) {
  const auto* src = static_cast<const StorageOf<S>*>(src_v);
  if (block % 16 != 0) {
    decode_block_scaled_range<S>(src, dst, 0, n, block, factors, o);
    return;
  }
  const bool flush = o.subnormals == Subnormals::flush;
  const std::size_t full = n / block * block;
  for (std::size_t b = 0; b * block < full; ++b) {
    const __m256 f = _mm256_set1_ps(factors[b]);
    for (std::size_t i = b * block; i < (b + 1) * block; i += 16) {
      __m256 lo, hi;
      decode16<S>(src + i, flush, lo, hi);
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(lo, f));
      _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(hi, f));
    }
  }
  decode_block_scaled_range<S>(src, dst, full, n - full, block, factors, o);
}

}  // namespace
}  // namespace mixprec::detail
MIXPREC_TARGET_END

namespace mixprec::detail {
namespace {

template <const MiniFloatSpec& S>
FormatKernels make_avx2() {
  return FormatKernels{
      [](const float* s, void* d, std::size_t n, const ConvertOptions& o) {
        (void)encode_kernel<S, false>(s, d, n, o);
      },
      &encode_stochastic_kernel<S>,
      &encode_kernel<S, true>,
      &decode_kernel<S>,
      &encode_amax_kernel<S>,
      &encode_block_scaled_kernel<S>,
      &decode_block_scaled_kernel<S>,
      [](float* v, void* d, std::size_t n, const ConvertOptions& o) {
        (void)encode_round_kernel<S, false>(v, d, n, o, nullptr);
      },
      &encode_round_kernel<S, true>,
  };
}

}  // namespace

const KernelTable* avx2_kernels() noexcept {
  static const KernelTable table{
      Isa::avx2, make_avx2<kF16Spec>(), make_avx2<kBF16Spec>(), make_avx2<kE4M3Spec>(),
      make_avx2<kE5M2Spec>(), AmaxKernels{&amax_bits_kernel, &block_amax_kernel},
  };
  return &table;
}

}  // namespace mixprec::detail

#else  // not x86-64: no AVX2 back end

namespace mixprec::detail {
const KernelTable* avx2_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
