// mixprec::torch::LowPrecisionLinear with recipes per GEMM direction and in time: each plan's y,
// dx, dw and db equal bit for bit to the GEMMs composed here from fake_quantize with explicit
// QuantizeConfigs (not through LinearPlan::config); TE's zoo names give TE's assignments; a
// recipe file's schedule switches at its step (low_precision_step) and its evaluation plan runs
// in eval mode; bad plans are refused before any module is built.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "mixprec/torch/low_precision.hpp"
#include "support.hpp"
#include "temp_dir.hpp"

namespace mixprec::torch {
namespace {

using lowp::Element;
using lowp::Layout;
using lowp::Recipe;
constexpr Layout kRow = Layout::rowwise, kCol = Layout::columnwise;

// One operand's config, written out.
lowp::QuantizeConfig config(Recipe r, Element e, Layout l, bool tile_2d = false, bool rht = false) {
  lowp::QuantizeConfig c;
  c.recipe = r;
  c.element = e;
  c.layout = l;
  c.tile_2d = tile_2d;
  c.rht = rht;
  return c;
}

at::Tensor fq(const at::Tensor& t, lowp::QuantizeConfig c, const std::vector<std::uint32_t>& random = {}) {
  c.stochastic_rounding = !random.empty();
  return fake_quantize(t, c, random);
}

at::Tensor mx8(const at::Tensor& t, Layout l) { return fq(t, config(Recipe::mxfp8, Element::e4m3, l)); }

std::vector<std::uint32_t> words(std::uint64_t seed, std::uint64_t draw, std::size_t n) {
  // The module's stream (low_precision.cpp): splitmix64 from seed * 0x100000001B3 + draw.
  std::uint64_t s = seed * 0x100000001B3ull + draw;
  std::vector<std::uint32_t> r(n);
  for (auto& w : r) {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    w = static_cast<std::uint32_t>((z ^ (z >> 31)) >> 32);
  }
  return r;
}

constexpr std::uint64_t kSeed = 3;

// One Linear [64 -> 48] running `mod`'s plan on a batch of `rows`: its y, dx, dw, db and inputs.
struct Result {
  at::Tensor x, w, b, dy, y, dx, dw, db;
};

Result run(LowPrecisionLinear& mod, std::int64_t rows) {
  Result r;
  r.w = mod->weight.detach().clone();
  r.b = mod->bias.detach().clone();
  r.x = ::torch::randn({rows, 64}).set_requires_grad(true);
  const at::Tensor y = mod->forward(r.x);
  r.dy = ::torch::randn_like(y);
  y.backward(r.dy);
  r.y = y.detach();
  r.dx = r.x.grad();
  r.dw = mod->weight.grad();
  r.db = mod->bias.grad();
  r.x = r.x.detach();
  return r;
}

Result run_plan(const lowp::LinearPlan& plan, std::int64_t rows = 32) {
  ::torch::manual_seed(1);
  LowPrecisionLinear mod(64, 48, plan, true, kSeed);
  return run(mod, rows);
}

lowp::LinearPlan entry_plan(const std::string& entry) {
  const lowp::Assignment a = lowp::parse_assignment(
      R"({"format":"mixprec.low_precision","version":1,"modules":{"m":)" + entry + "}}");
  return lowp::plan(a.entry("m"), a.options);
}

void expect_gemms(const Result& r, const at::Tensor& y, const at::Tensor& dx, const at::Tensor& dw) {
  EXPECT_TRUE(::torch::equal(r.y, y));
  EXPECT_TRUE(::torch::equal(r.dx, dx));
  EXPECT_TRUE(::torch::equal(r.dw, dw));
  EXPECT_TRUE(::torch::equal(r.db, r.dy.sum(0)));
}

// ---- TE's zoo --------------------------------------------------------------------------

struct ZooCase {
  const char* name;
  std::int64_t rows;
};

class ZooPlans : public ::testing::TestWithParam<ZooCase> {};

TEST_P(ZooPlans, AreTeAssignmentsGemmForGemm) {
  const auto [name, rows] = GetParam();
  const LowPrecision lp = LowPrecision::uniform(name);  // the zoo name, through the plan builder
  ASSERT_TRUE(lp.plan_for("b", 1, 3).has_value());
  EXPECT_EQ(*lp.plan_for("b", 1, 3), lowp::plan(lowp::zoo_choice(*lowp::parse_zoo(name))));
  EXPECT_FALSE(lp.plan_for("a", 0, 3).has_value());
  const Result r = run_plan(*lp.plan_for("b", 1, 3), rows);
  const at::Tensor &x = r.x, &w = r.w, &b = r.b, &dy = r.dy;
  const auto n = static_cast<std::size_t>(dy.numel());
  const bool rht = rows % 16 == 0;  // wgrad's RHT only along a batch of whole 16-row blocks
  const std::string z = name;
  SCOPED_TRACE(z + " rows " + std::to_string(rows));
  if (z == "high_precision_fwd_mxfp8_bwd") {
    expect_gemms(r, at::matmul(x, w.t()) + b, at::matmul(mx8(dy, kRow), mx8(w, kCol)),
                 at::matmul(mx8(dy, kCol).t(), mx8(x, kCol)));
  } else if (z == "mxfp8_fwd_high_precision_bwd") {
    const at::Tensor xq = mx8(x, kRow), wq = mx8(w, kRow);
    expect_gemms(r, at::matmul(xq, wq.t()) + b, at::matmul(dy, wq), at::matmul(dy.t(), xq));
  } else if (z == "mxfp8_fwd_nvfp4_bwd") {
    const at::Tensor xq = mx8(x, kRow), wq = mx8(w, kRow);
    // dgrad: TE's NVFP4 dy (stochastic, draw 0); w plain 1-D NVFP4 from fprop's MXFP8 values.
    const at::Tensor dyq = fq(dy, config(Recipe::nvfp4, Element::e2m1, kRow), words(kSeed, 0, n));
    const at::Tensor wc = fq(wq, config(Recipe::nvfp4, Element::e2m1, kCol));
    // wgrad: x from the original; RHT on both; dy stochastic (draw 1).
    const at::Tensor xc = fq(x, config(Recipe::nvfp4, Element::e2m1, kCol, false, rht));
    const at::Tensor dyc = fq(dy, config(Recipe::nvfp4, Element::e2m1, kCol, false, rht), words(kSeed, 1, n));
    expect_gemms(r, at::matmul(xq, wq.t()) + b, at::matmul(dyq, wc), at::matmul(dyc.t(), xc));
  } else {  // nvfp4_1d_weight
    const at::Tensor xq = fq(x, config(Recipe::nvfp4, Element::e2m1, kRow));
    const at::Tensor wq = fq(w, config(Recipe::nvfp4, Element::e2m1, kRow));  // w: no 2-D tiles
    const at::Tensor dyq = fq(dy, config(Recipe::nvfp4, Element::e2m1, kRow), words(kSeed, 0, n));
    const at::Tensor wc = fq(wq, config(Recipe::nvfp4, Element::e2m1, kCol));
    const at::Tensor xc = fq(x, config(Recipe::nvfp4, Element::e2m1, kCol, false, rht));
    const at::Tensor dyc = fq(dy, config(Recipe::nvfp4, Element::e2m1, kCol, false, rht), words(kSeed, 1, n));
    expect_gemms(r, at::matmul(xq, wq.t()) + b, at::matmul(dyq, wc), at::matmul(dyc.t(), xc));
  }
}

INSTANTIATE_TEST_SUITE_P(Zoo, ZooPlans,
                         ::testing::Values(ZooCase{"high_precision_fwd_mxfp8_bwd", 32},
                                           ZooCase{"mxfp8_fwd_high_precision_bwd", 32},
                                           ZooCase{"mxfp8_fwd_nvfp4_bwd", 32}, ZooCase{"mxfp8_fwd_nvfp4_bwd", 24},
                                           ZooCase{"nvfp4_1d_weight", 48}),
                         [](const ::testing::TestParamInfo<ZooCase>& i) {
                           return std::string(i.param.name) + "_rows" + std::to_string(i.param.rows);
                         });

TEST(LowPrecisionDirections, ZooPlanIsNotTheUniformRecipe) {
  // The plan is what runs: mxfp8_fwd_nvfp4_bwd's dgrad is not MXFP8's.
  const Result zoo = run_plan(*LowPrecision::uniform("mxfp8_fwd_nvfp4_bwd").plan_for("b", 1, 3));
  const Result uniform = run_plan(*LowPrecision::uniform("mxfp8").plan_for("b", 1, 3));
  EXPECT_TRUE(::torch::equal(zoo.y, uniform.y));
  EXPECT_FALSE(::torch::equal(zoo.dx, uniform.dx));
  LowPrecisionLinear mod(8, 8, *LowPrecision::uniform("high_precision_fwd_mxfp8_bwd").plan_for("b", 1, 3));
  EXPECT_EQ(mod->recipe().recipe, Recipe::mxfp8);  // the first quantized operand's (dgrad.dy)
}

// ---- hand-written entries --------------------------------------------------------------

TEST(LowPrecisionDirections, BackwardOverrideHighPrecision) {
  const Result r = run_plan(entry_plan(R"({"recipe":"fp8-current","backward_override":"high_precision"})"));
  const auto fc = [](const at::Tensor& t) { return fq(t, config(Recipe::fp8_current, Element::e4m3, kRow)); };
  expect_gemms(r, at::matmul(fc(r.x), fc(r.w).t()) + r.b, at::matmul(r.dy, r.w), at::matmul(r.dy.t(), r.x));
}

TEST(LowPrecisionDirections, DequantizedSourcesWithAQuantizedBackward) {
  // dgrad's w and wgrad's x from the values an MXFP4 fprop multiplied, quantized again with MXFP8.
  const Result r = run_plan(entry_plan(
      R"({"recipe":"mxfp4","dgrad":{"w":"mxfp8"},"wgrad":{"x":"mxfp8"},"columnwise_source":"dequantized"})"));
  const auto f4 = [](const at::Tensor& t, Layout l) { return fq(t, config(Recipe::mxfp4, Element::e2m1, l)); };
  const at::Tensor xq = f4(r.x, kRow), wq = f4(r.w, kRow);
  expect_gemms(r, at::matmul(xq, wq.t()) + r.b, at::matmul(f4(r.dy, kRow), mx8(wq, kCol)),
               at::matmul(f4(r.dy, kCol).t(), mx8(xq, kCol)));
  // From the originals, the same entry gives other gradients.
  const Result original = run_plan(entry_plan(R"({"recipe":"mxfp4","dgrad":{"w":"mxfp8"},"wgrad":{"x":"mxfp8"}})"));
  EXPECT_FALSE(::torch::equal(r.dx, original.dx));
  EXPECT_FALSE(::torch::equal(r.dw, original.dw));
}

TEST(LowPrecisionDirections, HighPrecisionForwardAndPerTensorWgradRecordTheirOperands) {
  // Forward in high precision, NVFP4 backward without RHT, wgrad fp8-current (HYBRID: x E4M3,
  // dy E5M2; one rowwise quantization serves both layouts).
  ::torch::manual_seed(1);
  LowPrecisionLinear mod(64, 48, entry_plan(R"({"recipe":"nvfp4","rht":false,"fprop":"bf16","wgrad":{"recipe":"fp8-current"}})"),
                         true, kSeed);
  const Result r = run(mod, 32);
  const auto n = static_cast<std::size_t>(r.dy.numel());
  const at::Tensor dyq = fq(r.dy, config(Recipe::nvfp4, Element::e2m1, kRow), words(kSeed, 0, n));
  const at::Tensor wc = fq(r.w, config(Recipe::nvfp4, Element::e2m1, kCol, /*tile_2d=*/true));
  expect_gemms(r, at::matmul(r.x, r.w.t()) + r.b, at::matmul(dyq, wc),
               at::matmul(fq(r.dy, config(Recipe::fp8_current, Element::e5m2, kRow)).t(),
                          fq(r.x, config(Recipe::fp8_current, Element::e4m3, kRow))));
  // Statistics per tensor from its first quantized operand: x from wgrad, w and dy from dgrad.
  EXPECT_EQ(mod->stats(OperandRole::x).recipe, Recipe::fp8_current);
  EXPECT_EQ(mod->stats(OperandRole::x).element, Element::e4m3);
  EXPECT_EQ(mod->stats(OperandRole::x).amax, r.x.abs().max().item<float>());
  EXPECT_EQ(mod->stats(OperandRole::w).recipe, Recipe::nvfp4);
  EXPECT_EQ(mod->stats(OperandRole::dy).recipe, Recipe::nvfp4);
  EXPECT_EQ(mod->stats(OperandRole::dy).element, Element::e2m1);
  EXPECT_EQ(mod->sr_draws.item<std::int64_t>(), 1);  // one stochastic operand: dgrad's dy
}

TEST(LowPrecisionDirections, DelayedHistoryFromTheBackwardOperands) {
  // fprop in high precision: x's and w's amax reach the history from wgrad and dgrad.
  ::torch::manual_seed(2);
  LowPrecisionLinear mod(16, 16, entry_plan(R"({"recipe":"fp8-delayed","amax_history_len":4,"fprop":"bf16"})"));
  ASSERT_TRUE(mod->amax_history.defined());
  const at::Tensor x = ::torch::randn({8, 16}).set_requires_grad(true);
  const at::Tensor y = mod->forward(x);
  EXPECT_TRUE(::torch::equal(y.detach(), at::matmul(x.detach(), mod->weight.detach().t()) + mod->bias.detach()));
  const at::Tensor dy = ::torch::randn_like(y);
  y.backward(dy);
  EXPECT_EQ(mod->scale[0].item<float>(), 448.0f / x.abs().max().item<float>());
  EXPECT_EQ(mod->scale[1].item<float>(), 448.0f / mod->weight.detach().abs().max().item<float>());
  EXPECT_EQ(mod->scale[2].item<float>(), 57344.0f / dy.abs().max().item<float>());
}

TEST(LowPrecisionDirections, StochasticRoundingStreamIsModuleState) {
  // sr_draws travels with the module: a copy resumed from step 1's state draws step 2's words.
  const lowp::LinearPlan plan = lowp::plan(lowp::zoo_choice(lowp::Zoo::nvfp4_1d_weight));
  ::torch::manual_seed(5);
  LowPrecisionLinear a(64, 48, plan, true, kSeed), b(64, 48, plan, true, kSeed);
  ::torch::NoGradGuard no_grad;
  b->weight.copy_(a->weight);
  b->bias.copy_(a->bias);
  const at::Tensor x = ::torch::randn({32, 64}), dy = ::torch::randn({32, 48});
  auto step = [&](LowPrecisionLinear& m) {
    ::torch::AutoGradMode grad(true);
    m->weight.mutable_grad() = at::Tensor();
    m->forward(x.clone().set_requires_grad(true)).backward(dy);
    return m->weight.grad().clone();
  };
  step(a);
  b->sr_draws.copy_(a->sr_draws);
  EXPECT_EQ(b->sr_draws.item<std::int64_t>(), 2);
  EXPECT_TRUE(::torch::equal(step(a), step(b)));
}

// ---- schedules and evaluation ----------------------------------------------------------

// Both Linears MXFP8; "2" runs fprop in high precision from step 3; `tail` closes the object.
std::string schedule_file(const std::string& tail) {
  return R"({"format":"mixprec.low_precision","version":1,"default":"bf16","modules":{"0":"mxfp8","2":"mxfp8"},
    "schedule":[{"from_step":3,"fprop":"bf16","modules":["2"],"label":"forward to bf16"}])" + tail;
}

// Linear(16, 16), GELU, Linear(16, 8), as LowPrecision builds them.
::torch::nn::Sequential two_linears(const LowPrecision& lp) {
  ::torch::manual_seed(4);
  lp.check_names({"0", "2"});
  ::torch::nn::Sequential model;
  model->push_back("0", lp.linear("0", 0, 2, 16, 16));
  model->push_back("1", ::torch::nn::GELU());
  model->push_back("2", lp.linear("2", 1, 2, 16, 8));
  return model;
}

using Switches = std::vector<std::pair<std::string, std::string>>;

TEST(LowPrecisionSchedule, SwitchesAtItsStepAndEvaluationRunsItsPlan) {
  test::TempDir dir("lowp_schedule");
  const std::string path = (dir.path() / "plan.json").string();
  std::ofstream(path) << schedule_file(R"(,"evaluation":"bf16"})");
  ::torch::nn::Sequential model = two_linears(LowPrecision::from_file(path));
  auto* lin0 = model->ptr(0)->as<LowPrecisionLinearImpl>();
  auto* lin2 = model->ptr(2)->as<LowPrecisionLinearImpl>();
  ASSERT_NE(lin0, nullptr);
  ASSERT_NE(lin2, nullptr);
  ::torch::NoGradGuard no_grad;
  const at::Tensor x = ::torch::randn({8, 16}), h = ::torch::randn({8, 16});
  const at::Tensor w0 = lin0->weight.detach(), b0 = lin0->bias.detach();
  const at::Tensor w = lin2->weight.detach(), b = lin2->bias.detach();
  const at::Tensor mx = at::matmul(mx8(h, kRow), mx8(w, kRow).t()) + b;
  const at::Tensor mx0 = at::matmul(mx8(x, kRow), mx8(w0, kRow).t()) + b0;
  EXPECT_EQ(low_precision_step(*model, 2), Switches{});
  EXPECT_TRUE(::torch::equal(lin2->forward(h), mx));
  EXPECT_EQ(low_precision_step(*model, 3), (Switches{{"2", "forward to bf16"}}));
  EXPECT_TRUE(::torch::equal(lin2->forward(h), at::matmul(h, w.t()) + b));  // fprop high from step 3
  EXPECT_FALSE(lin2->plan().at(lowp::Operand::fprop_x).has_value());
  EXPECT_EQ(lin2->plan().at(lowp::Operand::dgrad_dy)->recipe, Recipe::mxfp8);
  EXPECT_EQ(low_precision_step(*model, 4), Switches{});
  EXPECT_TRUE(::torch::equal(lin0->forward(x), mx0));
  // Evaluation: the file's evaluation plan (high precision) on every quantized Linear.
  model->eval();
  EXPECT_TRUE(::torch::equal(lin0->forward(x), at::matmul(x, w0.t()) + b0));
  model->train();
  EXPECT_TRUE(::torch::equal(lin0->forward(x), mx0));
  // Going back (a resumed run asks for its step): the step's plan again, before any phase.
  EXPECT_EQ(low_precision_step(*model, 0), (Switches{{"2", ""}}));
  EXPECT_TRUE(::torch::equal(lin2->forward(h), mx));
}

TEST(LowPrecisionSchedule, WithoutEvaluationPlanEvalModeRunsTheTrainingPlan) {
  ::torch::nn::Sequential model = two_linears(LowPrecision::from_assignment(lowp::parse_assignment(schedule_file("}"))));
  auto* lin0 = model->ptr(0)->as<LowPrecisionLinearImpl>();
  ::torch::NoGradGuard no_grad;
  const at::Tensor x = ::torch::randn({8, 16});
  model->eval();
  EXPECT_TRUE(::torch::equal(lin0->forward(x),
                             at::matmul(mx8(x, kRow), mx8(lin0->weight.detach(), kRow).t()) + lin0->bias.detach()));
}

TEST(LowPrecisionSchedule, FractionPhaseReachingAHighPrecisionModule) {
  const std::string text = R"({"format":"mixprec.low_precision","version":1,"default":"bf16","modules":{},
    "schedule":[{"from_fraction":0.5,"modules":["2"],"recipe":"mxfp8"}]})";
  LowPrecision lp = LowPrecision::from_assignment(lowp::parse_assignment(text));
  lp.check_names({"0", "2"});
  // Without the run's length the Linear it reaches cannot be built (nothing is).
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { lp.linear("2", 1, 2, 16, 8); }),
            "recipe file: schedule[0].from_fraction: the run's length is needed to turn a fraction into a step; give "
            "LowPrecision the run's steps (from_file(path, total_steps) or set_total_steps) (or use from_step)");
  lp.set_total_steps(10);
  ::torch::nn::Sequential model = two_linears(lp);
  EXPECT_EQ(model->ptr(0)->as<LowPrecisionLinearImpl>(), nullptr);  // never quantized: a plain Linear
  auto* lin2 = model->ptr(2)->as<LowPrecisionLinearImpl>();
  ASSERT_NE(lin2, nullptr);
  EXPECT_FALSE(lp.recipe_for("2", 1, 2).has_value());  // high precision at step 0
  ::torch::NoGradGuard no_grad;
  const at::Tensor h = ::torch::randn({4, 16});
  const at::Tensor w = lin2->weight.detach(), b = lin2->bias.detach();
  EXPECT_TRUE(::torch::equal(lin2->forward(h), at::matmul(h, w.t()) + b));  // high precision until step 5
  EXPECT_EQ(low_precision_step(*model, 4), Switches{});
  EXPECT_EQ(low_precision_step(*model, 5), (Switches{{"2", "phase 1"}}));
  EXPECT_TRUE(::torch::equal(lin2->forward(h), at::matmul(mx8(h, kRow), mx8(w, kRow).t()) + b));
}

// ---- bad input, refused before any module is built -------------------------------------

TEST(LowPrecisionSchedule, BadPlansAreRefusedBeforeAnyModuleIsBuilt) {
  const std::string head = R"({"format":"mixprec.low_precision","version":1,"default":"bf16",)";
  // A schedule pattern that matches no Linear of the model.
  const LowPrecision stray = LowPrecision::from_assignment(lowp::parse_assignment(
      head + R"("modules":{"0":"mxfp8"},"schedule":[{"from_step":1,"modules":["h.*"],"recipe":"mxfp8"}]})"));
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { stray.check_names({"0", "2"}); }),
            "recipe file: schedule[0].modules: 'h.*': expected a pattern matching a Linear of the model, found none "
            "that it matches");
  // A zoo name with options.
  test::TempDir dir("lowp_bad_plans");
  const std::string path = (dir.path() / "plan.json").string();
  std::ofstream(path) << head + R"("modules":{"0":{"recipe":"nvfp4_1d_weight","margin":2}}})";
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { LowPrecision::from_file(path); }),
            path + R"(: recipe file: modules["0"]: a zoo name ("nvfp4_1d_weight") takes no other fields)");
  // fp8-delayed with other options in a later phase: one amax history per tensor.
  const LowPrecision delayed = LowPrecision::from_assignment(lowp::parse_assignment(
      head + R"("modules":{"0":{"recipe":"fp8-delayed","amax_history_len":4}},
        "schedule":[{"from_step":2,"amax_history_len":8}]})"));
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { delayed.linear("0", 0, 2, 8, 8); }),
            "0: fp8-delayed: expected the same options in every plan of the run (its amax history is one per "
            "tensor), found different ones; give every phase the same fp8-delayed options");
  // A plan given whole must keep lowp::plan's rules.
  lowp::LinearPlan lone = lowp::plan(lowp::RecipeChoice::of(Recipe::mxfp8));
  lone.x_source = lowp::Source::dequantized;
  lone.operands[static_cast<std::size_t>(lowp::Operand::fprop_x)].reset();
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { LowPrecisionLinear(8, 8, lone); }),
            "LowPrecisionLinear: x_source: \"dequantized\" takes the values fprop multiplied, but fprop.x is high "
            "precision");
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { LowPrecisionLinear(8, 8, lowp::LinearPlan{}); }),
            "LowPrecisionLinear: expected a plan that quantizes some operand, found every operand in high precision "
            "in every plan of the run (use a torch::nn::Linear)");
}

}  // namespace
}  // namespace mixprec::torch
