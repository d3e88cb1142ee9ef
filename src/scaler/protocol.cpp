// The loss-scaling protocol (scaler/protocol.hpp): stages, windows, found_inf aggregation,
// the skip decision, the next scale, the state format and every misuse message.
#include "mixprec/scaler/protocol.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include "mixprec/core/json_read.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/optim/clip.hpp"

namespace mixprec {
namespace {

using json = nlohmann::json;

constexpr std::string_view kStateFormat = "mixprec.grad_scaler";
constexpr int kStateVersion = 2;
constexpr std::int64_t kMaxWindow = std::int64_t{1} << 30;
constexpr std::string_view kLayerwisePreset = "layerwise";

// The doors that differ on purpose: this table and kMisuseTable's two text columns.
constexpr DialectRules kDialects[] = {
    {Dialect::mixprec, "unscale()", true},
    {Dialect::torch, "unscale_()", false},
};

// Every misuse message, in both wordings. {call}, {done} and {k} are filled in; torch's
// column is torch.amp.GradScaler's own text where torch has the misuse, mixprec's where it
// has not (accumulation windows are mixprec's).
struct MisuseText {
  Misuse kind;
  std::string_view name;
  PythonError python;
  std::string_view mixprec_text;
  std::string_view torch_text;
};
constexpr MisuseText kMisuseTable[] = {
    {Misuse::unscale_twice, "unscale_twice", PythonError::runtime_error,
     "unscale() has already been called on this optimizer since the last update()",
     "unscale_() has already been called on this optimizer since the last update()."},
    {Misuse::unscale_after_step, "unscale_after_step", PythonError::runtime_error,
     "unscale() is being called after step()", "unscale_() is being called after step()."},
    {Misuse::step_twice, "step_twice", PythonError::runtime_error,
     "step() has already been called since the last update()",
     "step() has already been called since the last update()."},
    {Misuse::step_without_checks, "step_without_checks", PythonError::assertion_error,
     "No inf checks were recorded for this optimizer: none of its parameters has a gradient",
     "No inf checks were recorded for this optimizer."},
    {Misuse::update_without_checks, "update_without_checks", PythonError::assertion_error,
     "No inf checks were recorded prior to update()", "No inf checks were recorded prior to update."},
    {Misuse::window_incomplete, "window_incomplete", PythonError::runtime_error,
     "{call} after {done} of {k} backward passes of the accumulation window: one scale holds for the whole "
     "window; unscale, step and update once, at its end",
     "{call} after {done} of {k} backward passes of the accumulation window: one scale holds for the whole "
     "window; unscale_, step and update once, at its end"},
    {Misuse::window_overrun, "window_overrun", PythonError::runtime_error,
     "backward_done() called {done} times in an accumulation window of {k}; call step() and update() at the "
     "window's end",
     "backward_done() called {done} times in an accumulation window of {k}; call step() and update() at the "
     "window's end"},
    {Misuse::backward_after_step, "backward_after_step", PythonError::runtime_error,
     "backward_done() after unscale() or step() and before update(): a new window starts after update()",
     "backward_done() after unscale_() or step() and before update(): a new window starts after update()"},
    {Misuse::window_resized, "window_resized", PythonError::runtime_error,
     "set_accumulation_steps() in the middle of an accumulation window ({done} backward passes done)",
     "set_accumulation_steps() in the middle of an accumulation window ({done} backward passes done)"},
    {Misuse::load_mid_step, "load_mid_step", PythonError::runtime_error,
     "{call} in the middle of a step: an optimizer is {stage}; load before the step or after update()",
     "{call} in the middle of a step: an optimizer is {stage}; call it before scale()/step() or after update()"},
    {Misuse::load_mid_window, "load_mid_window", PythonError::runtime_error,
     "{call} in the middle of an accumulation window", "{call} in the middle of an accumulation window"},
    {Misuse::load_empty_state, "load_empty_state", PythonError::runtime_error,
     "the scaler state is empty, possibly because it was saved from a disabled GradScaler",
     "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."},
};

const MisuseText& misuse_text(Misuse m) {
  for (const MisuseText& t : kMisuseTable)
    if (t.kind == m) return t;
  throw std::logic_error("misuse_text: unknown misuse");
}

std::string fill(std::string_view pattern, std::string_view key, const std::string& value) {
  std::string s(pattern);
  std::string mark(1, '{');
  mark.append(key).push_back('}');
  for (auto at = s.find(mark); at != std::string::npos; at = s.find(mark, at + value.size())) s.replace(at, mark.size(), value);
  return s;
}

[[noreturn]] void bad_state(const std::string& what) { throw std::invalid_argument("GradScaler state: " + what); }

const char* const kTorchKeys[] = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"};

bool has_torch_keys(const json& j) {
  return std::all_of(std::begin(kTorchKeys), std::end(kTorchKeys), [&](const char* k) { return j.contains(k); });
}

double number_field(const json& j, const char* key) {
  const json& v = j.at(key);
  if (v.is_boolean() || !v.is_number()) bad_state(std::string("field '") + key + "' must be a number");
  return v.get<double>();
}

std::int64_t integer_field(const json& j, const char* key, std::int64_t lo, std::int64_t hi) {
  const json& v = j.at(key);
  // torch keeps growth_interval and _growth_tracker as Python ints; a float holding an integer is taken.
  if (v.is_boolean() || !v.is_number() || (v.is_number_float() && std::floor(v.get<double>()) != v.get<double>()))
    bad_state(std::string("field '") + key + "' must be an integer");
  const double d = v.get<double>();
  if (!(d >= static_cast<double>(lo) && d <= static_cast<double>(hi)))
    bad_state(std::string("field '") + key + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
              "], found " + v.dump());
  return v.is_number_float() ? static_cast<std::int64_t>(d) : v.get<std::int64_t>();
}

// The number a state writes for a scale: JSON has no inf (the Keras rule reaches it).
json scale_value(double s) { return std::isinf(s) ? json("inf") : json(s); }

// A state with torch's keys next to mixprec's (format 2, or the Python adapter's first
// format): the two must say the same, or a hand edit of one would be ignored silently.
void check_torch_keys_agree(const json& j, const LossScaleState& s, const char* where) {
  const auto differ = [&](const char* key, const json& mine) {
    bad_state(std::string("field '") + key + "' is " + j[key].dump() + " but " + where + " says " + mine.dump() +
              ": the torch keys and mixprec's state disagree (one was edited?); make them agree, or give "
              "torch.amp's five keys alone");
  };
  if (j.contains("scale")) {
    const json mine = scale_value(static_cast<double>(static_cast<float>(s.scale)));
    const json& v = j["scale"];
    const bool same = v.is_number() && mine.is_number() ? v.get<double>() == mine.get<double>() : v == mine;
    if (!same) differ("scale", mine);
  }
  const auto number = [&](const char* key, double mine) {
    if (j.contains(key) && !(j[key].is_number() && j[key].get<double>() == mine)) differ(key, json(mine));
  };
  number("growth_factor", s.config.growth_factor);
  number("backoff_factor", s.config.backoff_factor);
  number("growth_interval", static_cast<double>(s.config.growth_interval));
  number("_growth_tracker", static_cast<double>(s.counters.growth_tracker));
}

}  // namespace

std::string_view stage_name(OptimizerStage s) noexcept {
  switch (s) {
    case OptimizerStage::ready: return "ready";
    case OptimizerStage::unscaled: return "unscaled";
    case OptimizerStage::stepped: return "stepped";
  }
  return "?";
}

std::string_view dialect_name(Dialect d) noexcept { return d == Dialect::torch ? "torch" : "mixprec"; }

const DialectRules& dialect_rules(Dialect d) noexcept { return d == Dialect::torch ? kDialects[1] : kDialects[0]; }

std::string_view misuse_name(Misuse m) noexcept {
  for (const MisuseText& t : kMisuseTable)
    if (t.kind == m) return t.name;
  return "?";
}

PythonError python_error(Misuse m) noexcept {
  for (const MisuseText& t : kMisuseTable)
    if (t.kind == m) return t.python;
  return PythonError::runtime_error;
}

LossScaleConfig make_loss_scale_config(std::string_view preset,
                                       const std::vector<std::pair<std::string, std::string>>& overrides) {
  const LossScaleConfig base = loss_scale_preset(preset);
  // The static preset is a scale someone chose: without init_scale it would be 1 silently
  // (mixprec train refuses --loss-scale static for the same reason).
  if (base.rule == LossScaleRule::static_scale &&
      std::none_of(overrides.begin(), overrides.end(), [](const auto& kv) { return kv.first == "init_scale"; }))
    throw std::invalid_argument("init_scale: the static preset needs its scale: give init_scale=S (S > 0), as "
                                "--loss-scale static:S");
  return make_loss_scale_config(base, preset, overrides);
}

LossScaleConfig make_loss_scale_config(const LossScaleConfig& base, std::string_view preset,
                                       const std::vector<std::pair<std::string, std::string>>& overrides) {
  LossScaleConfig config = base;
  const auto& keys = loss_scale_config_keys();
  for (const auto& [k, v] : overrides) {
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) set(config, k, v);  // throws, listing the keys
  }
  for (const std::string& key : keys)
    for (const auto& [k, v] : overrides)
      if (k == key) set(config, k, v);
  // A chosen starting scale (not a stored one, which a backoff may have reached) must unscale.
  const bool chosen = std::any_of(overrides.begin(), overrides.end(), [](const auto& kv) { return kv.first == "init_scale"; });
  if (chosen && !starting_scale_ok(config.init_scale))
    throw std::invalid_argument("init_scale: expected a number > 0 whose reciprocal float32 holds (the unscale "
                                "multiplies by 1/S, and a smaller S skips every step): S in " +
                                std::string(kStartingScaleRange) + ", found " + text::num(config.init_scale));
  try {
    validate(config);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(e.what()) + " (preset " + std::string(preset) + " with the overrides)");
  }
  return config;
}

ScalerProtocol::ScalerProtocol(const LossScaleConfig& config, bool enabled, Dialect dialect, std::string preset)
    : ScalerProtocol(make_loss_scale(config), enabled, dialect, std::move(preset)) {}

ScalerProtocol::ScalerProtocol(std::unique_ptr<LossScale> scale, bool enabled, Dialect dialect, std::string preset)
    : scale_(std::move(scale)), enabled_(enabled), dialect_(dialect), preset_(std::move(preset)) {
  if (!scale_) throw std::invalid_argument("GradScaler: the loss scale is null");
  if (preset_ == kLayerwisePreset) layerwise_.emplace();
}

std::string ScalerProtocol::run_spec() const {
  if (!enabled_) return "none";
  if (scale_->config().rule == LossScaleRule::static_scale) return "static:" + text::num(scale_->scale());
  return preset_.empty() ? "dynamic" : preset_;
}

float ScalerProtocol::scale() const noexcept { return enabled_ ? scale_->scale() : 1.0f; }

std::string_view ScalerProtocol::text_of(Misuse m) const {
  const MisuseText& t = misuse_text(m);
  return dialect_ == Dialect::torch ? t.torch_text : t.mixprec_text;
}

void ScalerProtocol::misuse(Misuse m, const std::string& detail) const {
  throw ScalerMisuse(m, detail.empty() ? std::string(text_of(m)) : detail);
}

std::string ScalerProtocol::call_name(std::string_view call) const {
  return call == "unscale" ? std::string(dialect_rules(dialect_).unscale_call) : std::string(call);
}

void ScalerProtocol::require_window_complete(std::string_view call) const {
  if (window_steps_ > 1 && window_passes_ != window_steps_) {
    std::string s = fill(text_of(Misuse::window_incomplete), "call", call_name(call));
    s = fill(s, "done", std::to_string(window_passes_));
    misuse(Misuse::window_incomplete, fill(s, "k", std::to_string(window_steps_)));
  }
}

OptimizerStage ScalerProtocol::stage(OptimizerId id) const noexcept {
  const auto it = records_.find(id);
  return it == records_.end() ? OptimizerStage::ready : it->second.stage;
}

bool ScalerProtocol::between_steps() const noexcept {
  for (const auto& [id, r] : records_)
    if (r.stage != OptimizerStage::ready) return false;
  return window_passes_ == 0;
}

void ScalerProtocol::begin_unscale(OptimizerId id) const {
  // Disabled: nothing to unscale, the door does nothing; unless guarded, when the door checks
  // here as an enabled one does (a clip after unscale then sees the guards' norm first).
  if (!enabled_ && !guard_.any()) return;
  const OptimizerStage s = stage(id);
  if (s == OptimizerStage::unscaled) misuse(Misuse::unscale_twice);
  if (s == OptimizerStage::stepped) misuse(Misuse::unscale_after_step);
  if (enabled_) require_window_complete("unscale");
}

StepPlan ScalerProtocol::begin_step(OptimizerId id) const {
  if (!enabled_ && !dialect_rules(dialect_).disabled_checks_gradients && !guard_.any()) return StepPlan::pass_through;
  const OptimizerStage s = stage(id);
  if (s == OptimizerStage::stepped) misuse(Misuse::step_twice);
  if (enabled_) require_window_complete("step()");
  return s == OptimizerStage::ready ? StepPlan::check : StepPlan::step_only;
}

void ScalerProtocol::record(OptimizerId id, const GradientCheck& check) {
  GradientCheck c = check;
  if (agree_) {
    const RankFlags all = agree_({c.found_inf, c.checked});
    c.found_inf = c.found_inf || all.found_inf;
    c.checked = c.checked || all.checked;
  }
  const bool fresh = records_.find(id) == records_.end();
  const std::size_t order = records_.size();
  Record& r = records_[id];
  if (fresh) r.order = order;
  r.check = c;
  r.stage = OptimizerStage::unscaled;
}

void ScalerProtocol::validate_options(const DecideOptions& options) {
  if (options.max_grad_norm && !(std::isfinite(*options.max_grad_norm) && *options.max_grad_norm > 0.0f)) {
    throw std::invalid_argument("GradScaler::step: max_grad_norm " + text::num(*options.max_grad_norm) +
                                " is not allowed; it must be finite and > 0");
  }
}

GuardView ScalerProtocol::guard_view(OptimizerId id, const DecideOptions& options) const {
  const auto it = records_.find(id);
  if (it == records_.end() || it->second.stage != OptimizerStage::unscaled)
    throw std::logic_error("GradScaler protocol: guard_view() before the optimizer's gradients were checked");
  const Record& r = it->second;
  if (r.seen) return *r.seen;
  GuardView v;
  v.grad_norm = options.global_grad_norm ? *options.global_grad_norm : std::sqrt(r.check.sum_squares);
  if (step_loss_) v.loss = *step_loss_;
  if (!guard_.spikes()) return v;
  if (step_loss_) v.loss_z = step_loss_z_ ? *step_loss_z_ : loss_detector_.peek(*step_loss_);
  // No detector yet for this optimizer: its window is empty, so no z-score (and no allocation).
  if (r.order < grad_detectors_.size()) v.grad_z = grad_detectors_[r.order].peek(v.grad_norm);
  return v;
}

namespace {
// llm.c's test: the z-score as a float, finite and above a threshold that is on.
bool spike(double z, double threshold) {
  const float zf = static_cast<float>(z);
  return threshold > 0 && std::isfinite(zf) && zf > static_cast<float>(threshold);
}
}  // namespace

StepDecision ScalerProtocol::decide(OptimizerId id, const DecideOptions& options) {
  validate_options(options);
  const auto it = records_.find(id);
  if (it == records_.end() || it->second.stage != OptimizerStage::unscaled)
    throw std::logic_error("GradScaler protocol: decide() before the optimizer's gradients were checked");
  const GradientCheck& c = it->second.check;
  if (!c.checked) misuse(Misuse::step_without_checks);
  StepDecision d;
  d.scale = scale();
  d.first_overflow = c.first_overflow;
  d.carried_inv_scale = c.carried_inv_scale;
  d.grad_norm = std::sqrt(c.sum_squares);
  d.found_inf = c.found_inf || options.found_inf_elsewhere;
  if (options.global_grad_norm) d.grad_norm = *options.global_grad_norm;
  // A finite check whose norm is not: stepping would write inf into the weights.
  d.found_inf = d.found_inf || !std::isfinite(d.grad_norm);
  if (!d.found_inf && options.max_grad_norm) {
    d.clip_coef = clip_coefficient(d.grad_norm, *options.max_grad_norm);
    d.clip_pending = true;
  }
  if (it->second.clipped) {
    d.clip_coef = it->second.clipped->first;
    d.grad_norm = it->second.clipped->second;
    d.clip_pending = false;
  }
  // The guards: fed once per optimizer and step (the loss once per step), in llm.c's order
  // (the value is pushed, then judged against the window that holds it).
  Record& r = it->second;
  if (!r.seen) {
    GuardView v = guard_view(id, options);
    if (guard_.spikes()) {
      if (step_loss_ && !step_loss_z_) step_loss_z_ = loss_detector_.push(*step_loss_);
      if (step_loss_z_) v.loss_z = *step_loss_z_;
      while (grad_detectors_.size() <= r.order) grad_detectors_.emplace_back(guard_.window);
      v.grad_z = grad_detectors_[r.order].push(v.grad_norm);
    }
    r.seen = v;
  }
  d.guard = *r.seen;
  if (d.found_inf) d.reason = SkipReason::nonfinite_grad;
  else if (step_loss_ && !std::isfinite(*step_loss_)) d.reason = SkipReason::nonfinite_loss;
  else if (spike(d.guard.loss_z, guard_.loss_z)) d.reason = SkipReason::loss_spike;
  else if (spike(d.guard.grad_z, guard_.grad_z)) d.reason = SkipReason::grad_spike;
  else if (options.user_skip) d.reason = SkipReason::user;
  d.apply = d.reason == SkipReason::none;
  if (!d.apply) d.clip_pending = false;
  return d;
}

void ScalerProtocol::set_guard(const GuardConfig& config) {
  validate(config);
  require_between_steps();
  if (config.window != guard_.window || !config.spikes()) {
    loss_detector_ = ZScoreDetector(config.window);
    grad_detectors_.clear();
  }
  guard_ = config;
}

void ScalerProtocol::observe_loss(double loss) {
  if (step_loss_z_) return;  // already fed to the detector: this step's loss is decided
  step_loss_ = loss;
}

void ScalerProtocol::end_guard_step() noexcept {
  step_loss_.reset();
  step_loss_z_.reset();
}

void ScalerProtocol::clip_applied(OptimizerId id, float clip_coef, double grad_norm) {
  const auto it = records_.find(id);
  if (it == records_.end() || it->second.stage != OptimizerStage::unscaled)
    throw std::logic_error("GradScaler protocol: clip_applied() before the optimizer's gradients were checked");
  it->second.clipped = std::make_pair(clip_coef, grad_norm);
}

void ScalerProtocol::step_done(OptimizerId id) {
  if (keeps_records()) {
    records_[id].stage = OptimizerStage::stepped;
  } else {
    records_.erase(id);  // a disabled scaler keeps no records: update() has nothing to do
  }
}

void ScalerProtocol::update() {
  if (!enabled_) {  // no scale; a guarded scaler's step ends here
    records_.clear();
    end_guard_step();
    return;
  }
  require_window_complete("update()");
  bool any_checked = false, found_inf = false;
  for (const auto& [id, r] : records_) {
    if (r.stage == OptimizerStage::ready || !r.check.checked) continue;
    any_checked = true;
    found_inf = found_inf || r.check.found_inf;
  }
  if (!any_checked) misuse(Misuse::update_without_checks);
  records_.clear();  // the step is over even if the scale throws
  end_guard_step();
  window_passes_ = 0;
  if (layerwise_) layerwise_->update();
  scale_->update(found_inf);  // may throw ScaleCollapseError (the scale stays as it was)
}

void ScalerProtocol::update_to(double new_scale) {
  if (!enabled_) return;
  LossScaleState s = scale_->state();
  s.scale = s.config.rule == LossScaleRule::deepspeed || s.config.rule == LossScaleRule::apex
                ? new_scale
                : static_cast<double>(static_cast<float>(new_scale));
  if (s.config.rule == LossScaleRule::static_scale) s.config.init_scale = s.scale;
  scale_->load(s);  // validates: std::invalid_argument naming the scale, nothing changed
  records_.clear();
  end_guard_step();
  window_passes_ = 0;
  if (layerwise_) layerwise_->update();
}

float ScalerProtocol::next_scale() const {
  if (!enabled_) return 1.0f;
  bool any = false, found_inf = false;
  for (const auto& [id, r] : records_) {
    if (r.stage == OptimizerStage::ready || !r.check.checked) continue;
    any = true;
    found_inf = found_inf || r.check.found_inf;
  }
  if (!any) return scale_->scale();
  auto copy = make_loss_scale(scale_->config());
  copy->load(scale_->state());
  try {
    copy->update(found_inf);
  } catch (const ScaleCollapseError&) {
    // update() will throw it; the scale stays.
  }
  return copy->scale();
}

void ScalerProtocol::set_accumulation_steps(int k) {
  if (k < 1) throw std::invalid_argument("accumulation steps " + std::to_string(k) + " is not allowed; it must be >= 1");
  if (window_passes_ != 0) {
    misuse(Misuse::window_resized, fill(text_of(Misuse::window_resized), "done", std::to_string(window_passes_)));
  }
  window_steps_ = k;
}

void ScalerProtocol::backward_done() {
  if (!enabled_) return;  // a disabled scaler keeps no window (update() does nothing either)
  for (const auto& [id, r] : records_)
    if (r.stage != OptimizerStage::ready) misuse(Misuse::backward_after_step);
  if (window_passes_ == window_steps_) {
    const std::string s = fill(text_of(Misuse::window_overrun), "done", std::to_string(window_passes_ + 1));
    misuse(Misuse::window_overrun, fill(s, "k", std::to_string(window_steps_)));
  }
  ++window_passes_;
}

void ScalerProtocol::require_between_steps() const {
  const std::string call = dialect_ == Dialect::torch ? "load_state_dict()" : "load_state_json()";
  for (const auto& [id, r] : records_) {
    if (r.stage != OptimizerStage::ready) {
      const std::string s = fill(text_of(Misuse::load_mid_step), "call", call);
      misuse(Misuse::load_mid_step, fill(s, "stage", std::string(stage_name(r.stage))));
    }
  }
  if (window_passes_ != 0) {
    misuse(Misuse::load_mid_window, fill(text_of(Misuse::load_mid_window), "call", call));
  }
}

void ScalerProtocol::reconfigure(std::string_view key, std::string_view value) {
  LossScaleState s = scale_->state();
  set(s.config, key, value);  // the config in force now, not the one the scaler was built with
  validate(s.config);
  if (s.counters.growth_tracker >= s.config.growth_interval) s.counters.growth_tracker = s.config.growth_interval - 1;
  auto fresh = make_loss_scale(s.config);
  fresh->load(s);
  scale_ = std::move(fresh);
}

std::string ScalerProtocol::state_json() const {
  const LossScaleState s = scale_->state();
  json j = json::object();
  // torch.amp.GradScaler's keys first: its load_state_dict reads exactly these.
  j["scale"] = scale_value(static_cast<double>(scale_->scale()));
  j["growth_factor"] = s.config.growth_factor;
  j["backoff_factor"] = s.config.backoff_factor;
  j["growth_interval"] = s.config.growth_interval;
  j["_growth_tracker"] = s.counters.growth_tracker;
  j["format"] = kStateFormat;
  j["version"] = kStateVersion;
  j["enabled"] = enabled_;
  j["preset"] = preset_;
  j["accumulation_steps"] = window_steps_;
  j["loss_scale"] = json::parse(s.to_json());
  if (layerwise_) j["layerwise"] = json::parse(layerwise_->to_json());
  if (guard_.any()) {
    json g = json::object();
    g["config"] = json::parse(guard_config_json(guard_));
    g["loss"] = json::parse(loss_detector_.to_json());
    g["grad"] = json::array();
    for (const ZScoreDetector& d : grad_detectors_) g["grad"].push_back(json::parse(d.to_json()));
    j["guard"] = g;
  }
  return j.dump();
}

void ScalerProtocol::load_state_json(std::string_view text) {
  require_between_steps();
  json j;
  try {
    j = io::parse_json(text, "");
  } catch (const std::invalid_argument& e) {
    bad_state(e.what());
  }
  if (!j.is_object()) bad_state("expected a JSON object");
  if (j.empty()) misuse(Misuse::load_empty_state);

  bool enabled = enabled_;
  int window = window_steps_;
  std::string preset = preset_;
  LossScaleState state;
  std::optional<LayerwiseScales> layerwise;  // the state's per-layer scaling (preset layerwise)
  if (j.contains("format")) {  // mixprec's own, version 1 or 2
    if (j["format"] != kStateFormat) bad_state("field 'format' must be \"" + std::string(kStateFormat) + "\"");
    if (!j.contains("version") || !j["version"].is_number_integer() || (j["version"] != 1 && j["version"] != 2))
      bad_state("field 'version' must be 1 or 2");
    if (!j.contains("enabled") || !j["enabled"].is_boolean()) bad_state("field 'enabled' must be true or false");
    if (!j.contains("accumulation_steps")) bad_state("field 'accumulation_steps' is missing");
    window = static_cast<int>(integer_field(j, "accumulation_steps", 1, kMaxWindow));
    if (!j.contains("loss_scale") || !j["loss_scale"].is_object()) bad_state("field 'loss_scale' must be an object");
    if (j["version"] == 2) {
      if (!j.contains("preset") || !j["preset"].is_string()) bad_state("field 'preset' must be a string");
      preset = j["preset"].get<std::string>();
    }
    enabled = j["enabled"].get<bool>();
    state = LossScaleState::from_json(j["loss_scale"].dump());  // validates, names the field
    check_torch_keys_agree(j, state, "loss_scale");
    if (j.contains("layerwise") != (preset == kLayerwisePreset))
      bad_state(preset == kLayerwisePreset ? "preset layerwise: field 'layerwise' is missing"
                                           : "field 'layerwise' belongs to preset layerwise only, found preset '" +
                                                 preset + "'");
    if (j.contains("layerwise")) {
      layerwise = LayerwiseScales::from_json(j["layerwise"].dump());  // validates, names the field
      if (layerwise_) layerwise_->check_load(*layerwise);
    }
  } else if (j.contains("mixprec")) {  // the Python adapter's first format
    if (!j["mixprec"].is_object()) bad_state("field 'mixprec' must be an object (a loss-scale state)");
    if (j.contains("accumulation_steps")) window = static_cast<int>(integer_field(j, "accumulation_steps", 1, kMaxWindow));
    if (j.contains("preset")) {
      if (!j["preset"].is_string()) bad_state("field 'preset' must be a string");
      preset = j["preset"].get<std::string>();
    }
    state = LossScaleState::from_json(j["mixprec"].dump());
    check_torch_keys_agree(j, state, "mixprec");
  } else if (has_torch_keys(j)) {  // torch.amp.GradScaler's state_dict()
    const LossScaleConfig& mine = scale_->config();
    if (mine.rule != LossScaleRule::torch) {
      bad_state("a torch.amp.GradScaler state follows torch's rule; this scaler's rule is " +
                std::string(rule_name(mine.rule)) + " (load it into a scaler of preset torch or mixprec)");
    }
    state.config = mine;
    state.config.growth_factor = number_field(j, "growth_factor");
    state.config.backoff_factor = number_field(j, "backoff_factor");
    state.config.growth_interval = integer_field(j, "growth_interval", 1, 2147483647);
    double scale = 0;
    if (j["scale"].is_string() && (j["scale"] == "inf")) scale = std::numeric_limits<double>::infinity();
    else scale = number_field(j, "scale");
    state.scale = static_cast<double>(static_cast<float>(scale));  // torch holds a float32
    state.counters = initial_loss_scale_state(mine).counters;
    state.counters.growth_tracker = integer_field(j, "_growth_tracker", 0, 2147483647);
    try {
      validate(state.config);
      validate(state);
    } catch (const std::invalid_argument& e) {
      bad_state(std::string("torch.amp state: ") + e.what());
    }
  } else {
    std::string missing;
    for (const char* k : kTorchKeys)
      if (!j.contains(k)) missing += (missing.empty() ? "" : ", ") + std::string(k);
    bad_state("not a GradScaler state (mixprec's has 'format', torch.amp's the keys scale, growth_factor, "
              "backoff_factor, growth_interval, _growth_tracker): missing " + missing);
  }
  // The guards' part (any format may carry it): the state's config and detectors replace
  // this scaler's; a state without one keeps this scaler's guards, their windows empty.
  std::optional<GuardConfig> guard;
  std::optional<ZScoreDetector> loss_detector;
  std::vector<ZScoreDetector> grad_detectors;
  if (j.contains("guard")) {
    const json& g = j["guard"];
    if (!g.is_object()) bad_state("field 'guard' must be an object");
    for (const auto& item : g.items())
      if (item.key() != "config" && item.key() != "loss" && item.key() != "grad")
        bad_state("guard: unknown field '" + item.key() + "'");
    if (!g.contains("config") || !g.contains("loss") || !g.contains("grad") || !g["grad"].is_array())
      bad_state("guard: expected fields config, loss and grad (an array)");
    guard = guard_config_from_json(g["config"].dump(), "GradScaler state: guard.config");
    loss_detector = ZScoreDetector::from_json(g["loss"].dump(), "GradScaler state: guard.loss");
    for (std::size_t i = 0; i < g["grad"].size(); ++i)
      grad_detectors.push_back(ZScoreDetector::from_json(g["grad"][i].dump(),
                                                         "GradScaler state: guard.grad[" + std::to_string(i) + "]"));
    bool windows_agree = loss_detector->window() == guard->window;
    for (const ZScoreDetector& d : grad_detectors) windows_agree = windows_agree && d.window() == guard->window;
    if (!windows_agree) bad_state("guard: every detector's window must be config.skip_window");
  }
  std::unique_ptr<LossScale> fresh = make_loss_scale(state.config);
  fresh->load(state);
  if (guard) {
    guard_ = *guard;
    loss_detector_ = std::move(*loss_detector);
    grad_detectors_ = std::move(grad_detectors);
  } else {
    loss_detector_ = ZScoreDetector(guard_.window);
    grad_detectors_.clear();
  }
  // Everything checked: commit. Layers the door registered keep their indices; a state
  // without a per-layer part (torch.amp's, the first Python format) leaves them as they are.
  scale_ = std::move(fresh);
  enabled_ = enabled;
  window_steps_ = window;
  preset_ = preset;
  if (preset_ != kLayerwisePreset) {
    layerwise_.reset();
  } else if (!layerwise) {
    if (!layerwise_) layerwise_.emplace();
  } else if (layerwise_) {
    layerwise_->load_state(*layerwise);
  } else {
    layerwise_ = std::move(layerwise);
  }
}

}  // namespace mixprec
