// The format conversion kernels of each back end, as a table per Isa (core/isa.hpp).
// The public conversions (bulk.hpp) run the active_isa() table; tests and benchmarks
// reach each back end's table directly through kernel_table().
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/bulk.hpp"

namespace mixprec {

// Kernels: pure loops over raw pointers. They never allocate, log or check
// arguments; the public functions validate first. dst/src of the low format
// point at n elements of its storage type.
struct FormatKernels {
  void (*encode)(const float* src, void* dst, std::size_t n, const ConvertOptions& o);
  void (*encode_stochastic)(const float* src, void* dst, const std::uint32_t* random,
                            std::size_t n, const ConvertOptions& o);
  ConversionStats (*encode_counted)(const float* src, void* dst, std::size_t n,
                                    const ConvertOptions& o);
  void (*decode)(const void* src, float* dst, std::size_t n, const ConvertOptions& o);
  // encode with a fused amax of the unscaled input: returns max |src[i]| as fp32
  // magnitude bits compared as unsigned integers (a NaN, whose bits lie above inf's,
  // wins); 0 when n == 0. The codes are encode's, bit for bit.
  std::uint32_t (*encode_amax)(const float* src, void* dst, std::size_t n, const ConvertOptions& o);
  // Block-scaled (MX) conversions: element i is converted as src[i] * factors[i / block],
  // the product rounded to fp32 first; o.scale is ignored. block > 0.
  void (*encode_block_scaled)(const float* src, void* dst, std::size_t n, std::size_t block,
                              const float* factors, const ConvertOptions& o);
  void (*decode_block_scaled)(const void* src, float* dst, std::size_t n, std::size_t block,
                              const float* factors, const ConvertOptions& o);
  // Store and round (encode_and_round): encode's codes of v into dst, then v[i] =
  // decode(dst[i]) * (1 / o.scale), in one pass; each v[i] is read before it is written.
  void (*encode_round)(float* v, void* dst, std::size_t n, const ConvertOptions& o);
  // encode_round with encode_counted's stats; *amax_bits gets the input's max |v[i]|
  // as magnitude bits (as encode_amax: a NaN wins; 0 when n == 0).
  ConversionStats (*encode_round_counted)(float* v, void* dst, std::size_t n, const ConvertOptions& o,
                                          std::uint32_t* amax_bits);
};

// Format-independent reductions the FP8 recipes need.
struct AmaxKernels {
  // max |src[i]| as magnitude bits (unsigned order, as encode_amax); 0 when n == 0.
  std::uint32_t (*amax_bits)(const float* src, std::size_t n);
  // Per block of `block` elements (the last may be shorter): the magnitude-bits max, and
  // Transformer Engine's fmaxf(0, |x|...) max, which ignores NaN elements.
  void (*block_amax)(const float* src, std::size_t n, std::size_t block, std::uint32_t* bits,
                     float* max_ignoring_nan);
};

struct KernelTable {
  Isa isa;
  FormatKernels f16, bf16, f8e4m3, f8e5m2;
  AmaxKernels amax;

  template <LowPrecisionFormat T>
  const FormatKernels& get() const noexcept {
    if constexpr (std::is_same_v<T, mixprec::f16>) return f16;
    else if constexpr (std::is_same_v<T, mixprec::bf16>) return bf16;
    else if constexpr (std::is_same_v<T, mixprec::f8e4m3>) return f8e4m3;
    else return f8e5m2;
  }
};

// Conversions whose source + destination bytes reach this are written with
// non-temporal stores (they cannot stay in cache; streaming saves the
// read-for-ownership of every destination line). Results are identical.
inline constexpr std::size_t kStreamingStoreBytes = std::size_t{16} << 20;

// The table of `isa` when isa_available(isa), else nullptr (never another back end's
// table in its place); kernel_table(active_isa()) is never nullptr.
const KernelTable* kernel_table(Isa isa) noexcept;

}  // namespace mixprec
