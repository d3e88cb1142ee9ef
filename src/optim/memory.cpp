#include "mixprec/optim/memory.hpp"

#include <limits>
#include <stdexcept>
#include <string>

namespace mixprec {

std::string_view precision_name(PrecisionPreset p) noexcept {
  switch (p) {
    case PrecisionPreset::fp32: return "fp32";
    case PrecisionPreset::fp16: return "fp16";
    case PrecisionPreset::bf16: return "bf16";
    case PrecisionPreset::fp16_pure: return "fp16-pure";
    case PrecisionPreset::bf16_pure: return "bf16-pure";
  }
  return "?";
}

std::optional<PrecisionPreset> parse_precision(std::string_view s) noexcept {
  for (PrecisionPreset p : {PrecisionPreset::fp32, PrecisionPreset::fp16, PrecisionPreset::bf16,
                            PrecisionPreset::fp16_pure, PrecisionPreset::bf16_pure})
    if (s == precision_name(p)) return p;
  return std::nullopt;
}

MemoryPlan memory_plan(std::uint64_t param_count, OptimizerKind optimizer, PrecisionPreset precision) {
  std::uint64_t master = 0, grads = 0, model = 0;
  switch (precision) {
    case PrecisionPreset::fp32: master = 4; grads = 4; model = 0; break;
    case PrecisionPreset::fp16:
    case PrecisionPreset::bf16: master = 4; grads = 4; model = 2; break;
    case PrecisionPreset::fp16_pure:
    case PrecisionPreset::bf16_pure: master = 0; grads = 2; model = 2; break;
  }
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
