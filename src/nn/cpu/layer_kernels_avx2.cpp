// AVX2 + FMA back end of the layer kernels (src/nn/layer_kernels.hpp). Compiled for
// AVX2/FMA per function (core/simd_target.hpp) and only called after isa_available() has
// checked the CPU.
//
// Eight floats a step; a row's tail (< 8) is a masked vector (maskload / maskstore),
// so an element's result never depends on where it sits and the OpenMP split cannot
// change a result. exp is a Cephes-style polynomial (range reduction by ln 2 in two
// parts, degree-6 polynomial, 2^n applied in two halves so that results down to the
// subnormals and up to overflow come out right); about 1 ulp from std::exp. NaN
// inputs give NaN, +inf gives inf, -inf gives 0. GELU keeps the reference's formula
// (tanh(u) = 1 - 2/(exp(2u) + 1), IEEE division) with this exp; layer norm's sums run
// in eight lanes, then across; softmax's sum runs in the reference's order (see
// softmax_row). Bounds against the scalar reference: tests/nn/test_layer_kernels.cpp.
#include "nn/layer_kernels.hpp"

#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"

MIXPREC_TARGET_AVX2_FMA_BEGIN

namespace mixprec::nn::detail {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

inline __m256 set1(float v) { return _mm256_set1_ps(v); }

// Lanes [0, rem) active, rem in [0, 8].
inline __m256i tail_mask(std::size_t rem) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), idx);
}

inline __m256 pow2i(__m256i k) {  // 2^k for k in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

// exp(x), about 1 ulp; NaN -> NaN, +inf -> inf, -inf -> 0, subnormal results kept.
inline __m256 exp_ps(__m256 x) {
  const __m256 nan_mask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x, set1(-104.0f)), set1(89.0f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(xc, set1(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, set1(0.693359375f), xc);
  r = _mm256_fnmadd_ps(fx, set1(-2.12194440e-4f), r);
  __m256 p = set1(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, set1(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, set1(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, set1(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, set1(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, set1(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 y = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, set1(1.0f)));
  // 2^n in two halves: n in [-150, 129] is out of one exponent field's range.
  const __m256i n = _mm256_cvtps_epi32(fx);
  const __m256i n1 = _mm256_srai_epi32(n, 1);
  const __m256i n2 = _mm256_sub_epi32(n, n1);
  y = _mm256_mul_ps(_mm256_mul_ps(y, pow2i(n1)), pow2i(n2));
  return _mm256_blendv_ps(y, x, nan_mask);  // NaN stays NaN
}

// 1 - 2 / (exp(2u) + 1), as the reference.
inline __m256 tanh_ps(__m256 u) {
  const __m256 e = exp_ps(_mm256_add_ps(u, u));
  return _mm256_sub_ps(set1(1.0f), _mm256_div_ps(set1(2.0f), _mm256_add_ps(e, set1(1.0f))));
}

inline __m256 gelu_u(__m256 x) {
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(set1(0.044715f), x), x), x);
  return _mm256_mul_ps(set1(kGeluScale), _mm256_add_ps(x, cube));
}

inline __m256 gelu_fwd(__m256 x) {
  const __m256 th = tanh_ps(gelu_u(x));
  return _mm256_mul_ps(_mm256_mul_ps(set1(0.5f), x), _mm256_add_ps(set1(1.0f), th));
}

inline __m256 gelu_local(__m256 x) {
  const __m256 th = tanh_ps(gelu_u(x));
  const __m256 sech2 = _mm256_sub_ps(set1(1.0f), _mm256_mul_ps(th, th));
  const __m256 poly = _mm256_add_ps(set1(1.0f), _mm256_mul_ps(_mm256_mul_ps(set1(3.0f * 0.044715f), x), x));
  const __m256 right =
      _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(x, set1(0.5f)), sech2), set1(kGeluScale)), poly);
  return _mm256_add_ps(_mm256_mul_ps(set1(0.5f), _mm256_add_ps(set1(1.0f), th)), right);
}

void gelu_forward(float* out, const float* inp, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, gelu_fwd(_mm256_loadu_ps(inp + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, gelu_fwd(_mm256_maskload_ps(inp + i, m)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::size_t n, bool accumulate) noexcept {
  std::size_t i = 0;
  if (accumulate) {
    for (; i + 8 <= n; i += 8) {
      const __m256 g = _mm256_mul_ps(gelu_local(_mm256_loadu_ps(inp + i)), _mm256_loadu_ps(dout + i));
      _mm256_storeu_ps(dinp + i, _mm256_add_ps(_mm256_loadu_ps(dinp + i), g));
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dinp + i, _mm256_mul_ps(gelu_local(_mm256_loadu_ps(inp + i)), _mm256_loadu_ps(dout + i)));
    }
  }
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    __m256 g = _mm256_mul_ps(gelu_local(_mm256_maskload_ps(inp + i, m)), _mm256_maskload_ps(dout + i, m));
    if (accumulate) g = _mm256_add_ps(_mm256_maskload_ps(dinp + i, m), g);
    _mm256_maskstore_ps(dinp + i, m, g);
  }
}

void layernorm_forward_row(float* o, float* mean, float* rstd, const float* x, const float* weight, const float* bias,
                           std::size_t C, float eps) noexcept {
  const float inv_c = 1.0f / static_cast<float>(C);
  const std::size_t full = C / 8 * 8;
  const __m256i tm = tail_mask(C - full);
  __m256 acc = _mm256_setzero_ps();
  for (std::size_t i = 0; i < full; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  if (full < C) acc = _mm256_add_ps(acc, _mm256_maskload_ps(x + full, tm));
  const float m = simd::hsum(acc) * inv_c;
  const __m256 vm = set1(m);
  acc = _mm256_setzero_ps();
  for (std::size_t i = 0; i < full; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), vm);
    acc = _mm256_fmadd_ps(d, d, acc);
  }
  if (full < C) {
    const __m256 d = _mm256_and_ps(_mm256_sub_ps(_mm256_maskload_ps(x + full, tm), vm), _mm256_castsi256_ps(tm));
    acc = _mm256_fmadd_ps(d, d, acc);
  }
  const float v = simd::hsum(acc) * inv_c;
  const float s = 1.0f / std::sqrt(v + eps);
  const __m256 vs = set1(s);
  for (std::size_t i = 0; i < full; i += 8) {
    const __m256 nrm = _mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(nrm, _mm256_loadu_ps(weight + i), _mm256_loadu_ps(bias + i)));
  }
  if (full < C) {
    const __m256 nrm = _mm256_mul_ps(vs, _mm256_sub_ps(_mm256_maskload_ps(x + full, tm), vm));
    _mm256_maskstore_ps(o + full, tm,
                        _mm256_fmadd_ps(nrm, _mm256_maskload_ps(weight + full, tm), _mm256_maskload_ps(bias + full, tm)));
  }
  *mean = m;
  *rstd = s;
}

void layernorm_backward_dx_row(float* dx, const float* dy, const float* x, const float* weight, float m, float s,
                               std::size_t C, bool accumulate) noexcept {
  const float inv_c = 1.0f / static_cast<float>(C);
  const std::size_t full = C / 8 * 8;
  const __m256i tm = tail_mask(C - full);
  const __m256 vm = set1(m), vs = set1(s);
  __m256 a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
  for (std::size_t i = 0; i < full; i += 8) {
    const __m256 nrm = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vs);
    const __m256 dn = _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_loadu_ps(dy + i));
    a1 = _mm256_add_ps(a1, dn);
    a2 = _mm256_fmadd_ps(dn, nrm, a2);
  }
  if (full < C) {  // masked loads give 0 in dy and weight, so dn = 0 in inactive lanes
    const __m256 nrm = _mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(x + full, tm), vm), vs);
    const __m256 dn = _mm256_mul_ps(_mm256_maskload_ps(weight + full, tm), _mm256_maskload_ps(dy + full, tm));
    a1 = _mm256_add_ps(a1, dn);
    a2 = _mm256_fmadd_ps(dn, nrm, a2);
  }
  const __m256 dmean = set1(simd::hsum(a1) * inv_c);
  const __m256 dnmean = set1(simd::hsum(a2) * inv_c);
  auto grad = [&](__m256 xv, __m256 w, __m256 d) {
    const __m256 nrm = _mm256_mul_ps(_mm256_sub_ps(xv, vm), vs);
    const __m256 dn = _mm256_mul_ps(w, d);
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_sub_ps(dn, dmean), _mm256_mul_ps(nrm, dnmean)), vs);
  };
  for (std::size_t i = 0; i < full; i += 8) {
    const __m256 g = grad(_mm256_loadu_ps(x + i), _mm256_loadu_ps(weight + i), _mm256_loadu_ps(dy + i));
    _mm256_storeu_ps(dx + i, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dx + i), g) : g);
  }
  if (full < C) {
    const std::size_t i = full;
    const __m256 g = grad(_mm256_maskload_ps(x + i, tm), _mm256_maskload_ps(weight + i, tm),
                          _mm256_maskload_ps(dy + i, tm));
    _mm256_maskstore_ps(dx + i, tm, accumulate ? _mm256_add_ps(_mm256_maskload_ps(dx + i, tm), g) : g);
  }
}

void layernorm_backward_params(float* dweight, float* dbias, const float* dy, const float* x, const float* mean,
                               const float* rstd, std::size_t rows, std::size_t ld, std::size_t n) noexcept {
  const std::size_t full = n / 8 * 8;
  const __m256i tm = tail_mask(n - full);
  for (std::size_t r = 0; r < rows; ++r) {
    const __m256 vm = set1(mean[r]), vs = set1(rstd[r]);
    const float* yr = dy + r * ld;
    const float* xr = x + r * ld;
    for (std::size_t i = 0; i < full; i += 8) {
      const __m256 d = _mm256_loadu_ps(yr + i);
      const __m256 nrm = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + i), vm), vs);
      _mm256_storeu_ps(dbias + i, _mm256_add_ps(_mm256_loadu_ps(dbias + i), d));
      _mm256_storeu_ps(dweight + i, _mm256_fmadd_ps(nrm, d, _mm256_loadu_ps(dweight + i)));
    }
    if (full < n) {
      const std::size_t i = full;
      const __m256 d = _mm256_maskload_ps(yr + i, tm);
      const __m256 nrm = _mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(xr + i, tm), vm), vs);
      _mm256_maskstore_ps(dbias + i, tm, _mm256_add_ps(_mm256_maskload_ps(dbias + i, tm), d));
      _mm256_maskstore_ps(dweight + i, tm, _mm256_fmadd_ps(nrm, d, _mm256_maskload_ps(dweight + i, tm)));
    }
  }
}

SoftmaxStats softmax_row(float* out, const float* in, std::size_t n, std::size_t valid) noexcept {
  const std::size_t full = valid / 8 * 8;
  const __m256i tm = tail_mask(valid - full);
  const __m256 ninf = set1(-__builtin_inff());
  // max_ps(x, acc) returns acc when x is NaN: NaN skipped, as the reference's compare.
  __m256 mx = ninf;
  for (std::size_t i = 0; i < full; i += 8) mx = _mm256_max_ps(_mm256_loadu_ps(in + i), mx);
  if (full < valid) mx = _mm256_max_ps(_mm256_blendv_ps(ninf, _mm256_maskload_ps(in + full, tm), _mm256_castsi256_ps(tm)), mx);
  float maxval = simd::hmax(mx);
  if (maxval == -__builtin_inff() || in[0] != in[0]) maxval = in[0];  // as the reference: starts from in[0]
  const __m256 vmax = set1(maxval);
  // The sum in the reference's sixteen lanes (layer_kernels.hpp), four to a vector:
  // elements 0-7 of a block of 16 go to lanes[0] and lanes[1], 8-15 to lanes[2] and lanes[3].
  __m256d lanes[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  const auto add_lanes = [&](__m256 e, int half) {
    lanes[2 * half] = _mm256_add_pd(lanes[2 * half], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    lanes[2 * half + 1] = _mm256_add_pd(lanes[2 * half + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  };
  for (std::size_t i = 0; i < full; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(in + i), vmax));
    _mm256_storeu_ps(out + i, e);
    add_lanes(e, static_cast<int>((i / 8) & 1));
  }
  if (full < valid) {
    // Inactive lanes add +0, which leaves a lane sum (>= +0) as it is.
    const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_maskload_ps(in + full, tm), vmax)), _mm256_castsi256_ps(tm));
    _mm256_maskstore_ps(out + full, tm, e);
    add_lanes(e, static_cast<int>((full / 8) & 1));
  }
  alignas(32) double l[kSoftmaxSumLanes];
  for (int v = 0; v < 4; ++v) _mm256_store_pd(l + 4 * v, lanes[v]);
  const double total = fold_softmax_lanes(l);
  const auto sum = static_cast<float>(total);
  const __m256 inv = set1(1.0f / sum);
  for (std::size_t i = 0; i < full; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(out + i), inv));
  if (full < valid) _mm256_maskstore_ps(out + full, tm, _mm256_mul_ps(_mm256_maskload_ps(out + full, tm), inv));
  for (std::size_t i = valid; i < n; ++i) out[i] = 0.0f;
  return {maxval, sum, total};
}

void crossentropy_backward_row(float* d, const float* p, std::size_t n, std::size_t target, float dl,
                               bool accumulate) noexcept {
  const __m256 vdl = set1(dl);
  const __m256i vt = _mm256_set1_epi32(static_cast<int>(target));
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  auto grad = [&](__m256 pv) {
    const __m256 ind = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(idx, vt)), set1(1.0f));
    return _mm256_mul_ps(_mm256_sub_ps(pv, ind), vdl);
  };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8, idx = _mm256_add_epi32(idx, eight)) {
    __m256 g = grad(_mm256_loadu_ps(p + i));
    if (accumulate) g = _mm256_add_ps(_mm256_loadu_ps(d + i), g);
    _mm256_storeu_ps(d + i, g);
  }
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    __m256 g = grad(_mm256_maskload_ps(p + i, m));
    if (accumulate) g = _mm256_add_ps(_mm256_maskload_ps(d + i, m), g);
    _mm256_maskstore_ps(d + i, m, g);
  }
}

void add(float* out, const float* a, const float* b, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, _mm256_add_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m)));
  }
}

void add_to_both(float* a, float* b, const float* d, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(d + i);
    _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), v));
    _mm256_storeu_ps(b + i, _mm256_add_ps(_mm256_loadu_ps(b + i), v));
  }
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    const __m256 v = _mm256_maskload_ps(d + i, m);
    _mm256_maskstore_ps(a + i, m, _mm256_add_ps(_mm256_maskload_ps(a + i, m), v));
    _mm256_maskstore_ps(b + i, m, _mm256_add_ps(_mm256_maskload_ps(b + i, m), v));
  }
}

}  // namespace

const LayerKernels* avx2_layer_kernels() noexcept {
  static const LayerKernels k{Isa::avx2,           &gelu_forward, &gelu_backward, &layernorm_forward_row,
                              &layernorm_backward_dx_row, &layernorm_backward_params, &softmax_row, &crossentropy_backward_row, &add,
                              &add_to_both};
  return &k;
}

}  // namespace mixprec::nn::detail

MIXPREC_TARGET_END

#else  // not x86-64: no AVX2 back end

namespace mixprec::nn::detail {
const LayerKernels* avx2_layer_kernels() noexcept { return nullptr; }
}  // namespace mixprec::nn::detail

#endif
