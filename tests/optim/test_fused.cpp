// The fused step equals the unfused sequence of passes, bit for bit, for every
// dtype mix, awkward sizes, both back ends and 1 or 2 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>

#include "mixprec/core/parallel.hpp"
#include "mixprec/optim/clip.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mlp.hpp"

namespace mixprec {
namespace {

const std::size_t kSizes[] = {0, 1, 7, 15, 16, 17, 4099};

// Tensors of the awkward sizes (and a 2-D one), so padding sits between them.
std::vector<ParamSpec> awkward_specs(std::size_t n) {
  return {{"a", {n}}, {"b", {3, 5}}, {"c", {n == 0 ? 0 : n + 1}}};
}

// A cheap deterministic generator (the sizes here are large for mt19937 + normal).
struct Gen {
  std::uint64_t x;
  float uniform() {  // [-1, 1)
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<std::int32_t>(x >> 32)) * 0x1p-31f;
  }
};

void fill_store(ParamStore& s, std::uint32_t seed) {
  Gen rng{seed};
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    if (s.has_master()) {
      for (float& w : s.master(t)) w = rng.uniform();
    } else {
      switch (s.model_dtype()) {
        case DType::f32: for (float& w : s.model<float>(t)) w = rng.uniform(); break;
        case DType::f16: for (auto& w : s.model<f16>(t)) w = f16(rng.uniform()); break;
        case DType::bf16: for (auto& w : s.model<bf16>(t)) w = bf16(rng.uniform()); break;
      }
    }
  }
  s.refresh_model();
}

// Scaled gradients over many magnitudes (some underflow to f16 subnormals when unscaled).
void fill_grads(ParamStore& s, std::uint32_t seed, float scale) {
  Gen rng{seed * 7919ull + 1};
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    auto gen = [&] {
      const float m = rng.uniform();
      const int e = static_cast<int>((rng.uniform() + 1.0f) * 11.0f) - 20;  // 2^-20 .. 2^2
      return std::ldexp(m, e) * scale;
    };
    switch (s.grad_dtype()) {
      case DType::f32: for (float& g : s.grads<float>(t)) g = gen(); break;
      case DType::f16: for (auto& g : s.grads<f16>(t)) g = f16(gen()); break;
      case DType::bf16: for (auto& g : s.grads<bf16>(t)) g = bf16(gen()); break;
    }
  }
}

using Factory = std::function<std::unique_ptr<Optimizer>(ParamStore&, PureOptions)>;
struct NamedFactory {
  const char* name;
  Factory make;
};
const NamedFactory kFactories[] = {
    {"adam", [](ParamStore& s, PureOptions p) { return std::make_unique<Adam>(s, AdamConfig{.lr = 1e-2}, p); }},
    {"adam_l2", [](ParamStore& s, PureOptions p) {
       return std::make_unique<Adam>(s, AdamConfig{.lr = 1e-2, .beta1 = 0.3, .weight_decay = 0.1}, p);  // lerp's other branch
     }},
    {"adamw", [](ParamStore& s, PureOptions p) { return std::make_unique<AdamW>(s, AdamConfig{.lr = 1e-2, .weight_decay = 0.01}, p); }},
    {"sgd", [](ParamStore& s, PureOptions p) { return std::make_unique<SGD>(s, SgdConfig{.lr = 0.1}, p); }},
    {"sgd_momentum_wd", [](ParamStore& s, PureOptions p) {
       return std::make_unique<SGD>(s, SgdConfig{.lr = 0.1, .momentum = 0.9, .dampening = 0.5, .weight_decay = 1e-3}, p);
     }},
    {"sgd_nesterov", [](ParamStore& s, PureOptions p) {
       return std::make_unique<SGD>(s, SgdConfig{.lr = 0.1, .momentum = 0.9, .nesterov = true}, p);
     }},
};

struct Case {
  DType model, grads;
  bool master;
  Rounding rounding;
};

std::string describe(const Case& c, const char* opt, std::size_t n, Isa isa, unsigned threads, bool clip) {
  return std::string(opt) + " model " + std::string(dtype_name(c.model)) + " grads " +
         std::string(dtype_name(c.grads)) + (c.master ? " master" : " pure") +
         (c.rounding == Rounding::stochastic ? " SR" : "") + " n " + std::to_string(n) + " isa " +
         std::string(isa_name(isa)) + " threads " + std::to_string(threads) + (clip ? " clip" : "");
}

void check_case(const Case& c, const NamedFactory& f, std::size_t n, Isa isa, ThreadPool* pool, bool clip) {
  const StoreOptions so{.model = c.model, .grads = c.grads, .master = c.master, .state_slots = 2};
  ParamStore fused_store(awkward_specs(n), so), ref_store(awkward_specs(n), so);
  fill_store(fused_store, 11);
  fill_store(ref_store, 11);
  const PureOptions pure{.rounding = c.rounding, .seed = 99};
  auto fused = f.make(fused_store, pure);
  auto ref = f.make(ref_store, pure);
  fused->set_isa(isa);
  ref->set_isa(Isa::scalar);
  std::vector<float> scratch(ref->unfused_scratch_size());
  const std::string what = describe(c, f.name, n, isa, pool ? pool->size() : 1, clip);
  const float scale = 3000.0f;  // not a power of two: unscaling rounds
  const float max_norm = 0.02f;
  for (std::uint32_t step = 0; step < 3; ++step) {
    fill_grads(fused_store, 100 + step, scale);
    fill_grads(ref_store, 100 + step, scale);
    const float inv = 1.0f / scale;
    StepControls ctl{.inv_scale = inv};
    if (clip) {
      const GradStats st = grad_stats(fused_store, inv, pool);
      ASSERT_FALSE(st.found_inf) << what;
      // The fused norm (one read of the grads) equals the plain reference loop.
      ASSERT_EQ(st.norm, global_grad_norm(fused_store, inv)) << what;
      ctl.clip_coef = clip_coefficient(st.norm, max_norm);
      if (n > 100) {
        ASSERT_LT(ctl.clip_coef, 1.0f) << what;
      }
    }
    ASSERT_TRUE(fused->step(ctl, pool)) << what;
    ASSERT_TRUE(ref->step_unfused({.inv_scale = inv}, scratch, clip ? std::optional<float>(max_norm) : std::nullopt))
        << what;
    ASSERT_EQ(test::snapshot(fused_store), test::snapshot(ref_store)) << what << " step " << step;
  }
  EXPECT_EQ(fused->step_count(), 3);
  // Padding stays zero.
  if (c.master) {
    const float* m = fused_store.master_data();
    for (std::size_t t = 0; t < fused_store.tensor_count(); ++t) {
      const std::size_t end = t + 1 < fused_store.tensor_count() ? fused_store.offset(t + 1) : fused_store.flat_size();
      for (std::size_t i = fused_store.offset(t) + fused_store.numel(t); i < end; ++i) ASSERT_EQ(m[i], 0.0f) << what;
    }
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType m : {DType::f32, DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::f16, DType::bf16}) cases.push_back({m, g, true, Rounding::nearest_even});
  for (DType m : {DType::f32, DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::f16, DType::bf16}) {
      cases.push_back({m, g, false, Rounding::nearest_even});
      if (m != DType::f32) cases.push_back({m, g, false, Rounding::stochastic});
    }
  return cases;
}

TEST(FusedStep, EqualsUnfusedSequenceBitwise) {
  ThreadPool pool(2);
  for (const Case& c : all_cases())
    for (const NamedFactory& f : kFactories)
      for (std::size_t n : kSizes)
        for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
          if (!isa_available(isa)) continue;
          check_case(c, f, n, isa, nullptr, false);
          if (HasFatalFailure()) return;
        }
}

TEST(FusedStep, EqualsUnfusedAtALargerSize) {
  for (const Case& c : all_cases())
    for (const NamedFactory& f : kFactories) {
      check_case(c, f, 20011, best_isa(), nullptr, false);
      if (HasFatalFailure()) return;
    }
}

TEST(FusedStep, EqualsUnfusedWithClippingAndThreads) {
  ThreadPool pool(2);
  for (const Case& c : all_cases())
    for (const NamedFactory& f : kFactories)
      for (std::size_t n : {std::size_t{17}, std::size_t{40001}}) {  // 40001: above the parallel threshold
        check_case(c, f, n, best_isa(), &pool, true);
        if (HasFatalFailure()) return;
      }
}

TEST(FusedStep, LargeStoreAcrossThreadCounts) {
  // Bigger than the parallel threshold and several norm blocks: 1 and 2 threads agree.
  const std::size_t n = (1u << 18) + 333;
  const StoreOptions so{.model = DType::f16, .grads = DType::f16, .master = true, .state_slots = 2};
  ParamStore a(awkward_specs(n), so), b(awkward_specs(n), so);
  fill_store(a, 5);
  fill_store(b, 5);
  Adam oa(a, {}), ob(b, {});
  ThreadPool pool(2);
  for (std::uint32_t step = 0; step < 2; ++step) {
    fill_grads(a, step, 1024.0f);
    fill_grads(b, step, 1024.0f);
    const GradStats sa = grad_stats(a, 1.0f / 1024, &pool), sb = grad_stats(b, 1.0f / 1024, nullptr);
    ASSERT_EQ(sa.norm, sb.norm);
    ASSERT_EQ(sa.norm, global_grad_norm(a, 1.0f / 1024));
    const float coef = clip_coefficient(sa.norm, 1.0f);
    oa.step({.inv_scale = 1.0f / 1024, .clip_coef = coef}, &pool);
    ob.step({.inv_scale = 1.0f / 1024, .clip_coef = coef}, nullptr);
    ASSERT_EQ(test::snapshot(a), test::snapshot(b));
  }
}

TEST(FusedStep, StochasticRoundingIsUnbiasedAndSeeded) {
  // Pure bf16 weights at 1.0 with a tiny SGD update (well below half an ulp):
  // round to nearest never moves, stochastic rounding moves about the right fraction.
  const std::size_t n = 1 << 16;
  auto run = [&](Rounding r, std::uint64_t seed) {
    ParamStore s({{"w", {n}}}, {.model = DType::bf16, .grads = DType::f32, .master = false, .state_slots = 0});
    for (auto& w : s.model<bf16>(0)) w = bf16(1.0f);
    for (float& g : s.grads<float>(0)) g = 1.0f;
    SGD opt(s, SgdConfig{.lr = 0x1p-10}, PureOptions{.rounding = r, .seed = seed});  // update -2^-10; ulp below 1 is 2^-8
    opt.step({});
    double sum = 0;
    for (auto w : s.model<bf16>(0)) sum += static_cast<double>(static_cast<float>(w));
    return std::pair{sum / n, test::bytes_of(s.model_data(), n * 2)};
  };
  EXPECT_EQ(run(Rounding::nearest_even, 0).first, 1.0);
  const auto [mean, bits1] = run(Rounding::stochastic, 1);
  EXPECT_NEAR(mean, 1.0 - 0x1p-10, 0x1p-10 * 0.05);
  EXPECT_EQ(run(Rounding::stochastic, 1).second, bits1);
  EXPECT_NE(run(Rounding::stochastic, 2).second, bits1);
}

}  // namespace
}  // namespace mixprec
