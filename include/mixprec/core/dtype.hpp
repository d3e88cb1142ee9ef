// Element types of tensors that kernels and optimizers accept.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace mixprec {

enum class DType : std::uint8_t { f32, f16, bf16 };

constexpr std::size_t dtype_size(DType t) noexcept { return t == DType::f32 ? 4 : 2; }

constexpr std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

constexpr std::optional<DType> parse_dtype(std::string_view s) noexcept {
  if (s == "f32" || s == "fp32") return DType::f32;
  if (s == "f16" || s == "fp16") return DType::f16;
  if (s == "bf16") return DType::bf16;
  return std::nullopt;
}

}  // namespace mixprec
