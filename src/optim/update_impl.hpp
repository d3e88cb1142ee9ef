// Private: the bodies of the update kernels, included by one translation unit per
// back end (reference/update_scalar.cpp, cpu/update_avx2.cpp, cpu/update_avx512.cpp) inside a
// distinct namespace. Plain loops the compiler vectorises; branches are hoisted into template
// parameters so that each loop body is straight-line code. The state formats' codecs
// (codec_impl.hpp) add intrinsics where the compiler cannot (table lookups, E4M3 codes).
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "formats/kernels.hpp"
#include "mixprec/formats/scalar.hpp"
#include "optim/kernels.hpp"

namespace MIXPREC_OPTIM_NS {

using mixprec::optim_detail::AdamScalars;
using mixprec::optim_detail::RuleScalars;
using mixprec::optim_detail::SgdScalars;

// Bc2One: bc2_sqrt == 1 (sqrt(1 - beta2^t) rounds to 1 once beta2^t < 2^-24: beta2 = 0.999
// after about 16,600 steps, 0.95 after about 325), where sqrt(v) / bc2_sqrt is sqrt(v)
// exactly: one of the three divider operations per element is skipped, with the same bits.
// One element of the step: gi the gradient after unscale and clip; p, m, v updated.
template <bool L2, bool Decoupled, bool LerpLow, bool Bc2One>
inline void adam_element(float gi, float& p, float& m, float& v, const AdamScalars& s) noexcept {
  float pi = p;
  if constexpr (L2) gi = gi + s.weight_decay * pi;
  if constexpr (Decoupled) pi = pi * s.decay_mul;
  float mi = m;
  if constexpr (LerpLow) mi = mi + s.weight * (gi - mi);
  else mi = gi - (gi - mi) * s.one_minus_weight;
  float vi = v * s.beta2;
  vi = vi + (s.one_minus_beta2 * gi) * gi;
  const float denom = (Bc2One ? std::sqrt(vi) : std::sqrt(vi) / s.bc2_sqrt) + s.eps;
  pi = pi + s.neg_step_size * (mi / denom);
  m = mi;
  v = vi;
  p = pi;
}

template <bool L2, bool Decoupled, bool LerpLow, bool Bc2One>
inline void adam_block(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                       std::size_t n, float pre, float clip, const AdamScalars& s) noexcept {
  const AdamScalars c = s;  // a local copy: no store below can alias it
  for (std::size_t i = 0; i < n; ++i) adam_element<L2, Decoupled, LerpLow, Bc2One>((g[i] * pre) * clip, p[i], m[i], v[i], c);
}

// Blocks of one cache line per stream, each stream prefetched 4 KiB ahead: the step is
// bound by memory, and one core alone keeps too few misses in flight (with the AVX-512
// loops, ~14 -> 17.3-17.9 GB/s of the 28 bytes a parameter on one thread; docs/performance.md).
// The prefetches change no value: every back end still gives the reference's bits.
template <bool L2, bool Decoupled, bool LerpLow, bool Bc2One>
void adam_loop(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
               const AdamScalars& s) noexcept {
  constexpr std::size_t kBlock = 16, kAhead = 1024;  // elements: one line, 4 KiB
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    __builtin_prefetch(p + i + kAhead, 1);
    __builtin_prefetch(m + i + kAhead, 1);
    __builtin_prefetch(v + i + kAhead, 1);
    __builtin_prefetch(g + i + kAhead, 0);
    adam_block<L2, Decoupled, LerpLow, Bc2One>(p + i, m + i, v + i, g + i, kBlock, pre, clip, s);
  }
  adam_block<L2, Decoupled, LerpLow, Bc2One>(p + i, m + i, v + i, g + i, n - i, pre, clip, s);
}

template <bool Bc2One>
void adam_variant(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
                  const AdamScalars& s) noexcept {
  const int k = (s.l2 ? 4 : 0) | (s.decoupled ? 2 : 0) | (s.lerp_low ? 1 : 0);
  switch (k) {
    case 0: return adam_loop<false, false, false, Bc2One>(p, m, v, g, n, pre, clip, s);
    case 1: return adam_loop<false, false, true, Bc2One>(p, m, v, g, n, pre, clip, s);
    case 2: return adam_loop<false, true, false, Bc2One>(p, m, v, g, n, pre, clip, s);
    case 3: return adam_loop<false, true, true, Bc2One>(p, m, v, g, n, pre, clip, s);
    case 4: return adam_loop<true, false, false, Bc2One>(p, m, v, g, n, pre, clip, s);
    case 5: return adam_loop<true, false, true, Bc2One>(p, m, v, g, n, pre, clip, s);
    case 6: return adam_loop<true, true, false, Bc2One>(p, m, v, g, n, pre, clip, s);
    default: return adam_loop<true, true, true, Bc2One>(p, m, v, g, n, pre, clip, s);
  }
}

void adam(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
          const AdamScalars& s) noexcept {
  if (s.bc2_sqrt == 1.0f) adam_variant<true>(p, m, v, g, n, pre, clip, s);
  else adam_variant<false>(p, m, v, g, n, pre, clip, s);
}

// The remainder master with bf16 gradients in one pass: the gradient decoded (bf16 bits << 16,
// times gscale: the bf16 decode of the formats), the master joined from its bf16 weight and
// remainder, adam_element, the master split back (state_format.hpp's join_master and
// split_master): adam's bits, without the three passes over buffers around it.
template <bool L2, bool Decoupled, bool LerpLow, bool Bc2One>
inline void adam_remainder_block(std::uint16_t* __restrict w, std::int16_t* __restrict r, float* __restrict m,
                                 float* __restrict v, const std::uint16_t* __restrict g, std::size_t n, float gscale,
                                 float clip, const AdamScalars& c) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float gd = std::bit_cast<float>(static_cast<std::uint32_t>(g[i]) << 16) * gscale;
    const std::uint32_t hi = static_cast<std::uint32_t>(w[i]) - (r[i] < 0 ? 1u : 0u);
    float p = std::bit_cast<float>(((hi & 0xFFFFu) << 16) | static_cast<std::uint16_t>(r[i]));
    adam_element<L2, Decoupled, LerpLow, Bc2One>(gd * clip, p, m[i], v[i], c);
    const std::uint32_t b = std::bit_cast<std::uint32_t>(p);
    const auto rem = static_cast<std::int16_t>(static_cast<std::uint16_t>(b & 0xFFFFu));
    w[i] = static_cast<std::uint16_t>((b >> 16) + (rem < 0 ? 1u : 0u));
    r[i] = rem;
  }
}

// As adam_loop: a cache line of the fp32 moments at a time, each prefetched 4 KiB ahead (fp32
// moments are updated in place; the caller prefetches the 16-bit streams).
template <bool L2, bool Decoupled, bool LerpLow, bool Bc2One>
void adam_remainder_loop(std::uint16_t* w, std::int16_t* r, float* m, float* v, const std::uint16_t* g, std::size_t n,
                         float gscale, float clip, const AdamScalars& s) noexcept {
  constexpr std::size_t kBlock = 16, kAhead = 1024;
  const AdamScalars c = s;  // a local copy: no store below can alias it
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    __builtin_prefetch(m + i + kAhead, 1);
    __builtin_prefetch(v + i + kAhead, 1);
    adam_remainder_block<L2, Decoupled, LerpLow, Bc2One>(w + i, r + i, m + i, v + i, g + i, kBlock, gscale, clip, c);
  }
  adam_remainder_block<L2, Decoupled, LerpLow, Bc2One>(w + i, r + i, m + i, v + i, g + i, n - i, gscale, clip, c);
}

template <bool Bc2One>
void adam_remainder_variant(std::uint16_t* w, std::int16_t* r, float* m, float* v, const std::uint16_t* g, std::size_t n,
                            float gscale, float clip, const AdamScalars& s) noexcept {
  const int k = (s.l2 ? 4 : 0) | (s.decoupled ? 2 : 0) | (s.lerp_low ? 1 : 0);
  switch (k) {
    case 0: return adam_remainder_loop<false, false, false, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
    case 1: return adam_remainder_loop<false, false, true, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
    case 2: return adam_remainder_loop<false, true, false, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
    case 3: return adam_remainder_loop<false, true, true, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
    case 4: return adam_remainder_loop<true, false, false, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
    case 5: return adam_remainder_loop<true, false, true, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
    case 6: return adam_remainder_loop<true, true, false, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
    default: return adam_remainder_loop<true, true, true, Bc2One>(w, r, m, v, g, n, gscale, clip, s);
  }
}

void adam_remainder(std::uint16_t* w, std::int16_t* r, float* m, float* v, const std::uint16_t* g, std::size_t n,
                    float gscale, float clip, const AdamScalars& s) noexcept {
  if (s.bc2_sqrt == 1.0f) adam_remainder_variant<true>(w, r, m, v, g, n, gscale, clip, s);
  else adam_remainder_variant<false>(w, r, m, v, g, n, gscale, clip, s);
}

// torchao's single_param_adam (torchao/optim/adam.py), element by element in fp32:
//   AdamW: p = p - (lr * wd) * p;  Adam: g = g + wd * p
//   m = lerp(m, g, 1 - beta1);  v = lerp(v, g * g, 1 - beta2)
//   denom = sqrt(v) / sqrt(bc2) + eps;  p = p - (lr * (m / bc1)) / denom
// torch.lerp's CPU kernel is one fused multiply-add (ATen's lerp_vec: fmadd(w, b - a, a) for
// |w| < 0.5, else fmadd(w - 1, b - a, b)), so these two are std::fma, the one FMA in the file.
inline float lerp_torch(float a, float b, float w, float omw, bool low) noexcept {
  return low ? std::fma(w, b - a, a) : std::fma(-omw, b - a, b);
}
void adam_torchao(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                  std::size_t n, float pre, float clip, const RuleScalars& s) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    float gi = (g[i] * pre) * clip;
    float pi = p[i];
    if (s.decoupled) pi = pi - s.decay * pi;
    if (s.l2) gi = gi + s.weight_decay * pi;
    const float mi = lerp_torch(m[i], gi, s.w1, s.omw1, s.low1);
    const float vi = lerp_torch(v[i], gi * gi, s.w2, s.omw2, s.low2);
    const float denom = std::sqrt(vi) / s.sqrt_bc2 + s.eps;
    pi = pi - (s.lr * (mi / s.bc1)) / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
  }
}

// Transformer Engine's FusedAdam kernel (multi_tensor_adam.cu, AdamFunctor), without FMA:
//   Adam (L2): g = g + wd * p
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + ((1 - beta2) * g) * g
//   denom = sqrt(v / bc2) + eps;  update = (m / bc1) / denom  (+ wd * p for AdamW);  p = p - lr * update
void adam_te(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
             std::size_t n, float pre, float clip, const RuleScalars& s) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    float gi = (g[i] * pre) * clip;
    float pi = p[i];
    if (s.l2) gi = gi + s.weight_decay * pi;
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * gi;
    const float vi = s.beta2 * v[i] + (s.one_minus_beta2 * gi) * gi;
    const float denom = std::sqrt(vi / s.bc2) + s.eps;
    float update = (mi / s.bc1) / denom;
    if (s.decoupled) update = update + s.decay * pi;
    pi = pi - s.lr * update;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
  }
}

// Mom: 0 none, 1 first step (buf = d_p), 2 later steps (buf = buf * mu + (1 - dampening) * d_p).
template <bool WD, int Mom, bool Nesterov>
void sgd_loop(float* __restrict p, float* __restrict buf, const float* __restrict g, std::size_t n, float pre,
              float clip, const SgdScalars& s) noexcept {
  const float wd = s.weight_decay, mu = s.momentum, omd = s.one_minus_dampening, nlr = s.neg_lr;
  for (std::size_t i = 0; i < n; ++i) {
    float d = (g[i] * pre) * clip;
    const float pi = p[i];
    if constexpr (WD) d = d + wd * pi;
    if constexpr (Mom != 0) {
      float b;
      if constexpr (Mom == 1) b = d;
      else b = buf[i] * mu + omd * d;
      buf[i] = b;
      if constexpr (Nesterov) d = d + mu * b;
      else d = b;
    }
    p[i] = pi + nlr * d;
  }
}

void sgd(float* p, float* buf, const float* g, std::size_t n, float pre, float clip, const SgdScalars& s) noexcept {
  const int mom = s.has_momentum ? (s.first ? 1 : 2) : 0;
  const bool nest = s.has_momentum && s.nesterov;
  const int k = (s.has_wd ? 8 : 0) | (mom << 1) | (nest ? 1 : 0);
  switch (k) {
    case 0: return sgd_loop<false, 0, false>(p, buf, g, n, pre, clip, s);
    case 2: return sgd_loop<false, 1, false>(p, buf, g, n, pre, clip, s);
    case 3: return sgd_loop<false, 1, true>(p, buf, g, n, pre, clip, s);
    case 4: return sgd_loop<false, 2, false>(p, buf, g, n, pre, clip, s);
    case 5: return sgd_loop<false, 2, true>(p, buf, g, n, pre, clip, s);
    case 8: return sgd_loop<true, 0, false>(p, buf, g, n, pre, clip, s);
    case 10: return sgd_loop<true, 1, false>(p, buf, g, n, pre, clip, s);
    case 11: return sgd_loop<true, 1, true>(p, buf, g, n, pre, clip, s);
    case 12: return sgd_loop<true, 2, false>(p, buf, g, n, pre, clip, s);
    default: return sgd_loop<true, 2, true>(p, buf, g, n, pre, clip, s);
  }
}

void scale(const float* src, float* dst, std::size_t n, float a) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = src[i] * a;
}

inline std::uint32_t fmix32(std::uint32_t h) noexcept {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The stochastic-rounding word of flat index idx.
inline std::uint32_t sr_word(std::uint64_t idx, std::uint64_t key) noexcept {
  const std::uint32_t h = fmix32(static_cast<std::uint32_t>(idx) ^ static_cast<std::uint32_t>(key));
  return fmix32(h ^ static_cast<std::uint32_t>(idx >> 32) ^ static_cast<std::uint32_t>(key >> 32));
}

void sr_bits(std::uint32_t* out, std::uint64_t first, std::size_t n, std::uint64_t key) noexcept {
  const auto klo = static_cast<std::uint32_t>(key), khi = static_cast<std::uint32_t>(key >> 32);
  const auto lo = static_cast<std::uint32_t>(first);
  if (static_cast<std::uint64_t>(lo) + n <= (std::uint64_t{1} << 32)) {
    // The high word of every index is first's: 32-bit lanes only (the same words).
    const std::uint32_t hk = static_cast<std::uint32_t>(first >> 32) ^ khi;
    for (std::size_t i = 0; i < n; ++i) out[i] = fmix32(fmix32((lo + static_cast<std::uint32_t>(i)) ^ klo) ^ hk);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t idx = first + i;
    const std::uint32_t h = fmix32(static_cast<std::uint32_t>(idx) ^ klo);
    out[i] = fmix32(h ^ static_cast<std::uint32_t>(idx >> 32) ^ khi);
  }
}

#include "optim/codec_impl.hpp"

inline const mixprec::optim_detail::UpdateKernels kTable{
    adam, adam_torchao, adam_te, sgd, scale, sr_bits,
    adam_moments, adam_moments_torchao, adam_moments_te,
    join_master, split_master, adam_remainder, round_bf16_stochastic,
    encode_fp8_blocks, encode_fp8_scaled, encode_map_blocks, decode_fp8_blocks,
    decode_map_blocks};

}  // namespace MIXPREC_OPTIM_NS
