// Private: the kernel table behind lowp::quantize (scalar reference back end, AVX2,
// AVX-512), and the scalar element rules that the reference, the scalar back end and
// the SIMD tails share.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/scalar.hpp"
#include "mixprec/lowp/quantize.hpp"

namespace mixprec::lowp::detail {

// E2M1 as a small float: 1 sign, 2 exponent (bias 1), 1 mantissa bit; no inf, no NaN;
// codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6. Its nan_code 0x8 lies outside the 3 magnitude
// bits, so decode never reads a NaN; encoders map NaN to 0 before encode_full.
inline constexpr mixprec::detail::MiniFloatSpec kE2M1Spec{4, 1, 1, false, 0x7, 0x7, 0x8};

// Counters the encode kernels add to (see lowp::Counts).
struct EncodeCounts {
  std::uint64_t saturated = 0;
  std::uint64_t flushed = 0;
  std::uint64_t nonfinite = 0;
  std::uint64_t zeros = 0;  // inputs equal to +-0 (lowp::Counts::nonzero = elements - zeros)

  EncodeCounts& operator+=(const EncodeCounts& o) noexcept {
    saturated += o.saturated;
    flushed += o.flushed;
    nonfinite += o.nonfinite;
    zeros += o.zeros;
    return *this;
  }
};

struct ElementSpec {
  const mixprec::detail::MiniFloatSpec* spec;
  float max_value;          // largest finite: 448, 57344, 6
  std::uint32_t mag_mask;   // magnitude bits of a code
};
ElementSpec element_spec(Element e) noexcept;

// One element: y = x * factor (fp32 product) encoded with round to nearest even (or
// stochastically from `random`), saturating (Overflow::saturate), subnormals kept; E2M1
// maps NaN to code 0 (TE's reference cast). Counts are taken against the unscaled x.
template <const mixprec::detail::MiniFloatSpec& S>
inline std::uint32_t encode_element(float x, float factor, bool stochastic, std::uint32_t random, float max_value,
                                    EncodeCounts& c) noexcept {
  const float y = x * factor;
  const std::uint32_t ax = std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
  const std::uint32_t ay = std::bit_cast<std::uint32_t>(y) & 0x7fffffffu;
  std::uint32_t code;
  if (S.bits == 4 && ay > 0x7f800000u) {
    code = 0;
  } else {
    code = mixprec::detail::encode_full<S>(y, {Overflow::saturate, Subnormals::keep}, stochastic, random).code;
  }
  constexpr std::uint32_t kMag = (1u << (S.bits - 1)) - 1;
  if (ax >= 0x7f800000u) {
    ++c.nonfinite;
  } else {
    if (ay <= 0x7f800000u && std::bit_cast<float>(ay) > max_value) ++c.saturated;
    if (ax != 0 && (code & kMag) == 0) ++c.flushed;
    if (ax == 0) ++c.zeros;
  }
  return code;
}

// Elements [begin, end) of a run through encode_element, element i scaled by
// factors[i / block] (kStochastic: with random[i]): the code of element i into byte i (fp8)
// or nibble i (e2m1: byte i / 2, the even element in the low nibble, so begin is even),
// counts into c, and (kAmax) the magnitude bits of src[i] into max_bits. The scalar back
// end's loop, and the SIMD back ends' tails.
template <const mixprec::detail::MiniFloatSpec& S, bool kStochastic, bool kAmax>
inline void encode_elements(const float* src, std::size_t begin, std::size_t end, std::size_t block,
                            const float* factors, std::uint8_t* dst, const std::uint32_t* random, float max_value,
                            EncodeCounts& c, std::uint32_t& max_bits) noexcept {
  for (std::size_t i = begin; i < end; ++i) {
    if constexpr (kAmax) {
      const std::uint32_t a = std::bit_cast<std::uint32_t>(src[i]) & 0x7fffffffu;
      max_bits = a > max_bits ? a : max_bits;
    }
    const std::uint32_t code = encode_element<S>(src[i], factors[i / block], kStochastic, kStochastic ? random[i] : 0u,
                                                 max_value, c);
    if constexpr (S.bits == 4) {
      if (i % 2 == 0) dst[i / 2] = static_cast<std::uint8_t>(code);
      else dst[i / 2] = static_cast<std::uint8_t>(dst[i / 2] | (code << 4));
    } else {
      dst[i] = static_cast<std::uint8_t>(code);
    }
  }
}

// TE's block amax (fmaxf over |x| from 0: NaN elements ignored) and the magnitude-bits max
// (a NaN, whose bits lie above inf's, wins) of one block.
inline void block_amax_one(const float* p, std::size_t n, float& max_ignoring_nan, std::uint32_t& max_bits) noexcept {
  float m = 0.0f;
  std::uint32_t b = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = std::bit_cast<std::uint32_t>(p[i]) & 0x7fffffffu;
    b = a > b ? a : b;
    const float f = std::bit_cast<float>(a);
    m = f > m ? f : m;  // false for NaN
  }
  max_ignoring_nan = m;
  max_bits = b;
}

// max_ignoring_nan of each block from its max_bits (block_amax_one's two results): for a block
// without NaN the same number (magnitudes at most inf's compare as unsigned bits as they do as
// floats); a block holding a NaN is read again by block_amax_one. The SIMD back ends take the
// bits alone and derive the float max this way: one max per vector instead of two.
inline void max_ignoring_nan_from_bits(const float* src, std::size_t n, std::size_t block, const std::uint32_t* max_bits,
                                       float* max_ignoring_nan) noexcept {
  for (std::size_t b = 0; b * block < n; ++b) {
    if (max_bits[b] <= 0x7f800000u) {
      max_ignoring_nan[b] = std::bit_cast<float>(max_bits[b]);
    } else {
      std::uint32_t unused;
      block_amax_one(src + b * block, n - b * block < block ? n - b * block : block, max_ignoring_nan[b], unused);
    }
  }
}

// min(v, FLT_MAX) keeping NaN (torch.min's rule, which TE's reference quantizer uses).
inline float min_flt_max(float v) noexcept { return v > kFltMax ? kFltMax : v; }

// The NVFP4 block scale (TE core_nvfp4.cuh, quantization_ref_nvfp4.py) from the block's
// amax (NaN-propagating), s_enc_div6 = S_enc * (1 / 6) and s_dec = 1 / S_enc:
//   code = e4m3(min(amax * s_enc_div6, FLT_MAX)) saturating (NaN -> 0x7F)
//   factor = min(1 / (float(code) * s_dec), FLT_MAX)
inline void nvfp4_scale_one(float amax, float s_enc_div6, float s_dec, std::uint8_t& code, float& factor) noexcept {
  const float v = min_flt_max(amax * s_enc_div6);
  code = static_cast<std::uint8_t>(
      mixprec::detail::encode_full<mixprec::detail::kE4M3Spec>(v, {Overflow::saturate, Subnormals::keep}, false, 0)
          .code);
  const float dec = mixprec::detail::decode<mixprec::detail::kE4M3Spec>(code, Subnormals::keep);
  factor = min_flt_max(1.0f / (dec * s_dec));
}

// The 16-point transform on one group: y = s * x (TE's sign vector), four butterfly
// stages (a, b) -> (a + b, a - b) at distances 1, 2, 4, 8, then y * 0.25.
inline constexpr float kRhtSigns[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
inline void rht16_one(float* v) noexcept {
  for (int i = 0; i < 16; ++i) v[i] = kRhtSigns[i] < 0 ? -v[i] : v[i];
  for (int h = 1; h < 16; h *= 2) {
    for (int i = 0; i < 16; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  for (int i = 0; i < 16; ++i) v[i] *= 0.25f;
}

// f(std::bool_constant<a>{}, std::bool_constant<b>{}): two run-time options of a kernel call
// (stochastic rounding, the fused amax) as template arguments of its loop, chosen once.
template <class F>
inline void with_options(bool a, bool b, F&& f) {
  if (a) {
    if (b) f(std::true_type{}, std::true_type{});
    else f(std::true_type{}, std::false_type{});
  } else {
    if (b) f(std::false_type{}, std::true_type{});
    else f(std::false_type{}, std::false_type{});
  }
}

// The format S of an encode loop as a type: SpecConstant<S>::value is S.
template <const mixprec::detail::MiniFloatSpec& S>
struct SpecConstant {
  static constexpr const mixprec::detail::MiniFloatSpec& value = S;
};

// f(SpecConstant<S>{}, max_finite(e)): the element format of a kernel call as the template
// argument of its loop, chosen once (the one Element -> spec switch of the encode kernels).
template <class F>
inline void with_element(Element e, F&& f) {
  switch (e) {
    case Element::e4m3: return f(SpecConstant<mixprec::detail::kE4M3Spec>{}, max_finite(Element::e4m3));
    case Element::e5m2: return f(SpecConstant<mixprec::detail::kE5M2Spec>{}, max_finite(Element::e5m2));
    case Element::e2m1: return f(SpecConstant<kE2M1Spec>{}, max_finite(Element::e2m1));
  }
}

// f(SpecConstant<S>{}, std::bool_constant<a>{}, std::bool_constant<b>{}, max_finite(e)): an
// encode call's element format and its two run-time options as template arguments of its
// loop, chosen once.
template <class F>
inline void with_element_options(Element e, bool a, bool b, F&& f) {
  with_element(e, [&](auto spec, float max_value) {
    with_options(a, b, [&](auto x, auto y) { f(spec, x, y, max_value); });
  });
}

// Kernels: pure loops over raw pointers; they never allocate, log or check arguments.
struct LowpKernels {
  Isa isa;
  // Per block of `block` elements (the last may be shorter): both maxima of block_amax_one;
  // max_ignoring_nan may be nullptr where only the bits are needed (nvfp4's scales, a tensor's
  // amax). The SIMD back ends take the bits and derive the float max from them
  // (max_ignoring_nan_from_bits).
  void (*block_amax)(const float* src, std::size_t n, std::size_t block, float* max_ignoring_nan,
                     std::uint32_t* max_bits);
  // Element i is encode_element(src[i], factors[i / block]) into format e: one byte per
  // element (fp8) or two per byte (e2m1: element i in byte i / 2, the even one in the low
  // nibble; an odd n leaves the last high nibble 0). random: nullptr, or n words. max_bits:
  // nullptr, or raised to the magnitude-bits max of src (block_amax_one's max_bits) in the same
  // pass, for a recipe that needs the input's amax but not before its codes (fp8-delayed):
  // one read of the input, whose loads then overlap the encode.
  void (*encode_scaled)(Element e, const float* src, std::size_t n, std::size_t block, const float* factors,
                        std::uint8_t* dst, const std::uint32_t* random, EncodeCounts* counts, std::uint32_t* max_bits);
  // nvfp4_scale_one for nblocks amaxes.
  void (*nvfp4_scales)(const float* amax, std::size_t nblocks, float s_enc_div6, float s_dec, std::uint8_t* codes,
                       float* factors);
  // rht16_one on consecutive groups of 16 of src into dst (n % 16 == 0); dst may be src.
  void (*rht16)(const float* src, float* dst, std::size_t n);
  // dst[c * rows + r] = src[r * cols + c]: a columnwise grid from its input and back (the
  // buffers do not overlap). Copies bits; the SIMD back ends move whole 16 x 16 (8 x 8) tiles
  // in registers, the edges as the scalar loop.
  void (*transpose)(const float* src, std::size_t rows, std::size_t cols, float* dst);
  // out[i] = splitmix64_word(seed, i) for i < n: lowp::random_words.
  void (*random_words)(std::uint64_t seed, std::uint32_t* out, std::size_t n);
};

// Word i of a splitmix64 stream from `seed` (state = seed + (i + 1) * golden, mixed), its top
// 32 bits: the reference of LowpKernels::random_words. The lanes of the SIMD back ends are
// independent words, so the stream is the same on every back end.
inline std::uint32_t splitmix64_word(std::uint64_t seed, std::uint64_t i) noexcept {
  std::uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<std::uint32_t>((z ^ (z >> 31)) >> 32);
}
inline void random_words_range(std::uint64_t seed, std::uint32_t* out, std::size_t begin, std::size_t end) noexcept {
  for (std::size_t i = begin; i < end; ++i) out[i] = splitmix64_word(seed, i);
}

// The scalar back end's transpose over rows [r0, r1) and columns [c0, c1), in tiles of 32 x 32
// so that both sides stay in cache; the SIMD back ends' edges.
inline void transpose_range(const float* src, std::size_t rows, std::size_t cols, float* dst, std::size_t r0,
                            std::size_t r1, std::size_t c0, std::size_t c1) noexcept {
  constexpr std::size_t kT = 32;
  for (std::size_t rt = r0; rt < r1; rt += kT) {
    for (std::size_t ct = c0; ct < c1; ct += kT) {
      const std::size_t re = rt + kT < r1 ? rt + kT : r1, ce = ct + kT < c1 ? ct + kT : c1;
      for (std::size_t r = rt; r < re; ++r) {
        for (std::size_t c = ct; c < ce; ++c) dst[c * rows + r] = src[r * cols + c];
      }
    }
  }
}

const LowpKernels& scalar_kernels() noexcept;
const LowpKernels* avx2_kernels() noexcept;    // nullptr when not compiled in
const LowpKernels* avx512_kernels() noexcept;  // nullptr when not compiled in
// The table of `isa` when available on this CPU, else nullptr (core/select_kernels.hpp).
const LowpKernels* lowp_kernels(Isa isa) noexcept;

// ---- shared by the driver (quantize.cpp), the reference and the torchao flavour ----

// Validates the call and sizes every field of the result (codes zero, scales 1 / 0); prepare
// reuses q's buffers.
Quantized make_result(std::size_t src_size, std::size_t rows, std::size_t cols, const QuantizeConfig& config,
                      std::size_t random_size);
void prepare(Quantized& q, std::size_t src_size, std::size_t rows, std::size_t cols, const QuantizeConfig& config,
             std::size_t random_size);
// The quantized grid's input into g: src copied, or transposed (k.transpose) for a columnwise layout.
void grid_input(const LowpKernels& k, std::span<const float> src, const Quantized& q, std::vector<float>& g);
// The multiplier of each scale block in dequantize (its scale_rows * scale_cols, into m).
void block_multipliers(const Quantized& q, std::vector<float>& m);
// Magnitude bits to the amax float: NaN patterns become the quiet NaN 0x7fc00000.
inline float canonical_amax(std::uint32_t bits) noexcept {
  return std::bit_cast<float>(bits > 0x7f800000u ? 0x7fc00000u : bits);
}

// The scale of one block from its amaxes (TE's NaN-ignoring max, the NaN-propagating bits).
struct BlockScale {
  float factor;       // what the elements are multiplied by before the cast (NaN: a NaN-scale block)
  float scale_inv;    // f32 scale formats
  std::uint8_t code;  // e8m0 scale formats
};
BlockScale fp8_block_scale(const QuantizeConfig& c, float max_ignoring_nan) noexcept;
// fp8_block_scale's factors and scale_inv for n blocks, the config read once and the blocks
// independent (the divisions overlap instead of waiting on each other in calls).
void fp8_block_scales(const QuantizeConfig& c, const float* max_ignoring_nan, std::size_t n, float* factors,
                      float* scale_inv) noexcept;
BlockScale mx_block_scale(const QuantizeConfig& c, float max_ignoring_nan, std::uint32_t max_bits) noexcept;
// mx_block_scale's factors and codes for n blocks (TE's rule inline, the config read once);
// true when a block has the NaN scale.
bool mx_block_scales(const QuantizeConfig& c, const float* max_ignoring_nan, const std::uint32_t* max_bits,
                     std::size_t n, float* factors, std::uint8_t* codes) noexcept;
// The canonical codes of a NaN-scale MX block: E4M3 0x7F, E5M2 0x7E, E2M1 0.
std::uint8_t nan_block_code(Element e) noexcept;

// The torchao flavour's scales (torchao 0.18 mx_tensor.py to_mx, nvfp4_tensor.py
// nvfp4_quantize; docs/low_precision.md lists each difference from TE's):
//   MX rceil: d = amax / elem_max; NaN -> 0xFF (factor NaN), inf -> 0xFE (factor 2^-127),
//             else code = clamp(ceil(log2 d), -127, 127) + 127 with log2 exact, factor 1 for
//             code 0, else 2^(127 - code);
//   MX floor: code = clamp(exponent field of amax - 127 - emax_elem, -127, 128) + 127 (NaN amax:
//             0xFF); factor = 1 / max(float(code << 23), 2^-126) (0 for the code 0xFF);
//   NVFP4:    tensor_scale = amax_tensor / 2688; s = clamp((amax_b / 6) / tensor_scale, 2^-6, 448)
//             (NaN stays NaN); code = e4m3(s); factor = (1 / tensor_scale) / float(code).
BlockScale torchao_mx_scale(const QuantizeConfig& c, float amax) noexcept;
void torchao_nvfp4_scale(float amax, float tensor_scale, std::uint8_t& code, float& factor) noexcept;
float torchao_nvfp4_dequantize_one(float element, std::uint8_t scale_code, float tensor_scale) noexcept;

// lowp::quantize with a given table (tests run every back end through the whole driver).
void quantize_with(const LowpKernels& k, std::span<const float> src, std::size_t rows, std::size_t cols,
                   const QuantizeConfig& config, std::span<const std::uint32_t> random, Quantized& out);
Quantized quantize_with(const LowpKernels& k, std::span<const float> src, std::size_t rows, std::size_t cols,
                        const QuantizeConfig& config, std::span<const std::uint32_t> random);

}  // namespace mixprec::lowp::detail
