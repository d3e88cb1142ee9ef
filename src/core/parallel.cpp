#include "mixprec/core/parallel.hpp"

#include "mixprec/core/keys.hpp"

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>

#if defined(MIXPREC_POOL_STD_THREADS)
#include <condition_variable>
#include <mutex>
#include <vector>
#else
#include <omp.h>
#endif

namespace mixprec {

unsigned ThreadPool::environment_threads() {
  if (const char* env = std::getenv("MIXPREC_THREADS"); env != nullptr && *env != '\0') {
    // The number grammar of every key and flag (--threads): "MIXPREC_THREADS: expected ..., found 'abc'".
    static const keys::Spec spec{.name = "MIXPREC_THREADS", .kind = keys::Kind::integer, .int_min = 1, .int_max = 1024};
    return static_cast<unsigned>(std::get<keys::Integer>(keys::parse_text(spec, env)).magnitude);
  }
  return 0;
}

static unsigned default_threads() {
  if (const unsigned env = ThreadPool::environment_threads(); env > 0) return env;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : hw;
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

ThreadPool* ThreadPool::of_size(unsigned threads) {
  if (threads <= 1) return nullptr;
  static std::mutex lock;
  static std::map<unsigned, std::unique_ptr<ThreadPool>> pools;  // kept: a caller may still run on one
  const std::lock_guard<std::mutex> hold(lock);
  std::unique_ptr<ThreadPool>& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return p.get();
}

#if !defined(MIXPREC_POOL_STD_THREADS)

// OpenMP: the team of the calling thread, as the layers and oneDNN use it.
struct ThreadPool::Workers {};

const char* ThreadPool::runtime() noexcept { return "openmp"; }

ThreadPool::ThreadPool(unsigned threads) : size_(threads == 0 ? default_threads() : threads) {}
ThreadPool::~ThreadPool() = default;

void ThreadPool::run_erased(Task task, void* ctx) {
  const unsigned n = size_;
  bool idle = false;
  if (n == 1 || !busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
    // Busy (or one thread): the whole task on this thread, part by part.
    for (unsigned w = 0; w < n; ++w) task(ctx, w);
    return;
  }
  // The runtime may give fewer threads than asked (inside another parallel region, under
  // OMP_THREAD_LIMIT): every part still runs, some threads taking several in turn.
  #pragma omp parallel num_threads(static_cast<int>(n))
  {
    const auto team = static_cast<unsigned>(omp_get_num_threads());
    for (auto w = static_cast<unsigned>(omp_get_thread_num()); w < n; w += team) task(ctx, w);
  }
  busy_.store(false, std::memory_order_release);
}

#else

// The pool's own threads: the caller plus size() - 1 workers woken per task.
struct ThreadPool::Workers {
  std::vector<std::thread> threads;
  std::mutex mu;
  std::condition_variable wake, done;
  Task task = nullptr;
  void* ctx = nullptr;
  std::uint64_t generation = 0;
  unsigned pending = 0;
  bool stop = false;

  void loop(unsigned index) {
    std::uint64_t seen = 0;
    for (;;) {
      Task t;
      void* c;
      {
        std::unique_lock lock(mu);
        wake.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
        t = task;
        c = ctx;
      }
      t(c, index);
      {
        const std::lock_guard lock(mu);
        if (--pending == 0) done.notify_one();
      }
    }
  }
};

const char* ThreadPool::runtime() noexcept { return "std::thread"; }

ThreadPool::ThreadPool(unsigned threads)
    : size_(threads == 0 ? default_threads() : threads), workers_(std::make_unique<Workers>()) {
  workers_->threads.reserve(size_ - 1);
  for (unsigned i = 1; i < size_; ++i) workers_->threads.emplace_back([this, i] { workers_->loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    const std::lock_guard lock(workers_->mu);
    workers_->stop = true;
  }
  workers_->wake.notify_all();
  for (auto& t : workers_->threads) t.join();
}

void ThreadPool::run_erased(Task task, void* ctx) {
  bool idle = false;
  if (size_ == 1 || !busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
    for (unsigned w = 0; w < size_; ++w) task(ctx, w);
    return;
  }
  Workers& k = *workers_;
  {
    const std::lock_guard lock(k.mu);
    k.task = task;
    k.ctx = ctx;
    k.pending = size_ - 1;
    ++k.generation;
  }
  k.wake.notify_all();
  task(ctx, 0);  // exceptions from tasks are not supported: tasks run kernels, which do not throw
  {
    std::unique_lock lock(k.mu);
    k.done.wait(lock, [&] { return k.pending == 0; });
  }
  busy_.store(false, std::memory_order_release);
}

#endif

}  // namespace mixprec
