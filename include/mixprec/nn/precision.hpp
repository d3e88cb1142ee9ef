// The precision policy (the seeds' "autocast"): which format each kind of tensor
// is stored in during training. Every op computes in fp32 on values read from its
// inputs' storage format and rounds its output, once, to the activation format; so
// underflow and overflow happen at the same op boundaries as on a GPU that stores
// activations in fp16/bf16. The op-by-op table is in docs/training.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/core/dtype.hpp"

namespace mixprec::nn {

enum class Precision : std::uint8_t {
  fp32,       // everything fp32 (the baseline)
  fp16,       // mixed: fp16 activations and weight copy, fp32 master weights and weight gradients
  bf16,       // mixed: bf16 activations and weight copy, fp32 master weights and weight gradients
  fp16_pure,  // fp16 everywhere the model lives: weights (no master copy), weight gradients, activations
};

std::string_view precision_name(Precision p) noexcept;  // "fp32", "fp16", "bf16", "fp16-pure"
std::optional<Precision> parse_precision(std::string_view s) noexcept;
const std::vector<std::string>& precision_names();

struct PrecisionPolicy {
  DType activations = DType::f32;   // stored activations and activation gradients
  DType weights = DType::f32;       // the weights the forward pass reads (ParamStore model region)
  DType weight_grads = DType::f32;  // ParamStore grads region
  bool master = false;              // fp32 master weights that the optimizer updates

  bool low_precision() const noexcept { return activations != DType::f32; }
  friend bool operator==(const PrecisionPolicy&, const PrecisionPolicy&) = default;
};

PrecisionPolicy policy_of(Precision p) noexcept;

}  // namespace mixprec::nn
