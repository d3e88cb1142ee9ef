// Private: the Trainer's state, shared by trainer.cpp and checkpoint.cpp.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "kernels/unscale_kernels.hpp"
#include "mixprec/dist/communicator.hpp"
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
  // fp8 tensors, per role (0 forward, 1 backward): nonzero, saturated, flushed values.
  std::uint64_t fp8_nonzero[2] = {0, 0}, fp8_saturated[2] = {0, 0}, fp8_flushed[2] = {0, 0};
  double lost_update_sum = 0;  // over applied steps
  double seconds = 0;
  double final_loss = 0;
  std::optional<double> val_loss;
};

// ZeRO stage 1 (docs/distributed.md): this rank's contiguous slice [begin, end) of the
// flat parameter vector, in a store of its own holding the fp32 master weights, the
// model copy, the gradients and the optimizer state of the slice only. Slices are cut
// at tensor starts or kUnscaleChunk boundaries inside a tensor, so that the exact
// partial sums of squares of the slices add up to the unsharded norm bit for bit.
struct ZeroShard {
  std::vector<std::size_t> bounds;  // ranks + 1 flat offsets
  std::size_t begin = 0, end = 0;
  std::unique_ptr<ParamStore> store;
  std::vector<float> grads;                 // the reduce-scatter's fp32 sums
  std::vector<GradTensor> segments;         // the pieces of the tensors in the slice (norm)
  std::vector<detail::ExactSum> sums;       // every rank's partial sum of squares
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
  std::unique_ptr<ZeroShard> zero;  // --zero 1; the optimizer then steps zero->store

  Impl(const TrainConfig& c, nn::Dataset d);
};

// ZeRO: the full fp32 weights of record (empty without master weights) and optimizer
// state arrays (flat_size each), gathered from every rank's slice. A collective.
void zero_gather(const ZeroShard& z, dist::Communicator& comm, std::size_t flat_size, std::vector<float>& weights,
                 std::vector<std::vector<float>>& states);

// "none" -> disabled scaler; "dynamic" -> the mixprec preset; "static:S"; a preset name.
std::unique_ptr<GradScaler> make_scaler(const std::string& spec);

}  // namespace mixprec::train
