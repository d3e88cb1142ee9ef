// Step guards (scaler/step_guard.hpp): the z-score detector against a plain transcription of
// llm.c's rule, every skip reason through the protocol and its skip semantics bit for bit
// (weights, moments, step counter, scale), the state round trip, bad configs and states.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/mixprec.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/scaler/step_guard.hpp"

namespace mixprec {
namespace {

// ---- llm.c's rule, transcribed plainly (llmc/outlier_detector.h, train_gpt2.cu) ----------
// A fixed array, count/index, running sums; NaN while the window fills; the z-score as a
// float compared with the threshold when finite and the threshold is not 0.
template <int W>
struct LlmcDetector {
  double buffer[W] = {};
  int count = 0, index = 0;
  double sum = 0, sum_sq = 0;
  double update(double v) {
    if (count < W) {
      buffer[count] = v;
      sum += v;
      sum_sq += v * v;
      count++;
      return std::nan("");
    }
    double old = buffer[index];
    sum -= old;
    sum_sq -= old * old;
    buffer[index] = v;
    sum += v;
    sum_sq += v * v;
    index = (index + 1) % W;
    double mean = sum / W;
    double variance = (sum_sq / W) - (mean * mean);
    double std_dev = std::sqrt(variance);
    if (std_dev == 0.0) return 0.0;
    return (v - mean) / std_dev;
  }
};
bool llmc_flags(float z, float threshold) { return std::isfinite(z) && threshold != 0.0f && z > threshold; }

// A loss curve as training gives one: decaying, noisy, with spikes of several sizes.
std::vector<double> loss_series(int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> noise(0.0, 0.04);
  std::vector<double> v;
  for (int i = 0; i < n; ++i) {
    double x = 2.0 + 4.0 * std::exp(-i / 150.0) + noise(rng);
    if (i % 97 == 50) x += 0.3 * (1 + i % 5);  // spikes from 0.3 to 1.5
    v.push_back(static_cast<float>(x));      // losses arrive as floats
  }
  return v;
}

template <int W>
void expect_same_as_llmc(const std::vector<double>& series, float threshold, int min_flagged = 3) {
  LlmcDetector<W> ref;
  ZScoreDetector mine(W);
  int flagged = 0;
  for (std::size_t i = 0; i < series.size(); ++i) {
    const double a = ref.update(series[i]);
    const double peeked = mine.peek(series[i]);
    const double b = mine.push(series[i]);
    ASSERT_EQ(std::bit_cast<std::uint64_t>(peeked), std::bit_cast<std::uint64_t>(b)) << "step " << i << ": peek != push";
    ASSERT_EQ(std::isnan(a), std::isnan(b)) << "step " << i;
    if (!std::isnan(a)) {
      ASSERT_EQ(std::bit_cast<std::uint64_t>(a), std::bit_cast<std::uint64_t>(b))
          << "step " << i << ": llm.c " << a << ", mixprec " << b;
    }
    const bool flag_ref = llmc_flags(static_cast<float>(a), threshold);
    ASSERT_EQ(flag_ref, std::isfinite(static_cast<float>(b)) && static_cast<float>(b) > threshold) << "step " << i;
    flagged += flag_ref;
  }
  // The series has spikes the rule flags (or the comparison would prove little).
  EXPECT_GE(flagged, min_flagged) << "window " << W;
}

// The losses of a real run (mixprec train, bf16, 300 steps, random labels at step 120).
std::vector<double> recorded_losses() {
  std::ifstream in(std::string(MIXPREC_SCALER_FIXTURES) + "/loss_series_gpt_bf16.txt");
  std::vector<double> v;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] != '#') v.push_back(std::stod(line));
  return v;
}

TEST(StepGuard, DetectorEqualsLlmcTranscriptionOnARecordedRun) {
  const std::vector<double> losses = recorded_losses();
  ASSERT_EQ(losses.size(), 300u);
  expect_same_as_llmc<128>(losses, 3.0f, 0);  // z from step 129 on: after the spike
  expect_same_as_llmc<64>(losses, 3.0f, 1);
  // The rule flags the random-label step (120) at window 64 and threshold 5, and nothing else.
  ZScoreDetector d(64);
  std::vector<int> flagged;
  for (std::size_t i = 0; i < losses.size(); ++i) {
    const float z = static_cast<float>(d.push(losses[i]));
    if (std::isfinite(z) && z > 5.0f) flagged.push_back(static_cast<int>(i) + 1);
  }
  EXPECT_EQ(flagged, std::vector<int>{120});
}

TEST(StepGuard, DetectorEqualsLlmcTranscriptionStepForStep) {
  expect_same_as_llmc<128>(loss_series(1500, 1), 3.0f);
  expect_same_as_llmc<16>(loss_series(600, 2), 2.5f);
  expect_same_as_llmc<2>(loss_series(300, 3), 0.5f);
}

TEST(StepGuard, DetectorPeekChangesNothingAndIgnoresNonFinite) {
  ZScoreDetector d(4);
  for (double x : {1.0, 2.0, 3.0, 4.0}) EXPECT_TRUE(std::isnan(d.push(x)));
  const std::string before = d.to_json();
  const double p = d.peek(10.0);
  EXPECT_EQ(d.to_json(), before);
  EXPECT_EQ(std::bit_cast<std::uint64_t>(p), std::bit_cast<std::uint64_t>(d.push(10.0)));
  const std::string after = d.to_json();
  EXPECT_TRUE(std::isnan(d.push(INFINITY)));
  EXPECT_TRUE(std::isnan(d.push(NAN)));
  EXPECT_EQ(d.to_json(), after) << "a non-finite value must not enter the running sums";
  // Constant values: deviation 0, z 0 (llm.c's rule), never a skip.
  ZScoreDetector c(3);
  for (int i = 0; i < 3; ++i) c.push(5.0);
  EXPECT_EQ(c.push(5.0), 0.0);
}

TEST(StepGuard, DetectorStateRoundTripsExactly) {
  ZScoreDetector a(8);
  for (double x : loss_series(21, 4)) a.push(x);
  ZScoreDetector b = ZScoreDetector::from_json(a.to_json(), "here");
  for (double x : loss_series(40, 5)) {
    const double za = a.push(x), zb = b.push(x);
    ASSERT_EQ(std::bit_cast<std::uint64_t>(za), std::bit_cast<std::uint64_t>(zb));
  }
  EXPECT_THROW(ZScoreDetector::from_json(R"({"window":8,"count":9,"index":0,"sum":0,"sum_sq":0,"values":[]})", "x"),
               std::invalid_argument);
  EXPECT_THROW(ZScoreDetector::from_json(R"({"window":1,"count":0,"index":0,"sum":0,"sum_sq":0,"values":[]})", "x"),
               std::invalid_argument);
  try {
    ZScoreDetector::from_json(R"({"window":4,"count":2,"index":0,"sum":0,"sum_sq":0,"values":[1]})", "guard.loss");
    ADD_FAILURE() << "a detector whose values disagree with its count was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("guard.loss: values"), std::string::npos) << e.what();
  }
}

TEST(StepGuard, ConfigKeysRefuseValuesOutOfRangeByName) {
  GuardConfig c;
  const auto refused = [&](const char* key, const char* value, const char* needle) {
    const GuardConfig before = c;
    try {
      set(c, key, value);
      ADD_FAILURE() << key << "=" << value << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(c, before);
  };
  refused("skip_loss_z", "-1", "skip_loss_z: expected");
  refused("skip_grad_z", "nan", "skip_grad_z: expected");
  refused("skip_grad_z", "inf", "skip_grad_z: expected");
  refused("skip_window", "1", "skip_window: expected an integer in [2, 1000000]");
  refused("skip_nonfinite", "maybe", "skip_nonfinite: expected");
  // A threshold no z-score over the window can reach is refused, not left to never fire.
  GuardConfig unreachable;
  unreachable.window = 8;
  unreachable.loss_z = 3;
  try {
    validate(unreachable);
    ADD_FAILURE() << "skip_loss_z 3 over a window of 8 (z <= 2.65) was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("skip_loss_z: expected 0 (off) or a number below sqrt(skip_window - 1) = 2.6457"),
              std::string::npos)
        << e.what();
  }
  refused("skip_sometimes", "1", "unknown key 'skip_sometimes'");
  set(c, "skip_loss_z", "3");
  set(c, "skip_window", "64");
  EXPECT_EQ(c.loss_z, 3.0);
  EXPECT_EQ(c.window, 64);
  EXPECT_EQ(guard_config_from_json(guard_config_json(c), "here"), c);
}

// ---- through the protocol, over a ParamStore and AdamW ---------------------------------

std::vector<ParamSpec> specs() { return {{"w1", {4, 6}}, {"b1", {6}}, {"w2", {6, 3}}}; }

ParamStore make_store(DType model, DType grads, bool master) {
  ParamStore s(specs(), StoreOptions{model, grads, master, 2});
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  if (master) {
    for (std::size_t i = 0; i < s.tensor_count(); ++i)
      for (float& w : s.master(i)) w = nd(rng);
    s.refresh_model();
  } else {
    for (std::size_t i = 0; i < s.tensor_count(); ++i)
      for (std::size_t k = 0; k < s.numel(i); ++k) {
        const float w = nd(rng);
        if (model == DType::f32) s.model<float>(i)[k] = w;
        else if (model == DType::bf16) s.model<bf16>(i)[k] = bf16(w);
        else s.model<f16>(i)[k] = f16(w);
      }
  }
  return s;
}

void write_grads(ParamStore& s, float scale, int step, float magnitude = 1e-2f, float poison = 0.0f) {
  std::mt19937 rng(100 + static_cast<unsigned>(step));
  std::normal_distribution<float> nd(0.0f, magnitude);
  for (std::size_t i = 0; i < s.tensor_count(); ++i)
    for (std::size_t k = 0; k < s.numel(i); ++k) {
      float g = nd(rng) * scale;
      if (poison != 0.0f && i == 1 && k == 2) g = poison;
      switch (s.grad_dtype()) {
        case DType::f32: s.grads<float>(i)[k] = g; break;
        case DType::f16: s.grads<f16>(i)[k] = f16(g); break;
        case DType::bf16: s.grads<bf16>(i)[k] = bf16(g); break;
      }
    }
}

// Every byte the optimizer owns: weights of record, model copy, both moments, the step count.
std::vector<std::byte> optimizer_bytes(const ParamStore& s, const Optimizer& opt) {
  std::vector<std::byte> b;
  const auto add = [&](const void* p, std::size_t n) {
    const auto* c = static_cast<const std::byte*>(p);
    b.insert(b.end(), c, c + n);
  };
  if (s.has_master()) add(s.master_data(), s.flat_size() * 4);
  add(s.model_data(), s.flat_size() * dtype_size(s.model_dtype()));
  for (unsigned k = 0; k < 2; ++k) add(s.state_data(k), s.flat_size() * 4);
  const std::int64_t step = opt.state().step;
  add(&step, sizeof step);
  return b;
}

struct Case {
  const char* name;
  DType model, grads;
  bool master;
  bool scaled;  // an enabled loss scale (fp16); else a disabled scaler (bf16, fp32)
};
const Case kCases[] = {
    {"fp16 scaled", DType::f16, DType::f16, true, true},
    {"bf16 no scaler", DType::bf16, DType::bf16, true, false},
    {"fp32 no scaler", DType::f32, DType::f32, false, false},
};

// Ten calm steps, then step 11 is given one bad thing; the guard must skip exactly it, leave
// every optimizer byte and the scale as they were, and the next calm step must apply.
enum class Bad { loss_spike, grad_spike, nonfinite_grad, nonfinite_loss, user };

void run_case(const Case& k, Bad bad) {
  SCOPED_TRACE(k.name);
  ParamStore s = make_store(k.model, k.grads, k.master);
  AdamW opt(s, AdamConfig{});
  LossScaleConfig lc = loss_scale_preset("torch");
  lc.init_scale = 256;
  GradScaler scaler(lc, k.scaled);
  GuardConfig g;
  g.loss_z = 3;
  g.grad_z = 3;
  g.window = 16;  // z reaches at most sqrt(15) = 3.87
  scaler.set_guard(g);
  std::mt19937 rng(7);
  std::normal_distribution<double> wobble(0.0, 0.01);
  for (int step = 1; step <= 20; ++step) {
    const bool is_bad = step == 18;
    const float S = scaler.get_scale();
    float magnitude = 1e-2f, poison = 0.0f;
    double loss = 2.0 + wobble(rng);
    if (is_bad && bad == Bad::grad_spike) magnitude = 1.0f;
    if (is_bad && bad == Bad::nonfinite_grad) poison = INFINITY;
    if (is_bad && bad == Bad::loss_spike) loss = 9.0;
    if (is_bad && bad == Bad::nonfinite_loss) loss = NAN;
    write_grads(s, S, step, magnitude, poison);
    StepOptions o;
    o.loss = loss;
    o.max_grad_norm = 1.0f;
    int asked = 0;
    if (bad == Bad::user) o.skip_if = [&](const GuardView& v) {
      ++asked;
      EXPECT_EQ(v.loss, loss);
      EXPECT_TRUE(std::isfinite(v.grad_norm));
      return is_bad;
    };
    const std::vector<std::byte> before = optimizer_bytes(s, opt);
    const StepOutcome out = scaler.step(opt, o);
    scaler.update();
    if (bad == Bad::user) {
      EXPECT_EQ(asked, 1);
    }
    if (!is_bad) {
      EXPECT_TRUE(out.applied) << "step " << step << " reason " << skip_reason_name(out.reason);
      EXPECT_EQ(out.reason, SkipReason::none);
      continue;
    }
    EXPECT_FALSE(out.applied);
    const SkipReason want = bad == Bad::loss_spike       ? SkipReason::loss_spike
                            : bad == Bad::grad_spike     ? SkipReason::grad_spike
                            : bad == Bad::nonfinite_grad ? SkipReason::nonfinite_grad
                            : bad == Bad::nonfinite_loss ? SkipReason::nonfinite_loss
                                                         : SkipReason::user;
    EXPECT_EQ(out.reason, want) << skip_reason_name(out.reason);
    EXPECT_EQ(optimizer_bytes(s, opt), before) << "a skipped step wrote optimizer state";
    // Only an overflow of a loss scale backs it off.
    if (k.scaled && want == SkipReason::nonfinite_grad) {
      EXPECT_LT(scaler.get_scale(), S);
    } else {
      EXPECT_EQ(scaler.get_scale(), S);
    }
    if (want == SkipReason::loss_spike) {
      EXPECT_GT(out.guard.loss_z, 3.0);
    }
    if (want == SkipReason::grad_spike) {
      EXPECT_GT(out.guard.grad_z, 3.0);
    }
  }
}

TEST(StepGuard, EachReasonSkipsExactlyTheBadStepAndTouchesNothing) {
  for (const Case& k : kCases) {
    run_case(k, Bad::loss_spike);
    run_case(k, Bad::grad_spike);
    run_case(k, Bad::nonfinite_grad);
    run_case(k, Bad::nonfinite_loss);
    run_case(k, Bad::user);
  }
}

TEST(StepGuard, WithoutGuardsNothingChangesAndZScoresAreNotComputed) {
  ParamStore s = make_store(DType::f16, DType::f16, true);
  AdamW opt(s, AdamConfig{});
  GradScaler scaler(loss_scale_preset("torch"));
  write_grads(s, scaler.get_scale(), 1);
  const StepOutcome out = scaler.step(opt);
  EXPECT_TRUE(out.applied);
  EXPECT_TRUE(std::isnan(out.guard.loss_z));
  EXPECT_TRUE(std::isnan(out.guard.grad_z));
  EXPECT_EQ(scaler.state_json().find("\"guard\""), std::string::npos);
}

TEST(StepGuard, StateCarriesTheWindowsAndAResumedScalerDecidesTheSame) {
  const auto make = [] {
    GradScaler sc(loss_scale_preset("torch"));
    GuardConfig g;
    g.loss_z = 2;
    g.grad_z = 2;
    g.window = 10;
    sc.set_guard(g);
    return sc;
  };
  ParamStore s = make_store(DType::f16, DType::f16, true);
  AdamW opt(s, AdamConfig{});
  GradScaler a = make();
  std::vector<double> losses = loss_series(30, 9);
  losses[20] += 5;  // a spike after the resume point
  std::string saved;
  std::vector<SkipReason> reasons_a, reasons_b;
  for (int step = 0; step < 30; ++step) {
    if (step == 12) saved = a.state_json();
    write_grads(s, a.get_scale(), step);
    StepOptions o;
    o.loss = losses[static_cast<std::size_t>(step)];
    const StepOutcome out = a.step(opt, o);
    a.update();
    if (step >= 12) reasons_a.push_back(out.reason);
  }
  ParamStore s2 = make_store(DType::f16, DType::f16, true);
  AdamW opt2(s2, AdamConfig{});
  GradScaler b(loss_scale_preset("torch"));  // no guard of its own: the state brings it
  b.load_state_json(saved);
  EXPECT_EQ(b.guard().window, 10);
  for (int step = 12; step < 30; ++step) {
    write_grads(s2, b.get_scale(), step);
    StepOptions o;
    o.loss = losses[static_cast<std::size_t>(step)];
    const StepOutcome out = b.step(opt2, o);
    b.update();
    reasons_b.push_back(out.reason);
  }
  EXPECT_EQ(reasons_a, reasons_b);
  EXPECT_NE(std::find(reasons_a.begin(), reasons_a.end(), SkipReason::loss_spike), reasons_a.end());
}

TEST(StepGuard, BadGuardStateIsRefusedAndChangesNothing) {
  GradScaler sc(loss_scale_preset("torch"));
  GuardConfig g;
  g.loss_z = 2;
  g.window = 10;
  sc.set_guard(g);
  const std::string good = sc.state_json();
  const auto refused = [&](std::string text, const char* needle) {
    const std::string before = sc.state_json();
    try {
      sc.load_state_json(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(sc.state_json(), before);
  };
  std::string wrong_window = good;
  const std::size_t at = wrong_window.find("\"window\":10");
  ASSERT_NE(at, std::string::npos);
  wrong_window.replace(at, 11, "\"window\":12");
  refused(wrong_window, "guard");
  std::string bad_key = good;
  bad_key.replace(bad_key.find("\"skip_loss_z\""), 13, "\"skip_lossy\"");
  refused(bad_key, "guard.config");
}

TEST(StepGuard, AGuardedDisabledScalerNeedsUpdateBetweenSteps) {
  ParamStore s = make_store(DType::bf16, DType::bf16, true);
  AdamW opt(s, AdamConfig{});
  GradScaler sc(LossScaleConfig{}, false);
  GuardConfig g;
  g.grad_z = 3;
  sc.set_guard(g);
  write_grads(s, 1.0f, 1);
  EXPECT_TRUE(sc.step(opt).applied);
  EXPECT_THROW(sc.step(opt), ScalerMisuse);
  sc.update();
  EXPECT_TRUE(sc.step(opt).applied);
}

}  // namespace
}  // namespace mixprec
