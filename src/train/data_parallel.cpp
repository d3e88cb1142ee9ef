// Data-parallel training and ZeRO-1 (docs/distributed.md): the fp32 accumulation of
// micro-batch gradients, what the ranks agree on before a step, the gradient reduction
// (--grad-reduce fp32 or low, or ZeRO-1's reduce-scatter and sharded norm) and
// ZeRO-1's slices.
#include "data_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "mixprec/optim/optimizer.hpp"
#include "trainer_impl.hpp"

namespace mixprec::train {
namespace {

// acc rounded once into the store's grads region (to nearest even, inf past the max).
void store_grads(ParamStore& s, std::span<const float> acc) {
  switch (s.grad_dtype()) {
    case DType::f32: std::memcpy(s.grad_data(), acc.data(), acc.size_bytes()); return;
    case DType::f16: convert(acc, std::span<f16>(static_cast<f16*>(s.grad_data()), acc.size())); return;
    case DType::bf16: convert(acc, std::span<bf16>(static_cast<bf16*>(s.grad_data()), acc.size())); return;
  }
}

bool any_nonfinite(std::span<const float> v) {
  bool bad = false;
  for (const float x : v) bad = bad || !std::isfinite(x);
  return bad;
}

// ZeRO slice boundaries: rank r's slice starts at the first cut point at or after
// r * flat_size / ranks; cut points are tensor starts and kUnscaleChunk boundaries
// inside tensors (the chunks of the norm's fixed summation order).
std::vector<std::size_t> zero_bounds(const ParamStore& s, int ranks) {
  std::vector<std::size_t> cuts;
  for (std::size_t t = 0; t < s.tensor_count(); ++t)
    for (std::size_t k = 0; k == 0 || k < s.numel(t); k += kUnscaleChunk) cuts.push_back(s.offset(t) + k);
  cuts.push_back(s.flat_size());
  std::vector<std::size_t> b{0};
  for (std::size_t r = 1; r < static_cast<std::size_t>(ranks); ++r) {
    const std::size_t ideal = s.flat_size() * r / static_cast<std::size_t>(ranks);
    const auto it = std::lower_bound(cuts.begin(), cuts.end(), std::max(ideal, b.back()));
    b.push_back(it == cuts.end() ? s.flat_size() : *it);
  }
  b.push_back(s.flat_size());
  return b;
}

// ZeRO: the global norm of the unscaled gradients, the exact combination of every
// slice's exact partial sum of squares (z.grads already stored in the slice's store).
// The partial sums travel as bytes.
static_assert(std::is_trivially_copyable_v<ExactSum>);
double zero_global_norm(ZeroShard& z, dist::Communicator& comm, float scale) {
  ExactSum part;
  bool bad = false;
  // A scale whose inverse float32 cannot hold (inf, 0: the keras preset has no floor or guard)
  // unscales nothing: the norm is inf, and the step an overflow (GradScaler skips it too).
  // Every rank has the same scale, so every rank still joins the all-gather below.
  const float inv_scale = inv_scale_of(scale);
  const bool unscalable = !can_unscale(inv_scale);
  if (!unscalable) sum_squares_exact(z.segments, inv_scale, part, bad);
  const std::size_t me = static_cast<std::size_t>(comm.rank());
  z.sums[me] = part;
  comm.all_gather(std::as_bytes(std::span<const ExactSum>(&z.sums[me], 1)),
                  std::as_writable_bytes(std::span<ExactSum>(z.sums)), sizeof(ExactSum));
  ExactSum total;
  for (const ExactSum& s : z.sums) total.merge(s);
  if (unscalable) return std::numeric_limits<double>::infinity();
  return std::sqrt(total.value());
}

}  // namespace

std::unique_ptr<ZeroShard> make_zero_shard(const TrainConfig& config, const nn::ModelConfig& mc, const ParamStore& full,
                                           bool master, const dist::Communicator& comm) {
  auto z = std::make_unique<ZeroShard>();
  z->bounds = zero_bounds(full, comm.size());
  z->begin = z->bounds[static_cast<std::size_t>(comm.rank())];
  z->end = z->bounds[static_cast<std::size_t>(comm.rank()) + 1];
  const std::size_t len = z->end - z->begin;
  const OptimizerKind kind = *parse_optimizer(config.optimizer);
  z->store = std::make_unique<ParamStore>(std::vector<ParamSpec>{{"shard", {len}}},
                                          StoreOptions{full.model_dtype(), full.grad_dtype(), master,
                                                       optimizer_state_slots(kind)});
  {
    // The initial fp32 weights of the slice, from a model built the same way (the
    // model the trainer keeps has no master weights); dropped right away.
    const std::unique_ptr<nn::Model> init = nn::make_model(mc, config.precision, 0);
    const ParamStore& is = init->params();
    if (master) {
      std::memcpy(z->store->master_data(), is.master_data() + z->begin, len * 4);
      z->store->refresh_model();
    } else {
      const std::size_t ds = dtype_size(is.model_dtype());
      std::memcpy(z->store->model_data(), static_cast<const std::byte*>(is.model_data()) + z->begin * ds, len * ds);
    }
  }
  z->grads.assign(len, 0.0f);
  const std::size_t gs = dtype_size(full.grad_dtype());
  for (std::size_t t = 0; t < full.tensor_count(); ++t) {
    const std::size_t lo = std::max(full.offset(t), z->begin);
    const std::size_t hi = std::min(full.offset(t) + full.numel(t), z->end);
    if (lo < hi)
      z->segments.push_back({static_cast<std::byte*>(z->store->grad_data()) + (lo - z->begin) * gs, hi - lo,
                             full.grad_dtype()});
  }
  z->sums.resize(static_cast<std::size_t>(comm.size()));
  return z;
}

void zero_gather(const ZeroShard& z, dist::Communicator& comm, std::size_t flat_size, std::vector<float>& weights,
                 std::vector<std::vector<float>>& states) {
  const ParamStore& zs = *z.store;
  const std::size_t n = flat_size;
  auto gather = [&](const float* shard, std::vector<float>& out) {
    out.assign(n, 0.0f);
    comm.all_gather(std::as_bytes(std::span<const float>(shard, z.end - z.begin)),
                    std::as_writable_bytes(std::span<float>(out)), sizeof(float), z.bounds);
  };
  weights.clear();
  if (zs.has_master()) gather(zs.master_data(), weights);
  states.resize(zs.state_slots());
  for (unsigned k = 0; k < zs.state_slots(); ++k) gather(zs.state_data(k), states[k]);
}

void zero_share_weights(const ZeroShard& z, dist::Communicator& comm, ParamStore& full) {
  const std::size_t ds = dtype_size(full.model_dtype());
  const ParamStore& zs = *z.store;
  comm.all_gather({static_cast<const std::byte*>(zs.model_data()), zs.flat_size() * ds},
                  {static_cast<std::byte*>(full.model_data()), full.flat_size() * ds}, ds, z.bounds);
}

void accumulate_grads(const ParamStore& s, std::span<float> acc, bool first, std::span<float> tmp) {
  if (first) {
    to_f32(s.grad_data(), s.grad_dtype(), acc);
    return;
  }
  to_f32(s.grad_data(), s.grad_dtype(), tmp);
  for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += tmp[i];
}

bool Trainer::Impl::agree_across_ranks(StepRecord& r, double& loss_sum) {
  // found_inf and a non-finite forward pass, MAX over the ranks (after any injection),
  // so that every rank skips together; the scaler checks the reduced gradients again
  // (an overflow the sum itself creates is caught too).
  float flags[2] = {any_nonfinite(acc) ? 1.0f : 0.0f, r.loss_finite ? 0.0f : 1.0f};
  comm->allreduce_max(flags);
  r.loss_finite = flags[1] == 0.0f;
  comm->allreduce_sum(std::span<double>(&loss_sum, 1));
  std::uint64_t counts[6] = {r.act_grads.elements, r.act_grads.nonzero,  r.act_grads.nonfinite_input,
                             r.act_grads.underflow, r.act_grads.subnormal, r.act_grads.overflow};
  comm->allreduce_sum(counts);
  r.act_grads = {counts[0], counts[1], counts[2], counts[3], counts[4], counts[5]};
  return flags[0] != 0.0f;
}

std::optional<double> Trainer::Impl::reduce_gradients(float scale) {
  ParamStore& store = model->params();
  if (config.grad_reduce == "low") {
    // The scaled gradients rounded to the model's f16/bf16 format (the store's
    // gradients themselves when they are f16/bf16), summed in fp32 by their shard
    // owner and rounded again: half the bytes of fp32.
    const bool own = store.grad_dtype() != DType::f32;
    const DType t = own ? store.grad_dtype() : store.model_dtype();
    void* buf = own ? store.grad_data() : static_cast<void*>(low.data());
    const std::size_t n = store.flat_size();
    if (t == DType::f16) {
      const std::span<f16> v(static_cast<f16*>(buf), n);
      convert(std::span<const float>(acc), v);
      comm->allreduce_sum(v);
      if (!own) convert(std::span<const f16>(v), std::span<float>(static_cast<float*>(store.grad_data()), n));
    } else {
      const std::span<bf16> v(static_cast<bf16*>(buf), n);
      convert(std::span<const float>(acc), v);
      comm->allreduce_sum(v);
      if (!own) convert(std::span<const bf16>(v), std::span<float>(static_cast<float*>(store.grad_data()), n));
    }
    return std::nullopt;
  }
  if (zero) {
    // ZeRO-1: each rank receives the rank-order fp32 sums of its slice only; the norm
    // is then computed across the slices.
    comm->reduce_scatter_sum(acc, zero->grads, zero->bounds);
    store_grads(*zero->store, zero->grads);
    return zero_global_norm(*zero, *comm, scale);
  }
  comm->allreduce_sum(std::span<float>(acc));
  store_grads(store, acc);
  return std::nullopt;
}

}  // namespace mixprec::train
