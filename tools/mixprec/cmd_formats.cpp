// `mixprec formats`: the range and precision of every format, and
// `mixprec formats --value X`: how one number is stored in each of them.
#include "cmd_formats.hpp"

#include <fmt/core.h>

#include <bit>
#include <charconv>
#include <cmath>
#include <string>

#include "mixprec/mixprec.hpp"

namespace mixprec::cli {
namespace {

struct Row {
  std::string_view name;
  int bits, exponent_bits, mantissa_bits, bias;
  float max_finite, min_normal, min_subnormal, epsilon;
  bool has_infinity;
  std::string_view nan;
};

template <class T>
Row row(std::string_view nan) {
  using Tr = format_traits<T>;
  return {Tr::name, Tr::bits, Tr::exponent_bits, Tr::mantissa_bits, Tr::bias, Tr::max_finite,
          Tr::min_normal, Tr::min_subnormal, Tr::epsilon, Tr::has_infinity, nan};
}

std::string pow2(double v) {
  if (v == 0.0) return "-";
  const double l = std::log2(v);
  if (l == std::floor(l)) return fmt::format("2^{}", static_cast<int>(l));
  return fmt::format("2^{:.2f}", l);
}

void print_table() {
  const Row rows[] = {
      row<float>("many"),           row<f16>("S.11111.m!=0"),      row<bf16>("S.11111111.m!=0"),
      row<f8e4m3>("S.1111.111 only"), row<f8e5m2>("S.11111.{01,10,11}"), row<e8m0>("0xFF"),
  };
  fmt::print("mixprec {}: number formats (round to nearest even from f32; back end: {})\n\n", kVersionString,
             isa_name(active_isa()));
  fmt::print("{:<7} {:>6} {:>5} {:>13} {:>13} {:>13} {:>10} {:>7} {:>8} {:>4}  {}\n", "format", "s/e/m", "bias",
             "max finite", "min normal", "min subnorm", "epsilon", "digits", "binades", "inf", "NaN codes");
  for (const Row& r : rows) {
    const double lowest = r.min_subnormal > 0 ? static_cast<double>(r.min_subnormal) : static_cast<double>(r.min_normal);
    const double binades = std::log2(static_cast<double>(r.max_finite) / lowest);
    const double digits = (r.mantissa_bits + 1) * std::log10(2.0);
    const bool is_e8m0 = r.name == "e8m0";
    fmt::print("{:<7} {:>6} {:>5} {:>13.6g} {:>13.6g} {:>13} {:>10} {:>7.2f} {:>8.1f} {:>4}  {}\n", r.name,
               fmt::format("{}/{}/{}", is_e8m0 ? 0 : 1, r.exponent_bits, r.mantissa_bits), r.bias,
               static_cast<double>(r.max_finite), static_cast<double>(r.min_normal),
               r.min_subnormal > 0 ? fmt::format("{:.6g}", static_cast<double>(r.min_subnormal)) : std::string("-"),
               pow2(static_cast<double>(r.epsilon)), digits, binades, r.has_infinity ? "yes" : "no", r.nan);
  }
  fmt::print(
      "\ndigits: decimal digits of precision; binades: log2(max finite / smallest positive).\n"
      "fp16 holds gradients down to 2^-24 = 6.0e-8; smaller ones become 0 unless the loss is scaled up.\n"
      "bf16 keeps fp32's range with 8 bits of precision; E4M3/E5M2 need a scale per tensor.\n"
      "Try: mixprec formats --value 1e-7\n");
}

// Parses a whole string as a double: decimal, scientific, inf, nan, or 0x hex.
std::optional<double> parse_number(const std::string& text, std::string& why) {
  std::string_view s = text;
  bool negative = false;
  if (!s.empty() && (s.front() == '-' || s.front() == '+')) {
    negative = s.front() == '-';
    s.remove_prefix(1);
  }
  auto fmt_kind = std::chars_format::general;
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s.remove_prefix(2);
    fmt_kind = std::chars_format::hex;
  }
  if (s.empty()) {
    why = "no digits";
    return std::nullopt;
  }
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, fmt_kind);
  if (ec == std::errc::result_out_of_range) {
    why = "out of the range of a double";
    return std::nullopt;
  }
  if (ec != std::errc{} || end != s.data() + s.size()) {
    why = "not a number";
    return std::nullopt;
  }
  return negative ? -v : v;
}

struct Outcome {
  std::string text;
  std::string scale_hint;
};

// What happened to the value v when it was stored as `stored` (decoded).
template <class T>
Outcome classify(double v, float stored) {
  using Tr = format_traits<T>;
  const double s = static_cast<double>(stored);
  const double av = std::fabs(v);
  if (std::isnan(v)) return {std::isnan(s) ? "NaN stays NaN" : "NaN lost", ""};
  if (std::isinf(v)) {
    if (std::isinf(s)) return {"infinity", ""};
    return {std::isnan(s) ? "inf -> NaN (no inf in format)" : "inf -> finite", ""};
  }
  const double maxf = static_cast<double>(Tr::max_finite);
  const double minn = static_cast<double>(Tr::min_normal);
  if (std::isinf(s) || std::isnan(s)) {
    const int k = static_cast<int>(std::floor(std::log2(maxf / av)));
    return {std::isinf(s) ? "OVERFLOW to inf" : "OVERFLOW to NaN", fmt::format("scale <= 2^{} fits", k)};
  }
  if (v != 0.0 && s == 0.0) {
    const int k = static_cast<int>(std::ceil(std::log2(minn / av)));
    return {"UNDERFLOW to 0", fmt::format("scale >= 2^{} is normal", k)};
  }
  if (v == 0.0) return {"exact (zero)", ""};
  const std::string exactness = s == v ? "exact" : "rounded";
  if (std::fabs(s) < minn && Tr::has_subnormals) {
    const int k = static_cast<int>(std::ceil(std::log2(minn / av)));
    return {"subnormal, " + exactness + " (precision lost)", fmt::format("scale >= 2^{} is normal", k)};
  }
  return {exactness, ""};
}

template <class T>
void print_value_row(double v, float x32) {
  const T t(x32);
  const float back = static_cast<float>(t);
  const Outcome o = classify<T>(v, back);
  const std::string rel =
      (v == 0.0 || !std::isfinite(v) || !std::isfinite(back))
          ? std::string("-")
          : fmt::format("{:+.3e}", (static_cast<double>(back) - v) / v);
  fmt::print("{:<7} {:<11} {:>16.9g} {:>12}  {:<36} {}\n", format_traits<T>::name,
             fmt::format("0x{:0{}x}", t.bits(), format_traits<T>::bits / 4), static_cast<double>(back), rel, o.text,
             o.scale_hint);
}

int print_value(double v) {
  const float x32 = static_cast<float>(v);
  fmt::print("value {} (as f32: 0x{:08x} = {:.9g})\n\n", v, std::bit_cast<std::uint32_t>(x32),
             static_cast<double>(x32));
  fmt::print("{:<7} {:<11} {:>16} {:>12}  {:<36} {}\n", "format", "bits", "decoded", "rel. error", "outcome",
             "loss-scale hint");
  {
    const Outcome o = classify<float>(v, x32);
    const std::string rel = (v == 0.0 || !std::isfinite(v) || !std::isfinite(x32))
                                ? std::string("-")
                                : fmt::format("{:+.3e}", (static_cast<double>(x32) - v) / v);
    fmt::print("{:<7} {:<11} {:>16.9g} {:>12}  {:<36} {}\n", "f32",
               fmt::format("0x{:08x}", std::bit_cast<std::uint32_t>(x32)), static_cast<double>(x32), rel, o.text,
               o.scale_hint);
  }
  print_value_row<f16>(v, x32);
  print_value_row<bf16>(v, x32);
  print_value_row<f8e4m3>(v, x32);
  print_value_row<f8e5m2>(v, x32);
  fmt::print("\nEach format is rounded from the f32 value (nearest, ties to even; IEEE overflow).\n");
  return 0;
}

}  // namespace

void add_formats_command(CLI::App& app, std::function<int()>& action) {
  auto* cmd = app.add_subcommand("formats", "Show every number format's range and precision");
  auto value = std::make_shared<std::string>();
  cmd->add_option("--value", *value, "Show how this number is stored in each format (e.g. 1e-7, -65520, 0x1p-24)");
  cmd->callback([cmd, value, &action] {
    if (cmd->count("--value") == 0) {
      action = [] {
        print_table();
        return 0;
      };
      return;
    }
    std::string why;
    const auto v = parse_number(*value, why);
    if (!v) {
      throw CLI::ValidationError("--value", "'" + *value + "' is " + why +
                                                "; give a decimal, scientific (1e-7), inf, nan or hex (0x1p-24) number");
    }
    action = [x = *v] { return print_value(x); };
  });
}

}  // namespace mixprec::cli
