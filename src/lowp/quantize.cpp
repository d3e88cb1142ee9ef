// lowp::quantize (include/mixprec/lowp/quantize.hpp): the recipe table, validation, the
// driver that runs the dispatched kernels block by block, and dequantize.
#include "mixprec/lowp/quantize.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "core/select_kernels.hpp"
#include "lowp/kernels.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/formats/kernel_table.hpp"
#include "mixprec/lowp/scaling.hpp"

namespace mixprec::lowp {

namespace {

constexpr std::array<RecipeInfo, 6> kRecipes{{
    {Recipe::fp8_delayed, "fp8-delayed", "DelayedScaling", Element::e4m3, 0, 1, ScaleFormat::f32, false,
     "FP8 per tensor, scale from the amax history of earlier steps"},
    {Recipe::fp8_current, "fp8-current", "Float8CurrentScaling", Element::e4m3, 0, 1, ScaleFormat::f32, false,
     "FP8 per tensor, scale from this tensor's amax"},
    {Recipe::mxfp8, "mxfp8", "MXFP8BlockScaling", Element::e4m3, 32, 1, ScaleFormat::e8m0, false,
     "FP8 in blocks of 32 with an E8M0 scale"},
    {Recipe::fp8_block, "fp8-block", "Float8BlockScaling", Element::e4m3, 128, 128, ScaleFormat::f32, false,
     "FP8 in 1x128 blocks (128x128 tiles for weights) with fp32 scales"},
    {Recipe::nvfp4, "nvfp4", "NVFP4BlockScaling", Element::e2m1, 16, 16, ScaleFormat::e4m3, true,
     "FP4 E2M1 in blocks of 16 (16x16 tiles for weights) with E4M3 scales and an fp32 tensor scale"},
    {Recipe::mxfp4, "mxfp4", "(OCP MX; TE reference quantizer)", Element::e2m1, 32, 1, ScaleFormat::e8m0, false,
     "FP4 E2M1 in blocks of 32 with an E8M0 scale"},
}};

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

bool is_fp8_recipe(Recipe r) {
  return r == Recipe::fp8_delayed || r == Recipe::fp8_current || r == Recipe::mxfp8 || r == Recipe::fp8_block;
}

}  // namespace

std::span<const RecipeInfo> recipe_table() noexcept { return kRecipes; }

const RecipeInfo& recipe_info(Recipe recipe) noexcept {
  for (const RecipeInfo& r : kRecipes) {
    if (r.recipe == recipe) return r;
  }
  return kRecipes[0];
}

std::string_view recipe_name(Recipe recipe) noexcept { return recipe_info(recipe).name; }

std::optional<Recipe> parse_recipe(std::string_view name) noexcept {
  for (const RecipeInfo& r : kRecipes) {
    if (r.name == name) return r.recipe;
  }
  return std::nullopt;
}

std::string recipe_names() {
  std::string s;
  for (const RecipeInfo& r : kRecipes) s.append(s.empty() ? "" : ", ").append(r.name);
  return s;
}

std::string_view element_name(Element e) noexcept {
  switch (e) {
    case Element::e4m3: return "e4m3";
    case Element::e5m2: return "e5m2";
    case Element::e2m1: return "e2m1";
  }
  return "?";
}

std::optional<Element> parse_element(std::string_view name) noexcept {
  for (Element e : {Element::e4m3, Element::e5m2, Element::e2m1}) {
    if (element_name(e) == name) return e;
  }
  return std::nullopt;
}

std::string_view scale_rounding_name(ScaleRounding r) noexcept { return r == ScaleRounding::rceil ? "rceil" : "floor"; }

std::optional<ScaleRounding> parse_scale_rounding(std::string_view name) noexcept {
  if (name == "rceil") return ScaleRounding::rceil;
  if (name == "floor") return ScaleRounding::floor;
  return std::nullopt;
}

std::string_view flavour_name(Flavour f) noexcept { return f == Flavour::te ? "te" : "torchao"; }

std::optional<Flavour> parse_flavour(std::string_view name) noexcept {
  if (name == "te") return Flavour::te;
  if (name == "torchao") return Flavour::torchao;
  return std::nullopt;
}

std::string_view layout_name(Layout l) noexcept { return l == Layout::rowwise ? "rowwise" : "columnwise"; }


bool effective_power_of_2_scales(const QuantizeConfig& c) noexcept {
  return c.power_of_2_scales.value_or(c.recipe == Recipe::fp8_block);
}

void validate(const QuantizeConfig& c) {
  const auto known = parse_recipe(recipe_name(c.recipe));
  if (!known || *known != c.recipe) fail("recipe: unknown; expected one of " + recipe_names());
  const std::string r = "recipe " + std::string(recipe_name(c.recipe)) + ": ";
  if (c.element != Element::e4m3 && c.element != Element::e5m2 && c.element != Element::e2m1)
    fail(r + "element: unknown; expected e4m3, e5m2 or e2m1");
  if (c.layout != Layout::rowwise && c.layout != Layout::columnwise)
    fail(r + "layout: unknown; expected rowwise or columnwise");
  if (c.scale_rounding != ScaleRounding::rceil && c.scale_rounding != ScaleRounding::floor)
    fail(r + "scale_rounding: unknown; expected rceil or floor");
  if (c.flavour != Flavour::te && c.flavour != Flavour::torchao) fail(r + "flavour: unknown; expected te or torchao");
  const bool fp8 = is_fp8_recipe(c.recipe);
  if (fp8 && c.element == Element::e2m1)
    fail(r + "element: expected e4m3 or e5m2, found e2m1 (FP4 is the nvfp4 and mxfp4 recipes)");
  if (!fp8 && c.element != Element::e2m1)
    fail(r + "element: expected e2m1, found " + std::string(element_name(c.element)));
  if (c.tile_2d && c.recipe != Recipe::fp8_block && c.recipe != Recipe::nvfp4)
    fail(r + "tile_2d: only fp8-block (128x128) and nvfp4 (16x16) have 2-D tiles");
  if (c.scale_rounding != ScaleRounding::rceil && c.recipe != Recipe::mxfp8 && c.recipe != Recipe::mxfp4)
    fail(r + "scale_rounding: only mxfp8 and mxfp4 have it");
  if (c.power_of_2_scales.has_value() && c.recipe != Recipe::fp8_current && c.recipe != Recipe::fp8_block)
    fail(r + "power_of_2_scales: only fp8-current and fp8-block have it");
  if (!(std::isfinite(c.amax_epsilon) && c.amax_epsilon >= 0.0f))
    fail(r + "amax_epsilon: expected a finite number >= 0, found " + text::num_f32(c.amax_epsilon));
  if (c.amax_epsilon != 0.0f && c.recipe != Recipe::fp8_current && c.recipe != Recipe::fp8_block)
    fail(r + "amax_epsilon: only fp8-current and fp8-block have it");
  if (!(std::isfinite(c.value_for_inf) && c.value_for_inf > 0.0f))
    fail(r + "value_for_inf: expected a finite number > 0, found " + text::num_f32(c.value_for_inf));
  if (!(std::isfinite(c.scale) && c.scale > 0.0f))
    fail(r + "scale: expected a finite number > 0, found " + text::num_f32(c.scale));
  if (c.scale != 1.0f && c.recipe != Recipe::fp8_delayed) fail(r + "scale: only fp8-delayed takes a given scale");
  if (c.rht && c.recipe != Recipe::nvfp4) fail(r + "rht: only nvfp4 has the random Hadamard transform");
  if (c.rht && c.tile_2d) fail(r + "rht: TE applies it to 1x16 blocks only (not to 16x16 weight tiles)");
  if (c.stochastic_rounding && c.recipe != Recipe::nvfp4 && c.recipe != Recipe::mxfp4)
    fail(r + "stochastic_rounding: only nvfp4 and mxfp4 have it");
  if (c.flavour == Flavour::torchao && c.recipe != Recipe::mxfp8 && c.recipe != Recipe::mxfp4 &&
      c.recipe != Recipe::nvfp4)
    fail(r + "flavour: torchao has no such recipe (only mxfp8, mxfp4 and nvfp4)");
  if (c.flavour == Flavour::torchao && (c.rht || c.stochastic_rounding || c.tile_2d))
    fail(r + "flavour torchao: rht, stochastic_rounding and tile_2d are TE's (use flavour te)");
}

float scale_from_amax(float amax, float fp8_max, bool power_of_2, float epsilon, float value_for_inf) noexcept {
  return lowp::current_scale(amax, fp8_max, power_of_2, epsilon, value_for_inf);
}

float nvfp4_tensor_scale(float amax) noexcept {
  const float s = detail::min_flt_max(max_finite(Element::e4m3) * max_finite(Element::e2m1) / amax);
  return (amax == 0.0f || s == 0.0f) ? 1.0f : s;
}

std::uint8_t e2m1_encode(float x, bool stochastic, std::uint32_t random) noexcept {
  detail::EncodeCounts ignored;
  return static_cast<std::uint8_t>(
      detail::encode_element<detail::kE2M1Spec>(x, 1.0f, stochastic, random, max_finite(Element::e2m1), ignored));
}

float e2m1_decode(std::uint8_t code) noexcept {
  return mixprec::detail::decode<detail::kE2M1Spec>(code & 0xFu, Subnormals::keep);
}

namespace detail {

ElementSpec element_spec(Element e) noexcept {
  switch (e) {
    case Element::e4m3: return {&mixprec::detail::kE4M3Spec, max_finite(Element::e4m3), 0x7f};
    case Element::e5m2: return {&mixprec::detail::kE5M2Spec, max_finite(Element::e5m2), 0x7f};
    case Element::e2m1: return {&kE2M1Spec, max_finite(Element::e2m1), 0x7};
  }
  return {&mixprec::detail::kE4M3Spec, max_finite(Element::e4m3), 0x7f};
}

const LowpKernels* lowp_kernels(Isa isa) noexcept {
  return mixprec::detail::select_kernels(isa, &scalar_kernels, &avx2_kernels, &avx512_kernels);
}

Quantized make_result(std::size_t src_size, std::size_t rows, std::size_t cols, const QuantizeConfig& c,
                      std::size_t random_size) {
  Quantized q;
  prepare(q, src_size, rows, cols, c, random_size);
  return q;
}

void prepare(Quantized& q, std::size_t src_size, std::size_t rows, std::size_t cols, const QuantizeConfig& c,
             std::size_t random_size) {
  validate(c);
  const std::string shape = "quantize: shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
  if (rows != 0 && cols > std::numeric_limits<std::size_t>::max() / rows) fail(shape + " has too many elements");
  if (rows * cols != src_size)
    fail(shape + " needs " + std::to_string(rows * cols) + " elements, found " + std::to_string(src_size));
  const RecipeInfo& info = recipe_info(c.recipe);
  q.config = c;
  q.tensor_amax = 0.0f;
  q.tensor_scale = 1.0f;
  q.counts = {};
  q.rows = rows;
  q.cols = cols;
  const bool col = c.layout == Layout::columnwise;
  q.code_rows = col ? cols : rows;
  q.code_cols = col ? rows : cols;
  if (c.rht && q.code_cols % 16 != 0)
    fail("quantize: rht needs the quantized rows' length (" + std::to_string(q.code_cols) +
         ") to be a multiple of 16, as TE's transform");
  const std::size_t n = q.code_rows * q.code_cols;
  if (c.stochastic_rounding && random_size != n)
    fail("quantize: stochastic_rounding needs one random word per element (" + std::to_string(n) + "), found " +
         std::to_string(random_size));
  if (!c.stochastic_rounding && random_size != 0)
    fail("quantize: random words given but stochastic_rounding is off");
  q.row_bytes = c.element == Element::e2m1 ? (q.code_cols + 1) / 2 : q.code_cols;
  q.codes.resize(q.code_rows * q.row_bytes);  // every byte is written (the pad nibble of an odd row: 0)
  q.scale_format = info.scale_format;
  if (info.block == 0) {
    q.scale_rows = 1;
    q.scale_cols = 1;
  } else {
    const std::size_t tr = c.tile_2d ? info.tile_rows : 1;
    q.scale_rows = (q.code_rows + tr - 1) / tr;
    q.scale_cols = (q.code_cols + info.block - 1) / info.block;
  }
  // assign() keeps the capacity: a result quantized again into allocates nothing.
  if (q.scale_format == ScaleFormat::f32) {
    q.scale_inv.assign(q.scale_rows * q.scale_cols, 1.0f);
    q.scale_codes.clear();
  } else {
    q.scale_codes.assign(q.scale_rows * q.scale_cols, 0);
    q.scale_inv.clear();
  }
  q.counts.elements = n;
}

void grid_input(const LowpKernels& k, std::span<const float> src, const Quantized& q, std::vector<float>& g) {
  g.resize(src.size());
  if (q.config.layout == Layout::rowwise) {
    std::copy(src.begin(), src.end(), g.begin());
    return;
  }
  k.transpose(src.data(), q.rows, q.cols, g.data());
}

BlockScale fp8_block_scale(const QuantizeConfig& c, float max_ignoring_nan) noexcept {
  float factor, scale_inv;
  fp8_block_scales(c, &max_ignoring_nan, 1, &factor, &scale_inv);
  return {factor, scale_inv, 0};
}

void fp8_block_scales(const QuantizeConfig& c, const float* max_ignoring_nan, std::size_t n, float* factors,
                      float* scale_inv) noexcept {
  const float fp8_max = max_finite(c.element);
  const bool pow2 = effective_power_of_2_scales(c);
  for (std::size_t b = 0; b < n; ++b) {
    const float s = lowp::current_scale(max_ignoring_nan[b], fp8_max, pow2, c.amax_epsilon, c.value_for_inf);
    factors[b] = s;
    scale_inv[b] = 1.0f / s;
  }
}

BlockScale mx_block_scale(const QuantizeConfig& c, float max_ignoring_nan, std::uint32_t max_bits) noexcept {
  if (c.flavour == Flavour::torchao) return torchao_mx_scale(c, canonical_amax(max_bits));
  const ScaleRounding rounding = c.scale_rounding;
  const float amax = rounding == ScaleRounding::rceil ? max_ignoring_nan : canonical_amax(max_bits);
  const e8m0 scale = mx_scale(amax, c.element, rounding);
  // A NaN factor makes the counts those of the canonical NaN-block codes written after the cast.
  if (scale.bits() == 0xFF) return {std::numeric_limits<float>::quiet_NaN(), 1.0f, 0xFF};
  return {lowp::mx_quantize_factor(scale, rounding), 1.0f, scale.bits()};
}

bool mx_block_scales(const QuantizeConfig& c, const float* max_ignoring_nan, const std::uint32_t* max_bits,
                     std::size_t n, float* factors, std::uint8_t* codes) noexcept {
  bool any_nan = false;
  if (c.flavour == Flavour::te && c.scale_rounding == ScaleRounding::rceil) {
    const float rcp = lowp::mx_max_norm_rcp(max_finite(c.element));
    for (std::size_t b = 0; b < n; ++b) {
      const std::uint8_t code = lowp::mx_scale_code_te(max_ignoring_nan[b], rcp);
      codes[b] = code;
      factors[b] = lowp::mx_factor_te(code);  // NaN for 0xFF: the counts of the NaN-block codes
      any_nan = any_nan || code == 0xFF;
    }
    return any_nan;
  }
  for (std::size_t b = 0; b < n; ++b) {
    const BlockScale s = mx_block_scale(c, max_ignoring_nan[b], max_bits[b]);
    factors[b] = s.factor;
    codes[b] = s.code;
    any_nan = any_nan || std::isnan(s.factor);
  }
  return any_nan;
}

std::uint8_t nan_block_code(Element e) noexcept {
  return e == Element::e4m3 ? 0x7F : e == Element::e5m2 ? 0x7E : 0x00;
}

}  // namespace detail

namespace {

using detail::EncodeCounts;
using detail::LowpKernels;

constexpr std::size_t kChunkElements = 1024;
constexpr std::size_t kChunkBlocks = kChunkElements / 16;  // 16: the shortest block (nvfp4)

// Codes of row r start at byte r * row_bytes; element offsets within a row are even for
// e2m1 (blocks of 16, 32 or 128 start at even columns).
std::uint8_t* code_ptr(Quantized& q, std::size_t row, std::size_t col) {
  return q.codes.data() + row * q.row_bytes + (q.config.element == Element::e2m1 ? col / 2 : col);
}

void set_nan_block(Quantized& q, std::size_t row, std::size_t c0, std::size_t len) {
  const std::uint8_t code = detail::nan_block_code(q.config.element);
  if (q.config.element == Element::e2m1) std::fill_n(code_ptr(q, row, c0), (len + 1) / 2, code);
  else std::fill_n(code_ptr(q, row, c0), len, code);
}

// The 1-D block recipes (mxfp8, mxfp4, fp8-block 1x128, nvfp4 1x16) over one run of
// `len` elements of the grid starting at (row, c0), which covers whole blocks of `block`
// (the last may be shorter) and whose scales start at scale index s0.
struct Run {
  const float* src;
  std::size_t len;
  std::size_t row, c0;   // codes
  std::size_t s0;        // first scale
  const std::uint32_t* random;
};

// With rht (nvfp4, blocks of 16, rows a multiple of 16) each chunk is transformed into
// this buffer first, while it is in cache: the transformed grid is never written out.
constexpr std::size_t kRhtChunk = kChunkElements;

// The magnitude-bits max of a whole tensor or chunk: the formats table's amax_bits of the same
// back end (the FP8 recipes' amax kernel), not a second loop of lowp's own.
std::uint32_t tensor_amax_bits(const LowpKernels& k, const float* src, std::size_t n) {
  return kernel_table(k.isa)->amax.amax_bits(src, n);
}

// One chunk's 16-point transform into t (len % 16 == 0: the groups are the whole grid's).
const float* rht_chunk(const LowpKernels& k, const float* src, std::size_t len, float* t) {
  k.rht16(src, t, len);
  return t;
}

void quantize_run_1d(const LowpKernels& k, Quantized& q, const Run& run, float s_enc_div6, float s_dec,
                     EncodeCounts& counts, std::uint32_t& amax_bits) {
  const QuantizeConfig& c = q.config;
  const std::size_t block = recipe_info(c.recipe).block;
  float fmax[kChunkBlocks], factors[kChunkBlocks];
  std::uint32_t bits[kChunkBlocks];
  alignas(64) float transformed[kRhtChunk];
  // Chunks of about kChunkElements: block_amax streams them in, the encode rereads them from
  // L1; longer chunks (fp8-block's 64 x 128) leave the memory stream idle for longer between
  // block_amax calls and ran slower out of cache (measured: 1024 the best of 256..8192).
  const std::size_t chunk_blocks = std::clamp<std::size_t>(kChunkElements / block, 1, kChunkBlocks);
  for (std::size_t begin = 0; begin < run.len; begin += chunk_blocks * block) {
    const std::size_t len = std::min(run.len - begin, chunk_blocks * block);
    const std::size_t nb = (len + block - 1) / block;
    const std::size_t sb = run.s0 + begin / block;
    const float* src = c.rht ? rht_chunk(k, run.src + begin, len, transformed) : run.src + begin;
    k.block_amax(src, len, block, c.recipe == Recipe::nvfp4 ? nullptr : fmax, bits);  // nvfp4: bits only
    bool any_nan_block = false;
    for (std::size_t b = 0; b < nb; ++b) amax_bits = std::max(amax_bits, bits[b]);
    if (c.recipe == Recipe::nvfp4) {
      float amax[kChunkBlocks];
      for (std::size_t b = 0; b < nb; ++b) amax[b] = detail::canonical_amax(bits[b]);
      if (c.flavour == Flavour::torchao) {
        for (std::size_t b = 0; b < nb; ++b) detail::torchao_nvfp4_scale(amax[b], q.tensor_scale, q.scale_codes[sb + b], factors[b]);
      } else {
        k.nvfp4_scales(amax, nb, s_enc_div6, s_dec, q.scale_codes.data() + sb, factors);
      }
    } else if (c.recipe == Recipe::fp8_block) {
      detail::fp8_block_scales(c, fmax, nb, factors, q.scale_inv.data() + sb);  // never NaN
    } else {
      any_nan_block = detail::mx_block_scales(c, fmax, bits, nb, factors, q.scale_codes.data() + sb);
    }
    // Element offsets: e2m1 blocks start at even columns, so the byte offset is exact.
    std::uint8_t* dst = c.element == Element::e2m1 ? q.codes.data() + run.row * q.row_bytes + (run.c0 + begin) / 2
                                                   : q.codes.data() + run.row * q.row_bytes + run.c0 + begin;
    k.encode_scaled(c.element, src, len, block, factors, dst, run.random != nullptr ? run.random + begin : nullptr,
                    &counts, nullptr);
    if (!any_nan_block) continue;
    for (std::size_t b = 0; b < nb; ++b) {
      if (q.scale_codes[sb + b] != 0xFF) continue;
      const std::size_t e0 = b * block, e1 = std::min(len, e0 + block);
      // The run's columns continue across rows only when the row length is a multiple of
      // the block; set_nan_block takes row-relative columns, so map the flat offset back.
      const std::size_t flat = run.c0 + begin + e0;
      set_nan_block(q, run.row + flat / q.code_cols, flat % q.code_cols, e1 - e0);
    }
  }
}

// 2-D tiles (fp8-block 128x128, nvfp4 16x16): per band of tile_rows rows, the tile amaxes
// from every row's block amaxes, then each row's encode with its band's factors.
void quantize_2d(const LowpKernels& k, Quantized& q, const float* g, float s_enc_div6, float s_dec,
                 EncodeCounts& counts, std::uint32_t& amax_bits) {
  const QuantizeConfig& c = q.config;
  const RecipeInfo& info = recipe_info(c.recipe);
  const std::size_t block = info.block, tr = info.tile_rows, C = q.code_cols;
  const bool nvfp4 = c.recipe == Recipe::nvfp4;
  const std::size_t nb = q.scale_cols;
  // Per-band scratch: one buffer per thread, grown once (a reused result allocates nothing).
  thread_local std::vector<float> fscratch;
  thread_local std::vector<std::uint32_t> uscratch;
  if (fscratch.size() < 4 * nb) fscratch.resize(4 * nb);
  if (uscratch.size() < 2 * nb) uscratch.resize(2 * nb);
  const std::span<float> fmax(fscratch.data(), nb), row_fmax(fscratch.data() + nb, nb),
      factors(fscratch.data() + 2 * nb, nb), amax(fscratch.data() + 3 * nb, nb);
  const std::span<std::uint32_t> bits(uscratch.data(), nb), row_bits(uscratch.data() + nb, nb);
  for (std::size_t band = 0; band < q.scale_rows; ++band) {
    const std::size_t r0 = band * tr, r1 = std::min(q.code_rows, r0 + tr);
    std::fill(fmax.begin(), fmax.end(), 0.0f);
    std::fill(bits.begin(), bits.end(), 0u);
    for (std::size_t r = r0; r < r1; ++r) {
      k.block_amax(g + r * C, C, block, nvfp4 ? nullptr : row_fmax.data(), row_bits.data());  // nvfp4: bits only
      for (std::size_t b = 0; b < nb; ++b) {
        if (!nvfp4) fmax[b] = row_fmax[b] > fmax[b] ? row_fmax[b] : fmax[b];
        bits[b] = std::max(bits[b], row_bits[b]);
      }
    }
    for (std::size_t b = 0; b < nb; ++b) amax_bits = std::max(amax_bits, bits[b]);
    if (c.recipe == Recipe::nvfp4) {
      for (std::size_t b = 0; b < nb; ++b) amax[b] = detail::canonical_amax(bits[b]);
      k.nvfp4_scales(amax.data(), nb, s_enc_div6, s_dec, q.scale_codes.data() + band * nb, factors.data());
    } else {
      detail::fp8_block_scales(c, fmax.data(), nb, factors.data(), q.scale_inv.data() + band * nb);
    }
    for (std::size_t r = r0; r < r1; ++r) k.encode_scaled(c.element, g + r * C, C, block, factors.data(), code_ptr(q, r, 0), nullptr, &counts, nullptr);
  }
}

}  // namespace

namespace detail {

Quantized quantize_with(const LowpKernels& k, std::span<const float> src, std::size_t rows, std::size_t cols,
                        const QuantizeConfig& c, std::span<const std::uint32_t> random) {
  Quantized q;
  quantize_with(k, src, rows, cols, c, random, q);
  return q;
}

void quantize_with(const LowpKernels& k, std::span<const float> src, std::size_t rows, std::size_t cols,
                   const QuantizeConfig& c, std::span<const std::uint32_t> random, Quantized& q) {
  prepare(q, src.size(), rows, cols, c, random.size());
  const std::size_t n = src.size();
  if (n == 0) return;
  // The transposed grid: one buffer per thread, grown once. The RHT is applied chunk by
  // chunk as the grid is read (rht_chunk), never to a whole copy.
  thread_local std::vector<float> scratch;
  const float* g = src.data();
  if (c.layout == Layout::columnwise) {
    grid_input(k, src, q, scratch);
    g = scratch.data();
  }
  EncodeCounts counts;
  std::uint32_t amax_bits = 0;
  const RecipeInfo& info = recipe_info(c.recipe);
  float s_enc_div6 = 1.0f, s_dec = 1.0f;
  // With rht: the input's amax (the grid is the input or its transpose: the same maximum),
  // taken in the same pass as the transformed amax.
  std::uint32_t input_amax_bits = 0;
  if (c.recipe == Recipe::nvfp4) {
    std::uint32_t b = 0;  // the amaxes here are bits (canonical_amax), no float max
    if (c.rht) {
      alignas(64) float t[kRhtChunk];
      for (std::size_t i = 0; i < n; i += kRhtChunk) {
        const std::size_t len = std::min(n - i, kRhtChunk);
        input_amax_bits = std::max(input_amax_bits, tensor_amax_bits(k, g + i, len));
        b = std::max(b, tensor_amax_bits(k, rht_chunk(k, g + i, len, t), len));
      }
    } else {
      b = tensor_amax_bits(k, g, n);
    }
    q.tensor_amax = canonical_amax(b);
    q.tensor_scale = c.flavour == Flavour::torchao ? q.tensor_amax / (max_finite(Element::e4m3) * max_finite(Element::e2m1)) : nvfp4_tensor_scale(q.tensor_amax);
    s_enc_div6 = q.tensor_scale * (1.0f / max_finite(Element::e2m1));
    s_dec = 1.0f / q.tensor_scale;
  }
  if (c.recipe == Recipe::fp8_delayed) {
    // The scale is given: one pass over the input, the amax (for the history) taken by the
    // encode from the vectors it reads. (An amax pass per chunk, then its encode from L1, left
    // the memory idle while it encoded: one thread took the sum of the two times.)
    const float scale = c.scale;
    q.tensor_scale = scale;
    q.scale_inv[0] = 1.0f / scale;
    k.encode_scaled(c.element, g, n, n, &scale, q.codes.data(), nullptr, &counts, &amax_bits);
  } else if (info.block == 0) {
    // Current scaling: the scale needs the whole tensor's amax before the first code, so the
    // input is read twice (TE runs an amax kernel, then the cast).
    amax_bits = tensor_amax_bits(k, g, n);
    const float scale = scale_from_amax(canonical_amax(amax_bits), max_finite(c.element),
                                        effective_power_of_2_scales(c), c.amax_epsilon, c.value_for_inf);
    q.tensor_scale = scale;
    q.scale_inv[0] = 1.0f / scale;
    k.encode_scaled(c.element, g, n, n, &scale, q.codes.data(), nullptr, &counts, nullptr);
  } else if (c.tile_2d) {
    quantize_2d(k, q, g, s_enc_div6, s_dec, counts, amax_bits);
  } else if (q.code_cols % info.block == 0) {
    // Whole blocks per row: the grid is one run, blocks never straddle rows.
    quantize_run_1d(k, q, Run{g, n, 0, 0, 0, c.stochastic_rounding ? random.data() : nullptr}, s_enc_div6, s_dec,
                    counts, amax_bits);
  } else {
    for (std::size_t r = 0; r < q.code_rows; ++r) {
      const Run run{g + r * q.code_cols, q.code_cols, r, 0, r * q.scale_cols,
                    c.stochastic_rounding ? random.data() + r * q.code_cols : nullptr};
      quantize_run_1d(k, q, run, s_enc_div6, s_dec, counts, amax_bits);
    }
  }
  q.counts.saturated = counts.saturated;
  q.counts.flushed = counts.flushed;
  q.counts.nonfinite = counts.nonfinite;
  q.counts.nonzero = q.counts.elements - counts.zeros;
  if (c.rht) amax_bits = input_amax_bits;
  q.counts.amax = canonical_amax(amax_bits);
}

}  // namespace detail

namespace {
const detail::LowpKernels& active_kernels() {
  static const detail::LowpKernels* table = detail::lowp_kernels(active_isa());
  return *table;
}
}  // namespace

Quantized quantize(std::span<const float> src, std::size_t rows, std::size_t cols, const QuantizeConfig& config,
                   std::span<const std::uint32_t> random) {
  return detail::quantize_with(active_kernels(), src, rows, cols, config, random);
}

void quantize(std::span<const float> src, std::size_t rows, std::size_t cols, const QuantizeConfig& config,
              std::span<const std::uint32_t> random, Quantized& out) {
  detail::quantize_with(active_kernels(), src, rows, cols, config, random, out);
}

// ---- dequantize ---------------------------------------------------------------------

namespace detail {
void block_multipliers(const Quantized& q, std::vector<float>& m) {
  //   f32 scales: scale_inv; E8M0: float(code); nvfp4 (TE dequantize_nvfp4.cuh):
  //   float(scale) * amax * float(1 / (6 * 448)); nvfp4 torchao: tensor_scale * float(scale).
  constexpr float kNvfp4FactorInv = static_cast<float>(1.0 / (double{max_finite(Element::e2m1)} * double{max_finite(Element::e4m3)}));
  m.resize(q.scale_rows * q.scale_cols);
  for (std::size_t s = 0; s < m.size(); ++s) {
    if (q.scale_format == ScaleFormat::f32) {
      m[s] = q.scale_inv[s];
    } else if (q.scale_format == ScaleFormat::e8m0) {
      m[s] = static_cast<float>(e8m0::from_bits(q.scale_codes[s]));
    } else {
      const float sb = mixprec::detail::decode<mixprec::detail::kE4M3Spec>(q.scale_codes[s], Subnormals::keep);
      m[s] = q.config.flavour == Flavour::torchao ? q.tensor_scale * sb : sb * q.tensor_amax * kNvfp4FactorInv;
    }
  }
}
}  // namespace detail

// Every element is decode(code) * m, with one multiplier m per block (block_multipliers).
// A code row is decoded exactly (fp8 through the formats' bulk decode, E2M1 through its
// 16 values), then each block of it multiplied by its m: decode(code) * 1 is the value
// itself, so the product is reference::dequantize's, bit for bit, without its per-element
// division by the block length and its layout and element branches. A columnwise grid is
// decoded whole, then transposed into the input's layout (LowpKernels::transpose).
void dequantize(const Quantized& q, std::span<float> dst) {
  if (dst.size() != q.rows * q.cols)
    fail("dequantize: destination has " + std::to_string(dst.size()) + " elements, the tensor " +
         std::to_string(q.rows * q.cols));
  const QuantizeConfig& c = q.config;
  const RecipeInfo& info = recipe_info(c.recipe);
  const bool col = c.layout == Layout::columnwise;
  const std::size_t tr = info.block == 0 ? std::max<std::size_t>(q.code_rows, 1) : (c.tile_2d ? info.tile_rows : 1);
  const std::size_t block = info.block == 0 ? std::max<std::size_t>(q.code_cols, 1) : info.block;
  thread_local std::vector<float> m, grid;  // grown once per thread
  detail::block_multipliers(q, m);
  if (col) grid.resize(q.code_rows * q.code_cols);
  float e2m1_values[16];
  for (unsigned code = 0; code < 16; ++code) e2m1_values[code] = e2m1_decode(static_cast<std::uint8_t>(code));
  const std::size_t n = q.code_cols;
  for (std::size_t r = 0; r < q.code_rows; ++r) {
    const std::uint8_t* row = q.codes.data() + r * q.row_bytes;
    float* out = col ? grid.data() + r * q.code_cols : dst.data() + r * q.cols;
    switch (c.element) {
      case Element::e4m3:
        convert(std::span<const f8e4m3>(reinterpret_cast<const f8e4m3*>(row), n), std::span<float>(out, n));
        break;
      case Element::e5m2:
        convert(std::span<const f8e5m2>(reinterpret_cast<const f8e5m2*>(row), n), std::span<float>(out, n));
        break;
      case Element::e2m1:
        for (std::size_t i = 0; i + 1 < n; i += 2) {
          out[i] = e2m1_values[row[i / 2] & 0xF];
          out[i + 1] = e2m1_values[row[i / 2] >> 4];
        }
        if (n % 2 == 1) out[n - 1] = e2m1_values[row[n / 2] & 0xF];
        break;
    }
    const float* mr = m.data() + (r / tr) * q.scale_cols;
    for (std::size_t b0 = 0, s = 0; b0 < n; b0 += block, ++s) {
      const float f = mr[s];
      const std::size_t b1 = std::min(n, b0 + block);
      if (std::isnan(f)) {
        std::fill(out + b0, out + b1, f);
      } else {
        for (std::size_t i = b0; i < b1; ++i) out[i] *= f;
      }
    }
  }
  if (col) active_kernels().transpose(grid.data(), q.code_rows, q.code_cols, dst.data());
}

void random_words(std::uint64_t seed, std::span<std::uint32_t> out) noexcept {
  active_kernels().random_words(seed, out.data(), out.size());
}

std::vector<float> dequantize(const Quantized& q) {
  std::vector<float> v(q.rows * q.cols);
  dequantize(q, v);
  return v;
}

}  // namespace mixprec::lowp
