// Private: the quantized Linear layers of the quantized presets and of recipe files
// (docs/fp8.md, "fp8 in the engine"; docs/low_precision.md, "Recipe files in the engine").
// Each Linear runs a plan (lowp::LinearPlan): every operand of its three GEMMs quantized with
// the plan's config of that operand through lowp::quantize, or passed through in fp32:
//   Y  = Q[fprop.x](X) Q[fprop.w](W)^T + b
//   dX += Q[dgrad.dy](dY) Q[dgrad.w](W')      W' = W, or D(Q[fprop.w](W)) (w_source dequantized)
//   dW += Q[wgrad.dy](dY)^T Q[wgrad.x](X')    X' = X, or D(Q[fprop.x](X)) (x_source dequantized)
//   db += column sums of dY (unquantized, as TE's fused bias-gradient).
// Q is lowp::quantize and D lowp::dequantize ("fake quantization": the values a low-precision
// GEMM with fp32 accumulation multiplies); the GEMMs are the fp32 GEMMs of layers.hpp. A
// preset runs one uniform plan on every Linear; a recipe file gives each Linear its plan, which
// its schedule may switch at phase starts (set_step), and an evaluation plan (set_evaluation).
//
// The backward uses what the forward kept of X: wgrad's quantized copy (codes plus scales, as
// Transformer Engine does), fprop's quantization (x_source dequantized, wgrad.x in high
// precision) or, for a high-precision wgrad.x from the original, X itself in fp32; it
// dequantizes codes into fp32 work memory right before its GEMM. The weight is quantized again
// from W (unchanged between a forward and its backward), so no copy of it is kept. Per-tensor
// recipes (fp8-delayed, fp8-current) quantize each tensor once where two operands share its
// config (one scale gives the same values in every layout).
//
// Everything is allocated by finish() for every plan the Linears can reach; forward/backward
// allocate nothing. The fp32 work memory for the dequantized operands is either the caller's
// (spans of scratch it does not need during the call) or, finish(true), buffers of this object.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/nn/precision.hpp"

namespace mixprec::nn::detail {

// The plans a recipe file gives the Linear `name` in a run of `total_steps` optimizer steps:
// (first step, plan) at step 0 and at every phase start that changes it, ascending. Throws
// std::invalid_argument as lowp::plan does ("recipe file: ...").
std::vector<std::pair<std::uint64_t, lowp::LinearPlan>> recipe_timeline(const lowp::Assignment& a,
                                                                        std::string_view name,
                                                                        std::uint64_t total_steps);

// ---- the Linear layers of one model ----------------------------------------------------

class Fp8Linears {
 public:
  // A quantized preset: every Linear runs the uniform plan of the preset's recipe with the
  // options of `config`.
  Fp8Linears(QuantizedGemms gemms, const Fp8Config& config);
  // A recipe file (checked by nn::check_recipes): each Linear's plans from its entry and the
  // schedule's phases (from_fraction phases placed in a run of `total_steps`), and the
  // evaluation entry for evaluation forwards.
  Fp8Linears(std::shared_ptr<const lowp::Assignment> recipes, std::uint64_t total_steps);

  // Registers a Linear X[rows, in] -> Y[rows, out] named `layer` ("h0.attn.qkv"); its tensors
  // are "<layer>.input", "<layer>.weight" (forward) and "<layer>.grad_output" (backward), in
  // that order. Returns its id. Before finish().
  std::size_t add(const std::string& layer, std::size_t rows, std::size_t in, std::size_t out);
  // Allocates every buffer, for every plan the Linears can reach; own_work: also the fp32 work
  // memory, for callers that pass no work spans.
  void finish(bool own_work = true);

  // Recipe files: every Linear's plan at optimizer step `step` (0-based); the plans change at
  // the schedule's phase starts only. Returns whether some Linear's plan changed. No-op for a
  // preset.
  bool set_step(std::uint64_t step);
  // Evaluation forwards (on): the recipe file's evaluation plan on the Linears that some plan
  // of the run quantizes (as every door); nothing is kept or recorded. Off: the training plans.
  void set_evaluation(bool on) noexcept { evaluation_ = on; }
  // The training plan of Linear `id` in force.
  const lowp::LinearPlan& plan(std::size_t id) const { return plans_.at(linears_.at(id).current).plan; }

  // fp32 work memory of one call: the dequantized operands are carved out of these spans
  // (first fit), which the caller does not read or write during the call; empty: this
  // object's own (finish(true)). Too little is a std::logic_error. Needed at most: forward
  // rows*in floats in one span; backward N*OC (dgrad's dY), N*OC (wgrad's dY) and N*C
  // (wgrad's X), each in one span, for the operands the plan quantizes.
  using Work = std::span<const std::span<float>>;

  // y[rows, out] = Q(X) Q(W)^T + b for the first `rows` rows of x; a training forward (all
  // rows, not evaluating) keeps what the backward needs of X. What the quantization did is
  // held until backward() (an evaluation forward records nothing).
  void forward(Gemm& g, std::size_t id, std::span<float> y, std::span<const float> x, std::span<const float> w,
               std::span<const float> b, std::size_t rows, Work work = {});
  // The backward of the last forward of this layer, which must have been a training forward;
  // w is the weight that forward multiplied. dx may be empty (not needed); db must be empty
  // exactly when the layer has no bias.
  void backward(Gemm& g, std::size_t id, std::span<float> dx, std::span<float> dw, std::span<float> db,
                std::span<const float> dy, std::span<const float> w, Work work = {});

  void step_done();           // fp8-delayed: DelayedScaling::update()
  void reset_stats() noexcept;  // the per-step counts; scales and histories stay
  // Sampled steps (the engine's histogram steps): every committed quantization also gets its
  // lowp::block_stats and its input's lowp::kurtosis (Fp8TensorStats::blocks, kurtosis: the
  // step's last one of each tensor). The one allocation of a forward or backward: block_stats'
  // per-block vector, at these steps only.
  void set_sampled(bool on) noexcept { sampled_ = on; }
  // Per tensor: the first quantized operand of each of X (fprop.x, else wgrad.x), W (fprop.w,
  // else dgrad.w) and dY (dgrad.dy, else wgrad.dy); a tensor with none has no counts.
  std::span<const Fp8TensorStats> stats() const noexcept { return stats_; }
  lowp::DelayedScaling* delayed() noexcept { return delayed_on_ ? &delayed_ : nullptr; }
  // What is kept from a forward to its backward, the most any reachable plan keeps: X's codes
  // and scales (per tensor: 1 byte per element; block-scaled recipes: lowp's codes and block
  // scales), or X in fp32 for a high-precision wgrad.x from the original.
  std::size_t saved_bytes() const noexcept;
  std::size_t scratch_bytes() const noexcept;  // the weight, the codes on their way, own work

 private:
  // What one quantization did, before it is committed to the step's stats.
  struct Pending {
    ConversionStats stats;
    float amax = 0;
    float scale = 1;
    std::optional<lowp::BlockStats> blocks;  // sampled steps: of this quantization and its input
    std::optional<double> kurtosis;
  };
  // What the forward keeps of X for wgrad.
  enum class Saved : std::uint8_t { quantized, fprop, fp32 };
  // One plan as this object runs it.
  struct RunPlan {
    lowp::LinearPlan plan;
    // Per operand: its QuantizeConfig (per-tensor recipes rowwise: one scale gives the same
    // values in every layout); nullopt: high precision. fp8-delayed's scale and RHT's row
    // rule are applied per call.
    std::array<std::optional<lowp::QuantizeConfig>, lowp::kOperands> config;
    bool delayed = false;   // fp8-delayed operands: their tensors' DelayedScaling scales
    bool share_x = false;   // wgrad.x is fprop.x's quantization (per tensor, same config, the original X)
    bool share_w = false;   // dgrad.w is fprop.w's quantization again, at the forward's scale
    bool share_dy = false;  // wgrad.dy is dgrad.dy's quantization
    Saved saved = Saved::quantized;
  };
  struct Linear {
    std::size_t rows = 0, in = 0, out = 0;
    std::size_t tensor = 0;          // index of "<layer>.input"; weight and grad_output follow
    std::size_t forward_rows = 0;    // rows of the last training forward (0: none to go back through)
    std::size_t forward_plan = 0;    // its plan
    std::size_t current = 0;         // the training plan in force (index into plans_)
    std::vector<std::pair<std::uint64_t, std::size_t>> timeline;  // (first step, plan), ascending
    std::size_t saved_bytes = 0;     // the most a reachable plan keeps
    bool evaluated = false;          // some training plan quantizes an operand: evaluation runs the file's plan
    bool input_quantized = false;    // the last training forward quantized X
    Pending input, weight;
  };

  std::size_t add_plan(const lowp::LinearPlan& p);
  void describe_tensors(std::size_t id);  // stats_' recipe and element of the plan in force
  // Operand o's config for this call: fp8-delayed at the scale of tensor t (1 for fp8-noscale),
  // RHT dropped where the row count is not a multiple of 16.
  lowp::QuantizeConfig call_config(const RunPlan& p, lowp::Operand o, std::size_t t, std::size_t rows) const;
  void commit(std::size_t t, const Pending& p, bool delayed);
  Pending lowp_fake(std::span<const float> x, std::span<float> out, std::size_t rows, std::size_t cols,
                    const lowp::QuantizeConfig& c, lowp::Quantized* keep = nullptr);
  std::span<const std::uint32_t> random_words(std::size_t n);
  // Every quantization of every reachable plan once on zeros, so that the buffers they grow
  // exist before the first step (recipe files: a switch must not allocate).
  void warm_up();

  std::optional<QuantizedGemms> gemms_;  // a preset's; nullopt: a recipe file
  Fp8Config config_;
  std::shared_ptr<const lowp::Assignment> recipes_;
  std::uint64_t total_steps_ = 0;
  std::vector<RunPlan> plans_;
  std::optional<std::size_t> evaluation_plan_;  // the recipe file's evaluation entry
  bool evaluation_ = false;
  std::optional<lowp::DelayedScalingConfig> delayed_config_;  // of the fp8-delayed plans
  lowp::DelayedScaling delayed_;
  bool delayed_on_ = false;
  bool unit_scale_ = false;  // fp8-noscale
  std::vector<Linear> linears_;
  std::vector<Fp8TensorStats> stats_;
  std::vector<float> wq_;                  // the weight being multiplied (forward or backward)
  std::vector<float> work_;                // own work memory (finish(true))
  std::vector<lowp::Quantized> saved_q_;   // per Linear: what it keeps of X as codes
  std::vector<std::vector<float>> saved_x_;  // per Linear: X in fp32 (high-precision wgrad.x)
  lowp::Quantized work_q_;                 // the other operands' codes on their way
  std::vector<std::uint32_t> random_;      // stochastic rounding's words (splitmix64)
  std::uint64_t draws_ = 0;
  std::size_t max_weight_ = 0, max_work_ = 0, max_codes_ = 0, max_random_ = 0;
  bool finished_ = false;
  bool sampled_ = false;
};

}  // namespace mixprec::nn::detail
