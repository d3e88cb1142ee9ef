// The torchao flavour of the MX and NVFP4 scales (lowp/kernels.hpp states each rule).
// The element pass is the same as TE's (the product x * factor, round to nearest even,
// saturating): torchao's divisions by a power-of-two scale equal products with its exact
// reciprocal, and its clamp-then-cast equals the saturating cast.
#include <bit>
#include <cmath>
#include <limits>

#include "lowp/kernels.hpp"

namespace mixprec::lowp::detail {

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ceil(log2(d)) exactly for a finite d > 0 (torchao computes it with an fp32 log2, which can
// round just-above-a-power-of-two values down: docs/low_precision.md).
int ceil_log2(float d) noexcept {
  int k;
  const float m = std::frexp(d, &k);  // d = m * 2^k, m in [0.5, 1)
  return m == 0.5f ? k - 1 : k;
}

// NaN-propagating clamp, as torch.clamp.
float clamp_keep_nan(float v, float lo, float hi) noexcept {
  if (std::isnan(v)) return v;
  return v < lo ? lo : (v > hi ? hi : v);
}

}  // namespace

BlockScale torchao_mx_scale(const QuantizeConfig& c, float amax) noexcept {
  if (c.scale_rounding == ScaleRounding::rceil) {
    const float d = amax / max_finite(c.element);
    if (std::isnan(d)) return {kNaN, 1.0f, 0xFF};
    if (std::isinf(d)) return {0x1p-127f, 1.0f, 0xFE};
    int e = d == 0.0f ? -127 : ceil_log2(d);
    e = e < -127 ? -127 : (e > 127 ? 127 : e);
    const int code = e + 127;
    return {code == 0 ? 1.0f : std::ldexp(1.0f, 127 - code), 1.0f, static_cast<std::uint8_t>(code)};
  }
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(amax);
  int unbiased = static_cast<int>((bits >> 23) & 0xFFu) - 127 - max_exponent(c.element);
  unbiased = unbiased < -127 ? -127 : (unbiased > 128 ? 128 : unbiased);
  const std::uint32_t code = std::isnan(amax) ? 0xFFu : static_cast<std::uint32_t>(unbiased + 127);
  float scale = std::bit_cast<float>(code << 23);  // 0xFF: +inf
  if (scale < 0x1p-126f) scale = 0x1p-126f;
  return {1.0f / scale, 1.0f, static_cast<std::uint8_t>(code)};
}

void torchao_nvfp4_scale(float amax, float tensor_scale, std::uint8_t& code, float& factor) noexcept {
  const float block_scale = amax / max_finite(Element::e2m1);
  const float s = clamp_keep_nan(block_scale / tensor_scale, 0x1p-6f, max_finite(Element::e4m3));
  code = static_cast<std::uint8_t>(
      mixprec::detail::encode_full<mixprec::detail::kE4M3Spec>(s, {Overflow::saturate, Subnormals::keep}, false, 0).code);
  const float sf = mixprec::detail::decode<mixprec::detail::kE4M3Spec>(code, Subnormals::keep);
  factor = (1.0f / tensor_scale) / sf;
}

float torchao_nvfp4_dequantize_one(float element, std::uint8_t scale_code, float tensor_scale) noexcept {
  return element * (tensor_scale * mixprec::detail::decode<mixprec::detail::kE4M3Spec>(scale_code, Subnormals::keep));
}

}  // namespace mixprec::lowp::detail
