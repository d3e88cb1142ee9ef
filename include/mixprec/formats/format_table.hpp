// Every number format, one row each: its names, its layout, its facts (max finite, min
// normal, ...), its codes and which conversion kernels it has. Everything that lists
// formats reads these rows: format_traits<T> (types.hpp), the reference codec's specs
// (scalar.hpp), DType's names and sizes (formats/dtype.hpp), `mixprec formats`, `mixprec
// inspect --formats`, the report's format bands, the headroom of a run's steps and the
// Python package's format names. tests/formats/test_format_table.cpp checks every row
// against the codec over all of the format's codes.
//
// A new format is a row here plus its kernels: a value type (types.hpp), a spec (scalar.hpp),
// the bulk kernels of each back end (formats/kernel_table.hpp) and a case in visit_format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec {

enum class FormatId : std::uint8_t { f32, f16, bf16, f8e4m3, f8e5m2, e8m0 };

struct FormatRow {
  FormatId id;
  std::string_view name;     // the library's and the Python package's name: "f16", "f8e4m3"
  std::string_view label;    // the command line's: "fp16", "e4m3" (parse_format takes both)
  std::string_view display;  // in reports and prose: "fp16", "E4M3"
  int bits, exponent_bits, mantissa_bits, bias;
  // Values are exact floats.
  float max_finite, min_normal;
  float min_subnormal;  // 0 when the format has none
  float epsilon;        // the next value above 1, minus 1
  bool has_infinity, has_subnormals, is_signed;
  std::string_view nan_codes;  // which codes are NaN, as `mixprec formats` shows them
  // Magnitude codes of the reference codec (scalar.hpp): the largest finite value, what an
  // IEEE overflow gives (inf, or NaN for E4M3) and the canonical quiet NaN.
  std::uint32_t max_code, overflow_code, nan_code;
  bool converts;  // fp32 <-> format bulk kernels (bulk.hpp): encode, decode, counted, stochastic

  constexpr std::size_t bytes() const noexcept { return static_cast<std::size_t>(bits) / 8; }
};

// In FormatId order.
inline constexpr FormatRow kFormatTable[] = {
    {FormatId::f32, "f32", "fp32", "fp32", 32, 8, 23, 127, 0x1.fffffep127f, 0x1p-126f, 0x1p-149f, 0x1p-23f, true, true,
     true, "many", 0x7f7fffff, 0x7f800000, 0x7fc00000, false},
    {FormatId::f16, "f16", "fp16", "fp16", 16, 5, 10, 15, 65504.0f, 0x1p-14f, 0x1p-24f, 0x1p-10f, true, true, true,
     "S.11111.m!=0", 0x7bff, 0x7c00, 0x7e00, true},
    {FormatId::bf16, "bf16", "bf16", "bf16", 16, 8, 7, 127, 0x1.fep127f, 0x1p-126f, 0x1p-133f, 0x1p-7f, true, true, true,
     "S.11111111.m!=0", 0x7f7f, 0x7f80, 0x7fc0, true},
    {FormatId::f8e4m3, "f8e4m3", "e4m3", "E4M3", 8, 4, 3, 7, 448.0f, 0x1p-6f, 0x1p-9f, 0x1p-3f, false, true, true,
     "S.1111.111 only", 0x7e, 0x7f, 0x7f, true},
    {FormatId::f8e5m2, "f8e5m2", "e5m2", "E5M2", 8, 5, 2, 15, 57344.0f, 0x1p-14f, 0x1p-16f, 0x1p-2f, true, true, true,
     "S.11111.{01,10,11}", 0x7b, 0x7c, 0x7e, true},
    {FormatId::e8m0, "e8m0", "e8m0", "E8M0", 8, 8, 0, 127, 0x1p127f, 0x1p-127f, 0.0f, 1.0f, false, false, false, "0xFF",
     0xfe, 0xff, 0xff, false},
};

constexpr const FormatRow& format_row(FormatId id) noexcept { return kFormatTable[static_cast<std::size_t>(id)]; }

constexpr bool rows_in_id_order() {
  for (std::size_t i = 0; i < std::size(kFormatTable); ++i)
    if (static_cast<std::size_t>(kFormatTable[i].id) != i) return false;
  return true;
}
static_assert(rows_in_id_order(), "kFormatTable: one row per FormatId, in FormatId order");

// A format by its name or label ("f16" or "fp16", "f8e4m3" or "e4m3").
constexpr std::optional<FormatId> parse_format(std::string_view s) noexcept {
  for (const FormatRow& r : kFormatTable)
    if (r.name == s || r.label == s) return r.id;
  return std::nullopt;
}

// The formats with fp32 conversion kernels (f16, bf16, f8e4m3, f8e5m2), in table order.
std::vector<FormatId> convertible_formats();
// "fp16, bf16, e4m3, e5m2" (labels) or "f16, bf16, f8e4m3, f8e5m2" (names) of `formats`.
std::string format_labels(const std::vector<FormatId>& formats);
std::string format_names(const std::vector<FormatId>& formats);

}  // namespace mixprec
