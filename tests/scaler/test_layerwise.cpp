// Per-layer loss scaling (scaler/layerwise.hpp): erfinv and the approx_range rule against an
// independent computation (long double, erfinv by bisection on erfl), the per-layer state
// machine, its state format and the protocol's preset "layerwise".
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mixprec/formats/types.hpp"
#include "mixprec/scaler/layerwise.hpp"
#include "mixprec/scaler/protocol.hpp"

namespace mixprec {
namespace {

using json = nlohmann::json;

// erfinv by bisection on erfl: nothing shared with the implementation (no closed-form start,
// no Halley steps, no erfc).
long double erfinv_bisect(long double x) {
  const long double a = std::fabs(x);
  // erfinv(a) < a below 0.5 (erf(y) > y there): a relative bracket, so that tiny x keep digits.
  long double lo = 0, hi = a < 0.5L ? a : 7;
  for (int i = 0; i < 200; ++i) {
    const long double mid = (lo + hi) / 2;
    if (std::erf(mid) < a) lo = mid;
    else hi = mid;
  }
  const long double y = (lo + hi) / 2;
  return x < 0 ? -y : y;
}

TEST(Layerwise, ErfinvMatchesBisection) {
  std::vector<double> xs = {1e-300, 1e-12, 1e-6, 1e-3, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 0.999999};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(-0.9999, 0.9999);
  for (int i = 0; i < 2000; ++i) xs.push_back(u(rng));
  for (double x : xs) {
    for (double s : {x, -x}) {
      const double want = static_cast<double>(erfinv_bisect(s));
      const double got = erfinv(s);
      EXPECT_NEAR(got, want, 4e-15 * std::fabs(want) + 1e-300) << "erfinv(" << s << ")";
    }
  }
  EXPECT_EQ(erfinv(0.0), 0.0);
  EXPECT_TRUE(std::signbit(erfinv(-0.0)));
  EXPECT_EQ(erfinv(1.0), INFINITY);
  EXPECT_EQ(erfinv(-1.0), -INFINITY);
  EXPECT_TRUE(std::isnan(erfinv(1.0000001)));
  EXPECT_TRUE(std::isnan(erfinv(-2.0)));
  EXPECT_TRUE(std::isnan(erfinv(NAN)));
  // A published value: erfinv(0.5) = 0.4769362762044699 (Abramowitz & Stegun tables).
  EXPECT_NEAR(erfinv(0.5), 0.4769362762044699, 1e-16);
}

struct Values {
  std::vector<float> v;
  TensorMoments m;
};

Values normal(std::mt19937_64& rng, std::size_t n, double mean, double sd) {
  std::normal_distribution<double> d(mean, sd);
  Values out;
  for (std::size_t i = 0; i < n; ++i) out.v.push_back(static_cast<float>(d(rng)));
  out.m = moments_of(out.v);
  return out;
}

// The rule as the issue writes it, in long double, from the raw values (mean and population
// variance by two passes): the reference for approx_range_factor. Returns the factor before
// the power-of-two step.
long double rule_raw(const std::vector<float>& g, const std::vector<float>& w, std::int64_t fan_in, long double chain,
                     const LayerwiseConfig& c) {
  auto mv = [](const std::vector<float>& x, long double& mean, long double& var, long double& amax) {
    long double s = 0;
    amax = 0;
    for (float v : x) {
      s += v;
      amax = std::max(amax, std::fabs(static_cast<long double>(v)));
    }
    mean = s / static_cast<long double>(x.size());
    long double q = 0;
    for (float v : x) q += (v - mean) * (v - mean);
    var = q / static_cast<long double>(x.size());
  };
  long double mg, vg, ag, mw, vw, aw;
  mv(g, mg, vg, ag);
  mv(w, mw, vw, aw);
  const long double n = static_cast<long double>(fan_in);
  const long double sigma_o = std::sqrt((vg + mg * mg) * (vw + mw * mw)) * std::sqrt(0.5L * n);
  long double s = std::max(1.0L, c.u_min / (erfinv_bisect(c.n_uf) * std::sqrt(2.0L) * sigma_o));
  s = std::min(s, (c.u_max / n) / (ag * aw));
  s = std::min({s, c.max_chain / chain, static_cast<long double>(c.max_factor)});
  return s;
}

TEST(Layerwise, ApproxRangeMatchesTheFormula) {
  const LayerwiseConfig c;
  std::mt19937_64 rng(11);
  int below_one = 0, underflow_branch = 0, capped = 0, near_boundary = 0, cases = 0;
  for (int k = 0; k < 400; ++k) {
    const std::int64_t fan_in = std::int64_t{1} << (k % 11);
    // g spans 2^-36 .. 2^+11 (underflow-driven factors above 1, overflow-bounded ones below);
    // W of a typical init and a few large ones.
    const double g_sd = std::ldexp(1.0, -36 + (k * 7) % 48);
    const double w_sd = k % 3 == 0 ? 4.0 : 0.02;
    const Values g = normal(rng, 64 + k, k % 3 == 0 ? g_sd : 0.0, g_sd);
    const Values w = normal(rng, 48, k % 4 == 0 ? w_sd / 2 : 0.0, w_sd);
    const double chain = std::ldexp(1.0, k % 12);
    const long double raw = rule_raw(g.v, w.v, fan_in, chain, c);
    const double got = approx_range_factor(g.m, w.m, fan_in, chain, c);
    ++cases;
    const long double l2 = std::log2(raw);
    const bool cap = raw == 16 || raw == static_cast<long double>(c.max_chain) / chain;
    if (cap || raw == 1) {
      EXPECT_EQ(got, static_cast<double>(raw)) << "case " << k;  // a cap or the floor at 1: exact
      capped += cap;
      continue;
    }
    // The power of two below raw; a raw value within rounding of a power of two may go either way.
    if (std::fabs(l2 - std::round(l2)) < 1e-9L) {
      ++near_boundary;
      EXPECT_TRUE(got == std::exp2(std::round(l2)) || got == std::exp2(std::round(l2) - 1)) << k;
      continue;
    }
    EXPECT_EQ(got, static_cast<double>(std::exp2(std::floor(l2)))) << "case " << k << " raw " << static_cast<double>(raw);
    below_one += raw < 1;
    underflow_branch += raw > 1 && raw < 16;
  }
  // Every branch of the rule was met.
  EXPECT_GT(below_one, 10);
  EXPECT_GT(underflow_branch, 20);
  EXPECT_GT(capped, 20);
  EXPECT_LT(near_boundary, cases / 10);
}

TEST(Layerwise, ApproxRangeEdges) {
  const LayerwiseConfig c;
  TensorMoments zero;
  zero.count = 10;
  TensorMoments w = moments_of(std::vector<float>{0.5f, -0.25f});
  EXPECT_EQ(approx_range_factor(zero, w, 8, 1.0, c), 1.0);  // an all-zero gradient: nothing to rescue
  // The chain cap: a chain already at 1024 gets 1, beyond it a factor below 1.
  TensorMoments tiny = moments_of(std::vector<float>{1e-9f, -1e-9f});
  EXPECT_EQ(approx_range_factor(tiny, w, 8, 1.0, c), 16.0);
  EXPECT_EQ(approx_range_factor(tiny, w, 8, 256.0, c), 4.0);
  EXPECT_EQ(approx_range_factor(tiny, w, 8, 1024.0, c), 1.0);
  EXPECT_EQ(approx_range_factor(tiny, w, 8, 4096.0, c), 0.25);
  // The overflow bound: max|g| max|W| fan_in may not pass u_max.
  TensorMoments big = moments_of(std::vector<float>{30000.0f, -1.0f});
  EXPECT_EQ(approx_range_factor(big, moments_of(std::vector<float>{1.0f}), 4, 1.0, c), 0.5);  // 65504/4/30000 = 0.546
}

TEST(Layerwise, MomentsOfEveryDtype) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> d(0.1f, 3.0f);
  std::vector<float> f32;
  std::vector<f16> h;
  std::vector<bf16> b;
  for (int i = 0; i < 1000; ++i) {
    const float x = d(rng);
    h.push_back(f16(x));
    b.push_back(bf16(x));
  }
  h[17] = f16::from_bits(0x7C00);  // inf
  auto check = [](const TensorMoments& m, const std::vector<float>& decoded) {
    long double s = 0, q = 0, a = 0;
    bool finite = true;
    for (float x : decoded) {
      if (!std::isfinite(x)) {
        finite = false;
        continue;
      }
      s += x;
      q += static_cast<long double>(x) * x;
      a = std::max(a, static_cast<long double>(std::fabs(x)));
    }
    EXPECT_EQ(m.count, decoded.size());
    EXPECT_EQ(m.finite, finite);
    EXPECT_NEAR(m.sum, static_cast<double>(s), 1e-9 * static_cast<double>(q));
    EXPECT_NEAR(m.sum_squares, static_cast<double>(q), 1e-12 * static_cast<double>(q));
    EXPECT_EQ(m.amax, static_cast<double>(a));
  };
  std::vector<float> dh, db;
  for (f16 x : h) dh.push_back(static_cast<float>(x));
  for (bf16 x : b) db.push_back(static_cast<float>(x));
  check(moments_of(GradTensor{h.data(), h.size(), DType::f16}), dh);
  check(moments_of(GradTensor{b.data(), b.size(), DType::bf16}), db);
  check(moments_of(GradTensor{db.data(), db.size(), DType::f32}), db);
  EXPECT_FALSE(moments_of(GradTensor{h.data(), h.size(), DType::f16}).finite);
}

TensorMoments tiny_g() { return moments_of(std::vector<float>{1e-9f, -1e-9f, 2e-9f}); }
TensorMoments unit_w() { return moments_of(std::vector<float>{0.02f, -0.01f}); }

TEST(Layerwise, BackoffOnlyForTheOrigin) {
  LayerwiseConfig c;
  c.recovery_interval = 3;
  LayerwiseScales s(c);
  const std::size_t a = s.add_layer("a", 4), b = s.add_layer("b", 4);
  EXPECT_EQ(s.add_layer("a", 4), a);
  EXPECT_THROW(s.add_layer("a", 5), std::invalid_argument);  // same name, other fan_in
  EXPECT_EQ(s.decide(a, tiny_g(), unit_w(), 1.0), 16.0);
  EXPECT_EQ(s.decide(b, tiny_g(), unit_w(), 16.0), 16.0);
  EXPECT_EQ(s.layer(b).chain, 256.0);
  // a's own gradients overflowed (its input was finite): origin; b fine.
  EXPECT_EQ(s.finish_layer(a, false), LayerOutcome::origin);
  EXPECT_EQ(s.finish_layer(b, true), LayerOutcome::applied);
  EXPECT_TRUE(s.any_origin());
  s.update();
  EXPECT_EQ(s.layer(a).backoff, 1);
  EXPECT_EQ(s.layer(a).overflows, 1);
  EXPECT_EQ(s.layer(b).backoff, 0);
  EXPECT_FALSE(s.any_origin());
  // Next step: a's factor is the rule's halved.
  EXPECT_EQ(s.decide(a, tiny_g(), unit_w(), 1.0), 8.0);
  // A non-finite incoming gradient: factor 1, and its overflow is not its own.
  TensorMoments bad = tiny_g();
  bad.finite = false;
  EXPECT_EQ(s.decide(b, bad, unit_w(), 8.0), 1.0);
  EXPECT_EQ(s.finish_layer(a, true), LayerOutcome::applied);
  EXPECT_EQ(s.finish_layer(b, false), LayerOutcome::victim);
  EXPECT_FALSE(s.any_origin());
  s.update();
  EXPECT_EQ(s.layer(b).backoff, 0);
  EXPECT_EQ(s.layer(b).skipped, 1);
  EXPECT_EQ(s.layer(b).overflows, 0);
  // recovery_interval clean steps undo one backoff.
  for (int i = 0; i < 2; ++i) {
    s.finish_layer(a, true);
    s.update();
  }
  EXPECT_EQ(s.layer(a).backoff, 0);
  // keep(): a later pass of the window gets the first pass's factor; its input is checked.
  EXPECT_EQ(s.decide(a, tiny_g(), unit_w(), 1.0), 16.0);
  EXPECT_EQ(s.keep(a, true), 16.0);
  EXPECT_EQ(s.keep(a, false), 16.0);
  EXPECT_EQ(s.finish_layer(a, false), LayerOutcome::victim);
}

TEST(Layerwise, MaxBackoffBoundsTheBackoff) {
  LayerwiseConfig c;
  c.max_backoff = 2;
  LayerwiseScales s(c);
  const std::size_t a = s.add_layer("a", 4);
  for (int i = 0; i < 5; ++i) {
    s.finish_layer(a, false);
    s.update();
  }
  EXPECT_EQ(s.layer(a).backoff, 2);
  EXPECT_EQ(s.layer(a).overflows, 5);
  EXPECT_EQ(s.decide(a, tiny_g(), unit_w(), 1.0), 4.0);
}

TEST(Layerwise, ConfigIsValidated) {
  auto bad = [](auto change, const char* field) {
    LayerwiseConfig c;
    change(c);
    try {
      validate(c);
      ADD_FAILURE() << field << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  bad([](LayerwiseConfig& c) { c.u_min = 0; }, "u_min");
  bad([](LayerwiseConfig& c) { c.u_max = INFINITY; }, "u_max");
  bad([](LayerwiseConfig& c) { c.n_uf = 1; }, "n_uf");
  bad([](LayerwiseConfig& c) { c.max_factor = 0.5; }, "max_factor");
  bad([](LayerwiseConfig& c) { c.max_chain = NAN; }, "max_chain");
  bad([](LayerwiseConfig& c) { c.recovery_interval = 0; }, "recovery_interval");
  bad([](LayerwiseConfig& c) { c.max_backoff = -1; }, "max_backoff");
  EXPECT_NO_THROW(validate(LayerwiseConfig{}));
}

TEST(Layerwise, StateRoundTripAndErrors) {
  LayerwiseScales s;
  const std::size_t a = s.add_layer("h0.attn.qkv", 192);
  s.add_layer("h0.mlp.fc", 256);
  s.finish_layer(a, false);
  s.update();
  const std::string text = s.to_json();
  const LayerwiseScales back = LayerwiseScales::from_json(text);
  EXPECT_EQ(back.to_json(), text);
  EXPECT_EQ(back.layer(0).backoff, 1);
  // Loading keeps the registered order: a door that registered in another order keeps its indices.
  LayerwiseScales other;
  other.add_layer("h0.mlp.fc", 256);
  other.load_state(back);
  EXPECT_EQ(other.layer(0).name, "h0.mlp.fc");
  EXPECT_EQ(other.layer(1).name, "h0.attn.qkv");
  EXPECT_EQ(other.layer(1).backoff, 1);
  LayerwiseScales wrong;
  wrong.add_layer("h0.mlp.fc", 128);
  EXPECT_THROW(wrong.load_state(back), std::invalid_argument);
  EXPECT_EQ(wrong.layer(0).fan_in, 128);
  auto refuse = [&](const std::string& t, const char* says) {
    try {
      (void)LayerwiseScales::from_json(t);
      ADD_FAILURE() << t;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  json j = json::parse(text);
  auto with = [&](auto change) {
    json k = j;
    change(k);
    return k.dump();
  };
  refuse("[]", "expected an object");
  refuse("{", "malformed JSON");
  refuse(with([](json& k) { k["extra"] = 1; }), "unknown field 'extra'");
  refuse(with([](json& k) { k["config"]["n_uf"] = 2; }), "n_uf");
  refuse(with([](json& k) { k["config"].erase("u_max"); }),
         "layerwise state: config.u_max: expected a number, found nothing");
  refuse(with([](json& k) { k["layers"][0]["backoff"] = 99; }),
         "layerwise state: layers[0].backoff: expected an integer in [0, 24], found 99");
  refuse(with([](json& k) { k["layers"][0]["overflows"] = 5; }),
         "layerwise state: layers[0].overflows: expected an integer in [0, 1], found 5");
  refuse(with([](json& k) { k["layers"][1]["name"] = "h0.attn.qkv"; }), "appears twice");
  refuse(with([](json& k) { k["layers"][1]["clean_steps"] = 3; }), "clean_steps counts only while backoff > 0");
  refuse(with([](json& k) { k["layers"][0]["fan_in"] = 0; }),
         "layerwise state: layers[0].fan_in: expected an integer in [1, 2147483647], found 0");
}

// The protocol's per-layer part; a test failure (not a null dereference) when there is none.
LayerwiseScales& layers_of(ScalerProtocol& p) {
  LayerwiseScales* l = p.layerwise();
  if (l == nullptr) throw std::logic_error("the protocol has no per-layer scaling");
  return *l;
}

TEST(Layerwise, ProtocolPresetCarriesTheLayers) {
  ScalerProtocol p(loss_scale_preset("layerwise"), true, Dialect::mixprec, "layerwise");
  ASSERT_NE(p.layerwise(), nullptr);
  EXPECT_EQ(p.scale(), 65536.0f);  // the base scale is the mixprec preset's
  ScalerProtocol plain(loss_scale_preset("mixprec"), true, Dialect::mixprec, "mixprec");
  EXPECT_EQ(plain.layerwise(), nullptr);
  const std::size_t a = layers_of(p).add_layer("fc0", 8);
  layers_of(p).finish_layer(a, false);
  p.record(1, GradientCheck{.checked = true, .sum_squares = 1.0});
  p.update();  // ends the layers' step too
  EXPECT_EQ(layers_of(p).layer(a).backoff, 1);
  EXPECT_EQ(p.scale(), 65536.0f);  // a layer's overflow is not the base scale's
  const std::string state = p.state_json();
  const json j = json::parse(state);
  ASSERT_TRUE(j.contains("layerwise"));
  EXPECT_EQ(j["preset"], "layerwise");
  EXPECT_EQ(j["layerwise"]["layers"][0]["backoff"], 1);
  // Into a plain scaler: the state's preset and its layers come with it.
  plain.load_state_json(state);
  ASSERT_NE(plain.layerwise(), nullptr);
  EXPECT_EQ(layers_of(plain).layer(0).backoff, 1);
  EXPECT_EQ(plain.state_json(), state);
  // A layerwise state without its layers, or layers under another preset: refused, nothing changed.
  json no_layers = j;
  no_layers.erase("layerwise");
  EXPECT_THROW(plain.load_state_json(no_layers.dump()), std::invalid_argument);
  json stray = j;
  stray["preset"] = "torch";
  EXPECT_THROW(plain.load_state_json(stray.dump()), std::invalid_argument);
  EXPECT_EQ(plain.state_json(), state);
  // A plain state into the layerwise scaler: per-layer scaling goes with the preset.
  p.load_state_json(ScalerProtocol(loss_scale_preset("torch"), true, Dialect::mixprec, "torch").state_json());
  EXPECT_EQ(p.layerwise(), nullptr);
  // torch.amp's five keys into a layerwise scaler: the base scale is loaded, the layers stay.
  plain.load_state_json(R"({"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                            "_growth_tracker": 0})");
  ASSERT_NE(plain.layerwise(), nullptr);
  EXPECT_EQ(plain.scale(), 1024.0f);
  EXPECT_EQ(layers_of(plain).layer(0).backoff, 1);
}

}  // namespace
}  // namespace mixprec
