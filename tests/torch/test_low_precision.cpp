// mixprec::torch::LowPrecisionLinear: each recipe's forward, dgrad, wgrad and bias gradient
// equal bit for bit to the GEMMs composed by hand from lowp::quantize / dequantize; delayed
// scaling's scale sequence and state; LowPrecision's plans (uniform, recipe file).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include "mixprec/torch/low_precision.hpp"
#include "support.hpp"
#include "temp_dir.hpp"

namespace mixprec::torch {
namespace {

at::Tensor fq(const at::Tensor& t, const lowp::LinearRecipe& r, bool gradient, bool weight, lowp::Layout layout,
              bool rht = false, std::span<const std::uint32_t> random = {}) {
  lowp::QuantizeConfig c = r.config(gradient, weight, layout);
  c.rht = rht;
  c.stochastic_rounding = !random.empty();
  return fake_quantize(t, c, random);
}

std::vector<std::uint32_t> module_words(std::uint64_t seed, std::uint64_t draw, std::size_t n) {
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

class LowPrecisionLinearGemms : public ::testing::TestWithParam<const char*> {};

TEST_P(LowPrecisionLinearGemms, AreTeQuantizedProducts) {
  ::torch::manual_seed(1);
  const lowp::LinearRecipe r = *lowp::resolve(lowp::RecipeChoice::of(lowp::parse_recipe(GetParam())));
  LowPrecisionLinear mod(64, 48, r, true, 3);
  const at::Tensor x = ::torch::randn({32, 64}).set_requires_grad(true);
  const at::Tensor y = mod->forward(x);
  const at::Tensor dy = ::torch::randn_like(y);
  y.backward(dy);
  const at::Tensor w = mod->weight.detach();
  const at::Tensor xq = fq(x, r, false, false, lowp::Layout::rowwise);
  const at::Tensor wq = fq(w, r, false, true, lowp::Layout::rowwise);
  EXPECT_TRUE(::torch::equal(y, at::matmul(xq, wq.t()) + mod->bias.detach())) << GetParam();
  std::vector<std::uint32_t> r0, r1;
  if (r.stochastic_rounding) {
    r0 = module_words(3, 0, static_cast<std::size_t>(dy.numel()));
    r1 = module_words(3, 1, static_cast<std::size_t>(dy.numel()));
  }
  const at::Tensor dyq = fq(dy, r, true, false, lowp::Layout::rowwise, false, r0);
  const at::Tensor wc = fq(w, r, false, true, r.per_tensor() ? lowp::Layout::rowwise : lowp::Layout::columnwise);
  EXPECT_TRUE(::torch::equal(x.grad(), at::matmul(dyq, wc))) << GetParam();
  const at::Tensor dyc = r.per_tensor() ? dyq : fq(dy, r, true, false, lowp::Layout::columnwise, r.rht, r1);
  const at::Tensor xc = r.per_tensor() ? xq : fq(x, r, false, false, lowp::Layout::columnwise, r.rht);
  EXPECT_TRUE(::torch::equal(mod->weight.grad(), at::matmul(dyc.t(), xc))) << GetParam();
  EXPECT_TRUE(::torch::equal(mod->bias.grad(), dy.sum(0))) << GetParam();
  EXPECT_GT(mod->stats(OperandRole::x).amax, 0.0f);
  EXPECT_EQ(mod->stats(OperandRole::dy).elements, static_cast<std::uint64_t>(dy.numel()));
}

INSTANTIATE_TEST_SUITE_P(Recipes, LowPrecisionLinearGemms,
                         ::testing::Values("fp8-current", "mxfp8", "fp8-block", "nvfp4", "mxfp4"));

TEST(LowPrecisionLinear, DelayedScalingHistoryAndState) {
  ::torch::manual_seed(4);
  lowp::RecipeChoice c = lowp::RecipeChoice::of(lowp::Recipe::fp8_delayed);
  c.amax_history_len = 2;
  const lowp::LinearRecipe r = *lowp::resolve(c);
  LowPrecisionLinear mod(16, 16, r);
  std::vector<float> amax, scales;
  for (float s : {1.0f, 4.0f, 0.5f, 0.5f}) {
    const at::Tensor x = ::torch::randn({8, 16}) * s;
    mod->forward(x).sum().backward();
    amax.push_back(x.abs().max().item<float>());
    scales.push_back(mod->scale[0].item<float>());
  }
  for (std::size_t i = 0; i < 4; ++i) {
    const float window = i == 0 ? amax[0] : std::max(amax[i - 1], amax[i]);
    EXPECT_EQ(scales[i], 448.0f / window) << i;
  }
  LowPrecisionLinear other(16, 16, r);
  ::torch::NoGradGuard no_grad;
  other->weight.copy_(mod->weight);
  other->bias.copy_(mod->bias);
  other->amax_history.copy_(mod->amax_history);
  other->scale.copy_(mod->scale);
  const at::Tensor x = ::torch::randn({8, 16}) * 3;
  EXPECT_TRUE(::torch::equal(mod->forward(x), other->forward(x)));
}

TEST(LowPrecision, UniformKeepsFirstAndLastHigh) {
  const LowPrecision plan = LowPrecision::uniform("mxfp8");
  EXPECT_FALSE(plan.recipe_for("a", 0, 4).has_value());
  EXPECT_EQ(plan.recipe_for("b", 1, 4)->recipe, lowp::Recipe::mxfp8);
  EXPECT_FALSE(plan.recipe_for("d", 3, 4).has_value());
  auto m = plan.linear("b", 1, 4, 8, 8);
  EXPECT_NE(m.ptr()->name().find("LowPrecisionLinear"), std::string::npos) << m.ptr()->name();
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { LowPrecision::uniform("fp4"); }),
            "recipe: expected one of fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4 or a zoo name "
            "(high_precision_fwd_mxfp8_bwd, mxfp8_fwd_high_precision_bwd, mxfp8_fwd_nvfp4_bwd, nvfp4_1d_weight), found 'fp4'");
}

TEST(LowPrecision, FromRecipeFile) {
  test::TempDir dir("lowp_plan");
  const std::string path = (dir.path() / "assign.json").string();
  std::ofstream(path) << R"({"format":"mixprec.low_precision","version":1,"default":"nvfp4",
    "modules":{"fc0":"bf16","fc1":{"recipe":"fp8-delayed","amax_history_len":16}}})";
  const LowPrecision plan = LowPrecision::from_file(path);
  EXPECT_FALSE(plan.recipe_for("fc0", 0, 3).has_value());
  EXPECT_EQ(plan.recipe_for("fc1", 1, 3)->amax_history_len, 16u);
  EXPECT_EQ(plan.recipe_for("fc2", 2, 3)->recipe, lowp::Recipe::nvfp4);
  EXPECT_TRUE(plan.recipe_for("fc2", 2, 3)->rht);
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { plan.check_names({"fc1", "fc2"}); }),
            "recipe file: module 'fc0': expected a Linear of the model, found no such Linear");
  std::ofstream(path) << R"({"format":"mixprec.low_precision","version":2,"modules":{}})";
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { LowPrecision::from_file(path); }),
            path + ": recipe file: version: expected 1, found 2");
}

}  // namespace
}  // namespace mixprec::torch
