// The run layer (include/mixprec/run/step_record.hpp).
#include "mixprec/run/step_record.hpp"
#include "mixprec/kernels/unscale.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

namespace mixprec::train {

void RunTotals::add(const StepRecord& r) {
  ++steps;
  (r.skipped ? skipped : applied) += 1;
  if (r.skipped) ++skipped_by[static_cast<std::size_t>(skip_reason_of(r))];
  if (!r.skipped && std::isfinite(r.lost_update_fraction)) {
    lost_update_sum += r.lost_update_fraction;
    ++lost_update_steps;
  }
  tokens += r.tokens;
  act_grads += r.act_grads;
  for (const nn::Fp8TensorStats& f : r.fp8) {
    const int role = f.role == lowp::Role::forward ? 0 : 1;
    fp8_nonzero[role] += f.nonzero;
    fp8_saturated[role] += f.saturated;
    fp8_flushed[role] += f.flushed;
  }
  if (!r.optimizer_state.empty()) ++state_steps;
  for (std::size_t i = 0; i < r.optimizer_state.size(); ++i) {
    const StepRecord::StateStats& x = r.optimizer_state[i];
    StateTotals* t = i < optimizer_state.size() && optimizer_state[i].name == x.name ? &optimizer_state[i] : nullptr;
    for (std::size_t k = 0; t == nullptr && k < optimizer_state.size(); ++k)
      if (optimizer_state[k].name == x.name) t = &optimizer_state[k];
    if (t == nullptr) t = &optimizer_state.emplace_back(StateTotals{.name = x.name});
    if (std::isfinite(x.m_error)) {
      ++t->m_steps;
      t->m_error_sum += x.m_error;
      t->m_error_max = std::max(t->m_error_max, x.m_error);
    }
    if (std::isfinite(x.v_error)) {
      ++t->v_steps;
      t->v_error_sum += x.v_error;
      t->v_error_max = std::max(t->v_error_max, x.v_error);
    }
    t->meant += x.meant;
    t->lost += x.lost;
  }
  if (std::isfinite(r.seconds)) seconds += r.seconds;
  final_loss = r.loss;
  final_loss_finite = r.loss_finite;
  if (r.val_loss) val_loss = r.val_loss;
  if (r.val_loss_ema) val_loss_ema = r.val_loss_ema;
  final_scale = r.next_scale;
  step_ms.push_back(r.seconds * 1e3);
}

TrainSummary RunTotals::summary() const {
  auto fraction = [](std::uint64_t part, std::uint64_t whole) {
    return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
  };
  TrainSummary s;
  s.steps = steps;
  s.applied = applied;
  s.skipped = skipped;
  std::copy(std::begin(skipped_by), std::end(skipped_by), std::begin(s.skipped_by));
  s.final_loss = final_loss;
  s.val_loss = val_loss;
  s.val_loss_ema = val_loss_ema;
  s.final_scale = final_scale;
  s.underflow_fraction = fraction(act_grads.underflow, act_grads.nonzero);
  s.subnormal_fraction = fraction(act_grads.subnormal, act_grads.nonzero);
  s.lost_update_fraction = lost_update_steps > 0 ? lost_update_sum / static_cast<double>(lost_update_steps) : 0.0;
  s.fp8_forward_saturated_fraction = fraction(fp8_saturated[0], fp8_nonzero[0]);
  s.fp8_forward_flushed_fraction = fraction(fp8_flushed[0], fp8_nonzero[0]);
  s.fp8_backward_saturated_fraction = fraction(fp8_saturated[1], fp8_nonzero[1]);
  s.fp8_backward_flushed_fraction = fraction(fp8_flushed[1], fp8_nonzero[1]);
  s.seconds = seconds;
  s.tokens = tokens;
  s.mean_step_ms = steps > 0 ? seconds * 1e3 / static_cast<double>(steps) : 0.0;
  if (!step_ms.empty()) {
    std::vector<double> v = step_ms;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    s.median_step_ms = v[v.size() / 2];
  }
  return s;
}

double RunTotals::shown_final_loss() const noexcept {
  return steps > 0 && final_loss_finite ? final_loss : std::numeric_limits<double>::quiet_NaN();
}

std::optional<FieldProblem> sampled_stats_problem(const nn::Fp8TensorStats& t) {
  auto problem = [](std::string field, std::string rule, double found) {
    return std::optional<FieldProblem>(FieldProblem{std::move(field), std::move(rule), found});
  };
  auto d = [](std::uint64_t v) { return static_cast<double>(v); };
  if (t.blocks) {
    const lowp::BlockStats& b = *t.blocks;
    const lowp::BlockQuantiles& q = b.log2_multiplier_quantiles;
    if (b.multiplier_blocks > b.blocks)
      return problem("blocks.multiplier_blocks", "at most blocks", d(b.multiplier_blocks));
    if (b.multiplier_left_out != b.blocks - b.multiplier_blocks)
      return problem("blocks.multiplier_left_out", "blocks - multiplier_blocks", d(b.multiplier_left_out));
    if (b.blocks_with_flush > b.blocks || b.blocks_with_flush > b.flushed ||
        (b.flushed > 0) != (b.blocks_with_flush > 0))
      return problem("blocks.blocks_with_flush", "at most blocks and flushed, and > 0 exactly when flushed is",
                     d(b.blocks_with_flush));
    if (b.blocks_with_saturation > b.blocks || b.blocks_with_saturation > b.saturated ||
        (b.saturated > 0) != (b.blocks_with_saturation > 0))
      return problem("blocks.blocks_with_saturation", "at most blocks and saturated, and > 0 exactly when saturated is",
                     d(b.blocks_with_saturation));
    if (b.zero_blocks > b.blocks) return problem("blocks.zero_blocks", "at most blocks", d(b.zero_blocks));
    if (b.far_blocks > b.blocks - b.zero_blocks)
      return problem("blocks.far_blocks", "at most blocks - zero_blocks", d(b.far_blocks));
    const std::pair<const char*, double> fractions[] = {{"blocks.max_flushed_fraction", b.max_flushed_fraction},
                                                        {"blocks.max_saturated_fraction", b.max_saturated_fraction}};
    for (const auto& [field, v] : fractions)
      if (!(v >= 0 && v <= 1)) return problem(field, "a number in [0, 1]", v);
    // The log2 multipliers: finite, the quantiles ascending between min and max.
    const std::pair<const char*, double> order[] = {
        {"blocks.log2_multiplier_min", b.log2_multiplier_min}, {"blocks.log2_multiplier_quantiles.p01", q.p01},
        {"blocks.log2_multiplier_quantiles.p05", q.p05},        {"blocks.log2_multiplier_quantiles.p25", q.p25},
        {"blocks.log2_multiplier_quantiles.p50", q.p50},        {"blocks.log2_multiplier_quantiles.p75", q.p75},
        {"blocks.log2_multiplier_quantiles.p95", q.p95},        {"blocks.log2_multiplier_quantiles.p99", q.p99},
        {"blocks.log2_multiplier_max", b.log2_multiplier_max}};
    for (std::size_t i = 0; i < std::size(order); ++i) {
      if (!std::isfinite(order[i].second)) return problem(order[i].first, "a finite number", order[i].second);
      if (i > 0 && order[i].second < order[i - 1].second)
        return problem(order[i].first, std::string("a number >= ").append(order[i - 1].first), order[i].second);
    }
    if (!std::isfinite(b.log2_multiplier_mean))
      return problem("blocks.log2_multiplier_mean", "a finite number", b.log2_multiplier_mean);
    const std::pair<const char*, double> nonnegative[] = {
        {"blocks.log2_multiplier_std", b.log2_multiplier_std},
        {"blocks.far_log2", b.far_log2},
        {"blocks.dynamic_range", b.dynamic_range},
        {"blocks.max_block_dynamic_range", b.max_block_dynamic_range}};
    for (const auto& [field, v] : nonnegative)
      if (!(v >= 0 && std::isfinite(v))) return problem(field, "a finite number >= 0", v);
    if (!(b.tensor_amax >= 0))  // inf is a tensor that held inf
      return problem("blocks.tensor_amax", "a number >= 0 (null: inf)", static_cast<double>(b.tensor_amax));
  }
  if (t.kurtosis && !(*t.kurtosis >= 0 && std::isfinite(*t.kurtosis)))
    return problem("kurtosis", "a finite number >= 0", *t.kurtosis);
  for (std::size_t i = 0; i < t.what_if.size(); ++i) {
    const nn::Fp8WhatIf& w = t.what_if[i];
    const std::string at = "what_if[" + std::to_string(i) + "].";
    if (w.saturated + w.flushed > w.elements || w.saturated > w.elements)
      return problem(at + "elements", "at least saturated + flushed", d(w.elements));
    if (w.rel_rms_error && !(*w.rel_rms_error >= 0 && std::isfinite(*w.rel_rms_error)))
      return problem(at + "rel_rms_error", "a finite number >= 0", *w.rel_rms_error);
    if (w.far_blocks > w.blocks) return problem(at + "far_blocks", "at most blocks", d(w.far_blocks));
    if (!(w.log2_multiplier_std >= 0 && std::isfinite(w.log2_multiplier_std)))
      return problem(at + "log2_multiplier_std", "a finite number >= 0", w.log2_multiplier_std);
    if (!std::isfinite(w.log2_multiplier_p01))
      return problem(at + "log2_multiplier_p01", "a finite number", w.log2_multiplier_p01);
    if (!(std::isfinite(w.log2_multiplier_p99) && w.log2_multiplier_p99 >= w.log2_multiplier_p01))
      return problem(at + "log2_multiplier_p99", "a finite number >= log2_multiplier_p01", w.log2_multiplier_p99);
  }
  return std::nullopt;
}

bool histogram_step(std::uint64_t step, std::size_t every, std::uint64_t last_step) noexcept {
  return every > 0 && (step == 1 || step % every == 0 || (last_step > 0 && step == last_step));
}

void measure_amax(std::span<const GradTensor> views, float scale, std::span<float> out, ThreadPool* pool) {
  UnscaleOptions o;
  o.write = false;
  o.amax = true;
  const bool all_present = std::all_of(views.begin(), views.end(),
                                       [](const GradTensor& v) { return v.size > 0 && v.data != nullptr; });
  if (all_present) {
    if (!views.empty()) (void)unscale_and_check(views, scale, o, out, pool);
  } else {
    // The kernel takes no empty view: measure the others, 0 for these.
    std::vector<GradTensor> present;
    std::vector<std::size_t> where;
    for (std::size_t i = 0; i < views.size(); ++i) {
      out[i] = 0.0f;
      if (views[i].size == 0 || views[i].data == nullptr) continue;
      present.push_back(views[i]);
      where.push_back(i);
    }
    if (present.empty()) return;
    std::vector<float> amax(present.size());
    (void)unscale_and_check(present, scale, o, amax, pool);
    for (std::size_t k = 0; k < where.size(); ++k) out[where[k]] = amax[k];
  }
  for (float& a : out) a = std::isfinite(a) ? a : std::numeric_limits<float>::infinity();
}

}  // namespace mixprec::train
