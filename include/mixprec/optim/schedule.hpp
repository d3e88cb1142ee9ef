// Learning-rate schedule: linear warmup then cosine decay to min_lr (llm.c's shape).
#pragma once

#include <cstdint>

namespace mixprec {

struct WarmupCosine {
  double base_lr = 1e-3;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  double min_lr = 0.0;

  // Throws std::invalid_argument unless 0 <= min_lr <= base_lr (finite),
  // 0 <= warmup_steps <= total_steps and total_steps >= 1.
  void validate() const;
  // step < warmup: base_lr * (step + 1) / warmup_steps;
  // step >= total_steps: min_lr;
  // else: min_lr + 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup))) * (base_lr - min_lr).
  // Negative steps throw std::invalid_argument.
  double lr_at(std::int64_t step) const;
};

// Whether the schedule moves on skipped steps.
enum class ScheduleAdvance : std::uint8_t { applied_steps, every_step };

class LrSchedule {
 public:
  explicit LrSchedule(WarmupCosine shape, ScheduleAdvance advance = ScheduleAdvance::applied_steps);
  double lr() const { return shape_.lr_at(position_); }  // the lr for the next step
  // Call once per optimizer step with whether it was applied.
  void on_step(bool applied) noexcept {
    if (applied || advance_ == ScheduleAdvance::every_step) ++position_;
  }
  std::int64_t position() const noexcept { return position_; }
  void set_position(std::int64_t p);  // for resuming; throws when negative
  const WarmupCosine& shape() const noexcept { return shape_; }
  ScheduleAdvance advance() const noexcept { return advance_; }

 private:
  WarmupCosine shape_;
  ScheduleAdvance advance_;
  std::int64_t position_ = 0;
};

}  // namespace mixprec
