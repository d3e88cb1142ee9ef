// bench_layers: the layer kernels (src/nn/layer_kernels.hpp) of the dispatched SIMD
// back end against the scalar reference, same shapes, same run, randomly interleaved
// repetitions (bench_common's defaults); the table shows ratios of medians.
// Shapes are the 3.45M gpt's (4 layers, 256 channels, context 128, batch 8: N = 1024
// rows): GELU over N x 4C, layer norm rows of C = 256, softmax / cross-entropy rows of a
// small (char) and a large vocabulary, causal attention rows of T = 128, residual adds
// of N x C. One thread (the kernels; the layers split rows with OpenMP around them).
#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "mixprec/core/isa.hpp"
#include "nn/layer_kernels.hpp"

namespace mixprec::bench {
namespace {

using nn::detail::LayerKernels;

constexpr std::size_t kRows = 1024, kC = 256;

enum class Op { gelu_fwd, gelu_bwd, ln_fwd, ln_bwd, softmax_96, softmax_8192, causal_128, ce_bwd_96, add, add_both };
const char* op_name(Op op) {
  switch (op) {
    case Op::gelu_fwd: return "gelu_forward/1Mi";
    case Op::gelu_bwd: return "gelu_backward/1Mi";
    case Op::ln_fwd: return "layernorm_forward/1024x256";
    case Op::ln_bwd: return "layernorm_backward/1024x256";
    case Op::softmax_96: return "softmax_row/1024x96";
    case Op::softmax_8192: return "softmax_row/64x8192";
    case Op::causal_128: return "softmax_row/causal128";
    case Op::ce_bwd_96: return "ce_backward_row/1024x96";
    case Op::add: return "residual_add/256Ki";
    case Op::add_both: return "add_to_both/256Ki";
  }
  return "?";
}
constexpr Op kOps[] = {Op::gelu_fwd, Op::gelu_bwd,  Op::ln_fwd,    Op::ln_bwd, Op::softmax_96,
                       Op::softmax_8192, Op::causal_128, Op::ce_bwd_96, Op::add, Op::add_both};

struct Data {
  std::vector<float> a, b, c, d, w, bias, mean, rstd;
};

Data make_data() {
  const std::size_t n = kRows * 4 * kC;
  Data x;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto* v : {&x.a, &x.b, &x.c, &x.d}) {
    v->resize(n);
    for (float& f : *v) f = 2.0f * nd(rng);
  }
  x.w.assign(kC, 1.0f);
  x.bias.assign(kC, 0.0f);
  x.mean.assign(kRows, 0.0f);
  x.rstd.assign(kRows, 1.0f);
  return x;
}

// Elements processed per iteration.
std::size_t items(Op op) {
  switch (op) {
    case Op::gelu_fwd:
    case Op::gelu_bwd: return kRows * 4 * kC;
    case Op::ln_fwd:
    case Op::ln_bwd:
    case Op::add:
    case Op::add_both: return kRows * kC;
    case Op::softmax_96:
    case Op::ce_bwd_96: return kRows * 96;
    case Op::softmax_8192: return 64 * 8192;
    case Op::causal_128: return 8 * 128 * 128;
  }
  return 0;
}

void run_case(benchmark::State& state, Op op, const LayerKernels& k, Data& x) {
  for (auto _ : state) {
    switch (op) {
      case Op::gelu_fwd: k.gelu_forward(x.b.data(), x.a.data(), items(op)); break;
      case Op::gelu_bwd: k.gelu_backward(x.c.data(), x.a.data(), x.b.data(), items(op), false); break;
      case Op::ln_fwd:
        for (std::size_t r = 0; r < kRows; ++r) {
          k.layernorm_forward_row(&x.b[r * kC], &x.mean[r], &x.rstd[r], &x.a[r * kC], x.w.data(), x.bias.data(), kC,
                                  1e-5f);
        }
        break;
      case Op::ln_bwd:
        k.layernorm_backward_params(&x.d[0], &x.d[kC], x.b.data(), x.a.data(), x.mean.data(), x.rstd.data(), kRows,
                                    kC, kC);
        for (std::size_t r = 0; r < kRows; ++r) {
          k.layernorm_backward_dx_row(&x.c[r * kC], &x.b[r * kC], &x.a[r * kC], x.w.data(), x.mean[r], x.rstd[r], kC,
                                      false);
        }
        break;
      case Op::softmax_96:
        for (std::size_t r = 0; r < kRows; ++r) benchmark::DoNotOptimize(k.softmax_row(&x.b[r * 96], &x.a[r * 96], 96, 96));
        break;
      case Op::softmax_8192:
        for (std::size_t r = 0; r < 64; ++r) {
          benchmark::DoNotOptimize(k.softmax_row(&x.b[r * 8192], &x.a[r * 8192], 8192, 8192));
        }
        break;
      case Op::causal_128:
        for (std::size_t r = 0; r < 8 * 128; ++r) {
          benchmark::DoNotOptimize(k.softmax_row(&x.b[r * 128], &x.a[r * 128], 128, r % 128 + 1));
        }
        break;
      case Op::ce_bwd_96:
        for (std::size_t r = 0; r < kRows; ++r) k.crossentropy_backward_row(&x.c[r * 96], &x.b[r * 96], 96, r % 96, 1e-3f, false);
        break;
      case Op::add: k.add(x.c.data(), x.a.data(), x.b.data(), items(op)); break;
      case Op::add_both: k.add_to_both(x.c.data(), x.d.data(), x.a.data(), items(op)); break;
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(items(op)) * static_cast<std::int64_t>(state.iterations()));
}

std::string case_name(Op op, const LayerKernels& k) { return fmt::format("{}/{}", op_name(op), isa_name(k.isa)); }

}  // namespace
}  // namespace mixprec::bench

int main(int argc, char** argv) {
  using namespace mixprec::bench;
  if (!initialize(argc, argv, "bench_layers", default_flags())) return 1;
  const LayerKernels& ref = mixprec::nn::detail::scalar_layer_kernels();
  std::vector<const LayerKernels*> tables{&ref};
  for (mixprec::Isa isa : {mixprec::Isa::avx2, mixprec::Isa::avx512}) {
    if (const LayerKernels* k = mixprec::nn::detail::layer_kernels(isa)) tables.push_back(k);
  }
  Data data = make_data();
  for (Op op : kOps) {
    for (const LayerKernels* k : tables) {
      benchmark::RegisterBenchmark(case_name(op, *k).c_str(), [op, k, &data](benchmark::State& s) {
        run_case(s, op, *k, data);
      })->UseRealTime();
    }
  }
  run_registered([&](const Collector& col) {
    fmt::print("\nbench_layers: ratios of medians from this run, 1 thread (Melem/s; x = over the reference)\n");
    fmt::print("{:<30} {:>10}", "kernel", "reference");
    for (std::size_t t = 1; t < tables.size(); ++t) fmt::print(" {:>10} {:>7}", mixprec::isa_name(tables[t]->isa), "x");
    fmt::print("\n");
    for (Op op : kOps) {
      const auto r = col.find(case_name(op, ref), 1);
      if (!r) continue;
      fmt::print("{:<30} {:>10.1f}", op_name(op), r->items_per_s / 1e6);
      for (std::size_t t = 1; t < tables.size(); ++t) {
        const auto f = col.find(case_name(op, *tables[t]), 1);
        fmt::print(" {:>10} {:>7}", f ? fmt::format("{:.1f}", f->items_per_s / 1e6) : "-",
                   f ? fmt::format("{:.2f}x", f->items_per_s / r->items_per_s) : "-");
      }
      fmt::print("\n");
    }
  });
  return 0;
}
