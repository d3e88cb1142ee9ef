// Private: the back ends of unscale_and_check (scalar reference, AVX2, AVX-512) and the
// pieces both share: the per-element step of the reference and the flush of
// chunk lane sums into the exact accumulator (mixprec/kernels/exact_sum.hpp).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/scalar.hpp"
#include "mixprec/kernels/exact_sum.hpp"
#include "mixprec/kernels/unscale.hpp"

namespace mixprec::detail {

// What one segment (a tensor's elements [begin, begin + n), begin a multiple
// of kUnscaleChunk) reports: max |g| and max |y| as f32 bit patterns (their
// order is the order of the magnitudes; NaN patterns lie above inf), and its
// chunk lane sums added to `sum` when summing.
// max_in is only ever compared with the bits of inf: a back end may report kInfBits
// (0x7f800000) for "an input was inf/NaN" instead of the true largest magnitude.
// Likewise any max_out above inf means NaN (amax reports the canonical NaN), so a
// back end need not find the largest NaN payload.
struct SegmentOut {
  std::uint32_t max_in = 0;
  std::uint32_t max_out = 0;
};

// One kernel per (dtype, write, sum, amax), chosen before the loop. `sum` is
// null when not summing.
using SegmentKernel = void (*)(void* data, std::size_t n, float inv_scale, SegmentOut& out,
                               ExactSum* sum);

struct UnscaleKernels {
  Isa isa;
  // [dtype][write][sum][amax]
  SegmentKernel segment[3][2][2][2];
};

const UnscaleKernels& scalar_unscale_kernels() noexcept;
const UnscaleKernels* avx2_unscale_kernels() noexcept;    // nullptr when not compiled in
const UnscaleKernels* avx512_unscale_kernels() noexcept;  // nullptr when not compiled in
// The AVX-512 back end with or without its AVX512-BF16 bf16 store (the one above picks by
// the CPU); tests reach both. Only call with true where cpu_has_avx512_bf16().
const UnscaleKernels* avx512_unscale_kernels(bool bf16_instructions) noexcept;

inline constexpr int kSumLanes = 16;

// How far ahead the SIMD back ends prefetch the tensor they update in place. One core
// keeps too few misses in flight to reach memory bandwidth on its own: prefetching took
// 16-bit unscale from 0.88 to 1.19-1.26 of the compiler's in-place multiply loop (one thread);
// 4 KiB measured a little ahead of 2 and 8 KiB for the 16-bit kernels (docs/performance.md).
inline constexpr std::size_t kPrefetchBytes = 4096;

// The element helpers have internal linkage: each back end's translation unit
// (compiled for its own ISA) keeps its own copy.
namespace {

// The reference step for one element: load, multiply, optionally store,
// track maxima and the lane sum. Used by the scalar back end and SIMD tails.
template <DType D>
inline float load_elem(const void* data, std::size_t i) noexcept {
  if constexpr (D == DType::f32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (D == DType::f16) {
    return decode<kF16Spec>(static_cast<const std::uint16_t*>(data)[i], Subnormals::keep);
  } else {
    return decode<kBF16Spec>(static_cast<const std::uint16_t*>(data)[i], Subnormals::keep);
  }
}

template <DType D>
inline void store_elem(void* data, std::size_t i, float y) noexcept {
  if constexpr (D == DType::f32) {
    static_cast<float*>(data)[i] = y;
  } else if constexpr (D == DType::f16) {
    static_cast<std::uint16_t*>(data)[i] = static_cast<std::uint16_t>(encode_full<kF16Spec>(y, {}, false, 0).code);
  } else {
    static_cast<std::uint16_t*>(data)[i] = static_cast<std::uint16_t>(encode_full<kBF16Spec>(y, {}, false, 0).code);
  }
}

inline std::uint32_t abs_bits(float x) noexcept { return std::bit_cast<std::uint32_t>(x) & 0x7fffffffu; }

// Elements [i0, i1) of a segment with the reference step; lane of element i is
// (i - lane_base) % 16. lanes may be null when not summing.
template <DType D, bool kWrite, bool kSum, bool kAmax>
inline void unscale_range(void* data, std::size_t i0, std::size_t i1, std::size_t lane_base, float inv,
                          SegmentOut& out, double* lanes) noexcept {
  for (std::size_t i = i0; i < i1; ++i) {
    const float x = load_elem<D>(data, i);
    const float y = x * inv;
    const std::uint32_t ax = abs_bits(x);
    out.max_in = ax > out.max_in ? ax : out.max_in;
    if constexpr (kWrite) store_elem<D>(data, i, y);
    if constexpr (kAmax) {
      const std::uint32_t ay = abs_bits(y);
      out.max_out = ay > out.max_out ? ay : out.max_out;
    }
    if constexpr (kSum) {
      const double yd = static_cast<double>(y);
      double& l = lanes[(i - lane_base) % kSumLanes];
      l += yd * yd;  // the product is exact, so this equals fma(yd, yd, l)
    }
  }
}

// amax of the products of a 16-bit segment from its largest input magnitude: rounding
// is monotonic, so for inv > 0 (unscale_and_check refuses any other) max |fl(x * inv)|
// is fl(max |x| * inv), and the loop saves two vector operations a step. With a NaN
// input the result lies above inf, which is all that matters: amax reports any NaN as
// the canonical one (and with inf but no NaN it is inf).
inline std::uint32_t product_amax_bits(std::uint32_t max_in_bits, float inv) noexcept {
  return abs_bits(std::bit_cast<float>(max_in_bits) * inv);
}

inline void flush_lanes(double* lanes, ExactSum& sum) noexcept {
  for (int j = 0; j < kSumLanes; ++j) {
    sum.add(lanes[j]);
    lanes[j] = 0.0;
  }
}

}  // namespace

}  // namespace mixprec::detail
