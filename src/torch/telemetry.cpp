#include "mixprec/torch/telemetry.hpp"

#include <ATen/ATen.h>

#include <array>
#include <chrono>
#include <iterator>
#include <optional>
#include <cmath>
#include <stdexcept>

#include "device_counts.hpp"
#include "dtype.hpp"
#include "mixprec/formats/count.hpp"
#include "mixprec/nn/model.hpp"

namespace mixprec::torch {
namespace {

using detail::mixprec_dtype;

// A CPU tensor as the core's view: contiguous fp32/fp16/bf16 as it is (a dense tensor of any
// layout through its storage); anything else as a contiguous copy of its dtype, or fp32 for
// another dtype, kept alive in `keep`. A sparse tensor is its stored values (its implicit
// zeros change no |max|), a complex one its magnitudes |z|, a view with the negative bit its
// values with the sign resolved.
GradTensor view_of(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  if (!t.defined() || t.numel() == 0) return {nullptr, 0, DType::f32};
  at::Tensor c = t;
  if (c.is_sparse()) c = c.detach().coalesce().values();
  else if (c.layout() != at::kStrided) c = c.detach().values();  // CSR, CSC, BSR, BSC
  if (c.is_complex()) c = c.detach().abs();
  else if (c.is_neg()) c = c.detach().resolve_neg();
  const auto d = mixprec_dtype(c.scalar_type());
  if (!(d && c.is_non_overlapping_and_dense())) c = c.detach().to(d ? c.scalar_type() : at::kFloat).contiguous();
  if (c.numel() == 0) return {nullptr, 0, DType::f32};
  if (!c.is_same(t)) keep.push_back(c);
  return {c.data_ptr(), static_cast<std::size_t>(c.numel()), *mixprec_dtype(c.scalar_type())};
}

using Pending = Telemetry::Pending;

// Reads the device results in one host copy per device, in the order they were queued;
// counts the copies in `reads`.
std::vector<std::vector<std::int64_t>> read_all(const std::vector<Pending>& pending, std::uint64_t& reads) {
  std::vector<std::vector<std::int64_t>> out(pending.size());
  std::vector<bool> done(pending.size(), false);
  for (std::size_t first = 0; first < pending.size(); ++first) {
    if (done[first]) continue;
    const at::Device device = pending[first].values.device();
    std::vector<std::size_t> members;
    std::vector<at::Tensor> parts;
    for (std::size_t k = first; k < pending.size(); ++k) {
      if (done[k] || pending[k].values.device() != device) continue;
      members.push_back(k);
      parts.push_back(pending[k].values.reshape({-1}));
      done[k] = true;
    }
    const at::Tensor host = at::cat(parts).to(at::kCPU).contiguous();
    ++reads;
    const std::int64_t* v = host.data_ptr<std::int64_t>();
    for (std::size_t k : members) {
      const auto n = static_cast<std::size_t>(pending[k].values.numel());
      out[k].assign(v, v + n);
      v += n;
    }
  }
  return out;
}

nn::Log2Histogram histogram_from(const std::vector<std::int64_t>& v) {
  nn::Log2Histogram h;
  for (std::size_t i = 0; i < h.counts.size(); ++i) h.counts[i] = static_cast<std::uint64_t>(v[i]);
  h.zeros = static_cast<std::uint64_t>(v[h.counts.size()]);
  h.nonfinite = static_cast<std::uint64_t>(v[h.counts.size() + 1]);
  return h;
}

}  // namespace

Telemetry::Telemetry(std::string dir, const TelemetryOptions& options, Counting counting)
    : rec_(std::move(dir), options), counting_(counting) {}

std::vector<monitor::Alert> Telemetry::finish() { return rec_.finish(); }

bool Telemetry::on_aten(const at::Tensor& t) const { return counting_ == Counting::aten || !t.device().is_cpu(); }

void Telemetry::watch(const std::string& name, const at::Tensor& activation) {
  if (!activation.requires_grad()) {
    throw std::invalid_argument("telemetry: watch('" + name +
                                "'): the tensor does not require grad, so backward never reaches it");
  }
  // A hook on a non-leaf tensor: called with its gradient; returning nothing keeps it. It is
  // called with an undefined tensor for an output of a multi-output node that received no
  // gradient: nothing to count.
  at::Tensor a = activation;
  a.register_hook([this, name](const at::Tensor& g) {
    if (g.defined()) count(name, g);
  });
}

void Telemetry::count(const std::string& name, const at::Tensor& grad) {
  if (on_aten(grad)) {
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor g = detail::counted(grad);
    Pending p{Pending::Kind::gradient, name, detail::counted_dtype(g), static_cast<std::uint64_t>(g.numel()),
              detail::profile(g)};
    std::optional<Pending> h;
    if (rec_.histogram_step())
      h = Pending{Pending::Kind::histogram, "activation_grads", DType::f32, 0,
                  detail::histogram(g, static_cast<std::int64_t>(nn::kHistogramStride))};
    {
      std::lock_guard lock(pending_mu_);
      pending_.push_back(std::move(p));
      if (h) pending_.push_back(std::move(*h));
    }
    rec_.add_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return;
  }
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
  // The scale update() will set, as the protocol decides it (found_inf over every optimizer
  // of the step and every rank), without touching the scaler.
  s.next_scale = scaler.next_scale();
  s.found_inf = outcome.found_inf;
  s.applied = outcome.applied;
  s.grad_norm = outcome.grad_norm;
  s.clip_coef = outcome.clip_coef;
  s.overflow_param = outcome.first_overflow_name;
  // docs/spike_guards.md; none: the recorder's own reading (an outcome built by hand says none)
  if (outcome.reason != SkipReason::none) s.skip_reason = std::string(skip_reason_name(outcome.reason));
  s.loss_z = outcome.guard.loss_z;
  s.grad_z = outcome.guard.grad_z;
  std::vector<train::NamedParam> params;
  std::vector<at::Tensor> keep;
  std::vector<Pending> pending;
  {
    ::torch::NoGradGuard ng;
    const bool histogram = rec_.histogram_step();
    // Parameters counted by ATen: their |max| in one reduction per dtype, histograms summed.
    std::vector<at::Tensor> on_device;
    std::vector<std::pair<std::size_t, bool>> where;  // (parameter, is_gradient)
    for (const auto& item : named_parameters) {
      const at::Tensor& p = item.value();
      const std::size_t i = params.size();
      if (on_aten(p)) {
        params.push_back({item.key(), {}, {nullptr, static_cast<std::size_t>(p.numel()), DType::f32}});
        if (p.grad().defined()) {
          on_device.push_back(detail::counted(p.grad()));
          where.emplace_back(i, true);
        }
        on_device.push_back(detail::counted(p));
        where.emplace_back(i, false);
      } else {
        params.push_back({item.key(), view_of(p.grad(), keep), view_of(p.detach(), keep)});
      }
    }
    std::vector<std::size_t> order;
    if (!on_device.empty()) {
      auto [bits, o] = detail::amax_bits(on_device);
      order = std::move(o);
      if (!order.empty()) pending.push_back({Pending::Kind::gradient, "", DType::f32, 0, bits});
      if (histogram) {
        for (const bool grads : {true, false}) {
          std::vector<at::Tensor> hs;
          for (std::size_t k = 0; k < on_device.size(); ++k)
            if (where[k].second == grads) hs.push_back(detail::histogram(on_device[k], 1));
          if (!hs.empty())
            pending.push_back({Pending::Kind::histogram, grads ? "weight_grads" : "weights", DType::f32, 0,
                               at::stack(hs).sum(0)});
        }
      }
      for (std::size_t k = 0; k < on_device.size(); ++k) {
        train::NamedParam& np = params[where[k].first];
        (where[k].second ? np.grad_amax : np.weight_amax) = 0.0f;  // empty: 0 unless measured below
      }
    }
    std::vector<Pending> hooks;
    {
      std::lock_guard lock(pending_mu_);
      hooks.swap(pending_);
    }
    const std::size_t params_first = hooks.size();
    hooks.insert(hooks.end(), std::make_move_iterator(pending.begin()), std::make_move_iterator(pending.end()));
    const std::vector<std::vector<std::int64_t>> host = read_all(hooks, host_reads_);
    for (std::size_t k = 0; k < hooks.size(); ++k) {
      const Pending& p = hooks[k];
      const std::vector<std::int64_t>& v = host[k];
      if (p.kind == Pending::Kind::histogram) {
        train::StepRecord::Histograms h;
        const nn::Log2Histogram one = histogram_from(v);
        if (p.name == "activation_grads") h.activation_grads = one;
        else if (p.name == "weight_grads") h.weight_grads = one;
        else h.weights = one;
        rec_.add_histograms(h);
      } else if (k < params_first) {
        const std::array<std::uint64_t, 5> above = {static_cast<std::uint64_t>(v[0]), static_cast<std::uint64_t>(v[1]),
                                                    static_cast<std::uint64_t>(v[2]), static_cast<std::uint64_t>(v[3]),
                                                    static_cast<std::uint64_t>(v[4])};
        rec_.add_activation_grad(p.name, counted_from_profile(p.dtype, p.elements, above, static_cast<std::uint32_t>(v[5])),
                                 p.dtype);
      } else {  // the parameters' |max|, in `order`
        for (std::size_t j = 0; j < order.size(); ++j) {
          train::NamedParam& np = params[where[order[j]].first];
          (where[order[j]].second ? np.grad_amax : np.weight_amax) =
              detail::f32_from_bits(static_cast<std::uint32_t>(v[j]));
        }
      }
    }
  }
  const double views_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rec_.add_seconds(views_s);
  return rec_.record(s, params);
}

}  // namespace mixprec::torch
