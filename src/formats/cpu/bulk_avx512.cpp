// AVX-512 back end of the 16-bit encodes (f16 and bf16): encode, encode_counted,
// encode_round and encode_round_counted, 32 elements an iteration in 32-bit lanes,
// with mask registers for the NaN fix, saturation, flush and the counters. Every
// other kernel (decodes, fp8, stochastic rounding, block scaling, amax) is the AVX2
// back end's: they were measured memory-bound there already. Heads and tails go
// through the scalar loops, so every element matches the reference bit for bit
// (tests/formats: every input class, and all 2^32 inputs against the reference).
//
// Rounding to nearest even, as the AVX2 back end:
//   f16   vcvtps2ph (AVX-512F, the hardware oracle);
//   bf16  the integer trick (bits + 0x7fff + lsb) >> 16, NaN lanes made quiet.
// (vcvtneps2bf16 is not used: it flushes subnormal inputs and outputs.)
//
// Compiled for AVX-512 F/BW/DQ/VL per function (target pragma, no -m flags), called
// only after isa_available(Isa::avx512).
#include "formats/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <bit>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma,popcnt"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma,popcnt")
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), a self-initialised
// variable that -W(maybe-)uninitialized reports in every caller (as in
// src/kernels/cpu/unscale_avx512.cpp). GCC only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace mixprec::detail {
namespace {

constexpr int kPrefetchBytes = 2048;  // streamed sources, as the AVX2 back end

inline __m512i set1(std::uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
inline __m512i abs_bits(__m512 v) { return _mm512_and_si512(_mm512_castps_si512(v), set1(0x7fffffffu)); }
inline unsigned count(__mmask16 m) { return static_cast<unsigned>(std::popcount(static_cast<unsigned>(m))); }

constexpr bool is_f16(const MiniFloatSpec& s) {
  return s.bits == kF16Spec.bits && s.man_bits == kF16Spec.man_bits && s.bias == kF16Spec.bias;
}

// 16 codes in 32-bit lanes: round to nearest even, IEEE overflow, subnormals kept.
template <const MiniFloatSpec& S>
inline __m512i raw_codes(__m512 y) {
  if constexpr (is_f16(S)) {
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(set1(0x7fffu), _mm512_and_si512(hi, set1(1)))), 16);
    // NaN: keep sign and top payload bits, set the quiet bit (the add may have carried).
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs_bits(y), set1(0x7f800000u));
    return nan == 0 ? r : _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, set1(0x40u)));
  }
}

// Exact decode of 16 codes in 32-bit lanes.
template <const MiniFloatSpec& S>
inline __m512 decode_codes(__m512i c) {
  if constexpr (is_f16(S)) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(c));
  else return _mm512_castsi512_ps(_mm512_slli_epi32(c, 16));
}

constexpr std::uint32_t kMag = 0x7fffu;
constexpr std::uint32_t kSign = 0x8000u;

// The counters of encode_counted (same definitions as the AVX2 back end's), on raw codes.
struct Counts {
  std::uint64_t elements = 0, zero_in = 0, zero_out = 0, small_out = 0, past_max = 0, nonfinite = 0;

  template <const MiniFloatSpec& S>
  void add(__m512 x, __m512i raw) {
    const __m512i mag = _mm512_and_si512(raw, set1(kMag));
    elements += 16;
    zero_in += count(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ));
    zero_out += count(_mm512_cmpeq_epi32_mask(mag, _mm512_setzero_si512()));
    small_out += count(_mm512_cmplt_epu32_mask(mag, set1(1u << S.man_bits)));
    const __mmask16 past = _mm512_cmpge_epu32_mask(mag, set1(S.overflow_code));
    if (past != 0) {
      past_max += count(past);
      nonfinite += count(_mm512_cmpge_epu32_mask(abs_bits(x), set1(0x7f800000u)));
    }
  }

  ConversionStats stats(bool flush) const {
    ConversionStats s;
    s.elements = elements;
    s.nonzero = elements - zero_in;
    s.nonfinite_input = nonfinite;
    s.underflow = (flush ? small_out : zero_out) - zero_in;
    s.subnormal = flush ? 0 : small_out - zero_out;
    s.overflow = past_max - nonfinite;
    return s;
  }
};

// The stored codes: raw codes after saturation (inf -> max finite, NaN kept) and flush
// (subnormal -> zero of the same sign).
template <const MiniFloatSpec& S>
inline __m512i finish_codes(__m512i c, bool saturate, bool flush) {
  if (saturate) {
    const __mmask16 inf = _mm512_cmpeq_epi32_mask(_mm512_and_si512(c, set1(kMag)), set1(S.overflow_code));
    c = _mm512_mask_mov_epi32(c, inf, _mm512_or_si512(_mm512_and_si512(c, set1(kSign)), set1(S.max_code)));
  }
  if (flush) {
    const __mmask16 small = _mm512_cmplt_epu32_mask(_mm512_and_si512(c, set1(kMag)), set1(1u << S.man_bits));
    c = _mm512_mask_and_epi32(c, small, c, set1(kSign));
  }
  return c;
}

template <bool kStream>
inline void store_halves(std::uint16_t* d, __m256i h) {
  if constexpr (kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(d), h);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), h);
}
template <bool kStream>
inline void store_codes(std::uint16_t* d, __m512i c) {
  store_halves<kStream>(d, _mm512_cvtepi32_epi16(c));
}

// The body over whole blocks of 32; returns how many elements it did. kAmax folds max |x|
// (magnitude bits) into *amax; kRound writes decode(code) * (1 / o.scale) to back (back
// may be src: each block is loaded before it is overwritten).
template <const MiniFloatSpec& S, bool kCount, bool kStream, bool kAmax, bool kRound>
std::size_t encode_blocks(const float* src, std::uint16_t* dst, std::size_t n, const ConvertOptions& o, Counts& counts,
                          std::uint32_t* amax, float* back) {
  const bool saturate = o.overflow == Overflow::saturate;
  const bool flush = o.subnormals == Subnormals::flush;
  const bool scaled = o.scale != 1.0f;
  const __m512 scale = _mm512_set1_ps(o.scale);
  [[maybe_unused]] const __m512 unscale = _mm512_set1_ps(1.0f / o.scale);
  __m512i amax_acc = _mm512_setzero_si512();
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if constexpr (kStream) {  // both source lines of the block
      _mm_prefetch(reinterpret_cast<const char*>(src + i) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(src + i + 16) + kPrefetchBytes, _MM_HINT_T0);
    }
    const __m512 x0 = _mm512_loadu_ps(src + i);
    const __m512 x1 = _mm512_loadu_ps(src + i + 16);
    if constexpr (kAmax) amax_acc = _mm512_max_epu32(amax_acc, _mm512_max_epu32(abs_bits(x0), abs_bits(x1)));
    const __m512 y0 = scaled ? _mm512_mul_ps(x0, scale) : x0;  // x * 1 == x, bit for bit, after rounding
    const __m512 y1 = scaled ? _mm512_mul_ps(x1, scale) : x1;
    if constexpr (is_f16(S) && !kCount && !kRound) {
      if (!saturate && !flush) {  // the plain f16 encode: vcvtps2ph's codes are the stored ones
        store_halves<kStream>(dst + i, _mm512_cvtps_ph(y0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        store_halves<kStream>(dst + i + 16, _mm512_cvtps_ph(y1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        continue;
      }
    }
    __m512i c0 = raw_codes<S>(y0), c1 = raw_codes<S>(y1);
    if constexpr (kCount) {
      counts.add<S>(x0, c0);
      counts.add<S>(x1, c1);
    }
    c0 = finish_codes<S>(c0, saturate, flush);
    c1 = finish_codes<S>(c1, saturate, flush);
    store_codes<kStream>(dst + i, c0);
    store_codes<kStream>(dst + i + 16, c1);
    if constexpr (kRound) {
      __m512 lo = decode_codes<S>(c0), hi = decode_codes<S>(c1);
      if (scaled) {
        lo = _mm512_mul_ps(lo, unscale);
        hi = _mm512_mul_ps(hi, unscale);
      }
      _mm512_storeu_ps(back + i, lo);
      _mm512_storeu_ps(back + i + 16, hi);
    }
  }
  if constexpr (kAmax) {
    const std::uint32_t m = _mm512_reduce_max_epu32(amax_acc);
    *amax = m > *amax ? m : *amax;
  }
  return i;
}

// Elements before dst reaches a 64-byte boundary (at most n).
inline std::size_t head_to_align(const std::uint16_t* dst, std::size_t n) {
  const auto mis = reinterpret_cast<std::uintptr_t>(dst) % 64;
  if (mis == 0) return 0;
  const std::size_t head = (64 - mis) / sizeof(std::uint16_t);
  return head < n ? head : n;
}

inline bool streamed(std::size_t n) { return n * (sizeof(float) + sizeof(std::uint16_t)) >= kStreamingStoreBytes; }

template <const MiniFloatSpec& S, bool kCount>
ConversionStats encode_kernel(const float* src, void* dst_v, std::size_t n, const ConvertOptions& o) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  Counts counts;
  ConversionStats head_tail;
  std::size_t i = 0;
  if (streamed(n)) {
    i = head_to_align(dst, n);
    if constexpr (kCount) encode_counted_range<S>(src, dst, i, o, head_tail);
    else encode_range<S>(src, dst, i, o);
    i += encode_blocks<S, kCount, true, false, false>(src + i, dst + i, n - i, o, counts, nullptr, nullptr);
    _mm_sfence();
  } else {
    i = encode_blocks<S, kCount, false, false, false>(src, dst, n, o, counts, nullptr, nullptr);
  }
  if constexpr (kCount) {
    encode_counted_range<S>(src + i, dst + i, n - i, o, head_tail);
    ConversionStats s = counts.stats(o.subnormals == Subnormals::flush);
    s += head_tail;
    return s;
  } else {
    encode_range<S>(src + i, dst + i, n - i, o);
    return {};
  }
}

template <const MiniFloatSpec& S, bool kCount>
ConversionStats encode_round_kernel(float* v, void* dst_v, std::size_t n, const ConvertOptions& o,
                                    std::uint32_t* amax_bits) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  Counts counts;
  ConversionStats head_tail;
  std::uint32_t m = 0;
  std::size_t i = 0;
  if (streamed(n)) {
    i = head_to_align(dst, n);
    if constexpr (kCount) encode_round_counted_range<S>(v, dst, i, o, head_tail, m);
    else encode_round_range<S>(v, dst, i, o);
    i += encode_blocks<S, kCount, true, kCount, true>(v + i, dst + i, n - i, o, counts, &m, v + i);
    _mm_sfence();
  } else {
    i = encode_blocks<S, kCount, false, kCount, true>(v, dst, n, o, counts, &m, v);
  }
  if constexpr (kCount) {
    encode_round_counted_range<S>(v + i, dst + i, n - i, o, head_tail, m);
    *amax_bits = m;
    ConversionStats s = counts.stats(o.subnormals == Subnormals::flush);
    s += head_tail;
    return s;
  } else {
    encode_round_range<S>(v + i, dst + i, n - i, o);
    return {};
  }
}

}  // namespace
}  // namespace mixprec::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace mixprec::detail {
namespace {

template <const MiniFloatSpec& S>
void with_avx512_encodes(FormatKernels& k) {
  k.encode = [](const float* s, void* d, std::size_t n, const ConvertOptions& o) {
    (void)encode_kernel<S, false>(s, d, n, o);
  };
  k.encode_counted = &encode_kernel<S, true>;
  k.encode_round = [](float* v, void* d, std::size_t n, const ConvertOptions& o) {
    (void)encode_round_kernel<S, false>(v, d, n, o, nullptr);
  };
  k.encode_round_counted = &encode_round_kernel<S, true>;
}

}  // namespace

const KernelTable* avx512_kernels() noexcept {
  static const KernelTable table = [] {
    const KernelTable* avx2 = avx2_kernels();
    KernelTable t = *avx2;
    t.isa = Isa::avx512;
    with_avx512_encodes<kF16Spec>(t.f16);
    with_avx512_encodes<kBF16Spec>(t.bf16);
    return t;
  }();
  return &table;
}

}  // namespace mixprec::detail

#else  // not x86-64: no AVX-512 back end

namespace mixprec::detail {
const KernelTable* avx512_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
