// AVX-512 back end of the layer kernels (src/nn/layer_kernels.hpp): GELU forward and
// backward and the softmax row, sixteen floats a step, the same operations as the AVX2
// back end (src/nn/cpu/layer_kernels_avx2.cpp) lane for lane, so its results equal
// AVX2's bit for bit (tested). The other kernels are AVX2's: the adds and row kernels
// are memory-bound or short (docs/performance.md). (An AVX-512 softmax row was once
// measured no faster, on the 96-token vocabulary the model had then; on today's
// 1024-token rows it pays.) Compiled for AVX-512 F/BW/DQ/VL per function
// (core/simd_target.hpp), called only after isa_available(Isa::avx512).
#include "nn/layer_kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX512_FMA_BEGIN

namespace mixprec::nn::detail {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

inline __m512 set1(float v) { return _mm512_set1_ps(v); }
inline __mmask16 tail_mask(std::size_t rem) { return static_cast<__mmask16>((1u << rem) - 1u); }  // rem < 16

inline __m512 pow2i(__m512i k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23));
}

// As the AVX2 exp_ps, lane for lane.
inline __m512 exp_ps(__m512 x) {
  const __mmask16 nan_mask = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, set1(-104.0f)), set1(89.0f));
  const __m512 fx =
      _mm512_roundscale_ps(_mm512_mul_ps(xc, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, set1(0.693359375f), xc);
  r = _mm512_fnmadd_ps(fx, set1(-2.12194440e-4f), r);
  __m512 p = set1(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, set1(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, set1(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, set1(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, set1(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, set1(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 y = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, set1(1.0f)));
  const __m512i n = _mm512_cvtps_epi32(fx);
  const __m512i n1 = _mm512_srai_epi32(n, 1);
  const __m512i n2 = _mm512_sub_epi32(n, n1);
  y = _mm512_mul_ps(_mm512_mul_ps(y, pow2i(n1)), pow2i(n2));
  return _mm512_mask_blend_ps(nan_mask, y, x);
}

inline __m512 tanh_ps(__m512 u) {
  const __m512 e = exp_ps(_mm512_add_ps(u, u));
  return _mm512_sub_ps(set1(1.0f), _mm512_div_ps(set1(2.0f), _mm512_add_ps(e, set1(1.0f))));
}

inline __m512 gelu_u(__m512 x) {
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(set1(0.044715f), x), x), x);
  return _mm512_mul_ps(set1(kGeluScale), _mm512_add_ps(x, cube));
}

inline __m512 gelu_fwd(__m512 x) {
  const __m512 th = tanh_ps(gelu_u(x));
  return _mm512_mul_ps(_mm512_mul_ps(set1(0.5f), x), _mm512_add_ps(set1(1.0f), th));
}

inline __m512 gelu_local(__m512 x) {
  const __m512 th = tanh_ps(gelu_u(x));
  const __m512 sech2 = _mm512_sub_ps(set1(1.0f), _mm512_mul_ps(th, th));
  const __m512 poly = _mm512_add_ps(set1(1.0f), _mm512_mul_ps(_mm512_mul_ps(set1(3.0f * 0.044715f), x), x));
  const __m512 right =
      _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(x, set1(0.5f)), sech2), set1(kGeluScale)), poly);
  return _mm512_add_ps(_mm512_mul_ps(set1(0.5f), _mm512_add_ps(set1(1.0f), th)), right);
}

void gelu_forward(float* out, const float* inp, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, gelu_fwd(_mm512_loadu_ps(inp + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, gelu_fwd(_mm512_maskz_loadu_ps(m, inp + i)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::size_t n, bool accumulate) noexcept {
  std::size_t i = 0;
  if (accumulate) {
    for (; i + 16 <= n; i += 16) {
      const __m512 g = _mm512_mul_ps(gelu_local(_mm512_loadu_ps(inp + i)), _mm512_loadu_ps(dout + i));
      _mm512_storeu_ps(dinp + i, _mm512_add_ps(_mm512_loadu_ps(dinp + i), g));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      _mm512_storeu_ps(dinp + i, _mm512_mul_ps(gelu_local(_mm512_loadu_ps(inp + i)), _mm512_loadu_ps(dout + i)));
    }
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    __m512 g = _mm512_mul_ps(gelu_local(_mm512_maskz_loadu_ps(m, inp + i)), _mm512_maskz_loadu_ps(m, dout + i));
    if (accumulate) g = _mm512_add_ps(_mm512_maskz_loadu_ps(m, dinp + i), g);
    _mm512_mask_storeu_ps(dinp + i, m, g);
  }
}

// AVX2's softmax_row, sixteen lanes a step: the same exp lane for lane, and the sum in
// the reference's sixteen double lanes (layer_kernels.hpp), so it equals AVX2's bit for
// bit. bench_layers, one run: 1.36x AVX2's on 96-token rows, 1.47x on 8192-token rows
// (docs/performance.md).
SoftmaxStats softmax_row(float* out, const float* in, std::size_t n, std::size_t valid) noexcept {
  const std::size_t full = valid / 16 * 16;
  const __mmask16 tm = tail_mask(valid - full);
  // max_ps(x, acc) returns acc when x is NaN: NaN skipped, as the reference's compare.
  __m512 mx = set1(-__builtin_inff());
  for (std::size_t i = 0; i < full; i += 16) mx = _mm512_max_ps(_mm512_loadu_ps(in + i), mx);
  if (full < valid) mx = _mm512_mask_max_ps(mx, tm, _mm512_maskz_loadu_ps(tm, in + full), mx);
  float maxval = _mm512_reduce_max_ps(mx);
  if (maxval == -__builtin_inff() || in[0] != in[0]) maxval = in[0];  // as the reference: starts from in[0]
  const __m512 vmax = set1(maxval);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();  // lanes 0-7, 8-15
  const auto add_lanes = [&](__m512 e) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  };
  for (std::size_t i = 0; i < full; i += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(in + i), vmax));
    _mm512_storeu_ps(out + i, e);
    add_lanes(e);
  }
  if (full < valid) {  // inactive lanes add +0
    const __m512 e = _mm512_maskz_mov_ps(tm, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tm, in + full), vmax)));
    _mm512_mask_storeu_ps(out + full, tm, e);
    add_lanes(e);
  }
  alignas(64) double l[kSoftmaxSumLanes];
  _mm512_store_pd(l, lo);
  _mm512_store_pd(l + 8, hi);
  const double total = fold_softmax_lanes(l);
  const auto sum = static_cast<float>(total);
  const __m512 inv = set1(1.0f / sum);
  for (std::size_t i = 0; i < full; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), inv));
  if (full < valid) _mm512_mask_storeu_ps(out + full, tm, _mm512_mul_ps(_mm512_maskz_loadu_ps(tm, out + full), inv));
  for (std::size_t i = valid; i < n; ++i) out[i] = 0.0f;
  return {maxval, sum, total};
}

LayerKernels make() {
  LayerKernels k = *avx2_layer_kernels();
  k.isa = Isa::avx512;
  k.gelu_forward = &gelu_forward;
  k.gelu_backward = &gelu_backward;
  k.softmax_row = &softmax_row;
  return k;
}

}  // namespace

const LayerKernels* avx512_layer_kernels() noexcept {
  static const LayerKernels k = make();
  return &k;
}

}  // namespace mixprec::nn::detail

MIXPREC_TARGET_END

#else  // not x86-64

namespace mixprec::nn::detail {
const LayerKernels* avx512_layer_kernels() noexcept { return nullptr; }
}  // namespace mixprec::nn::detail

#endif
