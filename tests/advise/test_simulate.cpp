// The loss-scale policy simulation on synthetic logs written through the run-log writer:
// the overflow model of each kind of step, the replay against the library's policies,
// the recorded side, collapses, and the errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/kernels/unscale.hpp"
#include "mixprec/advise/simulate.hpp"
#include "mixprec/run/run_log.hpp"
#include "support.hpp"

namespace mixprec::monitor {
namespace {

using test::error_of;

namespace fs = std::filesystem;
using train::StepRecord;

constexpr float kInfF = std::numeric_limits<float>::infinity();

// A step recorded at `scale` whose activation gradients reach `unscaled` x scale.
StepRecord step(std::uint64_t n, float scale, double unscaled, bool skipped = false) {
  StepRecord r;
  r.step = n;
  r.loss = 5;
  r.scale = scale;
  r.next_scale = skipped ? scale / 2 : scale;
  r.skipped = r.found_inf = skipped;
  r.grad_norm = skipped ? std::numeric_limits<double>::quiet_NaN() : 1.0;
  r.act_grads = {.elements = 100, .nonzero = 100, .nonfinite_input = 0, .underflow = 0, .subnormal = 0, .overflow = 0};
  const float amax = static_cast<float>(unscaled * static_cast<double>(scale));
  r.act_grad_amax = amax;
  r.headroom_log2 = std::log2(65504.0 / static_cast<double>(amax));
  r.act_grad_tensors.push_back({"logits.grad", r.act_grads, amax});
  return r;
}

// Writes the records as log.jsonl through the run-log writer and reads them back.
class SimulateLog : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mixprec-simulate-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<StepRecord> round_trip(const std::vector<StepRecord>& rs) {
    const fs::path p = dir_ / "log.jsonl";
    {
      std::ofstream out(p, std::ios::binary);
      for (const StepRecord& r : rs) out << train::step_record_json(r) << '\n';
    }
    return train::read_run_log(p.string());
  }

  fs::path dir_;
};

std::string strip(const Simulation& s, bool simulated) {
  std::string out;
  for (const SimulatedStep& t : s.steps) out += (simulated ? t.skipped : t.recorded_skipped) ? 'x' : '.';
  return out;
}

TEST(Simulate, OverflowLimits) {
  EXPECT_EQ(overflow_limit(nn::Precision::fp16), 65520.0);
  EXPECT_EQ(overflow_limit(nn::Precision::fp16_pure), 65520.0);
  EXPECT_EQ(overflow_limit(nn::Precision::bf16), 0x1.ffp127);
  EXPECT_EQ(overflow_limit(nn::Precision::fp32), 0x1.ffffffp127);
  EXPECT_EQ(overflow_model_name(OverflowModel::amax), "amax");
  EXPECT_EQ(overflow_model_name(OverflowModel::always), "always");
  EXPECT_EQ(overflow_model_name(OverflowModel::from_scale), "from-recorded-scale");
}

TEST_F(SimulateLog, AmaxModelAgainstTorchWithShortInterval) {
  // The run (static 2^10) never overflowed; its gradients reach 1.0 unscaled, so any
  // scale >= 65520 overflows. torch from 2^16: skip, back to 2^15, grow after 3 clean
  // steps to 2^16, skip again, ...
  std::vector<StepRecord> rs;
  for (std::uint64_t i = 1; i <= 10; ++i) rs.push_back(step(i, 1024, 1.0));
  LossScaleConfig torch = loss_scale_preset("torch");
  torch.growth_interval = 3;
  const Simulation s = simulate(round_trip(rs), nn::Precision::fp16, torch);
  ASSERT_EQ(s.steps.size(), 10u);
  EXPECT_EQ(s.steps[0].model, OverflowModel::amax);
  EXPECT_EQ(s.steps[0].unscaled_amax, 1.0);
  EXPECT_EQ(s.steps[0].overflow_scale, 65520.0);
  EXPECT_EQ(strip(s, false), "..........");
  EXPECT_EQ(strip(s, true), "x...x...x.");
  EXPECT_EQ(s.steps[0].scale, 65536.0);
  EXPECT_EQ(s.steps[0].next_scale, 32768.0);
  EXPECT_EQ(s.steps[3].next_scale, 65536.0);
  EXPECT_EQ(s.simulated.skipped, 3u);
  EXPECT_EQ(s.simulated.first_skip, 1u);
  EXPECT_EQ(s.simulated.growths, 2u);
  EXPECT_EQ(s.simulated.backoffs, 3u);
  EXPECT_EQ(s.simulated.final_scale, 32768.0);
  EXPECT_EQ(s.simulated.min_scale, 32768.0);
  EXPECT_EQ(s.simulated.max_scale, 65536.0);
  EXPECT_EQ(s.recorded.skipped, 0u);
  EXPECT_EQ(s.recorded.first_skip, 0u);
  EXPECT_EQ(s.recorded.final_scale, 1024.0);
  EXPECT_EQ(s.recorded.min_scale, 1024.0);
  EXPECT_EQ(s.agree, 10u);
  EXPECT_TRUE(s.collapse.empty());
}

TEST_F(SimulateLog, ThresholdIsTheRoundingBoundary) {
  // Just below 65520 rounds to 65504 (no overflow); 65520 itself rounds to inf.
  std::vector<StepRecord> rs{step(1, 1, 65519.0 / 65536.0), step(2, 1, 65520.0 / 65536.0)};
  LossScaleConfig stat = loss_scale_preset("static");
  stat.init_scale = 65536;
  const Simulation s = simulate(round_trip(rs), nn::Precision::fp16, stat);
  EXPECT_EQ(strip(s, true), ".x");
  EXPECT_EQ(s.simulated.final_scale, 65536.0);
  EXPECT_EQ(s.simulated.growths + s.simulated.backoffs, 0u);
  // In bf16 nothing near that overflows.
  EXPECT_EQ(strip(simulate(round_trip(rs), nn::Precision::bf16, stat), true), "..");
}

TEST_F(SimulateLog, DeepSpeedHysteresisSkipsButKeepsItsScale) {
  // The run (torch-like, 2^16) overflowed at step 2 with amax 2^17 (unscaled 2): any
  // scale >= 32760 overflows at step 2 only.
  std::vector<StepRecord> rs{step(1, 65536, 0.01), step(2, 65536, 2.0, true), step(3, 32768, 0.01),
                             step(4, 32768, 0.01)};
  const auto log = round_trip(rs);
  const Simulation ds = simulate(log, nn::Precision::fp16, loss_scale_preset("deepspeed"));
  EXPECT_EQ(strip(ds, false), ".x..");
  EXPECT_EQ(strip(ds, true), ".x..");
  EXPECT_EQ(ds.steps[1].next_scale, 65536.0);  // hysteresis 2: the first overflow is tolerated
  EXPECT_EQ(ds.simulated.final_scale, 65536.0);
  EXPECT_EQ(ds.recorded.final_scale, 32768.0);
  EXPECT_EQ(ds.recorded.backoffs, 1u);
  EXPECT_EQ(ds.agree, 4u);
  // A policy starting at 2^14 would not have skipped at all.
  LossScaleConfig low = loss_scale_preset("torch");
  low.init_scale = 16384;
  EXPECT_EQ(strip(simulate(log, nn::Precision::fp16, low), true), "....");
}

TEST_F(SimulateLog, NonFiniteForwardAndInjectedOverflowAtAnyScale) {
  StepRecord f = step(2, 1024, 0.01, true);
  f.loss_finite = false;
  f.forward_nonfinite = "h0.attn.qkv";
  StepRecord inj = step(3, 512, 0.01, true);
  inj.injected = true;
  std::vector<StepRecord> rs{step(1, 1024, 0.01), f, inj, step(4, 256, 0.01)};
  LossScaleConfig stat = loss_scale_preset("static");
  stat.init_scale = 1;
  const Simulation s = simulate(round_trip(rs), nn::Precision::fp16, stat);
  EXPECT_EQ(s.steps[1].model, OverflowModel::always);
  EXPECT_EQ(s.steps[1].overflow_scale, 0.0);
  EXPECT_EQ(s.steps[2].model, OverflowModel::always);
  EXPECT_EQ(strip(s, true), ".xx.");
}

TEST_F(SimulateLog, FirstNonFiniteTensorExplainedOrNot) {
  // Backward order: an overflowing store (finite amax 70000 >= 65520) then the inf it
  // propagated: the range explains it, u = 70000 / 2^16.
  StepRecord a = step(1, 65536, 0.01, true);
  a.act_grad_tensors = {{"logits.grad", {}, 70000.0f}, {"lnf.grad", {}, kInfF}, {"h1.mlp.fc.grad", {}, 1e9f}};
  a.act_grad_amax = kInfF;
  // A non-finite tensor with no overflowing store before it: fp32 arithmetic, any scale.
  StepRecord b = step(2, 32768, 0.01, true);
  b.act_grad_tensors = {{"logits.grad", {}, 100.0f}, {"lnf.grad", {}, kInfF}};
  b.act_grad_amax = kInfF;
  const auto log = round_trip({a, b});
  const Simulation s = simulate(log, nn::Precision::fp16, loss_scale_preset("torch"));
  EXPECT_EQ(s.steps[0].model, OverflowModel::amax);
  EXPECT_EQ(s.steps[0].unscaled_amax, 70000.0 / 65536.0);
  EXPECT_TRUE(s.steps[0].predicted_at_recorded);
  EXPECT_EQ(s.steps[1].model, OverflowModel::always);
  // At 2^15 step 1 (u = 1.068) would not overflow: 1.068 x 32768 < 65520.
  LossScaleConfig low = loss_scale_preset("torch");
  low.init_scale = 32768;
  EXPECT_EQ(strip(simulate(log, nn::Precision::fp16, low), true), ".x");
  EXPECT_EQ(s.agree, 2u);
}

TEST_F(SimulateLog, UnexplainedOverflowDependsOnTheWeightGradientFormat) {
  // Skipped although the activation gradients stayed in range.
  std::vector<StepRecord> rs{step(1, 4096, 0.01, true), step(2, 2048, 0.01)};
  const auto log = round_trip(rs);
  LossScaleConfig low = loss_scale_preset("torch");
  low.init_scale = 2048;
  // fp16-pure: fp16 weight gradients scale with S: overflow iff S >= 4096.
  const Simulation pure = simulate(log, nn::Precision::fp16_pure, low);
  EXPECT_EQ(pure.steps[0].model, OverflowModel::from_scale);
  EXPECT_EQ(pure.steps[0].overflow_scale, 4096.0);
  EXPECT_EQ(strip(pure, true), "..");
  // fp16 mixed: fp32 weight gradients: the inf came from non-finite arithmetic.
  const Simulation mixed = simulate(log, nn::Precision::fp16, low);
  EXPECT_EQ(mixed.steps[0].model, OverflowModel::always);
  EXPECT_EQ(strip(mixed, true), "x.");
}

TEST_F(SimulateLog, AmaxOnlyLogs) {
  // No per-tensor list: a finite amax is the amax model, a non-finite one from-recorded-scale.
  StepRecord a = step(1, 1024, 0.5);
  a.act_grad_tensors.clear();
  StepRecord b = step(2, 1024, 0.5, true);
  b.act_grad_tensors.clear();
  b.act_grad_amax = kInfF;
  const auto log = round_trip({a, b});
  const Simulation s = simulate(log, nn::Precision::fp16, loss_scale_preset("torch"));
  EXPECT_EQ(s.steps[0].model, OverflowModel::amax);
  EXPECT_EQ(s.steps[0].unscaled_amax, 0.5);
  EXPECT_EQ(s.steps[1].model, OverflowModel::from_scale);
  EXPECT_EQ(strip(s, true), ".x");  // 2^16 x 0.5 = 32768 < 65520; 2^16 >= 1024
}

TEST_F(SimulateLog, CollapseStopsTheSimulation) {
  // Every step's forward pass is non-finite: mixprec's floor of 1 is reached after 16
  // backoffs and the 10th overflow there throws.
  std::vector<StepRecord> rs;
  for (std::uint64_t i = 1; i <= 40; ++i) {
    StepRecord r = step(i, 1, 0.01, true);
    r.loss_finite = false;
    r.forward_nonfinite = "logits";
    rs.push_back(r);
  }
  const Simulation s = simulate(round_trip(rs), nn::Precision::fp16, loss_scale_preset("mixprec"));
  EXPECT_EQ(s.collapse_step, 26u);
  EXPECT_EQ(s.steps.size(), 25u);
  EXPECT_TRUE(s.collapse.find("the last 10 steps all overflowed") != std::string::npos) << s.collapse;
  EXPECT_EQ(s.simulated.skipped, 25u);
  EXPECT_EQ(s.recorded.steps, 40u);
  EXPECT_EQ(s.recorded.skipped, 40u);
  const std::string j = simulation_json(s);
  EXPECT_NE(j.find("\"collapse\":{\"step\":26,\"message\":"), std::string::npos) << j.substr(0, 400);
}

TEST_F(SimulateLog, Json) {
  const auto log = round_trip({step(1, 1024, 1.0), step(2, 1024, 0.0)});
  const Simulation s = simulate(log, nn::Precision::fp16, loss_scale_preset("deepspeed"));
  const std::string j = simulation_json(s);
  for (const char* part :
       {R"({"precision":"fp16","overflow_limit":65520.0,"policy":{)", R"("rule":"deepspeed")",
        R"("recorded":{"steps":2,"skipped":0,"first_skip":null,"growths":0,"backoffs":0,"final_scale":1024.0,)",
        R"("simulated":{"steps":2,"skipped":1,"first_skip":1,)", R"("agreement":{"steps":2,"agree":2},"collapse":null,)",
        R"({"step":1,"model":"amax","unscaled_amax":1.0,"overflow_scale":65520.0,"recorded_scale":1024.0,)",
        R"("recorded_skipped":false,"predicted_at_recorded":false,"scale":65536.0,"skipped":true,"next_scale":65536.0})",
        R"({"step":2,"model":"amax","unscaled_amax":0.0,"overflow_scale":null,)"})
    EXPECT_NE(j.find(part), std::string::npos) << part << "\n" << j;
}

TEST_F(SimulateLog, Errors) {
  EXPECT_EQ(error_of<std::invalid_argument>(
                [] { simulate(std::vector<StepRecord>{}, nn::Precision::fp16, loss_scale_preset("torch")); }),
            "simulate: the run log has no steps");
  StepRecord old = step(1, 1024, 0.5);
  old.act_grad_amax = 0;
  old.act_grad_tensors.clear();
  const auto log = round_trip({old});
  EXPECT_TRUE(error_of<std::invalid_argument>([&] { simulate(log, nn::Precision::fp16, loss_scale_preset("torch")); })
                  .starts_with("simulate: the run log has no activation-gradient telemetry"));
  LossScaleConfig bad = loss_scale_preset("torch");
  bad.growth_factor = 0.5;
  const auto good = round_trip({step(1, 1024, 0.5)});
  EXPECT_TRUE(error_of<std::invalid_argument>([&] { simulate(good, nn::Precision::fp16, bad); })
                  .starts_with("growth_factor"));
}

// A scale whose gradients cannot be unscaled (below about 2^-128: 1/scale overflows float32)
// skips every step in every GradScaler door; the model says so, recorded and simulated
// (issue 30: it modelled such steps as clean).
TEST_F(SimulateLog, AScaleThatCannotBeUnscaledSkips) {
  const float tiny = 1e-40f;  // a float32 subnormal: 1/tiny is beyond float32
  const std::vector<StepRecord> log = round_trip({step(1, tiny, 1.0, true), step(2, tiny, 1.0, true)});
  const Simulation recorded = simulate(log, nn::Precision::fp16, loss_scale_preset("keras"));
  EXPECT_TRUE(recorded.steps[0].predicted_at_recorded);  // the recorded skip is explained
  EXPECT_EQ(recorded.agree, 2u);
  // keras' rule, no floor: from 2^-126 the scale backs off past 2^-128, where every step skips.
  LossScaleConfig keras = loss_scale_preset("keras");
  keras.init_scale = 0x1p-126;
  std::vector<StepRecord> clean;
  for (std::uint64_t n = 1; n <= 6; ++n) clean.push_back(step(n, 1.0f, 1e-3, n <= 2));
  const Simulation sim = simulate(round_trip(clean), nn::Precision::fp16, keras);
  ASSERT_EQ(sim.steps.size(), 6u);
  // Steps 1 and 2 overflowed at any scale (skipped with their gradients in range): two backoffs
  // take the scale to 2^-128. Steps 3-6 are clean at any scale that can be unscaled, and
  // skipped at one that cannot.
  for (const SimulatedStep& t : sim.steps) {
    const bool unscalable = !(static_cast<float>(t.scale) > 0) || !can_unscale(inv_scale_of(static_cast<float>(t.scale)));
    if (unscalable) {
      EXPECT_TRUE(t.skipped) << "step " << t.step << " at scale " << t.scale;
    }
  }
  EXPECT_TRUE(std::any_of(sim.steps.begin(), sim.steps.end(), [](const SimulatedStep& t) {
    return !can_unscale(inv_scale_of(static_cast<float>(t.scale))) && t.skipped;
  }));
}

}  // namespace
}  // namespace mixprec::monitor
