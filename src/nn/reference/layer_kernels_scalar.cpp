// The scalar reference of the layer kernels (src/nn/layer_kernels.hpp): the plain
// definitions, exactly the loops include/mixprec/nn/layers.hpp's functions always ran
// (MIXPREC_ISA=scalar reproduces them bit for bit). Every fast back end is tested
// against these (tests/nn/test_layer_kernels.cpp).
#include <cmath>

#include "core/select_kernels.hpp"
#include "nn/layer_kernels.hpp"

namespace mixprec::nn::detail {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

// tanh(u) = 1 - 2 / (exp(2u) + 1): one expf instead of libm's tanhf (three times
// slower here), absolute error within a few fp32 ulps of 1; exp overflow to inf gives
// exactly 1 and underflow to 0 gives exactly -1.
inline float tanh_fast(float u) { return 1.0f - 2.0f / (std::exp(2.0f * u) + 1.0f); }

void gelu_forward(float* out, const float* inp, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    out[i] = 0.5f * x * (1.0f + tanh_fast(kGeluScale * (x + cube)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::size_t n, bool accumulate) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    const float th = tanh_fast(kGeluScale * (x + cube));
    const float sech2 = 1.0f - th * th;  // 1/cosh^2, no overflow for large |x|
    const float local = 0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    if (accumulate) dinp[i] += local * dout[i];
    else dinp[i] = local * dout[i];
  }
}

void layernorm_forward_row(float* o, float* mean, float* rstd, const float* x, const float* weight, const float* bias,
                           std::size_t C, float eps) noexcept {
  const float inv_c = 1.0f / static_cast<float>(C);
  float m = 0.0f;
  for (std::size_t i = 0; i < C; ++i) m += x[i];
  m *= inv_c;
  float v = 0.0f;
  for (std::size_t i = 0; i < C; ++i) {
    const float d = x[i] - m;
    v += d * d;
  }
  v *= inv_c;
  const float s = 1.0f / std::sqrt(v + eps);
  for (std::size_t i = 0; i < C; ++i) o[i] = (s * (x[i] - m)) * weight[i] + bias[i];
  *mean = m;
  *rstd = s;
}

void layernorm_backward_dx_row(float* dx, const float* dy, const float* x, const float* weight, float m, float s,
                               std::size_t C, bool accumulate) noexcept {
  const float inv_c = 1.0f / static_cast<float>(C);
  // two reductions: mean of dnorm and mean of dnorm * norm
  float dnorm_mean = 0.0f;
  float dnorm_norm_mean = 0.0f;
  for (std::size_t i = 0; i < C; ++i) {
    const float norm = (x[i] - m) * s;
    const float dnorm = weight[i] * dy[i];
    dnorm_mean += dnorm;
    dnorm_norm_mean += dnorm * norm;
  }
  dnorm_mean *= inv_c;
  dnorm_norm_mean *= inv_c;
  for (std::size_t i = 0; i < C; ++i) {
    const float norm = (x[i] - m) * s;
    const float dnorm = weight[i] * dy[i];
    const float g = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    if (accumulate) dx[i] += g;
    else dx[i] = g;
  }
}

void layernorm_backward_params(float* dweight, float* dbias, const float* dy, const float* x, const float* mean,
                               const float* rstd, std::size_t rows, std::size_t ld, std::size_t n) noexcept {
  for (std::size_t r = 0; r < rows; ++r) {
    const float m = mean[r], s = rstd[r];
    const float* yr = dy + r * ld;
    const float* xr = x + r * ld;
    for (std::size_t i = 0; i < n; ++i) {
      const float norm = (xr[i] - m) * s;
      dbias[i] += yr[i];
      dweight[i] += norm * yr[i];
    }
  }
}

SoftmaxStats softmax_row(float* out, const float* in, std::size_t n, std::size_t valid) noexcept {
  float maxval = in[0];
  for (std::size_t i = 1; i < valid; ++i) maxval = in[i] > maxval ? in[i] : maxval;
  double lanes[kSoftmaxSumLanes] = {};
  for (std::size_t i = 0; i < valid; ++i) {
    const float e = std::exp(in[i] - maxval);
    out[i] = e;
    lanes[i % kSoftmaxSumLanes] += static_cast<double>(e);
  }
  const double total = fold_softmax_lanes(lanes);
  const auto sum = static_cast<float>(total);
  const float inv = 1.0f / sum;  // sum >= 1 (the maximum contributes exp(0))
  for (std::size_t i = 0; i < valid; ++i) out[i] *= inv;
  for (std::size_t i = valid; i < n; ++i) out[i] = 0.0f;
  return {maxval, sum, total};
}

void crossentropy_backward_row(float* d, const float* p, std::size_t n, std::size_t target, float dl,
                               bool accumulate) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float indicator = i == target ? 1.0f : 0.0f;
    const float g = (p[i] - indicator) * dl;
    if (accumulate) d[i] += g;
    else d[i] = g;
  }
}

void add(float* out, const float* a, const float* b, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void add_to_both(float* a, float* b, const float* d, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    a[i] += d[i];
    b[i] += d[i];
  }
}

}  // namespace

const LayerKernels& scalar_layer_kernels() noexcept {
  static const LayerKernels k{Isa::scalar,          &gelu_forward, &gelu_backward, &layernorm_forward_row,
                              &layernorm_backward_dx_row, &layernorm_backward_params, &softmax_row, &crossentropy_backward_row, &add,
                              &add_to_both};
  return k;
}

const LayerKernels* layer_kernels(Isa isa) noexcept {
  return mixprec::detail::select_kernels(isa, &scalar_layer_kernels, &avx2_layer_kernels, &avx512_layer_kernels);
}

const LayerKernels& active_layer_kernels() {
  static const LayerKernels* k = layer_kernels(active_isa());
  return *k;
}

}  // namespace mixprec::nn::detail
