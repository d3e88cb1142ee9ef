// ParamStore views and errors, optimizer validation, state save/load, clipping,
// the learning-rate schedule and memory accounting.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "mixprec/optim/clip.hpp"
#include "mixprec/nn/memory.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/schedule.hpp"
#include "mlp.hpp"
#include "support.hpp"

namespace mixprec {
namespace {

using test::error_of;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(ParamStore, LayoutIsOneAlignedBlockWithNamedViews) {
  ParamStore s({{"w", {3, 5}}, {"b", {5}}, {"s", {}}, {"e", {0}}},
               {.model = DType::bf16, .grads = DType::f16, .master = true, .state_slots = 2});
  EXPECT_EQ(s.tensor_count(), 4u);
  EXPECT_EQ(s.param_count(), 15u + 5u + 1u);
  EXPECT_EQ(s.numel(s.index_of("s")), 1u);
  EXPECT_EQ(s.numel(s.index_of("e")), 0u);
  EXPECT_EQ(s.offset(0), 0u);
  EXPECT_EQ(s.offset(1), 32u);
  EXPECT_EQ(s.offset(2), 64u);
  EXPECT_EQ(s.flat_size(), 96u);
  EXPECT_EQ(s.bytes(), 96u * (4 + 2 + 2 + 8));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s.master_data()) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s.model<bf16>("b").data()) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s.grads<f16>(1).data()) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s.state(1, 1).data()) % 64, 0u);
  s.master("b")[2] = 1.5f;
  s.refresh_model();
  EXPECT_EQ(static_cast<float>(s.model<bf16>(1)[2]), 1.5f);
  const auto views = s.grad_tensors();
  ASSERT_EQ(views.size(), 4u);
  EXPECT_EQ(views[1].data, s.grads<f16>(1).data());
  EXPECT_EQ(views[1].size, 5u);
  EXPECT_EQ(views[1].dtype, DType::f16);
  EXPECT_EQ(s.flat_grads().size, 96u);
}

TEST(ParamStore, ErrorsNameWhatWasExpectedAndFound) {
  EXPECT_NE(error_of<std::invalid_argument>([] { ParamStore({}, {}); }).find("expected at least one tensor"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { ParamStore({{"a", {1}}, {"a", {2}}}, {}); }).find("duplicate tensor name 'a'"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { ParamStore({{"", {1}}}, {}); }).find("empty name"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { ParamStore({{"a", {1}}}, {.state_slots = 3}); }).find("state_slots must be 0, 1 or 2, found 3"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { ParamStore({{"a", {std::size_t{1} << 40, std::size_t{1} << 40}}}, {}); }).find("overflows"),
            std::string::npos);
  ParamStore s({{"w", {4}}}, {.model = DType::f16, .grads = DType::f32, .master = false, .state_slots = 0});
  EXPECT_NE(error_of<std::invalid_argument>([&] { s.index_of("nope"); }).find("no tensor named 'nope'; tensors: w"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { s.model<bf16>(0); }).find("model view of type bf16 requested, but the model region holds f16"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { s.master(0); }).find("expected a store with master weights"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { s.state(0, 0); }).find("state slot 0 out of range"), std::string::npos);
}

TEST(Optimizer, RejectsBadHyperparametersAndStores) {
  ParamStore s({{"w", {4}}}, {.state_slots = 1});
  EXPECT_NE(error_of<std::invalid_argument>([&] { Adam(s, {}); }).find("expected a store with 2 state slots, found 1"), std::string::npos);
  ParamStore s2({{"w", {4}}}, {});
  EXPECT_NE(error_of<std::invalid_argument>([&] { Adam(s2, {.lr = -1}); }).find("expected lr finite and >= 0, found -1"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { Adam(s2, {.beta1 = 1.0}); }).find("beta1 in [0, 1)"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { Adam(s2, {.eps = std::nan("")}); }).find("eps finite"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { SGD(s2, {.momentum = 0.0, .nesterov = true}); }).find("expected momentum > 0 for nesterov, found 0"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { SGD(s2, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}); }).find("dampening == 0"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { SGD(s2, {}, PureOptions{.rounding = Rounding::stochastic}); }).find("stochastic rounding"),
            std::string::npos);
}

TEST(Optimizer, StepValidatesBeforeWritingAnything) {
  ParamStore s(test::Mlp::specs(), {.model = DType::f16, .grads = DType::f16, .master = true, .state_slots = 2});
  test::Mlp::init(s, 1);
  for (auto& g : s.grads<f16>(0)) g = f16(0.5f);
  Adam opt(s, {});
  const auto before = test::snapshot(s);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step({.inv_scale = 0.0f}); }).find("expected inv_scale finite and > 0, found 0"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step({.inv_scale = kInf}); }).find("inv_scale"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step({.clip_coef = kNaN}); }).find("set skip instead"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step({.clip_coef = -1.0f}); }).find("clip_coef finite and >= 0"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step({.lr = -0.5}); }).find("lr finite and >= 0, found -0.5"), std::string::npos);
  std::vector<float> small(3), scratch(opt.unfused_scratch_size());
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step_unfused({}, small); }).find("scratch of at least"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step_unfused({.clip_coef = 0.5f}, scratch); }).find("pass max_norm instead"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step_unfused({}, scratch, 0.0f); }).find("max_norm finite and > 0"), std::string::npos);
  EXPECT_EQ(test::snapshot(s), before);
  EXPECT_EQ(opt.step_count(), 0);
  // An overflowed gradient with clipping but no skip: the unfused path refuses too.
  s.grads<f16>(0)[0] = f16(kInf);
  EXPECT_NE(error_of<std::invalid_argument>([&] { opt.step_unfused({}, scratch, 1.0f); }).find("not finite"), std::string::npos);
  EXPECT_EQ(test::snapshot(s), before);
}

TEST(Optimizer, AdamFirstStepMovesEachWeightByAboutLr) {
  // PyTorch: after one step m_hat = g and v_hat = g^2, so p -= lr * g / (|g| + eps).
  ParamStore s({{"w", {4}}}, {.model = DType::f32, .grads = DType::f32, .master = true, .state_slots = 2});
  const float g[4] = {0.5f, -2.0f, 1e-3f, 3.0f};
  for (int i = 0; i < 4; ++i) {
    s.master(0)[static_cast<std::size_t>(i)] = 1.0f;
    s.grads<float>(0)[static_cast<std::size_t>(i)] = g[i];
  }
  Adam opt(s, {.lr = 0.1});
  ASSERT_TRUE(opt.step({}));
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(s.master(0)[static_cast<std::size_t>(i)], 1.0f - 0.1f * (g[i] > 0 ? 1.0f : -1.0f), 1e-5f) << i;
  EXPECT_EQ(s.model<float>(0)[0], s.master(0)[0]);
  EXPECT_FLOAT_EQ(s.state(0, 0)[1], 0.1f * -2.0f);          // m = (1 - beta1) g
  EXPECT_FLOAT_EQ(s.state(1, 0)[3], 0.001f * 9.0f);         // v = (1 - beta2) g^2
}

TEST(Optimizer, SgdMatchesPyTorchByHand) {
  ParamStore s({{"w", {1}}}, {.model = DType::f32, .grads = DType::f32, .master = true, .state_slots = 1});
  s.master(0)[0] = 1.0f;
  SGD opt(s, {.lr = 0.5, .momentum = 0.5, .dampening = 0.5, .weight_decay = 0.25});
  s.grads<float>(0)[0] = 1.0f;
  opt.step({});  // d = 1 + 0.25 = 1.25; buf = 1.25 (first step: no dampening); p = 1 - 0.625
  EXPECT_EQ(s.master(0)[0], 0.375f);
  EXPECT_EQ(s.state(0, 0)[0], 1.25f);
  opt.step({});  // d = 1 + 0.09375 = 1.09375; buf = 0.625 + 0.546875 = 1.171875; p = 0.375 - 0.5859375
  EXPECT_EQ(s.state(0, 0)[0], 1.171875f);
  EXPECT_EQ(s.master(0)[0], 0.375f - 0.5859375f);
}

TEST(Optimizer, SaveAndLoadResumesBitwise) {
  const StoreOptions so{.model = DType::bf16, .grads = DType::f16, .master = true, .state_slots = 2};
  ParamStore a(test::Mlp::specs(), so);
  test::Mlp::init(a, 4);
  AdamW oa(a, {.lr = 3e-3, .weight_decay = 0.05});
  auto grads = [](ParamStore& s, int step) {
    for (std::size_t t = 0; t < s.tensor_count(); ++t) {
      auto g = s.grads<f16>(t);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = f16(std::sin(static_cast<float>(i * 7 + t * 3 + step)) * 100.0f);
    }
  };
  for (int k = 0; k < 3; ++k) {
    grads(a, k);
    oa.step({.inv_scale = 1.0f / 128});
  }
  // "Checkpoint": the state struct, the master weights and the moments.
  const OptimizerState saved = oa.state();
  EXPECT_EQ(saved.step, 3);
  std::vector<float> master(a.master_data(), a.master_data() + a.flat_size());
  std::vector<float> m(a.state_data(0), a.state_data(0) + a.flat_size()), v(a.state_data(1), a.state_data(1) + a.flat_size());

  ParamStore b(test::Mlp::specs(), so);
  AdamW ob(b, {.lr = 1.0});
  // Validation happens before anything changes.
  OptimizerState wrong = saved;
  wrong.kind = OptimizerKind::adam;
  EXPECT_NE(error_of<std::invalid_argument>([&] { ob.load_state(wrong); }).find("expected kind adamw, found adam"), std::string::npos);
  wrong = saved;
  wrong.flat_size += 32;
  EXPECT_NE(error_of<std::invalid_argument>([&] { ob.load_state(wrong); }).find("parameters"), std::string::npos);
  wrong = saved;
  wrong.beta2 = 1.5;
  EXPECT_NE(error_of<std::invalid_argument>([&] { ob.load_state(wrong); }).find("beta2"), std::string::npos);
  wrong = saved;
  wrong.step = -1;
  EXPECT_NE(error_of<std::invalid_argument>([&] { ob.load_state(wrong); }).find("step >= 0"), std::string::npos);
  EXPECT_EQ(ob.step_count(), 0);
  EXPECT_EQ(ob.lr(), 1.0);

  ob.load_state(saved);
  std::memcpy(b.master_data(), master.data(), master.size() * 4);
  std::memcpy(b.state_data(0), m.data(), m.size() * 4);
  std::memcpy(b.state_data(1), v.data(), v.size() * 4);
  b.refresh_model();
  EXPECT_EQ(ob.state(), saved);
  for (int k = 3; k < 6; ++k) {
    grads(a, k);
    grads(b, k);
    oa.step({.inv_scale = 1.0f / 128});
    ob.step({.inv_scale = 1.0f / 128});
  }
  EXPECT_EQ(test::snapshot(a), test::snapshot(b));
  EXPECT_EQ(ob.step_count(), 6);
}

TEST(Clip, CoefficientFollowsPyTorchAndNeverHidesAnOverflow) {
  EXPECT_EQ(clip_coefficient(0.0, 1.0f), 1.0f);
  EXPECT_EQ(clip_coefficient(0.5, 1.0f), 1.0f);
  EXPECT_EQ(clip_coefficient(4.0, 1.0f), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_TRUE(std::isnan(clip_coefficient(std::numeric_limits<double>::infinity(), 1.0f)));
  EXPECT_TRUE(std::isnan(clip_coefficient(std::nan(""), 1.0f)));
  EXPECT_NE(error_of<std::invalid_argument>([] { clip_coefficient(1.0, 0.0f); }).find("expected max_norm finite and > 0, found 0"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { clip_coefficient(1.0, kInf); }).find("max_norm"), std::string::npos);
  // Small values as given, not std::to_string's "-0.000000".
  EXPECT_EQ(error_of<std::invalid_argument>([] { clip_coefficient(1.0, -1e-12f); }),
            "clip_coefficient: expected max_norm finite and > 0, found -1e-12");
  EXPECT_EQ(error_of<std::invalid_argument>([] { WarmupCosine{.base_lr = 1e-7, .min_lr = 2e-7}.validate(); }),
            "WarmupCosine: expected 0 <= min_lr <= base_lr, found min_lr 2e-07");
}

TEST(Clip, GradStatsFlagsInfAndNaNAndComputesTheUnscaledNorm) {
  ParamStore s({{"a", {3}}, {"b", {2}}}, {.model = DType::f16, .grads = DType::bf16, .master = true, .state_slots = 0});
  auto a = s.grads<bf16>(0), b = s.grads<bf16>(1);
  a[0] = bf16(3.0f * 64);
  b[1] = bf16(4.0f * 64);
  GradStats st = grad_stats(s, 1.0f / 64);
  EXPECT_FALSE(st.found_inf);
  EXPECT_EQ(st.norm, 5.0);
  EXPECT_EQ(st.sum_squares, 25.0);
  EXPECT_EQ(global_grad_norm(s, 1.0f / 64), 5.0);
  b[0] = bf16(kNaN);
  st = grad_stats(s, 1.0f / 64);
  EXPECT_TRUE(st.found_inf);
  EXPECT_TRUE(std::isnan(clip_coefficient(st.norm, 1.0f)));
  b[0] = bf16(-kInf);
  st = grad_stats(s, 1.0f / 64);
  EXPECT_TRUE(st.found_inf);
  EXPECT_TRUE(std::isnan(clip_coefficient(st.norm, 1.0f)));
  EXPECT_NE(error_of<std::invalid_argument>([&] { grad_stats(s, 0.0f); }).find("inv_scale"), std::string::npos);
  float u[3] = {3.0f, 0.0f, 4.0f};
  const GradTensor t{u, 3, DType::f32};
  EXPECT_EQ(global_grad_norm(std::span<const GradTensor>(&t, 1)), 5.0);
}

TEST(Schedule, WarmupThenCosineToMin) {
  const WarmupCosine w{.base_lr = 1.0, .warmup_steps = 4, .total_steps = 14, .min_lr = 0.1};
  EXPECT_DOUBLE_EQ(w.lr_at(0), 0.25);
  EXPECT_DOUBLE_EQ(w.lr_at(3), 1.0);
  EXPECT_DOUBLE_EQ(w.lr_at(4), 1.0);
  EXPECT_DOUBLE_EQ(w.lr_at(9), 0.1 + 0.5 * 0.9);  // halfway through the decay
  EXPECT_NEAR(w.lr_at(13), 0.1 + 0.5 * (1 + std::cos(M_PI * 0.9)) * 0.9, 1e-15);
  EXPECT_DOUBLE_EQ(w.lr_at(14), 0.1);
  EXPECT_DOUBLE_EQ(w.lr_at(1000), 0.1);
  for (std::int64_t k = 5; k < 14; ++k) EXPECT_LT(w.lr_at(k), w.lr_at(k - 1));
  const WarmupCosine none{.base_lr = 2.0, .warmup_steps = 0, .total_steps = 10, .min_lr = 0.0};
  EXPECT_DOUBLE_EQ(none.lr_at(0), 2.0);
  EXPECT_NE(error_of<std::invalid_argument>([] { WarmupCosine{.warmup_steps = 5, .total_steps = 4}.validate(); }).find("warmup_steps"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { WarmupCosine{.base_lr = 1, .min_lr = 2}.validate(); }).find("min_lr"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { WarmupCosine{.total_steps = 0}.validate(); }).find("total_steps >= 1, found 0"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { (void)w.lr_at(-1); }).find("step >= 0"), std::string::npos);
}

TEST(Schedule, AdvancesOnAppliedStepsOnlyUnlessAsked) {
  const WarmupCosine w{.base_lr = 1.0, .warmup_steps = 4, .total_steps = 14, .min_lr = 0.1};
  LrSchedule applied(w), every(w, ScheduleAdvance::every_step);
  for (bool ok : {true, false, false, true, true}) {
    applied.on_step(ok);
    every.on_step(ok);
  }
  EXPECT_EQ(applied.position(), 3);
  EXPECT_EQ(every.position(), 5);
  EXPECT_DOUBLE_EQ(applied.lr(), w.lr_at(3));
  EXPECT_DOUBLE_EQ(every.lr(), w.lr_at(5));
  applied.set_position(10);
  EXPECT_DOUBLE_EQ(applied.lr(), w.lr_at(10));
  EXPECT_THROW(applied.set_position(-2), std::invalid_argument);
  EXPECT_THROW(LrSchedule(WarmupCosine{.total_steps = 0}), std::invalid_argument);
}

TEST(Memory, AdamFp16IsFourPlusEightPlusFourPlusTwoBytesPerParameter) {
  const std::uint64_t p = 7'000'000'000ull;
  const MemoryPlan m = memory_plan(p, OptimizerKind::adam, nn::Precision::fp16);
  EXPECT_EQ(m.master_weights, 4 * p);
  EXPECT_EQ(m.moments, 8 * p);
  EXPECT_EQ(m.gradients, 4 * p);
  EXPECT_EQ(m.model_copy, 2 * p);
  EXPECT_EQ(m.total, 18 * p);
  EXPECT_EQ(memory_plan(p, OptimizerKind::adamw, nn::Precision::fp32).total, 16 * p);
  EXPECT_EQ(memory_plan(p, OptimizerKind::sgd, nn::Precision::bf16).total, 10 * p);
  EXPECT_EQ(memory_plan(p, OptimizerKind::sgd_momentum, nn::Precision::fp16).moments, 4 * p);
  const MemoryPlan pure = memory_plan(p, OptimizerKind::adam, nn::Precision::bf16_pure);
  EXPECT_EQ(pure.master_weights, 0u);
  EXPECT_EQ(pure.total, 12 * p);
  EXPECT_EQ(memory_plan(0, OptimizerKind::adam, nn::Precision::fp16).total, 0u);
  EXPECT_THROW(memory_plan(std::uint64_t{1} << 62, OptimizerKind::adam, nn::Precision::fp16), std::invalid_argument);
  EXPECT_EQ(nn::parse_precision("bf16-pure"), nn::Precision::bf16_pure);
  EXPECT_EQ(nn::parse_precision("fp8"), std::nullopt);
  EXPECT_EQ(parse_optimizer("sgd-momentum"), OptimizerKind::sgd_momentum);
  EXPECT_EQ(parse_optimizer("lamb"), std::nullopt);
}

TEST(Memory, StoreBytesMatchThePlan) {
  // A store padded to 32 elements holds exactly the plan's bytes (f32 grads, the seed's accounting).
  const std::size_t n = 4096;
  ParamStore s({{"w", {n}}}, {.model = DType::f16, .grads = DType::f32, .master = true, .state_slots = 2});
  EXPECT_EQ(s.bytes(), memory_plan(n, OptimizerKind::adam, nn::Precision::fp16).total);
}

}  // namespace
}  // namespace mixprec
