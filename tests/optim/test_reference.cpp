// The optimizers against an independent reference over many steps.
//
// The reference below is a plain double-precision transcription of the published
// update rules, written apart from the library (it shares none of its helpers,
// scalars or loops):
//   SGD (PyTorch's torch.optim.SGD): d = g + wd p; with momentum mu: buf = d on the
//     first applied step, else buf = mu buf + (1 - dampening) d; Nesterov: d = d + mu buf,
//     else d = buf; p = p - lr d.
//   Adam (Kingma & Ba, Algorithm 1; L2 as torch.optim.Adam): g = g + wd p;
//     m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; m^ = m / (1 - b1^t);
//     v^ = v / (1 - b2^t); p = p - lr m^ / (sqrt(v^) + eps).
//   AdamW (Loshchilov & Hutter, as torch.optim.AdamW): p = p (1 - lr wd) first, then
//     Adam's update with the undecayed gradient.
// t counts applied steps only: a skipped step changes nothing, not even t.
//
// Each run is 60 steps with a learning rate that changes every step, skipped steps in
// the middle (and two in a row), loss scales from 2^4 to 2^14, clipping coefficients on
// some steps, and gradients whose magnitudes span 2^-40 .. 2^16 within one tensor.
// Hyperparameters are chosen so that every term matters: lr * wd = 0.02 .. 0.04 (so
// decaying before or after the update differs by 2-4% of an update), beta1 != beta2
// far apart, dampening 0.3.
//
// Tolerance, in ulps, and why. The library computes in fp32; every operation rounds
// once (at most half an ulp: 2^-24 relative). By the usual forward error analysis the
// error one step adds to a weight is a few such roundings of the magnitudes that step
// touched: |p| and the absolute values of the terms summed into the update (for Adam
// lr/bc1 * (b1 |m_prev| + (1 - b1) |g|) / denom: m can cancel, its rounding error does
// not). Errors already in p, m and v are carried forward, decayed. So each weight gets
// the budget
//   B = sum over applied steps of (|p| + magnitude of that step's update terms)
// and the test asserts |p_fp32 - p_ref| <= K * 2^-24 * B, K = 4 ulps. B counts every
// step's magnitudes once, which already covers the carried errors; the worst error
// measured over all runs and back ends is 0.61 of these ulps (SGD with momentum and
// dampening; Adam and AdamW 0.13-0.24), so K = 4 leaves a 6x margin for other
// compilers while the mutations the test exists for (beta1 for beta2, weight decay after
// the update, 1 - wd for 1 - lr wd, a skipped step that counts) land hundreds to millions
// of these ulps away (docs/testing.md).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "mixprec/core/parallel.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "support.hpp"

namespace mixprec {
namespace {

// ---- the reference: doubles, no library code -------------------------------------------
namespace ref {

enum class Kind { sgd, adam, adamw };

struct Hyper {
  Kind kind = Kind::adam;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  double momentum = 0, dampening = 0;
  bool nesterov = false;
};

struct State {
  std::vector<double> p, m, v, buf;  // buf: SGD momentum
  std::vector<double> budget;        // running sum of magnitudes (see the header)
  long t = 0;                        // applied steps
};

void step(State& s, const Hyper& h, double lr, const std::vector<double>& g) {
  ++s.t;
  for (std::size_t i = 0; i < s.p.size(); ++i) {
    double p = s.p[i];
    double gi = g[i];
    double mag = std::fabs(p);
    if (h.kind == Kind::sgd) {
      double d = gi + h.weight_decay * p;
      double dmag = std::fabs(gi) + std::fabs(h.weight_decay * p);
      if (h.momentum != 0) {
        const double bmag = s.t == 1 ? dmag : h.momentum * std::fabs(s.buf[i]) + (1 - h.dampening) * dmag;
        s.buf[i] = s.t == 1 ? d : h.momentum * s.buf[i] + (1 - h.dampening) * d;
        if (h.nesterov) {
          d = d + h.momentum * s.buf[i];
          dmag = dmag + h.momentum * bmag;
        } else {
          d = s.buf[i];
          dmag = bmag;
        }
      }
      s.p[i] = p - lr * d;
      mag += lr * dmag;
    } else {
      if (h.kind == Kind::adamw) {
        p = p * (1 - lr * h.weight_decay);
      } else {
        gi = gi + h.weight_decay * p;
      }
      const double m_prev = s.m[i];
      s.m[i] = h.beta1 * s.m[i] + (1 - h.beta1) * gi;
      s.v[i] = h.beta2 * s.v[i] + (1 - h.beta2) * gi * gi;
      const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(s.t));
      const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(s.t));
      const double m_hat = s.m[i] / bc1, v_hat = s.v[i] / bc2;
      const double denom = std::sqrt(v_hat) + h.eps;
      s.p[i] = p - lr * m_hat / denom;
      mag += std::fabs(p) + lr / bc1 * (h.beta1 * std::fabs(m_prev) + (1 - h.beta1) * std::fabs(gi)) / denom;
    }
    s.budget[i] += mag;
  }
}

}  // namespace ref

// ---- the run ---------------------------------------------------------------------------

// An independent fp16 decode (sign, 5-bit exponent, 10-bit fraction), for gradients stored in f16.
double f16_bits_to_double(std::uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  double v = e == 0 ? std::ldexp(f, -24) : std::ldexp(1024 + f, e - 25);
  return sign ? -v : v;
}


struct Run {
  const char* name;
  ref::Hyper h;
  double lr;
  int min_exp, max_exp;  // gradient magnitudes 2^min_exp .. 2^max_exp
};

const Run kRuns[] = {
    {"sgd", {.kind = ref::Kind::sgd}, 0.05, -40, 4},
    {"sgd_wd", {.kind = ref::Kind::sgd, .weight_decay = 0.3}, 0.05, -40, 4},
    {"sgd_momentum_dampening_wd", {.kind = ref::Kind::sgd, .weight_decay = 0.2, .momentum = 0.9, .dampening = 0.3}, 0.03,
     -40, 4},
    {"sgd_nesterov_wd", {.kind = ref::Kind::sgd, .weight_decay = 0.1, .momentum = 0.8, .nesterov = true}, 0.03, -40, 4},
    {"adam", {.kind = ref::Kind::adam}, 0.01, -40, 16},
    {"adam_l2", {.kind = ref::Kind::adam, .beta1 = 0.8, .beta2 = 0.99, .weight_decay = 0.5}, 0.01, -40, 6},
    {"adam_lerp_high", {.kind = ref::Kind::adam, .beta1 = 0.3, .beta2 = 0.95, .eps = 1e-6}, 0.01, -40, 16},
    {"adamw", {.kind = ref::Kind::adamw, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.5}, 0.05, -40, 16},
    {"adamw_default_betas", {.kind = ref::Kind::adamw, .weight_decay = 0.4}, 0.08, -40, 16},
};

// gtest names a failing case by this rather than by the bytes of the struct.
void PrintTo(const Run& r, std::ostream* os) { *os << r.name; }

std::unique_ptr<Optimizer> make_optimizer(ParamStore& s, const Run& r) {
  const ref::Hyper& h = r.h;
  switch (h.kind) {
    case ref::Kind::sgd:
      return std::make_unique<SGD>(
          s, SgdConfig{.lr = r.lr, .momentum = h.momentum, .dampening = h.dampening, .nesterov = h.nesterov,
                       .weight_decay = h.weight_decay});
    case ref::Kind::adam:
      return std::make_unique<Adam>(
          s, AdamConfig{.lr = r.lr, .beta1 = h.beta1, .beta2 = h.beta2, .eps = h.eps, .weight_decay = h.weight_decay});
    case ref::Kind::adamw:
      return std::make_unique<AdamW>(
          s, AdamConfig{.lr = r.lr, .beta1 = h.beta1, .beta2 = h.beta2, .eps = h.eps, .weight_decay = h.weight_decay});
  }
  return nullptr;
}

constexpr int kSteps = 60;
const std::set<int> kSkipped = {9, 23, 24, 41};  // 1-based step numbers

// Per step: the loss scale (a power of two, so scaled fp32 gradients are exact), a
// clipping coefficient (1 on most steps) and the learning rate.
double loss_scale(int step) { return std::ldexp(1.0, 4 + (step * 7) % 11); }
float clip_coef(int step) { return step % 5 == 3 ? 0.375f + 0.0625f * static_cast<float>(step % 7) : 1.0f; }
double lr_at(const Run& r, int step) { return r.lr * (0.55 + 0.45 * std::cos(0.37 * step)); }

struct Mode {
  DType grads;
  Isa isa;
  bool fused;
  bool threads;
};

std::string describe(const Run& r, const Mode& m) {
  return std::string(r.name) + " grads " + std::string(dtype_name(m.grads)) + " isa " + std::string(isa_name(m.isa)) +
         (m.fused ? " fused" : " unfused") + (m.threads ? " 2 threads" : "");
}

// Runs kSteps of r through the library (mode m) and the reference; returns the
// worst |error| / (2^-24 * budget) over all weights, checking it against kMaxUlps.
constexpr double kMaxUlps = 4;

double run_against_reference(const Run& r, const Mode& m) {
  const std::string what = describe(r, m);
  const std::vector<ParamSpec> specs = {{"a", {37}}, {"b", {5, 9}}, {"c", {1}}, {"d", {4099}}};
  const unsigned slots = r.h.kind == ref::Kind::sgd ? (r.h.momentum != 0 ? 1u : 0u) : 2u;
  ParamStore s(specs, {.model = DType::f32, .grads = m.grads, .master = true, .state_slots = slots});
  auto opt = make_optimizer(s, r);
  opt->set_isa(m.isa);
  ThreadPool pool(2);
  std::vector<float> scratch(opt->unfused_scratch_size());

  // Flat views over the tensors, in order (the reference ignores the store's padding).
  std::size_t total = 0;
  for (std::size_t t = 0; t < s.tensor_count(); ++t) total += s.numel(t);
  ref::State st;
  st.p.resize(total);
  st.m.assign(total, 0);
  st.v.assign(total, 0);
  st.buf.assign(total, 0);
  st.budget.assign(total, 0);
  test::SplitMix64 gen{0x5eed0000u + static_cast<std::uint64_t>(r.h.kind)};
  {
    std::size_t k = 0;
    for (std::size_t t = 0; t < s.tensor_count(); ++t)
      for (float& w : s.master(t)) {
        w = static_cast<float>(2.0 * gen.uniform() - 1.0) * 2.0f;
        st.p[k++] = w;
      }
    s.refresh_model();
  }

  std::vector<double> g(total);
  for (int step = 1; step <= kSteps; ++step) {
    const bool skip = kSkipped.count(step) != 0;
    const double S = loss_scale(step);
    const float coef = clip_coef(step);
    const double lr = lr_at(r, step);
    // The unscaled fp32 gradient the library reads from the store: stored * (1/S), exact
    // for a power-of-two S; decoded by the test's own f16 decoder.
    auto unscaled = [&](std::size_t t, std::size_t i) {
      if (m.grads == DType::f32) return static_cast<float>(static_cast<double>(s.grads<float>(t)[i]) / S);
      std::uint16_t bits;
      std::memcpy(&bits, &s.grads<f16>(t)[i], 2);
      return static_cast<float>(f16_bits_to_double(bits) / S);
    };
    // Gradients: sign, mantissa in [1, 2), exponent uniform in [min_exp, max_exp], stored
    // scaled by S (f16: whatever that rounds to, tiny ones flushed, large ones clamped).
    for (std::size_t t = 0; t < s.tensor_count(); ++t) {
      for (std::size_t i = 0; i < s.numel(t); ++i) {
        const int e = r.min_exp + static_cast<int>(gen.next() % static_cast<std::uint64_t>(r.max_exp - r.min_exp + 1));
        const double v = std::ldexp(1.0 + gen.uniform(), e) * (gen.next() & 1 ? -1.0 : 1.0);
        if (m.grads == DType::f32) s.grads<float>(t)[i] = static_cast<float>(v * S);  // exact: S is a power of two
        else s.grads<f16>(t)[i] = f16(static_cast<float>(std::fmin(std::fabs(v * S), 60000.0) * (v < 0 ? -1 : 1)));
      }
    }
    StepControls ctl{.inv_scale = static_cast<float>(1.0 / S), .clip_coef = coef, .skip = skip, .lr = lr};
    bool applied;
    if (m.fused) {
      // The fused step clips the unscaled fp32 gradient: (g * inv_scale) * coef, as fp32.
      for (std::size_t t = 0, k = 0; t < s.tensor_count(); ++t)
        for (std::size_t i = 0; i < s.numel(t); ++i, ++k) g[k] = static_cast<double>(unscaled(t, i) * coef);
      applied = opt->step(ctl, m.threads ? &pool : nullptr);
    } else {
      // The unfused path clips through max_norm only: fold this step's coefficient into the
      // stored gradients, and give the reference what is stored then.
      if (coef != 1.0f) {
        for (std::size_t t = 0; t < s.tensor_count(); ++t) {
          if (m.grads == DType::f32)
            for (float& x : s.grads<float>(t)) x *= coef;
          else
            for (auto& x : s.grads<f16>(t)) x = f16(static_cast<float>(x) * coef);
        }
      }
      for (std::size_t t = 0, k = 0; t < s.tensor_count(); ++t)
        for (std::size_t i = 0; i < s.numel(t); ++i, ++k) g[k] = static_cast<double>(unscaled(t, i));
      ctl.clip_coef = 1.0f;
      applied = opt->step_unfused(ctl, scratch, std::nullopt, m.threads ? &pool : nullptr);
    }
    EXPECT_EQ(applied, !skip) << what << " step " << step;
    if (!skip) ref::step(st, r.h, lr, g);
    EXPECT_EQ(opt->step_count(), st.t) << what << " step " << step;
  }

  // Compare every weight.
  double worst = 0;
  std::size_t k = 0, failures = 0;
  for (std::size_t t = 0; t < s.tensor_count(); ++t) {
    const std::span<const float> w = s.master(t);
    for (std::size_t i = 0; i < w.size(); ++i, ++k) {
      const double err = std::fabs(static_cast<double>(w[i]) - st.p[k]);
      const double units = err / (0x1p-24 * st.budget[k]);
      worst = std::max(worst, units);
      if (!(units <= kMaxUlps) && failures++ < 5) {
        ADD_FAILURE() << what << ": " << s.spec(t).name << "[" << i << "] = " << w[i] << ", reference " << st.p[k]
                      << ", error " << err << " = " << units << " ulps of the budget " << st.budget[k]
                      << " (allowed " << kMaxUlps << ")";
      }
    }
  }
  EXPECT_EQ(failures, 0u) << what << ": weights outside the tolerance";
  return worst;
}

std::vector<Mode> modes() {
  std::vector<Mode> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) {
      std::printf("[  SKIP    ] back end %s: not available on this CPU\n", std::string(isa_name(isa)).c_str());
      continue;
    }
    for (DType g : {DType::f32, DType::f16}) {
      out.push_back({g, isa, true, false});
      out.push_back({g, isa, false, false});
    }
    out.push_back({DType::f32, isa, true, true});
  }
  return out;
}

class OptimizerReference : public ::testing::TestWithParam<Run> {};

TEST_P(OptimizerReference, SixtyStepsMatchTheDoubleTranscription) {
  double worst = 0;
  for (const Mode& m : modes()) {
    worst = std::max(worst, run_against_reference(GetParam(), m));
    if (HasFailure()) return;
  }
  std::printf("%s: worst error %.2f ulps of the magnitude budget (allowed %.0f)\n", GetParam().name, worst, kMaxUlps);
}

INSTANTIATE_TEST_SUITE_P(Rules, OptimizerReference, ::testing::ValuesIn(kRuns),
                         [](const ::testing::TestParamInfo<Run>& i) { return std::string(i.param.name); });

// The reference is not trivially close to anything: a step with the wrong rule is far
// outside the tolerance. Guards against a tolerance so loose that the test cannot fail.
TEST(OptimizerReferenceSelfCheck, AWrongRuleIsFarOutsideTheTolerance) {
  ref::Hyper right{.kind = ref::Kind::adamw, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.5};
  ref::State a, b;
  for (ref::State* s : {&a, &b}) {
    s->p = {1.0, -0.5, 0.25};
    s->m.assign(3, 0);
    s->v.assign(3, 0);
    s->buf.assign(3, 0);
    s->budget.assign(3, 0);
  }
  ref::Hyper wrong = right;
  wrong.kind = ref::Kind::adam;  // L2 instead of decoupled decay
  const std::vector<double> g = {0.1, -2.0, 1e-6};
  for (int i = 0; i < 10; ++i) {
    ref::step(a, right, 0.05, g);
    ref::step(b, wrong, 0.05, g);
  }
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_GT(std::fabs(a.p[i] - b.p[i]) / (0x1p-24 * a.budget[i]), 100 * kMaxUlps) << i;
}

}  // namespace
}  // namespace mixprec
