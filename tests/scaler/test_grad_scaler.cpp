// The GradScaler protocol: stages and misuse errors, skip outcomes, fused path
// == explicit-unscale path, clipping on the true norm, accumulation windows,
// several optimizers, enabled = false, f16/bf16 gradients, state round trips.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "mixprec/mixprec.hpp"
#include "mixprec/optim/clip.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/scaler/grad_scaler.hpp"

namespace mixprec {
namespace {

std::vector<ParamSpec> specs() { return {{"w1", {3, 5}}, {"b1", {5}}, {"w2", {5, 2}}}; }

ParamStore make_store(DType grads, DType model = DType::f16) {
  ParamStore s(specs(), StoreOptions{model, grads, true, 2});
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  for (std::size_t i = 0; i < s.tensor_count(); ++i) {
    for (float& w : s.master(i)) w = nd(rng);
  }
  s.refresh_model();
  return s;
}

// Writes grads = scale * g for a deterministic g (per step), in the store's grad dtype.
void write_grads(ParamStore& s, float scale, int step, float poison = 0.0f, std::size_t poison_tensor = 0) {
  std::mt19937 rng(100 + static_cast<unsigned>(step));
  std::normal_distribution<float> nd(0.0f, 1e-3f);
  for (std::size_t i = 0; i < s.tensor_count(); ++i) {
    for (std::size_t k = 0; k < s.numel(i); ++k) {
      float g = nd(rng) * scale;
      if (poison != 0.0f && i == poison_tensor && k == 1) g = poison;
      switch (s.grad_dtype()) {
        case DType::f32: s.grads<float>(i)[k] = g; break;
        case DType::f16: s.grads<f16>(i)[k] = f16(g); break;
        case DType::bf16: s.grads<bf16>(i)[k] = bf16(g); break;
      }
    }
  }
}

std::vector<std::uint32_t> master_bits(const ParamStore& s) {
  std::vector<std::uint32_t> v;
  for (std::size_t i = 0; i < s.tensor_count(); ++i) {
    for (float w : s.master(i)) v.push_back(std::bit_cast<std::uint32_t>(w));
  }
  return v;
}

LossScaleConfig small_torch(double init = 1024.0, std::int64_t interval = 3) {
  LossScaleConfig c = loss_scale_preset("torch");
  c.init_scale = init;
  c.growth_interval = interval;
  return c;
}

StepOptions clip_to(float max_norm) {
  StepOptions o;
  o.max_grad_norm = max_norm;
  return o;
}

template <class F>
void expect_logic_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected std::logic_error containing '" << needle << "'";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GradScaler, MisuseIsNamed) {
  ParamStore s = make_store(DType::f32);
  Adam opt(s, {});
  GradScaler scaler(small_torch());
  expect_logic_error([&] { scaler.update(); }, "No inf checks were recorded prior to update()");
  write_grads(s, scaler.get_scale(), 0);
  scaler.unscale(opt);
  EXPECT_EQ(scaler.stage(opt), OptimizerStage::unscaled);
  expect_logic_error([&] { scaler.unscale(opt); }, "unscale() has already been called on this optimizer");
  scaler.step(opt);
  EXPECT_EQ(scaler.stage(opt), OptimizerStage::stepped);
  expect_logic_error([&] { scaler.step(opt); }, "step() has already been called since the last update()");
  expect_logic_error([&] { scaler.unscale(opt); }, "unscale() is being called after step()");
  scaler.update();
  EXPECT_EQ(scaler.stage(opt), OptimizerStage::ready);
}

TEST(GradScaler, OverflowSkipsAndReportsTheFirstTensor) {
  ParamStore s = make_store(DType::f16);
  Adam opt(s, {});
  GradScaler scaler(small_torch(1024.0));
  write_grads(s, scaler.get_scale(), 0, INFINITY, /*poison_tensor=*/1);
  const auto before = master_bits(s);
  const StepOutcome out = scaler.step(opt);
  EXPECT_FALSE(out.applied);
  EXPECT_TRUE(out.found_inf);
  EXPECT_EQ(out.scale, 1024.0f);
  EXPECT_EQ(out.first_overflow, 1);
  EXPECT_EQ(out.first_overflow_name, "b1");
  EXPECT_FALSE(std::isfinite(out.grad_norm));
  EXPECT_EQ(master_bits(s), before) << "a skipped step must not touch the weights";
  EXPECT_EQ(opt.step_count(), 0) << "a skipped step must not advance Adam's step counter";
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0f);  // backed off

  write_grads(s, scaler.get_scale(), 1);
  const StepOutcome ok = scaler.step(opt);
  EXPECT_TRUE(ok.applied);
  EXPECT_FALSE(ok.found_inf);
  EXPECT_EQ(ok.first_overflow, -1);
  EXPECT_TRUE(std::isfinite(ok.grad_norm));
  EXPECT_EQ(opt.step_count(), 1);
  scaler.update();
}

// A NaN placed in the last tensor, then in the first: first_overflow follows it.
TEST(GradScaler, FirstOverflowIsTheLowestIndex) {
  ParamStore s = make_store(DType::bf16);
  SGD opt(s, {});
  GradScaler scaler(small_torch());
  write_grads(s, scaler.get_scale(), 0, NAN, 2);
  EXPECT_EQ(scaler.step(opt).first_overflow_name, "w2");
  scaler.update();
  write_grads(s, scaler.get_scale(), 0, NAN, 0);
  EXPECT_EQ(scaler.step(opt).first_overflow_name, "w1");
  scaler.update();
}

// The fused path and the explicit unscale() path give the same weights bit for bit
// (f32 gradients: unscaling in place is then exactly what the fused step computes).
TEST(GradScaler, FusedPathEqualsExplicitUnscale) {
  ParamStore a = make_store(DType::f32, DType::bf16), b = make_store(DType::f32, DType::bf16);
  AdamW oa(a, {}), ob(b, {});
  GradScaler sa(small_torch(3000.0, 2)), sb(small_torch(3000.0, 2));  // not a power of two
  for (int step = 0; step < 12; ++step) {
    const float poison = step == 5 ? INFINITY : 0.0f;
    write_grads(a, sa.get_scale(), step, poison);
    write_grads(b, sb.get_scale(), step, poison);
    const StepOutcome fa = sa.step(oa, clip_to(2e-3f));
    sb.unscale(ob);
    const StepOutcome fb = sb.step(ob, clip_to(2e-3f));
    EXPECT_EQ(fa.applied, fb.applied) << "step " << step;
    EXPECT_EQ(fa.clip_coef, fb.clip_coef) << "step " << step;
    sa.update();
    sb.update();
    ASSERT_EQ(master_bits(a), master_bits(b)) << "step " << step;
    EXPECT_EQ(sa.get_scale(), sb.get_scale());
  }
  EXPECT_EQ(oa.step_count(), 11);
}

// Clipping uses the true (unscaled) norm: the norm a scaler reports for grads
// scaled by S equals the norm of the unscaled grads (S a power of two: exact).
TEST(GradScaler, ClipsOnTheUnscaledNorm) {
  ParamStore scaled = make_store(DType::f32), plain = make_store(DType::f32);
  Adam os(scaled, {}), op(plain, {});
  GradScaler with(small_torch(65536.0)), without(small_torch(1.0));
  write_grads(scaled, 65536.0f, 0);
  write_grads(plain, 1.0f, 0);
  const StepOutcome a = with.step(os, clip_to(1e-3f));
  const StepOutcome b = without.step(op, clip_to(1e-3f));
  EXPECT_EQ(a.grad_norm, b.grad_norm);
  EXPECT_LT(a.clip_coef, 1.0f);
  EXPECT_EQ(a.clip_coef, clip_coefficient(b.grad_norm, 1e-3f));
  EXPECT_EQ(master_bits(scaled), master_bits(plain));
}

TEST(GradScaler, AccumulationWindow) {
  ParamStore s = make_store(DType::f32);
  Adam opt(s, {});
  GradScaler scaler(small_torch(1.0, 1));  // would grow after every clean step
  scaler.set_accumulation_steps(3);
  const float scale0 = scaler.get_scale();
  scaler.backward_done();
  expect_logic_error([&] { scaler.step(opt); }, "after 1 of 3 backward passes");
  expect_logic_error([&] { scaler.unscale(opt); }, "after 1 of 3 backward passes");
  expect_logic_error([&] { scaler.update(); }, "update() after 1 of 3 backward passes");
  EXPECT_EQ(scaler.get_scale(), scale0) << "one scale for the whole window";
  scaler.backward_done();
  scaler.backward_done();
  expect_logic_error([&] { scaler.backward_done(); }, "in an accumulation window of 3");
  write_grads(s, scaler.get_scale(), 0);
  EXPECT_TRUE(scaler.step(opt).applied);
  expect_logic_error([&] { scaler.backward_done(); }, "before update()");
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 2.0f * scale0);
  EXPECT_EQ(scaler.backward_passes(), 0);
  EXPECT_THROW(scaler.set_accumulation_steps(0), std::invalid_argument);
}

TEST(GradScaler, SeveralOptimizersSkipOnTheirOwnAndBackOffTogether) {
  ParamStore s1 = make_store(DType::f32), s2 = make_store(DType::f16);
  Adam o1(s1, {});
  SGD o2(s2, {});
  GradScaler scaler(small_torch(256.0));
  write_grads(s1, scaler.get_scale(), 0);
  write_grads(s2, scaler.get_scale(), 0, -INFINITY);
  EXPECT_TRUE(scaler.step(o1).applied);
  EXPECT_FALSE(scaler.step(o2).applied);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 128.0f);
  EXPECT_EQ(o1.step_count(), 1);
  EXPECT_EQ(o2.step_count(), 0);
  // The other way round: whichever optimizer's record update() reads last, an overflow
  // in any one of them backs the scale off (not only the last one's).
  write_grads(s1, scaler.get_scale(), 1, INFINITY);
  write_grads(s2, scaler.get_scale(), 1);
  EXPECT_FALSE(scaler.step(o1).applied);
  EXPECT_TRUE(scaler.step(o2).applied);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 64.0f);
  EXPECT_EQ(o1.step_count(), 1);
  EXPECT_EQ(o2.step_count(), 1);
  // And a clean window in both grows nothing yet (interval 3) but keeps the scale.
  write_grads(s1, scaler.get_scale(), 2);
  write_grads(s2, scaler.get_scale(), 2);
  EXPECT_TRUE(scaler.step(o1).applied);
  EXPECT_TRUE(scaler.step(o2).applied);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 64.0f);
}

TEST(GradScaler, DisabledIsAPassThrough) {
  ParamStore s = make_store(DType::f32), ref = make_store(DType::f32);
  Adam opt(s, {}), ref_opt(ref, {});
  GradScaler scaler(small_torch(1024.0), /*enabled=*/false);
  EXPECT_EQ(scaler.scale(3.5f), 3.5f);
  EXPECT_EQ(scaler.get_scale(), 1.0f);
  write_grads(s, 1.0f, 0);
  write_grads(ref, 1.0f, 0);
  scaler.unscale(opt);  // no-op
  EXPECT_TRUE(scaler.step(opt).applied);
  scaler.update();  // no-op, and no error
  ref_opt.step({});
  EXPECT_EQ(master_bits(s), master_bits(ref));
  // Still refuses to write a NaN into the weights.
  write_grads(s, 1.0f, 1, NAN);
  const StepOutcome out = scaler.step(opt);
  EXPECT_FALSE(out.applied);
  EXPECT_TRUE(out.found_inf);
}

TEST(GradScaler, StateRoundTripAndValidation) {
  ParamStore s = make_store(DType::f32);
  Adam opt(s, {});
  GradScaler a(loss_scale_preset("deepspeed"));
  a.set_accumulation_steps(2);
  for (int step = 0; step < 7; ++step) {
    a.backward_done();
    a.backward_done();
    write_grads(s, a.get_scale(), step, step == 2 || step == 3 ? INFINITY : 0.0f);
    a.step(opt);
    a.update();
  }
  const std::string json = a.state_json();
  GradScaler b(small_torch(), false);
  b.load_state_json(json);
  EXPECT_EQ(b.state_json(), json);
  EXPECT_TRUE(b.enabled());
  EXPECT_EQ(b.accumulation_steps(), 2);
  EXPECT_EQ(b.loss_scale().counters(), a.loss_scale().counters());
  EXPECT_EQ(b.get_scale(), a.get_scale());

  // Bad states change nothing.
  const std::string before = b.state_json();
  for (const std::string& bad : {std::string("{"), std::string("[]"), std::string(R"({"format":"other"})"),
                                std::string(R"({"format":"mixprec.grad_scaler","version":2})"),
                                std::string(R"({"format":"mixprec.grad_scaler","version":1,"enabled":1})"),
                                std::string(R"({"format":"mixprec.grad_scaler","version":1,"enabled":true,)"
                                            R"("accumulation_steps":0,"loss_scale":{}})"),
                                std::string(R"({"format":"mixprec.grad_scaler","version":1,"enabled":true,)"
                                            R"("accumulation_steps":1,"loss_scale":{"format":"x"}})")}) {
    EXPECT_THROW(b.load_state_json(bad), std::invalid_argument) << bad;
    EXPECT_EQ(b.state_json(), before) << bad;
  }
  // Not in the middle of a step.
  write_grads(s, b.get_scale(), 9);
  b.backward_done();
  b.backward_done();
  b.unscale(opt);
  expect_logic_error([&] { b.load_state_json(json); }, "in the middle of a step");
}

TEST(GradScaler, CollapseIsReported) {
  ParamStore s = make_store(DType::f32);
  SGD opt(s, {});
  LossScaleConfig c = loss_scale_preset("mixprec");
  c.init_scale = 2.0;
  c.max_floor_overflows = 3;
  GradScaler scaler(c);
  bool threw = false;
  for (int step = 0; step < 10 && !threw; ++step) {
    write_grads(s, scaler.get_scale(), step, NAN);
    scaler.step(opt);
    try {
      scaler.update();
    } catch (const ScaleCollapseError& e) {
      threw = true;
      EXPECT_NE(std::string(e.what()).find("floor"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(threw);
  EXPECT_EQ(opt.step_count(), 0);
}

// A scale below 1 can make finite gradients overflow when unscaled; the step
// must be skipped rather than write inf into the weights.
TEST(GradScaler, OverflowCreatedByUnscalingIsSkipped) {
  ParamStore s = make_store(DType::f32);
  Adam opt(s, {});
  LossScaleConfig c = loss_scale_preset("torch");
  c.init_scale = 0x1p-10;
  GradScaler scaler(c);
  write_grads(s, 1.0f, 0, 3.0e38f);  // finite, but times 2^10 it is inf
  const auto before = master_bits(s);
  const StepOutcome out = scaler.step(opt);
  EXPECT_FALSE(out.applied);
  EXPECT_TRUE(out.found_inf);
  EXPECT_EQ(out.first_overflow, 0) << "the tensor whose unscaled value overflows is named";
  EXPECT_EQ(master_bits(s), before);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 0x1p-11f);
}

// The keras preset follows Keras 3: no floor. A scale below 1 unscales by 1/S > 1; for a
// power of two the weights equal those of a run at scale 1 on the same gradients.
TEST(GradScaler, KerasScaleBelowOneUnscalesUp) {
  ParamStore a = make_store(DType::f32), b = make_store(DType::f32);
  Adam oa(a, {}), ob(b, {});
  LossScaleConfig c = loss_scale_preset("keras");
  c.init_scale = 0x1p-10;
  GradScaler below(c), one(small_torch(1.0, 1000));
  for (int step = 0; step < 4; ++step) {
    write_grads(a, below.get_scale(), step);
    write_grads(b, 1.0f, step);
    const StepOutcome oa_out = below.step(oa);
    const StepOutcome ob_out = one.step(ob);
    EXPECT_TRUE(oa_out.applied);
    EXPECT_EQ(oa_out.grad_norm, ob_out.grad_norm);
    below.update();
    one.update();
    ASSERT_EQ(master_bits(a), master_bits(b)) << "step " << step;
  }
  EXPECT_EQ(below.get_scale(), 0x1p-10f);
}

// Keras 3 can grow the scale to inf (no finite guard). Its scaled loss is then inf, every
// gradient non-finite, every step skipped, and inf * 0.5 stays inf. mixprec does the same
// without throwing on the inverse scale 0: found_inf, nothing written, on both paths.
TEST(GradScaler, KerasScaleInfSkipsEveryStep) {
  ParamStore s = make_store(DType::f32);
  Adam opt(s, {});
  LossScaleConfig c = loss_scale_preset("keras");
  c.init_scale = 0x1p127;
  c.growth_interval = 1;
  GradScaler scaler(c);
  write_grads(s, scaler.get_scale(), 0);
  EXPECT_TRUE(scaler.step(opt).applied);
  scaler.update();
  ASSERT_TRUE(std::isinf(scaler.get_scale()));
  for (int step = 1; step <= 6; ++step) {
    // Gradients of a loss scaled by inf (inf and NaN), or finite ones: skipped either way.
    write_grads(s, step % 2 ? scaler.get_scale() : 1.0f, step);
    const auto before = master_bits(s);
    std::vector<float> grads_before(s.grads<float>(0).begin(), s.grads<float>(0).end());
    StepOutcome out;
    if (step % 3 == 0) {
      ASSERT_NO_THROW(scaler.unscale(opt));
      const std::span<const float> g = s.grads<float>(0);
      for (std::size_t k = 0; k < g.size(); ++k)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(g[k]), std::bit_cast<std::uint32_t>(grads_before[k]))
            << "unscale() must not write when the scale cannot be inverted";
    }
    ASSERT_NO_THROW(out = scaler.step(opt));
    EXPECT_FALSE(out.applied) << "step " << step;
    EXPECT_TRUE(out.found_inf) << "step " << step;
    EXPECT_TRUE(std::isinf(out.scale));
    EXPECT_TRUE(std::isnan(out.grad_norm));
    EXPECT_EQ(out.first_overflow, step % 2 ? 0 : -1) << "step " << step;
    EXPECT_EQ(out.first_overflow_name, step % 2 ? "w1" : "") << "step " << step;
    EXPECT_EQ(master_bits(s), before);
    scaler.update();
    EXPECT_TRUE(std::isinf(scaler.get_scale())) << "the scale never recovers";
  }
  EXPECT_EQ(opt.step_count(), 1);
  GradScaler copy(loss_scale_preset("keras"));
  copy.load_state_json(scaler.state_json());
  EXPECT_TRUE(std::isinf(copy.get_scale()));
}

// A scale of 0 (Keras 3's halving underflows to it after 165 overflows from 2^15) or one so
// small that 1/S overflows float32 cannot unscale either: skipped, where Keras 3 would divide
// 0 by 0 and write NaN into the weights.
TEST(GradScaler, KerasScaleZeroOrTinySkips) {
  for (double init : {0x1p-149, 0x1p-140}) {
    ParamStore s = make_store(DType::f32);
    SGD opt(s, {});
    LossScaleConfig c = loss_scale_preset("keras");
    c.init_scale = init;
    GradScaler scaler(c);
    if (init == 0x1p-149) {  // one overflow: 2^-150 rounds to 0
      write_grads(s, 1.0f, 0, INFINITY);
      EXPECT_FALSE(scaler.step(opt).applied);
      scaler.update();
      ASSERT_EQ(scaler.get_scale(), 0.0f);
    }
    write_grads(s, scaler.get_scale(), 1);
    const auto before = master_bits(s);
    StepOutcome out;
    ASSERT_NO_THROW(out = scaler.step(opt)) << init;
    EXPECT_FALSE(out.applied) << init;
    EXPECT_TRUE(out.found_inf) << init;
    EXPECT_EQ(out.first_overflow, -1) << init;
    EXPECT_EQ(master_bits(s), before) << init;
    scaler.update();
  }
}

TEST(GradScaler, RejectsBadStepOptions) {
  ParamStore s = make_store(DType::f32);
  SGD opt(s, {});
  GradScaler scaler(small_torch());
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    EXPECT_THROW(scaler.step(opt, clip_to(bad)), std::invalid_argument) << bad;
    EXPECT_EQ(scaler.stage(opt), OptimizerStage::ready);
  }
}

}  // namespace
}  // namespace mixprec

namespace mixprec {
namespace {

// Independent scalers on independent threads share ThreadPool::global(): a busy pool runs
// the other caller's split inline (it used to throw "already running a task").
TEST(GradScaler, IndependentScalersOnFourThreads) {
  constexpr int kSteps = 200;
  std::vector<float> finals(4, 0.0f);
  std::vector<int> wrong(4, 0);
  auto worker = [&](int t) {
    ParamStore s({{"w", {std::size_t{1} << 20}}}, StoreOptions{DType::f32, DType::f32, true, 0});
    SGD opt(s, {});
    LossScaleConfig c = small_torch(1024.0, 50);
    GradScaler scaler(c);
    for (int step = 0; step < kSteps; ++step) {
      for (float& g : s.grads<float>(0)) g = 1024.0f;
      if (step % 37 == 0) s.grads<float>(0)[7] = NAN;
      const StepOutcome out = scaler.step(opt);
      if (out.applied != (step % 37 != 0)) ++wrong[static_cast<std::size_t>(t)];
      scaler.update();
    }
    finals[static_cast<std::size_t>(t)] = scaler.get_scale();
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong, std::vector<int>(4, 0));
  for (float f : finals) EXPECT_EQ(f, finals[0]);
  EXPECT_GT(finals[0], 0.0f);
}

}  // namespace
}  // namespace mixprec

namespace mixprec {
namespace {

TEST(GradScaler, RankAgreementSkipsWhenAnotherRankOverflowed) {
  ParamStore s = make_store(DType::f32);
  SGD opt(s, {});
  GradScaler scaler(small_torch(64.0, 100));
  int calls = 0;
  scaler.set_rank_agreement([&](RankFlags local) {
    ++calls;
    return RankFlags{true, local.checked};
  });
  write_grads(s, scaler.get_scale(), 0);
  const auto before = master_bits(s);
  const StepOutcome out = scaler.step(opt);
  EXPECT_FALSE(out.applied);
  EXPECT_TRUE(out.found_inf);
  EXPECT_EQ(master_bits(s), before);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32.0f);
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace mixprec
