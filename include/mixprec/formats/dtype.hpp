// Element types of tensors that kernels and optimizers accept (three of the formats of the
// format table, formats/format_table.hpp, whose rows give their names and sizes) and the
// tensor view they pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "mixprec/formats/format_table.hpp"

namespace mixprec {

enum class DType : std::uint8_t { f32, f16, bf16 };

// The format a DType stores.
constexpr FormatId format_of(DType t) noexcept {
  switch (t) {
    case DType::f16: return FormatId::f16;
    case DType::bf16: return FormatId::bf16;
    case DType::f32: break;
  }
  return FormatId::f32;
}

constexpr std::size_t dtype_size(DType t) noexcept { return format_row(format_of(t)).bytes(); }

// The format's name: "f32", "f16", "bf16".
constexpr std::string_view dtype_name(DType t) noexcept {
  if (static_cast<unsigned>(t) > static_cast<unsigned>(DType::bf16)) return "?";
  return format_row(format_of(t)).name;
}

// A format's name or label ("f32" or "fp32", "f16" or "fp16", "bf16").
constexpr std::optional<DType> parse_dtype(std::string_view s) noexcept {
  for (const DType t : {DType::f32, DType::f16, DType::bf16})
    if (format_row(format_of(t)).name == s || format_row(format_of(t)).label == s) return t;
  return std::nullopt;
}

// One tensor the kernels read or write in place: `size` elements of `dtype` at `data`
// (contiguous). Gradients travel as this view through the scaler, the optimizers and the
// front doors.
struct GradTensor {
  void* data = nullptr;
  std::size_t size = 0;
  DType dtype = DType::f32;
};

}  // namespace mixprec
