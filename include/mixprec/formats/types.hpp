// Value types for the low-precision formats: f16, bf16, f8e4m3, f8e5m2, e8m0.
//
// Each is a trivially copyable wrapper of exactly its width holding the bit
// pattern. Construction from float rounds to nearest, ties to even, with IEEE
// overflow and gradual underflow; conversion back to float is exact. Other
// modes (saturation, flush-to-zero, stochastic rounding) go through
// mixprec::encode<T>(x, mode) and mixprec::encode_stochastic<T>(...).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include "mixprec/formats/format_table.hpp"
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

// Facts about each format: its row of the format table (format_table.hpp), at compile time.
template <class T>
struct format_traits;

namespace detail {
template <FormatId I>
struct row_traits {
  static constexpr FormatId id = I;
  static constexpr std::string_view name = format_row(I).name;
  static constexpr int bits = format_row(I).bits;
  static constexpr int exponent_bits = format_row(I).exponent_bits;
  static constexpr int mantissa_bits = format_row(I).mantissa_bits;
  static constexpr int bias = format_row(I).bias;
  static constexpr float max_finite = format_row(I).max_finite;
  static constexpr float min_normal = format_row(I).min_normal;
  static constexpr float min_subnormal = format_row(I).min_subnormal;  // 0 when the format has none
  static constexpr float epsilon = format_row(I).epsilon;              // next value above 1, minus 1
  static constexpr bool has_infinity = format_row(I).has_infinity;
  static constexpr bool has_subnormals = format_row(I).has_subnormals;
  static constexpr bool is_signed = format_row(I).is_signed;
};
}  // namespace detail

template <> struct format_traits<float> : detail::row_traits<FormatId::f32> {};
template <> struct format_traits<f16> : detail::row_traits<FormatId::f16> {};
template <> struct format_traits<bf16> : detail::row_traits<FormatId::bf16> {};
template <> struct format_traits<f8e4m3> : detail::row_traits<FormatId::f8e4m3> {};
template <> struct format_traits<f8e5m2> : detail::row_traits<FormatId::f8e5m2> {};
template <> struct format_traits<e8m0> : detail::row_traits<FormatId::e8m0> {};

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

// f(T{}) with the value type of a format that has conversion kernels (FormatRow::converts);
// std::invalid_argument for another. The one place a runtime FormatId becomes a type.
template <class F>
decltype(auto) visit_format(FormatId id, F&& f) {
  switch (id) {
    case FormatId::f16: return f(f16{});
    case FormatId::bf16: return f(bf16{});
    case FormatId::f8e4m3: return f(f8e4m3{});
    case FormatId::f8e5m2: return f(f8e5m2{});
    case FormatId::f32:
    case FormatId::e8m0: break;
  }
  throw std::invalid_argument(std::string("format ").append(format_row(id).name).append(
      " has no conversion kernels; expected one of ").append(format_names(convertible_formats())));
}

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2 && sizeof(f8e4m3) == 1 && sizeof(f8e5m2) == 1 &&
              sizeof(e8m0) == 1);
template <class T>
constexpr bool size_matches_row() { return sizeof(T) == format_row(format_traits<T>::id).bytes(); }
static_assert(size_matches_row<float>() && size_matches_row<f16>() && size_matches_row<bf16>() &&
              size_matches_row<f8e4m3>() && size_matches_row<f8e5m2>() && size_matches_row<e8m0>());
static_assert(std::is_trivially_copyable_v<f16> && std::is_trivially_copyable_v<bf16> &&
              std::is_trivially_copyable_v<f8e4m3> && std::is_trivially_copyable_v<f8e5m2> &&
              std::is_trivially_copyable_v<e8m0>);

}  // namespace mixprec
