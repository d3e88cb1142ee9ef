// AVX2 + F16C back end of unscale_and_check. Its kernels are compiled for AVX2,
// F16C and FMA (per function, core/simd_target.hpp) and only called after
// isa_available() has checked the CPU.
//
// Sixteen elements a step: two vectors of 8 f32 (f16 through vcvtph2ps /
// vcvtps2ph with round to nearest even, which is the library's f16 rounding;
// bf16 by shifting, and rounded back with the integer trick
// (bits + 0x7fff + lsb) >> 16, NaN quieted). The check takes the max of the
// input magnitudes' bit patterns (unsigned), amax the same of the products;
// squares go to 16 double lanes (4 vectors of 4: lane = index % 16 inside the
// chunk), exactly as the reference's lanes. Tails of a tensor (< 16 elements)
// run the reference step on the same lanes. Results equal the reference bit
// for bit.
//
// Stores are ordinary: the update is in place, so every line is read before it
// is written and there is no read-for-ownership to save; non-temporal stores
// would evict lines that are already in cache and cost a second memory trip.
#include "kernels/unscale_kernels.hpp"
#include "mixprec/formats/types.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX2_F16C_FMA_BEGIN

namespace mixprec::detail {
namespace {

inline __m256i set1(std::uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
inline __m256i vabs(__m256 v) { return _mm256_and_si256(_mm256_castps_si256(v), set1(0x7fffffffu)); }

// Round to nearest even; NaN lanes are wrong here (the add can carry out of
// them) and fixed by bf16_fix_nan, only in blocks that hold a NaN.
inline __m256i bf16_codes8_finite(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), set1(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(set1(0x7fffu), lsb)), 16);
}
inline __m256i bf16_fix_nan(__m256 y, __m256i r) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), set1(0x40u)), nan);
}

// Also returns the raw 16-bit codes (f16/bf16), for the non-finite check.
// bf16 is widened by interleaving with zeros, which leaves the elements in the
// order [0-3, 8-11] (x0) and [4-7, 12-15] (x1): store16 packs them back into
// place, and the sum of squares assigns lanes accordingly (kInterleaved).
template <DType D>
inline void load16(const void* data, std::size_t i, __m256& x0, __m256& x1, __m256i& raw) {
  if constexpr (D == DType::f32) {
    (void)raw;
    const float* p = static_cast<const float*>(data) + i;
    x0 = _mm256_loadu_ps(p);
    x1 = _mm256_loadu_ps(p + 8);
  } else {
    const auto* p = static_cast<const std::uint16_t*>(data) + i;
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    raw = h;
    if constexpr (D == DType::f16) {
      x0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      x1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {
      x0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
      x1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
    }
  }
}

template <DType D>
inline void store16(void* data, std::size_t i, __m256 y0, __m256 y1) {
  if constexpr (D == DType::f32) {
    float* p = static_cast<float*>(data) + i;
    _mm256_storeu_ps(p, y0);
    _mm256_storeu_ps(p + 8, y1);
  } else {
    auto* p = static_cast<std::uint16_t*>(data) + i;
    __m256i c;
    if constexpr (D == DType::f16) {
      c = _mm256_set_m128i(_mm256_cvtps_ph(y1, _MM_FROUND_TO_NEAREST_INT),
                           _mm256_cvtps_ph(y0, _MM_FROUND_TO_NEAREST_INT));
    } else {
      __m256i r0 = bf16_codes8_finite(y0), r1 = bf16_codes8_finite(y1);
      if (!_mm256_testz_ps(_mm256_cmp_ps(y0, y1, _CMP_UNORD_Q), _mm256_cmp_ps(y0, y1, _CMP_UNORD_Q))) {
        r0 = bf16_fix_nan(y0, r0);
        r1 = bf16_fix_nan(y1, r1);
      }
      c = _mm256_packus_epi32(r0, r1);  // undoes load16's interleaved order
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), c);
  }
}

inline __m256d sq_acc(__m128 y, __m256d acc) {
  const __m256d d = _mm256_cvtps_pd(y);
  return _mm256_fmadd_pd(d, d, acc);  // d * d is exact: equals the reference's d * d + acc
}

template <DType D, bool kWrite, bool kSum, bool kAmax>
void segment_avx2(void* data, std::size_t n, float inv, SegmentOut& out, ExactSum* sum) {
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i max_in = _mm256_setzero_si256();
  __m256i max_out = _mm256_setzero_si256();
  double lanes[kSumLanes] = {};
  for (std::size_t c = 0; c < n; c += kUnscaleChunk) {
    const std::size_t end = n - c < kUnscaleChunk ? n : c + kUnscaleChunk;
    const std::size_t main_end = c + ((end - c) & ~std::size_t{15});
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    __m256d a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
    for (std::size_t i = c; i < main_end; i += 16) {
      // One prefetch a cache line (16 f32 or 32 16-bit elements).
      if (D == DType::f32 || (i & 31) == 0) {
        _mm_prefetch(static_cast<const char*>(data) + dtype_size(D) * i + kPrefetchBytes, _MM_HINT_T0);
      }
      __m256 x0, x1;
      __m256i raw;
      load16<D>(data, i, x0, x1, raw);
      if constexpr (D == DType::f32) {
        max_in = _mm256_max_epu32(max_in, _mm256_max_epu32(vabs(x0), vabs(x1)));
      } else {  // the largest 16-bit magnitude: half the work of widening first
        max_in = _mm256_max_epu16(max_in, _mm256_and_si256(raw, _mm256_set1_epi16(0x7fff)));
      }
      const __m256 y0 = _mm256_mul_ps(x0, vinv);
      const __m256 y1 = _mm256_mul_ps(x1, vinv);
      if constexpr (kWrite) store16<D>(data, i, y0, y1);
      if constexpr (kAmax && D == DType::f32) max_out = _mm256_max_epu32(max_out, _mm256_max_epu32(vabs(y0), vabs(y1)));
      if constexpr (kSum) {  // element i of the block goes to lane i % 16
        constexpr bool kInterleaved = D == DType::bf16;
        a0 = sq_acc(_mm256_castps256_ps128(y0), a0);
        a1 = sq_acc(kInterleaved ? _mm256_castps256_ps128(y1) : _mm256_extractf128_ps(y0, 1), a1);
        a2 = sq_acc(kInterleaved ? _mm256_extractf128_ps(y0, 1) : _mm256_castps256_ps128(y1), a2);
        a3 = sq_acc(_mm256_extractf128_ps(y1, 1), a3);
      }
    }
    if constexpr (kSum) {
      _mm256_storeu_pd(lanes, a0);
      _mm256_storeu_pd(lanes + 4, a1);
      _mm256_storeu_pd(lanes + 8, a2);
      _mm256_storeu_pd(lanes + 12, a3);
    }
    if (main_end != end) unscale_range<D, kWrite, kSum, kAmax>(data, main_end, end, c, inv, out, lanes);
    if constexpr (kSum) flush_lanes(lanes, *sum);
  }
  // As fp32 bits (what the scalar tail records): f16/bf16 magnitudes decode monotonically.
  std::uint32_t mi;
  if constexpr (D == DType::f32) {
    mi = simd::hmax_epu32(max_in);
  } else if constexpr (D == DType::f16) {
    mi = std::bit_cast<std::uint32_t>(
        static_cast<float>(f16::from_bits(static_cast<std::uint16_t>(simd::hmax_epu16(max_in)))));
  } else {
    mi = simd::hmax_epu16(max_in) << 16;
  }
  out.max_in = mi > out.max_in ? mi : out.max_in;
  if constexpr (kAmax) {
    std::uint32_t mo;
    if constexpr (D == DType::f32) mo = simd::hmax_epu32(max_out);
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
  t[0][0][0] = &segment_avx2<D, false, false, false>;
  t[0][0][1] = &segment_avx2<D, false, false, true>;
  t[0][1][0] = &segment_avx2<D, false, true, false>;
  t[0][1][1] = &segment_avx2<D, false, true, true>;
  t[1][0][0] = &segment_avx2<D, true, false, false>;
  t[1][0][1] = &segment_avx2<D, true, false, true>;
  t[1][1][0] = &segment_avx2<D, true, true, false>;
  t[1][1][1] = &segment_avx2<D, true, true, true>;
}

UnscaleKernels make() {
  UnscaleKernels k{};
  k.isa = Isa::avx2;
  fill<DType::f32>(k);
  fill<DType::f16>(k);
  fill<DType::bf16>(k);
  return k;
}

}  // namespace

const UnscaleKernels* avx2_unscale_kernels() noexcept {
  static const UnscaleKernels k = make();
  return &k;
}

}  // namespace mixprec::detail

#else  // not x86-64: no AVX2 back end

namespace mixprec::detail {
const UnscaleKernels* avx2_unscale_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
