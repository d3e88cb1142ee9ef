// Data-parallel training and ZeRO-1 (docs/distributed.md): the fp32 accumulation of
// micro-batch gradients, what the ranks agree on before a step, the gradient reduction
// (--grad-reduce fp32 or low, or ZeRO-1's reduce-scatter and sharded norm) and
// ZeRO-1's slices.
#include "data_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
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

// ZeRO over whole tensors: rank r's slice starts at the tensor start nearest r * flat_size /
// ranks that leaves every rank at least one tensor.
std::vector<std::size_t> zero_tensor_bounds(const ParamStore& s, int ranks) {
  const auto n = static_cast<std::size_t>(ranks);
  if (s.tensor_count() < n)
    throw std::invalid_argument("zero: expected at least as many parameter tensors as ranks with --master/--moments "
                                "other than fp32 (ZeRO-1 then shards whole tensors), found " +
                                std::to_string(s.tensor_count()) + " tensors for " + std::to_string(ranks) + " ranks");
  std::vector<std::size_t> b{0};
  std::size_t t = 0;  // the first tensor of the next slice
  for (std::size_t r = 1; r < n; ++r) {
    const std::size_t ideal = s.flat_size() * r / n;
    std::size_t best = t + 1;  // at least one tensor in the slice before
    for (std::size_t c = t + 1; c + (n - r) <= s.tensor_count(); ++c) {
      const auto dist = [&](std::size_t k) { return s.offset(k) > ideal ? s.offset(k) - ideal : ideal - s.offset(k); };
      if (dist(c) < dist(best)) best = c;
    }
    t = best;
    b.push_back(s.offset(t));
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
  const StateFormats formats = state_formats(config);
  z->whole_tensors = formats.master != MasterFormat::fp32 || formats.m != MomentFormat::fp32 ||
                     formats.v != MomentFormat::fp32;
  z->bounds = z->whole_tensors ? zero_tensor_bounds(full, comm.size()) : zero_bounds(full, comm.size());
  z->begin = z->bounds[static_cast<std::size_t>(comm.rank())];
  z->end = z->bounds[static_cast<std::size_t>(comm.rank()) + 1];
  const std::size_t len = z->end - z->begin;
  const OptimizerKind kind = *parse_optimizer(config.optimizer);
  const StoreOptions options{full.model_dtype(), full.grad_dtype(), master, optimizer_state_slots(kind),
                             z->whole_tensors ? formats : StateFormats{}};
  if (z->whole_tensors) {
    std::vector<ParamSpec> specs;
    while (full.offset(z->first_tensor) < z->begin) ++z->first_tensor;
    for (std::size_t t = z->first_tensor; t < full.tensor_count() && full.offset(t) < z->end; ++t)
      specs.push_back(full.spec(t));
    z->store = std::make_unique<ParamStore>(std::move(specs), options);
    // The tensors' padded layout repeats from any tensor start (offsets are multiples of
    // kAlignElements): the slice [begin, end) of every full region is this store's region.
    if (z->store->flat_size() != len)
      throw std::logic_error("ZeRO: a whole-tensor slice of " + std::to_string(len) + " elements laid out as " +
                             std::to_string(z->store->flat_size()));
  } else {
    z->store = std::make_unique<ParamStore>(std::vector<ParamSpec>{{"shard", {len}}}, options);
  }
  {
    // The initial fp32 weights of the slice, from a model built the same way (the
    // model the trainer keeps has no master weights); dropped right away.
    const std::unique_ptr<nn::Model> init = nn::make_model(mc, config.precision, 0);
    const ParamStore& is = init->params();
    if (master) {
      z->store->set_weights_of_record({is.master_data() + z->begin, len});  // remainder masters: split
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

std::unique_ptr<ParamStore> zero_gather_store(const ZeroShard& z, dist::Communicator& comm, const ParamStore& full) {
  const ParamStore& zs = *z.store;
  std::vector<ParamSpec> specs;
  for (std::size_t t = 0; t < full.tensor_count(); ++t) specs.push_back(full.spec(t));
  auto g = std::make_unique<ParamStore>(std::move(specs), zs.options());
  // The flat regions: every rank's [begin, end) is its store's region, element for element.
  auto flat = [&](const void* shard, void* out, std::size_t elem) {
    comm.all_gather({static_cast<const std::byte*>(shard), zs.flat_size() * elem},
                    {static_cast<std::byte*>(out), g->flat_size() * elem}, elem, z.bounds);
  };
  flat(zs.model_data(), g->model_data(), dtype_size(zs.model_dtype()));
  if (zs.remainder_data() != nullptr) flat(zs.remainder_data(), g->remainder_data(), 2);
  else if (zs.master_data() != nullptr) flat(zs.master_data(), g->master_data(), 4);
  // The moments: each tensor's codes then scales, every rank's tensors in order, as bytes.
  const std::size_t ranks = z.bounds.size() - 1;
  for (unsigned k = 0; k < zs.state_slots(); ++k) {
    if (!zs.compact_moments()) {
      flat(zs.state_data(k), g->state_data(k), 4);
      continue;
    }
    auto bytes_of = [&](const MomentView& v) { return v.layout.code_bytes() + 4 * v.layout.scale_count(); };
    std::vector<std::size_t> byte_bounds{0};
    for (std::size_t r = 0, t = 0; r < ranks; ++r) {
      std::size_t sum = 0;
      for (; t < g->tensor_count() && g->offset(t) < z.bounds[r + 1]; ++t) sum += bytes_of(g->moment(k, t));
      byte_bounds.push_back(byte_bounds.back() + sum);
    }
    std::vector<std::byte> mine, all(byte_bounds.back());
    for (std::size_t j = 0; j < zs.tensor_count(); ++j) {
      const MomentView v = const_cast<ParamStore&>(zs).moment(k, j);
      const auto* c = static_cast<const std::byte*>(v.codes);
      mine.insert(mine.end(), c, c + v.layout.code_bytes());
      const auto* sc = reinterpret_cast<const std::byte*>(v.scales);
      mine.insert(mine.end(), sc, sc + 4 * v.layout.scale_count());
    }
    comm.all_gather(mine, all, 1, byte_bounds);
    for (std::size_t t = 0, at = 0; t < g->tensor_count(); ++t) {
      const MomentView v = g->moment(k, t);
      std::memcpy(v.codes, all.data() + at, v.layout.code_bytes());
      at += v.layout.code_bytes();
      std::memcpy(v.scales, all.data() + at, 4 * v.layout.scale_count());
      at += 4 * v.layout.scale_count();
    }
  }
  return g;
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
