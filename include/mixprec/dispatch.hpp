// Run-time choice of the kernel back end: made once, at the edge.
//
// The public conversion functions use active_isa(), picked at first use from
// what the CPU reports (AVX2 with F16C and FMA, else scalar). The environment
// variable MIXPREC_ISA=scalar|avx2 overrides the choice (an unavailable or
// unknown value is an error at first use). Tests and benchmarks reach each
// back end directly through kernel_table().
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "mixprec/formats/bulk.hpp"

namespace mixprec {

enum class Isa : std::uint8_t { scalar, avx2 };

std::string_view isa_name(Isa isa) noexcept;
std::optional<Isa> parse_isa(std::string_view name) noexcept;
bool isa_available(Isa isa) noexcept;  // compiled in and supported by this CPU
Isa best_isa() noexcept;               // what the CPU supports best
Isa active_isa();                      // best_isa(), or MIXPREC_ISA; throws if that is invalid

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

// nullptr when the back end is not compiled in or the CPU lacks it.
const KernelTable* kernel_table(Isa isa) noexcept;

}  // namespace mixprec
