// Private: the back ends of the fp32 layers' elementwise and row kernels (GELU,
// layer norm, softmax / cross-entropy, residual add, embedding rows): the scalar
// reference (src/nn/reference/layer_kernels_scalar.cpp, the plain definitions the
// layers always had), AVX2 + FMA (src/nn/cpu/layer_kernels_avx2.cpp) and AVX-512
// (src/nn/cpu/layer_kernels_avx512.cpp: GELU; AVX2's other kernels). layers.cpp
// picks one table once (active_isa(), MIXPREC_ISA) and keeps the argument checks and
// the OpenMP split; the kernels only compute: they never allocate, throw or log.
//
// Exactness: the AVX2 exp/tanh are polynomial, not libm's, and its reductions sum in
// eight lanes, so results are not bitwise equal to the reference. The bounds the
// tests hold them to (tests/nn/test_layer_kernels.cpp) are stated there and in
// docs/layers.md. Every kernel is elementwise-position independent: the same
// input value gives the same output wherever it sits in a row (tails are masked
// vectors, not a scalar loop), so the OpenMP split never changes a result.
#pragma once

#include <cstddef>
#include <span>

#include "mixprec/core/isa.hpp"
#include "mixprec/nn/data.hpp"

namespace mixprec::nn::detail {

// What softmax_row reports: the row maximum and sum exp(x - max) over the valid part.
// The sum runs in double in kSoftmaxSumLanes lanes (element i into lane i % 16, in index
// order), the lanes are folded in halves (lane j += lane j + 8 for j < 8, then + 4, + 2,
// + 1), and lane 0 is rounded once to float: every back end adds in that order, so they
// differ only through exp, and the sum is nearly correctly rounded (a float running sum
// carries up to valid - 1 roundings; it was also one dependent add per element, most of
// softmax_row's 17% of the default model's bf16 step, where sixteen lanes leave one add
// per lane per 16 elements).
inline constexpr std::size_t kSoftmaxSumLanes = 16;

// The fold above, on the lanes in place; returns lane 0.
inline double fold_softmax_lanes(double* lanes) noexcept {
  for (std::size_t w = kSoftmaxSumLanes / 2; w > 0; w /= 2) {
    for (std::size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  }
  return lanes[0];
}
struct SoftmaxStats {
  float max;
  float sum;          // lane_total rounded to float
  double lane_total;  // the folded lanes, before that rounding (tests compare back ends on it)
};

struct LayerKernels {
  Isa isa;
  // out[i] = gelu(inp[i]) (tanh form); out may alias inp.
  void (*gelu_forward)(float* out, const float* inp, std::size_t n) noexcept;
  // accumulate: dinp[i] += gelu'(inp[i]) * dout[i]; else dinp[i] = gelu'(inp[i]) * dout[i].
  // dinp may alias dout.
  void (*gelu_backward)(float* dinp, const float* inp, const float* dout, std::size_t n, bool accumulate) noexcept;
  // One row of C: out, and the row's mean and rstd.
  void (*layernorm_forward_row)(float* out, float* mean, float* rstd, const float* x, const float* weight,
                                const float* bias, std::size_t C, float eps) noexcept;
  // One row of dx (+= or =). Rows are independent (split over threads by row).
  void (*layernorm_backward_dx_row)(float* dx, const float* dy, const float* x, const float* weight, float mean,
                                    float rstd, std::size_t C, bool accumulate) noexcept;
  // dweight[i] += norm(r, i) * dy(r, i), dbias[i] += dy(r, i) for i < n, row after row
  // (r < rows, rows ld apart; mean/rstd per row): each column sums its rows in order, so
  // a split of the columns over threads does not change a result.
  void (*layernorm_backward_params)(float* dweight, float* dbias, const float* dy, const float* x, const float* mean,
                                    const float* rstd, std::size_t rows, std::size_t ld, std::size_t n) noexcept;
  // Softmax of one row in[0, valid) into out[0, valid); out[valid, n) = 0 (causal rows:
  // valid = t + 1). valid >= 1. out may alias in. Returns max and sum of exp(in - max).
  SoftmaxStats (*softmax_row)(float* out, const float* in, std::size_t n, std::size_t valid) noexcept;
  // d[i] (+= or =) (p[i] - [i == target]) * dl over one row of n.
  void (*crossentropy_backward_row)(float* d, const float* p, std::size_t n, std::size_t target, float dl,
                                    bool accumulate) noexcept;
  // out[i] = a[i] + b[i] (out may alias a or b).
  void (*add)(float* out, const float* a, const float* b, std::size_t n) noexcept;
  // a[i] += d[i]; b[i] += d[i] (a, b distinct from d).
  void (*add_to_both)(float* a, float* b, const float* d, std::size_t n) noexcept;
};

const LayerKernels& scalar_layer_kernels() noexcept;
const LayerKernels* avx2_layer_kernels() noexcept;    // nullptr when not compiled in
const LayerKernels* avx512_layer_kernels() noexcept;  // nullptr when not compiled in

// The table of `isa` (nullptr where this CPU or build lacks it), as select_kernels().
const LayerKernels* layer_kernels(Isa isa) noexcept;
// The table the layers use: layer_kernels(active_isa()), chosen at first use.
const LayerKernels& active_layer_kernels();

// The models' variants of three backward layers (include/mixprec/nn/layers.hpp) that
// STORE the input gradient (dinp = ...) instead of accumulating into it, so that a
// model need not zero a buffer the op then overwrites in full. Same checks and
// kernels; dweight/dbias still accumulate.
void gelu_backward_store(std::span<float> dinp, std::span<const float> inp, std::span<const float> dout);
void layernorm_backward_store(std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                              std::span<const float> dout, std::span<const float> inp, std::span<const float> weight,
                              std::span<const float> mean, std::span<const float> rstd, std::size_t N, std::size_t C);
// out[n, o] += bias[o] over N rows of OC: linear_forward's bias, for a model that adds it
// in the same pass as its commit (Engine::run_stages).
void add_bias_rows(std::span<float> out, std::span<const float> bias, std::size_t N, std::size_t OC);
// layernorm_backward's two halves (same kernels, same split), for a model that commits
// dinp block by block: the parameter gradients over all N rows, then dinp (+= when
// accumulate, else =) over N rows. Sizes as layernorm_backward's (std::invalid_argument).
void layernorm_backward_params(std::span<float> dweight, std::span<float> dbias, std::span<const float> dout,
                               std::span<const float> inp, std::span<const float> mean, std::span<const float> rstd,
                               std::size_t N, std::size_t C);
void layernorm_backward_dx(std::span<float> dinp, std::span<const float> dout, std::span<const float> inp,
                           std::span<const float> weight, std::span<const float> mean, std::span<const float> rstd,
                           std::size_t N, std::size_t C, bool accumulate);
void crossentropy_softmax_backward_store(std::span<float> dlogits, std::span<const float> dlosses,
                                         std::span<const float> probs, std::span<const TokenId> targets,
                                         std::size_t B, std::size_t T, std::size_t V);

}  // namespace mixprec::nn::detail
