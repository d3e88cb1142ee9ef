// The loss-scaling protocol of torch.amp.GradScaler, without tensors: the one place where
// every front door's protocol decision is made (docs/loss_scaling.md, "The GradScaler
// protocol"). mixprec::GradScaler (ParamStore views), mixprec::torch::GradScaler (libtorch
// tensors) and mixprec.torch.GradScaler (Python, through nanobind) are adapters over it:
// they find the gradients, check them with check_gradients() (scaler/check_gradients.hpp)
// or ATen, run their optimizer, and ask this class everything else.
//
// One step, for each optimizer (an opaque OptimizerId the door chooses):
//
//   begin_unscale(id)                 misuse checks only            [optional]
//     door checks/unscales -> record(id, check)       stage READY -> UNSCALED
//   begin_step(id) -> StepPlan        misuse checks; what the door must do
//     pass_through: the door calls its optimizer, nothing else (a disabled torch-dialect scaler)
//     check:        the door checks (record) first, then as step_only
//     step_only:    decide(id, options) -> StepDecision (apply? clip coefficient?)
//                   the door runs its optimizer if apply, then step_done(id): UNSCALED -> STEPPED
//   update()                          every record back to READY; the scale's update(any found_inf)
//
// The stage becomes UNSCALED as soon as the check is recorded, before the optimizer runs: an
// optimizer that throws (LBFGS without a closure) leaves the gradients unscaled once, and a
// retried step() steps them without unscaling again (torch's order).
//
// found_inf is aggregated here: over tensors (the check), over ranks (the RankAgreement hook
// the door supplies: torch.distributed, MPI, or none; called once per record()), and over
// optimizers (update() backs off when any optimizer overflowed; each optimizer skips on its
// own). Misuse throws ScalerMisuse (a std::logic_error) whose kind() names the misuse and whose
// text is the dialect's (kMisuseTable in protocol.cpp holds both wordings side by side).
//
// Not thread-safe for one instance (neither is torch's); independent instances on
// independent threads are (the check's thread pool runs a call inline when it is busy).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/scaler/layerwise.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/scaler/step_guard.hpp"

namespace mixprec {

enum class OptimizerStage : std::uint8_t { ready, unscaled, stepped };
std::string_view stage_name(OptimizerStage s) noexcept;

// Whose words and whose deliberate differences a protocol instance follows. The doors that
// differ on purpose, in one place (dialect_rules() returns the row):
//   mixprec (the core and libtorch): call names unscale()/step(); a disabled scaler still
//            checks the gradients and refuses to write inf/NaN into the weights;
//   torch   (the Python drop-in): torch.amp's own messages (unscale_(), RuntimeError or
//            AssertionError as torch raises them); a disabled scaler is a pass-through.
enum class Dialect : std::uint8_t { mixprec, torch };
std::string_view dialect_name(Dialect d) noexcept;

struct DialectRules {
  Dialect dialect;
  std::string_view unscale_call;      // "unscale()" or "unscale_()"
  bool disabled_checks_gradients;     // false: disabled = the optimizer's own step, nothing else
};
const DialectRules& dialect_rules(Dialect d) noexcept;

// Every misuse of the protocol, one value each; what Python raises for it (torch's class).
enum class Misuse : std::uint8_t {
  unscale_twice,             // unscale after unscale, same optimizer, same step
  unscale_after_step,
  step_twice,
  step_without_checks,       // step() on an optimizer none of whose parameters has a gradient
  update_without_checks,     // update() with no optimizer checked since the last update()
  window_incomplete,         // unscale/step/update before the k-th backward pass of a window
  window_overrun,            // backward_done() a (k+1)-th time
  backward_after_step,       // backward_done() after unscale/step and before update()
  window_resized,            // set_accumulation_steps() inside a window
  load_mid_step,             // load_state_json() with an optimizer unscaled or stepped
  load_mid_window,           // load_state_json() inside an accumulation window
  load_empty_state,          // torch's "source state dict is empty" (a disabled scaler's {})
};
enum class PythonError : std::uint8_t { runtime_error, assertion_error };
std::string_view misuse_name(Misuse m) noexcept;  // "unscale_twice", ...
PythonError python_error(Misuse m) noexcept;

class ScalerMisuse : public std::logic_error {
 public:
  ScalerMisuse(Misuse kind, const std::string& text) : std::logic_error(text), kind_(kind) {}
  Misuse kind() const noexcept { return kind_; }

 private:
  Misuse kind_;
};

// The opaque identity of one optimizer: its address in C++, id() in Python.
using OptimizerId = std::uint64_t;

// What a door's gradient check of one optimizer found (check_gradients() fills it for CPU
// views; a door's ATen path fills it the same way).
struct GradientCheck {
  bool checked = false;               // some parameter had a gradient (torch: an inf check was recorded)
  bool found_inf = false;             // a gradient held inf/NaN, or its unscaled value overflows its dtype
  std::int64_t first_overflow = -1;   // the door's index of the first such tensor; -1 when none
  double sum_squares = std::numeric_limits<double>::quiet_NaN();  // of the unscaled values; NaN: unknown
  float carried_inv_scale = 1.0f;     // what the optimizer step must still multiply by (1: unscaled in place)
};

// found_inf and checked of this rank in, the MAX over all ranks out (every rank calls it together).
struct RankFlags {
  bool found_inf = false;
  bool checked = false;
};
using RankAgreement = std::function<RankFlags(RankFlags)>;

enum class StepPlan : std::uint8_t { pass_through, check, step_only };

struct DecideOptions {
  std::optional<float> max_grad_norm;      // clip the unscaled gradients to this global norm
  bool found_inf_elsewhere = false;        // the engine's MPI agreement (another rank overflowed)
  std::optional<double> global_grad_norm;  // ZeRO: the norm over every rank's slice
  bool user_skip = false;                  // the door's predicate (skip_if) asked to skip this step
};

struct StepDecision {
  bool apply = false;                 // run the optimizer
  bool found_inf = false;
  float scale = 1.0f;                 // the scale the gradients carried
  std::int64_t first_overflow = -1;
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // L2 norm of the unscaled gradients
  float clip_coef = 1.0f;             // 1: no clipping
  bool clip_pending = false;          // the door must still multiply the gradients by clip_coef
  float carried_inv_scale = 1.0f;     // as GradientCheck's
  SkipReason reason = SkipReason::none;  // why apply is false (none when it is true)
  GuardView guard;                    // the loss, norm and z-scores the guards saw
};

class ScalerProtocol {
 public:
  // `preset`: the name the config came from (echoed in the state; "" when none). Preset
  // "layerwise" adds per-layer scaling (scaler/layerwise.hpp) on top of the config's scale.
  explicit ScalerProtocol(const LossScaleConfig& config = {}, bool enabled = true, Dialect dialect = Dialect::mixprec,
                          std::string preset = "");
  explicit ScalerProtocol(std::unique_ptr<LossScale> scale, bool enabled = true, Dialect dialect = Dialect::mixprec,
                          std::string preset = "");

  bool enabled() const noexcept { return enabled_; }
  Dialect dialect() const noexcept { return dialect_; }
  const std::string& preset() const noexcept { return preset_; }
  // How a run folder's config names this scaler (TrainConfig::loss_scale): "none" when
  // disabled, "static:S" for the static rule, else the preset ("dynamic" when unnamed).
  std::string run_spec() const;
  float scale() const noexcept;  // 1 when disabled
  const LossScale& loss_scale() const noexcept { return *scale_; }

  void set_rank_agreement(RankAgreement agree) { agree_ = std::move(agree); }

  // Per-layer scaling (preset "layerwise"; nullptr otherwise): the door registers its watched
  // layers, asks for each layer's factor in backward and says which layers' gradients are
  // finite before it checks the rest (docs/loss_scaling.md, "Per-layer loss scaling").
  // update() ends the layers' step too.
  LayerwiseScales* layerwise() noexcept { return layerwise_ ? &*layerwise_ : nullptr; }
  const LayerwiseScales* layerwise() const noexcept { return layerwise_ ? &*layerwise_ : nullptr; }

  void begin_unscale(OptimizerId id) const;  // throws ScalerMisuse; changes nothing
  // Whether unscale() checks the gradients: an enabled scaler, or a disabled one with guards
  // (which keeps its records until update() as an enabled one does).
  bool checks_on_unscale() const noexcept { return enabled_ || guard_.any(); }
  StepPlan begin_step(OptimizerId id) const;
  void record(OptimizerId id, const GradientCheck& check);  // READY -> UNSCALED
  // The skip decision, in this order: a non-finite gradient (found_inf, here or on another
  // rank), a non-finite loss, the loss spike, the gradient-norm spike, the door's predicate
  // (scaler/step_guard.hpp). The first decide() of an optimizer in a step feeds the guards'
  // detectors (a retried step decides again without feeding them twice).
  StepDecision decide(OptimizerId id, const DecideOptions& options = {});
  // What decide() would give the guards and the door's predicate, changing nothing.
  GuardView guard_view(OptimizerId id, const DecideOptions& options = {}) const;

  // Step guards (scaler/step_guard.hpp), set between steps; with any guard on, a disabled
  // scaler checks its gradients and keeps its records until update(), as an enabled one.
  void set_guard(const GuardConfig& config);
  const GuardConfig& guard() const noexcept { return guard_; }
  // This step's loss (the mean over its accumulation window, unscaled), once per step before
  // the first decide(): the loss guards read it. Not given: the loss guards stay silent.
  void observe_loss(double loss);
  // std::invalid_argument for options decide() would refuse (max_grad_norm not finite and > 0):
  // a door calls it before it checks anything, so that a bad call changes nothing.
  static void validate_options(const DecideOptions& options);
  // A door that clips in place says so once it has: a retried step (its optimizer threw)
  // neither clips twice nor forgets the coefficient.
  void clip_applied(OptimizerId id, float clip_coef, double grad_norm);
  void step_done(OptimizerId id);  // -> STEPPED (a disabled scaler forgets the optimizer)
  OptimizerStage stage(OptimizerId id) const noexcept;
  // No optimizer unscaled or stepped and no window open: where a state may be saved or pickled.
  bool between_steps() const noexcept;

  // Every record back to READY, the window closed, then the scale's update(found_inf of any
  // optimizer). The step is over even if the scale throws ScaleCollapseError.
  void update();
  // torch's update(new_scale): the scale set, counters kept, records and window cleared.
  void update_to(double new_scale);
  // The scale update() would leave, changing nothing (the recorded found_inf; the current
  // scale when nothing is recorded or the scaler is disabled): what telemetry logs.
  float next_scale() const;

  // Accumulation windows (k >= 1; 1 = none): k backward passes share one scale.
  void set_accumulation_steps(int k);
  int accumulation_steps() const noexcept { return window_steps_; }
  void backward_done();
  int backward_passes() const noexcept { return window_passes_; }

  // One config key changed (loss_scale_config_keys(); the value as set() reads it), on the
  // config in force now, the scale and counters kept (a growth tracker past a new, smaller
  // interval is clamped below it, as torch would grow at once).
  void reconfigure(std::string_view key, std::string_view value);

  // The one state format (docs/loss_scaling.md, "Scaler state"): torch.amp.GradScaler's five
  // keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker: torch's
  // load_state_dict takes the object as it is) and mixprec's: format "mixprec.grad_scaler",
  // version 2, enabled, preset, accumulation_steps, loss_scale (the exact scale, the full
  // config and every counter), and for preset "layerwise" `layerwise` (its config and every
  // layer's backoff and counters).
  std::string state_json() const;
  // Loads that format, version 1 (no torch keys), the Python adapter's first format (torch
  // keys + "mixprec": a loss-scale state) or torch.amp.GradScaler's own five keys (rule
  // torch: into a scaler whose rule is torch, its other settings kept). Validates everything
  // first: on any error (std::invalid_argument naming the field) nothing changes.
  void load_state_json(std::string_view json);

 private:
  struct Record {
    OptimizerStage stage = OptimizerStage::ready;
    GradientCheck check;
    std::optional<std::pair<float, double>> clipped;  // (coefficient, norm) applied in place
    std::size_t order = 0;                   // optimizers checked before it this step (its norm detector)
    std::optional<GuardView> seen;           // what its first decide() fed the guards
  };
  bool keeps_records() const noexcept { return enabled_ || guard_.any(); }
  void end_guard_step() noexcept;
  std::string_view text_of(Misuse m) const;  // the misuse's text in this dialect (kMisuseTable)
  [[noreturn]] void misuse(Misuse m, const std::string& detail = {}) const;
  void require_window_complete(std::string_view call) const;
  void require_between_steps() const;
  std::string call_name(std::string_view call) const;

  std::unique_ptr<LossScale> scale_;
  bool enabled_;
  Dialect dialect_;
  std::string preset_;
  int window_steps_ = 1;
  int window_passes_ = 0;
  std::map<OptimizerId, Record> records_;
  RankAgreement agree_;
  std::optional<LayerwiseScales> layerwise_;
  GuardConfig guard_;
  ZScoreDetector loss_detector_{guard_.window};
  std::vector<ZScoreDetector> grad_detectors_;  // one per optimizer, in the order they are checked
  std::optional<double> step_loss_;             // observe_loss() of this step
  std::optional<double> step_loss_z_;           // its z-score, once fed to the detector
};

// What every C++ GradScaler door (mixprec::GradScaler over ParamStore views,
// mixprec::torch::GradScaler over libtorch tensors) hands to its protocol unchanged: each door
// derives from it and adds only how it reads gradients and runs its optimizer.
class ScalerDoor {
 public:
  bool enabled() const noexcept { return protocol_.enabled(); }
  float get_scale() const noexcept { return protocol_.scale(); }  // 1 when disabled
  const LossScale& loss_scale() const noexcept { return protocol_.loss_scale(); }
  const ScalerProtocol& protocol() const noexcept { return protocol_; }
  // Preset layerwise: the per-layer scaling the door drives (nullptr otherwise).
  LayerwiseScales* layerwise() noexcept { return protocol_.layerwise(); }

  // Data parallelism: {found_inf, checked} MAX-reduced over the ranks by the caller's
  // collective (c10d all_reduce, MPI), once per check.
  void set_rank_agreement(RankAgreement agree) { protocol_.set_rank_agreement(std::move(agree)); }

  void update() { protocol_.update(); }  // may throw ScaleCollapseError (preset "mixprec")
  float next_scale() const { return protocol_.next_scale(); }  // what update() will leave

  // Accumulation windows (k >= 1; 1 = no accumulation). Changing k mid-window is an error.
  void set_accumulation_steps(int k) { protocol_.set_accumulation_steps(k); }
  int accumulation_steps() const noexcept { return protocol_.accumulation_steps(); }
  void backward_done() { protocol_.backward_done(); }
  int backward_passes() const noexcept { return protocol_.backward_passes(); }

  template <class Optimizer>
  OptimizerStage stage(const Optimizer& opt) const noexcept {
    return protocol_.stage(id_of(opt));
  }

  // The one state format (the same for every door; it carries torch.amp's keys too).
  std::string state_json() const { return protocol_.state_json(); }
  void load_state_json(std::string_view json) { protocol_.load_state_json(json); }
  // Step guards (scaler/step_guard.hpp), set between steps.
  void set_guard(const GuardConfig& config) { protocol_.set_guard(config); }
  const GuardConfig& guard() const noexcept { return protocol_.guard(); }
  // One loss-scale config key changed in place (torch's set_growth_factor & co.).
  void reconfigure(std::string_view key, std::string_view value) { protocol_.reconfigure(key, value); }

 protected:
  explicit ScalerDoor(ScalerProtocol protocol) : protocol_(std::move(protocol)) {}
  template <class Optimizer>
  static OptimizerId id_of(const Optimizer& opt) noexcept {
    return reinterpret_cast<std::uintptr_t>(&opt);
  }
  ScalerProtocol protocol_;
};

// A preset with `--set key=value` overrides, applied in the order of the core's key table
// (rule first, so that growth_factor then sets a one-factor rule's backoff) whatever order
// they come in, then validated: the one way every door builds a loss-scale config.
LossScaleConfig make_loss_scale_config(std::string_view preset,
                                       const std::vector<std::pair<std::string, std::string>>& overrides);
// The same over any base config (a run folder's stored one); `name` names it in messages.
LossScaleConfig make_loss_scale_config(const LossScaleConfig& base, std::string_view name,
                                       const std::vector<std::pair<std::string, std::string>>& overrides);

}  // namespace mixprec
