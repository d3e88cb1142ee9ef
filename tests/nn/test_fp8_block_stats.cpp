// The engine's per-block statistics at its sampled steps (Fp8Linears::set_sampled, which
// Model::set_histograms drives: the histogram steps): each tensor's blocks and kurtosis are
// lowp::block_stats and lowp::kurtosis of the quantization its counts come from (the step's
// last micro-batch), computed here from lowp::quantize with the plan's config; none at the
// steps that are not sampled.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "mixprec/lowp/block_stats.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/nn/model.hpp"
#include "nn/fp8_linear.hpp"

namespace mixprec::nn::detail {
namespace {

constexpr std::size_t kN = 32, kC = 64, kOC = 48;

std::vector<float> normal(std::size_t n, std::uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The engine's stochastic-rounding words of draw `draw` (splitmix64, as its random_words).
std::vector<std::uint32_t> engine_words(std::size_t n, std::uint64_t draw) {
  std::vector<std::uint32_t> w(n);
  lowp::random_words(0x5EEDull * 0x100000001B3ull + draw, w);
  return w;
}

// What the engine records of tensor values v [rows, cols] quantized by operand o of the plan.
lowp::BlockStats expected(const Fp8Linears& f, lowp::Operand o, const std::vector<float>& v, std::size_t rows,
                          std::size_t cols, std::uint64_t draw) {
  lowp::QuantizeConfig c = f.plan(0).config(o);
  if (c.recipe == lowp::Recipe::fp8_current || c.recipe == lowp::Recipe::fp8_delayed) c.layout = lowp::Layout::rowwise;
  std::vector<std::uint32_t> words;
  if (c.stochastic_rounding) words = engine_words(v.size(), draw);
  return lowp::block_stats(lowp::quantize(v, rows, cols, c, words), v);
}

TEST(Fp8LinearBlockStats, SampledStepsCarryTheRecordedQuantizationsBlocks) {
  const QuantizedGemms recipes[] = {{lowp::Recipe::mxfp8}, {lowp::Recipe::fp8_block}, {lowp::Recipe::nvfp4},
                                    {lowp::Recipe::fp8_current}};
  for (const QuantizedGemms& q : recipes) {
    const std::string name(lowp::recipe_name(q.recipe));
    Fp8Linears f(q, {});
    f.add("l", kN, kC, kOC);
    f.finish();
    Gemm g;
    std::vector<float> w = normal(kOC * kC, 2, 0.05f), b(kOC, 0.0f), y(kN * kOC);
    std::vector<float> dx(kN * kC), dw(kOC * kC), db(kOC);
    // Two micro-batches; the second's x holds a few outlier features (a heavy tail).
    std::vector<float> x1 = normal(kN * kC, 1, 1.0f), x2 = normal(kN * kC, 5, 1.0f);
    for (std::size_t n = 0; n < kN; ++n) x2[n * kC + 3] *= 200.0f;
    const std::vector<float> dy1 = normal(kN * kOC, 3, 1e-3f), dy2 = normal(kN * kOC, 4, 1e-3f);

    // Not sampled: counts, no statistics.
    f.reset_stats();
    f.forward(g, 0, y, x1, w, b, kN);
    f.backward(g, 0, dx, dw, db, dy1, w);
    for (const Fp8TensorStats& s : f.stats()) {
      EXPECT_GT(s.elements, 0u) << name << " " << s.name;
      EXPECT_FALSE(s.blocks.has_value()) << name << " " << s.name;
      EXPECT_FALSE(s.kurtosis.has_value()) << name << " " << s.name;
    }

    // Sampled: the statistics of the step's last micro-batch.
    f.reset_stats();
    f.set_sampled(true);
    const std::uint64_t first_draw = q.recipe == lowp::Recipe::nvfp4 ? 2 : 0;  // the unsampled step drew 0 and 1
    f.forward(g, 0, y, x1, w, b, kN);
    f.backward(g, 0, dx, dw, db, dy1, w);
    f.forward(g, 0, y, x2, w, b, kN);
    f.backward(g, 0, dx, dw, db, dy2, w);
    const std::span<const Fp8TensorStats> s = f.stats();
    ASSERT_EQ(s.size(), 3u);
    const lowp::BlockStats want[] = {expected(f, lowp::Operand::fprop_x, x2, kN, kC, 0),
                                     expected(f, lowp::Operand::fprop_w, w, kOC, kC, 0),
                                     expected(f, lowp::Operand::dgrad_dy, dy2, kN, kOC, first_draw + 2)};
    const double want_k[] = {lowp::kurtosis(x2), lowp::kurtosis(w), lowp::kurtosis(dy2)};
    for (std::size_t t = 0; t < 3; ++t) {
      ASSERT_TRUE(s[t].blocks.has_value()) << name << " " << s[t].name;
      EXPECT_EQ(*s[t].blocks, want[t]) << name << " " << s[t].name;
      ASSERT_TRUE(s[t].kurtosis.has_value()) << name << " " << s[t].name;
      EXPECT_EQ(*s[t].kurtosis, want_k[t]) << name << " " << s[t].name;
    }
    // The outlier feature is there to be seen: x's kurtosis far above a Gaussian's 3.
    EXPECT_GT(*s[0].kurtosis, 20.0) << name;
    if (q.recipe != lowp::Recipe::fp8_current) {
      EXPECT_GT(s[0].blocks->blocks, 1u) << name;
    }

    // The next step, not sampled: gone again.
    f.reset_stats();
    f.set_sampled(false);
    f.forward(g, 0, y, x1, w, b, kN);
    f.backward(g, 0, dx, dw, db, dy1, w);
    for (const Fp8TensorStats& st : f.stats()) EXPECT_FALSE(st.blocks.has_value() || st.kurtosis.has_value()) << name;
  }
}

// Model::set_histograms turns the sampling on and off for every quantized Linear.
TEST(Fp8LinearBlockStats, HistogramStepsOfTheModelAreItsSampledSteps) {
  ModelConfig c;
  c.kind = ModelKind::gpt;
  c.vocab = 23;
  c.context = 8;
  c.batch = 4;
  c.layers = 2;
  c.heads = 2;
  c.channels = 32;
  c.seed = 7;
  auto m = make_model(c, Precision::mxfp8, 0);
  std::mt19937 rng(11);
  std::vector<TokenId> in, tgt;
  for (std::size_t i = 0; i < c.batch * c.context; ++i) {
    in.push_back(static_cast<TokenId>(rng() % c.vocab));
    tgt.push_back(static_cast<TokenId>(rng() % c.vocab));
  }
  for (const bool sampled : {true, false, true}) {
    m->reset_stats();
    m->set_histograms(sampled);
    const ForwardResult r = m->forward(in, tgt);
    m->backward(1.0f / static_cast<float>(r.count));
    m->set_histograms(false);  // as the trainer does after reading the histograms
    ASSERT_EQ(m->fp8_stats().size(), 3u * 4 * c.layers);
    for (const Fp8TensorStats& t : m->fp8_stats()) {
      EXPECT_EQ(t.blocks.has_value(), sampled) << t.name;
      EXPECT_EQ(t.kurtosis.has_value(), sampled) << t.name;
      if (sampled) {
        EXPECT_EQ(t.blocks->flushed, t.flushed) << t.name;  // one micro-batch: the counts' quantization
        EXPECT_EQ(t.blocks->saturated, t.saturated) << t.name;
      }
    }
  }
}

}  // namespace
}  // namespace mixprec::nn::detail
