// SGD, Adam and AdamW over a ParamStore, with PyTorch's update formulas
// (docs/optimizers.md writes them out).
//
// A step reads each gradient g, forms ((g * inv_scale) * clip_coef) in fp32,
// updates the fp32 master weights and moments, and refreshes the low-precision
// model copy, in one pass over memory (step()). step_unfused() does the same work
// as the separate passes a framework runs (unscale into an fp32 buffer, clip,
// update, refresh the model copy) and gives bitwise the same result.
//
// Skipping: StepControls::skip = true writes nothing at all and leaves the step
// counter alone; bias correction counts applied steps only.
//
// A store with remainder masters or compact moments (StoreOptions::formats) steps each tensor
// with adam_tensor_step (optim/state_format.hpp): Adam and AdamW only, no step_unfused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "mixprec/core/isa.hpp"
#include "mixprec/optim/param_store.hpp"

namespace mixprec {

class ThreadPool;

enum class OptimizerKind : std::uint8_t { sgd, sgd_momentum, adam, adamw };
std::string_view optimizer_name(OptimizerKind k) noexcept;
std::optional<OptimizerKind> parse_optimizer(std::string_view s) noexcept;  // sgd, sgd-momentum, adam, adamw
unsigned optimizer_state_slots(OptimizerKind k) noexcept;                   // 0, 1, 2, 2

struct SgdConfig {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0 (as PyTorch)
  double weight_decay = 0.0;
};

struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // Adam: L2 added to the gradient; AdamW: decoupled (PyTorch's AdamW default is 1e-2)
};

// How a master-less ("pure") store rounds updated weights back to its format.
enum class Rounding : std::uint8_t { nearest_even, stochastic };

struct PureOptions {
  Rounding rounding = Rounding::nearest_even;
  std::uint64_t seed = 0;  // stochastic rounding: bits = hash(seed, applied step, flat index)
};

struct StepControls {
  float inv_scale = 1.0f;  // 1 / loss scale: each gradient is multiplied by it as it is read
  float clip_coef = 1.0f;  // then by this (clip_coefficient()); 1 = no clipping
  bool skip = false;       // overflow: write nothing, do not count the step
  std::optional<double> lr = std::nullopt;  // this step's learning rate; the configured lr when empty
};

// Everything but the state arrays (those are views of the store: state(slot, i)).
struct OptimizerState {
  OptimizerKind kind = OptimizerKind::adam;
  std::int64_t step = 0;  // applied steps
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  double momentum = 0, dampening = 0;
  bool nesterov = false;
  std::size_t flat_size = 0;  // the store layout the state arrays belong to
  std::size_t param_count = 0;
  friend bool operator==(const OptimizerState&, const OptimizerState&) = default;
};

class Optimizer {
 public:
  // Fused path: one pass. Validates first (std::invalid_argument): unless skip,
  // inv_scale must be finite and > 0, clip_coef finite and >= 0 (a NaN coefficient
  // means the gradients overflowed: set skip instead), lr finite and >= 0.
  // Returns whether the step was applied. pool: split across its threads (results
  // do not depend on the thread count); nullptr runs on the caller.
  bool step(const StepControls& c, ThreadPool* pool = nullptr);

  // Reference sequence of separate passes: (1) scratch = grads * inv_scale,
  // (2) when max_norm is given: norm of scratch, clip coefficient, scratch *= coef,
  // (3) update from scratch, (4) model copy refresh. c.clip_coef must be 1.
  // scratch: unfused_scratch_size() floats, allocated once by the caller.
  // Bitwise equal to grad_stats() + clip_coefficient() + step().
  bool step_unfused(const StepControls& c, std::span<float> scratch, std::optional<float> max_norm = std::nullopt,
                    ThreadPool* pool = nullptr);
  std::size_t unfused_scratch_size() const noexcept;

  OptimizerKind kind() const noexcept { return state_.kind; }
  std::int64_t step_count() const noexcept { return state_.step; }
  double lr() const noexcept { return state_.lr; }
  void set_lr(double lr);
  const OptimizerState& state() const noexcept { return state_; }
  // Checks kind and store layout, and that the hyperparameters are valid, before
  // changing anything (std::invalid_argument naming the mismatch). The state
  // arrays are restored separately, through the store's views.
  void load_state(const OptimizerState& s);

  // Back end for the inner loops; active_isa() by default. For tests and benchmarks.
  void set_isa(Isa isa);
  Isa isa() const noexcept { return isa_; }

  ParamStore& store() noexcept { return *store_; }

  // Stores with state formats (remainder masters, compact moments), which step tensor by
  // tensor: with measure_state(true) the next applied step also measures, per tensor, the
  // moments' quantization error and the lost updates (AdamStepStats, in store order), which
  // state_stats() then holds until a later measured step. Other stores measure nothing
  // (state_stats() stays empty).
  void measure_state(bool on) noexcept { measure_ = on; }
  bool steps_per_tensor() const noexcept { return per_tensor_; }
  std::span<const AdamStepStats> state_stats() const noexcept { return stats_; }

 protected:
  Optimizer(ParamStore& store, OptimizerState s, PureOptions pure);

 private:
  void validate_controls(const StepControls& c, bool unfused) const;
  // Stores with remainder masters or compact moments: adam_tensor_step per tensor.
  bool step_per_tensor(const StepControls& c, ThreadPool* pool);
  bool per_tensor_ = false;
  bool measure_ = false;
  std::vector<AdamStepStats> stats_;  // the last measured per-tensor step's
  ParamStore* store_;
  OptimizerState state_;
  PureOptions pure_;
  Isa isa_;
  std::vector<GradTensor> scratch_views_;  // step_unfused: per-tensor views of its scratch, for the norm
};

class SGD : public Optimizer {
 public:
  SGD(ParamStore& store, const SgdConfig& cfg, PureOptions pure = {});
};

class Adam : public Optimizer {
 public:
  Adam(ParamStore& store, const AdamConfig& cfg, PureOptions pure = {});
};

class AdamW : public Optimizer {
 public:
  AdamW(ParamStore& store, const AdamConfig& cfg, PureOptions pure = {});
};

}  // namespace mixprec
