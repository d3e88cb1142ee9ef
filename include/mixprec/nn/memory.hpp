// Memory accounting of a training step's persistent buffers, for any precision preset of
// the precision table (nn/precision.hpp): the planner reads the preset's storage policy.
#pragma once

#include <cstdint>

#include "mixprec/nn/precision.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/state_format.hpp"

namespace mixprec {

// Bytes of each buffer for param_count parameters, from the policy's formats:
//   weights updated in fp32 (fp32):  4P, reported as master_weights; no model copy
//   master weights (mixed, fp8):     master 4P, model copy the weights' format (2P)
//   no master (pure):                the weights in their format are the model copy (2P)
//   gradients:                       the weight-gradient format (4P fp32, 2P in the pure presets)
//   moments: sgd 0, sgd-momentum 4P, adam/adamw 8P (fp32), or the chosen StateFormats:
//            bf16 2P each, fp8 and 8bit P + a 4-byte scale per block, 4bit P/2 + scales
//   master weights under StateFormats: fp32 4P, remainder 2P (bf16 weights), none 0
// Adam + fp16: 4P + 8P + 4P + 2P = 18P. The fp8 presets' operand copies are transient, like
// activations: not counted.
struct MemoryPlan {
  std::uint64_t params = 0;
  std::uint64_t master_weights = 0, moments = 0, gradients = 0, model_copy = 0, total = 0;
};

// Throws std::invalid_argument when the total does not fit in 64 bits.
MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, nn::Precision precision);
MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, const nn::PrecisionPolicy& policy);
// With the master and moment formats of `state` (std::invalid_argument: remainder without bf16
// weights, moment formats with an SGD optimizer, a master format for a preset without masters).
MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, const nn::PrecisionPolicy& policy,
                       const StateFormats& state);

}  // namespace mixprec
