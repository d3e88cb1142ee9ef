#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
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

TEST(ThreadPool, NestedRunIsRefused) {
  ThreadPool pool(1);
  bool threw = false;
  pool.run([&](unsigned) {
    try {
      pool.run([](unsigned) {});
    } catch (const std::logic_error&) {
      threw = true;
    }
  });
  EXPECT_TRUE(threw);
}

}  // namespace
}  // namespace mixprec
