// Format conversion benchmarks and their ratio table (docs/performance.md).
//
// Every conversion is timed next to a memcpy that moves the same number of
// bytes, and (in cache) next to the scalar reference, in the same run; the
// table reports ratios of medians, because absolute rates on shared machines
// drift from run to run while ratios measured side by side do not.
#include "formats_bench.hpp"

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "mixprec/formats/kernel_table.hpp"

namespace mixprec::bench {
namespace {

constexpr std::size_t kOutOfCache = std::size_t{64} << 20;  // 64 Mi elements
constexpr std::size_t kInCache = std::size_t{8} << 10;      // 8 Ki elements
constexpr std::size_t kSizes[] = {kOutOfCache, kInCache};
constexpr int kThreadCounts[] = {1, 2};

constexpr double kCopyTarget = 0.90;      // f32<->f16/bf16 out of cache, vs copy
constexpr double kCountedTarget = 0.85;   // counting pass out of cache, vs copy
constexpr double kInCacheTarget = 20e9;   // elements/s, f32<->f16/bf16, AVX-512 machines
constexpr double kScalarTarget = 5.0;     // SIMD / scalar reference

enum class Op { memcpy, stream, encode, decode, counted, round, encode_decode };
enum class Fmt { f16, bf16, e4m3, e5m2 };
constexpr Fmt kFormats[] = {Fmt::f16, Fmt::bf16, Fmt::e4m3, Fmt::e5m2};
constexpr Op kConversions[] = {Op::encode, Op::decode, Op::counted};

const char* op_name(Op op) {
  switch (op) {
    case Op::memcpy: return "memcpy";
    case Op::stream: return "stream";
    case Op::encode: return "encode";
    case Op::decode: return "decode";
    case Op::counted: return "counted";
    case Op::round: return "round";
    case Op::encode_decode: return "enc+dec";
  }
  return "?";
}
const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::f16: return "f16";
    case Fmt::bf16: return "bf16";
    case Fmt::e4m3: return "e4m3";
    case Fmt::e5m2: return "e5m2";
  }
  return "?";
}
std::size_t width(Fmt f) { return f == Fmt::f16 || f == Fmt::bf16 ? 2 : 1; }
bool is_16bit(Fmt f) { return width(f) == 2; }
const char* size_name(std::size_t n) { return n == kOutOfCache ? "64Mi" : "8Ki"; }

const FormatKernels& kernels_of(const KernelTable& t, Fmt f) {
  switch (f) {
    case Fmt::f16: return t.f16;
    case Fmt::bf16: return t.bf16;
    case Fmt::e4m3: return t.f8e4m3;
    case Fmt::e5m2: return t.f8e5m2;
  }
  return t.f16;
}

// ---- buffers: allocated and touched once, shared by every case ---------------
//
// First touch of a page costs ~10 us, far more than converting it, so nothing
// is allocated inside a timed loop (bench_common's allocate()). Huge pages keep
// TLB misses out of both the copy and the conversions alike.
struct Buffers {
  Buffer f32_in;        // kOutOfCache floats, standard normal: encode input, copy source
  Buffer f32_out;       // kOutOfCache floats: decode output, copy destination
  Buffer low[4];        // per format: its encoding of f32_in (decode input, encode output)

  float* in() const { return reinterpret_cast<float*>(f32_in.get()); }
  float* out() const { return reinterpret_cast<float*>(f32_out.get()); }
  std::byte* low_of(Fmt f) const { return low[static_cast<int>(f)].get(); }
};

Buffers make_buffers(const KernelTable& fast) {
  Buffers b;
  b.f32_in = allocate(kOutOfCache * sizeof(float));
  b.f32_out = allocate(kOutOfCache * sizeof(float));
  // Typical tensor values. A 1 Mi block tiled over the buffer: out of cache
  // the kernels do not care about repeats, and in cache only the start is used.
  constexpr std::size_t kBlock = std::size_t{1} << 20;
  std::mt19937 rng(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float* in = b.in();
  for (std::size_t i = 0; i < kBlock; ++i) in[i] = normal(rng);
  for (std::size_t i = kBlock; i < kOutOfCache; i += kBlock) std::memcpy(in + i, in, kBlock * sizeof(float));
  // Decode reads real codes of its own format; encoding the same input again
  // in the encode cases writes the same bytes, so they can share the buffer.
  for (Fmt f : kFormats) {
    b.low[static_cast<int>(f)] = allocate(kOutOfCache * width(f));
    kernels_of(fast, f).encode(in, b.low_of(f), kOutOfCache, ConvertOptions{});
  }
  return b;
}

// ---- cases ---------------------------------------------------------------------
struct Case {
  Op op;
  Fmt fmt;                      // copy: the format whose byte volume it matches
  const KernelTable* table;     // nullptr for the copy
  std::size_t n;                // elements, all threads together
  std::size_t bytes_per_elem;   // read + written by the conversion (4 + width)
  std::string name;
};

bool is_copy(Op op) { return op == Op::memcpy || op == Op::stream; }

std::string copy_name(Op op, std::size_t bytes_per_elem, std::size_t n) {
  // (4 + w) / 2 bytes copied per element: "3B" for 16-bit formats, "2.5B" for 8-bit.
  return fmt::format("copy/{}/{}B/{}", op_name(op),
                     bytes_per_elem % 2 == 0 ? std::to_string(bytes_per_elem / 2) : "2.5", size_name(n));
}

// stream_copy (bench_common): out of cache the fastest plain copy here; glibc's
// memcpy does not scale to two threads on this machine, which would flatter
// the conversions.
std::string case_name(Op op, Fmt f, const KernelTable& t, std::size_t n) {
  return fmt::format("{}/{}/{}/{}", op_name(op), fmt_name(f), isa_name(t.isa), size_name(n));
}

// Each thread converts its own half of the shared buffers; Google Benchmark sums
// items and bytes over threads and divides by the (real) time, giving the
// aggregate rate.
void run_case(benchmark::State& state, const Case& c, const Buffers& b) {
  const auto threads = static_cast<std::size_t>(state.threads());
  const std::size_t per = c.n / threads;
  const std::size_t lo = per * static_cast<std::size_t>(state.thread_index());
  const ConvertOptions opts{};
  const std::size_t w = width(c.fmt);
  switch (c.op) {
    case Op::memcpy:
    case Op::stream: {
      const std::size_t bytes = per * c.bytes_per_elem / 2;  // per is even: 2.5 B/elem is exact
      const std::byte* src = b.f32_in.get() + lo * c.bytes_per_elem / 2;
      std::byte* dst = b.f32_out.get() + lo * c.bytes_per_elem / 2;
      for (auto _ : state) {
        if (c.op == Op::memcpy) std::memcpy(dst, src, bytes);
        else stream_copy(dst, src, bytes);
        benchmark::ClobberMemory();
      }
      break;
    }
    case Op::encode: {
      const auto& k = kernels_of(*c.table, c.fmt);
      for (auto _ : state) {
        k.encode(b.in() + lo, b.low_of(c.fmt) + lo * w, per, opts);
        benchmark::ClobberMemory();
      }
      break;
    }
    case Op::counted: {
      const auto& k = kernels_of(*c.table, c.fmt);
      for (auto _ : state) {
        ConversionStats st = k.encode_counted(b.in() + lo, b.low_of(c.fmt) + lo * w, per, opts);
        benchmark::DoNotOptimize(st);
        benchmark::ClobberMemory();
      }
      break;
    }
    case Op::decode: {
      const auto& k = kernels_of(*c.table, c.fmt);
      for (auto _ : state) {
        k.decode(b.low_of(c.fmt) + lo * w, b.out() + lo, per, opts);
        benchmark::ClobberMemory();
      }
      break;
    }
    // Store and round over b.out() (v is overwritten; after the first pass it holds
    // rounded values, which the kernel handles at the same speed), against the
    // engine's former two passes over the same buffers.
    case Op::round: {
      const auto& k = kernels_of(*c.table, c.fmt);
      for (auto _ : state) {
        k.encode_round(b.out() + lo, b.low_of(c.fmt) + lo * w, per, opts);
        benchmark::ClobberMemory();
      }
      break;
    }
    case Op::encode_decode: {
      const auto& k = kernels_of(*c.table, c.fmt);
      for (auto _ : state) {
        k.encode(b.out() + lo, b.low_of(c.fmt) + lo * w, per, opts);
        k.decode(b.low_of(c.fmt) + lo * w, b.out() + lo, per, opts);
        benchmark::ClobberMemory();
      }
      break;
    }
  }
  const auto items = static_cast<std::int64_t>(per) * static_cast<std::int64_t>(state.iterations());
  state.SetItemsProcessed(items);
  state.SetBytesProcessed(items * static_cast<std::int64_t>(c.bytes_per_elem));
}

// The copy rate for a byte volume: the faster of memcpy and the streaming copy.
struct CopyRef {
  Result result;
  Op op;
};
std::optional<CopyRef> copy_ref(const Collector& col, std::size_t bytes_per_elem, std::size_t n, int threads) {
  std::optional<CopyRef> best;
  for (Op op : {Op::memcpy, Op::stream}) {
    const auto r = col.find(copy_name(op, bytes_per_elem, n), threads);
    if (r && (!best || r->bytes_per_s > best->result.bytes_per_s)) best = CopyRef{*r, op};
  }
  return best;
}

void print_copies(const Collector& col) {
  fmt::print("\nCopy reference (GB/s counts bytes read + written; the faster one is used):\n");
  fmt::print("{:<7} {:>5} {:>3} {:>8} {:>5} {:>8} {:>5}\n", "bytes", "size", "thr", "memcpy", "cv%", "stream", "cv%");
  for (std::size_t bpe : {std::size_t{6}, std::size_t{5}}) {
    for (std::size_t n : kSizes) {
      for (int t : kThreadCounts) {
        std::string cells;
        for (Op op : {Op::memcpy, Op::stream}) {
          const auto r = col.find(copy_name(op, bpe, n), t);
          cells += r ? fmt::format(" {:>8.1f} {:>5}", r->bytes_per_s / 1e9,
                                   r->cv >= 0 ? fmt::format("{:.1f}", r->cv * 100) : "-")
                     : fmt::format(" {:>8} {:>5}", "-", "-");
        }
        fmt::print("{:<7} {:>5} {:>3}{}\n", bpe == 6 ? "3B/el" : "2.5B/el", size_name(n), t, cells);
      }
    }
  }
}

void print_table(const Collector& col, const std::vector<Case>& cases, const KernelTable& fast,
                 const KernelTable* scalar) {
  const bool avx512 = has_avx512();
  const bool compare_scalar = scalar != nullptr && scalar != &fast;
  Tally copy_tally, counted_tally, scalar_tally;
  // Slowest and fastest in-cache single-thread f32<->f16/bf16 rate (the 20 G elem/s target).
  double in_cache_min = 0, in_cache_max = 0;

  fmt::print("\nmixprec bench formats: ratios of medians from this run\n");
  fmt::print("SIMD path: {}; AVX-512: {}. GB/s = bytes read + written by the conversion;\n",
             isa_name(fast.isa), avx512 ? "yes" : "no");
  fmt::print("copy GB/s = the faster copy (mc: memcpy, st: streaming) of the same total bytes,\n");
  fmt::print("same size and threads; cv% = spread of the conversion's rate over the repetitions.\n");
  print_copies(col);
  fmt::print("\n{:<22} {:>5} {:>3} {:>8} {:>7} {:>10} {:>7} {:>9} {:>5}  {}\n", "conversion", "size", "thr",
             "Gelem/s", "GB/s", "copy GB/s", "vs copy", "vs scalar", "cv%", "target");

  for (const Case& c : cases) {
    if (is_copy(c.op) || c.op == Op::round || c.op == Op::encode_decode) continue;
    if (c.table != &fast && c.table != scalar) continue;  // AVX2 beside AVX-512: its own table below
    const bool is_scalar_row = compare_scalar && c.table == scalar;
    for (int t : kThreadCounts) {
      const auto r = col.find(c.name, t);
      if (!r) continue;
      const auto copy = copy_ref(col, c.bytes_per_elem, c.n, t);
      const double vs_copy = copy ? r->bytes_per_s / copy->result.bytes_per_s : 0;
      std::string vs_scalar = "-";
      std::string target;
      const std::string label = fmt::format("{} {} {}/{}", op_name(c.op), fmt_name(c.fmt), size_name(c.n), t);

      if (!is_scalar_row && c.n == kOutOfCache && copy) {
        if (c.op == Op::counted) {
          const bool ok = vs_copy >= kCountedTarget;
          counted_tally.add(ok, fmt::format("{} at {:.3f} of copy", label, vs_copy));
          target = fmt::format(">= {:.2f} copy: {}", kCountedTarget, ok ? "met" : "NOT MET");
        } else if (is_16bit(c.fmt)) {
          const bool ok = vs_copy >= kCopyTarget;
          copy_tally.add(ok, fmt::format("{} at {:.3f} of copy", label, vs_copy));
          target = fmt::format(">= {:.2f} copy: {}", kCopyTarget, ok ? "met" : "NOT MET");
        }
      }
      if (!is_scalar_row && c.n == kInCache && t == 1) {
        if (compare_scalar) {
          const Case* ref = nullptr;
          for (const Case& s : cases) {
            if (s.table == scalar && s.op == c.op && s.fmt == c.fmt && s.n == c.n) ref = &s;
          }
          const auto rs = ref ? col.find(ref->name, 1) : std::nullopt;
          if (rs) {
            const double x = r->items_per_s / rs->items_per_s;
            vs_scalar = fmt::format("{:.2f}x", x);
            scalar_tally.add(x >= kScalarTarget, fmt::format("{} at {:.2f}x", label, x));
            target = fmt::format(">= {:.0f}x scalar: {}", kScalarTarget, x >= kScalarTarget ? "met" : "NOT MET");
          }
        }
        if (is_16bit(c.fmt) && c.op != Op::counted) {
          in_cache_min = in_cache_min == 0 ? r->items_per_s : std::min(in_cache_min, r->items_per_s);
          in_cache_max = std::max(in_cache_max, r->items_per_s);
        }
      }
      const std::string cv = r->cv >= 0 ? fmt::format("{:.1f}", r->cv * 100) : "-";
      fmt::print("{:<22} {:>5} {:>3} {:>8.2f} {:>7.1f} {:>10} {:>7} {:>9} {:>5}  {}\n",
                 fmt::format("{} {} {}", op_name(c.op), fmt_name(c.fmt), isa_name(c.table->isa)),
                 size_name(c.n), t, r->items_per_s / 1e9, r->bytes_per_s / 1e9,
                 copy ? fmt::format("{:.1f} {}", copy->result.bytes_per_s / 1e9,
                                    copy->op == Op::memcpy ? "mc" : "st")
                      : "-",
                 copy ? fmt::format("{:.3f}", vs_copy) : "-", vs_scalar, cv, target);
    }
  }

  fmt::print("\nStore and round (encode_round) vs encode then decode, same buffers (speedup = time of the two\n"
             "passes / time of the fused one):\n");
  fmt::print("{:<6} {:>5} {:>3} {:>12} {:>12} {:>8}\n", "format", "size", "thr", "round el/ns", "enc+dec el/ns",
             "speedup");
  for (const Case& c : cases) {
    if (c.op != Op::round || c.table != &fast) continue;
    for (int t : kThreadCounts) {
      const auto r = col.find(c.name, t);
      const auto sep = col.find(case_name(Op::encode_decode, c.fmt, *c.table, c.n), t);
      if (!r || !sep) continue;
      fmt::print("{:<6} {:>5} {:>3} {:>12.2f} {:>12.2f} {:>7.2f}x\n", fmt_name(c.fmt), size_name(c.n), t,
                 r->items_per_s / 1e9, sep->items_per_s / 1e9, r->items_per_s / sep->items_per_s);
    }
  }

  // The AVX-512 back end's own kernels (the 16-bit encodes) against AVX2's, same run.
  bool header = false;
  for (const Case& c : cases) {
    if (c.table == &fast || c.table == scalar || is_copy(c.op)) continue;
    const Case* mine = nullptr;
    for (const Case& m : cases) {
      if (m.table == &fast && m.op == c.op && m.fmt == c.fmt && m.n == c.n) mine = &m;
    }
    if (mine == nullptr) continue;
    for (int t : kThreadCounts) {
      const auto a = col.find(mine->name, t);
      const auto b = col.find(c.name, t);
      if (!a || !b) continue;
      if (!header) {
        fmt::print("\n{} vs {} on the kernels {} replaces (same run; speedup = {} el/ns / {} el/ns):\n",
                   isa_name(fast.isa), isa_name(c.table->isa), isa_name(fast.isa), isa_name(fast.isa),
                   isa_name(c.table->isa));
        fmt::print("{:<14} {:>5} {:>3} {:>12} {:>12} {:>8}\n", "conversion", "size", "thr", isa_name(fast.isa),
                   isa_name(c.table->isa), "speedup");
        header = true;
      }
      fmt::print("{:<14} {:>5} {:>3} {:>12.2f} {:>12.2f} {:>7.2f}x\n",
                 fmt::format("{} {}", op_name(c.op), fmt_name(c.fmt)), size_name(c.n), t, a->items_per_s / 1e9,
                 b->items_per_s / 1e9, a->items_per_s / b->items_per_s);
    }
  }

  fmt::print("\nTargets (issue), judged on the medians above:\n");
  copy_tally.print("out of cache, f32<->f16 and f32<->bf16 >= 90% of copy");
  counted_tally.print("out of cache, counting pass >= 85% of copy");
  const char* in_cache_title = "in cache, f32<->f16 and f32<->bf16 >= 20 G elem/s (AVX-512 machines)";
  if (in_cache_max <= 0) {
    fmt::print("  {}: not measured in this run\n", in_cache_title);
  } else {
    const bool ok = in_cache_min >= kInCacheTarget;
    fmt::print("  {}: {} (here {:.2f} to {:.2f} G elem/s, 1 thread)\n", in_cache_title,
               ok ? "MET" : (avx512 ? "NOT MET" : "n/a: no AVX-512"), in_cache_min / 1e9, in_cache_max / 1e9);
  }
  if (compare_scalar) {
    scalar_tally.print("SIMD >= 5x scalar reference (in cache, 1 thread)");
  } else {
    fmt::print("  SIMD >= 5x scalar reference: n/a: no SIMD back end on this CPU\n");
  }
}

}  // namespace

int run_formats(int argc, char** argv) {
  const KernelTable* scalar = kernel_table(Isa::scalar);
  const KernelTable* fast = kernel_table(best_isa());
  if (fast == nullptr) fast = scalar;

  // The suite's defaults come first so that the caller's flags override them.
  // Random interleaving spreads each case's repetitions over the whole run, so
  // a conversion and its copy see the same machine weather.
  if (!initialize(argc, argv, "bench_formats", default_flags())) return 1;

  std::vector<Case> cases;
  for (std::size_t n : kSizes) {
    for (std::size_t bpe : {std::size_t{6}, std::size_t{5}}) {
      const Fmt f = bpe == 6 ? Fmt::f16 : Fmt::e4m3;
      cases.push_back({Op::memcpy, f, nullptr, n, bpe, copy_name(Op::memcpy, bpe, n)});
      // In cache, non-temporal stores only lose (they go to memory).
      if (n == kOutOfCache) cases.push_back({Op::stream, f, nullptr, n, bpe, copy_name(Op::stream, bpe, n)});
    }
  }
  // Table order: conversion, format, then size; the scalar reference only in
  // cache and on one thread (it runs ~5 ns/element, too slow out of cache).
  for (Op op : kConversions) {
    for (Fmt f : kFormats) {
      for (std::size_t n : kSizes) cases.push_back({op, f, fast, n, 4 + width(f), case_name(op, f, *fast, n)});
      if (scalar != fast) {
        cases.push_back({op, f, scalar, kInCache, 4 + width(f), case_name(op, f, *scalar, kInCache)});
      }
    }
  }

  // Store and round and its two-pass equivalent: the 16-bit formats the engine stores.
  for (Op op : {Op::round, Op::encode_decode}) {
    for (Fmt f : {Fmt::f16, Fmt::bf16}) {
      for (std::size_t n : kSizes) cases.push_back({op, f, fast, n, 8 + width(f), case_name(op, f, *fast, n)});
    }
  }

  // Where the best back end is AVX-512, AVX2's 16-bit encodes run beside it (the kernels
  // AVX-512 replaces), so the table shows what it gained in the same run.
  const KernelTable* avx2 = kernel_table(Isa::avx2);
  if (fast->isa == Isa::avx512 && avx2 != nullptr) {
    for (Op op : {Op::encode, Op::counted, Op::round}) {
      for (Fmt f : {Fmt::f16, Fmt::bf16}) {
        for (std::size_t n : kSizes) {
          cases.push_back({op, f, avx2, n, (op == Op::round ? 8 : 4) + width(f), case_name(op, f, *avx2, n)});
        }
      }
    }
  }

  const Buffers buffers = make_buffers(*fast);
  for (const Case& c : cases) {
    auto* b = benchmark::RegisterBenchmark(c.name.c_str(), [&c, &buffers](benchmark::State& s) {
      run_case(s, c, buffers);
    });
    b->UseRealTime();
    const bool scalar_case = c.table == scalar && scalar != fast;
    if (scalar_case) {
      b->Threads(1);
    } else {
      for (int t : kThreadCounts) b->Threads(t);
    }
  }

  run_registered([&](const Collector& results) { print_table(results, cases, *fast, scalar); });
  return 0;
}

}  // namespace mixprec::bench
