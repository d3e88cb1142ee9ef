// AVX-512 back end of unscale_and_check (AVX512F/BW/DQ/VL, the target pragma below;
// only called after isa_available(Isa::avx512) has checked the CPU).
//
// Sixteen elements a step, one vector of 16 f32 (f16 through vcvtph2ps / vcvtps2ph
// with round to nearest even; bf16 widened by zero-extension and a shift, rounded back
// with (bits + 0x7fff + lsb) >> 16, NaN quieted). The check: for f32, vfpclassps marks
// inf/NaN lanes (one instruction where abs + max take two: at one thread this loop is
// close enough to the core's limits that it shows, 0.92 -> 0.96 of a bare multiply); for
// f16/bf16, the max of the raw 16-bit magnitudes. amax: the max of the products' bits. Squares go to 16
// double lanes, two vectors of 8 (lane = index % 16 inside the chunk), in the
// reference's order; tails (< 16 elements) run the reference step on the same lanes.
// Results equal the reference bit for bit.
//
// Where the CPU has AVX512-BF16 (checked at run time; the file is compiled with it, the
// kernels without it never execute such an instruction), the bf16 store rounds with
// vcvtneps2bf16: one instruction for the integer trick's eight, +20% for
// unscale+norm+amax on bf16. It flushes subnormal results to zero, so a vector holding
// one (vfpclassps) takes the integer path.
//
// Why a second SIMD back end for a loop bound by memory: with one thread a core keeps
// only so many loads in flight, and a 64-byte vector moves a cache line per load and
// per store where AVX2 needs two of each; measured in bench_torch against ATen's
// in-place multiply (docs/libtorch.md, "Speed").
#include "kernels/unscale_kernels.hpp"
#include "mixprec/formats/types.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
// GCC 12's avx512fintrin.h builds its "undefined" vectors from a self-initialised
// variable (__Y = __Y), which -W(maybe-)uninitialized reports in every caller.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace mixprec::detail {
namespace {

inline __m512i vabs(__m512 v) { return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)); }

// Also returns the raw 16-bit codes (f16/bf16), for the non-finite check.
template <DType D>
inline __m512 load16(const void* data, std::size_t i, __m256i& raw) {
  if constexpr (D == DType::f32) {
    (void)raw;
    return _mm512_loadu_ps(static_cast<const float*>(data) + i);
  } else {
    raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(data) + i));
    if constexpr (D == DType::f16) return _mm512_cvtph_ps(raw);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

template <DType D, bool kBf16Insn>
inline void store16(void* data, std::size_t i, __m512 y) {
  if constexpr (D == DType::f32) {
    _mm512_storeu_ps(static_cast<float*>(data) + i, y);
  } else {
    __m256i c;
    if constexpr (D == DType::f16) {
      c = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT);
    } else if (kBf16Insn && _mm512_fpclass_ps_mask(y, 0x20) == 0) {  // 0x20: subnormal
      c = (__m256i)_mm512_cvtneps_pbh(y);  // RNE, NaN quieted as below
    } else {
      const __m512i u = _mm512_castps_si512(y);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);  // masked, not branched: cheaper
      r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      c = _mm512_cvtepi32_epi16(r);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(data) + i), c);
  }
}

inline std::uint32_t hmax_epu16(__m256i v) {
  __m128i m = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0xb1));
  m = _mm_max_epu16(m, _mm_srli_epi32(m, 16));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(m)) & 0xffffu;
}

template <DType D, bool kWrite, bool kSum, bool kAmax, bool kBf16Insn>
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
      } else {  // the largest 16-bit magnitude, before widening
        max_in16 = _mm256_max_epu16(max_in16, _mm256_and_si256(raw, _mm256_set1_epi16(0x7fff)));
      }
      const __m512 y = _mm512_mul_ps(x, vinv);
      if constexpr (kWrite) store16<D, kBf16Insn>(data, i, y);
      if constexpr (kAmax && D == DType::f32) max_out = _mm512_max_epu32(max_out, vabs(y));
      if constexpr (kSum) {  // d * d is exact: equals the reference's d * d + lane
        const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(y));
        const __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
        lo = _mm512_fmadd_pd(d0, d0, lo);
        hi = _mm512_fmadd_pd(d1, d1, hi);
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
  } else if constexpr (D == DType::f16) {
    mi = std::bit_cast<std::uint32_t>(static_cast<float>(f16::from_bits(static_cast<std::uint16_t>(hmax_epu16(max_in16)))));
  } else {
    mi = hmax_epu16(max_in16) << 16;
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
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace mixprec::detail {
namespace {

template <DType D, bool kBf16Insn = false>
void fill(UnscaleKernels& k) {
  auto& t = k.segment[static_cast<int>(D)];
  t[0][0][0] = &segment_avx512<D, false, false, false, kBf16Insn>;
  t[0][0][1] = &segment_avx512<D, false, false, true, kBf16Insn>;
  t[0][1][0] = &segment_avx512<D, false, true, false, kBf16Insn>;
  t[0][1][1] = &segment_avx512<D, false, true, true, kBf16Insn>;
  t[1][0][0] = &segment_avx512<D, true, false, false, kBf16Insn>;
  t[1][0][1] = &segment_avx512<D, true, false, true, kBf16Insn>;
  t[1][1][0] = &segment_avx512<D, true, true, false, kBf16Insn>;
  t[1][1][1] = &segment_avx512<D, true, true, true, kBf16Insn>;
}

UnscaleKernels make(bool bf16_instructions) {
  UnscaleKernels k{};
  k.isa = Isa::avx512;
  fill<DType::f32>(k);
  fill<DType::f16>(k);
  if (bf16_instructions) fill<DType::bf16, true>(k);
  else fill<DType::bf16>(k);
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
