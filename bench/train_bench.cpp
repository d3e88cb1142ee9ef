// Training-step benchmarks (train_bench.hpp). Each case owns a Trainer on the default
// model and runs whole optimizer steps; the step count is unbounded, so nothing but
// steps is timed (no evaluation). To keep the suite short a step here accumulates 4
// micro-batches instead of the default 32: the per-micro-batch work, which is what
// the precisions change, is the same, and the ratio between presets with it.
#include "train_bench.hpp"

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <span>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "mixprec/formats/dtype.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/scaler/protocol.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::bench {
namespace {

constexpr std::size_t kBenchAccum = 4;

struct Case {
  nn::Precision precision;
  std::string loss_scale;
  std::string name;
};

train::TrainConfig config_for(const Case& c, std::size_t accum) {
  train::TrainConfig t;  // the default task's model, data and optimiser
  t.precision = c.precision;
  t.loss_scale = c.loss_scale;
  t.accum = accum;
  t.steps = 1'000'000'000;
  t.warmup = 0;
  t.eval_every = 0;
  t.corpus_tokens = 200'000;  // enough windows; the model is what is timed
  return t;
}

void run_case(benchmark::State& st, train::Trainer& t) {
  for (auto _ : st) {
    const train::StepRecord r = t.train_step();
    benchmark::DoNotOptimize(r.loss);
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(t.model().tokens_per_batch() * kBenchAccum) * st.iterations());
}

// Telemetry's share of a step: the amax pass over every activation gradient the step
// stored (timed here over the same number of values, in cache-sized blocks as the
// stores are), and the per-parameter amax passes over the store (twice the parameters).
// Histograms, only at histogram steps, are timed as the step-time difference.
struct TelemetryCost {
  double amax_ms = 0, histogram_step_extra_ms = 0;
};

// Median of the scaler's share over a few full default steps (32 micro-batches).
double scaler_share(const Case& c, std::size_t steps, double* step_ms, TelemetryCost* tel) {
  train::TrainConfig cfg = config_for(c, train::TrainConfig{}.accum);
  cfg.histogram_every = 2;  // every other step records histograms
  train::Trainer t(cfg);
  t.train_step();  // warm-up: first-touch and oneDNN's first calls
  std::vector<double> share, ms, with_hist, without_hist;
  std::uint64_t act_values = 0;
  for (std::size_t i = 0; i < 2 * steps; ++i) {
    const train::StepRecord r = t.train_step();
    (r.histograms ? with_hist : without_hist).push_back(r.seconds * 1e3);
    if (r.histograms) continue;
    share.push_back(r.scaler_seconds / r.seconds);
    ms.push_back(r.seconds * 1e3);
    act_values = r.act_grads.elements;
  }
  tel->histogram_step_extra_ms = median(with_hist) - median(without_hist);
  // The amax pass over act_values values, in 1 Mi-value blocks (a store is at most 1 Mi values here).
  std::vector<float> block(std::size_t{1} << 20, 0.5f);
  const std::size_t params = 2 * t.model().params().flat_size();
  float sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t done = 0; done < act_values + params; done += block.size()) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(block.size(), act_values + params - done));
    sink += nn::amax_of(std::span<const float>(block).first(n));
  }
  tel->amax_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(sink);
  *step_ms = median(ms);
  return median(share);
}

// The step guards' cost (docs/spike_guards.md), two ways: their own work per step (the
// protocol's decide + update with llm.c's two detectors on, minus the same without them,
// timed over many steps), and whole default fp16 steps (32 micro-batches) with the guards on
// and off, alternated, as the median of the paired ratios. The engine's localisation adds no
// pass: the backward store already counts non-finite values, and the forward scan runs only
// after a non-finite loss.
struct GuardCost {
  double own_us = 0;        // per step
  double paired_ratio = 0;  // guarded step / plain step, median of pairs
  std::size_t pairs = 0;
};

GuardCost guard_cost(std::size_t pairs) {
  GuardCost out;
  const auto protocol_us = [](bool guarded) {
    ScalerProtocol p(loss_scale_preset("torch"));
    GuardConfig g;
    g.loss_z = guarded ? 6 : 0;
    g.grad_z = guarded ? 6 : 0;
    if (guarded) p.set_guard(g);
    GradientCheck c;
    c.checked = true;
    constexpr int kSteps = 200000;
    const auto t0 = std::chrono::steady_clock::now();
    double sink = 0;
    for (int i = 0; i < kSteps; ++i) {
      c.sum_squares = 1.0 + 1e-3 * (i % 17);
      p.record(1, c);
      p.observe_loss(4.0 + 1e-3 * (i % 13));
      const StepDecision d = p.decide(1);
      sink += d.grad_norm;
      p.step_done(1);
      p.update();
    }
    benchmark::DoNotOptimize(sink);
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kSteps;
  };
  std::vector<double> own;
  for (int r = 0; r < 5; ++r) own.push_back(protocol_us(true) - protocol_us(false));
  out.own_us = median(own);
  train::TrainConfig plain = config_for({nn::Precision::fp16, "dynamic", "fp16"}, train::TrainConfig{}.accum);
  train::TrainConfig guarded = plain;
  guarded.skip_loss_z = 6;
  guarded.skip_grad_z = 6;
  guarded.skip_window = 64;
  train::Trainer a(plain), b(guarded);
  a.train_step();
  b.train_step();
  std::vector<double> ratios;
  for (std::size_t i = 0; i < pairs; ++i) {
    // Alternated, and in turn first (ABBA): the machine's drift and the order hit both.
    double ta = 0, tb = 0;
    if (i % 2 == 0) {
      ta = a.train_step().seconds;
      tb = b.train_step().seconds;
    } else {
      tb = b.train_step().seconds;
      ta = a.train_step().seconds;
    }
    ratios.push_back(tb / ta);
  }
  out.paired_ratio = median(ratios);
  out.pairs = pairs;
  return out;
}

// ---- the step against its GEMM bound ------------------------------------------------------
// A step's GEMM work (Model::gemm_flops over one step, attention's per-head products among
// it) divided by the machine's GEMM peak for the preset's operand type on the same threads
// is the time the step would take if it were nothing but its matrix multiplies at full rate:
// its bound. The peak is the fastest of a few large shapes through the same Gemm.

struct BoundModel {
  const char* name;
  nn::ModelConfig model;  // vocab comes from the data
  std::size_t accum;
};

// The default gpt, and bench/peers/pytorch_gpt.py's 3.45M one (its GEMMs 256 and 1024 wide).
std::vector<BoundModel> bound_models() {
  BoundModel small{"default", train::TrainConfig{}.model, kBenchAccum};
  BoundModel mid{"3.45M", train::TrainConfig{}.model, 2};
  mid.model.layers = 4;
  mid.model.channels = 256;
  mid.model.heads = 4;
  mid.model.context = 128;
  mid.model.batch = 8;
  return {small, mid};
}

// The type the preset's GEMMs take: the engine hands oneDNN the stored bf16 tensors where it
// has a bf16 matmul (Engine::operand), and fp32 values otherwise; fp16's GEMMs multiply the
// exact fp32 values of its fp16 tensors (docs/gemm.md), so their bound is the f32 peak.
struct BoundPreset {
  nn::Precision precision;
  const char* loss_scale;
  DType operands;
};
constexpr BoundPreset kBoundPresets[] = {{nn::Precision::fp32, "none", DType::f32},
                                         {nn::Precision::bf16, "none", DType::bf16},
                                         {nn::Precision::fp16, "dynamic", DType::f32}};

// GFLOP/s of the fastest of three large products of `type` on `threads` oneDNN threads
// (median of 5 timings of each, every timing at least 20 ms).
double gemm_peak_gflops(DType type, unsigned threads) {
  struct Shape {
    std::size_t m, n, k;
  };
  constexpr Shape kShapes[] = {{512, 512, 512}, {1024, 1024, 1024}, {2048, 1024, 1024}};
  std::size_t most = 0;
  for (const Shape& s : kShapes) most = std::max({most, s.m * s.k, s.k * s.n});
  std::vector<float> a32(most), b32(most), c(2048 * 1024);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : a32) x = normal(rng);
  for (float& x : b32) x = normal(rng);
  std::vector<f16> a16(a32.begin(), a32.end()), b16(b32.begin(), b32.end());
  std::vector<bf16> ab(a32.begin(), a32.end()), bb(b32.begin(), b32.end());
  const auto operand = [&](bool first, std::size_t rows, std::size_t cols) -> nn::MatrixView {
    if (type == DType::f16) return nn::view((first ? a16 : b16).data(), rows, cols);
    if (type == DType::bf16) return nn::view((first ? ab : bb).data(), rows, cols);
    return nn::view((first ? a32 : b32).data(), rows, cols);
  };
  nn::Gemm gemm(nn::GemmOptions{.threads = threads});
  double best = 0;
  for (const Shape& s : kShapes) {
    const nn::MatrixView a = operand(true, s.m, s.k), b = operand(false, s.k, s.n);
    const nn::OutputView out = nn::output(c.data(), s.m, s.n);
    gemm.run(a, b, out);
    std::vector<double> rates;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      std::size_t calls = 0;
      double secs = 0;
      do {
        gemm.run(a, b, out);
        ++calls;
        secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } while (secs < 0.02);
      rates.push_back(2.0 * static_cast<double>(s.m * s.n * s.k) * static_cast<double>(calls) / secs / 1e9);
    }
    best = std::max(best, median(rates));
  }
  return best;
}

struct BoundRow {
  std::string model;
  unsigned threads = 1;
  const BoundPreset* preset = nullptr;
  double step_ms = 0, gflop = 0, attention_gflop = 0, peak = 0;
  double bound_ms() const { return gflop / peak * 1e3; }
};

// Each model at 1 and 2 threads: one Trainer per preset, stepped in turn (ABC, then the order
// rotated) for `rounds` rounds after a warm-up step; each preset's figure is its median step.
std::vector<BoundRow> measure_bounds(std::size_t rounds) {
  std::vector<BoundRow> rows;
  std::map<std::pair<DType, unsigned>, double> peaks;  // measured once per type and thread count
  for (const BoundModel& bm : bound_models()) {
    for (unsigned threads : {1u, 2u}) {
      std::vector<std::unique_ptr<train::Trainer>> trainers;
      std::vector<std::vector<double>> ms(std::size(kBoundPresets));
      for (const BoundPreset& p : kBoundPresets) {
        train::TrainConfig cfg = config_for({p.precision, p.loss_scale, ""}, bm.accum);
        cfg.model = bm.model;
        cfg.threads = threads;
        trainers.push_back(std::make_unique<train::Trainer>(cfg));
        trainers.back()->train_step();  // first touch, oneDNN's primitives
      }
      std::vector<std::uint64_t> flops(trainers.size());
      for (std::size_t r = 0; r < rounds; ++r) {
        for (std::size_t j = 0; j < trainers.size(); ++j) {
          const std::size_t i = (j + r) % trainers.size();
          const std::uint64_t before = trainers[i]->model().gemm_flops();
          ms[i].push_back(trainers[i]->train_step().seconds * 1e3);
          flops[i] = trainers[i]->model().gemm_flops() - before;
        }
      }
      for (std::size_t i = 0; i < trainers.size(); ++i) {
        BoundRow row;
        row.model = bm.name;
        row.threads = threads;
        row.preset = &kBoundPresets[i];
        row.step_ms = median(ms[i]);
        row.gflop = static_cast<double>(flops[i]) / 1e9;
        nn::ModelConfig mc = trainers[i]->model().config();
        row.attention_gflop = static_cast<double>(nn::attention_flops(mc) * bm.accum) / 1e9;
        const auto key = std::make_pair(kBoundPresets[i].operands, threads);
        if (!peaks.contains(key)) peaks[key] = gemm_peak_gflops(key.first, threads);
        row.peak = peaks[key];
        rows.push_back(row);
      }
    }
  }
  return rows;
}

void print_bounds(const std::vector<BoundRow>& rows, std::size_t rounds) {
  const nn::GemmBackendInfo& info = nn::gemm_backend_info();
  fmt::print("\nThe step against its GEMM bound (bound = the step's GEMM FLOPs / the GEMM peak of its operand type\n"
             "on the same threads; medians of {} rotated rounds; CPU {}; oneDNN {} {})\n",
             rounds, cpu_model(), info.onednn_version, info.cpu_isa);
  fmt::print("{:<8} {:>3} {:<6} {:>8} {:>11} {:>10} {:>16} {:>9} {:>11} {:>9}\n", "model", "thr", "preset", "step ms",
             "GEMM GFLOP", "attention", "GEMM peak", "bound ms", "step/bound", "vs fp32");
  Tally speed;
  for (const BoundRow& r : rows) {
    const BoundRow* f32 = nullptr;
    for (const BoundRow& o : rows) {
      if (o.model == r.model && o.threads == r.threads && o.preset->precision == nn::Precision::fp32) f32 = &o;
    }
    const double ratio = r.step_ms / r.bound_ms(), speedup = f32->step_ms / r.step_ms;
    std::string peak = fmt::format("{:.0f} {}", r.peak, dtype_name(r.preset->operands));
    if (r.preset->operands == DType::bf16 && !info.bf16_native) {
      peak += "*";
    }
    fmt::print("{:<8} {:>3} {:<6} {:>8.1f} {:>11.2f} {:>10.2f} {:>16} {:>9.1f} {:>10.2f}x {:>8.2f}x\n", r.model,
               r.threads, nn::precision_name(r.preset->precision), r.step_ms, r.gflop, r.attention_gflop, peak,
               r.bound_ms(), ratio, speedup);
    if (r.model != std::string("3.45M")) continue;  // the default model's GEMMs are 64 wide: no target
    const std::string where = fmt::format("3.45M {} thread{}", r.threads, r.threads > 1 ? "s" : "");
    if (r.preset->precision == nn::Precision::fp32) {
      speed.add(ratio <= 1.2, fmt::format("{}: fp32 step {:.2f}x its bound (target <= 1.2x)", where, ratio));
    } else if (r.preset->precision == nn::Precision::bf16) {
      speed.add(ratio <= 1.5, fmt::format("{}: bf16 step {:.2f}x its bound (target <= 1.5x)", where, ratio));
      if (info.avx512_bf16 && info.bf16_native) {
        speed.add(speedup >= 1.8, fmt::format("{}: bf16 {:.2f}x faster than fp32 (target >= 1.8x)", where, speedup));
      }
    }
  }
  fmt::print("  GEMM GFLOP: every product of one step (forward, input and weight gradients), counted by the\n"
             "  engine's Gemm; attention: its per-head products among them (in fp32 in every preset). fp16's\n"
             "  GEMMs multiply the fp32 values of its fp16 tensors: its peak is f32's.\n"
             "  * no oneDNN matmul of that type here: its operands are widened to f32, and the peak is that path's.\n");
  speed.print("Bound targets");
}

void print_table(const Collector& col, const std::vector<Case>& cases, const std::string& model,
                 double tokens_per_step) {
  const nn::GemmBackendInfo& info = nn::gemm_backend_info();
  fmt::print("\nmixprec bench train: one optimizer step of the default model, {} micro-batches each (medians)\n",
             kBenchAccum);
  fmt::print("{}\n", model);
  fmt::print("AVX512-BF16: {}; oneDNN bf16 matmul: {}\n\n", info.avx512_bf16 ? "yes" : "no",
             info.bf16_native ? "native" : "not available (bf16 inputs widened exactly to f32)");
  const auto f32 = col.find(cases.front().name, 1);
  fmt::print("{:<22} {:>10} {:>12} {:>6} {:>10}\n", "preset", "step ms", "tokens/s", "cv%", "time/fp32");
  for (const Case& c : cases) {
    const auto r = col.find(c.name, 1);
    if (!r) continue;
    const double ms = 1e3 * tokens_per_step / r->items_per_s;
    fmt::print("{:<22} {:>10.1f} {:>12.0f} {:>6} {:>9.2f}x\n", c.name.substr(11), ms, r->items_per_s,
               r->cv >= 0 ? fmt::format("{:.1f}", r->cv * 100) : "-", f32 ? f32->items_per_s / r->items_per_s : 0.0);
  }
  Tally speed;
  for (const Case& c : cases) {
    const auto r = col.find(c.name, 1);
    if (!r || !f32) continue;
    const double ratio = f32->items_per_s / r->items_per_s;
    if (c.precision == nn::Precision::fp16) {
      speed.add(ratio <= 1.25, fmt::format("fp16 step {:.2f}x fp32 (target <= 1.25x)", ratio));
    }
    if (c.precision == nn::Precision::bf16 && info.avx512_bf16 && info.bf16_native) {
      speed.add(ratio <= 1.0 / 1.3, fmt::format("bf16 step {:.2f}x fp32 (target <= 0.77x, i.e. >= 1.3x faster)", ratio));
    }
  }
  if (!(info.avx512_bf16 && info.bf16_native)) {
    fmt::print("\nbf16 faster than fp32 (>= 1.3x): not applicable on this CPU (no AVX512-BF16): bf16 GEMMs run widened.\n");
  }
  double step_ms = 0;
  TelemetryCost tel;
  const double share = scaler_share({nn::Precision::fp16, "dynamic", "fp16"}, 3, &step_ms, &tel);
  fmt::print("\nScaler work (check + unscale + clip + fused AdamW + scale update) at the default 32 micro-batches:\n"
             "  {:.3f}% of a {:.0f} ms fp16 step (median of 3 steps)\n",
             share * 100, step_ms);
  speed.add(share < 0.01, fmt::format("scaler share {:.3f}% (target < 1%)", share * 100));
  const double tel_share = tel.amax_ms / step_ms;
  fmt::print("Telemetry: amax passes {:.1f} ms = {:.2f}% of the step (every step); histograms add {:.1f} ms = {:.2f}%\n"
             "  at histogram steps only (default every 50th step)\n",
             tel.amax_ms, tel_share * 100, tel.histogram_step_extra_ms, tel.histogram_step_extra_ms / step_ms * 100);
  speed.add(tel_share < 0.03, fmt::format("telemetry share {:.2f}% (target < 3%)", tel_share * 100));
  const GuardCost guards = guard_cost(16);
  fmt::print("Step guards (loss and gradient-norm z-scores, window 64) and localisation: their own work {:.3f} us "
             "= {:.2g}% of the step;\n  whole steps with guards / without, median of {} alternated pairs: {:.3f}\n",
             guards.own_us, guards.own_us / (step_ms * 1e3) * 100, guards.pairs, guards.paired_ratio);
  speed.add(guards.own_us / (step_ms * 1e3) < 0.01,
            fmt::format("guards' own share {:.2g}% (target <= 1%)", guards.own_us / (step_ms * 1e3) * 100));
  speed.print("Targets");
}

}  // namespace

int run_train(int argc, char** argv) {
  // A step takes a few hundred ms: 5 repetitions of at least one step each.
  std::vector<std::string> defaults = default_flags();
  for (std::string& f : defaults) {
    if (f.starts_with("--benchmark_repetitions=")) f = "--benchmark_repetitions=5";
  }
  if (!initialize(argc, argv, "bench_train", defaults)) return 1;
  const std::vector<Case> cases = {
      {nn::Precision::fp32, "none", "train/step/fp32"},
      {nn::Precision::fp16, "dynamic", "train/step/fp16-dynamic"},
      {nn::Precision::bf16, "none", "train/step/bf16"},
      {nn::Precision::fp16_pure, "dynamic", "train/step/fp16-pure"},
  };
  std::vector<std::unique_ptr<train::Trainer>> trainers;
  for (const Case& c : cases) {
    trainers.push_back(std::make_unique<train::Trainer>(config_for(c, kBenchAccum)));
    trainers.back()->train_step();  // warm-up outside the timing
  }
  const std::string model = trainers.front()->model().describe();
  const double tokens_per_step = static_cast<double>(trainers.front()->model().tokens_per_batch() * kBenchAccum);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    train::Trainer* t = trainers[i].get();
    auto* b = benchmark::RegisterBenchmark(cases[i].name.c_str(), [t](benchmark::State& s) { run_case(s, *t); });
    b->UseRealTime();
    b->Unit(benchmark::kMillisecond);
  }
  run_registered([&](const Collector& results) { print_table(results, cases, model, tokens_per_step); });
  trainers.clear();
  constexpr std::size_t kBoundRounds = 5;
  print_bounds(measure_bounds(kBoundRounds), kBoundRounds);
  return 0;
}

}  // namespace mixprec::bench
