#include "mixprec/optim/optimizer.hpp"
#include "mixprec/core/text.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/select_kernels.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/formats/kernel_table.hpp"
#include "mixprec/optim/clip.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "optim/kernels.hpp"

namespace mixprec {

const optim_detail::UpdateKernels* optim_detail::update_kernels(Isa isa) noexcept {
  // The AVX-512 table where the CPU has it: with the per-line prefetch it moves more bytes
  // a second from one core than AVX2 (docs/optimizers.md, "The AVX-512 build").
  return detail::select_kernels(isa, &scalar_update_kernels, &avx2_update_kernels, &avx512_update_kernels);
}

using optim_detail::AdamScalars;
using optim_detail::kChunk;
using optim_detail::SgdScalars;
using optim_detail::UpdateKernels;

std::string_view optimizer_name(OptimizerKind k) noexcept {
  switch (k) {
    case OptimizerKind::sgd: return "sgd";
    case OptimizerKind::sgd_momentum: return "sgd-momentum";
    case OptimizerKind::adam: return "adam";
    case OptimizerKind::adamw: return "adamw";
  }
  return "?";
}

std::optional<OptimizerKind> parse_optimizer(std::string_view s) noexcept {
  for (OptimizerKind k : {OptimizerKind::sgd, OptimizerKind::sgd_momentum, OptimizerKind::adam, OptimizerKind::adamw})
    if (s == optimizer_name(k)) return k;
  return std::nullopt;
}

unsigned optimizer_state_slots(OptimizerKind k) noexcept {
  switch (k) {
    case OptimizerKind::sgd: return 0;
    case OptimizerKind::sgd_momentum: return 1;
    default: return 2;
  }
}

namespace {

using text::num;

void require(bool ok, const std::string& what, double found) {
  if (!ok) throw std::invalid_argument("optimizer: expected " + what + ", found " + num(found));
}

// Hyperparameter checks shared by construction and load_state (PyTorch's, plus finiteness).
void validate_hyper(const OptimizerState& s) {
  require(std::isfinite(s.lr) && s.lr >= 0, "lr finite and >= 0", s.lr);
  require(std::isfinite(s.weight_decay) && s.weight_decay >= 0, "weight_decay finite and >= 0", s.weight_decay);
  if (s.kind == OptimizerKind::adam || s.kind == OptimizerKind::adamw) {
    require(std::isfinite(s.eps) && s.eps >= 0, "eps finite and >= 0", s.eps);
    require(s.beta1 >= 0 && s.beta1 < 1, "beta1 in [0, 1)", s.beta1);
    require(s.beta2 >= 0 && s.beta2 < 1, "beta2 in [0, 1)", s.beta2);
  } else {
    require(std::isfinite(s.momentum) && s.momentum >= 0, "momentum finite and >= 0", s.momentum);
    require(std::isfinite(s.dampening), "dampening finite", s.dampening);
    if (s.nesterov) {
      require(s.momentum > 0, "momentum > 0 for nesterov", s.momentum);
      require(s.dampening == 0, "dampening == 0 for nesterov", s.dampening);
    }
  }
  require(s.step >= 0, "step >= 0", static_cast<double>(s.step));
}

AdamScalars adam_scalars(const OptimizerState& s, double lr, std::int64_t t) {
  return optim_detail::adam_scalars(lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.kind == OptimizerKind::adamw, t);
}

SgdScalars sgd_scalars(const OptimizerState& s, double lr) {
  SgdScalars g{};
  g.weight_decay = static_cast<float>(s.weight_decay);
  g.momentum = static_cast<float>(s.momentum);
  g.one_minus_dampening = static_cast<float>(1.0 - s.dampening);
  g.neg_lr = static_cast<float>(-lr);
  g.has_wd = s.weight_decay != 0;
  g.has_momentum = s.kind == OptimizerKind::sgd_momentum && s.momentum != 0;
  g.first = s.step == 0;
  g.nesterov = s.nesterov;
  return g;
}

const FormatKernels* format_kernels(const KernelTable* t, DType d) noexcept {
  switch (d) {
    case DType::f16: return &t->f16;
    case DType::bf16: return &t->bf16;
    default: return nullptr;
  }
}

// Everything one pass needs, resolved before any element is touched.
struct Pass {
  const UpdateKernels* k;
  const FormatKernels* grad_fmt;   // nullptr: f32 grads
  const FormatKernels* model_fmt;  // nullptr: f32 model
  std::byte* grads;
  std::byte* model;
  float* master;
  float* s0;
  float* s1;
  bool adam;
  AdamScalars as;
  SgdScalars ss;
  float inv_scale, clip;
  bool sr;
  std::uint64_t key;

  void update(float* p, const float* g, std::size_t i, std::size_t n, float pre, float clip_coef) const noexcept {
    if (adam) k->adam(p, s0 + i, s1 + i, g, n, pre, clip_coef, as);
    else k->sgd(p, s0 != nullptr ? s0 + i : nullptr, g, n, pre, clip_coef, ss);
  }
  // Writes the low-precision weights (model copy or pure weights) from fp32 p.
  void write_model(const float* p, std::size_t i, std::size_t n) const noexcept {
    const ConvertOptions plain{};
    if (model_fmt == nullptr) {
      float* dst = reinterpret_cast<float*>(model) + i;
      if (dst != p) std::memcpy(dst, p, n * sizeof(float));
    } else if (sr) {
      alignas(64) std::uint32_t bits[kChunk];
      for (std::size_t j = 0; j < n; j += kChunk) {
        const std::size_t m = std::min(kChunk, n - j);
        k->sr_bits(bits, i + j, m, key);
        model_fmt->encode_stochastic(p + j, model + 2 * (i + j), bits, m, plain);
      }
    } else {
      model_fmt->encode(p, model + 2 * i, n, plain);
    }
  }
};

// The fused pass over [begin, end): read grads, multiply, update, write the model copy.
void fused_range(const Pass& c, std::size_t begin, std::size_t end) noexcept {
  alignas(64) float gbuf[kChunk];
  alignas(64) float pbuf[kChunk];
  const ConvertOptions gopt{Overflow::ieee, Subnormals::keep, c.inv_scale};
  for (std::size_t i = begin; i < end; i += kChunk) {
    const std::size_t n = std::min(kChunk, end - i);
    const float* g;
    float pre;
    if (c.grad_fmt == nullptr) {
      g = reinterpret_cast<const float*>(c.grads) + i;
      pre = c.inv_scale;
    } else {
      c.grad_fmt->decode(c.grads + 2 * i, gbuf, n, gopt);
      g = gbuf;
      pre = 1.0f;
    }
    float* p;
    if (c.master != nullptr) {
      p = c.master + i;
    } else if (c.model_fmt == nullptr) {
      p = reinterpret_cast<float*>(c.model) + i;
    } else {
      c.model_fmt->decode(c.model + 2 * i, pbuf, n, ConvertOptions{});
      p = pbuf;
    }
    c.update(p, g, i, n, pre, c.clip);
    c.write_model(p, i, n);
  }
}

constexpr std::size_t kMinParallel = std::size_t{1} << 15;

template <class F>
void split(ThreadPool* pool, std::size_t n, F&& fn) {
  if (pool != nullptr) pool->parallel_for(n, kChunk, kMinParallel, [&](std::size_t b, std::size_t e, unsigned) { fn(b, e); });
  else if (n > 0) fn(std::size_t{0}, n);
}

}  // namespace

Optimizer::Optimizer(ParamStore& store, OptimizerState s, PureOptions pure)
    : store_(&store), state_(s), pure_(pure), isa_(active_isa()) {
  validate_hyper(state_);
  const unsigned need = optimizer_state_slots(s.kind);
  if (store.state_slots() < need)
    throw std::invalid_argument("optimizer " + std::string(optimizer_name(s.kind)) + ": expected a store with " +
                                std::to_string(need) + " state slots, found " + std::to_string(store.state_slots()));
  if (pure.rounding == Rounding::stochastic && (store.has_master() || store.model_dtype() == DType::f32))
    throw std::invalid_argument(
        "optimizer: stochastic rounding expected a pure store with f16 or bf16 weights, found " +
        std::string(store.has_master() ? "a store with master weights" : "f32 weights"));
  state_.flat_size = store.flat_size();
  state_.param_count = store.param_count();
  per_tensor_ = store.compact_moments() || store.master_format() == MasterFormat::remainder;
  if (per_tensor_ && s.kind != OptimizerKind::adam && s.kind != OptimizerKind::adamw)
    throw std::invalid_argument("optimizer " + std::string(optimizer_name(s.kind)) +
                                ": expected fp32 masters and moments (the state formats are Adam's), found master " +
                                std::string(master_format_name(store.master_format())) + ", moments " +
                                std::string(moment_format_name(store.options().formats.m)) + "/" +
                                std::string(moment_format_name(store.options().formats.v)));
}

void Optimizer::set_lr(double lr) {
  require(std::isfinite(lr) && lr >= 0, "lr finite and >= 0", lr);
  state_.lr = lr;
}

void Optimizer::set_isa(Isa isa) {
  if (!isa_available(isa))
    throw std::invalid_argument("optimizer: back end '" + std::string(isa_name(isa)) + "' is not available here");
  isa_ = isa;
}

void Optimizer::load_state(const OptimizerState& s) {
  if (s.kind != state_.kind)
    throw std::invalid_argument("optimizer load_state: expected kind " + std::string(optimizer_name(state_.kind)) +
                                ", found " + std::string(optimizer_name(s.kind)));
  if (s.flat_size != state_.flat_size || s.param_count != state_.param_count)
    throw std::invalid_argument("optimizer load_state: expected a store of " + std::to_string(state_.param_count) +
                                " parameters (" + std::to_string(state_.flat_size) + " padded), found " +
                                std::to_string(s.param_count) + " (" + std::to_string(s.flat_size) + ")");
  validate_hyper(s);
  state_ = s;
}

std::size_t Optimizer::unfused_scratch_size() const noexcept {
  const bool pure_low = !store_->has_master() && store_->model_dtype() != DType::f32;
  return store_->flat_size() * (pure_low ? 2 : 1);
}

void Optimizer::validate_controls(const StepControls& c, bool unfused) const {
  if (c.skip) return;
  if (!std::isfinite(c.inv_scale) || !(c.inv_scale > 0.0f))
    throw std::invalid_argument("optimizer step: expected inv_scale finite and > 0, found " + num(c.inv_scale));
  if (!std::isfinite(c.clip_coef) || !(c.clip_coef >= 0.0f))
    throw std::invalid_argument(
        "optimizer step: expected clip_coef finite and >= 0, found " + num(c.clip_coef) +
        " (a non-finite gradient norm means the gradients overflowed: set skip instead)");
  if (unfused && c.clip_coef != 1.0f)
    throw std::invalid_argument("optimizer step_unfused: expected clip_coef 1 (pass max_norm instead), found " +
                                num(c.clip_coef));
  if (c.lr) require(std::isfinite(*c.lr) && *c.lr >= 0, "lr finite and >= 0", *c.lr);
}

namespace {
Pass make_pass(ParamStore& st, const OptimizerState& s, const PureOptions& pure, Isa isa, const StepControls& c) {
  const double lr = c.lr.value_or(s.lr);
  const KernelTable* table = kernel_table(isa);
  Pass p{};
  p.k = optim_detail::update_kernels(isa);
  p.grad_fmt = format_kernels(table, st.grad_dtype());
  p.model_fmt = format_kernels(table, st.model_dtype());
  p.grads = static_cast<std::byte*>(st.grad_data());
  p.model = static_cast<std::byte*>(st.model_data());
  p.master = st.master_data();
  const unsigned slots = optimizer_state_slots(s.kind);
  p.s0 = slots > 0 ? st.state_data(0) : nullptr;
  p.s1 = slots > 1 ? st.state_data(1) : nullptr;
  p.adam = s.kind == OptimizerKind::adam || s.kind == OptimizerKind::adamw;
  if (p.adam) p.as = adam_scalars(s, lr, s.step + 1);
  else p.ss = sgd_scalars(s, lr);
  p.inv_scale = c.inv_scale;
  p.clip = c.clip_coef;
  p.sr = pure.rounding == Rounding::stochastic;
  p.key = optim_detail::sr_key(pure.seed, static_cast<std::uint64_t>(s.step + 1));
  return p;
}
}  // namespace

bool Optimizer::step_per_tensor(const StepControls& c, ThreadPool* pool) {
  ParamStore& st = *store_;
  AdamStepArgs a;
  a.hyper = AdamHyper{c.lr.value_or(state_.lr), state_.beta1, state_.beta2, state_.eps, state_.weight_decay,
                      state_.kind == OptimizerKind::adamw};
  a.step = state_.step + 1;
  a.inv_scale = c.inv_scale;
  a.clip_coef = c.clip_coef;
  a.rule = st.options().formats.rule;
  a.stochastic = pure_.rounding == Rounding::stochastic;
  a.seed = pure_.seed;
  const std::size_t gw = dtype_size(st.grad_dtype()), ww = dtype_size(st.model_dtype());
  auto tensor = [&](std::size_t i) {
    AdamTensor t;
    t.n = st.numel(i);
    t.grad_dtype = st.grad_dtype();
    t.grad = static_cast<const std::byte*>(st.grad_data()) + st.offset(i) * gw;
    t.weight_dtype = st.model_dtype();
    t.weight = static_cast<std::byte*>(st.model_data()) + st.offset(i) * ww;
    t.master = st.master_format();
    if (st.master_data() != nullptr) t.master_f32 = st.master_data() + st.offset(i);
    if (st.remainder_data() != nullptr) t.remainder = st.remainder_data() + st.offset(i);
    t.m = st.moment(0, i);
    t.v = st.moment(1, i);
    t.first_index = st.offset(i);  // stochastic rounding keyed by flat index, as the fused pass
    return t;
  };
  for (std::size_t i = 0; i < st.tensor_count(); ++i) validate(tensor(i), a);  // before anything is written
  const Isa isa = isa_;
  // An fp32 model copy beside fp32 masters (the step updates the master in place): copied after.
  const bool copy_model = st.master_data() != nullptr && st.model_dtype() == DType::f32;
  if (measure_) stats_.assign(st.tensor_count(), AdamStepStats{});
  auto one = [&](std::size_t i, ThreadPool* inside) {
    adam_tensor_step(tensor(i), a, isa, measure_ ? &stats_[i] : nullptr, inside);
    if (copy_model)
      std::memcpy(static_cast<float*>(st.model_data()) + st.offset(i), st.master_data() + st.offset(i), st.numel(i) * 4);
  };
  // Large tensors one at a time, each split over the pool (one tensor may hold most of the
  // parameters: an embedding), then the others split over the pool by tensor.
  constexpr std::size_t kSplitTensor = std::size_t{1} << 18;
  if (pool != nullptr) {
    for (std::size_t i = 0; i < st.tensor_count(); ++i)
      if (st.numel(i) >= kSplitTensor) one(i, pool);
    pool->parallel_for(st.tensor_count(), 1, 2, [&](std::size_t b, std::size_t e, unsigned) {
      for (std::size_t i = b; i < e; ++i)
        if (st.numel(i) < kSplitTensor) one(i, nullptr);
    });
  } else {
    for (std::size_t i = 0; i < st.tensor_count(); ++i) one(i, nullptr);
  }
  ++state_.step;
  return true;
}

bool Optimizer::step(const StepControls& c, ThreadPool* pool) {
  validate_controls(c, false);
  if (c.skip) return false;
  if (per_tensor_) return step_per_tensor(c, pool);
  const Pass p = make_pass(*store_, state_, pure_, isa_, c);
  split(pool, store_->flat_size(), [&](std::size_t b, std::size_t e) { fused_range(p, b, e); });
  ++state_.step;
  return true;
}

bool Optimizer::step_unfused(const StepControls& c, std::span<float> scratch, std::optional<float> max_norm,
                             ThreadPool* pool) {
  validate_controls(c, true);
  if (per_tensor_)
    throw std::invalid_argument("optimizer step_unfused: expected fp32 masters and moments, found master " +
                                std::string(master_format_name(store_->master_format())) +
                                " (the state formats step through step())");
  if (scratch.size() < unfused_scratch_size())
    throw std::invalid_argument("optimizer step_unfused: expected scratch of at least " +
                                std::to_string(unfused_scratch_size()) + " floats, found " +
                                std::to_string(scratch.size()));
  if (max_norm && (!std::isfinite(*max_norm) || !(*max_norm > 0.0f)))
    throw std::invalid_argument("optimizer step_unfused: expected max_norm finite and > 0, found " + num(*max_norm));
  if (c.skip) return false;
  const Pass p = make_pass(*store_, state_, pure_, isa_, c);
  const std::size_t n = store_->flat_size();
  float* u = scratch.data();
  // (1) unscale into fp32.
  const ConvertOptions gopt{Overflow::ieee, Subnormals::keep, c.inv_scale};
  split(pool, n, [&](std::size_t b, std::size_t e) {
    if (p.grad_fmt == nullptr) p.k->scale(reinterpret_cast<const float*>(p.grads) + b, u + b, e - b, c.inv_scale);
    else p.grad_fmt->decode(p.grads + 2 * b, u + b, e - b, gopt);
  });
  // (2) clip on the unscaled norm.
  if (max_norm) {
    // The norm in the library's one order: per tensor, as unscale_and_check reads the store.
    if (scratch_views_.empty() || scratch_views_.front().data != u + store_->offset(0)) {
      scratch_views_.clear();
      for (std::size_t i = 0; i < store_->tensor_count(); ++i) {
        scratch_views_.push_back({u + store_->offset(i), store_->numel(i), DType::f32});
      }
    }
    UnscaleOptions norm_only;
    norm_only.write = false;
    norm_only.sum_squares = true;
    const double sq = unscale_and_check(isa_, scratch_views_, 1.0f, norm_only, {}, pool).sum_squares;
    const float coef = clip_coefficient(std::sqrt(sq), *max_norm);
    if (!std::isfinite(coef))
      throw std::invalid_argument(
          "optimizer step_unfused: the gradient norm is not finite (the gradients overflowed): set skip instead");
    split(pool, n, [&](std::size_t b, std::size_t e) { p.k->scale(u + b, u + b, e - b, coef); });
  }
  // (3) update, (4) refresh the model copy (or round the pure weights back).
  float* w = nullptr;
  if (p.master != nullptr) {
    w = p.master;
  } else if (p.model_fmt == nullptr) {
    w = reinterpret_cast<float*>(p.model);
  } else {
    w = scratch.data() + n;
    split(pool, n, [&](std::size_t b, std::size_t e) { p.model_fmt->decode(p.model + 2 * b, w + b, e - b, {}); });
  }
  split(pool, n, [&](std::size_t b, std::size_t e) { p.update(w + b, u + b, b, e - b, 1.0f, 1.0f); });
  split(pool, n, [&](std::size_t b, std::size_t e) { p.write_model(w + b, b, e - b); });
  ++state_.step;
  return true;
}

SGD::SGD(ParamStore& store, const SgdConfig& cfg, PureOptions pure)
    : Optimizer(store,
                [&] {
                  OptimizerState s;
                  s.kind = cfg.momentum != 0 ? OptimizerKind::sgd_momentum : OptimizerKind::sgd;
                  s.lr = cfg.lr;
                  s.momentum = cfg.momentum;
                  s.dampening = cfg.dampening;
                  s.nesterov = cfg.nesterov;
                  s.weight_decay = cfg.weight_decay;
                  return s;
                }(),
                pure) {}

namespace {
OptimizerState adam_state(OptimizerKind k, const AdamConfig& cfg) {
  OptimizerState s;
  s.kind = k;
  s.lr = cfg.lr;
  s.beta1 = cfg.beta1;
  s.beta2 = cfg.beta2;
  s.eps = cfg.eps;
  s.weight_decay = cfg.weight_decay;
  return s;
}
}  // namespace

Adam::Adam(ParamStore& store, const AdamConfig& cfg, PureOptions pure)
    : Optimizer(store, adam_state(OptimizerKind::adam, cfg), pure) {}
AdamW::AdamW(ParamStore& store, const AdamConfig& cfg, PureOptions pure)
    : Optimizer(store, adam_state(OptimizerKind::adamw, cfg), pure) {}

}  // namespace mixprec
