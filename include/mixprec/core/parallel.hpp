// A fixed-size team for the library's host-side splits: run() calls fn(worker) for every
// worker in [0, size()) concurrently, the caller being worker 0, and returns when all are
// done. Kernels never start threads; the code that calls them splits work with a pool.
//
// The team is OpenMP's, the runtime the layers and oneDNN already run on: one set of
// threads for the whole step, so the optimizer, the check and the clip never compete with
// a second team's waiting threads for the cores (docs/performance.md, "One thread
// runtime"). Builds with MIXPREC_POOL_STD_THREADS (forced by MIXPREC_TSAN: libgomp is not
// instrumented) run the same splits on the pool's own std::threads instead, so that
// ThreadSanitizer sees every access of the threaded kernels.
//
// One task at a time per pool: a run() that finds the pool busy (another thread's run(),
// e.g. two independent GradScalers on two threads, or a run() from inside a task) runs
// every part of its task inline on its caller, in worker order. Callers' results do not
// depend on the thread count, so they are the same either way.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <type_traits>

namespace mixprec {

class ThreadPool {
 public:
  // threads == 0: std::thread::hardware_concurrency(), or MIXPREC_THREADS when set.
  explicit ThreadPool(unsigned threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const noexcept { return size_; }

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
  // A process-wide pool of `threads` workers, created on first use and kept (one per size
  // asked for); nullptr for threads <= 1. For the doors that follow their framework's thread
  // count (torch.get_num_threads(), at::get_num_threads()). Thread-safe.
  static ThreadPool* of_size(unsigned threads);

  // MIXPREC_THREADS: 0 when unset or empty, else its value; std::invalid_argument
  // ("MIXPREC_THREADS: expected an integer in [1, 1024], found 'abc'") when it is not an integer
  // in [1, 1024]. What a pool of 0 threads uses; `mixprec train --threads 0` too.
  static unsigned environment_threads();

  // The runtime this build's pools run on: "openmp" or "std::thread".
  static const char* runtime() noexcept;

 private:
  using Task = void (*)(void*, unsigned);
  void run_erased(Task task, void* ctx);

  struct Workers;  // the std::thread team (MIXPREC_POOL_STD_THREADS builds only)
  unsigned size_ = 1;
  std::atomic<bool> busy_{false};
  std::unique_ptr<Workers> workers_;
};

}  // namespace mixprec
