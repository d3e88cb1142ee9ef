#include "mixprec/torch/telemetry.hpp"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <stdexcept>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/train/config.hpp"
#include "mixprec/train/run_log.hpp"
#include "dtype.hpp"

namespace mixprec::torch {
namespace {

// Adds the time since `t0` to `total` when it goes out of scope (the caller holds the lock).
struct Spent {
  double& total;
  std::chrono::steady_clock::time_point t0;
  Spent(double& t, std::chrono::steady_clock::time_point start) : total(t), t0(start) {}
  ~Spent() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
  Spent(const Spent&) = delete;
  Spent& operator=(const Spent&) = delete;
};

const std::vector<std::string_view> kConfigKeys = {"precision", "loss-scale"};

train::TrainConfig run_config(const TelemetryOptions& o) {
  train::TrainConfig c;
  const auto p = nn::parse_precision(o.precision);
  if (!p || (*p != nn::Precision::fp32 && *p != nn::Precision::fp16 && *p != nn::Precision::bf16))
    throw std::invalid_argument("telemetry: precision: expected fp32, fp16 or bf16, found '" + o.precision + "'");
  c.precision = *p;
  c.loss_scale = o.loss_scale;
  (void)train::loss_scale_config(c.loss_scale);  // "loss-scale: expected ..." for anything else
  return c;
}

using detail::mixprec_dtype;

// |max| of each tensor (0 for an undefined or empty one; NaN when it holds NaN). CPU
// tensors in fp32/fp16/bf16 that are contiguous go through one pass of the core's
// multi-tensor kernel (check-only, amax, nothing written): one call instead of an ATen
// reduction and a host read per tensor, which cost more than the reading itself on
// small models. Any other tensor: ATen's infinity norm.
std::vector<float> amax_each(const std::vector<at::Tensor>& ts) {
  std::vector<float> out(ts.size(), 0.0f);
  std::vector<GradTensor> views;
  std::vector<std::size_t> where;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    if (!t.defined() || t.numel() == 0) continue;
    const auto d = mixprec_dtype(t.scalar_type());
    if (d && t.device().is_cpu() && t.is_contiguous() && !t.is_sparse()) {
      views.push_back({t.data_ptr(), static_cast<std::size_t>(t.numel()), *d});
      where.push_back(i);
    } else {
      out[i] = at::linalg_vector_norm(t, INFINITY).to(at::kFloat).item<float>();
    }
  }
  if (!views.empty()) {
    UnscaleOptions o;
    o.write = false;
    o.amax = true;
    std::vector<float> amax(views.size());
    (void)unscale_and_check(views, 1.0f, o, amax);
    for (std::size_t k = 0; k < where.size(); ++k) out[where[k]] = amax[k];
  }
  return out;
}

}  // namespace

Telemetry::Telemetry(std::string dir, const TelemetryOptions& options)
    : dir_(std::move(dir)),
      config_(run_config(options)),
      folder_(dir_, train::RunFolder::Mode::create),
      alerts_({}, monitor::RunContext::of(config_)) {
  folder_.write_config(train::to_json(config_, kConfigKeys, 2) + "\n");
}

std::vector<monitor::Alert> Telemetry::finish() {
  const monitor::RunNumbers n = numbers_.numbers();
  train::TrainSummary s;
  s.steps = n.steps;
  s.skipped = n.skipped;
  s.applied = n.steps - n.skipped;
  s.final_loss = n.final_loss;
  s.final_scale = n.final_scale;
  s.underflow_fraction = n.underflow_fraction;
  s.subnormal_fraction = n.subnormal_fraction;
  s.tokens = n.tokens;
  s.seconds = n.seconds;
  s.mean_step_ms = n.mean_step_ms;
  s.param_count = param_count_;
  if (!step_ms_.empty()) {
    std::vector<double> ms = step_ms_;
    std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
    s.median_step_ms = ms[ms.size() / 2];
  }
  // The summary with the run's alerts, as mixprec train writes it.
  const std::vector<monitor::Alert> alerts = alerts_.all();
  folder_.write_summary(
      monitor::summary_with_alerts(train::summary_json(s, train::to_json(config_, kConfigKeys)), alerts));
  return alerts;
}

void Telemetry::watch(const std::string& name, const at::Tensor& activation) {
  if (!activation.requires_grad()) {
    throw std::invalid_argument("telemetry: watch('" + name +
                                "'): the tensor does not require grad, so backward never reaches it");
  }
  // A hook on a non-leaf tensor: called with its gradient; returning nothing keeps it.
  at::Tensor a = activation;
  a.register_hook([this, name](const at::Tensor& g) { count(name, g); });
}

void Telemetry::count(const std::string& name, const at::Tensor& grad) {
  const auto t0 = std::chrono::steady_clock::now();
  const at::Tensor g = grad.detach();
  // The counts of converting the gradient, as it is (scaled), to fp16 with mixprec's
  // counted conversion: for an fp16 gradient its zeros and subnormals as stored (it is
  // fp16 already: nothing more underflows); for fp32 and bf16 what fp16 would flush, and
  // where it would overflow, at the current scale.
  const at::Tensor g32 = g.to(at::kFloat).contiguous();
  const auto n = static_cast<std::size_t>(g32.numel());
  // |max| as a reduction (the infinity norm), without an |g| tensor.
  const float amax_in = n ? at::linalg_vector_norm(g32, INFINITY).item<float>() : 0.0f;
  std::lock_guard lock(mu_);
  const Spent spent(seconds_, t0);
  if (fp16_scratch_.size() < n) fp16_scratch_.resize(n);
  const ConversionStats s = convert_counted(std::span<const float>(g32.const_data_ptr<float>(), n),
                                            std::span<f16>(fp16_scratch_.data(), n));
  float amax = s.elements ? amax_in : 0.0f;
  if (s.nonfinite_input) amax = std::numeric_limits<float>::infinity();
  // Binades between this gradient's largest value and its format's largest finite.
  const double fmt_max = g.scalar_type() == at::kHalf       ? 65504.0
                         : g.scalar_type() == at::kBFloat16 ? 3.3895313892515355e38
                         : g.scalar_type() == at::kDouble   ? std::numeric_limits<double>::max()
                                                            : static_cast<double>(std::numeric_limits<float>::max());
  const double headroom = amax > 0 && std::isfinite(amax) ? std::log2(fmt_max / static_cast<double>(amax))
                                                          : std::numeric_limits<double>::infinity();
  headroom_ = std::min(headroom_, headroom);
  act_total_ += s;
  act_amax_ = std::max(act_amax_, amax);
  if (s.nonfinite_input && first_nonfinite_.empty()) first_nonfinite_ = name;
  for (auto& t : act_) {
    if (t.name == name) {
      t.stats += s;
      t.amax = std::max(t.amax, amax);
      return;
    }
  }
  act_.push_back({name, s, amax});
}

train::StepRecord Telemetry::record(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                                    const StepOutcome& outcome, const GradScaler& scaler, const StepInfo& info) {
  const auto t0 = std::chrono::steady_clock::now();
  train::StepRecord r;
  r.step = ++step_;
  r.lr = info.lr;
  r.loss = info.loss;
  r.loss_finite = std::isfinite(info.loss);
  r.val_loss = info.val_loss;
  r.scale = outcome.scale;
  // The scale after this step's update, without touching the scaler: a copy of its policy.
  auto next = make_loss_scale(scaler.loss_scale().config());
  next->load(scaler.loss_scale().state());
  if (scaler.enabled()) {
    try {
      next->update(outcome.found_inf);
    } catch (const ScaleCollapseError&) {
    }
  }
  r.next_scale = scaler.enabled() ? next->scale() : 1.0f;
  r.found_inf = outcome.found_inf;
  r.skipped = !outcome.applied;
  r.grad_norm = outcome.found_inf ? std::numeric_limits<double>::quiet_NaN() : outcome.grad_norm;
  r.clip_coef = outcome.clip_coef;
  r.overflow_param = outcome.first_overflow_name;
  r.tokens = info.tokens;
  r.seconds = info.seconds;
  {
    ::torch::NoGradGuard ng;
    std::vector<at::Tensor> grads, weights;
    for (const auto& item : named_parameters) {
      const at::Tensor& p = item.value();
      grads.push_back(p.grad().defined() ? p.grad() : at::Tensor());
      weights.push_back(p.detach());
    }
    const std::vector<float> grad_amax = amax_each(grads), weight_amax = amax_each(weights);
    std::size_t i = 0;
    for (const auto& item : named_parameters) {
      train::StepRecord::ParamStats ps;
      ps.name = item.key();
      if (grads[i].defined() && grads[i].numel() > 0) {
        // step() left the gradients unscaled (and clipped: undo the coefficient).
        float a = grad_amax[i];
        if (!std::isfinite(a)) a = std::numeric_limits<float>::infinity();
        else if (outcome.applied && outcome.clip_coef < 1.0f) a /= outcome.clip_coef;
        ps.grad_amax = a;
      }
      if (weights[i].numel() > 0) ps.weight_amax = weight_amax[i];
      r.params.push_back(std::move(ps));
      ++i;
    }
  }
  {
    std::lock_guard lock(mu_);
    r.act_grads = act_total_;
    r.act_grad_amax = act_amax_;
    r.headroom_log2 = std::isfinite(headroom_) ? headroom_ : 0.0;  // the tightest watched tensor; 0 when none
    headroom_ = std::numeric_limits<double>::infinity();
    r.act_grad_tensors = act_;
    r.overflow_activation = first_nonfinite_;
    act_.clear();
    act_total_ = {};
    act_amax_ = 0;
    first_nonfinite_.clear();
  }
  folder_.append_log(train::step_record_json(r));
  (void)alerts_.observe(r);
  numbers_.add(r);
  if (param_count_ == 0)
    for (const auto& item : named_parameters) param_count_ += static_cast<std::size_t>(item.value().numel());
  step_ms_.push_back(1000.0 * r.seconds);
  std::lock_guard lock(mu_);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace mixprec::torch
