// FP8 quantize / dequantize (include/mixprec/fp8/quantize.hpp): the public functions
// validate on the host and run the dispatched kernels (formats' AVX2 or scalar back end,
// chosen once); fp8::reference holds the plain element loops they are tested against.
#include "mixprec/fp8/quantize.hpp"

#include "mixprec/formats/kernel_table.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace mixprec::fp8 {

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

void check_scale(float s, const char* what) {
  if (!(std::isfinite(s) && s > 0.0f))
    fail(std::string(what).append(": the scale must be finite and > 0"));
}

void check_sizes(std::size_t a, std::size_t b, const char* what) {
  if (a != b)
    fail(std::string(what).append(": spans of different lengths (").append(std::to_string(a)).append(" and ")
             .append(std::to_string(b)).append(")"));
}

constexpr EncodeMode kSaturate{Overflow::saturate, Subnormals::keep};

void check_mx_quantize(std::size_t n, std::size_t dst_n, std::size_t scales_n, MxRounding rounding) {
  check_sizes(n, dst_n, "fp8::mx_quantize");
  check_sizes(mx_blocks(n), scales_n, "fp8::mx_quantize (scales vs ceil(n / 32))");
  if (rounding != MxRounding::transformer_engine && rounding != MxRounding::ocp)
    fail("fp8::mx_quantize: unknown rounding");
}

void check_mx_dequantize(std::size_t n, std::size_t dst_n, std::size_t scales_n) {
  check_sizes(n, dst_n, "fp8::mx_dequantize");
  check_sizes(mx_blocks(n), scales_n, "fp8::mx_dequantize (scales vs ceil(n / 32))");
}

// amax over [p, p + n) as ordered bit patterns of |x|: NaN patterns lie above inf.
// Returns the magnitude bits of the largest; a NaN maps to the canonical quiet NaN.
std::uint32_t amax_bits(const float* p, std::size_t n) noexcept {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = std::bit_cast<std::uint32_t>(p[i]) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m > 0x7f800000u ? 0x7fc00000u : m;
}

// TE's block amax: fmaxf over |x| from 0, so NaN elements are ignored.
float amax_ignoring_nan(const float* p, std::size_t n) noexcept {
  float m = 0.0f;
  for (std::size_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs(p[i]));
  return m;
}

template <Fp8Type T>
T nan_code() noexcept {
  return encode<T>(std::numeric_limits<float>::quiet_NaN());
}

}  // namespace

namespace {

const KernelTable& kernels() {
  static const KernelTable* table = kernel_table(active_isa());
  return *table;
}

template <Fp8Type T>
const FormatKernels& format_kernels() {
  return kernels().get<T>();
}

std::uint32_t canonical_amax_bits(std::uint32_t m) noexcept { return m > 0x7f800000u ? 0x7fc00000u : m; }

}  // namespace

float amax(std::span<const float> src) noexcept {
  return std::bit_cast<float>(canonical_amax_bits(kernels().amax.amax_bits(src.data(), src.size())));
}

template <Fp8Type T>
float quantize(std::span<const float> src, std::span<T> dst, float scale) {
  check_sizes(src.size(), dst.size(), "fp8::quantize");
  check_scale(scale, "fp8::quantize");
  const ConvertOptions o{Overflow::saturate, Subnormals::keep, scale};
  return std::bit_cast<float>(
      canonical_amax_bits(format_kernels<T>().encode_amax(src.data(), dst.data(), src.size(), o)));
}

template <Fp8Type T>
void dequantize(std::span<const T> src, std::span<float> dst, float scale_inv) {
  check_sizes(src.size(), dst.size(), "fp8::dequantize");
  check_scale(scale_inv, "fp8::dequantize");
  format_kernels<T>().decode(src.data(), dst.data(), src.size(), ConvertOptions{Overflow::ieee, Subnormals::keep, scale_inv});
}

template <Fp8Type T>
CurrentQuantized quantize_current(std::span<const float> src, std::span<T> dst, bool power_of_2_scales,
                                  float amax_epsilon) {
  check_sizes(src.size(), dst.size(), "fp8::quantize_current");
  if (!(std::isfinite(amax_epsilon) && amax_epsilon >= 0.0f))
    fail("fp8::quantize_current: amax_epsilon must be finite and >= 0");
  CurrentQuantized r;
  r.amax = amax(src);
  r.scale = current_scale(r.amax, max_finite(dtype_of<T>()), power_of_2_scales, amax_epsilon);
  r.scale_inv = 1.0f / r.scale;
  quantize<T>(src, dst, r.scale);
  return r;
}

// MX in chunks of kChunkBlocks blocks: the block amaxes (one SIMD pass), the E8M0 scales
// and factors (one per 32 values; TE's rule inline), then the block-scaled encode of the chunk,
// which reads it again from L1. Blocks with the NaN scale get NaN codes afterwards.
template <Fp8Type T>
float mx_quantize(std::span<const float> src, std::span<T> dst, std::span<e8m0> scales, MxRounding rounding) {
  check_mx_quantize(src.size(), dst.size(), scales.size(), rounding);
  constexpr std::size_t kChunkBlocks = 64;
  const KernelTable& k = kernels();
  const FormatKernels& f = k.get<T>();
  const ConvertOptions o{Overflow::saturate, Subnormals::keep, 1.0f};
  std::uint32_t bits[kChunkBlocks];
  float ignoring_nan[kChunkBlocks], factors[kChunkBlocks];
  std::uint32_t total = 0;
  const std::size_t n = src.size();
  for (std::size_t begin = 0; begin < n; begin += kChunkBlocks * kMxBlock) {
    const std::size_t len = std::min(n - begin, kChunkBlocks * kMxBlock);
    const std::size_t nb = mx_blocks(len);
    const std::size_t b0 = begin / kMxBlock;
    k.amax.block_amax(src.data() + begin, len, kMxBlock, bits, ignoring_nan);
    bool any_nan_scale = false;
    for (std::size_t b = 0; b < nb; ++b) total = bits[b] > total ? bits[b] : total;
    if (rounding == MxRounding::transformer_engine) {
      // TE's rule inline (mx_scale's own code), the reciprocal taken once per call.
      const float rcp = mx_max_norm_rcp(max_finite(dtype_of<T>()));
      for (std::size_t b = 0; b < nb; ++b) {
        const std::uint8_t code = mx_scale_code_te(ignoring_nan[b], rcp);
        scales[b0 + b] = e8m0::from_bits(code);
        any_nan_scale = any_nan_scale || code == 0xFF;
        factors[b] = code == 0xFF ? 1.0f : mx_factor_te(code);
      }
    } else {
      for (std::size_t b = 0; b < nb; ++b) {
        const e8m0 scale = mx_scale(std::bit_cast<float>(canonical_amax_bits(bits[b])), dtype_of<T>(), rounding);
        scales[b0 + b] = scale;
        any_nan_scale = any_nan_scale || scale.bits() == 0xFF;
        factors[b] = scale.bits() == 0xFF ? 1.0f : mx_quantize_factor(scale, rounding);
      }
    }
    f.encode_block_scaled(src.data() + begin, dst.data() + begin, len, kMxBlock, factors, o);
    for (std::size_t b = 0; any_nan_scale && b < nb; ++b) {
      if (scales[b0 + b].bits() != 0xFF) continue;
      const std::size_t e = std::min(len, (b + 1) * kMxBlock);
      for (std::size_t i = b * kMxBlock; i < e; ++i) dst[begin + i] = nan_code<T>();
    }
  }
  return std::bit_cast<float>(canonical_amax_bits(total));
}

// Decoded value times float(scale): the same fp32 product as the reference. A NaN scale
// block goes through the reference loop so that NaN signs follow its operand order.
template <Fp8Type T>
void mx_dequantize(std::span<const T> src, std::span<const e8m0> scales, std::span<float> dst) {
  check_mx_dequantize(src.size(), dst.size(), scales.size());
  constexpr std::size_t kChunkBlocks = 64;
  const FormatKernels& f = format_kernels<T>();
  const ConvertOptions o{Overflow::ieee, Subnormals::keep, 1.0f};
  float factors[kChunkBlocks];
  const std::size_t n = src.size();
  for (std::size_t begin = 0; begin < n; begin += kChunkBlocks * kMxBlock) {
    const std::size_t len = std::min(n - begin, kChunkBlocks * kMxBlock);
    const std::size_t nb = mx_blocks(len), b0 = begin / kMxBlock;
    bool any_nan_scale = false;
    for (std::size_t b = 0; b < nb; ++b) {
      factors[b] = static_cast<float>(scales[b0 + b]);
      any_nan_scale = any_nan_scale || scales[b0 + b].bits() == 0xFF;
    }
    f.decode_block_scaled(src.data() + begin, dst.data() + begin, len, kMxBlock, factors, o);
    for (std::size_t b = 0; any_nan_scale && b < nb; ++b) {
      if (scales[b0 + b].bits() != 0xFF) continue;
      const std::size_t e = std::min(len, (b + 1) * kMxBlock);
      for (std::size_t i = b * kMxBlock; i < e; ++i) dst[begin + i] = decode(src[begin + i]) * factors[b];
    }
  }
}

namespace reference {

float amax(std::span<const float> src) noexcept {
  return std::bit_cast<float>(amax_bits(src.data(), src.size()));
}

template <Fp8Type T>
float quantize(std::span<const float> src, std::span<T> dst, float scale) {
  check_sizes(src.size(), dst.size(), "fp8::quantize");
  check_scale(scale, "fp8::quantize");
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < src.size(); ++i) {
    const float x = src[i];
    const std::uint32_t a = std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
    m = a > m ? a : m;
    dst[i] = encode<T>(x * scale, kSaturate);
  }
  return std::bit_cast<float>(m > 0x7f800000u ? 0x7fc00000u : m);
}

template <Fp8Type T>
void dequantize(std::span<const T> src, std::span<float> dst, float scale_inv) {
  check_sizes(src.size(), dst.size(), "fp8::dequantize");
  check_scale(scale_inv, "fp8::dequantize");
  for (std::size_t i = 0; i < src.size(); ++i) dst[i] = decode(src[i]) * scale_inv;
}

template <Fp8Type T>
float mx_quantize(std::span<const float> src, std::span<T> dst, std::span<e8m0> scales, MxRounding rounding) {
  check_mx_quantize(src.size(), dst.size(), scales.size(), rounding);
  const std::size_t n = src.size();
  std::uint32_t total = 0;
  for (std::size_t b = 0; b * kMxBlock < n; ++b) {
    const std::size_t begin = b * kMxBlock;
    const std::size_t len = n - begin < kMxBlock ? n - begin : kMxBlock;
    const float* p = src.data() + begin;
    const std::uint32_t block_bits = amax_bits(p, len);
    total = block_bits > total ? block_bits : total;
    const float block_amax = rounding == MxRounding::transformer_engine ? amax_ignoring_nan(p, len)
                                                                       : std::bit_cast<float>(block_bits);
    const e8m0 scale = mx_scale(block_amax, dtype_of<T>(), rounding);
    scales[b] = scale;
    if (scale.bits() == 0xFF) {  // NaN scale: the whole block is NaN
      for (std::size_t i = 0; i < len; ++i) dst[begin + i] = nan_code<T>();
      continue;
    }
    const float factor = mx_quantize_factor(scale, rounding);
    for (std::size_t i = 0; i < len; ++i) dst[begin + i] = encode<T>(p[i] * factor, kSaturate);
  }
  return std::bit_cast<float>(total);
}

template <Fp8Type T>
void mx_dequantize(std::span<const T> src, std::span<const e8m0> scales, std::span<float> dst) {
  check_mx_dequantize(src.size(), dst.size(), scales.size());
  for (std::size_t i = 0; i < src.size(); ++i)
    dst[i] = decode(src[i]) * static_cast<float>(scales[i / kMxBlock]);
}

}  // namespace reference

#define MIXPREC_FP8_INSTANTIATE(T)                                                                      \
  template float quantize<T>(std::span<const float>, std::span<T>, float);                              \
  template void dequantize<T>(std::span<const T>, std::span<float>, float);                             \
  template CurrentQuantized quantize_current<T>(std::span<const float>, std::span<T>, bool, float);     \
  template float mx_quantize<T>(std::span<const float>, std::span<T>, std::span<e8m0>, MxRounding);     \
  template void mx_dequantize<T>(std::span<const T>, std::span<const e8m0>, std::span<float>);
MIXPREC_FP8_INSTANTIATE(f8e4m3)
MIXPREC_FP8_INSTANTIATE(f8e5m2)
namespace reference {
#define MIXPREC_FP8_REFERENCE(T)                                                                        \
  template float quantize<T>(std::span<const float>, std::span<T>, float);                              \
  template void dequantize<T>(std::span<const T>, std::span<float>, float);                             \
  template float mx_quantize<T>(std::span<const float>, std::span<T>, std::span<e8m0>, MxRounding);     \
  template void mx_dequantize<T>(std::span<const T>, std::span<const e8m0>, std::span<float>);
MIXPREC_FP8_REFERENCE(f8e4m3)
MIXPREC_FP8_REFERENCE(f8e5m2)
#undef MIXPREC_FP8_REFERENCE
}  // namespace reference
#undef MIXPREC_FP8_INSTANTIATE

}  // namespace mixprec::fp8
