// A small persistent thread pool: the caller plus N-1 workers run one task
// together and the caller waits for all of them. Kernels never start threads;
// the host-side code that calls them splits work with this pool.
//
// One task at a time per pool: a run() that finds the pool busy (another thread's
// run(), e.g. two independent GradScalers on two threads, or a run() from inside a task)
// runs every part of its task inline on its caller, in worker order. Callers' results do
// not depend on the thread count, so they are the same either way.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace mixprec {

class ThreadPool {
 public:
  // threads == 0: std::thread::hardware_concurrency(), or MIXPREC_THREADS when set.
  explicit ThreadPool(unsigned threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const noexcept { return static_cast<unsigned>(workers_.size()) + 1; }

  // Calls fn(worker) for worker in [0, size()) concurrently; worker 0 is the caller.
  template <class F>
  void run(F&& fn) {
    run_erased([](void* ctx, unsigned w) { (*static_cast<std::remove_reference_t<F>*>(ctx))(w); }, &fn);
  }

  // Splits [0, n) into size() contiguous ranges, each a multiple of `align`
  // (except the last), and calls fn(begin, end, worker) on each non-empty one.
  // Runs inline on the caller when n < min_parallel.
  template <class F>
  void parallel_for(std::size_t n, std::size_t align, std::size_t min_parallel, F&& fn) {
    const unsigned parts = n < min_parallel ? 1u : size();
    if (parts == 1) {
      if (n > 0) fn(std::size_t{0}, n, 0u);
      return;
    }
    const std::size_t per = ((n + parts - 1) / parts + align - 1) / align * align;
    run([&](unsigned w) {
      const std::size_t begin = std::min(n, per * w);
      const std::size_t end = std::min(n, begin + per);
      if (begin < end) fn(begin, end, w);
    });
  }

  // The process-wide pool, created on first use.
  static ThreadPool& global();

  // MIXPREC_THREADS: 0 when unset or empty, else its value; std::invalid_argument
  // ("MIXPREC_THREADS='abc' must be an integer in [1, 1024]") when it is not an integer
  // in [1, 1024]. What a pool of 0 threads uses; `mixprec train --threads 0` too.
  static unsigned environment_threads();

 private:
  using Task = void (*)(void*, unsigned);
  void run_erased(Task task, void* ctx);
  void worker_loop(unsigned index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  std::uint64_t generation_ = 0;
  unsigned pending_ = 0;
  bool running_ = false;
  bool stop_ = false;
};

}  // namespace mixprec
