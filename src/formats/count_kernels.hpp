// Private: the back ends of the counting pass (mixprec/formats/count.hpp). A kernel reads
// n source words, clears their sign bit and reports, for each of kCountBounds bounds b[k],
// how many magnitudes lie above b[k], and the largest magnitude (or, max16, only that).
// Kernels never allocate or check arguments; count.cpp validates and turns a profile into
// ConversionStats. fp32's largest magnitude alone is the formats table's amax_bits
// (kernel_table.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "mixprec/core/isa.hpp"

namespace mixprec::detail {

inline constexpr int kCountBounds = 5;

struct MagnitudeProfile {
  std::uint64_t above[kCountBounds] = {0, 0, 0, 0, 0};
  std::uint32_t max = 0;  // largest magnitude bits (0 when n == 0)
};

using Profile16 = void (*)(const std::uint16_t* src, std::size_t n, const std::uint16_t* bounds,
                           MagnitudeProfile& out);
using Profile32 = void (*)(const std::uint32_t* src, std::size_t n, const std::uint32_t* bounds,
                           MagnitudeProfile& out);

// The largest magnitude of 16-bit codes alone (the profile's max, no counts); 0 when n == 0.
using Max16 = std::uint32_t (*)(const std::uint16_t* src, std::size_t n);

struct CountKernels {
  Isa isa;
  Profile16 profile16;  // fp16 and bf16 codes (bounds below 0x8000)
  Profile32 profile32;  // fp32 words (bounds below 0x80000000)
  Max16 max16;
};

const CountKernels& scalar_count_kernels() noexcept;
const CountKernels* avx2_count_kernels() noexcept;    // nullptr when not compiled in
const CountKernels* avx512_count_kernels() noexcept;  // nullptr when not compiled in

// The reference loop, also the SIMD back ends' tails: one element at a time.
template <class Word>
inline void profile_range(const Word* src, std::size_t n, const Word* bounds, MagnitudeProfile& out) noexcept {
  constexpr Word kMag = std::numeric_limits<Word>::max() >> 1;  // the sign bit cleared
  for (std::size_t i = 0; i < n; ++i) {
    const Word m = static_cast<Word>(src[i] & kMag);
    for (int k = 0; k < kCountBounds; ++k) out.above[k] += m > bounds[k] ? 1u : 0u;
    out.max = m > out.max ? m : out.max;
  }
}

inline std::uint32_t max_range(const std::uint16_t* src, std::size_t n, std::uint32_t max = 0) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t m = src[i] & 0x7fffu;
    max = m > max ? m : max;
  }
  return max;
}

}  // namespace mixprec::detail
