// Loss-scale policies: each preset against an independent model of its anchor over long random
// overflow sequences, hand-written edge cases, validation, set(), and save/load round trips.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <random>
#include <string>
#include <vector>

#include "mixprec/scaler/loss_scale.hpp"
#include "scaler/anchor_models.hpp"

namespace mixprec {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- overflow sequences with bursts and droughts ------------------------------------------

// A three-regime Markov chain: droughts (no overflow for long stretches), bursts (most steps
// overflow) and a normal regime where each step overflows with probability p.
std::vector<bool> overflow_sequence(std::uint64_t seed, std::size_t n, double p) {
  std::mt19937_64 rng(seed);
  auto u = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  std::vector<bool> seq;
  seq.reserve(n);
  int regime = 0;  // 0 normal, 1 drought, 2 burst
  while (seq.size() < n) {
    const double r = u();
    if (r < 0.004) regime = 1;
    else if (r < 0.008) regime = 2;
    else if (r < 0.02) regime = 0;
    const double q = regime == 0 ? p : regime == 1 ? 0.0 : 0.85;
    seq.push_back(u() < q);
  }
  return seq;
}

std::string bits(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}

std::string context(const std::vector<bool>& seq, std::size_t i) {
  std::string s;
  for (std::size_t j = i >= 20 ? i - 20 : 0; j <= i; ++j) s += seq[j] ? '1' : '0';
  return "step " + std::to_string(i) + " (last inputs " + s + ")";
}

// Runs the library scale and a model side by side; `same` returns "" or a description of the
// first difference in scale or counters. `model_step` may throw to model an anchor's error.
// Totals over every compared run, so the suite can check the sequences exercised the rules.
struct Totals {
  std::int64_t steps = 0, growths = 0, backoffs = 0, tolerated = 0, throws = 0;
};
Totals g_totals;

template <class Model>
void compare(const LossScaleConfig& config, Model model, const std::vector<bool>& seq,
             const std::function<void(Model&, bool)>& model_step,
             const std::function<std::string(const Model&, const LossScaleState&)>& same) {
  DynamicLossScale ls(config);
  ASSERT_EQ(same(model, ls.state()), "") << "initial state";
  for (std::size_t i = 0; i < seq.size(); ++i) {
    bool model_threw = false;
    try {
      model_step(model, seq[i]);
    } catch (const std::runtime_error&) {
      model_threw = true;
    }
    if (model_threw) {
      const LossScaleState before = ls.state();
      ASSERT_THROW(ls.update(seq[i]), ScaleCollapseError) << context(seq, i);
      ASSERT_EQ(ls.state(), before) << "a throwing update changed the state, " << context(seq, i);
      ++g_totals.throws;
      break;  // the anchor's run ends here
    }
    ASSERT_NO_THROW(ls.update(seq[i])) << context(seq, i);
    const std::string diff = same(model, ls.state());
    ASSERT_EQ(diff, "") << context(seq, i);
    ASSERT_EQ(ls.counters().steps, static_cast<std::int64_t>(i + 1));
  }
  const LossScaleCounters k = ls.counters();
  g_totals.steps += k.steps;
  g_totals.growths += k.growths;
  g_totals.backoffs += k.backoffs;
  g_totals.tolerated += k.overflows - k.backoffs;
}

// Each anchor test checks its runs grew and backed off many times (and, where asked, tolerated
// overflows through hysteresis and hit the floor error).
struct TotalsCheck {
  Totals start = g_totals;
  void expect(std::int64_t min_tolerated, std::int64_t min_throws) const {
    EXPECT_GT(g_totals.steps - start.steps, 100000);
    EXPECT_GT(g_totals.growths - start.growths, 1000);
    EXPECT_GT(g_totals.backoffs - start.backoffs, 1000);
    EXPECT_GE(g_totals.tolerated - start.tolerated, min_tolerated);
    EXPECT_GE(g_totals.throws - start.throws, min_throws);
  }
};

std::string diff_scale(double model, const LossScaleState& s) {
  if (std::bit_cast<std::uint64_t>(model) == std::bit_cast<std::uint64_t>(s.scale)) return "";
  return "scale: model " + bits(model) + ", library " + bits(s.scale);
}
std::string diff_count(const char* what, std::int64_t model, std::int64_t lib) {
  if (model == lib) return "";
  return std::string(what) + ": model " + std::to_string(model) + ", library " + std::to_string(lib);
}

// Sequence parameters: several seeds and overflow probabilities, thousands of steps each.
struct SeqCase {
  std::uint64_t seed;
  double p;
};
const SeqCase kSeqs[] = {{1, 0.001}, {2, 0.01}, {3, 0.05}, {4, 0.2}, {5, 0.5}, {6, 0.003}};
constexpr std::size_t kSteps = 6000;

// Growth intervals small enough to grow many times in a few thousand steps, and the default.
const std::int64_t kIntervals[] = {1, 2, 3, 7, 50, 0 /* preset default */};

LossScaleConfig with(LossScaleConfig c, std::int64_t interval, double init = 0) {
  if (interval > 0) c.growth_interval = interval;
  if (init > 0) c.init_scale = init;
  return c;
}

// ---- anchors vs library ------------------------------------------------------------------

TEST(LossScaleAnchors, TorchTrajectories) {
  const TotalsCheck totals;
  std::size_t runs = 0;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (double init : {65536.0, 0x1p120, 3.0}) {
        for (auto [g, b] : {std::pair{2.0, 0.5}, std::pair{3.0, 0.3}, std::pair{1.5, 0.9}}) {
          LossScaleConfig c = with(loss_scale_preset("torch"), iv, init);
          c.growth_factor = g;
          c.backoff_factor = b;
          anchors::Torch m{static_cast<float>(c.init_scale), g, b, static_cast<std::int32_t>(c.growth_interval)};
          compare<anchors::Torch>(
              c, m, seq, [](anchors::Torch& t, bool f) { t.update(f); },
              [](const anchors::Torch& t, const LossScaleState& s) {
                std::string d = diff_scale(static_cast<double>(t.scale), s);
                if (d.empty()) d = diff_count("growth_tracker", t.tracker, s.counters.growth_tracker);
                return d;
              });
          ++runs;
        }
      }
    }
  }
  EXPECT_EQ(runs, std::size(kSeqs) * std::size(kIntervals) * 9);
  totals.expect(0, 0);
}

TEST(LossScaleAnchors, MixprecTrajectories) {
  const TotalsCheck totals;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed + 100, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (bool raise : {true, false}) {
        for (std::int64_t n : {1, 3, 10}) {
          LossScaleConfig c = with(loss_scale_preset("mixprec"), iv, 64.0);
          c.floor_policy = raise ? FloorPolicy::error : FloorPolicy::keep_going;
          c.max_floor_overflows = n;
          anchors::MixprecModel m{{64.0f, 2.0, 0.5, static_cast<std::int32_t>(c.growth_interval)}, 1.0f,
                                  static_cast<int>(n), raise};
          compare<anchors::MixprecModel>(
              c, m, seq, [](anchors::MixprecModel& t, bool f) { t.update(f); },
              [](const anchors::MixprecModel& t, const LossScaleState& s) {
                std::string d = diff_scale(static_cast<double>(t.torch.scale), s);
                if (d.empty()) d = diff_count("growth_tracker", t.torch.tracker, s.counters.growth_tracker);
                if (d.empty()) d = diff_count("floor_overflows", t.at_floor, s.counters.floor_overflows);
                return d;
              });
        }
      }
    }
  }
  totals.expect(0, 10);
}

TEST(LossScaleAnchors, DeepSpeedTrajectories) {
  const TotalsCheck totals;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed + 200, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (std::int64_t h : {1, 2, 4}) {
        for (bool consecutive : {false, true}) {
          for (bool raise : {false, true}) {
            for (double init : {65536.0, 0x1p1015}) {
              LossScaleConfig c = with(loss_scale_preset("deepspeed"), iv, init);
              c.hysteresis = h;
              c.consecutive_hysteresis = consecutive;
              c.floor_policy = raise ? FloorPolicy::error : FloorPolicy::keep_going;
              anchors::DeepSpeed m{c.init_scale, 2.0, c.growth_interval, 1.0, h, consecutive, raise};
              compare<anchors::DeepSpeed>(
                  c, m, seq, [](anchors::DeepSpeed& t, bool f) { t.update_scale(f); },
                  [](const anchors::DeepSpeed& t, const LossScaleState& s) {
                    std::string d = diff_scale(t.cur_scale, s);
                    if (d.empty()) d = diff_count("cur_hysteresis", t.cur_hysteresis, s.counters.hysteresis_left);
                    if (d.empty()) d = diff_count("cur_iter", t.cur_iter, s.counters.iteration);
                    if (d.empty())
                      d = diff_count("last_overflow_iter", t.last_overflow_iter, s.counters.last_overflow_iter);
                    return d;
                  });
            }
          }
        }
      }
    }
  }
  totals.expect(1000, 10);
}

TEST(LossScaleAnchors, MegatronTrajectories) {
  const TotalsCheck totals;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed + 300, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (std::int64_t h : {1, 2, 5}) {
        for (double init : {0x1p32, 0x1p120}) {
          LossScaleConfig c = with(loss_scale_preset("megatron"), iv, init);
          c.hysteresis = h;
          anchors::Megatron m{static_cast<float>(c.init_scale), 1.0f, 2.0f, 0.5f, c.growth_interval, h};
          compare<anchors::Megatron>(
              c, m, seq, [](anchors::Megatron& t, bool f) { t.update(f); },
              [](const anchors::Megatron& t, const LossScaleState& s) {
                std::string d = diff_scale(static_cast<double>(t.scale), s);
                if (d.empty()) d = diff_count("growth_tracker", t.growth_tracker, s.counters.growth_tracker);
                if (d.empty())
                  d = diff_count("hysteresis_tracker", t.hysteresis_tracker, s.counters.hysteresis_left);
                return d;
              });
        }
      }
    }
  }
  totals.expect(1000, 0);
}

TEST(LossScaleAnchors, ApexTrajectories) {
  const TotalsCheck totals;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed + 400, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (double mn : {0.0, 1.0, 128.0}) {
        for (double mx : {0x1p24, kInf}) {
          LossScaleConfig c = with(loss_scale_preset("apex"), iv, 65536.0);
          c.min_scale = mn;
          c.max_scale = mx;
          anchors::Apex m{65536.0, mn, mx, c.growth_interval};
          compare<anchors::Apex>(
              c, m, seq, [](anchors::Apex& t, bool f) { t.update_scale(f); },
              [](const anchors::Apex& t, const LossScaleState& s) {
                std::string d = diff_scale(t.loss_scale, s);
                if (d.empty()) d = diff_count("unskipped", t.unskipped, s.counters.growth_tracker);
                return d;
              });
        }
      }
    }
  }
  totals.expect(0, 0);
}

// Keras 3: no floor and no guard, so these runs also fall below 1 (the bursts) and, from 2^125
// with short intervals, reach inf and stay there.
TEST(LossScaleAnchors, KerasTrajectories) {
  const TotalsCheck totals;
  int went_below_one = 0, reached_inf = 0, reached_zero = 0;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed + 500, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (double init : {32768.0, 0x1p125, 0x1p-120}) {
        const LossScaleConfig c = with(loss_scale_preset("keras"), iv, init);
        anchors::Keras3 m{static_cast<float>(c.init_scale), c.growth_interval};
        bool below = false, inf = false, zero = false;
        compare<anchors::Keras3>(
            c, m, seq,
            [&](anchors::Keras3& t, bool f) {
              t.apply(!f);
              below = below || t.dynamic_scale < 1.0f;
              inf = inf || std::isinf(t.dynamic_scale);
              zero = zero || t.dynamic_scale == 0.0f;
            },
            [](const anchors::Keras3& t, const LossScaleState& s) {
              std::string d = diff_scale(static_cast<double>(t.dynamic_scale), s);
              if (d.empty()) d = diff_count("step_counter", t.step_counter, s.counters.growth_tracker);
              return d;
            });
        went_below_one += below ? 1 : 0;
        reached_inf += inf ? 1 : 0;
        reached_zero += zero ? 1 : 0;
      }
    }
  }
  totals.expect(0, 0);
  EXPECT_GT(went_below_one, 10);
  EXPECT_GT(reached_inf, 0);
  EXPECT_GT(reached_zero, 0);
}

// Trajectories recorded from the real Keras 3 LossScaleOptimizer (keras 3.15.1, backend torch:
// see the file's header and record_keras3.py), replayed through the keras preset: the same
// float32 scale and step_counter after every step. The sequences include 30 overflows from
// 2^15, a collapse to 0, growth to inf with growth steps 1, and seeded burst/drought runs.
TEST(LossScaleAnchors, RecordedKeras3Trajectories) {
  const std::string path = std::string(MIXPREC_SCALER_FIXTURES) + "/keras3_trajectories.txt";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot open " << path;
  auto number = [](const std::string& s) {
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    EXPECT_EQ(*end, '\0') << "not a number: " << s;
    return v;
  };
  std::optional<DynamicLossScale> ls;
  std::string name, line;
  std::int64_t cases = 0, steps = 0, expected_steps = 0, step = 0;
  bool saw_inf = false, saw_zero = false, saw_below_one = false;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    if (line.rfind("case ", 0) == 0) {
      ASSERT_EQ(step, expected_steps) << "case " << name << " is short";
      std::string kw, init;
      std::int64_t growth_steps = 0;
      is >> kw >> name >> growth_steps >> init >> expected_steps;
      ASSERT_TRUE(is) << line;
      LossScaleConfig c = loss_scale_preset("keras");
      c.growth_interval = growth_steps;
      c.init_scale = number(init);
      ls.emplace(c);
      ASSERT_EQ(bits(ls->state().scale), bits(number(init))) << name;
      ++cases;
      step = 0;
      continue;
    }
    ASSERT_TRUE(ls.has_value()) << "a step before the first case: " << line;
    int overflow = 0;
    std::string scale;
    std::int64_t counter = 0;
    is >> overflow >> scale >> counter;
    ASSERT_TRUE(is) << line;
    ++step;
    ++steps;
    ASSERT_NO_THROW(ls->update(overflow == 1)) << name << " step " << step;
    const double want = number(scale);
    ASSERT_EQ(bits(ls->state().scale), bits(want)) << name << " step " << step;
    ASSERT_EQ(ls->counters().growth_tracker, counter) << name << " step " << step;
    saw_inf = saw_inf || std::isinf(want);
    saw_zero = saw_zero || want == 0;
    saw_below_one = saw_below_one || want < 1;
  }
  EXPECT_EQ(step, expected_steps) << "case " << name << " is short";
  EXPECT_GE(cases, 10);
  EXPECT_GT(steps, 15000);
  EXPECT_TRUE(saw_inf && saw_zero && saw_below_one);
}

TEST(LossScaleAnchors, TfKerasTrajectories) {
  const TotalsCheck totals;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed + 500, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (double init : {32768.0, 0x1p125}) {
        const LossScaleConfig c = with(loss_scale_preset("tf-keras"), iv, init);
        anchors::TfKeras m{static_cast<float>(c.init_scale), c.growth_interval};
        compare<anchors::TfKeras>(
            c, m, seq, [](anchors::TfKeras& t, bool f) { t.update(!f); },
            [](const anchors::TfKeras& t, const LossScaleState& s) {
              std::string d = diff_scale(static_cast<double>(t.current_loss_scale), s);
              if (d.empty()) d = diff_count("counter", t.counter, s.counters.growth_tracker);
              return d;
            });
      }
    }
  }
  totals.expect(0, 0);
}

TEST(LossScaleAnchors, JmpTrajectories) {
  const TotalsCheck totals;
  for (const SeqCase& sc : kSeqs) {
    const auto seq = overflow_sequence(sc.seed + 600, kSteps, sc.p);
    for (std::int64_t iv : kIntervals) {
      for (double init : {32768.0, 0x1p125}) {
        for (double mn : {1.0, 0.25}) {
          LossScaleConfig c = with(loss_scale_preset("jmp"), iv, init);
          c.min_scale = mn;
          anchors::Jmp m{static_cast<float>(c.init_scale), static_cast<std::int32_t>(c.growth_interval), 2.0f,
                         static_cast<float>(mn)};
          compare<anchors::Jmp>(
              c, m, seq, [](anchors::Jmp& t, bool f) { t.adjust(!f); },
              [](const anchors::Jmp& t, const LossScaleState& s) {
                std::string d = diff_scale(static_cast<double>(t.loss_scale), s);
                if (d.empty()) d = diff_count("counter", t.counter, s.counters.growth_tracker);
                return d;
              });
        }
      }
    }
  }
  totals.expect(0, 0);
}

// ---- hand-written edge cases ---------------------------------------------------------------

LossScaleConfig torch_example() {
  LossScaleConfig c = loss_scale_preset("torch");
  c.growth_factor = 2;
  c.backoff_factor = 0.25;
  c.growth_interval = 2;
  c.init_scale = 4;
  return c;
}

TEST(LossScaleRules, TorchReferenceExample) {
  DynamicLossScale ls(torch_example());
  EXPECT_EQ(ls.scale(), 4.0f);
  ls.update(false);
  EXPECT_EQ(ls.scale(), 4.0f);
  EXPECT_EQ(ls.counters().growth_tracker, 1);
  ls.update(false);
  EXPECT_EQ(ls.scale(), 8.0f);
  EXPECT_EQ(ls.counters().growth_tracker, 0);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 2.0f);
  EXPECT_EQ(ls.counters().growth_tracker, 0);
  EXPECT_EQ(ls.counters().steps, 3);
  EXPECT_EQ(ls.counters().overflows, 1);
  EXPECT_EQ(ls.counters().growths, 1);
  EXPECT_EQ(ls.counters().backoffs, 1);
}

TEST(LossScaleRules, TorchHasNoFloorAndUnderflowsToZero) {
  DynamicLossScale ls(loss_scale_preset("torch"));
  for (int i = 0; i < 16; ++i) ls.update(true);
  EXPECT_EQ(ls.scale(), 1.0f);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 0.5f);
  for (int i = 0; i < 200; ++i) ls.update(true);
  EXPECT_EQ(ls.scale(), 0.0f);  // float32 underflow, as in torch
  const LossScaleState s = ls.state();
  DynamicLossScale other(loss_scale_preset("torch"));
  other.load_json(s.to_json());  // a state with scale 0 (no floor) still round-trips
  EXPECT_EQ(other.state(), s);
}

TEST(LossScaleRules, GrowthIntoInfinityIsRefused) {
  for (const char* preset : {"torch", "tf-keras", "jmp", "mixprec"}) {
    LossScaleConfig c = loss_scale_preset(preset);
    c.growth_interval = 1;
    c.init_scale = 0x1p127;
    DynamicLossScale ls(c);
    ls.update(false);
    EXPECT_EQ(ls.scale(), 0x1p127f) << preset;
    EXPECT_EQ(ls.counters().growth_tracker, 0) << preset;
    EXPECT_EQ(ls.counters().growths, 0) << preset;
    c.refuse_nonfinite_growth = false;
    DynamicLossScale grows(c);
    grows.update(false);
    EXPECT_TRUE(std::isinf(grows.scale())) << preset;
  }
  // Megatron has no guard (float32 tensor grows to inf) unless asked for one.
  LossScaleConfig m = loss_scale_preset("megatron");
  m.growth_interval = 1;
  m.init_scale = 0x1p127;
  DynamicLossScale meg(m);
  meg.update(false);
  EXPECT_TRUE(std::isinf(meg.scale()));
  meg.update(true);
  meg.update(true);
  EXPECT_TRUE(std::isinf(meg.scale()));  // inf * 0.5 stays inf
  const LossScaleState s = meg.state();
  EXPECT_NE(s.to_json().find("\"scale\":\"inf\""), std::string::npos);
  DynamicLossScale back(m);
  back.load_json(s.to_json());
  EXPECT_EQ(back.state(), s);
  m.refuse_nonfinite_growth = true;
  DynamicLossScale guarded(m);
  guarded.update(false);
  EXPECT_EQ(guarded.scale(), 0x1p127f);
  // DeepSpeed's Python float grows past float32 range and on to inf in double.
  LossScaleConfig d = loss_scale_preset("deepspeed");
  d.growth_interval = 1;
  d.init_scale = 0x1p1023;
  DynamicLossScale ds(d);
  ds.update(false);
  ds.update(false);  // stable = 1: grows
  EXPECT_TRUE(std::isinf(ds.state().scale));
}

TEST(LossScaleRules, ApexClampsAtMax) {
  LossScaleConfig c = loss_scale_preset("apex");
  EXPECT_EQ(c.max_scale, 0x1p24);
  c.growth_interval = 1;
  c.init_scale = 0x1p23;
  DynamicLossScale ls(c);
  ls.update(false);
  EXPECT_EQ(ls.scale(), 0x1p24f);
  ls.update(false);
  EXPECT_EQ(ls.scale(), 0x1p24f);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 0x1p23f);
  // No floor by default: halves below 1.
  c.init_scale = 1;
  c.growth_interval = 100;
  DynamicLossScale low(c);
  low.update(true);
  EXPECT_EQ(low.state().scale, 0.5);
}

TEST(LossScaleRules, DeepSpeedHysteresisIsolatedVsConsecutive) {
  // Not consecutive (default): hysteresis refills only on growth, so two isolated overflows back off.
  LossScaleConfig c = loss_scale_preset("deepspeed");
  DynamicLossScale ls(c);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 65536.0f);
  EXPECT_EQ(ls.counters().hysteresis_left, 1);
  EXPECT_EQ(ls.counters().last_overflow_iter, 0);
  for (int i = 0; i < 10; ++i) ls.update(false);
  EXPECT_EQ(ls.counters().hysteresis_left, 1);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 32768.0f);
  EXPECT_EQ(ls.counters().iteration, 12);
  EXPECT_EQ(ls.counters().last_overflow_iter, 11);
  // Consecutive: every clean step refills, so isolated overflows never back off...
  c.consecutive_hysteresis = true;
  DynamicLossScale cons(c);
  for (int i = 0; i < 50; ++i) {
    cons.update(true);
    cons.update(false);
  }
  EXPECT_EQ(cons.scale(), 65536.0f);
  EXPECT_EQ(cons.counters().hysteresis_left, 2);
  // ...but two in a row do.
  cons.update(true);
  cons.update(true);
  EXPECT_EQ(cons.scale(), 32768.0f);
  EXPECT_EQ(cons.counters().hysteresis_left, 1);
}

TEST(LossScaleRules, DeepSpeedWindowCountsFromLastOverflow) {
  LossScaleConfig c = loss_scale_preset("deepspeed");
  c.growth_interval = 3;
  DynamicLossScale ls(c);
  // stable = iter - (-1) - 1 = iter: grows at iter 3 (the 4th clean step), then at 6.
  for (int i = 0; i < 3; ++i) ls.update(false);
  EXPECT_EQ(ls.scale(), 65536.0f);
  ls.update(false);
  EXPECT_EQ(ls.scale(), 131072.0f);
  ls.update(true);  // iter 4: hysteresis 2 -> 1, last_overflow_iter 4
  EXPECT_EQ(ls.scale(), 131072.0f);
  for (int i = 0; i < 3; ++i) ls.update(false);  // iters 5..7: stable 0, 1, 2
  EXPECT_EQ(ls.scale(), 131072.0f);
  ls.update(false);  // iter 8: stable 3: grows, refills hysteresis
  EXPECT_EQ(ls.scale(), 262144.0f);
  EXPECT_EQ(ls.counters().hysteresis_left, 2);
}

TEST(LossScaleRules, DeepSpeedRaisesAtMinScale) {
  LossScaleConfig c = loss_scale_preset("deepspeed");
  c.init_scale = 2;
  c.hysteresis = 1;
  DynamicLossScale ls(c);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 1.0f);
  const LossScaleState before = ls.state();
  EXPECT_THROW(ls.update(true), ScaleCollapseError);
  EXPECT_EQ(ls.state(), before);
  c.floor_policy = FloorPolicy::keep_going;
  DynamicLossScale keep(c);
  for (int i = 0; i < 5; ++i) keep.update(true);
  EXPECT_EQ(keep.scale(), 1.0f);
}

TEST(LossScaleRules, MegatronHysteresisTrackerKeepsCounting) {
  LossScaleConfig c = loss_scale_preset("megatron");
  DynamicLossScale ls(c);
  ls.update(true);  // isolated: tolerated
  EXPECT_EQ(ls.scale(), 0x1p32f);
  EXPECT_EQ(ls.counters().hysteresis_left, 1);
  ls.update(false);
  ls.update(true);  // no growth in between: backs off
  EXPECT_EQ(ls.scale(), 0x1p31f);
  EXPECT_EQ(ls.counters().hysteresis_left, 0);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 0x1p30f);
  EXPECT_EQ(ls.counters().hysteresis_left, -1);
  for (int i = 0; i < 1000; ++i) ls.update(false);  // growth refills
  EXPECT_EQ(ls.scale(), 0x1p31f);
  EXPECT_EQ(ls.counters().hysteresis_left, 2);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 0x1p31f);
}

TEST(LossScaleRules, TfKerasAndJmpFloorAtOne) {
  for (const char* p : {"tf-keras", "jmp"}) {
    LossScaleConfig c = loss_scale_preset(p);
    c.init_scale = 2;
    DynamicLossScale ls(c);
    ls.update(true);
    ls.update(true);
    ls.update(true);
    EXPECT_EQ(ls.scale(), 1.0f) << p;
    EXPECT_EQ(ls.counters().floor_overflows, 2) << p;
  }
}

// Keras 3 (keras preset): 30 overflows in a row from 2^15 halve it 30 times, through 1 and on
// below it: 2^14, 2^13, ..., 2^-15, each exact. tf-keras stops at its floor, 1.
TEST(LossScaleRules, KerasThirtyOverflowsGoBelowOne) {
  DynamicLossScale k3(loss_scale_preset("keras"));
  DynamicLossScale tf(loss_scale_preset("tf-keras"));
  EXPECT_EQ(k3.scale(), 0x1p15f);
  for (int i = 1; i <= 30; ++i) {
    k3.update(true);
    tf.update(true);
    EXPECT_EQ(k3.state().scale, std::ldexp(1.0, 15 - i)) << "overflow " << i;
    EXPECT_EQ(tf.state().scale, std::ldexp(1.0, std::max(0, 15 - i))) << "overflow " << i;
    EXPECT_EQ(k3.counters().growth_tracker, 0);
  }
  EXPECT_EQ(k3.scale(), 0x1p-15f);
  EXPECT_EQ(k3.counters().backoffs, 30);
  EXPECT_EQ(k3.counters().floor_overflows, 0) << "keras has no floor";
  EXPECT_EQ(tf.scale(), 1.0f);
  EXPECT_EQ(tf.counters().floor_overflows, 15);
  // On through the float32 subnormals: 2^-149 after 164 overflows, then 0 (2^-150 rounds to
  // even), and 0 stays 0 (0 * 2 = 0; Keras 3 has no guard against it either).
  for (int i = 31; i <= 164; ++i) k3.update(true);
  EXPECT_EQ(k3.scale(), 0x1p-149f);
  k3.update(true);
  EXPECT_EQ(k3.scale(), 0.0f);
  EXPECT_FALSE(std::signbit(k3.scale()));
  LossScaleConfig one = loss_scale_preset("keras");
  one.growth_interval = 1;
  LossScaleState zero = k3.state();
  zero.config = one;
  DynamicLossScale z(one);
  z.load(zero);
  for (int i = 0; i < 5; ++i) z.update(false);
  EXPECT_EQ(z.scale(), 0.0f);
  EXPECT_EQ(z.counters().growths, 5);
  DynamicLossScale back(loss_scale_preset("keras"));
  back.load_json(k3.to_json());  // a state with scale 0 round-trips
  EXPECT_EQ(back.state(), k3.state());
}

// Keras 3 with dynamic_growth_steps 1: every clean step doubles, up to 2^127 (the largest power
// of two float32 holds) and then to inf; inf * 0.5 stays inf, so no overflow brings it back.
// tf-keras refuses the growth into inf and stays at 2^127.
TEST(LossScaleRules, KerasGrowsToInfinityAndNeverRecovers) {
  LossScaleConfig c = loss_scale_preset("keras");
  c.growth_interval = 1;
  LossScaleConfig t = loss_scale_preset("tf-keras");
  t.growth_interval = 1;
  DynamicLossScale k3(c), tf(t);
  for (int i = 1; i <= 112; ++i) {
    k3.update(false);
    tf.update(false);
    ASSERT_EQ(k3.state().scale, std::ldexp(1.0, 15 + i)) << "clean step " << i;
    ASSERT_EQ(tf.state().scale, k3.state().scale);
  }
  EXPECT_EQ(k3.scale(), 0x1p127f);
  k3.update(false);
  tf.update(false);
  EXPECT_TRUE(std::isinf(k3.scale()));
  EXPECT_GT(k3.scale(), 0.0f);
  EXPECT_EQ(k3.counters().growths, 113);
  EXPECT_EQ(tf.scale(), 0x1p127f);
  EXPECT_EQ(tf.counters().growths, 112);
  for (int i = 0; i < 50; ++i) k3.update(i % 3 != 2);  // overflows and clean steps alike
  EXPECT_TRUE(std::isinf(k3.scale()));
  EXPECT_EQ(k3.counters().backoffs, 34);
  for (int i = 0; i < 200; ++i) k3.update(true);
  EXPECT_TRUE(std::isinf(k3.scale())) << "inf * 0.5 is inf: the scale never recovers";
  const std::string saved = k3.to_json();
  EXPECT_NE(saved.find("\"scale\":\"inf\""), std::string::npos);
  DynamicLossScale back(c);
  back.load_json(saved);
  EXPECT_EQ(back.state(), k3.state());
}

// The counter: Keras 3 grows when step_counter == dynamic_growth_steps - 1 (the 2000th clean
// step in a row) and resets it there and on every overflow.
TEST(LossScaleRules, KerasGrowthCounter) {
  DynamicLossScale k3(loss_scale_preset("keras"));
  for (int i = 0; i < 1999; ++i) k3.update(false);
  EXPECT_EQ(k3.scale(), 0x1p15f);
  EXPECT_EQ(k3.counters().growth_tracker, 1999);
  k3.update(false);
  EXPECT_EQ(k3.scale(), 0x1p16f);
  EXPECT_EQ(k3.counters().growth_tracker, 0);
  for (int i = 0; i < 1500; ++i) k3.update(false);
  k3.update(true);
  EXPECT_EQ(k3.scale(), 0x1p15f);
  EXPECT_EQ(k3.counters().growth_tracker, 0);
  for (int i = 0; i < 1999; ++i) k3.update(false);
  EXPECT_EQ(k3.scale(), 0x1p15f);
  k3.update(false);
  EXPECT_EQ(k3.scale(), 0x1p16f);
}

// mixprec's knobs still apply to the keras rule when set (off in the preset).
TEST(LossScaleRules, KerasWithMixprecKnobs) {
  LossScaleConfig c = loss_scale_preset("keras");
  c.min_scale = 1;
  c.init_scale = 2;
  c.refuse_nonfinite_growth = true;
  DynamicLossScale ls(c);
  for (int i = 0; i < 5; ++i) ls.update(true);
  EXPECT_EQ(ls.scale(), 1.0f);
  EXPECT_EQ(ls.counters().floor_overflows, 4);
  c.min_scale = 0;
  c.init_scale = 0x1p127;
  c.growth_interval = 1;
  DynamicLossScale guarded(c);
  guarded.update(false);
  EXPECT_EQ(guarded.scale(), 0x1p127f);
}

TEST(LossScaleRules, MixprecCollapseError) {
  LossScaleConfig c = loss_scale_preset("mixprec");
  c.init_scale = 4;
  DynamicLossScale ls(c);
  ls.update(true);
  ls.update(true);
  EXPECT_EQ(ls.scale(), 1.0f);
  EXPECT_EQ(ls.counters().floor_overflows, 0);
  for (int i = 0; i < 9; ++i) ls.update(true);  // 9 overflows at the floor are tolerated
  EXPECT_EQ(ls.counters().floor_overflows, 9);
  ls.update(false);  // a clean step resets the run
  EXPECT_EQ(ls.counters().floor_overflows, 0);
  for (int i = 0; i < 9; ++i) ls.update(true);
  const LossScaleState before = ls.state();
  try {
    ls.update(true);
    FAIL() << "expected ScaleCollapseError";
  } catch (const ScaleCollapseError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("at its floor"), std::string::npos) << m;
    EXPECT_NE(m.find("the last 10 steps all overflowed"), std::string::npos) << m;
    EXPECT_NE(m.find("cannot fix"), std::string::npos) << m;
    EXPECT_NE(m.find("learning rate"), std::string::npos) << m;
    EXPECT_NE(m.find("forward pass"), std::string::npos) << m;
    EXPECT_NE(m.find("floor_policy=continue"), std::string::npos) << m;
  }
  EXPECT_EQ(ls.state(), before);
  static_assert(std::is_base_of_v<std::runtime_error, ScaleCollapseError>);
  c.floor_policy = FloorPolicy::keep_going;
  DynamicLossScale keep(c);
  for (int i = 0; i < 1000; ++i) keep.update(true);
  EXPECT_EQ(keep.scale(), 1.0f);
  EXPECT_EQ(keep.counters().floor_overflows, 998);
}

TEST(LossScaleRules, StaticScaleNeverChanges) {
  StaticLossScale s(1024.0);
  for (int i = 0; i < 100; ++i) s.update(i % 3 == 0);
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.counters().steps, 100);
  EXPECT_EQ(s.counters().overflows, 34);
  auto made = make_loss_scale(loss_scale_preset("static"));
  EXPECT_EQ(made->scale(), 1.0f);
  EXPECT_NE(dynamic_cast<StaticLossScale*>(made.get()), nullptr);
  EXPECT_NE(dynamic_cast<DynamicLossScale*>(make_loss_scale(LossScaleConfig{}).get()), nullptr);
  EXPECT_THROW(StaticLossScale(loss_scale_preset("torch")), std::invalid_argument);
  EXPECT_THROW(DynamicLossScale(loss_scale_preset("static")), std::invalid_argument);
  EXPECT_THROW(StaticLossScale(0.0), std::invalid_argument);
}

// ---- presets ------------------------------------------------------------------------------

TEST(LossScalePresets, DefaultsMatchTheReferenceTable) {
  struct Row {
    const char* name;
    LossScaleRule rule;
    double init;
    std::int64_t interval, hysteresis;
    double min, max;
    bool refuse;
  };
  const Row rows[] = {
      {"torch", LossScaleRule::torch, 0x1p16, 2000, 1, 0, kInf, true},
      {"deepspeed", LossScaleRule::deepspeed, 0x1p16, 1000, 2, 1, kInf, false},
      {"megatron", LossScaleRule::megatron, 0x1p32, 1000, 2, 1, kInf, false},
      {"apex", LossScaleRule::apex, 0x1p16, 2000, 1, 0, 0x1p24, false},
      {"keras", LossScaleRule::keras, 0x1p15, 2000, 1, 0, kInf, false},
      {"tf-keras", LossScaleRule::tf_keras, 0x1p15, 2000, 1, 1, kInf, true},
      {"jmp", LossScaleRule::jmp, 0x1p15, 2000, 1, 1, kInf, true},
      {"mixprec", LossScaleRule::torch, 0x1p16, 2000, 1, 1, kInf, true},
  };
  for (const Row& r : rows) {
    const LossScaleConfig c = loss_scale_preset(r.name);
    EXPECT_EQ(c.rule, r.rule) << r.name;
    EXPECT_EQ(c.init_scale, r.init) << r.name;
    EXPECT_EQ(c.growth_factor, 2.0) << r.name;
    EXPECT_EQ(c.backoff_factor, 0.5) << r.name;
    EXPECT_EQ(c.growth_interval, r.interval) << r.name;
    EXPECT_EQ(c.hysteresis, r.hysteresis) << r.name;
    EXPECT_FALSE(c.consecutive_hysteresis) << r.name;
    EXPECT_EQ(c.min_scale, r.min) << r.name;
    EXPECT_EQ(c.max_scale, r.max) << r.name;
    EXPECT_EQ(c.refuse_nonfinite_growth, r.refuse) << r.name;
    EXPECT_NO_THROW(validate(c)) << r.name;
  }
  EXPECT_EQ(loss_scale_preset("mixprec"), LossScaleConfig{});
  EXPECT_EQ(loss_scale_preset("mixprec").floor_policy, FloorPolicy::error);
  EXPECT_EQ(loss_scale_preset("mixprec").max_floor_overflows, 10);
  EXPECT_EQ(loss_scale_preset("deepspeed").floor_policy, FloorPolicy::error);
  EXPECT_EQ(loss_scale_preset("deepspeed").max_floor_overflows, 1);
  EXPECT_EQ(loss_scale_preset("torch").floor_policy, FloorPolicy::keep_going);
  EXPECT_EQ(loss_scale_preset("static").rule, LossScaleRule::static_scale);
  for (const auto& n : loss_scale_preset_names()) EXPECT_NO_THROW(make_loss_scale(loss_scale_preset(n))) << n;
}

TEST(LossScalePresets, UnknownNameListsValidNames) {
  try {
    loss_scale_preset("pytorch");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "unknown loss-scale preset 'pytorch'; presets: mixprec, torch, deepspeed, megatron, apex, keras, "
                 "tf-keras, jmp, static, layerwise");
  }
}

// ---- validation ---------------------------------------------------------------------------

void expect_invalid(const LossScaleConfig& c, const std::string& field, const std::string& also = "") {
  try {
    validate(c);
    ADD_FAILURE() << "expected an error naming " << field;
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(field + ":", 0), 0u) << m;
    if (!also.empty()) {
      EXPECT_NE(m.find(also), std::string::npos) << m;
    }
  }
}

TEST(LossScaleValidation, EveryFieldIsChecked) {
  using C = LossScaleConfig;
  auto bad = [](std::function<void(C&)> f, const char* preset = "mixprec") {
    C c = loss_scale_preset(preset);
    f(c);
    return c;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_invalid(bad([](C& c) { c.rule = static_cast<LossScaleRule>(42); }), "rule", "found enum value 42");
  expect_invalid(bad([](C& c) { c.init_scale = 0; }), "init_scale", "found 0");
  expect_invalid(bad([](C& c) { c.init_scale = -1; }), "init_scale");
  expect_invalid(bad([&](C& c) { c.init_scale = nan; }), "init_scale", "found nan");
  expect_invalid(bad([](C& c) { c.init_scale = kInf; }), "init_scale", "found inf");
  expect_invalid(bad([](C& c) { c.init_scale = 1e300; }), "init_scale", "float32");
  expect_invalid(bad([](C& c) { c.growth_factor = 1; }), "growth_factor", "> 1, found 1");
  expect_invalid(bad([](C& c) { c.growth_factor = kInf; }), "growth_factor");
  expect_invalid(bad([](C& c) { c.backoff_factor = 1; }), "backoff_factor", "(0, 1), found 1");
  expect_invalid(bad([](C& c) { c.backoff_factor = 0; }), "backoff_factor");
  expect_invalid(bad([&](C& c) { c.backoff_factor = nan; }), "backoff_factor");
  expect_invalid(bad([](C& c) { c.growth_interval = 0; }), "growth_interval", "[1, 2147483647], found 0");
  expect_invalid(bad([](C& c) { c.growth_interval = 1LL << 40; }), "growth_interval");
  expect_invalid(bad([](C& c) { c.min_scale = -1; }), "min_scale");
  expect_invalid(bad([](C& c) { c.min_scale = kInf; }), "min_scale");
  expect_invalid(bad([](C& c) { c.min_scale = 1e6; }), "min_scale", "min_scale <= init_scale");
  expect_invalid(bad([](C& c) { c.max_scale = 0; }), "max_scale");
  expect_invalid(bad([](C& c) { c.max_scale = 1024; }), "max_scale", "init_scale <= max_scale");
  expect_invalid(bad([](C& c) { c.hysteresis = 0; }), "hysteresis");
  expect_invalid(bad([](C& c) { c.hysteresis = 2; }), "hysteresis", "torch rule has no hysteresis");
  expect_invalid(bad([](C& c) { c.consecutive_hysteresis = true; }), "consecutive_hysteresis");
  expect_invalid(bad([](C& c) { c.consecutive_hysteresis = true; }, "megatron"), "consecutive_hysteresis");
  expect_invalid(bad([](C& c) { c.floor_policy = static_cast<FloorPolicy>(9); }), "floor_policy");
  expect_invalid(bad([](C& c) { c.min_scale = 0; }), "floor_policy", "needs a floor");
  expect_invalid(bad([](C& c) { c.max_floor_overflows = 0; }), "max_floor_overflows");
  expect_invalid(bad([](C& c) { c.backoff_factor = 0.25; }, "deepspeed"), "backoff_factor",
                 "expected 1/growth_factor = 0.5");
  expect_invalid(bad([](C& c) { c.growth_factor = 4; }, "keras"), "backoff_factor");
  // Valid variations.
  EXPECT_NO_THROW(validate(bad([](C& c) { c.hysteresis = 7; }, "megatron")));
  EXPECT_NO_THROW(validate(bad([](C& c) { c.consecutive_hysteresis = true; }, "deepspeed")));
  EXPECT_NO_THROW(validate(bad([](C& c) { c.min_scale = 0; c.floor_policy = FloorPolicy::keep_going; })));
  EXPECT_THROW(DynamicLossScale(bad([](C& c) { c.growth_interval = 0; })), std::invalid_argument);
}

TEST(LossScaleValidation, SetParsesChecksAndNamesKeys) {
  LossScaleConfig c = loss_scale_preset("mixprec");
  set(c, "init_scale", "1024");
  set(c, "growth_interval", "5");
  set(c, "min_scale", "none");
  set(c, "floor_policy", "continue");
  set(c, "max_scale", "0x1p20");
  set(c, "refuse_nonfinite_growth", "false");
  EXPECT_EQ(c.init_scale, 1024);
  EXPECT_EQ(c.growth_interval, 5);
  EXPECT_EQ(c.min_scale, 0);
  EXPECT_EQ(c.max_scale, 0x1p20);
  EXPECT_EQ(c.floor_policy, FloorPolicy::keep_going);
  EXPECT_FALSE(c.refuse_nonfinite_growth);
  set(c, "max_scale", "inf");
  EXPECT_EQ(c.max_scale, kInf);
  validate(c);
  LossScaleConfig d = loss_scale_preset("deepspeed");
  set(d, "growth_factor", "4");
  EXPECT_EQ(d.backoff_factor, 0.25);  // one-factor rule
  validate(d);
  set(d, "rule", "megatron");
  set(d, "consecutive_hysteresis", "false");
  EXPECT_EQ(d.rule, LossScaleRule::megatron);

  auto message = [](std::string_view key, std::string_view value) {
    LossScaleConfig x;
    try {
      set(x, key, value);
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(x, LossScaleConfig{}) << "a failed set changed the config";
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("growth", "2"),
            "unknown key 'growth'; known keys: rule, init_scale, growth_factor, backoff_factor, growth_interval, "
            "min_scale, max_scale, hysteresis, consecutive_hysteresis, refuse_nonfinite_growth, floor_policy, "
            "max_floor_overflows");
  EXPECT_EQ(message("growth_factor", "1"), "growth_factor: expected a finite number > 1, found 1");
  EXPECT_EQ(message("growth_factor", "2x"), "growth_factor: expected a finite number > 1, found '2x'");
  EXPECT_EQ(message("backoff_factor", "1.5"), "backoff_factor: expected a number in (0, 1), found 1.5");
  EXPECT_EQ(message("growth_interval", "0"), "growth_interval: expected an integer in [1, 2147483647], found 0");
  EXPECT_EQ(message("growth_interval", "2.5"),
            "growth_interval: expected an integer in [1, 2147483647], found '2.5'");
  EXPECT_EQ(message("init_scale", "inf"), "init_scale: expected a finite number > 0, found inf");
  EXPECT_EQ(message("init_scale", ""), "init_scale: expected a finite number > 0, found ''");
  EXPECT_EQ(message("min_scale", "-1"), "min_scale: expected a finite number >= 0 or none, found -1");
  EXPECT_EQ(message("max_scale", "0"), "max_scale: expected a number > 0, inf or none, found 0");
  EXPECT_EQ(message("hysteresis", "-2"), "hysteresis: expected an integer in [1, 2147483647], found -2");
  EXPECT_EQ(message("consecutive_hysteresis", "yes"), "consecutive_hysteresis: expected true or false, found 'yes'");
  EXPECT_EQ(message("floor_policy", "ignore"), "floor_policy: expected continue or error, found 'ignore'");
  EXPECT_EQ(message("rule", "pytorch"),
            "rule: expected static, torch, deepspeed, megatron, apex, keras, tf-keras or jmp, found 'pytorch'");
  EXPECT_EQ(message("max_floor_overflows", "0"),
            "max_floor_overflows: expected an integer in [1, 2147483647], found 0");
  EXPECT_NE(describe(loss_scale_preset("apex")).find("max_scale = 16777216\n"), std::string::npos);
}

// Every key of the table: a valid value (text, written back by describe), one out of range,
// text of the wrong kind, and a JSON value of the wrong type in a saved state's config.
TEST(LossScaleValidation, EveryKeyValidOutOfRangeAndWrongKind) {
  struct Case {
    std::string key, good, canonical, bad, bad_message, wrong, wrong_json, json_message;
  };
  const std::string rules = "static, torch, deepspeed, megatron, apex, keras, tf-keras or jmp";
  const Case cases[] = {
      {"rule", "deepspeed", "", "pytorch", "rule: expected " + rules + ", found 'pytorch'", "", "3",
       "rule: expected " + rules + ", found 3"},
      {"init_scale", "0x1p10", "1024", "0", "init_scale: expected a finite number > 0, found 0", "2x", R"("1")",
       "init_scale: expected a finite number > 0, found string \"1\""},
      {"growth_factor", "4", "", "1", "growth_factor: expected a finite number > 1, found 1", "four", "null",
       "growth_factor: expected a finite number > 1, found null"},
      {"backoff_factor", "0.25", "", "1", "backoff_factor: expected a number in (0, 1), found 1", "", "true",
       "backoff_factor: expected a number in (0, 1), found boolean true"},
      {"growth_interval", "20.0", "20", "0", "growth_interval: expected an integer in [1, 2147483647], found 0", "2.9",
       "4.5", "growth_interval: expected an integer in [1, 2147483647], found 4.5"},
      {"min_scale", "none", "", "-1", "min_scale: expected a finite number >= 0 or none, found -1", "nope", R"("none")",
       "min_scale: expected a finite number >= 0 or none (none is null), found string \"none\""},
      {"max_scale", "inf", "none", "0", "max_scale: expected a number > 0, inf or none, found 0", "big", "false",
       "max_scale: expected a number > 0, inf or none (none is null), found boolean false"},
      {"hysteresis", "2e0", "2", "0", "hysteresis: expected an integer in [1, 2147483647], found 0", "x", R"("2")",
       "hysteresis: expected an integer in [1, 2147483647], found string \"2\""},
      {"consecutive_hysteresis", "1", "true", "", "", "yes", "0",
       "consecutive_hysteresis: expected true or false, found 0"},
      {"refuse_nonfinite_growth", "false", "", "", "", "no", R"("false")",
       "refuse_nonfinite_growth: expected true or false, found string \"false\""},
      {"floor_policy", "continue", "", "ignore", "floor_policy: expected continue or error, found 'ignore'", "", "1",
       "floor_policy: expected continue or error, found 1"},
      {"max_floor_overflows", "3", "", "2147483648",
       "max_floor_overflows: expected an integer in [1, 2147483647], found 2147483648", "3.5", "-1",
       "max_floor_overflows: expected an integer in [1, 2147483647], found -1"},
  };
  ASSERT_EQ(std::size(cases), loss_scale_config_keys().size());
  const std::string saved = DynamicLossScale(loss_scale_preset("mixprec")).to_json();
  for (std::size_t i = 0; i < std::size(cases); ++i) {
    const Case& k = cases[i];
    SCOPED_TRACE(k.key);
    EXPECT_EQ(k.key, loss_scale_config_keys()[i]);
    LossScaleConfig c = loss_scale_preset("mixprec");
    EXPECT_NO_THROW(set(c, k.key, k.good));
    const std::string line = k.key + " = " + (k.canonical.empty() ? k.good : k.canonical) + "\n";
    EXPECT_NE(describe(c).find(line), std::string::npos) << describe(c);
    auto message = [&](std::string_view text) {
      LossScaleConfig x = loss_scale_preset("mixprec");
      try {
        set(x, k.key, text);
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(x, loss_scale_preset("mixprec")) << "a refused value changed the config";
        return std::string(e.what());
      }
      return std::string("no error");
    };
    if (!k.bad.empty()) {
      EXPECT_EQ(message(k.bad), k.bad_message);
    }
    if (!k.wrong.empty()) {
      const std::string e = message(k.wrong);
      EXPECT_EQ(e.rfind(k.key + ": expected ", 0), 0u) << e;
      EXPECT_NE(e.find(", found '" + k.wrong + "'"), std::string::npos) << e;
    }
    // The saved state's config with this key's value replaced.
    std::string text = saved;
    const std::string field = "\"" + k.key + "\":";
    const auto at = text.find(field) + field.size();
    const auto end = text.find_first_of(",}", at);
    text.replace(at, end - at, k.wrong_json);
    try {
      (void)LossScaleState::from_json(text);
      ADD_FAILURE() << "accepted " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "loss-scale state: config." + k.json_message);
    }
  }
}

TEST(LossScaleValidation, IntegersTakeWholeFloatsAsTorchAmpDoes) {
  // torch.amp keeps growth_interval as a Python number: 20.0 is 20, 2.9 is refused.
  LossScaleConfig c = loss_scale_preset("torch");
  set(c, "growth_interval", "20.0");
  EXPECT_EQ(c.growth_interval, 20);
  set(c, "growth_interval", "2e3");
  EXPECT_EQ(c.growth_interval, 2000);
  set(c, "growth_interval", "+7");
  EXPECT_EQ(c.growth_interval, 7);
  EXPECT_THROW(set(c, "growth_interval", "2.9"), std::invalid_argument);
  EXPECT_THROW(set(c, "growth_interval", "0x10"), std::invalid_argument);
  EXPECT_EQ(c.growth_interval, 7);
  // A saved state written by a reader that keeps numbers as floats.
  std::string text = DynamicLossScale(loss_scale_preset("torch")).to_json();
  text.replace(text.find("\"growth_interval\":2000"), 22, "\"growth_interval\":2000.0");
  EXPECT_EQ(LossScaleState::from_json(text).config.growth_interval, 2000);
  text.replace(text.find("\"steps\":0"), 9, "\"steps\":0.0");
  EXPECT_EQ(LossScaleState::from_json(text).counters.steps, 0);
}

// ---- save / load ----------------------------------------------------------------------------

// Runs `prefix` steps, saves (struct and JSON), loads into a fresh scale, then runs both on the
// same `suffix` and requires identical states at every step.
void round_trip(const LossScaleConfig& c, const std::vector<bool>& prefix, const std::vector<bool>& suffix,
                const std::function<void(const LossScaleCounters&)>& check_mid = {}) {
  auto a = make_loss_scale(c);
  for (bool f : prefix) a->update(f);
  if (check_mid) check_mid(a->counters());
  const LossScaleState saved = a->state();
  const std::string text = saved.to_json();
  EXPECT_EQ(LossScaleState::from_json(text), saved) << text;
  EXPECT_EQ(LossScaleState::from_json(text).to_json(), text);

  LossScaleConfig other = loss_scale_preset(c.rule == LossScaleRule::static_scale ? "static" : "apex");
  auto b = make_loss_scale(other);
  b->load_json(text);
  EXPECT_EQ(b->state(), saved);
  EXPECT_EQ(b->config(), c);
  auto s = make_loss_scale(other);
  s->load(saved);
  EXPECT_EQ(s->state(), saved);
  for (std::size_t i = 0; i < suffix.size(); ++i) {
    a->update(suffix[i]);
    b->update(suffix[i]);
    ASSERT_EQ(a->state(), b->state()) << "after load, step " << i;
  }
}

std::vector<bool> pattern(const std::string& s) {
  std::vector<bool> v;
  for (char ch : s) v.push_back(ch == '1');
  return v;
}

TEST(LossScaleSaveLoad, TorchMidGrowthWindow) {
  LossScaleConfig c = loss_scale_preset("torch");
  c.growth_interval = 5;
  round_trip(c, pattern("0000001000"), overflow_sequence(11, 500, 0.1),
             [](const LossScaleCounters& k) { EXPECT_EQ(k.growth_tracker, 3); });
}

TEST(LossScaleSaveLoad, MixprecMidFloorRun) {
  LossScaleConfig c = loss_scale_preset("mixprec");
  c.init_scale = 2;
  c.floor_policy = FloorPolicy::keep_going;
  round_trip(c, pattern("1111"), overflow_sequence(12, 500, 0.2),
             [](const LossScaleCounters& k) { EXPECT_EQ(k.floor_overflows, 3); });
}

TEST(LossScaleSaveLoad, DeepSpeedMidHysteresis) {
  for (bool consecutive : {false, true}) {
    LossScaleConfig c = loss_scale_preset("deepspeed");
    c.hysteresis = 3;
    c.growth_interval = 4;
    c.consecutive_hysteresis = consecutive;
    c.floor_policy = FloorPolicy::keep_going;
    round_trip(c, pattern("00000100"), overflow_sequence(13, 800, 0.05), [&](const LossScaleCounters& k) {
      EXPECT_EQ(k.hysteresis_left, consecutive ? 3 : 2);
      EXPECT_EQ(k.iteration, 8);
      EXPECT_EQ(k.last_overflow_iter, 5);
    });
  }
}

TEST(LossScaleSaveLoad, MegatronNegativeHysteresisTracker) {
  LossScaleConfig c = loss_scale_preset("megatron");
  c.growth_interval = 6;
  round_trip(c, pattern("1011100"), overflow_sequence(14, 800, 0.05), [](const LossScaleCounters& k) {
    EXPECT_EQ(k.hysteresis_left, -2);
    EXPECT_EQ(k.growth_tracker, 2);
  });
}

TEST(LossScaleSaveLoad, ApexKerasJmpMidWindow) {
  for (const char* p : {"apex", "keras", "tf-keras", "jmp"}) {
    LossScaleConfig c = loss_scale_preset(p);
    c.growth_interval = 4;
    round_trip(c, pattern("0100000"), overflow_sequence(15, 500, 0.1),
               [&](const LossScaleCounters& k) { EXPECT_EQ(k.growth_tracker, 1) << p; });
  }
}

TEST(LossScaleSaveLoad, Static) {
  LossScaleConfig c = loss_scale_preset("static");
  c.init_scale = 512;
  round_trip(c, pattern("0101"), pattern("0011"));
  StaticLossScale s(8.0);
  EXPECT_THROW(s.load(DynamicLossScale().state()), std::invalid_argument);
  DynamicLossScale d;
  EXPECT_THROW(d.load(s.state()), std::invalid_argument);
}

TEST(LossScaleSaveLoad, JsonHasEveryFieldAndNulls) {
  const std::string j = DynamicLossScale(loss_scale_preset("torch")).to_json();
  EXPECT_EQ(j,
            "{\"config\":{\"backoff_factor\":0.5,\"consecutive_hysteresis\":false,\"floor_policy\":\"continue\","
            "\"growth_factor\":2.0,\"growth_interval\":2000,\"hysteresis\":1,\"init_scale\":65536.0,"
            "\"max_floor_overflows\":10,\"max_scale\":null,\"min_scale\":null,\"refuse_nonfinite_growth\":true,"
            "\"rule\":\"torch\"},\"counters\":{\"backoffs\":0,\"floor_overflows\":0,\"growth_tracker\":0,"
            "\"growths\":0,\"hysteresis_left\":1,\"iteration\":0,\"last_overflow_iter\":-1,\"overflows\":0,"
            "\"steps\":0},\"format\":\"mixprec.loss_scale\",\"scale\":65536.0,\"version\":1}");
}

// A bad state is rejected with the field named, and the scale it was loaded into is unchanged.
TEST(LossScaleSaveLoad, LoadValidatesEverythingFirst) {
  LossScaleConfig c = loss_scale_preset("mixprec");
  c.growth_interval = 4;
  DynamicLossScale ls(c);
  for (bool f : pattern("0010")) ls.update(f);
  const LossScaleState good = ls.state();
  const std::string text = good.to_json();
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const auto pos = t.find(from);
    EXPECT_NE(pos, std::string::npos) << from;
    return t.replace(pos, from.size(), to);
  };
  struct Case {
    std::string json, expect;
  };
  const Case cases[] = {
      {"{", "malformed JSON"},
      {"[]", "loss-scale state: expected an object, found array"},
      {replaced("\"format\":\"mixprec.loss_scale\"", "\"format\":\"other\""), "format: expected"},
      {replaced("\"version\":1", "\"version\":2"), "version: expected 1, found 2"},
      {replaced("\"rule\":\"torch\"", "\"rule\":\"pytorch\""), "config.rule: expected static, torch, deepspeed, megatron, apex, keras, tf-keras or jmp, found 'pytorch'"},
      {replaced("\"rule\":\"torch\"", "\"rule\":3"), "config.rule: expected static, torch, deepspeed, megatron, apex, keras, tf-keras or jmp, found 3"},
      {replaced("\"growth_factor\":2.0", "\"growth_factor\":\"2\""), "config.growth_factor: expected a finite number > 1, found string \"2\""},
      {replaced("\"growth_factor\":2.0", "\"growth_factor\":0.5"), "config.growth_factor: expected a finite number > 1"},
      {replaced("\"growth_interval\":4", "\"growth_interval\":4.5"), "config.growth_interval: expected an integer"},
      {replaced("\"growth_interval\":4", "\"growth_interval\":0"), "config.growth_interval: expected an integer in"},
      {replaced("\"floor_policy\":\"error\"", "\"floor_policy\":\"stop\""), "config.floor_policy: expected"},
      {replaced("\"hysteresis\":1,", ""), "config.hysteresis: missing"},
      {replaced("\"hysteresis\":1,", "\"hysteresis\":1,\"hysterisis\":1,"), "config.hysterisis: unknown field"},
      {replaced("\"consecutive_hysteresis\":false", "\"consecutive_hysteresis\":0"),
       "config.consecutive_hysteresis: expected true or false"},
      {replaced("\"min_scale\":1.0", "\"min_scale\":\"1\""), "config.min_scale: expected a finite number >= 0 or none (none is null), found string \"1\""},
      {replaced("\"scale\":32768.0", "\"scale\":-1.0"), "scale: expected a number > 0"},
      {replaced("\"scale\":32768.0", "\"scale\":0.5"), "scale: expected >= min_scale"},
      {replaced("\"scale\":32768.0", "\"scale\":0.1"), "float32"},
      {replaced("\"scale\":32768.0", "\"scale\":\"inf\""), "scale: inf is reachable only"},
      {replaced("\"scale\":32768.0", "\"scale\":null"), "scale: expected a number or \"inf\""},
      {replaced("\"growth_tracker\":1", "\"growth_tracker\":4"), "counters.growth_tracker: expected an integer in [0, 3]"},
      {replaced("\"steps\":4", "\"steps\":-1"), "counters.steps"},
      {replaced("\"overflows\":1", "\"overflows\":5"), "counters.overflows: expected an integer in [0, 4], found 5"},
      {replaced("\"iteration\":0", "\"iteration\":3"), "counters.iteration"},
      {replaced("\"floor_overflows\":0", "\"floor_overflows\":-1"), "counters.floor_overflows"},
      {replaced("\"hysteresis_left\":1", "\"hysteresis_left\":0"), "counters.hysteresis_left"},
      {replaced("\"steps\":4", "\"steps\":18446744073709551615"), "counters.steps: expected a 64-bit integer"},
      {replaced("\"version\":1", "\"version\":1,\"extra\":true"), "extra: unknown field"},
  };
  for (const Case& k : cases) {
    try {
      ls.load_json(k.json);
      ADD_FAILURE() << "accepted: " << k.json;
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind("loss-scale state: ", 0), 0u) << m;
      EXPECT_NE(m.find(k.expect), std::string::npos) << "message: " << m << "\nexpected: " << k.expect;
    }
    EXPECT_EQ(ls.state(), good) << "a failed load changed the state: " << k.json;
  }
  // The struct path validates too.
  LossScaleState s = good;
  s.counters.growth_tracker = 9;
  EXPECT_THROW(ls.load(s), std::invalid_argument);
  EXPECT_EQ(ls.state(), good);
}

}  // namespace
}  // namespace mixprec
