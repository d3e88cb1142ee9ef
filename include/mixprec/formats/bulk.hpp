// Bulk conversion between fp32 spans and low-precision spans.
//
// Every function here gives bit-identical results to the scalar reference in
// scalar.hpp, element by element, in every mode; the SIMD path is chosen once,
// at first use, from what the CPU offers (see mixprec/core/isa.hpp).
//
// Scale: encode converts x * scale; decode returns float(x) * scale. To undo an
// encode with scale s, decode with 1/s. The product is rounded to fp32 first
// (as Transformer Engine does), then converted.
//
// Errors: spans of different lengths, or a scale that is not a finite positive
// number, throw std::invalid_argument before anything is written.
#pragma once

#include <cstdint>
#include <span>

#include "mixprec/formats/types.hpp"

namespace mixprec {

struct ConvertOptions {
  Overflow overflow = Overflow::ieee;
  Subnormals subnormals = Subnormals::keep;
  float scale = 1.0f;
};

// What a conversion destroyed, counted on the fly (convert_counted).
// Input classes refer to the fp32 input before scaling; outcomes to the code written.
struct ConversionStats {
  std::uint64_t elements = 0;
  std::uint64_t nonzero = 0;           // finite or not, input != +-0
  std::uint64_t nonfinite_input = 0;   // input was inf or NaN
  std::uint64_t underflow = 0;         // nonzero input became +-0
  std::uint64_t subnormal = 0;         // nonzero input became a subnormal (lost precision)
  std::uint64_t overflow = 0;          // finite input rounded past max finite: inf, NaN or saturated

  ConversionStats& operator+=(const ConversionStats& o) noexcept {
    elements += o.elements;
    nonzero += o.nonzero;
    nonfinite_input += o.nonfinite_input;
    underflow += o.underflow;
    subnormal += o.subnormal;
    overflow += o.overflow;
    return *this;
  }
  friend bool operator==(const ConversionStats&, const ConversionStats&) = default;
};

template <LowPrecisionFormat T>
void convert(std::span<const float> src, std::span<T> dst, const ConvertOptions& opts = {});

template <LowPrecisionFormat T>
void convert(std::span<const T> src, std::span<float> dst, const ConvertOptions& opts = {});

// Stochastic rounding: random[i] supplies the 32 random bits for src[i].
template <LowPrecisionFormat T>
void convert_stochastic(std::span<const float> src, std::span<T> dst,
                        std::span<const std::uint32_t> random, const ConvertOptions& opts = {});

// Round to nearest even and count what the conversion destroyed.
template <LowPrecisionFormat T>
ConversionStats convert_counted(std::span<const float> src, std::span<T> dst,
                                const ConvertOptions& opts = {});

// Store and round in one pass (what a model does when it keeps a low-precision copy
// and goes on computing with the values it stored): writes convert(v, dst, opts)'s
// codes to dst, and overwrites v with them decoded back, i.e. with
// convert(dst, v, {opts.overflow, opts.subnormals, 1 / opts.scale}), bit for bit.
// v and dst must not overlap.
template <LowPrecisionFormat T>
void encode_and_round(std::span<float> v, std::span<T> dst, const ConvertOptions& opts = {});

// encode_and_round's counted form: convert_counted's stats, and amax, the largest |v[i]|
// of the input (unscaled) or +inf when any input is inf or NaN (a gradient with a
// nonfinite element reports an infinite amax); 0 for an empty span.
struct RoundedStats {
  ConversionStats stats;
  float amax = 0.0f;
};
template <LowPrecisionFormat T>
RoundedStats encode_and_round_counted(std::span<float> v, std::span<T> dst, const ConvertOptions& opts = {});

// Named forms of the most used directions.
inline void f32_to_f16(std::span<const float> s, std::span<f16> d, const ConvertOptions& o = {}) { convert(s, d, o); }
inline void f32_to_bf16(std::span<const float> s, std::span<bf16> d, const ConvertOptions& o = {}) { convert(s, d, o); }
inline void f16_to_f32(std::span<const f16> s, std::span<float> d, const ConvertOptions& o = {}) { convert(s, d, o); }
inline void bf16_to_f32(std::span<const bf16> s, std::span<float> d, const ConvertOptions& o = {}) { convert(s, d, o); }

}  // namespace mixprec
