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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/kernels/unscale.hpp"

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

std::string case_name(Op op, at::ScalarType dt, int t) {
  return std::string(op_name(op)) + "/" + (dt == at::kFloat ? "f32" : "bf16") + "/t" + std::to_string(t);
}

}  // namespace

int main(int argc, char** argv) {
  if (!initialize(argc, argv, "bench_torch", default_flags())) return 1;
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> thread_counts{1};
  if (all > 1) thread_counts.push_back(all);

  std::vector<Case> cases;
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    for (Op op : {Op::fused, Op::torch_2pass, Op::unscale, Op::aten_unscale, Op::mul}) {
      for (int t : thread_counts) cases.push_back({op, dt, t, case_name(op, dt, t)});
    }
  }
  std::vector<at::Tensor> f32 = make_grads(at::kFloat), bf16 = make_grads(at::kBFloat16);
  auto pools = std::make_unique<std::vector<std::unique_ptr<ThreadPool>>>();
  for (int t : thread_counts) pools->push_back(std::make_unique<ThreadPool>(t));

  for (const Case& c : cases) {
    auto* b = benchmark::RegisterBenchmark(c.name.c_str(), [&c, &f32, &bf16, &pools, &thread_counts](benchmark::State& s) {
      std::vector<at::Tensor>& grads = c.dtype == at::kFloat ? f32 : bf16;
      const auto it = std::find(thread_counts.begin(), thread_counts.end(), c.threads);
      ThreadPool& pool = *(*pools)[static_cast<std::size_t>(it - thread_counts.begin())];
      at::set_num_threads(c.threads);
      std::vector<GradTensor> views;
      for (auto& g : grads) views.push_back({g.data_ptr(), static_cast<std::size_t>(g.numel()), to_mixprec(c.dtype)});
      const at::Tensor found = at::zeros({}, at::kFloat);
      const at::Tensor inv_t[2] = {at::full({}, 0.5f), at::full({}, 2.0f)};
      int k = 0;
      for (auto _ : s) {
        const float inv = k ? 2.0f : 0.5f;
        switch (c.op) {
          case Op::fused:
          case Op::unscale: {
            UnscaleOptions o;
            o.sum_squares = c.op == Op::fused;
            benchmark::DoNotOptimize(unscale_and_check(views, inv, o, {}, &pool));
            break;
          }
          case Op::torch_2pass: {
            at::Tensor f = found;
            at::_amp_foreach_non_finite_check_and_unscale_(grads, f, inv_t[k]);
            std::vector<at::Tensor> norms;
            norms.reserve(grads.size());
            for (const auto& g : grads) norms.push_back(g.norm(2));
            benchmark::DoNotOptimize(at::stack(norms).norm(2).item<double>());
            break;
          }
          case Op::aten_unscale: {
            at::Tensor f = found;
            at::_amp_foreach_non_finite_check_and_unscale_(grads, f, inv_t[k]);
            break;
          }
          case Op::mul: at::_foreach_mul_(grads, at::Scalar(inv)); break;
        }
        k ^= 1;
      }
      const auto bytes = static_cast<std::int64_t>(kElements) * static_cast<std::int64_t>(grads[0].element_size());
      s.SetBytesProcessed(s.iterations() * bytes);
      s.SetItemsProcessed(s.iterations() * kElements);
    });
    b->UseRealTime();
    b->Unit(benchmark::kMillisecond);
  }
  run_registered([&](const Collector& col) {
    std::printf("\n%d tensors, %lld Mi elements; ratios of median rates (> 1: the first is faster)\n", kTensors,
                static_cast<long long>(kElements >> 20));
    std::printf("%-6s %7s %22s %22s %22s\n", "dtype", "threads", "fused vs torch_2pass", "unscale vs aten",
                "unscale vs mul");
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      for (int t : thread_counts) {
        auto rate = [&](Op op) {
          const auto r = col.find(case_name(op, dt, t), 1);
          return r ? r->items_per_s : 0.0;
        };
        auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
        std::printf("%-6s %7d %22.2f %22.2f %22.2f\n", dt == at::kFloat ? "f32" : "bf16", t,
                    ratio(rate(Op::fused), rate(Op::torch_2pass)), ratio(rate(Op::unscale), rate(Op::aten_unscale)),
                    ratio(rate(Op::unscale), rate(Op::mul)));
      }
    }
  });
  return 0;
}
