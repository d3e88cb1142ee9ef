// The engine's fused passes (Engine::run_stages: each op and the commit of its output, block
// by block) against the unfused sequence they are defined by (the op over the whole tensor,
// then the commit): the same losses, weight gradients and activation-gradient counts, bit
// for bit, in every precision preset, on one thread and split over two, with blocks that
// end inside the tensor and an overflowing step.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mixprec/nn/model.hpp"
#include "nn/engine.hpp"

namespace mixprec::nn {
namespace {

struct Outcome {
  std::vector<double> loss_sums;
  std::vector<std::byte> grads;
  BackwardStats stats;
};

// Two micro-batches (gradients accumulate), each forward + backward with dloss.
Outcome train(const ModelConfig& cfg, Precision p, float dloss, bool fused) {
  detail::set_fused_passes(fused);
  auto m = make_model(cfg, p, 2);
  m->params().zero_grads();
  m->reset_stats();
  Outcome o;
  std::mt19937 rng(17);
  for (int mb = 0; mb < 2; ++mb) {
    std::vector<TokenId> in(cfg.batch * cfg.context), tgt(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      in[i] = static_cast<TokenId>(rng() % cfg.vocab);
      tgt[i] = static_cast<TokenId>(rng() % cfg.vocab);
    }
    o.loss_sums.push_back(m->forward(in, tgt).loss_sum);
    m->backward(dloss);
  }
  const ParamStore& s = m->params();
  const auto* g = static_cast<const std::byte*>(s.grad_data());
  o.grads.assign(g, g + s.flat_size() * dtype_size(s.grad_dtype()));
  o.stats = m->stats();
  detail::set_fused_passes(true);
  return o;
}

void expect_same_counts(const ConversionStats& a, const ConversionStats& b, const std::string& what) {
  EXPECT_EQ(a.elements, b.elements) << what;
  EXPECT_EQ(a.nonzero, b.nonzero) << what;
  EXPECT_EQ(a.nonfinite_input, b.nonfinite_input) << what;
  EXPECT_EQ(a.underflow, b.underflow) << what;
  EXPECT_EQ(a.subnormal, b.subnormal) << what;
  EXPECT_EQ(a.overflow, b.overflow) << what;
}

void expect_same(const Outcome& fused, const Outcome& plain, const std::string& what) {
  ASSERT_EQ(fused.loss_sums.size(), plain.loss_sums.size());
  for (std::size_t i = 0; i < fused.loss_sums.size(); ++i) {
    EXPECT_EQ(std::memcmp(&fused.loss_sums[i], &plain.loss_sums[i], sizeof(double)), 0)
        << what << ": micro-batch " << i << " loss sum " << fused.loss_sums[i] << " fused, " << plain.loss_sums[i]
        << " unfused";
  }
  ASSERT_EQ(fused.grads.size(), plain.grads.size());
  std::size_t first = fused.grads.size();
  for (std::size_t i = 0; i < fused.grads.size() && first == fused.grads.size(); ++i)
    if (fused.grads[i] != plain.grads[i]) first = i;
  EXPECT_EQ(first, fused.grads.size()) << what << ": weight gradients differ from byte " << first;
  const BackwardStats &a = fused.stats, &b = plain.stats;
  expect_same_counts(a.activation_grads, b.activation_grads, what + ": all activation gradients");
  EXPECT_EQ(a.stores, b.stores) << what;
  EXPECT_EQ(a.first_overflow, b.first_overflow) << what;
  EXPECT_EQ(std::memcmp(&a.amax, &b.amax, sizeof(float)), 0) << what << ": amax " << a.amax << " / " << b.amax;
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (std::size_t t = 0; t < a.tensors.size(); ++t) {
    const std::string name = what + ": " + a.tensors[t].name;
    expect_same_counts(a.tensors[t].stats, b.tensors[t].stats, name);
    EXPECT_EQ(std::memcmp(&a.tensors[t].amax, &b.tensors[t].amax, sizeof(float)), 0)
        << name << ": amax " << a.tensors[t].amax << " / " << b.tensors[t].amax;
  }
}

// N = 512 rows of 128 channels: every stage splits over two threads (>= 64 Ki elements);
// blocks of 32 rows (4C), 128 (C) and 168 (the logits, the last block partial).
ModelConfig wide_gpt() {
  ModelConfig c;
  c.kind = ModelKind::gpt;
  c.vocab = 97;
  c.context = 32;
  c.batch = 16;
  c.layers = 2;
  c.heads = 4;
  c.channels = 128;
  c.seed = 5;
  return c;
}

// N = 117 rows of 48 channels: blocks of 85 rows (4C), the second partial.
ModelConfig odd_gpt() {
  ModelConfig c;
  c.kind = ModelKind::gpt;
  c.vocab = 31;
  c.context = 13;
  c.batch = 9;
  c.layers = 2;
  c.heads = 3;
  c.channels = 48;
  c.seed = 9;
  return c;
}

const Precision kPresets[] = {Precision::fp32, Precision::fp16, Precision::bf16, Precision::fp16_pure,
                              Precision::fp8_current};

TEST(EngineFusion, FusedPassesEqualTheUnfusedSequence) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const ModelConfig& cfg : {wide_gpt(), odd_gpt()}) {
      for (Precision p : kPresets) {
        const std::string what = std::string(precision_name(p)) + ", C=" + std::to_string(cfg.channels) + ", " +
                                 std::to_string(threads) + " thread(s)";
        expect_same(train(cfg, p, 1.0f / 512, true), train(cfg, p, 1.0f / 512, false), what);
      }
    }
  }
  omp_set_num_threads(saved);
}

// Overflowing gradients: the same counts, amaxes (inf) and first overflowing tensor.
TEST(EngineFusion, OverflowIsCountedAsUnfused) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  for (Precision p : {Precision::fp16, Precision::fp16_pure}) {
    const Outcome fused = train(wide_gpt(), p, 1e9f, true), plain = train(wide_gpt(), p, 1e9f, false);
    ASSERT_GT(plain.stats.activation_grads.overflow, 0u);
    EXPECT_EQ(plain.stats.first_overflow, "logits.grad");
    expect_same(fused, plain, std::string(precision_name(p)) + " overflowing");
  }
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace mixprec::nn
