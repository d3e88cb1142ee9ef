#include "mixprec/nn/memory.hpp"

#include <limits>
#include <stdexcept>
#include <string>

namespace mixprec {

MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, nn::Precision precision) {
  return memory_plan(param_count, optimizer, nn::policy_of(precision));
}

MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, const nn::PrecisionPolicy& policy) {
  const bool fp32_weights = !policy.master && policy.weights == DType::f32;  // updated in place, as master
  const std::uint64_t master = policy.master || fp32_weights ? 4 : 0;
  const std::uint64_t model = fp32_weights ? 0 : dtype_size(policy.weights);
  const std::uint64_t grads = dtype_size(policy.weight_grads);
  const std::uint64_t moments = 4ull * optimizer_state_slots(optimizer);
  const std::uint64_t per_param = master + grads + model + moments;
  if (param_count > std::numeric_limits<std::uint64_t>::max() / per_param)
    throw std::invalid_argument("memory_plan: " + std::to_string(param_count) +
                                " parameters overflow a 64-bit byte count");
  MemoryPlan m;
  m.params = param_count;
  m.master_weights = master * param_count;
  m.moments = moments * param_count;
  m.gradients = grads * param_count;
  m.model_copy = model * param_count;
  m.total = per_param * param_count;
  return m;
}

}  // namespace mixprec
