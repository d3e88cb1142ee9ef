// lowp::block_stats and lowp::kurtosis. Every statistic is computed again here from
// quantize's codes and scales alone (codes and scales decoded with the formats library, the
// multipliers checked against lowp::dequantize, the quantizer's factor written out from
// docs/low_precision.md's rules and checked by its counts summing to q.counts), for every
// recipe and layout, 2-D tiles, rht, short last blocks, zeros, NaN and inf; far and zero
// blocks are the planted ones; quantiles are checked on a hand-sorted list.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mixprec/formats/types.hpp"
#include "mixprec/lowp/block_stats.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/lowp/scaling.hpp"
#include "support.hpp"

namespace mixprec::lowp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- test data: lognormal values with planted regions ----------------------------------

struct Rect {
  std::size_t r0, r1, c0, c1;  // input rows [r0, r1), columns [c0, c1)
  bool holds(std::size_t r, std::size_t c) const { return r >= r0 && r < r1 && c >= c0 && c < c1; }
};

struct Shape {
  std::size_t rows, cols;
  std::vector<Rect> tiny, zero, huge;  // tiny: * 2^-24; zero: 0 (signs alternate); huge: * 16
  std::size_t nan_r, nan_c;            // one NaN, outside every region
};

// 256 x 320: fp8-block's last block of a row is 64 long; 37 x 70: every recipe's last block
// (and tile) is short; 48 x 80: rht in both layouts. The regions are aligned to 32 (16), so
// that they fill whole 1x32, 1x16 and 16x16 blocks in either layout.
std::vector<Shape> shapes() {
  return {
      {256, 320, {{32, 64, 64, 96}, {128, 160, 0, 32}, {224, 256, 288, 320}}, {{64, 96, 128, 160}},
       {{0, 32, 256, 288}}, 200, 100},
      {37, 70, {{0, 32, 32, 64}}, {{16, 32, 0, 16}}, {{32, 37, 64, 70}}, 36, 5},
      {48, 80, {{16, 32, 32, 64}}, {{0, 16, 64, 80}}, {{32, 48, 64, 80}}, 5, 5},
  };
}

// The variants: 0 numbers only; 1 one NaN (which makes nvfp4's tensor scale, and so every
// block's, NaN); 2 extremes: +-inf, -0, a subnormal, a value near FLT_MAX and a run of 32
// values of +-2^-130 (MX and NVFP4 blocks with the smallest scale); 3 the extremes, the NaN
// and a run of 32 NaNs (a block of the 1x32 recipes with no number in it). The planted values
// lie outside the regions.
std::vector<float> make_tensor(const Shape& s, std::uint64_t seed, int variant) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 0.5);
  std::vector<float> x(s.rows * s.cols);
  for (std::size_t r = 0; r < s.rows; ++r) {
    for (std::size_t c = 0; c < s.cols; ++c) {
      float v = static_cast<float>(std::exp(normal(gen)));
      if (gen() & 1) v = -v;
      for (const Rect& t : s.tiny) v = t.holds(r, c) ? v * 0x1p-24f : v;
      for (const Rect& t : s.huge) v = t.holds(r, c) ? v * 16.0f : v;
      for (const Rect& t : s.zero) v = t.holds(r, c) ? ((r + c) % 2 ? -0.0f : 0.0f) : v;
      x[r * s.cols + c] = v;
    }
  }
  if (variant == 1 || variant == 3) x[s.nan_r * s.cols + s.nan_c] = kNaN;
  if (variant >= 2) {
    const std::size_t last = s.rows - 1;
    x[last * s.cols + 0] = kInf;
    x[last * s.cols + 1] = -kInf;
    x[last * s.cols + 2] = -0.0f;
    x[last * s.cols + 3] = 0x1p-140f;
    x[(last - 1) * s.cols + 1] = -3e38f;
    for (std::size_t c = 0; c < 32; ++c) x[(last - 3) * s.cols + c] = c % 3 ? 0x1p-130f : -0x1p-130f;
    if (variant == 3 && s.cols >= 64) std::fill_n(x.begin() + static_cast<std::ptrdiff_t>((last - 2) * s.cols + 32), 32, kNaN);
  }
  return x;
}

// ---- the configurations ----------------------------------------------------------------

std::vector<QuantizeConfig> configs() {
  std::vector<QuantizeConfig> v;
  auto add = [&](Recipe r, Element e, auto&& tweak) {
    QuantizeConfig c;
    c.recipe = r;
    c.element = e;
    tweak(c);
    v.push_back(c);
  };
  auto none = [](QuantizeConfig&) {};
  for (Element e : {Element::e4m3, Element::e5m2}) {
    add(Recipe::fp8_delayed, e, none);
    add(Recipe::fp8_current, e, none);
  }
  add(Recipe::fp8_delayed, Element::e4m3, [](QuantizeConfig& c) { c.scale = 1024.0f; });  // saturates
  add(Recipe::fp8_current, Element::e4m3, [](QuantizeConfig& c) { c.power_of_2_scales = true; });
  for (Element e : {Element::e4m3, Element::e5m2}) {
    for (ScaleRounding sr : {ScaleRounding::rceil, ScaleRounding::floor}) {
      for (Flavour f : {Flavour::te, Flavour::torchao}) {
        add(Recipe::mxfp8, e, [&](QuantizeConfig& c) {
          c.scale_rounding = sr;
          c.flavour = f;
        });
      }
    }
  }
  for (bool tile : {false, true}) {
    for (bool pow2 : {false, true}) {
      add(Recipe::fp8_block, Element::e4m3, [&](QuantizeConfig& c) {
        c.tile_2d = tile;
        c.power_of_2_scales = pow2;
      });
    }
  }
  add(Recipe::fp8_block, Element::e5m2, none);
  add(Recipe::nvfp4, Element::e2m1, none);
  add(Recipe::nvfp4, Element::e2m1, [](QuantizeConfig& c) { c.tile_2d = true; });
  add(Recipe::nvfp4, Element::e2m1, [](QuantizeConfig& c) { c.flavour = Flavour::torchao; });
  add(Recipe::nvfp4, Element::e2m1, [](QuantizeConfig& c) { c.rht = true; });
  add(Recipe::nvfp4, Element::e2m1, [](QuantizeConfig& c) {
    c.rht = true;
    c.stochastic_rounding = true;
  });
  add(Recipe::nvfp4, Element::e2m1, [](QuantizeConfig& c) { c.stochastic_rounding = true; });
  for (ScaleRounding sr : {ScaleRounding::rceil, ScaleRounding::floor}) {
    for (Flavour f : {Flavour::te, Flavour::torchao}) {
      add(Recipe::mxfp4, Element::e2m1, [&](QuantizeConfig& c) {
        c.scale_rounding = sr;
        c.flavour = f;
      });
    }
  }
  add(Recipe::mxfp4, Element::e2m1, [](QuantizeConfig& c) { c.stochastic_rounding = true; });
  return v;
}

std::string describe(const QuantizeConfig& c, const Shape& s, int variant) {
  std::string n(recipe_name(c.recipe));
  n.append(" ").append(element_name(c.element)).append(" ").append(layout_name(c.layout));
  if (c.tile_2d) n.append(" tile_2d");
  if (c.rht) n.append(" rht");
  if (c.stochastic_rounding) n.append(" sr");
  if (c.power_of_2_scales) n.append(*c.power_of_2_scales ? " pow2" : " no-pow2");
  if (c.recipe == Recipe::fp8_delayed) n.append(" scale ").append(std::to_string(c.scale));
  if (c.recipe == Recipe::mxfp8 || c.recipe == Recipe::mxfp4) n.append(" ").append(scale_rounding_name(c.scale_rounding));
  n.append(" ").append(flavour_name(c.flavour));
  n.append(" ").append(std::to_string(s.rows)).append("x").append(std::to_string(s.cols));
  if (variant == 1) n.append(" nan");
  if (variant == 2) n.append(" extremes");
  if (variant == 3) n.append(" extremes nan");
  return n;
}

struct Case {
  QuantizeConfig config;
  Shape shape;
  int variant;
  std::vector<float> x;
  Quantized q;
  std::string name;
};

template <class F>
void for_each_case(F&& f) {
  std::uint64_t seed = 1;
  for (const Shape& s : shapes()) {
    for (QuantizeConfig c : configs()) {
      for (Layout l : {Layout::rowwise, Layout::columnwise}) {
        c.layout = l;
        if (c.rht && (l == Layout::rowwise ? s.cols : s.rows) % 16 != 0) continue;
        for (int variant : {0, 1, 2, 3}) {
          Case t{c, s, variant, make_tensor(s, ++seed, variant), {}, describe(c, s, variant)};
          std::vector<std::uint32_t> random;
          if (c.stochastic_rounding) {
            random.resize(s.rows * s.cols);
            random_words(seed * 7919, random);
          }
          t.q = quantize(t.x, s.rows, s.cols, c, random);
          f(t);
        }
      }
    }
  }
}

// ---- the independent computation ---------------------------------------------------------

float decode_code(const Quantized& q, std::size_t r, std::size_t c) {
  if (q.config.element == Element::e2m1) {
    const std::uint8_t byte = q.codes[r * q.row_bytes + c / 2];
    return e2m1_decode(static_cast<std::uint8_t>(c % 2 == 0 ? byte & 0xF : byte >> 4));
  }
  const std::uint8_t code = q.codes[r * q.row_bytes + c];
  return q.config.element == Element::e4m3 ? static_cast<float>(f8e4m3::from_bits(code))
                                           : static_cast<float>(f8e5m2::from_bits(code));
}

// What dequantize multiplies block s by, from the stored scale (docs/low_precision.md).
float multiplier(const Quantized& q, std::size_t s) {
  switch (q.scale_format) {
    case ScaleFormat::f32: return q.scale_inv[s];
    case ScaleFormat::e8m0: return static_cast<float>(e8m0::from_bits(q.scale_codes[s]));
    case ScaleFormat::e4m3: {
      const float sb = static_cast<float>(f8e4m3::from_bits(q.scale_codes[s]));
      if (q.config.flavour == Flavour::torchao) return q.tensor_scale * sb;
      return sb * q.tensor_amax * static_cast<float>(1.0 / (6.0 * 448.0));
    }
  }
  return 0.0f;
}

// What quantize multiplied block s's values by before the cast, from the stored scale (the
// fp8-block scale from the block's amax: its stored 1 / scale does not give it back).
float factor(const Quantized& q, std::size_t s, float block_amax) {
  const QuantizeConfig& c = q.config;
  if (recipe_info(c.recipe).block == 0) return q.tensor_scale;
  if (c.recipe == Recipe::fp8_block)
    return scale_from_amax(block_amax, max_finite(c.element), effective_power_of_2_scales(c), c.amax_epsilon,
                           c.value_for_inf);
  if (c.recipe == Recipe::nvfp4) {
    const float sb = static_cast<float>(f8e4m3::from_bits(q.scale_codes[s]));
    if (c.flavour == Flavour::torchao) return (1.0f / q.tensor_scale) / sb;
    return std::min(1.0f / (sb * (1.0f / q.tensor_scale)), kFltMax);  // std::min keeps a NaN first operand
  }
  const std::uint8_t code = q.scale_codes[s];
  if (c.flavour == Flavour::te) return mx_quantize_factor(e8m0::from_bits(code), c.scale_rounding);
  if (c.scale_rounding == ScaleRounding::rceil) return code == 0xFF ? kNaN : code == 0 ? 1.0f : std::exp2(127.0f - code);
  return code == 0xFF ? 0.0f : 1.0f / std::max(std::exp2(static_cast<float>(code) - 127.0f), 0x1p-126f);
}

struct Block {
  std::size_t r0, r1, c0, c1;  // grid rows and columns
};

Block block_of(const Quantized& q, std::size_t s) {
  const RecipeInfo& info = recipe_info(q.config.recipe);
  if (info.block == 0) return {0, q.code_rows, 0, q.code_cols};
  const std::size_t tr = q.config.tile_2d ? info.tile_rows : 1;
  const std::size_t sr = s / q.scale_cols, sc = s % q.scale_cols;
  return {sr * tr, std::min(q.code_rows, (sr + 1) * tr), sc * info.block,
          std::min(q.code_cols, (sc + 1) * info.block)};
}

// The input element at grid position (r, c).
std::size_t input_index(const Quantized& q, std::size_t r, std::size_t c) {
  return q.config.layout == Layout::rowwise ? r * q.cols + c : c * q.cols + r;
}

// The grid's values as the cast saw them (transposed; rht along each grid row).
std::vector<float> grid_values(const Quantized& q, const std::vector<float>& x) {
  std::vector<float> g(q.code_rows * q.code_cols);
  for (std::size_t r = 0; r < q.code_rows; ++r)
    for (std::size_t c = 0; c < q.code_cols; ++c) g[r * q.code_cols + c] = x[input_index(q, r, c)];
  if (q.config.rht) reference::rht16(g);
  return g;
}

struct Expected {
  BlockStats st;
  std::vector<std::uint64_t> flushed, saturated;  // per block
};

Expected expected_stats(const Quantized& q, const std::vector<float>& x, double far_log2) {
  const std::vector<float> g = grid_values(q, x);
  const float max_value = max_finite(q.config.element);
  Expected e;
  BlockStats& st = e.st;
  st.blocks = q.scale_rows * q.scale_cols;
  st.far_log2 = far_log2;
  std::vector<float> amax(st.blocks);
  std::vector<double> logs;
  float maxf_all = 0.0f, minnz_all = kInf;
  for (std::size_t s = 0; s < st.blocks; ++s) {
    const Block b = block_of(q, s);
    float a = 0.0f, maxf = 0.0f, minnz = kInf;
    for (std::size_t r = b.r0; r < b.r1; ++r)
      for (std::size_t c = b.c0; c < b.c1; ++c) {
        const float v = std::fabs(g[r * q.code_cols + c]);
        if (!std::isnan(v)) a = std::max(a, v);
        if (std::isfinite(v) && v != 0.0f) {
          maxf = std::max(maxf, v);
          minnz = std::min(minnz, v);
        }
      }
    const float f = factor(q, s, a);
    std::uint64_t flushed = 0, saturated = 0;
    for (std::size_t r = b.r0; r < b.r1; ++r)
      for (std::size_t c = b.c0; c < b.c1; ++c) {
        const float v = g[r * q.code_cols + c];
        if (!std::isfinite(v)) continue;
        if (std::fabs(v * f) > max_value) ++saturated;
        if (v != 0.0f && decode_code(q, r, c) == 0.0f) ++flushed;
      }
    e.flushed.push_back(flushed);
    e.saturated.push_back(saturated);
    const double n = static_cast<double>((b.r1 - b.r0) * (b.c1 - b.c0));
    st.flushed += flushed;
    st.saturated += saturated;
    st.blocks_with_flush += flushed > 0;
    st.blocks_with_saturation += saturated > 0;
    if (flushed > 0) st.max_flushed_fraction = std::max(st.max_flushed_fraction, static_cast<double>(flushed) / n);
    if (saturated > 0) st.max_saturated_fraction = std::max(st.max_saturated_fraction, static_cast<double>(saturated) / n);
    amax[s] = a;
    st.tensor_amax = std::max(st.tensor_amax, a);
    st.zero_blocks += a == 0.0f;
    if (minnz != kInf) {
      st.max_block_dynamic_range =
          std::max(st.max_block_dynamic_range, std::log2(static_cast<double>(maxf)) - std::log2(static_cast<double>(minnz)));
      maxf_all = std::max(maxf_all, maxf);
      minnz_all = std::min(minnz_all, minnz);
    }
    const float m = multiplier(q, s);
    if (std::isfinite(m) && m > 0.0f) logs.push_back(std::log2(static_cast<double>(m)));
  }
  if (minnz_all != kInf)
    st.dynamic_range = std::log2(static_cast<double>(maxf_all)) - std::log2(static_cast<double>(minnz_all));
  for (float a : amax) st.far_blocks += a > 0.0f && static_cast<double>(st.tensor_amax) > static_cast<double>(a) * std::exp2(far_log2);
  std::sort(logs.begin(), logs.end());
  const std::size_t n = logs.size();
  st.multiplier_blocks = n;
  st.multiplier_left_out = st.blocks - n;
  if (n > 0) {
    st.log2_multiplier_min = logs.front();
    st.log2_multiplier_max = logs.back();
    double sum = 0.0;
    for (double l : logs) sum += l;
    st.log2_multiplier_mean = sum / static_cast<double>(n);
    double sq = 0.0;
    for (double l : logs) sq += (l - st.log2_multiplier_mean) * (l - st.log2_multiplier_mean);
    st.log2_multiplier_std = std::sqrt(sq / static_cast<double>(n));
    // Nearest rank: the smallest k with k / n >= P / 100.
    auto rank = [&](std::size_t p) {
      std::size_t k = p * n / 100;
      if (k * 100 < p * n) ++k;
      return logs[k - 1];
    };
    st.log2_multiplier_quantiles = {rank(1), rank(5), rank(25), rank(50), rank(75), rank(95), rank(99)};
  }
  return e;
}

void expect_stats(const BlockStats& got, const BlockStats& want, const std::string& name) {
  EXPECT_EQ(got.blocks, want.blocks) << name;
  EXPECT_EQ(got.multiplier_blocks, want.multiplier_blocks) << name;
  EXPECT_EQ(got.multiplier_left_out, want.multiplier_left_out) << name;
  EXPECT_EQ(got.log2_multiplier_min, want.log2_multiplier_min) << name;
  EXPECT_EQ(got.log2_multiplier_max, want.log2_multiplier_max) << name;
  EXPECT_NEAR(got.log2_multiplier_mean, want.log2_multiplier_mean, 1e-9) << name;
  EXPECT_NEAR(got.log2_multiplier_std, want.log2_multiplier_std, 1e-9) << name;
  const BlockQuantiles& g = got.log2_multiplier_quantiles;
  const BlockQuantiles& w = want.log2_multiplier_quantiles;
  EXPECT_EQ(g.p01, w.p01) << name;
  EXPECT_EQ(g.p05, w.p05) << name;
  EXPECT_EQ(g.p25, w.p25) << name;
  EXPECT_EQ(g.p50, w.p50) << name;
  EXPECT_EQ(g.p75, w.p75) << name;
  EXPECT_EQ(g.p95, w.p95) << name;
  EXPECT_EQ(g.p99, w.p99) << name;
  EXPECT_EQ(got.flushed, want.flushed) << name;
  EXPECT_EQ(got.saturated, want.saturated) << name;
  EXPECT_EQ(got.blocks_with_flush, want.blocks_with_flush) << name;
  EXPECT_EQ(got.blocks_with_saturation, want.blocks_with_saturation) << name;
  EXPECT_EQ(got.max_flushed_fraction, want.max_flushed_fraction) << name;
  EXPECT_EQ(got.max_saturated_fraction, want.max_saturated_fraction) << name;
  EXPECT_EQ(std::bit_cast<std::uint32_t>(got.tensor_amax), std::bit_cast<std::uint32_t>(want.tensor_amax)) << name;
  EXPECT_EQ(got.far_log2, want.far_log2) << name;
  EXPECT_EQ(got.far_blocks, want.far_blocks) << name;
  EXPECT_EQ(got.zero_blocks, want.zero_blocks) << name;
  EXPECT_NEAR(got.dynamic_range, want.dynamic_range, 1e-12) << name;
  EXPECT_NEAR(got.max_block_dynamic_range, want.max_block_dynamic_range, 1e-12) << name;
}

// ---- tests ---------------------------------------------------------------------------

// The test's multipliers are what dequantize multiplies by: every element of a block whose
// code decodes to a finite nonzero number dequantizes to decode(code) * m (a NaN m: NaN).
TEST(BlockStats, TheTestsMultipliersAreDequantizes) {
  std::size_t checked = 0;
  for_each_case([&](const Case& t) {
    const Quantized& q = t.q;
    const std::vector<float> d = dequantize(q);
    std::size_t bad = 0;
    for (std::size_t s = 0; s < q.scale_rows * q.scale_cols; ++s) {
      const Block b = block_of(q, s);
      const float m = multiplier(q, s);
      for (std::size_t r = b.r0; r < b.r1; ++r)
        for (std::size_t c = b.c0; c < b.c1; ++c) {
          const float v = decode_code(q, r, c), got = d[input_index(q, r, c)];
          if (std::isnan(m)) bad += !std::isnan(got);
          else if (std::isfinite(v) && v != 0.0f) bad += std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(v * m);
          ++checked;
        }
    }
    EXPECT_EQ(bad, 0u) << t.name;
  });
  EXPECT_GT(checked, 0u);
}

// Per-block flushed and saturated counts add up to the quantizer's own counts, in block_stats
// and in this test's computation (which checks the test's factors against the quantizer).
TEST(BlockStats, PerBlockCountsSumToTheQuantizersCounts) {
  std::uint64_t left_out = 0;
  std::uint64_t flushed[6] = {}, saturated[6] = {}, partial[6] = {};  // per recipe
  for_each_case([&](const Case& t) {
    const BlockStats st = block_stats(t.q, t.x);
    EXPECT_EQ(st.flushed, t.q.counts.flushed) << t.name;
    EXPECT_EQ(st.saturated, t.q.counts.saturated) << t.name;
    const Expected e = expected_stats(t.q, t.x, 8.0);
    std::uint64_t f = 0, s = 0;
    for (std::size_t b = 0; b < e.flushed.size(); ++b) {
      f += e.flushed[b];
      s += e.saturated[b];
    }
    EXPECT_EQ(f, t.q.counts.flushed) << t.name;
    EXPECT_EQ(s, t.q.counts.saturated) << t.name;
    const auto r = static_cast<std::size_t>(t.q.config.recipe);
    flushed[r] += st.flushed;
    saturated[r] += st.saturated;
    // Some but not all blocks flushed: the per-block split is not all-or-nothing.
    partial[r] += st.blocks_with_flush > 0 && st.blocks_with_flush < st.blocks;
    left_out += st.multiplier_left_out;
  });
  // The sweep covers flushes in every recipe, saturation where a recipe can saturate (a
  // given scale, MX floor, E4M3 block scales rounded down) and blocks without a usable
  // multiplier.
  for (const RecipeInfo& info : recipe_table()) {
    const auto r = static_cast<std::size_t>(info.recipe);
    EXPECT_GT(flushed[r], 0u) << info.name;
    if (info.block != 0) {
      EXPECT_GT(partial[r], 0u) << info.name;
    }
    if (info.recipe != Recipe::fp8_current && info.recipe != Recipe::fp8_block) {
      EXPECT_GT(saturated[r], 0u) << info.name;
    }
  }
  EXPECT_GT(left_out, 0u);
}

TEST(BlockStats, EveryStatisticMatchesAnIndependentComputation) {
  for_each_case([&](const Case& t) {
    for (double far_log2 : {8.0, 12.5}) {
      expect_stats(block_stats(t.q, t.x, far_log2), expected_stats(t.q, t.x, far_log2).st,
                   t.name + " far_log2 " + std::to_string(far_log2));
    }
  });
}

// Without inf, the far blocks are the blocks inside the planted tiny regions (2^-24 of the
// rest) and the zero blocks those inside the zero regions; a per-tensor recipe has one block.
TEST(BlockStats, FarAndZeroBlocksAreThePlantedOnes) {
  std::uint64_t planted_far = 0;
  for_each_case([&](const Case& t) {
    if (t.variant >= 2) return;
    const Quantized& q = t.q;
    std::uint64_t tiny = 0, zero = 0;
    for (std::size_t s = 0; s < q.scale_rows * q.scale_cols; ++s) {
      const Block b = block_of(q, s);
      bool all_tiny = true, all_zero = true, holds_nan = false;
      for (std::size_t r = b.r0; r < b.r1; ++r)
        for (std::size_t c = b.c0; c < b.c1; ++c) {
          const std::size_t i = input_index(q, r, c), row = i / q.cols, col = i % q.cols;
          holds_nan = holds_nan || (row == t.shape.nan_r && col == t.shape.nan_c);
          all_tiny = all_tiny && std::any_of(t.shape.tiny.begin(), t.shape.tiny.end(), [&](const Rect& x) { return x.holds(row, col); });
          all_zero = all_zero && std::any_of(t.shape.zero.begin(), t.shape.zero.end(), [&](const Rect& x) { return x.holds(row, col); });
        }
      tiny += all_tiny;
      // With rht the NaN spreads over its group of 16 (the block), which is then all NaN: amax 0.
      zero += all_zero || (q.config.rht && t.variant == 1 && holds_nan);
    }
    const BlockStats st = block_stats(q, t.x, 12.0);
    EXPECT_EQ(st.far_blocks, tiny) << t.name;
    EXPECT_EQ(st.zero_blocks, zero) << t.name;
    if (recipe_info(q.config.recipe).block == 0) {
      EXPECT_EQ(st.blocks, 1u) << t.name;
    }
    planted_far += tiny;
  });
  EXPECT_GT(planted_far, 100u);
}

// fp8-block without power-of-two scales: for amax 0x1.c69526p+0, s = 448 / amax gives
// amax * s == 448 (not saturated), but 1 / (1 / s) is one ulp above s and would make every
// element of the block saturated: the factor must be the quantizer's, not 1 / scale_inv.
TEST(BlockStats, Fp8BlockFactorIsTheQuantizersNotOneOverScaleInv) {
  const float amax = 0x1.c69526p+0f;
  QuantizeConfig c;
  c.recipe = Recipe::fp8_block;
  c.power_of_2_scales = false;
  const std::vector<float> x(128, amax);
  const Quantized q = quantize(x, 1, 128, c);
  ASSERT_NE(1.0f / q.scale_inv[0], 448.0f / amax);  // the case: 1 / scale_inv is not the scale
  ASSERT_GT(amax * (1.0f / q.scale_inv[0]), 448.0f);
  EXPECT_EQ(q.counts.saturated, 0u);
  const BlockStats st = block_stats(q, x);
  EXPECT_EQ(st.saturated, 0u);
  EXPECT_EQ(st.blocks_with_saturation, 0u);
}

// far_blocks: amax > 0 and tensor_amax > amax * 2^far_log2, strictly.
TEST(BlockStats, FarBlocksLieBeyondTheThreshold) {
  // Block amaxes 256 (the tensor's), 1 (exactly 2^8 below: not far), 1.5 (2^7.4 below),
  // 0.99 (far), 2^-20 (far), 0 (a zero block, never far).
  const float amax[6] = {256.0f, 1.0f, 1.5f, 0.99f, 0x1p-20f, 0.0f};
  std::vector<float> x(6 * 32);
  for (std::size_t b = 0; b < 6; ++b)
    for (std::size_t i = 0; i < 32; ++i) x[b * 32 + i] = amax[b] * (i % 2 ? 1.0f : -0.5f);
  QuantizeConfig c;
  c.recipe = Recipe::mxfp8;
  const Quantized q = quantize(x, 1, x.size(), c);
  const BlockStats st = block_stats(q, x);
  EXPECT_EQ(st.tensor_amax, 256.0f);
  EXPECT_EQ(st.zero_blocks, 1u);
  EXPECT_EQ(st.far_blocks, 2u);
  EXPECT_EQ(block_stats(q, x, 7.0).far_blocks, 4u);   // 1.5: 256 > 1.5 * 128
  EXPECT_EQ(block_stats(q, x, 7.5).far_blocks, 3u);   // 1.5 * 2^7.5 = 271.5 > 256
  EXPECT_EQ(block_stats(q, x, 0.0).far_blocks, 4u);   // every block below the tensor's
  EXPECT_EQ(block_stats(q, x, 27.9).far_blocks, 1u);  // 2^-20 is 2^28 below 256
  EXPECT_EQ(block_stats(q, x, 28.0).far_blocks, 0u);  // ... and not more
}

// mxfp8 blocks holding 2^e alone have the multiplier 2^(e - 8) (TE's rounding up of
// 2^e / 448); the quantiles are the nearest ranks of the hand-sorted list.
TEST(BlockStats, QuantilesAreNearestRanksOfTheSortedMultipliers) {
  const int e[20] = {5, -3, 12, 0, 7, 7, -10, 2, 9, 1, 4, -1, 15, 3, 6, 8, -6, 11, 2, 20};
  // Sorted: -10 -6 -3 -1 0 1 2 2 3 4 | 5 6 7 7 8 9 11 12 15 20; log2 multipliers are these - 8.
  std::vector<float> x(20 * 32);
  for (std::size_t b = 0; b < 20; ++b) std::fill_n(x.begin() + static_cast<std::ptrdiff_t>(b * 32), 32, std::ldexp(1.0f, e[b]));
  QuantizeConfig c;
  c.recipe = Recipe::mxfp8;
  const Quantized q = quantize(x, 1, x.size(), c);
  for (std::size_t b = 0; b < 20; ++b) ASSERT_EQ(static_cast<float>(e8m0::from_bits(q.scale_codes[b])), std::ldexp(1.0f, e[b] - 8));
  const BlockStats st = block_stats(q, x);
  EXPECT_EQ(st.blocks, 20u);
  EXPECT_EQ(st.multiplier_blocks, 20u);
  EXPECT_EQ(st.log2_multiplier_min, -18.0);
  EXPECT_EQ(st.log2_multiplier_max, 12.0);
  // k = ceil(P * 20 / 100): p01 1, p05 1, p25 5, p50 10, p75 15, p95 19, p99 20.
  const BlockQuantiles want{-18.0, -18.0, -8.0, -4.0, 0.0, 7.0, 12.0};
  EXPECT_EQ(st.log2_multiplier_quantiles, want);
  EXPECT_DOUBLE_EQ(st.log2_multiplier_mean, 92.0 / 20.0 - 8.0);
  // sum of e^2 = 1374: variance 1374 / 20 - 4.6^2 = 47.54.
  EXPECT_NEAR(st.log2_multiplier_std, std::sqrt(47.54), 1e-12);
  // Seven blocks: k = 1, 1, 2, 4, 6, 7, 7.
  const BlockStats seven = block_stats(quantize(std::span<const float>(x).first(7 * 32), 1, 7 * 32, c),
                                       std::span<const float>(x).first(7 * 32));
  // e of the first seven: 5 -3 12 0 7 7 -10, sorted -10 -3 0 5 7 7 12.
  const BlockQuantiles want7{-18.0, -18.0, -11.0, -3.0, -1.0, 4.0, 4.0};
  EXPECT_EQ(seven.log2_multiplier_quantiles, want7);
  // One block: every quantile is its value.
  const BlockStats one = block_stats(quantize(std::span<const float>(x).first(32), 1, 32, c), std::span<const float>(x).first(32));
  const BlockQuantiles want1{-3.0, -3.0, -3.0, -3.0, -3.0, -3.0, -3.0};
  EXPECT_EQ(one.log2_multiplier_quantiles, want1);
  EXPECT_EQ(one.log2_multiplier_std, 0.0);
}

// block_stats depends on (q, src) alone: a what-if (the same tensor under another recipe,
// quantized into the same result object) gives that recipe's statistics, and the first
// result's statistics do not change after it.
TEST(BlockStats, IsAPureFunctionOfTheQuantizationAndItsInput) {
  const Shape s = shapes()[0];
  const std::vector<float> x = make_tensor(s, 99, 0);
  QuantizeConfig a;
  a.recipe = Recipe::mxfp8;
  QuantizeConfig b;
  b.recipe = Recipe::nvfp4;
  b.element = Element::e2m1;
  b.tile_2d = true;
  const Quantized qa = quantize(x, s.rows, s.cols, a);
  const BlockStats first = block_stats(qa, x);
  Quantized reused = qa;
  EXPECT_EQ(block_stats(reused, x), first);
  quantize(x, s.rows, s.cols, b, {}, reused);  // the what-if, into the same object
  const BlockStats what_if = block_stats(reused, x);
  expect_stats(what_if, expected_stats(reused, x, 8.0).st, "nvfp4 tile_2d what-if");
  EXPECT_EQ(what_if, block_stats(quantize(x, s.rows, s.cols, b), x));
  EXPECT_EQ(block_stats(qa, x), first);
  EXPECT_NE(what_if.blocks, first.blocks);
}

TEST(BlockStats, EmptyTensorsAndOneBlockRecipes) {
  QuantizeConfig c;  // fp8-current: one block, also for an empty tensor
  const std::vector<float> none;
  const BlockStats e = block_stats(quantize(none, 0, 5, c), none);
  EXPECT_EQ(e.blocks, 1u);
  EXPECT_EQ(e.zero_blocks, 1u);
  EXPECT_EQ(e.flushed, 0u);
  EXPECT_EQ(e.max_flushed_fraction, 0.0);
  EXPECT_EQ(e.dynamic_range, 0.0);
  c.recipe = Recipe::mxfp8;
  const BlockStats m = block_stats(quantize(none, 0, 5, c), none);
  EXPECT_EQ(m.blocks, 0u);
  EXPECT_EQ(m.multiplier_blocks, 0u);
  EXPECT_EQ(m.log2_multiplier_mean, 0.0);
  // Values 1 and 2^-20 in one fp8-current block: both dynamic ranges are 20.
  c.recipe = Recipe::fp8_current;
  const std::vector<float> x = {1.0f, 0x1p-20f, 0.0f, kNaN};
  const BlockStats t = block_stats(quantize(x, 2, 2, c), x);
  EXPECT_EQ(t.blocks, 1u);
  EXPECT_DOUBLE_EQ(t.dynamic_range, 20.0);
  EXPECT_DOUBLE_EQ(t.max_block_dynamic_range, 20.0);
  EXPECT_EQ(t.flushed, 1u);  // 2^-20 * 448 is below E4M3's smallest subnormal
  EXPECT_EQ(t.max_flushed_fraction, 0.25);
}

TEST(BlockStats, RejectsAWrongInputAndFarLog2) {
  QuantizeConfig c;
  c.recipe = Recipe::mxfp8;
  const std::vector<float> x(6, 1.0f);
  const Quantized q = quantize(x, 2, 3, c);
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { block_stats(q, std::span<const float>(x).first(5)); }),
            "block_stats: src: expected 6 elements, found 5");
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { block_stats(q, x, -1.0); }),
            "block_stats: far_log2: expected a finite number >= 0, found -1");
  EXPECT_NE(test::error_of<std::invalid_argument>([&] { block_stats(q, x, kNaN); }).find("far_log2: expected"),
            std::string::npos);
  // A hand-made q is checked before its buffers are read.
  Quantized broken = q;
  broken.scale_codes.pop_back();
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { block_stats(broken, x); }),
            "block_stats: q: expected 2 x 1 scales of recipe mxfp8, found 2 x 1 (1 stored)");
  broken = q;
  broken.codes.pop_back();
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { block_stats(broken, x); }),
            "block_stats: q: expected a code grid [2, 3] of 6 bytes for the rowwise input [2, 3], found [2, 3] of 5");
  broken = q;
  broken.config.rht = true;  // the transform's groups of 16 are nvfp4's blocks only
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { block_stats(broken, x); }),
            "block_stats: q: rht: expected nvfp4 with 1x16 blocks, found recipe mxfp8");
}

// ---- kurtosis -------------------------------------------------------------------------

TEST(Kurtosis, ConstantAndEmptyGiveZero) {
  EXPECT_EQ(kurtosis(std::vector<float>(100, 3.5f)), 0.0);
  EXPECT_EQ(kurtosis(std::vector<float>{}), 0.0);
  EXPECT_EQ(kurtosis(std::vector<float>{kNaN, kInf, -kInf}), 0.0);
}

TEST(Kurtosis, SmallVectorByHand) {
  // mean 4; deviations -3 -2 -1 0 6: m2 = 50 / 5 = 10, m4 = (81 + 16 + 1 + 0 + 1296) / 5 = 278.8.
  EXPECT_DOUBLE_EQ(kurtosis(std::vector<float>{1, 2, 3, 4, 10}), 2.788);
  // Two values: m4 / m2^2 = 1.
  EXPECT_DOUBLE_EQ(kurtosis(std::vector<float>{-1.0f, 1.0f}), 1.0);
}

TEST(Kurtosis, NaNAndInfAreSkipped) {
  EXPECT_DOUBLE_EQ(kurtosis(std::vector<float>{1, kNaN, 2, 3, kInf, 4, -kInf, 10}), 2.788);
}

TEST(Kurtosis, GaussianNearThreeUniformNearOnePointEight) {
  std::mt19937_64 gen(7);
  std::normal_distribution<float> normal(5.0f, 2.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> g(1 << 20), u(1 << 20);
  for (float& v : g) v = normal(gen);
  for (float& v : u) v = uniform(gen);
  EXPECT_NEAR(kurtosis(g), 3.0, 0.03);
  EXPECT_NEAR(kurtosis(u), 1.8, 0.01);
}

}  // namespace
}  // namespace mixprec::lowp
