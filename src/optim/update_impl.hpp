// Private: the bodies of the update kernels, included by one translation unit per
// back end (reference/update_scalar.cpp, cpu/update_avx2.cpp, cpu/update_avx512.cpp) inside a
// distinct namespace. Plain loops the compiler vectorises; branches are hoisted into template
// parameters so that each loop body is straight-line code. The state formats' codecs
// (codec_impl.hpp) add intrinsics where the compiler cannot (table lookups, E4M3 codes).
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "formats/kernels.hpp"
#include "mixprec/formats/scalar.hpp"
#include "optim/kernels.hpp"

namespace MIXPREC_OPTIM_NS {

using mixprec::optim_detail::AdamScalars;
using mixprec::optim_detail::RuleScalars;
using mixprec::optim_detail::SgdScalars;

using mixprec::optim_detail::Divisor;

// ---- quotients by a divisor fixed over a loop (optim/kernels.hpp's Divisor) --------------------
#if defined(MIXPREC_OPTIM_AVX2) || defined(MIXPREC_OPTIM_AVX512)
inline constexpr bool kQuotientsByFma = true;
#else
inline constexpr bool kQuotientsByFma = false;  // the reference divides
#endif
#if defined(MIXPREC_OPTIM_AVX512)
// The FMA quotient from q0 = x * r: q0 + (x - q0 d) r (Divisor says where it is exact).
inline __m512 corrected_quotient(__m512 x, __m512 q0, __m512 r, __m512 d) noexcept {
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, d, x), r, q0);
}

// x / d for the block codecs' finite blocks, where every quotient at or above `tiny` lies in the
// FMA quotient's range and every one below it encodes as any other value of its sign below it:
// q0 = x * r there (its sign is x's), the FMA quotient elsewhere.
inline __m512 quotient_above(__m512 x, __m512 r, __m512 d, __m512 tiny) noexcept {
  const __m512 q0 = _mm512_mul_ps(x, r);
  return _mm512_mask_mov_ps(corrected_quotient(x, q0, r, d), _mm512_cmp_ps_mask(_mm512_abs_ps(q0), tiny, _CMP_LT_OQ),
                            q0);
}

// x / c.d in 16 lanes: by FMAs where every lane is in their range, else by the divider.
inline __m512 quotient_v(__m512 x, Divisor c) noexcept {
  const __m512 r = _mm512_set1_ps(c.r);
  const __m512 q0 = _mm512_mul_ps(x, r);
  const __m512 q1 = corrected_quotient(x, q0, r, _mm512_set1_ps(c.d));
  const __m512 ax = _mm512_abs_ps(x), aq = _mm512_abs_ps(q0);
  const __mmask16 zero = _mm512_cmp_ps_mask(ax, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __mmask16 in = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(mixprec::optim_detail::kQuotientMinX), _CMP_GE_OQ) &
                       _mm512_cmp_ps_mask(aq, _mm512_set1_ps(mixprec::optim_detail::kQuotientMinQ), _CMP_GE_OQ) &
                       _mm512_cmp_ps_mask(aq, _mm512_set1_ps(mixprec::optim_detail::kQuotientMaxQ), _CMP_LT_OQ);
  if (c.by_fma && static_cast<__mmask16>(zero | in) == 0xFFFF) return _mm512_mask_mov_ps(q1, zero, q0);
  return _mm512_div_ps(x, _mm512_set1_ps(c.d));
}
#elif defined(MIXPREC_OPTIM_AVX2)
// x / c.d in 8 lanes: by FMAs where every lane is in their range, else by the divider.
inline __m256 quotient_v(__m256 x, Divisor c) noexcept {
  const __m256 r = _mm256_set1_ps(c.r);
  const __m256 q0 = _mm256_mul_ps(x, r);
  const __m256 q1 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, _mm256_set1_ps(c.d), x), r, q0);
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 ax = _mm256_and_ps(x, mag), aq = _mm256_and_ps(q0, mag);
  const __m256 zero = _mm256_cmp_ps(ax, _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 in =
      _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(ax, _mm256_set1_ps(mixprec::optim_detail::kQuotientMinX), _CMP_GE_OQ),
                                  _mm256_cmp_ps(aq, _mm256_set1_ps(mixprec::optim_detail::kQuotientMinQ), _CMP_GE_OQ)),
                    _mm256_cmp_ps(aq, _mm256_set1_ps(mixprec::optim_detail::kQuotientMaxQ), _CMP_LT_OQ));
  if (c.by_fma && _mm256_movemask_ps(_mm256_or_ps(zero, in)) == 0xFF) return _mm256_blendv_ps(q1, q0, zero);
  return _mm256_div_ps(x, _mm256_set1_ps(c.d));
}
#endif

// q[i] = x[i] / c.d: quotient_v in the vector back ends (the tail of AVX2 by the divider), the
// divider in the reference. The same bits either way.
void divide_by(const float* __restrict x, float* __restrict q, std::size_t n, Divisor c) noexcept {
  std::size_t i = 0;
#if defined(MIXPREC_OPTIM_AVX512)
  for (; i < n; i += 16) {
    const auto k = static_cast<__mmask16>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(q + i, k, quotient_v(_mm512_maskz_loadu_ps(k, x + i), c));  // masked lanes: 0
  }
#elif defined(MIXPREC_OPTIM_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(q + i, quotient_v(_mm256_loadu_ps(x + i), c));
#endif
  for (; i < n; ++i) q[i] = x[i] / c.d;
}

void divide(const float* x, float* q, std::size_t n, float d) noexcept {
  divide_by(x, q, n, mixprec::optim_detail::divisor(d));
}

// ---- torch's Adam/AdamW ---------------------------------------------------------------------
// How the step divides sqrt(v) by bc2_sqrt:
// - kBc2One: bc2_sqrt == 1 (sqrt(1 - beta2^t) rounds to 1 once beta2^t < 2^-24: beta2 = 0.999
//   after about 16,600 steps, 0.95 after about 325): sqrt(v) itself, the same bits.
// - kByFma (vector back ends, bc2_sqrt in [2^-30, 1], so that 1 / bc2_sqrt <= 2^30): the FMA
//   quotient (Divisor) with no range test: a finite v >= 0 has sqrt(v) = 0 or in [2^-75, 2^64],
//   so sqrt(v) * r lies in [2^-75, 2^94], inside the FMAs' range; for 0, inf and NaN, q0 =
//   sqrt(v) * r already is the quotient's bits (0 keeps its sign, NaN its payload).
// - kDivide: the divider (the reference, and any other bc2_sqrt).
enum Quot : int { kBc2One, kByFma, kDivide };

inline Quot quot_of(const AdamScalars& s) noexcept {
  if (s.bc2_sqrt.d == 1.0f) return kBc2One;
  return kQuotientsByFma && s.bc2_sqrt.by_fma && s.bc2_sqrt.d >= 0x1p-30f ? kByFma : kDivide;
}

// The new m and v of one element (gi the gradient after unscale and clip, p the weight as read):
// the whole of the per-tensor first pass, the first half of adam_element.
template <bool L2, bool LerpLow>
inline void adam_moments_element(float gi, float p, float& m, float& v, const AdamScalars& s) noexcept {
  if constexpr (L2) gi = gi + s.weight_decay * p;
  float mi = m;
  if constexpr (LerpLow) mi = mi + s.weight * (gi - mi);
  else mi = gi - (gi - mi) * s.one_minus_weight;
  float vi = v * s.beta2;
  vi = vi + (s.one_minus_beta2 * gi) * gi;
  m = mi;
  v = vi;
}

// One element of the step: p, m, v updated.
template <bool L2, bool Decoupled, bool LerpLow, int Q>
inline void adam_element(float gi, float& p, float& m, float& v, const AdamScalars& s) noexcept {
  float pi = p, mi = m, vi = v;
  adam_moments_element<L2, LerpLow>(gi, pi, mi, vi, s);
  if constexpr (Decoupled) pi = pi * s.decay_mul;
  const float root = std::sqrt(vi);
  float d;
  if constexpr (Q == kBc2One) {
    d = root;
  } else if constexpr (Q == kByFma) {
    const float q0 = root * s.bc2_sqrt.r;
    const float q1 = std::fma(std::fma(-q0, s.bc2_sqrt.d, root), s.bc2_sqrt.r, q0);
    d = ((root > 0.0f) & (root < std::numeric_limits<float>::infinity())) ? q1 : q0;
  } else {
    d = root / s.bc2_sqrt.d;
  }
  pi = pi + s.neg_step_size * (mi / (d + s.eps));
  m = mi;
  v = vi;
  p = pi;
}

template <bool L2, bool Decoupled, bool LerpLow, int Q>
inline void adam_block(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                       std::size_t n, float pre, float clip, const AdamScalars& s) noexcept {
  const AdamScalars c = s;  // a local copy: no store below can alias it
  for (std::size_t i = 0; i < n; ++i) adam_element<L2, Decoupled, LerpLow, Q>((g[i] * pre) * clip, p[i], m[i], v[i], c);
}

// Blocks of one cache line per stream, each stream prefetched 4 KiB ahead: the step is
// bound by memory, and one core alone keeps too few misses in flight (with the AVX-512
// loops, ~14 -> 17.3-17.9 GB/s of the 28 bytes a parameter on one thread; docs/performance.md).
// The prefetches change no value: every back end still gives the reference's bits.
template <bool L2, bool Decoupled, bool LerpLow, int Q>
void adam_loop(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
               const AdamScalars& s) noexcept {
  constexpr std::size_t kBlock = 16, kAhead = 1024;  // elements: one line, 4 KiB
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    __builtin_prefetch(p + i + kAhead, 1);
    __builtin_prefetch(m + i + kAhead, 1);
    __builtin_prefetch(v + i + kAhead, 1);
    __builtin_prefetch(g + i + kAhead, 0);
    adam_block<L2, Decoupled, LerpLow, Q>(p + i, m + i, v + i, g + i, kBlock, pre, clip, s);
  }
  adam_block<L2, Decoupled, LerpLow, Q>(p + i, m + i, v + i, g + i, n - i, pre, clip, s);
}

template <int Q>
void adam_variant(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
                  const AdamScalars& s) noexcept {
  const int k = (s.l2 ? 4 : 0) | (s.decoupled ? 2 : 0) | (s.lerp_low ? 1 : 0);
  switch (k) {
    case 0: return adam_loop<false, false, false, Q>(p, m, v, g, n, pre, clip, s);
    case 1: return adam_loop<false, false, true, Q>(p, m, v, g, n, pre, clip, s);
    case 2: return adam_loop<false, true, false, Q>(p, m, v, g, n, pre, clip, s);
    case 3: return adam_loop<false, true, true, Q>(p, m, v, g, n, pre, clip, s);
    case 4: return adam_loop<true, false, false, Q>(p, m, v, g, n, pre, clip, s);
    case 5: return adam_loop<true, false, true, Q>(p, m, v, g, n, pre, clip, s);
    case 6: return adam_loop<true, true, false, Q>(p, m, v, g, n, pre, clip, s);
    default: return adam_loop<true, true, true, Q>(p, m, v, g, n, pre, clip, s);
  }
}

void adam(float* p, float* m, float* v, const float* g, std::size_t n, float pre, float clip,
          const AdamScalars& s) noexcept {
  switch (quot_of(s)) {
    case kBc2One: return adam_variant<kBc2One>(p, m, v, g, n, pre, clip, s);
    case kByFma: return adam_variant<kByFma>(p, m, v, g, n, pre, clip, s);
    default: return adam_variant<kDivide>(p, m, v, g, n, pre, clip, s);
  }
}

// The remainder master with bf16 gradients in one pass: the gradient decoded (bf16 bits << 16,
// times gscale: the bf16 decode of the formats), the master joined from its bf16 weight and
// remainder, adam_element, the master split back (state_format.hpp's join_master and
// split_master): adam's bits, without the three passes over buffers around it.
template <bool L2, bool Decoupled, bool LerpLow, int Q>
inline void adam_remainder_block(std::uint16_t* __restrict w, std::int16_t* __restrict r, float* __restrict m,
                                 float* __restrict v, const std::uint16_t* __restrict g, std::size_t n, float gscale,
                                 float clip, const AdamScalars& c) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float gd = std::bit_cast<float>(static_cast<std::uint32_t>(g[i]) << 16) * gscale;
    const std::uint32_t hi = static_cast<std::uint32_t>(w[i]) - (r[i] < 0 ? 1u : 0u);
    float p = std::bit_cast<float>(((hi & 0xFFFFu) << 16) | static_cast<std::uint16_t>(r[i]));
    adam_element<L2, Decoupled, LerpLow, Q>(gd * clip, p, m[i], v[i], c);
    const std::uint32_t b = std::bit_cast<std::uint32_t>(p);
    const auto rem = static_cast<std::int16_t>(static_cast<std::uint16_t>(b & 0xFFFFu));
    w[i] = static_cast<std::uint16_t>((b >> 16) + (rem < 0 ? 1u : 0u));
    r[i] = rem;
  }
}

// As adam_loop: a cache line of the fp32 moments at a time, each prefetched 4 KiB ahead (fp32
// moments are updated in place; the caller prefetches the 16-bit streams).
template <bool L2, bool Decoupled, bool LerpLow, int Q>
void adam_remainder_loop(std::uint16_t* w, std::int16_t* r, float* m, float* v, const std::uint16_t* g, std::size_t n,
                         float gscale, float clip, const AdamScalars& s) noexcept {
  constexpr std::size_t kBlock = 16, kAhead = 1024;
  const AdamScalars c = s;  // a local copy: no store below can alias it
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    __builtin_prefetch(m + i + kAhead, 1);
    __builtin_prefetch(v + i + kAhead, 1);
    adam_remainder_block<L2, Decoupled, LerpLow, Q>(w + i, r + i, m + i, v + i, g + i, kBlock, gscale, clip, c);
  }
  adam_remainder_block<L2, Decoupled, LerpLow, Q>(w + i, r + i, m + i, v + i, g + i, n - i, gscale, clip, c);
}

template <int Q>
void adam_remainder_variant(std::uint16_t* w, std::int16_t* r, float* m, float* v, const std::uint16_t* g, std::size_t n,
                            float gscale, float clip, const AdamScalars& s) noexcept {
  const int k = (s.l2 ? 4 : 0) | (s.decoupled ? 2 : 0) | (s.lerp_low ? 1 : 0);
  switch (k) {
    case 0: return adam_remainder_loop<false, false, false, Q>(w, r, m, v, g, n, gscale, clip, s);
    case 1: return adam_remainder_loop<false, false, true, Q>(w, r, m, v, g, n, gscale, clip, s);
    case 2: return adam_remainder_loop<false, true, false, Q>(w, r, m, v, g, n, gscale, clip, s);
    case 3: return adam_remainder_loop<false, true, true, Q>(w, r, m, v, g, n, gscale, clip, s);
    case 4: return adam_remainder_loop<true, false, false, Q>(w, r, m, v, g, n, gscale, clip, s);
    case 5: return adam_remainder_loop<true, false, true, Q>(w, r, m, v, g, n, gscale, clip, s);
    case 6: return adam_remainder_loop<true, true, false, Q>(w, r, m, v, g, n, gscale, clip, s);
    default: return adam_remainder_loop<true, true, true, Q>(w, r, m, v, g, n, gscale, clip, s);
  }
}

void adam_remainder(std::uint16_t* w, std::int16_t* r, float* m, float* v, const std::uint16_t* g, std::size_t n,
                    float gscale, float clip, const AdamScalars& s) noexcept {
  switch (quot_of(s)) {
    case kBc2One: return adam_remainder_variant<kBc2One>(w, r, m, v, g, n, gscale, clip, s);
    case kByFma: return adam_remainder_variant<kByFma>(w, r, m, v, g, n, gscale, clip, s);
    default: return adam_remainder_variant<kDivide>(w, r, m, v, g, n, gscale, clip, s);
  }
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
inline void torchao_moments_element(float gi, float p, float& m, float& v, const RuleScalars& s) noexcept {
  if (s.l2) gi = gi + s.weight_decay * p;  // l2 excludes decoupled: p is the weight as read
  m = lerp_torch(m, gi, s.w1, s.omw1, s.low1);
  v = lerp_torch(v, gi * gi, s.w2, s.omw2, s.low2);
}
void adam_torchao(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                  std::size_t n, float pre, float clip, const RuleScalars& s) noexcept {
  float root[16], d[16], mb[16];
  for (std::size_t b = 0; b < n; b += 16) {
    const std::size_t k = n - b < 16 ? n - b : 16;
    for (std::size_t i = b; i < b + k; ++i) {
      torchao_moments_element((g[i] * pre) * clip, p[i], m[i], v[i], s);
      root[i - b] = std::sqrt(v[i]);
    }
    divide_by(root, d, k, s.sqrt_bc2);
    divide_by(m + b, mb, k, s.bc1);
    for (std::size_t i = b; i < b + k; ++i) {
      float pi = p[i];
      if (s.decoupled) pi = pi - s.decay * pi;
      p[i] = pi - (s.lr * mb[i - b]) / (d[i - b] + s.eps);
    }
  }
}

// Transformer Engine's FusedAdam kernel (multi_tensor_adam.cu, AdamFunctor), without FMA:
//   Adam (L2): g = g + wd * p
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + ((1 - beta2) * g) * g
//   denom = sqrt(v / bc2) + eps;  update = (m / bc1) / denom  (+ wd * p for AdamW);  p = p - lr * update
inline void te_moments_element(float gi, float p, float& m, float& v, const RuleScalars& s) noexcept {
  if (s.l2) gi = gi + s.weight_decay * p;
  m = s.beta1 * m + s.one_minus_beta1 * gi;
  v = s.beta2 * v + (s.one_minus_beta2 * gi) * gi;
}
void adam_te(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
             std::size_t n, float pre, float clip, const RuleScalars& s) noexcept {
  float vb[16], mb[16];
  for (std::size_t b = 0; b < n; b += 16) {
    const std::size_t k = n - b < 16 ? n - b : 16;
    for (std::size_t i = b; i < b + k; ++i) te_moments_element((g[i] * pre) * clip, p[i], m[i], v[i], s);
    divide_by(v + b, vb, k, s.bc2);
    divide_by(m + b, mb, k, s.bc1);
    for (std::size_t i = b; i < b + k; ++i) {
      const float pi = p[i];
      float update = mb[i - b] / (std::sqrt(vb[i - b]) + s.eps);
      if (s.decoupled) update = update + s.decay * pi;
      p[i] = pi - s.lr * update;
    }
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
    adam, adam_torchao, adam_te, sgd, scale, divide, sr_bits,
    adam_moments, adam_moments_torchao, adam_moments_te,
    join_master, split_master, adam_remainder, round_bf16_stochastic,
    encode_fp8_blocks, encode_fp8_scaled, encode_map_blocks, decode_fp8_blocks,
    decode_map_blocks};

}  // namespace MIXPREC_OPTIM_NS
