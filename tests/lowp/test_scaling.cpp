// The scale rules of lowp/scaling.hpp (docs/fp8.md): delayed scaling with hand-computed
// scales for histories with zeros, infs, NaNs, a spike and the margin; state save/load;
// current scaling; MX block scales under both roundings on edge blocks, through
// lowp::quantize; its per-tensor codes bit-exact against the library's encode.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/lowp/scaling.hpp"

namespace mixprec::lowp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kFltMax = std::numeric_limits<float>::max();

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

#define EXPECT_SAME_FLOAT(a, b) EXPECT_EQ(bits(a), bits(b)) << (a) << " vs " << (b)

// One tensor under delayed scaling; records `amaxes` one per step and returns the scales.
std::vector<float> run_delayed(DelayedScalingConfig c, Role role, const std::vector<float>& amaxes) {
  DelayedScaling d(c);
  const auto t = d.add_tensor("t", role);
  std::vector<float> out;
  for (float a : amaxes) {
    d.record_amax(t, a);
    d.update();
    EXPECT_SAME_FLOAT(d.scale_inv(t), 1.0f / d.scale(t));
    out.push_back(d.scale(t));
  }
  return out;
}

TEST(Fp8Formats, DtypesAndMaxima) {
  EXPECT_EQ(max_finite(Element::e4m3), 448.0f);
  EXPECT_EQ(max_finite(Element::e5m2), 57344.0f);
  EXPECT_EQ(max_finite(Element::e2m1), 6.0f);
  EXPECT_EQ(dtype_for(Format::hybrid, Role::forward), Element::e4m3);
  EXPECT_EQ(dtype_for(Format::hybrid, Role::backward), Element::e5m2);
  EXPECT_EQ(dtype_for(Format::e4m3, Role::backward), Element::e4m3);
  const DelayedScalingConfig defaults;  // TE DelayedScaling() defaults
  EXPECT_EQ(defaults.margin, 0);
  EXPECT_EQ(defaults.amax_history_len, 1024u);
  EXPECT_EQ(defaults.amax_compute_algo, AmaxAlgo::max);
  EXPECT_EQ(defaults.format, Format::hybrid);
}

TEST(Fp8Delayed, HistoryWithZerosNaNsAndInfs) {
  // E4M3, margin 0, history length 4, "max". fp8_max = 448.
  // h is shown as [slot 0 (this step), ..., oldest]; update rolls a_i = h[i+1], a_3 = h[0]
  // into h' = [0, a_1, a_2, a_3] and uses fmax over all a_i (NaN ignored).
  //  step 1: h=[2,0,0,0]     amax 2          -> 448/2 = 224        h'=[0,0,0,2]
  //  step 2: h=[0,0,0,2]     amax 2          -> 224                h'=[0,0,2,0]
  //  step 3: h=[NaN,0,2,0]   amax 2 (NaN ignored) -> 224           h'=[0,2,0,NaN]
  //  step 4: h=[inf,2,0,NaN] amax inf        -> keep 224           h'=[0,0,NaN,inf]
  //  steps 5-7: 1 recorded, the inf is still in the window -> keep 224
  //  step 8: h=[1,1,1,1]     amax 1          -> 448
  DelayedScalingConfig c;
  c.format = Format::e4m3;
  c.amax_history_len = 4;
  const auto s = run_delayed(c, Role::forward, {2, 0, kNaN, kInf, 1, 1, 1, 1});
  const std::vector<float> want{224, 224, 224, 224, 224, 224, 224, 448};
  EXPECT_EQ(s, want);
}

TEST(Fp8Delayed, HistoryContentsFollowTheRoll) {
  DelayedScalingConfig c;
  c.amax_history_len = 4;
  DelayedScaling d(c);
  const auto t = d.add_tensor("x", Role::forward);
  for (float a : {2.0f, 0.0f, kNaN, kInf}) {
    d.record_amax(t, a);
    d.update();
  }
  const auto h = d.amax_history(t);  // [0, 0, NaN, inf] (see the table above)
  ASSERT_EQ(h.size(), 4u);
  EXPECT_EQ(h[0], 0.0f);
  EXPECT_EQ(h[1], 0.0f);
  EXPECT_TRUE(std::isnan(h[2]));
  EXPECT_EQ(h[3], kInf);
}

TEST(Fp8Delayed, InitialScaleKeptWhileNothingUsable) {
  // Scale starts at 1 (TE initialises scale to ones). Zero, NaN, inf amaxes keep it.
  DelayedScalingConfig c;
  c.amax_history_len = 1;  // window = this step only
  c.format = Format::e4m3;
  const auto s = run_delayed(c, Role::forward, {0, kNaN, kInf, 4, 0, kNaN});
  // 0 -> 1; NaN -> fmax(0, NaN) = 0 -> 1; inf -> 1; 4 -> 448/4 = 112; then kept.
  const std::vector<float> want{1, 1, 1, 112, 112, 112};
  EXPECT_EQ(s, want);
}

TEST(Fp8Delayed, SpikeStaysForTheHistoryLength) {
  // Length 4, "max": the spike 100 at step 3 rules steps 3..6 (448/100 in fp32), step 7 is back.
  DelayedScalingConfig c;
  c.format = Format::e4m3;
  c.amax_history_len = 4;
  const auto s = run_delayed(c, Role::forward, {1, 1, 100, 1, 1, 1, 1});
  const float spike = 448.0f / 100.0f;
  const std::vector<float> want{448, 448, spike, spike, spike, spike, 448};
  EXPECT_EQ(s, want);
  // "most_recent" forgets it at once.
  c.amax_compute_algo = AmaxAlgo::most_recent;
  const auto r = run_delayed(c, Role::forward, {1, 1, 100, 1});
  const std::vector<float> want_recent{448, 448, spike, 448};
  EXPECT_EQ(r, want_recent);
}

TEST(Fp8Delayed, MostRecentKeepsPreviousOnZeroNaNInf) {
  // most_recent uses h[0] only: 2 -> 224; 0, NaN, inf keep 224; 4 -> 112.
  DelayedScalingConfig c;
  c.format = Format::e4m3;
  c.amax_history_len = 3;
  c.amax_compute_algo = AmaxAlgo::most_recent;
  const auto s = run_delayed(c, Role::forward, {2, 0, kNaN, kInf, 4});
  const std::vector<float> want{224, 224, 224, 224, 112};
  EXPECT_EQ(s, want);
}

TEST(Fp8Delayed, Margin) {
  // scaled_max = fp8_max * 2^-margin.
  DelayedScalingConfig c;
  c.amax_history_len = 2;
  c.margin = 2;  // E4M3 forward: 448 / 4 = 112; amax 2 -> 56
  EXPECT_EQ(run_delayed(c, Role::forward, {2}), std::vector<float>{56});
  c.margin = 1;  // HYBRID backward is E5M2: 57344 / 2 = 28672; amax 4 -> 7168
  EXPECT_EQ(run_delayed(c, Role::backward, {4}), std::vector<float>{7168});
  c.margin = -1;  // negative margin: 896 / 2 = 448 (E4M3 forward)
  EXPECT_EQ(run_delayed(c, Role::forward, {2}), std::vector<float>{448});
}

TEST(Fp8Delayed, TinyAmaxGivesFltMax) {
  // 448 / 1e-38 overflows fp32 -> FLT_MAX; scale_inv = 1 / FLT_MAX (a subnormal, not 0).
  EXPECT_SAME_FLOAT(delayed_scale(1e-38f, 1.0f, 448.0f, 0), kFltMax);
  EXPECT_GT(1.0f / kFltMax, 0.0f);
  // amax 2^-120: 448 * 2^120 = 1.75 * 2^128 overflows -> FLT_MAX at margin 0. With margin 1 TE
  // divides 224 by amax once: 1.75 * 2^127 is finite. (the documented (fp8_max/amax)/2^margin
  // would give inf/2 -> FLT_MAX; this window is the only place the two forms differ.)
  EXPECT_SAME_FLOAT(delayed_scale(0x1p-120f, 1.0f, 448.0f, 0), kFltMax);
  EXPECT_SAME_FLOAT(delayed_scale(0x1p-120f, 1.0f, 448.0f, 1), 0x1.cp127f);
  // Ordinary values: one rounding, as 448 / amax.
  EXPECT_SAME_FLOAT(delayed_scale(3.0f, 1.0f, 448.0f, 0), 448.0f / 3.0f);
  EXPECT_SAME_FLOAT(delayed_scale(3.0f, 1.0f, 448.0f, 3), 56.0f / 3.0f);
  EXPECT_SAME_FLOAT(delayed_scale(0.0f, 7.0f, 448.0f, 0), 7.0f);
  EXPECT_SAME_FLOAT(delayed_scale(kNaN, 7.0f, 448.0f, 0), 7.0f);
  EXPECT_SAME_FLOAT(delayed_scale(kInf, 7.0f, 448.0f, 0), 7.0f);
}

TEST(Fp8Delayed, RecordTakesTheMaxAndKeepsNaN) {
  DelayedScaling d;
  const auto a = d.add_tensor("a", Role::forward);
  const auto b = d.add_tensor("b", Role::backward);
  d.record_amax(a, 3);
  d.record_amax(a, 5);
  d.record_amax(a, 4);
  d.record_amax(b, kNaN);
  d.record_amax(b, 5);
  const auto cur = d.current_amaxes();
  EXPECT_EQ(cur[0], 5.0f);
  EXPECT_TRUE(std::isnan(cur[1]));
  EXPECT_THROW(d.record_amax(a, -1.0f), std::invalid_argument);
  EXPECT_THROW(d.record_amax(2, 1.0f), std::invalid_argument);
  EXPECT_THROW(d.add_tensor("a", Role::forward), std::invalid_argument);
  // An all-reduce with MAX across ranks replaces the slots.
  const std::vector<float> reduced{8.0f, 16.0f};
  d.set_current_amaxes(reduced);
  d.update();
  EXPECT_EQ(d.scale(a), 56.0f);    // E4M3: 448 / 8
  EXPECT_EQ(d.scale(b), 3584.0f);  // E5M2: 57344 / 16
  EXPECT_EQ(d.dtype(b), Element::e5m2);
  EXPECT_THROW(d.set_current_amaxes(std::vector<float>{1.0f}), std::invalid_argument);
}

TEST(Fp8Delayed, ConfigValidation) {
  DelayedScalingConfig c;
  c.amax_history_len = 0;
  EXPECT_THROW(DelayedScaling{c}, std::invalid_argument);
  c.amax_history_len = 1;
  c.margin = 65;
  EXPECT_THROW(DelayedScaling{c}, std::invalid_argument);
}

TEST(Fp8DelayedState, JsonRoundTripIsBitExact) {
  DelayedScalingConfig c;
  c.amax_history_len = 3;
  c.margin = 1;
  c.amax_compute_algo = AmaxAlgo::most_recent;
  DelayedScaling d(c);
  const auto a = d.add_tensor("layer0.input", Role::forward);
  const auto g = d.add_tensor("layer0.grad \"out\"", Role::backward);
  d.record_amax(a, 1e-38f);  // scale becomes FLT_MAX
  d.record_amax(g, 0.1f);
  d.update();
  d.record_amax(a, kInf);
  d.record_amax(g, kNaN);
  d.update();
  d.record_amax(a, 0.3f);  // a pending slot value is part of the state too
  EXPECT_SAME_FLOAT(d.scale(a), kFltMax);
  const std::string text = d.to_json();
  DelayedScaling e(c);
  e.load_json(text);
  EXPECT_EQ(e.state(), d.state());
  EXPECT_EQ(e.to_json(), text);
  // The loaded object continues exactly like the original.
  d.update();
  e.update();
  EXPECT_EQ(e.state(), d.state());
}

TEST(Fp8DelayedState, RejectsBadStates) {
  DelayedScalingConfig c;
  c.amax_history_len = 2;
  DelayedScaling d(c);
  d.add_tensor("w", Role::forward);
  const std::string good = d.to_json();
  auto bad = [&](const std::string& from, const std::string& to, const std::string& message) {
    std::string text = good;
    const auto pos = text.find(from);
    ASSERT_NE(pos, std::string::npos) << from << " in " << text;
    text.replace(pos, from.size(), to);
    try {
      DelayedScalingState::from_json(text);
      ADD_FAILURE() << "accepted " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    // load leaves the object unchanged on error.
    DelayedScaling copy = d;
    EXPECT_THROW(copy.load_json(text), std::invalid_argument);
    EXPECT_EQ(copy.state(), d.state());
  };
  bad("\"amax_history\":[0.0,0.0]", "\"amax_history\":[0.0]", "amax_history: expected 2 values");
  bad("\"amax_history\":[0.0,0.0]", "\"amax_history\":[0.0,-1.0]", "amax_history: values must be");
  bad("\"scale_inv\":1.0", "\"scale_inv\":0.5", "scale_inv: expected 1 / scale");
  bad("\"scale\":1.0", "\"scale\":\"inf\"", "scale: expected a finite number");
  bad("\"margin\":0", "\"margin\":100", "margin");
  bad("\"margin\":0", "\"margin\":0.5", "margin: expected an integer");
  bad("\"amax_compute_algo\":\"max\"", "\"amax_compute_algo\":\"mean\"", "amax_compute_algo");
  bad("\"fp8_format\":\"HYBRID\"", "\"fp8_format\":\"E5M2\"", "fp8_format");
  bad("\"role\":\"forward\"", "\"role\":\"sideways\"", "role");
  bad("\"version\":1", "\"version\":2", "version");
  bad("\"version\":1", "\"version\":1,\"extra\":3", "extra: unknown field");
  bad("\"scale\":1.0", "\"scale\":0.1", "scale: not an fp32 value");  // 0.1 is no fp32 value
  EXPECT_THROW(DelayedScalingState::from_json("{"), std::invalid_argument);
}

// ---- current scaling -------------------------------------------------------------

TEST(Fp8Current, ScaleRule) {
  EXPECT_EQ(current_scale(0.0f, 448.0f, false, 0.0f), 1.0f);
  EXPECT_EQ(current_scale(kInf, 448.0f, false, 0.0f), 1.0f);
  EXPECT_EQ(current_scale(kNaN, 448.0f, false, 0.0f), 1.0f);  // 448 / NaN is NaN -> 1
  EXPECT_EQ(current_scale(2.0f, 448.0f, false, 0.0f), 224.0f);
  EXPECT_SAME_FLOAT(current_scale(3.0f, 448.0f, false, 0.0f), 448.0f / 3.0f);  // 149.33
  EXPECT_EQ(current_scale(3.0f, 448.0f, true, 0.0f), 128.0f);                  // 149.33 -> 2^7
  EXPECT_EQ(current_scale(57344.0f, 57344.0f, false, 0.0f), 1.0f);
  EXPECT_SAME_FLOAT(current_scale(1e-38f, 448.0f, false, 0.0f), kFltMax);
  EXPECT_EQ(current_scale(1e-38f, 448.0f, true, 0.0f), 0x1p127f);  // FLT_MAX -> 2^127
  // epsilon: amax 1e-10 is raised to 1e-4: 448 / 1e-4 = 4.48e6 -> power of two 2^22.
  EXPECT_SAME_FLOAT(current_scale(1e-10f, 448.0f, false, 1e-4f), 448.0f / 1e-4f);
  EXPECT_EQ(current_scale(1e-10f, 448.0f, true, 1e-4f), 0x1p22f);
  EXPECT_EQ(current_scale(0.0f, 448.0f, false, 1e-4f), 448.0f / 1e-4f);  // 0 < eps: raised too
  EXPECT_EQ(current_scale(kNaN, 448.0f, false, 1e-4f), 1.0f);
  CurrentScalingConfig bad;
  bad.amax_epsilon = -1.0f;
  EXPECT_THROW(validate(bad), std::invalid_argument);
}

// The scale rules through lowp::quantize, the one quantizer: a span of n values is one row
// of n (per tensor: fp8-delayed at a given scale, fp8-current; MX: mxfp8 rowwise, blocks of
// 32 from the row's start). The tests below check its codes, scales and amax against the
// rules of this file by hand.
template <class T>
constexpr Element element_of() { return std::is_same_v<T, f8e4m3> ? Element::e4m3 : Element::e5m2; }

template <class T>
Quantized quantize_row(std::span<const float> x, QuantizeConfig c) {
  c.element = element_of<T>();
  return lowp::quantize(x, 1, x.size(), c);
}

template <class T>
void codes_to(const Quantized& z, std::span<T> q) {
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = T::from_bits(z.codes[i]);
}

float amax(const std::vector<float>& x) {
  if (x.empty()) return 0.0f;
  QuantizeConfig c;
  c.recipe = Recipe::fp8_delayed;
  return quantize_row<f8e4m3>(x, c).counts.amax;
}

struct CurrentQuantized {
  float amax, scale, scale_inv;
};
template <class T>
CurrentQuantized quantize_current(const std::vector<float>& x, std::span<T> q, bool pow2, float eps) {
  QuantizeConfig c;
  c.recipe = Recipe::fp8_current;
  c.power_of_2_scales = pow2;
  c.amax_epsilon = eps;
  const Quantized z = quantize_row<T>(x, c);
  codes_to(z, q);
  return {z.counts.amax, z.tensor_scale, z.scale_inv.at(0)};
}

template <class T>
float mx_quantize(const std::vector<float>& x, std::span<T> q, std::span<e8m0> s, ScaleRounding r) {
  QuantizeConfig c;
  c.recipe = Recipe::mxfp8;
  c.scale_rounding = r;
  const Quantized z = quantize_row<T>(x, c);
  EXPECT_EQ(z.scale_codes.size(), s.size());
  codes_to(z, q);
  for (std::size_t b = 0; b < s.size(); ++b) s[b] = e8m0::from_bits(z.scale_codes.at(b));
  return z.counts.amax;
}

// lowp::dequantize of codes and E8M0 scales written into a quantization of the same shape.
template <class T>
void mx_dequantize(std::span<const T> q, std::span<const e8m0> s, std::span<float> out) {
  QuantizeConfig c;
  c.recipe = Recipe::mxfp8;
  Quantized z = quantize_row<T>(std::vector<float>(q.size(), 0.0f), c);
  for (std::size_t i = 0; i < q.size(); ++i) z.codes[i] = q[i].bits();
  for (std::size_t b = 0; b < s.size(); ++b) z.scale_codes[b] = s[b].bits();
  lowp::dequantize(z, out);
}
template <class T>
void mx_dequantize(const std::vector<T>& q, const std::vector<e8m0>& s, std::vector<float>& out) {
  mx_dequantize<T>(std::span<const T>(q), std::span<const e8m0>(s), std::span<float>(out));
}

constexpr std::size_t mx_blocks(std::size_t n) noexcept { return (n + kMxBlock - 1) / kMxBlock; }

TEST(Fp8Current, QuantizeCurrent) {
  const std::vector<float> x{1.0f, -2.0f, 0.5f, 0.0f};
  std::vector<f8e4m3> q(x.size());
  const auto r = quantize_current<f8e4m3>(x, q, false, 0.0f);
  EXPECT_EQ(r.amax, 2.0f);
  EXPECT_EQ(r.scale, 224.0f);
  EXPECT_SAME_FLOAT(r.scale_inv, 1.0f / 224.0f);
  EXPECT_EQ(decode(q[0]), 224.0f);
  EXPECT_EQ(decode(q[1]), -448.0f);
  EXPECT_EQ(decode(q[2]), 112.0f);
  EXPECT_EQ(q[3].bits(), 0);
  QuantizeConfig c;
  c.recipe = Recipe::fp8_current;
  const std::vector<float> back = lowp::dequantize(lowp::quantize(x, 1, x.size(), c));
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_SAME_FLOAT(back[i], decode(q[i]) * r.scale_inv);
}

// ---- quantize references, bit-exact against the library's encode ----------------------

std::vector<float> edge_and_random(std::size_t n, std::uint32_t seed) {
  std::vector<float> v{0.0f, -0.0f, kInf, -kInf, kNaN, -kNaN, 448.0f, 464.0f, -465.0f, 57344.0f,
                       61440.0f, 0x1p-9f, 0x1p-10f, 0x1.8p-10f, 1e-45f, kFltMax, -kFltMax, 1.0f};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::uint32_t> any;
  std::lognormal_distribution<float> mag(0.0f, 4.0f);
  while (v.size() < n) {
    if (v.size() % 3 == 0) {
      v.push_back(std::bit_cast<float>(any(rng)));
    } else {
      const float m = mag(rng);
      v.push_back(any(rng) & 1 ? m : -m);
    }
  }
  v.resize(n);
  return v;
}

template <class T>
void check_quantize_matches_convert() {
  for (std::size_t n : {1u, 7u, 33u, 1000u}) {
    const auto x = edge_and_random(n, static_cast<std::uint32_t>(n) + 1);
    for (float scale : {1.0f, 224.0f, 0.0078125f, 1.0f / 3.0f, kFltMax, 1e-30f}) {
      QuantizeConfig c;
      c.recipe = Recipe::fp8_delayed;
      c.scale = scale;
      const Quantized z = quantize_row<T>(x, c);
      std::vector<T> got(n), want(n);
      codes_to(z, std::span<T>(got));
      convert(std::span<const float>(x), std::span<T>(want), ConvertOptions{Overflow::saturate, Subnormals::keep, scale});
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i].bits(), want[i].bits()) << i << " scale " << scale;
      std::vector<float> back(n), want_back(n);
      lowp::dequantize(z, back);
      convert(std::span<const T>(got), std::span<float>(want_back), ConvertOptions{Overflow::saturate, Subnormals::keep, 1.0f / scale});
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(bits(back[i]), bits(want_back[i])) << i;
    }
  }
}

TEST(Fp8Quantize, MatchesLibraryConvertE4M3) { check_quantize_matches_convert<f8e4m3>(); }
TEST(Fp8Quantize, MatchesLibraryConvertE5M2) { check_quantize_matches_convert<f8e5m2>(); }

TEST(Fp8Quantize, FusedAmax) {
  EXPECT_EQ(bits(amax(std::vector<float>{})), 0u);
  EXPECT_EQ(amax(std::vector<float>{1.0f, -3.0f, 2.0f}), 3.0f);
  EXPECT_EQ(amax(std::vector<float>{1.0f, -kInf, 2.0f}), kInf);
  EXPECT_EQ(bits(amax(std::vector<float>{-kNaN, kInf})), 0x7fc00000u);
  // A per-tensor scale must be finite and > 0.
  QuantizeConfig c;
  c.recipe = Recipe::fp8_delayed;
  for (float bad : {0.0f, -1.0f, kInf, kNaN}) {
    c.scale = bad;
    EXPECT_THROW(quantize_row<f8e4m3>(std::vector<float>{1.0f}, c), std::invalid_argument) << bad;
  }
}

// ---- MX ---------------------------------------------------------------------------

struct Mx {
  std::vector<f8e4m3> q;
  std::vector<e8m0> s;
  float amax;
};
Mx mx4(const std::vector<float>& x, ScaleRounding r) {
  Mx m{std::vector<f8e4m3>(x.size()), std::vector<e8m0>(mx_blocks(x.size())), 0};
  m.amax = mx_quantize<f8e4m3>(x, m.q, m.s, r);
  return m;
}
std::vector<float> block(float first, float rest = 0.0f) {
  std::vector<float> v(32, rest);
  v[0] = first;
  return v;
}
constexpr auto kTE = ScaleRounding::rceil;
constexpr auto kOCP = ScaleRounding::floor;

TEST(Fp8Mx, AllZeroBlock) {
  // TE: amax 0 -> code 0x00, factor 1. OCP: 0 reads as 2^-126: -126 - 8 = -134 -> -127 (code 0).
  auto x = block(-0.0f);
  for (auto r : {kTE, kOCP}) {
    const auto m = mx4(x, r);
    EXPECT_EQ(m.s[0].bits(), 0x00);
    EXPECT_EQ(m.q[0].bits(), 0x80);  // -0 keeps its sign
    for (std::size_t i = 1; i < 32; ++i) EXPECT_EQ(m.q[i].bits(), 0x00);
    std::vector<float> back(32);
    mx_dequantize<f8e4m3>(m.q, m.s, back);
    EXPECT_EQ(bits(back[0]), 0x80000000u);
    EXPECT_EQ(bits(back[1]), 0u);
  }
}

TEST(Fp8Mx, AmaxAtPowerOfTwo) {
  // amax 256 = 2^8. TE: 256 * float(1/448) = 0.571.. = 1.14 * 2^-1, mantissa set -> 2^0.
  // OCP: floor(log2 256) - 8 = 0 -> 2^0. Both keep 256 exact.
  auto x = block(256.0f, 1.0f);
  for (auto r : {kTE, kOCP}) {
    const auto m = mx4(x, r);
    EXPECT_EQ(m.s[0].exponent(), 0) << scale_rounding_name(r);
    EXPECT_EQ(decode(m.q[0]), 256.0f);
  }
  // amax 2^-20: TE -> 2^-20 * 1.14 * 2^-9 -> 2^-28; OCP: -20 - 8 = -28. Element 2^-20 -> 256.
  x = block(0x1p-20f);
  for (auto r : {kTE, kOCP}) {
    const auto m = mx4(x, r);
    EXPECT_EQ(m.s[0].exponent(), -28);
    EXPECT_EQ(decode(m.q[0]), 256.0f);
  }
  // amax 448: 448 * float(1/448) = 448 * 9586981 * 2^-32 = 1 + 4.5e-8, rounds to 1.0 exactly:
  // TE exponent 0 (no mantissa bit); OCP floor(log2 448) - 8 = 0. 448 stays 448.
  x = block(448.0f);
  for (auto r : {kTE, kOCP}) {
    const auto m = mx4(x, r);
    EXPECT_EQ(m.s[0].exponent(), 0);
    EXPECT_EQ(decode(m.q[0]), 448.0f);
  }
}

TEST(Fp8Mx, TeRoundsUpOcpSaturates) {
  // amax 500: TE 500/448 = 1.116 -> 2^1, 500/2 = 250 -> E4M3 256 (between 240 and 256).
  // OCP: floor(log2 500) - 8 = 0 -> 500 saturates to 448.
  const auto x = block(500.0f, 3.0f);
  const auto te = mx4(x, kTE);
  EXPECT_EQ(te.s[0].exponent(), 1);
  EXPECT_EQ(decode(te.q[0]), 256.0f);
  EXPECT_EQ(decode(te.q[1]), 1.5f);
  const auto ocp = mx4(x, kOCP);
  EXPECT_EQ(ocp.s[0].exponent(), 0);
  EXPECT_EQ(decode(ocp.q[0]), 448.0f);
  EXPECT_EQ(decode(ocp.q[1]), 3.0f);
}

TEST(Fp8Mx, BlocksWithInfAndNaN) {
  // TE: amax ignores NaN (fmaxf); inf -> 0xFE (2^127), factor bits (254-254)<<23 = 0:
  // finite * 0 = +-0, inf * 0 = NaN, NaN stays NaN.
  auto x = block(kInf, 1.0f);
  x[1] = -2.0f;
  x[2] = kNaN;
  const auto te = mx4(x, kTE);
  EXPECT_EQ(te.s[0].bits(), 0xFE);
  EXPECT_EQ(te.q[0].bits() & 0x7F, 0x7F);  // NaN (inf * 0; its sign is the platform's default NaN's)
  EXPECT_EQ(te.q[1].bits(), 0x80);  // -2 * 0 = -0
  EXPECT_EQ(te.q[2].bits() & 0x7F, 0x7F);
  EXPECT_EQ(te.q[3].bits(), 0x00);
  EXPECT_TRUE(std::isnan(te.amax));
  // OCP: a block holding inf or NaN gets the NaN scale 0xFF; every element decodes to NaN.
  const auto ocp = mx4(x, kOCP);
  EXPECT_EQ(ocp.s[0].bits(), 0xFF);
  std::vector<float> back(32);
  mx_dequantize<f8e4m3>(ocp.q, ocp.s, back);
  for (float v : back) EXPECT_TRUE(std::isnan(v));
  // NaN without inf: TE scales from the finite values (amax 3: 3 * 2^-9 * 1.14 -> 2^-7,
  // factor 2^7, 3 -> 384); the NaN element stays NaN.
  auto y = block(kNaN, 0.0f);
  y[5] = 3.0f;
  const auto te2 = mx4(y, kTE);
  EXPECT_EQ(te2.s[0].exponent(), -7);
  EXPECT_EQ(decode(te2.q[5]), 384.0f);
  EXPECT_EQ(te2.q[0].bits(), 0x7F);
  EXPECT_EQ(mx4(y, kOCP).s[0].bits(), 0xFF);
}

TEST(Fp8Mx, SubnormalOnlyBlocks) {
  // fp32 subnormals only, amax 2^-130.
  // TE: 2^-130 * float(1/448) is an fp32 subnormal of at most 2^-127 -> code 0x00, and TE's
  //     exp2f_rcp(0) is 1, so the elements are cast unscaled: all become 0.
  // OCP: -130 - 8 = -138 -> clamped to -127 (code 0), factor 2^127: 2^-130 -> 0.125 exactly,
  //      and back: 0.125 * 2^-127 = 2^-130.
  auto x = block(0x1p-130f, 0x1p-131f);
  const auto te = mx4(x, kTE);
  EXPECT_EQ(te.s[0].bits(), 0x00);
  for (const auto& c : te.q) EXPECT_EQ(c.bits(), 0x00);
  const auto ocp = mx4(x, kOCP);
  EXPECT_EQ(ocp.s[0].bits(), 0x00);
  EXPECT_EQ(decode(ocp.q[0]), 0.125f);
  EXPECT_EQ(decode(ocp.q[1]), 0.0625f);
  std::vector<float> back(32);
  mx_dequantize<f8e4m3>(ocp.q, ocp.s, back);
  EXPECT_EQ(back[0], 0x1p-130f);
  EXPECT_EQ(back[1], 0x1p-131f);
}

TEST(Fp8Mx, E5M2Scales) {
  // amax 1: TE 1 * float(1/57344) = 1.14 * 2^-16 -> 2^-15; OCP 0 - 15 = -15. 1 -> 32768.
  std::vector<float> x = block(1.0f);
  for (auto r : {kTE, kOCP}) {
    std::vector<f8e5m2> q(32);
    std::vector<e8m0> s(1);
    mx_quantize<f8e5m2>(x, q, s, r);
    EXPECT_EQ(s[0].exponent(), -15);
    EXPECT_EQ(decode(q[0]), 32768.0f);
  }
}

TEST(Fp8Mx, PartialLastBlock) {
  std::vector<float> x(40, 1.0f);
  x[35] = 64.0f;  // second block (8 values): amax 64 -> TE and OCP 2^-2 (64/448 = 1.14 * 2^-3 -> up)
  const auto m = mx4(x, kTE);
  ASSERT_EQ(m.s.size(), 2u);
  EXPECT_EQ(m.s[0].exponent(), -8);  // amax 1: 1.14 * 2^-9 -> 2^-8
  EXPECT_EQ(m.s[1].exponent(), -2);
  EXPECT_EQ(decode(m.q[35]), 256.0f);
}

// Independent derivations of the two scale rules in double arithmetic, on random amaxes.
int te_exponent_by_log2(float amax, Element d) {
  const float v = amax * static_cast<float>(1.0 / static_cast<double>(max_finite(d)));
  const int e = static_cast<int>(std::ceil(std::log2(static_cast<double>(v))));  // smallest 2^e >= v
  return std::min(std::max(e, -127), 127);
}
int ocp_exponent_by_log2(float amax, Element d) {
  const int e = static_cast<int>(std::floor(std::log2(static_cast<double>(amax)))) - (d == Element::e4m3 ? 8 : 15);
  return std::max(e, -127);
}

TEST(Fp8Mx, ScaleRulesAgainstLog2AndNeverSaturate) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any(1, 0x7f7fffffu);  // positive finite
  for (int i = 0; i < 200000; ++i) {
    const float a = std::bit_cast<float>(any(rng));
    for (Element d : {Element::e4m3, Element::e5m2}) {
      const auto te = mx_scale(a, d, kTE);
      const float v = a * static_cast<float>(1.0 / static_cast<double>(max_finite(d)));
      if (v > 0x1p-127f && std::isfinite(v)) {
        ASSERT_EQ(te.exponent(), te_exponent_by_log2(a, d)) << a;
        // never saturates: amax * factor <= fp8_max (the product is the one the kernel casts)
        ASSERT_LE(a * mx_quantize_factor(te, kTE), max_finite(d) * (1.0f + 0x1p-23f)) << a;
      }
      ASSERT_EQ(mx_scale(a, d, kOCP).exponent(), ocp_exponent_by_log2(a, d)) << a;
      // OCP: amax / 2^e lies in [2^emax, 2^(emax+1)) unless clamped
      if (ocp_exponent_by_log2(a, d) > -127) {
        const float y = a * mx_quantize_factor(mx_scale(a, d, kOCP), kOCP);
        ASSERT_GE(y, d == Element::e4m3 ? 256.0f : 32768.0f);
        ASSERT_LT(y, d == Element::e4m3 ? 512.0f : 65536.0f);
      }
    }
  }
}

TEST(Fp8Mx, QuantizeIsEncodeOfTheScaledValue) {
  const auto x = edge_and_random(32 * 50 + 5, 11);
  for (auto r : {kTE, kOCP}) {
    const auto m = mx4(x, r);
    std::vector<float> back(x.size());
    mx_dequantize<f8e4m3>(m.q, m.s, back);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const e8m0 s = m.s[i / 32];
      const f8e4m3 want = s.bits() == 0xFF ? encode<f8e4m3>(kNaN)
                                           : encode<f8e4m3>(x[i] * mx_quantize_factor(s, r),
                                                            EncodeMode{Overflow::saturate, Subnormals::keep});
      ASSERT_EQ(m.q[i].bits(), want.bits()) << i;
      ASSERT_EQ(bits(back[i]), bits(decode(m.q[i]) * static_cast<float>(s))) << i;
    }
    EXPECT_SAME_FLOAT(m.amax, amax(x));
  }
}

}  // namespace
}  // namespace mixprec::lowp
