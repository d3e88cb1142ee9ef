// Private: the Trainer's state, shared by trainer.cpp and checkpoint.cpp.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "mixprec/nn/data.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/schedule.hpp"
#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::train {

// Counters behind TrainSummary; saved in checkpoints so a resumed run reports the
// whole run.
struct RunTotals {
  std::uint64_t steps = 0, applied = 0, skipped = 0, tokens = 0;
  ConversionStats act_grads;
  double lost_update_sum = 0;  // over applied steps
  double seconds = 0;
  double final_loss = 0;
  std::optional<double> val_loss;
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
  std::vector<double> step_ms;      // this process's steps (median)
  RunTotals totals;
  dist::Communicator* comm = nullptr;
  std::unique_ptr<dist::SingleProcess> own_comm;  // when constructed without one
  std::vector<float> acc;           // distributed: this rank's gradient sum in fp32 (flat_size)
  std::vector<std::uint16_t> low;   // grad-reduce low with fp32 gradients: the f16/bf16 reduce buffer

  Impl(const TrainConfig& c, nn::Dataset d);
};

// "none" -> disabled scaler; "dynamic" -> the mixprec preset; "static:S"; a preset name.
std::unique_ptr<GradScaler> make_scaler(const std::string& spec);

}  // namespace mixprec::train
