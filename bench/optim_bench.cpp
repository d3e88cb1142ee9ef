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
//
// Then the state formats (optim/state_format.hpp): adam_tensor_step over one tensor of
// 16 Mi parameters, bf16 weights and gradients, one thread, for a list of master / m / v
// formats, each against a copy of the bytes that combination must move, in paired rounds
// (every case and its copies once per round, the order rotated; medians over rounds).
// `--state-formats-only` runs only this table, `--no-state-formats` skips it.
#include "optim_bench.hpp"

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "mixprec/core/isa.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/state_format.hpp"

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

// ---- state formats: adam_tensor_step over one tensor ------------------------------------------

constexpr std::size_t kFormatParams = std::size_t{16} << 20;  // out of cache
// A round takes ~2 s on one thread (the 8bit step alone ~0.7 s): with the set-up, ~20 s in all.
constexpr int kFormatRounds = 5;

struct FormatCase {
  const char* name;  // master/m/v
  StateFormats formats;
  bool stochastic = false;  // master none: stochastic rounding of the bf16 weights
};

constexpr MasterFormat kFp32M = MasterFormat::fp32, kRem = MasterFormat::remainder, kNone = MasterFormat::none;
const FormatCase kFormatCases[] = {
    {"fp32/fp32/fp32", {kFp32M, MomentFormat::fp32, MomentFormat::fp32}},
    {"remainder/fp32/fp32", {kRem, MomentFormat::fp32, MomentFormat::fp32}},
    {"remainder/bf16/bf16", {kRem, MomentFormat::bf16, MomentFormat::bf16}},
    {"remainder/fp16/fp16", {kRem, MomentFormat::fp16, MomentFormat::fp16}},
    {"remainder/fp8/fp8", {kRem, MomentFormat::fp8, MomentFormat::fp8}},
    {"remainder/8bit/8bit", {kRem, MomentFormat::q8, MomentFormat::q8}},
    {"remainder/4bit/4bit", {kRem, MomentFormat::q4, MomentFormat::q4}},
    {"none/bf16/bf16 SR", {kNone, MomentFormat::bf16, MomentFormat::bf16}, true},
    {"fp32/fp8/fp8 per tensor", {kFp32M, MomentFormat::fp8, MomentFormat::fp8, 0, true}},
};

// One moment's storage, shared by the cases whose layout is the same.
struct MomentBuffers {
  Buffer codes, scales;
  MomentView view;
  MomentBuffers(const MomentLayout& l, const float* init) {
    view.layout = l;
    codes = allocate(l.code_bytes());
    scales = allocate(4 * std::max<std::size_t>(1, l.scale_count()));
    view.codes = codes.get();
    view.scales = reinterpret_cast<float*>(scales.get());
    quantize_moment(init, view);
  }
};

// Codes and scales, read and written once a step.
double moment_traffic(const MomentLayout& l) { return 2.0 * static_cast<double>(l.code_bytes() + 4 * l.scale_count()); }

// One case: views of the set's buffers, its step counter and the bytes it must move.
struct FormatTensor {
  const FormatCase* c = nullptr;
  AdamTensor t;
  AdamStepArgs args;
  double bytes = 0;  // what the step must read and write

  // Per-tensor scales (TE: fp16, fp8 per tensor) need the new absmax before any code is written.
  int passes() const { return t.m.layout.per_tensor || t.v.layout.per_tensor ? 2 : 1; }

  void step(ThreadPool* pool = nullptr) {
    adam_tensor_step(t, args, active_isa(), nullptr, pool);
    ++args.step;
  }
};

// Every buffer allocated (and touched) once. Cases with the same master share its weights and
// master (or remainders), cases with the same moment layout share the moment: fresh pages are
// slow to fault in on the VMs, and the codecs' cost does not depend on whose steps the values
// came from.
struct FormatSet {
  static constexpr std::size_t kCopyBytes = kFormatParams * 14;  // half the most a case moves (28 B)
  Buffer grad, copy_src, copy_dst;
  Buffer master_weights, master, rem_weights, remainder, none_weights;
  std::vector<std::unique_ptr<MomentBuffers>> moments;
  std::vector<FormatTensor> tensors;

  FormatSet() {
    const std::size_t n = kFormatParams;
    grad = allocate(2 * n);
    copy_src = allocate(kCopyBytes);
    copy_dst = allocate(kCopyBytes);
    // The starting values live in the copy source: the copies only read it.
    auto* w0 = reinterpret_cast<float*>(copy_src.get());
    float* m0 = w0 + n;
    float* v0 = m0 + n;
    auto* g = reinterpret_cast<std::uint16_t*>(grad.get());
    std::uint32_t x = 12345;
    for (std::size_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      const float u = static_cast<float>(static_cast<std::int32_t>(x)) * 0x1p-31f;
      x = x * 1664525u + 1013904223u;
      const float u2 = static_cast<float>(static_cast<std::int32_t>(x)) * 0x1p-31f;
      const float gi = u2 * 0x1p-6f;
      w0[i] = u * 0.05f;
      g[i] = bf16(gi * 1024.0f).bits();  // scaled by 2^10
      m0[i] = 0.5f * gi + 0.01f * u * 0x1p-6f;
      v0[i] = gi * gi + 1e-6f * u * u;
    }
    for (const FormatCase& c : kFormatCases) add(c, w0, m0, v0);
  }

  static std::uint16_t* bf16_weights(Buffer& b, const float* w0) {
    if (!b) {
      b = allocate(2 * kFormatParams);
      auto* w = reinterpret_cast<std::uint16_t*>(b.get());
      for (std::size_t i = 0; i < kFormatParams; ++i) w[i] = bf16(w0[i]).bits();
    }
    return reinterpret_cast<std::uint16_t*>(b.get());
  }

  MomentView moment(MomentFormat f, bool is_signed, const StateFormats& formats, const float* init) {
    const MomentLayout l = moment_layout(f, is_signed, kFormatParams, formats);
    for (const auto& mb : moments) {
      const MomentLayout& o = mb->view.layout;
      if (o.format == l.format && o.is_signed == l.is_signed && o.block == l.block && o.per_tensor == l.per_tensor)
        return mb->view;
    }
    moments.push_back(std::make_unique<MomentBuffers>(l, init));
    return moments.back()->view;
  }

  void add(const FormatCase& c, const float* w0, const float* m0, const float* v0) {
    const std::size_t n = kFormatParams;
    FormatTensor ft;
    ft.c = &c;
    AdamTensor& t = ft.t;
    t.n = n;
    t.grad_dtype = DType::bf16;
    t.grad = grad.get();
    t.weight_dtype = DType::bf16;
    t.master = c.formats.master;
    t.m = moment(c.formats.m, true, c.formats, m0);
    t.v = moment(c.formats.v, false, c.formats, v0);
    ft.bytes = 2.0 * n + moment_traffic(t.m.layout) + moment_traffic(t.v.layout);  // the gradient, read
    switch (c.formats.master) {
      case MasterFormat::fp32:
        t.weight = bf16_weights(master_weights, w0);
        if (!master) {
          master = allocate(4 * n);
          std::memcpy(master.get(), w0, 4 * n);
        }
        t.master_f32 = reinterpret_cast<float*>(master.get());
        ft.bytes += 8.0 * n + 2.0 * n;  // master read and written, weights written
        break;
      case MasterFormat::remainder:
        if (!remainder) {
          rem_weights = allocate(2 * n);
          remainder = allocate(2 * n);
          split_master(w0, reinterpret_cast<std::uint16_t*>(rem_weights.get()),
                       reinterpret_cast<std::int16_t*>(remainder.get()), n);
        }
        t.weight = rem_weights.get();
        t.remainder = reinterpret_cast<std::int16_t*>(remainder.get());
        ft.bytes += 4.0 * n + 4.0 * n;  // weights and remainders read and written
        break;
      case MasterFormat::none:
        t.weight = bf16_weights(none_weights, w0);
        ft.bytes += 4.0 * n;  // weights read and written
        break;
    }
    ft.args.hyper = AdamHyper{.lr = 1e-4};
    ft.args.inv_scale = 1.0f / 1024;
    ft.args.stochastic = c.stochastic;
    ft.args.seed = 7;
    validate(c.formats);
    validate(t, ft.args);
    tensors.push_back(ft);
  }
};

struct FormatResult {
  double step_s = 0, copy_s = 0, vs_copy = 0;
};

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  benchmark::ClobberMemory();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Paired rounds: per round every case's step, then a memcpy and a streaming copy of the bytes
// that step moves (half read, half written), the cases in an order rotated from round to round.
// vs copy = the faster copy's time / the step's time inside a round, the median over rounds.
std::vector<FormatResult> paired_formats(FormatSet& s, int rounds) {
  const std::size_t k = s.tensors.size();
  auto copy_pair = [&](const FormatTensor& ft, double* mem, double* stream) {
    const auto half = static_cast<std::size_t>(ft.bytes / 2);
    *mem = seconds([&] { std::memcpy(s.copy_dst.get(), s.copy_src.get(), half); });
    *stream = seconds([&] { stream_copy(s.copy_dst.get(), s.copy_src.get(), half); });
  };
  std::vector<std::vector<double>> step_t(k), copy_t(k), ratio(k);
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t i = (j + static_cast<std::size_t>(round)) % k;
      FormatTensor& ft = s.tensors[i];
      const double st = seconds([&] { ft.step(); });
      double mem, stream;
      copy_pair(ft, &mem, &stream);
      const double copy = std::min(mem, stream);
      step_t[i].push_back(st);
      copy_t[i].push_back(copy);
      ratio[i].push_back(copy / st);
    }
  }
  std::vector<FormatResult> r(k);
  for (std::size_t i = 0; i < k; ++i) r[i] = {median(step_t[i]), median(copy_t[i]), median(ratio[i])};
  return r;
}

// The step's arithmetic alone: the same case over its first kCacheParams parameters (about 0.4-0.9
// MB of state, inside L2), repeated; the median of 21 runs of 10 steps. The rate the step would
// reach if memory cost nothing: vs copy cannot exceed it times B/param over the copy's GB/s.
constexpr std::size_t kCacheParams = 32768;

double in_cache_seconds(const FormatTensor& ft) {
  FormatTensor c = ft;
  c.t.n = kCacheParams;
  c.t.m.layout = moment_layout(ft.c->formats.m, true, kCacheParams, ft.c->formats);
  c.t.v.layout = moment_layout(ft.c->formats.v, false, kCacheParams, ft.c->formats);
  c.step();  // the lines in cache
  std::vector<double> t;
  for (int r = 0; r < 21; ++r)
    t.push_back(seconds([&] {
                  for (int k = 0; k < 10; ++k) c.step();
                }) /
                10);
  return median(t);
}

// The step split over a pool of every core's thread (adam_tensor_step's pieces), out of cache:
// the median of 5 steps.
double pooled_seconds(FormatTensor& ft, ThreadPool& pool) {
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) t.push_back(seconds([&] { ft.step(&pool); }));
  return median(t);
}

void print_format_table(int rounds) {
  ThreadPool pool(std::max(1u, std::thread::hardware_concurrency()));
  auto set = std::make_unique<FormatSet>();
  const std::vector<FormatResult> r = paired_formats(*set, rounds);
  fmt::print("\nmixprec bench optim: state formats, adam_tensor_step over one tensor (optim/state_format.hpp)\n");
  fmt::print("{} Mi parameters, bf16 weights and gradients, torch's AdamW rule, 1 thread; CPU {}, back end {}.\n",
             kFormatParams >> 20, cpu_model(), isa_name(active_isa()));
  fmt::print("B/param = what the step must read and write: the gradient read; weights (written only under an fp32\n"
             "master), master or remainder, moment codes and scales read and written. GB/s = those bytes over the\n"
             "step's median time; copy = the faster of memcpy and a streaming copy moving the same bytes;\n"
             "vs copy = copy time / step time, the median over {} paired rounds. passes 2: per-tensor scales\n"
             "(TE) need the new absmax first, so the step reads its inputs twice (counted once in B/param).\n"
             "in L2 = the step over its first {} Ki parameters, in cache: the arithmetic's own rate; ceiling =\n"
             "that rate's bytes over the copy's, the most vs copy the arithmetic allows on this core.\n"
             "{}T Mparam/s = the step split over {} threads (the median of 5 steps; not paired).\n\n",
             rounds, kCacheParams >> 10, pool.size(), pool.size());
  fmt::print("{:<24} {:>7} {:>8} {:>7} {:>9} {:>7} {:>8} {:>6} {:>9} {:>7} {:>11}\n", "master/m/v", "B/param",
             "step ms", "GB/s", "copy GB/s", "vs copy", "Mparam/s", "passes", "in L2 Mp/s", "ceiling",
             fmt::format("{}T Mparam/s", pool.size()));
  for (std::size_t i = 0; i < r.size(); ++i) {
    FormatTensor& ft = set->tensors[i];
    const double per_param = ft.bytes / static_cast<double>(kFormatParams);
    const double pooled_rate = static_cast<double>(kFormatParams) / pooled_seconds(ft, pool);
    const double l2_rate = static_cast<double>(kCacheParams) / in_cache_seconds(ft);
    const double copy_rate = ft.bytes / r[i].copy_s;
    fmt::print("{:<24} {:>7.3f} {:>8.1f} {:>7.2f} {:>9.2f} {:>7.3f} {:>8.0f} {:>6} {:>9.0f} {:>7.3f} {:>11.0f}\n",
               ft.c->name, per_param, r[i].step_s * 1e3, ft.bytes / r[i].step_s / 1e9, copy_rate / 1e9, r[i].vs_copy,
               static_cast<double>(kFormatParams) / r[i].step_s / 1e6, ft.passes(), l2_rate / 1e6,
               l2_rate * per_param / copy_rate, pooled_rate / 1e6);
  }
}

}  // namespace

int run_optim(int argc, char** argv) {
  // This suite's own flags, taken out before Google Benchmark sees the rest.
  bool formats_only = false, formats = true;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string_view a = i > 0 ? std::string_view(argv[i]) : std::string_view();
    if (a == "--state-formats-only") formats_only = true;
    else if (a == "--no-state-formats") formats = false;
    else args.push_back(argv[i]);
  }
  if (!initialize(static_cast<int>(args.size()), args.data(), "bench_optim", default_flags())) return 1;
  if (formats_only) {
    print_format_table(kFormatRounds);
    benchmark::Shutdown();
    return 0;
  }
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
  state.reset();  // its buffers are not needed by the state formats' table
  if (formats) print_format_table(kFormatRounds);
  return 0;
}

}  // namespace mixprec::bench
