// The HTML report of training runs (see report.hpp, docs/report.md): one document
// with inline CSS and SVG, built from in-memory runs.
#include "mixprec/report/report.hpp"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/nn/precision.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/version.hpp"
#include "report/svg_chart.hpp"

namespace mixprec::monitor {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using svg::escape;
using svg::number;
using train::StepRecord;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One colour per run, in order (red is kept for skipped steps).
const char* run_color(std::size_t i) {
  static const char* const palette[] = {"#2563eb", "#f59e0b", "#10b981", "#8b5cf6", "#06b6d4",
                                        "#ec4899", "#84cc16", "#64748b", "#a16207", "#0f766e"};
  return palette[i % (sizeof palette / sizeof palette[0])];
}

// Lines of one chart that are not runs (tensor groups).
const char* group_color(std::size_t i) {
  static const char* const palette[] = {"#0ea5e9", "#f97316", "#22c55e", "#a855f7", "#eab308",
                                        "#14b8a6", "#f43f5e", "#6366f1", "#78716c", "#84cc16"};
  return palette[i % (sizeof palette / sizeof palette[0])];
}

constexpr const char* kSkipColor = "#dc2626";

using text::squote;

// An empty table cell shows an en dash, as duration's does.
std::string percent(double f) { return std::isfinite(f) ? text::percent(f) : "\u2013"; }

std::string duration(double s) {
  if (!std::isfinite(s) || s < 0) return "\u2013";
  if (s < 60) return number(s, s < 1 ? 2 : 3) + " s";
  const auto t = static_cast<long long>(std::llround(s));
  char buf[32];
  if (t < 3600)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, t % 3600 / 60);
  return buf;
}

std::string loss_text(double v) { return number(v, 4); }

std::optional<std::string> config_value(const ReportRun& r, std::string_view key) {
  for (const auto& [k, v] : r.config)
    if (k == key) return v;
  return std::nullopt;
}

std::optional<nn::PrecisionPolicy> policy(const ReportRun& r) {
  const auto p = config_value(r, "precision");
  if (!p) return std::nullopt;
  const auto prec = nn::parse_precision(*p);
  if (!prec) return std::nullopt;
  return nn::policy_of(*prec);
}

// Index of a storage format in svg::standard_ranges(), -1 for one it has no band for (fp32).
int range_index(DType t) {
  const auto& ranges = svg::standard_ranges();
  for (std::size_t i = 0; i < ranges.size(); ++i)
    if (ranges[i].name == format_row(format_of(t)).display) return static_cast<int>(i);
  return -1;
}

std::string run_setup(const ReportRun& r) {
  std::string s;
  if (const auto p = config_value(r, "precision")) s += *p;
  if (const auto l = config_value(r, "loss-scale")) s += (s.empty() ? "loss scale " : ", loss scale ") + *l;
  return s;
}

std::string swatch(const char* color) {
  return std::string("<span class=\"swatch\" style=\"background:").append(color).append("\"></span>");
}

double fraction(std::uint64_t part, std::uint64_t whole) {
  return whole == 0 ? kNaN : static_cast<double>(part) / static_cast<double>(whole);
}

std::string card(const std::string& title, const std::string& body, const std::string& note = {},
                 const char* cls = "card") {
  std::string out = std::string("<div class=\"").append(cls).append("\">");
  if (!title.empty()) out += "<h3>" + title + "</h3>";
  if (!note.empty()) out += "<p class=\"note\">" + note + "</p>";
  out += body;
  out += "</div>";
  return out;
}

// ---- charts -------------------------------------------------------------------------------

std::string loss_chart(const std::vector<ReportRun>& runs) {
  svg::LineChart c;
  c.id = "loss";
  c.height = 380;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "loss";
  bool any_val = false;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    svg::Series s;
    s.label = runs[i].name;
    s.color = run_color(i);
    svg::Series v;
    v.color = s.color;
    v.line = false;
    v.marker = svg::Marker::circle;
    v.marker_size = 4;
    for (const StepRecord& r : runs[i].records) {
      const double x = static_cast<double>(r.step);
      s.points.push_back({x, r.loss_finite ? r.loss : kNaN});
      if (r.val_loss) {
        v.points.push_back({x, *r.val_loss});
        any_val = true;
      }
      // A recipe file's switch (the first step of a phase of its schedule).
      if (!r.recipe_phase.empty())
        c.vlines.push_back({x, runs.size() > 1 ? runs[i].name + ": " + r.recipe_phase : r.recipe_phase, s.color});
    }
    c.series.push_back(std::move(s));
    c.series.push_back(std::move(v));
  }
  if (any_val) {
    svg::Series legend;
    legend.label = "validation loss";
    legend.color = "#6b7280";
    legend.line = false;
    legend.marker = svg::Marker::circle;
    legend.marker_size = 4;
    c.series.push_back(std::move(legend));
  }
  return svg::render(c);
}

std::string scale_chart(const std::vector<ReportRun>& runs) {
  svg::LineChart c;
  c.id = "loss-scale";
  c.width = 560;
  c.height = 320;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "loss scale";
  c.y.log2 = true;
  svg::Series skipped;
  skipped.label = "skipped step";
  skipped.color = kSkipColor;
  skipped.line = false;
  skipped.marker = svg::Marker::cross;
  skipped.marker_size = 4;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    svg::Series s;
    s.label = runs[i].name;
    s.color = run_color(i);
    s.steps = true;
    for (const StepRecord& r : runs[i].records) {
      const double x = static_cast<double>(r.step);
      s.points.push_back({x, static_cast<double>(r.scale)});
      if (r.skipped) skipped.points.push_back({x, static_cast<double>(r.scale)});
    }
    c.series.push_back(std::move(s));
  }
  c.series.push_back(std::move(skipped));
  return svg::render(c);
}

std::string skip_chart(const std::vector<ReportRun>& runs, int window) {
  svg::LineChart c;
  c.id = "skip-rate";
  c.width = 560;
  c.height = 320;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "skipped steps, last " + std::to_string(window);
  c.y.percent = true;
  c.y.min = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    svg::Series s;
    s.label = runs[i].name;
    s.color = run_color(i);
    const auto& recs = runs[i].records;
    std::size_t in_window = 0;
    for (std::size_t k = 0; k < recs.size(); ++k) {
      if (recs[k].skipped) ++in_window;
      if (k >= static_cast<std::size_t>(window) && recs[k - static_cast<std::size_t>(window)].skipped) --in_window;
      const std::size_t n = std::min(k + 1, static_cast<std::size_t>(window));
      s.points.push_back({static_cast<double>(recs[k].step), static_cast<double>(in_window) / static_cast<double>(n)});
    }
    c.series.push_back(std::move(s));
  }
  return svg::render(c);
}

std::string underflow_chart(const std::vector<ReportRun>& runs) {
  svg::LineChart c;
  c.id = "underflow";
  c.height = 320;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "underflow / nonzero";
  c.y.percent = true;
  c.y.min = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    svg::Series s;
    s.label = runs[i].name;
    s.color = run_color(i);
    for (const StepRecord& r : runs[i].records)
      s.points.push_back({static_cast<double>(r.step), fraction(r.act_grads.underflow, r.act_grads.nonzero)});
    c.series.push_back(std::move(s));
  }
  return svg::render(c);
}

// "h12.mlp.fc.grad" -> "h*.mlp.fc.grad": the same role in every layer (the layer
// number is the digits that end the name's first component).
std::string role_of(const std::string& name) {
  const std::size_t dot = std::min(name.find('.'), name.size());
  std::size_t d = dot;
  while (d > 0 && name[d - 1] >= '0' && name[d - 1] <= '9') --d;
  if (d == dot || d == 0) return name;
  return name.substr(0, d) + "*" + name.substr(dot);
}

// The most lines a per-tensor or per-layer chart draws (the rest are grouped or left out).
constexpr std::size_t kMaxChartLines = 12;

// Per-tensor underflow of one run: one line per tensor when there are few, else per
// role (layers summed), the eleven with most underflow and "other"; and all tensors.
// Empty when the log has no per-tensor statistics.
std::string tensor_chart(const ReportRun& run, std::size_t index, std::string& note) {
  std::vector<std::string> names;
  std::uint64_t total_underflow = 0;
  for (const StepRecord& r : run.records)
    for (const nn::TensorGradStats& t : r.act_grad_tensors) {
      if (std::find(names.begin(), names.end(), t.name) == names.end()) names.push_back(t.name);
      total_underflow += t.stats.underflow;
    }
  if (names.empty()) return {};
  std::uint64_t stores = 0;
  for (const StepRecord& r : run.records) stores += r.act_grads.nonzero;
  if (total_underflow == 0 && stores == 0) {
    const auto pol = policy(run);
    note = pol && pol->activations == DType::f32
               ? "activation gradients are stored in fp32 here: nothing is rounded, nothing underflows"
               : "no counted activation-gradient values in this log";
    return {};
  }
  if (total_underflow == 0) {
    note = "no activation-gradient value underflowed in " + std::to_string(run.records.size()) + " steps (" +
           std::to_string(names.size()) + " tensors, " + number(static_cast<double>(stores), 6) + " nonzero values" +
           ")";
    return {};
  }
  const bool by_role = names.size() > kMaxChartLines;
  std::vector<std::string> groups;
  std::map<std::string, std::uint64_t> group_total;
  auto group_of = [&](const std::string& n) { return by_role ? role_of(n) : n; };
  for (const std::string& n : names) {
    const std::string g = group_of(n);
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  }
  for (const StepRecord& r : run.records)
    for (const nn::TensorGradStats& t : r.act_grad_tensors) group_total[group_of(t.name)] += t.stats.underflow;
  // Keep the nine groups with most underflow (stable, in backward order); the rest is "other".
  std::vector<std::string> kept = groups;
  std::string other;
  if (groups.size() > kMaxChartLines) {
    std::vector<std::string> ranked = groups;
    std::stable_sort(ranked.begin(), ranked.end(),
                     [&](const std::string& a, const std::string& b) { return group_total[a] > group_total[b]; });
    ranked.resize(kMaxChartLines - 1);
    kept.clear();
    for (const std::string& g : groups)
      if (std::find(ranked.begin(), ranked.end(), g) != ranked.end()) kept.push_back(g);
    other = "other (" + std::to_string(groups.size() - (kMaxChartLines - 1)) + ")";
  }
  std::vector<std::string> lines = kept;
  if (!other.empty()) lines.push_back(other);
  // A role that only one tensor has is labelled with that tensor's name.
  std::vector<std::string> labels = lines;
  if (by_role)
    for (std::string& l : labels) {
      auto in_role = [&](const std::string& n) { return role_of(n) == l; };
      if (std::count_if(names.begin(), names.end(), in_role) == 1)
        l = *std::find_if(names.begin(), names.end(), in_role);
    }

  svg::LineChart c;
  c.id = "tensors-" + std::to_string(index);
  c.width = 560;
  c.height = 340;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "underflow / nonzero";
  c.y.percent = true;
  c.y.min = 0;
  std::vector<svg::Series> series(lines.size());
  for (std::size_t g = 0; g < lines.size(); ++g) {
    series[g].label = labels[g];
    series[g].color = group_color(g);
    series[g].width = 1.6;
  }
  svg::Series all;
  all.label = "all tensors";
  all.color = "#111827";
  all.width = 2.4;
  all.dash = "6 3";
  for (const StepRecord& r : run.records) {
    std::vector<std::uint64_t> under(lines.size(), 0), nonzero(lines.size(), 0);
    for (const nn::TensorGradStats& t : r.act_grad_tensors) {
      const std::string g = group_of(t.name);
      auto it = std::find(lines.begin(), lines.end(), g);
      const std::size_t k = it != lines.end() ? static_cast<std::size_t>(it - lines.begin()) : lines.size() - 1;
      under[k] += t.stats.underflow;
      nonzero[k] += t.stats.nonzero;
    }
    const double x = static_cast<double>(r.step);
    for (std::size_t g = 0; g < lines.size(); ++g) series[g].points.push_back({x, fraction(under[g], nonzero[g])});
    all.points.push_back({x, fraction(r.act_grads.underflow, r.act_grads.nonzero)});
  }
  series.push_back(std::move(all));
  c.series = std::move(series);
  note = by_role ? "one line per role, summed over layers (* = layer number)" : "one line per tensor";
  return svg::render(c);
}

// ---- fp8 (runs of the fp8 presets: the log's "fp8" arrays) ---------------------------------

bool has_fp8(const ReportRun& r) {
  return std::any_of(r.records.begin(), r.records.end(), [](const StepRecord& s) { return !s.fp8.empty(); });
}

// The fp8 tensors a per-tensor chart shows: all when few, else those of the first layer
// (its name prefix up to the first dot), in log order.
std::vector<std::string> fp8_chart_tensors(const ReportRun& run, bool& first_layer_only) {
  std::vector<std::string> names;
  for (const StepRecord& r : run.records)
    for (const nn::Fp8TensorStats& t : r.fp8)
      if (std::find(names.begin(), names.end(), t.name) == names.end()) names.push_back(t.name);
  first_layer_only = names.size() > kMaxChartLines;
  if (!first_layer_only) return names;
  const std::string prefix = names.front().substr(0, names.front().find('.') + 1);
  std::vector<std::string> kept;
  for (const std::string& n : names)
    if (n.starts_with(prefix) && kept.size() < kMaxChartLines) kept.push_back(n);
  return kept;
}

// One line per tensor of `value` (scale or amax) over the steps, log2 axis.
std::string fp8_tensor_chart(const ReportRun& run, std::size_t index, const std::vector<std::string>& names,
                             const char* what, const std::string& label) {
  svg::LineChart c;
  c.id = std::string("fp8-").append(what).append("-").append(std::to_string(index));
  c.width = 560;
  c.height = 340;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = label;
  c.y.log2 = true;
  for (std::size_t k = 0; k < names.size(); ++k) {
    svg::Series s;
    s.label = names[k];
    s.color = group_color(k);
    s.width = 1.6;
    s.steps = std::string_view(what) == "scale";
    if (names[k].ends_with(".grad_output")) s.dash = "5 3";
    for (const StepRecord& r : run.records)
      for (const nn::Fp8TensorStats& t : r.fp8)
        if (t.name == names[k]) {
          const double v = std::string_view(what) == "scale" ? static_cast<double>(t.scale)
                                                              : static_cast<double>(t.amax);
          s.points.push_back({static_cast<double>(r.step), v});
        }
    c.series.push_back(std::move(s));
  }
  return svg::render(c);
}

bool has_quantization_error(const ReportRun& r) {
  return std::any_of(r.records.begin(), r.records.end(), [](const StepRecord& s) {
    return std::any_of(s.fp8.begin(), s.fp8.end(), [](const nn::Fp8TensorStats& t) { return t.rel_rms_error.has_value(); });
  });
}

// One role's relative RMS quantization error per step, one line per tensor of that role
// (`suffix`: ".input", ".weight" or ".grad_output"; the first 12 in log order), log2 axis.
std::string fp8_error_chart(const ReportRun& run, std::size_t index, std::string_view suffix,
                            std::size_t& shown, std::size_t& total) {
  std::vector<std::string> names;
  for (const StepRecord& r : run.records)
    for (const nn::Fp8TensorStats& t : r.fp8)
      if (t.rel_rms_error && t.name.ends_with(suffix) && std::find(names.begin(), names.end(), t.name) == names.end())
        names.push_back(t.name);
  total = names.size();
  if (names.size() > kMaxChartLines) names.resize(kMaxChartLines);
  shown = names.size();
  svg::LineChart c;
  c.id = std::string("fp8-error").append(suffix).append("-").append(std::to_string(index));
  std::replace(c.id.begin(), c.id.end(), '.', '-');
  c.width = 560;
  c.height = 320;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "rel. RMS error";
  c.y.log2 = true;
  for (std::size_t k = 0; k < names.size(); ++k) {
    svg::Series s;
    s.label = names[k].substr(0, names[k].size() - suffix.size());
    s.color = group_color(k);
    s.width = 1.6;
    for (const StepRecord& r : run.records)
      for (const nn::Fp8TensorStats& t : r.fp8)
        if (t.name == names[k] && t.rel_rms_error && *t.rel_rms_error > 0)
          s.points.push_back({static_cast<double>(r.step), *t.rel_rms_error});
    c.series.push_back(std::move(s));
  }
  return svg::render(c);
}

// Per step, of the nonzero values quantized to fp8: saturated or flushed (`flushed`),
// forward tensors (solid) and backward tensors (dashed) of every fp8 run.
std::string fp8_fraction_chart(const std::vector<ReportRun>& runs, bool flushed) {
  svg::LineChart c;
  c.id = flushed ? "fp8-flushed" : "fp8-saturated";
  c.width = 560;
  c.height = 320;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = flushed ? "flushed / nonzero" : "saturated / nonzero";
  c.y.percent = true;
  c.y.min = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!has_fp8(runs[i])) continue;
    for (int role = 0; role < 2; ++role) {
      svg::Series s;
      s.label = runs[i].name + (role == 0 ? " forward" : " backward");
      s.color = run_color(i);
      if (role == 1) s.dash = "5 3";
      for (const StepRecord& r : runs[i].records) {
        if (r.fp8.empty()) continue;  // a step that recorded none (Telemetry's unsampled steps): no point
        std::uint64_t part = 0, nonzero = 0;
        for (const nn::Fp8TensorStats& t : r.fp8) {
          if ((t.role == lowp::Role::forward) != (role == 0)) continue;
          part += flushed ? t.flushed : t.saturated;
          nonzero += t.nonzero;
        }
        s.points.push_back({static_cast<double>(r.step), fraction(part, nonzero)});
      }
      c.series.push_back(std::move(s));
    }
  }
  return svg::render(c);
}

// Whole-log fractions of one run: {forward saturated, forward flushed, backward saturated, backward flushed}.
std::array<double, 4> fp8_fractions(const ReportRun& run) {
  std::uint64_t sat[2] = {0, 0}, fl[2] = {0, 0}, nz[2] = {0, 0};
  for (const StepRecord& r : run.records)
    for (const nn::Fp8TensorStats& t : r.fp8) {
      const int k = t.role == lowp::Role::forward ? 0 : 1;
      sat[k] += t.saturated;
      fl[k] += t.flushed;
      nz[k] += t.nonzero;
    }
  return {fraction(sat[0], nz[0]), fraction(fl[0], nz[0]), fraction(sat[1], nz[1]), fraction(fl[1], nz[1])};
}

std::string fp8_section(const std::vector<ReportRun>& runs) {
  if (std::none_of(runs.begin(), runs.end(), has_fp8)) return {};
  std::string out = "<section id=\"fp8\"><h2>fp8 scaling</h2>";
  std::string rows;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!has_fp8(runs[i])) continue;
    const std::array<double, 4> f = fp8_fractions(runs[i]);
    rows += "<tr><td>" + swatch(run_color(i)) + escape(runs[i].name) + "</td><td>" + percent(f[0]) + "</td><td>" +
            percent(f[1]) + "</td><td>" + percent(f[2]) + "</td><td>" + percent(f[3]) + "</td></tr>";
  }
  out += card("Saturated and flushed values",
              "<table><thead><tr><th>run</th><th>forward saturated</th><th>forward flushed</th>"
              "<th>backward saturated</th><th>backward flushed</th></tr></thead><tbody>" +
                  rows + "</tbody></table>",
              "of the nonzero values quantized over the whole log: forward = Linear inputs and weights "
              "(E4M3; E2M1 under nvfp4 and mxfp4), backward = output gradients (E5M2 with the HYBRID format); "
              "mixprec.torch.Telemetry records its low-precision modules at the sampled steps only");
  out += "<div class=\"grid2\">";
  out += card("Flushed to zero", fp8_fraction_chart(runs, true), "per step; solid: forward tensors, dashed: backward");
  out += card("Saturated", fp8_fraction_chart(runs, false), "per step; solid: forward tensors, dashed: backward");
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!has_fp8(runs[i])) continue;
    bool first_layer = false;
    const std::vector<std::string> names = fp8_chart_tensors(runs[i], first_layer);
    const std::string which = first_layer ? "the first layer's tensors" : "every fp8 tensor";
    out += card(swatch(run_color(i)) + escape(runs[i].name) + " <span class=\"muted\">per-tensor scales</span>",
                fp8_tensor_chart(runs[i], i, names, "scale", "scale"),
                "the scale each step quantized with (log\u2082 axis; mxfp8: the smallest block factor), " + which +
                    "; dashed: output gradients");
    out += card(swatch(run_color(i)) + escape(runs[i].name) + " <span class=\"muted\">amax per step</span>",
                fp8_tensor_chart(runs[i], i, names, "amax", "amax"),
                "max |x| of each tensor per step, the values the amax history holds (log\u2082 axis), " + which);
  }
  // Low-precision recipes measured by mixprec.torch.Telemetry: a chart per role.
  constexpr std::pair<const char*, const char*> kRoles[] = {
      {".input", "x (inputs)"}, {".weight", "w (weights)"}, {".grad_output", "dy (output gradients)"}};
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!has_quantization_error(runs[i])) continue;
    for (const auto& [suffix, role] : kRoles) {
      std::size_t shown = 0, total = 0;
      const std::string chart = fp8_error_chart(runs[i], i, suffix, shown, total);
      if (total == 0) continue;
      out += card(swatch(run_color(i)) + escape(runs[i].name) + " <span class=\"muted\">quantization error, " + role +
                      "</span>",
                  chart,
                  "||dequantize(quantize(t)) - t|| / ||t|| at the sampled steps, one line per module" +
                      (shown < total ? " (the first " + std::to_string(shown) + " of " + std::to_string(total) + ")"
                                     : std::string()) +
                      " (log\u2082 axis)");
    }
  }
  out += "</div></section>\n";
  return out;
}

// ---- per-block statistics (the fp8 entries' blocks, kurtosis and what_if at sampled steps) ----

bool has_blocks(const ReportRun& r) {
  return std::any_of(r.records.begin(), r.records.end(), [](const StepRecord& s) {
    return std::any_of(s.fp8.begin(), s.fp8.end(), [](const nn::Fp8TensorStats& t) { return t.blocks || t.kurtosis; });
  });
}

// The tensors with sampled statistics, in log order.
std::vector<std::string> block_tensors(const ReportRun& run) {
  std::vector<std::string> names;
  for (const StepRecord& r : run.records)
    for (const nn::Fp8TensorStats& t : r.fp8)
      if ((t.blocks || t.kurtosis) && std::find(names.begin(), names.end(), t.name) == names.end())
        names.push_back(t.name);
  return names;
}

// One line per layer: the kurtosis of its input (the activation) at the sampled steps (log2 axis).
std::string activation_kurtosis_chart(const ReportRun& run, std::size_t index, const std::vector<std::string>& inputs) {
  svg::LineChart c;
  c.id = "blocks-kurtosis-" + std::to_string(index);
  c.height = 320;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "kurtosis of x";
  c.y.log2 = true;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    svg::Series s;
    s.label = inputs[k].substr(0, inputs[k].size() - std::string_view(".input").size());
    s.color = group_color(k);
    s.width = 1.6;
    s.marker = svg::Marker::circle;
    s.marker_size = 2.2;
    for (const StepRecord& r : run.records)
      for (const nn::Fp8TensorStats& t : r.fp8)
        if (t.name == inputs[k] && t.kurtosis) s.points.push_back({static_cast<double>(r.step), *t.kurtosis});
    c.series.push_back(std::move(s));
  }
  return svg::render(c);
}

// One tensor's blocks over the sampled steps: the log2 multipliers' p01-p99 band and median.
std::string block_band_chart(const ReportRun& run, std::size_t index, std::size_t k, const std::string& name) {
  svg::LineChart c;
  c.id = "blocks-band-" + std::to_string(index) + "-" + std::to_string(k);
  c.width = 380;
  c.height = 190;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "log2 multiplier";
  svg::Band b;
  b.label = "p01\u2013p99";
  b.color = "#2563eb";
  svg::Series median;
  median.label = "median";
  median.color = "#1e3a8a";
  median.width = 1.6;
  median.marker = svg::Marker::circle;
  median.marker_size = 2;
  for (const StepRecord& r : run.records)
    for (const nn::Fp8TensorStats& t : r.fp8)
      if (t.name == name && t.blocks && t.blocks->multiplier_blocks > 0) {
        const double x = static_cast<double>(r.step);
        const lowp::BlockQuantiles& q = t.blocks->log2_multiplier_quantiles;
        b.low.push_back({x, q.p01});
        b.high.push_back({x, q.p99});
        median.points.push_back({x, q.p50});
      }
  c.bands.push_back(std::move(b));
  c.series.push_back(std::move(median));
  return svg::render(c);
}

// One tensor's kurtosis over the sampled steps (a linear axis from 0: a small chart has no
// room for a tick per binade).
std::string tensor_kurtosis_chart(const ReportRun& run, std::size_t index, std::size_t k, const std::string& name) {
  svg::LineChart c;
  c.id = "blocks-k-" + std::to_string(index) + "-" + std::to_string(k);
  c.width = 380;
  c.height = 150;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "kurtosis";
  c.y.min = 0;
  svg::Series s;
  s.label = "kurtosis";
  s.color = "#b45309";
  s.width = 1.6;
  s.marker = svg::Marker::circle;
  s.marker_size = 2;
  for (const StepRecord& r : run.records)
    for (const nn::Fp8TensorStats& t : r.fp8)
      if (t.name == name && t.kurtosis) s.points.push_back({static_cast<double>(r.step), *t.kurtosis});
  c.series.push_back(std::move(s));
  return svg::render(c);
}

// The latest sampled step of each tensor: its blocks, far blocks, dynamic ranges, kurtosis and
// what-ifs (a column per recipe the log names).
std::string block_table(const ReportRun& run, const std::vector<std::string>& names) {
  std::vector<std::pair<std::uint64_t, const nn::Fp8TensorStats*>> last(names.size(), {0, nullptr});
  std::vector<std::string> recipes;
  for (const StepRecord& r : run.records)
    for (const nn::Fp8TensorStats& t : r.fp8) {
      if (!t.blocks && !t.kurtosis) continue;
      const auto it = std::find(names.begin(), names.end(), t.name);
      last[static_cast<std::size_t>(it - names.begin())] = {r.step, &t};
      for (const nn::Fp8WhatIf& w : t.what_if)
        if (std::find(recipes.begin(), recipes.end(), w.recipe) == recipes.end()) recipes.push_back(w.recipe);
    }
  std::string head =
      "<tr><th>tensor</th><th>recipe</th><th class=\"num\">step</th><th class=\"num\">blocks</th>"
      "<th class=\"num\">far blocks</th><th class=\"num\">log\u2082 mult. p01 / p50 / p99</th>"
      "<th class=\"num\">std</th><th class=\"num\">max block range</th><th class=\"num\">kurtosis</th>"
      "<th class=\"num\">flushed</th>";
  for (const std::string& r : recipes) head += "<th class=\"num\">what-if " + escape(r) + " flushed</th>";
  head += "</tr>";
  std::string rows;
  for (std::size_t k = 0; k < names.size(); ++k) {
    const nn::Fp8TensorStats& t = *last[k].second;
    const std::string dash = "\u2013";
    rows += "<tr><td class=\"name\">" + escape(t.name) + "</td><td>" + escape(t.recipe.empty() ? "fp8" : t.recipe) +
            "</td><td class=\"num\">" + std::to_string(last[k].first) + "</td>";
    if (t.blocks) {
      const lowp::BlockStats& b = *t.blocks;
      const lowp::BlockQuantiles& q = b.log2_multiplier_quantiles;
      rows += "<td class=\"num\">" + std::to_string(b.blocks) + "</td><td class=\"num\">" +
              std::to_string(b.far_blocks) + " (" + percent(fraction(b.far_blocks, b.blocks)) +
              ")</td><td class=\"num\">" +
              number(q.p01, 3) + " / " + number(q.p50, 3) + " / " + number(q.p99, 3) + "</td><td class=\"num\">" +
              number(b.log2_multiplier_std, 3) + "</td><td class=\"num\">" + number(b.max_block_dynamic_range, 3) +
              " binades</td>";
    } else {
      rows += "<td class=\"num\">" + dash + "</td><td class=\"num\">" + dash + "</td><td class=\"num\">" + dash +
              "</td><td class=\"num\">" + dash + "</td><td class=\"num\">" + dash + "</td>";
    }
    rows += "<td class=\"num\">" + (t.kurtosis ? number(*t.kurtosis, 4) : dash) + "</td><td class=\"num\">" +
            percent(fraction(t.flushed, t.nonzero)) + "</td>";
    for (const std::string& r : recipes) {
      const auto w =
          std::find_if(t.what_if.begin(), t.what_if.end(), [&](const nn::Fp8WhatIf& x) { return x.recipe == r; });
      rows += "<td class=\"num\">" + (w == t.what_if.end() ? dash : percent(fraction(w->flushed, t.nonzero))) + "</td>";
    }
    rows += "</tr>";
  }
  return "<div class=\"scroll\"><table><thead>" + head + "</thead><tbody>" + rows + "</tbody></table></div>";
}

// The small multiples are drawn for at most this many tensors of a run (the table lists all).
constexpr std::size_t kMaxBlockTensors = 48;

std::string blocks_section(const std::vector<ReportRun>& runs) {
  if (std::none_of(runs.begin(), runs.end(), has_blocks)) return {};
  std::string out = "<section id=\"blocks\"><h2>Per-block statistics</h2>";
  out += "<p class=\"lead\">At the sampled steps, for each quantized tensor: how its scale blocks' multipliers "
         "spread (log\u2082; a block whose values are far smaller than the rest gets a larger multiplier), how "
         "many blocks sit far below the tensor's amax, and the kurtosis of its values (3 for a Gaussian; a few "
         "outlier values make it grow). A rising activation kurtosis and a widening band are the early signs of "
         "a recipe breaking (docs/low_precision.md, \"Per-block statistics\"; the alerts kurtosis-rise and "
         "block-spread-rise).</p>";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!has_blocks(runs[i])) continue;
    const std::vector<std::string> names = block_tensors(runs[i]);
    std::vector<std::string> inputs;
    for (const std::string& n : names)
      if (n.ends_with(".input")) inputs.push_back(n);
    const std::size_t all_inputs = inputs.size();
    if (inputs.size() > kMaxChartLines) inputs.resize(kMaxChartLines);
    const std::string who = swatch(run_color(i)) + escape(runs[i].name);
    if (!inputs.empty())
      out += card(who + " <span class=\"muted\">kurtosis of each layer's input (the activation)</span>",
                  activation_kurtosis_chart(runs[i], i, inputs),
                  "at the sampled steps, one line per Linear (log\u2082 axis)" +
                      (inputs.size() < all_inputs ? " (the first " + std::to_string(inputs.size()) + " of " +
                                                        std::to_string(all_inputs) + ")"
                                                  : std::string()));
    out += card(who + " <span class=\"muted\">the latest sampled step of each tensor</span>",
                block_table(runs[i], names),
                "far blocks: blocks whose amax is more than 2^far_log2 (2^8) below the tensor's; max block range: "
                "the largest log\u2082(max |x| / min |x|) of a block's nonzero values; flushed: of the tensor's "
                "nonzero values, under its recipe and, what-if, under each recipe Telemetry(what_if=...) named");
    out += "<div class=\"grid3\">";
    const std::size_t shown = std::min(names.size(), kMaxBlockTensors);
    for (std::size_t k = 0; k < shown; ++k)
      out += card(escape(names[k]),
                  block_band_chart(runs[i], i, k, names[k]) + tensor_kurtosis_chart(runs[i], i, k, names[k]), {},
                  "card small");
    out += "</div>";
    if (shown < names.size())
      out += card("", "<p class=\"muted\">Charts for the first " + std::to_string(shown) + " of " +
                          std::to_string(names.size()) + " tensors; the table lists every one.</p>");
  }
  return out + "</section>\n";
}

// ---- per-layer loss scaling (preset layerwise: the log's "layers" arrays) ------------------

bool has_layers(const ReportRun& r) {
  return std::any_of(r.records.begin(), r.records.end(), [](const StepRecord& s) { return !s.layers.empty(); });
}

// One line per scaled layer: the factor its weight gradient carried above the base scale (chain).
std::string layer_chain_chart(const ReportRun& run, std::size_t index, const std::vector<std::string>& names) {
  svg::LineChart c;
  c.id = std::string("layers-").append(std::to_string(index));
  c.width = 560;
  c.height = 340;
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y.label = "chain (factor above the base scale)";
  c.y.log2 = true;
  for (std::size_t k = 0; k < names.size(); ++k) {
    svg::Series s;
    s.label = names[k];
    s.color = group_color(k);
    s.width = 1.6;
    s.steps = true;
    for (const StepRecord& r : run.records)
      for (const StepRecord::LayerScale& l : r.layers)
        if (l.name == names[k]) s.points.push_back({static_cast<double>(r.step), l.chain});
    c.series.push_back(std::move(s));
  }
  return svg::render(c);
}

std::string layerwise_section(const std::vector<ReportRun>& runs) {
  if (std::none_of(runs.begin(), runs.end(), has_layers)) return {};
  std::string out = "<section id=\"layerwise\"><h2>Per-layer loss scaling</h2>";
  std::string rows;
  std::string charts;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!has_layers(runs[i])) continue;
    std::vector<std::string> names;
    for (const StepRecord& r : runs[i].records)
      for (const StepRecord::LayerScale& l : r.layers)
        if (std::find(names.begin(), names.end(), l.name) == names.end()) names.push_back(l.name);
    for (const std::string& n : names) {
      double log2_sum = 0, last_chain = 1;
      std::uint64_t steps = 0, origin = 0, skipped = 0;
      std::int64_t backoff = 0;
      for (const StepRecord& r : runs[i].records)
        for (const StepRecord::LayerScale& l : r.layers)
          if (l.name == n) {
            log2_sum += std::log2(l.chain);
            last_chain = l.chain;
            backoff = l.backoff;
            ++steps;
            origin += l.outcome == "origin";
            skipped += l.outcome != "applied";
          }
      rows += "<tr><td>" + swatch(run_color(i)) + escape(runs[i].name) + "</td><td>" + escape(n) + "</td><td>" +
              text::num(std::round(100 * log2_sum / static_cast<double>(std::max<std::uint64_t>(steps, 1))) / 100) +
              "</td><td>" + text::num(last_chain) + "</td><td>" + std::to_string(backoff) + "</td><td>" +
              std::to_string(origin) + "</td><td>" + std::to_string(skipped) + "</td></tr>";
    }
    charts += card(swatch(run_color(i)) + escape(runs[i].name) + " <span class=\"muted\">per-layer chains</span>",
                   layer_chain_chart(runs[i], i, names),
                   "per step, the factor each scaled layer's gradients carried above the base loss scale (log\u2082)");
  }
  out += card("Scaled layers",
              "<table><thead><tr><th>run</th><th>layer</th><th>mean log\u2082 chain</th><th>last chain</th>"
              "<th>backoff</th><th>overflows here</th><th>skipped</th></tr></thead><tbody>" +
                  rows + "</tbody></table>",
              "chain: the factor above the base scale the layer's gradients carried; backoff: its halvings after "
              "its own overflows (at the last step); skipped: steps its update was skipped while the rest stepped");
  out += "<div class=\"grid2\">" + charts + "</div></section>\n";
  return out;
}

const StepRecord* last_histogram_step(const ReportRun& r) {
  for (auto it = r.records.rbegin(); it != r.records.rend(); ++it)
    if (it->histograms) return &*it;
  return nullptr;
}

void populated_range(const nn::Log2Histogram& h, int& lo, int& hi) {
  for (std::size_t i = 0; i < h.counts.size(); ++i) {
    if (h.counts[i] == 0) continue;
    const int e = nn::Log2Histogram::kMinExp + static_cast<int>(i);
    lo = std::min(lo, e);
    hi = std::max(hi, e + 1);
  }
}

std::string histogram_chart(const nn::Log2Histogram& h, const std::string& id, const char* color, int shaded, int lo,
                            int hi) {
  svg::Histogram c;
  c.id = id;
  c.first_exp = nn::Log2Histogram::kMinExp;
  c.counts.reserve(h.counts.size());
  for (std::uint64_t v : h.counts) c.counts.push_back(static_cast<double>(v));
  c.zeros = static_cast<double>(h.zeros);
  c.nonfinite = static_cast<double>(h.nonfinite);
  c.lo_exp = lo;
  c.hi_exp = hi;
  c.color = color;
  c.ranges = svg::standard_ranges();
  c.shaded = shaded;
  return svg::render(c);
}

std::string pow2_label(double v) {
  if (!(v > 0) || !std::isfinite(v)) return number(v, 6);
  const double e = std::log2(v);
  if (e == std::floor(e)) return "2<sup>" + number(e, 6) + "</sup> = " + number(v, 8);
  return number(v, 6);
}

std::string histograms_section(const std::vector<ReportRun>& runs) {
  int lo = -26, hi = 17;  // fp16's subnormal and normal ranges at least
  bool any = false;
  for (const ReportRun& r : runs)
    if (const StepRecord* s = last_histogram_step(r)) {
      any = true;
      populated_range(s->histograms->activation_grads, lo, hi);
      populated_range(s->histograms->activations, lo, hi);
      populated_range(s->histograms->weight_grads, lo, hi);
      populated_range(s->histograms->weights, lo, hi);
    }
  lo = std::max(nn::Log2Histogram::kMinExp, lo - 1);
  hi = std::min(nn::Log2Histogram::kMaxExp + 1, hi + 1);
  std::string out = "<section id=\"histograms\"><h2>Magnitudes against the format ranges</h2>";
  std::vector<std::string> band_names;
  for (const svg::FormatRange& f : svg::standard_ranges()) band_names.push_back(f.name);
  out += "<p class=\"lead\">log<sub>2</sub>|x| of every value at the run's last histogram step. Rows under each chart: "
         "the normal (dark) and subnormal (light) ranges of " +
         keys::join(band_names, " and ") +
         "; the shaded band is the format these values are stored in. Bars left of a format's light band would "
         "become 0 in it; bars right of its dark band would overflow.</p>";
  if (!any) {
    out += card("", "<p class=\"muted\">No histograms in " +
                        std::string(runs.size() == 1 ? "this log" : "these logs") +
                        " (<code>mixprec train --histogram-every N</code> writes them; a libtorch run's "
                        "Telemetry does not).</p>");
    return out + "</section>";
  }
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ReportRun& r = runs[i];
    const StepRecord* s = last_histogram_step(r);
    out += "<h3 class=\"run-title\">" + swatch(run_color(i)) + escape(r.name);
    if (s) out += " <span class=\"muted\">step " + std::to_string(s->step) + "</span>";
    out += "</h3>";
    if (!s) {
      out += card("", "<p class=\"muted\">No histogram step in this run's log.</p>");
      continue;
    }
    const auto pol = policy(r);
    const int act = pol ? range_index(pol->activations) : -1;
    const int wgt = pol ? range_index(pol->weights) : -1;
    const int wgrad = pol ? range_index(pol->weight_grads) : -1;
    const std::string id = "hist-" + std::to_string(i) + "-";
    const StepRecord::Histograms& h = *s->histograms;
    out += "<div class=\"grid2\">";
    out += card("Activation gradients <span class=\"muted\">(scaled)</span>",
                histogram_chart(h.activation_grads, id + "act-grad", "#4f46e5", act, lo, hi),
                "before rounding, in the scaled domain: they carry the loss scale " +
                    pow2_label(static_cast<double>(s->scale)) + " of step " + std::to_string(s->step) +
                    " (true gradient = value / scale)");
    out += card("Weight gradients <span class=\"muted\">(unscaled)</span>",
                histogram_chart(h.weight_grads, id + "weight-grad", "#7c3aed", wgrad, lo, hi),
                "after unscaling, as the optimizer reads them");
    out += card("Weights", histogram_chart(h.weights, id + "weights", "#059669", wgt, lo, hi),
                "the weights of record after the step");
    out += card("Activations", histogram_chart(h.activations, id + "act", "#b45309", act, lo, hi),
                "stored activations, before rounding");
    out += "</div>";
  }
  return out + "</section>";
}

// ---- tables ---------------------------------------------------------------------------------

std::string alerts_count(const ReportRun& r) {
  if (!r.alerts) return "<span class=\"muted\">\u2013</span>";
  if (r.alerts->empty()) return "<span class=\"ok\">0</span>";
  return "<span class=\"bad\">" + std::to_string(r.alerts->size()) + "</span>";
}

std::optional<double> fp32_val(const std::vector<ReportRun>& runs, const std::vector<RunNumbers>& nums) {
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (config_value(runs[i], "precision") == "fp32" && nums[i].val_loss && std::isfinite(*nums[i].val_loss))
      return nums[i].val_loss;
  return std::nullopt;
}

std::string summary_table(const std::vector<ReportRun>& runs, const std::vector<RunNumbers>& nums) {
  const std::optional<double> base = fp32_val(runs, nums);
  std::string out =
      "<table class=\"summary\"><thead><tr><th>run</th><th>precision</th><th>loss scale</th>"
      "<th class=\"num\">steps</th>"
      "<th class=\"num\">val loss</th>";
  if (base) out += "<th class=\"num\">vs fp32</th>";
  out +=
      "<th class=\"num\">skipped</th><th class=\"num\">final scale</th><th class=\"num\">underflow</th>"
      "<th class=\"num\">subnormal</th><th class=\"num\">lost updates</th><th class=\"num\">step ms</th>"
      "<th class=\"num\">time</th><th class=\"num\">alerts</th></tr></thead><tbody>";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ReportRun& r = runs[i];
    const RunNumbers& n = nums[i];
    out += "<tr><td class=\"name\">" + swatch(run_color(i)) + escape(r.name) + "</td>";
    out += "<td>" + escape(config_value(r, "precision").value_or("\u2013")) + "</td>";
    out += "<td>" + escape(config_value(r, "loss-scale").value_or("\u2013")) + "</td>";
    out += "<td class=\"num\">" + std::to_string(n.steps) + "</td>";
    out += "<td class=\"num\">" + (n.val_loss ? loss_text(*n.val_loss) : std::string("\u2013")) + "</td>";
    if (base) {
      std::string gap = "\u2013";
      if (n.val_loss && std::isfinite(*n.val_loss)) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%+.2f%%", (*n.val_loss - *base) / *base * 100);
        gap = buf;
      }
      out += "<td class=\"num\">" + gap + "</td>";
    }
    out += std::string("<td class=\"num") + (n.skipped > 0 ? " warn" : "") + "\">" + std::to_string(n.skipped) +
           "</td>";
    out += "<td class=\"num\">" + number(static_cast<double>(n.final_scale), 7) + "</td>";
    out += "<td class=\"num\">" + percent(n.underflow_fraction) + "</td>";
    out += "<td class=\"num\">" + percent(n.subnormal_fraction) + "</td>";
    out += "<td class=\"num\">" + percent(n.lost_update_fraction) + "</td>";
    out += "<td class=\"num\">" + number(n.mean_step_ms, 3) + "</td>";
    out += "<td class=\"num\">" + duration(n.seconds) + "</td>";
    out += "<td class=\"num\">" + alerts_count(r) + "</td></tr>";
  }
  return out + "</tbody></table>";
}

std::string tiles(const ReportRun& r, const RunNumbers& n) {
  auto tile = [](const std::string& label, const std::string& value, const std::string& cls = {}) {
    return "<div class=\"tile" + cls + "\"><div class=\"label\">" + label + "</div><div class=\"value\">" + value +
           "</div></div>";
  };
  std::string out = "<div class=\"tiles\">";
  out += tile("validation loss", n.val_loss ? loss_text(*n.val_loss) : "\u2013");
  out += tile("final training loss", loss_text(n.final_loss));
  // The skips by reason (docs/spike_guards.md), when any step was skipped.
  std::string reasons;
  for (std::size_t i = 1; i < kSkipReasons; ++i) {
    if (n.skipped_by[i] == 0) continue;
    reasons += (reasons.empty() ? ": " : ", ") + std::to_string(n.skipped_by[i]) + " " +
               std::string(skip_reason_name(static_cast<SkipReason>(i)));
  }
  out += tile("steps", std::to_string(n.steps) + " <small" + (n.skipped > 0 ? " class=\"warn\"" : "") + ">" +
                           std::to_string(n.skipped) + " skipped" + reasons + "</small>");
  out += tile("final loss scale", number(static_cast<double>(n.final_scale), 7));
  out += tile("act-grad underflow", percent(n.underflow_fraction));
  out += tile("subnormal", percent(n.subnormal_fraction));
  out += tile("lost updates", percent(n.lost_update_fraction));
  out += tile("training time", duration(n.seconds));
  out += tile("mean step", number(n.mean_step_ms, 3) + " <small>ms</small>");
  out += tile("alerts", alerts_count(r));
  return out + "</div>";
}

std::string alerts_section(const std::vector<ReportRun>& runs) {
  std::string out = "<section id=\"alerts\"><h2>Alerts</h2>";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ReportRun& r = runs[i];
    std::string body;
    if (!r.alerts) {
      body = "<p class=\"muted\">Alerts were not evaluated for this run (its summary.json has no alerts).</p>";
    } else if (r.alerts->empty()) {
      body = "<p class=\"ok\">\u2713 No alerts.</p>";
    } else {
      body = "<ul class=\"alerts\">";
      for (const ReportAlert& a : *r.alerts) {
        body += "<li><div class=\"alert-head\"><code class=\"alert-id\">" + escape(a.id) + "</code>";
        if (!a.severity.empty()) body += " <span class=\"sev\">" + escape(a.severity) + "</span>";
        if (a.step) {
          body += " <span class=\"muted\">step " + std::to_string(*a.step);
          if (a.last_step && *a.last_step > *a.step) body += "\u2013" + std::to_string(*a.last_step);
          if (a.steps && *a.steps > 1) body += ", held on " + std::to_string(*a.steps) + " steps";
          body += "</span>";
        }
        body += "</div><div class=\"alert-msg\">" + escape(a.message) + "</div>";
        if (!a.advice.empty()) body += "<div class=\"advice\">\u2192 " + escape(a.advice) + "</div>";
        body += "</li>";
      }
      body += "</ul>";
    }
    out += card(swatch(run_color(i)) + escape(r.name), body);
  }
  return out + "</section>";
}

std::string config_value_html(const std::string& v) {
  return v.empty() ? std::string("<span class=\"muted\">(empty)</span>") : escape(v);
}

// Keys with one value in every run as a compact grid; keys whose values differ as a
// table with one column per run.
std::string config_section(const std::vector<ReportRun>& runs) {
  std::string out = "<section id=\"config\"><h2>Configuration</h2>";
  std::vector<std::string> keys;
  for (const ReportRun& r : runs)
    for (const auto& kv : r.config)
      if (std::find(keys.begin(), keys.end(), kv.first) == keys.end()) keys.push_back(kv.first);
  if (keys.empty()) {
    out += card("", "<p class=\"muted\">No config.json in " +
                        std::string(runs.size() == 1 ? "the run folder." : "the run folders.") + "</p>");
    return out + "</section>";
  }
  std::string shared, differs;
  for (const std::string& k : keys) {
    std::vector<std::string> values;
    for (const ReportRun& r : runs) values.push_back(config_value(r, k).value_or("\u2013"));
    const bool same = std::all_of(values.begin(), values.end(), [&](const std::string& v) { return v == values[0]; });
    if (same) {
      shared += "<div class=\"kv-item\"><span class=\"key\">" + escape(k) + "</span><span class=\"val\">" +
                config_value_html(values[0]) + "</span></div>";
    } else {
      differs += "<tr class=\"differs\"><td class=\"key\">" + escape(k) + "</td>";
      for (const std::string& v : values) differs += "<td>" + config_value_html(v) + "</td>";
      differs += "</tr>";
    }
  }
  if (!differs.empty()) {
    std::string t = "<table class=\"config\"><thead><tr><th>key</th>";
    for (std::size_t i = 0; i < runs.size(); ++i) t += "<th>" + swatch(run_color(i)) + escape(runs[i].name) + "</th>";
    t += "</tr></thead><tbody>" + differs + "</tbody></table>";
    out += card("Differs between the runs", t);
  }
  if (!shared.empty())
    out += card(runs.size() > 1 ? "Shared by all runs" : "", "<div class=\"kv\">" + shared + "</div>",
                runs.size() > 1 ? "" : "config.json of the run");
  std::string folders;
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (!runs[i].dir.empty())
      folders +=
          "<li>" + swatch(run_color(i)) + escape(runs[i].name) + ": <code>" + escape(runs[i].dir) + "</code></li>";
  if (!folders.empty()) out += card("Run folders", "<ul class=\"plain\">" + folders + "</ul>");
  return out + "</section>";
}

// The precision advisor (docs/advisor.md): per run with advice, the choice per layer with its
// reason and the cheaper candidates' rejections, and a layer x role heat map of the relative
// RMS error per candidate (green within the role's bound, red beyond it; a cell's title holds
// saturated, flushed and headroom). No choice is shown without the measurements behind it.
std::string advisor_section(const std::vector<ReportRun>& runs) {
  namespace adv = advisor;
  std::string out;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!runs[i].advice) continue;
    const adv::Advice& a = *runs[i].advice;
    const adv::Budget& b = a.config.budget;
    if (out.empty()) out = "<section id=\"advisor\"><h2>Precision advisor</h2>";
    std::string bound;
    for (std::size_t r = 0; r < adv::kRoles; ++r)
      if (b.roles[r])
        bound += std::string(bound.empty() ? "" : ", ") + std::string(adv::role_name(static_cast<adv::Role>(r))) +
                 " \u2264 " + number(b.max_rel_rms_error[r], 3);
    const std::string lead = "From " + std::to_string(a.steps) + " sampled step" + (a.steps == 1 ? "" : "s") + " (" +
                             std::to_string(a.first_step) + "\u2013" + std::to_string(a.last_step) +
                             "). Per layer the cheapest candidate whose relative RMS error stays within the bound (" +
                             bound + "), saturating at most " + percent(b.max_saturated) + " and flushing at most " +
                             percent(b.max_flushed) + " of the values. Modeled cost of the assignment: " +
                             number(a.cost_bf16 > 0 ? a.cost_chosen / a.cost_bf16 : 1.0, 3) + "\u00d7 all-bf16.";
    std::string t = "<table><thead><tr><th>layer</th><th class=\"num\">tokens \u00d7 in \u2192 out</th><th>choice</th>"
                    "<th class=\"num\">cost / bf16</th><th>why</th></tr></thead><tbody>";
    for (const adv::LayerAdvice& l : a.layers) {
      const double bf = l.cost[static_cast<std::size_t>(adv::Candidate::bf16)];
      t += "<tr><td class=\"name\"><code>" + escape(l.layer) + "</code></td><td class=\"num\">" +
           std::to_string(l.tokens) + " \u00d7 " + std::to_string(l.in) + " \u2192 " + std::to_string(l.out) +
           "</td><td>" + (l.chosen ? "<b>" + escape(std::string(adv::candidate_name(*l.chosen))) + "</b>"
                                   : std::string("<span class=\"bad\">none</span>")) +
           "</td><td class=\"num\">" +
           (l.chosen && bf > 0 ? number(l.cost[static_cast<std::size_t>(*l.chosen)] / bf, 3) : "\u2013") +
           "</td><td>" + escape(l.reason);
      if (!l.rejected.empty()) {
        t += "<div class=\"muted\">rejected: ";
        for (std::size_t k = 0; k < l.rejected.size(); ++k) t += (k ? "; " : "") + escape(l.rejected[k]);
        t += "</div>";
      }
      t += "</td></tr>";
    }
    t += "</tbody></table>";
    // The heat map: a row per layer, a column group per candidate, a column per sampled role.
    std::array<bool, adv::kRoles> any{};
    for (const adv::LayerAdvice& l : a.layers)
      for (std::size_t r = 0; r < adv::kRoles; ++r) any[r] = any[r] || l.sampled[r];
    std::string h = "<table class=\"heat\"><thead><tr><th rowspan=\"2\">layer</th>";
    std::size_t nroles = 0;
    for (bool x : any) nroles += x ? 1 : 0;
    for (adv::Candidate c : a.candidates)
      h += "<th class=\"grp\" colspan=\"" + std::to_string(nroles) + "\">" + escape(std::string(adv::candidate_name(c))) +
           "</th>";
    h += "</tr><tr>";
    for (std::size_t k = 0; k < a.candidates.size(); ++k)
      for (std::size_t r = 0; r < adv::kRoles; ++r)
        if (any[r]) h += "<th>" + std::string(adv::role_name(static_cast<adv::Role>(r))) + "</th>";
    h += "</tr></thead><tbody>";
    for (const adv::LayerAdvice& l : a.layers) {
      h += "<tr><td class=\"name\"><code>" + escape(l.layer) + "</code></td>";
      for (adv::Candidate c : a.candidates) {
        const bool chosen = l.chosen == c;
        for (std::size_t r = 0; r < adv::kRoles; ++r) {
          if (!any[r]) continue;
          if (!l.sampled[r]) {
            h += "<td class=\"cell\">\u2013</td>";
            continue;
          }
          const adv::Measurement& m = l.measurements[static_cast<std::size_t>(c)][r];
          const double ratio = m.rel_rms_error / b.max_rel_rms_error[r];
          // Within the bound: white to green as the error falls; beyond it: red.
          std::string bg;
          if (!(ratio <= 1.0)) {
            bg = "#fca5a5";
          } else {
            const double g = std::clamp(1.0 - ratio, 0.0, 1.0);
            char buf[32];
            std::snprintf(buf, sizeof buf, "rgb(%d,%d,%d)", static_cast<int>(236 - 70 * g), static_cast<int>(252 - 20 * g),
                          static_cast<int>(236 - 70 * g));
            bg = buf;
          }
          const std::string title = "saturated " + percent(m.saturated) + ", flushed " + percent(m.flushed) +
                                    ", headroom " + (std::isnan(m.headroom_log2) ? std::string("n/a") : number(m.headroom_log2, 3) + " binades") +
                                    ", worst step " + number(m.worst_rel_rms_error, 3);
          h += "<td class=\"cell" + std::string(chosen ? " chosen" : "") + (b.roles[r] ? "" : " free") +
               "\" style=\"background:" + bg + "\" title=\"" + escape(title) + "\">" + number(m.rel_rms_error, 2) + "</td>";
        }
      }
      h += "</tr>";
    }
    h += "</tbody></table>";
    out += "<h3 class=\"run-title\">" + swatch(run_color(i)) + escape(runs[i].name) + "</h3>";
    out += "<p class=\"lead\">" + escape(lead) + "</p>";
    out += card("The choice per layer", t);
    out += card("Relative RMS error per candidate (layer \u00d7 role)", "<div class=\"scroll\">" + h + "</div>",
                "green: within the role's bound (darker: further within), red: beyond it; bold: the chosen candidate; "
                "italic: a role the budget does not require; hover a cell for saturated, flushed, headroom and the "
                "worst sampled step");
  }
  return out.empty() ? out : out + "</section>\n";
}

// ---- the optimizer state (summary.json's "optimizer_state": mixprec.torch.Telemetry(optimizer=)) --

constexpr std::size_t kOptimizerRows = 6;  // tensors per table: the worst few

// summary.json's "optimizer_state", checked: a wrong type names its path and what was found.
ReportOptimizerState parse_optimizer_state(const ojson& o, const std::string& where) {
  auto bad = [&](const std::string& path, const char* expected, const ojson& v) {
    throw std::runtime_error(where + ": optimizer_state" + path + ": expected " + expected + ", found " +
                             v.dump(-1, ' ', false, ojson::error_handler_t::replace));
  };
  auto present = [](const ojson& obj, const char* key) -> const ojson* {
    const auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  };
  // Missing or null: NaN (not measured); a count: 0; a text: "".
  auto real = [&](const ojson& obj, const char* key, const std::string& path) {
    const ojson* v = present(obj, key);
    if (v == nullptr) return kNaN;
    if (!v->is_number()) bad(path + "." + key, "a number", *v);
    return v->get<double>();
  };
  auto count = [&](const ojson& obj, const char* key, const std::string& path) -> std::uint64_t {
    const ojson* v = present(obj, key);
    if (v == nullptr) return 0;
    if (!v->is_number_unsigned()) bad(path + "." + key, "an integer >= 0", *v);
    return v->get<std::uint64_t>();
  };
  auto text = [&](const ojson& obj, const char* key, const std::string& path) {
    const ojson* v = present(obj, key);
    if (v == nullptr) return std::string();
    if (!v->is_string()) bad(path + "." + key, "a string", *v);
    return v->get<std::string>();
  };
  if (!o.is_object()) bad("", "an object", o);
  ReportOptimizerState s;
  s.optimizer = text(o, "optimizer", "");
  if (const ojson* f = present(o, "formats")) {
    if (!f->is_array()) bad(".formats", "an array", *f);
    for (std::size_t i = 0; i < f->size(); ++i) {
      const ojson& g = (*f)[i];
      if (!g.is_object()) bad(".formats[" + std::to_string(i) + "]", "an object", g);
      std::vector<std::pair<std::string, std::string>> kv;
      for (const auto& [k, v] : g.items())
        kv.emplace_back(k, v.is_string() ? v.get<std::string>()
                                         : v.dump(-1, ' ', false, ojson::error_handler_t::replace));
      s.formats.push_back(std::move(kv));
    }
  }
  if (const ojson* b = present(o, "bytes_per_param")) {
    if (!b->is_object()) bad(".bytes_per_param", "an object", *b);
    s.params_bytes = real(*b, "params", ".bytes_per_param");
    s.master_bytes = real(*b, "master", ".bytes_per_param");
    s.m_bytes = real(*b, "m", ".bytes_per_param");
    s.v_bytes = real(*b, "v", ".bytes_per_param");
  }
  s.sampled_steps = count(o, "sampled_steps", "");
  if (const double f = real(o, "lost_update_fraction", ""); !std::isnan(f)) s.lost_update_fraction = f;
  if (const ojson* ps = present(o, "params")) {
    if (!ps->is_array()) bad(".params", "an array", *ps);
    for (std::size_t i = 0; i < ps->size(); ++i) {
      const ojson& p = (*ps)[i];
      const std::string path = ".params[" + std::to_string(i) + "]";
      if (!p.is_object()) bad(path, "an object", p);
      ReportOptimizerTensor t;
      t.name = text(p, "name", path);
      t.elements = count(p, "elements", path);
      t.master = text(p, "master", path);
      t.m = text(p, "m", path);
      t.v = text(p, "v", path);
      t.steps = count(p, "steps", path);
      t.m_error = real(p, "m_error", path);
      t.m_error_max = real(p, "m_error_max", path);
      t.v_error = real(p, "v_error", path);
      t.v_error_max = real(p, "v_error_max", path);
      t.lost_fraction = real(p, "lost_fraction", path);
      t.meant = count(p, "meant", path);
      s.tensors.push_back(std::move(t));
    }
  }
  return s;
}

// "remainder · fp8 / fp8": the master and the moments as stored.
std::string tensor_formats(const ReportOptimizerTensor& t) {
  return escape(t.master) + " \u00b7 " + escape(t.m) + " / " + escape(t.v);
}

// The larger of a tensor's two moment errors (NaN, sorted last, when it was not measured).
double worst_error(const ReportOptimizerTensor& t) {
  if (std::isnan(t.m_error)) return t.v_error;
  if (std::isnan(t.v_error)) return t.m_error;
  return std::max(t.m_error, t.v_error);
}

// The measured tensors whose `key` is above 0, worst first, at most kOptimizerRows of them, as
// a table; `shown` says how many of how many.
template <typename Key>
std::string optimizer_table(const std::vector<ReportOptimizerTensor>& tensors, Key key, std::string& shown) {
  std::vector<const ReportOptimizerTensor*> rows;
  std::size_t measured = 0;
  for (const ReportOptimizerTensor& t : tensors) {
    measured += t.steps > 0 ? 1 : 0;
    if (t.steps > 0 && key(t) > 0) rows.push_back(&t);
  }
  if (rows.empty()) return {};
  shown = (rows.size() > kOptimizerRows ? "the " + std::to_string(kOptimizerRows) + " largest of " : std::string()) +
          std::to_string(rows.size()) + (rows.size() == 1 ? " tensor" : " tensors");
  if (rows.size() < measured) shown += " above 0 (of " + std::to_string(measured) + " measured)";
  std::stable_sort(rows.begin(), rows.end(), [&](const ReportOptimizerTensor* a, const ReportOptimizerTensor* b) {
    const double x = key(*a), y = key(*b);
    return std::isnan(y) ? !std::isnan(x) : x > y;
  });
  if (rows.size() > kOptimizerRows) rows.resize(kOptimizerRows);
  std::string out =
      "<table><thead><tr><th>tensor</th><th>master \u00b7 m / v</th><th class=\"num\">elements</th>"
      "<th class=\"num\">m error</th><th class=\"num\">v error</th><th class=\"num\">lost updates</th></tr></thead>"
      "<tbody>";
  for (const ReportOptimizerTensor* t : rows) {
    const char* lost = !(t->lost_fraction > 0.01) ? "" : t->lost_fraction > 0.1 ? " bad" : " warn";
    out += "<tr><td class=\"name\"><code>" + escape(t->name) + "</code></td><td class=\"fmt\">" + tensor_formats(*t) +
           "</td><td class=\"num\">" + text::grouped(t->elements) + "</td><td class=\"num\" title=\"largest: " +
           percent(t->m_error_max) + "\">" + percent(t->m_error) + "</td><td class=\"num\" title=\"largest: " +
           percent(t->v_error_max) + "\">" + percent(t->v_error) + "</td><td class=\"num" + lost +
           "\" title=\"" + text::grouped(t->meant) + " meant to move\">" + percent(t->lost_fraction) + "</td></tr>";
  }
  return out + "</tbody></table>";
}

// Per run with an optimizer state: its formats, its bytes per parameter, the mean lost-update
// fraction, and the tensors with the largest moment error and the most lost updates.
std::string optimizer_section(const std::vector<ReportRun>& runs) {
  if (std::none_of(runs.begin(), runs.end(), [](const ReportRun& r) { return r.optimizer.has_value(); })) return {};
  std::string out = "<section id=\"optimizer\"><h2>Optimizer state</h2>";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!runs[i].optimizer) continue;
    const ReportOptimizerState& s = *runs[i].optimizer;
    if (runs.size() > 1) out += "<h3 class=\"run-title\">" + swatch(run_color(i)) + escape(runs[i].name) + "</h3>";
    std::string formats;
    for (std::size_t g = 0; g < s.formats.size(); ++g) {
      std::string main, rest;
      for (const auto& [k, v] : s.formats[g]) {
        if (k == "master" || k == "m" || k == "v")
          main += (main.empty() ? "" : ", ") + escape(k) + " <b>" + escape(v) + "</b>";
        else
          rest += (rest.empty() ? "" : ", ") + escape(k) + " " + escape(v);
      }
      formats += (formats.empty() ? "" : "; ") + (s.formats.size() > 1 ? "group " + std::to_string(g) + ": " : "") +
                 main + (rest.empty() ? "" : " <span class=\"muted\">(" + rest + ")</span>");
    }
    out += "<p class=\"lead\">" + escape(s.optimizer.empty() ? std::string("The optimizer") : s.optimizer) +
           (formats.empty() ? std::string() : ": " + formats) + ". Bytes per parameter measured from the state's " +
           "tensors (the weights themselves: " + number(s.params_bytes, 3) + "); errors and lost updates measured at " +
           std::to_string(s.sampled_steps) + " sampled step" + (s.sampled_steps == 1 ? "" : "s") + ".</p>";
    auto tile = [](const std::string& label, const std::string& value) {
      return "<div class=\"tile\"><div class=\"label\">" + label + "</div><div class=\"value\">" + value +
             "</div></div>";
    };
    auto bytes = [](double b) { return number(b, 3) + " <small>B/param</small>"; };
    out += "<div class=\"tiles\">";
    out += tile("state: master + m + v", bytes(s.master_bytes + s.m_bytes + s.v_bytes));
    out += tile("master", bytes(s.master_bytes));
    out += tile("m (first moment)", bytes(s.m_bytes));
    out += tile("v (second moment)", bytes(s.v_bytes));
    out += tile("lost updates", s.lost_update_fraction ? percent(*s.lost_update_fraction) : "\u2013");
    out += "</div>";
    if (std::none_of(s.tensors.begin(), s.tensors.end(), [](const ReportOptimizerTensor& t) { return t.steps > 0; })) {
      out += card("", "<p class=\"muted\">No sampled step measured the state (no applied optimizer step at a "
                      "sampled step).</p>");
      continue;
    }
    std::string err_shown, lost_shown;
    std::string err = optimizer_table(s.tensors, worst_error, err_shown);
    std::string lost = optimizer_table(
        s.tensors, [](const ReportOptimizerTensor& t) { return t.lost_fraction; }, lost_shown);
    if (err.empty()) err = "<p class=\"ok\">\u2713 Every moment is stored exactly (fp32 moments).</p>";
    if (lost.empty()) lost = "<p class=\"ok\">\u2713 No update was lost at the sampled steps.</p>";
    out += "<div class=\"grid2\">";
    out += card("Largest moment quantization error", err,
                err_shown.empty() ? std::string()
                                  : escape(err_shown) + ", by the larger relative error \u2016stored \u2212 "
                                                        "exact\u2016 / \u2016exact\u2016 of m or v after the step, "
                                                        "mean over the sampled steps (hover: the largest)");
    out += card("Most lost updates", lost,
                lost_shown.empty() ? std::string()
                                   : escape(lost_shown) + ": of the elements a step meant to move, those whose "
                                                          "weights of record did not change, over the sampled steps");
    out += "</div>";
  }
  return out + "</section>\n";
}

constexpr const char* kStyle = R"CSS(
:root{--fg:#1f2937;--muted:#6b7280;--line:#e5e7eb;--bg:#f5f6f8;--accent:#2563eb}
*{box-sizing:border-box}
html{background:var(--bg)}
body{margin:0;color:var(--fg);font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue","Noto Sans","Liberation Sans",Arial,sans-serif;-webkit-font-smoothing:antialiased}
header{background:#fff;border-bottom:1px solid var(--line)}
header .wrap{max-width:1240px;margin:0 auto;padding:22px 20px 18px}
h1{margin:0 0 4px;font-size:24px;font-weight:650;letter-spacing:-.01em}
h2{margin:30px 0 12px;font-size:18px;font-weight:650}
h3{margin:0 0 6px;font-size:14.5px;font-weight:600}
h3.run-title{margin:18px 0 10px;font-size:15px}
main{max-width:1240px;margin:0 auto;padding:4px 20px 40px}
.sub{margin:0;color:var(--muted)}
.sub .run{margin-right:14px;white-space:nowrap}
.lead{color:var(--muted);margin:-4px 0 14px;max-width:980px}
.card{background:#fff;border:1px solid var(--line);border-radius:10px;padding:16px 18px;margin-bottom:16px;box-shadow:0 1px 2px rgba(16,24,40,.04)}
.card .note{color:var(--muted);font-size:12.5px;margin:-2px 0 8px}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:16px}
.grid2>.card{margin-bottom:0}
.grid3{display:grid;grid-template-columns:repeat(3,1fr);gap:12px}
.grid3>.card{margin-bottom:0;padding:10px 12px}
.grid3>.card h3{font-size:12.5px;word-break:break-all}
.grid3+.card{margin-top:16px}
.grid2+.grid2,.grid2+.card,.tiles+.grid2,.tiles+.card{margin-top:16px}
.card.notes{padding:12px 18px}
svg.chart{display:block;width:100%;height:auto;font-family:inherit}
.swatch{display:inline-block;width:10px;height:10px;border-radius:50%;margin-right:7px;vertical-align:0}
.muted{color:var(--muted);font-weight:400}
.ok{color:#047857}
.bad{color:#b91c1c;font-weight:600}
.warn{color:#b45309;font-weight:600}
code{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;background:#f3f4f6;border-radius:4px;padding:1px 5px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:7px 10px;border-bottom:1px solid var(--line);vertical-align:top}
th{font-size:12px;font-weight:600;color:var(--muted);text-transform:uppercase;letter-spacing:.03em;background:#fafafa}
td.num,th.num{text-align:right}
td.num,td.fmt{white-space:nowrap}
td.name{font-weight:600;white-space:nowrap}
table.config td{font-size:13px;word-break:break-word}
table.config td.key{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;color:#374151;white-space:nowrap;width:1%}
table.config tr.differs td{background:#fffbeb}
.kv{display:grid;grid-template-columns:repeat(3,1fr);column-gap:28px}
.kv-item{display:flex;gap:12px;padding:5px 2px;border-bottom:1px solid #f0f1f3;font-size:13px;min-width:0}
.kv-item .key{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;color:#4b5563;flex:0 0 auto}
.kv-item .val{margin-left:auto;text-align:right;word-break:break-all;font-variant-numeric:tabular-nums}
tbody tr:last-child td{border-bottom:none}
.tiles{display:grid;grid-template-columns:repeat(5,1fr);gap:12px}
.tile{background:#fff;border:1px solid var(--line);border-radius:10px;padding:12px 14px}
.tile .label{font-size:12px;color:var(--muted);text-transform:uppercase;letter-spacing:.03em}
.tile .value{font-size:21px;font-weight:650;margin-top:2px;font-variant-numeric:tabular-nums}
.tile .value small{font-size:13px;font-weight:500;color:var(--muted)}
.tile .value small.warn{color:#b45309}
ul.alerts{list-style:none;margin:0;padding:0}
ul.alerts li{border-left:3px solid #f59e0b;background:#fffbeb;border-radius:6px;padding:9px 12px;margin:8px 0}
.alert-id{background:#fef3c7;color:#92400e;font-weight:600}
.sev{font-size:11.5px;text-transform:uppercase;letter-spacing:.04em;color:#92400e}
.alert-msg{margin-top:3px}
.advice{color:#374151;margin-top:3px;font-size:13px}
ul.plain{margin:0;padding-left:0;list-style:none}
ul.plain li{margin:3px 0}
footer{max-width:1240px;margin:0 auto;padding:0 20px 30px;color:var(--muted);font-size:12px}
.scroll{overflow-x:auto}
table.heat th,table.heat td{padding:3px 5px;font-size:11.5px;text-align:center}
table.heat th.grp{border-left:2px solid var(--line)}
table.heat td.name{text-align:left}
table.heat td.chosen{font-weight:700;outline:1.5px solid #047857}
table.heat td.free{font-style:italic;opacity:.75}
)CSS";

}  // namespace

RunNumbers run_numbers(const std::vector<StepRecord>& records) {
  train::RunTotals totals;
  for (const StepRecord& r : records) totals.add(r);
  RunNumbers n = totals.summary();
  n.final_loss = totals.shown_final_loss();
  return n;
}

std::string render_report(const std::vector<ReportRun>& runs, const ReportOptions& options) {
  std::vector<RunNumbers> nums;
  for (const ReportRun& r : runs) {
    nums.push_back(run_numbers(r.records));
    // A Telemetry's log says 0 at every step: its optimizer state's measurement, the mean over
    // the sampled steps, is the run's.
    if (r.optimizer && r.optimizer->lost_update_fraction)
      nums.back().lost_update_fraction = *r.optimizer->lost_update_fraction;
  }
  const int window = std::max(1, options.skip_window);

  std::string title = options.title;
  if (runs.size() == 1) title += ": " + runs[0].name;

  std::string out;
  out.reserve(1 << 18);
  out += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
         "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
         "<meta name=\"generator\" content=\"mixprec " +
         std::string(kVersionString) + "\"><title>" + escape(title) + "</title><style>" + kStyle +
         "</style></head><body>\n";
  out += "<header><div class=\"wrap\"><h1>" + escape(title) + "</h1><p class=\"sub\">";
  if (runs.empty()) {
    out += "no runs";
  } else {
    for (std::size_t i = 0; i < runs.size(); ++i) {
      out += "<span class=\"run\">" + swatch(run_color(i)) + "<b>" + escape(runs[i].name) + "</b>";
      const std::string setup = run_setup(runs[i]);
      if (!setup.empty()) out += " <span class=\"muted\">" + escape(setup) + "</span>";
      out += "</span> ";
    }
  }
  out += "</p></div></header>\n<main>\n";

  if (runs.empty()) {
    out += card("", "<p class=\"muted\">No runs to report.</p>");
    out += "</main></body></html>\n";
    return out;
  }

  // Summary.
  out += "<section id=\"summary\"><h2>Summary</h2>";
  if (runs.size() == 1)
    out += tiles(runs[0], nums[0]);
  else
    out += card("", summary_table(runs, nums),
                "Numbers over the whole log: underflow and subnormal are fractions of the nonzero activation-gradient "
                "values; lost updates are averaged over applied steps (with a Telemetry's optimizer state, over "
                "its sampled steps).");
  out += "</section>\n";

  // Training curves.
  out += "<section id=\"training\"><h2>Training</h2>";
  const bool switches = std::any_of(runs.begin(), runs.end(), [](const ReportRun& r) {
    return std::any_of(r.records.begin(), r.records.end(), [](const StepRecord& s) { return !s.recipe_phase.empty(); });
  });
  out += card("Training loss", loss_chart(runs),
              std::string("mean loss of each step's tokens") +
                  (runs.size() > 1 ? "; one line per run" : "") + "; dots: validation loss" +
                  (switches ? "; dashed lines: recipe-file phases beginning (their labels)" : ""));
  out += "<div class=\"grid2\">";
  out += card("Loss scale", scale_chart(runs), "the scale each step's gradients carried (log\u2082 axis); "
                                                "\u2715 = skipped step (inf/NaN in the gradients)");
  out += card("Skip rate", skip_chart(runs, window),
              "share of skipped steps among the last " + std::to_string(window) + " steps");
  out += "</div></section>\n";

  // Underflow.
  out += "<section id=\"underflow\"><h2>Activation-gradient underflow</h2>";
  out += card("All activation gradients", underflow_chart(runs),
              "nonzero activation-gradient values that became 0 when stored in the activation format, per step");
  std::string cells, notes;
  std::size_t charts = 0;
  bool missing = false;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    std::string note;
    const std::string chart = tensor_chart(runs[i], i, note);
    if (!chart.empty()) {
      cells += card(swatch(run_color(i)) + escape(runs[i].name) + " <span class=\"muted\">per tensor</span>", chart,
                    escape(note));
      ++charts;
    } else if (!note.empty()) {
      notes += "<li>" + swatch(run_color(i)) + "<b>" + escape(runs[i].name) + "</b>: <span class=\"ok\">\u2713 " +
               escape(note) + "</span></li>";
    } else {
      missing = true;
    }
  }
  if (charts > 0) out += "<div class=\"grid2\">" + cells + "</div>";
  if (!notes.empty()) out += card("", "<ul class=\"plain\">" + notes + "</ul>", {}, "card notes");
  if (missing)
    out += card("", std::string("<p class=\"muted\">") +
                        (charts > 0 || !notes.empty() ? "Some logs have" : "The log has") +
                        " no per-tensor activation-gradient statistics.</p>");
  out += "</section>\n";

  out += fp8_section(runs);
  out += blocks_section(runs);
  out += advisor_section(runs);
  out += layerwise_section(runs);
  out += optimizer_section(runs);
  out += histograms_section(runs) + "\n";
  out += alerts_section(runs) + "\n";
  out += config_section(runs) + "\n";
  out += "</main><footer>Generated by mixprec " + std::string(kVersionString) +
         ". Self-contained: inline SVG and CSS, no scripts, no network.</footer></body></html>\n";
  return out;
}

ReportRun load_run(const std::string& dir, const std::string& name) {
  std::error_code ec;
  const fs::path p(dir);
  train::check_run_folder(p);

  ReportRun run;
  run.dir = dir;
  run.name = name;
  if (run.name.empty()) {
    fs::path n = p.lexically_normal();
    if (!n.has_filename()) n = n.parent_path();
    std::string base = n.filename().string();
    if (base.empty() || base == "." || base == "..") base = fs::absolute(p, ec).lexically_normal().filename().string();
    if (base.empty() || base == "." || base == "..") {
      const auto abs = fs::absolute(p, ec).lexically_normal();
      base = abs.has_filename() ? abs.filename().string() : abs.parent_path().filename().string();
    }
    run.name = base.empty() ? dir : base;
  }
  run.records = train::read_run_log((p / train::run_files::log).string());

  auto read_json = [&](std::string_view file) -> std::optional<ojson> {
    const std::optional<std::string> text = train::read_run_file(p, file);
    if (!text) return std::nullopt;
    const std::string where = squote((p / file).string());
    try {
      return io::parse_ordered_json(*text, where);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(e.what());
    }
  };
  auto text_of = [](const ojson& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object()) {  // loss-scale-config: the scaler's whole config, "key=value, ..."
      std::string s;
      for (const auto& [k, e] : v.items())
        s += (s.empty() ? "" : ", ") + k + "=" +
             (e.is_string() ? e.get<std::string>() : e.dump(-1, ' ', false, ojson::error_handler_t::replace));
      return s;
    }
    if (v.is_array()) {
      std::string s;
      for (const ojson& e : v) s += (s.empty() ? "" : ",") + (e.is_string() ? e.get<std::string>() : e.dump());
      return s;
    }
    return v.dump(-1, ' ', false, ojson::error_handler_t::replace);
  };

  if (const auto cfg = read_json(train::run_files::config)) {
    if (!cfg->is_object()) throw std::runtime_error(squote((p / "config.json").string()) + ": expected a JSON object");
    for (const auto& [k, v] : cfg->items()) run.config.emplace_back(k, text_of(v));
  }
  if (const auto sum = read_json(train::run_files::summary)) {
    const std::string where = squote((p / "summary.json").string());
    if (!sum->is_object()) throw std::runtime_error(where + ": expected a JSON object");
    if (run.config.empty() && sum->contains("config") && (*sum)["config"].is_object())
      for (const auto& [k, v] : (*sum)["config"].items()) run.config.emplace_back(k, text_of(v));
    if (sum->contains("alerts")) {
      const ojson& a = (*sum)["alerts"];
      if (!a.is_array()) throw std::runtime_error(where + ": alerts: expected an array");
      std::vector<ReportAlert> alerts;
      for (std::size_t i = 0; i < a.size(); ++i) {
        const ojson& e = a[i];
        if (!e.is_object())
          throw std::runtime_error(where + ": alerts[" + std::to_string(i) + "]: expected an object");
        ReportAlert al;
        auto str = [&](const char* key) {
          const auto it = e.find(key);
          return it == e.end() || it->is_null() ? std::string() : text_of(*it);
        };
        al.id = str("id");
        al.message = str("message");
        al.advice = str("advice");
        al.severity = str("severity");
        if (al.severity.empty()) al.severity = str("level");
        auto count = [&](const char* key) -> std::optional<std::uint64_t> {
          const auto it = e.find(key);
          if (it == e.end() || it->is_null()) return std::nullopt;
          if (!it->is_number_unsigned())
            throw std::runtime_error(where + ": alerts[" + std::to_string(i) + "]." + key +
                                     ": expected an integer >= 0, found " +
                                     it->dump(-1, ' ', false, ojson::error_handler_t::replace));
          return it->get<std::uint64_t>();
        };
        al.step = count("step");
        al.last_step = count("last_step");
        al.steps = count("steps");
        alerts.push_back(std::move(al));
      }
      run.alerts = std::move(alerts);
    }
    if (const auto it = sum->find("optimizer_state"); it != sum->end() && !it->is_null())
      run.optimizer = parse_optimizer_state(*it, where);
  }
  // The precision advisor's evidence (`mixprec advise RUN_DIR` writes it).
  if (const auto adv = train::read_run_file(p, "advice/advice.json")) {
    try {
      run.advice = advisor::parse_advice_json(*adv, (p / "advice" / "advice.json").string());
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(e.what());
    }
  }
  return run;
}

void make_names_unique(std::vector<ReportRun>& runs) {
  auto count = [&](const std::string& n) {
    return std::count_if(runs.begin(), runs.end(), [&](const ReportRun& r) { return r.name == n; });
  };
  std::vector<bool> dup(runs.size());
  for (std::size_t i = 0; i < runs.size(); ++i) dup[i] = count(runs[i].name) > 1;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!dup[i]) continue;
    const std::string setup = run_setup(runs[i]);
    if (!setup.empty()) runs[i].name += " (" + setup + ")";
  }
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (count(runs[i].name) > 1 && !runs[i].dir.empty()) runs[i].name = runs[i].dir;
  std::vector<std::string> names;
  for (const ReportRun& r : runs) names.push_back(r.name);
  std::map<std::string, int> seen;
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (std::count(names.begin(), names.end(), names[i]) > 1)
      runs[i].name = names[i] + " #" + std::to_string(++seen[names[i]]);
}

std::string report_output(const std::vector<std::string>& dirs, const std::string& out_, std::string_view key_) {
  const std::string key(key_);
  std::string out = out_;
  if (out.empty()) out = dirs.size() == 1 ? (fs::path(dirs[0]) / "report.html").string() : "report.html";
  std::error_code ec;
  const fs::path parent = fs::path(out).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec))
    throw std::invalid_argument(key + ": folder " + squote(parent.string()) + " does not exist");
  if (const std::string problem = io::output_file_problem(out); !problem.empty())
    throw std::invalid_argument(key + ": " + problem);
  std::vector<fs::path> run_dirs(dirs.begin(), dirs.end());
  train::check_output_not_input(out, key, run_dirs);
  return out;
}

void write_report(const std::string& path, const std::vector<ReportRun>& runs, const ReportOptions& options) {
  const std::string html = render_report(runs, options);
  io::write_file_atomic(path, html);
}

}  // namespace mixprec::monitor
