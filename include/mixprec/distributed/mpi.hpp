// MpiCommunicator: the Communicator over MPI (library mixprec_dist_mpi, built when
// CMake finds MPI; it defines MIXPREC_WITH_MPI for its users). See communicator.hpp
// for the reduction order and the deadlines, docs/distributed.md for the protocol.
//
// Every collective is a non-blocking MPI call (MPI_Ialltoallv, MPI_Iallgatherv,
// MPI_Ibcast, ...) completed by polling MPI_Test against the deadline, sleeping
// between polls (the ranks may share cores with each other's compute). No MPI type
// appears in this header.
#pragma once

#include <chrono>
#include <cstddef>
#include <vector>

#include "mixprec/distributed/communicator.hpp"

namespace mixprec::dist {

class MpiCommunicator final : public Communicator {
 public:
  // Initializes MPI (MPI_THREAD_FUNNELED) unless it already is, on MPI_COMM_WORLD;
  // the destructor finalizes it when this object initialized it. timeout_seconds:
  // the deadline of every collective, finite and > 0 (std::invalid_argument).
  explicit MpiCommunicator(double timeout_seconds = 120.0);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  // Whether this process was started by an MPI launcher (mpirun / mpiexec / srun):
  // the OpenMPI, PMI or PMIx rank variables are set.
  static bool launched_by_mpi() noexcept;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  double timeout_seconds() const noexcept { return timeout_; }

  void barrier() override;
  void allreduce_sum(std::span<float> data) override;
  void allreduce_sum(std::span<f16> data) override;
  void allreduce_sum(std::span<bf16> data) override;
  void allreduce_sum(std::span<double> data) override;
  void allreduce_sum(std::span<std::uint64_t> data) override;
  void allreduce_max(std::span<float> data) override;
  void broadcast(std::span<std::byte> data, int root) override;
  void reduce_scatter_sum(std::span<const float> in, std::span<float> out,
                          std::span<const std::size_t> bounds = {}) override;
  void all_gather(std::span<const std::byte> shard, std::span<std::byte> full, std::size_t elem_size,
                  std::span<const std::size_t> bounds = {}) override;
  [[noreturn]] void abort(int code) override;

 private:
  template <class T>
  void sum_in_place(std::span<T> data, Collective kind);
  // Exchanges the shards of `in` (n elements of elem bytes) so that recv holds
  // size() rows of this rank's shard, row r from rank r.
  void exchange_shards(const void* in, std::size_t n, std::size_t elem, Collective kind,
                       std::span<const std::size_t> bounds);
  void gather_shards(void* data, std::size_t n, std::size_t elem, Collective kind, bool call,
                     std::span<const std::size_t> bounds);
  void gather_all(const void* in, std::size_t bytes, Collective kind);  // recv := size() copies, rank order
  void wait(void* request, Collective kind, std::size_t elements);
  void account(Collective kind, std::size_t bytes, std::chrono::steady_clock::time_point t0, bool call = true);

  int rank_ = 0, size_ = 1;
  double timeout_ = 120.0;
  bool finalize_ = false;
  std::vector<std::byte> recv_;    // grows to the largest collective, then reused
  std::vector<int> counts_, displs_, rcounts_, rdispls_;
};

}  // namespace mixprec::dist
