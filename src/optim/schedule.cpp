#include "mixprec/optim/schedule.hpp"
#include "mixprec/core/text.hpp"

#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>

namespace mixprec {

void WarmupCosine::validate() const {
  if (!std::isfinite(base_lr) || base_lr < 0)
    throw std::invalid_argument("WarmupCosine: expected base_lr finite and >= 0, found " + text::num(base_lr));
  if (!std::isfinite(min_lr) || min_lr < 0 || min_lr > base_lr)
    throw std::invalid_argument("WarmupCosine: expected 0 <= min_lr <= base_lr, found min_lr " + text::num(min_lr));
  if (total_steps < 1)
    throw std::invalid_argument("WarmupCosine: expected total_steps >= 1, found " + std::to_string(total_steps));
  if (warmup_steps < 0 || warmup_steps > total_steps)
    throw std::invalid_argument("WarmupCosine: expected 0 <= warmup_steps <= total_steps (" +
                                std::to_string(total_steps) + "), found " + std::to_string(warmup_steps));
}

double WarmupCosine::lr_at(std::int64_t step) const {
  if (step < 0) throw std::invalid_argument("WarmupCosine: expected step >= 0, found " + std::to_string(step));
  if (step < warmup_steps) return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (step >= total_steps) return min_lr;
  const double ratio = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
  return min_lr + coeff * (base_lr - min_lr);
}

LrSchedule::LrSchedule(WarmupCosine shape, ScheduleAdvance advance) : shape_(shape), advance_(advance) {
  shape_.validate();
}

void LrSchedule::set_position(std::int64_t p) {
  if (p < 0) throw std::invalid_argument("LrSchedule: expected position >= 0, found " + std::to_string(p));
  position_ = p;
}

}  // namespace mixprec
