// MpiCommunicator (include/mixprec/distributed/mpi.hpp).
#include "mixprec/distributed/mpi.hpp"

#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#include <algorithm>

namespace mixprec::dist {
namespace {

using Clock = std::chrono::steady_clock;

int to_int(std::size_t bytes, std::string_view what) {
  if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw std::invalid_argument(std::string(what).append(": ") + std::to_string(bytes) +
                                " bytes per rank; at most 2^31 - 1 are supported");
  return static_cast<int>(bytes);
}

void check(int rc, std::string_view call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string(call).append(" failed: ").append(text, static_cast<std::size_t>(len)));
}

float widen(float x) { return x; }
float widen(f16 x) { return static_cast<float>(x); }
float widen(bf16 x) { return static_cast<float>(x); }

}  // namespace

MpiCommunicator::MpiCommunicator(double timeout_seconds) : timeout_(timeout_seconds) {
  if (!(std::isfinite(timeout_seconds) && timeout_seconds > 0))
    throw std::invalid_argument("dist-timeout: expected a finite number of seconds > 0, found " +
                                std::to_string(timeout_seconds));
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    finalize_ = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  const auto n = static_cast<std::size_t>(size_);
  counts_.assign(n, 0);
  displs_.assign(n, 0);
  rcounts_.assign(n, 0);
  rdispls_.assign(n, 0);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalize_ && !finalized) MPI_Finalize();
}

bool MpiCommunicator::launched_by_mpi() noexcept {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

void MpiCommunicator::wait(void* request, Collective kind, std::size_t elements) {
  auto* req = static_cast<MPI_Request*>(request);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_));
  auto pause = std::chrono::microseconds(20);
  for (int polls = 0;; ++polls) {
    int done = 0;
    check(MPI_Test(req, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done != 0) return;
    if (Clock::now() > deadline) {
      throw TimeoutError(std::string(collective_name(kind))
                             .append(" of ")
                             .append(std::to_string(elements))
                             .append(" elements at step ")
                             .append(std::to_string(step_))
                             .append(" did not complete within ")
                             .append(std::to_string(timeout_))
                             .append(" s on rank ")
                             .append(std::to_string(rank_))
                             .append(" of ")
                             .append(std::to_string(size_))
                             .append(": a peer rank died, stalled or is not in the same collective"));
    }
    // Poll tightly at first (fast collectives), then sleep so that a waiting rank
    // leaves the cores to ranks still computing.
    if (polls > 200) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

void MpiCommunicator::account(Collective kind, std::size_t bytes, Clock::time_point t0, bool call) {
  CollectiveStats& s = stats_[static_cast<std::size_t>(kind)];
  if (call) ++s.calls;
  s.bytes_sent += bytes;
  s.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
}

void MpiCommunicator::exchange_shards(const void* in, std::size_t n, std::size_t elem, Collective kind,
                                      std::span<const std::size_t> bounds) {
  const ShardRange mine = shard_of(n, size_, rank_, bounds);
  std::size_t sent = 0;
  for (int r = 0; r < size_; ++r) {
    const ShardRange s = shard_of(n, size_, r, bounds);
    const auto i = static_cast<std::size_t>(r);
    counts_[i] = to_int(s.size() * elem, collective_name(kind));
    displs_[i] = to_int(s.begin * elem, collective_name(kind));
    rcounts_[i] = to_int(mine.size() * elem, collective_name(kind));
    rdispls_[i] = to_int(i * mine.size() * elem, collective_name(kind));
    if (r != rank_) sent += s.size() * elem;
  }
  const std::size_t need = static_cast<std::size_t>(size_) * mine.size() * elem;
  if (recv_.size() < need) recv_.resize(need);
  const auto t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ialltoallv(in, counts_.data(), displs_.data(), MPI_BYTE, recv_.data(), rcounts_.data(), rdispls_.data(),
                       MPI_BYTE, MPI_COMM_WORLD, &req),
        "MPI_Ialltoallv");
  wait(&req, kind, n);
  account(kind, sent, t0);
}

void MpiCommunicator::gather_shards(void* data, std::size_t n, std::size_t elem, Collective kind, bool call,
                                    std::span<const std::size_t> bounds) {
  const ShardRange mine = shard_of(n, size_, rank_, bounds);
  for (int r = 0; r < size_; ++r) {
    const ShardRange s = shard_of(n, size_, r, bounds);
    const auto i = static_cast<std::size_t>(r);
    rcounts_[i] = to_int(s.size() * elem, collective_name(kind));
    rdispls_[i] = to_int(s.begin * elem, collective_name(kind));
  }
  const auto t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, data, rcounts_.data(), rdispls_.data(), MPI_BYTE, MPI_COMM_WORLD,
                        &req),
        "MPI_Iallgatherv");
  wait(&req, kind, n);
  account(kind, mine.size() * elem * static_cast<std::size_t>(size_ - 1), t0, call);
}

void MpiCommunicator::gather_all(const void* in, std::size_t bytes, Collective kind) {
  const std::size_t need = bytes * static_cast<std::size_t>(size_);
  if (recv_.size() < need) recv_.resize(need);
  const int count = to_int(bytes, collective_name(kind));
  const auto t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Iallgather(in, count, MPI_BYTE, recv_.data(), count, MPI_BYTE, MPI_COMM_WORLD, &req), "MPI_Iallgather");
  wait(&req, kind, bytes);
  account(kind, bytes * static_cast<std::size_t>(size_ - 1), t0);
}

// Reduce-scatter by shard owner (rank-order fp32 sums, one rounding), then all-gather.
template <class T>
void MpiCommunicator::sum_in_place(std::span<T> data, Collective kind) {
  const std::size_t n = data.size();
  exchange_shards(data.data(), n, sizeof(T), kind, {});
  const ShardRange mine = shard_range(n, size_, rank_);
  const auto* rows = reinterpret_cast<const T*>(recv_.data());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    float acc = widen(rows[i]);
    for (std::size_t r = 1; r < static_cast<std::size_t>(size_); ++r) acc += widen(rows[r * mine.size() + i]);
    data[mine.begin + i] = T(acc);
  }
  gather_shards(data.data(), n, sizeof(T), kind, false, {});  // the second half of one all-reduce
}

void MpiCommunicator::barrier() {
  const auto t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ibarrier(MPI_COMM_WORLD, &req), "MPI_Ibarrier");
  wait(&req, Collective::barrier, 0);
  account(Collective::barrier, 0, t0);
}

void MpiCommunicator::allreduce_sum(std::span<float> data) { sum_in_place(data, Collective::allreduce_sum_f32); }
void MpiCommunicator::allreduce_sum(std::span<f16> data) { sum_in_place(data, Collective::allreduce_sum_low); }
void MpiCommunicator::allreduce_sum(std::span<bf16> data) { sum_in_place(data, Collective::allreduce_sum_low); }

void MpiCommunicator::allreduce_sum(std::span<double> data) {
  gather_all(data.data(), data.size_bytes(), Collective::allreduce_sum_f64);
  const auto* rows = reinterpret_cast<const double*>(recv_.data());
  for (std::size_t i = 0; i < data.size(); ++i) {
    double acc = rows[i];
    for (std::size_t r = 1; r < static_cast<std::size_t>(size_); ++r) acc += rows[r * data.size() + i];
    data[i] = acc;
  }
}

void MpiCommunicator::allreduce_sum(std::span<std::uint64_t> data) {
  const auto t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(MPI_IN_PLACE, data.data(), to_int(data.size(), "allreduce_sum_u64"), MPI_UINT64_T, MPI_SUM,
                       MPI_COMM_WORLD, &req),
        "MPI_Iallreduce");
  wait(&req, Collective::allreduce_sum_u64, data.size());
  account(Collective::allreduce_sum_u64, data.size_bytes() * static_cast<std::size_t>(size_ - 1), t0);
}

void MpiCommunicator::allreduce_max(std::span<float> data) {
  gather_all(data.data(), data.size_bytes(), Collective::allreduce_max);
  const auto* rows = reinterpret_cast<const float*>(recv_.data());
  for (std::size_t i = 0; i < data.size(); ++i) {
    float m = rows[i];
    for (std::size_t r = 1; r < static_cast<std::size_t>(size_); ++r) {
      const float x = rows[r * data.size() + i];
      if (std::isnan(m)) break;
      if (std::isnan(x) || x > m) m = x;
    }
    data[i] = m;
  }
}

void MpiCommunicator::broadcast(std::span<std::byte> data, int root) {
  if (root < 0 || root >= size_)
    throw std::invalid_argument("broadcast: expected a root in [0, " + std::to_string(size_) + "), found " +
                                std::to_string(root));
  const auto t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ibcast(data.data(), to_int(data.size(), "broadcast"), MPI_BYTE, root, MPI_COMM_WORLD, &req),
        "MPI_Ibcast");
  wait(&req, Collective::broadcast, data.size());
  account(Collective::broadcast, rank_ == root ? data.size() * static_cast<std::size_t>(size_ - 1) : 0, t0);
}

void MpiCommunicator::reduce_scatter_sum(std::span<const float> in, std::span<float> out,
                                         std::span<const std::size_t> bounds) {
  const ShardRange mine = shard_of(in.size(), size_, rank_, bounds);
  if (out.size() != mine.size())
    throw std::invalid_argument("reduce_scatter_sum: expected an output of " + std::to_string(mine.size()) +
                                " elements (rank " + std::to_string(rank_) + "'s shard of " +
                                std::to_string(in.size()) + "), found " + std::to_string(out.size()));
  exchange_shards(in.data(), in.size(), sizeof(float), Collective::reduce_scatter, bounds);
  const auto* rows = reinterpret_cast<const float*>(recv_.data());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    float acc = rows[i];
    for (std::size_t r = 1; r < static_cast<std::size_t>(size_); ++r) acc += rows[r * mine.size() + i];
    out[i] = acc;
  }
}

void MpiCommunicator::all_gather(std::span<const std::byte> shard, std::span<std::byte> full, std::size_t elem_size,
                                 std::span<const std::size_t> bounds) {
  if (elem_size == 0 || full.size() % elem_size != 0)
    throw std::invalid_argument("all_gather: expected a buffer of whole elements of " + std::to_string(elem_size) +
                                " bytes, found " + std::to_string(full.size()) + " bytes");
  const std::size_t n = full.size() / elem_size;
  const ShardRange mine = shard_of(n, size_, rank_, bounds);
  if (shard.size() != mine.size() * elem_size)
    throw std::invalid_argument("all_gather: expected rank " + std::to_string(rank_) + "'s shard of " +
                                std::to_string(mine.size() * elem_size) + " bytes, found " +
                                std::to_string(shard.size()));
  if (!shard.empty() && shard.data() != full.data() + mine.begin * elem_size)
    std::memmove(full.data() + mine.begin * elem_size, shard.data(), shard.size());
  gather_shards(full.data(), n, elem_size, Collective::all_gather, true, bounds);
}

void MpiCommunicator::abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace mixprec::dist
