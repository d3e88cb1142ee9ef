// Loss-scale policies: a static scale, and dynamic scales that reproduce, step by step,
// the update rules of PyTorch, DeepSpeed, Megatron-LM, Apex, Keras 3, tf.keras (Keras 2) and
// jmp (written out in docs/loss_scaling.md), plus mixprec's own default.
//
//   mixprec::DynamicLossScale ls(mixprec::loss_scale_preset("mixprec"));
//   loss * ls.scale();  ...  ls.update(found_inf);   // once per optimizer step
//
// Every overflow step (found_inf) is a skipped step; update() only adjusts the scale.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec {

// Which anchor's update rule a scale follows. Each rule keeps the anchor's arithmetic
// precision (see docs/loss_scaling.md): torch holds a float32 and multiplies in double;
// deepspeed and apex hold a Python float (double); megatron, keras, tf_keras and jmp compute
// in float32. keras is Keras 3's LossScaleOptimizer (no floor, no finite guard: the scale can
// fall below 1, to 0, or grow to inf and stay there); tf_keras is tf.keras / Keras 2's (floor
// at 1, growth only into a finite value).
enum class LossScaleRule : std::uint8_t { static_scale, torch, deepspeed, megatron, apex, keras, tf_keras, jmp };

// What to do when the scale is at its floor (min_scale) and an overflow asks to back off.
enum class FloorPolicy : std::uint8_t {
  keep_going,  // "continue": stay at the floor and keep skipping steps
  error,       // "error": throw ScaleCollapseError after max_floor_overflows such overflows in a row
};

std::string_view rule_name(LossScaleRule r) noexcept;         // "static", "torch", ..., "tf-keras", "jmp"
std::string_view floor_policy_name(FloorPolicy p) noexcept;   // "continue", "error"

// Defaults are the `mixprec` preset: torch's rule, floor at 1, error after 10 overflows at the floor.
struct LossScaleConfig {
  LossScaleRule rule = LossScaleRule::torch;
  double init_scale = 65536.0;
  double growth_factor = 2.0;    // > 1
  double backoff_factor = 0.5;   // in (0, 1); rules with one factor require 1/growth_factor
  std::int64_t growth_interval = 2000;  // clean steps per growth (DeepSpeed scale_window), >= 1
  double min_scale = 1.0;        // floor; 0 = none
  double max_scale = std::numeric_limits<double>::infinity();  // cap; +inf = none
  std::int64_t hysteresis = 1;   // overflows tolerated before a backoff is hysteresis - 1 (deepspeed, megatron)
  bool consecutive_hysteresis = false;  // deepspeed: refill hysteresis on every clean step, not on growth
  bool refuse_nonfinite_growth = true;  // keep the scale when growing would make it inf
  FloorPolicy floor_policy = FloorPolicy::error;
  std::int64_t max_floor_overflows = 10;  // >= 1; with error: throw on the N-th overflow in a row at the floor

  friend bool operator==(const LossScaleConfig&, const LossScaleConfig&) = default;
};

// Names accepted by loss_scale_preset, in order: mixprec, torch, deepspeed, megatron, apex, keras, tf-keras,
// jmp, static.
const std::vector<std::string>& loss_scale_preset_names();
// The preset's config; an unknown name throws std::invalid_argument listing the valid names.
LossScaleConfig loss_scale_preset(std::string_view name);

// Throws std::invalid_argument naming the field, what was expected and what was found.
void validate(const LossScaleConfig& config);

// A scale someone chooses to start from (an init_scale override, `--loss-scale static:S`) must
// have a reciprocal float32 holds: the unscale multiplies by 1/S, so below 1/FLT_MAX
// (2.9387359e-39) every step would be skipped. validate() accepts such scales, since a backoff
// reaches them and a saved state may hold one; the doors that parse a user's scale refuse them.
bool starting_scale_ok(double scale) noexcept;
inline constexpr const char* kStartingScaleRange = "(2.9387359e-39, 3.4028235e+38]";

// Keys accepted by set(), in order.
const std::vector<std::string>& loss_scale_config_keys();
// Sets one field from text (the CLI's --set key=value). Checks the field's own range; checks
// across fields (min <= init <= max, ...) are validate()'s. Unknown key, unparsable or out-of-range
// value: std::invalid_argument naming the key and what it accepts. For rules with one factor
// (deepspeed, apex, keras, tf-keras, jmp) setting growth_factor also sets backoff_factor = 1/growth_factor.
void set(LossScaleConfig& config, std::string_view key, std::string_view value);

// One line per field, "key = value", as set() accepts them.
std::string describe(const LossScaleConfig& config);

// The config alone as the JSON object a state holds under "config" (LossScaleState::to_json),
// and back: every field required, validated; std::invalid_argument "KEY: ..." otherwise (the
// caller says where the config was).
// A run folder stores its scaler's whole config so (docs/run_folder.md, "loss-scale-config").
std::string loss_scale_config_json(const LossScaleConfig& config);
LossScaleConfig loss_scale_config_from_json(std::string_view json);

// The counters a scale keeps. Each rule uses the ones its anchor has; the rest keep their
// initial values. All are updated by update(); see docs/loss_scaling.md for which is which.
struct LossScaleCounters {
  std::int64_t steps = 0;               // update() calls
  std::int64_t overflows = 0;           // update(true) calls = skipped steps
  std::int64_t growths = 0;             // times the scale grew
  std::int64_t backoffs = 0;            // times an overflow lowered (or tried to lower) the scale
  std::int64_t growth_tracker = 0;      // clean steps toward the next growth (torch growth tracker,
                                        // megatron growth_tracker, apex _unskipped, keras step_counter,
                                        // tf-keras/jmp counter)
  std::int64_t hysteresis_left = 1;     // deepspeed cur_hysteresis, megatron hysteresis_tracker (may go < 0)
  std::int64_t iteration = 0;           // deepspeed cur_iter
  std::int64_t last_overflow_iter = -1; // deepspeed last_overflow_iter
  std::int64_t floor_overflows = 0;     // overflows in a row that found the scale at its floor

  friend bool operator==(const LossScaleCounters&, const LossScaleCounters&) = default;
};

// Everything needed to resume: the config, the exact scale and the counters.
struct LossScaleState {
  LossScaleConfig config;
  double scale = 0;  // exact (a float32 value for float32 rules)
  LossScaleCounters counters;

  // JSON text: {"format":"mixprec.loss_scale","version":1,"config":{...},"scale":...,"counters":{...}}.
  // A min_scale of 0 is written as null ("none"), a max_scale of inf as null, an infinite scale as "inf".
  std::string to_json() const;
  // Parses and validates everything (types, ranges, rule and policy names, counters) and throws
  // std::invalid_argument naming the field before anything is returned.
  static LossScaleState from_json(std::string_view json);

  friend bool operator==(const LossScaleState&, const LossScaleState&) = default;
};

// Throws std::invalid_argument naming the field when the state could not come from its config.
void validate(const LossScaleState& state);

// Thrown by update() when the floor policy is `error` and max_floor_overflows overflows in a row
// found the scale at its floor. The scale is left as it was before the throwing call.
class ScaleCollapseError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The interface a gradient scaler drives: multiply the loss by scale(), then once per optimizer
// step call update(found_inf). Both kinds hold the same state (config, exact scale, counters);
// only update() and what load() accepts differ.
class LossScale {
 public:
  virtual ~LossScale() = default;
  float scale() const { return static_cast<float>(scale_); }  // the current scale as float32
  virtual void update(bool found_inf) = 0;                     // may throw ScaleCollapseError
  const LossScaleConfig& config() const { return config_; }
  LossScaleCounters counters() const { return counters_; }
  LossScaleState state() const { return {config_, scale_, counters_}; }
  // Validates the whole state first (throws std::invalid_argument, object unchanged), then
  // replaces config, scale and counters. A static scale accepts only static states, a dynamic
  // scale only dynamic ones.
  virtual void load(const LossScaleState& state) = 0;

  std::string to_json() const { return state().to_json(); }
  void load_json(std::string_view json) { load(LossScaleState::from_json(json)); }

 protected:
  explicit LossScale(const LossScaleState& initial)
      : config_(initial.config), scale_(initial.scale), counters_(initial.counters) {}
  LossScale(const LossScale&) = default;
  LossScale& operator=(const LossScale&) = default;
  LossScaleConfig config_;
  double scale_;  // exact; a float32 value for float32 rules
  LossScaleCounters counters_;
};

// A scale that never changes (rule static): only init_scale is used.
class StaticLossScale final : public LossScale {
 public:
  explicit StaticLossScale(double scale);  // rounded to float32; must be finite and > 0
  explicit StaticLossScale(const LossScaleConfig& config);  // config.rule must be static
  void update(bool found_inf) override;
  void load(const LossScaleState& state) override;
};

// The dynamic rules. One explicit switch on config.rule; each branch is the anchor's rule.
class DynamicLossScale final : public LossScale {
 public:
  DynamicLossScale() : DynamicLossScale(LossScaleConfig{}) {}
  explicit DynamicLossScale(const LossScaleConfig& config);  // validates; rule must not be static
  void update(bool found_inf) override;
  void load(const LossScaleState& state) override;

 private:
  void check_floor(double scale_before);  // throws ScaleCollapseError (no state change)
};

// StaticLossScale for rule static, DynamicLossScale otherwise.
std::unique_ptr<LossScale> make_loss_scale(const LossScaleConfig& config);

// The initial state of a scale made from config (validated).
LossScaleState initial_loss_scale_state(const LossScaleConfig& config);

}  // namespace mixprec
