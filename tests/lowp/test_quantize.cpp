// lowp: the recipes' formats exhaustively (all 16 E2M1 codes and every tie, all 256 E4M3
// scale codes, every E8M0 exponent), the scale rules by hand from the formulas of
// docs/low_precision.md, the block edge cases of every recipe, and every back end this
// CPU has (through the whole driver and kernel by kernel) against the scalar reference
// bit for bit. Failures print values in hex.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "lowp/kernels.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "support.hpp"

namespace mixprec::lowp {
namespace {

using test::hex;
using test::hexf;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
// "[i] " (built with append: GCC 12's -Wrestrict misfires on "[" + std::string here).
std::string at(std::size_t i) { return std::string("[").append(std::to_string(i)).append("] "); }

std::vector<const detail::LowpKernels*> tables() {
  std::vector<const detail::LowpKernels*> v;
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (const auto* t = detail::lowp_kernels(i); t != nullptr && t->isa == i) v.push_back(t);
  }
  return v;
}

float e4m3_value(std::uint8_t code) { return static_cast<float>(f8e4m3::from_bits(code)); }

// ---- E2M1 ---------------------------------------------------------------------------

TEST(LowpE2m1, AllSixteenCodesDecodeAndRoundTrip) {
  const float values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (std::uint8_t c = 0; c < 16; ++c) {
    const float want = (c & 8) ? -values[c & 7] : values[c & 7];
    EXPECT_EQ(bits(e2m1_decode(c)), bits(want)) << "code " << hex(c, 1);
    EXPECT_EQ(e2m1_encode(want), c) << "value " << want;
  }
}

TEST(LowpE2m1, EveryTieRoundsToEven) {
  // Midpoints between neighbours: the result is the code with the even mantissa bit.
  const struct {
    float x;
    std::uint8_t code;
  } ties[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6}};
  for (const auto& t : ties) {
    EXPECT_EQ(e2m1_encode(t.x), t.code) << t.x;
    EXPECT_EQ(e2m1_encode(-t.x), t.code | 8) << -t.x;
    EXPECT_EQ(e2m1_encode(std::nextafter(t.x, 0.0f)), e2m1_encode(t.x - 0.01f)) << "below " << t.x;
    EXPECT_EQ(e2m1_encode(std::nextafter(t.x, 10.0f)), e2m1_encode(t.x + 0.01f)) << "above " << t.x;
    EXPECT_NE(e2m1_encode(std::nextafter(t.x, 0.0f)), e2m1_encode(std::nextafter(t.x, 10.0f))) << t.x;
  }
  EXPECT_EQ(e2m1_encode(6.9f), 7);
  EXPECT_EQ(e2m1_encode(7.0f), 7);  // saturates (round to 8 is past max)
  EXPECT_EQ(e2m1_encode(1e30f), 7);
  EXPECT_EQ(e2m1_encode(kInf), 7);
  EXPECT_EQ(e2m1_encode(-kInf), 15);
  EXPECT_EQ(e2m1_encode(kNaN), 0);
  EXPECT_EQ(e2m1_encode(-kNaN), 0);
  EXPECT_EQ(e2m1_encode(-0.0f), 8);
  EXPECT_EQ(e2m1_encode(0x1p-149f), 0);
}

TEST(LowpE2m1, StochasticRoundingUpWithTheDistance) {
  // Between neighbours lo < x < hi, x rounds up for exactly the random words whose top bits
  // exceed the remaining distance: (x - lo) / (hi - lo) of 2^16 evenly spaced words.
  const float xs[] = {0.1f, 0.3f, 0.6f, 1.2f, 1.9f, 2.25f, 3.75f, 4.5f, 5.5f};
  for (float x : xs) {
    const float lo = e2m1_decode(e2m1_encode(x, true, 0));
    const float hi = e2m1_decode(e2m1_encode(x, true, 0xffffffffu));
    ASSERT_LT(lo, x);
    ASSERT_GT(hi, x);
    int up = 0;
    for (std::uint32_t i = 0; i < 65536; ++i) up += e2m1_decode(e2m1_encode(x, true, i << 16)) == hi;
    const double want = (static_cast<double>(x) - static_cast<double>(lo)) / static_cast<double>(hi - lo) * 65536.0;
    EXPECT_NEAR(up, want, 1.0) << "x=" << x;
  }
  EXPECT_EQ(e2m1_encode(1.5f, true, 0xffffffffu), 3);  // exact values never move
  EXPECT_EQ(e2m1_encode(6.0f, true, 0xffffffffu), 7);
}

// ---- NVFP4 scales -------------------------------------------------------------------

TEST(LowpNvfp4, TensorScale) {
  EXPECT_EQ(nvfp4_tensor_scale(6.0f), 448.0f);
  EXPECT_EQ(nvfp4_tensor_scale(2688.0f), 1.0f);
  EXPECT_EQ(nvfp4_tensor_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_tensor_scale(kInf), 1.0f);                    // S_enc 0 -> 1
  EXPECT_EQ(nvfp4_tensor_scale(1e-38f), std::numeric_limits<float>::max());  // capped
  EXPECT_EQ(bits(nvfp4_tensor_scale(3.0f)), bits(2688.0f / 3.0f));
  EXPECT_TRUE(std::isnan(nvfp4_tensor_scale(kNaN)));
}

TEST(LowpNvfp4, AllE4m3ScaleCodesFromTheirValue) {
  // A block amax whose S_dec_b is exactly the value of each positive finite E4M3 code, with
  // S_enc = 1 in the formula: the code, and the factor 1 / value (FLT_MAX for code 0).
  for (std::uint32_t c = 0; c < 0x7F; ++c) {
    const float v = e4m3_value(static_cast<std::uint8_t>(c));
    std::uint8_t code;
    float factor;
    detail::nvfp4_scale_one(v, 1.0f, 1.0f, code, factor);
    EXPECT_EQ(code, c) << hexf(v);
    EXPECT_EQ(bits(factor), bits(c == 0 ? std::numeric_limits<float>::max() : 1.0f / v)) << hex(c, 2);
    if (c + 1 < 0x7F) {  // the midpoint to the next code rounds to the even one
      const float mid = static_cast<float>((static_cast<double>(v) + static_cast<double>(e4m3_value(static_cast<std::uint8_t>(c + 1)))) / 2);
      detail::nvfp4_scale_one(mid, 1.0f, 1.0f, code, factor);
      EXPECT_EQ(code, (c & 1) ? c + 1 : c) << "midpoint above " << hex(c, 2);
    }
  }
  std::uint8_t code;
  float factor;
  detail::nvfp4_scale_one(1000.0f, 1.0f, 1.0f, code, factor);  // saturates at 448
  EXPECT_EQ(code, 0x7E);
  detail::nvfp4_scale_one(kInf, 1.0f, 1.0f, code, factor);      // min(inf, FLT_MAX) -> 448
  EXPECT_EQ(code, 0x7E);
  detail::nvfp4_scale_one(kNaN, 1.0f, 1.0f, code, factor);      // NaN block: NaN scale
  EXPECT_EQ(code, 0x7F);
  EXPECT_TRUE(std::isnan(factor));
}

TEST(LowpNvfp4, DequantizeReadsAll256ScaleCodes) {
  // A hand-made 1x16 NVFP4 tensor per scale code (signed and NaN codes included): every
  // element decodes as e2m1 * (float(scale) * amax * float(1 / 2688)).
  QuantizeConfig c;
  c.recipe = Recipe::nvfp4;
  c.element = Element::e2m1;
  Quantized q = reference::quantize(std::vector<float>(16, 1.0f), 1, 16, c);
  for (int s = 0; s < 256; ++s) {
    q.scale_codes[0] = static_cast<std::uint8_t>(s);
    q.tensor_amax = 3.0f;
    for (int i = 0; i < 8; ++i) q.codes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>((2 * i) | ((2 * i + 1) << 4));
    const std::vector<float> out = dequantize(q);
    const float sb = static_cast<float>(f8e4m3::from_bits(static_cast<std::uint8_t>(s)));
    const float final_scale = sb * 3.0f * static_cast<float>(1.0 / 2688.0);
    for (std::size_t i = 0; i < 16; ++i) {
      const float want = e2m1_decode(static_cast<std::uint8_t>(i)) * final_scale;
      EXPECT_EQ(bits(out[i]), bits(want)) << "scale " << hex(static_cast<unsigned>(s), 2) << " element " << i;
    }
  }
}

TEST(LowpNvfp4, FormulaByHand) {
  // The order of operations, written out independently of the library.
  std::vector<float> x(32);
  for (std::size_t i = 0; i < 32; ++i) x[i] = (static_cast<float>(i) - 13.0f) * 0.37f;
  x[20] = 0.0f;
  QuantizeConfig c;
  c.recipe = Recipe::nvfp4;
  c.element = Element::e2m1;
  const Quantized q = quantize(x, 2, 16, c);
  float amax = 0;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float s_enc = std::min(448.0f * 6.0f / amax, std::numeric_limits<float>::max());
  EXPECT_EQ(bits(q.tensor_scale), bits(s_enc));
  EXPECT_EQ(bits(q.tensor_amax), bits(amax));
  for (std::size_t b = 0; b < 2; ++b) {
    float bmax = 0;
    for (std::size_t i = 0; i < 16; ++i) bmax = std::max(bmax, std::fabs(x[b * 16 + i]));
    const float one_sixth = 1.0f / 6.0f;
    const f8e4m3 s_dec_b = encode<f8e4m3>(bmax * (s_enc * one_sixth), {Overflow::saturate, Subnormals::keep});
    EXPECT_EQ(q.scale_codes[b], s_dec_b.bits()) << "block " << b;
    const float enc_b = std::min(1.0f / (static_cast<float>(s_dec_b) * (1.0f / s_enc)), std::numeric_limits<float>::max());
    for (std::size_t i = 0; i < 16; ++i) {
      const float y = std::clamp(x[b * 16 + i] * enc_b, -6.0f, 6.0f);
      const std::uint8_t byte = q.codes[b * 8 + i / 2];
      const std::uint8_t code = (i % 2 == 0) ? byte & 0xF : byte >> 4;
      EXPECT_EQ(code, e2m1_encode(y)) << "element " << b * 16 + i;
    }
  }
}

// ---- MX: every E8M0 exponent -----------------------------------------------------------

TEST(LowpMx, EveryE8m0ExponentFromItsAmax) {
  for (Element e : {Element::e4m3, Element::e5m2, Element::e2m1}) {
    QuantizeConfig c;
    c.recipe = e == Element::e2m1 ? Recipe::mxfp4 : Recipe::mxfp8;
    c.element = e;
    const float elem_max = max_finite(e);
    const int emax = e == Element::e4m3 ? 8 : e == Element::e5m2 ? 15 : 2;
    for (int k = -127; k <= 127; ++k) {
      // rceil: amax = elem_max * 2^k gives exponent k exactly (nothing above the max).
      const float amax_r = std::ldexp(elem_max, k);
      if (std::isfinite(amax_r) && amax_r >= 0x1p-126f && k > -126) {
        c.scale_rounding = ScaleRounding::rceil;
        const auto s = detail::mx_block_scale(c, amax_r, bits(amax_r));
        EXPECT_EQ(s.code, k + 127) << element_name(e) << " rceil k=" << k;
        EXPECT_LE(amax_r * s.factor, elem_max) << element_name(e) << " rceil k=" << k;
        // just above: one exponent more
        const float above = std::nextafter(amax_r, kInf);
        if (k < 127 && k > -110) {
          EXPECT_EQ(detail::mx_block_scale(c, above, bits(above)).code, k + 128) << k;
        }
      }
      // floor: amax = 2^(k + emax) gives exponent k; the next power of two down gives k - 1.
      const float amax_f = std::ldexp(1.0f, k + emax);
      if (std::isfinite(amax_f) && k + emax >= -149) {
        c.scale_rounding = ScaleRounding::floor;
        const auto s = detail::mx_block_scale(c, amax_f, bits(amax_f));
        EXPECT_EQ(s.code, std::max(k, -127) + 127) << element_name(e) << " floor k=" << k;
        if (k > -127) {
          EXPECT_EQ(bits(s.factor), bits(std::ldexp(1.0f, -k))) << k;
        }
      }
    }
  }
}

TEST(LowpMx, DequantizeReadsEveryE8m0Code) {
  QuantizeConfig c;
  c.recipe = Recipe::mxfp8;
  Quantized q = reference::quantize(std::vector<float>(32, 1.0f), 1, 32, c);
  for (int s = 0; s < 256; ++s) {
    q.scale_codes[0] = static_cast<std::uint8_t>(s);
    for (std::size_t i = 0; i < 32; ++i) q.codes[i] = static_cast<std::uint8_t>(i * 7);
    const std::vector<float> out = dequantize(q);
    const float sv = static_cast<float>(e8m0::from_bits(static_cast<std::uint8_t>(s)));
    for (std::size_t i = 0; i < 32; ++i) {
      const float want = static_cast<float>(f8e4m3::from_bits(static_cast<std::uint8_t>(i * 7))) * sv;
      EXPECT_EQ(bits(out[i]), bits(want)) << "scale " << hex(static_cast<unsigned>(s), 2) << " [" << i << "]";
    }
  }
}

// ---- FP8 block scaling ------------------------------------------------------------------

TEST(LowpFp8Block, ScaleFromAmaxAsTe) {
  EXPECT_EQ(scale_from_amax(1.0f, 448.0f, false, 0.0f, kFltMax), 448.0f);
  EXPECT_EQ(scale_from_amax(1.0f, 448.0f, true, 0.0f, kFltMax), 256.0f);  // mantissa masked: rounds down
  EXPECT_EQ(scale_from_amax(3.0f, 448.0f, false, 0.0f, kFltMax), 448.0f / 3.0f);
  EXPECT_EQ(scale_from_amax(0.0f, 448.0f, true, 0.0f, kFltMax), 1.0f);
  EXPECT_EQ(scale_from_amax(kInf, 448.0f, true, 0.0f, kFltMax), 1.0f);
  EXPECT_EQ(scale_from_amax(kNaN, 448.0f, true, 0.0f, kFltMax), 1.0f);
  EXPECT_EQ(scale_from_amax(1e-6f, 448.0f, false, 1e-3f, kFltMax), 448.0f / 1e-3f);  // epsilon floor
  EXPECT_EQ(scale_from_amax(0.0f, 448.0f, false, 1e-3f, kFltMax), 448.0f / 1e-3f);   // 0 < eps too
  EXPECT_EQ(scale_from_amax(0x1p-149f, 448.0f, false, 0.0f, kFltMax), kFltMax);      // inf -> value_for_inf
  EXPECT_EQ(scale_from_amax(0x1p-149f, 448.0f, false, 0.0f, kBf16Max), kBf16Max);
  EXPECT_EQ(scale_from_amax(0x1p-149f, 448.0f, true, 0.0f, kFltMax), 0x1p127f);
}

QuantizeConfig block_config(bool tile_2d) {
  QuantizeConfig c;
  c.recipe = Recipe::fp8_block;
  c.tile_2d = tile_2d;
  return c;
}

TEST(LowpFp8Block, RowBlocksAndTilesByHand) {
  // 3 x 300: row blocks of 128, 128 and a ragged 44; one 128x128 tile column per 128.
  std::vector<float> x(3 * 300);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i)) * static_cast<float>(1 + i % 7);
  x[1 * 300 + 260] = 100.0f;  // the amax of row 1's ragged block and of tile column 2
  const Quantized q = quantize(x, 3, 300, block_config(false));
  ASSERT_EQ(q.scale_rows, 3u);
  ASSERT_EQ(q.scale_cols, 3u);
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::size_t b = 0; b < 3; ++b) {
      float amax = 0;
      for (std::size_t i = b * 128; i < std::min<std::size_t>(300, b * 128 + 128); ++i) amax = std::max(amax, std::fabs(x[r * 300 + i]));
      const float s = std::bit_cast<float>(bits(448.0f / amax) & 0xFF800000u);
      EXPECT_EQ(bits(q.scale_inv[r * 3 + b]), bits(1.0f / s)) << r << "," << b;
      for (std::size_t i = b * 128; i < std::min<std::size_t>(300, b * 128 + 128); ++i) {
        EXPECT_EQ(q.codes[r * 300 + i], encode<f8e4m3>(x[r * 300 + i] * s, {Overflow::saturate, Subnormals::keep}).bits());
      }
    }
  }
  const Quantized t = quantize(x, 3, 300, block_config(true));
  ASSERT_EQ(t.scale_rows, 1u);
  ASSERT_EQ(t.scale_cols, 3u);
  EXPECT_EQ(bits(t.scale_inv[2]), bits(1.0f / std::bit_cast<float>(bits(448.0f / 100.0f) & 0xFF800000u)));
}

// ---- block edge cases: every recipe ----------------------------------------------------

std::vector<QuantizeConfig> all_configs() {
  std::vector<QuantizeConfig> v;
  for (const RecipeInfo& info : recipe_table()) {
    const bool fp4 = info.element == Element::e2m1;
    for (Element e : fp4 ? std::vector<Element>{Element::e2m1} : std::vector<Element>{Element::e4m3, Element::e5m2}) {
      for (Layout l : {Layout::rowwise, Layout::columnwise}) {
        QuantizeConfig c;
        c.recipe = info.recipe;
        c.element = e;
        c.layout = l;
        if (info.recipe == Recipe::fp8_delayed) c.scale = 3.5f;
        v.push_back(c);
        if (info.recipe == Recipe::fp8_current) {
          c.power_of_2_scales = true;
          c.amax_epsilon = 1e-3f;
          v.push_back(c);
          c.power_of_2_scales.reset();
          c.amax_epsilon = 0.0f;
        }
        if (info.recipe == Recipe::fp8_block) {
          c.power_of_2_scales = false;
          c.value_for_inf = kBf16Max;
          v.push_back(c);
          c.power_of_2_scales.reset();
          c.value_for_inf = kFltMax;
          c.tile_2d = true;
          v.push_back(c);
          c.tile_2d = false;
        }
        if (info.recipe == Recipe::mxfp8 || info.recipe == Recipe::mxfp4) {
          c.scale_rounding = ScaleRounding::floor;
          v.push_back(c);
          c.flavour = Flavour::torchao;
          v.push_back(c);
          c.scale_rounding = ScaleRounding::rceil;
          v.push_back(c);
          c.flavour = Flavour::te;
        }
        if (info.recipe == Recipe::nvfp4) {
          c.tile_2d = true;
          v.push_back(c);
          c.tile_2d = false;
          c.rht = true;
          v.push_back(c);
          c.rht = false;
          c.flavour = Flavour::torchao;
          v.push_back(c);
          c.flavour = Flavour::te;
        }
        if (fp4) {
          c.stochastic_rounding = true;
          v.push_back(c);
          if (info.recipe == Recipe::nvfp4) {
            c.rht = true;
            v.push_back(c);
          }
        }
      }
    }
  }
  return v;
}

std::string describe(const QuantizeConfig& c) {
  std::string s(recipe_name(c.recipe));
  s.append("/").append(element_name(c.element)).append("/").append(layout_name(c.layout));
  if (c.tile_2d) s += "/2d";
  if (c.rht) s += "/rht";
  if (c.stochastic_rounding) s += "/sr";
  if (c.scale_rounding == ScaleRounding::floor) s += "/floor";
  if (c.flavour == Flavour::torchao) s += "/torchao";
  if (c.power_of_2_scales) s += *c.power_of_2_scales ? "/pow2" : "/fp32scale";
  return s;
}

void expect_same(const Quantized& got, const Quantized& want, const std::string& what) {
  ASSERT_EQ(got.codes.size(), want.codes.size()) << what;
  test::Failures f;
  for (std::size_t i = 0; i < want.codes.size(); ++i) {
    if (got.codes[i] != want.codes[i]) f.add("code byte " + std::to_string(i) + ": " + hex(got.codes[i], 2) + " want " + hex(want.codes[i], 2));
  }
  for (std::size_t i = 0; i < want.scale_codes.size(); ++i) {
    if (got.scale_codes[i] != want.scale_codes[i]) f.add("scale code " + std::to_string(i) + ": " + hex(got.scale_codes[i], 2) + " want " + hex(want.scale_codes[i], 2));
  }
  for (std::size_t i = 0; i < want.scale_inv.size(); ++i) {
    if (bits(got.scale_inv[i]) != bits(want.scale_inv[i])) f.add("scale_inv " + std::to_string(i) + ": " + hexf(got.scale_inv[i]) + " want " + hexf(want.scale_inv[i]));
  }
  EXPECT_EQ(f.count(), 0u) << what << ": " << f.report();
  EXPECT_EQ(bits(got.tensor_scale), bits(want.tensor_scale)) << what;
  EXPECT_EQ(bits(got.tensor_amax), bits(want.tensor_amax)) << what;
  EXPECT_EQ(got.counts.elements, want.counts.elements) << what;
  EXPECT_EQ(got.counts.nonzero, want.counts.nonzero) << what;
  EXPECT_EQ(got.counts.saturated, want.counts.saturated) << what;
  EXPECT_EQ(got.counts.flushed, want.counts.flushed) << what;
  EXPECT_EQ(got.counts.nonfinite, want.counts.nonfinite) << what;
  EXPECT_EQ(bits(got.counts.amax), bits(want.counts.amax)) << what;
}

std::vector<std::uint32_t> random_words(std::size_t n, std::uint64_t seed) {
  test::SplitMix64 rng{seed};
  std::vector<std::uint32_t> r(n);
  for (auto& w : r) w = static_cast<std::uint32_t>(rng.next());
  return r;
}

TEST(LowpBackends, EveryBackEndThisCpuHasIsTested) {
  std::string tested;
  for (const auto* k : tables()) tested.append(isa_name(k->isa)).append(" ");
  EXPECT_EQ(tables().front()->isa, Isa::scalar);
  for (Isa i : {Isa::avx2, Isa::avx512}) {
    if (isa_available(i)) {
      EXPECT_NE(tested.find(std::string(isa_name(i))), std::string::npos) << tested;
    }
  }
  if (!isa_available(Isa::avx512)) GTEST_SKIP() << "no AVX-512 on this CPU: tested " << tested;
  std::printf("lowp back ends tested: %s\n", tested.c_str());
}

// Values of every class, a few of them in every block.
std::vector<float> mixed(std::size_t n, std::uint64_t seed, bool specials) {
  test::SplitMix64 rng{seed};
  std::vector<float> v(n);
  for (float& x : v) {
    const auto k = rng.next() % 100;
    const float sign = (rng.next() & 1) ? -1.0f : 1.0f;
    if (specials && k == 0) x = sign * kNaN;
    else if (specials && k == 1) x = sign * kInf;
    else if (k < 5) x = sign * 0.0f;
    else if (k < 8) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng.next() & 0x807fffffu));
    else x = sign * static_cast<float>(std::exp2(rng.uniform() * 40.0 - 20.0));
  }
  return v;
}

// Shapes with ragged rows, blocks and tiles, and RHT-compatible ones (multiples of 16).
const std::size_t kShapes[][2] = {{1, 1}, {1, 15}, {3, 17}, {2, 32}, {5, 48}, {7, 100}, {16, 16}, {17, 33},
                                  {32, 64}, {130, 144}, {4, 300}, {129, 256}, {1, 4096}, {0, 5}};

// One case of the mixed-data sweeps: a config, a shape and its input.
struct MixedCase {
  const QuantizeConfig& config;
  std::size_t rows, cols;
  bool specials;
  std::vector<float> x;
  std::vector<std::uint32_t> random;  // stochastic rounding's words, else empty
  std::string name() const {
    return describe(config) + " [" + std::to_string(rows) + "x" + std::to_string(cols) + "]" +
           (specials ? " specials" : "");
  }
};

// f(case) for every config and shape (RHT configs only where the grid's rows are whole groups
// of 16), on mixed data without and with specials.
template <class F>
void for_each_mixed_case(F&& f) {
  for (const QuantizeConfig& c : all_configs()) {
    for (const auto& shape : kShapes) {
      const std::size_t rows = shape[0], cols = shape[1];
      const std::size_t grid_cols = c.layout == Layout::rowwise ? cols : rows;
      if (c.rht && grid_cols % 16 != 0) continue;
      for (bool specials : {false, true}) {
        f(MixedCase{c, rows, cols, specials, mixed(rows * cols, rows * 1000 + cols + (specials ? 7 : 0), specials),
                    c.stochastic_rounding ? random_words(rows * cols, rows * 131 + cols)
                                          : std::vector<std::uint32_t>{}});
      }
    }
  }
}

TEST(LowpBackends, EveryConfigEqualsTheReferenceOnMixedData) {
  for_each_mixed_case([](const MixedCase& t) {
    const Quantized want = reference::quantize(t.x, t.rows, t.cols, t.config, t.random);
    if (!t.config.rht) {  // the values encoded are the inputs: nonzero is a plain count of them
      std::uint64_t nonzero = 0;
      for (float v : t.x) nonzero += v != 0.0f || std::isnan(v);
      EXPECT_EQ(want.counts.nonzero, nonzero) << t.name();
    }
    for (const auto* k : tables()) {
      expect_same(detail::quantize_with(*k, t.x, t.rows, t.cols, t.config, t.random), want,
                  t.name() + " " + std::string(isa_name(k->isa)));
    }
  });
}

// dequantize (a row decoded exactly, then each block multiplied) equals the element loop of
// reference::dequantize bit for bit, on every config and layout, specials included: zeros of
// both signs, NaN and inf codes, NaN-scale blocks, E2M1 rows of odd length.
TEST(LowpDequantize, EqualsTheReferenceForEveryConfig) {
  for_each_mixed_case([](const MixedCase& t) {
    const Quantized q = quantize(t.x, t.rows, t.cols, t.config, t.random);
    std::vector<float> want(t.rows * t.cols, -1.0f), got(t.rows * t.cols, -2.0f);
    reference::dequantize(q, want);
    dequantize(q, got);
    test::Failures f;
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (bits(got[i]) != bits(want[i])) f.add(at(i) + "got " + hexf(got[i]) + " want " + hexf(want[i]));
    }
    EXPECT_EQ(f.count(), 0u) << t.name() << ": " << f.report();
  });
}

// quantize(..., out): one result quantized into again and again (recipes, layouts and shapes
// changing, large then small) equals a fresh reference result each time; nothing of the
// previous call (counts, scales of the other format, sizes) survives.
TEST(LowpBackends, QuantizeIntoAReusedResultEqualsAFreshOne) {
  Quantized reused;
  const std::size_t shapes[][2] = {{130, 144}, {3, 17}, {0, 5}, {32, 64}};
  for (const auto& shape : shapes) {
    for (const QuantizeConfig& c : all_configs()) {
      const std::size_t rows = shape[0], cols = shape[1];
      if (c.rht && (c.layout == Layout::rowwise ? cols : rows) % 16 != 0) continue;
      const std::vector<float> x = mixed(rows * cols, rows * 7 + cols, true);
      const std::vector<std::uint32_t> random =
          c.stochastic_rounding ? random_words(rows * cols, rows + cols) : std::vector<std::uint32_t>{};
      const Quantized want = reference::quantize(x, rows, cols, c, random);
      quantize(x, rows, cols, c, random, reused);
      const std::string what = describe(c) + " [" + std::to_string(rows) + "x" + std::to_string(cols) + "] reused";
      EXPECT_EQ(reused.scale_codes.size(), want.scale_codes.size()) << what;
      EXPECT_EQ(reused.scale_inv.size(), want.scale_inv.size()) << what;
      EXPECT_EQ(reused.scale_rows, want.scale_rows) << what;
      EXPECT_EQ(reused.code_rows, want.code_rows) << what;
      expect_same(reused, want, what);
    }
  }
}

TEST(LowpBackends, EdgeBlocksEqualTheReference) {
  // Per recipe: an all-zero block, a block with inf, one with NaN, a subnormal amax, amax at
  // FLT_MAX, signed zeros, and a ragged last block (cols 80 = 2.5 blocks of 32, 5 of 16).
  const std::size_t rows = 6, cols = 80;
  std::vector<float> x(rows * cols);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 23) - 11) * 0.125f;
  for (std::size_t i = 0; i < cols; ++i) x[i] = (i % 2) ? -0.0f : 0.0f;                    // row 0: zeros
  x[cols + 3] = kInf;                                                                       // row 1: inf
  x[2 * cols + 40] = kNaN;                                                                  // row 2: NaN
  for (std::size_t i = 0; i < cols; ++i) x[3 * cols + i] = std::bit_cast<float>(static_cast<std::uint32_t>(1 + i * 977));  // subnormals
  x[4 * cols + 70] = std::numeric_limits<float>::max();                                    // row 4: FLT_MAX
  x[5 * cols + 79] = -std::numeric_limits<float>::max();
  for (const QuantizeConfig& c : all_configs()) {
    if (c.rht) continue;  // rht needs rows of a multiple of 16 (tested above)
    std::vector<std::uint32_t> random;
    random = c.stochastic_rounding ? random_words(rows * cols, 99) : std::vector<std::uint32_t>{};
    const Quantized want = reference::quantize(x, rows, cols, c, random);
    for (const auto* k : tables()) expect_same(detail::quantize_with(*k, x, rows, cols, c, random), want, describe(c) + " " + std::string(isa_name(k->isa)));
  }
}

QuantizeConfig config_of(Recipe r, Element e = Element::e4m3) {
  QuantizeConfig c;
  c.recipe = r;
  c.element = e;
  return c;
}

TEST(LowpEdges, RulesByHand) {
  const std::vector<float> zeros(32, 0.0f);
  // All-zero blocks: scale 1 (fp8), E8M0 code 0 (MX rceil and floor), E4M3 scale 0 (nvfp4); codes 0.
  EXPECT_EQ(quantize(zeros, 1, 32, config_of(Recipe::fp8_current)).scale_inv[0], 1.0f);
  EXPECT_EQ(quantize(zeros, 1, 32, config_of(Recipe::fp8_block)).scale_inv[0], 1.0f);
  EXPECT_EQ(quantize(zeros, 1, 32, config_of(Recipe::mxfp8)).scale_codes[0], 0);
  const Quantized nz = quantize(zeros, 1, 32, config_of(Recipe::nvfp4, Element::e2m1));
  EXPECT_EQ(nz.tensor_scale, 1.0f);
  EXPECT_EQ(nz.scale_codes[0], 0);
  for (float v : dequantize(nz)) EXPECT_EQ(bits(v), 0u);

  // A block with NaN: fp8-block and MX rceil ignore it for the scale (TE's fmaxf) and keep it
  // NaN; MX floor (OCP) makes the whole block NaN; nvfp4 (TE's reference) makes every scale NaN.
  std::vector<float> x(32, 1.0f);
  x[5] = kNaN;
  const Quantized fb = quantize(x, 1, 32, config_of(Recipe::fp8_block));
  EXPECT_EQ(bits(fb.scale_inv[0]), bits(1.0f / 256.0f));
  EXPECT_EQ(fb.codes[5], 0x7F);
  EXPECT_EQ(fb.codes[4], encode<f8e4m3>(256.0f).bits());
  EXPECT_EQ(quantize(x, 1, 32, config_of(Recipe::mxfp8)).scale_codes[0], 127 - 8);  // ceil(log2(1/448)) = -8
  QuantizeConfig floor = config_of(Recipe::mxfp8);
  floor.scale_rounding = ScaleRounding::floor;
  const Quantized mf = quantize(x, 1, 32, floor);
  EXPECT_EQ(mf.scale_codes[0], 0xFF);
  for (std::uint8_t code : mf.codes) EXPECT_EQ(code, 0x7F);
  const Quantized nn = quantize(x, 2, 16, config_of(Recipe::nvfp4, Element::e2m1));
  EXPECT_TRUE(std::isnan(nn.tensor_scale));
  for (std::uint8_t s : nn.scale_codes) EXPECT_EQ(s, 0x7F);
  for (float v : dequantize(nn)) EXPECT_TRUE(std::isnan(v));

  // A block with inf: fp8-block scale 1 (inf -> 448, the rest unscaled); nvfp4: S_enc = 1,
  // the inf block's scale saturates to 448 and its inf to code 7 (+6).
  x[5] = kInf;
  const Quantized fi = quantize(x, 1, 32, config_of(Recipe::fp8_block));
  EXPECT_EQ(fi.scale_inv[0], 1.0f);
  EXPECT_EQ(fi.codes[5], 0x7E);
  const Quantized ni = quantize(x, 2, 16, config_of(Recipe::nvfp4, Element::e2m1));
  EXPECT_EQ(ni.tensor_scale, 1.0f);
  EXPECT_EQ(ni.scale_codes[0], 0x7E);
  EXPECT_EQ(ni.codes[2] >> 4, 7);
  EXPECT_EQ(ni.counts.nonfinite, 1u);

  // Subnormal amax: fp8-block's scale overflows to value_for_inf (then 2^127 by pow2).
  const std::vector<float> tiny(128, 0x1p-140f);
  EXPECT_EQ(quantize(tiny, 1, 128, config_of(Recipe::fp8_block)).scale_inv[0], 1.0f / 0x1p127f);
  // amax at FLT_MAX: nvfp4's S_enc = 2688 / FLT_MAX (a normal number), nothing saturates.
  std::vector<float> big(16, 1.0f);
  big[3] = std::numeric_limits<float>::max();
  const Quantized nb = quantize(big, 1, 16, config_of(Recipe::nvfp4, Element::e2m1));
  EXPECT_EQ(bits(nb.tensor_scale), bits(2688.0f / std::numeric_limits<float>::max()));
  EXPECT_EQ(nb.scale_codes[0], 0x7E);
  EXPECT_EQ(nb.codes[1] >> 4, 7);
  EXPECT_EQ(nb.counts.saturated, 0u);
}

TEST(LowpCounts, ByHand) {
  // fp8-delayed with a given scale 1: 500 saturates, 1e-10 flushes, inf and NaN are non-finite.
  QuantizeConfig c = config_of(Recipe::fp8_delayed);
  const std::vector<float> x = {500.0f, -1e-10f, 1.0f, kInf, kNaN, 0.0f, -448.0f, 449.0f};
  const Quantized q = quantize(x, 1, 8, c);
  EXPECT_EQ(q.counts.elements, 8u);
  EXPECT_EQ(q.counts.nonzero, 7u);    // all but 0.0f (inf and NaN count)
  EXPECT_EQ(q.counts.saturated, 2u);  // 500 and 449 (> 448; 449 rounds to 448)
  EXPECT_EQ(q.counts.flushed, 1u);
  EXPECT_EQ(q.counts.nonfinite, 2u);
  EXPECT_TRUE(std::isnan(q.counts.amax));
}

// ---- kernels one by one -----------------------------------------------------------------

// transpose moves every element to dst[c * rows + r], on every back end, over shapes with and
// without whole SIMD tiles (8 x 8, 16 x 16) and their edges; bits are kept (NaN payloads).
TEST(LowpKernels, TransposeMovesEveryElementOnEveryBackEnd) {
  const std::size_t shapes[][2] = {{1, 1}, {1, 37}, {37, 1}, {8, 8}, {16, 16}, {15, 17}, {17, 15}, {32, 48},
                                   {33, 47}, {100, 7}, {64, 256}, {129, 130}};
  for (const auto& s : shapes) {
    const std::size_t rows = s[0], cols = s[1];
    std::vector<float> src(rows * cols);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = std::bit_cast<float>(static_cast<std::uint32_t>(0x7f800001u + i));
    for (const auto* k : tables()) {
      std::vector<float> dst(rows * cols, 0.0f);
      k->transpose(src.data(), rows, cols, dst.data());
      test::Failures f;
      for (std::size_t r = 0; r < rows; ++r) {
        for (std::size_t c = 0; c < cols; ++c) {
          if (bits(dst[c * rows + r]) != bits(src[r * cols + c])) {
            f.add(at(c * rows + r) + hexf(dst[c * rows + r]) + " want " + hexf(src[r * cols + c]));
          }
        }
      }
      EXPECT_EQ(f.count(), 0u) << isa_name(k->isa) << " " << rows << "x" << cols << ": " << f.report();
    }
  }
}

// random_words: every back end gives splitmix64's stream, written out here as its loop (the state
// advanced by the golden ratio, mixed), for lengths around the vector widths and several seeds.
TEST(LowpKernels, RandomWordsAreTheSplitmix64StreamOnEveryBackEnd) {
  for (std::uint64_t seed : {0ull, 1ull, 0x5EEDull * 0x100000001B3ull + 7, ~0ull}) {
    for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 16u, 1000u, 4099u}) {
      std::vector<std::uint32_t> want(n);
      std::uint64_t state = seed;
      for (std::size_t i = 0; i < n; ++i) {
        std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        want[i] = static_cast<std::uint32_t>((z ^ (z >> 31)) >> 32);
      }
      for (const auto* k : tables()) {
        std::vector<std::uint32_t> got(n + 1, 0xDEADBEEFu);
        k->random_words(seed, got.data(), n);
        test::Failures f;
        for (std::size_t i = 0; i < n; ++i) {
          if (got[i] != want[i]) f.add(at(i) + hex(got[i], 8) + " want " + hex(want[i], 8));
        }
        EXPECT_EQ(f.count(), 0u) << isa_name(k->isa) << " seed " << seed << " n " << n << ": " << f.report();
        EXPECT_EQ(got[n], 0xDEADBEEFu) << "wrote past n";
      }
    }
  }
}

TEST(LowpKernels, Rht16IsTheSignedSylvesterMatrix) {
  // rht16(e_i)[j] = sign_i * (-1)^popcount(i & j) / 4 exactly, for every back end.
  for (const auto* k : tables()) {
    for (int i = 0; i < 16; ++i) {
      std::vector<float> v(16, 0.0f);
      v[static_cast<std::size_t>(i)] = 1.0f;
      k->rht16(v.data(), v.data(), 16);
      for (int j = 0; j < 16; ++j) {
        const float want = detail::kRhtSigns[i] * ((std::popcount(static_cast<unsigned>(i & j)) % 2) ? -0.25f : 0.25f);
        EXPECT_EQ(v[static_cast<std::size_t>(j)], want) << isa_name(k->isa) << " i=" << i << " j=" << j;
      }
    }
  }
}

TEST(LowpKernels, Rht16BackendsEqualTheReferenceAndTheExactSum) {
  test::SplitMix64 rng{5};
  std::vector<float> x(16 * 257);
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng.next() % 2001) - 1000) * 0.0625f;  // exact sums
  std::vector<float> want = x;
  reference::rht16(want);
  for (std::size_t g = 0; g < x.size(); g += 16) {
    for (std::size_t j = 0; j < 16; ++j) {
      double s = 0;
      for (std::size_t i = 0; i < 16; ++i) {
        s += static_cast<double>(detail::kRhtSigns[i] * x[g + i]) * ((std::popcount(static_cast<unsigned>(i & j)) % 2) ? -1.0 : 1.0);
      }
      ASSERT_EQ(static_cast<double>(want[g + j]), s / 4) << "group " << g / 16 << " j=" << j;
    }
  }
  const std::vector<float> m = mixed(16 * 301, 11, false);
  std::vector<float> want_m = m;
  reference::rht16(want_m);
  for (const auto* k : tables()) {
    std::vector<float> got = m;
    k->rht16(got.data(), got.data(), got.size());
    test::Failures f;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (bits(got[i]) != bits(want_m[i])) f.add(at(i) + hexf(got[i]) + " want " + hexf(want_m[i]));
    }
    EXPECT_EQ(f.count(), 0u) << isa_name(k->isa) << ": " << f.report();
    // Out of place (what the driver does, chunk by chunk): the same values, src untouched.
    std::vector<float> out(m.size());
    k->rht16(m.data(), out.data(), m.size());
    test::Failures g;
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (bits(out[i]) != bits(want_m[i])) g.add(at(i) + hexf(out[i]) + " want " + hexf(want_m[i]));
    }
    EXPECT_EQ(g.count(), 0u) << isa_name(k->isa) << " out of place: " << g.report();
  }
  // Values from {+-0, +-0.5, +-1}: sums cancel to zero often, so every stage's zero sign
  // (+0 from a + (-a), -0 from -0 + -0) is compared bit for bit too.
  const float few[] = {0.0f, -0.0f, 0.5f, -0.5f, 1.0f, -1.0f};
  std::vector<float> z(16 * 512);
  for (float& v : z) v = few[rng.next() % 6];
  std::vector<float> want_z = z;
  reference::rht16(want_z);
  for (const auto* k : tables()) {
    std::vector<float> got = z;
    k->rht16(got.data(), got.data(), got.size());
    test::Failures f;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (bits(got[i]) != bits(want_z[i])) f.add(at(i) + hexf(got[i]) + " want " + hexf(want_z[i]));
    }
    EXPECT_EQ(f.count(), 0u) << isa_name(k->isa) << " zero signs: " << f.report();
  }
}

TEST(LowpKernels, Nvfp4ScalesEqualTheScalarRule) {
  test::SplitMix64 rng{17};
  std::vector<float> amax(1000);
  for (float& a : amax) a = static_cast<float>(std::exp2(rng.uniform() * 300.0 - 150.0));
  amax[3] = 0.0f;
  amax[4] = kInf;
  amax[5] = kNaN;
  amax[6] = std::numeric_limits<float>::max();
  for (float s_enc : {1.0f, 448.0f, 3.1e-5f, 7.7e20f, std::numeric_limits<float>::max()}) {
    const float div6 = s_enc * (1.0f / 6.0f), dec = 1.0f / s_enc;
    std::vector<std::uint8_t> wc(amax.size());
    std::vector<float> wf(amax.size());
    for (std::size_t i = 0; i < amax.size(); ++i) detail::nvfp4_scale_one(amax[i], div6, dec, wc[i], wf[i]);
    for (const auto* k : tables()) {
      std::vector<std::uint8_t> gc(amax.size());
      std::vector<float> gf(amax.size());
      k->nvfp4_scales(amax.data(), amax.size(), div6, dec, gc.data(), gf.data());
      for (std::size_t i = 0; i < amax.size(); ++i) {
        ASSERT_EQ(gc[i], wc[i]) << isa_name(k->isa) << " amax " << hexf(amax[i]) << " s_enc " << s_enc;
        ASSERT_EQ(bits(gf[i]), bits(wf[i])) << isa_name(k->isa) << " amax " << hexf(amax[i]) << " s_enc " << s_enc;
      }
    }
  }
}

TEST(LowpKernels, EncodeScaledEqualsTheScalarRuleForEveryFp32Class) {
  // Every exponent of fp32 with several mantissas, both signs, through each element format
  // with factors from tiny to huge; stochastic rounding with random words too.
  std::vector<float> x;
  for (std::uint32_t e = 0; e < 256; ++e) {
    for (std::uint32_t m : {0u, 1u, 0x200000u, 0x400000u, 0x400001u, 0x5fffffu, 0x7fffffu}) {
      x.push_back(std::bit_cast<float>((e << 23) | m));
      x.push_back(std::bit_cast<float>(0x80000000u | (e << 23) | m));
    }
  }
  const std::vector<std::uint32_t> random = random_words(x.size(), 3);
  for (Element e : {Element::e4m3, Element::e5m2, Element::e2m1}) {
    for (float factor : {1.0f, 0x1p-100f, 0x1p100f, 3.0f, 0.0f}) {
      for (bool sr : {false, true}) {
        const std::vector<float> factors(x.size(), factor);
        std::vector<std::uint8_t> want(x.size());
        detail::EncodeCounts wc;
        detail::scalar_kernels().encode_scaled(e, x.data(), x.size(), 16, factors.data(), want.data(), sr ? random.data() : nullptr, &wc, nullptr);
        EXPECT_EQ(wc.zeros, 2u);  // +0 and -0 (exponent 0, mantissa 0)
        for (const auto* k : tables()) {
          std::vector<std::uint8_t> got(x.size());
          detail::EncodeCounts gc;
          k->encode_scaled(e, x.data(), x.size(), 16, factors.data(), got.data(), sr ? random.data() : nullptr, &gc, nullptr);
          test::Failures f;
          for (std::size_t i = 0; i < (e == Element::e2m1 ? (x.size() + 1) / 2 : x.size()); ++i) {
            if (got[i] != want[i]) f.add(at(i) + "x=" + hexf(x[i]) + " got " + hex(got[i], 2) + " want " + hex(want[i], 2));
          }
          EXPECT_EQ(f.count(), 0u) << isa_name(k->isa) << " " << element_name(e) << " factor " << factor << (sr ? " sr" : "") << ": " << f.report();
          EXPECT_EQ(gc.saturated, wc.saturated);
          EXPECT_EQ(gc.flushed, wc.flushed);
          EXPECT_EQ(gc.nonfinite, wc.nonfinite);
          EXPECT_EQ(gc.zeros, wc.zeros);
        }
      }
    }
  }
}

TEST(LowpKernels, EncodeScaledTakesTheInputsAmaxInTheSamePass) {
  // With max_bits (fp8-delayed's one pass): the magnitude-bits max of the input, NaN above
  // inf above every finite, with the largest value at every position of every length up to
  // 70 and of a few long ones (whole vectors, the 32-element groups of AVX2, every tail), and
  // the codes and counts the same as without it. max_bits starts at a value below the data's
  // (it is raised, never lowered) or above it (kept).
  const float big[] = {1000.0f, -3.0e38f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(), 0x1p-140f};
  for (std::size_t n : {1u, 2u, 7u, 8u, 9u, 15u, 16u, 17u, 31u, 32u, 33u, 47u, 63u, 64u, 65u, 70u, 1000u, 1027u}) {
    for (std::size_t pos = 0; pos < n; pos += n > 70 ? 37 : 1) {
      for (float v : big) {
        std::vector<float> x(n);
        for (std::size_t i = 0; i < n; ++i) x[i] = (v == 0x1p-140f ? 0x1p-149f : 1.0f) * static_cast<float>(static_cast<int>(i % 7) - 3);
        x[pos] = v;
        std::uint32_t want_bits = 0;
        for (float f : x) want_bits = std::max(want_bits, bits(f) & 0x7fffffffu);
        for (const auto* k : tables()) {
          for (Element e : {Element::e4m3, Element::e2m1}) {
            const float factor = 2.0f;
            const std::size_t bytes = e == Element::e2m1 ? (n + 1) / 2 : n;
            std::vector<std::uint8_t> plain(bytes), fused(bytes);
            detail::EncodeCounts pc, fc;
            k->encode_scaled(e, x.data(), n, n, &factor, plain.data(), nullptr, &pc, nullptr);
            std::uint32_t got = 1;
            k->encode_scaled(e, x.data(), n, n, &factor, fused.data(), nullptr, &fc, &got);
            ASSERT_EQ(got, want_bits) << isa_name(k->isa) << " " << element_name(e) << " n " << n << " largest "
                                      << hexf(v) << " at " << pos << ": got " << hex(got, 8) << " want " << hex(want_bits, 8);
            std::uint32_t kept = 0xffffffffu;
            k->encode_scaled(e, x.data(), n, n, &factor, fused.data(), nullptr, &fc, &kept);
            ASSERT_EQ(kept, 0xffffffffu) << isa_name(k->isa) << " n " << n;
            ASSERT_EQ(fused, plain) << isa_name(k->isa) << " " << element_name(e) << " n " << n << " at " << pos;
            ASSERT_EQ(fc.saturated, 2 * pc.saturated);
            ASSERT_EQ(fc.flushed, 2 * pc.flushed);
            ASSERT_EQ(fc.nonfinite, 2 * pc.nonfinite);
          }
        }
      }
    }
  }
}

TEST(LowpKernels, BlockAmaxEqualsTheScalarRuleForEveryCountOfBlocks) {
  // Every number of whole blocks from 0 to 40 (the SIMD kernels reduce up to sixteen at once),
  // with and without a ragged tail, on values of every class (NaN and inf included); both
  // maxima, then the bits alone.
  for (std::size_t block : {16u, 32u, 128u, 48u, 1024u}) {
    for (std::size_t whole = 0; whole <= 40; ++whole) {
      for (std::size_t tail : {0u, 1u, 15u}) {
        const std::size_t n = whole * block + (tail < block ? tail : 0);
        if (n == 0) continue;
        const std::vector<float> x = mixed(n, 1000 * block + 10 * whole + tail, true);
        const std::size_t nb = (n + block - 1) / block;
        std::vector<float> wf(nb), gf(nb);
        std::vector<std::uint32_t> wb(nb), gb(nb);
        detail::scalar_kernels().block_amax(x.data(), n, block, wf.data(), wb.data());
        for (const auto* k : tables()) {
          std::fill(gf.begin(), gf.end(), -1.0f);  // no result carried over from another table
          std::fill(gb.begin(), gb.end(), 0xdeadbeefu);
          k->block_amax(x.data(), n, block, gf.data(), gb.data());
          for (std::size_t b = 0; b < nb; ++b) {
            ASSERT_EQ(gb[b], wb[b]) << isa_name(k->isa) << " block " << block << " n " << n << " at " << b;
            ASSERT_EQ(bits(gf[b]), bits(wf[b])) << isa_name(k->isa) << " block " << block << " n " << n << " at " << b
                                                << ": " << hexf(gf[b]) << " want " << hexf(wf[b]);
          }
          // The bits alone (no float max asked for): the same bits.
          std::fill(gb.begin(), gb.end(), 0xdeadbeefu);
          k->block_amax(x.data(), n, block, nullptr, gb.data());
          for (std::size_t b = 0; b < nb; ++b) {
            ASSERT_EQ(gb[b], wb[b]) << isa_name(k->isa) << " bits only, block " << block << " n " << n << " at " << b;
          }
        }
      }
    }
  }
}

TEST(LowpKernels, EncodeScaledEqualsTheScalarRuleOnEveryNormalOfEachFormat) {
  // Every fp32 from each format's smallest normal to its largest finite (sampled under the
  // sanitizers), signs mixed: whole vectors of such values take the SIMD kernels' shortest
  // path (normal rounding only, nothing to count), which must equal the scalar rule, ties
  // and the two ends included.
  constexpr std::uint32_t kStep = MIXPREC_EXHAUSTIVE ? 1 : 4099;
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  for (Element e : {Element::e4m3, Element::e5m2, Element::e2m1}) {
    const auto spec = detail::element_spec(e);
    const std::uint32_t lo = static_cast<std::uint32_t>(mixprec::detail::min_normal_f32_exponent(*spec.spec)) << 23;
    const std::uint32_t hi = bits(spec.max_value);
    std::vector<float> x(kChunk);
    const float factor = 1.0f;
    std::vector<std::uint8_t> want(kChunk), got(kChunk);
    std::uint64_t values = 0;
    for (std::uint64_t start = lo; start <= hi; start += std::uint64_t{kChunk} * kStep) {
      std::size_t n = 0;
      for (std::uint64_t b = start; b <= hi && n < kChunk; b += kStep, ++n) {
        x[n] = std::bit_cast<float>(static_cast<std::uint32_t>(b) | (n % 3 == 1 ? 0x80000000u : 0u));
      }
      values += n;
      detail::EncodeCounts wc;
      detail::scalar_kernels().encode_scaled(e, x.data(), n, n, &factor, want.data(), nullptr, &wc, nullptr);
      ASSERT_EQ(wc.saturated + wc.flushed + wc.nonfinite, 0u) << element_name(e) << " from " << hex(start, 8);
      for (const auto* k : tables()) {
        detail::EncodeCounts gc;
        std::fill(got.begin(), got.end(), std::uint8_t{0xA5});  // no code carried over from another table
        k->encode_scaled(e, x.data(), n, n, &factor, got.data(), nullptr, &gc, nullptr);
        test::Failures f;
        const std::size_t bytes = e == Element::e2m1 ? (n + 1) / 2 : n;
        for (std::size_t i = 0; i < bytes; ++i) {
          if (got[i] != want[i]) f.add(at(i) + "x=" + hexf(x[e == Element::e2m1 ? 2 * i : i]) + " got " + hex(got[i], 2) + " want " + hex(want[i], 2));
        }
        ASSERT_EQ(f.count(), 0u) << isa_name(k->isa) << " " << element_name(e) << ": " << f.report();
        ASSERT_EQ(gc.saturated + gc.flushed + gc.nonfinite, 0u) << isa_name(k->isa) << " " << element_name(e);
      }
    }
    EXPECT_EQ(values, (std::uint64_t{hi} - lo) / kStep + 1) << element_name(e);
  }
}

// ---- dequantize and the recipe table ------------------------------------------------------

TEST(LowpDequantize, ColumnwiseComesBackInTheInputLayout) {
  std::vector<float> x(6 * 40);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 17) - 8);
  for (const QuantizeConfig& base : all_configs()) {
    if (base.rht || base.stochastic_rounding || base.layout == Layout::columnwise) continue;
    QuantizeConfig col = base;
    col.layout = Layout::columnwise;
    // The transpose quantized rowwise, then transposed back, equals the columnwise result.
    std::vector<float> xt(x.size());
    for (std::size_t r = 0; r < 6; ++r)
      for (std::size_t c = 0; c < 40; ++c) xt[c * 6 + r] = x[r * 40 + c];
    const std::vector<float> a = dequantize(quantize(x, 6, 40, col));
    const std::vector<float> b = dequantize(quantize(xt, 40, 6, base));
    for (std::size_t r = 0; r < 6; ++r)
      for (std::size_t c = 0; c < 40; ++c)
        ASSERT_EQ(bits(a[r * 40 + c]), bits(b[c * 6 + r])) << describe(base) << " " << r << "," << c;
  }
}

TEST(LowpDequantize, CloseToTheInput) {
  // Relative RMS error of the round trip, per recipe, on a well-scaled tensor.
  std::vector<float> x(64 * 64);
  test::SplitMix64 rng{1};
  for (float& v : x) v = static_cast<float>((rng.uniform() - 0.5) * 4.0);
  const struct {
    Recipe r;
    Element e;
    double bound;
  } cases[] = {{Recipe::fp8_current, Element::e4m3, 0.04}, {Recipe::fp8_block, Element::e4m3, 0.04},
               {Recipe::mxfp8, Element::e4m3, 0.04},      {Recipe::fp8_current, Element::e5m2, 0.08},
               {Recipe::nvfp4, Element::e2m1, 0.15},      {Recipe::mxfp4, Element::e2m1, 0.25}};
  for (const auto& cs : cases) {
    const std::vector<float> y = dequantize(quantize(x, 64, 64, config_of(cs.r, cs.e)));
    double num = 0, den = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double d = static_cast<double>(y[i]) - static_cast<double>(x[i]);
      num += d * d;
      den += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    }
    EXPECT_LT(std::sqrt(num / den), cs.bound) << recipe_name(cs.r);
    EXPECT_GT(std::sqrt(num / den), 0.0) << recipe_name(cs.r);
  }
}

TEST(LowpRecipes, OneTableOfNames) {
  EXPECT_EQ(recipe_names(), "fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4");
  for (const RecipeInfo& r : recipe_table()) {
    EXPECT_EQ(parse_recipe(r.name), r.recipe);
    EXPECT_EQ(recipe_name(r.recipe), r.name);
  }
  EXPECT_FALSE(parse_recipe("fp4").has_value());
}

TEST(LowpValidation, ClearErrors) {
  using test::error_of;
  const std::vector<float> x(32, 1.0f);
  QuantizeConfig c = config_of(Recipe::nvfp4, Element::e4m3);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x, 1, 32, c); }), "recipe nvfp4: element: expected e2m1, found e4m3");
  c = config_of(Recipe::mxfp8);
  c.tile_2d = true;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x, 1, 32, c); }),
            "recipe mxfp8: tile_2d: only fp8-block (128x128) and nvfp4 (16x16) have 2-D tiles");
  c = config_of(Recipe::nvfp4, Element::e2m1);
  c.rht = true;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(std::vector<float>(24, 1.0f), 2, 12, c); }),
            "quantize: rht needs the quantized rows' length (12) to be a multiple of 16, as TE's transform");
  c.rht = false;
  c.stochastic_rounding = true;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x, 1, 32, c); }),
            "quantize: stochastic_rounding needs one random word per element (32), found 0");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x, 3, 11, config_of(Recipe::mxfp8)); }),
            "quantize: shape [3, 11] needs 33 elements, found 32");
  c = config_of(Recipe::fp8_current);
  c.scale = 2.0f;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x, 1, 32, c); }), "recipe fp8-current: scale: only fp8-delayed takes a given scale");
  c = config_of(Recipe::fp8_block);
  c.flavour = Flavour::torchao;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x, 1, 32, c); }),
            "recipe fp8-block: flavour: torchao has no such recipe (only mxfp8, mxfp4 and nvfp4)");
}

}  // namespace
}  // namespace mixprec::lowp
