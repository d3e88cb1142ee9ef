// Which recipe each Linear of a model runs, and its options: TE's per-GEMM use of a recipe
// (LinearRecipe, resolved with TE's defaults) and the versioned recipe file that holds a
// mixed assignment (module name -> recipe or "bf16"), as the precision advisor writes it.
// docs/low_precision.md, "The recipe file". Every door (libtorch, Python) reads and resolves
// through these functions.
#pragma once

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

// The options of one Linear's recipe as written (unset: the recipe's TE default).
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
// the choice keeps the Linear in high precision ("bf16").
std::optional<LinearRecipe> resolve(const RecipeChoice& choice, const RecipeChoice& defaults = {});

// The recipe file: {"format":"mixprec.low_precision","version":1,"default":...,"options":{...},
// "modules":{name: entry},"notes":"..."}; an entry is a recipe name, "bf16", or an object with
// "recipe" and option fields.
inline constexpr std::string_view kAssignmentFormat = "mixprec.low_precision";
inline constexpr int kAssignmentVersion = 1;

struct Assignment {
  RecipeChoice default_choice;  // of every Linear not named (recipe unset: "bf16")
  RecipeChoice options;         // applied to every entry (recipe always unset)
  std::vector<std::pair<std::string, RecipeChoice>> modules;
  std::string notes;
  friend bool operator==(const Assignment&, const Assignment&) = default;
};

// Reads and checks the whole file (format, version, fields, every entry resolved) before
// returning; std::invalid_argument says which field and what was expected. The text is read
// through the core's JSON reader (io::parse_json: depth, duplicate keys, BOM).
Assignment parse_assignment(std::string_view json);
// The recipe file at `path` (a regular file, io::read_json_text), parsed by parse_assignment;
// errors are prefixed with the path.
Assignment read_assignment(const std::string& path);
std::string to_json(const Assignment& a);

}  // namespace mixprec::lowp
