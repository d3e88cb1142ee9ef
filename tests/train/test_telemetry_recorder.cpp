// train::TelemetryRecorder (include/mixprec/train/telemetry_recorder.hpp): the core behind
// mixprec::torch::Telemetry and mixprec.torch.Telemetry. Its counts against the core's
// counted conversion on the same values, its log line read back through the run log's own
// parser, its histograms, forward checks and refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/train/telemetry_recorder.hpp"
#include "support.hpp"
#include "temp_dir.hpp"

namespace mixprec::train {
namespace {

using test::error_of;

std::vector<float> gradient_like(std::size_t n, unsigned seed) {
  // Magnitudes over 2^-40 .. 2^20: fp16 flushes some, keeps some subnormal, overflows some.
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> e(-40.0f, 20.0f);
  std::vector<float> v(n);
  for (float& x : v) x = ((rng() & 1) ? -1.0f : 1.0f) * std::exp2(e(rng));
  v[n / 3] = 0.0f;
  return v;
}

GradTensor view(std::vector<float>& v) { return {v.data(), v.size(), DType::f32}; }

TEST(TelemetryRecorder, CountsEqualConvertCountedForEveryStorageDtype) {
  test::TempDir tmp("telrec");
  TelemetryRecorder rec((tmp.path() / "run").string(), {.precision = "bf16", .loss_scale = "none"});
  std::vector<float> a = gradient_like(4099, 1), b = gradient_like(1000, 2);
  std::vector<bf16> b16(b.size());
  f32_to_bf16(b, b16);
  std::vector<float> b_widened(b.size());
  bf16_to_f32(b16, b_widened);
  std::vector<float> c = gradient_like(513, 3);
  for (float& x : c) x = std::ldexp(x, -8);  // inside fp16's range: its |max| is finite
  std::vector<f16> h16(c.size());
  f32_to_f16(c, h16);
  std::vector<float> h_widened(c.size());
  f16_to_f32(h16, h_widened);

  rec.count_activation_grad("fc", view(a));
  rec.count_activation_grad("fc", view(a));  // a second micro-batch: summed under one name
  rec.count_activation_grad("proj", {b16.data(), b16.size(), DType::bf16});
  rec.count_activation_grad("head", {h16.data(), h16.size(), DType::f16});
  const StepRecord r = rec.record({.loss = 2.0}, {});

  std::vector<f16> sink(a.size());
  const ConversionStats sa = convert_counted(std::span<const float>(a), std::span<f16>(sink));
  const ConversionStats sb = convert_counted(std::span<const float>(b_widened), std::span<f16>(sink.data(), b.size()));
  const ConversionStats sh = convert_counted(std::span<const float>(h_widened), std::span<f16>(sink.data(), c.size()));
  ASSERT_EQ(r.act_grad_tensors.size(), 3u);
  ConversionStats twice = sa;
  twice += sa;
  EXPECT_EQ(r.act_grad_tensors[0].name, "fc");
  EXPECT_EQ(r.act_grad_tensors[0].stats, twice);
  EXPECT_EQ(r.act_grad_tensors[1].stats, sb);
  EXPECT_EQ(r.act_grad_tensors[2].stats, sh);
  EXPECT_GT(sa.underflow, 0u);
  EXPECT_GT(sa.overflow, 0u);
  EXPECT_EQ(sh.underflow, 0u) << "an fp16 gradient has underflowed already: nothing more is counted";
  ConversionStats all = twice;
  all += sb;
  all += sh;
  EXPECT_EQ(r.act_grads, all);
  EXPECT_EQ(r.act_grad_amax, nn::amax_of(a));
  // The tightest headroom: the fp16 gradient's (its format max is the smallest).
  EXPECT_DOUBLE_EQ(r.headroom_log2, std::log2(65504.0 / static_cast<double>(nn::amax_of(h_widened))));

  // What was written is what was returned, through the run log's own reader.
  const std::vector<StepRecord> back = read_run_log((tmp.path() / "run" / run_files::log).string());
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].act_grads, all);
  EXPECT_EQ(back[0].act_grad_tensors.size(), 3u);
  // The next step starts from zero.
  EXPECT_EQ(rec.record({.loss = 1.0}, {}).act_grads, ConversionStats{});
}

TEST(TelemetryRecorder, NamesTheFirstNonFiniteGradientAndForwardOutput) {
  test::TempDir tmp("telrec");
  TelemetryRecorder rec((tmp.path() / "run").string(), {});
  std::vector<float> ok = {1, 2, 3}, bad = {1, std::numeric_limits<float>::quiet_NaN(), 3};
  EXPECT_FALSE(rec.check_activation("ln", view(ok)));
  EXPECT_TRUE(rec.check_activation("mlp.fc", view(bad)));
  EXPECT_TRUE(rec.check_activation("mlp.proj", view(bad)));
  rec.count_activation_grad("attn", view(ok));
  rec.count_activation_grad("mlp", view(bad));
  rec.count_activation_grad("head", view(bad));
  const StepRecord r = rec.record({.loss = std::numeric_limits<double>::infinity()}, {});
  EXPECT_EQ(r.forward_nonfinite, "mlp.fc");
  EXPECT_EQ(r.overflow_activation, "mlp");
  EXPECT_FALSE(r.loss_finite);
  EXPECT_TRUE(std::isinf(r.act_grad_amax));
  const StepRecord next = rec.record({.loss = 1.0}, {});
  EXPECT_EQ(next.forward_nonfinite, "");
  EXPECT_EQ(next.overflow_activation, "");
}

TEST(TelemetryRecorder, ParameterAmaxUndoesClippingAndSkipsMissingGradients) {
  test::TempDir tmp("telrec");
  TelemetryRecorder rec((tmp.path() / "run").string(), {});
  std::vector<float> g = {0.5f, -2.0f, 1.0f}, w = {3.0f, -7.0f};
  std::vector<bf16> g16(g.size());
  f32_to_bf16(g, g16);
  const std::vector<NamedParam> params = {
      {"a", view(g), view(w)},
      {"b", {g16.data(), g16.size(), DType::bf16}, view(w)},
      {"frozen", {nullptr, 0, DType::f32}, view(w)},
  };
  const StepRecord r = rec.record({.loss = 1, .scale = 1024, .next_scale = 2048, .clip_coef = 0.5f}, params);
  ASSERT_EQ(r.params.size(), 3u);
  EXPECT_EQ(r.params[0].grad_amax, 4.0f) << "|max| 2 was clipped by 0.5: the record holds the unclipped 4";
  EXPECT_EQ(r.params[1].grad_amax, 4.0f);
  EXPECT_EQ(r.params[2].grad_amax, 0.0f);
  EXPECT_EQ(r.params[0].weight_amax, 7.0f);
  EXPECT_EQ(r.params[2].weight_amax, 7.0f);
  EXPECT_EQ(r.scale, 1024.0f);
  EXPECT_EQ(r.next_scale, 2048.0f);

  std::vector<float> inf_grad = {1.0f, -std::numeric_limits<float>::infinity()};
  const std::vector<NamedParam> over = {{"a", view(inf_grad), view(w)}};
  const StepRecord s =
      rec.record({.loss = 1, .found_inf = true, .applied = false, .grad_norm = 5, .overflow_param = "a"}, over);
  EXPECT_TRUE(s.skipped);
  EXPECT_TRUE(std::isnan(s.grad_norm)) << "no norm is claimed for a step that overflowed";
  EXPECT_TRUE(std::isinf(s.params[0].grad_amax));
  EXPECT_EQ(s.overflow_param, "a");

  // The summary: the totals of the records, as the report computes them.
  (void)rec.finish();
  const std::string text = io::read_file(tmp.path() / "run" / run_files::summary);
  EXPECT_NE(text.find("\"skipped\": 1"), std::string::npos) << text;
  EXPECT_NE(text.find("\"param_count\": 6"), std::string::npos) << text;
}

TEST(TelemetryRecorder, SummaryHoldsTheLastValidationLossAsTheEnginesDoes) {
  test::TempDir tmp("telrec");
  TelemetryRecorder rec((tmp.path() / "run").string(), {});
  (void)rec.record({.loss = 2.0}, {});
  (void)rec.record({.loss = 1.5, .val_loss = 1.25}, {});
  (void)rec.record({.loss = 1.0}, {});  // no evaluation at the last step: the last one stands
  (void)rec.finish();
  const std::string text = io::read_file(tmp.path() / "run" / run_files::summary);
  EXPECT_NE(text.find("\"val_loss\": 1.25"), std::string::npos) << text;
}

// A low-precision module's tensors (mixprec.torch.low_precision) go to the log's fp8 array
// and the summary's fractions; a bad one is refused before anything is written.
TEST(TelemetryRecorder, QuantizedTensorsReachTheLogAndSummary) {
  test::TempDir tmp("telrec");
  const std::string dir = (tmp.path() / "run").string();
  TelemetryRecorder rec(dir, {});
  nn::Fp8TensorStats x;
  x.name = "fc.input";
  x.recipe = "mxfp8";
  x.amax = 2.5f;
  x.elements = 1000;
  x.nonzero = 800;
  x.saturated = 8;
  x.flushed = 40;
  x.rel_rms_error = 0.03;
  nn::Fp8TensorStats dy = x;
  dy.name = "fc.grad_output";
  dy.role = lowp::Role::backward;
  dy.saturated = 0;
  dy.flushed = 200;
  TelemetryStep step{.loss = 2.0};
  step.quantized = {x, dy};
  (void)rec.record(step, {});
  // Refused, each naming the tensor and the rule: the log keeps its one line.
  const std::pair<std::function<void(nn::Fp8TensorStats&)>, std::string> bad[] = {
      {[](nn::Fp8TensorStats& t) { t.recipe = "fp6"; }, "quantized 'fc.input': recipe: expected one of fp8-delayed"},
      {[](nn::Fp8TensorStats& t) { t.recipe.clear(); }, "recipe: expected one of"},
      {[](nn::Fp8TensorStats& t) { t.scale = -1.0f; }, "quantized 'fc.input': scale: expected a number >= 0, found -1"},
      {[](nn::Fp8TensorStats& t) { t.flushed = 993; }, "quantized 'fc.input': elements: expected at least saturated"},
      {[](nn::Fp8TensorStats& t) { t.rel_rms_error = -0.5; }, "rel_rms_error: expected a number >= 0, found -0.5"},
      {[](nn::Fp8TensorStats& t) { t.name.clear(); }, "quantized: a tensor without a name"},
  };
  for (const auto& [edit, message] : bad) {
    TelemetryStep b{.loss = 1.0};
    b.quantized = {x};
    edit(b.quantized.front());
    EXPECT_NE(error_of<std::invalid_argument>([&] { (void)rec.record(b, {}); }).find(message), std::string::npos)
        << message;
  }
  (void)rec.finish();
  const std::vector<StepRecord> back = read_run_log((tmp.path() / "run" / run_files::log).string());
  ASSERT_EQ(back.size(), 1u);
  ASSERT_EQ(back[0].fp8.size(), 2u);
  EXPECT_EQ(back[0].fp8[0].recipe, "mxfp8");
  EXPECT_EQ(back[0].fp8[1].rel_rms_error, 0.03);
  // forward: 8 of 800 saturated, 40 flushed; backward: 200 of 800 flushed.
  const std::string text = io::read_file(tmp.path() / "run" / run_files::summary);
  EXPECT_NE(text.find("\"fp8_forward_saturated_fraction\": 0.01"), std::string::npos) << text;
  EXPECT_NE(text.find("\"fp8_forward_flushed_fraction\": 0.05"), std::string::npos) << text;
  EXPECT_NE(text.find("\"fp8_backward_flushed_fraction\": 0.25"), std::string::npos) << text;
}

TEST(TelemetryRecorder, HistogramsAtStepOneAndEveryNth) {
  test::TempDir tmp("telrec");
  TelemetryRecorder rec((tmp.path() / "run").string(), {.histogram_every = 3});
  std::vector<float> act(64, 0.25f), grad(64, 1.0f / 1024), w = {2.0f, 0.0f};
  const std::vector<NamedParam> params = {{"w", view(grad), view(w)}};
  std::vector<bool> taken;
  for (int step = 1; step <= 7; ++step) {
    EXPECT_EQ(rec.histogram_step(), step == 1 || step % 3 == 0) << "step " << step;
    (void)rec.check_activation("x", view(act));
    rec.count_activation_grad("x", view(grad));
    const StepRecord r = rec.record({.loss = 1}, params);
    taken.push_back(r.histograms.has_value());
    if (!r.histograms) continue;
    const int bin = -2 - nn::Log2Histogram::kMinExp;
    EXPECT_EQ(r.histograms->activations.counts[static_cast<std::size_t>(bin)], 64 / nn::kHistogramStride);
    EXPECT_EQ(r.histograms->weight_grads.counts[static_cast<std::size_t>(-10 - nn::Log2Histogram::kMinExp)], 64u);
    EXPECT_EQ(r.histograms->weights.zeros, 1u);
    EXPECT_EQ(r.histograms->activation_grads.total(), 64 / nn::kHistogramStride);
  }
  EXPECT_EQ(taken, (std::vector<bool>{true, false, true, false, false, true, false}));
  TelemetryRecorder never((tmp.path() / "never").string(), {.histogram_every = 0});
  EXPECT_FALSE(never.histogram_step());
}

// What a front end measured elsewhere (a GPU; the scaler's pass) goes into the same record as
// what the recorder measures itself: one run fed each way logs the same line.
TEST(TelemetryRecorder, CountsAndMaximaMeasuredElsewhereLogWhatItsOwnPassesLog) {
  test::TempDir tmp("telrec");
  TelemetryRecorder own((tmp.path() / "own").string(), {.histogram_every = 1});
  TelemetryRecorder fed((tmp.path() / "fed").string(), {.histogram_every = 1});
  std::vector<float> g = gradient_like(3000, 5), act = gradient_like(800, 6), w = gradient_like(300, 7);
  act[5] = std::numeric_limits<float>::infinity();
  std::vector<bf16> g16(g.size());
  f32_to_bf16(g, g16);
  const GradTensor grad16{g16.data(), g16.size(), DType::bf16};
  own.count_activation_grad("h", grad16);
  (void)own.check_activation("x", view(act));
  fed.add_activation_grad("h", count_bf16_to_f16(g16), DType::bf16);
  fed.forward_nonfinite("x");
  StepRecord::Histograms h;
  h.activation_grads.add(std::vector<float>(g16.begin(), g16.end()), nn::kHistogramStride);
  h.activations.add(act, nn::kHistogramStride);
  fed.add_histograms(h);
  std::vector<float> wg(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) wg[i] = w[i] * 0.5f;
  std::vector<float> gw(g.begin(), g.begin() + 300);
  const std::vector<NamedParam> mine = {{"p", view(gw), view(w)}};
  float gmax = 0, wmax = 0;
  for (float x : gw) gmax = std::max(gmax, std::fabs(x));
  for (float x : w) wmax = std::max(wmax, std::fabs(x));
  // The device's |max| of the clipped gradient (undone like the recorder's own), the weight's.
  const std::vector<NamedParam> theirs = {{"p", view(gw), {nullptr, w.size(), DType::f32}, gmax, std::nullopt, wmax}};
  const StepRecord a = own.record({.loss = 1, .clip_coef = 0.5f}, mine);
  StepRecord::Histograms weights_elsewhere;
  weights_elsewhere.weights.add(w);
  fed.add_histograms(weights_elsewhere);
  const StepRecord b = fed.record({.loss = 1, .clip_coef = 0.5f}, theirs);
  EXPECT_EQ(step_record_json(a), step_record_json(b));
  EXPECT_EQ(b.forward_nonfinite, "x");
  EXPECT_EQ(b.params[0].grad_amax, gmax / 0.5f);
  // The scaler's |max| is taken before clipping: as it is.
  const std::vector<NamedParam> unclipped = {{"p", {}, view(w), std::nullopt, 3.0f, std::nullopt}};
  EXPECT_EQ(fed.record({.loss = 1, .clip_coef = 0.5f}, unclipped).params[0].grad_amax, 3.0f);
  (void)fed.finish();
  EXPECT_NE(io::read_file(tmp.path() / "fed" / run_files::summary).find("\"param_count\": 300"), std::string::npos);
}

TEST(TelemetryRecorder, RefusesBadOptionsAndAFolderInUse) {
  test::TempDir tmp("telrec");
  const std::string dir = (tmp.path() / "run").string();
  EXPECT_NE(error_of<std::invalid_argument>([&] { TelemetryRecorder r(dir, {.precision = "fp8"}); })
                .find("precision: expected fp32, fp16 or bf16, found 'fp8'"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { TelemetryRecorder r(dir, {.loss_scale = "sometimes"}); })
                .find("loss-scale"),
            std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir)) << "bad options leave nothing behind";
  {
    TelemetryRecorder first(dir, {});
    (void)first.record({.loss = 1}, {});
    // The folder is locked and holds a run: a second writer is refused.
    EXPECT_NE(error_of<std::runtime_error>([&] { TelemetryRecorder second(dir, {}); }).find("in use"),
              std::string::npos);
  }
  // A finished run is never overwritten.
  EXPECT_NE(error_of<std::invalid_argument>([&] { TelemetryRecorder again(dir, {}); })
                .find("exists and is not empty; choose a new folder (a finished run is never overwritten)"),
            std::string::npos);
  EXPECT_EQ(read_run_log((std::filesystem::path(dir) / run_files::log).string()).size(), 1u);
}

}  // namespace
}  // namespace mixprec::train
