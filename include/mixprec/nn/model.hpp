// Trainable models under a precision policy: a decoder-only transformer (`gpt`) and
// a deep MLP next-token classifier (`mlp`), llm.c style.
//
// Everything is allocated at construction: parameters, gradients and optimizer-state
// slots in one ParamStore, every saved activation in the policy's activation format,
// and the fp32 scratch the fp32 layers (layers.hpp) run in. forward/backward then
// allocate nothing (the Gemm primitives are prepared up front too).
//
// Protocol per optimizer step (the Trainer does this):
//   params().zero_grads();
//   for each micro-batch: forward(inputs, targets); backward(dloss);
//   ... scaler / optimizer step on params() ...
//   weights_updated();   // re-read the (possibly low-precision) weights
// dloss is d(objective)/d(per-token loss) including the loss scale, e.g.
// scale / tokens_per_step for a loss averaged over the whole effective batch.
#pragma once

#include <cstddef>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/block_stats.hpp"
#include "mixprec/lowp/scaling.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/nn/precision.hpp"
#include "mixprec/optim/param_store.hpp"

namespace mixprec {
class LayerwiseScales;
}

namespace mixprec::nn {

enum class ModelKind : std::uint8_t { gpt, mlp };
std::string_view model_kind_name(ModelKind k) noexcept;
std::optional<ModelKind> parse_model_kind(std::string_view s) noexcept;

struct ModelConfig {
  ModelKind kind = ModelKind::gpt;
  std::size_t vocab = 0;     // V: set from the data
  std::size_t context = 64;  // T: tokens per sequence (gpt: positions; mlp: tokens of context)
  std::size_t batch = 16;    // B: sequences per micro-batch
  // gpt
  std::size_t layers = 2;
  std::size_t heads = 4;
  std::size_t channels = 64;  // C; heads must divide it
  // mlp: embedding of C channels per context token, concatenated, then `depth` hidden
  // Linear+GELU layers of width `hidden`, then a Linear to V logits.
  std::size_t depth = 4;
  std::size_t hidden = 256;
  std::uint64_t seed = 1;    // weight initialisation
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// Throws std::invalid_argument naming the field, the allowed range and the value.
void validate(const ModelConfig& c);

// The FLOPs (2 M N K) of attention's per-head products in one micro-batch's forward and
// backward, as the engine runs them: the full T x T score block of every sequence and head
// (the causal half is masked after the product), 2 products forward and 4 backward, so
// 12 L B T^2 C for gpt; 0 for mlp. Model::gemm_flops counts these among all GEMMs.
std::uint64_t attention_flops(const ModelConfig& c) noexcept;

// A log2-magnitude histogram: counts[i] holds the values with floor(log2|x|) ==
// kMinExp + i (the first and last bins also take everything beyond them); zeros and
// non-finite values are counted apart.
struct Log2Histogram {
  static constexpr int kMinExp = -64;
  static constexpr int kMaxExp = 32;
  std::vector<std::uint64_t> counts = std::vector<std::uint64_t>(kMaxExp - kMinExp + 1, 0);
  std::uint64_t zeros = 0;
  std::uint64_t nonfinite = 0;
  // Adds every `stride`-th value (stride >= 1), starting with the first.
  void add(std::span<const float> values, std::size_t stride = 1) noexcept;
  void clear() noexcept;
  std::uint64_t total() const noexcept;
};

// Largest |x| of v: inf when some x is inf; NaN is skipped (a vectorised pass).
float amax_of(std::span<const float> v) noexcept;

// One activation-gradient tensor (layer and role, e.g. "h1.mlp.fc.grad"), summed over
// the micro-batches of a step: what rounding to the activation format did to it, and
// the largest magnitude before rounding (in the scaled domain: it includes the loss scale).
struct TensorGradStats {
  std::string name;
  ConversionStats stats;
  float amax = 0;
};

// What rounding to the activation format did to activation gradients during backward
// (the counting conversion of every activation-gradient store), and where overflow
// first appeared. Reset by reset_stats() (which keeps the per-tensor list's names).
struct BackwardStats {
  ConversionStats activation_grads;  // all activation-gradient stores together
  std::string first_overflow;        // first activation-gradient tensor whose store overflowed or was non-finite
  std::uint64_t stores = 0;
  float amax = 0;                    // largest |activation gradient| before rounding (scaled domain); inf/NaN -> inf
  std::vector<TensorGradStats> tensors;  // per tensor, in backward order
};

// Histograms the model collects while histograms are on (set_histograms): stored
// activations and activation gradients before rounding (scaled domain), sampled:
// every kHistogramStride-th value of each stored tensor (a histogram's shape needs no
// more, and a full pass cost half a step).
constexpr std::size_t kHistogramStride = 8;
struct ModelHistograms {
  Log2Histogram activations;
  Log2Histogram activation_grads;
};

// What another recipe would do to one quantized tensor at a sampled step (the what-if of
// mixprec.torch.Telemetry(what_if=...)): the same values quantized with that recipe's config of
// the same GEMM operand (docs/low_precision.md, "Per-block statistics").
struct Fp8WhatIf {
  std::string recipe;
  lowp::Element element = lowp::Element::e4m3;
  std::uint64_t elements = 0, saturated = 0, flushed = 0;  // lowp's counts of that quantization
  std::optional<double> rel_rms_error;                      // nullopt: the values held inf/NaN
  // Of lowp::block_stats of that quantization.
  std::uint64_t blocks = 0, far_blocks = 0;
  double log2_multiplier_std = 0, log2_multiplier_p01 = 0, log2_multiplier_p99 = 0;
};

// One fp8 tensor of a Linear layer under an fp8 preset, over one optimizer step (all
// micro-batches; evaluation forwards are not counted). docs/telemetry.md.
struct Fp8TensorStats {
  std::string name;                    // "<layer>.input", "<layer>.weight", "<layer>.grad_output"
  lowp::Role role = lowp::Role::forward;  // input and weight: forward; grad_output: backward
  lowp::Element dtype = lowp::Element::e4m3;
  float scale = 1;           // the scale used (fp8-current: of the step's last call; mxfp8: the smallest block factor)
  float amax = 0;            // max |x| of the unscaled values this step (lowp::amax rules: NaN, then inf, win)
  std::uint64_t elements = 0;
  std::uint64_t nonzero = 0;    // input != 0
  std::uint64_t saturated = 0;  // finite input clipped to the largest finite value by the saturating cast
  std::uint64_t flushed = 0;    // nonzero input that became 0
  // The low-precision recipes (the engine's fp8-block, nvfp4 and mxfp4; every recipe of
  // mixprec.torch.low_precision): the recipe's name and this tensor's element format, which
  // the log writes as "dtype" (E2M1 included). Empty: an fp8 preset's tensor, of `dtype`.
  std::string recipe;
  lowp::Element element = lowp::Element::e4m3;
  // ||dequantize(quantize(x)) - x|| / ||x|| (0 for an all-zero x) at the steps that measure it
  // (mixprec.torch.Telemetry's sampled steps); nullopt: not measured, or x held inf/NaN.
  std::optional<double> rel_rms_error;
  // At the sampled steps (mixprec.torch.Telemetry's; the engine's histogram steps), of the
  // step's last quantization of this tensor: lowp::block_stats of it and the values it came
  // from, and lowp::kurtosis of those values; nullopt at the other steps. what_if: the recipes
  // Telemetry(what_if=...) names, in that order (empty otherwise).
  std::optional<lowp::BlockStats> blocks;
  std::optional<double> kurtosis;
  std::vector<Fp8WhatIf> what_if;

  // What `elements` must be, checked wherever these counts come in (the log, a front door).
  static constexpr const char* kElementsRule = "at least saturated + flushed and at least nonzero";
  bool counts_consistent() const noexcept { return saturated + flushed <= elements && nonzero <= elements; }
};

namespace detail {
class Fp8Linears;
class Engine;
}

struct ForwardResult {
  double loss_sum = 0;        // sum of per-token (per-example) losses, fp32 values summed in double
  std::size_t count = 0;      // how many losses
  bool finite = true;         // every loss finite
  std::string first_nonfinite;  // the first activation (layer output) that held inf/NaN, when !finite
};

// A GEMM layer that per-layer loss scaling (preset layerwise, scaler/layerwise.hpp) scales in
// backward: its incoming gradient is multiplied by the layer's factor before its GEMMs.
struct ScaledLayer {
  std::string name;                 // "h0.attn.qkv", "fc1", ...
  std::int64_t fan_in = 1;          // reduction length of the GEMM that makes its input gradient
  std::vector<std::size_t> params;  // its weight and bias (store tensor indices)
};

struct ModelMemory {
  std::size_t parameter_bytes = 0;   // ParamStore: master + model copy + grads + optimizer state
  std::size_t activation_bytes = 0;  // saved activations (in the activation format) + their fp32 statistics
                                     // + fp8_activation_bytes
  std::size_t gradient_bytes = 0;    // activation-gradient buffers (activation format)
  std::size_t scratch_bytes = 0;     // fp32 working buffers + decoded weights + GEMM scratch
  std::size_t fp8_activation_bytes = 0;  // of activation_bytes: the fp8 Linears' saved inputs (codes + scales)
  // Of parameter_bytes, as allocated: the master weights (fp32, or int16 remainders) and the
  // optimizer state (moments in their formats: codes and scales).
  std::size_t master_bytes = 0;
  std::size_t optimizer_state_bytes = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const noexcept { return config_; }
  const PrecisionPolicy& policy() const noexcept { return policy_; }
  ParamStore& params() noexcept { return *store_; }
  const ParamStore& params() const noexcept { return *store_; }

  // Tokens per micro-batch as the sampler must deliver them (B*T each for inputs and targets).
  std::size_t tokens_per_batch() const noexcept { return config_.batch * config_.context; }
  // Losses per micro-batch: B*T for gpt, B for mlp (it predicts each window's last target).
  virtual std::size_t losses_per_batch() const noexcept = 0;

  // Forward over one micro-batch; saves what backward needs. `rows` <= batch: only the
  // first rows*T tokens are used (evaluation's last partial batch).
  virtual ForwardResult forward(std::span<const TokenId> inputs, std::span<const TokenId> targets,
                                std::size_t rows) = 0;
  ForwardResult forward(std::span<const TokenId> inputs, std::span<const TokenId> targets) {
    return forward(inputs, targets, config_.batch);
  }
  // Accumulates (+=) parameter gradients of sum_i dloss * loss_i for the last forward
  // (which must have used all rows).
  virtual void backward(float dloss) = 0;

  // Call after anything writes the weights (optimizer step, checkpoint load).
  virtual void weights_updated() = 0;

  const BackwardStats& stats() const noexcept { return stats_; }
  void reset_stats() noexcept;
  // Collect log2 histograms of activations and activation gradients until turned off
  // (costs one extra pass over each stored tensor while on).
  void set_histograms(bool on) noexcept;
  bool histograms_on() const noexcept { return histograms_on_; }
  const ModelHistograms& histograms() const noexcept { return histograms_; }
  virtual ModelMemory memory() const = 0;

  // fp8 presets (fp8-noscale, fp8-delayed, fp8-current, mxfp8): per fp8 tensor, this step's
  // counts (reset by reset_stats); empty for the other presets. Under a recipe file, a tensor
  // none of whose operands its Linear's plan quantizes has no recipe and no counts.
  std::span<const Fp8TensorStats> fp8_stats() const noexcept;
  // Recipe files (ModelOptions::recipes): every quantized Linear's plan at optimizer step
  // `step` (0-based), as the file's schedule gives it; the plans change at phase starts only.
  // Returns whether some Linear's plan changed. No-op without a recipe file.
  bool set_recipe_step(std::uint64_t step);
  // Evaluation forwards (validation loss) between set_evaluation(true) and (false): the recipe
  // file's evaluation plan on the Linears that some plan of the run quantizes; nothing is kept
  // for a backward. The training plans otherwise, and without a recipe file.
  void set_evaluation(bool on) noexcept;
  // Ends an optimizer step for the fp8 recipe: fp8-delayed rolls every amax history and
  // updates every scale (TE's once-per-step update). Call once per step after the last
  // backward, whether or not the optimizer step is applied. No-op for other recipes.
  // reduce_amaxes (data parallel): called first with this step's amax of every delayed-
  // scaling tensor, to replace them in place by their MAX over the ranks, so that every
  // replica derives the same scales (TE's amax reduction); not called for other recipes.
  void fp8_step_done(const std::function<void(std::span<float>)>& reduce_amaxes = {});
  // fp8-delayed: the delayed-scaling state (amax histories, scales); nullptr otherwise.
  const lowp::DelayedScaling* fp8_delayed() const noexcept;
  // Replaces the delayed-scaling state after checking it belongs to this model: same
  // recipe config, tensor names, roles and history length (std::invalid_argument naming
  // what was expected and found; nothing changes on error).
  void load_fp8_delayed(const lowp::DelayedScalingState& state);
  void check_fp8_delayed(const lowp::DelayedScalingState& state) const;  // the checks of load_fp8_delayed
  // Testing (docs/spike_guards.md, localisation): from now on, forward passes write NaN into
  // the first element of activation `name` as they store it (backward = false), or backward
  // passes write +inf into the first element of activation gradient `name` (backward =
  // true), as a fault there would; "" clears. std::invalid_argument naming the tensors the
  // model has for a name it has not. The names are those stats() and ForwardResult report.
  void set_fault(const std::string& name, bool backward);
  // 2 M N K summed over every GEMM this model has run (forward and backward, attention's
  // per-head products included): a step's GEMM work is the difference across it.
  std::uint64_t gemm_flops() const noexcept;
  // One line, e.g. "gpt: 2 layers, 4 heads, 64 channels, context 64, vocab 1024 (200,448 parameters)".
  virtual std::string describe() const = 0;

  // Per-layer loss scaling (docs/loss_scaling.md, "Per-layer loss scaling"). gpt: every
  // block's attn.qkv, attn.proj, mlp.fc and mlp.proj (the tied LM head is not scaled: its
  // weight also takes the embedding's gradient); mlp: every fc<i> and the head.
  const std::vector<ScaledLayer>& scaled_layers() const noexcept { return scaled_layers_; }
  // Scales the next backward passes (nullptr: none). decide: the factors are decided from
  // this pass's gradients (the first pass of an accumulation window); otherwise the ones
  // decided then are kept, since the weight gradients accumulate in place. Registers the
  // layers with `scales` on first use.
  void set_layer_scales(LayerwiseScales* scales, bool decide);
  // After backward: per store tensor, the factor above the base loss scale its gradient
  // carries (1 for a tensor no scaled layer reaches).
  std::span<const double> grad_factors() const noexcept { return grad_factors_; }

 protected:
  Model(const ModelConfig& c, PrecisionPolicy p) : config_(c), policy_(p) {}
  // Registers an activation-gradient tensor for stats().tensors; returns its index.
  std::size_t grad_label(std::string name);
  // Where the engine adds histogram values (nullptr while histograms are off).
  ModelHistograms* histogram_sink() noexcept { return histograms_on_ ? &histograms_ : nullptr; }
  virtual void histograms_changed() noexcept {}
  // The fp8 Linear machinery of an fp8 preset, nullptr otherwise.
  virtual detail::Fp8Linears* fp8_linears() const noexcept { return nullptr; }
  // The engine that stores this model's activations (set_fault plants its faults there).
  virtual detail::Engine& engine() noexcept = 0;
  virtual const detail::Engine& engine() const noexcept = 0;
  // Per-layer loss scaling in backward. scaled_layer(): the constructor's list. scale_layer():
  // at scaled layer `slot`, whose incoming gradient g carries `chain` above the base scale,
  // the layer's factor f (1 when scaling is off); g is multiplied by f and the layer's
  // tensors are marked as carrying chain * f. rescale(): v *= f (exact: f is a power of two).
  void scaled_layer(std::string name, std::int64_t fan_in, std::vector<std::size_t> params);
  double scale_layer(std::size_t slot, std::span<float> g, std::span<const float> w, double chain);
  void mark_grad_factor(std::size_t tensor, double factor) noexcept;
  static void rescale(std::span<float> v, double f) noexcept;
  ModelConfig config_;
  PrecisionPolicy policy_;
  std::unique_ptr<ParamStore> store_;
  BackwardStats stats_;
  ModelHistograms histograms_;
  bool histograms_on_ = false;

 private:
  std::vector<ScaledLayer> scaled_layers_;
  std::vector<std::size_t> scaled_index_;  // slot -> index in layer_scales_
  std::vector<double> grad_factors_;
  LayerwiseScales* layer_scales_ = nullptr;
  bool decide_ = false;
};

// The Linears a quantized preset or a recipe file quantizes, in the order the model adds
// them: gpt "h<l>.attn.qkv", "h<l>.attn.proj", "h<l>.mlp.fc", "h<l>.mlp.proj" per block; mlp
// the hidden Linears "fc<i>". The embedding and the head stay in the preset's bf16.
std::vector<std::string> quantized_linear_names(const ModelConfig& c);
// Checks a recipe file (lowp::Assignment) against a model of config `c` trained for
// `total_steps` optimizer steps: every module it names is one of quantized_linear_names(c),
// every schedule pattern matches one, its phases resolve to steps (from_fraction of
// total_steps), every Linear's plan at every phase start is valid, fp8-delayed comes with one
// set of options (one amax-history config per model) and not in the evaluation entry.
// std::invalid_argument "recipe file: FIELD: expected ..., found ...".
void check_recipes(const lowp::Assignment& a, const ModelConfig& c, std::uint64_t total_steps);

// Builds the model with initialised weights (GPT-2 style: normal(0, 0.02), residual
// projections scaled by 1/sqrt(2*layers), layer-norm weights 1, biases 0; deterministic
// from config.seed). state_slots: optimizer state arrays to reserve in the store.
// fp8: the recipe options of the fp8 presets (ignored by the others).
std::unique_ptr<Model> make_model(const ModelConfig& config, Precision precision, unsigned state_slots,
                                  const Fp8Config& fp8 = {});

// The same with every option, among them a store without the preset's master weights.
struct ModelOptions {
  unsigned state_slots = 0;  // optimizer state arrays to reserve in the store
  Fp8Config fp8;             // the fp8 presets' recipe options (ignored by the others)
  // false: no fp32 master weights in the store even when the preset has them, for an
  // optimizer that keeps them elsewhere (ZeRO-1: each rank's slice, in a store of its own).
  bool master_weights = true;
  // The optimizer state formats of the store (optim/state_format.hpp); remainder masters need a
  // preset with bf16 weights and master weights, compact moments 2 state slots.
  StateFormats formats{};
  // A recipe file (docs/low_precision.md, "Recipe files in the engine"): each quantized Linear's
  // plan and its schedule, in place of the precision's recipe (which must be a quantized
  // preset: it gives the rest of the model's precision; fp8 is then ignored). recipe_steps: the
  // run's optimizer steps (places from_fraction phases). null: the precision's own recipe.
  std::shared_ptr<const lowp::Assignment> recipes{};
  std::uint64_t recipe_steps = 0;
};
std::unique_ptr<Model> make_model(const ModelConfig& config, Precision precision, const ModelOptions& options);

}  // namespace mixprec::nn
