// Models under the precision policy: gradients against finite differences (fp32),
// low-precision paths against the fp32 path, exact loss-scale invariance, underflow
// counting, and no allocation per step.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <vector>

#include "mixprec/nn/model.hpp"

// The replacement operator new below uses malloc, so free is the matching release.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

// Records allocation sizes so a test can prove forward/backward allocate no buffers.
// (oneDNN 2.6 makes a few allocations of 32 to 104 bytes inside every execute, its
// argument map, freed before it returns: docs/gemm.md. Those are not ours.)
namespace {
std::atomic<long> g_allocations{0};
std::atomic<std::size_t> g_largest{0};
}
void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  std::size_t prev = g_largest.load(std::memory_order_relaxed);
  while (n > prev && !g_largest.compare_exchange_weak(prev, n)) {
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace mixprec::nn {
namespace {

ModelConfig small_gpt() {
  ModelConfig c;
  c.kind = ModelKind::gpt;
  c.vocab = 23;
  c.context = 8;
  c.batch = 3;
  c.layers = 2;
  c.heads = 2;
  c.channels = 16;
  c.seed = 7;
  return c;
}

ModelConfig small_mlp() {
  ModelConfig c;
  c.kind = ModelKind::mlp;
  c.vocab = 19;
  c.context = 4;
  c.batch = 5;
  c.channels = 6;
  c.depth = 3;
  c.hidden = 24;
  c.seed = 3;
  return c;
}

struct Batch {
  std::vector<TokenId> in, tgt;
};

Batch random_batch(const ModelConfig& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b;
  for (std::size_t i = 0; i < c.batch * c.context; ++i) {
    b.in.push_back(static_cast<TokenId>(rng() % c.vocab));
    b.tgt.push_back(static_cast<TokenId>(rng() % c.vocab));
  }
  return b;
}

double mean_loss(Model& m, const Batch& b) {
  const ForwardResult r = m.forward(b.in, b.tgt);
  return r.loss_sum / static_cast<double>(r.count);
}

// Weight gradients as fp32 (the store's grads, decoded).
std::vector<float> grads_f32(ParamStore& s) {
  std::vector<float> g(s.flat_size());
  if (s.grad_dtype() == DType::f32) std::memcpy(g.data(), s.grad_data(), g.size() * 4);
  else convert(std::span<const f16>(static_cast<const f16*>(s.grad_data()), g.size()), std::span<float>(g));
  return g;
}

// d(mean loss)/d(tensor) . d against a central difference along d over the whole
// tensor (fp32 model): tests the wiring of every parameter's gradient.
void check_directional_derivatives(const ModelConfig& cfg) {
  auto m = make_model(cfg, Precision::fp32, 0);
  const Batch b = random_batch(cfg, 11);
  ParamStore& s = m->params();
  s.zero_grads();
  const ForwardResult r = m->forward(b.in, b.tgt);
  m->backward(1.0f / static_cast<float>(r.count));
  const std::vector<float> g = grads_f32(s);
  std::mt19937 rng(5);
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    std::span<float> w = s.model<float>(t);
    std::vector<float> d(w.size()), w0(w.begin(), w.end());
    double analytic = 0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      d[i] = (rng() % 2 ? 1.0f : -1.0f);
      analytic += static_cast<double>(g[s.offset(t) + i]) * static_cast<double>(d[i]);
    }
    const float eps = 1e-3f;
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = w0[i] + eps * d[i];
    m->weights_updated();
    const double lp = mean_loss(*m, b);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = w0[i] - eps * d[i];
    m->weights_updated();
    const double lm = mean_loss(*m, b);
    std::copy(w0.begin(), w0.end(), w.begin());
    m->weights_updated();
    const double fd = (lp - lm) / (2.0 * static_cast<double>(eps));
    EXPECT_NEAR(fd, analytic, 2e-2 * std::abs(analytic) + 1e-3)
        << s.spec(t).name << ": finite difference " << fd << ", backward " << analytic;
  }
}

TEST(Model, GptGradientsMatchFiniteDifferences) { check_directional_derivatives(small_gpt()); }
TEST(Model, MlpGradientsMatchFiniteDifferences) { check_directional_derivatives(small_mlp()); }

// Loss-scale invariance: scaling dloss by a power of two scales every fp32 weight
// gradient by exactly that power (no rounding differs) in the fp32 model.
TEST(Model, PowerOfTwoLossScaleIsExactInFp32) {
  for (const ModelConfig& cfg : {small_gpt(), small_mlp()}) {
    auto m = make_model(cfg, Precision::fp32, 0);
    const Batch b = random_batch(cfg, 2);
    ParamStore& s = m->params();
    s.zero_grads();
    m->forward(b.in, b.tgt);
    m->backward(1.0f / 64.0f);
    const std::vector<float> g1 = grads_f32(s);
    s.zero_grads();
    m->forward(b.in, b.tgt);
    m->backward(1024.0f / 64.0f);
    const std::vector<float> g2 = grads_f32(s);
    for (std::size_t i = 0; i < g1.size(); ++i) {
      ASSERT_EQ(g1[i] * 1024.0f, g2[i]) << model_kind_name(cfg.kind) << " element " << i;
    }
  }
}

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ab += double(a[i]) * double(b[i]);
    aa += double(a[i]) * double(a[i]);
    bb += double(b[i]) * double(b[i]);
  }
  return ab / std::sqrt(aa * bb);
}

// The low-precision paths compute the same function up to rounding at op boundaries:
// loss within a per-format tolerance of fp32, weight gradients nearly parallel.
TEST(Model, LowPrecisionTracksFp32) {
  struct Case {
    Precision p;
    double loss_rel, min_cosine;
  };
  for (const ModelConfig& cfg : {small_gpt(), small_mlp()}) {
    const Batch b = random_batch(cfg, 9);
    auto ref = make_model(cfg, Precision::fp32, 0);
    ref->params().zero_grads();
    const double l32 = mean_loss(*ref, b);
    ref->backward(1.0f / static_cast<float>(ref->losses_per_batch()));
    const std::vector<float> g32 = grads_f32(ref->params());
    for (Case c : {Case{Precision::fp16, 2e-3, 0.999}, Case{Precision::bf16, 2e-2, 0.99},
                   Case{Precision::fp16_pure, 2e-3, 0.999}}) {
      auto m = make_model(cfg, c.p, 0);
      m->params().zero_grads();
      const double l = mean_loss(*m, b);
      EXPECT_NEAR(l, l32, c.loss_rel * l32) << model_kind_name(cfg.kind) << " " << precision_name(c.p);
      // A loss scale keeps fp16 gradients out of the subnormal range; undo it.
      const float scale = 1024.0f;
      m->backward(scale / static_cast<float>(m->losses_per_batch()));
      std::vector<float> g = grads_f32(m->params());
      for (float& x : g) x /= scale;
      EXPECT_GT(cosine(g, g32), c.min_cosine) << model_kind_name(cfg.kind) << " " << precision_name(c.p);
    }
  }
}

// fp16 activation gradients underflow when unscaled and tiny; a scale rescues them.
TEST(Model, Fp16UnderflowIsCountedAndScalingRemovesIt) {
  ModelConfig cfg = small_gpt();
  auto m = make_model(cfg, Precision::fp16, 0);
  const Batch b = random_batch(cfg, 4);
  m->forward(b.in, b.tgt);
  m->reset_stats();
  m->backward(1.0f / 65536.0f);  // e.g. a loss averaged over 64k tokens
  const ConversionStats tiny = m->stats().activation_grads;
  m->reset_stats();
  m->backward(1.0f);
  const ConversionStats scaled = m->stats().activation_grads;
  EXPECT_GT(tiny.underflow, 0u);
  EXPECT_GT(tiny.underflow, 10 * scaled.underflow);
  EXPECT_EQ(tiny.elements, scaled.elements);
  EXPECT_GT(m->stats().stores, 0u);
  // fp32 stores nothing lossy.
  auto f = make_model(cfg, Precision::fp32, 0);
  f->forward(b.in, b.tgt);
  f->backward(1.0f / 65536.0f);
  EXPECT_EQ(f->stats().activation_grads.underflow, 0u);
}

// Overflowing activation gradients are reported with the tensor they first hit.
TEST(Model, Fp16OverflowNamesTheFirstTensor) {
  ModelConfig cfg = small_gpt();
  auto m = make_model(cfg, Precision::fp16, 0);
  const Batch b = random_batch(cfg, 4);
  m->forward(b.in, b.tgt);
  m->backward(1e9f);  // logit gradients up to 1e9 > 65504
  EXPECT_EQ(m->stats().first_overflow, "logits.grad");
  EXPECT_GT(m->stats().activation_grads.overflow, 0u);
}

// Stored activations are really half the bytes in fp16/bf16.
TEST(Model, LowPrecisionHalvesActivationMemory) {
  const ModelConfig cfg = small_gpt();
  const ModelMemory f32 = make_model(cfg, Precision::fp32, 2)->memory();
  const ModelMemory f16 = make_model(cfg, Precision::fp16, 2)->memory();
  EXPECT_LT(f16.activation_bytes, f32.activation_bytes * 7 / 10);  // fp32 softmax and statistics stay
  EXPECT_EQ(f16.gradient_bytes * 2, f32.gradient_bytes);
}

// No buffer is allocated per step: the only heap allocations during a warm forward +
// backward are oneDNN's small per-execute ones (under 1 KiB; the model's smallest
// activation buffer here is 16 KiB), and their number does not change step to step.
TEST(Model, ForwardAndBackwardAllocateNoBuffers) {
  for (Precision p : {Precision::fp32, Precision::fp16, Precision::bf16, Precision::fp16_pure, Precision::fp8_noscale,
                      Precision::fp8_delayed, Precision::fp8_current, Precision::mxfp8}) {
    ModelConfig g = small_gpt();
    g.batch = 8;
    g.context = 32;
    g.channels = 32;
    ModelConfig m = small_mlp();
    m.batch = 64;
    m.hidden = 128;
    for (const ModelConfig& cfg : {g, m}) {
      auto model = make_model(cfg, p, 2);
      const Batch b = random_batch(cfg, 1);
      long counts[3] = {};
      for (long& count : counts) {
        g_largest = 0;
        const long before = g_allocations.load();
        model->params().zero_grads();
        model->forward(b.in, b.tgt);
        model->backward(1.0f);
        model->fp8_step_done();
        model->reset_stats();
        model->weights_updated();
        count = g_allocations.load() - before;
      }
      EXPECT_EQ(counts[1], counts[2]) << model_kind_name(cfg.kind) << " " << precision_name(p);
      EXPECT_LT(g_largest.load(), 1024u) << model_kind_name(cfg.kind) << " " << precision_name(p);
    }
  }
}

// Weight gradients of a model as fp32.
std::vector<float> grads_after_step(Model& m, const Batch& b) {
  m.params().zero_grads();
  m.reset_stats();
  const ForwardResult r = m.forward(b.in, b.tgt);
  m.backward(1.0f / static_cast<float>(r.count));
  m.fp8_step_done();
  return grads_f32(m.params());
}


// The scaled fp8 presets compute weight gradients close to the bf16 preset's (every
// Linear of the blocks quantized; delayed scaling after one step has set its scales),
// and count what they quantize.
TEST(Model, Fp8GradientsTrackBf16) {
  for (const ModelConfig& cfg : {small_gpt(), small_mlp()}) {
    const Batch b = random_batch(cfg, 21);
    auto ref = make_model(cfg, Precision::bf16, 0);
    const std::vector<float> g_bf16 = grads_after_step(*ref, b);
    for (Precision p : {Precision::fp8_delayed, Precision::fp8_current, Precision::mxfp8}) {
      auto m = make_model(cfg, p, 0);
      (void)grads_after_step(*m, b);  // delayed scaling: the first step sets the scales
      const std::vector<float> g = grads_after_step(*m, b);
      EXPECT_GT(cosine(g, g_bf16), 0.99) << model_kind_name(cfg.kind) << " " << precision_name(p);
      const std::span<const Fp8TensorStats> s = m->fp8_stats();
      const std::size_t linears = cfg.kind == ModelKind::gpt ? 4 * cfg.layers : cfg.depth;
      ASSERT_EQ(s.size(), 3 * linears);
      for (const Fp8TensorStats& t : s) {
        EXPECT_GT(t.elements, 0u) << t.name;
        EXPECT_EQ(t.dtype, t.role == fp8::Role::backward ? fp8::Dtype::e5m2 : fp8::Dtype::e4m3) << t.name;
        // Scaled: next to nothing is flushed or saturated.
        EXPECT_LE(t.flushed, t.nonzero / 50) << precision_name(p) << " " << t.name;
        EXPECT_LE(t.saturated, t.nonzero / 1000 + 1) << precision_name(p) << " " << t.name;
      }
    }
  }
}

// Without scaling, E5M2's smallest subnormal (2^-16) is above most output gradients of a
// mean loss over the default task's effective batch (accum 32 x 16 x 64 = 32768 tokens,
// so each token's loss gradient is 2^-15): most of them flush to zero, and the counts
// say so.
TEST(Model, Fp8WithoutScalingFlushesMostGradients) {
  ModelConfig cfg = small_gpt();
  cfg.batch = 8;
  cfg.context = 16;
  auto m = make_model(cfg, Precision::fp8_noscale, 0);
  const Batch b = random_batch(cfg, 3);
  m->reset_stats();
  m->forward(b.in, b.tgt);
  m->backward(1.0f / 32768);
  std::uint64_t nonzero = 0, flushed = 0;
  for (const Fp8TensorStats& t : m->fp8_stats()) {
    EXPECT_EQ(t.scale, 1.0f) << t.name;
    if (t.role != fp8::Role::backward) continue;
    nonzero += t.nonzero;
    flushed += t.flushed;
  }
  EXPECT_GT(nonzero, 0u);
  EXPECT_GT(static_cast<double>(flushed), 0.5 * static_cast<double>(nonzero)) << flushed << " of " << nonzero;
  // Non-fp8 presets report no fp8 tensors.
  EXPECT_TRUE(make_model(cfg, Precision::bf16, 0)->fp8_stats().empty());
  EXPECT_EQ(make_model(cfg, Precision::bf16, 0)->fp8_delayed(), nullptr);
}

TEST(Model, RejectsBadConfigsAndBatches) {
  ModelConfig c = small_gpt();
  c.heads = 3;
  EXPECT_THROW(make_model(c, Precision::fp32, 0), std::invalid_argument);
  c = small_gpt();
  c.vocab = 1;
  EXPECT_THROW(make_model(c, Precision::fp32, 0), std::invalid_argument);
  auto m = make_model(small_gpt(), Precision::fp16, 0);
  Batch b = random_batch(small_gpt(), 1);
  b.in[3] = 23;  // == vocab
  EXPECT_THROW(m->forward(b.in, b.tgt), std::invalid_argument);
  b = random_batch(small_gpt(), 1);
  EXPECT_THROW(m->forward(b.in, b.tgt, 4), std::invalid_argument);
  m->forward(b.in, b.tgt, 2);
  EXPECT_THROW(m->backward(1.0f), std::logic_error);  // backward needs a full batch
}

// Forward overflow (a non-finite activation) is detected and located.
TEST(Model, NonFiniteForwardIsLocated) {
  auto m = make_model(small_gpt(), Precision::fp16, 0);
  ParamStore& s = m->params();
  s.master("h1.mlp.fc.weight")[0] = 1e6f;  // fc output overflows fp16
  s.refresh_model();
  m->weights_updated();
  const Batch b = random_batch(small_gpt(), 1);
  const ForwardResult r = m->forward(b.in, b.tgt);
  EXPECT_FALSE(r.finite);
  EXPECT_EQ(r.first_nonfinite, "h1.mlp.fc");
}

}  // namespace
}  // namespace mixprec::nn

namespace mixprec::nn {
namespace {

// amax_of (SSE2 lanes) equals the plain loop at every length and position, skips NaN,
// and returns inf when an inf is present.
TEST(Telemetry, AmaxMatchesTheScalarDefinition) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  for (std::size_t n : {0u, 1u, 3u, 15u, 16u, 17u, 33u, 100u, 1000u}) {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    for (std::size_t pos = 0; pos < n; pos += 7) {
      std::vector<float> w = v;
      w[pos] = -1e4f;
      if (pos + 1 < n) w[pos + 1] = std::numeric_limits<float>::quiet_NaN();
      float ref = 0;
      for (float x : w) ref = std::isnan(x) ? ref : std::max(ref, std::fabs(x));
      EXPECT_EQ(amax_of(w), ref) << "n " << n << " pos " << pos;
      w[pos] = -std::numeric_limits<float>::infinity();
      EXPECT_EQ(amax_of(w), std::numeric_limits<float>::infinity()) << "n " << n << " pos " << pos;
    }
  }
  EXPECT_EQ(amax_of({}), 0.0f);
}

TEST(Telemetry, Log2HistogramBinsByExponent) {
  Log2Histogram h;
  const float values[] = {0.0f, -0.0f, 1.0f, 1.5f, -2.0f, 0.75f, 1e-45f, 3e38f, INFINITY, NAN, 1e-30f};
  h.add(values);
  EXPECT_EQ(h.zeros, 2u);
  EXPECT_EQ(h.nonfinite, 2u);
  auto bin = [&](int e) { return h.counts[static_cast<std::size_t>(e - Log2Histogram::kMinExp)]; };
  EXPECT_EQ(bin(0), 2u);   // 1, 1.5
  EXPECT_EQ(bin(1), 1u);   // -2
  EXPECT_EQ(bin(-1), 1u);  // 0.75
  EXPECT_EQ(bin(Log2Histogram::kMinExp), 2u);  // 2^-149 and 1e-30 ~ 2^-100: clamped into the first bin
  EXPECT_EQ(bin(Log2Histogram::kMaxExp), 1u);  // 3e38 ~ 2^127: clamped into the last bin
  EXPECT_EQ(h.total(), 11u);
}

// Per-tensor statistics add up to the step's totals, and histograms see every store.
TEST(Telemetry, PerTensorStatisticsSumToTheTotals) {
  auto m = make_model(small_gpt(), Precision::fp16, 0);
  const Batch b = random_batch(small_gpt(), 4);
  m->set_histograms(true);
  m->forward(b.in, b.tgt);
  m->reset_stats();
  m->backward(1.0f / 4096.0f);
  ConversionStats sum;
  float amax = 0;
  for (const TensorGradStats& t : m->stats().tensors) {
    sum += t.stats;
    amax = std::max(amax, t.amax);
    EXPECT_FALSE(t.name.empty());
  }
  EXPECT_EQ(sum, m->stats().activation_grads);
  EXPECT_EQ(amax, m->stats().amax);
  EXPECT_GT(amax, 0.0f);
  EXPECT_EQ(m->stats().tensors.size(), 3u + 8u * small_gpt().layers);
  // Sampled: every kHistogramStride-th value of each store.
  EXPECT_GE(m->histograms().activation_grads.total(), sum.elements / kHistogramStride);
  EXPECT_LE(m->histograms().activation_grads.total(), sum.elements / kHistogramStride + m->stats().stores);
  EXPECT_GT(m->histograms().activations.total(), 0u);
}

}  // namespace
}  // namespace mixprec::nn
