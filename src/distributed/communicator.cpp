// Communicator basics and the single-process communicator (include/mixprec/distributed/communicator.hpp).
#include "mixprec/distributed/communicator.hpp"

#include <cstdlib>
#include <cstring>

namespace mixprec::dist {

std::string_view collective_name(Collective c) noexcept {
  switch (c) {
    case Collective::barrier: return "barrier";
    case Collective::allreduce_sum_f32: return "allreduce_sum_f32";
    case Collective::allreduce_sum_low: return "allreduce_sum_low";
    case Collective::allreduce_max: return "allreduce_max";
    case Collective::allreduce_sum_f64: return "allreduce_sum_f64";
    case Collective::allreduce_sum_u64: return "allreduce_sum_u64";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
  }
  return "?";
}

ShardRange shard_range(std::size_t n, int size, int rank) noexcept {
  const auto s = static_cast<std::size_t>(size < 1 ? 1 : size);
  const auto r = static_cast<std::size_t>(rank < 0 ? 0 : rank);
  const std::size_t base = n / s, extra = n % s;
  const std::size_t begin = r * base + (r < extra ? r : extra);
  return {begin, begin + base + (r < extra ? 1 : 0)};
}

ShardRange shard_of(std::size_t n, int size, int rank, std::span<const std::size_t> bounds) {
  if (bounds.empty()) return shard_range(n, size, rank);
  bool ok = bounds.size() == static_cast<std::size_t>(size) + 1 && bounds.front() == 0 && bounds.back() == n;
  for (std::size_t i = 1; ok && i < bounds.size(); ++i) ok = bounds[i - 1] <= bounds[i];
  if (!ok)
    throw std::invalid_argument("shard bounds: expected " + std::to_string(size + 1) +
                                " non-decreasing offsets from 0 to " + std::to_string(n) + ", found " +
                                std::to_string(bounds.size()) + " offsets");
  const auto r = static_cast<std::size_t>(rank);
  return {bounds[r], bounds[r + 1]};
}

std::string Communicator::broadcast_string(const std::string& s, int root) {
  std::uint64_t n = s.size();
  broadcast({reinterpret_cast<std::byte*>(&n), sizeof n}, root);
  std::string out = rank() == root ? s : std::string(n, '\0');
  broadcast({reinterpret_cast<std::byte*>(out.data()), out.size()}, root);
  return out;
}

void SingleProcess::broadcast(std::span<std::byte>, int root) {
  if (root != 0) throw std::invalid_argument("broadcast: root " + std::to_string(root) + " of a 1-rank communicator");
}

void SingleProcess::reduce_scatter_sum(std::span<const float> in, std::span<float> out,
                                       std::span<const std::size_t> bounds) {
  (void)shard_of(in.size(), 1, 0, bounds);
  if (in.size() != out.size())
    throw std::invalid_argument("reduce_scatter_sum: expected an output of " + std::to_string(in.size()) +
                                " elements (1 rank), found " + std::to_string(out.size()));
  if (in.data() != out.data() && !in.empty()) std::memmove(out.data(), in.data(), in.size() * sizeof(float));
}

void SingleProcess::all_gather(std::span<const std::byte> shard, std::span<std::byte> full, std::size_t elem_size,
                               std::span<const std::size_t> bounds) {
  if (elem_size != 0) (void)shard_of(full.size() / elem_size, 1, 0, bounds);
  if (shard.size() != full.size())
    throw std::invalid_argument("all_gather: expected a shard of " + std::to_string(full.size()) +
                                " bytes (1 rank), found " + std::to_string(shard.size()));
  if (shard.data() != full.data() && !shard.empty()) std::memmove(full.data(), shard.data(), shard.size());
}

void SingleProcess::abort(int code) { std::exit(code); }

}  // namespace mixprec::dist
