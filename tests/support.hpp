// Test helpers: hex formatting, the message of an expected exception, and a
// multi-threaded sweep over all 2^32 fp32 patterns.
#pragma once

#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mixprec::test {

inline std::string hex(std::uint64_t v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%0*llx", digits, static_cast<unsigned long long>(v));
  return buf;
}
inline std::string hexf(float f) { return hex(std::bit_cast<std::uint32_t>(f), 8); }

// splitmix64: deterministic, cheap test data (next(): 64 random bits; uniform(): [0, 1)).
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }
};

// what() of the E that f() throws; a marker (which no expected message equals) when it
// throws another exception or nothing.
template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(wrong exception type: ") + e.what() + ")";
  }
  return "(no exception of the expected type)";
}

// Collects the first few failures of a sweep, printed in hex.
class Failures {
 public:
  void add(const std::string& what) {
    const std::lock_guard lock(mu_);
    ++count_;
    if (first_.size() < 12) first_.push_back(what);
  }
  std::uint64_t count() const { return count_; }
  std::string report() const {
    std::string s = std::to_string(count_) + " mismatches; first:\n";
    for (const auto& f : first_) s += "  " + f + "\n";
    return s;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> first_;
  std::uint64_t count_ = 0;
};

// Calls chunk(first_bits, count, worker) for consecutive chunks covering
// [begin, end) of the 32-bit pattern space (with a stride: every stride-th
// chunk), spread over all hardware threads.
inline void sweep_patterns(std::uint64_t begin, std::uint64_t end, std::uint64_t chunk_size,
                           std::uint64_t chunk_stride,
                           const std::function<void(std::uint32_t, std::size_t, unsigned)>& chunk) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<std::uint64_t> next{begin};
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (;;) {
        const std::uint64_t first = next.fetch_add(chunk_size * chunk_stride);
        if (first >= end) return;
        const std::uint64_t n = std::min<std::uint64_t>(chunk_size, end - first);
        chunk(static_cast<std::uint32_t>(first), static_cast<std::size_t>(n), t);
      }
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace mixprec::test
