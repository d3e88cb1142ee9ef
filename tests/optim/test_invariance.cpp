// Scale invariance and skip invariance on a small MLP trained in fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <string>

#include "mixprec/optim/clip.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/schedule.hpp"
#include "mlp.hpp"

namespace mixprec {
namespace {

using test::Mlp;

enum class Opt { sgd, sgd_momentum, sgd_nesterov_wd, adam, adam_wd, adamw };
const Opt kOpts[] = {Opt::sgd, Opt::sgd_momentum, Opt::sgd_nesterov_wd, Opt::adam, Opt::adam_wd, Opt::adamw};
const char* opt_name(Opt o) {
  switch (o) {
    case Opt::sgd: return "sgd";
    case Opt::sgd_momentum: return "sgd_momentum_dampening";
    case Opt::sgd_nesterov_wd: return "sgd_nesterov_wd";
    case Opt::adam: return "adam";
    case Opt::adam_wd: return "adam_l2";
    case Opt::adamw: return "adamw";
  }
  return "?";
}

std::unique_ptr<Optimizer> make(Opt o, ParamStore& s) {
  switch (o) {
    case Opt::sgd: return std::make_unique<SGD>(s, SgdConfig{.lr = 0.05});
    case Opt::sgd_momentum: return std::make_unique<SGD>(s, SgdConfig{.lr = 0.05, .momentum = 0.9, .dampening = 0.1});
    case Opt::sgd_nesterov_wd:
      return std::make_unique<SGD>(s, SgdConfig{.lr = 0.05, .momentum = 0.8, .nesterov = true, .weight_decay = 1e-2});
    case Opt::adam: return std::make_unique<Adam>(s, AdamConfig{.lr = 1e-2});
    case Opt::adam_wd: return std::make_unique<Adam>(s, AdamConfig{.lr = 1e-2, .weight_decay = 1e-2});
    case Opt::adamw: return std::make_unique<AdamW>(s, AdamConfig{.lr = 1e-2, .weight_decay = 1e-1});
  }
  return nullptr;
}

ParamStore make_store() {
  ParamStore s(Mlp::specs(), {.model = DType::f32, .grads = DType::f32, .master = true, .state_slots = 2});
  Mlp::init(s, 7);
  return s;
}

struct RunResult {
  std::vector<std::uint8_t> snapshot;
  std::int64_t steps;
  std::vector<double> norms;
};

// Trains `batches` steps with a static loss scale; clipping when max_norm > 0.
// Batches in `overflow` get an inf injected into one gradient (the step must skip).
RunResult train(Opt o, float loss_scale, float max_norm, int batches, const std::set<int>& overflow,
                const std::set<int>& never_seen, bool fused = true) {
  ParamStore s = make_store();
  auto opt = make(o, s);
  std::vector<float> scratch(opt->unfused_scratch_size());
  LrSchedule sched(WarmupCosine{.base_lr = opt->lr(), .warmup_steps = 3, .total_steps = 20, .min_lr = opt->lr() / 10});
  RunResult r;
  for (int b = 0; b < batches; ++b) {
    if (never_seen.count(b)) continue;
    Mlp::backward(s, Mlp::batch(static_cast<std::uint32_t>(b)), loss_scale);
    if (overflow.count(b)) s.grads<float>("w2")[3] = std::numeric_limits<float>::infinity();
    const float inv = 1.0f / loss_scale;
    const GradStats st = grad_stats(s, inv);
    EXPECT_EQ(st.found_inf, overflow.count(b) == 1);
    StepControls c{.inv_scale = inv, .skip = st.found_inf, .lr = sched.lr()};
    bool applied;
    if (fused) {
      if (max_norm > 0) {
        c.clip_coef = clip_coefficient(st.norm, max_norm);
        if (st.found_inf) {
          EXPECT_TRUE(std::isnan(c.clip_coef));
        }
      }
      applied = opt->step(c);
    } else {
      applied = opt->step_unfused(c, scratch, max_norm > 0 ? std::optional<float>(max_norm) : std::nullopt);
    }
    EXPECT_EQ(applied, !st.found_inf);
    sched.on_step(applied);
    if (!st.found_inf) r.norms.push_back(st.norm);
  }
  r.snapshot = test::snapshot(s);
  r.steps = opt->step_count();
  EXPECT_EQ(sched.position(), r.steps);
  return r;
}

TEST(ScaleInvariance, PowerOfTwoLossScalesGiveBitwiseIdenticalWeights) {
  for (Opt o : kOpts) {
    for (float max_norm : {0.0f, 0.05f}) {
      const RunResult base = train(o, 1.0f, max_norm, 12, {}, {});
      for (float scale : {0.25f, 2.0f, 1024.0f, 65536.0f, 0x1p24f}) {
        const RunResult r = train(o, scale, max_norm, 12, {}, {});
        EXPECT_EQ(r.snapshot, base.snapshot) << opt_name(o) << " scale " << scale << " max_norm " << max_norm;
        EXPECT_EQ(r.norms, base.norms) << opt_name(o) << " scale " << scale;  // the clip norm, bitwise
        EXPECT_EQ(r.steps, 12);
      }
    }
  }
}

TEST(ScaleInvariance, UnfusedSequenceAgreesAtEveryScale) {
  for (Opt o : kOpts) {
    for (float max_norm : {0.0f, 0.05f}) {
      const RunResult base = train(o, 1.0f, max_norm, 8, {}, {}, /*fused=*/false);
      const RunResult r = train(o, 4096.0f, max_norm, 8, {}, {}, /*fused=*/true);
      EXPECT_EQ(r.snapshot, base.snapshot) << opt_name(o) << " max_norm " << max_norm;
    }
  }
}

TEST(ScaleInvariance, ClippingActuallyClips) {
  // Guard against a vacuous test: with max_norm 0.05 the coefficient is below 1.
  ParamStore s = make_store();
  Mlp::backward(s, Mlp::batch(0), 1.0f);
  const GradStats st = grad_stats(s, 1.0f);
  EXPECT_GT(st.norm, 0.05);
  EXPECT_LT(clip_coefficient(st.norm, 0.05f), 1.0f);
}

TEST(SkipInvariance, SkippedStepsEqualNeverSeenBatches) {
  const std::set<int> k = {0, 4, 5, 9};
  for (Opt o : kOpts) {
    for (float max_norm : {0.0f, 0.05f}) {
      for (bool fused : {true, false}) {
        const RunResult skipped = train(o, 256.0f, max_norm, 14, k, {}, fused);
        const RunResult never = train(o, 256.0f, max_norm, 14, {}, k, fused);
        EXPECT_EQ(skipped.snapshot, never.snapshot) << opt_name(o) << " max_norm " << max_norm << " fused " << fused;
        EXPECT_EQ(skipped.steps, 10);
        EXPECT_EQ(never.steps, 10);
      }
    }
  }
}

TEST(SkipInvariance, ASkipWritesNothingNotEvenTheModelCopy) {
  ParamStore s(Mlp::specs(), {.model = DType::f16, .grads = DType::f16, .master = true, .state_slots = 2});
  Mlp::init(s, 3);
  Adam opt(s, AdamConfig{});
  // Make the model copy differ from round(master), so a refresh would show.
  for (auto& h : s.model<f16>("w1")) h = f16::from_bits(0x1234);
  for (auto& g : s.grads<f16>("b1")) g = f16(1.0f);
  const auto before = test::snapshot(s);
  EXPECT_FALSE(opt.step({.inv_scale = 1.0f, .clip_coef = std::numeric_limits<float>::quiet_NaN(), .skip = true}));
  std::vector<float> scratch(opt.unfused_scratch_size());
  EXPECT_FALSE(opt.step_unfused({.skip = true}, scratch, 1.0f));
  EXPECT_EQ(test::snapshot(s), before);
  EXPECT_EQ(opt.step_count(), 0);
}

}  // namespace
}  // namespace mixprec
