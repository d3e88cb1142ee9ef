// `mixprec inspect FILE.npy`: for a tensor saved by NumPy, the fraction of its values that
// would underflow, become subnormal or overflow in each format at scales 2^0 .. 2^max, and
// the static scale that keeps the most values normal without overflow (docs/inspect.md).
#include "cmd_inspect.hpp"
#include "cli_app.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "mixprec/inspect/inspect.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/inspect/npy.hpp"

namespace mixprec::cli {
namespace {

using monitor::Advice;
using monitor::FormatInspection;
using monitor::InspectReport;
using monitor::NpyArray;
using monitor::ScaleOutcome;
using monitor::TensorStats;

struct Request {
  std::string file;
  std::vector<FormatId> formats;
  int max_scale_log2 = 24;
  int every = 1;
  bool json = false;
};

// The formats inspect counts: those with conversion kernels, by label.
std::string format_list() { return format_labels(convertible_formats()); }

using text::json_quote;

// A percentage that never shows a nonzero share as 0 or a partial one as 100.
std::string share_text(std::uint64_t n, const TensorStats& s) {
  if (n == 0) return "0";
  if (n == s.finite_nonzero) return "100";
  const double p = 100.0 * monitor::fraction_of(n, s);
  if (p < 0.01) return "<0.01";
  if (p > 99.99) return ">99.99";
  return fmt::format("{:.2f}", p);
}

std::string pow2_text(double v) {
  if (v <= 0.0) return "-";
  return fmt::format("2^{:.2f}", std::log2(v));
}

std::string scale_value(int k) { return fmt::format("{}", std::ldexp(1.0, k)); }

std::vector<FormatId> parse_formats(const std::string& text) {
  std::vector<FormatId> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    std::string name = text.substr(start, comma - start);
    const auto f = parse_format(name);  // a label (e4m3) or a name (f8e4m3)
    if (!f || !format_row(*f).converts)
      throw CLI::ValidationError("--formats", std::string("unknown format '")
                                                  .append(name)
                                                  .append("'; expected a comma-separated list of ")
                                                  .append(format_list()));
    if (std::find(out.begin(), out.end(), *f) == out.end()) out.push_back(*f);
    if (comma == text.size()) break;
    start = comma + 1;
  }
  return out;
}

void print_table(const Request& q, const NpyArray& a, const InspectReport& r) {
  const TensorStats& s = r.stats;
  fmt::print("mixprec inspect: {}\n", q.file);
  fmt::print("shape {}, dtype '{}' ({} order, npy {}.{}): {} values\n", monitor::shape_text(a.shape), a.dtype,
             a.fortran_order ? "Fortran" : "C", a.version_major, a.version_minor, s.count);
  const double zero_share = s.count == 0 ? 0.0 : 100.0 * static_cast<double>(s.zeros) / static_cast<double>(s.count);
  fmt::print("zeros {} ({:.2f}%), NaN {}, inf {}, finite nonzero {}\n", s.zeros, zero_share, s.nan, s.inf,
             s.finite_nonzero);
  if (s.finite_nonzero > 0) {
    fmt::print("amax {:.6g} ({}), smallest nonzero {:.6g} ({})\n", static_cast<double>(s.amax),
               pow2_text(static_cast<double>(s.amax)), static_cast<double>(s.min_nonzero),
               pow2_text(static_cast<double>(s.min_nonzero)));
    fmt::print("floor(log2|x|): min {}, median {}, max {}\n", s.exponent_min, s.exponent_median, s.exponent_max);
  }
  if (a.narrowed_to_zero + a.narrowed_to_inf > 0)
    fmt::print("note: float64 values were rounded to float32 first: {} became 0 (counted as zeros), {} became inf "
               "(counted as inf)\n",
               a.narrowed_to_zero, a.narrowed_to_inf);
  if (s.nan + s.inf > 0)
    fmt::print("warning: {} of the values {} NaN or inf ({} NaN, {} inf); loss scaling cannot fix these, and they are "
               "left out of the fractions below\n",
               s.nan + s.inf, s.nan + s.inf == 1 ? "is" : "are", s.nan, s.inf);
  if (s.finite_nonzero == 0) {
    fmt::print("\nno finite nonzero values: nothing to scale\n");
    return;
  }

  fmt::print("\nPercent of the {} finite nonzero values that become 0 (under), subnormal (sub) or overflow (over)\n"
             "when stored as value * scale; * marks each format's recommended scale.\n\n",
             s.finite_nonzero);
  std::string names = fmt::format("{:>7}", "scale"), columns = fmt::format("{:>7}", "");
  for (const FormatInspection& f : r.formats) {
    names += fmt::format("  {:^20} ", monitor::inspect_format_name(f.format));
    columns += fmt::format("  {:>6} {:>6} {:>6} ", "under", "sub", "over");
  }
  while (names.back() == ' ') names.pop_back();
  while (columns.back() == ' ') columns.pop_back();
  fmt::print("{}\n{}\n", names, columns);
  for (int k = 0; k <= r.max_scale_log2; ++k) {
    bool recommended_here = false;
    for (const FormatInspection& f : r.formats)
      recommended_here = recommended_here || (f.advice == Advice::scale && f.recommended_log2 == k);
    if (k % q.every != 0 && k != r.max_scale_log2 && !recommended_here) continue;
    std::string line = fmt::format("{:>7}", fmt::format("2^{}", k));
    for (const FormatInspection& f : r.formats) {
      const ScaleOutcome& o = f.scales[static_cast<std::size_t>(k)];
      const bool mark = f.advice == Advice::scale && f.recommended_log2 == k;
      line += fmt::format("  {:>6} {:>6} {:>6}{}", share_text(o.underflow, s), share_text(o.subnormal, s),
                          share_text(o.overflow, s), mark ? "*" : " ");
    }
    while (line.back() == ' ') line.pop_back();
    fmt::print("{}\n", line);
  }
  fmt::print("\n");
  for (const FormatInspection& f : r.formats) {
    const std::string_view name = monitor::inspect_format_name(f.format);
    if (f.advice == Advice::overflows_always) {
      fmt::print("{}: overflows at every scale from 2^0 (amax {:.6g}); a scale of 2^{} = {} or below would fit, "
                 "and scales below 1 are not inspected\n",
                 name, static_cast<double>(s.amax), f.fitting_log2, scale_value(f.fitting_log2));
      continue;
    }
    const ScaleOutcome& o = f.scales[static_cast<std::size_t>(f.recommended_log2)];
    std::string lost;
    if (o.subnormal > 0) lost.append(share_text(o.subnormal, s)).append("% subnormal");
    if (o.underflow > 0) lost.append(lost.empty() ? "" : ", ").append(share_text(o.underflow, s)).append("% become 0");
    fmt::print("{}: static scale 2^{} = {} keeps {}% of values normal{}, no overflow (headroom {:.1f} binades)\n", name,
               f.recommended_log2, scale_value(f.recommended_log2), share_text(o.normal, s),
               lost.empty() ? std::string() : std::string(" (").append(lost).append(")"), f.headroom_binades);
  }
}

void print_json(const Request& q, const NpyArray& a, const InspectReport& r) {
  const TensorStats& s = r.stats;
  std::string shape = "[";
  for (std::size_t i = 0; i < a.shape.size(); ++i) shape.append(i ? "," : "").append(std::to_string(a.shape[i]));
  shape += "]";
  fmt::print("{{\"file\":{},\"shape\":{},\"dtype\":{},\"fortran_order\":{},\"npy_version\":\"{}.{}\",", json_quote(q.file),
             shape, json_quote(a.dtype), a.fortran_order, a.version_major, a.version_minor);
  fmt::print("\"narrowed_to_zero\":{},\"narrowed_to_inf\":{},\n", a.narrowed_to_zero, a.narrowed_to_inf);
  const bool any = s.finite_nonzero > 0;
  std::string hist = "[";
  for (std::size_t i = 0; i < s.exponent_counts.size(); ++i) {
    if (s.exponent_counts[i] == 0) continue;
    hist.append(hist.size() > 1 ? "," : "")
        .append(fmt::format("[{},{}]", static_cast<int>(i) + monitor::kMinExponent, s.exponent_counts[i]));
  }
  hist += "]";
  fmt::print("\"stats\":{{\"count\":{},\"zeros\":{},\"nan\":{},\"inf\":{},\"finite_nonzero\":{},\"amax\":{},"
             "\"min_nonzero\":{},\"log2_exponent\":{{\"min\":{},\"median\":{},\"max\":{},\"histogram\":{}}}}},\n",
             s.count, s.zeros, s.nan, s.inf, s.finite_nonzero, any ? fmt::format("{}", s.amax) : "null",
             any ? fmt::format("{}", s.min_nonzero) : "null", any ? std::to_string(s.exponent_min) : "null",
             any ? std::to_string(s.exponent_median) : "null", any ? std::to_string(s.exponent_max) : "null", hist);
  fmt::print("\"formats\":[");
  for (std::size_t fi = 0; fi < r.formats.size(); ++fi) {
    const FormatInspection& f = r.formats[fi];
    const monitor::FormatThresholds t = monitor::format_thresholds(f.format);
    fmt::print("{}{{\"format\":\"{}\",\"thresholds\":{{\"nonzero\":{},\"normal\":{},\"overflow\":{}}},\"recommendation\":",
               fi ? ",\n" : "\n", monitor::inspect_format_name(f.format), t.nonzero, t.normal, t.overflow);
    switch (f.advice) {
      case Advice::no_values: fmt::print("{{\"advice\":\"no_values\"}}"); break;
      case Advice::overflows_always:
        fmt::print("{{\"advice\":\"overflows_always\",\"fitting_scale_log2\":{},\"fitting_scale\":{}}}", f.fitting_log2,
                   scale_value(f.fitting_log2));
        break;
      case Advice::scale: {
        const ScaleOutcome& o = f.scales[static_cast<std::size_t>(f.recommended_log2)];
        fmt::print("{{\"advice\":\"scale\",\"scale_log2\":{},\"scale\":{},\"normal_fraction\":{},\"headroom_binades\":{}}}",
                   f.recommended_log2, scale_value(f.recommended_log2), monitor::fraction_of(o.normal, s),
                   f.headroom_binades);
        break;
      }
    }
    fmt::print(",\"scales\":[");
    for (const ScaleOutcome& o : f.scales) {
      fmt::print("{}{{\"scale_log2\":{},\"scale\":{},\"underflow\":{},\"subnormal\":{},\"overflow\":{},\"normal\":{},"
                 "\"underflow_fraction\":{},\"subnormal_fraction\":{},\"overflow_fraction\":{}}}",
                 o.scale_log2 ? ",\n" : "\n", o.scale_log2, scale_value(o.scale_log2), o.underflow, o.subnormal,
                 o.overflow, o.normal, monitor::fraction_of(o.underflow, s), monitor::fraction_of(o.subnormal, s),
                 monitor::fraction_of(o.overflow, s));
    }
    fmt::print("]}}");
  }
  fmt::print("]}}\n");
}

int run_inspect(const Request& q) {
  const NpyArray a = monitor::read_npy(q.file);
  monitor::InspectOptions o;
  o.formats = q.formats;
  o.max_scale_log2 = q.max_scale_log2;
  const InspectReport r = monitor::inspect(a.values, o);
  if (q.json) print_json(q, a, r);
  else print_table(q, a, r);
  return 0;
}

}  // namespace

void add_inspect_command(CLI::App& app, std::function<int()>& action) {
  auto* cmd = app.add_subcommand(
      "inspect", "For a tensor saved as .npy: what each format loses at scales 2^0 .. 2^24, and the static scale to use");
  auto q = std::make_shared<Request>();
  auto formats = std::make_shared<std::string>("fp16,bf16,e4m3,e5m2");
  // Numbers as text, read by the core's grammar in the callback (flag_value), as every key's.
  auto max_scale_log2 = std::make_shared<std::string>("24");
  auto every = std::make_shared<std::string>("1");
  cmd->add_option("file", q->file, "The .npy file (float32, float16 or float64)")->required();
  cmd->add_flag("--json", q->json, "Print JSON (every scale of every format) instead of a table");
  cmd->add_option("--formats", *formats, std::string("Comma-separated formats among ").append(format_list()))
      ->capture_default_str();
  cmd->add_option("--max-scale-log2", *max_scale_log2, "Inspect scales 2^0 .. 2^N, N in [0, 127]")
      ->type_name("N")
      ->capture_default_str();
  cmd->add_option("--every", *every, "Print every N-th scale in the table (JSON has all), N in [1, 127]")
      ->type_name("N")
      ->capture_default_str();
  cmd->callback([q, formats, max_scale_log2, every, &action] {
    static const keys::Spec max_spec{
        .name = "--max-scale-log2", .kind = keys::Kind::integer, .int_min = 0, .int_max = 127};
    static const keys::Spec every_spec{.name = "--every", .kind = keys::Kind::integer, .int_min = 1, .int_max = 127};
    q->max_scale_log2 = static_cast<int>(std::get<keys::Integer>(flag_value(max_spec, *max_scale_log2)).magnitude);
    q->every = static_cast<int>(std::get<keys::Integer>(flag_value(every_spec, *every)).magnitude);
    q->formats = parse_formats(*formats);
    action = [q] { return run_inspect(*q); };
  });
}

}  // namespace mixprec::cli
