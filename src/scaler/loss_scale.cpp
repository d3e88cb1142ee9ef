// Loss-scale policies. Each dynamic rule is transcribed from its framework's update code as
// docs/loss_scaling.md writes it out; the branches of DynamicLossScale::update() can be read
// side by side with that page.
#include "mixprec/scaler/loss_scale.hpp"

#include "../core/key_table.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/text.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <string>

namespace mixprec {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr std::int64_t kMaxCount = 2147483647;  // torch and jmp keep their counters in int32
constexpr double kFloatMax = static_cast<double>(std::numeric_limits<float>::max());

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

using text::num;

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// Every rule, one row each, in the order messages list them: its name, and what its anchor
// does that validation and the update depend on.
struct RuleRow {
  LossScaleRule rule;
  std::string_view name;
  bool holds_f32;       // the anchor holds (or computes) the scale in float32
  bool single_factor;   // one factor: growth multiplies by it, backoff divides by it
  bool has_hysteresis;  // overflows tolerated before a backoff (deepspeed, megatron)
};

constexpr RuleRow kRules[] = {
    {LossScaleRule::static_scale, "static", true, false, false},
    {LossScaleRule::torch, "torch", true, false, false},
    {LossScaleRule::deepspeed, "deepspeed", false, true, true},
    {LossScaleRule::megatron, "megatron", true, false, true},
    {LossScaleRule::apex, "apex", false, true, false},
    {LossScaleRule::keras, "keras", true, true, false},
    {LossScaleRule::tf_keras, "tf-keras", true, true, false},
    {LossScaleRule::jmp, "jmp", true, true, false},
};

const RuleRow* rule_row(LossScaleRule r) noexcept {
  for (const RuleRow& row : kRules)
    if (row.rule == r) return &row;
  return nullptr;
}

bool holds_f32(LossScaleRule r) {
  const RuleRow* row = rule_row(r);
  return row != nullptr && row->holds_f32;
}
bool single_factor(LossScaleRule r) {
  const RuleRow* row = rule_row(r);
  return row != nullptr && row->single_factor;
}
bool has_hysteresis(LossScaleRule r) {
  const RuleRow* row = rule_row(r);
  return row != nullptr && row->has_hysteresis;
}

// A bound (min or max scale) as the rule compares with it.
double in_rule_precision(LossScaleRule r, double v) {
  return holds_f32(r) ? static_cast<double>(static_cast<float>(v)) : v;
}

std::string collapse_message(const LossScaleConfig& c, double scale, std::int64_t step) {
  const std::int64_t n = c.max_floor_overflows;
  const std::string last = n == 1 ? "this step overflowed" : "the last " + std::to_string(n) + " steps all overflowed";
  return "loss scale collapsed (rule " + std::string(rule_name(c.rule)) + ", update " + std::to_string(step) +
         "): the scale is at its floor min_scale = " + num(scale) + " and " + last +
         " (inf/NaN gradients) even there. Lowering the scale cannot fix this: the overflow does not come from "
         "loss scaling. Likely causes: a learning rate too high (loss or weights diverging), bad data (inf/NaN "
         "inputs or labels), or non-finite values produced in the forward pass (log(0), division by zero, "
         "activations or attention logits overflowing in low precision). Check the loss and the activations for "
         "inf/NaN, inspect the batch, lower the learning rate; set floor_policy=continue to keep skipping steps "
         "instead.";
}

}  // namespace

std::string_view rule_name(LossScaleRule r) noexcept {
  const RuleRow* row = rule_row(r);
  return row != nullptr ? row->name : "?";
}

std::string_view floor_policy_name(FloorPolicy p) noexcept {
  switch (p) {
    case FloorPolicy::keep_going: return "continue";
    case FloorPolicy::error: return "error";
  }
  return "?";
}

// ---- presets -----------------------------------------------------------------

namespace {

// The anchors' common ground: no error at the floor unless the anchor raises, no hysteresis,
// factors 2 and 1/2, no cap.
LossScaleConfig anchor(LossScaleRule rule, double init_scale, std::int64_t growth_interval, double min_scale,
                       bool refuse_nonfinite_growth) {
  LossScaleConfig c;
  c.rule = rule;
  c.init_scale = init_scale;
  c.growth_interval = growth_interval;
  c.min_scale = min_scale;
  c.refuse_nonfinite_growth = refuse_nonfinite_growth;
  c.floor_policy = FloorPolicy::keep_going;
  c.hysteresis = 1;
  c.consecutive_hysteresis = false;
  c.growth_factor = 2.0;
  c.backoff_factor = 0.5;
  c.max_scale = kInf;
  return c;
}

template <class F>
LossScaleConfig with(LossScaleConfig c, F&& change) {
  change(c);
  return c;
}

struct Preset {
  std::string name;
  LossScaleConfig config;
};

// Every preset, one row each, in the order loss_scale_preset_names() lists them.
const std::vector<Preset>& preset_table() {
  using R = LossScaleRule;
  static const std::vector<Preset> table = {
      {"mixprec", LossScaleConfig{}},
      {"torch", anchor(R::torch, 65536.0, 2000, 0.0, true)},
      // initial_scale_power 16, hysteresis 2, raise_error_at_min_scale
      {"deepspeed", with(anchor(R::deepspeed, 65536.0, 1000, 1.0, false),
                         [](LossScaleConfig& c) {
                           c.hysteresis = 2;
                           c.floor_policy = FloorPolicy::error;
                           c.max_floor_overflows = 1;
                         })},
      {"megatron", with(anchor(R::megatron, 4294967296.0, 1000, 1.0, false), [](LossScaleConfig& c) { c.hysteresis = 2; })},
      {"apex", with(anchor(R::apex, 65536.0, 2000, 0.0, false), [](LossScaleConfig& c) { c.max_scale = 16777216.0; })},
      // Keras 3 LossScaleOptimizer: initial_scale 2^15, dynamic_growth_steps 2000, no floor, no
      // finite guard (the scale can go below 1, to 0, or grow to inf).
      {"keras", anchor(R::keras, 32768.0, 2000, 0.0, false)},
      // tf.keras / Keras 2 LossScaleOptimizer (dynamic): floor at 1, growth only into a finite value.
      {"tf-keras", anchor(R::tf_keras, 32768.0, 2000, 1.0, true)},
      {"jmp", anchor(R::jmp, 32768.0, 2000, 1.0, true)},
      // DeepSpeed's and Apex's static LossScaler default; set init_scale
      {"static", anchor(R::static_scale, 1.0, 2000, 0.0, true)},
      // mixprec's scale for the loss, with per-layer factors on top (scaler/layerwise.hpp)
      {"layerwise", LossScaleConfig{}},
  };
  return table;
}

}  // namespace

const std::vector<std::string>& loss_scale_preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const Preset& p : preset_table()) n.push_back(p.name);
    return n;
  }();
  return names;
}

LossScaleConfig loss_scale_preset(std::string_view name) {
  for (const Preset& p : preset_table())
    if (p.name == name) return p.config;
  fail("unknown loss-scale preset '" + std::string(name) + "'; presets: " + join(loss_scale_preset_names()));
}

// ---- the key table ---------------------------------------------------------------

namespace {

std::optional<LossScaleRule> parse_rule(std::string_view s) {
  for (const RuleRow& r : kRules)
    if (r.name == s) return r.rule;
  return std::nullopt;
}

std::optional<FloorPolicy> parse_floor_policy(std::string_view s) {
  for (FloorPolicy p : {FloorPolicy::keep_going, FloorPolicy::error})
    if (floor_policy_name(p) == s) return p;
  return std::nullopt;
}

std::vector<std::string> names_of_rules() {
  std::vector<std::string> n;
  for (const RuleRow& r : kRules) n.emplace_back(r.name);
  return n;
}

// Every LossScaleConfig field, one row each, in the order set(), describe() and
// loss_scale_config_keys() list them: its text (--set, Python keywords, describe), its JSON
// (the saved state's "config"), its range and doc line, through the key-table mechanism
// every config shares (src/core/key_table.hpp). Rules across fields are validate()'s.
const keys::KeyTable<LossScaleConfig>& config_table() {
  using keys::Spec;
  using C = LossScaleConfig;
  static const keys::KeyTable<C> table([] {
    const auto count = [](std::string name, std::string doc) {
      return Spec{.name = std::move(name), .doc = std::move(doc), .type = "N", .int_min = 1, .int_max = kMaxCount};
    };
    std::vector<keys::Key<C>> k;
    k.push_back(keys::enum_key<C>(
        Spec{.name = "rule",
             .doc = "The update rule: static, or the anchor's whose update it reproduces",
             .type = "NAME",
             .choices = names_of_rules()},
        [](auto& c) -> auto& { return c.rule; }, parse_rule));
    k.push_back(keys::number_key<C>(
        Spec{.name = "init_scale", .doc = "The scale at the first step", .type = "X", .lo = 0, .lo_open = true},
        [](auto& c) -> auto& { return c.init_scale; }));
    k.push_back(keys::number_key<C>(
        Spec{.name = "growth_factor",
             .doc = "A growth multiplies the scale by it (the one-factor rules also back off by dividing by it)",
             .type = "X",
             .lo = 1,
             .lo_open = true},
        [](auto& c) -> auto& { return c.growth_factor; }));
    k.push_back(keys::number_key<C>(
        Spec{.name = "backoff_factor",
             .doc = "An overflow multiplies the scale by it; 1/growth_factor for the one-factor rules",
             .type = "X",
             .lo = 0,
             .hi = 1,
             .lo_open = true,
             .hi_open = true},
        [](auto& c) -> auto& { return c.backoff_factor; }));
    k.push_back(keys::integer_key<C>(
        count("growth_interval", "Clean steps in a row before the scale grows (DeepSpeed's scale_window)"),
        [](auto& c) -> auto& { return c.growth_interval; }));
    k.push_back(keys::number_key<C>(
        Spec{.name = "min_scale", .doc = "The floor; none (0) = no floor", .type = "X", .lo = 0, .none = 0.0},
        [](auto& c) -> auto& { return c.min_scale; }));
    k.push_back(keys::number_key<C>(Spec{.name = "max_scale",
                                         .doc = "The cap; none (inf) = no cap",
                                         .type = "X",
                                         .lo = 0,
                                         .lo_open = true,
                                         .allow_inf = true,
                                         .none = std::numeric_limits<double>::infinity()},
                                    [](auto& c) -> auto& { return c.max_scale; }));
    k.push_back(keys::integer_key<C>(
        count("hysteresis", "Overflows tolerated before a backoff, plus one (deepspeed, megatron; 1 = none)"),
        [](auto& c) -> auto& { return c.hysteresis; }));
    k.push_back(keys::bool_key<C>(
        Spec{.name = "consecutive_hysteresis",
             .doc = "deepspeed: refill the hysteresis on every clean step, not only on a growth",
             .type = "BOOL"},
        [](auto& c) -> auto& { return c.consecutive_hysteresis; }));
    k.push_back(keys::bool_key<C>(
        Spec{.name = "refuse_nonfinite_growth", .doc = "Keep the scale when growing would make it inf", .type = "BOOL"},
        [](auto& c) -> auto& { return c.refuse_nonfinite_growth; }));
    k.push_back(keys::enum_key<C>(
        Spec{.name = "floor_policy",
             .doc = "At the floor: continue (keep skipping steps) or error (ScaleCollapseError after "
                    "max_floor_overflows overflows in a row)",
             .type = "NAME",
             .choices = {std::string(floor_policy_name(FloorPolicy::keep_going)),
                         std::string(floor_policy_name(FloorPolicy::error))}},
        [](auto& c) -> auto& { return c.floor_policy; }, parse_floor_policy));
    k.push_back(keys::integer_key<C>(
        count("max_floor_overflows", "floor_policy error: the overflows in a row at the floor that raise"),
        [](auto& c) -> auto& { return c.max_floor_overflows; }));
    return k;
  }());
  return table;
}

}  // namespace

// ---- validation --------------------------------------------------------------

bool starting_scale_ok(double s) noexcept {
  return std::isfinite(s) && s > 0 && s <= kFloatMax && static_cast<float>(s) != 0.0f &&
         std::isfinite(1.0f / static_cast<float>(s));
}

void validate(const LossScaleConfig& c) {
  config_table().check(c);  // every field's range
  const std::string rule(rule_name(c.rule));
  if (holds_f32(c.rule)) {
    if (c.init_scale > kFloatMax || static_cast<float>(c.init_scale) == 0.0f)
      fail("init_scale: the " + rule + " rule holds the scale in float32; expected a value in (0, " + num(kFloatMax) +
           "] that does not round to 0, found " + num(c.init_scale));
  }
  if (c.min_scale > c.init_scale)
    fail("min_scale: expected min_scale <= init_scale, found min_scale " + num(c.min_scale) + " > init_scale " +
         num(c.init_scale));
  if (c.init_scale > c.max_scale)
    fail("max_scale: expected init_scale <= max_scale, found init_scale " + num(c.init_scale) + " > max_scale " +
         num(c.max_scale));
  if (c.rule == LossScaleRule::static_scale) return;  // the static rule uses init_scale only
  if (c.floor_policy == FloorPolicy::error && c.min_scale == 0)
    fail("floor_policy: 'error' needs a floor, but min_scale is 0 (none); set min_scale > 0 or floor_policy=continue");
  if (single_factor(c.rule) && c.backoff_factor != 1.0 / c.growth_factor)
    fail("backoff_factor: the " + rule + " rule has one factor (growth multiplies by it, backoff divides by it); "
         "expected 1/growth_factor = " + num(1.0 / c.growth_factor) + ", found " + num(c.backoff_factor));
  if (!has_hysteresis(c.rule) && c.hysteresis != 1)
    fail("hysteresis: the " + rule + " rule has no hysteresis (deepspeed and megatron have it); expected 1, found " +
         std::to_string(c.hysteresis));
  if (c.rule != LossScaleRule::deepspeed && c.consecutive_hysteresis)
    fail("consecutive_hysteresis: only the deepspeed rule has it; expected false, found true");
}

void validate(const LossScaleState& s) {
  validate(s.config);
  const LossScaleConfig& c = s.config;
  const LossScaleCounters& k = s.counters;
  const std::string rule(rule_name(c.rule));
  const bool dynamic = c.rule != LossScaleRule::static_scale;
  // scale
  if (std::isnan(s.scale) || s.scale < 0) fail("scale: expected a number > 0, found " + num(s.scale));
  if (s.scale == 0 && !(dynamic && c.min_scale == 0))
    fail("scale: 0 is reachable only by a dynamic rule without a floor; expected > 0, found 0");
  if (std::isinf(s.scale) && !(dynamic && !c.refuse_nonfinite_growth && std::isinf(c.max_scale)))
    fail("scale: inf is reachable only when refuse_nonfinite_growth is false and max_scale is inf; found inf");
  if (holds_f32(c.rule) && std::isfinite(s.scale) &&
      (s.scale > kFloatMax || static_cast<double>(static_cast<float>(s.scale)) != s.scale))
    fail("scale: the " + rule + " rule holds the scale in float32; " + num(s.scale) + " is not a float32 value");
  if (!dynamic && s.scale != in_rule_precision(c.rule, c.init_scale))
    fail("scale: a static scale equals init_scale (as float32) " + num(in_rule_precision(c.rule, c.init_scale)) +
         ", found " + num(s.scale));
  if (dynamic && c.min_scale > 0 && s.scale < in_rule_precision(c.rule, c.min_scale))
    fail("scale: expected >= min_scale " + num(c.min_scale) + ", found " + num(s.scale));
  if (dynamic && s.scale > in_rule_precision(c.rule, c.max_scale) && std::isfinite(c.max_scale))
    fail("scale: expected <= max_scale " + num(c.max_scale) + ", found " + num(s.scale));
  // counters
  auto range = [](const char* name, std::int64_t v, std::int64_t lo, std::int64_t hi) {
    if (v < lo || v > hi)
      fail(std::string("counters.") + name + ": expected an integer in [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "], found " + std::to_string(v));
  };
  constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max();
  range("steps", k.steps, 0, big);
  range("overflows", k.overflows, 0, k.steps);
  range("growths", k.growths, 0, k.steps - k.overflows);
  range("backoffs", k.backoffs, 0, k.overflows);
  range("floor_overflows", k.floor_overflows, 0, k.overflows);
  if (dynamic && c.floor_policy == FloorPolicy::error)
    range("floor_overflows", k.floor_overflows, 0, c.max_floor_overflows - 1);
  const bool tracker_used = dynamic && c.rule != LossScaleRule::deepspeed;
  range("growth_tracker", k.growth_tracker, 0, tracker_used ? c.growth_interval - 1 : 0);
  if (c.rule == LossScaleRule::deepspeed) {
    range("hysteresis_left", k.hysteresis_left, 1, c.hysteresis);
    range("iteration", k.iteration, 0, big);
    range("last_overflow_iter", k.last_overflow_iter, -1, k.iteration - 1);
  } else {
    if (c.rule == LossScaleRule::megatron)  // Megatron's tracker keeps counting down below 0
      range("hysteresis_left", k.hysteresis_left, c.hysteresis - k.overflows, c.hysteresis);
    else
      range("hysteresis_left", k.hysteresis_left, c.hysteresis, c.hysteresis);
    range("iteration", k.iteration, 0, 0);
    range("last_overflow_iter", k.last_overflow_iter, -1, -1);
  }
}

LossScaleState initial_loss_scale_state(const LossScaleConfig& config) {
  validate(config);
  LossScaleState s;
  s.config = config;
  s.scale = in_rule_precision(config.rule, config.init_scale);
  s.counters.hysteresis_left = config.hysteresis;
  return s;
}

// ---- the scales --------------------------------------------------------------

StaticLossScale::StaticLossScale(double scale) : StaticLossScale([scale] {
        LossScaleConfig c = loss_scale_preset("static");
        c.init_scale = scale;
        return c;
      }()) {}

namespace {
// The initial state, after the check that the class fits the rule.
LossScaleState initial_state_of(const LossScaleConfig& config, bool static_class) {
  if (static_class && config.rule != LossScaleRule::static_scale)
    fail("rule: StaticLossScale expects rule static, found " + std::string(rule_name(config.rule)) +
         " (use DynamicLossScale or make_loss_scale)");
  if (!static_class && config.rule == LossScaleRule::static_scale)
    fail("rule: DynamicLossScale expects a dynamic rule, found static (use StaticLossScale or make_loss_scale)");
  return initial_loss_scale_state(config);
}
}  // namespace

StaticLossScale::StaticLossScale(const LossScaleConfig& config) : LossScale(initial_state_of(config, true)) {}

void StaticLossScale::update(bool found_inf) {
  counters_.steps += 1;
  if (found_inf) counters_.overflows += 1;
}

void StaticLossScale::load(const LossScaleState& s) {
  if (s.config.rule != LossScaleRule::static_scale)
    fail("rule: a static loss scale loads only static states, found rule " + std::string(rule_name(s.config.rule)));
  validate(s);
  config_ = s.config;
  scale_ = s.scale;
  counters_ = s.counters;
}

DynamicLossScale::DynamicLossScale(const LossScaleConfig& config) : LossScale(initial_state_of(config, false)) {}

void DynamicLossScale::load(const LossScaleState& s) {
  if (s.config.rule == LossScaleRule::static_scale)
    fail("rule: a dynamic loss scale loads only dynamic states, found rule static");
  validate(s);
  config_ = s.config;
  scale_ = s.scale;
  counters_ = s.counters;
}

// Called in each rule's backoff branch, before the rule changes anything. Throws with the state
// untouched when the floor policy says the run is broken; otherwise counts overflows at the floor.
void DynamicLossScale::check_floor(double scale_before) {
  const bool at_floor = config_.min_scale > 0 && scale_before <= in_rule_precision(config_.rule, config_.min_scale);
  if (!at_floor) {
    counters_.floor_overflows = 0;
    return;
  }
  if (config_.floor_policy == FloorPolicy::error && counters_.floor_overflows + 1 >= config_.max_floor_overflows)
    throw ScaleCollapseError(collapse_message(config_, scale_before, counters_.steps + 1));
  counters_.floor_overflows += 1;
}

void DynamicLossScale::update(bool found_inf) {
  const LossScaleConfig& c = config_;
  LossScaleCounters& k = counters_;
  const bool refuse = c.refuse_nonfinite_growth;
  // Bounds and factors in the rule's precision.
  const double min_d = c.min_scale, max_d = c.max_scale;
  const float min_f = static_cast<float>(c.min_scale), max_f = static_cast<float>(c.max_scale);
  const float growth_f = static_cast<float>(c.growth_factor), backoff_f = static_cast<float>(c.backoff_factor);
  // The float32 rules' growth: scale * factor in float32, clamped to the maximum; into inf
  // only where the knob allows it.
  auto grow_f32 = [&](float scale) {
    const float n = scale * growth_f;
    if (std::isfinite(n) || !refuse) {
      scale_ = std::min(n, max_f);
      k.growths += 1;
    }
  };

  switch (c.rule) {
    case LossScaleRule::torch: {
      // float32 scale; factor arithmetic in double, rounded to float (torch's _amp_update_scale_).
      const float scale = static_cast<float>(scale_);
      if (found_inf) {
        check_floor(scale_);
        float n = static_cast<float>(static_cast<double>(scale) * c.backoff_factor);
        if (c.min_scale > 0) n = std::max(n, min_f);  // mixprec extension: floor
        scale_ = n;
        k.growth_tracker = 0;
        k.backoffs += 1;
      } else {
        const std::int64_t t = k.growth_tracker + 1;
        if (t == c.growth_interval) {
          const float n = static_cast<float>(static_cast<double>(scale) * c.growth_factor);
          if (std::isfinite(n) || !refuse) {
            scale_ = std::min(n, max_f);
            k.growths += 1;
          }
          k.growth_tracker = 0;
        } else {
          k.growth_tracker = t;
        }
        k.floor_overflows = 0;
      }
      break;
    }
    case LossScaleRule::deepspeed: {
      // Python float (double) scale; one factor; iteration-based window; hysteresis.
      if (found_inf) {
        if (c.hysteresis == 1 || k.hysteresis_left == 1) {
          check_floor(scale_);  // raise_error_at_min_scale
          scale_ = std::max(scale_ / c.growth_factor, min_d);
          k.backoffs += 1;
        } else {
          k.hysteresis_left -= 1;
        }
        k.last_overflow_iter = k.iteration;
      } else {
        if (c.consecutive_hysteresis) k.hysteresis_left = c.hysteresis;
        const std::int64_t stable = k.iteration - k.last_overflow_iter - 1;
        if (stable > 0 && stable % c.growth_interval == 0) {
          if (!c.consecutive_hysteresis) k.hysteresis_left = c.hysteresis;
          const double n = scale_ * c.growth_factor;
          if (std::isfinite(n) || !refuse) {
            scale_ = std::min(n, max_d);
            k.growths += 1;
          }
        }
        k.floor_overflows = 0;
      }
      k.iteration += 1;
      break;
    }
    case LossScaleRule::megatron: {
      // float32 tensors for scale, factors and min; hysteresis tracker refilled on growth.
      const float scale = static_cast<float>(scale_);
      if (found_inf) {
        const std::int64_t h = k.hysteresis_left - 1;
        if (h <= 0) check_floor(scale_);
        k.growth_tracker = 0;
        k.hysteresis_left = h;
        if (h <= 0) {
          scale_ = std::max(scale * backoff_f, min_f);
          k.backoffs += 1;
        }
      } else {
        k.growth_tracker += 1;
        if (k.growth_tracker == c.growth_interval) {
          k.growth_tracker = 0;
          k.hysteresis_left = c.hysteresis;
          grow_f32(scale);
        }
        k.floor_overflows = 0;
      }
      break;
    }
    case LossScaleRule::apex: {
      // Python float (double); min only when set; growth clamped to max (2^24 by default).
      if (found_inf) {
        check_floor(scale_);
        scale_ = c.min_scale > 0 ? std::max(min_d, scale_ / c.growth_factor) : scale_ / c.growth_factor;
        k.growth_tracker = 0;  // _unskipped
        k.backoffs += 1;
      } else {
        k.growth_tracker += 1;
        k.floor_overflows = 0;
      }
      if (k.growth_tracker == c.growth_interval) {
        const double n = scale_ * c.growth_factor;
        if (std::isfinite(n) || !refuse) {
          scale_ = std::min(max_d, n);
          k.growths += 1;
        }
        k.growth_tracker = 0;
      }
      break;
    }
    case LossScaleRule::keras: {
      // Keras 3 LossScaleOptimizer: float32 variable dynamic_scale, integer step_counter.
      // Finite grads: if step_counter == dynamic_growth_steps - 1, scale * 2 (in float32, may
      // become inf: no guard) and counter 0; else counter + 1. Non-finite: counter 0, scale * 0.5
      // (no floor: below 1, through the subnormals, to 0; inf * 0.5 stays inf). min_scale,
      // max_scale and refuse_nonfinite_growth are mixprec's knobs, off in the preset.
      const float scale = static_cast<float>(scale_);
      if (!found_inf) {
        if (k.growth_tracker == c.growth_interval - 1) {
          grow_f32(scale);
          k.growth_tracker = 0;
        } else {
          k.growth_tracker += 1;
        }
        k.floor_overflows = 0;
      } else {
        check_floor(scale_);
        k.growth_tracker = 0;
        float n = scale / growth_f;  // Keras 3: scale * 0.5, the same float32 value for factor 2
        if (c.min_scale > 0) n = std::max(n, min_f);
        scale_ = n;
        k.backoffs += 1;
      }
      break;
    }
    case LossScaleRule::tf_keras: {
      // tf.keras / Keras 2: float32 variable; counter + 1 >= growth_steps; growth only into a
      // finite value; backoff max(scale / multiplier, 1).
      const float scale = static_cast<float>(scale_);
      if (!found_inf) {
        if (k.growth_tracker + 1 >= c.growth_interval) {
          grow_f32(scale);
          k.growth_tracker = 0;
        } else {
          k.growth_tracker += 1;
        }
        k.floor_overflows = 0;
      } else {
        check_floor(scale_);
        k.growth_tracker = 0;
        scale_ = std::max(scale / growth_f, min_f);
        k.backoffs += 1;
      }
      break;
    }
    case LossScaleRule::jmp: {
      // float32 array; counter modulo period; first_finite(scale * factor, scale).
      const float scale = static_cast<float>(scale_);
      if (!found_inf) {
        if (k.growth_tracker == c.growth_interval - 1) {
          grow_f32(scale);
        }
        k.floor_overflows = 0;
      } else {
        check_floor(scale_);
        scale_ = std::max(min_f, scale / growth_f);
        k.backoffs += 1;
      }
      k.growth_tracker = !found_inf ? (k.growth_tracker + 1) % c.growth_interval : 0;
      break;
    }
    case LossScaleRule::static_scale:
      fail("rule: DynamicLossScale cannot run rule static");
  }
  k.steps += 1;
  if (found_inf) k.overflows += 1;
}

std::unique_ptr<LossScale> make_loss_scale(const LossScaleConfig& config) {
  if (config.rule == LossScaleRule::static_scale) return std::make_unique<StaticLossScale>(config);
  return std::make_unique<DynamicLossScale>(config);
}

// ---- JSON --------------------------------------------------------------------

namespace {

using nlohmann::json;

// Reads the fields of one JSON object, each exactly once, and rejects unknown keys at the end.
class Fields {
 public:
  // `what` opens every message ("loss-scale state: "; "" for a config alone, whose caller names it).
  Fields(const json& j, std::string prefix, std::string what = "loss-scale state: ")
      : j_(j), prefix_(std::move(prefix)), what_(std::move(what)) {
    if (!j_.is_object()) fail(where("") + "expected an object, found " + std::string(j_.type_name()));
  }
  const json& get(const std::string& key) {
    const auto it = j_.find(key);
    if (it == j_.end()) fail(where(key) + "missing");
    seen_.push_back(key);
    return *it;
  }
  // An integer in the grammar of every key (2, 2.0, 2e3; keys::json_integer).
  std::int64_t integer(const std::string& key) {
    const json& v = get(key);
    const auto i = keys::json_integer(v);
    if (!i) fail(where(key) + "expected an integer, found " + keys::describe(v));
    constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    if (i->magnitude > kMax + (i->negative ? 1 : 0)) fail(where(key) + "expected a 64-bit integer, found " + v.dump());
    return i->negative ? -static_cast<std::int64_t>(i->magnitude - 1) - 1 : static_cast<std::int64_t>(i->magnitude);
  }
  std::string text(const std::string& key) {
    const json& v = get(key);
    if (!v.is_string()) fail(where(key) + "expected a string, found " + v.dump());
    return v.get<std::string>();
  }
  void no_others() const {
    for (const auto& item : j_.items())
      if (std::find(seen_.begin(), seen_.end(), item.key()) == seen_.end())
        fail(where(item.key()) + "unknown field");
  }
  std::string where(const std::string& key) const {
    std::string path = prefix_ + key;
    if (!path.empty() && path.back() == '.') path.pop_back();
    return what_ + path + (path.empty() ? "" : ": ");
  }

 private:
  const json& j_;
  std::string prefix_;
  std::string what_;
  std::vector<std::string> seen_;
};


}  // namespace

const std::vector<std::string>& loss_scale_config_keys() {
  static const std::vector<std::string> names = config_table().names();
  return names;
}

void set(LossScaleConfig& c, std::string_view key, std::string_view value) {
  config_table().set_text(c, key, value);
  // The one-factor rules keep backoff = 1/growth (a text override of the factor means both).
  if (key == "growth_factor" && single_factor(c.rule)) c.backoff_factor = 1.0 / c.growth_factor;
}

std::string describe(const LossScaleConfig& c) {
  std::string s;
  for (const auto& k : config_table().keys()) s.append(k.spec.name).append(" = ").append(keys::text_of(k.spec, k.get(c))).append("\n");
  return s;
}

std::string loss_scale_config_json(const LossScaleConfig& c) { return config_table().to_json<json>(c).dump(); }

namespace {

// Every field of the config object `f` reads, in table order; the key table's messages
// ("KEY: expected ...") prefixed by `prefix`.
LossScaleConfig read_config_fields(Fields& f, const std::string& prefix) {
  LossScaleConfig c;
  for (const auto& k : config_table().keys()) {
    const json& v = f.get(k.spec.name);
    try {
      config_table().set_json(c, k, v);
    } catch (const std::invalid_argument& e) {
      fail(prefix + e.what());
    }
  }
  f.no_others();
  return c;
}

}  // namespace

LossScaleConfig loss_scale_config_from_json(std::string_view text) {
  const json j = io::parse_json(text, "");
  Fields f(j, "", "");
  LossScaleConfig c = read_config_fields(f, "");
  validate(c);
  return c;
}

std::string LossScaleState::to_json() const {
  json j = json::object();
  j["format"] = "mixprec.loss_scale";
  j["version"] = 1;
  j["config"] = config_table().to_json<json>(config);
  j["scale"] = std::isinf(scale) ? json("inf") : json(scale);
  json k = json::object();
  k["steps"] = counters.steps;
  k["overflows"] = counters.overflows;
  k["growths"] = counters.growths;
  k["backoffs"] = counters.backoffs;
  k["growth_tracker"] = counters.growth_tracker;
  k["hysteresis_left"] = counters.hysteresis_left;
  k["iteration"] = counters.iteration;
  k["last_overflow_iter"] = counters.last_overflow_iter;
  k["floor_overflows"] = counters.floor_overflows;
  j["counters"] = k;
  return j.dump();
}

LossScaleState LossScaleState::from_json(std::string_view text) {
  const json j = io::parse_json(text, "loss-scale state");
  Fields top(j, "");
  const std::string format = top.text("format");
  if (format != "mixprec.loss_scale")
    fail("loss-scale state: format: expected \"mixprec.loss_scale\", found \"" + format + "\"");
  const std::int64_t version = top.integer("version");
  if (version != 1) fail("loss-scale state: version: expected 1, found " + std::to_string(version));

  LossScaleState s;
  Fields cf(top.get("config"), "config.");
  s.config = read_config_fields(cf, "loss-scale state: config.");

  const json& sc = top.get("scale");
  if (sc.is_string() && sc.get<std::string>() == "inf") {
    s.scale = kInf;
  } else if (sc.is_number()) {
    s.scale = sc.get<double>();
  } else {
    fail("loss-scale state: scale: expected a number or \"inf\", found " + sc.dump());
  }

  Fields kf(top.get("counters"), "counters.");
  s.counters.steps = kf.integer("steps");
  s.counters.overflows = kf.integer("overflows");
  s.counters.growths = kf.integer("growths");
  s.counters.backoffs = kf.integer("backoffs");
  s.counters.growth_tracker = kf.integer("growth_tracker");
  s.counters.hysteresis_left = kf.integer("hysteresis_left");
  s.counters.iteration = kf.integer("iteration");
  s.counters.last_overflow_iter = kf.integer("last_overflow_iter");
  s.counters.floor_overflows = kf.integer("floor_overflows");
  kf.no_others();
  top.no_others();

  try {
    validate(s);
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    if (what.rfind("counters.", 0) == 0 || what.rfind("scale", 0) == 0) fail("loss-scale state: " + what);
    fail("loss-scale state: config." + what);
  }
  return s;
}

}  // namespace mixprec
