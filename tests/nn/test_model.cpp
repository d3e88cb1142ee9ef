// Models under the precision policy: gradients against finite differences (fp32) and,
// tensor by tensor, against an independent double-precision model, low-precision
// paths against the fp32 path, exact loss-scale invariance, underflow counting, and
// no allocation per step.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
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
// The nothrow forms too (std::stable_sort's temporary buffer): every form allocates with malloc
// and frees with free, so no pair mixes this file's operators with the runtime's.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }

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

// ---- every parameter's gradient against an independent double-precision model ----
//
// The fp32 check above cannot see a misrouted gradient of a small tensor: its fp32
// finite differences need an absolute floor (1e-3) larger than the directional
// derivatives of layer-norm gains and biases at the library's initialisation (~1e-4),
// so e.g. ln1's weight gradient written into ln2's slot passes it (and so do a wrong
// sign or index in attention's backward). Here the forward of
// each model is transcribed again, in double, from the architecture (not from the
// library's code: no layer function, Gemm or helper of the library is called), and
// reads the model's fp32 weights. Its loss must equal the library's fp32 loss to 1e-6
// relative (a check of the forward too). Then, per tensor, 3 random Gaussian
// directions d (unit norm) restricted to that tensor: the double loss's derivative
// along d by the 4-point central stencil, step h = 1e-3 (truncation ~h^4/30 |f^(5)| ~
// 1e-14, round-off ~1e-16 |L| / h ~ 1e-12: exact to ~1e-11 absolute), against
// <fp32 backward gradient, d>. Tolerance per tensor and direction, relative:
//   |found - expected| <= 1e-4 |expected| + 64 u sum_i |g_i d_i|,  u = 2^-24.
// The fp32 backward's own error, measured: at most ~1e-5 of |expected| wherever the
// sum does not cancel, and error/tolerance <= 0.02 everywhere (a 50x margin; the test
// prints both per model). The floor is 64 fp32 ulps of the tensor's own gradient
// magnitude along d: it only matters for a direction along which sum_i g_i d_i cancels
// (e.g. the mlp's wte at initialisation, |<g,d>| 1.5e4 times below sum_i |g_i d_i|),
// where the fp32 gradient's rounding is of that order; it is never a fixed absolute
// number that a small tensor's derivative can hide under. A misrouted, dropped or
// mis-signed gradient is an O(1) relative error of some tensor's derivative; even
// GELU's derivative with 0.04 for 0.044715 moves derivatives by 2e-4 to 6e-3 relative.
// Each model is checked at the library's initialisation and at random O(1) weights
// (layer-norm gains 1 + 0.3 N(0,1), every bias 0.3 N(0,1), matrices N(0, 1/fan_in)):
// there attention is far from uniform and every tensor's gradient is substantive.
namespace dref {

using D = std::vector<double>;

// y[N,OC] = x[N,IC] w[OC,IC]^T (+ b)
D matmul_t(const D& x, const D& w, const D* b, std::size_t N, std::size_t IC, std::size_t OC) {
  D y(N * OC);
  for (std::size_t n = 0; n < N; ++n) {
    const double* xr = x.data() + n * IC;  // raw pointers: a Debug+ASan build runs this 3x faster
    for (std::size_t o = 0; o < OC; ++o) {
      const double* wr = w.data() + o * IC;
      double s = b ? (*b)[o] : 0.0;
      for (std::size_t i = 0; i < IC; ++i) s += xr[i] * wr[i];
      y[n * OC + o] = s;
    }
  }
  return y;
}

D layer_norm(const D& x, const D& g, const D& b, std::size_t N, std::size_t C) {
  D y(N * C);
  for (std::size_t n = 0; n < N; ++n) {
    const double* xr = x.data() + n * C;
    double mu = 0, var = 0;
    for (std::size_t i = 0; i < C; ++i) mu += xr[i];
    mu /= double(C);
    for (std::size_t i = 0; i < C; ++i) var += (xr[i] - mu) * (xr[i] - mu);
    var /= double(C);
    for (std::size_t i = 0; i < C; ++i) y[n * C + i] = (xr[i] - mu) / std::sqrt(var + 1e-5) * g[i] + b[i];
  }
  return y;
}

double gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / 3.141592653589793238) * (x + 0.044715 * x * x * x)));
}

// Mean over rows of -log softmax(logits[row])[target[row]].
double mean_cross_entropy(const D& logits, const std::vector<TokenId>& targets, std::size_t V) {
  const std::size_t N = targets.size();
  double total = 0;
  for (std::size_t n = 0; n < N; ++n) {
    const double* l = &logits[n * V];
    const double mx = *std::max_element(l, l + V);
    double z = 0;
    for (std::size_t i = 0; i < V; ++i) z += std::exp(l[i] - mx);
    total += mx + std::log(z) - l[targets[n]];
  }
  return total / double(N);
}

// The model's parameters in double, by name.
struct Weights {
  std::vector<std::string> names;
  std::vector<D> w;
  const D& operator[](const std::string& n) const {
    for (std::size_t i = 0; i < names.size(); ++i)
      if (names[i] == n) return w[i];
    throw std::invalid_argument("dref: no tensor " + n);
  }
};

// GPT-2, pre-norm: x = wte[tok] + wpe[t]; per block x += proj(attn(qkv(ln1(x)))),
// x += proj(gelu(fc(ln2(x)))); logits = lnf(x) wte^T (tied); mean cross-entropy.
double gpt_loss(const Weights& W, const ModelConfig& c, const Batch& b) {
  const std::size_t B = c.batch, T = c.context, C = c.channels, V = c.vocab, NH = c.heads, hs = C / NH;
  const std::size_t N = B * T;
  const D& wte = W["wte"];
  const D& wpe = W["wpe"];
  D x(N * C);
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < C; ++i)
        x[(bi * T + t) * C + i] = wte[b.in[bi * T + t] * C + i] + wpe[t * C + i];
  for (std::size_t l = 0; l < c.layers; ++l) {
    const std::string h = std::string("h").append(std::to_string(l)).append(".");  // not "h" + ...: GCC 12 -Wrestrict
    const D a = layer_norm(x, W[h + "ln1.weight"], W[h + "ln1.bias"], N, C);
    const D qkv = matmul_t(a, W[h + "attn.qkv.weight"], &W[h + "attn.qkv.bias"], N, C, 3 * C);
    D y(N * C, 0.0);
    for (std::size_t bi = 0; bi < B; ++bi) {
      for (std::size_t hd = 0; hd < NH; ++hd) {
        for (std::size_t t = 0; t < T; ++t) {
          const double* q = &qkv[(bi * T + t) * 3 * C + hd * hs];
          std::vector<double> p(t + 1);
          for (std::size_t s = 0; s <= t; ++s) {
            const double* k = &qkv[(bi * T + s) * 3 * C + C + hd * hs];
            double dot = 0;
            for (std::size_t i = 0; i < hs; ++i) dot += q[i] * k[i];
            p[s] = dot / std::sqrt(double(hs));
          }
          const double mx = *std::max_element(p.begin(), p.end());
          double z = 0;
          for (double& v : p) z += (v = std::exp(v - mx));
          for (std::size_t s = 0; s <= t; ++s) {
            const double* v = &qkv[(bi * T + s) * 3 * C + 2 * C + hd * hs];
            double* yr = y.data() + (bi * T + t) * C + hd * hs;
            for (std::size_t i = 0; i < hs; ++i) yr[i] += p[s] / z * v[i];
          }
        }
      }
    }
    const D proj = matmul_t(y, W[h + "attn.proj.weight"], &W[h + "attn.proj.bias"], N, C, C);
    for (std::size_t i = 0; i < N * C; ++i) x[i] += proj[i];
    const D m = layer_norm(x, W[h + "ln2.weight"], W[h + "ln2.bias"], N, C);
    D f = matmul_t(m, W[h + "mlp.fc.weight"], &W[h + "mlp.fc.bias"], N, C, 4 * C);
    for (double& v : f) v = gelu(v);
    const D o = matmul_t(f, W[h + "mlp.proj.weight"], &W[h + "mlp.proj.bias"], N, 4 * C, C);
    for (std::size_t i = 0; i < N * C; ++i) x[i] += o[i];
  }
  const D xf = layer_norm(x, W["lnf.weight"], W["lnf.bias"], N, C);
  return mean_cross_entropy(matmul_t(xf, wte, nullptr, N, C, V), b.tgt, V);
}

// MLP: the T context embeddings of each window concatenated, depth x (Linear, GELU),
// a Linear head; mean cross-entropy against each window's last target.
double mlp_loss(const Weights& W, const ModelConfig& c, const Batch& b) {
  const std::size_t B = c.batch, T = c.context, C = c.channels, H = c.hidden, V = c.vocab;
  const D& wte = W["wte"];
  D x(B * T * C);
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < C; ++i) x[bi * T * C + t * C + i] = wte[b.in[bi * T + t] * C + i];
  std::size_t in = T * C;
  for (std::size_t l = 0; l < c.depth; ++l) {
    const std::string f = std::string("fc").append(std::to_string(l)).append(".");
    x = matmul_t(x, W[f + "weight"], &W[f + "bias"], B, in, H);
    for (double& v : x) v = gelu(v);
    in = H;
  }
  std::vector<TokenId> last(B);
  for (std::size_t bi = 0; bi < B; ++bi) last[bi] = b.tgt[bi * T + T - 1];
  return mean_cross_entropy(matmul_t(x, W["head.weight"], &W["head.bias"], B, H, V), last, V);
}

double loss_of(const Weights& W, const ModelConfig& c, const Batch& b) {
  return c.kind == ModelKind::gpt ? gpt_loss(W, c, b) : mlp_loss(W, c, b);
}

}  // namespace dref

// Overwrites an fp32 model's weights with random O(1) values (see above).
void randomize_weights(Model& m, std::uint32_t seed) {
  ParamStore& s = m.params();
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    const ParamSpec& spec = s.spec(t);
    const std::string& n = spec.name;
    std::span<float> w = s.model<float>(t);
    const bool norm = n.starts_with("ln") || n.find(".ln") != std::string::npos;
    double mean = 0, sd = 0;
    if (norm && n.ends_with(".weight")) mean = 1.0, sd = 0.3;
    else if (n.ends_with(".bias")) sd = 0.3;
    else if (n == "wte" || n == "wpe") sd = 0.5;
    else sd = 1.0 / std::sqrt(static_cast<double>(spec.shape.back()));  // [out, in]: N(0, 1/fan_in)
    for (float& x : w) x = static_cast<float>(mean + sd * nd(rng));
  }
  m.weights_updated();
}

// Worst |found - expected| / |expected| over the tensors and directions, for the report.
struct RefCheck {
  double worst_rel = 0;
  std::string worst_name;
  double worst_ratio = 0;  // max error / tolerance: the tightest margin
  std::string tightest_name;
  double loss_rel = 0;
};

RefCheck check_against_double_reference(Model& m, const ModelConfig& cfg, const Batch& b, const char* what) {
  ParamStore& s = m.params();
  s.zero_grads();
  const ForwardResult r = m.forward(b.in, b.tgt);
  m.backward(1.0f / static_cast<float>(r.count));
  const std::vector<float> g = grads_f32(s);
  dref::Weights W;
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    const std::span<float> w = s.model<float>(t);
    W.names.push_back(s.spec(t).name);
    W.w.emplace_back(w.begin(), w.end());
  }
  RefCheck out;
  const double lib_loss = r.loss_sum / static_cast<double>(r.count);
  const double ref_loss = dref::loss_of(W, cfg, b);
  out.loss_rel = std::abs(lib_loss - ref_loss) / std::abs(ref_loss);
  EXPECT_LT(out.loss_rel, 1e-6) << what << ": library fp32 loss " << lib_loss << ", double reference " << ref_loss;

  std::mt19937 rng(1234);
  std::normal_distribution<double> nd(0.0, 1.0);
  constexpr double h = 1e-3;
  const double u = std::ldexp(1.0, -24);
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    const std::string& name = s.spec(t).name;
    const dref::D w0 = W.w[t];
    for (int k = 0; k < 3; ++k) {
      dref::D d(w0.size());
      double norm = 0;
      for (double& x : d) {
        x = nd(rng);
        norm += x * x;
      }
      norm = std::sqrt(norm);
      double found = 0, magnitude = 0;
      for (std::size_t i = 0; i < d.size(); ++i) {
        d[i] /= norm;
        const double gi = static_cast<double>(g[s.offset(t) + i]);
        found += gi * d[i];
        magnitude += std::abs(gi * d[i]);
      }
      auto at = [&](double step) {
        for (std::size_t i = 0; i < d.size(); ++i) W.w[t][i] = w0[i] + step * d[i];
        return dref::loss_of(W, cfg, b);
      };
      const double expected = (8.0 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12.0 * h);
      W.w[t] = w0;
      const double err = std::abs(found - expected);
      const double tol = 1e-4 * std::abs(expected) + 64 * u * magnitude;
      EXPECT_LE(err, tol) << what << " " << name << " direction " << k << ": expected (double reference) "
                          << expected << ", found (fp32 backward) " << found << ", relative error "
                          << err / std::abs(expected) << ", tolerance " << tol;
      const double rel = err / std::abs(expected);
      if (rel > out.worst_rel) {
        out.worst_rel = rel;
        out.worst_name = name + " (direction " + std::to_string(k) + ")";
      }
      if (err / tol > out.worst_ratio) {
        out.worst_ratio = err / tol;
        out.tightest_name = name + " (direction " + std::to_string(k) + ")";
      }
    }
  }
  std::printf("%s: loss rel. error %.1e; gradients: worst rel. error %.1e at %s, largest error/tolerance %.2f at %s\n",
              what, out.loss_rel, out.worst_rel, out.worst_name.c_str(), out.worst_ratio, out.tightest_name.c_str());
  return out;
}

void check_model_against_double_reference(const ModelConfig& cfg) {
  auto m = make_model(cfg, Precision::fp32, 0);
  const Batch b = random_batch(cfg, 11);
  const std::string kind(model_kind_name(cfg.kind));
  check_against_double_reference(*m, cfg, b, (kind + " at initialisation").c_str());
  randomize_weights(*m, 99);
  check_against_double_reference(*m, cfg, b, (kind + " at random O(1) weights").c_str());
}

TEST(Model, GptGradientsMatchDoubleReference) { check_model_against_double_reference(small_gpt()); }
TEST(Model, MlpGradientsMatchDoubleReference) { check_model_against_double_reference(small_mlp()); }

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

// The fp8 presets save each block Linear's input for the backward as fp8 codes + scales
// (counted as activations), neither as fp32 copies nor as the bf16 activation: less
// memory in all than bf16 for the same model. (The shared buffers are a fixed cost, so
// a model needs a few blocks for this: here 4.)
TEST(Model, Fp8PresetsSaveLinearInputsAsCodesAndUseLessMemoryThanBf16) {
  ModelConfig cfg = small_gpt();
  cfg.layers = 4;
  cfg.channels = 32;
  cfg.context = 32;
  cfg.batch = 4;
  cfg.vocab = 64;
  const ModelMemory bf16 = make_model(cfg, Precision::bf16, 2)->memory();
  EXPECT_EQ(bf16.fp8_activation_bytes, 0u);
  const std::size_t N = cfg.batch * cfg.context, C = cfg.channels;
  for (Precision p : {Precision::fp8_noscale, Precision::fp8_delayed, Precision::fp8_current, Precision::mxfp8}) {
    const ModelMemory m = make_model(cfg, p, 2)->memory();
    // 1 byte per input element of the four Linears of every block (C, C, C, 4C per row);
    // per tensor one fp32 scale per Linear, mxfp8 one E8M0 scale per 32 elements (along N).
    const std::size_t codes = cfg.layers * N * 7 * C, linears = cfg.layers * 4;
    EXPECT_EQ(m.fp8_activation_bytes, p == Precision::mxfp8 ? codes + codes / 32 : codes + linears * sizeof(float))
        << precision_name(p);
    EXPECT_LT(m.activation_bytes, bf16.activation_bytes) << precision_name(p);
    EXPECT_LT(m.activation_bytes + m.scratch_bytes, bf16.activation_bytes + bf16.scratch_bytes)
        << precision_name(p);
    EXPECT_EQ(m.gradient_bytes, bf16.gradient_bytes) << precision_name(p);
  }
}

// Without master weights (ZeRO-1 keeps them in each rank's slice) the store holds the
// same model copy, and the same forward, as with them.
TEST(Model, WithoutMasterWeightsKeepsTheSameModelCopy) {
  const ModelConfig cfg = small_gpt();
  ModelOptions no_master;
  no_master.state_slots = 2;
  no_master.master_weights = false;
  for (Precision p : {Precision::fp16, Precision::bf16, Precision::fp8_delayed}) {
    SCOPED_TRACE(std::string(precision_name(p)));
    auto with = make_model(cfg, p, 2);
    auto without = make_model(cfg, p, no_master);
    const ParamStore& a = with->params();
    const ParamStore& b = without->params();
    ASSERT_TRUE(a.has_master());
    EXPECT_FALSE(b.has_master());
    EXPECT_EQ(b.state_slots(), 2u);
    ASSERT_EQ(a.flat_size(), b.flat_size());
    const std::size_t bytes = a.flat_size() * dtype_size(a.model_dtype());
    EXPECT_EQ(std::memcmp(a.model_data(), b.model_data(), bytes), 0);
    const Batch batch = random_batch(cfg, 5);
    EXPECT_EQ(with->forward(batch.in, batch.tgt).loss_sum, without->forward(batch.in, batch.tgt).loss_sum);
  }
  // fp32 has no master weights to drop: the option changes nothing.
  EXPECT_FALSE(make_model(cfg, Precision::fp32, no_master)->params().has_master());
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

// A recipe file's switches allocate nothing: finish() planned and grew every buffer of every
// plan the run can reach (nvfp4 to mxfp8, whose codes are twice as large; wgrad in bf16, which
// keeps X in fp32; the evaluation plan), so the step of each switch allocates no buffer and as
// often as the next step of its plan.
TEST(Model, RecipeSwitchesAllocateNoBuffers) {
  ModelConfig g = small_gpt();
  g.batch = 8;
  g.context = 32;
  g.channels = 32;
  ModelConfig m = small_mlp();
  m.batch = 64;
  m.hidden = 128;
  for (const ModelConfig& cfg : {g, m}) {
    const std::string first = cfg.kind == ModelKind::gpt ? "h0.attn.qkv" : "fc1";
    const auto recipes = std::make_shared<const lowp::Assignment>(lowp::parse_assignment(
        R"({"format":"mixprec.low_precision","version":1,"default":"nvfp4","modules":{")" + first +
        R"(":{"recipe":"mxfp8","backward_override":"high_precision"}},"schedule":[{"from_step":2,"recipe":"mxfp8"},)"
        R"({"from_step":4,"wgrad":"bf16"}],"evaluation":"fp8-block"})"));
    auto model = make_model(cfg, Precision::mxfp8, {.state_slots = 2, .fp8 = {}, .recipes = recipes, .recipe_steps = 8});
    const Batch b = random_batch(cfg, 1);
    long counts[6] = {};
    for (std::uint64_t step = 0; step < 6; ++step) {
      g_largest = 0;
      const long before = g_allocations.load();
      EXPECT_EQ(model->set_recipe_step(step), step == 2 || step == 4) << model_kind_name(cfg.kind) << " " << step;
      model->params().zero_grads();
      model->forward(b.in, b.tgt);
      model->backward(1.0f);
      model->fp8_step_done();
      model->reset_stats();
      model->weights_updated();
      model->set_evaluation(true);
      model->forward(b.in, b.tgt, 1);
      model->set_evaluation(false);
      counts[step] = g_allocations.load() - before;
      if (step > 0) {
        EXPECT_LT(g_largest.load(), 1024u) << model_kind_name(cfg.kind) << " step " << step;
      }
    }
    // The step of a switch allocates what the next step of the same plan does (small
    // allocations of the GEMM library's calls, which differ between plans).
    EXPECT_EQ(counts[2], counts[3]) << model_kind_name(cfg.kind);
    EXPECT_EQ(counts[4], counts[5]) << model_kind_name(cfg.kind);
  }
}

// The Linears a preset quantizes are quantized_linear_names, in their order: the names its
// fp8 tensors carry.
TEST(Model, QuantizedLinearNamesAreTheModelsFp8Tensors) {
  for (const ModelConfig& cfg : {small_gpt(), small_mlp()}) {
    const auto model = make_model(cfg, Precision::fp8_current, 0);
    const std::vector<std::string> names = quantized_linear_names(cfg);
    const std::span<const Fp8TensorStats> stats = model->fp8_stats();
    ASSERT_EQ(stats.size(), 3 * names.size());
    for (std::size_t i = 0; i < names.size(); ++i) EXPECT_EQ(stats[3 * i].name, names[i] + ".input");
  }
  EXPECT_THROW(make_model(small_gpt(), Precision::bf16,
                          {.fp8 = {}, .recipes = std::make_shared<const lowp::Assignment>(), .recipe_steps = 1}),
               std::invalid_argument);
}

// The GEMM counter over one forward and backward equals the FLOPs of the layers' products
// counted by hand: every Linear's forward, input-gradient and weight-gradient products
// (3 x 2 M N K), and attention's 6 per-head products per (sequence, head).
TEST(Model, GemmFlopsCountEveryProductOfAStep) {
  for (Precision p : {Precision::fp32, Precision::bf16, Precision::fp8_current}) {
    ModelConfig g = small_gpt();
    ModelConfig m = small_mlp();
    for (const ModelConfig& cfg : {g, m}) {
      auto model = make_model(cfg, p, 2);
      const Batch b = random_batch(cfg, 1);
      const std::uint64_t N = cfg.batch * cfg.context, C = cfg.channels, V = cfg.vocab, L = cfg.layers;
      std::uint64_t linear = 0, attention = 0;
      if (cfg.kind == ModelKind::gpt) {
        // qkv C->3C, proj C->C, fc C->4C, fcproj 4C->C per layer; the tied head C->V.
        linear = 3 * 2 * N * (L * (3 * C * C + C * C + 4 * C * C + 4 * C * C) + C * V);
        const std::uint64_t hs = C / cfg.heads;
        attention = cfg.batch * cfg.heads * L * 6 * 2 * cfg.context * cfg.context * hs;
      } else {
        // The concatenated embedding T*C -> hidden, depth - 1 hidden -> hidden, the head hidden -> V.
        const std::uint64_t H = cfg.hidden, B = cfg.batch;
        linear = 3 * 2 * B * (cfg.context * C * H + (cfg.depth - 1) * H * H + H * V);
      }
      EXPECT_EQ(attention_flops(cfg), attention) << model_kind_name(cfg.kind);
      const std::uint64_t before = model->gemm_flops();
      model->params().zero_grads();
      model->forward(b.in, b.tgt);
      model->backward(1.0f);
      model->fp8_step_done();
      EXPECT_EQ(model->gemm_flops() - before, linear + attention)
          << model_kind_name(cfg.kind) << " " << precision_name(p);
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
        EXPECT_EQ(t.dtype, t.role == lowp::Role::backward ? lowp::Element::e5m2 : lowp::Element::e4m3) << t.name;
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
    if (t.role != lowp::Role::backward) continue;
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
