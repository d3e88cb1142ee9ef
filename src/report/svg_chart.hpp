// A small SVG chart helper for the HTML report (report.cpp): line charts (axes,
// ticks, grid, legend, linear or log2 y axis, markers, step lines, broken lines at
// non-finite values) and log2-magnitude histograms with the ranges of number formats.
// Output is plain SVG markup with no script; every text is escaped. Series groups
// carry data-* attributes (label, points) so tests can check what was drawn.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::monitor::svg {

// Text for HTML/SVG content and attribute values: & < > " ' escaped.
std::string escape(std::string_view text);
// A number in at most `digits` significant digits, no exponent for ordinary magnitudes
// ("0.001", "1.5e-07", "65504").
std::string number(double v, int digits = 4);

struct Point {
  double x = 0, y = 0;
};

enum class Marker { none, circle, cross };

struct Series {
  std::string label;           // in the legend; empty: left out of it
  std::string color = "#2563eb";
  std::vector<Point> points;   // a non-finite y (or y <= 0 on a log2 axis) breaks the line
  bool line = true;
  bool steps = false;          // a step line: each value holds until the next point's x
  double width = 2;
  std::string dash;            // stroke-dasharray, e.g. "5 3"
  Marker marker = Marker::none;
  double marker_size = 3.5;
};

struct Axis {
  std::string label;
  bool log2 = false;               // ticks at powers of two, labelled 2^k
  std::optional<double> min, max;  // fixed bounds (data otherwise)
  bool percent = false;            // tick labels as percentages of 1
  bool integer = false;            // integer ticks only (steps)
};

// A vertical line across the plot at x, labelled at its top (an event: a recipe switch).
struct VLine {
  double x = 0;
  std::string label;
  std::string color = "#6b7280";
};

// A filled area between two lines (a quantile band): low[i] and high[i] at the same x. A
// pair with a non-finite value (or <= 0 on a log2 axis) breaks the area.
struct Band {
  std::string label;           // in the legend (a filled square); empty: left out of it
  std::string color = "#2563eb";
  std::vector<Point> low, high;
  double opacity = 0.22;
};

struct LineChart {
  std::string id;                  // unique in the document (clip path id, data-chart)
  int width = 1160, height = 360;
  Axis x, y;
  std::vector<Series> series;
  std::vector<VLine> vlines;       // drawn under the series; those outside the x range are left out
  std::vector<Band> bands;         // drawn under the series, in the axes' domain with them
  std::string empty_text = "no data";
};

std::string render(const LineChart& chart);

// A format's representable magnitudes in log2 units: normal [normal_lo, normal_hi),
// subnormal [subnormal_lo, normal_lo).
struct FormatRange {
  std::string name;
  double subnormal_lo = 0, normal_lo = 0, normal_hi = 0;
  std::string color;
  std::string range_text;          // e.g. "2^-14 .. 65504 (subnormal to 2^-24)"
};

struct Histogram {
  std::string id;
  int width = 560, height = 330;
  int first_exp = -64;              // bin i holds floor(log2|x|) == first_exp + i
  std::vector<double> counts;       // per bin
  double zeros = 0, nonfinite = 0;  // counted apart
  int lo_exp = -40, hi_exp = 20;    // shown: [lo_exp, hi_exp)
  std::string color = "#2563eb";
  std::vector<FormatRange> ranges;  // drawn as rows under the plot, aligned with its x axis
  int shaded = -1;                  // index into ranges shaded inside the plot (-1: none)
  std::string x_label = "log2 |x|";
};

std::string render(const Histogram& h);

// The formats of the report's histograms (those with conversion kernels: fp16, bf16, E4M3,
// E5M2), each from its row of the format table.
const std::vector<FormatRange>& standard_ranges();

}  // namespace mixprec::monitor::svg
