// Private: data-parallel training and ZeRO-1 (docs/distributed.md), the pieces the
// trainer's phases call; the reductions of a step are Trainer::Impl's
// agree_across_ranks and reduce_gradients (data_parallel.cpp).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "mixprec/distributed/communicator.hpp"
#include "mixprec/kernels/exact_sum.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/optim/param_store.hpp"
#include "mixprec/run/config.hpp"

namespace mixprec::train {

// ZeRO stage 1: this rank's contiguous slice [begin, end) of the flat parameter
// vector, in a store of its own holding the fp32 master weights, the model copy, the
// gradients and the optimizer state of the slice only. Slices are cut at tensor starts
// or kUnscaleChunk boundaries inside a tensor, so that the exact partial sums of
// squares of the slices add up to the unsharded norm bit for bit.
// With state formats other than fp32 (--master, --moments) the slices are whole tensors
// (`whole_tensors`): a block's scale, a per-tensor scale and torchao's fallback rule belong to
// a tensor, so each rank steps the tensors [first_tensor, first_tensor + its store's
// tensor_count()) with their own names, shapes and layouts, which are the unsharded run's.
struct ZeroShard {
  std::vector<std::size_t> bounds;  // ranks + 1 flat offsets
  std::size_t begin = 0, end = 0;
  bool whole_tensors = false;
  std::size_t first_tensor = 0;
  std::unique_ptr<ParamStore> store;
  std::vector<float> grads;          // the reduce-scatter's fp32 sums
  std::vector<GradTensor> segments;  // the pieces of the tensors in the slice (norm)
  std::vector<ExactSum> sums;        // every rank's partial sum of squares
};

// This rank's slice of `full`, holding the initial weights of a model built from mc
// (master: with fp32 master weights, as the preset has them).
std::unique_ptr<ZeroShard> make_zero_shard(const TrainConfig& config, const nn::ModelConfig& mc, const ParamStore& full,
                                           bool master, const dist::Communicator& comm);

// ZeRO: the full fp32 weights of record (empty without master weights) and optimizer
// state arrays (flat_size each), gathered from every rank's slice. A collective.
void zero_gather(const ZeroShard& z, dist::Communicator& comm, std::size_t flat_size, std::vector<float>& weights,
                 std::vector<std::vector<float>>& states);

// ZeRO over whole tensors: a store of the full layout (the shard stores' options) holding every
// rank's weights, remainders or masters and optimizer state, gathered. A collective.
std::unique_ptr<ParamStore> zero_gather_store(const ZeroShard& z, dist::Communicator& comm, const ParamStore& full);

// ZeRO, after an applied step: every rank's updated slice of the model copy into
// `full`'s model copy, on every rank. A collective.
void zero_share_weights(const ZeroShard& z, dist::Communicator& comm, ParamStore& full);

// Distributed accumulation: this micro-batch's gradient (the store's grads region,
// written into zeros) added to acc in fp32, in micro-batch order; the first one is
// copied (so that the sum is bitwise the same as the communicator's rank-order sum).
void accumulate_grads(const ParamStore& s, std::span<float> acc, bool first, std::span<float> tmp);

}  // namespace mixprec::train
