// The run layer (include/mixprec/run/step_record.hpp).
#include "mixprec/run/step_record.hpp"
#include "mixprec/kernels/unscale.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

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
