// Private: the inner loops of the optimizers, one table per back end.
//
// Kernels never allocate, check, log or throw; the public entry points validate
// first. Every loop is element-wise fp32 arithmetic in a fixed order, compiled
// without FMA contraction (-ffp-contract=off), so the scalar, AVX2 and AVX-512 builds give
// bitwise the same results.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mixprec/core/isa.hpp"

namespace mixprec::optim_detail {

// Scalars of one Adam/AdamW step, rounded to fp32 once per step (PyTorch passes
// Python floats, which become fp32 when applied to fp32 tensors).
struct AdamScalars {
  float weight;          // lerp weight 1 - beta1
  float one_minus_weight;
  float beta2, one_minus_beta2;
  float eps;
  float weight_decay;    // Adam: g += wd * p
  float decay_mul;       // AdamW: p *= 1 - lr * wd
  float neg_step_size;   // -(lr / (1 - beta1^t))
  float bc2_sqrt;        // sqrt(1 - beta2^t)
  bool l2, decoupled, lerp_low;  // lerp_low: |weight| < 0.5
};

// Scalars of the torchao and Transformer Engine update rules (state_format.hpp's AdamRule),
// rounded to fp32 as each system rounds them (docs/optimizers.md, "Update rules").
struct RuleScalars {
  float lr;
  float decay;             // torchao AdamW: lr * wd (fp32 product); TE: wd
  float weight_decay;      // Adam (L2): g += wd * p
  float w1, omw1, w2, omw2;  // torchao: lerp weights 1 - beta1, 1 - beta2 and their complements
  bool low1, low2;         // torchao: |w| < 0.5, lerp's branch
  float beta1, one_minus_beta1, beta2, one_minus_beta2;  // TE
  float bc1, bc2;          // bias corrections 1 - beta^t (torchao: fp32 pow; TE: double pow, rounded)
  float sqrt_bc2;          // torchao: sqrt of the fp32 bc2
  float eps;
  bool l2, decoupled;
};

struct SgdScalars {
  float weight_decay, momentum, one_minus_dampening, neg_lr;
  bool has_wd, has_momentum, first, nesterov;
};

// Elements per chunk of the fused pass (the decoded chunk stays in L1).
inline constexpr std::size_t kChunk = 1024;

struct UpdateKernels {
  // g_i = (g[i] * pre) * clip, then the optimizer's update of p (and m, v / buf).
  void (*adam)(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
               const AdamScalars& s);
  // The same step in torchao's single_param_adam order and in TE's FusedAdam kernel order.
  void (*adam_torchao)(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
                       const RuleScalars& s);
  void (*adam_te)(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
                  const RuleScalars& s);
  void (*sgd)(float* p, float* buf, const float* g, std::size_t n, float pre, float clip, const SgdScalars& s);
  // dst[i] = src[i] * a (dst may equal src).
  void (*scale)(const float* src, float* dst, std::size_t n, float a);
  // Stochastic-rounding words for flat indices first .. first + n - 1.
  void (*sr_bits)(std::uint32_t* out, std::uint64_t first, std::size_t n, std::uint64_t key);
};

const UpdateKernels& scalar_update_kernels() noexcept;  // reference/update_scalar.cpp
const UpdateKernels* avx2_update_kernels() noexcept;    // cpu/update_avx2.cpp; nullptr when not compiled in
const UpdateKernels* avx512_update_kernels() noexcept;  // cpu/update_avx512.cpp; nullptr when not compiled in
// The table of `isa` by the rule of every kernel table (core/select_kernels.hpp):
// nullptr when isa is not available.
const UpdateKernels* update_kernels(Isa isa) noexcept;

constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
constexpr std::uint64_t sr_key(std::uint64_t seed, std::uint64_t step) noexcept {
  return splitmix64(seed ^ splitmix64(step));
}

}  // namespace mixprec::optim_detail
