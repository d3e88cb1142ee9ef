#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "mixprec/core/parallel.hpp"

namespace mixprec {
namespace {

TEST(ThreadPool, EveryWorkerRunsOncePerTask) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.size(), 3u);
  for (int rep = 0; rep < 200; ++rep) {
    std::vector<std::atomic<int>> hits(pool.size());
    pool.run([&](unsigned w) { hits[w].fetch_add(1); });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(ThreadPool, ParallelForCoversTheRangeOnceInAlignedParts) {
  ThreadPool pool(2);
  for (std::size_t n : {0, 1, 15, 16, 17, 1000, 4099}) {
    std::vector<int> seen(n, 0);
    pool.parallel_for(n, 16, 0, [&](std::size_t b, std::size_t e, unsigned) {
      EXPECT_EQ(b % 16, 0u);
      for (std::size_t i = b; i < e; ++i) ++seen[i];
    });
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "n=" << n << " i=" << i;
  }
}

TEST(ThreadPool, SmallRangesRunInline) {
  ThreadPool pool(2);
  unsigned worker = 99;
  pool.parallel_for(10, 1, 100, [&](std::size_t, std::size_t, unsigned w) { worker = w; });
  EXPECT_EQ(worker, 0u);
}

TEST(ThreadPool, NestedRunRunsInlineOnTheCaller) {
  ThreadPool pool(3);
  std::vector<std::vector<unsigned>> inner(3);  // per outer worker: the inner parts it ran
  pool.run([&](unsigned w) {
    pool.run([&](unsigned part) { inner[w].push_back(part); });
  });
  // The pool was busy for every nested call: each ran all three parts itself, in order.
  for (const auto& parts : inner) EXPECT_EQ(parts, (std::vector<unsigned>{0, 1, 2}));
}

TEST(ThreadPool, IndependentCallersShareTheGlobalPool) {
  // Two threads using one pool at once: one of them gets the workers, the other runs inline;
  // both get every part done (the race that raised "already running a task" before).
  ThreadPool pool(2);
  std::atomic<int> done{0};
  auto caller = [&] {
    for (int i = 0; i < 2000; ++i) {
      std::atomic<int> parts{0};
      pool.run([&](unsigned) { parts.fetch_add(1); });
      if (parts.load() == 2) done.fetch_add(1);
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(done.load(), 4000);
}

TEST(ThreadPool, ARunInsideAnotherPoolsTaskDoesEveryPartOnce) {
  // OpenMP: the inner team is nested in the outer one (one thread: every part in turn);
  // std::threads: the first caller gets the inner pool's workers, the other runs inline.
  ThreadPool outer(2), inner(3);
  for (int rep = 0; rep < 100; ++rep) {
    std::vector<std::atomic<int>> hits(outer.size() * inner.size());
    outer.run([&](unsigned w) { inner.run([&](unsigned part) { hits[w * inner.size() + part].fetch_add(1); }); });
    for (std::size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << "outer part " << i / 3 << ", inner " << i % 3;
  }
}

TEST(ThreadPool, IndependentPoolsOnIndependentThreads) {
  // Each caller thread has its own team (OpenMP: one per master thread).
  std::atomic<int> done{0};
  auto caller = [&] {
    ThreadPool pool(2);
    for (int i = 0; i < 500; ++i) {
      std::vector<int> seen(4099, 0);
      pool.parallel_for(seen.size(), 64, 0, [&](std::size_t b, std::size_t e, unsigned) {
        for (std::size_t j = b; j < e; ++j) ++seen[j];
      });
      if (std::accumulate(seen.begin(), seen.end(), 0) == 4099) done.fetch_add(1);
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(done.load(), 1000);
}

// MIXPREC_THREADS is read by the number grammar of every key (--threads): its message, and
// no text strtol would take and the grammar does not (" 8", "8 ").
TEST(ThreadPool, EnvironmentThreadsFollowTheNumberGrammar) {
  const char* before = std::getenv("MIXPREC_THREADS");
  const std::optional<std::string> saved = before ? std::optional<std::string>(before) : std::nullopt;
  auto with = [](const char* v) {
    ::setenv("MIXPREC_THREADS", v, 1);
    try {
      return std::to_string(ThreadPool::environment_threads());
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(with("8"), "8");
  EXPECT_EQ(with("1e1"), "10");  // a whole number, as --threads 1e1
  for (const char* v : {"abc", "nan", "inf", "1e999", " 8", "8 ", "0x8", "2.5"})
    EXPECT_EQ(with(v), "MIXPREC_THREADS: expected an integer in [1, 1024], found '" + std::string(v) + "'" +
                           (std::string(v) == "1e999" ? " (past the range of a double)"
                            : std::string(v) == "0x8"
                                ? " (integers are written in decimal: digits, or a whole number such as 2e6 or 20.0)"
                                : ""))
        << v;
  EXPECT_EQ(with("-1"), "MIXPREC_THREADS: expected an integer in [1, 1024], found -1");
  EXPECT_EQ(with("0"), "MIXPREC_THREADS: expected an integer in [1, 1024], found 0");
  EXPECT_EQ(with("1025"), "MIXPREC_THREADS: expected an integer in [1, 1024], found 1025");
  if (saved) ::setenv("MIXPREC_THREADS", saved->c_str(), 1);
  else ::unsetenv("MIXPREC_THREADS");
}

TEST(ThreadPool, NamesItsRuntime) {
  const std::string r = ThreadPool::runtime();
  EXPECT_TRUE(r == "openmp" || r == "std::thread") << r;
}

}  // namespace
}  // namespace mixprec
