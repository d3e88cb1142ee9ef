// Scalar reference conversions between fp32 and the low-precision formats.
//
// Contract (one line each, every format, every mode):
//   encode: the exact fp32 value is rounded to the nearest code, ties to even
//           (or stochastically from a caller-provided 32-bit random word).
//   overflow: Overflow::ieee gives +-inf (E4M3, which has none: NaN);
//             Overflow::saturate gives +-max finite, for +-inf inputs too.
//   subnormals: Subnormals::keep is IEEE gradual underflow; Subnormals::flush
//             rounds first, then replaces a subnormal result by a signed zero
//             (encode) or treats a subnormal input as a signed zero (decode).
//   NaN: stays NaN and becomes quiet; IEEE-like formats keep the sign and the
//        top payload bits (the x86 F16C behaviour), E4M3 has one NaN per sign.
//   zero: the sign of zero is kept.
//   decode: exact; NaN payloads are kept and the quiet bit set (as F16C does).
//
// These functions are the reference every fast path is tested against. They
// are constexpr, branchy and slow on purpose: plain integer arithmetic that a
// reader can check against the format tables.
#pragma once

#include <bit>
#include <cstdint>

#include "mixprec/formats/format_table.hpp"

namespace mixprec {

enum class Overflow : std::uint8_t { ieee, saturate };
enum class Subnormals : std::uint8_t { keep, flush };

struct EncodeMode {
  Overflow overflow = Overflow::ieee;
  Subnormals subnormals = Subnormals::keep;
};

namespace detail {

// Layout of a small sign/exponent/mantissa format with an IEEE-style bias.
struct MiniFloatSpec {
  int bits;          // total width
  int man_bits;      // explicit mantissa bits
  int bias;          // exponent bias
  bool has_inf;      // true: the all-ones exponent holds inf (mantissa 0) and NaN
  std::uint32_t max_code;       // magnitude code of the largest finite value
  std::uint32_t overflow_code;  // magnitude code an IEEE overflow produces (inf, or NaN for E4M3)
  std::uint32_t nan_code;       // magnitude code of the canonical quiet NaN
};

// Each format's spec is its row of the format table.
constexpr MiniFloatSpec spec_of_row(const FormatRow& r) noexcept {
  return {r.bits, r.mantissa_bits, r.bias, r.has_infinity, r.max_code, r.overflow_code, r.nan_code};
}
inline constexpr MiniFloatSpec kF16Spec = spec_of_row(format_row(FormatId::f16));
inline constexpr MiniFloatSpec kBF16Spec = spec_of_row(format_row(FormatId::bf16));
inline constexpr MiniFloatSpec kE4M3Spec = spec_of_row(format_row(FormatId::f8e4m3));
inline constexpr MiniFloatSpec kE5M2Spec = spec_of_row(format_row(FormatId::f8e5m2));

// fp32 biased exponent of the format's smallest normal number.
constexpr int min_normal_f32_exponent(const MiniFloatSpec& s) { return 128 - s.bias; }

// Bits of the smallest fp32 magnitude whose round-to-nearest-even result
// exceeds the largest finite value: the midpoint above max, plus one ulp when
// max has an even mantissa (the tie then rounds down to max).
constexpr std::uint32_t overflow_threshold_bits(const MiniFloatSpec& s) {
  const int m = s.man_bits;
  const std::uint32_t exp_field = s.max_code >> m;
  const std::uint32_t man_field = s.max_code & ((1u << m) - 1);
  const std::uint32_t max_f32 =
      ((exp_field + 127u - static_cast<std::uint32_t>(s.bias)) << 23) | (man_field << (23 - m));
  const std::uint32_t midpoint = max_f32 + (1u << (22 - m));
  return (man_field & 1u) ? midpoint : midpoint + 1u;
}

// Result of one encode: the code and whether the value (rounded, before any
// saturation) lies past max finite, infinities included; NaN never does.
struct EncodeResult {
  std::uint32_t code;
  bool overflowed;
};

template <const MiniFloatSpec& S>
constexpr EncodeResult encode_full(float x, EncodeMode mode, bool stochastic,
                                   std::uint32_t random) noexcept {
  constexpr int M = S.man_bits;
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (u >> 31) << (S.bits - 1);
  const std::uint32_t a = u & 0x7fffffffu;

  if (a > 0x7f800000u) {  // NaN
    if constexpr (S.has_inf) {
      return {sign | S.overflow_code | (1u << (M - 1)) | ((a & 0x7fffffu) >> (23 - M)), false};
    } else {
      return {sign | S.nan_code, false};
    }
  }
  if (a == 0x7f800000u) {  // infinity lies past max finite too
    return {sign | (mode.overflow == Overflow::saturate ? S.max_code : S.overflow_code), true};
  }

  // Value = sig * 2^(E - 150), sig with the implicit bit for normal fp32.
  int e32 = static_cast<int>(a >> 23);
  std::uint32_t sig = a & 0x7fffffu;
  if (e32 != 0) {
    sig |= 0x800000u;
  } else {
    e32 = 1;
  }
  constexpr int kMinNormalE32 = min_normal_f32_exponent(S);
  int shift = 23 - M;  // fp32 mantissa bits dropped
  std::uint32_t base = 0;  // (target biased exponent - 1) << M; the implicit bit in q adds the 1
  if (e32 >= kMinNormalE32) {
    base = static_cast<std::uint32_t>(e32 - kMinNormalE32) << M;
  } else {
    shift += kMinNormalE32 - e32;  // subnormal in the target: drop more bits
  }
  if (shift > 31) {
    // The value is below 2^-8 of the smallest subnormal: keep 31 dropped bits.
    // RNE still gives zero; stochastic rounding keeps 31 bits of probability.
    const int pre = shift - 31 > 31 ? 31 : shift - 31;
    sig >>= pre;
    shift = 31;
  }
  const std::uint32_t add =
      stochastic ? (random >> (32 - shift))
                 : ((1u << (shift - 1)) - 1u + ((sig >> shift) & 1u));
  const std::uint32_t code = base + ((sig + add) >> shift);

  if (code > S.max_code) {
    return {sign | (mode.overflow == Overflow::saturate ? S.max_code : S.overflow_code), true};
  }
  if (mode.subnormals == Subnormals::flush && code < (1u << M)) return {sign, false};
  return {sign | code, false};
}

template <const MiniFloatSpec& S>
constexpr float decode(std::uint32_t code, Subnormals subnormals) noexcept {
  constexpr int M = S.man_bits;
  constexpr std::uint32_t kMagMask = (1u << (S.bits - 1)) - 1;
  constexpr std::uint32_t kExpAllOnes = kMagMask >> M;
  const std::uint32_t sign = ((code >> (S.bits - 1)) & 1u) << 31;
  const std::uint32_t mag = code & kMagMask;
  const std::uint32_t exp = mag >> M;
  const std::uint32_t man = mag & ((1u << M) - 1);

  if (S.has_inf && exp == kExpAllOnes) {
    if (man == 0) return std::bit_cast<float>(sign | 0x7f800000u);
    return std::bit_cast<float>(sign | 0x7fc00000u | (man << (23 - M)));
  }
  if (!S.has_inf && mag == S.nan_code) return std::bit_cast<float>(sign | 0x7fc00000u);
  if (exp != 0) {
    const std::uint32_t e32 = exp + 127u - static_cast<std::uint32_t>(S.bias);
    return std::bit_cast<float>(sign | (e32 << 23) | (man << (23 - M)));
  }
  if (man == 0 || subnormals == Subnormals::flush) return std::bit_cast<float>(sign);
  // Subnormal: man * 2^(1 - bias - M). Normalise to an fp32 exponent.
  int top = 31 - std::countl_zero(man);  // index of the leading one
  const int e32 = top + 1 - S.bias - M + 127;
  if (e32 >= 1) {
    const std::uint32_t frac = (man << (23 - top)) & 0x7fffffu;
    return std::bit_cast<float>(sign | (static_cast<std::uint32_t>(e32) << 23) | frac);
  }
  // fp32 subnormal (only bf16 gets here): the mantissa lines up with fp32's.
  constexpr int kSubnormalShift = 150 - S.bias - M;
  if constexpr (kSubnormalShift >= 0 && kSubnormalShift < 32) {
    return std::bit_cast<float>(sign | (man << kSubnormalShift));
  } else {
    return std::bit_cast<float>(sign);  // unreachable for the formats defined here
  }
}

}  // namespace detail

// ---- E8M0: an unsigned power of two, 2^(code - 127), 0xFF is NaN. ----------
// Used for MX block scales. No zero, no sign, no infinity.
namespace detail {
inline constexpr std::uint8_t kE8M0Nan = 0xff;

constexpr float e8m0_decode(std::uint8_t code) noexcept {
  if (code == kE8M0Nan) return std::bit_cast<float>(0x7fc00000u);
  if (code == 0) return std::bit_cast<float>(0x00400000u);  // 2^-127, an fp32 subnormal
  return std::bit_cast<float>(static_cast<std::uint32_t>(code) << 23);
}

// Nearest power of two in linear distance (the midpoint 1.5 * 2^k rounds up,
// as ties-to-even does with no mantissa bits). Values below 2^-127 give
// 2^-127 (nothing smaller exists); values from 1.5 * 2^127 up overflow:
// NaN, or 2^127 when saturating. Zero, negatives and NaN give NaN: a scale
// must be a positive number.
constexpr std::uint8_t e8m0_encode(float x, Overflow overflow) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u >> 31) != 0 || u == 0 || u > 0x7f800000u) return kE8M0Nan;
  if (u == 0x7f800000u) return overflow == Overflow::saturate ? 0xfe : kE8M0Nan;
  if (u <= 0x00400000u) return 0;  // at or below 2^-127
  std::uint32_t e32 = u >> 23;
  std::uint32_t man = u & 0x7fffffu;
  if (e32 == 0) {  // fp32 subnormal above 2^-127: between 2^-127 and 2^-126
    return man >= 0x600000u ? 1 : 0;
  }
  if (man >= 0x400000u) ++e32;  // at or above 1.5 * 2^k: round up
  if (e32 > 254) return overflow == Overflow::saturate ? 0xfe : kE8M0Nan;
  return static_cast<std::uint8_t>(e32);
}
}  // namespace detail

}  // namespace mixprec
