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
#include <span>
#include <string>
#include <vector>

#include "mixprec/distributed/communicator.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/step_record.hpp"

namespace mixprec::train {

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
  // --ema: the fp32 average of the weights of record over applied steps (empty when off).
  std::span<const float> ema() const noexcept;
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
