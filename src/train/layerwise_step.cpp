// Per-layer loss scaling in the training loop (preset layerwise; docs/loss_scaling.md,
// "Per-layer loss scaling"): which layers step, which are skipped, and the gradients brought
// back to the base scale before the scaler's one check.
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "mixprec/nn/precision.hpp"
#include "mixprec/scaler/layerwise.hpp"
#include "trainer_impl.hpp"

namespace mixprec::train {

void check_layerwise(const TrainConfig& c) {
  if (c.loss_scale != "layerwise") return;
  const nn::PrecisionPolicy p = nn::policy_of(c.precision);
  // The engine scales a layer's fp32 operands in place and brings the fp32 weight gradients
  // back to the base scale: bf16 and the fp8 presets multiply stored operands instead, and
  // fp16-pure keeps fp16 weight gradients.
  if (nn::is_fp8(c.precision) || p.activations == DType::bf16 || p.weight_grads != DType::f32)
    throw std::invalid_argument("loss-scale layerwise: expected precision fp16 or fp32, found " +
                                std::string(nn::precision_name(c.precision)));
  if (c.distributed)
    throw std::invalid_argument("loss-scale layerwise: expected a single-process run, found distributed");
}

void Trainer::Impl::finish_layers(StepRecord& r) {
  ParamStore& store = model->params();
  const std::size_t n = store.tensor_count();
  float* grads = static_cast<float*>(store.grad_data());  // f32 (check_layerwise)
  auto finite = [&](std::size_t t) {
    const float* g = grads + store.offset(t);
    for (std::size_t i = 0; i < store.numel(t); ++i)
      if (!std::isfinite(g[i])) return false;
    return true;
  };
  std::vector<char> ok(n);
  for (std::size_t t = 0; t < n; ++t) ok[t] = finite(t);
  r.layers.clear();
  std::vector<char> skip(n, 0);  // the tensors of layers that do not step, then any other inf/NaN
  for (const nn::ScaledLayer& l : model->scaled_layers()) {
    bool all = true;
    for (std::size_t t : l.params) all = all && ok[t];
    const std::size_t i = *layerwise->find(l.name);
    const LayerOutcome o = layerwise->finish_layer(i, all);
    const LayerState& s = layerwise->layer(i);
    r.layers.push_back({l.name, s.factor, s.chain, s.backoff, std::string(layer_outcome_name(o))});
    if (o != LayerOutcome::applied)
      for (std::size_t t : l.params) skip[t] = 1;
  }
  // A layer started the overflow: every inf/NaN of the step is explained by it; the layers
  // holding one, and any other tensor holding one, skip their update (zeroed here, put back
  // after the step). Otherwise the scaler's check sees them and skips the whole step, as one
  // scale would.
  skipped.clear();
  if (layerwise->any_origin())
    for (std::size_t t = 0; t < n; ++t)
      if (skip[t] || !ok[t]) skipped.push_back(t);
  const std::span<const double> factors = model->grad_factors();
  std::size_t next_skipped = 0;
  for (std::size_t t = 0; t < n; ++t) {
    float* g = grads + store.offset(t);
    if (next_skipped < skipped.size() && skipped[next_skipped] == t) {
      ++next_skipped;
      std::fill(g, g + store.numel(t), 0.0f);
    } else if (factors[t] != 1.0) {
      // Exact: a power of two on fp32 values far from fp32's range ends.
      const float k = static_cast<float>(1.0 / factors[t]);
      for (std::size_t i = 0; i < store.numel(t); ++i) g[i] *= k;
    }
  }
  // The skipped tensors' weights of record, model copy and optimizer state, as they are.
  skipped_saved.clear();
  const std::size_t model_width = dtype_size(store.model_dtype());
  auto save = [&](const void* base, std::size_t width, std::size_t t) {
    const auto* p = static_cast<const std::byte*>(base) + store.offset(t) * width;
    skipped_saved.insert(skipped_saved.end(), p, p + store.numel(t) * width);
  };
  for (std::size_t t : skipped) {
    if (store.has_master()) save(store.master_data(), 4, t);
    save(store.model_data(), model_width, t);
    for (unsigned k = 0; k < store.state_slots(); ++k) save(store.state_data(k), 4, t);
  }
}

void Trainer::Impl::restore_skipped() {
  ParamStore& store = model->params();
  const std::size_t model_width = dtype_size(store.model_dtype());
  std::size_t at = 0;
  auto put = [&](void* base, std::size_t width, std::size_t t) {
    const std::size_t bytes = store.numel(t) * width;
    std::memcpy(static_cast<std::byte*>(base) + store.offset(t) * width, skipped_saved.data() + at, bytes);
    at += bytes;
  };
  for (std::size_t t : skipped) {
    if (store.has_master()) put(store.master_data(), 4, t);
    put(store.model_data(), model_width, t);
    for (unsigned k = 0; k < store.state_slots(); ++k) put(store.state_data(k), 4, t);
  }
}

}  // namespace mixprec::train
