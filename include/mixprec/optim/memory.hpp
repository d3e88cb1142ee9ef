// Memory accounting of a training step's persistent buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "mixprec/optim/optimizer.hpp"

namespace mixprec {

enum class PrecisionPreset : std::uint8_t { fp32, fp16, bf16, fp16_pure, bf16_pure };
std::string_view precision_name(PrecisionPreset p) noexcept;
std::optional<PrecisionPreset> parse_precision(std::string_view s) noexcept;  // fp32 fp16 bf16 fp16-pure bf16-pure

// Bytes of each buffer for param_count parameters.
//   fp32:            weights 4P (reported as master_weights), grads 4P, no model copy
//   fp16 / bf16:     master 4P, grads 4P (fp32, as the seed counts them), model copy 2P
//   *-pure:          no master, grads 2P, model copy (the weights) 2P
//   moments: sgd 0, sgd-momentum 4P, adam/adamw 8P (fp32 in every preset)
// Adam + fp16: 4P + 8P + 4P + 2P = 18P.
struct MemoryPlan {
  std::uint64_t params = 0;
  std::uint64_t master_weights = 0, moments = 0, gradients = 0, model_copy = 0, total = 0;
};

// Throws std::invalid_argument when the total does not fit in 64 bits.
MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, PrecisionPreset precision);

}  // namespace mixprec
