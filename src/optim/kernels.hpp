// Private: the inner loops of the optimizers, one table per back end.
//
// Kernels never allocate, check, log or throw; the public entry points validate
// first. Every loop is element-wise fp32 arithmetic in a fixed order, compiled
// without FMA contraction (-ffp-contract=off), so the scalar, AVX2 and AVX-512 builds give
// bitwise the same results.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/format_table.hpp"

namespace mixprec::optim_detail {

// The formats' largest finite values, from the format table: TE scales an fp16 state to half of
// fp16's (absmax / 32752) and an E4M3 state, like torchao's blocks, to E4M3's (absmax / 448).
inline constexpr float kE4M3Max = format_row(FormatId::f8e4m3).max_finite;
inline constexpr float kTeFp16Range = format_row(FormatId::f16).max_finite / 2;

// A divisor fixed over a loop (a bias correction, a block's scale) and r = RN(1 / d). With it
// the vector back ends divide without the divider, which bounds the step (one vdivps takes as
// long as a dozen FMAs): q = RN(x r) lies within one ulp of x / d, e = x - q d is exact in one
// FMA, and RN(q + e r) is RN(x / d) (Markstein's theorem, P. Markstein, IBM J. Res. Dev. 34(1),
// 1990) wherever no step under- or overflows (the ranges below); the back ends divide the
// divider's way outside them. tests/optim/test_kernels.cpp checks every fp32
// significand against divisors including the all-ones significand, and every range edge.
struct Divisor {
  float d, r;
  bool by_fma;  // d and r normal: the FMA quotient applies (a NaN, inf or zero scale divides)
};
inline Divisor divisor(float d) noexcept {
  const float r = 1.0f / d;
  return {d, r, std::isnormal(d) && std::isnormal(r)};
}
// The FMA quotient from q0 = x * r, fma(fma(-q0, d, x), r, q0), is x / d where |x| >= kQuotientMinX
// and kQuotientMinQ <= |q0| < kQuotientMaxQ; for a zero x, q0 is (the FMAs would turn -0 into +0).
inline constexpr float kQuotientMinX = 0x1p-96f;    // e = x - q d stays above fp32's subnormals
inline constexpr float kQuotientMinQ = 0x1p-124f;   // q normal, with a margin for its last step
inline constexpr float kQuotientMaxQ = 0x1p126f;    // q + e r cannot overflow

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
  Divisor bc2_sqrt;      // sqrt(1 - beta2^t)
  bool l2, decoupled, lerp_low;  // lerp_low: |weight| < 0.5
};

// The scalars of torch's Adam (decoupled = false: L2) or AdamW step t (applied steps including
// this one) at learning rate lr; bias corrections in double, as Python computes them.
inline AdamScalars adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                                std::int64_t t) noexcept {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(t));
  AdamScalars a{};
  a.weight = static_cast<float>(1.0 - beta1);
  a.one_minus_weight = 1.0f - a.weight;
  a.lerp_low = std::fabs(a.weight) < 0.5f;
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.decay_mul = static_cast<float>(1.0 - lr * weight_decay);
  a.neg_step_size = static_cast<float>(-(lr / bc1));
  a.bc2_sqrt = divisor(static_cast<float>(std::sqrt(bc2)));
  a.l2 = !decoupled && weight_decay != 0;
  a.decoupled = decoupled && weight_decay != 0;
  return a;
}

// Scalars of the torchao and Transformer Engine update rules (state_format.hpp's AdamRule),
// rounded to fp32 as each system rounds them (docs/optimizers.md, "Update rules").
struct RuleScalars {
  float lr;
  float decay;             // torchao AdamW: lr * wd (fp32 product); TE: wd
  float weight_decay;      // Adam (L2): g += wd * p
  float w1, omw1, w2, omw2;  // torchao: lerp weights 1 - beta1, 1 - beta2 and their complements
  bool low1, low2;         // torchao: |w| < 0.5, lerp's branch
  float beta1, one_minus_beta1, beta2, one_minus_beta2;  // TE
  Divisor bc1, bc2;        // bias corrections 1 - beta^t (torchao: fp32 pow; TE: double pow, rounded)
  Divisor sqrt_bc2;        // torchao: sqrt of the fp32 bc2
  float eps;
  bool l2, decoupled;
};

struct SgdScalars {
  float weight_decay, momentum, one_minus_dampening, neg_lr;
  bool has_wd, has_momentum, first, nesterov;
};

// Elements per chunk of the fused pass (the decoded chunk stays in L1).
inline constexpr std::size_t kChunk = 1024;

// One of torchao's 8bit / 4bit code maps with the tables its code search reads (state_format.cpp
// builds them once; code_map() never allocates after that). The code of y is torchao's: the
// largest code whose value is <= y (0 for NaN or below every value), one up when
// y - value >= (next - value) * 0.5. That code never decreases as y grows, so it is also the
// number of thresholds <= y, threshold k being the least fp32 value whose code is k.
struct CodeMap {
  const float* values;            // n sorted values
  std::size_t n;                  // 256 (8bit) or 16 (4bit)
  // The reference back end's search: the largest code whose value is <= the lowest fp32 value
  // with top 16 bits k (0 when none), walked up from there.
  const std::uint8_t* walk_start;  // 65536
  // The vector back ends' search: thresholds[k] for k in [1, n), thresholds[0] = -inf,
  // thresholds[n] = NaN (no y is >= it); start[k] = the code of the lowest fp32 value with top
  // 16 bits k, followed by 3 padding bytes (read as 32-bit words); at most `steps` thresholds lie
  // above that lowest value inside one such bucket (the code is start + that many compares).
  const float* thresholds;        // n + 1
  const std::uint8_t* start;      // 65536 + 3
  unsigned steps;
  // steps <= 1: one 32-bit word a bucket, start | offset << 8, offset = where the threshold above
  // start lies inside the bucket as the low 16 bits of y (their complement for a negative
  // bucket, where a larger value has fewer magnitude bits), 0x10000 when none: the code is
  // start + (key >= offset), key = the low 16 bits of y (complemented when negative).
  // nullptr when steps > 1.
  const std::uint32_t* packed;    // 65536
  // Every y with |y| < zero_band has the code of 0 (and of -0): a quotient that small needs no
  // exact rounding.
  float zero_band;
};
const CodeMap& code_map(bool eight_bit, bool is_signed) noexcept;  // state_format.cpp

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
  // q[i] = x[i] / d, correctly rounded (the quotients inside the steps and codecs: Divisor).
  void (*divide)(const float* x, float* q, std::size_t n, float d);
  // Stochastic-rounding words for flat indices first .. first + n - 1.
  void (*sr_bits)(std::uint32_t* out, std::uint64_t first, std::size_t n, std::uint64_t key);

  // The state formats' step (state_format.cpp). The first pass of per-tensor scales: the new
  // moments alone, as adam / adam_torchao / adam_te compute them (p is read only for L2 and
  // never written).
  void (*adam_moments)(const float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
                       const AdamScalars& s);
  void (*adam_moments_torchao)(const float* p, float* m, float* v, const float* g, std::size_t n, float pre,
                               float clip, const RuleScalars& s);
  void (*adam_moments_te)(const float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
                          const RuleScalars& s);
  // The remainder master (state_format.hpp's split_master / join_master, the same bits).
  void (*join_master)(const std::uint16_t* bf16_bits, const std::int16_t* remainder, float* master, std::size_t n);
  void (*split_master)(const float* master, std::uint16_t* bf16_bits, std::int16_t* remainder, std::size_t n);
  // adam over the remainder master with bf16 gradients, in place: gradient i = bf16 g[i] * gscale
  // (the formats' decode) times clip; the master joined from w and r, updated, split back into
  // them. The same bits as the formats' decode, join_master, adam (pre 1), split_master.
  void (*adam_remainder)(std::uint16_t* w, std::int16_t* r, float* m, float* v, const std::uint16_t* g, std::size_t n,
                         float gscale, float clip, const AdamScalars& s);
  // Stochastic rounding of fp32 weights to bf16 with sr_bits' words for flat indices
  // first .. first + n - 1: the formats' encode_stochastic of bf16 (IEEE overflow, subnormals
  // kept), the words made in the same pass.
  void (*round_bf16_stochastic)(const float* p, std::uint16_t* out, std::uint64_t first, std::size_t n,
                                std::uint64_t key);
  // torchao's blocked moments over n elements (a multiple of block; 4bit: an even block; the
  // vector back ends take the plain loop for a block not a multiple of 32): per block,
  // scale = max(absmax, 1e-12) (fp8: / 448) into scales[block index], then codes of x / scale:
  // E4M3 (IEEE overflow), or the code map's (4bit: two a byte, the first element in the high
  // nibble). x is only read.
  void (*encode_fp8_blocks)(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block);
  // TE's per-tensor E4M3 moment: codes of e4m3_satfinite(x * qscale).
  void (*encode_fp8_scaled)(const float* x, std::uint8_t* codes, std::size_t n, float qscale);
  void (*encode_map_blocks)(const float* x, std::uint8_t* codes, float* scales, std::size_t n, std::size_t block,
                            const CodeMap& map);
  // x[i] = the E4M3 value of codes[i] * factors[i / block] (n a multiple of block; per tensor:
  // block = n).
  void (*decode_fp8_blocks)(const std::uint8_t* codes, const float* factors, float* x, std::size_t n,
                            std::size_t block);
  // x = value of the code * its block's scale.
  void (*decode_map_blocks)(const std::uint8_t* codes, const float* scales, float* x, std::size_t n,
                            std::size_t block, const CodeMap& map);
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
