// SVG line charts and log2 histograms for the report (see svg_chart.hpp).
#include "report/svg_chart.hpp"

#include "mixprec/formats/format_table.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::monitor::svg {
namespace {

constexpr const char* kAxisColor = "#9ca3af";
constexpr const char* kGridColor = "#eceef1";
constexpr const char* kTextColor = "#4b5563";

// Coordinates: one decimal is plenty at these sizes and keeps files small.
std::string coord(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  std::string s(buf);
  if (s.size() > 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  if (s == "-0") s = "0";
  return s;
}

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", std::max(0, decimals), v);
  std::string s(buf);
  if (s.find('.') != std::string::npos) {
    while (s.back() == '0') s.pop_back();
    if (s.back() == '.') s.pop_back();
  }
  if (s == "-0") s = "0";
  return s;
}

// 2 followed by the exponent in Unicode superscripts: 2⁻¹⁴.
std::string pow2_text(int e) {
  static const char* const digits[] = {"\u2070", "\u00b9", "\u00b2", "\u00b3", "\u2074",
                                       "\u2075", "\u2076", "\u2077", "\u2078", "\u2079"};
  std::string s = "2";
  if (e < 0) s += "\u207b";
  const std::string d = std::to_string(e < 0 ? -e : e);
  for (char c : d) s += digits[c - '0'];
  return s;
}

double nice_step(double span, int target) {
  if (!(span > 0) || !std::isfinite(span)) return 1;
  const double raw = span / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double m = norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10;
  return m * mag;
}

int step_decimals(double step) {
  if (!(step > 0)) return 0;
  return std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
}

struct Tick {
  double value;       // in axis units (log2 exponent on a log axis)
  std::string label;
};

struct Scale {
  double lo = 0, hi = 1;  // domain in axis units
  double a = 0, b = 1;    // pixel range
  bool log2 = false;
  double map(double v) const {  // v in data units
    const double t = log2 ? std::log2(v) : v;
    return a + (t - lo) / (hi - lo) * (b - a);
  }
  bool valid(double v) const { return std::isfinite(v) && (!log2 || v > 0); }
};

std::vector<Tick> linear_ticks(double& lo, double& hi, int target, bool integer, bool percent, bool extend) {
  double step = nice_step(hi - lo, target);
  if (integer) step = std::max(1.0, std::round(step));
  if (extend) {
    lo = std::floor(lo / step + 1e-9) * step;
    hi = std::ceil(hi / step - 1e-9) * step;
  }
  std::vector<Tick> ticks;
  const double first = std::ceil(lo / step - 1e-9);
  const int dec = percent ? step_decimals(step * 100) : step_decimals(step);
  for (int i = 0; i < 64; ++i) {
    const double v = (first + i) * step;
    if (v > hi + step * 1e-6) break;
    const double shown = std::fabs(v) < step * 1e-6 ? 0.0 : v;
    ticks.push_back({shown, percent ? fixed(shown * 100, dec) + "%" : fixed(shown, dec)});
  }
  return ticks;
}

std::vector<Tick> log2_ticks(double lo, double hi) {
  const int span = static_cast<int>(std::lround(hi - lo));
  int k = 1;
  for (int c : {1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64}) {
    k = c;
    if (span / c <= 8) break;
  }
  std::vector<Tick> ticks;
  const int first = static_cast<int>(std::ceil(lo / k)) * k;
  for (int e = first; e <= static_cast<int>(hi); e += k) ticks.push_back({static_cast<double>(e), pow2_text(e)});
  return ticks;
}

void text(std::string& out, double x, double y, std::string_view s, const char* anchor = "start", double size = 11,
          const char* color = kTextColor, const char* extra = "") {
  out += "<text x=\"" + coord(x) + "\" y=\"" + coord(y) + "\" font-size=\"" + coord(size) + "\" fill=\"" + color +
         "\" text-anchor=\"" + anchor + "\"" + extra + ">" + escape(s) + "</text>";
}

void rect(std::string& out, double x, double y, double w, double h, const std::string& fill, double opacity = 1,
          const char* extra = "") {
  out += "<rect x=\"" + coord(x) + "\" y=\"" + coord(y) + "\" width=\"" + coord(std::max(0.0, w)) + "\" height=\"" +
         coord(std::max(0.0, h)) + "\" fill=\"" + fill + "\"";
  if (opacity < 1) out += " fill-opacity=\"" + fixed(opacity, 3) + "\"";
  out += extra;
  out += "/>";
}

void line(std::string& out, double x1, double y1, double x2, double y2, const char* color, double width = 1,
          const std::string& dash = {}) {
  out += "<line x1=\"" + coord(x1) + "\" y1=\"" + coord(y1) + "\" x2=\"" + coord(x2) + "\" y2=\"" + coord(y2) +
         "\" stroke=\"" + color + "\" stroke-width=\"" + coord(width) + "\"";
  if (!dash.empty()) out += " stroke-dasharray=\"" + dash + "\"";
  out += "/>";
}

std::string svg_open(const std::string& id, int w, int h, const char* kind) {
  return "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart " + std::string(kind) + "\" data-chart=\"" +
         escape(id) + "\" viewBox=\"0 0 " + std::to_string(w) + " " + std::to_string(h) + "\" width=\"" +
         std::to_string(w) + "\" height=\"" + std::to_string(h) + "\" role=\"img\">";
}

// Rough width of a label at 11px in a system sans-serif font.
double label_width(std::string_view s) {
  double w = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if ((c & 0xC0) == 0x80) continue;  // UTF-8 continuation
    const bool wide = (c >= 'A' && c <= 'Z') || c == 'm' || c == 'w';
    const bool narrow = c == ' ' || c == '.' || c == 'i' || c == 'l';
    w += wide ? 8.0 : narrow ? 3.5 : 6.3;
  }
  return w;
}

void marker_path(std::string& d, double x, double y, double s) {
  d += "M" + coord(x - s) + " " + coord(y - s) + "L" + coord(x + s) + " " + coord(y + s) + "M" + coord(x - s) + " " +
       coord(y + s) + "L" + coord(x + s) + " " + coord(y - s);
}

// Pixel points of one unbroken run of a series; columns with many points keep their
// first, lowest, highest and last point.
std::vector<Point> decimate(const std::vector<Point>& px, double columns) {
  if (static_cast<double>(px.size()) <= 4 * columns) return px;
  std::vector<Point> out;
  std::size_t i = 0;
  while (i < px.size()) {
    const double col = std::floor(px[i].x);
    std::size_t j = i, lo = i, hi = i;
    while (j < px.size() && std::floor(px[j].x) == col) {
      if (px[j].y < px[lo].y) lo = j;
      if (px[j].y > px[hi].y) hi = j;
      ++j;
    }
    std::vector<std::size_t> keep = {i, lo, hi, j - 1};
    std::sort(keep.begin(), keep.end());
    keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
    for (std::size_t k : keep) out.push_back(px[k]);
    i = j;
  }
  return out;
}

}  // namespace

std::string escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string number(double v, int digits) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e-4 && a < 1e7) {
    if (a == std::floor(a)) return fixed(v, 0);
    const int mag = static_cast<int>(std::floor(std::log10(a)));
    return fixed(v, digits - 1 - mag);
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*e", std::max(0, digits - 1), v);
  std::string s(buf);
  const std::size_t e = s.find('e');
  std::string mant = s.substr(0, e), ex = s.substr(e + 1);
  if (mant.find('.') != std::string::npos) {
    while (mant.back() == '0') mant.pop_back();
    if (mant.back() == '.') mant.pop_back();
  }
  const bool neg = ex[0] == '-';
  std::size_t k = 1;
  while (k + 1 < ex.size() && ex[k] == '0') ++k;
  return mant + "e" + (neg ? "-" : "") + ex.substr(k);
}

std::string render(const LineChart& c) {
  const double W = c.width, H = c.height;
  const double left = 66, right = 18, bottom = 46;

  // Legend rows at the top.
  struct Item {
    const Series* s;
    double x, y;
    const Band* band = nullptr;  // a band's legend item (s null)
  };
  std::vector<Item> items;
  double lx = left, ly = 14;
  auto place = [&](const std::string& label, const Series* s, const Band* b) {
    if (label.empty()) return;
    const double w = 30 + label_width(label) + 18;
    if (lx + w > W - right && lx > left) {
      lx = left;
      ly += 18;
    }
    items.push_back({s, lx, ly, b});
    lx += w;
  };
  for (const Band& b : c.bands) place(b.label, nullptr, &b);
  for (const Series& s : c.series) place(s.label, &s, nullptr);
  const double top = (items.empty() ? 10 : ly + 14) + 6;
  const double pw = W - left - right, ph = H - top - bottom;

  // Domains from the finite points.
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin, ymin = xmin, ymax = -xmin;
  std::size_t finite = 0;
  auto extend = [&](const Point& p) {
    if (!std::isfinite(p.x) || !std::isfinite(p.y) || (c.y.log2 && p.y <= 0)) return;
    ++finite;
    xmin = std::min(xmin, p.x);
    xmax = std::max(xmax, p.x);
    ymin = std::min(ymin, p.y);
    ymax = std::max(ymax, p.y);
  };
  for (const Series& s : c.series)
    for (const Point& p : s.points) extend(p);
  for (const Band& b : c.bands) {
    for (const Point& p : b.low) extend(p);
    for (const Point& p : b.high) extend(p);
  }

  std::string out = svg_open(c.id, c.width, c.height, "line-chart");
  rect(out, 0, 0, W, H, "#ffffff");

  // Legend.
  for (const Item& it : items) {
    if (it.band != nullptr) {
      out += "<g class=\"legend-item\">";
      rect(out, it.x, it.y - 10, 22, 12, it.band->color, std::min(1.0, it.band->opacity * 2));
      text(out, it.x + 28, it.y, it.band->label, "start", 11.5, "#1f2937");
      out += "</g>";
      continue;
    }
    const Series& s = *it.s;
    out += "<g class=\"legend-item\">";
    if (s.line) line(out, it.x, it.y - 4, it.x + 22, it.y - 4, s.color.c_str(), std::min(s.width, 3.0), s.dash);
    if (s.marker == Marker::circle) {
      out += "<circle cx=\"" + coord(it.x + 11) + "\" cy=\"" + coord(it.y - 4) + "\" r=\"" + coord(s.marker_size) +
             "\" fill=\"" + s.color + "\" stroke=\"#fff\" stroke-width=\"1\"/>";
    } else if (s.marker == Marker::cross) {
      std::string d;
      marker_path(d, it.x + 11, it.y - 4, s.marker_size);
      out += "<path d=\"" + d + "\" stroke=\"" + s.color + "\" stroke-width=\"2\" fill=\"none\"/>";
    }
    text(out, it.x + 28, it.y, s.label, "start", 11.5, "#1f2937");
    out += "</g>";
  }

  if (finite == 0) {
    rect(out, left, top, pw, ph, "#fafafa", 1, " stroke=\"#e5e7eb\"");
    text(out, left + pw / 2, top + ph / 2 + 4, c.empty_text, "middle", 13, "#9ca3af");
    text(out, left + pw / 2, H - 8, c.x.label, "middle", 11.5);
    out += "</svg>";
    return out;
  }

  // x: the data's extent (or fixed bounds), ticks inside.
  double x0 = c.x.min.value_or(xmin), x1 = c.x.max.value_or(xmax);
  if (!(x1 > x0)) {
    x0 -= 1;
    x1 += 1;
  }
  const std::vector<Tick> xt = linear_ticks(x0, x1, std::max(2, static_cast<int>(pw / 90)), c.x.integer,
                                            c.x.percent, false);
  Scale sx{x0, x1, left, left + pw, false};

  Scale sy;
  std::vector<Tick> yt;
  sy.a = top + ph;
  sy.b = top;
  sy.log2 = c.y.log2;
  if (c.y.log2) {
    double lo = std::floor(std::log2(c.y.min.value_or(ymin)));
    double hi = std::ceil(std::log2(c.y.max.value_or(ymax)));
    if (!(hi > lo)) {
      lo -= 1;
      hi += 1;
    }
    sy.lo = lo;
    sy.hi = hi;
    yt = log2_ticks(lo, hi);
  } else {
    double lo = c.y.min.value_or(ymin), hi = c.y.max.value_or(ymax);
    if (!(hi > lo)) {
      const double pad = lo == 0 ? (c.y.percent ? 0.01 : 1) : std::fabs(lo) * 0.1;
      if (!c.y.min) lo -= pad;
      hi = lo + 2 * pad;
      if (c.y.min) hi = lo + pad;
    }
    yt = linear_ticks(lo, hi, std::max(2, static_cast<int>(ph / 55)), c.y.integer, c.y.percent, true);
    sy.lo = lo;
    sy.hi = hi;
  }

  // Grid and ticks.
  out += "<g class=\"grid\">";
  for (const Tick& t : yt) {
    const double y = sy.a + (t.value - sy.lo) / (sy.hi - sy.lo) * (sy.b - sy.a);
    line(out, left, y, left + pw, y, kGridColor);
    text(out, left - 8, y + 4, t.label, "end");
  }
  for (const Tick& t : xt) {
    const double x = sx.map(t.value);
    line(out, x, top, x, top + ph, kGridColor);
    line(out, x, top + ph, x, top + ph + 4, kAxisColor);
    text(out, x, top + ph + 17, t.label, "middle");
  }
  out += "</g>";
  line(out, left, top + ph, left + pw, top + ph, kAxisColor);
  line(out, left, top, left, top + ph, kAxisColor);
  text(out, left + pw / 2, H - 8, c.x.label, "middle", 11.5);
  out += "<text transform=\"translate(14 " + coord(top + ph / 2) +
         ") rotate(-90)\" font-size=\"11.5\" fill=\"" + kTextColor + "\" text-anchor=\"middle\">" + escape(c.y.label) +
         "</text>";

  const std::string clip = "clip-" + escape(c.id);
  out += "<clipPath id=\"" + clip + "\">";
  rect(out, left - 5, top - 5, pw + 10, ph + 10, "#fff");
  out += "</clipPath>";

  // Events: a dashed vertical line and its label at the top of the plot.
  for (const VLine& v : c.vlines) {
    if (!std::isfinite(v.x) || v.x < x0 || v.x > x1) continue;
    const double x = sx.map(v.x);
    out += "<g class=\"vline\" data-x=\"" + number(v.x, 12) + "\" data-label=\"" + escape(v.label) + "\">";
    line(out, x, top, x, top + ph, v.color.c_str(), 1.5, "4 3");
    text(out, x + 4, top + 12, v.label, "start", 11, v.color.c_str());
    out += "</g>";
  }

  // Bands: one filled polygon per run of points valid on both edges.
  for (const Band& b : c.bands) {
    const std::size_t n = std::min(b.low.size(), b.high.size());
    std::size_t valid = 0;
    std::string polys;
    std::vector<Point> lo, hi;
    auto flush = [&] {
      if (lo.size() >= 2) {
        polys += "<polygon fill=\"" + b.color + "\" fill-opacity=\"" + number(b.opacity, 3) +
                 "\" stroke=\"none\" points=\"";
        for (std::size_t i = 0; i < lo.size(); ++i)
          polys.append(i ? " " : "").append(coord(lo[i].x)).append(",").append(coord(lo[i].y));
        for (std::size_t i = hi.size(); i-- > 0;)
          polys.append(" ").append(coord(hi[i].x)).append(",").append(coord(hi[i].y));
        polys += "\"/>";
      }
      lo.clear();
      hi.clear();
    };
    for (std::size_t i = 0; i < n; ++i) {
      const Point& l = b.low[i];
      const Point& h = b.high[i];
      if (!std::isfinite(l.x) || !std::isfinite(h.x) || !sy.valid(l.y) || !sy.valid(h.y)) {
        flush();
        continue;
      }
      ++valid;
      lo.push_back({sx.map(l.x), sy.map(l.y)});
      hi.push_back({sx.map(h.x), sy.map(h.y)});
    }
    flush();
    out += "<g class=\"area\" data-label=\"" + escape(b.label) + "\" data-points=\"" + std::to_string(valid) +
           "\" clip-path=\"url(#" + clip + ")\">" + polys + "</g>";
  }

  // Series: lines first, then markers on top.
  for (int pass = 0; pass < 2; ++pass) {
    for (const Series& s : c.series) {
      if (pass == 0 && !s.line) continue;
      if (pass == 1 && s.marker == Marker::none) continue;
      std::size_t n = 0;
      for (const Point& p : s.points)
        if (std::isfinite(p.x) && sy.valid(p.y)) ++n;
      out += "<g class=\"" + std::string(pass == 0 ? "series" : "markers") + "\" data-label=\"" + escape(s.label) +
             "\" data-points=\"" + std::to_string(n) + "\" clip-path=\"url(#" + clip + ")\">";
      if (pass == 0) {
        std::vector<Point> run;
        auto flush = [&] {
          if (run.size() >= 2) {
            const std::vector<Point> px = decimate(run, pw);
            out += "<polyline fill=\"none\" stroke=\"" + s.color + "\" stroke-width=\"" + coord(s.width) +
                   "\" stroke-linejoin=\"round\" stroke-linecap=\"round\"";
            if (!s.dash.empty()) out += " stroke-dasharray=\"" + s.dash + "\"";
            out += " points=\"";
            for (std::size_t i = 0; i < px.size(); ++i) {
              if (i) out += ' ';
              out += coord(px[i].x) + "," + coord(px[i].y);
            }
            out += "\"/>";
          } else if (run.size() == 1 && s.marker == Marker::none) {
            out += "<circle cx=\"" + coord(run[0].x) + "\" cy=\"" + coord(run[0].y) + "\" r=\"" +
                   coord(std::max(1.5, s.width)) + "\" fill=\"" + s.color + "\"/>";
          }
          run.clear();
        };
        for (const Point& p : s.points) {
          if (!std::isfinite(p.x) || !sy.valid(p.y)) {
            flush();
            continue;
          }
          const Point q{sx.map(p.x), sy.map(p.y)};
          if (s.steps && !run.empty()) run.push_back({q.x, run.back().y});
          run.push_back(q);
        }
        flush();
      } else {
        std::string d;
        for (const Point& p : s.points) {
          if (!std::isfinite(p.x) || !sy.valid(p.y)) continue;
          const double x = sx.map(p.x), y = sy.map(p.y);
          if (s.marker == Marker::circle)
            out += "<circle cx=\"" + coord(x) + "\" cy=\"" + coord(y) + "\" r=\"" + coord(s.marker_size) +
                   "\" fill=\"" + s.color + "\" stroke=\"#fff\" stroke-width=\"1\"/>";
          else
            marker_path(d, x, y, s.marker_size);
        }
        if (!d.empty())
          out += "<path d=\"" + d + "\" stroke=\"" + s.color + "\" stroke-width=\"2\" fill=\"none\"/>";
      }
      out += "</g>";
    }
  }
  out += "</svg>";
  return out;
}

std::string render(const Histogram& h) {
  const double W = h.width, H = h.height;
  const double left = 56, right = 14, top = 24;
  const double row_h = 15;
  const double rows = static_cast<double>(h.ranges.size());
  const double bottom = 24 + rows * row_h + (rows > 0 ? 8 : 0) + 20;
  const double pw = W - left - right, ph = H - top - bottom;
  const int lo = h.lo_exp, hi = std::max(h.hi_exp, h.lo_exp + 1);
  auto sx = [&](double e) { return left + (std::clamp(e, double(lo), double(hi)) - lo) / (hi - lo) * pw; };

  double total = h.zeros + h.nonfinite;
  for (double v : h.counts) total += v;
  double maxf = 0;
  std::size_t bins = 0;
  for (std::size_t i = 0; i < h.counts.size(); ++i) {
    const int e = h.first_exp + static_cast<int>(i);
    if (e < lo || e >= hi || !(h.counts[i] > 0)) continue;
    ++bins;
    maxf = std::max(maxf, h.counts[i] / total);
  }

  std::string out = svg_open(h.id, h.width, h.height, "histogram");
  rect(out, 0, 0, W, H, "#ffffff");

  // Zeros and non-finite values, which have no bin.
  if (total > 0) {
    std::string note = "zeros " + number(100 * h.zeros / total, 3) + "%";
    if (h.nonfinite > 0) note += ", non-finite " + number(h.nonfinite, 6);
    note += " of " + number(total, 6) + " values";
    text(out, W - right, 14, note, "end", 10.5);
  }

  // The shaded format inside the plot.
  if (h.shaded >= 0 && static_cast<std::size_t>(h.shaded) < h.ranges.size()) {
    const FormatRange& f = h.ranges[static_cast<std::size_t>(h.shaded)];
    out += "<g class=\"band\" data-format=\"" + escape(f.name) + "\">";
    const double s0 = sx(f.subnormal_lo), n0 = sx(f.normal_lo), n1 = sx(f.normal_hi);
    rect(out, s0, top, n0 - s0, ph, f.color, 0.07);
    rect(out, n0, top, n1 - n0, ph, f.color, 0.13);
    if (n1 - n0 > 60) text(out, n0 + 4, top + 12, f.name + " normal", "start", 10, f.color.c_str());
    out += "</g>";
  }

  // y: percent of all values.
  double ylo = 0, yhi = maxf > 0 ? maxf : 1;
  const std::vector<Tick> yt = linear_ticks(ylo, yhi, std::max(2, static_cast<int>(ph / 45)), false, true, true);
  auto sy = [&](double f) { return top + ph - f / yhi * ph; };
  out += "<g class=\"grid\">";
  for (const Tick& t : yt) {
    line(out, left, sy(t.value), left + pw, sy(t.value), kGridColor);
    text(out, left - 6, sy(t.value) + 4, t.label, "end", 10.5);
  }
  int xstep = 1;
  for (int c : {1, 2, 4, 8, 16, 32}) {
    xstep = c;
    if ((hi - lo) / c <= std::max(4, static_cast<int>(pw / 55))) break;
  }
  const int xfirst = static_cast<int>(std::ceil(static_cast<double>(lo) / xstep)) * xstep;
  for (int e = xfirst; e <= hi; e += xstep) {
    line(out, sx(e), top + ph, sx(e), top + ph + 4, kAxisColor);
    text(out, sx(e), top + ph + 16, pow2_text(e), "middle", 10.5);
  }
  out += "</g>";

  // Bars.
  out += "<g class=\"bars\" data-bins=\"" + std::to_string(bins) + "\" fill=\"" + h.color + "\">";
  const double bw = pw / (hi - lo);
  for (std::size_t i = 0; i < h.counts.size(); ++i) {
    const int e = h.first_exp + static_cast<int>(i);
    if (e < lo || e >= hi || !(h.counts[i] > 0)) continue;
    const double f = h.counts[i] / total;
    const double bh = std::max(1.5, f / yhi * ph);
    const double gap = bw > 4 ? 0.6 : 0;
    out += "<rect x=\"" + coord(sx(e) + gap) + "\" y=\"" + coord(top + ph - bh) + "\" width=\"" +
           coord(bw - 2 * gap) + "\" height=\"" + coord(bh) + "\"><title>" + escape(pow2_text(e)) + " \u2264 |x| < " +
           escape(pow2_text(e + 1)) + ": " + number(h.counts[i], 6) + " (" + number(100 * f, 3) +
           "%)</title></rect>";
  }
  out += "</g>";
  line(out, left, top + ph, left + pw, top + ph, kAxisColor);
  line(out, left, top, left, top + ph, kAxisColor);
  out += "<text transform=\"translate(13 " + coord(top + ph / 2) + ") rotate(-90)\" font-size=\"11\" fill=\"" +
         kTextColor + "\" text-anchor=\"middle\">% of values</text>";

  // Format ranges: one row each, subnormal light, normal dark.
  out += "<g class=\"ranges\" data-formats=\"" + std::to_string(h.ranges.size()) + "\">";
  for (std::size_t i = 0; i < h.ranges.size(); ++i) {
    const FormatRange& f = h.ranges[i];
    const double y = top + ph + 24 + static_cast<double>(i) * row_h;
    text(out, left - 6, y + 9, f.name, "end", 10, "#374151");
    rect(out, left, y + 1, pw, row_h - 4, "#f3f4f6");
    const double s0 = sx(f.subnormal_lo), n0 = sx(f.normal_lo), n1 = sx(f.normal_hi);
    out += "<g class=\"range\" data-format=\"" + escape(f.name) + "\">";
    if (n0 > s0) rect(out, s0, y + 1, n0 - s0, row_h - 4, f.color, 0.35, " rx=\"2\"");
    if (n1 > n0) rect(out, n0, y + 1, n1 - n0, row_h - 4, f.color, 0.85, " rx=\"2\"");
    if (n1 - n0 > label_width(f.range_text) * 0.85 + 8)
      text(out, (n0 + n1) / 2, y + 9.5, f.range_text, "middle", 9, "#ffffff");
    else if (!f.range_text.empty() && left + pw - n1 > label_width(f.range_text) * 0.85 + 8)
      text(out, n1 + 4, y + 9.5, f.range_text, "start", 9, "#374151");
    else if (!f.range_text.empty() && s0 - left > label_width(f.range_text) * 0.85 + 8)
      text(out, s0 - 4, y + 9.5, f.range_text, "end", 9, "#374151");
    out += "</g>";
  }
  out += "</g>";
  text(out, left + pw / 2, H - 6, h.x_label, "middle", 11);
  out += "</svg>";
  return out;
}

namespace {

// 2 and an exponent in superscript digits: "2⁻¹⁴".
std::string pow2_superscript(int e) {
  static const char* const digits[] = {"\u2070", "\u00b9", "\u00b2", "\u00b3", "\u2074",
                                       "\u2075", "\u2076", "\u2077", "\u2078", "\u2079"};
  std::string out = "2";
  if (e < 0) out += "\u207b";
  for (const char ch : std::to_string(e < 0 ? -e : e)) out += digits[ch - '0'];
  return out;
}

// 65504, 448; 3.4e38 past a million.
std::string max_text(double v) {
  char buf[32];
  if (v < 1e6) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    const int e = static_cast<int>(std::floor(std::log10(v)));
    std::snprintf(buf, sizeof buf, "%.1fe%d", v / std::pow(10.0, e), e);
  }
  return buf;
}

}  // namespace

const std::vector<FormatRange>& standard_ranges() {
  // A band per format with conversion kernels, from its row of the format table.
  static const std::vector<FormatRange> ranges = [] {
    static const char* const colors[] = {"#0284c7", "#0d9488", "#ea580c", "#db2777", "#7c3aed", "#65a30d"};
    std::vector<FormatRange> out;
    for (const FormatId f : convertible_formats()) {
      const FormatRow& r = format_row(f);
      const int sub = static_cast<int>(std::log2(r.min_subnormal));
      const int normal = static_cast<int>(std::log2(r.min_normal));
      out.push_back({std::string(r.display), static_cast<double>(sub), static_cast<double>(normal),
                     std::log2(static_cast<double>(r.max_finite)), colors[out.size() % std::size(colors)],
                     pow2_superscript(normal) + " \u2026 " + max_text(r.max_finite) + ", subnormal to " +
                         pow2_superscript(sub)});
    }
    return out;
  }();
  return ranges;
}

}  // namespace mixprec::monitor::svg
