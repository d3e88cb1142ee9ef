// `mixprec formats`: the range and precision of every format, and
// `mixprec formats --value X`: how one number is stored in each of them.
#include "cmd_formats.hpp"

#include <fmt/core.h>

#include <bit>
#include <charconv>
#include <cmath>
#include <string>

#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/mixprec.hpp"

namespace mixprec::cli {
namespace {

std::string pow2(double v) {
  if (v == 0.0) return "-";
  const double l = std::log2(v);
  if (l == std::floor(l)) return fmt::format("2^{}", static_cast<int>(l));
  return fmt::format("2^{:.2f}", l);
}

void print_table() {
  fmt::print("mixprec {}: number formats (round to nearest even from f32; back end: {})\n\n", kVersionString,
             isa_name(active_isa()));
  fmt::print("{:<7} {:>6} {:>5} {:>13} {:>13} {:>13} {:>10} {:>7} {:>8} {:>4}  {}\n", "format", "s/e/m", "bias",
             "max finite", "min normal", "min subnorm", "epsilon", "digits", "binades", "inf", "NaN codes");
  for (const FormatRow& r : kFormatTable) {
    const double lowest = r.min_subnormal > 0 ? static_cast<double>(r.min_subnormal) : static_cast<double>(r.min_normal);
    const double binades = std::log2(static_cast<double>(r.max_finite) / lowest);
    const double digits = (r.mantissa_bits + 1) * std::log10(2.0);
    fmt::print("{:<7} {:>6} {:>5} {:>13.6g} {:>13.6g} {:>13} {:>10} {:>7.2f} {:>8.1f} {:>4}  {}\n", r.name,
               fmt::format("{}/{}/{}", r.is_signed ? 1 : 0, r.exponent_bits, r.mantissa_bits), r.bias,
               static_cast<double>(r.max_finite), static_cast<double>(r.min_normal),
               r.min_subnormal > 0 ? fmt::format("{:.6g}", static_cast<double>(r.min_subnormal)) : std::string("-"),
               pow2(static_cast<double>(r.epsilon)), digits, binades, r.has_infinity ? "yes" : "no", r.nan_codes);
  }
  fmt::print(
      "\ndigits: decimal digits of precision; binades: log2(max finite / smallest positive).\n"
      "fp16 holds gradients down to 2^-24 = 6.0e-8; smaller ones become 0 unless the loss is scaled up.\n"
      "bf16 keeps fp32's range with 8 bits of precision; E4M3/E5M2 need a scale per tensor.\n"
      "Try: mixprec formats --value 1e-7\n");
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
  for (const FormatId f : convertible_formats()) visit_format(f, [&]<class T>(T) { print_value_row<T>(v, x32); });
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
    // The number grammar of every key (core/keys.hpp); -0 keeps its sign here.
    keys::NumberProblem problem{};
    const auto v = keys::parse_number(*value, &problem);
    if (!v)
      throw CLI::ValidationError(
          std::string("--value: expected a number: decimal, scientific (1e-7), inf, nan or hex (0x1p-24), found ") +
          text::squote(*value) + (problem == keys::NumberProblem::out_of_range ? " (past the range of a double)" : ""));
    action = [x = *v] { return print_value(x); };
  });
}

}  // namespace mixprec::cli
