// Precision presets (include/mixprec/nn/precision.hpp, docs/training.md).
#include "mixprec/nn/precision.hpp"

namespace mixprec::nn {

std::string_view precision_name(Precision p) noexcept {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::fp16: return "fp16";
    case Precision::bf16: return "bf16";
    case Precision::fp16_pure: return "fp16-pure";
  }
  return "?";
}

const std::vector<std::string>& precision_names() {
  static const std::vector<std::string> names{"fp32", "fp16", "bf16", "fp16-pure"};
  return names;
}

std::optional<Precision> parse_precision(std::string_view s) noexcept {
  for (Precision p : {Precision::fp32, Precision::fp16, Precision::bf16, Precision::fp16_pure}) {
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
  }
  return {};
}

}  // namespace mixprec::nn
