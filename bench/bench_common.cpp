#include "bench_common.hpp"

#include <fmt/core.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <new>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace mixprec::bench {

void FreeDeleter::operator()(void* p) const noexcept { std::free(p); }

Buffer allocate(std::size_t bytes) {
  constexpr std::size_t kAlign = std::size_t{2} << 20;
  bytes = (bytes + kAlign - 1) / kAlign * kAlign;
  if (bytes == 0) bytes = kAlign;
  void* p = std::aligned_alloc(kAlign, bytes);
  if (p == nullptr) throw std::bad_alloc();
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // advisory; 4 KiB pages work too
  std::memset(p, 0, bytes);
  return Buffer(static_cast<std::byte*>(p));
}

// glibc's memcpy does not scale to two threads on this machine (measured
// ~22 GB/s with two threads against ~32 GB/s for this loop): it skips the
// read-for-ownership of the destination.
void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
#if defined(__x86_64__)
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  std::size_t i = head;
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
  _mm_sfence();
  std::memcpy(dst + i, src + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

namespace {
double counter(const benchmark::BenchmarkReporter::Run& r, const char* name) {
  const auto it = r.counters.find(name);
  return it == r.counters.end() ? 0.0 : it->second.value;
}
}  // namespace

void Collector::ReportRuns(const std::vector<Run>& runs) {
  std::vector<Run> shown;
  for (const Run& r : runs) {
    if (r.error_occurred) continue;
    const bool median = r.run_type == Run::RT_Aggregate && r.aggregate_name == "median";
    const bool single = r.run_type == Run::RT_Iteration && r.repetitions <= 1;
    Result& res = results_[{r.run_name.function_name, static_cast<int>(r.threads)}];
    if (median || single) {
      res.items_per_s = counter(r, "items_per_second");
      res.bytes_per_s = counter(r, "bytes_per_second");
      shown.push_back(r);
    } else if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "cv") {
      res.cv = counter(r, "items_per_second");
    }
  }
  if (!shown.empty()) ConsoleReporter::ReportRuns(shown);
}

std::optional<Result> Collector::find(const std::string& name, int threads) const {
  const auto it = results_.find({name, threads});
  if (it == results_.end() || it->second.items_per_s <= 0) return std::nullopt;
  return it->second;
}

benchmark::ConsoleReporter::OutputOptions console_options() {
  return isatty(STDOUT_FILENO) ? benchmark::ConsoleReporter::OO_Color : benchmark::ConsoleReporter::OO_None;
}

void Tally::add(bool ok, std::string what) {
  if (ok) ++met;
  else missed.push_back(std::move(what));
}

void Tally::print(const char* title) const {
  const int total = met + static_cast<int>(missed.size());
  if (total == 0) {
    fmt::print("  {}: not measured in this run\n", title);
    return;
  }
  fmt::print("  {}: {} ({}/{} met)\n", title, missed.empty() ? "MET" : "NOT MET", met, total);
  for (const auto& m : missed) fmt::print("      not met: {}\n", m);
}

bool has_avx512() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
  }
  return "unknown CPU";
}

std::vector<std::string> default_flags() {
  return {
      "--benchmark_repetitions=9",
      "--benchmark_report_aggregates_only=true",
      "--benchmark_min_time=0.1",
      "--benchmark_enable_random_interleaving=true",
  };
}

bool initialize(int argc, char** argv, const char* program, const std::vector<std::string>& defaults) {
  // Google Benchmark keeps argv[0] (the executable name in reports): it must outlive the run.
  static std::deque<std::string> program_names;
  program_names.emplace_back(argc > 0 ? argv[0] : program);
  std::vector<std::string> storage = {program_names.back()};
  storage.insert(storage.end(), defaults.begin(), defaults.end());
  for (int i = 1; i < argc; ++i) storage.emplace_back(argv[i]);
  std::vector<char*> args;
  for (auto& s : storage) args.push_back(s.data());
  args[0] = program_names.back().data();
  int n_args = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&n_args, args.data());
  return !benchmark::ReportUnrecognizedArguments(n_args, args.data());
}

}  // namespace mixprec::bench
