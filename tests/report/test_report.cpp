// The HTML report: rendering from synthetic in-memory runs (structure of the SVG
// charts, legends, escaping, bands, alerts, config), degenerate runs (none, empty,
// one step, NaN values), the SVG helpers, and loading run folders (errors, alerts,
// no partial output).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "mixprec/report/report.hpp"
#include "mixprec/run/run_log.hpp"
#include "report/svg_chart.hpp"

namespace mixprec::monitor {
namespace {

namespace fs = std::filesystem;
using train::StepRecord;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::size_t count(const std::string& s, const std::string& sub) {
  std::size_t n = 0;
  for (std::size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
  return n;
}

// The markup of one chart: from its data-chart attribute to its </svg>.
std::string chart(const std::string& html, const std::string& id) {
  const std::size_t a = html.find("data-chart=\"" + id + "\"");
  if (a == std::string::npos) return {};
  return html.substr(a, html.find("</svg>", a) - a);
}

// data-points of the series group labelled `label` in `svg` (-1 when absent).
long points_of(const std::string& svg, const std::string& label, const std::string& cls = "series") {
  const std::regex re("class=\"" + cls + "\" data-label=\"" + label + "\" data-points=\"([0-9]+)\"");
  std::smatch m;
  if (!std::regex_search(svg, m, re)) return -1;
  return std::stol(m[1]);
}

nn::TensorGradStats tensor(const std::string& name, std::uint64_t nonzero, std::uint64_t underflow) {
  nn::TensorGradStats t;
  t.name = name;
  t.stats.elements = nonzero + 10;
  t.stats.nonzero = nonzero;
  t.stats.underflow = underflow;
  t.amax = 1;
  return t;
}

// A run of `steps` steps: falling loss, an overflow (skipped, scale halved) at
// `skip_at`, validation every 5 steps, two tensors per layer, histograms on the last step.
ReportRun synthetic(const std::string& name, std::size_t steps, std::size_t skip_at, std::size_t layers = 1) {
  ReportRun run;
  run.name = name;
  run.dir = "runs/" + name;
  run.config = {{"model", "gpt"}, {"precision", "fp16"}, {"loss-scale", "dynamic"}, {"steps", std::to_string(steps)}};
  float scale = 65536;
  for (std::size_t s = 1; s <= steps; ++s) {
    StepRecord r;
    r.step = s;
    r.loss = 5.5 - 2.0 * static_cast<double>(s) / static_cast<double>(steps);
    r.scale = scale;
    r.skipped = r.found_inf = s == skip_at;
    if (r.skipped) scale /= 2;
    r.next_scale = scale;
    r.tokens = 64;
    r.seconds = 0.01;
    if (s % 5 == 0) r.val_loss = r.loss + 0.1;
    for (std::size_t l = 0; l < layers; ++l) {
      const std::string h = std::string("h").append(std::to_string(l)).append(".");
      r.act_grad_tensors.push_back(tensor(h + "mlp.fc.grad", 1000, 10 * l + s));
      r.act_grad_tensors.push_back(tensor(h + "attn.qkv.grad", 1000, 0));
      r.act_grad_tensors.push_back(tensor(h + "ln1.grad", 1000, 1));
      r.act_grad_tensors.push_back(tensor(h + "ln2.grad", 1000, 2));
      r.act_grad_tensors.push_back(tensor(h + "attn.proj.grad", 1000, 3));
    }
    for (const nn::TensorGradStats& t : r.act_grad_tensors) r.act_grads += t.stats;
    if (s == steps) {
      StepRecord::Histograms hist;
      hist.activation_grads.counts[static_cast<std::size_t>(-20 - nn::Log2Histogram::kMinExp)] = 500;
      hist.activation_grads.counts[static_cast<std::size_t>(-30 - nn::Log2Histogram::kMinExp)] = 50;
      hist.activation_grads.zeros = 20;
      hist.weight_grads.counts[static_cast<std::size_t>(-12 - nn::Log2Histogram::kMinExp)] = 100;
      hist.weights.counts[static_cast<std::size_t>(-6 - nn::Log2Histogram::kMinExp)] = 100;
      hist.weights.counts[static_cast<std::size_t>(-5 - nn::Log2Histogram::kMinExp)] = 70;
      hist.activations.counts[static_cast<std::size_t>(0 - nn::Log2Histogram::kMinExp)] = 300;
      hist.activations.nonfinite = 1;
      r.histograms = hist;
    }
    run.records.push_back(std::move(r));
  }
  run.alerts = std::vector<ReportAlert>{};
  return run;
}

TEST(Report, TwoRunsHaveEveryChartWithTheirData) {
  std::vector<ReportRun> runs = {synthetic("fp16-dynamic", 30, 7), synthetic("fp16-static", 30, 12)};
  runs[1].config[2].second = "static:1024";
  runs[1].alerts = std::vector<ReportAlert>{{"scale-collapse", 12, "warning", "scale fell", "raise it", 20, 5}};
  const std::string html = render_report(runs);

  ASSERT_TRUE(html.starts_with("<!DOCTYPE html>"));
  EXPECT_EQ(count(html, "<script"), 0u);
  EXPECT_EQ(count(html, "http://") + count(html, "https://"), count(html, "xmlns=\"http://www.w3.org/2000/svg\""))
      << "no network references";

  // (1) loss: one polyline per run with every step, validation points, legend labels.
  const std::string loss = chart(html, "loss");
  ASSERT_FALSE(loss.empty());
  EXPECT_EQ(count(loss, "<polyline"), 2u);
  EXPECT_EQ(points_of(loss, "fp16-dynamic"), 30);
  EXPECT_EQ(points_of(loss, "fp16-static"), 30);
  EXPECT_EQ(count(loss, "class=\"legend-item\""), 3u);  // two runs + validation loss
  EXPECT_NE(loss.find(">validation loss</text>"), std::string::npos);
  EXPECT_EQ(count(loss, "<circle"), 2u * 6u + 1u);  // 6 evaluations per run + the legend's dot

  // (2) loss scale on a log2 axis, one skipped marker per skipped step.
  const std::string scale = chart(html, "loss-scale");
  EXPECT_EQ(points_of(scale, "skipped step", "markers"), 2);
  EXPECT_NE(scale.find("2\u00b9\u2076"), std::string::npos) << "2^16 tick";
  EXPECT_NE(scale.find("stroke=\"#dc2626\""), std::string::npos);

  // (3) skip rate; (4) underflow overall and per tensor.
  EXPECT_EQ(points_of(chart(html, "skip-rate"), "fp16-dynamic"), 30);
  EXPECT_EQ(points_of(chart(html, "underflow"), "fp16-static"), 30);
  const std::string tensors = chart(html, "tensors-0");
  EXPECT_EQ(count(tensors, "class=\"series\""), 6u);  // 5 tensors + all tensors
  EXPECT_EQ(points_of(tensors, "h0.mlp.fc.grad"), 30);
  EXPECT_EQ(points_of(tensors, "all tensors"), 30);
  EXPECT_FALSE(chart(html, "tensors-1").empty());

  // (5) histograms of the last step: four per run, format rows, the fp16 band.
  for (const char* kind : {"act-grad", "weight-grad", "weights", "act"}) {
    const std::string h = chart(html, std::string("hist-1-") + kind);
    ASSERT_FALSE(h.empty()) << kind;
    EXPECT_NE(h.find("class=\"ranges\" data-formats=\"4\""), std::string::npos);
    for (const char* f : {"fp16", "bf16", "E4M3", "E5M2"})
      EXPECT_NE(h.find(std::string("class=\"range\" data-format=\"") + f + "\""), std::string::npos) << f;
  }
  const std::string ag = chart(html, "hist-0-act-grad");
  EXPECT_NE(ag.find("data-bins=\"2\""), std::string::npos);
  EXPECT_NE(ag.find("class=\"band\" data-format=\"fp16\""), std::string::npos);
  EXPECT_EQ(chart(html, "hist-0-weight-grad").find("class=\"band\""), std::string::npos) << "fp32 weight grads";
  EXPECT_NE(html.find("loss scale 2<sup>15</sup> = 32768"), std::string::npos)
      << "the scale beside the act-grad histogram";

  // (6) alerts, (7) configuration and the summary table.
  EXPECT_NE(html.find("\u2713 No alerts."), std::string::npos);
  EXPECT_NE(html.find(">scale-collapse</code>"), std::string::npos);
  EXPECT_NE(html.find("step 12\u201320, held on 5 steps"), std::string::npos);
  EXPECT_NE(html.find("\u2192 raise it"), std::string::npos);
  EXPECT_NE(html.find("<tr class=\"differs\"><td class=\"key\">loss-scale</td><td>dynamic</td><td>static:1024</td>"),
            std::string::npos);
  EXPECT_NE(html.find("<span class=\"key\">model</span><span class=\"val\">gpt</span>"), std::string::npos);
  EXPECT_NE(html.find(">Shared by all runs</h3>"), std::string::npos);
  EXPECT_NE(html.find("<table class=\"summary\">"), std::string::npos);
  EXPECT_NE(html.find("<code>runs/fp16-dynamic</code>"), std::string::npos);
}

// A recipe file's switch: a labelled vertical line on the loss chart at its step, named
// by its run when the report has several; none without one.
TEST(Report, RecipeSwitchesAreMarkedOnTheLossChart) {
  ReportRun a = synthetic("a", 20, 0), b = synthetic("b", 20, 0);
  EXPECT_EQ(chart(render_report({a}), "loss").find("class=\"vline\""), std::string::npos);
  a.records[11].recipe_phase = "to <nvfp4>";
  const std::string one = chart(render_report({a}), "loss");
  EXPECT_EQ(count(one, "class=\"vline\""), 1u);
  EXPECT_NE(one.find(R"(class="vline" data-x="12" data-label="to &lt;nvfp4&gt;")"), std::string::npos) << one;
  EXPECT_NE(one.find(">to &lt;nvfp4&gt;</text>"), std::string::npos);
  b.records[4].recipe_phase = "hp wgrad";
  const std::string two = chart(render_report({a, b}), "loss");
  EXPECT_EQ(count(two, "class=\"vline\""), 2u);
  EXPECT_NE(two.find(R"(data-x="5" data-label="b: hp wgrad")"), std::string::npos) << two;
  EXPECT_NE(two.find(R"(data-x="12" data-label="a: to &lt;nvfp4&gt;")"), std::string::npos);
  // Outside the chart's x range: left out.
  svg::LineChart c;
  c.id = "v";
  svg::Series s;
  s.points = {{1, 1}, {2, 2}};
  c.series.push_back(s);
  c.vlines = {{1.5, "in"}, {7, "out"}};
  const std::string svg = svg::render(c);
  EXPECT_EQ(count(svg, "class=\"vline\""), 1u);
  EXPECT_NE(svg.find("data-label=\"in\""), std::string::npos);
}

TEST(Report, EscapesEveryTextFromTheRun) {
  ReportRun run = synthetic("<script>alert(\"x\")</script> & 'q'", 4, 2);
  run.dir = "a\"><img src=x onerror=alert(1)>";
  run.config.emplace_back("data", "</td><script>bad()</script>");
  run.config.emplace_back("<k>", "v");
  run.alerts = std::vector<ReportAlert>{{"<id>", 3, "<sev>", "<b>boom</b>", "<i>fix</i>", std::nullopt, std::nullopt}};
  run.records[0].act_grad_tensors[0].name = "<t>";
  ReportOptions o;
  o.title = "<title>&";
  const std::string html = render_report({run}, o);
  EXPECT_EQ(count(html, "<script"), 0u);
  EXPECT_EQ(count(html, "<img"), 0u);
  EXPECT_EQ(count(html, "<b>boom"), 0u);
  EXPECT_EQ(count(html, "<t>"), 0u);
  EXPECT_EQ(count(html, "<k>"), 0u);
  EXPECT_NE(html.find("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;q&#39;"), std::string::npos);
  EXPECT_NE(html.find("&lt;b&gt;boom&lt;/b&gt;"), std::string::npos);
  EXPECT_NE(html.find("<title>&lt;title&gt;&amp;: "), std::string::npos);
  EXPECT_NE(html.find("data-label=\"&lt;script&gt;"), std::string::npos) << "attributes escaped too";
}

TEST(Report, NoRunsEmptyRunsAndOneStepDoNotCrash) {
  EXPECT_NE(render_report({}).find("No runs to report."), std::string::npos);

  ReportRun empty;
  empty.name = "empty";
  const std::string html = render_report({empty});
  EXPECT_NE(chart(html, "loss").find(">no data</text>"), std::string::npos);
  EXPECT_NE(chart(html, "loss-scale").find(">no data</text>"), std::string::npos);
  EXPECT_NE(html.find("No histograms in this log"), std::string::npos);
  EXPECT_NE(html.find("Alerts were not evaluated"), std::string::npos);
  EXPECT_NE(html.find("No config.json in the run folder."), std::string::npos);
  EXPECT_NE(html.find("The log has no per-tensor activation-gradient statistics."), std::string::npos);

  ReportRun one = synthetic("one", 1, 0);
  const std::string h1 = render_report({one});
  EXPECT_EQ(points_of(chart(h1, "loss"), "one"), 1);
  EXPECT_EQ(count(chart(h1, "loss"), "<polyline"), 0u);
  EXPECT_NE(chart(h1, "loss").find("<circle"), std::string::npos) << "a lone point is still drawn";
  EXPECT_FALSE(chart(h1, "hist-0-act-grad").empty());

  // A run without steps next to one with steps: the chart has the other's data.
  const std::string both = render_report({empty, one});
  EXPECT_EQ(points_of(chart(both, "loss"), "empty"), 0);
  EXPECT_EQ(points_of(chart(both, "loss"), "one"), 1);
}

TEST(Report, NonFiniteValuesAreLeftOutAndBreakTheLines) {
  ReportRun run = synthetic("nan", 10, 0);
  run.records[4].loss = kNaN;
  run.records[4].loss_finite = false;
  run.records[6].loss = std::numeric_limits<double>::infinity();
  run.records[2].scale = std::numeric_limits<float>::infinity();
  run.records[3].scale = 0;  // not on a log axis
  run.records[5].act_grads.nonzero = 0;
  run.records[5].act_grads.underflow = 0;
  run.records[8].seconds = kNaN;
  const std::string html = render_report({run});
  const std::string loss = chart(html, "loss");
  EXPECT_EQ(points_of(loss, "nan"), 8);
  EXPECT_EQ(count(loss, "<polyline"), 2u);  // 1-4 and 8-10; the lone step 6 is a dot
  EXPECT_EQ(points_of(chart(html, "loss-scale"), "nan"), 8);
  EXPECT_EQ(points_of(chart(html, "underflow"), "nan"), 9);
  const std::regex bad("(points|cx|cy|x|y|width|height)=\"[^\"]*(nan|inf)", std::regex::icase);
  EXPECT_FALSE(std::regex_search(html, bad)) << "no NaN/inf coordinates";
}

TEST(Report, ManyTensorsAreGroupedByRole) {
  ReportRun run = synthetic("deep", 8, 0, 4);  // 4 layers x 5 roles = 20 tensors
  const std::string t = chart(render_report({run}), "tensors-0");
  EXPECT_EQ(points_of(t, "h\\*.mlp.fc.grad"), 8);
  EXPECT_EQ(points_of(t, "h\\*.attn.qkv.grad"), 8);
  EXPECT_EQ(points_of(t, "h\\*.ln1.grad"), 8) << "only the layer number is a wildcard";
  EXPECT_EQ(count(t, "class=\"series\""), 6u);

  ReportRun quiet = synthetic("quiet", 4, 0);
  for (StepRecord& r : quiet.records) {
    for (nn::TensorGradStats& x : r.act_grad_tensors) x.stats.underflow = 0;
    r.act_grads.underflow = 0;
  }
  const std::string html = render_report({quiet});
  EXPECT_TRUE(chart(html, "tensors-0").empty());
  EXPECT_NE(html.find("no activation-gradient value underflowed in 4 steps (5 tensors"), std::string::npos);

  ReportRun fp32 = synthetic("fp32", 4, 0);
  fp32.config[1].second = "fp32";
  for (StepRecord& r : fp32.records) {
    for (nn::TensorGradStats& x : r.act_grad_tensors) x.stats = {};
    r.act_grads = {};
  }
  EXPECT_NE(render_report({fp32}).find("activation gradients are stored in fp32 here"), std::string::npos);
}

// Preset layerwise: a section with a row per run and layer and each layer's chain per step;
// absent for runs without scaled layers.
TEST(Report, PerLayerScalingSection) {
  ReportRun plain = synthetic("plain", 6, 0);
  EXPECT_EQ(render_report({plain}).find("id=\"layerwise\""), std::string::npos);
  ReportRun lw = synthetic("lw", 6, 0);
  for (StepRecord& r : lw.records) {
    const bool hit = r.step == 4;
    r.layers = {{"h0.mlp.fc", 16, 64, 0, "applied"},
                {"h0.mlp.proj", 4, 4, r.step > 4 ? 1 : 0, hit ? "origin" : "applied"}};
  }
  const std::string html = render_report({plain, lw});
  ASSERT_NE(html.find("id=\"layerwise\""), std::string::npos);
  // lw's h0.mlp.proj: mean log2 chain 2, last chain 4, backoff 1, one overflow started there, one skipped step.
  EXPECT_NE(html.find("h0.mlp.proj</td><td>2</td><td>4</td><td>1</td><td>1</td><td>1</td>"), std::string::npos);
  EXPECT_NE(html.find("h0.mlp.fc</td><td>6</td><td>64</td><td>0</td><td>0</td><td>0</td>"), std::string::npos);
  const std::string c = chart(html, "layers-1");
  EXPECT_EQ(points_of(c, "h0.mlp.fc"), 6);
  EXPECT_EQ(points_of(c, "h0.mlp.proj"), 6);
  EXPECT_TRUE(chart(html, "layers-0").empty());
}

// The per-block statistics: absent without sampled statistics; with them, the activation
// kurtosis per layer, a row per tensor of its latest sampled step (what-if columns per recipe),
// and per tensor a band of its log2 multipliers (p01-p99, median) and its kurtosis over the
// sampled steps.
TEST(Report, PerBlockStatisticsSection) {
  ReportRun plain = synthetic("plain", 8, 0);
  EXPECT_EQ(render_report({plain}).find("id=\"blocks\""), std::string::npos);
  ReportRun q = synthetic("lowp", 8, 0);
  for (StepRecord& r : q.records) {
    for (const char* name : {"h0.mlp.fc.input", "h0.mlp.fc.weight", "h0.mlp.fc.grad_output", "h1.mlp.fc.input"}) {
      nn::Fp8TensorStats t;
      t.name = name;
      t.recipe = "mxfp8";
      t.elements = 6400;
      t.nonzero = 6400;
      t.flushed = 64;
      if (r.step % 2 == 0) {  // sampled every 2nd step: 4 samples
        lowp::BlockStats b;
        b.blocks = b.multiplier_blocks = 200;
        b.log2_multiplier_quantiles = {-3.0 - static_cast<double>(r.step), -2, -1, -0.5, 0, 1, 2};
        b.log2_multiplier_std = 0.25 * static_cast<double>(r.step);
        b.far_blocks = r.step;
        b.max_block_dynamic_range = 7.5;
        t.blocks = b;
        t.kurtosis = 3.0 * static_cast<double>(r.step);
        if (std::string_view(name) == "h0.mlp.fc.input")
          t.what_if = {{"nvfp4", lowp::Element::e2m1, 6400, 0, 640, 0.1, 400, 2, 1.0, -1.0, 1.0}};
      }
      r.fp8.push_back(t);
    }
  }
  const std::string html = render_report({plain, q});
  const std::size_t at = html.find("id=\"blocks\"");
  ASSERT_NE(at, std::string::npos);
  const std::string sec = html.substr(at, html.find("</section>", at) - at);
  // Activation kurtosis: one line per layer's input, a point per sampled step.
  const std::string k = chart(sec, "blocks-kurtosis-1");
  EXPECT_EQ(points_of(k, "h0.mlp.fc"), 4);
  EXPECT_EQ(points_of(k, "h1.mlp.fc"), 4);
  EXPECT_EQ(points_of(k, "h0.mlp.fc.weight"), -1);
  EXPECT_TRUE(chart(sec, "blocks-kurtosis-0").empty());
  // The table: the latest sampled step (8), every tensor, the what-if column.
  EXPECT_NE(sec.find("<th class=\"num\">what-if nvfp4 flushed</th>"), std::string::npos);
  EXPECT_NE(sec.find("<td class=\"name\">h0.mlp.fc.input</td><td>mxfp8</td><td class=\"num\">8</td>"
                     "<td class=\"num\">200</td><td class=\"num\">8 (4.00%)</td><td class=\"num\">-11 / -0.5 / 2</td>"
                     "<td class=\"num\">2</td><td class=\"num\">7.5 binades</td><td class=\"num\">24</td>"
                     "<td class=\"num\">1.00%</td><td class=\"num\">10.00%</td></tr>"),
            std::string::npos)
      << sec;
  EXPECT_NE(sec.find("<td class=\"name\">h0.mlp.fc.grad_output</td>"), std::string::npos);
  EXPECT_NE(sec.find("<td class=\"num\">1.00%</td><td class=\"num\">\u2013</td></tr>"), std::string::npos);
  // Small multiples: a band with its median, and the kurtosis, per tensor (4 tensors).
  for (int t = 0; t < 4; ++t) {
    const std::string band = chart(sec, "blocks-band-1-" + std::to_string(t));
    EXPECT_EQ(points_of(band, "p01\u2013p99", "area"), 4) << t;
    EXPECT_EQ(points_of(band, "median"), 4) << t;
    EXPECT_EQ(count(band, "<polygon"), 1u) << t;
    EXPECT_EQ(points_of(chart(sec, "blocks-k-1-" + std::to_string(t)), "kurtosis"), 4) << t;
  }
  EXPECT_TRUE(chart(sec, "blocks-band-1-4").empty());
}

TEST(Report, SkipRateIsARollingWindow) {
  ReportRun run = synthetic("skips", 6, 0);
  run.records[0].skipped = run.records[1].skipped = true;
  ReportOptions o;
  o.skip_window = 2;
  const std::string skip = chart(render_report({run}, o), "skip-rate");
  EXPECT_NE(skip.find("skipped steps, last 2"), std::string::npos);
  EXPECT_EQ(points_of(skip, "skips"), 6);
}

TEST(Report, RunNumbers) {
  const ReportRun run = synthetic("n", 10, 3);
  const RunNumbers n = run_numbers(run.records);
  EXPECT_EQ(n.steps, 10u);
  EXPECT_EQ(n.skipped, 1u);
  EXPECT_EQ(n.tokens, 640u);
  EXPECT_FLOAT_EQ(n.final_scale, 32768.f);
  ASSERT_TRUE(n.val_loss);
  EXPECT_DOUBLE_EQ(*n.val_loss, run.records[9].loss + 0.1);
  // underflow per step: s + 0 + 1 + 2 + 3 of 5000 nonzero.
  EXPECT_NEAR(n.underflow_fraction, (55.0 + 60.0) / 50000.0, 1e-12);
  EXPECT_NEAR(n.seconds, 0.1, 1e-12);
  EXPECT_NEAR(n.mean_step_ms, 10, 1e-9);
  const RunNumbers none = run_numbers({});
  EXPECT_EQ(none.steps, 0u);
  EXPECT_TRUE(std::isnan(none.final_loss));
}

TEST(Report, UniqueNames) {
  std::vector<ReportRun> runs(4);
  runs[0].name = runs[1].name = runs[2].name = "run";
  runs[0].config = {{"precision", "fp16"}, {"loss-scale", "dynamic"}};
  runs[1].config = {{"precision", "bf16"}, {"loss-scale", "none"}};
  runs[2].config = runs[1].config;
  runs[1].dir = "a/run";
  runs[3].name = "other";
  make_names_unique(runs);
  EXPECT_EQ(runs[0].name, "run (fp16, loss scale dynamic)");
  EXPECT_EQ(runs[1].name, "a/run");
  EXPECT_EQ(runs[2].name, "run (bf16, loss scale none)");
  EXPECT_EQ(runs[3].name, "other");
  std::vector<ReportRun> same(2);
  same[0].name = same[1].name = "x";
  make_names_unique(same);
  EXPECT_EQ(same[0].name, "x #1");
  EXPECT_EQ(same[1].name, "x #2");
}

TEST(Svg, EscapeAndNumbers) {
  EXPECT_EQ(svg::escape("<a href=\"x\">'&'</a>"), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
  EXPECT_EQ(svg::number(65504), "65504");
  EXPECT_EQ(svg::number(0.001), "0.001");
  EXPECT_EQ(svg::number(3.14159, 3), "3.14");
  EXPECT_EQ(svg::number(1.5e-7), "1.5e-7");
  EXPECT_EQ(svg::number(2e9), "2e9");
  EXPECT_EQ(svg::number(0), "0");
  EXPECT_EQ(svg::number(kNaN), "NaN");
}

TEST(Svg, LineChartAxesTicksAndLegend) {
  svg::LineChart c;
  c.id = "t";
  c.x = {"step", false, std::nullopt, std::nullopt, false, true};
  c.y = {"scale", true, std::nullopt, std::nullopt, false, false};
  svg::Series s;
  s.label = "a";
  s.steps = true;
  s.points = {{1, 1024}, {2, 1024}, {3, 512}, {4, 65536}};
  c.series.push_back(s);
  const std::string out = svg::render(c);
  EXPECT_NE(out.find(">2\u00b9\u2070</text>"), std::string::npos) << out;  // 2^10
  EXPECT_NE(out.find(">2\u00b9\u2076</text>"), std::string::npos);
  EXPECT_NE(out.find(">step</text>"), std::string::npos);
  EXPECT_NE(out.find(">a</text>"), std::string::npos);
  // A step line: each of the 3 later points adds a corner, so 4 + 3 vertices.
  const std::size_t p = out.find(" points=\"");
  ASSERT_NE(p, std::string::npos);
  const std::string pts = out.substr(p + 9, out.find('"', p + 9) - p - 9);
  EXPECT_EQ(count(pts, ","), 7u);

  // Thousands of points are thinned to a few per pixel column.
  svg::Series big;
  big.label = "big";
  for (int i = 0; i < 100000; ++i) big.points.push_back({static_cast<double>(i), std::sin(i * 0.01)});
  c.y.log2 = false;
  c.series = {big};
  const std::string thin = svg::render(c);
  EXPECT_LT(thin.size(), 80000u);
  EXPECT_NE(thin.find("data-points=\"100000\""), std::string::npos);
}

// ---- run folders ------------------------------------------------------------------------

class RunFolder : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mixprec-report-test-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "run");
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / "run" / name, std::ios::binary) << text;
  }
  std::string run() const { return (dir_ / "run").string(); }
  std::string error_of(const std::string& d) {
    try {
      load_run(d);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "no error";
  }
  fs::path dir_;
};

std::string log_text(std::size_t steps) {
  std::string out;
  const ReportRun r = synthetic("x", steps, 2);
  for (const StepRecord& s : r.records) out += train::step_record_json(s) + "\n";
  return out;
}

TEST_F(RunFolder, LoadsLogConfigAndAlerts) {
  write("log.jsonl", log_text(5));
  write("config.json", "{\"model\": \"gpt\", \"precision\": \"bf16\", \"inject-overflow-at\": [2, 4], \"lr\": 0.003}");
  ReportRun r = load_run(run());
  EXPECT_EQ(r.name, "run");
  EXPECT_EQ(r.records.size(), 5u);
  ASSERT_EQ(r.config.size(), 4u);
  EXPECT_EQ(r.config[0], (std::pair<std::string, std::string>{"model", "gpt"}));
  EXPECT_EQ(r.config[2].second, "2,4");
  EXPECT_EQ(r.config[3].second, "0.003");
  EXPECT_FALSE(r.alerts) << "no summary.json: not evaluated";
  EXPECT_EQ(load_run(run() + "/").name, "run");
  EXPECT_EQ(load_run(run(), "named").name, "named");

  write("summary.json", "{\"steps\": 5, \"alerts\": []}");
  r = load_run(run());
  ASSERT_TRUE(r.alerts);
  EXPECT_TRUE(r.alerts->empty());
  write("summary.json",
        "{\"alerts\": [{\"id\": \"skips\", \"step\": 2, \"last_step\": 4, \"steps\": 3, \"message\": \"m\", "
        "\"advice\": \"a\", "
        "\"severity\": \"warning\"},"
        " {\"id\": \"x\", \"step\": null, \"message\": \"n\"}]}");
  r = load_run(run());
  ASSERT_TRUE(r.alerts);
  ASSERT_EQ(r.alerts->size(), 2u);
  EXPECT_EQ((*r.alerts)[0].id, "skips");
  EXPECT_EQ((*r.alerts)[0].step, 2u);
  EXPECT_EQ((*r.alerts)[0].severity, "warning");
  EXPECT_EQ((*r.alerts)[0].last_step, 4u);
  EXPECT_EQ((*r.alerts)[0].steps, 3u);
  EXPECT_FALSE((*r.alerts)[1].step);
  EXPECT_EQ((*r.alerts)[1].advice, "");
}

TEST_F(RunFolder, ClearErrors) {
  EXPECT_EQ(error_of((dir_ / "nope").string()), "run folder '" + (dir_ / "nope").string() + "' does not exist");
  EXPECT_NE(error_of(run()).find("has no log.jsonl: not a run folder"), std::string::npos);
  write("file", "x");
  EXPECT_NE(error_of(run() + "/file").find("is not a folder"), std::string::npos);
  std::string log = log_text(3);
  log.insert(log.find('\n') + 1, "{\"step\": 2, \"lr\": \n");
  write("log.jsonl", log);
  EXPECT_NE(error_of(run()).find("log.jsonl:2: malformed JSON"), std::string::npos) << error_of(run());
  write("log.jsonl", log_text(3));
  write("config.json", "{\"model\": ");
  EXPECT_NE(error_of(run()).find("config.json': malformed JSON"), std::string::npos) << error_of(run());
  write("config.json", "{}");
  write("summary.json", "{\"alerts\": {}}");
  EXPECT_NE(error_of(run()).find("summary.json': alerts: expected an array"), std::string::npos);
}

TEST_F(RunFolder, WriteReportLeavesNoPartialFile) {
  write("log.jsonl", log_text(3));
  const std::vector<ReportRun> runs = {load_run(run())};
  const fs::path out = dir_ / "report.html";
  write_report(out.string(), runs);
  std::ifstream in(out, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  const std::string html = text.str();
  EXPECT_EQ(html, render_report(runs));
  EXPECT_THROW(write_report((dir_ / "missing" / "r.html").string(), runs), std::runtime_error);
  EXPECT_FALSE(fs::exists(dir_ / "missing"));
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 2u) << "run/ and report.html, no temporary left";
}

// summary.json's "optimizer_state" (mixprec.torch.Telemetry(optimizer=)): read, checked, and shown
// as the "Optimizer state" section; its mean lost-update fraction is the run's.
TEST_F(RunFolder, OptimizerStateSection) {
  write("log.jsonl", log_text(4));
  std::string params;
  for (int i = 0; i < 8; ++i)  // w0..w7: error 0.001 * i, lost 0.01 * (7 - i); "small" is fp32, exact
    params += "{\"name\": \"w" + std::to_string(i) + "\", \"elements\": 8192, \"master\": \"none\", \"m\": \"8bit\", "
              "\"v\": \"8bit\", \"steps\": 2, \"m_error\": " + std::to_string(0.001 * i) + ", \"m_error_max\": 0.5, "
              "\"v_error\": 0.0001, \"v_error_max\": 0.0002, \"lost_fraction\": " + std::to_string(0.01 * (7 - i)) +
              ", \"meant\": 16384},";
  params += "{\"name\": \"small<b>\", \"elements\": 96, \"master\": \"none\", \"m\": \"fp32\", \"v\": \"fp32\", "
            "\"steps\": 2, \"m_error\": 0, \"m_error_max\": 0, \"v_error\": 0, \"v_error_max\": 0, "
            "\"lost_fraction\": 0, \"meant\": 192},"
            "{\"name\": \"frozen\", \"elements\": 10, \"master\": \"none\", \"m\": \"fp32\", \"v\": \"fp32\"}";
  const std::string state =
      "{\"optimizer\": \"mixprec.torch.optim.AdamW\", \"formats\": [{\"tensors\": 10, \"master\": \"none\", "
      "\"m\": \"8bit\", \"v\": \"8bit\", \"block\": 0, \"rule\": \"torch\"}], \"elements\": 65642, "
      "\"bytes_per_param\": {\"params\": 2.0, \"master\": 0.0, \"m\": 1.0625, \"v\": 1.0625}, \"sampled_steps\": 2, "
      "\"lost_update_fraction\": 0.375, \"params\": [" + params + "]}";
  write("summary.json", "{\"steps\": 4, \"lost_update_fraction\": 0.375, \"alerts\": [], \"optimizer_state\": " +
                            state + "}");
  const ReportRun r = load_run(run());
  ASSERT_TRUE(r.optimizer);
  const ReportOptimizerState& s = *r.optimizer;
  EXPECT_EQ(s.optimizer, "mixprec.torch.optim.AdamW");
  ASSERT_EQ(s.formats.size(), 1u);
  EXPECT_EQ(s.formats[0][1], (std::pair<std::string, std::string>{"master", "none"}));
  EXPECT_EQ(s.formats[0][4].second, "0");
  EXPECT_EQ(s.m_bytes, 1.0625);
  EXPECT_EQ(s.sampled_steps, 2u);
  ASSERT_TRUE(s.lost_update_fraction);
  EXPECT_EQ(*s.lost_update_fraction, 0.375);
  ASSERT_EQ(s.tensors.size(), 10u);
  EXPECT_EQ(s.tensors[3].m_error, 0.003);
  EXPECT_EQ(s.tensors[3].meant, 16384u);
  EXPECT_EQ(s.tensors[9].steps, 0u);
  EXPECT_TRUE(std::isnan(s.tensors[9].m_error)) << "not measured";

  const std::string html = render_report({r});
  const std::size_t at = html.find("<section id=\"optimizer\"><h2>Optimizer state</h2>");
  ASSERT_NE(at, std::string::npos);
  const std::string sec = html.substr(at, html.find("</section>", at) - at);
  EXPECT_NE(sec.find("master <b>none</b>, m <b>8bit</b>, v <b>8bit</b>"), std::string::npos) << sec;
  EXPECT_NE(sec.find("2.12 <small>B/param</small>"), std::string::npos) << "master + m + v";
  EXPECT_NE(sec.find("37.50%"), std::string::npos);
  // The error table: w7 first, six rows, the exact fp32 tensor and the unmeasured one left out.
  const std::size_t err = sec.find("Largest moment quantization error"), lost = sec.find("Most lost updates");
  ASSERT_TRUE(err != std::string::npos && lost != std::string::npos && err < lost);
  const std::string err_table = sec.substr(err, lost - err), lost_table = sec.substr(lost);
  EXPECT_NE(err_table.find("the 6 largest of 8 tensors above 0 (of 9 measured)"), std::string::npos) << err_table;
  EXPECT_LT(err_table.find("<code>w7</code>"), err_table.find("<code>w6</code>"));
  EXPECT_EQ(count(err_table, "<tr><td class=\"name\">"), 6u);
  EXPECT_EQ(err_table.find("<code>w1</code>"), std::string::npos) << "the seventh is cut";
  EXPECT_EQ(err_table.find("small"), std::string::npos);
  EXPECT_EQ(err_table.find("frozen"), std::string::npos);
  // The lost table: w0 first (7%, a warning), the run's mean in the summary tiles.
  EXPECT_LT(lost_table.find("<code>w0</code>"), lost_table.find("<code>w1</code>"));
  EXPECT_NE(lost_table.find("class=\"num warn\" title=\"16,384 meant to move\">7.00%"), std::string::npos);
  const std::size_t summary = html.find("<section id=\"summary\">");
  EXPECT_EQ(html.find("lost updates</div><div class=\"value\">37.50%", summary),
            html.find("lost updates</div><div class=\"value\">", summary))
      << "the summary's tile shows the optimizer's measurement, not the log's 0";
  EXPECT_EQ(html.find("small<b>"), std::string::npos) << "names are escaped";

  // Every lost fraction 0: a line that says so instead of a table of zeros.
  std::string none = state;
  for (int i = 0; i < 8; ++i) {
    const std::string from = "\"lost_fraction\": " + std::to_string(0.01 * (7 - i));
    none.replace(none.find(from), from.size(), "\"lost_fraction\": 0");
  }
  write("summary.json", "{\"optimizer_state\": " + none + "}");
  EXPECT_NE(render_report({load_run(run())}).find("No update was lost at the sampled steps"), std::string::npos);

  write("summary.json", "{\"optimizer_state\": {\"params\": [{\"name\": \"w\", \"m_error\": \"big\"}]}}");
  EXPECT_NE(error_of(run()).find("summary.json': optimizer_state.params[0].m_error: expected a number, found \"big\""),
            std::string::npos)
      << error_of(run());
  write("summary.json", "{\"alerts\": []}");
  EXPECT_FALSE(load_run(run()).optimizer);
  EXPECT_EQ(render_report({load_run(run())}).find("id=\"optimizer\""), std::string::npos) << "no section without one";
}

}  // namespace
}  // namespace mixprec::monitor
