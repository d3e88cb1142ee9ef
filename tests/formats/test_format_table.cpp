// The format table (formats/format_table.hpp) against the kernels: every fact of each row
// (max finite, min normal, min subnormal, epsilon, infinity, subnormals, sign, the codes)
// is measured over all of the format's codes, decoded by the scalar reference and by every
// back end's decode kernel, and must equal the row. Also: each name and label parses to its
// row, the value types and DTypes have the row's size, and the traits are the rows.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "backends.hpp"
#include "mixprec/formats/dtype.hpp"
#include "mixprec/formats/format_table.hpp"
#include "mixprec/formats/kernel_table.hpp"
#include "mixprec/formats/types.hpp"

namespace mixprec {
namespace {

std::string hex(std::uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%x", v);
  return b;
}

// The facts of a format as its codes decode.
struct Measured {
  float max_finite = 0, min_normal = 0, min_subnormal = 0, epsilon = 0;
  std::uint32_t max_code = 0;
  bool has_infinity = false, has_subnormals = false, is_signed = false;
};

// `decoded[c]` is code c's value; `normal(c)`: its exponent field is not all zeros.
template <class Normal>
Measured measure(const std::vector<float>& decoded, Normal normal) {
  Measured m;
  float next_above_one = std::numeric_limits<float>::infinity();
  for (std::uint32_t c = 0; c < decoded.size(); ++c) {
    const float v = decoded[c];
    if (std::isnan(v)) continue;
    if (std::isinf(v)) {
      m.has_infinity = true;
      continue;
    }
    if (std::signbit(v) && v != 0) m.is_signed = true;
    if (v > m.max_finite) {
      m.max_finite = v;
      m.max_code = c;
    }
    if (v > 0 && normal(c) && (m.min_normal == 0 || v < m.min_normal)) m.min_normal = v;
    if (v > 0 && !normal(c) && (m.min_subnormal == 0 || v < m.min_subnormal)) m.min_subnormal = v;
    if (v > 1 && v < next_above_one) next_above_one = v;
  }
  m.has_subnormals = m.min_subnormal > 0;
  m.epsilon = next_above_one - 1;
  return m;
}

void expect_row(const FormatRow& r, const Measured& m, const std::string& by) {
  SCOPED_TRACE(std::string(r.name) + " decoded by " + by);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(r.max_finite), std::bit_cast<std::uint32_t>(m.max_finite))
      << r.max_finite << " vs " << m.max_finite;
  EXPECT_EQ(r.max_code, m.max_code) << hex(r.max_code) << " vs " << hex(m.max_code);
  EXPECT_EQ(r.min_normal, m.min_normal);
  EXPECT_EQ(r.min_subnormal, m.min_subnormal);
  EXPECT_EQ(r.epsilon, m.epsilon);
  EXPECT_EQ(r.has_infinity, m.has_infinity);
  EXPECT_EQ(r.has_subnormals, m.has_subnormals);
  EXPECT_EQ(r.is_signed, m.is_signed);
}

template <class T>
void check_convertible() {
  using S = typename T::storage_type;
  const FormatRow& r = format_row(format_traits<T>::id);
  ASSERT_TRUE(r.converts);
  EXPECT_EQ(sizeof(S) * 8, static_cast<std::size_t>(r.bits));
  EXPECT_EQ(1 + r.exponent_bits + r.mantissa_bits, r.bits);
  EXPECT_EQ(r.min_normal, std::ldexp(1.0f, 1 - r.bias));
  const std::uint32_t n = 1u << r.bits;
  const auto normal = [&](std::uint32_t c) { return ((c >> r.mantissa_bits) & ((1u << r.exponent_bits) - 1)) != 0; };
  // The scalar reference, code by code.
  std::vector<float> ref(n);
  for (std::uint32_t c = 0; c < n; ++c) ref[c] = decode(T::from_bits(static_cast<S>(c)));
  expect_row(r, measure(ref, normal), "the scalar reference");
  // Every back end's decode kernel over all codes at once.
  std::vector<S> codes(n);
  for (std::uint32_t c = 0; c < n; ++c) codes[c] = static_cast<S>(c);
  std::string missing;
  std::vector<test::Backend> backends = test::simd_backends(missing);
  backends.insert(backends.begin(), {"scalar", kernel_table(Isa::scalar)});
  for (const test::Backend& b : backends) {
    std::vector<float> got(n);
    b.table->get<T>().decode(codes.data(), got.data(), n, ConvertOptions{});
    expect_row(r, measure(got, normal), b.name);
  }
  if (!missing.empty()) std::printf("[ note ] back ends not on this CPU (not checked): %s\n", missing.c_str());
  // What an IEEE overflow and a NaN encode to.
  EXPECT_EQ(encode<T>(std::numeric_limits<float>::infinity()).bits(), r.overflow_code) << hex(r.overflow_code);
  EXPECT_EQ(encode<T>(std::numeric_limits<float>::max()).bits(), r.overflow_code);
  EXPECT_EQ(encode<T>(std::numeric_limits<float>::quiet_NaN()).bits(), r.nan_code) << hex(r.nan_code);
  EXPECT_EQ(encode<T>(r.max_finite).bits(), r.max_code);
  // The traits are the row.
  EXPECT_EQ(format_traits<T>::max_finite, r.max_finite);
  EXPECT_EQ(format_traits<T>::name, r.name);
}

TEST(FormatTable, ConvertibleRowsMatchTheirCodesInEveryBackEnd) {
  int checked = 0;
  for (const FormatId f : convertible_formats()) {
    visit_format(f, []<class T>(T) { check_convertible<T>(); });
    ++checked;
  }
  EXPECT_EQ(checked, 4);  // f16, bf16, f8e4m3, f8e5m2
}

TEST(FormatTable, Fp32AndE8m0Rows) {
  const FormatRow& f = format_row(FormatId::f32);
  EXPECT_EQ(f.max_finite, std::numeric_limits<float>::max());
  EXPECT_EQ(f.min_normal, std::numeric_limits<float>::min());
  EXPECT_EQ(f.min_subnormal, std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(f.epsilon, std::numeric_limits<float>::epsilon());
  EXPECT_EQ(f.bits, 32);
  EXPECT_EQ(f.max_code, std::bit_cast<std::uint32_t>(std::numeric_limits<float>::max()));
  EXPECT_EQ(f.overflow_code, std::bit_cast<std::uint32_t>(std::numeric_limits<float>::infinity()));
  // E8M0: 2^(code - 127), code 0xff is NaN, no sign, no zero.
  const FormatRow& e = format_row(FormatId::e8m0);
  std::vector<float> decoded(256);
  for (std::uint32_t c = 0; c < 256; ++c) decoded[c] = static_cast<float>(e8m0::from_bits(static_cast<std::uint8_t>(c)));
  EXPECT_TRUE(std::isnan(decoded[e.nan_code]));
  const Measured m = measure(decoded, [](std::uint32_t) { return true; });
  expect_row(e, m, "e8m0's decode");
  EXPECT_EQ(sizeof(e8m0) * 8, static_cast<std::size_t>(e.bits));
}

TEST(FormatTable, NamesLabelsAndSizes) {
  for (const FormatRow& r : kFormatTable) {
    SCOPED_TRACE(r.name);
    EXPECT_EQ(parse_format(r.name), r.id);
    EXPECT_EQ(parse_format(r.label), r.id);
    EXPECT_EQ(r.bits % 8, 0);
    for (const FormatRow& o : kFormatTable)
      if (o.id != r.id) {
        EXPECT_TRUE(o.name != r.name && o.label != r.label && o.display != r.display) << o.name;
      }
  }
  EXPECT_EQ(parse_format("fp8"), std::nullopt);
  EXPECT_EQ(format_labels(convertible_formats()), "fp16, bf16, e4m3, e5m2");
  EXPECT_EQ(format_names(convertible_formats()), "f16, bf16, f8e4m3, f8e5m2");
  // DType is three rows of the table.
  EXPECT_EQ(dtype_size(DType::f32), sizeof(float));
  EXPECT_EQ(dtype_size(DType::f16), sizeof(f16));
  EXPECT_EQ(dtype_size(DType::bf16), sizeof(bf16));
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
  EXPECT_EQ(parse_dtype("fp16"), DType::f16);
  EXPECT_EQ(parse_dtype("f32"), DType::f32);
  EXPECT_EQ(parse_dtype("e4m3"), std::nullopt);
  EXPECT_THROW(visit_format(FormatId::e8m0, [](auto) { return 0; }), std::invalid_argument);
}

}  // namespace
}  // namespace mixprec
