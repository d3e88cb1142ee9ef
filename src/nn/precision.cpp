// Precision presets (include/mixprec/nn/precision.hpp, docs/training.md).
#include "mixprec/nn/precision.hpp"

namespace mixprec::nn {

std::string_view precision_name(Precision p) noexcept {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::fp16: return "fp16";
    case Precision::bf16: return "bf16";
    case Precision::fp16_pure: return "fp16-pure";
    case Precision::fp8_noscale: return "fp8-noscale";
    case Precision::fp8_delayed: return "fp8-delayed";
    case Precision::fp8_current: return "fp8-current";
    case Precision::mxfp8: return "mxfp8";
  }
  return "?";
}

const std::vector<std::string>& precision_names() {
  static const std::vector<std::string> names{"fp32", "fp16", "bf16", "fp16-pure", "fp8-noscale",
                                                "fp8-delayed", "fp8-current", "mxfp8"};
  return names;
}

std::optional<Precision> parse_precision(std::string_view s) noexcept {
  for (Precision p : {Precision::fp32, Precision::fp16, Precision::bf16, Precision::fp16_pure, Precision::fp8_noscale,
                      Precision::fp8_delayed, Precision::fp8_current, Precision::mxfp8}) {
    if (precision_name(p) == s) return p;
  }
  return std::nullopt;
}

PrecisionPolicy policy_of(Precision p) noexcept {
  switch (p) {
    case Precision::fp32: return {DType::f32, DType::f32, DType::f32, false};
    // Mixed presets are PyTorch AMP's arrangement: fp32 parameters (our master weights)
    // and fp32 .grad, low-precision weight copies and activations.
    case Precision::fp16: return {DType::f16, DType::f16, DType::f32, true};
    case Precision::bf16: return {DType::bf16, DType::bf16, DType::f32, true};
    case Precision::fp16_pure: return {DType::f16, DType::f16, DType::f16, false};
    // fp8 presets: the bf16 arrangement; only the Linear GEMM operands are fp8 (fp8_linear.hpp).
    case Precision::fp8_noscale:
    case Precision::fp8_delayed:
    case Precision::fp8_current:
    case Precision::mxfp8: return {DType::bf16, DType::bf16, DType::f32, true};
  }
  return {};
}

Fp8Recipe fp8_recipe_of(Precision p) noexcept {
  switch (p) {
    case Precision::fp8_noscale: return Fp8Recipe::noscale;
    case Precision::fp8_delayed: return Fp8Recipe::delayed;
    case Precision::fp8_current: return Fp8Recipe::current;
    case Precision::mxfp8: return Fp8Recipe::mx;
    default: return Fp8Recipe::none;
  }
}

bool is_fp8(Precision p) noexcept { return fp8_recipe_of(p) != Fp8Recipe::none; }

}  // namespace mixprec::nn
