// Private: the Trainer's state and the phases of a step, shared by trainer.cpp,
// data_parallel.cpp and checkpoint.cpp.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "data_parallel.hpp"
#include "mixprec/distributed/communicator.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/schedule.hpp"
#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::train {

// One step's training loss before averaging.
struct StepLoss {
  double sum = 0;         // of the per-token losses computed (this rank's until summed over the ranks)
  std::size_t count = 0;  // losses in the effective batch (every rank's)
  double mean() const noexcept { return sum / static_cast<double>(count); }
};

struct Trainer::Impl {
  TrainConfig config;
  nn::Dataset data;
  std::unique_ptr<nn::Model> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<GradScaler> scaler;
  LrSchedule schedule;
  nn::BatchSampler sampler;
  std::vector<nn::TokenId> inputs, targets;
  std::vector<std::byte> snapshot;  // weights of record before a step (lost-update count)
  std::vector<float> scratch;       // flat fp32 values for telemetry (unscaled grads, decoded weights)
  std::vector<float> joined;        // remainder masters: the fp32 weights of record, rebuilt
  std::vector<float> first_moment;  // compact moments: m decoded for the lost-update count
  RunTotals totals;                 // the summary's counters (saved in checkpoints)
  dist::Communicator* comm = nullptr;
  std::unique_ptr<dist::SingleProcess> own_comm;  // when constructed without one
  std::vector<float> acc;           // distributed: this rank's gradient sum in fp32 (flat_size)
  std::vector<std::uint16_t> low;   // grad-reduce low with fp32 gradients: the f16/bf16 reduce buffer
  std::unique_ptr<ZeroShard> zero;  // --zero 1; the optimizer then steps zero->store
  // --threads threads (OpenMP's team size) for the step's own passes: the check, the
  // optimizer, the telemetry. Without it the optimizer ran on one thread whatever
  // --threads said, and the check on every core even under --threads 1.
  std::unique_ptr<ThreadPool> pool;
  std::vector<float> amax;          // per-tensor amaxes (telemetry)
  std::vector<GradTensor> weights;  // views of the weights of record, per tensor (telemetry; rebuilt each step)
  // Preset layerwise (layerwise_step.cpp): the scaler's per-layer scaling, this step's tensors
  // whose update it skips, and their weights, model copy and optimizer state before the step.
  LayerwiseScales* layerwise = nullptr;
  std::vector<std::size_t> skipped;
  std::vector<std::byte> skipped_saved;
  // --ema: the fp32 average of the weights of record over applied steps (empty when off).
  std::vector<float> ema;
  // --recipe-file: the recipes the model's Linears run, and the first step (0-based) of each
  // phase of its schedule, in file order (the labels the log marks).
  std::shared_ptr<const lowp::Assignment> recipes;
  std::vector<std::uint64_t> phase_starts;

  Impl(const TrainConfig& c, nn::Dataset d);

  // The phases of Trainer::train_step, in the order it calls them.
  StepRecord begin_step();  // gradients and statistics zeroed; step, lr and scale recorded
  StepLoss forward_backward(StepRecord& r);  // every micro-batch of the step, gradients accumulated
  void end_fp8_step(StepRecord& r);          // the fp8 recipe's once-per-step scale update
  void inject_overflow(StepRecord& r);       // --inject-overflow-at
  // Data parallel (data_parallel.cpp): whether another rank found inf/NaN, once the
  // flags, the loss sum and the activation-gradient counts are reduced over the ranks;
  // then the gradients reduced into the store the optimizer steps (ZeRO: the global
  // norm of the unscaled gradients, from every rank's slice).
  bool agree_across_ranks(StepRecord& r, double& loss_sum);
  std::optional<double> reduce_gradients(float scale);
  void record_gradient_telemetry(StepRecord& r);  // amaxes, headroom, histograms
  void snapshot_weights();                         // the weights of record before the step (lost updates)
  // Check + unscale, clip, and the optimizer step unless some gradient (here or on
  // another rank) is inf/NaN.
  StepOutcome step_or_skip(StepRecord& r, bool found_inf_elsewhere, std::optional<double> global_norm);
  void update_loss_scale(StepRecord& r);
  // Preset layerwise, after the backward passes: each scaled layer's outcome; when a layer
  // started an overflow, the tensors holding inf/NaN are zeroed and saved (their update is
  // skipped, the rest steps); every gradient brought to the base scale. After the optimizer:
  // the skipped tensors' weights and optimizer state put back.
  void finish_layers(StepRecord& r);
  void restore_skipped();
  void record_weight_telemetry(StepRecord& r);  // amaxes and histograms after the step
  void update_ema();                            // after an applied step: ema += (1 - decay) (w - ema)
  // Evaluation with the EMA: the weights of record saved (snapshot) and the EMA written in
  // their place (rounded to the model's dtype without a master copy); then put back bytewise.
  void load_ema();
  void restore_weights();
};

// Flat fp32 values of a store region of dtype t (out.size() elements) into out.
void to_f32(const void* src, DType t, std::span<float> out);

// c.loss_scale: "none" -> disabled scaler; "dynamic" -> the mixprec preset; "static:S"; a
// preset name; with c's step guards (skip-loss-z, skip-grad-z, skip-window). With a
// communicator (data parallel), the protocol's rank hook MAX-reduces found_inf over the ranks
// at every check: a ZeRO shard whose unscaled values overflow their dtype (a check no norm
// sees) makes every rank skip.
std::unique_ptr<GradScaler> make_scaler(const TrainConfig& c, dist::Communicator* comm);

// Preset layerwise: std::invalid_argument unless the precision keeps fp32 weight gradients
// and scales fp32 GEMM operands (fp16, fp32) and the run is not distributed.
void check_layerwise(const TrainConfig& c);

}  // namespace mixprec::train
