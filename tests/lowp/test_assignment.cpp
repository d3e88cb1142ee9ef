// lowp::resolve (TE's defaults per recipe, options that do not fit) and the recipe file:
// parse, check, write, read back.
#include <gtest/gtest.h>

#include <string>

#include "mixprec/lowp/assignment.hpp"
#include "support.hpp"

namespace mixprec::lowp {
namespace {

using test::error_of;

LinearRecipe resolved(Recipe r, RecipeChoice c = {}) {
  c.recipe = r;
  return *resolve(c);
}

TEST(LowpResolve, TeDefaultsPerRecipe) {
  EXPECT_EQ(resolved(Recipe::fp8_delayed).fp8_format, lowp::Format::hybrid);
  EXPECT_EQ(resolved(Recipe::fp8_current).fp8_format, lowp::Format::hybrid);
  EXPECT_EQ(resolved(Recipe::mxfp8).fp8_format, lowp::Format::e4m3);
  EXPECT_EQ(resolved(Recipe::fp8_block).fp8_format, lowp::Format::e4m3);
  EXPECT_TRUE(resolved(Recipe::fp8_block).weight_2d);
  const LinearRecipe n = resolved(Recipe::nvfp4);
  EXPECT_TRUE(n.weight_2d && n.rht && n.stochastic_rounding);
  EXPECT_FALSE(resolved(Recipe::mxfp4).stochastic_rounding);
  EXPECT_EQ(resolved(Recipe::fp8_delayed).amax_history_len, 1024u);
  // The element per operand: E5M2 gradients under HYBRID, E2M1 for fp4.
  EXPECT_EQ(resolved(Recipe::fp8_current).element(true), Element::e5m2);
  EXPECT_EQ(resolved(Recipe::fp8_current).element(false), Element::e4m3);
  EXPECT_EQ(resolved(Recipe::mxfp8).element(true), Element::e4m3);
  EXPECT_EQ(resolved(Recipe::nvfp4).element(true), Element::e2m1);
  // torchao: none of TE's extras.
  RecipeChoice t;
  t.flavour = Flavour::torchao;
  const LinearRecipe nt = resolved(Recipe::nvfp4, t);
  EXPECT_FALSE(nt.weight_2d || nt.rht || nt.stochastic_rounding);
  EXPECT_FALSE(resolve(RecipeChoice{}).has_value());  // "bf16"
}

TEST(LowpResolve, OptionsMustFitTheRecipe) {
  RecipeChoice c;
  c.scale_rounding = ScaleRounding::floor;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { resolved(Recipe::nvfp4, c); }),
            "scale_rounding: only mxfp8 and mxfp4 have it, found it with nvfp4");
  c = {};
  c.rht = true;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { resolved(Recipe::mxfp8, c); }), "rht: only nvfp4 have it, found it with mxfp8");
  c = {};
  c.flavour = Flavour::torchao;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { resolved(Recipe::fp8_block, c); }),
            "flavour torchao: only mxfp8, mxfp4 and nvfp4 have it, found it with fp8-block");
  c.rht = true;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { resolved(Recipe::nvfp4, c); }),
            "flavour torchao: weight_2d, rht and stochastic_rounding are TE's (leave them unset or false)");
  // Shared defaults reach only the recipes that have the option.
  RecipeChoice shared;
  shared.amax_history_len = 16;
  shared.rht = false;
  EXPECT_EQ(resolve(RecipeChoice::of(Recipe::fp8_delayed), shared)->amax_history_len, 16u);
  EXPECT_FALSE(resolve(RecipeChoice::of(Recipe::nvfp4), shared)->rht);
  EXPECT_EQ(resolve(RecipeChoice::of(Recipe::mxfp8), shared)->recipe, Recipe::mxfp8);
}

constexpr const char* kFile = R"({
  "format": "mixprec.low_precision", "version": 1, "default": "nvfp4",
  "options": {"amax_history_len": 32},
  "modules": {"h.0.fc": "bf16", "h.0.proj": {"recipe": "fp8-delayed", "margin": 1},
              "h.1.fc": {"recipe": "mxfp4", "scale_rounding": "floor"}},
  "notes": "by hand"})";

TEST(LowpAssignment, ParseWriteRead) {
  const Assignment a = parse_assignment(kFile);
  ASSERT_EQ(a.modules.size(), 3u);
  EXPECT_FALSE(resolve(a.modules[0].second, a.options).has_value());
  const LinearRecipe p = *resolve(a.modules[1].second, a.options);
  EXPECT_EQ(p.margin, 1);
  EXPECT_EQ(p.amax_history_len, 32u);
  EXPECT_EQ(resolve(a.modules[2].second, a.options)->scale_rounding, ScaleRounding::floor);
  EXPECT_EQ(resolve(a.default_choice, a.options)->recipe, Recipe::nvfp4);
  EXPECT_EQ(a.notes, "by hand");
  EXPECT_EQ(parse_assignment(to_json(a)), a);
}

TEST(LowpAssignment, ErrorsNameTheField) {
  auto err = [](const std::string& text) { return error_of<std::invalid_argument>([&] { parse_assignment(text); }); };
  EXPECT_EQ(err("[1]"), "recipe file: expected a JSON object, found [1]");
  EXPECT_EQ(err(R"({"format":"x","version":1,"modules":{}})"), "recipe file: format: expected \"mixprec.low_precision\", found \"x\"");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","modules":{}})"), "recipe file: version: expected 1, found nothing");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1,"modules":{},"extra":1})"),
            "recipe file: extra: unknown field; expected format, version, default, options, modules, notes");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1})"),
            "recipe file: modules: expected an object (module name -> recipe)");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1,"modules":{"a":"fp4"}})"),
            "recipe file: modules[\"a\"]: expected one of fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4 or "
            "\"bf16\", found \"fp4\"");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1,"modules":{"a":{"recipe":"nvfp4","margin":1}}})"),
            "recipe file: modules[\"a\"]: amax_history_len/amax_compute_algo/margin: only fp8-delayed have it, found it "
            "with nvfp4");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1,"modules":{"a":{"recipe":"mxfp8","rhtt":true}}})")
                .substr(0, 46),
            "recipe file: modules[\"a\"].rhtt: unknown option");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1,"modules":{"a":{"recipe":"bf16","rht":true}}})"),
            "recipe file: modules[\"a\"]: \"bf16\" takes no options");
  // A shared option that no module's recipe (nor the default's) has is a mistake, not ignored.
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1,"options":{"rht":true},"modules":{"a":"mxfp8"}})"),
            "recipe file: options.rht: no module's recipe has this option");
}

}  // namespace
}  // namespace mixprec::lowp
