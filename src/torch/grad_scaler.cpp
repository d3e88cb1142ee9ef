// mixprec::torch::GradScaler: ScalerProtocol over libtorch tensors and optimizers. What this
// file decides is only where a gradient is read: the core's check on its memory, or ATen.
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
#include "dtype.hpp"

namespace mixprec::torch {
namespace {

using detail::mixprec_dtype;

// One gradient to check: its index over the optimizer's parameters and the tensor read
// (a sparse gradient's values).
struct Entry {
  std::int64_t index;
  at::Tensor grad;
};

// Read by the core: CPU fp32/fp16/bf16 over one block of memory (any dense layout).
bool core_readable(const at::Tensor& g) {
  return g.device().is_cpu() && mixprec_dtype(g.scalar_type()) && g.is_non_overlapping_and_dense();
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

GradientCheck merge(const GradientCheck& a, const std::vector<std::int64_t>& a_index, const GradientCheck& b,
                    const std::vector<std::int64_t>& b_index) {
  GradientCheck m;
  m.checked = a.checked || b.checked;
  m.found_inf = a.found_inf || b.found_inf;
  const std::int64_t ia = a.first_overflow >= 0 ? a_index[static_cast<std::size_t>(a.first_overflow)] : -1;
  const std::int64_t ib = b.first_overflow >= 0 ? b_index[static_cast<std::size_t>(b.first_overflow)] : -1;
  m.first_overflow = ia < 0 ? ib : (ib < 0 ? ia : std::min(ia, ib));
  m.sum_squares = (a.checked ? a.sum_squares : 0.0) + (b.checked ? b.sum_squares : 0.0);
  m.carried_inv_scale = 1.0f;
  return m;
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
      return "param[" + std::to_string(index) + "]";
    }
  }
  return "param[" + std::to_string(index) + "]";
}

// Validates every gradient of `opt` (nothing is touched before all are checked), then checks
// and unscales them in place: libtorch's optimizers read the gradients as they are.
GradientCheck GradScaler::check(::torch::optim::Optimizer& opt) {
  std::vector<Entry> entries;
  std::int64_t index = 0;
  std::optional<std::pair<at::Device, std::int64_t>> first_device;
  std::vector<std::pair<at::Tensor*, std::int64_t>> to_coalesce;  // fp16 sparse gradients
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      const std::int64_t i = index++;
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;  // took no part in the loss: skipped, as PyTorch does
      auto who = [&] { return "the gradient of " + name_of(opt, i); };
      if (g.is_meta()) {
        throw std::invalid_argument(who() + " is a meta tensor (no values to check); mixprec::torch::GradScaler "
                                    "checks gradients on CPU, CUDA or another device with memory");
      }
      if (g.layout() != at::kStrided && g.layout() != at::kSparse) {
        throw std::invalid_argument(who() + " has layout " + c10::str(g.layout()) +
                                    "; mixprec::torch::GradScaler takes strided and sparse COO gradients, as "
                                    "torch.amp.GradScaler does");
      }
      if (!at::isFloatingType(g.scalar_type())) {
        throw std::invalid_argument(who() + " has dtype " + std::string(c10::toString(g.scalar_type())) +
                                    "; gradients must be floating point");
      }
      if (!first_device) {
        first_device = std::make_pair(g.device(), i);
      } else if (first_device->first != g.device()) {
        throw std::invalid_argument("gradients on more than one device: " + name_of(opt, first_device->second) +
                                    " on " + first_device->first.str() + ", " + name_of(opt, i) + " on " +
                                    g.device().str() + "; use one GradScaler step per device's optimizer");
      }
      if (g.is_sparse() && g.scalar_type() == at::kHalf) to_coalesce.emplace_back(&p.mutable_grad(), i);
      entries.push_back({i, g});
    }
  }
  // Everything validated: torch's sparse rule (fp16 duplicates summed before the check, where
  // they may overflow), then each sparse gradient read through its values.
  for (auto& [grad, i] : to_coalesce) *grad = grad->coalesce();
  std::vector<GradTensor> views;
  std::vector<std::int64_t> view_index, aten_index;
  std::vector<at::Tensor> aten;
  for (Entry& e : entries) {
    at::Tensor g = e.grad;
    if (g.is_sparse()) {
      for (const auto& [grad, i] : to_coalesce)
        if (i == e.index) g = *grad;
      g = g._values();
    }
    if (path_ == GradientPath::automatic && core_readable(g)) {
      views.push_back({g.numel() ? g.data_ptr() : nullptr, static_cast<std::size_t>(g.numel()),
                       *mixprec_dtype(g.scalar_type())});
      view_index.push_back(e.index);
    } else {
      aten.push_back(g);
      aten_index.push_back(e.index);
    }
  }
  const float scale = get_scale();
  if (aten.empty()) {
    GradientCheck c = check_gradients(views, scale, true);
    if (c.first_overflow >= 0) c.first_overflow = view_index[static_cast<std::size_t>(c.first_overflow)];
    return c;
  }
  if (views.empty()) {
    GradientCheck c = check_gradients_aten(aten, scale, true);
    if (c.first_overflow >= 0) c.first_overflow = aten_index[static_cast<std::size_t>(c.first_overflow)];
    return c;
  }
  // Both kinds: at a scale below 1 nothing is written until both have been read.
  const bool read_first = inv_scale_of(scale) > 1.0f;
  GradientCheck c = merge(check_gradients(views, scale, !read_first), view_index,
                          check_gradients_aten(aten, scale, !read_first), aten_index);
  if (read_first && !c.found_inf) {
    (void)check_gradients(views, scale, true);
    (void)check_gradients_aten(aten, scale, true);
  }
  return c;
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

  StepOutcome out;
  out.scale = decision.scale;
  out.found_inf = decision.found_inf;
  out.first_overflow = decision.first_overflow;
  if (out.first_overflow >= 0) out.first_overflow_name = name_of(opt, out.first_overflow);
  out.grad_norm = decision.grad_norm;
  out.clip_coef = decision.clip_coef;
  out.reason = decision.reason;
  out.guard = decision.guard;
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
