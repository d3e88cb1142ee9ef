#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/core/json_depth.hpp"
#include "mixprec/core/text.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/kernels/unscale.hpp"
#include "mixprec/optim/clip.hpp"

namespace mixprec {
namespace {

constexpr std::string_view kStateFormat = "mixprec.grad_scaler";
constexpr int kStateVersion = 1;

}  // namespace

std::string_view stage_name(OptimizerStage s) noexcept {
  switch (s) {
    case OptimizerStage::ready: return "ready";
    case OptimizerStage::unscaled: return "unscaled";
    case OptimizerStage::stepped: return "stepped";
  }
  return "?";
}

GradScaler::GradScaler(const LossScaleConfig& config, bool enabled)
    : GradScaler(make_loss_scale(config), enabled) {}

GradScaler::GradScaler(std::unique_ptr<LossScale> scale, bool enabled) : scale_(std::move(scale)), enabled_(enabled) {
  if (!scale_) throw std::invalid_argument("GradScaler: the loss scale is null");
}

float GradScaler::get_scale() const noexcept { return enabled_ ? scale_->scale() : 1.0f; }

float GradScaler::scale(float loss) const noexcept { return loss * get_scale(); }

// found_inf is what the check read (as PyTorch's), plus one case PyTorch lets
// through: finite gradients whose unscaled values overflow (only possible with a
// scale below 1). Their norm is inf; stepping would write inf into the weights.
void GradScaler::record_check(Record& r, const UnscaleResult& res) {
  r.first_overflow = res.first_nonfinite;
  r.grad_norm = std::sqrt(res.sum_squares);
  r.found_inf = res.found_inf || !std::isfinite(r.grad_norm);
}

// The scale is inf, 0 or so small that 1/S overflows float32: the gradients cannot be
// unscaled. Keras 3 at scale inf multiplies the loss by inf, finds non-finite gradients and
// skips the step (and inf * 0.5 stays inf: every later step too); at scale 0 it would divide
// 0 by 0 and write NaN into the weights. mixprec skips both: found_inf, nothing written.
// The check still reads the gradients as they are (inv_scale 1) to name the first tensor
// holding inf/NaN; the unscaled norm is unknown (NaN).
void GradScaler::record_unscalable(Record& r, Optimizer& opt, ThreadPool* pool) {
  UnscaleOptions o;
  o.write = false;
  const UnscaleResult res = unscale_and_check(opt.store().grad_tensors(), 1.0f, o, {}, pool);
  r.first_overflow = res.first_nonfinite;
  r.grad_norm = std::numeric_limits<double>::quiet_NaN();
  r.found_inf = true;
}

GradScaler::Record& GradScaler::record(Optimizer& opt) {
  return records_[&opt];
}

OptimizerStage GradScaler::stage(const Optimizer& opt) const noexcept {
  const auto it = records_.find(&opt);
  return it == records_.end() ? OptimizerStage::ready : it->second.stage;
}

void AccumulationWindow::require_complete(const char* call) const {
  if (steps_ > 1 && passes_ != steps_) {
    throw std::logic_error(std::string(call) + " after " + std::to_string(passes_) + " of " + std::to_string(steps_) +
                           " backward passes of the accumulation window: one scale holds for the whole "
                           "window; unscale, step and update once, at its end");
  }
}

void AccumulationWindow::require_between(const char* call) const {
  if (passes_ != 0) throw std::logic_error(std::string(call) + " in the middle of an accumulation window");
}

void AccumulationWindow::set_steps(int k) {
  if (k < 1) throw std::invalid_argument("accumulation steps " + std::to_string(k) + " is not allowed; it must be >= 1");
  if (passes_ != 0) {
    throw std::logic_error("set_accumulation_steps() in the middle of an accumulation window (" +
                           std::to_string(passes_) + " backward passes done)");
  }
  steps_ = k;
}

void AccumulationWindow::backward_done(bool step_started) {
  if (step_started) {
    throw std::logic_error("backward_done() after unscale() or step() and before update(): a new window starts "
                           "after update()");
  }
  if (passes_ == steps_) {
    throw std::logic_error("backward_done() called " + std::to_string(passes_ + 1) + " times in an accumulation "
                           "window of " + std::to_string(steps_) + "; call step() and update() at the window's end");
  }
  ++passes_;
}

void GradScaler::unscale(Optimizer& opt, ThreadPool* pool) {
  if (!enabled_) return;
  Record& r = record(opt);
  if (r.stage == OptimizerStage::unscaled) {
    throw std::logic_error("unscale() has already been called on this optimizer since the last update()");
  }
  if (r.stage == OptimizerStage::stepped) throw std::logic_error("unscale() is being called after step()");
  window_.require_complete("unscale()");
  const float inv_scale = inv_scale_of(scale_->scale());
  if (can_unscale(inv_scale)) {
    UnscaleOptions o;
    o.sum_squares = true;
    const UnscaleResult res = unscale_and_check(opt.store().grad_tensors(), inv_scale, o, {}, pool);
    record_check(r, res);
  } else {
    record_unscalable(r, opt, pool);  // nothing written; step() will skip
  }
  r.stage = OptimizerStage::unscaled;
}

StepOutcome GradScaler::step(Optimizer& opt, const StepOptions& options) {
  if (options.max_grad_norm && !(std::isfinite(*options.max_grad_norm) && *options.max_grad_norm > 0.0f)) {
    throw std::invalid_argument("GradScaler::step: max_grad_norm " + std::to_string(*options.max_grad_norm) +
                                " is not allowed; it must be finite and > 0");
  }
  Record& r = record(opt);
  if (r.stage == OptimizerStage::stepped) {
    throw std::logic_error("step() has already been called since the last update()");
  }
  if (enabled_) window_.require_complete("step()");

  // The check: fused (read-only pass over the scaled gradients) unless unscale() already ran.
  float inv_scale = 1.0f;
  if (r.stage == OptimizerStage::ready) {
    inv_scale = enabled_ ? inv_scale_of(scale_->scale()) : 1.0f;
    if (can_unscale(inv_scale)) {
      UnscaleOptions o;
      o.write = false;
      o.sum_squares = true;
      const UnscaleResult res = unscale_and_check(opt.store().grad_tensors(), inv_scale, o, {}, options.pool);
      record_check(r, res);
    } else {
      record_unscalable(r, opt, options.pool);
    }
  }
  r.found_inf = r.found_inf || options.found_inf_elsewhere;
  if (options.global_grad_norm) {
    r.grad_norm = *options.global_grad_norm;
    r.found_inf = r.found_inf || !std::isfinite(r.grad_norm);
  }

  StepOutcome out;
  out.scale = get_scale();
  out.found_inf = r.found_inf;
  out.first_overflow = r.first_overflow;
  if (r.first_overflow >= 0) out.first_overflow_name = opt.store().spec(static_cast<std::size_t>(r.first_overflow)).name;
  out.grad_norm = r.grad_norm;
  if (!r.found_inf) {
    out.clip_coef = options.max_grad_norm ? clip_coefficient(r.grad_norm, *options.max_grad_norm) : 1.0f;
    StepControls c;
    c.inv_scale = inv_scale;
    c.clip_coef = out.clip_coef;
    c.lr = options.lr;
    out.applied = opt.step(c, options.pool);
  }
  // A disabled scaler keeps no records: update() has nothing to do.
  if (enabled_) r.stage = OptimizerStage::stepped;
  else r.reset();
  return out;
}

void GradScaler::update() {
  if (!enabled_) return;
  window_.require_complete("update()");
  bool any_recorded = false, found_inf = false;
  for (auto& [opt, r] : records_) {
    if (r.stage == OptimizerStage::ready) continue;
    any_recorded = true;
    found_inf = found_inf || r.found_inf;
  }
  if (!any_recorded) throw std::logic_error("No inf checks were recorded prior to update()");
  for (auto& [opt, r] : records_) r.reset();
  window_.end();
  scale_->update(found_inf);
}

void GradScaler::backward_done() {
  if (!enabled_) return;  // a disabled scaler keeps no window (update() does nothing either)
  bool started = false;
  for (const auto& [opt, r] : records_) started = started || r.stage != OptimizerStage::ready;
  window_.backward_done(started);
}

std::string GradScaler::state_json() const {
  nlohmann::json j;
  j["format"] = kStateFormat;
  j["version"] = kStateVersion;
  j["enabled"] = enabled_;
  j["accumulation_steps"] = window_.steps();
  j["loss_scale"] = nlohmann::json::parse(scale_->to_json());
  return j.dump();
}

void GradScaler::load_state_json(std::string_view text) {
  for (const auto& [opt, r] : records_) {
    if (r.stage != OptimizerStage::ready) {
      throw std::logic_error("load_state_json() in the middle of a step: an optimizer is " +
                             std::string(stage_name(r.stage)) + "; load before the step or after update()");
    }
  }
  window_.require_between("load_state_json()");
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("GradScaler state: " + what);
  };
  if (const std::string deep = json_depth_problem(text); !deep.empty()) fail(deep);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail("not valid JSON: " + std::string(text::json_error_detail(e.what())));
  }
  if (!j.is_object()) fail("expected a JSON object");
  if (!j.contains("format") || j["format"] != kStateFormat) {
    fail("field 'format' must be \"" + std::string(kStateFormat) + "\"");
  }
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"] != kStateVersion) {
    fail("field 'version' must be " + std::to_string(kStateVersion));
  }
  if (!j.contains("enabled") || !j["enabled"].is_boolean()) fail("field 'enabled' must be true or false");
  if (!j.contains("accumulation_steps") || !j["accumulation_steps"].is_number_integer() ||
      j["accumulation_steps"].get<std::int64_t>() < 1 || j["accumulation_steps"].get<std::int64_t>() > 1 << 30) {
    fail("field 'accumulation_steps' must be an integer in [1, 2^30]");
  }
  if (!j.contains("loss_scale") || !j["loss_scale"].is_object()) fail("field 'loss_scale' must be an object");
  const LossScaleState state = LossScaleState::from_json(j["loss_scale"].dump());  // validates, names fields
  std::unique_ptr<LossScale> fresh = make_loss_scale(state.config);
  fresh->load(state);
  // Everything checked: commit.
  scale_ = std::move(fresh);
  enabled_ = j["enabled"].get<bool>();
  window_.set_steps(j["accumulation_steps"].get<int>());
}

}  // namespace mixprec
