// bench_torch: mixprec::torch's gradient pass against what a PyTorch (libtorch) user runs,
// on a model-sized set of CPU gradients (100 tensors, 16 Mi elements), fp32 and bf16,
// 1 thread and all threads (docs/libtorch.md, "Speed"):
//   fused       mixprec::unscale_and_check over GradTensor views of the tensors' storage,
//               exactly as GradScaler::step runs it: check + unscale + sum of squares, one pass;
//   torch_2pass at::_amp_foreach_non_finite_check_and_unscale_, then clip_grad_norm_'s norm
//               (each tensor's norm, the norm of their stack, .item()): two passes;
//   unscale     mixprec's unscale and check alone (no norm);
//   aten_unscale at::_amp_foreach_non_finite_check_and_unscale_ alone;
//   mul         at::_foreach_mul_ of the same tensors by the same scalar (in-place multiply).
// Threads: mixprec's ThreadPool of that size and at::set_num_threads to that size.
// inv_scale alternates 0.5 and 2 between iterations, so that the values stay put.
//
// Then the fused optimizer step against PyTorch's (paired rounds, as below): mixprec's
// AdamW::step over 16 Mi fp32 parameters, fp32 gradients and moments (no master copy:
// read p, g, m, v and write p, m, v, 28 bytes a parameter) against at::_fused_adamw_,
// what torch.optim.AdamW(fused=True) runs, on the same arrays' twins; and mixprec's
// mixed-precision step (f16 gradients, fp32 master and moments, f16 model copy: also
// 28 bytes a parameter), on 1 thread and on all. `bench_torch --adam-only` prints only
// that table (docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/param_store.hpp"

namespace {

using namespace mixprec;
using namespace mixprec::bench;

constexpr int kTensors = 100;
constexpr std::int64_t kElements = std::int64_t{16} << 20;

enum class Op { fused, torch_2pass, unscale, aten_unscale, mul };
const char* op_name(Op o) {
  switch (o) {
    case Op::fused: return "fused";
    case Op::torch_2pass: return "torch_2pass";
    case Op::unscale: return "unscale";
    case Op::aten_unscale: return "aten_unscale";
    case Op::mul: return "mul";
  }
  return "?";
}

struct Case {
  Op op;
  at::ScalarType dtype;
  int threads;
  std::string name;
};

std::vector<at::Tensor> make_grads(at::ScalarType dt) {
  // Sizes from a transformer-like mix (large matrices, small vectors), summing to kElements.
  at::manual_seed(7);
  std::vector<std::int64_t> sizes;
  std::int64_t total = 0;
  for (int i = 0; i < kTensors - 1; ++i) {
    const std::int64_t n = (i % 4 == 3) ? 1024 : (kElements / (kTensors * 3 / 4 + 1)) & ~std::int64_t{63};
    sizes.push_back(n);
    total += n;
  }
  sizes.push_back(kElements - total);
  std::vector<at::Tensor> g;
  for (auto n : sizes) g.push_back((at::randn({n}) * 1e-3).to(dt).contiguous());
  return g;
}

DType to_mixprec(at::ScalarType t) { return t == at::kFloat ? DType::f32 : DType::bf16; }

// The tensors of one dtype, their GradTensor views and ATen's 0-dim arguments.
struct Grads {
  std::vector<at::Tensor> tensors;
  std::vector<GradTensor> views;
  at::Tensor found = at::zeros({}, at::kFloat);
  at::Tensor inv_t[2] = {at::full({}, 0.5f), at::full({}, 2.0f)};
};

Grads make_set(at::ScalarType dt) {
  Grads g;
  g.tensors = make_grads(dt);
  for (auto& t : g.tensors) g.views.push_back({t.data_ptr(), static_cast<std::size_t>(t.numel()), to_mixprec(dt)});
  return g;
}

// One run of `op`; k (0 or 1) picks inv_scale 0.5 or 2.
void run_op(Op op, Grads& g, ThreadPool& pool, int k) {
  const float inv = k ? 2.0f : 0.5f;
  switch (op) {
    case Op::fused:
    case Op::unscale: {
      UnscaleOptions o;
      o.sum_squares = op == Op::fused;
      benchmark::DoNotOptimize(unscale_and_check(g.views, inv, o, {}, &pool));
      break;
    }
    case Op::torch_2pass: {
      at::Tensor f = g.found;
      at::_amp_foreach_non_finite_check_and_unscale_(g.tensors, f, g.inv_t[k]);
      std::vector<at::Tensor> norms;
      norms.reserve(g.tensors.size());
      for (const auto& t : g.tensors) norms.push_back(t.norm(2));
      benchmark::DoNotOptimize(at::stack(norms).norm(2).item<double>());
      break;
    }
    case Op::aten_unscale: {
      at::Tensor f = g.found;
      at::_amp_foreach_non_finite_check_and_unscale_(g.tensors, f, g.inv_t[k]);
      break;
    }
    case Op::mul: at::_foreach_mul_(g.tensors, at::Scalar(inv)); break;
  }
}

constexpr Op kOps[] = {Op::fused, Op::torch_2pass, Op::unscale, Op::aten_unscale, Op::mul};
constexpr int kRounds = 41;

// Paired rounds: every op once per round, in an order rotated from round to round, each
// timed on its own; a ratio of two ops is taken inside a round (both ran within a few
// milliseconds of each other) and the median over the rounds is reported. On a shared
// host whose memory bandwidth swings by 2x for seconds at a time, the medians of
// separately timed benchmarks can come from different regimes; paired ratios cannot.
std::array<double, 3> paired_ratios(Grads& g, ThreadPool& pool, int threads) {
  at::set_num_threads(threads);
  constexpr int n = static_cast<int>(std::size(kOps));
  for (Op op : kOps) run_op(op, g, pool, 0), run_op(op, g, pool, 1);  // warm
  std::vector<double> r[3];
  for (int round = 0; round < kRounds; ++round) {
    double t[n] = {};
    for (int j = 0; j < n; ++j) {
      const int i = (j + round) % n;
      const auto t0 = std::chrono::steady_clock::now();
      run_op(kOps[i], g, pool, round & 1);
      t[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    // t[]: fused, torch_2pass, unscale, aten_unscale, mul; ratios > 1: the first is faster.
    r[0].push_back(t[1] / t[0]);
    r[1].push_back(t[3] / t[2]);
    r[2].push_back(t[4] / t[2]);
  }
  std::array<double, 3> med{};
  for (int i = 0; i < 3; ++i) {
    std::sort(r[i].begin(), r[i].end());
    med[static_cast<std::size_t>(i)] = r[i][r[i].size() / 2];
  }
  return med;
}

// ---- the fused AdamW step ---------------------------------------------------------------

constexpr std::int64_t kAdamParams = std::int64_t{16} << 20;
constexpr int kAdamRounds = 21;
constexpr double kAdamBytesPerParam = 28;

struct AdamSet {
  // mixprec: fp32 weights and gradients (no master), and the mixed f16/master store.
  ParamStore plain{{{"w", {static_cast<std::size_t>(kAdamParams)}}},
                   {.model = DType::f32, .grads = DType::f32, .master = false, .state_slots = 2}};
  ParamStore mixed{{{"w", {static_cast<std::size_t>(kAdamParams)}}},
                   {.model = DType::f16, .grads = DType::f16, .master = true, .state_slots = 2}};
  std::unique_ptr<AdamW> plain_opt, mixed_opt;
  // PyTorch: the same values in its own tensors.
  at::Tensor p, g, m, v, step = at::zeros({}, at::kFloat);

  AdamSet() {
    at::manual_seed(11);
    const at::Tensor w = at::randn({kAdamParams}) * 0.02;
    const at::Tensor grad = at::randn({kAdamParams}) * 1e-3;
    std::memcpy(plain.model_data(), w.data_ptr<float>(), static_cast<std::size_t>(kAdamParams) * 4);
    std::memcpy(plain.grad_data(), grad.data_ptr<float>(), static_cast<std::size_t>(kAdamParams) * 4);
    std::memcpy(mixed.master_data(), w.data_ptr<float>(), static_cast<std::size_t>(kAdamParams) * 4);
    const at::Tensor g16 = grad.to(at::kHalf);
    std::memcpy(mixed.grad_data(), g16.data_ptr(), static_cast<std::size_t>(kAdamParams) * 2);
    mixed.refresh_model();
    const AdamConfig cfg{.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
    plain_opt = std::make_unique<AdamW>(plain, cfg);
    mixed_opt = std::make_unique<AdamW>(mixed, cfg);
    p = w.clone();
    g = grad.clone();
    m = at::zeros_like(p);
    v = at::zeros_like(p);
  }
};

enum class AdamOp { mixprec_plain, torch_fused, mixprec_mixed };

void run_adam(AdamOp op, AdamSet& s, ThreadPool& pool) {
  switch (op) {
    case AdamOp::mixprec_plain: s.plain_opt->step({}, &pool); break;
    case AdamOp::mixprec_mixed: s.mixed_opt->step({}, &pool); break;
    case AdamOp::torch_fused:
      s.step.add_(1);
      at::_fused_adamw_({s.p}, {s.g}, {s.m}, {s.v}, {}, {s.step}, 1e-4, 0.9, 0.999, 0.01, 1e-8, false, false);
      break;
  }
}

// Paired rounds (see paired_ratios): per round each op once, rotated; returns the median
// over rounds of torch / mixprec_plain and torch / mixprec_mixed (> 1: mixprec is faster),
// and the median GB/s of each op at 28 bytes a parameter.
struct AdamResult {
  double plain_vs_torch = 0, mixed_vs_torch = 0;
  double gbs[3] = {};
};

AdamResult paired_adam(AdamSet& s, ThreadPool& pool, int threads) {
  at::set_num_threads(threads);
  constexpr AdamOp ops[] = {AdamOp::mixprec_plain, AdamOp::torch_fused, AdamOp::mixprec_mixed};
  for (AdamOp op : ops) run_adam(op, s, pool), run_adam(op, s, pool);  // warm
  std::vector<double> r0, r1, t[3];
  for (int round = 0; round < kAdamRounds; ++round) {
    double dt[3] = {};
    for (int j = 0; j < 3; ++j) {
      const int i = (j + round) % 3;
      const auto t0 = std::chrono::steady_clock::now();
      run_adam(ops[i], s, pool);
      dt[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    r0.push_back(dt[1] / dt[0]);
    r1.push_back(dt[1] / dt[2]);
    for (int i = 0; i < 3; ++i) t[i].push_back(dt[i]);
  }
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  AdamResult r;
  r.plain_vs_torch = median(r0);
  r.mixed_vs_torch = median(r1);
  for (int i = 0; i < 3; ++i) r.gbs[i] = kAdamBytesPerParam * static_cast<double>(kAdamParams) / median(t[i]) / 1e9;
  return r;
}

std::string case_name(Op op, at::ScalarType dt, int t) {
  return std::string(op_name(op)) + "/" + (dt == at::kFloat ? "f32" : "bf16") + "/t" + std::to_string(t);
}

// The AdamW table: paired rounds at each thread count, with the pool of that size.
template <class PoolFor>
void print_adam_table(const std::vector<int>& thread_counts, PoolFor&& pool_for) {
  auto adam = std::make_unique<AdamSet>();
  std::printf("\nFused AdamW step, %lld Mi parameters, 28 bytes each; %d paired rounds, medians; ThreadPool on %s\n",
              static_cast<long long>(kAdamParams >> 20), kAdamRounds, ThreadPool::runtime());
  std::printf("  mixprec fp32: AdamW::step, fp32 weights/grads/moments; torch: at::_fused_adamw_ (AdamW(fused=True))\n");
  std::printf("  mixprec mixed: f16 grads, fp32 master + moments, f16 model copy\n");
  std::printf("%7s %14s %14s %14s %18s %18s\n", "threads", "mixprec GB/s", "torch GB/s", "mixed GB/s",
              "fp32: torch/ours", "mixed: torch/ours");
  for (int t : thread_counts) {
    const AdamResult r = paired_adam(*adam, pool_for(t), t);
    std::printf("%7d %14.1f %14.1f %14.1f %18.2f %18.2f\n", t, r.gbs[0], r.gbs[1], r.gbs[2], r.plain_vs_torch,
                r.mixed_vs_torch);
  }
  std::printf("Target (issue 31): fused AdamW >= PyTorch's fused AdamW on 1 and 2 threads (fp32: torch/ours >= 1).\n");
}

}  // namespace

int main(int argc, char** argv) {
  // --adam-only: only the AdamW table (the gradient-pass suite before it takes minutes).
  bool adam_only = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::strcmp(argv[i], "--adam-only") == 0) adam_only = true;
    else args.push_back(argv[i]);
  }
  argc = static_cast<int>(args.size());
  argv = args.data();
  if (!initialize(argc, argv, "bench_torch", default_flags())) return 1;
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> thread_counts{1};
  if (all > 1) thread_counts.push_back(all);
  auto pools = std::make_unique<std::vector<std::unique_ptr<ThreadPool>>>();
  for (int t : thread_counts) pools->push_back(std::make_unique<ThreadPool>(t));
  auto pool_for = [&](int threads) -> ThreadPool& {
    const auto it = std::find(thread_counts.begin(), thread_counts.end(), threads);
    return *(*pools)[static_cast<std::size_t>(it - thread_counts.begin())];
  };
  if (adam_only) {
    print_adam_table(thread_counts, pool_for);
    return 0;
  }

  std::vector<Case> cases;
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    for (Op op : kOps) {
      for (int t : thread_counts) cases.push_back({op, dt, t, case_name(op, dt, t)});
    }
  }
  Grads f32 = make_set(at::kFloat), bf16 = make_set(at::kBFloat16);
  for (const Case& c : cases) {
    auto* b = benchmark::RegisterBenchmark(c.name.c_str(), [&c, &f32, &bf16, &pool_for](benchmark::State& s) {
      Grads& g = c.dtype == at::kFloat ? f32 : bf16;
      ThreadPool& pool = pool_for(c.threads);
      at::set_num_threads(c.threads);
      int k = 0;
      for (auto _ : s) {
        run_op(c.op, g, pool, k);
        k ^= 1;
      }
      const auto bytes = static_cast<std::int64_t>(kElements) * static_cast<std::int64_t>(g.tensors[0].element_size());
      s.SetBytesProcessed(s.iterations() * bytes);
      s.SetItemsProcessed(s.iterations() * kElements);
    });
    b->UseRealTime();
    b->Unit(benchmark::kMillisecond);
  }
  run_registered([&](const Collector& col) {
    std::printf("\n%d tensors, %lld Mi elements; ratios (> 1: the first is faster)\n", kTensors,
                static_cast<long long>(kElements >> 20));
    std::printf("  medians: the ratio of the two benchmarks' median rates above\n");
    std::printf("  paired:  the median over %d rounds of the ratio inside a round (every op once per round)\n",
                kRounds);
    std::printf("%-6s %7s %24s %24s %24s\n", "dtype", "threads", "fused vs torch_2pass", "unscale vs aten",
                "unscale vs mul");
    std::printf("%-6s %7s %24s %24s %24s\n", "", "", "median / paired", "median / paired", "median / paired");
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      for (int t : thread_counts) {
        auto rate = [&](Op op) {
          const auto r = col.find(case_name(op, dt, t), 1);
          return r ? r->items_per_s : 0.0;
        };
        auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
        const auto p = paired_ratios(dt == at::kFloat ? f32 : bf16, pool_for(t), t);
        std::printf("%-6s %7d %15.2f / %5.2f %15.2f / %5.2f %15.2f / %5.2f\n", dt == at::kFloat ? "f32" : "bf16", t,
                    ratio(rate(Op::fused), rate(Op::torch_2pass)), p[0], ratio(rate(Op::unscale), rate(Op::aten_unscale)),
                    p[1], ratio(rate(Op::unscale), rate(Op::mul)), p[2]);
      }
    }
    print_adam_table(thread_counts, pool_for);
  });
  return 0;
}
