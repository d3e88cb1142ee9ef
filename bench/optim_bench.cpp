// Fused optimizer step benchmarks and their ratio table (docs/performance.md).
//
// Adam over P = 16 Mi parameters: f16 gradients, fp32 master weights and moments,
// f16 model copy. The bytes the fused step must move per parameter: read grad 2,
// master 4, m 4, v 4; write master 4, m 4, v 4, model copy 2 = 28 bytes.
// Timed in the same run next to
//   copy:    the faster of memcpy and a streaming copy of 14P bytes (28P moved);
//   unfused: the sequence a framework runs (unscale into an fp32 buffer, update,
//            refresh the model copy), each pass with the same back end and threads.
// The table reports ratios of medians.
#include "optim_bench.hpp"

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "mixprec/core/isa.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/optim/optimizer.hpp"

namespace mixprec::bench {
namespace {

constexpr std::size_t kParams = std::size_t{16} << 20;
constexpr std::size_t kBytesPerParam = 28;
constexpr int kThreadCounts[] = {1, 2};
constexpr double kBandwidthTarget = 0.80;  // fused bytes/s vs copy bytes/s
constexpr double kSpeedupTarget = 1.5;     // unfused time / fused time

enum class Op { memcpy, stream, fused, unfused };
const char* op_name(Op op) {
  switch (op) {
    case Op::memcpy: return "memcpy";
    case Op::stream: return "stream_copy";
    case Op::fused: return "adam_fused";
    case Op::unfused: return "adam_unfused";
  }
  return "?";
}

struct Case {
  Op op;
  int threads;
  std::string name;
};

std::string case_name(Op op, int threads) {
  return fmt::format("optim/{}/f16grad_f32master_f16model/{}Mi/t{}", op_name(op), kParams >> 20, threads);
}

struct State {
  ParamStore store{{{"w", {kParams}}}, {.model = DType::f16, .grads = DType::f16, .master = true, .state_slots = 2}};
  std::unique_ptr<Adam> fused, unfused;
  std::vector<float> scratch;
  Buffer copy_src, copy_dst;
  ThreadPool pool1{1}, pool2{2};
  ThreadPool& pool(int t) { return t == 1 ? pool1 : pool2; }

  State() {
    float* m = store.master_data();
    auto* g = static_cast<f16*>(store.grad_data());
    std::uint32_t x = 12345;
    for (std::size_t i = 0; i < kParams; ++i) {
      x = x * 1664525u + 1013904223u;
      const float u = static_cast<float>(static_cast<std::int32_t>(x)) * 0x1p-31f;
      m[i] = u;
      g[i] = f16(u * 1024.0f * 0x1p-6f);  // scaled by 2^10
    }
    store.refresh_model();
    fused = std::make_unique<Adam>(store, AdamConfig{.lr = 1e-4});
    unfused = std::make_unique<Adam>(store, AdamConfig{.lr = 1e-4});
    scratch.assign(unfused->unfused_scratch_size(), 0.0f);
    copy_src = allocate(kParams * kBytesPerParam / 2);
    copy_dst = allocate(kParams * kBytesPerParam / 2);
  }
};

void run_case(benchmark::State& st, const Case& c, State& s) {
  ThreadPool& pool = s.pool(c.threads);
  const std::size_t half = kParams * kBytesPerParam / 2;
  const StepControls ctl{.inv_scale = 1.0f / 1024};
  switch (c.op) {
    case Op::memcpy:
    case Op::stream:
      for (auto _ : st) {
        pool.parallel_for(half, 4096, 0, [&](std::size_t b, std::size_t e, unsigned) {
          if (c.op == Op::memcpy) std::memcpy(s.copy_dst.get() + b, s.copy_src.get() + b, e - b);
          else stream_copy(s.copy_dst.get() + b, s.copy_src.get() + b, e - b);
        });
        benchmark::ClobberMemory();
      }
      break;
    case Op::fused:
      for (auto _ : st) {
        s.fused->step(ctl, &pool);
        benchmark::ClobberMemory();
      }
      break;
    case Op::unfused:
      for (auto _ : st) {
        s.unfused->step_unfused(ctl, s.scratch, std::nullopt, &pool);
        benchmark::ClobberMemory();
      }
      break;
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(kParams) * st.iterations());
  st.SetBytesProcessed(static_cast<std::int64_t>(kParams * kBytesPerParam) * st.iterations());
}

void print_table(const Collector& col) {
  Tally bw, speed;
  fmt::print("\nmixprec bench optim: ratios of medians from this run\n");
  fmt::print("Adam over {} Mi parameters: f16 grads, fp32 master + moments, f16 model copy; back end {}.\n",
             kParams >> 20, isa_name(active_isa()));
  fmt::print("GB/s = the {} bytes per parameter the fused step must move (for every case, so rates compare as times);\n",
             kBytesPerParam);
  fmt::print("copy = the faster of memcpy and a streaming copy moving the same bytes; speedup = unfused time / fused time.\n\n");
  fmt::print("{:>3} {:>10} {:>5} {:>10} {:>5} {:>12} {:>5} {:>9} {:>8} {:>8}\n", "thr", "copy GB/s", "cv%", "fused GB/s",
             "cv%", "unfused GB/s", "cv%", "vs copy", "speedup", "Gparam/s");
  for (int t : kThreadCounts) {
    const auto mc = col.find(case_name(Op::memcpy, t), 1), sc = col.find(case_name(Op::stream, t), 1);
    const auto f = col.find(case_name(Op::fused, t), 1), u = col.find(case_name(Op::unfused, t), 1);
    if (!f || !u || (!mc && !sc)) continue;
    const Result copy = (!sc || (mc && mc->bytes_per_s > sc->bytes_per_s)) ? *mc : *sc;
    const double vs = f->bytes_per_s / copy.bytes_per_s, sp = f->bytes_per_s / u->bytes_per_s;
    auto cv = [](const Result& r) { return r.cv >= 0 ? fmt::format("{:.1f}", r.cv * 100) : std::string("-"); };
    fmt::print("{:>3} {:>10.1f} {:>5} {:>10.1f} {:>5} {:>12.1f} {:>5} {:>9.3f} {:>8.2f} {:>8.3f}\n", t,
               copy.bytes_per_s / 1e9, cv(copy), f->bytes_per_s / 1e9, cv(*f), u->bytes_per_s / 1e9, cv(*u), vs, sp,
               f->items_per_s / 1e9);
    bw.add(vs >= kBandwidthTarget, fmt::format("t{} fused at {:.3f} of copy", t, vs));
    speed.add(sp >= kSpeedupTarget, fmt::format("t{} speedup {:.2f}x", t, sp));
  }
  fmt::print("\nTargets (issue), judged on the medians above:\n");
  bw.print("fused Adam step >= 80% of the copy bandwidth for the same bytes (1 and 2 threads)");
  speed.print("fused Adam step >= 1.5x the unfused sequence (1 and 2 threads)");
}

}  // namespace

int run_optim(int argc, char** argv) {
  if (!initialize(argc, argv, "bench_optim", default_flags())) return 1;
  std::vector<Case> cases;
  for (Op op : {Op::memcpy, Op::stream, Op::fused, Op::unfused})
    for (int t : kThreadCounts) cases.push_back({op, t, case_name(op, t)});
  auto state = std::make_unique<State>();
  for (const Case& c : cases) {
    auto* b = benchmark::RegisterBenchmark(c.name.c_str(), [&c, &state](benchmark::State& s) { run_case(s, c, *state); });
    b->UseRealTime();
    b->Unit(benchmark::kMillisecond);
  }
  run_registered([&](const Collector& results) { print_table(results); });
  return 0;
}

}  // namespace mixprec::bench
