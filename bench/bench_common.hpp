// Helpers shared by mixprec's benchmark suites (formats, scaler, optimizers):
// huge-page aligned buffers, a streaming copy, the reporter that keeps the
// median of each case for a ratio table, a met/not-met tally, and the
// start-up of Google Benchmark with a suite's default flags.
//
// Every suite registers its cases dynamically (benchmark::RegisterBenchmark)
// inside its run function, so suites linked into one program (the `mixprec`
// CLI) never run each other's cases.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::bench {

// ---- buffers -----------------------------------------------------------------
// Allocated once, 2 MiB aligned, madvise(MADV_HUGEPAGE), and touched (zeroed)
// before any timing: first touch of a page costs far more than the kernels do.
struct FreeDeleter {
  void operator()(void* p) const noexcept;
};
using Buffer = std::unique_ptr<std::byte, FreeDeleter>;

// bytes rounded up to 2 MiB; throws std::bad_alloc.
Buffer allocate(std::size_t bytes);

// A copy with non-temporal stores (16 bytes at a time, aligned head).
// Out of cache it is the fastest plain copy on the 2-core Zen 3 machine.
void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes);

// ---- results -----------------------------------------------------------------
struct Result {
  double items_per_s = 0;
  double bytes_per_s = 0;
  double cv = -1;  // coefficient of variation of the rate over repetitions; -1 if unknown
};

// Shows the medians on the console and keeps them (and the spread) for a
// table, keyed by (benchmark name, threads). With --benchmark_repetitions=1
// the single run stands in for the median.
class Collector : public benchmark::ConsoleReporter {
 public:
  using ConsoleReporter::ConsoleReporter;
  void ReportRuns(const std::vector<Run>& runs) override;
  std::optional<Result> find(const std::string& name, int threads) const;

 private:
  std::map<std::pair<std::string, int>, Result> results_;
};

// A console reporter coloured when stdout is a terminal.
benchmark::ConsoleReporter::OutputOptions console_options();

// One target's tally for the summary.
struct Tally {
  int met = 0;
  std::vector<std::string> missed;
  void add(bool ok, std::string what);
  void print(const char* title) const;  // "title: MET (n/n met)" or NOT MET with the misses
};

bool has_avx512();

// The middle element of x (the upper of the two middle ones for an even count); x not empty.
double median(std::vector<double> x);

// The CPU as /proc/cpuinfo names it ("model name"), for a table's heading; "unknown CPU".
std::string cpu_model();

// benchmark::Initialize with argv[0], then the suite's defaults, then the
// caller's flags (argv[1..]) so that they override the defaults. Returns false
// (after Google Benchmark has printed why) when an argument is not recognised.
bool initialize(int argc, char** argv, const char* program, const std::vector<std::string>& defaults);

// Runs every registered benchmark into a Collector, hands it to report (the
// suite's ratio table), then clears the registry (its lambdas refer to the
// suite's cases and buffers) and shuts Google Benchmark down, so that the next
// suite in the same process starts clean.
template <class Report>
void run_registered(Report&& report) {
  Collector reporter(console_options());
  benchmark::RunSpecifiedBenchmarks(&reporter);
  report(static_cast<const Collector&>(reporter));
  benchmark::ClearRegisteredBenchmarks();
  benchmark::Shutdown();
}

// The defaults every suite uses: 9 repetitions, aggregates only, 0.1 s each,
// randomly interleaved so a kernel and its reference see the same machine weather.
std::vector<std::string> default_flags();

}  // namespace mixprec::bench
