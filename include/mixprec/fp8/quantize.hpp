// FP8 quantize / dequantize with a fused amax: per-tensor scale (delayed and
// current scaling) and MX blocks of 32 values with E8M0 scales.
//
// Every element is converted with the library's scalar encode (round to nearest
// even, Overflow::saturate as Transformer Engine's satfinite casts, subnormals
// kept): per tensor, code = encode<T>(float(x * scale)) exactly as
// mixprec::convert with ConvertOptions{saturate, keep, scale}; per MX block,
// code = encode<T>(float(x * mx_quantize_factor(block scale))).
//
// amax (fused, of the fp32 input before scaling): max |x| as fp32; 0 for an
// empty span; the quiet NaN 0x7fc00000 if some x is NaN, else +inf if some x is
// inf. (The MX TE rule ignores NaN for its block scale; see recipes.hpp.)
//
// The functions run the dispatched SIMD kernels (AVX2 where the CPU has it, see
// mixprec/core/isa.hpp) with the amax fused into the conversion pass; fp8::reference
// holds plain element loops with the same contracts, which the kernels are tested
// against bit for bit. Errors (std::invalid_argument, before anything is written):
// spans of different lengths, a scale that is not finite and > 0, an MX scale span
// whose length is not ceil(n / 32).
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include "mixprec/formats/types.hpp"
#include "mixprec/fp8/recipes.hpp"

namespace mixprec::fp8 {

template <class T>
concept Fp8Type = std::is_same_v<T, f8e4m3> || std::is_same_v<T, f8e5m2>;

template <Fp8Type T>
constexpr Dtype dtype_of() noexcept {
  return std::is_same_v<T, f8e4m3> ? Dtype::e4m3 : Dtype::e5m2;
}

// max |x| with the NaN/inf rules above.
float amax(std::span<const float> src) noexcept;

// dst[i] = encode<T>(src[i] * scale), saturating; returns amax(src).
template <Fp8Type T>
float quantize(std::span<const float> src, std::span<T> dst, float scale);

// dst[i] = decode(src[i]) * scale_inv (fp32 product). scale_inv must be finite and > 0.
template <Fp8Type T>
void dequantize(std::span<const T> src, std::span<float> dst, float scale_inv);

// Current scaling in one call: amax of src, scale = current_scale(amax, ...), then quantize.
struct CurrentQuantized {
  float amax = 0;
  float scale = 1;
  float scale_inv = 1;
};
template <Fp8Type T>
CurrentQuantized quantize_current(std::span<const float> src, std::span<T> dst,
                                  bool power_of_2_scales = false, float amax_epsilon = 0.0f);

// MX: scales[b] is the E8M0 scale of src[32b, 32b + 32) (the last block may be shorter).
// A block whose scale is NaN (OCP rule, block holding inf or NaN) gets NaN codes throughout.
// Returns amax(src).
template <Fp8Type T>
float mx_quantize(std::span<const float> src, std::span<T> dst, std::span<e8m0> scales,
                  MxRounding rounding = MxRounding::transformer_engine);

// dst[i] = decode(src[i]) * float(scales[i / 32]) (fp32 product; scale code 0 is 2^-127,
// 0xFF is NaN and makes the whole block NaN).
template <Fp8Type T>
void mx_dequantize(std::span<const T> src, std::span<const e8m0> scales, std::span<float> dst);

constexpr std::size_t mx_blocks(std::size_t n) noexcept { return (n + kMxBlock - 1) / kMxBlock; }

// The scalar references: one element at a time through encode/decode (scalar.hpp).
namespace reference {
float amax(std::span<const float> src) noexcept;
template <Fp8Type T>
float quantize(std::span<const float> src, std::span<T> dst, float scale);
template <Fp8Type T>
void dequantize(std::span<const T> src, std::span<float> dst, float scale_inv);
template <Fp8Type T>
float mx_quantize(std::span<const float> src, std::span<T> dst, std::span<e8m0> scales,
                  MxRounding rounding = MxRounding::transformer_engine);
template <Fp8Type T>
void mx_dequantize(std::span<const T> src, std::span<const e8m0> scales, std::span<float> dst);
}  // namespace reference

}  // namespace mixprec::fp8
