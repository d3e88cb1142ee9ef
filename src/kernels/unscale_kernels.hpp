// Private: the back ends of unscale_and_check (scalar reference, AVX2) and the
// pieces both share: the exact accumulator for chunk lane sums and the
// per-element step of the reference.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/scalar.hpp"
#include "mixprec/kernels/unscale.hpp"

namespace mixprec::detail {

// Exact sum of non-negative doubles that are multiples of 2^-298 and below
// 2^320 (sums of squares of f32 values: every f32 is a multiple of 2^-149).
// Fixed point with 32-bit digits held in 64-bit limbs (carries deferred), so
// addition is associative: the total does not depend on the order of add()
// or merge(). inf and NaN are remembered and win (NaN over inf).
class ExactSum {
 public:
  static constexpr int kLsbExp = -298;  // weight of bit 0
  static constexpr int kDigits = 20;    // 640 bits: up to 2^342

  // Out of line (exact_sum.cpp, compiled for the baseline ISA), so that no
  // AVX2-compiled copy of them can be picked by the linker for scalar code.
  void add(double x) noexcept;
  void merge(const ExactSum& o) noexcept;
  double value() const noexcept;  // the exact total rounded once to double, to nearest even

 private:
  void normalize() noexcept;
  std::uint64_t bits(int lo, int count) const noexcept;  // count (<= 63) bits from bit index lo
  bool any_below(int k) const noexcept;                   // any bit with index < k

  std::uint64_t d_[kDigits] = {};
  std::uint32_t pending_ = 0;
  bool nan_ = false;
  bool inf_ = false;
};

// What one segment (a tensor's elements [begin, begin + n), begin a multiple
// of kUnscaleChunk) reports: max |g| and max |y| as f32 bit patterns (their
// order is the order of the magnitudes; NaN patterns lie above inf), and its
// chunk lane sums added to `sum` when summing.
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

// The unrounded sum of squares of unscale_and_check (check only) over `grads`, added
// to `sum`, on the active back end, one thread; found_inf when an element read is
// inf/NaN. Each tensor's chunks start at its first element, so a piece of a tensor
// that starts at a chunk boundary of that tensor adds exactly what the whole tensor's
// pass adds for those chunks: ZeRO's shards add up to the unsharded norm (dist/).
void sum_squares_exact(std::span<const GradTensor> grads, float inv_scale, ExactSum& sum, bool& found_inf);
const UnscaleKernels* avx2_unscale_kernels() noexcept;  // nullptr when not compiled in

inline constexpr int kSumLanes = 16;

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

inline void flush_lanes(double* lanes, ExactSum& sum) noexcept {
  for (int j = 0; j < kSumLanes; ++j) {
    sum.add(lanes[j]);
    lanes[j] = 0.0;
  }
}

}  // namespace

}  // namespace mixprec::detail
