// Which recipe each Linear of a model runs, and its options: TE's per-GEMM use of a recipe
// (LinearRecipe, resolved with TE's defaults) and the versioned recipe file that holds a
// mixed assignment (module name -> recipe or "bf16"), as the precision advisor writes it.
// docs/low_precision.md, "The recipe file". Every door (libtorch, Python) reads and resolves
// through these functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/lowp/scaling.hpp"
#include "mixprec/lowp/quantize.hpp"

namespace mixprec::lowp {

// The six operands of a Linear's three GEMMs, each one use of its three tensors (TE's
// rowwise and columnwise copies):
//   fprop  y  = x w^T        x rowwise, w rowwise
//   dgrad  dx = dy w         dy rowwise, w columnwise
//   wgrad  dw = dy^T x       x columnwise, dy columnwise
enum class Operand : std::uint8_t { fprop_x, fprop_w, dgrad_dy, dgrad_w, wgrad_x, wgrad_dy };
inline constexpr std::size_t kOperands = 6;
std::string_view operand_name(Operand o) noexcept;  // "fprop.x", "fprop.w", "dgrad.dy", ...
std::optional<Operand> parse_operand(std::string_view s) noexcept;
constexpr bool is_gradient(Operand o) noexcept { return o == Operand::dgrad_dy || o == Operand::wgrad_dy; }
constexpr bool is_weight(Operand o) noexcept { return o == Operand::fprop_w || o == Operand::dgrad_w; }
constexpr Layout layout_of(Operand o) noexcept {
  return o == Operand::dgrad_w || o == Operand::wgrad_x || o == Operand::wgrad_dy ? Layout::columnwise
                                                                                   : Layout::rowwise;
}

// Where the backward copies of x and w come from (TE's HybridQuantizer columnwise_source): the
// original high-precision tensor, or the values the forward GEMM multiplied (dequantized from
// fprop's quantization; TE's "rowwise_dequantized").
enum class Source : std::uint8_t { original, dequantized };
std::string_view source_name(Source s) noexcept;  // "original", "dequantized"

// TE's recipe-level backward_override: both backward GEMMs in high precision, from the
// original x and w ("high_precision") or from the values fprop multiplied ("dequantized").
enum class BackwardOverride : std::uint8_t { high_precision, dequantized };
std::string_view backward_override_name(BackwardOverride b) noexcept;

// TE 2.x's quantizer-factory zoo (custom_recipes/quantizer_factory_zoo.py), Linear roles:
//   high_precision_fwd_mxfp8_bwd  fprop high precision; dgrad, wgrad MXFP8 (from the originals)
//   mxfp8_fwd_high_precision_bwd  fprop MXFP8; backward high precision from the dequantized
//                                 fprop x and w (backward_override "dequantized")
//   mxfp8_fwd_nvfp4_bwd           fprop MXFP8; dgrad and wgrad NVFP4 (TE's NVFP4 factory: RHT on
//                                 wgrad's x and dy, stochastic dy), dgrad's w plain 1-D NVFP4 (no
//                                 RHT, no stochastic rounding, no 2-D tiles) from fprop's
//                                 dequantized w; wgrad's x from the original
//   nvfp4_1d_weight               NVFP4 everywhere, w plain 1-D NVFP4 in fprop and dgrad, dgrad's
//                                 from fprop's dequantized w
enum class Zoo : std::uint8_t { high_precision_fwd_mxfp8_bwd, mxfp8_fwd_high_precision_bwd, mxfp8_fwd_nvfp4_bwd,
                                nvfp4_1d_weight };
std::string_view zoo_name(Zoo z) noexcept;
std::optional<Zoo> parse_zoo(std::string_view s) noexcept;
std::string zoo_names();  // the four names, comma separated

// The options of one Linear's recipe as written (unset: the recipe's TE default), with what
// its GEMM operands change (unset: every operand runs `recipe`).
struct RecipeChoice {
  std::optional<Recipe> recipe;                 // nullopt: "bf16" (the Linear stays in high precision)
  std::optional<lowp::Format> fp8_format;        // fp8 recipes: HYBRID or E4M3
  std::optional<std::size_t> amax_history_len;  // fp8-delayed
  std::optional<lowp::AmaxAlgo> amax_compute_algo;
  std::optional<int> margin;
  std::optional<bool> power_of_2_scales;        // fp8-current, fp8-block
  std::optional<ScaleRounding> scale_rounding;  // mxfp8, mxfp4
  std::optional<bool> weight_2d;                // fp8-block, nvfp4
  std::optional<bool> rht;                      // nvfp4
  std::optional<bool> stochastic_rounding;      // nvfp4, mxfp4
  std::optional<Flavour> flavour;
  // Per operand: the operand's own choice (recipe unset: high precision), over the
  // Linear's; operand_ids[i] is the operand of operand_choices[i], at most once each, in
  // the enum's order.
  std::vector<Operand> operand_ids;
  std::vector<RecipeChoice> operand_choices;
  std::optional<BackwardOverride> backward_override;
  std::optional<Source> x_source, w_source;  // of wgrad's x and dgrad's w
  std::optional<Zoo> zoo;                      // written as this zoo name (the fields above are its expansion)
  bool directional() const noexcept {
    return !operand_ids.empty() || backward_override || x_source || w_source || zoo;
  }
  static RecipeChoice of(std::optional<Recipe> r) {
    RecipeChoice c;
    c.recipe = r;
    return c;
  }
  friend bool operator==(const RecipeChoice&, const RecipeChoice&) = default;
};

// A recipe with every option decided (TE's defaults for what the choice left unset):
// fp8_format HYBRID for fp8-delayed / fp8-current, E4M3 for mxfp8 / fp8-block; history 1024,
// "max", margin 0; weight_2d for fp8-block and nvfp4; rht and stochastic rounding for nvfp4
// (all three TE's, so off under the torchao flavour).
struct LinearRecipe {
  Recipe recipe = Recipe::fp8_current;
  lowp::Format fp8_format = lowp::Format::hybrid;
  std::size_t amax_history_len = 1024;
  lowp::AmaxAlgo amax_compute_algo = lowp::AmaxAlgo::max;
  int margin = 0;
  std::optional<bool> power_of_2_scales;
  ScaleRounding scale_rounding = ScaleRounding::rceil;
  bool weight_2d = false;
  bool rht = false;
  bool stochastic_rounding = false;
  Flavour flavour = Flavour::te;

  // The element of each GEMM operand: E2M1 (fp4), E5M2 for gradients under HYBRID, else E4M3.
  Element element(bool gradient) const noexcept;
  // The QuantizeConfig of one operand (rowwise or columnwise; weights get the 2-D tiles).
  QuantizeConfig config(bool gradient, bool weight, Layout layout) const;
  bool per_tensor() const noexcept { return recipe == Recipe::fp8_delayed || recipe == Recipe::fp8_current; }
  friend bool operator==(const LinearRecipe&, const LinearRecipe&) = default;
};

// Applies the choice over `defaults` (an entry's own options win; a default reaches only the
// recipes that have that option), then TE's defaults; checks that every option of the choice
// fits its recipe. Throws std::invalid_argument naming the option. nullopt:
// the choice keeps the Linear in high precision ("bf16"). The Linear's own recipe only: its
// per-operand choices are plan()'s.
std::optional<LinearRecipe> resolve(const RecipeChoice& choice, const RecipeChoice& defaults = {});

// Every operand of one Linear decided: its recipe (nullopt: high precision, the fp32 value
// itself) and where the backward copies of x and w come from. The GEMMs (each door's):
//   y  = Q[fprop.x](x) Q[fprop.w](w)^T + b
//   dx = Q[dgrad.dy](dy) Q[dgrad.w](w')       w' = w, or D(Q[fprop.w](w)) when w_source is dequantized
//   dw = Q[wgrad.dy](dy)^T Q[wgrad.x](x')     x' = x, or D(Q[fprop.x](x)) when x_source is dequantized
// where Q quantizes with config(operand) and D dequantizes. Rules plan() checks: fp8-delayed
// (one amax history per tensor) combines only with high precision, every quantized operand
// the same recipe; RHT is on both wgrad operands or on neither; a dequantized source needs a
// quantized fprop operand.
struct LinearPlan {
  std::array<std::optional<LinearRecipe>, kOperands> operands;
  Source x_source = Source::original, w_source = Source::original;

  const std::optional<LinearRecipe>& at(Operand o) const noexcept { return operands[static_cast<std::size_t>(o)]; }
  // The QuantizeConfig of a quantized operand: its recipe's element, layout, 2-D tiles (w),
  // stochastic rounding (dy of an fp4 recipe with it on) and RHT (wgrad's x and dy of an nvfp4
  // recipe with it on; the door drops it where the batch is not a multiple of 16, on both).
  QuantizeConfig config(Operand o) const;
  // Every operand runs the same recipe from the originals (a plan written without per-operand
  // choices): that recipe. nullopt otherwise, or when all are high precision.
  std::optional<LinearRecipe> uniform() const;
  bool any_quantized() const noexcept;
  // The recipe a door reports the Linear by: fprop.x's, else the first quantized operand's.
  std::optional<LinearRecipe> primary() const;
  friend bool operator==(const LinearPlan&, const LinearPlan&) = default;
};

// Resolves the Linear's recipe and every operand's choice (an operand's own options, then the
// Linear's, then `defaults`, then TE's) and checks the rules above. Throws
// std::invalid_argument naming the operand and the rule. A choice without per-operand fields
// gives the uniform plan of resolve(choice) (every operand high precision for "bf16").
LinearPlan plan(const RecipeChoice& choice, const RecipeChoice& defaults = {});
// The choice a zoo name stands for (TE's assignments, above).
RecipeChoice zoo_choice(Zoo z);
// `change` written over `base` (a schedule phase over a module's entry): its set options,
// operand choices, backward_override and sources replace the base's (a backward_override
// drops the base's backward operand choices and sources; a backward operand choice drops the
// base's backward_override). A phase that names "recipe" replaces the entry instead.
RecipeChoice apply_change(const RecipeChoice& base, const RecipeChoice& change);

// The recipe file: {"format":"mixprec.low_precision","version":1,"default":...,"options":{...},
// "modules":{name: entry},"schedule":[phase...],"evaluation":entry,"notes":"..."}; an entry is a
// recipe name, "bf16", a zoo name, or an object with "recipe" and option fields and the
// per-direction fields "fprop", "dgrad", "wgrad" (an entry for both operands of that GEMM, or
// {"x"|"w"|"dy": entry}), "backward_override" and "columnwise_source" ("original" or
// "dequantized", or {"x": .., "w": ..}). A phase: {"from_step": N | "from_fraction": f,
// "modules": [pattern...], "label": "...", and the fields of an entry it changes}.
// docs/low_precision.md, "The recipe file".
inline constexpr std::string_view kAssignmentFormat = "mixprec.low_precision";
inline constexpr int kAssignmentVersion = 1;

// A switch in time (the recipe file's "schedule"): from a step (or a fraction of the run's
// steps, which the door that knows the run's length turns into a step) the modules matching
// `modules` (exact names or '*' wildcards; empty: every Linear) run their entry with `change`
// written over it (apply_change). Phases that have begun apply in the order of their first
// step (file order among equals): a later switch is written last.
struct Phase {
  std::optional<std::uint64_t> from_step;
  std::optional<double> from_fraction;  // in [0, 1): the phase covers the last (1 - f) of the run
  std::vector<std::string> modules;
  RecipeChoice change;
  bool replace_entry = false;  // the phase names "recipe" (or a zoo): `change` is the whole entry
  std::string label;  // what the run log and the report call the switch (default "phase N")
  friend bool operator==(const Phase&, const Phase&) = default;
};

struct Assignment {
  RecipeChoice default_choice;  // of every Linear not named (recipe unset: "bf16")
  RecipeChoice options;         // applied to every entry (recipe always unset)
  std::vector<std::pair<std::string, RecipeChoice>> modules;
  std::vector<Phase> schedule;
  // The recipe of evaluation forwards (Megatron's evaluation_recipe): nullopt: the training
  // recipe; a choice with recipe unset: high precision.
  std::optional<RecipeChoice> evaluation;
  std::string notes;
  friend bool operator==(const Assignment&, const Assignment&) = default;

  // The entry of `module` before any phase: its own, else the default.
  const RecipeChoice& entry(std::string_view module) const;
  // Steps are counted from 0 (step N is the (N+1)-th optimizer step; a run log's line N+1).
  // The first step of each phase for a run of `total_steps` (0: unknown; a phase given as a
  // fraction then throws std::invalid_argument saying the door must be told the run's length):
  // from_step, or ceil(fraction * total_steps).
  std::vector<std::uint64_t> phase_starts(std::uint64_t total_steps) const;
  // The entry of `module` at `step` (0-based optimizer step): its entry with every phase that
  // has begun and matches it written over it, in the order of their first steps.
  RecipeChoice choice_at(std::string_view module, std::uint64_t step, std::uint64_t total_steps = 0) const;
  // How many phases have begun at `step` (the phase index the run is in; 0 before any).
  std::size_t phases_begun(std::uint64_t step, std::uint64_t total_steps = 0) const;
};
// '*' matches any run of characters (dots included); everything else itself.
bool module_matches(std::string_view pattern, std::string_view name) noexcept;

// Reads and checks the whole file (format, version, fields, every entry resolved) before
// returning; std::invalid_argument says which field and what was expected. The text is read
// through the core's JSON reader (io::parse_json: depth, duplicate keys, BOM).
Assignment parse_assignment(std::string_view json);
// The recipe file at `path` (a regular file, io::read_json_text), parsed by parse_assignment;
// errors are prefixed with the path.
Assignment read_assignment(const std::string& path);
std::string to_json(const Assignment& a);

}  // namespace mixprec::lowp
