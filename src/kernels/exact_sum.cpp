// The exact accumulator of unscale_and_check's sum of squares (see
// include/mixprec/kernels/exact_sum.hpp). Compiled for the baseline ISA.
#include "mixprec/kernels/exact_sum.hpp"

#include <bit>
#include <cmath>
#include <limits>

namespace mixprec {

void ExactSum::add(double x) noexcept {
  const std::uint64_t b = std::bit_cast<std::uint64_t>(x);
  const auto exp_field = static_cast<int>((b >> 52) & 0x7ff);
  if (exp_field == 0x7ff) {  // inf or NaN (negative values never occur)
    if ((b & ((std::uint64_t{1} << 52) - 1)) != 0) nan_ = true;
    else inf_ = true;
    return;
  }
  std::uint64_t m = b & ((std::uint64_t{1} << 52) - 1);
  int e = -1074;
  if (exp_field != 0) {
    m |= std::uint64_t{1} << 52;
    e = exp_field - 1075;
  }
  if (m == 0) return;
  int shift = e - kLsbExp;
  if (shift < 0) {  // below 2^-298: cannot come from squares of f32; truncated
    m >>= (-shift < 64 ? -shift : 63);
    shift = 0;
  }
  const int pos = shift / 32;
  const int off = shift % 32;
  if (pos + 2 >= kDigits) {  // beyond 2^342: cannot come from f32 squares
    inf_ = true;
    return;
  }
  const std::uint64_t lo = (m & 0xffffffffu) << off;  // < 2^63
  const std::uint64_t hi = (m >> 32) << off;          // < 2^52
  d_[pos] += lo & 0xffffffffu;
  d_[pos + 1] += (lo >> 32) + (hi & 0xffffffffu);
  d_[pos + 2] += hi >> 32;
  if (++pending_ >= (1u << 30)) normalize();
}

void ExactSum::merge(const ExactSum& o) noexcept {
  ExactSum a = o;
  a.normalize();
  normalize();
  for (int i = 0; i < kDigits; ++i) d_[i] += a.d_[i];
  normalize();
  nan_ = nan_ || o.nan_;
  inf_ = inf_ || o.inf_;
}

double ExactSum::value() const noexcept {
  if (nan_) return std::numeric_limits<double>::quiet_NaN();
  if (inf_) return std::numeric_limits<double>::infinity();
  ExactSum n = *this;
  n.normalize();
  int top = kDigits - 1;
  while (top >= 0 && n.d_[top] == 0) --top;
  if (top < 0) return 0.0;
  const int msb = top * 32 + (63 - std::countl_zero(n.d_[top]));  // bit index of the leading one
  if (msb <= 52) return std::ldexp(static_cast<double>(n.bits(0, msb + 1)), kLsbExp);
  const int low = msb - 52;  // bit index of the mantissa's last bit
  std::uint64_t mant = n.bits(low, 53);
  const bool round = n.bits(low - 1, 1) != 0;
  const bool sticky = n.any_below(low - 1);
  if (round && (sticky || (mant & 1u))) ++mant;  // 2^53 after a carry is still exact
  return std::ldexp(static_cast<double>(mant), low + kLsbExp);
}

void ExactSum::normalize() noexcept {
  std::uint64_t carry = 0;
  for (int i = 0; i < kDigits; ++i) {
    const std::uint64_t v = d_[i] + carry;
    d_[i] = v & 0xffffffffu;
    carry = v >> 32;
  }
  if (carry != 0) inf_ = true;  // unreachable for f32 squares
  pending_ = 0;
}
std::uint64_t ExactSum::bits(int lo, int count) const noexcept {
  std::uint64_t r = 0;
  for (int i = count - 1; i >= 0; --i) {
    const int k = lo + i;
    r = (r << 1) | ((d_[k / 32] >> (k % 32)) & 1u);
  }
  return r;
}
bool ExactSum::any_below(int k) const noexcept {
  if (k <= 0) return false;
  for (int i = 0; i < k / 32; ++i) {
    if (d_[i] != 0) return true;
  }
  return (d_[k / 32] & ((std::uint64_t{1} << (k % 32)) - 1)) != 0;
}


}  // namespace mixprec
