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
            "recipe file: extra: unknown field; expected format, version, default, options, modules, schedule, "
            "evaluation, notes");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1})"),
            "recipe file: modules: expected an object (module name -> recipe)");
  EXPECT_EQ(err(R"({"format":"mixprec.low_precision","version":1,"modules":{"a":"fp4"}})"),
            "recipe file: modules[\"a\"]: expected one of fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4, "
            "\"bf16\" or a zoo name (high_precision_fwd_mxfp8_bwd, mxfp8_fwd_high_precision_bwd, mxfp8_fwd_nvfp4_bwd, "
            "nvfp4_1d_weight), found \"fp4\"");
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


// ---- per-operand plans, TE's zoo, schedules ----------------------------------------------

std::string file_with(const std::string& fields) {
  return R"({"format":"mixprec.low_precision","version":1,)" + fields + "}";
}

LinearRecipe plain_nvfp4() {
  RecipeChoice c = RecipeChoice::of(Recipe::nvfp4);
  c.weight_2d = c.rht = c.stochastic_rounding = false;
  return *resolve(c);
}

TEST(LowpPlan, ZooNamesGiveTeAssignments) {
  const LinearRecipe mx = resolved(Recipe::mxfp8), nv = resolved(Recipe::nvfp4);
  using O = Operand;
  // high_precision_fwd_mxfp8_bwd: identity rowwise x and w; MXFP8 columnwise copies and dy.
  LinearPlan p = plan(zoo_choice(Zoo::high_precision_fwd_mxfp8_bwd));
  EXPECT_FALSE(p.at(O::fprop_x) || p.at(O::fprop_w));
  for (const O o : {O::dgrad_dy, O::dgrad_w, O::wgrad_x, O::wgrad_dy}) EXPECT_EQ(p.at(o), mx) << operand_name(o);
  EXPECT_EQ(p.x_source, Source::original);
  EXPECT_EQ(p.w_source, Source::original);
  // mxfp8_fwd_high_precision_bwd: backward_override "dequantized".
  p = plan(zoo_choice(Zoo::mxfp8_fwd_high_precision_bwd));
  EXPECT_EQ(p.at(O::fprop_x), mx);
  EXPECT_EQ(p.at(O::fprop_w), mx);
  for (const O o : {O::dgrad_dy, O::dgrad_w, O::wgrad_x, O::wgrad_dy}) EXPECT_FALSE(p.at(o)) << operand_name(o);
  EXPECT_EQ(p.x_source, Source::dequantized);
  EXPECT_EQ(p.w_source, Source::dequantized);
  // mxfp8_fwd_nvfp4_bwd: TE's NVFP4 factory for dy and wgrad's x, plain 1-D NVFP4 for dgrad's
  // w (from fprop's dequantized w), wgrad's x from the original.
  p = plan(zoo_choice(Zoo::mxfp8_fwd_nvfp4_bwd));
  EXPECT_EQ(p.at(O::fprop_x), mx);
  EXPECT_EQ(p.at(O::fprop_w), mx);
  EXPECT_EQ(p.at(O::dgrad_dy), nv);
  EXPECT_EQ(p.at(O::dgrad_w), plain_nvfp4());
  EXPECT_EQ(p.at(O::wgrad_x), nv);
  EXPECT_EQ(p.at(O::wgrad_dy), nv);
  EXPECT_EQ(p.x_source, Source::original);
  EXPECT_EQ(p.w_source, Source::dequantized);
  // Per operand: RHT on wgrad's x and dy only, stochastic rounding on dy only, 2-D tiles off.
  EXPECT_TRUE(p.config(O::wgrad_x).rht && p.config(O::wgrad_dy).rht);
  EXPECT_FALSE(p.config(O::dgrad_dy).rht || p.config(O::dgrad_w).rht);
  EXPECT_TRUE(p.config(O::dgrad_dy).stochastic_rounding && p.config(O::wgrad_dy).stochastic_rounding);
  EXPECT_FALSE(p.config(O::wgrad_x).stochastic_rounding || p.config(O::dgrad_w).stochastic_rounding);
  EXPECT_FALSE(p.config(O::dgrad_w).tile_2d);
  EXPECT_EQ(p.config(O::dgrad_w).layout, Layout::columnwise);
  EXPECT_EQ(p.config(O::fprop_x).element, Element::e4m3);
  // nvfp4_1d_weight: plain 1-D NVFP4 weights in both directions, everything else TE's NVFP4.
  p = plan(zoo_choice(Zoo::nvfp4_1d_weight));
  EXPECT_EQ(p.at(O::fprop_w), plain_nvfp4());
  EXPECT_EQ(p.at(O::dgrad_w), plain_nvfp4());
  for (const O o : {O::fprop_x, O::dgrad_dy, O::wgrad_x, O::wgrad_dy}) EXPECT_EQ(p.at(o), nv) << operand_name(o);
  EXPECT_EQ(p.w_source, Source::dequantized);
  EXPECT_FALSE(p.uniform());
  // A plain recipe is uniform; its per-operand configs are TE's single-recipe ones.
  p = plan(RecipeChoice::of(Recipe::nvfp4));
  ASSERT_TRUE(p.uniform());
  EXPECT_TRUE(p.config(O::fprop_w).tile_2d);
  EXPECT_FALSE(p.config(O::fprop_x).rht);
  EXPECT_FALSE(plan(RecipeChoice{}).any_quantized());
}

TEST(LowpPlan, FileEntriesPerDirection) {
  const Assignment a = parse_assignment(file_with(R"(
    "modules": {
      "a": {"recipe": "nvfp4", "fprop": "bf16"},
      "b": {"recipe": "mxfp8", "dgrad": {"dy": "nvfp4", "w": {"recipe": "nvfp4", "weight_2d": false, "rht": false,
             "stochastic_rounding": false}}, "wgrad": "nvfp4", "columnwise_source": {"w": "dequantized"}},
      "c": {"recipe": "fp8-current", "backward_override": "high_precision"},
      "d": {"recipe": "bf16", "fprop": {"x": "mxfp8", "w": "mxfp8"}},
      "e": "mxfp8_fwd_nvfp4_bwd",
      "f": {"recipe": "mxfp8", "scale_rounding": "floor", "wgrad": {"x": "mxfp8"}}
    })"));
  using O = Operand;
  const LinearPlan pa = plan(a.entry("a"), a.options);
  EXPECT_FALSE(pa.at(O::fprop_x) || pa.at(O::fprop_w));
  EXPECT_EQ(pa.at(O::wgrad_x), resolved(Recipe::nvfp4));
  // Written by hand, b is the zoo's mxfp8_fwd_nvfp4_bwd.
  EXPECT_EQ(plan(a.entry("b")), plan(a.entry("e")));
  EXPECT_EQ(a.entry("e").zoo, Zoo::mxfp8_fwd_nvfp4_bwd);
  const LinearPlan pc = plan(a.entry("c"));
  EXPECT_EQ(pc.at(O::fprop_x), resolved(Recipe::fp8_current));
  EXPECT_FALSE(pc.at(O::dgrad_dy) || pc.at(O::wgrad_x));
  EXPECT_EQ(pc.x_source, Source::original);
  const LinearPlan pd = plan(a.entry("d"));
  EXPECT_EQ(pd.at(O::fprop_w), resolved(Recipe::mxfp8));
  EXPECT_FALSE(pd.at(O::dgrad_w));
  EXPECT_EQ(pd.primary(), resolved(Recipe::mxfp8));
  // The entry's options reach its operands: f's wgrad.x rounds with floor as its fprop does.
  EXPECT_EQ(plan(a.entry("f")).at(O::wgrad_x)->scale_rounding, ScaleRounding::floor);
  EXPECT_EQ(plan(a.entry("f")).at(O::dgrad_dy)->scale_rounding, ScaleRounding::floor);
  // Written and read back: the same assignment.
  EXPECT_EQ(parse_assignment(to_json(a)), a);
  EXPECT_EQ(parse_assignment(to_json(a)).entry("e").zoo, Zoo::mxfp8_fwd_nvfp4_bwd);
}

TEST(LowpPlan, RulesAreCheckedAndNamed) {
  auto err = [](const std::string& modules) {
    return error_of<std::invalid_argument>([&] { parse_assignment(file_with(R"("modules": {"m": )" + modules + "}")); });
  };
  EXPECT_EQ(err(R"({"recipe": "fp8-delayed", "wgrad": "mxfp8"})"),
            "recipe file: modules[\"m\"]: wgrad.x: fp8-delayed keeps one amax history per tensor, so it combines only "
            "with high precision; found mxfp8 beside it");
  EXPECT_EQ(err(R"({"recipe": "nvfp4", "wgrad": {"dy": "mxfp8"}})"),
            "recipe file: modules[\"m\"]: wgrad: the Hadamard transform cancels only when both operands have it; "
            "found it on x alone (set rht the same on wgrad.x and wgrad.dy)");
  EXPECT_EQ(err(R"({"recipe": "nvfp4", "wgrad": {"dy": "bf16"}})"),
            "recipe file: modules[\"m\"]: wgrad: the Hadamard transform cancels only when both operands have it; "
            "found one operand in high precision (set rht false on the quantized one)");
  EXPECT_EQ(err(R"({"recipe": "mxfp8", "fprop": {"x": "bf16"}, "columnwise_source": "dequantized"})"),
            "recipe file: modules[\"m\"]: columnwise_source.x: \"dequantized\" takes the values fprop multiplied, but "
            "fprop.x is high precision");
  EXPECT_EQ(err(R"({"recipe": "mxfp8", "backward_override": "dequantized", "dgrad": "nvfp4"})"),
            "recipe file: modules[\"m\"]: dgrad.dy: backward_override sets every backward operand (remove one of the two)");
  EXPECT_EQ(err(R"({"recipe": "mxfp8", "backward_override": "sideways"})"),
            "recipe file: modules[\"m\"].backward_override: expected \"high_precision\" or \"dequantized\", found \"sideways\"");
  EXPECT_EQ(err(R"({"recipe": "mxfp8", "fprop": {"dy": "nvfp4"}})"),
            "recipe file: modules[\"m\"].fprop.dy: unknown operand; expected \"x\", \"w\" or \"recipe\" (an entry for both)");
  EXPECT_EQ(err(R"({"recipe": "mxfp8", "dgrad": "mxfp8_fwd_nvfp4_bwd"})"),
            "recipe file: modules[\"m\"].dgrad: expected one of fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, "
            "mxfp4, \"bf16\", found \"mxfp8_fwd_nvfp4_bwd\"");
  EXPECT_EQ(err(R"({"recipe": "mxfp8_fwd_nvfp4_bwd", "margin": 1})"),
            "recipe file: modules[\"m\"]: a zoo name (\"mxfp8_fwd_nvfp4_bwd\") takes no other fields");
  EXPECT_EQ(err(R"({"recipe": "mxfp8", "wgrad": {"recipe": "nvfp4", "fprop": "bf16"}})"),
            "recipe file: modules[\"m\"].wgrad.fprop: not allowed here (an operand's own entry)");
  EXPECT_EQ(err(R"({"recipe": "mxfp8", "wgrad": {"x": {"recipe": "mxfp8", "rht": true}}})"),
            "recipe file: modules[\"m\"]: wgrad.x: rht: only nvfp4 have it, found it with mxfp8");
  EXPECT_EQ(err(R"({"recipe": "bf16", "margin": 2, "fprop": "fp8-delayed"})"),
            "recipe file: modules[\"m\"]: \"bf16\" takes no options");
}

TEST(LowpSchedule, PhasesSwitchModulesInTime) {
  const Assignment a = parse_assignment(file_with(R"(
    "default": "nvfp4",
    "modules": {"lm_head": "bf16", "h.0.attn.qkv": {"recipe": "nvfp4", "wgrad": "mxfp8", "rht": false}},
    "schedule": [
      {"from_fraction": 0.9, "fprop": "bf16", "label": "forward to bf16 before decay"},
      {"from_step": 50, "modules": ["h.*.mlp.*"], "recipe": "mxfp8"}
    ],
    "evaluation": "bf16")"));
  ASSERT_EQ(a.schedule.size(), 2u);
  EXPECT_EQ(a.schedule[0].label, "forward to bf16 before decay");
  EXPECT_EQ(a.schedule[1].label, "phase 2");
  EXPECT_TRUE(a.schedule[1].replace_entry);
  EXPECT_FALSE(a.schedule[0].replace_entry);
  ASSERT_TRUE(a.evaluation.has_value());
  EXPECT_FALSE(plan(*a.evaluation).any_quantized());
  // A fraction needs the run's length.
  EXPECT_EQ(error_of<std::invalid_argument>([&] { a.choice_at("h.1.mlp.fc", 10); }),
            "recipe file: schedule[0].from_fraction: the run's length is needed to turn a fraction into a step; "
            "give the door the number of steps (or use from_step)");
  EXPECT_EQ(a.phase_starts(100), (std::vector<std::uint64_t>{90, 50}));
  EXPECT_EQ(a.phase_starts(101), (std::vector<std::uint64_t>{91, 50}));  // ceil
  using O = Operand;
  const LinearRecipe nv = resolved(Recipe::nvfp4), mx = resolved(Recipe::mxfp8);
  // Before any phase: the entries.
  EXPECT_EQ(plan(a.choice_at("h.1.mlp.fc", 49, 100)), plan(RecipeChoice::of(Recipe::nvfp4)));
  EXPECT_EQ(a.phases_begun(49, 100), 0u);
  // From step 50 the MLP Linears run mxfp8 (the phase names "recipe": the whole entry).
  EXPECT_EQ(plan(a.choice_at("h.1.mlp.fc", 50, 100)).uniform(), mx);
  EXPECT_EQ(plan(a.choice_at("h.1.attn.proj", 50, 100)).uniform(), nv);
  EXPECT_EQ(a.phases_begun(50, 100), 1u);
  // From step 90 every Linear's forward is bf16; the backward keeps the entry's recipe.
  const LinearPlan late = plan(a.choice_at("h.1.attn.proj", 90, 100));
  EXPECT_FALSE(late.at(O::fprop_x) || late.at(O::fprop_w));
  EXPECT_EQ(late.at(O::dgrad_dy), nv);
  const LinearPlan qkv = plan(a.choice_at("h.0.attn.qkv", 95, 100));
  EXPECT_FALSE(qkv.at(O::fprop_x));
  EXPECT_EQ(qkv.at(O::wgrad_x), mx);
  EXPECT_FALSE(qkv.at(O::dgrad_dy)->rht);  // the entry's own option stays
  const LinearPlan mlp = plan(a.choice_at("h.1.mlp.fc", 95, 100));  // both phases, in the order they begin
  EXPECT_FALSE(mlp.at(O::fprop_x));
  EXPECT_EQ(mlp.at(O::wgrad_dy), mx);
  EXPECT_FALSE(plan(a.choice_at("lm_head", 95, 100)).at(O::dgrad_dy));
  EXPECT_EQ(a.phases_begun(99, 100), 2u);
  // Written and read back.
  EXPECT_EQ(parse_assignment(to_json(a)), a);
}

TEST(LowpSchedule, ErrorsNameThePhase) {
  auto err = [](const std::string& schedule) {
    return error_of<std::invalid_argument>([&] {
      parse_assignment(file_with(R"("default": "nvfp4", "modules": {"a": "fp8-delayed"}, "schedule": )" + schedule));
    });
  };
  EXPECT_EQ(err(R"({"from_step": 3})"), "recipe file: schedule: expected an array of phases, found {\"from_step\":3}");
  EXPECT_EQ(err(R"([{"fprop": "bf16"}])"),
            "recipe file: schedule[0]: expected exactly one of from_step and from_fraction, found neither");
  EXPECT_EQ(err(R"([{"from_step": 1, "from_fraction": 0.5, "fprop": "bf16"}])"),
            "recipe file: schedule[0]: expected exactly one of from_step and from_fraction, found both");
  EXPECT_EQ(err(R"([{"from_fraction": 1.5, "fprop": "bf16"}])"),
            "recipe file: schedule[0].from_fraction: expected a number in [0, 1), found 1.5");
  EXPECT_EQ(err(R"([{"from_fraction": 1, "fprop": "bf16"}])"),
            "recipe file: schedule[0].from_fraction: expected a number in [0, 1), found 1");
  EXPECT_EQ(err(R"([{"from_step": -2, "fprop": "bf16"}])"),
            "recipe file: schedule[0].from_step: expected an integer >= 0, found -2");
  EXPECT_EQ(err(R"([{"from_step": 2}])"),
            "recipe file: schedule[0]: expected what the phase changes (recipe, fprop, dgrad, wgrad, backward_override, "
            "columnwise_source or an option), found nothing");
  EXPECT_EQ(err(R"([{"from_step": 2, "modules": [], "fprop": "bf16"}])"),
            "recipe file: schedule[0].modules: expected a non-empty array of module names or patterns, found []");
  // A change that breaks a rule over an entry it reaches: the fp8-delayed module's wgrad to mxfp8.
  EXPECT_EQ(err(R"([{"from_step": 2, "wgrad": "mxfp8"}])"),
            "recipe file: schedule[0]: over modules[\"a\"]: wgrad.x: fp8-delayed keeps one amax history per tensor, so "
            "it combines only with high precision; found mxfp8 beside it");
  EXPECT_EQ(err(R"([{"from_step": 2, "modules": ["b*"], "wgrad": {"x": "mxfp8"}}])"),
            "recipe file: schedule[0]: over the default: wgrad: the Hadamard transform cancels only when both operands "
            "have it; found it on dy alone (set rht the same on wgrad.x and wgrad.dy)");
  EXPECT_EQ(err(R"([{"from_step": 2, "when": 3}])"),
            "recipe file: schedule[0].when: unknown option; expected one of recipe, amax_compute_algo, amax_history_len, "
            "flavour, fp8_format, margin, power_of_2_scales, rht, scale_rounding, stochastic_rounding, weight_2d, fprop, "
            "dgrad, wgrad, backward_override, columnwise_source");
}

TEST(LowpSchedule, ApplyChangeAndPatterns) {
  EXPECT_TRUE(module_matches("h.*.mlp.*", "h.10.mlp.fc"));
  EXPECT_TRUE(module_matches("*", "lm_head"));
  EXPECT_TRUE(module_matches("lm_head", "lm_head"));
  EXPECT_FALSE(module_matches("lm_head", "lm_head2"));
  EXPECT_FALSE(module_matches("h.*.mlp", "h.1.mlp.fc"));
  EXPECT_TRUE(module_matches("*fc*", "h.1.mlp.fc"));
  EXPECT_FALSE(module_matches("*.proj", "h.1.attn.qkv"));
  // A backward_override drops the base's backward choices; a backward choice drops it.
  RecipeChoice base = RecipeChoice::of(Recipe::mxfp8);
  base.operand_ids = {Operand::wgrad_x, Operand::fprop_x};
  base.operand_choices = {RecipeChoice::of(Recipe::nvfp4), RecipeChoice{}};
  RecipeChoice ch;
  ch.backward_override = BackwardOverride::high_precision;
  RecipeChoice out = apply_change(base, ch);
  EXPECT_EQ(out.operand_ids, std::vector<Operand>{Operand::fprop_x});
  EXPECT_EQ(out.backward_override, BackwardOverride::high_precision);
  RecipeChoice ch2;
  ch2.operand_ids = {Operand::dgrad_dy};
  ch2.operand_choices = {RecipeChoice::of(Recipe::mxfp8)};
  out = apply_change(out, ch2);
  EXPECT_FALSE(out.backward_override);
  EXPECT_EQ(out.operand_ids, (std::vector<Operand>{Operand::fprop_x, Operand::dgrad_dy}));
  // A zoo entry changed is no longer written as the zoo's name.
  EXPECT_FALSE(apply_change(zoo_choice(Zoo::nvfp4_1d_weight), ch2).zoo);
}

}  // namespace
}  // namespace mixprec::lowp
