// Alert rules on synthetic step sequences: each rule fires, and does not fire, at its
// boundaries; the 100x-learning-rate pattern names the learning rate and the data;
// healthy runs raise nothing; the thresholds table of docs/alerts.md matches the defaults.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/run/alerts.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "support.hpp"

namespace mixprec::monitor {
namespace {

using test::error_of;

namespace fs = std::filesystem;
using train::StepRecord;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A healthy-looking step: loss falling slowly, no underflow, telemetry present with 10
// binades of headroom.
StepRecord healthy(std::uint64_t step) {
  StepRecord r;
  r.step = step;
  r.lr = 3e-3;
  r.loss = 6.0 - 0.01 * static_cast<double>(step);
  r.scale = r.next_scale = 65536;
  r.grad_norm = 1.0;
  r.act_grads = {.elements = 2'000'000, .nonzero = 1'000'000, .nonfinite_input = 0, .underflow = 0, .subnormal = 0,
                 .overflow = 0};
  r.act_grad_amax = 64;
  r.headroom_log2 = 10;
  r.act_grad_tensors.push_back({"logits.grad", r.act_grads, 64});
  r.tokens = 1024;
  return r;
}

// n steps: healthy(i), then `edit` (which may set skipped / loss / ...), then, for a
// dynamic policy, scale and next_scale from the library's LossScale driven by r.skipped.
std::vector<StepRecord> run(std::uint64_t n, const std::function<void(StepRecord&)>& edit,
                            const std::string& preset = "", LossScaleConfig* cfg = nullptr) {
  std::unique_ptr<LossScale> ls;
  if (!preset.empty()) {
    LossScaleConfig c = cfg != nullptr ? *cfg : loss_scale_preset(preset);
    c.floor_policy = FloorPolicy::keep_going;
    ls = make_loss_scale(c);
  }
  std::vector<StepRecord> out;
  for (std::uint64_t i = 1; i <= n; ++i) {
    StepRecord r = healthy(i);
    edit(r);
    if (r.skipped) r.found_inf = true;
    if (ls) {
      r.scale = ls->scale();
      ls->update(r.skipped);
      r.next_scale = ls->scale();
    }
    out.push_back(std::move(r));
  }
  return out;
}

RunContext ctx(const std::string& loss_scale = "dynamic", const std::string& precision = "fp16", double lr = 3e-3) {
  RunContext c;
  c.precision = precision;
  c.loss_scale = loss_scale;
  c.lr = lr;
  return c;
}

std::vector<std::string> ids(const std::vector<Alert>& alerts) {
  std::vector<std::string> out;
  for (const Alert& a : alerts) out.push_back(a.id);
  return out;
}

const Alert* find(const std::vector<Alert>& alerts, AlertKind k) {
  for (const Alert& a : alerts)
    if (a.kind == k) return &a;
  return nullptr;
}

// The first step at which observe() raised kind k (0: never).
std::uint64_t raised_at(const std::vector<StepRecord>& log, const RunContext& c, AlertKind k,
                        const AlertThresholds& t = {}) {
  AlertMonitor m(t, c);
  for (const StepRecord& r : log)
    for (const Alert& a : m.observe(r))
      if (a.kind == k) return r.step;
  return 0;
}

// ---- thresholds, context, bookkeeping ---------------------------------------------------

TEST(AlertThresholds, DefaultsAreValidAndDescribed) {
  const AlertThresholds t;
  EXPECT_NO_THROW(validate(t));
  const auto d = describe(t);
  ASSERT_EQ(d.size(), 21u);
  EXPECT_EQ(d[0], (std::pair<std::string, std::string>{"warmup_steps", "20"}));
  EXPECT_EQ(d[2], (std::pair<std::string, std::string>{"overflow_skip_rate", "0.2"}));
  EXPECT_EQ(d[12], (std::pair<std::string, std::string>{"input_activations", "embedding"}));
}

TEST(AlertThresholds, DocumentedTableMatchesTheDefaults) {
  const fs::path doc = fs::path(MIXPREC_DOCS_DIR) / "alerts.md";
  std::ifstream in(doc);
  ASSERT_TRUE(in) << doc;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  for (const auto& [key, value] : describe(AlertThresholds{}))
    EXPECT_TRUE(contains(text, "| `" + key + "` | " + value + " |")) << "docs/alerts.md lacks the row of " << key
                                                                      << " = " << value;
}

TEST(AlertThresholds, InvalidValuesAreNamed) {
  auto err = [](auto edit) {
    AlertThresholds t;
    edit(t);
    return error_of<std::invalid_argument>([&] { validate(t); });
  };
  EXPECT_EQ(err([](AlertThresholds& t) { t.overflow_window = 0; }),
            "alerts: overflow_window: expected an integer in [1, 1000000], found 0");
  EXPECT_EQ(err([](AlertThresholds& t) { t.overflow_skip_rate = 1; }),
            "alerts: overflow_skip_rate: expected a number in [0, 1), found 1");
  EXPECT_EQ(err([](AlertThresholds& t) { t.plateau_loss_change = 0; }),
            "alerts: plateau_loss_change: expected a number in (0, 1], found 0");
  EXPECT_EQ(err([](AlertThresholds& t) { t.plateau_window = 2; }),
            "alerts: plateau_window: expected an integer >= 3 (first and last thirds), found 2");
  EXPECT_EQ(err([](AlertThresholds& t) { t.plateau_underflow = std::nan(""); }),
            "alerts: plateau_underflow: expected a number in [0, 1], found nan");
  EXPECT_EQ(err([](AlertThresholds& t) { t.collapse_binades = 0; }),
            "alerts: collapse_binades: expected a number in (0, 256], found 0");
  EXPECT_EQ(err([](AlertThresholds& t) { t.input_activations = {""}; }),
            "alerts: input_activations: expected non-empty activation names, found ''");
  EXPECT_EQ(err([](AlertThresholds& t) { t.divergence_window = 2; }),
            "alerts: divergence_window: expected an integer >= 3, found 2");
  EXPECT_EQ(err([](AlertThresholds& t) { t.divergence_nats = -1; }),
            "alerts: divergence_nats: expected a finite number >= 0, found -1");
  EXPECT_EQ(err([](AlertThresholds& t) { t.tensor_baseline = 0; }),
            "alerts: tensor_baseline: expected an integer in [1, 1000000], found 0");
  EXPECT_EQ(err([](AlertThresholds& t) { t.kurtosis_rise = 1; }),
            "alerts: kurtosis_rise: expected a finite number > 1, found 1");
  EXPECT_EQ(err([](AlertThresholds& t) { t.kurtosis_min = std::nan(""); }),
            "alerts: kurtosis_min: expected a finite number >= 0, found nan");
  EXPECT_EQ(err([](AlertThresholds& t) { t.spread_rise_binades = 0; }),
            "alerts: spread_rise_binades: expected a finite number > 0, found 0");
  EXPECT_EQ(err([](AlertThresholds& t) { t.far_blocks_rise = 1.5; }),
            "alerts: far_blocks_rise: expected a number in (0, 1], found 1.5");
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([] { AlertMonitor m({}, ctx("dynamic", "fp12")); }),
                       "alerts: precision: expected fp32, fp16, bf16, fp16-pure, bf16-pure, fp8-noscale, fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4 or mxfp4, found 'fp12'"));
  // The loss-scale spec is read by TrainConfig's one parser (train::loss_scale_config): its
  // message, and no spec it refuses is taken here (static:abc was).
  for (const char* spec : {"pytorch", "static:abc", "static:0", "static", "static:1e400"}) {
    std::string expected;
    try {
      (void)train::loss_scale_config(spec);
    } catch (const std::invalid_argument& e) {
      expected = std::string("alerts: ") + e.what();
    }
    ASSERT_FALSE(expected.empty()) << spec;
    EXPECT_EQ(error_of<std::invalid_argument>([&] { AlertMonitor m({}, ctx(spec)); }), expected);
  }
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([] { AlertMonitor m({}, ctx("pytorch")); }),
                       "alerts: loss-scale: expected none, dynamic, static:S (S a finite number > 0) or a preset "
                       "(mixprec, torch"))
      << error_of<std::invalid_argument>([] { AlertMonitor m({}, ctx("pytorch")); });
  RunContext c = ctx("torch");
  c.loss_scale_config = loss_scale_preset("static");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { AlertMonitor m({}, c); }),
            "alerts: loss_scale_config: expected a dynamic rule (loss-scale 'torch'), found rule static");
}

TEST(AlertMonitor, ContextFromConfigAndIncreasingSteps) {
  train::TrainConfig c;
  c.precision = nn::Precision::bf16;
  c.loss_scale = "deepspeed";
  c.lr = 0.01;
  const RunContext r = RunContext::of(c);
  EXPECT_EQ(r.precision, "bf16");
  EXPECT_EQ(r.loss_scale, "deepspeed");
  EXPECT_EQ(r.lr, 0.01);
  AlertMonitor m({}, r);
  m.observe(healthy(3));
  EXPECT_EQ(error_of<std::invalid_argument>([&] { m.observe(healthy(3)); }),
            "alerts: step 3 follows step 3; expected increasing steps");
}

TEST(AlertMonitor, AlertIdsAndJson) {
  std::vector<std::string> all;
  for (AlertKind k : alert_kinds()) all.emplace_back(alert_id(k));
  EXPECT_EQ(all, (std::vector<std::string>{"persistent-overflow", "scale-collapse", "underflow-plateau",
                                           "forward-overflow", "scale-pinned", "nonfinite-input",
                                           "loss-divergence", "guarded-skip", "kurtosis-rise",
                                           "block-spread-rise"}));
  Alert a;
  a.kind = AlertKind::forward_overflow;
  a.id = "forward-overflow";
  a.step = 4;
  a.last_step = 9;
  a.steps = 2;
  a.message = "the \"logits\" overflowed";
  a.advice = "lower it";
  EXPECT_EQ(alert_json(a),
            R"({"id":"forward-overflow","step":4,"last_step":9,"steps":2,"message":"the \"logits\" overflowed",)"
            R"("advice":"lower it"})");
  EXPECT_EQ(alerts_json(std::vector<Alert>{}), "[]");
  EXPECT_EQ(alerts_json(std::vector<Alert>{a, a}), "[" + alert_json(a) + "," + alert_json(a) + "]");
  EXPECT_EQ(alert_text(a), "ALERT step 4 forward-overflow: the \"logits\" overflowed\n  try: lower it");
}

// ---- healthy runs -------------------------------------------------------------------

TEST(Alerts, HealthyRunsRaiseNothing) {
  // A dynamic scale finding its range: skips at steps 1..6 (2^16 -> 2^10), then clean.
  const auto dyn = run(300, [](StepRecord& r) { r.skipped = r.step <= 6; }, "mixprec");
  EXPECT_TRUE(evaluate(dyn, ctx("dynamic")).empty()) << ids(evaluate(dyn, ctx("dynamic"))).size();
  // The same under every dynamic preset.
  for (const char* p : {"torch", "deepspeed", "megatron", "apex", "keras", "tf-keras", "jmp"}) {
    const auto log = run(300, [](StepRecord& r) { r.skipped = r.step <= 6 || r.step % 97 == 0; }, p);
    EXPECT_TRUE(evaluate(log, ctx(p)).empty()) << p;
  }
  // fp32 and bf16 without scaling: no scale, nothing flushed.
  const auto plain = run(200, [](StepRecord& r) { r.scale = r.next_scale = 1; });
  EXPECT_TRUE(evaluate(plain, ctx("none", "fp32")).empty());
  EXPECT_TRUE(evaluate(plain, ctx("none", "bf16")).empty());
}

// ---- persistent overflow ------------------------------------------------------------

TEST(Alerts, EarlySkipsAreNormal) {
  // 15 skips during the 20-step warm-up, then one skip every 10 steps (10%).
  const auto log = run(200, [](StepRecord& r) { r.skipped = (r.step <= 20 && r.step % 4 != 0) || r.step % 10 == 0; },
                       "torch");
  EXPECT_EQ(raised_at(log, ctx("torch"), AlertKind::persistent_overflow), 0u);
}

TEST(Alerts, PersistentOverflowBoundary) {
  // Exactly 10 skips (20% of 50) after the warm-up: not more than the rate.
  const auto ten = run(120, [](StepRecord& r) { r.skipped = r.step > 20 && r.step <= 30; }, "deepspeed");
  EXPECT_EQ(raised_at(ten, ctx("deepspeed"), AlertKind::persistent_overflow), 0u);
  // 11: raised at the 11th.
  const auto eleven = run(120, [](StepRecord& r) { r.skipped = r.step > 20 && r.step <= 31; }, "deepspeed");
  EXPECT_EQ(raised_at(eleven, ctx("deepspeed"), AlertKind::persistent_overflow), 31u);
  // Skips during the warm-up never count: 20 early ones plus 10 later ones.
  const auto early = run(120, [](StepRecord& r) { r.skipped = r.step <= 30; }, "deepspeed");
  EXPECT_EQ(raised_at(early, ctx("deepspeed"), AlertKind::persistent_overflow), 0u);
  // Two bursts of 10, 60 steps apart: no 50-step window holds more than 10.
  const auto bursts = run(200, [](StepRecord& r) {
    r.skipped = (r.step > 20 && r.step <= 30) || (r.step > 80 && r.step <= 90);
  }, "deepspeed");
  EXPECT_EQ(raised_at(bursts, ctx("deepspeed"), AlertKind::persistent_overflow), 0u);
  // The same bursts 39 steps apart (both in steps 21..70): raised at the 11th skip, step 60.
  const auto close = run(200, [](StepRecord& r) {
    r.skipped = (r.step > 20 && r.step <= 30) || (r.step > 59 && r.step <= 69);
  }, "deepspeed");
  EXPECT_EQ(raised_at(close, ctx("deepspeed"), AlertKind::persistent_overflow), 60u);
  // Custom thresholds: rate 0.5 over 10 steps after a 5-step warm-up.
  AlertThresholds t;
  t.warmup_steps = 5;
  t.overflow_window = 10;
  t.overflow_skip_rate = 0.5;
  const auto alt = run(40, [](StepRecord& r) { r.skipped = r.step > 5 && r.step % 2 == 0; }, "deepspeed");
  EXPECT_EQ(raised_at(alt, ctx("deepspeed"), AlertKind::persistent_overflow, t), 0u);  // 5 of 10: not more
  const auto alt2 = run(40, [](StepRecord& r) { r.skipped = r.step > 5 && r.step % 3 != 0; }, "deepspeed");
  EXPECT_EQ(raised_at(alt2, ctx("deepspeed"), AlertKind::persistent_overflow, t), 14u);  // 6 of steps 6..14
}

TEST(Alerts, LearningRateTooHighNamesTheLearningRateAndTheData) {
  // 100x learning rate: the loss climbs, the gradient norm explodes, every other step
  // after step 12 overflows in the backward pass.
  const auto log = run(100, [](StepRecord& r) {
    const double t = static_cast<double>(r.step);
    r.lr = 0.3;
    r.loss = 6.0 + 0.05 * t;
    r.grad_norm = std::pow(1.15, t);
    r.skipped = r.step > 12 && r.step % 2 == 1;
    if (r.skipped) {
      r.grad_norm = std::numeric_limits<double>::quiet_NaN();
      r.overflow_activation = "h1.mlp.fc.grad";
      r.overflow_param = "h1.mlp.fc.w";
      r.act_grad_amax = std::numeric_limits<float>::infinity();
    }
  }, "mixprec");
  const std::vector<Alert> alerts = evaluate(log, ctx("dynamic", "fp16", 0.3));
  const Alert* a = find(alerts, AlertKind::persistent_overflow);
  ASSERT_NE(a, nullptr) << ids(alerts).size();
  EXPECT_EQ(a->step, 41u);  // the 11th skip after step 20: steps 21, 23, ..., 41
  EXPECT_EQ(a->last_step, 100u);
  EXPECT_EQ(a->steps, 60u);
  EXPECT_TRUE(contains(a->message, "11 of the last 21 steps after the warm-up (steps 21-41) were skipped")) << a->message;
  EXPECT_TRUE(contains(a->message, "the loss went from 7.05 to 8.05")) << a->message;
  EXPECT_TRUE(contains(a->message, "the gradient norm of the applied steps went from")) << a->message;
  EXPECT_TRUE(contains(a->message, "first in 'h1.mlp.fc.grad'")) << a->message;
  EXPECT_TRUE(contains(a->advice, "learning-rate or data problem that loss scaling cannot fix")) << a->advice;
  EXPECT_TRUE(contains(a->advice, "lower the learning rate (peak 0.3; try 0.03)")) << a->advice;
  EXPECT_TRUE(contains(a->advice, "check the data")) << a->advice;
  // The scale kept falling too: the collapse alert also points away from the scaler.
  const Alert* c = find(alerts, AlertKind::scale_collapse);
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(contains(c->advice, "look beyond the scaler")) << c->advice;
  EXPECT_TRUE(contains(c->advice, "learning rate")) << c->advice;
}

TEST(Alerts, PersistentOverflowWithoutScalingAndInjected) {
  const auto log = run(80, [](StepRecord& r) {
    r.scale = r.next_scale = 1;
    r.skipped = r.step > 20 && r.step % 3 == 0;
    r.injected = r.skipped && r.step < 40;
  });
  const auto alerts = evaluate(log, ctx("none"));
  const Alert* a = find(alerts, AlertKind::persistent_overflow);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->step, 51u);  // the 11th multiple of 3 after 20
  EXPECT_TRUE(contains(a->message, "7 of them were injected")) << a->message;
  EXPECT_TRUE(contains(a->message, "with no loss scaling nothing adapts")) << a->message;
  // No dynamic scale: no collapse, however many skips at scale 1.
  EXPECT_EQ(find(alerts, AlertKind::scale_collapse), nullptr);
}

// ---- scale collapse -------------------------------------------------------------------

TEST(Alerts, CollapseBoundary) {
  // After the warm-up, 8 backoffs within 50 steps and no growth: 2^16 -> 2^8.
  const auto eight = run(150, [](StepRecord& r) { r.skipped = r.step >= 30 && r.step <= 72 && r.step % 6 == 0; },
                         "torch");
  EXPECT_EQ(raised_at(eight, ctx("torch"), AlertKind::scale_collapse), 72u);
  const auto a = evaluate(eight, ctx("torch"));
  const Alert* c = find(a, AlertKind::scale_collapse);
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(contains(c->message, "fell from 65536 (2^16) to 256 (2^8) (8 binades) over steps 23-72 without growing "
                                   "once (8 skipped steps)"))
      << c->message;
  // Only 7 binades: nothing (and 7 skips in 50 is no persistent overflow either).
  const auto seven = run(150, [](StepRecord& r) { r.skipped = r.step >= 30 && r.step < 72 && r.step % 6 == 0; },
                         "torch");
  EXPECT_TRUE(evaluate(seven, ctx("torch")).empty());
  // 8 binades but spread over more than 50 steps: nothing.
  const auto slow = run(200, [](StepRecord& r) { r.skipped = r.step > 30 && r.step <= 102 && r.step % 9 == 0; },
                        "torch");
  EXPECT_EQ(raised_at(slow, ctx("torch"), AlertKind::scale_collapse), 0u);
  // Growths inside the window: not a monotone decline, though the scale falls by more
  // than 8 binades (two backoffs, then a growth after two clean steps: net -1 per 4 steps).
  LossScaleConfig cfg = loss_scale_preset("torch");
  cfg.growth_interval = 2;
  cfg.init_scale = 0x1p32;
  const auto grows = run(150, [](StepRecord& r) { r.skipped = r.step > 30 && r.step % 4 <= 1; }, "torch", &cfg);
  EXPECT_GE(grows[30].scale, 256.0f * grows.back().next_scale);
  EXPECT_EQ(raised_at(grows, ctx("torch"), AlertKind::scale_collapse), 0u);
  // During the warm-up a fall of 8 binades is the scale finding its range.
  const auto warm = run(100, [](StepRecord& r) { r.skipped = r.step <= 10; }, "torch");
  EXPECT_EQ(raised_at(warm, ctx("torch"), AlertKind::scale_collapse), 0u);
}

TEST(Alerts, CollapseBelowOneAndAtTheFloor) {
  // torch has no floor: 17 overflows in a row from 2^16 reach 2^-1, even in the warm-up.
  const auto below = run(30, [](StepRecord& r) { r.skipped = r.step <= 17; }, "torch");
  EXPECT_EQ(raised_at(below, ctx("torch"), AlertKind::scale_collapse), 17u);
  EXPECT_TRUE(contains(evaluate(below, ctx("torch"))[0].message, "fell below 1 (to 0.5 (2^-1) at step 17)"));
  // mixprec's floor of 1: the 17th overflow finds the scale at 1.
  const auto floor = run(30, [](StepRecord& r) { r.skipped = r.step <= 17; }, "mixprec");
  EXPECT_EQ(raised_at(floor, ctx("dynamic"), AlertKind::scale_collapse), 17u);
  EXPECT_TRUE(contains(evaluate(floor, ctx("dynamic"))[0].message, "overflowed with the loss scale already at 1 (2^0)"));
  // 16 overflows reach 1 without overflowing there: nothing.
  const auto at_one = run(30, [](StepRecord& r) { r.skipped = r.step <= 16; }, "mixprec");
  EXPECT_EQ(raised_at(at_one, ctx("dynamic"), AlertKind::scale_collapse), 0u);
  // Injected overflows at the floor do not count.
  const auto inj = run(30, [](StepRecord& r) {
    r.skipped = r.step <= 18;
    r.injected = r.step >= 17;
  }, "mixprec");
  EXPECT_EQ(raised_at(inj, ctx("dynamic"), AlertKind::scale_collapse), 0u);
  // A static scale of 1 that overflows: not a collapse.
  const auto stat = run(30, [](StepRecord& r) {
    r.scale = r.next_scale = 1;
    r.skipped = true;
  });
  EXPECT_EQ(raised_at(stat, ctx("static:1"), AlertKind::scale_collapse), 0u);
}

// ---- underflow plateau ------------------------------------------------------------------

// fp16 without scaling on a plateau: loss 5.75 +- 0.2%, 39% of the nonzero activation
// gradients flushed to zero.
void noscale(StepRecord& r, double change_per_step, double underflow) {
  r.scale = r.next_scale = 1;
  r.loss = 5.75 * (1 - change_per_step * static_cast<double>(r.step)) + ((r.step % 2) != 0 ? 0.01 : -0.01);
  r.act_grads.underflow = static_cast<std::uint64_t>(underflow * static_cast<double>(r.act_grads.nonzero));
  r.act_grad_amax = 0.5f;
  r.headroom_log2 = std::log2(65504.0 / 0.5);
}

TEST(Alerts, UnderflowPlateau) {
  const auto flat = run(60, [](StepRecord& r) { noscale(r, 0, 0.39); });
  EXPECT_EQ(raised_at(flat, ctx("none"), AlertKind::underflow_plateau), 30u);
  const auto alerts = evaluate(flat, ctx("none"));
  ASSERT_EQ(ids(alerts), std::vector<std::string>{"underflow-plateau"});
  const Alert& a = alerts[0];
  EXPECT_EQ(a.steps, 31u);
  EXPECT_TRUE(contains(a.message, "over steps 1-30 the loss stayed flat (5.75 -> 5.75, 0.00%) while 39.0% of the "
                                  "nonzero activation gradients flushed to zero in fp16"))
      << a.message;
  EXPECT_TRUE(contains(a.message, "17 binades of headroom")) << a.message;
  EXPECT_TRUE(contains(a.advice, "enable loss scaling: --loss-scale dynamic")) << a.advice;
  EXPECT_TRUE(contains(a.advice, "or a static scale of about 2^8 (8 binades below where the largest gradient would overflow)")) << a.advice;
  EXPECT_TRUE(contains(a.advice, "a larger learning rate cannot bring it back")) << a.advice;
}

TEST(Alerts, UnderflowPlateauBoundaries) {
  // The first and last thirds (10 steps each) are 20 steps apart: a loss falling 0.045%
  // per step changes by 0.9% (flat), 0.055% per step by 1.1% (learning).
  EXPECT_EQ(raised_at(run(40, [](StepRecord& r) { noscale(r, 0.00045, 0.39); }), ctx("none"),
                      AlertKind::underflow_plateau),
            30u);
  EXPECT_EQ(raised_at(run(40, [](StepRecord& r) { noscale(r, 0.00055, 0.39); }), ctx("none"),
                      AlertKind::underflow_plateau),
            0u);
  // Underflow exactly 25%: raised; just under: not.
  EXPECT_EQ(raised_at(run(40, [](StepRecord& r) { noscale(r, 0, 0.25); }), ctx("none"), AlertKind::underflow_plateau),
            30u);
  EXPECT_EQ(raised_at(run(40, [](StepRecord& r) { noscale(r, 0, 0.2499); }), ctx("none"),
                      AlertKind::underflow_plateau),
            0u);
  // A converged run with little underflow: a flat loss alone is no alert.
  EXPECT_EQ(raised_at(run(40, [](StepRecord& r) { noscale(r, 0, 0.01); }), ctx("none"), AlertKind::underflow_plateau),
            0u);
  // Once a forward overflow was raised, the underflow is not blamed on the scaling.
  const auto gaps = run(40, [](StepRecord& r) {
    noscale(r, 0, 0.39);
    if (r.step % 4 == 0) {
      r.loss_finite = false;
      r.loss = std::numeric_limits<double>::quiet_NaN();
      r.forward_nonfinite = "h0.ln1";
      r.skipped = true;
    }
  });
  EXPECT_EQ(raised_at(gaps, ctx("none"), AlertKind::underflow_plateau), 0u);
  EXPECT_EQ(ids(evaluate(gaps, ctx("none"))), std::vector<std::string>{"forward-overflow"});
  // Raised before the forward overflow, it stays, and steps with a non-finite loss are
  // left out of its count.
  const auto late = run(80, [](StepRecord& r) {
    noscale(r, 0, 0.39);
    if (r.step > 30 && r.step % 8 == 0) {
      r.loss_finite = false;
      r.forward_nonfinite = "h0.ln1";
      r.skipped = true;
    }
  });
  const auto both = evaluate(late, ctx("none"));
  ASSERT_EQ(ids(both), (std::vector<std::string>{"underflow-plateau", "forward-overflow"}));
  EXPECT_EQ(both[0].steps, 51u - 7u);  // every step from 30 on but 32, 40, ..., 80
}

TEST(Alerts, UnderflowAdviceFollowsTheScaling) {
  const auto flat = run(40, [](StepRecord& r) { noscale(r, 0, 0.5); });
  const auto stat = evaluate(flat, ctx("static:8"));
  ASSERT_EQ(stat.size(), 1u);
  EXPECT_TRUE(contains(stat[0].advice, "raise the static scale (static:8) by about 2^8")) << stat[0].advice;
  const auto dyn = evaluate(flat, ctx("deepspeed"));
  ASSERT_EQ(dyn.size(), 1u);
  EXPECT_TRUE(contains(dyn[0].advice, "grows only after 1000 clean steps (growth_interval)")) << dyn[0].advice;
  EXPECT_TRUE(contains(dyn[0].advice, "bf16 (--precision bf16)")) << dyn[0].advice;
  const auto bf = evaluate(flat, ctx("none", "bf16"));
  ASSERT_EQ(bf.size(), 1u);
  EXPECT_FALSE(contains(bf[0].advice, "--precision bf16")) << bf[0].advice;
}

// ---- scale pinned -------------------------------------------------------------------------

void pinned(StepRecord& r, double headroom, double underflow) {
  r.headroom_log2 = headroom;
  r.act_grad_amax = static_cast<float>(65504.0 / std::exp2(headroom));
  r.act_grads.underflow = static_cast<std::uint64_t>(underflow * static_cast<double>(r.act_grads.nonzero));
}

TEST(Alerts, ScalePinnedWhileValuesFlush) {
  const auto log = run(150, [](StepRecord& r) { pinned(r, 10, 0.02); }, "mixprec");
  EXPECT_EQ(raised_at(log, ctx("dynamic"), AlertKind::scale_pinned), 100u);
  const auto alerts = evaluate(log, ctx("dynamic"));
  ASSERT_EQ(ids(alerts), std::vector<std::string>{"scale-pinned"});
  EXPECT_TRUE(contains(alerts[0].message, "stayed at 65536 (2^16) for steps 1-100 while the largest activation gradient "
                                          "kept at least 10 binades of headroom"))
      << alerts[0].message;
  EXPECT_TRUE(contains(alerts[0].advice, "the policy (mixprec) grows only after 2000 clean steps")) << alerts[0].advice;
  EXPECT_TRUE(contains(alerts[0].advice, "a scale 2^9 times larger would still not overflow")) << alerts[0].advice;
  EXPECT_EQ(alerts[0].steps, 51u);
}

TEST(Alerts, ScalePinnedBoundaries) {
  // Headroom just under 8 binades on one step, underflow under 1%, or no telemetry: nothing.
  EXPECT_EQ(raised_at(run(150, [](StepRecord& r) { pinned(r, r.step == 60 ? 7.99 : 10, 0.02); }, "mixprec"),
                      ctx("dynamic"), AlertKind::scale_pinned),
            0u);
  EXPECT_EQ(raised_at(run(150, [](StepRecord& r) { pinned(r, 8, 0.01); }, "mixprec"), ctx("dynamic"),
                      AlertKind::scale_pinned),
            100u);
  EXPECT_EQ(raised_at(run(150, [](StepRecord& r) { pinned(r, 10, 0.0099); }, "mixprec"), ctx("dynamic"),
                      AlertKind::scale_pinned),
            0u);
  EXPECT_EQ(raised_at(run(150, [](StepRecord& r) {
                        pinned(r, 10, 0.02);
                        r.act_grad_amax = 0;
                        r.act_grad_tensors.clear();
                      }, "mixprec"),
                      ctx("dynamic"), AlertKind::scale_pinned),
            0u);
  // A skip (and the backoff) at step 50 starts a new run of steady steps: raised at 150.
  EXPECT_EQ(raised_at(run(160, [](StepRecord& r) {
                        pinned(r, 10, 0.02);
                        r.skipped = r.step == 50;
                      }, "mixprec"),
                      ctx("dynamic"), AlertKind::scale_pinned),
            150u);
  // A static scale is pinned on purpose.
  EXPECT_EQ(raised_at(run(150, [](StepRecord& r) { pinned(r, 10, 0.02); }), ctx("static:65536"),
                      AlertKind::scale_pinned),
            0u);
}

TEST(Alerts, ScalePinnedAtApexCap) {
  // apex caps the scale at 2^24: start there (grow every 2 steps) and stay.
  LossScaleConfig cfg = loss_scale_preset("apex");
  cfg.init_scale = 0x1p24;
  const auto log = run(120, [](StepRecord& r) { pinned(r, 12, 0.05); }, "apex", &cfg);
  const auto alerts = evaluate(log, ctx("apex"));
  const Alert* a = find(alerts, AlertKind::scale_pinned);
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(contains(a->message, "stayed at 16777216 (2^24) for steps 1-100, its maximum (max_scale),")) << a->message;
  EXPECT_TRUE(contains(a->advice, "raise or remove the policy's max_scale (now 16777216 (2^24))")) << a->advice;
}

// ---- forward overflow and non-finite input -------------------------------------------

TEST(Alerts, ForwardOverflowNamesTheLayer) {
  const auto log = run(40, [](StepRecord& r) {
    if (r.step == 7 || r.step == 9) {
      r.loss_finite = false;
      r.loss = std::numeric_limits<double>::quiet_NaN();
      r.forward_nonfinite = "h1.attn.qkv";
      r.skipped = true;
    }
  }, "mixprec");
  EXPECT_EQ(raised_at(log, ctx("dynamic", "fp16", 0.3), AlertKind::forward_overflow), 7u);
  const auto alerts = evaluate(log, ctx("dynamic", "fp16", 0.3));
  ASSERT_EQ(ids(alerts), std::vector<std::string>{"forward-overflow"});
  EXPECT_EQ(alerts[0].steps, 2u);
  EXPECT_EQ(alerts[0].last_step, 9u);
  EXPECT_TRUE(contains(alerts[0].message, "at step 7 the forward pass produced inf/NaN, first in 'h1.attn.qkv'"));
  EXPECT_TRUE(contains(alerts[0].advice, "cannot repair activations that overflowed in the forward pass"));
  EXPECT_TRUE(contains(alerts[0].advice, "lower the learning rate (peak 0.3; try 0.03)"));
  EXPECT_TRUE(contains(alerts[0].advice, "activations above 65504 overflow in fp16"));
  // In fp32 there is no format to switch to.
  const auto f32 = evaluate(log, ctx("none", "fp32"));
  ASSERT_EQ(f32.size(), 1u);
  EXPECT_FALSE(contains(f32[0].advice, "--precision bf16"));
}

TEST(Alerts, NonFiniteInputIsNotAForwardOverflow) {
  const auto log = run(10, [](StepRecord& r) {
    if (r.step == 3) {
      r.loss_finite = false;
      r.forward_nonfinite = "embedding";
      r.skipped = true;
    }
  }, "mixprec");
  const auto alerts = evaluate(log, ctx("dynamic"));
  ASSERT_EQ(ids(alerts), std::vector<std::string>{"nonfinite-input"});
  EXPECT_EQ(alerts[0].step, 3u);
  EXPECT_TRUE(contains(alerts[0].message, "the first tensor computed from the data, 'embedding', already held inf/NaN"));
  EXPECT_TRUE(contains(alerts[0].advice, "check the data for NaN/inf"));
  // Other input tensors can be named.
  AlertThresholds t;
  t.input_activations = {"x0"};
  const auto other = evaluate(log, ctx("dynamic"), t);
  ASSERT_EQ(ids(other), std::vector<std::string>{"forward-overflow"});
}

// ---- loss divergence --------------------------------------------------------------------

// The first 24 losses of the default task at lr 0.3 (100x): no overflow at all (headroom
// above 9 binades), the loss jumping during the warmup; then stuck at 5.67 while the
// gradients vanish (4.7% flushed to zero).
const double kHighLr[] = {6.94, 6.79, 6.20, 6.87, 9.28, 7.78, 10.86, 8.06, 7.44, 6.51, 6.06, 6.18,
                          7.13, 6.50, 7.20, 6.83, 6.83, 6.69, 6.13, 6.37, 5.97, 6.41, 6.17, 6.31};

TEST(Alerts, LearningRateTooHighWithoutOverflow) {
  const auto log = run(150, [](StepRecord& r) {
    r.lr = 0.3;
    r.loss = r.step <= 24 ? kHighLr[r.step - 1] : 5.67;
    pinned(r, 9.6, 0.047);
  }, "mixprec");
  const auto alerts = evaluate(log, ctx("dynamic", "fp16", 0.3));
  ASSERT_EQ(ids(alerts), std::vector<std::string>{"loss-divergence"});  // not scale-pinned: not the scaler
  const Alert& a = alerts[0];
  EXPECT_EQ(a.step, 5u);
  EXPECT_EQ(a.steps, 2u);  // steps 5 and 7
  EXPECT_TRUE(contains(a.message, "at step 5 the loss jumped to 9.28, 36% (2.45 nats) above the median of the "
                                  "previous 4 steps (6.83); the gradient norm was 1, with finite gradients: nothing "
                                  "overflowed, so loss scaling is not involved"))
      << a.message;
  EXPECT_TRUE(contains(a.advice, "lower the learning rate (peak 0.3; try 0.03)")) << a.advice;
  EXPECT_TRUE(contains(a.advice, "check the data")) << a.advice;
  // Without the jumps, the same run is blamed on the scale's wasted headroom.
  const auto calm = run(150, [](StepRecord& r) {
    r.loss = 5.67;
    pinned(r, 9.6, 0.047);
  }, "mixprec");
  EXPECT_EQ(ids(evaluate(calm, ctx("dynamic"))), std::vector<std::string>{"scale-pinned"});
}

TEST(Alerts, LossDivergenceBoundaries) {
  auto jump = [](double base, double to) {
    return run(20, [=](StepRecord& r) { r.loss = r.step == 15 ? to : base; });
  };
  // 20% and 0.25 nats above the median are both needed, strictly.
  EXPECT_EQ(raised_at(jump(5.0, 6.0), ctx(), AlertKind::loss_divergence), 0u);      // exactly 20%
  EXPECT_EQ(raised_at(jump(5.0, 6.01), ctx(), AlertKind::loss_divergence), 15u);
  EXPECT_EQ(raised_at(jump(1.0, 1.25), ctx(), AlertKind::loss_divergence), 0u);     // 25% but 0.25 nats
  EXPECT_EQ(raised_at(jump(1.0, 1.26), ctx(), AlertKind::loss_divergence), 15u);
  // Batch noise of +-5% around a falling loss: nothing.
  const auto noisy = run(300, [](StepRecord& r) {
    r.loss = (6.0 - 0.005 * static_cast<double>(r.step)) * (1 + 0.05 * std::sin(static_cast<double>(r.step) * 1.7));
  });
  EXPECT_TRUE(evaluate(noisy, ctx()).empty());
  // The median needs three earlier losses: a jump at step 3 is not judged.
  const auto early = run(10, [](StepRecord& r) { r.loss = r.step == 3 ? 9.0 : 6.0; });
  EXPECT_EQ(raised_at(early, ctx(), AlertKind::loss_divergence), 0u);
}

TEST(Alerts, IncrementalEqualsEvaluate) {
  const auto log = run(200, [](StepRecord& r) {
    noscale(r, 0, 0.4);
    r.skipped = r.step > 100 && r.step % 2 == 0;
    if (r.step == 150) {
      r.loss_finite = false;
      r.forward_nonfinite = "logits";
    }
  });
  AlertMonitor m({}, ctx("none"));
  std::vector<Alert> raised;
  for (const StepRecord& r : log)
    for (Alert& a : m.observe(r)) raised.push_back(std::move(a));
  const std::vector<Alert> all = evaluate(log, ctx("none"));
  ASSERT_EQ(ids(raised), ids(all));
  EXPECT_EQ(ids(all), (std::vector<std::string>{"underflow-plateau", "persistent-overflow", "forward-overflow"}));
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(raised[i].step, all[i].step);
    EXPECT_EQ(raised[i].message, all[i].message);
    EXPECT_EQ(raised[i].steps, 1u);  // when raised
  }
  EXPECT_GT(all[0].steps, 1u);        // counted afterwards
}

}  // namespace
}  // namespace mixprec::monitor

namespace mixprec::monitor {
namespace {

// A step guard's skips: the guarded-skip alert names the reason, the z-score, the largest
// gradient and the most saturated quantized tensor; guard skips are not overflows.
TEST(Alerts, GuardedSkipNamesReasonWhereAndAdvice) {
  const std::vector<StepRecord> log = run(120, [](StepRecord& r) {
    r.params = {{"wte", 0.5f, 1.0f}, {"h1.mlp.fc.weight", r.step == 60 ? 900.0f : 0.2f, 1.0f}};
    if (r.step == 60 || (r.step > 60 && r.step % 3 == 0)) {  // one spike, then many guarded skips
      r.skipped = true;
      r.skip_reason = SkipReason::grad_spike;
      r.grad_norm = 1234.0;
      r.grad_z = 9.5;
    }
    if (r.step == 60) {
      nn::Fp8TensorStats f;
      f.name = "h1.mlp.fc.input";
      f.elements = 100;
      f.nonzero = 100;
      f.saturated = 40;
      r.fp8.push_back(f);
    }
  });
  const std::vector<Alert> alerts = evaluate(log, ctx("none", "bf16"));
  const Alert* g = nullptr;
  for (const Alert& a : alerts) {
    EXPECT_NE(a.id, "persistent-overflow") << "a guard's skips are not overflows: " << a.message;
    if (a.id == "guarded-skip") g = &a;
  }
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->step, 60u);
  EXPECT_EQ(g->steps, 21u);
  EXPECT_NE(g->message.find("(grad_spike): the gradient norm, 1234, was 9.5 standard deviations"), std::string::npos)
      << g->message;
  EXPECT_NE(g->message.find("the largest gradient was 'h1.mlp.fc.weight''s (|max| 900)"), std::string::npos)
      << g->message;
  EXPECT_NE(g->message.find("'h1.mlp.fc.input' saturated 40 of 100"), std::string::npos) << g->message;
  EXPECT_NE(g->advice.find("bad batch"), std::string::npos) << g->advice;
  EXPECT_NE(g->advice.find("its recipe is too coarse"), std::string::npos) << g->advice;
}

// ---- per-tensor rules: kurtosis-rise and block-spread-rise --------------------------------

// One sampled quantized tensor: its kurtosis and its blocks' log2-multiplier std and far blocks.
nn::Fp8TensorStats sampled(const std::string& name, double kurtosis, double spread, std::uint64_t far,
                           std::uint64_t blocks = 100) {
  nn::Fp8TensorStats t;
  t.name = name;
  t.role = name.ends_with(".grad_output") ? lowp::Role::backward : lowp::Role::forward;
  t.recipe = "mxfp8";
  t.elements = blocks * 32;
  t.nonzero = blocks * 32;
  t.flushed = 10;
  lowp::BlockStats b;
  b.blocks = b.multiplier_blocks = blocks;
  b.log2_multiplier_std = spread;
  b.far_blocks = far;
  t.blocks = b;
  t.kurtosis = kurtosis;
  return t;
}

// Three tensors sampled every 2nd step from step 2: "a.input" steady, "b.input" whose kurtosis
// climbs from step `rise` on (x2 per sample), "b.weight" whose blocks spread from step `spread`.
std::vector<StepRecord> tensor_run(std::uint64_t n, std::uint64_t rise, std::uint64_t spread) {
  return run(n, [&](StepRecord& r) {
    if (r.step % 2 != 0) return;  // an unsampled step: the entries carry no statistics
    const double k = r.step >= rise ? 3.0 * std::pow(2.0, static_cast<double>((r.step - rise) / 2 + 1)) : 3.0;
    const double s = r.step >= spread ? 0.5 + 0.5 * static_cast<double>((r.step - spread) / 2 + 1) : 0.5;
    r.fp8 = {sampled("a.input", 3.1, 0.4, 0), sampled("b.input", k, 0.6, 0), sampled("b.weight", 3.0, s, 0)};
    nn::Fp8TensorStats unsampled = sampled("c.input", 500, 9, 50);
    unsampled.blocks.reset();
    unsampled.kurtosis.reset();
    r.fp8.push_back(unsampled);  // never counted
  }, "mixprec");
}

TEST(AlertRules, KurtosisRiseIsPerTensorAgainstItsOwnBaseline) {
  AlertThresholds t;  // baseline: the median of 3 samples; rise 4x and >= 10
  // b.input: 3 at steps 2-8 (baseline 3), then 6, 12 (4x: step 12), 24, ...
  const std::vector<StepRecord> log = tensor_run(30, 10, 1000);
  AlertMonitor m(t, ctx());
  std::vector<Alert> raised;
  for (const StepRecord& r : log)
    for (Alert& a : m.observe(r)) raised.push_back(std::move(a));
  ASSERT_EQ(raised.size(), 1u) << ::testing::PrintToString(ids(raised));
  const Alert& a = raised[0];
  EXPECT_EQ(a.id, "kurtosis-rise");
  EXPECT_EQ(a.tensor, "b.input");
  EXPECT_EQ(a.step, 12u);
  ASSERT_EQ(m.all().size(), 1u);
  EXPECT_EQ(m.all()[0].last_step, 30u);  // held at every later sample, counted on the one alert
  EXPECT_EQ(m.all()[0].steps, 10u);
  EXPECT_TRUE(contains(a.message, "'b.input' (layer b, its input x (the activation)) rose to 12, 4x its baseline 3"))
      << a.message;
  EXPECT_TRUE(contains(a.message, "FOG, arXiv 2505.20524")) << a.message;
  EXPECT_TRUE(contains(a.advice, "keep this layer's forward in bf16 (in the recipe-file entry of 'b': \"fprop\": \"bf16\")"))
      << a.advice;
  EXPECT_TRUE(contains(alert_json(a), R"("tensor":"b.input")")) << alert_json(a);
  // One step below each threshold: nothing. 4x but under kurtosis_min: nothing.
  AlertThresholds higher;
  higher.kurtosis_rise = 4.01;
  EXPECT_EQ(raised_at(log, ctx(), AlertKind::kurtosis_rise, higher), 14u);
  AlertThresholds floor;
  floor.kurtosis_min = 12.5;
  EXPECT_EQ(raised_at(log, ctx(), AlertKind::kurtosis_rise, floor), 14u);
  // A longer baseline takes later samples into it (steps 2-12: median 3), so step 12 only builds it.
  AlertThresholds longer;
  longer.tensor_baseline = 6;
  EXPECT_EQ(raised_at(log, ctx(), AlertKind::kurtosis_rise, longer), 14u);
}

TEST(AlertRules, BlockSpreadRiseOnTheStdOrTheFarBlocks) {
  // b.weight: std 0.5 to step 18, then 1.0, 1.5, 2.0, 2.5 (+2 binades: step 26).
  const std::vector<StepRecord> log = tensor_run(30, 1000, 20);
  EXPECT_EQ(raised_at(log, ctx(), AlertKind::kurtosis_rise), 0u);
  AlertMonitor m({}, ctx());
  std::vector<Alert> raised;
  for (const StepRecord& r : log)
    for (Alert& a : m.observe(r)) raised.push_back(std::move(a));
  ASSERT_EQ(raised.size(), 1u) << ::testing::PrintToString(ids(raised));
  EXPECT_EQ(raised[0].id, "block-spread-rise");
  EXPECT_EQ(raised[0].tensor, "b.weight");
  EXPECT_EQ(raised[0].step, 26u);
  EXPECT_TRUE(contains(raised[0].message, "the std of their log2 multipliers rose to 2.5 binades from 0.5"))
      << raised[0].message;
  AlertThresholds wide;
  wide.spread_rise_binades = 2.01;
  EXPECT_EQ(raised_at(log, ctx(), AlertKind::block_spread_rise, wide), 28u);
  // The far-blocks fraction alone: 0 for the baseline, then 4%, 5% (+0.05: raised).
  const std::vector<StepRecord> far = run(20, [](StepRecord& r) {
    const std::uint64_t f = r.step <= 6 ? 0 : r.step == 7 ? 4 : 5;
    r.fp8 = {sampled("h0.mlp.proj.grad_output", 3, 0.5, f)};
  });
  AlertMonitor mf({}, ctx());
  std::vector<Alert> by_far;
  for (const StepRecord& r : far)
    for (Alert& a : mf.observe(r)) by_far.push_back(std::move(a));
  ASSERT_EQ(by_far.size(), 1u);
  EXPECT_EQ(by_far[0].step, 8u);
  EXPECT_TRUE(contains(by_far[0].message, "5.0% of the blocks (0.0% before) now sit more than 2^8 below")) << by_far[0].message;
  EXPECT_TRUE(contains(by_far[0].advice, "keep this layer's backward in bf16 (in the recipe-file entry of 'h0.mlp.proj': "
                                         "\"backward_override\": \"high_precision\")"))
      << by_far[0].advice;
}

TEST(AlertRules, PerTensorAlertsAreRaisedOncePerTensorAndKind) {
  // Two tensors whose kurtosis rises at different steps: one alert each; another kind on the
  // same tensor is its own alert too; the run-wide kinds stay once per run.
  const std::vector<StepRecord> log = run(30, [](StepRecord& r) {
    const double k1 = r.step >= 10 ? 50 : 3, k2 = r.step >= 20 ? 50 : 3, s2 = r.step >= 24 ? 4 : 0.5;
    r.fp8 = {sampled("h0.attn.qkv.input", k1, 0.5, 0), sampled("h1.attn.qkv.input", k2, s2, 0)};
    if (r.step == 15 || r.step == 16) r.loss = 20;  // loss-divergence, once (twice held)
  });
  const std::vector<Alert> all = evaluate(log, ctx());
  std::vector<std::string> got;
  for (const Alert& a : all) got.push_back(a.id + "@" + std::to_string(a.step) + ":" + a.tensor);
  EXPECT_EQ(got, (std::vector<std::string>{"kurtosis-rise@10:h0.attn.qkv.input", "loss-divergence@15:",
                                           "kurtosis-rise@20:h1.attn.qkv.input", "block-spread-rise@24:h1.attn.qkv.input"}));
  EXPECT_EQ(all[1].steps, 2u);
  EXPECT_FALSE(contains(alert_json(all[1]), "tensor")) << alert_json(all[1]);
  EXPECT_EQ(all[0].steps, 21u);  // steps 10-30
  // What-ifs in the step name what the other recipes would flush.
  std::vector<StepRecord> wi = run(6, [](StepRecord& r) {
    nn::Fp8TensorStats t = sampled("fc1.input", r.step >= 5 ? 40 : 3, 0.5, 0);
    t.what_if = {{"nvfp4", lowp::Element::e2m1, 3200, 0, 320, 0.1, 200, 3, 1.0, -2.0, 2.0},
                 {"fp8-current", lowp::Element::e4m3, 3200, 0, 32, 0.05, 1, 0, 0.0, 0.0, 0.0}};
    r.fp8 = {t};
  });
  const std::vector<Alert> w = evaluate(wi, ctx());
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(contains(w[0].advice, "here mxfp8 flushes 0.3% of its nonzero values to zero, and the what-if says "
                                    "nvfp4 would flush 10.0% (3 of 200 blocks far) and fp8-current would flush 1.0% "
                                    "(0 of 1 blocks far)"))
      << w[0].advice;
}

}  // namespace
}  // namespace mixprec::monitor
