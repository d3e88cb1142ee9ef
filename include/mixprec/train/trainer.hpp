// The training loop as a library: one call per optimizer step, in the order the
// seeds prescribe (forward with the scaled loss, backward, check for inf/NaN before
// unscale / clip / any optimizer-state write, skip without advancing the optimizer,
// update the scale once per accumulation window).
//
//   train::Trainer t(config);            // validates, loads data, builds model / optimizer / scaler
//   while (!t.done()) { StepRecord r = t.train_step(); ... }
//   double val = t.evaluate();
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mixprec/dist/communicator.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/train/config.hpp"

namespace mixprec::train {

// What one optimizer step did (one JSONL line of the run log).
struct StepRecord {
  std::uint64_t step = 0;        // 1-based
  double lr = 0;                 // learning rate of this step
  double loss = 0;               // mean training loss over the step's tokens (unscaled)
  bool loss_finite = true;       // false: the forward pass produced inf/NaN (loss scaling cannot repair this)
  std::string forward_nonfinite; // first activation that went non-finite, when !loss_finite
  float scale = 1;               // loss scale the gradients carried
  float next_scale = 1;          // loss scale after the update
  bool found_inf = false;        // inf/NaN among the gradients
  bool skipped = false;          // no optimizer update this step
  bool injected = false;         // --inject-overflow-at hit this step
  double grad_norm = 0;          // global norm of the unscaled gradients (NaN when skipped)
  float clip_coef = 1;
  std::string overflow_param;    // first parameter gradient holding inf/NaN
  std::string overflow_activation;  // first activation gradient whose fp16/bf16 store overflowed
  ConversionStats act_grads;     // what rounding did to activation gradients this step
  double lost_update_fraction = 0;  // of parameters the optimizer meant to change, those whose stored weights did not
  std::uint64_t tokens = 0;      // tokens processed this step
  double seconds = 0;            // wall time of the whole step
  double scaler_seconds = 0;     // of which check + unscale + clip + optimizer step + scale update
  std::optional<double> val_loss;  // when this step evaluated

  // Telemetry (docs/telemetry.md).
  float act_grad_amax = 0;       // largest |activation gradient| before rounding, scaled domain (inf if non-finite)
  double headroom_log2 = 0;      // log2(activation format max / act_grad_amax): binades left before overflow
  std::vector<nn::TensorGradStats> act_grad_tensors;  // per activation-gradient tensor
  struct ParamStats {
    std::string name;
    float grad_amax = 0;    // unscaled |gradient| max (inf/NaN -> inf)
    float weight_amax = 0;  // |weight| max of the weights of record after the step
  };
  std::vector<ParamStats> params;
  // At histogram steps (config histogram-every): log2-magnitude histograms.
  struct Histograms {
    nn::Log2Histogram activations, activation_grads;  // before rounding; activation grads in the scaled domain
    nn::Log2Histogram weight_grads;                   // unscaled
    nn::Log2Histogram weights;                        // weights of record
  };
  std::optional<Histograms> histograms;
  // fp8 presets: per fp8 tensor of the Linear layers, this step's quantization (docs/telemetry.md).
  std::vector<nn::Fp8TensorStats> fp8;
};

struct TrainSummary {
  std::uint64_t steps = 0, applied = 0, skipped = 0;
  double final_loss = 0;             // last step's training loss
  std::optional<double> val_loss;    // last evaluation
  float final_scale = 1;
  double underflow_fraction = 0;     // activation-gradient elements flushed to zero / all nonzero ones, whole run
  double subnormal_fraction = 0;     // ... left subnormal
  double lost_update_fraction = 0;   // mean over applied steps
  // fp8 presets, whole run: of the nonzero values quantized to fp8, the fraction clipped by
  // the saturating cast / flushed to zero; forward tensors (inputs, weights) and backward
  // tensors (output gradients) apart. 0 for other presets.
  double fp8_forward_saturated_fraction = 0, fp8_forward_flushed_fraction = 0;
  double fp8_backward_saturated_fraction = 0, fp8_backward_flushed_fraction = 0;
  double seconds = 0;                // training time (steps), excluding evaluation
  double mean_step_ms = 0;           // median would hide the tail: both are in the log
  double median_step_ms = 0;
  std::uint64_t tokens = 0;
  nn::ModelMemory memory;
  std::size_t param_count = 0;
  int ranks = 1;                     // data-parallel ranks of this process's run
};

class Trainer {
 public:
  // Everything validated here, before any state exists: config, data, model shape.
  explicit Trainer(const TrainConfig& config);
  // Data-parallel (config.distributed): every rank of `comm` constructs its Trainer
  // with the same config and calls train_step() in lockstep; rank r runs micro-batches
  // [r * accum, (r + 1) * accum) of the step's accum * ranks, the gradients are
  // all-reduced (grad-reduce), found_inf is MAX-reduced. Rank 0's weights and scaler
  // state are broadcast here. docs/distributed.md. `comm` must outlive the Trainer.
  Trainer(const TrainConfig& config, dist::Communicator& comm);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  const TrainConfig& config() const noexcept;
  const nn::Dataset& data() const noexcept;
  nn::Model& model() noexcept;
  const GradScaler& scaler() const noexcept;
  const Optimizer& optimizer() const noexcept;
  dist::Communicator& communicator() noexcept;

  std::uint64_t steps_done() const noexcept;
  bool done() const noexcept;
  // One optimizer step (accum micro-batches). Evaluates too when the step is a
  // multiple of eval_every or the last one.
  StepRecord train_step();
  // Mean validation loss over config().eval_windows windows (all when 0).
  double evaluate();
  TrainSummary summary() const;

  // Checkpoint: every tensor and all state (scaler, optimizer, schedule, sampler, step,
  // summary counters, config) so that a resumed run continues bitwise identically.
  void save_checkpoint(const std::string& path) const;
  // Loads a checkpoint written by save_checkpoint for the same config (model, data,
  // precision); validates everything before changing any state.
  void load_checkpoint(const std::string& path);

 private:
  void init(const TrainConfig& config, dist::Communicator* comm);  // comm: nullptr = a SingleProcess of its own
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixprec::train
