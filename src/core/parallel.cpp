#include "mixprec/core/parallel.hpp"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace mixprec {

unsigned ThreadPool::environment_threads() {
  if (const char* env = std::getenv("MIXPREC_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (*end != '\0' || v < 1 || v > 1024) {
      throw std::invalid_argument(std::string("MIXPREC_THREADS='") + env + "' must be an integer in [1, 1024]");
    }
    return static_cast<unsigned>(v);
  }
  return 0;
}

static unsigned default_threads() {
  if (const unsigned env = ThreadPool::environment_threads(); env > 0) return env;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : hw;
}

ThreadPool::ThreadPool(unsigned threads) {
  const unsigned n = threads == 0 ? default_threads() : threads;
  workers_.reserve(n - 1);
  for (unsigned i = 1; i < n; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    const std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(unsigned index) {
  std::uint64_t seen = 0;
  for (;;) {
    Task task;
    void* ctx;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      task = task_;
      ctx = ctx_;
    }
    task(ctx, index);
    {
      const std::lock_guard lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::run_erased(Task task, void* ctx) {
  {
    std::unique_lock lock(mu_);
    if (running_) {
      // Busy: the whole task on this thread, part by part (the same split, the same results).
      lock.unlock();
      for (unsigned w = 0; w < size(); ++w) task(ctx, w);
      return;
    }
    running_ = true;
    task_ = task;
    ctx_ = ctx;
    pending_ = static_cast<unsigned>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  task(ctx, 0);  // exceptions from tasks are not supported: tasks run kernels, which do not throw
  std::unique_lock lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  running_ = false;
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

}  // namespace mixprec
