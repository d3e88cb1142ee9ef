// mixprec::torch::GradScaler: every preset follows the core LossScale, the protocol's
// misuse errors, bad gradients, names, state JSON.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "mixprec/torch/grad_scaler.hpp"

namespace {

using at::Tensor;
using mixprec::torch::GradScaler;

// Expects `f` to throw E with a message containing `part`.
template <class E, class F>
void expect_error(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one containing: " << part;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "message: " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

struct TinyImpl : ::torch::nn::Module {
  TinyImpl() {
    w = register_parameter("w", ::torch::ones({4, 3}));
    b = register_parameter("b", ::torch::ones({3}));
  }
  Tensor w, b;
};
TORCH_MODULE(Tiny);

void set_grads(Tiny& m, float value) {
  m->w.mutable_grad() = ::torch::full({4, 3}, value);
  m->b.mutable_grad() = ::torch::full({3}, value);
}

// A long overflow sequence: bursts, single overflows and long clean runs.
bool overflow_at(int s) {
  const int k = s % 2600;  // 2287 clean steps in a row: every preset grows (intervals <= 2000)
  return k == 10 || k == 11 || k == 12 || k == 2300 || k == 2302 || (s > 5200 && s <= 5230 && s % 3 == 0);
}

TEST(TorchGradScaler, EveryPresetFollowsTheCoreLossScale) {
  for (const std::string& name : mixprec::loss_scale_preset_names()) {
    SCOPED_TRACE(name);
    const mixprec::LossScaleConfig cfg = mixprec::loss_scale_preset(name);
    Tiny m;
    ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.0));
    GradScaler scaler(cfg);
    scaler.set_names(*m);
    const auto core = mixprec::make_loss_scale(cfg);
    int growths = 0, backoffs = 0;
    for (int s = 0; s < 7000; ++s) {
      ASSERT_EQ(scaler.get_scale(), core->scale()) << "step " << s;
      set_grads(m, 0.5f * scaler.get_scale());
      const bool inf = overflow_at(s);
      if (inf) m->b.mutable_grad()[1] = NAN;
      const auto out = scaler.step(opt);
      EXPECT_EQ(out.found_inf, inf);
      EXPECT_EQ(out.applied, !inf);
      if (inf) {
        EXPECT_EQ(out.first_overflow_name, "b");
      } else {
        EXPECT_EQ(out.grad_norm, std::sqrt(15 * 0.25));  // unscaled exactly (power-of-two scales)
      }
      const float before = core->scale();
      scaler.update();
      core->update(inf);
      growths += core->scale() > before;
      backoffs += core->scale() < before;
    }
    EXPECT_EQ(scaler.loss_scale().state(), core->state());
    if (cfg.rule != mixprec::LossScaleRule::static_scale) {
      EXPECT_GT(growths, 0);
      EXPECT_GT(backoffs, 0);
    }
  }
}

TEST(TorchGradScaler, UnscaleTwiceStepTwiceUpdateWithoutChecks) {
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  set_grads(m, 1.0f);
  expect_error<std::logic_error>([&] { scaler.update(); }, "No inf checks were recorded prior to update()");
  scaler.unscale(opt);
  EXPECT_EQ(scaler.stage(opt), mixprec::OptimizerStage::unscaled);
  expect_error<std::logic_error>([&] { scaler.unscale(opt); },
                                 "unscale() has already been called on this optimizer since the last update()");
  scaler.step(opt);
  expect_error<std::logic_error>([&] { scaler.step(opt); }, "step() has already been called since the last update()");
  expect_error<std::logic_error>([&] { scaler.unscale(opt); }, "unscale() is being called after step()");
  scaler.update();
  EXPECT_EQ(scaler.stage(opt), mixprec::OptimizerStage::ready);
}

TEST(TorchGradScaler, AccumulationWindowMisuse) {
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  scaler.set_accumulation_steps(2);
  set_grads(m, 1.0f);
  scaler.backward_done();
  expect_error<std::logic_error>([&] { scaler.update(); }, "update() after 1 of 2 backward passes");
  expect_error<std::logic_error>([&] { scaler.step(opt); }, "step() after 1 of 2 backward passes");
  expect_error<std::logic_error>([&] { scaler.unscale(opt); }, "unscale() after 1 of 2 backward passes");
  expect_error<std::logic_error>([&] { scaler.set_accumulation_steps(3); }, "in the middle of an accumulation window");
  scaler.backward_done();
  expect_error<std::logic_error>([&] { scaler.backward_done(); }, "called 3 times in an accumulation window of 2");
  EXPECT_TRUE(scaler.step(opt).applied);
  scaler.update();
  EXPECT_EQ(scaler.backward_passes(), 0);
}

// What torch.amp's own kernel leaves in a gradient (a copy, unscaled at 1/scale).
Tensor torch_unscaled(const Tensor& g, float scale) {
  std::vector<Tensor> copy{g.clone()};
  Tensor found = ::torch::zeros({}, ::torch::kFloat);
  at::_amp_foreach_non_finite_check_and_unscale_(copy, found, ::torch::full({}, 1.0f / scale, ::torch::kFloat));
  return copy[0];
}

TEST(TorchGradScaler, GradientsAsTorchTakesThem) {
  const float scale = 1024.0f;
  // channels_last, a strided view, an fp64 gradient, sparse COO: each unscaled as torch does.
  std::vector<Tensor> grads = {
      (::torch::randn({2, 3, 4, 5}) * scale).contiguous(at::MemoryFormat::ChannelsLast),
      (::torch::randn({6}) * scale).slice(0, 0, 6, 2),
      ::torch::randn({3}, ::torch::kDouble) * scale,
      (::torch::randn({4, 3}) * scale).to_sparse(),
      (::torch::randn({5, 3}) * scale).to(::torch::kHalf).t(),
  };
  std::vector<Tensor> params;
  for (const Tensor& g : grads) params.push_back(::torch::zeros(g.sizes(), g.options().layout(at::kStrided)).set_requires_grad(true));
  std::vector<Tensor> want;
  for (std::size_t k = 0; k < grads.size(); ++k) {
    want.push_back(grads[k].is_sparse() ? torch_unscaled(grads[k]._values(), scale) : torch_unscaled(grads[k], scale));
    params[k].mutable_grad() = grads[k];
  }
  ::torch::optim::SGD opt(params, ::torch::optim::SGDOptions(0.0));
  mixprec::LossScaleConfig config = mixprec::loss_scale_preset("torch");
  config.init_scale = scale;
  GradScaler scaler(config);
  scaler.unscale(opt);
  EXPECT_TRUE(params[0].grad().is_contiguous(at::MemoryFormat::ChannelsLast)) << "the layout is kept";
  for (std::size_t k = 0; k < grads.size(); ++k) {
    const Tensor got = params[k].grad().is_sparse() ? params[k].grad()._values() : params[k].grad();
    EXPECT_TRUE(::torch::equal(got, want[k])) << "gradient " << k;
  }
  const auto out = scaler.step(opt);
  EXPECT_TRUE(out.applied);
  EXPECT_TRUE(std::isfinite(out.grad_norm));
}

TEST(TorchGradScaler, OverlappingGradientsGetTorchsOwnError) {
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.1));
  GradScaler scaler(mixprec::loss_scale_preset("torch"));
  m->w.mutable_grad() = ::torch::ones({4, 3});
  m->b.mutable_grad() = ::torch::ones({1}).expand({3});  // stride 0: three elements, one memory location
  std::vector<Tensor> same{::torch::ones({1}).expand({3})};
  std::string torch_error;
  try {
    Tensor found = ::torch::zeros({});
    at::_amp_foreach_non_finite_check_and_unscale_(same, found, ::torch::full({}, 0.5f));
  } catch (const std::exception& e) {
    torch_error = e.what();
  }
  std::string ours;
  try {
    scaler.step(opt);
  } catch (const std::exception& e) {
    ours = e.what();
  }
  EXPECT_EQ(ours.substr(0, 60), torch_error.substr(0, 60)) << "ours: " << ours << "\ntorch: " << torch_error;
}

TEST(TorchGradScaler, BadGradientsAreRefusedBeforeAnythingIsTouched) {
  {
    Tiny m;
    ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.1));
    GradScaler scaler;
    scaler.set_names(*m);
    m->w.mutable_grad() = ::torch::full({4, 3}, 2.0f);
    m->b.mutable_grad() = ::torch::ones({3}, ::torch::TensorOptions().device(::torch::kMeta));
    expect_error<std::invalid_argument>([&] { scaler.step(opt); }, "the gradient of b is a meta tensor");
    EXPECT_TRUE(::torch::equal(m->w.grad(), ::torch::full({4, 3}, 2.0f))) << "w was not unscaled";
    EXPECT_TRUE(::torch::equal(m->w, ::torch::ones({4, 3})));
  }
  {
    Tiny m;
    ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.1));
    GradScaler scaler;
    scaler.set_names(*m);
    set_grads(m, 1.0f);
    m->w.mutable_grad() = ::torch::ones({4, 3}).to_sparse_csr();
    expect_error<std::invalid_argument>([&] { scaler.unscale(opt); }, "the gradient of w has layout SparseCsr");
    EXPECT_TRUE(::torch::equal(m->b.grad(), ::torch::ones({3})));
  }
  {
    Tensor p = ::torch::ones({3}, ::torch::requires_grad());
    ::torch::optim::SGD opt(std::vector<Tensor>{p}, ::torch::optim::SGDOptions(0.1));
    opt.param_groups()[0].params().clear();
    GradScaler scaler;
    expect_error<mixprec::ScalerMisuse>([&] { scaler.step(opt); }, "No inf checks were recorded for this optimizer");
  }
  {
    Tiny m;
    ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.1));
    GradScaler scaler;
    set_grads(m, 1.0f);
    expect_error<std::invalid_argument>([&] { scaler.step(opt, {.max_grad_norm = -1.0f}); },
                                        "max_grad_norm -1 is not allowed");
    EXPECT_EQ(scaler.stage(opt), mixprec::OptimizerStage::ready);
  }
}

// The refusals are the core's routing (scaler/grad_route.hpp), word for word what the Python
// door raises; the outcome is the core's one StepOutcome.
TEST(TorchGradScaler, RefusalsAreTheCoresMessagesAndTheOutcomeIsTheCoresType) {
  static_assert(std::is_same_v<mixprec::torch::StepOutcome, mixprec::StepOutcome>);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  scaler.set_names(*m);
  set_grads(m, 2.0f);
  m->b.mutable_grad() = ::torch::ones({3}, ::torch::kLong);
  EXPECT_EQ(message([&] { scaler.step(opt); }), "the gradient of b has dtype int64; gradients must be floating point");
  m->b.mutable_grad() = ::torch::ones({3}, ::torch::kComplexFloat);
  EXPECT_EQ(message([&] { scaler.unscale(opt); }),
            "the gradient of b has dtype complex64; gradients must be floating point");
  m->b.mutable_grad() = ::torch::ones({1, 3}).to_sparse_csr();
  EXPECT_EQ(message([&] { scaler.step(opt); }),
            "the gradient of b has layout SparseCsr; GradScaler takes strided and sparse COO gradients, as "
            "torch.amp.GradScaler does");
  EXPECT_TRUE(::torch::equal(m->w.grad(), ::torch::full({4, 3}, 2.0f))) << "w was not unscaled";
  EXPECT_EQ(scaler.stage(opt), mixprec::OptimizerStage::ready);
}

TEST(TorchGradScaler, UndefinedGradientsAreSkippedAndUnnamedParametersGetIndices) {
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(1.0));
  GradScaler scaler(mixprec::loss_scale_preset("torch"));
  m->b.mutable_grad() = ::torch::full({3}, 4.0f * scaler.get_scale());  // w has no gradient
  auto out = scaler.step(opt);
  EXPECT_TRUE(out.applied);
  EXPECT_DOUBLE_EQ(out.grad_norm, std::sqrt(3.0 * 16.0));
  EXPECT_TRUE(::torch::equal(m->b, ::torch::full({3}, -3.0f)));
  EXPECT_TRUE(::torch::equal(m->w, ::torch::ones({4, 3})));
  scaler.update();
  m->b.mutable_grad()[2] = INFINITY;
  out = scaler.step(opt);
  EXPECT_FALSE(out.applied);
  EXPECT_EQ(out.first_overflow, 1);
  EXPECT_EQ(out.first_overflow_name, "param[1]");
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0f);
}

TEST(TorchGradScaler, Fp16AndBf16GradientsAreUnscaledInPlaceAsAtenDoes) {
  for (const auto dt : {::torch::kHalf, ::torch::kBFloat16, ::torch::kFloat}) {
    ::torch::manual_seed(3);
    Tensor p = ::torch::zeros({1000}, ::torch::TensorOptions().dtype(dt).requires_grad(true));
    Tensor g = (::torch::randn({1000}) * 1000).to(dt);
    p.mutable_grad() = g.clone();
    ::torch::optim::SGD opt(std::vector<Tensor>{p}, ::torch::optim::SGDOptions(0.0));
    GradScaler scaler(mixprec::loss_scale_preset("torch"));  // 65536
    const void* storage = p.grad().data_ptr();
    scaler.unscale(opt);
    EXPECT_EQ(p.grad().data_ptr(), storage) << "in place, no copy";
    Tensor ref = g.clone();
    Tensor found = ::torch::zeros({}, ::torch::kFloat);
    at::_amp_foreach_non_finite_check_and_unscale_({ref}, found, ::torch::full({}, 1.0f / 65536.0f));
    EXPECT_TRUE(::torch::equal(p.grad(), ref)) << c10::toString(dt);
  }
}

TEST(TorchGradScaler, ClipsOnTheUnscaledNorm) {
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(1.0));
  GradScaler scaler(mixprec::loss_scale_preset("torch"));
  set_grads(m, 2.0f * scaler.get_scale());  // unscaled norm sqrt(15 * 4)
  const auto out = scaler.step(opt, {.max_grad_norm = 1.0f});
  EXPECT_DOUBLE_EQ(out.grad_norm, std::sqrt(60.0));
  EXPECT_EQ(out.clip_coef, static_cast<float>(1.0 / (std::sqrt(60.0) + 1e-6)));
  EXPECT_TRUE(::torch::allclose(m->b.grad(), ::torch::full({3}, 2.0f * out.clip_coef)));
}

// The clip coefficient against clip_grad_norm_'s own arithmetic (fp32 per-tensor norms,
// the norm of their stack, max_norm * reciprocal(norm + 1e-6), clamped to 1) on the same
// gradients: a few ulps apart at most (docs/libtorch.md).
TEST(TorchGradScaler, ClipCoefficientWithinUlpsOfClipGradNorm) {
  int equal = 0;
  constexpr int kTrials = 200;
  for (int t = 0; t < kTrials; ++t) {
    ::torch::manual_seed(100 + t);
    std::vector<Tensor> params;
    for (int k = 0; k < 6; ++k) {
      Tensor p = ::torch::zeros({1 + 97 * k}, ::torch::requires_grad());
      p.mutable_grad() = ::torch::randn({1 + 97 * k}) * std::pow(10.0, (t % 7) - 3);
      params.push_back(p);
    }
    ::torch::optim::SGD opt(params, ::torch::optim::SGDOptions(0.0));
    std::vector<Tensor> norms;
    for (const auto& p : params) norms.push_back(p.grad().norm(2));
    const Tensor total = ::torch::stack(norms).norm(2);
    const float max_norm = 0.5f;
    const float ref = ::torch::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0).item<float>();
    GradScaler scaler(mixprec::loss_scale_preset("static"));  // scale 1: the gradients as they are
    const auto out = scaler.step(opt, {.max_grad_norm = max_norm});
    EXPECT_NEAR(out.grad_norm, total.item<double>(), 1e-6 * out.grad_norm);
    EXPECT_LE(std::abs(out.clip_coef - ref), 4 * std::nextafter(ref, 2.0f) - 4 * ref) << "trial " << t;
    equal += out.clip_coef == ref;
    scaler.update();
  }
  RecordProperty("bitwise_equal_coefficients", equal);
  std::printf("clip coefficient bitwise equal to clip_grad_norm_'s in %d of %d trials\n", equal, kTrials);
}

TEST(TorchGradScaler, ScaleMultipliesTheLossAndKeepsItsDtype) {
  GradScaler scaler(mixprec::loss_scale_preset("torch"));
  EXPECT_EQ(scaler.scale(::torch::full({}, 3.0f)).item<float>(), 3.0f * 65536.0f);
  // A 0-dim fp32 scale: type promotion as in PyTorch (an fp16 vector stays fp16).
  EXPECT_EQ(scaler.scale(::torch::full({2}, 0.5, ::torch::kHalf)).scalar_type(), ::torch::kHalf);
  GradScaler off(mixprec::loss_scale_preset("torch"), false);
  EXPECT_EQ(off.scale(::torch::full({}, 3.0f)).item<float>(), 3.0f);
  EXPECT_EQ(off.get_scale(), 1.0f);
}

TEST(TorchGradScaler, StateJsonRoundTripsAndIsTheCoreFormat) {
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(0.0));
  GradScaler a(mixprec::loss_scale_preset("deepspeed"));
  for (int s = 0; s < 5; ++s) {
    set_grads(m, 1.0f);
    if (s == 2) m->w.mutable_grad()[0][0] = INFINITY;
    a.step(opt);
    a.update();
  }
  const std::string json = a.state_json();
  EXPECT_NE(json.find("\"format\":\"mixprec.grad_scaler\""), std::string::npos);
  mixprec::GradScaler core;
  core.load_state_json(json);
  EXPECT_EQ(core.loss_scale().state(), a.loss_scale().state());
  GradScaler b;
  b.load_state_json(json);
  EXPECT_EQ(b.loss_scale().state(), a.loss_scale().state());
  EXPECT_EQ(b.state_json(), json);
  expect_error<std::invalid_argument>([&] { b.load_state_json("{\"format\":1}"); }, "GradScaler state: field 'format'");
  set_grads(m, 1.0f);
  b.unscale(opt);
  expect_error<std::logic_error>([&] { b.load_state_json(json); }, "load_state_json() in the middle of a step");
}

}  // namespace

namespace {

TEST(TorchGradScaler, IndependentScalersOnFourThreads) {
  std::vector<float> finals(4, 0.0f);
  std::vector<int> wrong(4, 0);
  auto worker = [&](int t) {
    at::Tensor w = ::torch::zeros({1 << 20}, ::torch::requires_grad());
    ::torch::optim::SGD opt(std::vector<at::Tensor>{w}, ::torch::optim::SGDOptions(1e-3));
    mixprec::LossScaleConfig c = mixprec::loss_scale_preset("torch");
    c.init_scale = 1024;
    c.growth_interval = 50;
    GradScaler scaler(c);
    for (int step = 0; step < 200; ++step) {
      w.mutable_grad() = ::torch::full({1 << 20}, 1024.0f);
      if (step % 37 == 0) w.mutable_grad()[7] = NAN;
      const auto out = scaler.step(opt);
      if (out.applied != (step % 37 != 0)) ++wrong[static_cast<std::size_t>(t)];
      scaler.update();
    }
    finals[static_cast<std::size_t>(t)] = scaler.get_scale();
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong, std::vector<int>(4, 0));
  for (float f : finals) EXPECT_EQ(f, finals[0]);
}

}  // namespace

namespace {

// The rank hook: another rank's overflow skips this rank's clean step, and the scale backs
// off on every rank (a c10d all_reduce or MPI in real use; here a stand-in that says so).
TEST(TorchGradScaler, RankAgreementSkipsWhenAnotherRankOverflowed) {
  Tiny m;
  ::torch::optim::SGD opt(m->parameters(), ::torch::optim::SGDOptions(1.0));
  mixprec::LossScaleConfig c = mixprec::loss_scale_preset("torch");
  c.init_scale = 64;
  GradScaler scaler(c);
  int calls = 0;
  bool other_rank_overflows = true;
  scaler.set_rank_agreement([&](mixprec::RankFlags local) {
    ++calls;
    return mixprec::RankFlags{local.found_inf || other_rank_overflows, true};
  });
  set_grads(m, 64.0f);
  const auto skipped = scaler.step(opt);
  EXPECT_FALSE(skipped.applied);
  EXPECT_TRUE(skipped.found_inf);
  EXPECT_EQ(skipped.first_overflow, -1) << "this rank's own gradients were finite";
  EXPECT_TRUE(::torch::equal(m->w, ::torch::ones({4, 3})));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32.0f);
  other_rank_overflows = false;
  set_grads(m, 32.0f);
  EXPECT_TRUE(scaler.step(opt).applied);
  scaler.update();
  EXPECT_EQ(calls, 2);
}

}  // namespace

namespace {

// Step guards through the libtorch door (docs/spike_guards.md): each reason skips the step and
// leaves the parameters and Adam's state (moments and step) byte for byte; only an overflow
// backs the scale off.
TEST(TorchGradScalerGuards, EachReasonSkipsAndTouchesNothing) {
  using mixprec::SkipReason;
  for (const SkipReason want : {SkipReason::loss_spike, SkipReason::grad_spike, SkipReason::nonfinite_grad,
                                SkipReason::nonfinite_loss, SkipReason::user}) {
    SCOPED_TRACE(std::string(mixprec::skip_reason_name(want)));
    ::torch::manual_seed(0);
    Tiny m;
    ::torch::optim::Adam opt(m->parameters(), ::torch::optim::AdamOptions(1e-3));
    mixprec::LossScaleConfig c = mixprec::loss_scale_preset("torch");
    c.init_scale = 64;
    GradScaler scaler(c);
    mixprec::GuardConfig g;
    g.loss_z = 3;
    g.grad_z = 3;
    g.window = 16;
    scaler.set_guard(g);
    for (int step = 1; step <= 20; ++step) {
      const bool bad = step == 18;
      const float S = scaler.get_scale();
      float grad = 0.01f * (1.0f + 0.05f * static_cast<float>(step % 3));
      double loss = 2.0 + 0.01 * (step % 4);
      if (bad && want == SkipReason::grad_spike) grad = 50.0f;
      if (bad && want == SkipReason::loss_spike) loss = 40.0;
      if (bad && want == SkipReason::nonfinite_loss) loss = std::nan("");
      set_grads(m, grad * S);
      if (bad && want == SkipReason::nonfinite_grad) m->w.mutable_grad()[0][0] = INFINITY;
      mixprec::torch::StepOptions o;
      o.loss = loss;
      if (want == SkipReason::user) o.skip_if = [&](const mixprec::GuardView&) { return bad; };
      std::vector<Tensor> before;
      for (const auto& p : m->parameters()) before.push_back(p.detach().clone());
      for (const auto& p : m->parameters()) {
        auto it = opt.state().find(p.unsafeGetTensorImpl());
        if (it == opt.state().end()) continue;
        const auto& st = static_cast<const ::torch::optim::AdamParamState&>(*it->second);
        before.push_back(st.exp_avg().clone());
        before.push_back(st.exp_avg_sq().clone());
        before.push_back(::torch::tensor(static_cast<double>(st.step())));
      }
      const mixprec::torch::StepOutcome out = scaler.step(opt, o);
      scaler.update();
      if (!bad) {
        EXPECT_TRUE(out.applied) << "step " << step << ": " << mixprec::skip_reason_name(out.reason);
        continue;
      }
      EXPECT_FALSE(out.applied);
      EXPECT_EQ(out.reason, want) << mixprec::skip_reason_name(out.reason);
      std::vector<Tensor> after;
      for (const auto& p : m->parameters()) after.push_back(p.detach().clone());
      for (const auto& p : m->parameters()) {
        const auto& st = static_cast<const ::torch::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
        after.push_back(st.exp_avg().clone());
        after.push_back(st.exp_avg_sq().clone());
        after.push_back(::torch::tensor(static_cast<double>(st.step())));
      }
      ASSERT_EQ(before.size(), after.size());
      for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(before[i].equal(after[i])) << "tensor " << i;
      EXPECT_EQ(scaler.get_scale(), want == SkipReason::nonfinite_grad ? S / 2 : S);
    }
  }
}

}  // namespace
