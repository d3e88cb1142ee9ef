// An exact, order-independent accumulator for sums of squares of f32 values: the
// fixed summation of unscale_and_check's sum of squares (kernels/unscale.hpp), and
// what lets partial sums computed apart (ZeRO's slices on different ranks) combine
// into the total bit for bit.
#pragma once

#include <cstdint>

namespace mixprec {

// Exact sum of non-negative doubles that are multiples of 2^-298 and below
// 2^320 (sums of squares of f32 values: every f32 is a multiple of 2^-149).
// Fixed point with 32-bit digits held in 64-bit limbs (carries deferred), so
// addition is associative: the total does not depend on the order of add()
// or merge(). inf and NaN are remembered and win (NaN over inf). Trivially
// copyable: partial sums travel between ranks as bytes.
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

}  // namespace mixprec
