// GradScaler: the loss-scaling protocol of torch.amp.GradScaler, in C++, over
// mixprec optimizers (docs/loss_scaling.md, "The GradScaler protocol").
//
//   GradScaler scaler;                                  // preset "mixprec"
//   for each step:
//     backward(scaler.scale(loss));                     // gradients are scaled by S
//     [scaler.unscale(opt);]                            // optional: unscale in place first
//     StepOutcome out = scaler.step(opt, {.max_grad_norm = 1.0f});
//     scaler.update();                                  // once, after every optimizer stepped
//
// Order inside step() (PyTorch's, docs/loss_scaling.md): check every gradient for inf/NaN
// -> unscale -> clip on the true (unscaled) norm -> optimizer update. When
// step() finds the optimizer still READY it runs the fused path: one read-only
// pass (unscale_and_check with write = false) gives found_inf, the first
// overflowing tensor and the unscaled norm; then the optimizer's fused step
// reads the scaled gradients and multiplies by 1/S and the clip coefficient as
// it goes. After an explicit unscale() the gradients are already unscaled and
// step() only clips and updates. Both paths give the same weights.
//
// The protocol (stages, misuse messages, accumulation windows, found_inf aggregation, the
// skip decision, the state format) is ScalerProtocol's (scaler/protocol.hpp), in its mixprec
// dialect; this class only finds the gradients (ParamStore views), checks them with
// check_gradients() and runs the optimizer. Misuse throws ScalerMisuse (a std::logic_error).
// Each optimizer skips on its own found_inf (as PyTorch does); update() backs off when any
// optimizer overflowed.
//
// Gradient accumulation: with set_accumulation_steps(k), call backward_done() after each of
// the k backward passes of a window; the scale is fixed for the window.
//
// Scales that cannot be inverted (inf, 0, below about 2^-128) and scales below 1 whose
// unscaled fp16/bf16/f32 values overflow make the step an overflow: found_inf, nothing
// written (check_gradients()).
//
// enabled = false: a pass-through for the scale: scale() returns the loss unchanged,
// update() does nothing, unscale() does nothing. step() still reads the gradients once
// (norm for clipping, and the check): it refuses to write inf/NaN into the weights and
// reports found_inf, where PyTorch would step (the protocol's dialect table).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/kernels/unscale.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/scaler/protocol.hpp"

namespace mixprec {

class ThreadPool;

struct StepOptions {
  std::optional<float> max_grad_norm;  // clip the unscaled gradients to this global norm
  std::optional<double> lr;            // this step's learning rate (else the optimizer's)
  // Threads for the check and the optimizer step. nullptr: the check splits large models
  // over ThreadPool::global(), and the optimizer step runs on the caller.
  ThreadPool* pool = nullptr;
  // Data parallelism (docs/distributed.md): another rank found inf/NaN (found_inf
  // MAX-reduced over the ranks): skip, and back off in update(), as if this one had.
  bool found_inf_elsewhere = false;
  // ZeRO (the optimizer holds one shard): the norm of ALL the unscaled gradients,
  // combined across ranks; it replaces this optimizer's own for clipping and the
  // record, and a non-finite value is found_inf.
  std::optional<double> global_grad_norm;
  // Step guards (set_guard(); docs/spike_guards.md): this step's loss (unscaled, the mean over
  // its window) for the loss guards, and a predicate asked after the check (true: skip).
  std::optional<double> loss{};
  std::function<bool(const GuardView&)> skip_if{};
};

// What step() did, so that schedules, logs and users can see skipped steps. The one
// definition for every door: mixprec::torch::StepOutcome is this type, and Python's
// mixprec.torch.StepOutcome carries the same fields with the same meanings (plus torch's
// `result` and its own extras).
struct StepOutcome {
  bool applied = false;                 // the optimizer updated the weights
  bool found_inf = false;               // some gradient was inf or NaN: the step was skipped
  float scale = 1.0f;                   // the loss scale these gradients carry
  // The first parameter whose gradient held inf/NaN (or overflowed when unscaled), as its
  // index over the optimizer's parameters (the engine: its parameter store's order; torch:
  // the param groups in order, each group's params in order); -1 when none, also on a rank
  // that skipped only because another rank overflowed.
  std::int64_t first_overflow = -1;
  // Its name, derived from first_overflow in one place per door: the parameter store's name
  // (engine), set_names' (torch doors) else the optimizer's param_names (Python), else
  // default_parameter_name(index) = "param[<index>]"; "" when first_overflow is -1.
  std::string first_overflow_name;
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // global norm of the unscaled gradients
  float clip_coef = 1.0f;               // applied clip coefficient (1: none)
  SkipReason reason = SkipReason::none; // why the step was skipped (none when applied)
  GuardView guard;                      // the loss, norm and z-scores the guards saw
};

// The protocol's decision as a door reports it, before the optimizer ran (applied false) and
// without the name (the door's to add).
StepOutcome step_outcome(const StepDecision& decision);

class GradScaler : public ScalerDoor {
 public:
  // preset: the name the config came from ("layerwise" adds per-layer scaling).
  explicit GradScaler(const LossScaleConfig& config = {}, bool enabled = true, std::string preset = "");
  explicit GradScaler(std::unique_ptr<LossScale> scale, bool enabled = true);

  float scale(float loss) const noexcept { return loss * get_scale(); }
  void unscale(Optimizer& opt, ThreadPool* pool = nullptr);
  StepOutcome step(Optimizer& opt, const StepOptions& options = {});
};

}  // namespace mixprec
