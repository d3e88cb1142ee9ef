// AVX-512 back end of the 16-bit encodes (f16 and bf16): encode, encode_counted,
// encode_round and encode_round_counted, 32 elements an iteration in 32-bit lanes,
// with mask registers for the NaN fix, saturation and flush, and vector lanes for the
// counters; and the tensor amax (amax_bits), which the FP8 and lowp recipes and amax_f32 run
// on data in cache too. Every other kernel (decodes, fp8, stochastic rounding, block scaling,
// block amax) is the AVX2 back end's: they were measured memory-bound there already. Heads and tails go
// through the scalar loops, so every element matches the reference bit for bit
// (tests/formats: every input class, and all 2^32 inputs against the reference).
//
// Rounding to nearest even, as the AVX2 back end:
//   f16   vcvtps2ph (AVX-512F, the hardware oracle);
//   bf16  where the CPU has AVX512-BF16, vcvtneps2bf16 (one instruction; the plain encode
//         packs two vectors with vcvtne2ps2bf16); it flushes subnormal inputs to zero, so
//         a vector holding one (vfpclassps) takes the integer trick. Elsewhere the
//         integer trick alone: (bits + 0x7fff + lsb) >> 16, NaN lanes made quiet (as
//         vcvtneps2bf16 quiets them). avx512_kernels(bool) gives either table; tests run
//         both. Against AVX2 in the same run (mixprec bench formats, 1 / 2 threads), the
//         plain bf16 encode went from 1.17x / 1.15x (integer trick) to 1.53x / 1.48x in
//         cache and from 0.99x / 0.98x to 1.11x / 1.24x out of cache; the counted and
//         round-back forms are bound by their other work and gained nothing measurable.
//
// Compiled for AVX-512 F/BW/DQ/VL per function (core/simd_target.hpp), called only after
// isa_available(Isa::avx512).
#include "formats/kernels.hpp"
#include "mixprec/core/isa.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <bit>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX512_BF16_F16C_FMA_BEGIN

namespace mixprec::detail {
namespace {

constexpr int kPrefetchBytes = 2048;  // streamed sources, as the AVX2 back end

inline __m512i set1(std::uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
inline __m512i abs_bits(__m512 v) { return _mm512_and_si512(_mm512_castps_si512(v), set1(0x7fffffffu)); }
inline unsigned count(__mmask16 m) { return static_cast<unsigned>(std::popcount(static_cast<unsigned>(m))); }

constexpr bool is_f16(const MiniFloatSpec& s) {
  return s.bits == kF16Spec.bits && s.man_bits == kF16Spec.man_bits && s.bias == kF16Spec.bias;
}

inline bool any_subnormal(__m512 y) { return _mm512_fpclass_ps_mask(y, 0x20) != 0; }  // 0x20: denormal

// 16 codes in 32-bit lanes: round to nearest even, IEEE overflow, subnormals kept.
// kBf16Insn: vcvtneps2bf16 where no lane is subnormal (only on AVX512-BF16 CPUs).
template <const MiniFloatSpec& S, bool kBf16Insn>
inline __m512i raw_codes(__m512 y) {
  if constexpr (is_f16(S)) {
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    if (kBf16Insn && !any_subnormal(y)) return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(y));
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
// The three that every vector touches count in 32-bit vector lanes (a masked subtract of
// -1: one instruction each, where a mask-to-register move, a popcount and an add took
// three); the rare ones (past max, non-finite) count in registers. The vector lanes live
// in locals of the loop, not here: stores of codes may alias a vector member. flush()
// moves them into the totals, before a lane could wrap (kFlushBlocks) and at the end.
struct LaneCounts {
  __m512i zero_in, zero_out, small_out;
};
inline LaneCounts zero_lanes() { return {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()}; }

struct Counts {
  std::uint64_t elements = 0, zero_in = 0, zero_out = 0, small_out = 0, past_max = 0, nonfinite = 0;

  template <const MiniFloatSpec& S>
  void add(LaneCounts& l, __m512 x, __m512i raw) {
    const __m512i minus_one = set1(0xffffffffu);
    const __m512i mag = _mm512_and_si512(raw, set1(kMag));
    elements += 16;
    l.zero_in = _mm512_mask_sub_epi32(l.zero_in, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ), l.zero_in,
                                      minus_one);
    l.zero_out = _mm512_mask_sub_epi32(l.zero_out, _mm512_cmpeq_epi32_mask(mag, _mm512_setzero_si512()), l.zero_out,
                                       minus_one);
    l.small_out = _mm512_mask_sub_epi32(l.small_out, _mm512_cmplt_epu32_mask(mag, set1(1u << S.man_bits)),
                                        l.small_out, minus_one);
    const __mmask16 past = _mm512_cmpge_epu32_mask(mag, set1(S.overflow_code));
    if (past != 0) {
      past_max += count(past);
      nonfinite += count(_mm512_cmpge_epu32_mask(abs_bits(x), set1(0x7f800000u)));
    }
  }

  void flush(LaneCounts& l) {
    zero_in += simd::hsum_epu32(l.zero_in);
    zero_out += simd::hsum_epu32(l.zero_out);
    small_out += simd::hsum_epu32(l.small_out);
    l = zero_lanes();
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
template <const MiniFloatSpec& S, bool kBf16Insn, bool kCount, bool kStream, bool kAmax, bool kRound>
std::size_t encode_blocks(const float* src, std::uint16_t* dst, std::size_t n, const ConvertOptions& o, Counts& counts,
                          std::uint32_t* amax, float* back) {
  const bool saturate = o.overflow == Overflow::saturate;
  const bool flush = o.subnormals == Subnormals::flush;
  const bool scaled = o.scale != 1.0f;
  const __m512 scale = _mm512_set1_ps(o.scale);
  [[maybe_unused]] const __m512 unscale = _mm512_set1_ps(1.0f / o.scale);
  __m512i amax_acc = _mm512_setzero_si512();
  [[maybe_unused]] LaneCounts lanes = zero_lanes();
  // A lane counts at most twice a block of 32 (two vectors): flushed far below 2^32, and
  // often enough that the large-array tests (over 16 MiB, tests/formats/test_bulk.cpp)
  // cross a flush.
  constexpr std::size_t kFlushBlocks = std::size_t{1} << 16;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if constexpr (kCount) {
      if (i != 0 && (i / 32) % kFlushBlocks == 0) counts.flush(lanes);
    }
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
    if constexpr (!is_f16(S) && kBf16Insn && !kCount && !kRound) {
      if (!saturate && !flush && !any_subnormal(y0) && !any_subnormal(y1)) {  // the plain bf16 encode
        const __m512i c = (__m512i)_mm512_cvtne2ps_pbh(y1, y0);  // words 0-15 from y0, 16-31 from y1
        store_halves<kStream>(dst + i, _mm512_castsi512_si256(c));
        store_halves<kStream>(dst + i + 16, _mm512_extracti64x4_epi64(c, 1));
        continue;
      }
    }
    __m512i c0 = raw_codes<S, kBf16Insn>(y0), c1 = raw_codes<S, kBf16Insn>(y1);
    if constexpr (kCount) {
      counts.add<S>(lanes, x0, c0);
      counts.add<S>(lanes, x1, c1);
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
  if constexpr (kCount) counts.flush(lanes);
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

template <const MiniFloatSpec& S, bool kBf16Insn, bool kCount>
ConversionStats encode_kernel(const float* src, void* dst_v, std::size_t n, const ConvertOptions& o) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  Counts counts;
  ConversionStats head_tail;
  std::size_t i = 0;
  if (streamed(n)) {
    i = head_to_align(dst, n);
    if constexpr (kCount) encode_counted_range<S>(src, dst, i, o, head_tail);
    else encode_range<S>(src, dst, i, o);
    i += encode_blocks<S, kBf16Insn, kCount, true, false, false>(src + i, dst + i, n - i, o, counts, nullptr, nullptr);
    _mm_sfence();
  } else {
    i = encode_blocks<S, kBf16Insn, kCount, false, false, false>(src, dst, n, o, counts, nullptr, nullptr);
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

template <const MiniFloatSpec& S, bool kBf16Insn, bool kCount>
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
    i += encode_blocks<S, kBf16Insn, kCount, true, kCount, true>(v + i, dst + i, n - i, o, counts, &m, v + i);
    _mm_sfence();
  } else {
    i = encode_blocks<S, kBf16Insn, kCount, false, kCount, true>(v, dst, n, o, counts, &m, v);
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

// max |src[i]| as magnitude bits (AmaxKernels::amax_bits): four independent maxima (the
// loads, not the max chain, set the pace in cache), the tail one masked load (its cleared
// lanes read as +0, which raises no max).
std::uint32_t amax_bits_kernel(const float* src, std::size_t n) {
  __m512i m0 = _mm512_setzero_si512(), m1 = m0, m2 = m0, m3 = m0;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    m0 = _mm512_max_epu32(m0, abs_bits(_mm512_loadu_ps(src + i)));
    m1 = _mm512_max_epu32(m1, abs_bits(_mm512_loadu_ps(src + i + 16)));
    m2 = _mm512_max_epu32(m2, abs_bits(_mm512_loadu_ps(src + i + 32)));
    m3 = _mm512_max_epu32(m3, abs_bits(_mm512_loadu_ps(src + i + 48)));
  }
  for (; i + 16 <= n; i += 16) m0 = _mm512_max_epu32(m0, abs_bits(_mm512_loadu_ps(src + i)));
  if (i < n) m1 = _mm512_max_epu32(m1, abs_bits(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - i)) - 1u), src + i)));
  return static_cast<std::uint32_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(m0, m1), _mm512_max_epu32(m2, m3))));
}

}  // namespace
}  // namespace mixprec::detail

MIXPREC_TARGET_END

namespace mixprec::detail {
namespace {

template <const MiniFloatSpec& S, bool kBf16Insn = false>
void with_avx512_encodes(FormatKernels& k) {
  k.encode = [](const float* s, void* d, std::size_t n, const ConvertOptions& o) {
    (void)encode_kernel<S, kBf16Insn, false>(s, d, n, o);
  };
  k.encode_counted = &encode_kernel<S, kBf16Insn, true>;
  k.encode_round = [](float* v, void* d, std::size_t n, const ConvertOptions& o) {
    (void)encode_round_kernel<S, kBf16Insn, false>(v, d, n, o, nullptr);
  };
  k.encode_round_counted = &encode_round_kernel<S, kBf16Insn, true>;
}

KernelTable make(bool bf16_instructions) {
  KernelTable t = *avx2_kernels();
  t.isa = Isa::avx512;
  t.amax.amax_bits = &amax_bits_kernel;
  with_avx512_encodes<kF16Spec>(t.f16);
  if (bf16_instructions) with_avx512_encodes<kBF16Spec, true>(t.bf16);
  else with_avx512_encodes<kBF16Spec, false>(t.bf16);
  return t;
}

}  // namespace

const KernelTable* avx512_kernels(bool bf16_instructions) noexcept {
  static const KernelTable with = make(true);
  static const KernelTable without = make(false);
  return bf16_instructions ? &with : &without;
}

const KernelTable* avx512_kernels() noexcept { return avx512_kernels(cpu_has_avx512_bf16()); }

}  // namespace mixprec::detail

#else  // not x86-64: no AVX-512 back end

namespace mixprec::detail {
const KernelTable* avx512_kernels(bool) noexcept { return nullptr; }
const KernelTable* avx512_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
