// Low-precision quantization recipes of NVIDIA Transformer Engine (TE) on a 2-D tensor:
// FP8 per tensor (delayed and current scaling), MXFP8 and MXFP4 (E8M0 scale per 32),
// FP8 block scaling (1x128 / 128x128, fp32 scales) and NVFP4 (E2M1 elements, E4M3 scale
// per 16, fp32 tensor scale, optional 16-point random Hadamard transform and stochastic
// rounding). docs/low_precision.md gives every formula and the TE source it follows.
//
// The recipe names are one table (recipe_table()) read by every door: the CLI, libtorch,
// Python (mixprec.quantize, mixprec.torch.low_precision) and the engine.
//
// Layout: the input is row-major [rows, cols] fp32. A rowwise quantization puts its blocks
// along each row; a columnwise one quantizes the transpose (blocks run down the columns)
// and stores codes and scales in the transposed [cols, rows] grid, as TE stores the
// columnwise copies that the dgrad/wgrad GEMMs read. A last block of a row may be shorter
// (TE pads with zeros, which do not change a block's amax).
//
// quantize() runs the dispatched kernels (scalar, AVX2 or AVX-512, picked once by
// core/isa.hpp); reference::quantize() is the plain element loop they are tested against
// bit for bit. Errors (std::invalid_argument, before anything is written) name the field,
// what was expected and what was found.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/lowp/scaling.hpp"

namespace mixprec::lowp {

enum class Recipe : std::uint8_t { fp8_delayed, fp8_current, mxfp8, fp8_block, nvfp4, mxfp4 };
// How the scales are stored: one fp32 scale_inv per block (or per tensor), or one E8M0 /
// E4M3 code per block.
enum class ScaleFormat : std::uint8_t { f32, e8m0, e4m3 };
// Whose order of operations: Transformer Engine's (default) or torchao's (docs/low_precision.md
// names every difference; only mxfp8, mxfp4 and nvfp4 have a torchao flavour).
enum class Flavour : std::uint8_t { te, torchao };
enum class Layout : std::uint8_t { rowwise, columnwise };

// One row per recipe: the only list of names.
struct RecipeInfo {
  Recipe recipe;
  std::string_view name;        // "fp8-delayed", ...
  std::string_view te_recipe;   // the TE recipe class it follows
  Element element;              // the forward element format (E4M3 / E2M1)
  std::size_t block;            // elements per scale along a row: 0 = the whole tensor
  std::size_t tile_rows;        // rows of a 2-D (weight) tile: 128 (fp8-block), 16 (nvfp4), else 1
  ScaleFormat scale_format;
  bool tensor_scale;            // a second, per-tensor fp32 scale (nvfp4)
  std::string_view summary;
};
std::span<const RecipeInfo> recipe_table() noexcept;
const RecipeInfo& recipe_info(Recipe recipe) noexcept;
std::string_view recipe_name(Recipe recipe) noexcept;
std::optional<Recipe> parse_recipe(std::string_view name) noexcept;
std::string recipe_names();  // "fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4"
std::string_view element_name(Element e) noexcept;          // "e4m3", "e5m2", "e2m1"
std::optional<Element> parse_element(std::string_view name) noexcept;
std::string_view scale_rounding_name(ScaleRounding r) noexcept;  // "rceil", "floor"
std::optional<ScaleRounding> parse_scale_rounding(std::string_view name) noexcept;
std::string_view flavour_name(Flavour f) noexcept;            // "te", "torchao"
std::optional<Flavour> parse_flavour(std::string_view name) noexcept;
std::string_view layout_name(Layout l) noexcept;              // "rowwise", "columnwise"

inline constexpr float kFltMax = 0x1.fffffep127f;
inline constexpr float kBf16Max = 0x1.fep127f;

struct QuantizeConfig {
  Recipe recipe = Recipe::fp8_current;
  Element element = Element::e4m3;  // fp8 recipes: e4m3 or e5m2; nvfp4, mxfp4: e2m1
  Layout layout = Layout::rowwise;
  bool tile_2d = false;             // fp8-block: 128x128 tiles; nvfp4: 16x16 tiles (TE's weights)
  ScaleRounding scale_rounding = ScaleRounding::rceil;  // mxfp8, mxfp4
  std::optional<bool> power_of_2_scales;  // fp8-current (default false), fp8-block (default true)
  float amax_epsilon = 0.0f;        // fp8-current, fp8-block: amax below it is raised to it
  float value_for_inf = kFltMax;    // fp8-block: the scale when fp8_max / amax overflows (TE: the
                                    // input dtype's largest finite; bf16 input: kBf16Max)
  float scale = 1.0f;               // fp8-delayed: the scale of this step (DelayedScaling::scale)
  bool rht = false;                 // nvfp4: 16-point random Hadamard transform first
  bool stochastic_rounding = false; // nvfp4, mxfp4: one caller-supplied random word per element
  Flavour flavour = Flavour::te;
  friend bool operator==(const QuantizeConfig&, const QuantizeConfig&) = default;
};
// Throws std::invalid_argument naming the field; checks that the options fit the recipe.
void validate(const QuantizeConfig& config);
bool effective_power_of_2_scales(const QuantizeConfig& config) noexcept;

// What the quantization did to the input (elements of the quantized grid):
//   saturated: finite inputs whose scaled value lay beyond the element format's largest
//              finite (clamped); flushed: finite nonzero inputs whose code is a zero;
//   nonzero: inputs other than +-0 (after the Hadamard transform where rht is on);
//   nonfinite: inf or NaN inputs; amax: max |x| of the input before any transform
//              (the quiet NaN if it holds a NaN, else +inf if it holds an inf).
struct Counts {
  std::uint64_t elements = 0;
  std::uint64_t nonzero = 0;  // inputs != +-0 (inf and NaN included), of the values encoded
  std::uint64_t saturated = 0;
  std::uint64_t flushed = 0;
  std::uint64_t nonfinite = 0;
  float amax = 0.0f;
  friend bool operator==(const Counts&, const Counts&) = default;
};

struct Quantized {
  QuantizeConfig config;
  std::size_t rows = 0, cols = 0;            // the input [rows, cols]
  std::size_t code_rows = 0, code_cols = 0;  // the quantized grid: [rows, cols] or [cols, rows]
  std::size_t row_bytes = 0;                 // bytes per code row: code_cols (fp8), ceil(code_cols / 2) (fp4)
  std::vector<std::uint8_t> codes;           // code_rows * row_bytes
  ScaleFormat scale_format = ScaleFormat::f32;
  std::size_t scale_rows = 0, scale_cols = 0;
  std::vector<float> scale_inv;              // f32: scale_rows * scale_cols values (1 / scale)
  std::vector<std::uint8_t> scale_codes;     // e8m0 / e4m3: scale_rows * scale_cols codes
  float tensor_amax = 0.0f;                  // nvfp4: the amax its tensor scale comes from
  float tensor_scale = 1.0f;                 // nvfp4: S_enc; fp8 per tensor: the scale used
  Counts counts;
};

// Quantizes src ([rows, cols], row-major). random: empty, or code_rows * code_cols words
// (in the quantized grid's order) when config.stochastic_rounding.
Quantized quantize(std::span<const float> src, std::size_t rows, std::size_t cols, const QuantizeConfig& config,
                   std::span<const std::uint32_t> random = {});
// The same into `out`, reusing its buffers: once they have grown, a call allocates nothing.
void quantize(std::span<const float> src, std::size_t rows, std::size_t cols, const QuantizeConfig& config,
              std::span<const std::uint32_t> random, Quantized& out);
// Stochastic rounding's words for quantize's `random`: out[i] is the top 32 bits of word i of
// the splitmix64 stream from `seed` (state seed + (i + 1) * 0x9E3779B97F4A7C15, mixed). The
// same words on every back end; a fixed seed per draw makes runs repeat.
void random_words(std::uint64_t seed, std::span<std::uint32_t> out) noexcept;

// Writes what the codes represent back in the input's [rows, cols] layout: decode(code) times the
// block's multiplier, the multiplier itself where it is NaN (a NaN-scale block) (with rht, the
// transformed values: the transform is orthogonal and cancels in a GEMM over both operands).
void dequantize(const Quantized& q, std::span<float> dst);
std::vector<float> dequantize(const Quantized& q);

// The scale rules, usable alone (tests, the engine, docs):
// TE's compute_scale_from_amax (recipe_common.cuh).
float scale_from_amax(float amax, float fp8_max, bool power_of_2, float epsilon, float value_for_inf) noexcept;
// NVFP4's per-tensor encode scale S_enc = min(448 * 6 / amax, FLT_MAX); 1 for amax 0 or S_enc 0.
float nvfp4_tensor_scale(float amax) noexcept;
// E2M1 of one value: round to nearest even (or stochastically from `random`), saturating to
// +-6; NaN gives code 0. Decode is exact.
std::uint8_t e2m1_encode(float x, bool stochastic = false, std::uint32_t random = 0) noexcept;
float e2m1_decode(std::uint8_t code) noexcept;

namespace reference {
// The same contract as lowp::quantize, one element at a time through the scalar encoders.
Quantized quantize(std::span<const float> src, std::size_t rows, std::size_t cols, const QuantizeConfig& config,
                   std::span<const std::uint32_t> random = {});
// The 16-point transform of TE's NVFP4 recipe on consecutive groups of 16 (n % 16 == 0).
void rht16(std::span<float> v) noexcept;
// The same contract as lowp::dequantize, one element at a time: decode(code) * its block's
// multiplier, through a table of the element format's codes; a NaN multiplier (a NaN-scale
// block) is every element's value, so no NaN of two operands is left to the compiler's order.
void dequantize(const Quantized& q, std::span<float> dst);
}  // namespace reference

}  // namespace mixprec::lowp
