#include "mixprec/torch/grad_scaler.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mixprec/kernels/unscale.hpp"
#include "mixprec/optim/clip.hpp"
#include "dtype.hpp"

namespace mixprec::torch {
namespace {

// One parameter with a gradient, in optimizer order (groups, then params).
struct Entry {
  std::int64_t index;
  at::Tensor grad;
};

std::string shape_text(at::IntArrayRef a) {
  std::ostringstream s;
  s << a;
  return s.str();
}

using detail::mixprec_dtype;

}  // namespace

GradScaler::GradScaler(const LossScaleConfig& config, bool enabled) : GradScaler(make_loss_scale(config), enabled) {}

GradScaler::GradScaler(std::unique_ptr<LossScale> scale, bool enabled) : scale_(std::move(scale)), enabled_(enabled) {
  if (!scale_) throw std::invalid_argument("mixprec::torch::GradScaler: the loss scale is null");
}

float GradScaler::get_scale() const noexcept { return enabled_ ? scale_->scale() : 1.0f; }

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!loss.defined()) throw std::invalid_argument("GradScaler::scale: the loss tensor is undefined");
  if (!enabled_) return loss;
  return loss * at::scalar_tensor(scale_->scale(), at::TensorOptions().dtype(at::kFloat).device(loss.device()));
}

void GradScaler::set_names(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters) {
  for (const auto& item : named_parameters) names_[item.value().unsafeGetTensorImpl()] = item.key();
}

void GradScaler::set_names(const ::torch::nn::Module& module) { set_names(module.named_parameters(true)); }

std::string GradScaler::name_of(const ::torch::optim::Optimizer& opt, std::int64_t index) const {
  std::int64_t i = 0;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      if (i++ != index) continue;
      const auto it = names_.find(p.unsafeGetTensorImpl());
      if (it != names_.end()) return it->second;
      return "param[" + std::to_string(index) + "]";
    }
  }
  return "param[" + std::to_string(index) + "]";
}

OptimizerStage GradScaler::stage(const ::torch::optim::Optimizer& opt) const noexcept {
  const auto it = records_.find(&opt);
  return it == records_.end() ? OptimizerStage::ready : it->second.stage;
}


// Validates every gradient of `opt` (nothing is touched before all are checked), then
// checks and unscales them in place (write_scaled: multiply by 1/scale) and records
// found_inf, the first overflowing parameter and the norm.
void GradScaler::check_unscale(::torch::optim::Optimizer& opt, Record& r, bool write_scaled) {
  std::vector<Entry> entries;
  std::int64_t index = 0;
  std::optional<at::Device> device;
  std::int64_t device_index = -1;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const std::int64_t i = index++;
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;  // took no part in the loss: skipped, as PyTorch does
      auto who = [&] { return "the gradient of " + name_of(opt, i); };
      if (g.is_sparse() || g.layout() != at::kStrided) {
        throw std::invalid_argument(who() + " is sparse (layout " + c10::str(g.layout()) +
                                    "); mixprec::torch::GradScaler needs dense gradients");
      }
      if (!mixprec_dtype(g.scalar_type())) {
        throw std::invalid_argument(who() + " has dtype " + std::string(c10::toString(g.scalar_type())) +
                                    "; mixprec::torch::GradScaler accepts fp32 (Float), fp16 (Half) and bf16 "
                                    "(BFloat16) gradients");
      }
      if (!g.is_contiguous()) {
        throw std::invalid_argument(who() + " is not contiguous (sizes " + shape_text(g.sizes()) + ", strides " +
                                    shape_text(g.strides()) +
                                    "); mixprec::torch::GradScaler reads gradients in place and needs them "
                                    "contiguous (.contiguous() them before step)");
      }
      if (!device) {
        device = g.device();
        device_index = i;
      } else if (*device != g.device()) {
        throw std::invalid_argument("gradients on more than one device: " + name_of(opt, device_index) + " on " +
                                    device->str() + ", " + name_of(opt, i) + " on " + g.device().str() +
                                    "; use one GradScaler step per device's optimizer");
      }
      if (g.device().type() != at::kCPU && g.device().type() != at::kCUDA) {
        throw std::invalid_argument(who() + " is on device " + g.device().str() +
                                    "; mixprec::torch::GradScaler handles CPU and CUDA gradients");
      }
      entries.push_back({i, g});
    }
  }
  if (index == 0) {
    throw std::invalid_argument("mixprec::torch::GradScaler: the optimizer has no parameters");
  }
  const float inv_scale = (enabled_ && write_scaled) ? inv_scale_of(scale_->scale()) : 1.0f;
  if (!can_unscale(inv_scale)) {
    // The scale is inf, 0 or below about 2^-128 (the keras preset, like Keras 3, has no floor
    // and no finite guard): nothing can be unscaled. As the core GradScaler: an overflow step,
    // nothing written, the first tensor holding inf/NaN named, the norm unknown.
    r.found_inf = true;
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    r.first_overflow = -1;
    for (const Entry& e : entries) {
      if (!at::isfinite(e.grad).all().item<bool>()) {
        r.first_overflow = e.index;
        break;
      }
    }
    return;
  }

  if (!device || device->is_cpu()) {
    // The fused pass over the tensors' own storage: GradTensor views, no copy.
    std::vector<GradTensor> views;
    views.reserve(entries.size());
    for (const Entry& e : entries) {
      views.push_back({e.grad.data_ptr(), static_cast<std::size_t>(e.grad.numel()), *mixprec_dtype(e.grad.scalar_type())});
    }
    UnscaleOptions o;
    o.write = true;  // libtorch's optimizers read the gradients: unscale in place (nothing written at 1)
    o.sum_squares = true;
    const UnscaleResult res = unscale_and_check(views, inv_scale, o);
    r.first_overflow = res.first_nonfinite >= 0 ? entries[static_cast<std::size_t>(res.first_nonfinite)].index : -1;
    r.grad_norm = std::sqrt(res.sum_squares);
    r.found_inf = res.found_inf || !std::isfinite(r.grad_norm);
    return;
  }

  // CUDA (untested on this machine): ATen's own fused check-and-unscale kernel, the norm
  // on the device, then one device-to-host copy of [found_inf, norm].
  std::vector<at::Tensor> grads;
  grads.reserve(entries.size());
  for (const Entry& e : entries) grads.push_back(e.grad);
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(*device);
  at::Tensor found = at::zeros({}, fopts);
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found, at::full({}, inv_scale, fopts));
  std::vector<at::Tensor> norms;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(at::linalg_vector_norm(g, 2, {}, false, at::kFloat));
  const at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  const at::Tensor host = at::stack({found, total}).to(at::kCPU);
  const float* h = host.data_ptr<float>();
  r.grad_norm = static_cast<double>(h[1]);
  r.found_inf = h[0] != 0.0f || !std::isfinite(r.grad_norm);
  r.first_overflow = -1;
  if (h[0] != 0.0f) {  // only on overflow steps: which tensor (one more read per tensor)
    for (std::size_t k = 0; k < grads.size(); ++k) {
      if (!at::isfinite(grads[k]).all().item<bool>()) {
        r.first_overflow = entries[k].index;
        break;
      }
    }
  }
}

void GradScaler::unscale(::torch::optim::Optimizer& opt) {
  if (!enabled_) return;
  Record& r = records_[&opt];
  if (r.stage == OptimizerStage::unscaled) {
    throw std::logic_error("unscale() has already been called on this optimizer since the last update()");
  }
  if (r.stage == OptimizerStage::stepped) throw std::logic_error("unscale() is being called after step()");
  window_.require_complete("unscale()");
  check_unscale(opt, r, true);
  r.stage = OptimizerStage::unscaled;
}

StepOutcome GradScaler::step(::torch::optim::Optimizer& opt, const StepOptions& options) {
  if (options.max_grad_norm && !(std::isfinite(*options.max_grad_norm) && *options.max_grad_norm > 0.0f)) {
    throw std::invalid_argument("GradScaler::step: max_grad_norm " + std::to_string(*options.max_grad_norm) +
                                " is not allowed; it must be finite and > 0");
  }
  Record& r = records_[&opt];
  if (r.stage == OptimizerStage::stepped) {
    throw std::logic_error("step() has already been called since the last update()");
  }
  if (enabled_) window_.require_complete("step()");
  if (r.stage == OptimizerStage::ready) check_unscale(opt, r, true);

  StepOutcome out;
  out.scale = get_scale();
  out.found_inf = r.found_inf;
  out.first_overflow = r.first_overflow;
  if (r.first_overflow >= 0) out.first_overflow_name = name_of(opt, r.first_overflow);
  out.grad_norm = r.grad_norm;
  if (!r.found_inf && options.max_grad_norm && options.clip_norm == ClipNorm::torch) {
    // clip_grad_norm_'s expressions, unchanged, so that the coefficient is its float.
    ::torch::NoGradGuard no_grad;
    std::vector<at::Tensor> grads, norms;
    for (const auto& group : opt.param_groups()) {
      for (const auto& p : group.params()) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
    }
    for (const auto& g : grads) norms.push_back(g.norm(2));
    const at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2);
    const at::Tensor coef = static_cast<double>(*options.max_grad_norm) / (total + 1e-6);
    const at::Tensor clamped = at::clamp(coef, std::nullopt, 1.0);
    for (auto& g : grads) g.mul_(clamped);
    out.grad_norm = total.item<double>();
    out.clip_coef = clamped.item<float>();
    opt.step();
    out.applied = true;
  } else if (!r.found_inf) {
    out.clip_coef = options.max_grad_norm ? clip_coefficient(r.grad_norm, *options.max_grad_norm) : 1.0f;
    if (out.clip_coef < 1.0f) {
      ::torch::NoGradGuard no_grad;
      for (const auto& group : opt.param_groups()) {
        for (const auto& p : group.params()) {
          if (p.grad().defined()) p.grad().mul_(out.clip_coef);
        }
      }
    }
    opt.step();
    out.applied = true;
  }
  if (enabled_) {
    r.stage = OptimizerStage::stepped;
  } else {
    records_.erase(&opt);  // a disabled scaler keeps no records: update() has nothing to do
  }
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
  records_.clear();  // as the core scaler: the step is over even if the update throws
  window_.end();
  scale_->update(found_inf);  // may throw ScaleCollapseError (the scale stays as it was)
}

void GradScaler::set_accumulation_steps(int k) { window_.set_steps(k); }

void GradScaler::backward_done() {
  if (!enabled_) return;
  bool started = false;
  for (const auto& [opt, r] : records_) started = started || r.stage != OptimizerStage::ready;
  window_.backward_done(started);
}

// The state format is the core GradScaler's: a core scaler holding a copy of the scale
// writes it, and parses and validates it on load (same fields, same messages).
std::string GradScaler::state_json() const {
  auto copy = make_loss_scale(scale_->config());
  copy->load(scale_->state());
  mixprec::GradScaler core(std::move(copy), enabled_);
  core.set_accumulation_steps(window_.steps());
  return core.state_json();
}

void GradScaler::load_state_json(std::string_view json) {
  for (const auto& [opt, r] : records_) {
    if (r.stage != OptimizerStage::ready) {
      throw std::logic_error("load_state_json() in the middle of a step: an optimizer is " +
                             std::string(stage_name(r.stage)) + "; load before the step or after update()");
    }
  }
  window_.require_between("load_state_json()");
  mixprec::GradScaler core;
  core.load_state_json(json);  // validates everything, throws std::invalid_argument naming the field
  auto fresh = make_loss_scale(core.loss_scale().config());
  fresh->load(core.loss_scale().state());
  scale_ = std::move(fresh);
  enabled_ = core.enabled();
  window_.set_steps(core.accumulation_steps());
}

}  // namespace mixprec::torch
