// What another loss-scale policy would have done on a recorded run: from the per-step
// activation-gradient amax in log.jsonl, estimate which steps would have overflowed
// under the policy's scale, replay the policy on those overflows (the library's own
// LossScale), and compare with what the run did. `mixprec scaler simulate RUN_DIR`.
// See docs/alerts.md ("Simulating another policy").
//
// It is an estimate:
//   - the gradients of step t depend on the weights, which differ as soon as the other
//     policy skips (or applies) a step the run did not; the replay keeps the recorded
//     gradients throughout;
//   - a value near the threshold rounds either way; the model compares the exact
//     products with the format's overflow threshold;
//   - only overflow is modelled: a lower scale would also flush more small gradients to
//     zero (and a higher one fewer), which changes the loss but not the skips modelled here.
//
// The model of step t (recorded scale s_t, activation-gradient telemetry of log.jsonl):
//   - a non-finite forward pass, an injected inf, or a first non-finite activation
//     gradient that no overflowing store before it explains: overflows at any scale;
//   - otherwise u_t = (largest finite |activation gradient| up to the first tensor that
//     went non-finite, in backward order) / s_t, the unscaled amax, and the step overflows
//     under scale S iff S >= limit / u_t, limit being the smallest magnitude that rounds
//     to inf in the activation format (65520 for fp16);
//   - a recorded overflow that u_t does not explain (the activation gradients stayed in
//     range, e.g. fp16-pure weight gradients overflowing) or a log without per-tensor
//     telemetry whose amax is not finite: overflows iff S >= s_t (gradients scale with S;
//     below s_t the step is assumed clean).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/nn/precision.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/run/step_record.hpp"

namespace mixprec::monitor {

enum class OverflowModel : std::uint8_t {
  amax,        // overflows iff S >= limit / unscaled amax
  always,      // overflows at any scale
  from_scale,  // overflows iff S >= the recorded scale
};
// "amax", "always", "from-recorded-scale".
std::string_view overflow_model_name(OverflowModel m) noexcept;

// The smallest magnitude that rounds to inf in the activation format of `precision`
// (round to nearest even): 65520 for fp16 and fp16-pure, 0x1.ffp127 for bf16,
// 0x1.ffffffp127 for fp32.
double overflow_limit(nn::Precision precision) noexcept;

struct SimulatedStep {
  std::uint64_t step = 0;
  OverflowModel model = OverflowModel::amax;
  double unscaled_amax = 0;      // u_t (amax model; 0 otherwise)
  double overflow_scale = std::numeric_limits<double>::infinity();  // smallest S that overflows (0: any)
  float recorded_scale = 1, recorded_next_scale = 1;
  bool recorded_skipped = false;
  bool predicted_at_recorded = false;  // the model's verdict at the recorded scale
  double scale = 0;              // simulated: the scale this step used
  bool skipped = false;          // simulated: predicted overflow (skipped)
  double next_scale = 0;         // simulated: after update
};

struct SimulationSide {
  std::uint64_t steps = 0, skipped = 0;
  std::uint64_t first_skip = 0;  // step; 0 = none
  std::uint64_t growths = 0, backoffs = 0;  // updates that raised / lowered the scale
  double final_scale = 0, min_scale = 0, max_scale = 0;  // over the scales used and the final one
};

struct Simulation {
  nn::Precision precision = nn::Precision::fp16;
  double limit = 0;              // overflow_limit(precision)
  LossScaleConfig policy;
  std::vector<SimulatedStep> steps;  // one per recorded step, up to a collapse
  SimulationSide recorded, simulated;
  std::uint64_t agree = 0;       // steps where predicted_at_recorded == recorded_skipped
  std::string collapse;          // ScaleCollapseError of the simulated policy ("" = none)
  std::uint64_t collapse_step = 0;  // the step it was thrown at (not in `steps`)
};

// Throws std::invalid_argument when the log is empty or carries no activation-gradient
// telemetry (act_grad_amax and act_grad_tensors are absent from every step: a log written
// before telemetry existed), or the policy is invalid.
Simulation simulate(std::span<const train::StepRecord> log, nn::Precision precision, const LossScaleConfig& policy);

// The whole simulation as one compact JSON object: precision, overflow_limit, policy (the
// config as LossScaleState JSON writes it), recorded and simulated sides, agreement,
// collapse (null or {step, message}), steps (one object per step; inf as null).
std::string simulation_json(const Simulation& s);

}  // namespace mixprec::monitor
