// The scalar back end of lowp's kernel table (element loops through the scalar rules of
// lowp/kernels.hpp), and lowp::reference::quantize: the whole recipe as plain loops over
// the quantized grid, one block and one element at a time, which every back end is
// tested against bit for bit.
#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "lowp/kernels.hpp"

namespace mixprec::lowp {
namespace detail {
namespace {

void block_amax_scalar(const float* src, std::size_t n, std::size_t block, float* fmax, std::uint32_t* bits) {
  for (std::size_t b = 0; b * block < n; ++b) {
    float f;
    block_amax_one(src + b * block, std::min(block, n - b * block), f, bits[b]);
    if (fmax != nullptr) fmax[b] = f;
  }
}

void encode_scaled_scalar(Element e, const float* src, std::size_t n, std::size_t block, const float* factors,
                          std::uint8_t* dst, const std::uint32_t* random, EncodeCounts* counts, std::uint32_t* max_bits) {
  with_element_options(e, random != nullptr, max_bits != nullptr, [&](auto spec, auto stochastic, auto amax, float max_value) {
    EncodeCounts c;
    std::uint32_t bits = amax ? *max_bits : 0u;
    encode_elements<decltype(spec)::value, decltype(stochastic)::value, decltype(amax)::value>(
        src, 0, n, block, factors, dst, random, max_value, c, bits);
    *counts += c;
    if constexpr (decltype(amax)::value) *max_bits = bits;
  });
}

void nvfp4_scales_scalar(const float* amax, std::size_t nb, float s_enc_div6, float s_dec, std::uint8_t* codes,
                         float* factors) {
  for (std::size_t b = 0; b < nb; ++b) nvfp4_scale_one(amax[b], s_enc_div6, s_dec, codes[b], factors[b]);
}

void rht16_scalar(const float* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    if (src != dst) std::copy_n(src + i, 16, dst + i);
    rht16_one(dst + i);
  }
}

void transpose_scalar(const float* src, std::size_t rows, std::size_t cols, float* dst) {
  transpose_range(src, rows, cols, dst, 0, rows, 0, cols);
}

void random_words_scalar(std::uint64_t seed, std::uint32_t* out, std::size_t n) {
  random_words_range(seed, out, 0, n);
}

constexpr LowpKernels kScalar{Isa::scalar, &block_amax_scalar, &encode_scaled_scalar, &nvfp4_scales_scalar,
                              &rht16_scalar, &transpose_scalar, &random_words_scalar};

}  // namespace

const LowpKernels& scalar_kernels() noexcept { return kScalar; }

}  // namespace detail

namespace reference {

void rht16(std::span<float> v) noexcept {
  for (std::size_t i = 0; i + 16 <= v.size(); i += 16) detail::rht16_one(v.data() + i);
}

namespace {

// One element of the grid through the scalar rule of its format.
std::uint32_t encode_one(Element e, float x, float factor, bool sr, std::uint32_t random, detail::EncodeCounts& c) {
  switch (e) {
    case Element::e4m3: return detail::encode_element<mixprec::detail::kE4M3Spec>(x, factor, sr, random, max_finite(Element::e4m3), c);
    case Element::e5m2: return detail::encode_element<mixprec::detail::kE5M2Spec>(x, factor, sr, random, max_finite(Element::e5m2), c);
    case Element::e2m1: return detail::encode_element<detail::kE2M1Spec>(x, factor, sr, random, max_finite(Element::e2m1), c);
  }
  return 0;
}

void put_code(Quantized& q, std::size_t r, std::size_t i, std::uint32_t code) {
  if (q.config.element == Element::e2m1) {
    std::uint8_t& byte = q.codes[r * q.row_bytes + i / 2];
    byte = static_cast<std::uint8_t>(i % 2 == 0 ? (byte & 0xF0) | code : (byte & 0x0F) | (code << 4));
  } else {
    q.codes[r * q.row_bytes + i] = static_cast<std::uint8_t>(code);
  }
}

}  // namespace

Quantized quantize(std::span<const float> src, std::size_t rows, std::size_t cols, const QuantizeConfig& c,
                   std::span<const std::uint32_t> random) {
  Quantized q = detail::make_result(src.size(), rows, cols, c, random.size());
  if (src.empty()) return q;
  std::vector<float> g;
  detail::grid_input(detail::scalar_kernels(), src, q, g);
  if (c.rht) rht16(g);
  const std::size_t R = q.code_rows, C = q.code_cols, n = R * C;
  const RecipeInfo& info = recipe_info(c.recipe);

  // Amaxes: TE's NaN-ignoring max and the magnitude-bits max of any range of the grid.
  auto range_amax = [&](std::size_t r0, std::size_t r1, std::size_t c0, std::size_t c1, float& fmax,
                        std::uint32_t& bits) {
    fmax = 0.0f;
    bits = 0;
    for (std::size_t r = r0; r < r1; ++r) {
      for (std::size_t i = c0; i < c1; ++i) {
        const std::uint32_t a = std::bit_cast<std::uint32_t>(g[r * C + i]) & 0x7fffffffu;
        bits = std::max(bits, a);
        if (std::bit_cast<float>(a) > fmax) fmax = std::bit_cast<float>(a);
      }
    }
  };

  float tensor_fmax;
  std::uint32_t tensor_bits;
  range_amax(0, R, 0, C, tensor_fmax, tensor_bits);
  float s_enc_div6 = 1.0f, s_dec = 1.0f;
  if (c.recipe == Recipe::nvfp4) {
    q.tensor_amax = detail::canonical_amax(tensor_bits);
    q.tensor_scale = c.flavour == Flavour::torchao ? q.tensor_amax / (max_finite(Element::e4m3) * max_finite(Element::e2m1)) : nvfp4_tensor_scale(q.tensor_amax);
    s_enc_div6 = q.tensor_scale * (1.0f / max_finite(Element::e2m1));
    s_dec = 1.0f / q.tensor_scale;
  }

  detail::EncodeCounts counts;
  const bool sr = c.stochastic_rounding;
  const std::size_t block = info.block == 0 ? std::max<std::size_t>(C, 1) : info.block;
  const std::size_t tr = info.block == 0 ? std::max<std::size_t>(R, 1) : (c.tile_2d ? info.tile_rows : 1);
  for (std::size_t r0 = 0; r0 < R; r0 += tr) {
    const std::size_t r1 = std::min(R, r0 + tr);
    for (std::size_t c0 = 0; c0 < C; c0 += block) {
      const std::size_t c1 = std::min(C, c0 + block);
      float fmax;
      std::uint32_t bits;
      range_amax(r0, r1, c0, c1, fmax, bits);
      const std::size_t s = info.block == 0 ? 0 : (r0 / tr) * q.scale_cols + c0 / block;
      float factor;
      bool nan_block = false;
      switch (c.recipe) {
        case Recipe::fp8_delayed:
        case Recipe::fp8_current: {
          const float scale = c.recipe == Recipe::fp8_delayed
                                  ? c.scale
                                  : scale_from_amax(detail::canonical_amax(tensor_bits), max_finite(c.element),
                                                    effective_power_of_2_scales(c), c.amax_epsilon, c.value_for_inf);
          q.tensor_scale = scale;
          q.scale_inv[0] = 1.0f / scale;
          factor = scale;
          break;
        }
        case Recipe::fp8_block: {
          const detail::BlockScale b = detail::fp8_block_scale(c, fmax);
          q.scale_inv[s] = b.scale_inv;
          factor = b.factor;
          break;
        }
        case Recipe::mxfp8:
        case Recipe::mxfp4: {
          const detail::BlockScale b = detail::mx_block_scale(c, fmax, bits);
          q.scale_codes[s] = b.code;
          factor = b.factor;
          nan_block = std::isnan(factor);
          break;
        }
        case Recipe::nvfp4:
        default:
          if (c.flavour == Flavour::torchao) {
            detail::torchao_nvfp4_scale(detail::canonical_amax(bits), q.tensor_scale, q.scale_codes[s], factor);
          } else {
            detail::nvfp4_scale_one(detail::canonical_amax(bits), s_enc_div6, s_dec, q.scale_codes[s], factor);
          }
          break;
      }
      for (std::size_t r = r0; r < r1; ++r) {
        for (std::size_t i = c0; i < c1; ++i) {
          const std::size_t k = r * C + i;
          const std::uint32_t code = encode_one(c.element, g[k], factor, sr, sr ? random[k] : 0u, counts);
          put_code(q, r, i, nan_block ? detail::nan_block_code(c.element) : code);
        }
      }
    }
  }
  q.counts.saturated = counts.saturated;
  q.counts.flushed = counts.flushed;
  q.counts.nonfinite = counts.nonfinite;
  q.counts.nonzero = q.counts.elements - counts.zeros;
  if (c.rht) {
    std::uint32_t b = 0;
    for (float x : src) b = std::max(b, std::bit_cast<std::uint32_t>(x) & 0x7fffffffu);
    tensor_bits = b;
  }
  q.counts.amax = n == 0 ? 0.0f : detail::canonical_amax(tensor_bits);
  return q;
}


void dequantize(const Quantized& q, std::span<float> dst) {
  if (dst.size() != q.rows * q.cols) throw std::invalid_argument("reference::dequantize: destination size");
  const QuantizeConfig& c = q.config;
  const RecipeInfo& info = recipe_info(c.recipe);
  const bool col = c.layout == Layout::columnwise;
  const std::size_t tr = info.block == 0 ? std::max<std::size_t>(q.code_rows, 1) : (c.tile_2d ? info.tile_rows : 1);
  const std::size_t block = info.block == 0 ? std::max<std::size_t>(q.code_cols, 1) : info.block;
  std::vector<float> m;
  detail::block_multipliers(q, m);
  float lut[256];
  for (unsigned code = 0; code < 256; ++code) {
    switch (c.element) {
      case Element::e4m3: lut[code] = mixprec::detail::decode<mixprec::detail::kE4M3Spec>(static_cast<std::uint8_t>(code), Subnormals::keep); break;
      case Element::e5m2: lut[code] = mixprec::detail::decode<mixprec::detail::kE5M2Spec>(static_cast<std::uint8_t>(code), Subnormals::keep); break;
      case Element::e2m1: lut[code] = e2m1_decode(static_cast<std::uint8_t>(code & 0xF)); break;
    }
  }
  for (std::size_t r = 0; r < q.code_rows; ++r) {
    const std::uint8_t* row = q.codes.data() + r * q.row_bytes;
    const float* mr = m.data() + (r / tr) * q.scale_cols;
    for (std::size_t i = 0; i < q.code_cols; ++i) {
      const std::uint8_t code = c.element == Element::e2m1 ? ((i % 2 == 0) ? row[i / 2] & 0xF : row[i / 2] >> 4) : row[i];
      const float f = mr[i / block];
      dst[col ? i * q.cols + r : r * q.cols + i] = std::isnan(f) ? f : lut[code] * f;
    }
  }
}

}  // namespace reference
}  // namespace mixprec::lowp
