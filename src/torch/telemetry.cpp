#include "mixprec/torch/telemetry.hpp"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <stdexcept>

#include "mixprec/scaler/loss_scale.hpp"
#include "dtype.hpp"

namespace mixprec::torch {
namespace {

using detail::mixprec_dtype;

// The tensor as the core's view: CPU, contiguous, fp32/fp16/bf16 as it is; anything else
// (another device or dtype, strided) as a contiguous fp32 copy kept alive in `keep`.
GradTensor view_of(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  if (!t.defined() || t.numel() == 0) return {nullptr, 0, DType::f32};
  at::Tensor c = t;
  const auto d = mixprec_dtype(t.scalar_type());
  if (!(d && t.device().is_cpu() && t.is_contiguous() && !t.is_sparse())) {
    c = t.detach().to(at::kCPU, at::kFloat).contiguous();
    keep.push_back(c);
  }
  return {c.data_ptr(), static_cast<std::size_t>(c.numel()), *mixprec_dtype(c.scalar_type())};
}

}  // namespace

Telemetry::Telemetry(std::string dir, const TelemetryOptions& options) : rec_(std::move(dir), options) {}

std::vector<monitor::Alert> Telemetry::finish() { return rec_.finish(); }

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
  std::vector<at::Tensor> keep;
  rec_.count_activation_grad(name, view_of(grad.detach(), keep));
}

train::StepRecord Telemetry::record(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                                    const StepOutcome& outcome, const GradScaler& scaler, const StepInfo& info) {
  const auto t0 = std::chrono::steady_clock::now();
  train::TelemetryStep s;
  s.loss = info.loss;
  s.lr = info.lr;
  s.tokens = info.tokens;
  s.seconds = info.seconds;
  s.val_loss = info.val_loss;
  s.scale = outcome.scale;
  // The scale after this step's update, without touching the scaler: a copy of its policy.
  auto next = make_loss_scale(scaler.loss_scale().config());
  next->load(scaler.loss_scale().state());
  if (scaler.enabled()) {
    try {
      next->update(outcome.found_inf);
    } catch (const ScaleCollapseError&) {
    }
  }
  s.next_scale = scaler.enabled() ? next->scale() : 1.0f;
  s.found_inf = outcome.found_inf;
  s.applied = outcome.applied;
  s.grad_norm = outcome.grad_norm;
  s.clip_coef = outcome.clip_coef;
  s.overflow_param = outcome.first_overflow_name;
  std::vector<train::NamedParam> params;
  std::vector<at::Tensor> keep;
  {
    ::torch::NoGradGuard ng;
    for (const auto& item : named_parameters) {
      const at::Tensor& p = item.value();
      params.push_back({item.key(), view_of(p.grad(), keep), view_of(p.detach(), keep)});
    }
  }
  const double views_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rec_.add_seconds(views_s);
  return rec_.record(s, params);
}

}  // namespace mixprec::torch
