// lowp::block_stats and lowp::kurtosis (include/mixprec/lowp/block_stats.hpp).
#include "mixprec/lowp/block_stats.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "lowp/kernels.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/formats/types.hpp"

namespace mixprec::lowp {

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

constexpr float kInfF = std::numeric_limits<float>::infinity();

// The shape of q's blocks in its grid: tile_rows grid rows by block grid columns.
struct BlockShape {
  std::size_t tile_rows, block;
};

BlockShape block_shape(const Quantized& q) {
  const RecipeInfo& info = recipe_info(q.config.recipe);
  if (info.block == 0) return {std::max<std::size_t>(q.code_rows, 1), std::max<std::size_t>(q.code_cols, 1)};
  return {q.config.tile_2d ? info.tile_rows : 1, info.block};
}

// A q built by hand must still fit its own shape before its buffers are indexed. The
// messages are built only on failure: a good call allocates nothing here.
void check_shape(const Quantized& q) {
  const QuantizeConfig& c = q.config;
  const std::optional<Recipe> known = parse_recipe(recipe_name(c.recipe));
  if (!known || *known != c.recipe) fail("block_stats: q: recipe: unknown; expected one of " + recipe_names());
  const RecipeInfo& info = recipe_info(c.recipe);
  if (c.rht && (c.recipe != Recipe::nvfp4 || c.tile_2d))
    fail("block_stats: q: rht: expected nvfp4 with 1x16 blocks, found recipe " + std::string(info.name) +
         (c.tile_2d ? " with tile_2d" : ""));
  const bool col = c.layout == Layout::columnwise;
  const std::size_t code_rows = col ? q.cols : q.rows, code_cols = col ? q.rows : q.cols;
  // (append: GCC 12's -Wrestrict misfires on "[" + std::string.)
  auto pair = [](std::size_t a, std::size_t b) {
    return std::string("[").append(std::to_string(a)).append(", ").append(std::to_string(b)).append("]");
  };
  if (q.rows != 0 && q.cols > std::numeric_limits<std::size_t>::max() / q.rows)
    fail("block_stats: q: shape " + pair(q.rows, q.cols) + " has too many elements");
  const std::size_t row_bytes = c.element == Element::e2m1 ? (code_cols + 1) / 2 : code_cols;
  if (q.code_rows != code_rows || q.code_cols != code_cols || q.row_bytes != row_bytes ||
      q.codes.size() != code_rows * row_bytes)
    fail("block_stats: q: expected a code grid " + pair(code_rows, code_cols) + " of " +
         std::to_string(code_rows * row_bytes) + " bytes for the " + std::string(layout_name(c.layout)) + " input " +
         pair(q.rows, q.cols) + ", found " + pair(q.code_rows, q.code_cols) + " of " + std::to_string(q.codes.size()));
  if (c.rht && code_cols % 16 != 0)
    fail("block_stats: q: rht: expected the grid's rows to be a multiple of 16 long, found " +
         std::to_string(code_cols));
  const BlockShape b = block_shape(q);
  const std::size_t scale_rows = info.block == 0 ? 1 : (code_rows + b.tile_rows - 1) / b.tile_rows;
  const std::size_t scale_cols = info.block == 0 ? 1 : (code_cols + b.block - 1) / b.block;
  const std::size_t scales = q.scale_format == ScaleFormat::f32 ? q.scale_inv.size() : q.scale_codes.size();
  if (q.scale_format != info.scale_format || q.scale_rows != scale_rows || q.scale_cols != scale_cols ||
      scales != scale_rows * scale_cols)
    fail("block_stats: q: expected " + std::to_string(scale_rows) + " x " + std::to_string(scale_cols) +
         " scales of recipe " + std::string(info.name) + ", found " + std::to_string(q.scale_rows) + " x " +
         std::to_string(q.scale_cols) + " (" + std::to_string(scales) + " stored)");
}

// The factor lowp::quantize multiplied block s's values by before the cast, from q's stored
// scales by the quantizer's rules (lowp/kernels.hpp), so that the counts are q.counts'
// element by element. fp8-block's fp32 scale_inv does not give its scale back exactly
// (1 / (1 / s) need not be s), so its factor comes from the block's amax as in the quantizer.
float block_factor(const Quantized& q, std::size_t s, float max_ignoring_nan) {
  const QuantizeConfig& c = q.config;
  switch (c.recipe) {
    case Recipe::fp8_delayed:
    case Recipe::fp8_current:
      return q.tensor_scale;
    case Recipe::fp8_block:
      return detail::fp8_block_scale(c, max_ignoring_nan).factor;
    case Recipe::mxfp8:
    case Recipe::mxfp4: {
      const std::uint8_t code = q.scale_codes[s];
      if (c.flavour == Flavour::te) return mx_quantize_factor(e8m0::from_bits(code), c.scale_rounding);
      // torchao (detail::torchao_mx_scale): rceil 2^(127 - code), 1 for code 0, NaN for 0xFF;
      // floor 1 / max(2^(code - 127), 2^-126), 0 for 0xFF (whose scale reads as +inf).
      if (c.scale_rounding == ScaleRounding::rceil) {
        if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
        return code == 0 ? 1.0f : std::ldexp(1.0f, 127 - static_cast<int>(code));
      }
      float scale = std::bit_cast<float>(static_cast<std::uint32_t>(code) << 23);
      if (scale < 0x1p-126f) scale = 0x1p-126f;
      return 1.0f / scale;
    }
    case Recipe::nvfp4: {
      const float sb = mixprec::detail::decode<mixprec::detail::kE4M3Spec>(q.scale_codes[s], Subnormals::keep);
      // detail::torchao_nvfp4_scale and detail::nvfp4_scale_one, from the code they chose.
      if (c.flavour == Flavour::torchao) return (1.0f / q.tensor_scale) / sb;
      const float s_dec = 1.0f / q.tensor_scale;
      return detail::min_flt_max(1.0f / (sb * s_dec));
    }
  }
  return 1.0f;
}

// One block's counts and extremes of its values.
struct BlockPass {
  float amax = 0.0f;              // NaN ignored
  float max_finite = 0.0f;        // of the finite nonzero values
  float min_nonzero = kInfF;      // of the finite nonzero values
  std::uint64_t flushed = 0, saturated = 0;

  // One value x that the quantizer multiplied by `factor` and encoded as `code`:
  // detail::encode_element's counts, the code read back from q.
  void add(float x, std::uint32_t code, float factor, float max_value, std::uint32_t mag_mask) noexcept {
    const std::uint32_t ax = std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
    const float a = std::bit_cast<float>(ax);
    amax = a > amax ? a : amax;  // false for NaN
    if (ax >= 0x7f800000u) return;  // inf, NaN: counted in q.counts.nonfinite only
    const std::uint32_t ay = std::bit_cast<std::uint32_t>(x * factor) & 0x7fffffffu;
    if (ay <= 0x7f800000u && std::bit_cast<float>(ay) > max_value) ++saturated;
    if (ax == 0) return;
    if ((code & mag_mask) == 0) ++flushed;
    max_finite = a > max_finite ? a : max_finite;
    min_nonzero = a < min_nonzero ? a : min_nonzero;
  }
};

// The code of grid element (r, c).
inline std::uint32_t code_at(const Quantized& q, bool fp4, std::size_t r, std::size_t c) noexcept {
  const std::uint8_t byte = q.codes[r * q.row_bytes + (fp4 ? c / 2 : c)];
  return fp4 ? (c % 2 == 0 ? byte & 0xFu : byte >> 4) : byte;
}

// f(x, r, c) for every grid element (r, c) of rows [r0, r1) and columns [c0, c1), in the input's
// memory order: a columnwise grid's (r, c) is input element (c, r).
template <class F>
inline void for_each_value(const Quantized& q, const float* src, std::size_t r0, std::size_t r1, std::size_t c0,
                           std::size_t c1, F&& f) {
  if (q.config.layout == Layout::rowwise) {
    for (std::size_t r = r0; r < r1; ++r) {
      const float* row = src + r * q.cols;
      for (std::size_t c = c0; c < c1; ++c) f(row[c], r, c);
    }
  } else {
    for (std::size_t c = c0; c < c1; ++c) {
      const float* row = src + c * q.cols;
      for (std::size_t r = r0; r < r1; ++r) f(row[r], r, c);
    }
  }
}

}  // namespace

BlockStats block_stats(const Quantized& q, std::span<const float> src, double far_log2) {
  check_shape(q);
  if (src.size() != q.rows * q.cols)
    fail("block_stats: src: expected " + std::to_string(q.rows * q.cols) + " elements, found " +
         std::to_string(src.size()));
  if (!(std::isfinite(far_log2) && far_log2 >= 0.0))
    fail("block_stats: far_log2: expected a finite number >= 0, found " + text::num(far_log2));
  const QuantizeConfig& c = q.config;
  const BlockShape shape = block_shape(q);
  const bool fp4 = c.element == Element::e2m1;
  const float max_value = max_finite(c.element);
  const std::uint32_t mag_mask = fp4 ? 0x7u : 0x7Fu;
  const bool rowwise = c.layout == Layout::rowwise;

  BlockStats st;
  st.far_log2 = far_log2;
  st.blocks = q.scale_rows * q.scale_cols;
  // The one vector: each block's amax, then (after far_blocks) each block's multiplier.
  std::vector<float> per_block(st.blocks);
  float max_finite_all = 0.0f, min_nonzero_all = kInfF;
  double max_block_ratio = 1.0;
  // Rowwise blocks in scale order; columnwise ones band by band of the input's rows (scale
  // column outer), so that neighbouring blocks share the input's cache lines.
  const std::size_t outer = rowwise ? q.scale_rows : q.scale_cols, inner = rowwise ? q.scale_cols : q.scale_rows;
  for (std::size_t o = 0; o < outer; ++o) {
    for (std::size_t i = 0; i < inner; ++i) {
      const std::size_t sr = rowwise ? o : i, sc = rowwise ? i : o, s = sr * q.scale_cols + sc;
      const std::size_t r0 = sr * shape.tile_rows, r1 = std::min(q.code_rows, r0 + shape.tile_rows);
      const std::size_t c0 = sc * shape.block, c1 = std::min(q.code_cols, c0 + shape.block);
      BlockPass p;
      if (c.rht) {
        // nvfp4 1x16 blocks (rht excludes tile_2d; rows are a multiple of 16): the block is
        // one group of the transform.
        float v[16];
        for_each_value(q, src.data(), r0, r1, c0, c1, [&](float x, std::size_t, std::size_t cc) { v[cc - c0] = x; });
        reference::rht16(std::span<float>(v, 16));
        const float factor = block_factor(q, s, 0.0f);
        for (std::size_t k = 0; k < 16; ++k) p.add(v[k], code_at(q, fp4, r0, c0 + k), factor, max_value, mag_mask);
      } else {
        float max_ignoring_nan = 0.0f;
        if (c.recipe == Recipe::fp8_block) {
          for_each_value(q, src.data(), r0, r1, c0, c1, [&](float x, std::size_t, std::size_t) {
            const float a = std::fabs(x);
            max_ignoring_nan = a > max_ignoring_nan ? a : max_ignoring_nan;
          });
        }
        const float factor = block_factor(q, s, max_ignoring_nan);
        for_each_value(q, src.data(), r0, r1, c0, c1, [&](float x, std::size_t r, std::size_t cc) {
          p.add(x, code_at(q, fp4, r, cc), factor, max_value, mag_mask);
        });
      }
      per_block[s] = p.amax;
      const double elements = static_cast<double>((r1 - r0) * (c1 - c0));
      st.flushed += p.flushed;
      st.saturated += p.saturated;
      if (p.flushed != 0) {
        ++st.blocks_with_flush;
        st.max_flushed_fraction = std::max(st.max_flushed_fraction, static_cast<double>(p.flushed) / elements);
      }
      if (p.saturated != 0) {
        ++st.blocks_with_saturation;
        st.max_saturated_fraction = std::max(st.max_saturated_fraction, static_cast<double>(p.saturated) / elements);
      }
      st.tensor_amax = std::max(st.tensor_amax, p.amax);
      if (p.amax == 0.0f) ++st.zero_blocks;
      if (p.min_nonzero != kInfF) {
        // log2 is monotonic: the largest quotient's log2 is the largest log2, one call at the end.
        max_block_ratio = std::max(max_block_ratio, static_cast<double>(p.max_finite) / static_cast<double>(p.min_nonzero));
        max_finite_all = std::max(max_finite_all, p.max_finite);
        min_nonzero_all = std::min(min_nonzero_all, p.min_nonzero);
      }
    }
  }
  if (min_nonzero_all != kInfF) {
    st.dynamic_range = std::log2(static_cast<double>(max_finite_all) / static_cast<double>(min_nonzero_all));
    st.max_block_dynamic_range = std::log2(max_block_ratio);
  }
  const double far = std::exp2(far_log2);
  const double tensor_amax = st.tensor_amax;
  for (const float a : per_block) st.far_blocks += a > 0.0f && tensor_amax > static_cast<double>(a) * far;

  // The multipliers, as dequantize takes them; sorted, the finite positive ones first.
  detail::block_multipliers(q, per_block);
  const auto kept_end = std::partition(per_block.begin(), per_block.end(),
                                       [](float m) { return std::isfinite(m) && m > 0.0f; });
  const std::size_t n = static_cast<std::size_t>(kept_end - per_block.begin());
  st.multiplier_blocks = n;
  st.multiplier_left_out = st.blocks - n;
  if (n != 0) {
    std::sort(per_block.begin(), kept_end);
    // Sorted, equal multipliers are neighbours (E8M0 and E4M3 scales give at most 256
    // distinct ones per tensor): log2 once per run of them.
    float last = per_block[0];
    double last_log2 = std::log2(static_cast<double>(last));
    auto log2_at = [&](std::size_t k) {
      if (per_block[k] != last) {
        last = per_block[k];
        last_log2 = std::log2(static_cast<double>(last));
      }
      return last_log2;
    };
    st.log2_multiplier_min = log2_at(0);
    st.log2_multiplier_max = log2_at(n - 1);
    double sum = 0.0;
    for (std::size_t k = 0; k < n; ++k) sum += log2_at(k);
    const double mean = sum / static_cast<double>(n);
    double squares = 0.0;
    for (std::size_t k = 0; k < n; ++k) {
      const double d = log2_at(k) - mean;
      squares += d * d;
    }
    st.log2_multiplier_mean = mean;
    st.log2_multiplier_std = std::sqrt(squares / static_cast<double>(n));
    auto quantile = [&](std::size_t percent) { return log2_at((percent * n + 99) / 100 - 1); };
    st.log2_multiplier_quantiles = {quantile(1),  quantile(5),  quantile(25), quantile(50),
                                    quantile(75), quantile(95), quantile(99)};
  }
  return st;
}

double kurtosis(std::span<const float> x) {
  // Two passes: the mean first, so that the central moments do not cancel.
  double sum = 0.0;
  std::size_t n = 0;
  for (const float v : x) {
    if (!std::isfinite(v)) continue;
    sum += static_cast<double>(v);
    ++n;
  }
  if (n == 0) return 0.0;
  const double mean = sum / static_cast<double>(n);
  double m2 = 0.0, m4 = 0.0;
  for (const float v : x) {
    if (!std::isfinite(v)) continue;
    const double d = static_cast<double>(v) - mean, d2 = d * d;
    m2 += d2;
    m4 += d2 * d2;
  }
  m2 /= static_cast<double>(n);
  m4 /= static_cast<double>(n);
  return m2 == 0.0 ? 0.0 : m4 / (m2 * m2);
}

}  // namespace mixprec::lowp
