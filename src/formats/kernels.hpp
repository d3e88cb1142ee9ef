// Private: the kernel back ends behind mixprec::kernel_table(), and the scalar
// element loops that both the reference back end and SIMD tails use.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "mixprec/formats/kernel_table.hpp"
#include "mixprec/formats/scalar.hpp"

namespace mixprec::detail {

const KernelTable& scalar_kernels() noexcept;
const KernelTable* avx2_kernels() noexcept;  // nullptr when not compiled in
// AVX-512: the 16-bit encodes (cpu/bulk_avx512.cpp), AVX2's other kernels; nullptr when not
// compiled in. Its bf16 encodes use AVX512-BF16 where the CPU has it.
const KernelTable* avx512_kernels() noexcept;
// The AVX-512 table with or without the AVX512-BF16 bf16 encodes (the one above picks by the
// CPU); tests reach both. Only call with true where cpu_has_avx512_bf16().
const KernelTable* avx512_kernels(bool bf16_instructions) noexcept;

inline EncodeMode mode_of(const ConvertOptions& o) noexcept { return {o.overflow, o.subnormals}; }

// Classifies one conversion for ConversionStats, from the unscaled input and the code.
template <const MiniFloatSpec& S>
inline void count_one(float x, const EncodeResult& r, ConversionStats& st) noexcept {
  constexpr std::uint32_t kMag = (1u << (S.bits - 1)) - 1;
  const std::uint32_t a = std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
  const std::uint32_t mag = r.code & kMag;
  ++st.elements;
  if (a != 0) ++st.nonzero;
  if (a >= 0x7f800000u) {
    ++st.nonfinite_input;
    return;
  }
  if (a != 0 && mag == 0) ++st.underflow;
  if (a != 0 && mag != 0 && mag < (1u << S.man_bits)) ++st.subnormal;
  if (r.overflowed) ++st.overflow;
}

template <const MiniFloatSpec& S, class Storage>
inline void encode_range(const float* src, Storage* dst, std::size_t n, const ConvertOptions& o) noexcept {
  const EncodeMode m = mode_of(o);
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<Storage>(encode_full<S>(src[i] * o.scale, m, false, 0).code);
  }
}

template <const MiniFloatSpec& S, class Storage>
inline void encode_stochastic_range(const float* src, Storage* dst, const std::uint32_t* random,
                                    std::size_t n, const ConvertOptions& o) noexcept {
  const EncodeMode m = mode_of(o);
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<Storage>(encode_full<S>(src[i] * o.scale, m, true, random[i]).code);
  }
}

template <const MiniFloatSpec& S, class Storage>
inline void encode_counted_range(const float* src, Storage* dst, std::size_t n,
                                 const ConvertOptions& o, ConversionStats& st) noexcept {
  const EncodeMode m = mode_of(o);
  for (std::size_t i = 0; i < n; ++i) {
    const EncodeResult r = encode_full<S>(src[i] * o.scale, m, false, 0);
    dst[i] = static_cast<Storage>(r.code);
    count_one<S>(src[i], r, st);
  }
}

// Store and round: the code, then the code decoded back over the input.
template <const MiniFloatSpec& S, class Storage>
inline void encode_round_range(float* v, Storage* dst, std::size_t n, const ConvertOptions& o) noexcept {
  const EncodeMode m = mode_of(o);
  const float back = 1.0f / o.scale;
  for (std::size_t i = 0; i < n; ++i) {
    const auto code = static_cast<Storage>(encode_full<S>(v[i] * o.scale, m, false, 0).code);
    dst[i] = code;
    v[i] = decode<S>(code, o.subnormals) * back;
  }
}

// The same, counted, with the input's magnitude-bits max folded into amax_bits.
template <const MiniFloatSpec& S, class Storage>
inline void encode_round_counted_range(float* v, Storage* dst, std::size_t n, const ConvertOptions& o,
                                       ConversionStats& st, std::uint32_t& amax_bits) noexcept {
  const EncodeMode m = mode_of(o);
  const float back = 1.0f / o.scale;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = v[i];
    const std::uint32_t a = std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
    amax_bits = a > amax_bits ? a : amax_bits;
    const EncodeResult r = encode_full<S>(x * o.scale, m, false, 0);
    const auto code = static_cast<Storage>(r.code);
    dst[i] = code;
    count_one<S>(x, r, st);
    v[i] = decode<S>(code, o.subnormals) * back;
  }
}

inline std::uint32_t amax_bits_range(const float* src, std::size_t n) noexcept {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = std::bit_cast<std::uint32_t>(src[i]) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m;
}

template <const MiniFloatSpec& S, class Storage>
inline std::uint32_t encode_amax_range(const float* src, Storage* dst, std::size_t n, const ConvertOptions& o) noexcept {
  encode_range<S>(src, dst, n, o);
  return amax_bits_range(src, n);
}

// Elements [begin, begin + n) of a block-scaled conversion (MX): element i uses factors[i / block].
template <const MiniFloatSpec& S, class Storage>
inline void encode_block_scaled_range(const float* src, Storage* dst, std::size_t begin, std::size_t n,
                                      std::size_t block, const float* factors, const ConvertOptions& o) noexcept {
  const EncodeMode m = mode_of(o);
  for (std::size_t i = begin; i < begin + n; ++i) {
    dst[i] = static_cast<Storage>(encode_full<S>(src[i] * factors[i / block], m, false, 0).code);
  }
}

template <const MiniFloatSpec& S, class Storage>
inline void decode_block_scaled_range(const Storage* src, float* dst, std::size_t begin, std::size_t n,
                                      std::size_t block, const float* factors, const ConvertOptions& o) noexcept {
  for (std::size_t i = begin; i < begin + n; ++i) dst[i] = decode<S>(src[i], o.subnormals) * factors[i / block];
}

// TE's block amax: fmaxf over |x| starting from 0 (NaN elements are ignored).
inline float max_ignoring_nan_range(const float* src, std::size_t n) noexcept {
  float m = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = std::bit_cast<float>(std::bit_cast<std::uint32_t>(src[i]) & 0x7fffffffu);
    m = a > m ? a : m;  // false for NaN: m stays
  }
  return m;
}

inline void block_amax_range(const float* src, std::size_t n, std::size_t block, std::uint32_t* bits,
                             float* max_ignoring_nan) noexcept {
  for (std::size_t b = 0; b * block < n; ++b) {
    const std::size_t len = n - b * block < block ? n - b * block : block;
    bits[b] = amax_bits_range(src + b * block, len);
    max_ignoring_nan[b] = max_ignoring_nan_range(src + b * block, len);
  }
}

template <const MiniFloatSpec& S, class Storage>
inline void decode_range(const Storage* src, float* dst, std::size_t n, const ConvertOptions& o) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = decode<S>(src[i], o.subnormals) * o.scale;
}

}  // namespace mixprec::detail
