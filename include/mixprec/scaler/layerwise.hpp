// Per-layer loss scaling for fp16 (docs/loss_scaling.md, "Per-layer loss scaling"): the
// `approx_range` rule of Zhao, Vogel, Ahmed, Luk ("Reducing Underflow in Mixed Precision
// Training by Gradient Scaling", IJCAI 2020), applied in backward at every watched GEMM layer
// on top of the base loss scale S0 (the preset's dynamic scale), and the per-layer state the
// rule keeps across steps (backoffs after a layer's own overflow).
//
// In backward, a watched layer with incoming (output) gradient g, which already carries
// S0 * chain (chain: the product of the factors of the watched layers it passed), and weight W:
//
//   sigma_o = sqrt((sigma_g^2 + mu_g^2) * (sigma_W^2 + mu_W^2)) * sqrt(0.5 * fan_in)
//   s = max(1, u_min / (erfinv(n_uf) * sqrt(2) * sigma_o))         (1 when sigma_o is 0)
//   s = min(s, (u_max / fan_in) / (max|g| * max|W|))                (no bound when that is 0)
//   s = min(s, max_chain / chain, max_factor);  s = 2^floor(log2 s)
//   s = s * 2^-backoff                                              (the layer's own backoffs)
//
// fan_in is the reduction length of the GEMM that makes the layer's input gradient
// (dx = g W: a Linear's out_features). g is multiplied by s before the layer's GEMMs, so that
// its input gradient and its weight gradient carry S0 * chain * s; the weight gradient is
// unscaled by exactly that. Moments are over every element (population variance).
//
// The doors (the engine's models, mixprec.torch's hooks) compute the moments, multiply, and
// ask LayerwiseScales everything else: the factor, which layer an overflow came from, which
// layers skip their update, the backoffs, the state.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/dtype.hpp"

namespace mixprec {

struct LayerwiseConfig {
  double u_min = 0x1p-24;   // the smallest fp16 subnormal
  double u_max = 65504.0;   // the largest finite fp16
  double n_uf = 1e-3;       // the underflow fraction the rule tolerates
  double max_factor = 16.0;    // one layer's factor at most
  double max_chain = 1024.0;   // the product of the factors along a chain at most
  // Clean steps of a layer after which one of its backoffs is undone (its factor doubles back).
  std::int64_t recovery_interval = 2000;
  std::int64_t max_backoff = 24;  // backoffs a layer accumulates at most (a factor down to 2^-24 of the rule's)
  friend bool operator==(const LayerwiseConfig&, const LayerwiseConfig&) = default;
};

// std::invalid_argument naming the field, what is allowed and what was found.
void validate(const LayerwiseConfig& c);

// The inverse error function in double: erf(erfinv(x)) == x to a few ulps for |x| < 1;
// +-inf at +-1, NaN outside [-1, 1] or for NaN.
double erfinv(double x) noexcept;

// Sums over one tensor's values (as doubles of the stored values).
struct TensorMoments {
  std::uint64_t count = 0;
  double sum = 0;
  double sum_squares = 0;
  double amax = 0;       // max |x| over the finite values
  bool finite = true;    // no inf/NaN
  double mean() const noexcept;
  double mean_square() const noexcept;  // sigma^2 + mu^2: the second moment
};
TensorMoments moments_of(std::span<const float> v) noexcept;
TensorMoments moments_of(const GradTensor& t) noexcept;  // f32, f16 or bf16 memory

// The rule above without the backoff: the factor (a power of two) for one layer. g carries
// the base scale and `chain`; g must be finite (a non-finite g gets factor 1 from decide()).
double approx_range_factor(const TensorMoments& g, const TensorMoments& w, std::int64_t fan_in, double chain,
                           const LayerwiseConfig& c);

// What happened to one layer in one optimizer step.
enum class LayerOutcome : std::uint8_t {
  applied,  // its gradients were finite: it stepped
  origin,   // its gradients held inf/NaN while its incoming gradient was finite: the overflow
            // started here. Skipped, and the layer backs off.
  victim,   // its gradients held inf/NaN that came in with its incoming gradient: skipped, no backoff
};
std::string_view layer_outcome_name(LayerOutcome o) noexcept;  // "applied", "origin", "victim"

struct LayerState {
  std::string name;
  std::int64_t fan_in = 1;
  // Across steps (saved in the state):
  std::int64_t backoff = 0;      // halvings on top of the rule (origin overflows not yet recovered)
  std::int64_t clean_steps = 0;  // applied steps since the last backoff change
  std::int64_t overflows = 0;    // steps this layer was the origin of an overflow
  std::int64_t skipped = 0;      // steps its update was skipped (origin or victim)
  // This step (telemetry; not saved):
  double factor = 1;       // the last factor decide() gave
  double chain = 1;        // chain * factor: what its weight gradient carries above the base scale
  bool decided = false;    // decide() ran since the last update()
  bool incoming_nonfinite = false;  // some pass of this step brought it a non-finite gradient
  std::optional<LayerOutcome> outcome;  // finish_layer() of this step
};

class LayerwiseScales {
 public:
  explicit LayerwiseScales(const LayerwiseConfig& c = {});  // validates

  const LayerwiseConfig& config() const noexcept { return config_; }
  // Registers a watched layer; a name already known (registered, or from a loaded state)
  // returns its index, after checking its fan_in. fan_in >= 1.
  std::size_t add_layer(std::string_view name, std::int64_t fan_in);
  std::size_t layer_count() const noexcept { return layers_.size(); }
  const LayerState& layer(std::size_t i) const { return layers_.at(i); }
  std::optional<std::size_t> find(std::string_view name) const noexcept;

  // Backward, at the layer: its factor (the rule, then its backoff), remembered with the chain
  // its weight gradient carries. A non-finite g gets 1 and marks the layer's input non-finite.
  double decide(std::size_t layer, const TensorMoments& g, const TensorMoments& w, double chain);
  // A later backward pass of the same step (an accumulation window): the factor decided on
  // the first pass, kept (the door's weight gradients accumulate at one scale); g_finite as
  // in decide().
  double keep(std::size_t layer, bool g_finite);

  // After the step's backward passes: whether the layer's own gradients are all finite.
  LayerOutcome finish_layer(std::size_t layer, bool grads_finite);
  // Some layer of this step is an origin (finish_layer): then every non-finite gradient of
  // the step is explained by it, and only what holds inf/NaN is skipped.
  bool any_origin() const noexcept;

  // Ends the step: origins back off one more (up to max_backoff), applied layers count a
  // clean step (recovery_interval of them undo one backoff), victims keep their state; every
  // layer's step fields are cleared.
  void update();

  // {"config":{...},"layers":[{"name","fan_in","backoff","clean_steps","overflows","skipped"}]}
  std::string to_json() const;
  // Parses and validates everything (std::invalid_argument naming the field); then
  // load_state() keeps registered layers' indices: a layer of the state with the name of a
  // registered one gives it its counters (same fan_in required), others are added.
  static LayerwiseScales from_json(std::string_view json);
  void check_load(const LayerwiseScales& state) const;  // load_state()'s checks, nothing changed
  void load_state(const LayerwiseScales& state);

 private:
  LayerwiseConfig config_;
  std::vector<LayerState> layers_;
};

}  // namespace mixprec
