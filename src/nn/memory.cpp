#include "mixprec/nn/memory.hpp"

#include <limits>
#include <stdexcept>
#include <string>

namespace mixprec {

MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, nn::Precision precision) {
  return memory_plan(param_count, optimizer, nn::policy_of(precision));
}

MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, const nn::PrecisionPolicy& policy) {
  return memory_plan(param_count, optimizer, policy, StateFormats{});
}

MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, const nn::PrecisionPolicy& policy,
                       const StateFormats& state) {
  const bool fp32_weights = !policy.master && policy.weights == DType::f32;  // updated in place, as master
  const bool adam = optimizer == OptimizerKind::adam || optimizer == OptimizerKind::adamw;
  if (!adam && (state.m != MomentFormat::fp32 || state.v != MomentFormat::fp32))
    throw std::invalid_argument("memory_plan: moment formats: expected fp32 with optimizer " +
                                std::string(optimizer_name(optimizer)) + " (the formats apply to adam and adamw)");
  if (state.master != MasterFormat::fp32 && !policy.master)
    throw std::invalid_argument("memory_plan: master " + std::string(master_format_name(state.master)) +
                                ": expected a preset with master weights (this one keeps none)");
  if (state.master == MasterFormat::remainder && policy.weights != DType::bf16)
    throw std::invalid_argument("memory_plan: master remainder: expected bf16 weights, found " +
                                std::string(dtype_name(policy.weights)));
  const std::uint64_t master = fp32_weights ? 4 : policy.master ? master_bytes_per_param(state.master) : 0;
  const std::uint64_t model = fp32_weights ? 0 : dtype_size(policy.weights);
  const std::uint64_t grads = dtype_size(policy.weight_grads);
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  // At most 4 + 4 + 4 + 8 bytes and two scales a parameter: checked once, every product below fits.
  if (param_count > kMax / 32)
    throw std::invalid_argument("memory_plan: " + std::to_string(param_count) +
                                " parameters overflow a 64-bit byte count");
  MemoryPlan m;
  m.params = param_count;
  m.master_weights = master * param_count;
  m.moments = adam ? moment_bytes(state.m, param_count, state) + moment_bytes(state.v, param_count, state)
                   : 4ull * optimizer_state_slots(optimizer) * param_count;
  m.gradients = grads * param_count;
  m.model_copy = model * param_count;
  m.total = m.master_weights + m.moments + m.gradients + m.model_copy;
  return m;
}

}  // namespace mixprec
