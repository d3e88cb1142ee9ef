// mixprec::torch::GradScaler: ScalerProtocol over libtorch tensors and optimizers. Where a
// gradient is read (the core's check on its memory, or ATen) is the core's decision
// (scaler/grad_route.hpp); this file describes the tensors and carries it out.
#include "mixprec/torch/grad_scaler.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mixprec/scaler/check_gradients.hpp"
#include "mixprec/scaler/grad_route.hpp"

namespace mixprec::torch {
namespace {

TensorLayout layout_of(at::Layout layout) noexcept {
  switch (layout) {
    case at::kStrided: return TensorLayout::strided;
    case at::kSparse: return TensorLayout::sparse_coo;
    case at::kSparseCsr: return TensorLayout::sparse_csr;
    case at::kSparseCsc: return TensorLayout::sparse_csc;
    case at::kSparseBsr: return TensorLayout::sparse_bsr;
    case at::kSparseBsc: return TensorLayout::sparse_bsc;
    case at::kMkldnn: return TensorLayout::mkldnn;
    case at::kJagged: return TensorLayout::jagged;
    default: return TensorLayout::other;
  }
}

// `g` as the core's routing reads it; `device` holds its device's name for the descriptor.
GradDescriptor describe(const at::Tensor& g, std::string& device) {
  device = g.device().str();
  GradDescriptor d;
  d.dtype = c10::getDtypeNames(g.scalar_type()).first;
  d.floating_point = at::isFloatingType(g.scalar_type());
  d.layout = layout_of(g.layout());
  d.device = device;
  if (g.layout() == at::kStrided) {
    d.sizes = {g.sizes().data(), g.sizes().size()};
    d.strides = {g.strides().data(), g.strides().size()};
  }
  return d;
}

// Which element of `grads` first holds inf/NaN; -1 when none.
std::int64_t first_nonfinite(const std::vector<at::Tensor>& grads) {
  for (std::size_t k = 0; k < grads.size(); ++k)
    if (!at::isfinite(grads[k]).all().item<bool>()) return static_cast<std::int64_t>(k);
  return -1;
}

// check_gradients' contract (scaler/check_gradients.hpp) through ATen's own unscale kernel,
// for what the core does not read: float64, strided or overlapping views, device tensors.
GradientCheck check_gradients_aten(const std::vector<at::Tensor>& grads, float scale, bool write) {
  GradientCheck c;
  c.checked = !grads.empty();
  if (grads.empty()) {
    c.sum_squares = 0;
    c.carried_inv_scale = 1.0f;
    return c;
  }
  const float inv = inv_scale_of(scale);
  if (!can_unscale(inv)) {
    c.found_inf = true;
    c.first_overflow = first_nonfinite(grads);
    return c;
  }
  // At a scale below 1 (or when nothing may be written) the kernel runs on copies first.
  const bool in_place = write && inv <= 1.0f;
  std::vector<at::Tensor> work;
  work.reserve(grads.size());
  for (const auto& g : grads) work.push_back(in_place ? g : g.clone());
  const auto device = grads.front().device();
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor found = at::zeros({}, fopts);
  at::_amp_foreach_non_finite_check_and_unscale_(work, found, at::full({}, inv, fopts));
  std::vector<at::Tensor> squares;
  squares.reserve(work.size());
  for (const auto& w : work) {
    const auto acc = w.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    squares.push_back(at::linalg_vector_norm(w, 2, {}, false, acc).to(at::kDouble).square());
  }
  const at::Tensor host = at::stack({found.to(at::kDouble), at::stack(squares).sum()}).to(at::kCPU);
  const double* h = host.data_ptr<double>();
  c.found_inf = h[0] != 0.0;
  c.sum_squares = h[1];
  if (inv > 1.0f) {
    // Products that overflowed their dtype are inf in the copies, as inf/NaN inputs are.
    c.first_overflow = first_nonfinite(work);
    c.found_inf = c.found_inf || c.first_overflow >= 0;
  } else if (c.found_inf) {
    c.first_overflow = first_nonfinite(grads);
  }
  if (c.found_inf) {
    c.sum_squares = std::numeric_limits<double>::infinity();
    return c;
  }
  if (write && !in_place)
    for (std::size_t k = 0; k < grads.size(); ++k) grads[k].copy_(work[k]);
  c.carried_inv_scale = write ? 1.0f : inv;
  return c;
}

}  // namespace

GradScaler::GradScaler(const LossScaleConfig& config, bool enabled) : ScalerDoor(ScalerProtocol(config, enabled)) {}

GradScaler::GradScaler(std::unique_ptr<LossScale> scale, bool enabled)
    : ScalerDoor(ScalerProtocol(std::move(scale), enabled)) {}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!loss.defined()) throw std::invalid_argument("GradScaler::scale: the loss tensor is undefined");
  if (!enabled()) return loss;
  return loss * at::scalar_tensor(get_scale(), at::TensorOptions().dtype(at::kFloat).device(loss.device()));
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
      break;
    }
  }
  return default_parameter_name(index);
}

// Routes every gradient of `opt` (the core validates all before anything is touched), then
// checks and unscales them in place: libtorch's optimizers read the gradients as they are.
GradientCheck GradScaler::check(::torch::optim::Optimizer& opt) {
  std::vector<at::Tensor*> grads;
  std::vector<std::int64_t> index;
  std::int64_t i = 0;
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) {  // else it took no part in the loss: skipped, as PyTorch does
        grads.push_back(&p.mutable_grad());
        index.push_back(i);
      }
      ++i;
    }
  }
  std::vector<std::string> devices(grads.size());
  std::vector<GradDescriptor> described;
  described.reserve(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) described.push_back(describe(*grads[k], devices[k]));
  const bool aten_only = path_ == GradientPath::aten;
  const std::vector<GradRouting> routes =
      route_gradients(described, index, aten_only, [&](std::int64_t j) { return name_of(opt, j); });
  for (std::size_t k = 0; k < grads.size(); ++k)
    if (routes[k].coalesce) *grads[k] = grads[k]->coalesce();
  std::vector<GradTensor> views;
  std::vector<std::int64_t> view_index, aten_index;
  std::vector<at::Tensor> aten;
  for (std::size_t k = 0; k < grads.size(); ++k) {
    at::Tensor g = *grads[k];
    GradRouting r = routes[k];
    if (r.route == GradRoute::sparse_values) {
      g = g._values();
      std::string device;
      r = route_gradient(describe(g, device), aten_only);
    }
    if (r.route == GradRoute::core) {
      views.push_back({g.numel() ? g.data_ptr() : nullptr, static_cast<std::size_t>(g.numel()), r.dtype});
      view_index.push_back(index[k]);
    } else {
      aten.push_back(g);
      aten_index.push_back(index[k]);
    }
  }
  const float scale = get_scale();
  return check_in_two_reads(scale, view_index, aten_index, [&](bool core, bool write) {
    return core ? check_gradients(views, scale, write) : check_gradients_aten(aten, scale, write);
  });
}

void GradScaler::unscale(::torch::optim::Optimizer& opt) {
  if (!protocol_.checks_on_unscale()) return;
  protocol_.begin_unscale(id_of(opt));
  protocol_.record(id_of(opt), check(opt));
}

StepOutcome GradScaler::step(::torch::optim::Optimizer& opt, const StepOptions& options) {
  mixprec::DecideOptions d;
  d.max_grad_norm = options.max_grad_norm;
  ScalerProtocol::validate_options(d);  // before anything is read or written
  const OptimizerId id = id_of(opt);
  if (protocol_.begin_step(id) == StepPlan::check) protocol_.record(id, check(opt));
  if (options.loss) protocol_.observe_loss(*options.loss);
  if (options.skip_if) d.user_skip = options.skip_if(protocol_.guard_view(id, d));
  const StepDecision decision = protocol_.decide(id, d);

  StepOutcome out = step_outcome(decision);
  if (out.first_overflow >= 0) out.first_overflow_name = name_of(opt, out.first_overflow);
  if (decision.apply) {
    if (decision.clip_pending) {
      ::torch::NoGradGuard no_grad;
      std::vector<at::Tensor> grads;
      for (const auto& group : opt.param_groups())
        for (const auto& p : group.params())
          if (p.grad().defined()) grads.push_back(p.grad());
      if (options.clip_norm == ClipNorm::torch) {
        // clip_grad_norm_'s expressions, unchanged, so that the coefficient is its float.
        std::vector<at::Tensor> norms;
        for (const auto& g : grads) norms.push_back(g.norm(2));
        const at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2);
        const at::Tensor coef = static_cast<double>(*options.max_grad_norm) / (total + 1e-6);
        const at::Tensor clamped = at::clamp(coef, std::nullopt, 1.0);
        for (auto& g : grads) g.mul_(clamped);
        out.grad_norm = total.item<double>();
        out.clip_coef = clamped.item<float>();
      } else if (out.clip_coef < 1.0f) {
        for (auto& g : grads) g.mul_(out.clip_coef);
      }
      protocol_.clip_applied(id, out.clip_coef, out.grad_norm);
    }
    opt.step();  // if it throws, the gradients stay unscaled (and clipped) once: a retry only steps
    out.applied = true;
  }
  protocol_.step_done(id);
  return out;
}

}  // namespace mixprec::torch
