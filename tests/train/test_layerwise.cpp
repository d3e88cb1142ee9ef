// Per-layer loss scaling in the engine (preset layerwise): the models' backward against the
// unscaled one (bitwise where nothing underflows), and the training loop: a layer's own
// overflow skips that layer only, the base scale stays, the skipped tensors keep their
// weights and optimizer state, and with every factor 1 the run equals one scale bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/nn/model.hpp"
#include "mixprec/scaler/layerwise.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec {
namespace {

nn::ModelConfig model_config(nn::ModelKind kind) {
  nn::ModelConfig c;
  c.kind = kind;
  c.vocab = 64;
  c.context = 8;
  c.batch = 4;
  c.layers = 2;
  c.heads = 2;
  c.channels = 16;
  c.depth = 3;
  c.hidden = 32;
  return c;
}

struct Batch {
  std::vector<nn::TokenId> inputs, targets;
};

Batch batch_for(const nn::Model& m) {
  std::mt19937 rng(5);
  Batch b;
  for (std::size_t i = 0; i < m.tokens_per_batch(); ++i) {
    b.inputs.push_back(static_cast<nn::TokenId>(rng() % m.config().vocab));
    b.targets.push_back(static_cast<nn::TokenId>(rng() % m.config().vocab));
  }
  return b;
}

std::vector<float> grads_of(nn::Model& m) {
  const float* g = static_cast<const float*>(m.params().grad_data());
  return {g, g + m.params().flat_size()};
}

// One backward at loss scale `scale`, per-layer scaling on or off: the gradients brought to the
// base scale (each tensor divided by its factor, exact), the largest factor and the flushed count.
struct Pass {
  std::vector<float> grads;
  double max_factor = 1;
  std::uint64_t flushed = 0;
};

Pass one_pass(nn::Model& m, const Batch& b, float scale, LayerwiseScales* scales) {
  m.reset_stats();
  m.params().zero_grads();
  m.set_layer_scales(scales, true);
  (void)m.forward(b.inputs, b.targets);
  m.backward(scale / static_cast<float>(m.losses_per_batch()));
  Pass p;
  p.grads = grads_of(m);
  const ParamStore& s = m.params();
  if (scales != nullptr) {
    const std::span<const double> f = m.grad_factors();
    for (std::size_t t = 0; t < s.tensor_count(); ++t) {
      p.max_factor = std::max(p.max_factor, f[t]);
      for (std::size_t i = 0; i < s.numel(t); ++i) p.grads[s.offset(t) + i] *= static_cast<float>(1.0 / f[t]);
    }
  }
  p.flushed = m.stats().activation_grads.underflow;
  m.set_layer_scales(nullptr, false);
  return p;
}

void expect_bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], 4) != 0;
  EXPECT_EQ(differ, 0u) << "of " << a.size() << " gradient values";
}

class ModelKinds : public ::testing::TestWithParam<nn::ModelKind> {};

// fp32 holds every scaled value exactly (no underflow, no overflow): whatever factors the rule
// picks, the gradients brought back to the base scale equal the unscaled backward's bit for bit.
// At loss scale 2^-16 the gradients are small enough for the rule to pick factors above 1, so
// the scaling, the chains and the merges at the residual stream all run.
TEST_P(ModelKinds, Fp32BackwardEqualsOneScaleBitwise) {
  auto m = nn::make_model(model_config(GetParam()), nn::Precision::fp32, 0);
  const Batch b = batch_for(*m);
  LayerwiseScales scales;
  const Pass plain = one_pass(*m, b, 0x1p-16f, nullptr);
  const Pass layered = one_pass(*m, b, 0x1p-16f, &scales);
  EXPECT_GE(layered.max_factor, 16.0) << "the rule picked no factor above 1: the test would prove nothing";
  expect_bitwise(layered.grads, plain.grads);
  EXPECT_EQ(scales.layer_count(), m->scaled_layers().size());
}

// fp16 at a scale where the rule gives every layer factor 1 (loss scale 1 here: at 2^16 the
// MLP's head gets a factor below 1 from the overflow bound): the same backward, bit for bit.
TEST_P(ModelKinds, Fp16EveryFactorOneEqualsOneScaleBitwise) {
  auto m = nn::make_model(model_config(GetParam()), nn::Precision::fp16, 0);
  const Batch b = batch_for(*m);
  LayerwiseScales scales;
  const Pass plain = one_pass(*m, b, 1.0f, nullptr);
  const Pass layered = one_pass(*m, b, 1.0f, &scales);
  for (std::size_t i = 0; i < scales.layer_count(); ++i) ASSERT_EQ(scales.layer(i).factor, 1.0) << scales.layer(i).name;
  expect_bitwise(layered.grads, plain.grads);
}

// fp16 at loss scale 2^-12: activation gradients flush; the factors rescue some of them.
TEST_P(ModelKinds, Fp16FactorsFlushLess) {
  auto m = nn::make_model(model_config(GetParam()), nn::Precision::fp16, 0);
  const Batch b = batch_for(*m);
  LayerwiseScales scales;
  const Pass plain = one_pass(*m, b, 0x1p-12f, nullptr);
  const Pass layered = one_pass(*m, b, 0x1p-12f, &scales);
  EXPECT_GT(layered.max_factor, 1.0);
  EXPECT_GT(plain.flushed, 0u);
  EXPECT_LT(layered.flushed, plain.flushed);
}

INSTANTIATE_TEST_SUITE_P(Layerwise, ModelKinds, ::testing::Values(nn::ModelKind::gpt, nn::ModelKind::mlp),
                         [](const auto& p) { return std::string(nn::model_kind_name(p.param)); });

train::TrainConfig tiny(std::string scale) {
  train::TrainConfig c;
  c.precision = nn::Precision::fp16;
  c.loss_scale = std::move(scale);
  c.model.layers = 2;
  c.model.heads = 2;
  c.model.channels = 16;
  c.model.context = 16;
  c.model.batch = 4;
  c.accum = 2;
  c.steps = 8;
  c.warmup = 2;
  c.corpus_tokens = 20000;
  c.vocab = "word:256";
  c.eval_every = 0;
  c.eval_windows = 8;
  return c;
}

std::vector<std::byte> bytes(const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  return {b, b + n};
}

struct State {
  std::vector<std::byte> master, model, m0, m1;
  bool operator==(const State&) const = default;
};

State state_of(train::Trainer& t) {
  ParamStore& s = t.model().params();
  return {bytes(s.master_data(), s.flat_size() * 4), bytes(s.model_data(), s.flat_size() * 2),
          bytes(s.state_data(0), s.flat_size() * 4), bytes(s.state_data(1), s.flat_size() * 4)};
}

// Nothing overflows and the base scale keeps every factor at 1: the run is global scaling's.
TEST(LayerwiseTrainer, EveryFactorOneEqualsDynamicBitwise) {
  train::Trainer a(tiny("dynamic")), b(tiny("layerwise"));
  while (!a.done()) {
    const train::StepRecord ra = a.train_step();
    const train::StepRecord rb = b.train_step();
    ASSERT_EQ(rb.layers.size(), 8u);
    for (const auto& l : rb.layers) {
      ASSERT_EQ(l.factor, 1.0) << l.name << " step " << rb.step;
      EXPECT_EQ(l.outcome, "applied");
    }
    EXPECT_EQ(ra.loss, rb.loss);
    EXPECT_EQ(ra.next_scale, rb.next_scale);
    EXPECT_TRUE(ra.layers.empty());
  }
  EXPECT_TRUE(state_of(a) == state_of(b));
}

// An overflow injected into one layer's weight gradient: global scaling skips the step and
// halves its scale; layerwise skips that layer's update only (its weights and moments stay,
// bitwise), backs it off, and keeps the base scale, so that fewer activation gradients flush.
TEST(LayerwiseTrainer, OneLayersOverflowSkipsThatLayerOnly) {
  train::TrainConfig c = tiny("layerwise");
  c.steps = 12;
  c.inject_overflow_at = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  c.inject_overflow_tensor = "h1.mlp.fc.weight";
  train::TrainConfig g = c;
  g.loss_scale = "dynamic";
  train::Trainer lw(c), global(g);
  ParamStore& s = lw.model().params();
  const std::size_t w = s.index_of("h1.mlp.fc.weight"), bias = s.index_of("h1.mlp.fc.bias");
  const std::size_t other = s.index_of("h0.mlp.fc.weight");
  auto tensor = [&](const float* base, std::size_t t) { return bytes(base + s.offset(t), s.numel(t) * 4); };
  std::int64_t backoff = 0;
  while (!lw.done()) {
    const auto before_w = tensor(s.master_data(), w), before_b = tensor(s.master_data(), bias);
    const auto before_m = tensor(s.state_data(0), w), before_o = tensor(s.master_data(), other);
    const train::StepRecord r = lw.train_step();
    const train::StepRecord rg = global.train_step();
    const bool injected = r.step >= 2 && r.step <= 11;
    EXPECT_EQ(rg.skipped, injected) << "step " << r.step;
    EXPECT_FALSE(r.skipped) << "step " << r.step;
    EXPECT_FALSE(r.found_inf) << "step " << r.step;
    EXPECT_EQ(r.next_scale, r.scale) << "step " << r.step;  // the base scale never backs off
    for (const auto& l : r.layers) {
      const bool hit = injected && l.name == "h1.mlp.fc";
      EXPECT_EQ(l.outcome, hit ? "origin" : "applied") << l.name << " step " << r.step;
      if (l.name == "h1.mlp.fc") {
        EXPECT_EQ(l.backoff, backoff) << "step " << r.step;
        backoff += hit;
      }
    }
    EXPECT_EQ(tensor(s.master_data(), w) == before_w, injected) << "step " << r.step;
    EXPECT_EQ(tensor(s.master_data(), bias) == before_b, injected) << "step " << r.step;
    EXPECT_EQ(tensor(s.state_data(0), w) == before_m, injected) << "step " << r.step;
    EXPECT_NE(tensor(s.master_data(), other), before_o) << "step " << r.step;
  }
  EXPECT_EQ(backoff, 10);
  EXPECT_EQ(lw.summary().skipped, 0u);
  EXPECT_EQ(global.summary().skipped, 10u);
  EXPECT_EQ(global.summary().final_scale, 64.0f);
  EXPECT_EQ(lw.summary().final_scale, 65536.0f);
  EXPECT_LT(lw.summary().underflow_fraction, global.summary().underflow_fraction);
  // The state carries the layer's backoff.
  EXPECT_NE(lw.scaler().state_json().find("\"backoff\":10"), std::string::npos) << lw.scaler().state_json();
}

// An overflow no layer explains (the embedding's gradient): one scale's behaviour.
TEST(LayerwiseTrainer, AnOverflowOutsideTheLayersSkipsTheStep) {
  train::TrainConfig c = tiny("layerwise");
  c.inject_overflow_at = {2};
  c.steps = 3;
  train::Trainer t(c);
  (void)t.train_step();
  const train::StepRecord r = t.train_step();
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.overflow_param, "wte");
  EXPECT_EQ(r.next_scale, r.scale / 2);
  for (const auto& l : r.layers) EXPECT_EQ(l.outcome, "applied") << l.name;
}

TEST(LayerwiseTrainer, RefusesWhatItCannotScale) {
  auto refuse = [](train::TrainConfig c, const char* says) {
    try {
      train::Trainer t(c);
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  train::TrainConfig c = tiny("layerwise");
  c.precision = nn::Precision::bf16;
  refuse(c, "loss-scale layerwise: expected precision fp16 or fp32, found bf16");
  c.precision = nn::Precision::fp16_pure;
  refuse(c, "found fp16-pure");
  c = tiny("dynamic");
  c.inject_overflow_tensor = "h9.nothing";
  refuse(c, "h9.nothing");
}

}  // namespace
}  // namespace mixprec
