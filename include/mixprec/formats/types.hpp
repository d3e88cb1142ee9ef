// Value types for the low-precision formats: f16, bf16, f8e4m3, f8e5m2, e8m0.
//
// Each is a trivially copyable wrapper of exactly its width holding the bit
// pattern. Construction from float rounds to nearest, ties to even, with IEEE
// overflow and gradual underflow; conversion back to float is exact. Other
// modes (saturation, flush-to-zero, stochastic rounding) go through
// mixprec::encode<T>(x, mode) and mixprec::encode_stochastic<T>(...).
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

#include "mixprec/formats/scalar.hpp"

namespace mixprec {

#define MIXPREC_MINIFLOAT_TYPE(NAME, STORAGE, SPEC)                                   \
  struct NAME {                                                                        \
    using storage_type = STORAGE;                                                      \
    NAME() = default;                                                                  \
    constexpr explicit NAME(float x) noexcept                                          \
        : bits_(static_cast<STORAGE>(detail::encode_full<SPEC>(x, {}, false, 0).code)) {} \
    static constexpr NAME from_bits(STORAGE b) noexcept {                              \
      NAME v;                                                                          \
      v.bits_ = b;                                                                     \
      return v;                                                                        \
    }                                                                                  \
    constexpr STORAGE bits() const noexcept { return bits_; }                          \
    constexpr explicit operator float() const noexcept {                               \
      return detail::decode<SPEC>(bits_, Subnormals::keep);                            \
    }                                                                                  \
    STORAGE bits_;                                                                     \
  }

MIXPREC_MINIFLOAT_TYPE(f16, std::uint16_t, detail::kF16Spec);
MIXPREC_MINIFLOAT_TYPE(bf16, std::uint16_t, detail::kBF16Spec);
MIXPREC_MINIFLOAT_TYPE(f8e4m3, std::uint8_t, detail::kE4M3Spec);
MIXPREC_MINIFLOAT_TYPE(f8e5m2, std::uint8_t, detail::kE5M2Spec);
#undef MIXPREC_MINIFLOAT_TYPE

// E8M0: the MX block-scale format, an unsigned power of two 2^(bits - 127).
struct e8m0 {
  using storage_type = std::uint8_t;
  e8m0() = default;
  constexpr explicit e8m0(float x) noexcept : bits_(detail::e8m0_encode(x, Overflow::ieee)) {}
  static constexpr e8m0 from_bits(std::uint8_t b) noexcept {
    e8m0 v;
    v.bits_ = b;
    return v;
  }
  // 2^exponent for exponent in [-127, 127]; callers validate the range.
  static constexpr e8m0 from_exponent(int exponent) noexcept {
    return from_bits(static_cast<std::uint8_t>(exponent + 127));
  }
  constexpr std::uint8_t bits() const noexcept { return bits_; }
  constexpr int exponent() const noexcept { return static_cast<int>(bits_) - 127; }
  constexpr explicit operator float() const noexcept { return detail::e8m0_decode(bits_); }
  std::uint8_t bits_;
};

// Facts about each format (docs/formats.md's table). Values are exact floats.
template <class T>
struct format_traits;

enum class FormatId : std::uint8_t { f32, f16, bf16, f8e4m3, f8e5m2, e8m0 };

#define MIXPREC_TRAITS(T, ID, NAME, BITS, EBITS, MBITS, BIAS, MAXF, MINN, MINS, EPS, INF, SUB) \
  template <>                                                                                \
  struct format_traits<T> {                                                                  \
    static constexpr FormatId id = FormatId::ID;                                             \
    static constexpr std::string_view name = NAME;                                           \
    static constexpr int bits = BITS;                                                        \
    static constexpr int exponent_bits = EBITS;                                              \
    static constexpr int mantissa_bits = MBITS;                                              \
    static constexpr int bias = BIAS;                                                        \
    static constexpr float max_finite = MAXF;                                                \
    static constexpr float min_normal = MINN;                                                \
    static constexpr float min_subnormal = MINS; /* 0 when the format has none */            \
    static constexpr float epsilon = EPS;        /* next value above 1, minus 1 */           \
    static constexpr bool has_infinity = INF;                                                \
    static constexpr bool has_subnormals = SUB;                                              \
    static constexpr bool is_signed = id != FormatId::e8m0;                                  \
  }

MIXPREC_TRAITS(float, f32, "f32", 32, 8, 23, 127, 0x1.fffffep127f, 0x1p-126f, 0x1p-149f, 0x1p-23f, true, true);
MIXPREC_TRAITS(f16, f16, "f16", 16, 5, 10, 15, 65504.0f, 0x1p-14f, 0x1p-24f, 0x1p-10f, true, true);
MIXPREC_TRAITS(bf16, bf16, "bf16", 16, 8, 7, 127, 0x1.fep127f, 0x1p-126f, 0x1p-133f, 0x1p-7f, true, true);
MIXPREC_TRAITS(f8e4m3, f8e4m3, "f8e4m3", 8, 4, 3, 7, 448.0f, 0x1p-6f, 0x1p-9f, 0x1p-3f, false, true);
MIXPREC_TRAITS(f8e5m2, f8e5m2, "f8e5m2", 8, 5, 2, 15, 57344.0f, 0x1p-14f, 0x1p-16f, 0x1p-2f, true, true);
MIXPREC_TRAITS(e8m0, e8m0, "e8m0", 8, 8, 0, 127, 0x1p127f, 0x1p-127f, 0.0f, 1.0f, false, false);
#undef MIXPREC_TRAITS

template <class T>
concept LowPrecisionFormat =
    std::is_same_v<T, f16> || std::is_same_v<T, bf16> || std::is_same_v<T, f8e4m3> ||
    std::is_same_v<T, f8e5m2>;

namespace detail {
template <class T>
constexpr const MiniFloatSpec& spec_of() {
  if constexpr (std::is_same_v<T, f16>) return kF16Spec;
  else if constexpr (std::is_same_v<T, bf16>) return kBF16Spec;
  else if constexpr (std::is_same_v<T, f8e4m3>) return kE4M3Spec;
  else return kE5M2Spec;
}
}  // namespace detail

// fp32 -> T with an explicit overflow and subnormal mode, round to nearest even.
template <LowPrecisionFormat T>
constexpr T encode(float x, EncodeMode mode = {}) noexcept {
  using S = typename T::storage_type;
  return T::from_bits(static_cast<S>(detail::encode_full<detail::spec_of<T>()>(x, mode, false, 0).code));
}

// fp32 -> T rounding up with probability (distance to the lower neighbour / gap),
// from 32 uniformly random bits supplied by the caller.
template <LowPrecisionFormat T>
constexpr T encode_stochastic(float x, std::uint32_t random, EncodeMode mode = {}) noexcept {
  using S = typename T::storage_type;
  return T::from_bits(static_cast<S>(detail::encode_full<detail::spec_of<T>()>(x, mode, true, random).code));
}

// T -> fp32, exact; Subnormals::flush reads a subnormal input as a signed zero.
template <LowPrecisionFormat T>
constexpr float decode(T v, Subnormals subnormals = Subnormals::keep) noexcept {
  return detail::decode<detail::spec_of<T>()>(v.bits(), subnormals);
}

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2 && sizeof(f8e4m3) == 1 && sizeof(f8e5m2) == 1 &&
              sizeof(e8m0) == 1);
static_assert(std::is_trivially_copyable_v<f16> && std::is_trivially_copyable_v<bf16> &&
              std::is_trivially_copyable_v<f8e4m3> && std::is_trivially_copyable_v<f8e5m2> &&
              std::is_trivially_copyable_v<e8m0>);

}  // namespace mixprec
