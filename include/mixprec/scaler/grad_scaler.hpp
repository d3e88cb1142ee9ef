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
// Per optimizer: READY -> UNSCALED (unscale) -> STEPPED (step); update() puts
// every optimizer back to READY. Misuse throws std::logic_error naming it:
// unscale twice, unscale after step, step twice, update with nothing recorded.
// Each optimizer skips on its own found_inf (as PyTorch does); update() backs
// off when any optimizer overflowed.
//
// Gradient accumulation: with set_accumulation_steps(k), call backward_done()
// after each of the k backward passes of a window; the scale is fixed for the
// window, and unscale/step/update before the k-th backward pass are errors.
//
// A scale whose inverse float32 cannot hold (inf, 0, or below about 2^-128, all
// reachable by the keras preset, which follows Keras 3: no floor, no finite guard)
// cannot unscale anything: every such step is an overflow (found_inf, nothing
// written, the first tensor holding inf/NaN named, grad_norm NaN), as in Keras 3,
// where a loss scaled by inf gives non-finite gradients and the step is skipped.
//
// enabled = false: a pass-through for the scale: scale() returns the loss
// unchanged, update() does nothing, unscale() does nothing. step() still reads
// the gradients once (norm for clipping, and the check): it refuses to write
// inf/NaN into the weights and reports found_inf, where PyTorch would step.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/kernels/unscale.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/scaler/loss_scale.hpp"

namespace mixprec {

class ThreadPool;

enum class OptimizerStage : std::uint8_t { ready, unscaled, stepped };
std::string_view stage_name(OptimizerStage s) noexcept;

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
};

// What step() did, so that schedules, logs and users can see skipped steps.
struct StepOutcome {
  bool applied = false;                 // the optimizer updated the weights
  bool found_inf = false;               // some gradient was inf or NaN: the step was skipped
  float scale = 1.0f;                   // the loss scale these gradients carry
  std::int64_t first_overflow = -1;     // index of the first tensor holding inf/NaN, or -1
  std::string first_overflow_name;      // its name in the parameter store
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // global norm of the unscaled gradients
  float clip_coef = 1.0f;               // applied clip coefficient (1: none)
};

// The accumulation window of a GradScaler (this one and mixprec::torch's): k backward
// passes share one scale; unscale, step and update come once, at the window's end. The
// errors name the misuse.
class AccumulationWindow {
 public:
  int steps() const noexcept { return steps_; }
  int passes() const noexcept { return passes_; }
  // k >= 1 (std::invalid_argument), between windows only (std::logic_error).
  void set_steps(int k);
  // One more backward pass. `step_started`: some optimizer was unscaled or stepped since
  // the last update() (std::logic_error, as is a pass beyond k).
  void backward_done(bool step_started);
  // std::logic_error for `call` (unscale(), step()) before the k-th pass when k > 1.
  void require_complete(const char* call) const;
  // std::logic_error for `call` (load_state_json()) inside a window.
  void require_between(const char* call) const;
  void end() noexcept { passes_ = 0; }  // update()

 private:
  int steps_ = 1;
  int passes_ = 0;
};

class GradScaler {
 public:
  explicit GradScaler(const LossScaleConfig& config = {}, bool enabled = true);
  explicit GradScaler(std::unique_ptr<LossScale> scale, bool enabled = true);

  bool enabled() const noexcept { return enabled_; }
  float get_scale() const noexcept;                 // 1 when disabled
  float scale(float loss) const noexcept;           // loss * get_scale()
  const LossScale& loss_scale() const noexcept { return *scale_; }

  void unscale(Optimizer& opt, ThreadPool* pool = nullptr);
  StepOutcome step(Optimizer& opt, const StepOptions& options = {});
  void update();  // may throw ScaleCollapseError (preset "mixprec": the scale collapsed)

  // Accumulation windows (k >= 1; 1 = no accumulation). Changing k mid-window is an error.
  void set_accumulation_steps(int k) { window_.set_steps(k); }
  int accumulation_steps() const noexcept { return window_.steps(); }
  void backward_done();
  int backward_passes() const noexcept { return window_.passes(); }

  OptimizerStage stage(const Optimizer& opt) const noexcept;

  // The whole state as JSON: enabled, accumulation window, the loss scale's state.
  // load_state_json validates everything first and changes nothing on error; it
  // also refuses to load in the middle of a step or an accumulation window.
  std::string state_json() const;
  void load_state_json(std::string_view json);

 private:
  struct Record {
    OptimizerStage stage = OptimizerStage::ready;
    bool found_inf = false;
    std::int64_t first_overflow = -1;
    double grad_norm = std::numeric_limits<double>::quiet_NaN();
    void reset() {
      stage = OptimizerStage::ready;
      found_inf = false;
      first_overflow = -1;
      grad_norm = std::numeric_limits<double>::quiet_NaN();
    }
  };
  Record& record(Optimizer& opt);
  static void record_check(Record& r, const UnscaleResult& res);
  static void record_unscalable(Record& r, Optimizer& opt, ThreadPool* pool);

  std::unique_ptr<LossScale> scale_;
  bool enabled_;
  AccumulationWindow window_;
  std::map<const Optimizer*, Record> records_;
};

}  // namespace mixprec
