// The run layer (include/mixprec/run/step_record.hpp): the summary accumulator every
// writer shares, the histogram rule, the amax measurement of StepRecord::ParamStats.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "mixprec/formats/types.hpp"
#include "mixprec/run/step_record.hpp"

namespace mixprec::train {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

StepRecord step(std::uint64_t n, double loss, bool skipped, double seconds) {
  StepRecord r;
  r.step = n;
  r.loss = loss;
  r.loss_finite = std::isfinite(loss);
  r.skipped = skipped;
  r.seconds = seconds;
  r.tokens = 100;
  r.next_scale = static_cast<float>(1024 >> n);
  r.act_grads.nonzero = 1000;
  r.act_grads.underflow = 10 * n;
  r.act_grads.subnormal = n;
  r.lost_update_fraction = skipped ? 0.0 : 0.25 * static_cast<double>(n);
  return r;
}

TEST(RunTotals, SummaryOfTheSteps) {
  RunTotals t;
  t.add(step(1, 3.0, false, 0.010));
  t.add(step(2, 2.5, true, 0.030));
  StepRecord r3 = step(3, 2.0, false, 0.020);
  r3.val_loss = 2.25;
  t.add(r3);
  const TrainSummary s = t.summary();
  EXPECT_EQ(s.steps, 3u);
  EXPECT_EQ(s.applied, 2u);
  EXPECT_EQ(s.skipped, 1u);
  EXPECT_EQ(s.tokens, 300u);
  EXPECT_EQ(s.final_loss, 2.0);
  ASSERT_TRUE(s.val_loss);
  EXPECT_EQ(*s.val_loss, 2.25);
  EXPECT_EQ(s.final_scale, 128.0f);                          // the last step's next_scale
  EXPECT_DOUBLE_EQ(s.underflow_fraction, 60.0 / 3000.0);
  EXPECT_DOUBLE_EQ(s.subnormal_fraction, 6.0 / 3000.0);
  EXPECT_DOUBLE_EQ(s.lost_update_fraction, (0.25 + 0.75) / 2);  // over the applied steps only
  EXPECT_DOUBLE_EQ(s.seconds, 0.060);
  EXPECT_DOUBLE_EQ(s.mean_step_ms, 20.0);
  EXPECT_DOUBLE_EQ(s.median_step_ms, 20.0);
  EXPECT_EQ(s.fp8_forward_saturated_fraction, 0.0);
}

TEST(RunTotals, WhatALogCannotSayIsLeftOut) {
  RunTotals t;
  StepRecord r = step(1, 3.0, false, kNaN);  // a hand-written log: no time, no lost-update figure
  r.lost_update_fraction = kNaN;
  t.add(r);
  t.add(step(2, 2.0, false, 0.5));
  const TrainSummary s = t.summary();
  EXPECT_EQ(s.seconds, 0.5);
  EXPECT_EQ(s.lost_update_fraction, 0.5);  // step 2's alone
}

TEST(RunTotals, FinalLossAsRecordedAndAsShown) {
  RunTotals none;
  EXPECT_EQ(none.summary().final_loss, 0.0);
  EXPECT_TRUE(std::isnan(none.shown_final_loss()));
  RunTotals t;
  t.add(step(1, 3.0, false, 0.01));
  EXPECT_EQ(t.shown_final_loss(), 3.0);
  t.add(step(2, std::numeric_limits<double>::infinity(), true, 0.01));
  EXPECT_TRUE(std::isinf(t.summary().final_loss)) << "the Trainer's summary says what the step said";
  EXPECT_TRUE(std::isnan(t.shown_final_loss())) << "the report shows no number";
}

TEST(HistogramStep, FirstEveryNthAndLast) {
  EXPECT_FALSE(histogram_step(1, 0, 10));
  EXPECT_TRUE(histogram_step(1, 5));
  EXPECT_FALSE(histogram_step(2, 5));
  EXPECT_TRUE(histogram_step(5, 5));
  EXPECT_TRUE(histogram_step(10, 5));
  EXPECT_FALSE(histogram_step(7, 5));
  EXPECT_TRUE(histogram_step(7, 5, 7)) << "the last step, when the writer knows it";
  EXPECT_FALSE(histogram_step(7, 5, 0));
}

TEST(MeasureAmax, PerTensorUnscaledInfForNonFinite) {
  std::vector<float> a = {1.0f, -6.0f, 2.0f};
  std::vector<float> nan = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> inf = {-kInf, 3.0f};
  std::vector<f16> h = {f16::from_bits(0x4400), f16::from_bits(0xC800)};  // 4, -8
  const std::vector<GradTensor> views = {{a.data(), a.size(), DType::f32},
                                         {nullptr, 0, DType::f32},
                                         {nan.data(), nan.size(), DType::f32},
                                         {inf.data(), inf.size(), DType::f32},
                                         {h.data(), h.size(), DType::f16}};
  std::vector<float> out(views.size(), -1.0f);
  measure_amax(views, 0.5f, out);
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ(out[1], 0.0f) << "an empty view";
  EXPECT_EQ(out[2], kInf);
  EXPECT_EQ(out[3], kInf);
  EXPECT_EQ(out[4], 4.0f);
  std::vector<float> none;
  measure_amax({}, 1.0f, none);  // nothing to measure, nothing written
}

}  // namespace
}  // namespace mixprec::train
