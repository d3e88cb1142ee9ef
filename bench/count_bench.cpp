// The counting pass (mixprec/formats/count.hpp) against what telemetry's counting did before
// it, on the same tensors in the same run: a 16-bit tensor widened to fp32, convert_counted to
// an fp16 scratch, and a separate |max| pass (measure_amax); an fp32 tensor without the
// widening. Also the scalar reference of the counting pass, and the |max| pass alone
// (amax_*, the forward check's). Google Benchmark; compare the
// medians of one run (docs/performance.md, "Telemetry's cost"):
//
//   build/release/bench/bench_count --benchmark_repetitions=9 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstddef>
#include <random>
#include <span>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/count.hpp"
#include "mixprec/run/step_record.hpp"

namespace {

using mixprec::bf16;
using mixprec::f16;

// Gradient-like values over 2^-30 .. 2^10: every outcome class is reached.
std::vector<float> values(std::size_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> e(-30, 10);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(normal(rng), e(rng));
  return v;
}

template <class T>
struct Data {
  std::vector<float> f32;
  std::vector<T> low;
  std::vector<float> widened;  // the old path's scratch, allocated once
  std::vector<f16> out;
  explicit Data(std::size_t n) : f32(values(n)), low(n), widened(n), out(n) {
    for (std::size_t i = 0; i < n; ++i) low[i] = T(f32[i]);
  }
};

template <class T>
mixprec::CountedTensor count(mixprec::Isa isa, const std::vector<T>& v) {
  if constexpr (std::is_same_v<T, f16>) return mixprec::count_f16_as_stored(isa, std::span<const f16>(v));
  else if constexpr (std::is_same_v<T, bf16>) return mixprec::count_bf16_to_f16(isa, std::span<const bf16>(v));
  else return mixprec::count_f32_to_f16(isa, std::span<const float>(v));
}

template <class T>
mixprec::DType dtype_of() {
  if constexpr (std::is_same_v<T, f16>) return mixprec::DType::f16;
  else if constexpr (std::is_same_v<T, bf16>) return mixprec::DType::bf16;
  else return mixprec::DType::f32;
}

template <class T>
void BM_count(benchmark::State& state) {
  Data<T> d(static_cast<std::size_t>(state.range(0)));
  const std::vector<T>& src = [&]() -> const std::vector<T>& {
    if constexpr (std::is_same_v<T, float>) return d.f32;
    else return d.low;
  }();
  const auto isa = static_cast<mixprec::Isa>(state.range(1));
  if (!mixprec::isa_available(isa)) {
    state.SkipWithError("back end not available on this CPU");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(count(isa, src));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// The |max| pass alone (amax_*: Telemetry's forward check for inf/NaN), on the same tensors.
template <class T>
void BM_amax(benchmark::State& state) {
  Data<T> d(static_cast<std::size_t>(state.range(0)));
  const auto isa = static_cast<mixprec::Isa>(state.range(1));
  if (!mixprec::isa_available(isa)) {
    state.SkipWithError("back end not available on this CPU");
    return;
  }
  for (auto _ : state) {
    if constexpr (std::is_same_v<T, f16>) benchmark::DoNotOptimize(mixprec::amax_f16(isa, std::span<const f16>(d.low)));
    else if constexpr (std::is_same_v<T, bf16>)
      benchmark::DoNotOptimize(mixprec::amax_bf16(isa, std::span<const bf16>(d.low)));
    else benchmark::DoNotOptimize(mixprec::amax_f32(isa, std::span<const float>(d.f32)));
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// The old recorder: widen (16-bit), convert_counted into a scratch, measure_amax.
template <class T>
void BM_widen_convert_counted(benchmark::State& state) {
  Data<T> d(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) {
    std::span<const float> g = d.f32;
    mixprec::GradTensor view{d.f32.data(), d.f32.size(), mixprec::DType::f32};
    if constexpr (!std::is_same_v<T, float>) {
      mixprec::convert(std::span<const T>(d.low), std::span<float>(d.widened));
      g = d.widened;
      view = {d.low.data(), d.low.size(), dtype_of<T>()};
    }
    benchmark::DoNotOptimize(mixprec::convert_counted(g, std::span<f16>(d.out)));
    float amax = 0;
    mixprec::train::measure_amax(std::span<const mixprec::GradTensor>(&view, 1), 1.0f, std::span<float>(&amax, 1));
    benchmark::DoNotOptimize(amax);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// 256 Ki elements (in L2/L3, as an activation gradient of the GPT-2 bench) and 16 Mi (memory).
void sizes(benchmark::internal::Benchmark* b) {
  for (long n : {256L << 10, 16L << 20})
    for (long isa : {0L, 1L, 2L}) b->Args({n, isa});
}
void sizes_old(benchmark::internal::Benchmark* b) {
  for (long n : {256L << 10, 16L << 20}) b->Args({n, 0});
}

BENCHMARK(BM_count<float>)->Apply(sizes);
BENCHMARK(BM_count<bf16>)->Apply(sizes);
BENCHMARK(BM_count<f16>)->Apply(sizes);
BENCHMARK(BM_amax<float>)->Apply(sizes);
BENCHMARK(BM_amax<bf16>)->Apply(sizes);
BENCHMARK(BM_amax<f16>)->Apply(sizes);
BENCHMARK(BM_widen_convert_counted<float>)->Apply(sizes_old);
BENCHMARK(BM_widen_convert_counted<bf16>)->Apply(sizes_old);
BENCHMARK(BM_widen_convert_counted<f16>)->Apply(sizes_old);

}  // namespace

BENCHMARK_MAIN();
