// AVX-512 back end of unscale_and_check (AVX512F/BW/DQ/VL per function,
// core/simd_target.hpp; only called after isa_available(Isa::avx512) has checked the CPU).
//
// f32 and f16: sixteen elements a step, one vector of 16 f32 (f16 through vcvtph2ps /
// vcvtps2ph with round to nearest even). bf16: thirty-two a step, as pairs of 32-bit
// words (segment_bf16_avx512 says how), rounded back with (bits + 0x7fff + lsb) >> 16,
// NaN quieted. The check: for f32, vfpclassps marks inf/NaN lanes (one instruction
// where abs + max take two: at one thread this loop is close enough to the core's
// limits that it shows, 0.92 -> 0.96 of a bare multiply); for f16/bf16, the max of the
// raw 16-bit magnitudes. amax: the max of the products' bits. Squares go to 16 double
// lanes, two vectors of 8 (lane = index % 16 inside the chunk), in the reference's
// order; tails run the reference step on the same lanes. Results equal the reference
// bit for bit.
//
// Where the CPU has AVX512-BF16 (checked at run time; the file is compiled with it, the
// kernels without it never execute such an instruction), the bf16 store rounds with
// vcvtne2ps2bf16: one instruction for two vectors, where the integer trick takes eight
// for each. It flushes subnormal results to zero, so a pair holding one (vfpclassps)
// takes the integer path.
//
// Why a second SIMD back end for a loop bound by memory: with one thread a core keeps
// only so many loads in flight, and a 64-byte vector moves a cache line per load and
// per store where AVX2 needs two of each; measured in bench_torch against ATen's
// in-place multiply (docs/libtorch.md, "Speed").
#include "kernels/unscale_kernels.hpp"
#include "mixprec/formats/types.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX512_BF16_F16C_FMA_BEGIN

namespace mixprec::detail {
namespace {

inline __m512i vabs(__m512 v) { return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)); }

// f32 or f16; also returns the raw f16 codes, for the non-finite check.
template <DType D>
inline __m512 load16(const void* data, std::size_t i, __m256i& raw) {
  if constexpr (D == DType::f32) {
    (void)raw;
    return _mm512_loadu_ps(static_cast<const float*>(data) + i);
  } else {
    raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(data) + i));
    return _mm512_cvtph_ps(raw);
  }
}

template <DType D>  // f32 or f16
inline void store16(void* data, std::size_t i, __m512 y) {
  if constexpr (D == DType::f32) {
    _mm512_storeu_ps(static_cast<float*>(data) + i, y);
  } else {
    const __m256i c = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(data) + i), c);
  }
}

// bf16, 32 elements a step from one 64-byte load. Each 32-bit word holds an even element
// (low half) and the odd one after it (high half): the even ones widen with a shift, the
// odd ones with a mask, so no cross-lane widening is needed (vpmovzxwd runs on the one
// shuffle port, which a 512-bit loop already shares with most of its work). The store packs
// both halves with one vcvtne2ps2bf16 and puts the words back in order with one vpermw;
// the integer trick needs no permute (the even results shift down, the odd ones stay up).
// Squares: lanes 0, 2, .., 14 come from the even elements and 1, 3, .., 15 from the odd
// ones (element i of the chunk still goes to lane i % 16, in index order).
// Against the 16-wide loop it replaced (widening with vpmovzxwd, one vcvtneps2bf16 a
// vector): 13.6 against 11.2 G elements/s in L2 (unscale, AVX512-BF16 store), and 0.73 ->
// 0.91 of the in-place multiply in mixprec bench scaler (docs/performance.md).
inline __m512i bf16_round_low(__m512 y) {  // the reference rounding, the code in bits 0-15
  const __m512i u = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

template <bool kBf16Insn>
inline __m512i bf16_store_pairs(__m512 even, __m512 odd) {
  if (kBf16Insn && (_mm512_fpclass_ps_mask(even, 0x20) | _mm512_fpclass_ps_mask(odd, 0x20)) == 0) {
    // Words 0-15 the even results, 16-31 the odd ones; word 2j <- j, 2j + 1 <- 16 + j.
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,  //
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
  }
  return _mm512_or_si512(bf16_round_low(even), _mm512_slli_epi32(bf16_round_low(odd), 16));
}

inline __m256 low8(__m512 y) { return _mm512_castps512_ps256(y); }
inline __m256 high8(__m512 y) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)); }

// acc + d * d for the eight values widened to double: d * d is exact, so this is the
// reference's lane + d * d.
inline __m512d square_add(__m256 h, __m512d acc) {
  const __m512d d = _mm512_cvtps_pd(h);
  return _mm512_fmadd_pd(d, d, acc);
}

template <bool kWrite, bool kSum, bool kAmax, bool kBf16Insn>
void segment_bf16_avx512(void* data, std::size_t n, float inv, SegmentOut& out, ExactSum* sum) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  std::uint16_t* p = static_cast<std::uint16_t*>(data);
  __m512i max_in16 = _mm512_setzero_si512();
  double lanes[kSumLanes] = {};
  for (std::size_t c = 0; c < n; c += kUnscaleChunk) {
    const std::size_t end = n - c < kUnscaleChunk ? n : c + kUnscaleChunk;
    const std::size_t main_end = c + ((end - c) & ~std::size_t{31});
    __m512d even_lanes = _mm512_setzero_pd(), odd_lanes = _mm512_setzero_pd();  // lanes 0, 2, ..; 1, 3, ..
    for (std::size_t i = c; i < main_end; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(p + i);
      max_in16 = _mm512_max_epu16(max_in16, _mm512_and_si512(raw, _mm512_set1_epi16(0x7fff)));
      const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), vinv);
      const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(raw, high)), vinv);
      if constexpr (kWrite) _mm512_storeu_si512(p + i, bf16_store_pairs<kBf16Insn>(even, odd));
      if constexpr (kSum) {
        even_lanes = square_add(high8(even), square_add(low8(even), even_lanes));  // elements 2j, then 16 + 2j
        odd_lanes = square_add(high8(odd), square_add(low8(odd), odd_lanes));
      }
    }
    if constexpr (kSum) {
      alignas(64) double e[8], o[8];
      _mm512_store_pd(e, even_lanes);
      _mm512_store_pd(o, odd_lanes);
      for (int j = 0; j < 8; ++j) {
        lanes[2 * j] = e[j];
        lanes[2 * j + 1] = o[j];
      }
    }
    if (main_end != end) unscale_range<DType::bf16, kWrite, kSum, kAmax>(data, main_end, end, c, inv, out, lanes);
    if constexpr (kSum) flush_lanes(lanes, *sum);
  }
  const __m256i m = _mm256_max_epu16(_mm512_castsi512_si256(max_in16), _mm512_extracti64x4_epi64(max_in16, 1));
  const std::uint32_t mi = simd::hmax_epu16(m) << 16;  // as fp32 bits (SegmentOut)
  out.max_in = mi > out.max_in ? mi : out.max_in;
  if constexpr (kAmax) {
    const std::uint32_t mo = product_amax_bits(mi, inv);
    out.max_out = mo > out.max_out ? mo : out.max_out;
  }
}

// f32 and f16, 16 elements a step.
template <DType D, bool kWrite, bool kSum, bool kAmax>
void segment_avx512(void* data, std::size_t n, float inv, SegmentOut& out, ExactSum* sum) {
  const __m512 vinv = _mm512_set1_ps(inv);
  __mmask16 bad = 0;  // f32: lanes that held inf/NaN (vfpclassps), one instruction a vector
  __m256i max_in16 = _mm256_setzero_si256();
  __m512i max_out = _mm512_setzero_si512();
  double lanes[kSumLanes] = {};
  for (std::size_t c = 0; c < n; c += kUnscaleChunk) {
    const std::size_t end = n - c < kUnscaleChunk ? n : c + kUnscaleChunk;
    const std::size_t main_end = c + ((end - c) & ~std::size_t{15});
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();  // lanes 0-7, 8-15
    for (std::size_t i = c; i < main_end; i += 16) {
      // One prefetch a cache line (16 f32 or 32 16-bit elements).
      if (D == DType::f32 || (i & 31) == 0) {
        _mm_prefetch(static_cast<const char*>(data) + dtype_size(D) * i + kPrefetchBytes, _MM_HINT_T0);
      }
      __m256i raw;
      const __m512 x = load16<D>(data, i, raw);
      if constexpr (D == DType::f32) {
        bad |= _mm512_fpclass_ps_mask(x, 0x99);  // QNaN | +inf | -inf | SNaN
      } else {  // the largest f16 magnitude, before widening
        max_in16 = _mm256_max_epu16(max_in16, _mm256_and_si256(raw, _mm256_set1_epi16(0x7fff)));
      }
      const __m512 y = _mm512_mul_ps(x, vinv);
      if constexpr (kWrite) store16<D>(data, i, y);
      if constexpr (kAmax && D == DType::f32) max_out = _mm512_max_epu32(max_out, vabs(y));
      if constexpr (kSum) {
        lo = square_add(low8(y), lo);
        hi = square_add(high8(y), hi);
      }
    }
    if constexpr (kSum) {
      _mm512_storeu_pd(lanes, lo);
      _mm512_storeu_pd(lanes + 8, hi);
    }
    if (main_end != end) unscale_range<D, kWrite, kSum, kAmax>(data, main_end, end, c, inv, out, lanes);
    if constexpr (kSum) flush_lanes(lanes, *sum);
  }
  // As fp32 bits (what the scalar tail records): f16/bf16 magnitudes decode monotonically.
  // For f32 only whether an input was inf/NaN is known: kInfBits stands for it (the one
  // use of max_in is that test; SegmentOut).
  std::uint32_t mi;
  if constexpr (D == DType::f32) {
    mi = bad ? 0x7f800000u : 0u;
  } else {
    mi = std::bit_cast<std::uint32_t>(
        static_cast<float>(f16::from_bits(static_cast<std::uint16_t>(simd::hmax_epu16(max_in16)))));
  }
  out.max_in = mi > out.max_in ? mi : out.max_in;
  if constexpr (kAmax) {
    std::uint32_t mo;
    if constexpr (D == DType::f32) mo = _mm512_reduce_max_epu32(max_out);
    else mo = product_amax_bits(mi, inv);
    out.max_out = mo > out.max_out ? mo : out.max_out;
  }
}

}  // namespace
}  // namespace mixprec::detail
MIXPREC_TARGET_END

namespace mixprec::detail {
namespace {

template <DType D>
void fill(UnscaleKernels& k) {
  auto& t = k.segment[static_cast<int>(D)];
  t[0][0][0] = &segment_avx512<D, false, false, false>;
  t[0][0][1] = &segment_avx512<D, false, false, true>;
  t[0][1][0] = &segment_avx512<D, false, true, false>;
  t[0][1][1] = &segment_avx512<D, false, true, true>;
  t[1][0][0] = &segment_avx512<D, true, false, false>;
  t[1][0][1] = &segment_avx512<D, true, false, true>;
  t[1][1][0] = &segment_avx512<D, true, true, false>;
  t[1][1][1] = &segment_avx512<D, true, true, true>;
}

template <bool kBf16Insn>
void fill_bf16(UnscaleKernels& k) {
  auto& t = k.segment[static_cast<int>(DType::bf16)];
  t[0][0][0] = &segment_bf16_avx512<false, false, false, kBf16Insn>;
  t[0][0][1] = &segment_bf16_avx512<false, false, true, kBf16Insn>;
  t[0][1][0] = &segment_bf16_avx512<false, true, false, kBf16Insn>;
  t[0][1][1] = &segment_bf16_avx512<false, true, true, kBf16Insn>;
  t[1][0][0] = &segment_bf16_avx512<true, false, false, kBf16Insn>;
  t[1][0][1] = &segment_bf16_avx512<true, false, true, kBf16Insn>;
  t[1][1][0] = &segment_bf16_avx512<true, true, false, kBf16Insn>;
  t[1][1][1] = &segment_bf16_avx512<true, true, true, kBf16Insn>;
}

UnscaleKernels make(bool bf16_instructions) {
  UnscaleKernels k{};
  k.isa = Isa::avx512;
  fill<DType::f32>(k);
  fill<DType::f16>(k);
  if (bf16_instructions) fill_bf16<true>(k);
  else fill_bf16<false>(k);
  return k;
}

}  // namespace

const UnscaleKernels* avx512_unscale_kernels(bool bf16_instructions) noexcept {
  static const UnscaleKernels with = make(true);
  static const UnscaleKernels without = make(false);
  return bf16_instructions ? &with : &without;
}

const UnscaleKernels* avx512_unscale_kernels() noexcept { return avx512_unscale_kernels(cpu_has_avx512_bf16()); }

}  // namespace mixprec::detail

#else  // not x86-64: no AVX-512 back end

namespace mixprec::detail {
const UnscaleKernels* avx512_unscale_kernels(bool) noexcept { return nullptr; }
const UnscaleKernels* avx512_unscale_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
