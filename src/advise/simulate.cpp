// Replaying another loss-scale policy on a recorded run (see simulate.hpp).
#include "mixprec/advise/simulate.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "mixprec/kernels/unscale.hpp"
#include "mixprec/inspect/inspect.hpp"

namespace mixprec::monitor {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A scale whose gradients cannot be unscaled (0, inf, below about 2^-128: 1/scale overflows
// float32) skips every step, as every GradScaler door skips it (check_gradients).
bool unscalable(double scale) {
  const auto s = static_cast<float>(scale);
  return !(s > 0) || !can_unscale(inv_scale_of(s));
}

bool has_telemetry(const train::StepRecord& r) { return r.act_grad_amax != 0 || !r.act_grad_tensors.empty(); }

// The model of one recorded step (see simulate.hpp).
void model_step(const train::StepRecord& r, double limit, bool low_weight_grads, SimulatedStep& s) {
  const double scale = static_cast<double>(r.scale);
  s.model = OverflowModel::amax;
  if (!r.loss_finite || r.injected) {
    s.model = OverflowModel::always;
  } else if (!r.act_grad_tensors.empty()) {
    // Backward order: the first non-finite amax is either explained by a store before it
    // that overflowed (its finite amax >= limit: the inf it stored propagated), or it
    // came from the fp32 arithmetic itself, which no scale would change.
    double amax = 0;
    bool explained = false, nonfinite = false;
    for (const nn::TensorGradStats& t : r.act_grad_tensors) {
      const double a = static_cast<double>(t.amax);
      if (!std::isfinite(a)) {
        nonfinite = true;
        break;
      }
      amax = std::max(amax, a);
      if (a >= limit) explained = true;
    }
    if (nonfinite && !explained) s.model = OverflowModel::always;
    s.unscaled_amax = scale > 0 ? amax / scale : 0;
  } else {
    const double a = static_cast<double>(r.act_grad_amax);
    if (std::isfinite(a)) {
      s.unscaled_amax = scale > 0 ? a / scale : 0;
    } else {
      s.model = OverflowModel::from_scale;
    }
  }
  if (s.model == OverflowModel::amax && r.skipped && !(s.unscaled_amax * scale >= limit)) {
    // The run overflowed although its activation gradients stayed in range: the inf came
    // from elsewhere. Low-precision weight gradients (fp16-pure) scale with S; fp32 ones
    // overflow only from non-finite arithmetic, which no scale changes.
    s.model = low_weight_grads ? OverflowModel::from_scale : OverflowModel::always;
  }
  switch (s.model) {
    case OverflowModel::always: s.overflow_scale = 0; s.unscaled_amax = 0; break;
    case OverflowModel::from_scale: s.overflow_scale = scale; s.unscaled_amax = 0; break;
    case OverflowModel::amax: s.overflow_scale = s.unscaled_amax > 0 ? limit / s.unscaled_amax : kInf; break;
  }
  s.predicted_at_recorded = scale >= s.overflow_scale || unscalable(scale);
}

void add_step(SimulationSide& side, std::uint64_t step, double scale, bool skipped, double next) {
  if (side.steps == 0) side.min_scale = side.max_scale = scale;
  side.min_scale = std::min({side.min_scale, scale, next});
  side.max_scale = std::max({side.max_scale, scale, next});
  ++side.steps;
  if (skipped) {
    ++side.skipped;
    if (side.first_skip == 0) side.first_skip = step;
  }
  if (next > scale) ++side.growths;
  if (next < scale) ++side.backoffs;
  side.final_scale = next;
}

nlohmann::ordered_json number_or_null(double v) {
  return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
}

nlohmann::ordered_json side_json(const SimulationSide& s) {
  nlohmann::ordered_json j;
  j["steps"] = s.steps;
  j["skipped"] = s.skipped;
  j["first_skip"] = s.first_skip == 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(s.first_skip);
  j["growths"] = s.growths;
  j["backoffs"] = s.backoffs;
  j["final_scale"] = number_or_null(s.final_scale);
  j["min_scale"] = number_or_null(s.min_scale);
  j["max_scale"] = number_or_null(s.max_scale);
  return j;
}

}  // namespace

std::string_view overflow_model_name(OverflowModel m) noexcept {
  switch (m) {
    case OverflowModel::amax: return "amax";
    case OverflowModel::always: return "always";
    case OverflowModel::from_scale: return "from-recorded-scale";
  }
  return "?";
}

double overflow_limit(nn::Precision precision) noexcept {
  const DType activations = nn::policy_of(precision).activations;
  if (activations != DType::f32) return static_cast<double>(format_thresholds(format_of(activations)).overflow);
  return 0x1.ffffffp127;  // halfway between FLT_MAX and 2^128: rounds to inf (ties to even)
}

Simulation simulate(std::span<const train::StepRecord> log, nn::Precision precision, const LossScaleConfig& policy) {
  if (log.empty()) throw std::invalid_argument("simulate: the run log has no steps");
  if (std::none_of(log.begin(), log.end(), has_telemetry))
    throw std::invalid_argument(
        "simulate: the run log has no activation-gradient telemetry (act_grad_amax, act_grad_tensors); it was "
        "written before mixprec recorded them: train the run again to simulate it");
  validate(policy);
  Simulation sim;
  sim.precision = precision;
  sim.limit = overflow_limit(precision);
  sim.policy = policy;
  const nn::PrecisionPolicy pp = nn::policy_of(precision);
  const bool low_weight_grads = pp.weight_grads != DType::f32;

  const std::unique_ptr<LossScale> ls = make_loss_scale(policy);
  bool stopped = false;
  for (const train::StepRecord& r : log) {
    SimulatedStep s;
    s.step = r.step;
    s.recorded_scale = r.scale;
    s.recorded_next_scale = r.next_scale;
    s.recorded_skipped = r.skipped;
    model_step(r, sim.limit, low_weight_grads, s);
    add_step(sim.recorded, r.step, static_cast<double>(r.scale), r.skipped, static_cast<double>(r.next_scale));
    if (s.predicted_at_recorded == s.recorded_skipped) ++sim.agree;
    if (stopped) continue;
    s.scale = static_cast<double>(ls->scale());
    s.skipped = s.scale >= s.overflow_scale || unscalable(s.scale);
    try {
      ls->update(s.skipped);
    } catch (const ScaleCollapseError& e) {
      sim.collapse = e.what();
      sim.collapse_step = r.step;
      stopped = true;
      continue;
    }
    s.next_scale = static_cast<double>(ls->scale());
    add_step(sim.simulated, r.step, s.scale, s.skipped, s.next_scale);
    sim.steps.push_back(s);
  }
  return sim;
}

std::string simulation_json(const Simulation& s) {
  using ojson = nlohmann::ordered_json;
  ojson j;
  j["precision"] = std::string(nn::precision_name(s.precision));
  j["overflow_limit"] = s.limit;
  j["policy"] = ojson::parse(initial_loss_scale_state(s.policy).to_json()).at("config");
  j["recorded"] = side_json(s.recorded);
  j["simulated"] = side_json(s.simulated);
  j["agreement"] = {{"steps", s.recorded.steps}, {"agree", s.agree}};
  j["collapse"] = s.collapse.empty() ? ojson(nullptr) : ojson{{"step", s.collapse_step}, {"message", s.collapse}};
  ojson steps = ojson::array();
  for (const SimulatedStep& t : s.steps) {
    ojson o;
    o["step"] = t.step;
    o["model"] = std::string(overflow_model_name(t.model));
    o["unscaled_amax"] = number_or_null(t.unscaled_amax);
    o["overflow_scale"] = number_or_null(t.overflow_scale);
    o["recorded_scale"] = number_or_null(static_cast<double>(t.recorded_scale));
    o["recorded_next_scale"] = number_or_null(static_cast<double>(t.recorded_next_scale));
    o["recorded_skipped"] = t.recorded_skipped;
    o["predicted_at_recorded"] = t.predicted_at_recorded;
    o["scale"] = number_or_null(t.scale);
    o["skipped"] = t.skipped;
    o["next_scale"] = number_or_null(t.next_scale);
    steps.push_back(std::move(o));
  }
  j["steps"] = std::move(steps);
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace mixprec::monitor
