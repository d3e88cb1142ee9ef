// Communicator: the collectives data-parallel training needs (docs/distributed.md).
//
//   dist::SingleProcess one;                  // size 1: every collective is the identity
//   dist::MpiCommunicator world(timeout_s);   // mixprec_dist_mpi, when built with MPI
//   world.allreduce_sum(grads);               // fp32, rank order: bitwise the same on every rank
//   world.allreduce_max(amaxes);              // found_inf, FP8 amaxes
//
// Determinism: sums never depend on the transport's reduction algorithm. Each
// element is reduced by the rank owning its shard (shard_range), which adds the
// ranks' values in rank order, ((x_0 + x_1) + x_2) + ..., in fp32 (f16/bf16 are
// widened to fp32, summed, and rounded once to the format, to nearest even); the
// shards are then all-gathered. So the result is bitwise the same on every rank
// and equal to the sequential sum of the ranks' buffers. MAX propagates NaN
// (a NaN anywhere gives NaN), then inf.
//
// Every collective of an MPI communicator has a deadline (timeout seconds): a
// collective that has not completed by then throws TimeoutError naming the
// operation, its size and the step (set_step); the caller reports it and calls
// abort(), so a dead or stalled peer never hangs the job. Communicators never log.
//
// Statistics: per collective kind, calls, bytes this rank sent and seconds spent
// (summary: volume and time per step).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/types.hpp"

namespace mixprec::dist {

enum class Collective : std::uint8_t {
  barrier,
  allreduce_sum_f32,   // gradients, fp32
  allreduce_sum_low,   // gradients, f16/bf16
  allreduce_max,       // found_inf, amaxes
  allreduce_sum_f64,   // losses
  allreduce_sum_u64,   // counters
  broadcast,           // initial weights, scaler state
  reduce_scatter,      // ZeRO: gradients to their shard owner
  all_gather,          // ZeRO: updated shards to every rank
};
inline constexpr std::size_t kCollectiveKinds = 9;
std::string_view collective_name(Collective c) noexcept;

struct CollectiveStats {
  std::uint64_t calls = 0;
  std::uint64_t bytes_sent = 0;  // by this rank
  double seconds = 0;            // wall time inside the collective, waiting included
};
using CommStats = std::array<CollectiveStats, kCollectiveKinds>;

// A collective exceeded its deadline.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Elements [begin, end) of a flat buffer of n elements that rank r of `size` owns:
// contiguous shards in rank order, the first n % size ranks one element longer.
struct ShardRange {
  std::size_t begin = 0, end = 0;
  std::size_t size() const noexcept { return end - begin; }
};
ShardRange shard_range(std::size_t n, int size, int rank) noexcept;
// Rank r's shard: [bounds[r], bounds[r + 1]), or shard_range(n, size, r) when bounds is
// empty. Throws std::invalid_argument when bounds is not size + 1 non-decreasing
// offsets from 0 to n.
ShardRange shard_of(std::size_t n, int size, int rank, std::span<const std::size_t> bounds);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;

  virtual void barrier() = 0;
  // Element-wise sums over ranks (rank order, fp32 accumulation; see above).
  virtual void allreduce_sum(std::span<float> data) = 0;
  virtual void allreduce_sum(std::span<f16> data) = 0;
  virtual void allreduce_sum(std::span<bf16> data) = 0;
  virtual void allreduce_sum(std::span<double> data) = 0;  // double accumulation, rank order
  virtual void allreduce_sum(std::span<std::uint64_t> data) = 0;
  // Element-wise max over ranks; NaN anywhere gives NaN.
  virtual void allreduce_max(std::span<float> data) = 0;
  // data.size() bytes from `root` to every rank (the same size on every rank).
  virtual void broadcast(std::span<std::byte> data, int root) = 0;
  // in: the whole buffer (n elements, the same n on every rank); out: this rank's
  // shard, the rank-order fp32 sum. Shards: `bounds` (size() + 1 offsets, 0 first, n
  // last, non-decreasing: rank r owns [bounds[r], bounds[r + 1])), or shard_range
  // when empty.
  virtual void reduce_scatter_sum(std::span<const float> in, std::span<float> out,
                                  std::span<const std::size_t> bounds = {}) = 0;
  // shard: this rank's shard of `full` (n = full.size() / elem_size elements of
  // elem_size bytes; shards as above); every rank's shard lands in place in `full`.
  virtual void all_gather(std::span<const std::byte> shard, std::span<std::byte> full, std::size_t elem_size,
                          std::span<const std::size_t> bounds = {}) = 0;

  // Ends the job on every rank (MPI_Abort); SingleProcess: std::exit.
  [[noreturn]] virtual void abort(int code) = 0;

  // Context for timeout messages.
  void set_step(std::uint64_t step) noexcept { step_ = step; }
  std::uint64_t step() const noexcept { return step_; }
  const CommStats& stats() const noexcept { return stats_; }
  void reset_stats() noexcept { stats_ = {}; }

  // Convenience: a broadcast of a string whose length only root knows.
  std::string broadcast_string(const std::string& s, int root);

 protected:
  CommStats stats_{};
  std::uint64_t step_ = 0;
};

// One process: size 1, rank 0; sums and max return the data unchanged.
class SingleProcess final : public Communicator {
 public:
  int rank() const noexcept override { return 0; }
  int size() const noexcept override { return 1; }
  void barrier() override {}
  void allreduce_sum(std::span<float>) override {}
  void allreduce_sum(std::span<f16>) override {}
  void allreduce_sum(std::span<bf16>) override {}
  void allreduce_sum(std::span<double>) override {}
  void allreduce_sum(std::span<std::uint64_t>) override {}
  void allreduce_max(std::span<float>) override {}
  void broadcast(std::span<std::byte>, int root) override;
  void reduce_scatter_sum(std::span<const float> in, std::span<float> out,
                          std::span<const std::size_t> bounds = {}) override;
  void all_gather(std::span<const std::byte> shard, std::span<std::byte> full, std::size_t elem_size,
                  std::span<const std::size_t> bounds = {}) override;
  [[noreturn]] void abort(int code) override;
};

}  // namespace mixprec::dist
