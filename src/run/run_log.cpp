// Run-log lines and the run summary as JSON (see run_log.hpp).
#include "mixprec/run/run_log.hpp"
#include "mixprec/core/io.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <iterator>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace mixprec::train {
namespace {

using json = nlohmann::json;

// Writes one JSON object field by field; doubles and floats in their shortest exact
// text, non-finite numbers as null.
class ObjectWriter {
 public:
  explicit ObjectWriter(std::string& out) : out_(out) { out_ += '{'; }
  void close() { out_ += '}'; }

  void key(std::string_view k) {
    if (!first_) out_ += ',';
    first_ = false;
    out_ += '"';
    out_ += k;
    out_ += "\":";
  }
  void field(std::string_view k, std::uint64_t v) {
    key(k);
    out_ += std::to_string(v);
  }
  void field(std::string_view k, bool v) {
    key(k);
    out_ += v ? "true" : "false";
  }
  void field(std::string_view k, double v) {
    key(k);
    append_number(v);
  }
  void field(std::string_view k, float v) {
    key(k);
    append_number(v);
  }
  void field(std::string_view k, std::string_view v) {
    key(k);
    out_ += json(std::string(v)).dump(-1, ' ', false, json::error_handler_t::replace);
  }
  void field(std::string_view k, const char* v) { field(k, std::string_view(v)); }
  void raw(std::string_view k, std::string_view text) {
    key(k);
    out_ += text;
  }

 private:
  template <class T>
  void append_number(T v) {
    if (!std::isfinite(v)) {
      out_ += "null";
      return;
    }
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    out_.append(buf, r.ptr);
  }

  std::string& out_;
  bool first_ = true;
};

std::string conversion_stats_json(const ConversionStats& s) {
  std::string out;
  ObjectWriter w(out);
  w.field("elements", s.elements);
  w.field("nonzero", s.nonzero);
  w.field("underflow", s.underflow);
  w.field("subnormal", s.subnormal);
  w.field("overflow", s.overflow);
  w.field("nonfinite_input", s.nonfinite_input);
  w.close();
  return out;
}

std::string histogram_json(const nn::Log2Histogram& h) {
  std::string out = "{\"counts\":[";
  for (std::size_t i = 0; i < h.counts.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(h.counts[i]);
  }
  out += "],\"zeros\":" + std::to_string(h.zeros) + ",\"nonfinite\":" + std::to_string(h.nonfinite) + "}";
  return out;
}

// Telemetry lists: one object per tensor.
std::string tensors_json(const std::vector<nn::TensorGradStats>& ts) {
  std::string out = "[";
  for (std::size_t i = 0; i < ts.size(); ++i) {
    if (i > 0) out += ',';
    ObjectWriter w(out);
    w.field("name", ts[i].name);
    w.field("elements", ts[i].stats.elements);
    w.field("nonzero", ts[i].stats.nonzero);
    w.field("underflow", ts[i].stats.underflow);
    w.field("subnormal", ts[i].stats.subnormal);
    w.field("overflow", ts[i].stats.overflow);
    w.field("nonfinite_input", ts[i].stats.nonfinite_input);
    w.field("amax", ts[i].amax);
    w.close();
  }
  return out + "]";
}

std::string params_json(const std::vector<StepRecord::ParamStats>& ps) {
  std::string out = "[";
  for (std::size_t i = 0; i < ps.size(); ++i) {
    if (i > 0) out += ',';
    ObjectWriter w(out);
    w.field("name", ps[i].name);
    w.field("grad_amax", ps[i].grad_amax);
    w.field("weight_amax", ps[i].weight_amax);
    w.close();
  }
  return out + "]";
}

// A low-precision tensor's element format as the log's "dtype" names it.
std::string_view element_dtype(lowp::Element e) noexcept {
  switch (e) {
    case lowp::Element::e4m3: return "E4M3";
    case lowp::Element::e5m2: return "E5M2";
    case lowp::Element::e2m1: return "E2M1";
  }
  return "?";
}

// A sampled tensor's lowp::block_stats (docs/telemetry.md, "fp8 and low-precision tensors").
std::string blocks_json(const lowp::BlockStats& b) {
  std::string out;
  ObjectWriter w(out);
  w.field("blocks", b.blocks);
  w.field("multiplier_blocks", b.multiplier_blocks);
  w.field("multiplier_left_out", b.multiplier_left_out);
  w.field("log2_multiplier_min", b.log2_multiplier_min);
  w.field("log2_multiplier_max", b.log2_multiplier_max);
  w.field("log2_multiplier_mean", b.log2_multiplier_mean);
  w.field("log2_multiplier_std", b.log2_multiplier_std);
  std::string q;
  ObjectWriter wq(q);
  const lowp::BlockQuantiles& p = b.log2_multiplier_quantiles;
  wq.field("p01", p.p01);
  wq.field("p05", p.p05);
  wq.field("p25", p.p25);
  wq.field("p50", p.p50);
  wq.field("p75", p.p75);
  wq.field("p95", p.p95);
  wq.field("p99", p.p99);
  wq.close();
  w.raw("log2_multiplier_quantiles", q);
  w.field("flushed", b.flushed);
  w.field("saturated", b.saturated);
  w.field("blocks_with_flush", b.blocks_with_flush);
  w.field("blocks_with_saturation", b.blocks_with_saturation);
  w.field("max_flushed_fraction", b.max_flushed_fraction);
  w.field("max_saturated_fraction", b.max_saturated_fraction);
  w.field("tensor_amax", b.tensor_amax);  // null: inf
  w.field("far_log2", b.far_log2);
  w.field("far_blocks", b.far_blocks);
  w.field("zero_blocks", b.zero_blocks);
  w.field("dynamic_range", b.dynamic_range);
  w.field("max_block_dynamic_range", b.max_block_dynamic_range);
  w.close();
  return out;
}

std::string what_if_json(const std::vector<nn::Fp8WhatIf>& ws) {
  std::string out = "[";
  for (std::size_t i = 0; i < ws.size(); ++i) {
    if (i > 0) out += ',';
    const nn::Fp8WhatIf& x = ws[i];
    ObjectWriter w(out);
    w.field("recipe", x.recipe);
    w.field("dtype", element_dtype(x.element));
    w.field("elements", x.elements);
    w.field("saturated", x.saturated);
    w.field("flushed", x.flushed);
    if (x.rel_rms_error) w.field("rel_rms_error", *x.rel_rms_error);
    w.field("blocks", x.blocks);
    w.field("far_blocks", x.far_blocks);
    w.field("log2_multiplier_std", x.log2_multiplier_std);
    w.field("log2_multiplier_p01", x.log2_multiplier_p01);
    w.field("log2_multiplier_p99", x.log2_multiplier_p99);
    w.close();
  }
  return out + "]";
}

// fp8 tensors (fp8 presets, low-precision recipes): one compact object per tensor.
std::string fp8_json(const std::vector<nn::Fp8TensorStats>& ts) {
  std::string out = "[";
  for (std::size_t i = 0; i < ts.size(); ++i) {
    if (i > 0) out += ',';
    ObjectWriter w(out);
    w.field("name", ts[i].name);
    w.field("role", lowp::role_name(ts[i].role));
    if (ts[i].recipe.empty()) {
      w.field("dtype", lowp::element_label(ts[i].dtype));
    } else {
      w.field("recipe", ts[i].recipe);
      w.field("dtype", element_dtype(ts[i].element));
    }
    w.field("scale", ts[i].scale);
    w.field("amax", ts[i].amax);
    w.field("elements", ts[i].elements);
    w.field("nonzero", ts[i].nonzero);
    w.field("saturated", ts[i].saturated);
    w.field("flushed", ts[i].flushed);
    if (ts[i].rel_rms_error) w.field("rel_rms_error", *ts[i].rel_rms_error);
    if (ts[i].kurtosis) w.field("kurtosis", *ts[i].kurtosis);
    if (ts[i].blocks) w.raw("blocks", blocks_json(*ts[i].blocks));
    if (!ts[i].what_if.empty()) w.raw("what_if", what_if_json(ts[i].what_if));
    w.close();
  }
  return out + "]";
}

// Per-layer loss scaling (preset layerwise): one object per scaled layer.
std::string layers_json(const std::vector<StepRecord::LayerScale>& ls) {
  std::string out = "[";
  for (std::size_t i = 0; i < ls.size(); ++i) {
    if (i > 0) out += ',';
    ObjectWriter w(out);
    w.field("name", ls[i].name);
    w.field("factor", ls[i].factor);
    w.field("chain", ls[i].chain);
    w.field("backoff", static_cast<std::uint64_t>(ls[i].backoff));
    w.field("outcome", ls[i].outcome);
    w.close();
  }
  return out + "]";
}

// The optimizer state at a sampled step: one object per tensor, the schema of the Python door's
// optimizer.jsonl "params" (docs/telemetry.md, "Optimizer state").
std::string state_json(const std::vector<StepRecord::StateStats>& ts) {
  std::string out = "[";
  for (std::size_t i = 0; i < ts.size(); ++i) {
    if (i > 0) out += ',';
    ObjectWriter w(out);
    w.field("name", ts[i].name);
    w.field("m_error", ts[i].m_error);
    w.field("v_error", ts[i].v_error);
    w.field("lost_fraction",
            ts[i].meant > 0 ? static_cast<double>(ts[i].lost) / static_cast<double>(ts[i].meant) : 0.0);
    w.field("meant", ts[i].meant);
    w.close();
  }
  return out + "]";
}

[[noreturn]] void bad(std::string_view key, std::string_view what, const json& v) {
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  throw std::invalid_argument(std::string(key) + ": expected " + std::string(what) + ", found " +
                              (v.is_number() || v.is_null() ? text : std::string(v.type_name()) + " " + text));
}

const json& require(const json& obj, std::string_view key) {
  const auto it = obj.find(key);
  if (it == obj.end()) throw std::invalid_argument(std::string(key) + ": missing");
  return *it;
}

std::uint64_t get_uint(const json& obj, std::string_view key) {
  const json& v = require(obj, key);
  if (!v.is_number_unsigned()) bad(key, "a non-negative integer", v);
  return v.get<std::uint64_t>();
}

bool get_bool(const json& obj, std::string_view key) {
  const json& v = require(obj, key);
  if (!v.is_boolean()) bad(key, "true or false", v);
  return v.get<bool>();
}

// A number, or null for a value that was not finite (read back as NaN).
double get_number(const json& obj, std::string_view key, bool nullable) {
  const json& v = require(obj, key);
  if (v.is_null() && nullable) return std::numeric_limits<double>::quiet_NaN();
  if (!v.is_number()) bad(key, nullable ? "a number or null" : "a number", v);
  return v.get<double>();
}

float get_float(const json& obj, std::string_view key) {
  const double d = get_number(obj, key, true);
  if (std::isfinite(d) && std::fabs(d) > static_cast<double>(std::numeric_limits<float>::max()))
    bad(key, "a number float32 holds", require(obj, key));
  return static_cast<float>(d);
}

std::string get_string(const json& obj, std::string_view key) {
  const json& v = require(obj, key);
  if (!v.is_string()) bad(key, "a string", v);
  return v.get<std::string>();
}

// f() with the errors of a nested object's keys prefixed by where the object is ("fp8[].blocks.").
template <class F>
auto within(std::string_view where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(where).append(e.what()));
  }
}

// A low-precision entry's "dtype": E4M3, E5M2 or E2M1.
std::optional<lowp::Element> dtype_element(std::string_view dtype) {
  for (const lowp::Element e : {lowp::Element::e4m3, lowp::Element::e5m2, lowp::Element::e2m1})
    if (element_dtype(e) == dtype) return e;
  return std::nullopt;
}

// A sampled tensor's "blocks" (blocks_json); the rules across fields are sampled_stats_problem's.
lowp::BlockStats parse_blocks(const json& o) {
  if (!o.is_object()) bad("fp8[].blocks", "an object", o);
  return within("fp8[].blocks.", [&] {
    lowp::BlockStats b;
    b.blocks = get_uint(o, "blocks");
    b.multiplier_blocks = get_uint(o, "multiplier_blocks");
    b.multiplier_left_out = get_uint(o, "multiplier_left_out");
    b.log2_multiplier_min = get_number(o, "log2_multiplier_min", false);
    b.log2_multiplier_max = get_number(o, "log2_multiplier_max", false);
    b.log2_multiplier_mean = get_number(o, "log2_multiplier_mean", false);
    b.log2_multiplier_std = get_number(o, "log2_multiplier_std", false);
    const json& q = require(o, "log2_multiplier_quantiles");
    if (!q.is_object()) bad("log2_multiplier_quantiles", "an object", q);
    within("log2_multiplier_quantiles.", [&] {
      lowp::BlockQuantiles& p = b.log2_multiplier_quantiles;
      p.p01 = get_number(q, "p01", false);
      p.p05 = get_number(q, "p05", false);
      p.p25 = get_number(q, "p25", false);
      p.p50 = get_number(q, "p50", false);
      p.p75 = get_number(q, "p75", false);
      p.p95 = get_number(q, "p95", false);
      p.p99 = get_number(q, "p99", false);
    });
    b.flushed = get_uint(o, "flushed");
    b.saturated = get_uint(o, "saturated");
    b.blocks_with_flush = get_uint(o, "blocks_with_flush");
    b.blocks_with_saturation = get_uint(o, "blocks_with_saturation");
    b.max_flushed_fraction = get_number(o, "max_flushed_fraction", false);
    b.max_saturated_fraction = get_number(o, "max_saturated_fraction", false);
    const float amax = get_float(o, "tensor_amax");  // null: an inf value
    b.tensor_amax = std::isnan(amax) ? std::numeric_limits<float>::infinity() : amax;
    b.far_log2 = get_number(o, "far_log2", false);
    b.far_blocks = get_uint(o, "far_blocks");
    b.zero_blocks = get_uint(o, "zero_blocks");
    b.dynamic_range = get_number(o, "dynamic_range", false);
    b.max_block_dynamic_range = get_number(o, "max_block_dynamic_range", false);
    return b;
  });
}

// A sampled tensor's "what_if" array (what_if_json).
std::vector<nn::Fp8WhatIf> parse_what_if(const json& a) {
  if (!a.is_array()) bad("fp8[].what_if", "an array", a);
  std::vector<nn::Fp8WhatIf> out;
  for (const json& o : a) {
    if (!o.is_object()) bad("fp8[].what_if[]", "an object", o);
    out.push_back(within("fp8[].what_if[].", [&] {
      nn::Fp8WhatIf w;
      w.recipe = get_string(o, "recipe");
      if (!lowp::parse_recipe(w.recipe)) bad("recipe", "one of " + lowp::recipe_names(), o["recipe"]);
      const std::optional<lowp::Element> e = dtype_element(get_string(o, "dtype"));
      if (!e) bad("dtype", "E4M3, E5M2 or E2M1", o["dtype"]);
      w.element = *e;
      w.elements = get_uint(o, "elements");
      w.saturated = get_uint(o, "saturated");
      w.flushed = get_uint(o, "flushed");
      if (o.contains("rel_rms_error")) w.rel_rms_error = get_number(o, "rel_rms_error", false);
      w.blocks = get_uint(o, "blocks");
      w.far_blocks = get_uint(o, "far_blocks");
      w.log2_multiplier_std = get_number(o, "log2_multiplier_std", false);
      w.log2_multiplier_p01 = get_number(o, "log2_multiplier_p01", false);
      w.log2_multiplier_p99 = get_number(o, "log2_multiplier_p99", false);
      return w;
    }));
  }
  return out;
}

// Telemetry fields are optional (logs written before they existed stay readable);
// when present they are validated like the rest. null amax means non-finite (inf).
void parse_telemetry(const json& j, StepRecord& r) {
  auto amax = [](const json& obj, std::string_view key) {
    const double d = get_number(obj, key, true);
    return std::isnan(d) ? std::numeric_limits<float>::infinity() : static_cast<float>(d);
  };
  if (j.contains("act_grad_amax")) r.act_grad_amax = amax(j, "act_grad_amax");
  if (j.contains("headroom_log2")) {
    const double h = get_number(j, "headroom_log2", true);
    r.headroom_log2 = std::isnan(h) ? std::numeric_limits<double>::infinity() : h;
  }
  if (j.contains("act_grad_tensors")) {
    const json& a = j["act_grad_tensors"];
    if (!a.is_array()) bad("act_grad_tensors", "an array", a);
    for (const json& t : a) {
      if (!t.is_object()) bad("act_grad_tensors[]", "an object", t);
      nn::TensorGradStats g;
      g.name = get_string(t, "name");
      g.stats.elements = get_uint(t, "elements");
      g.stats.nonzero = get_uint(t, "nonzero");
      g.stats.underflow = get_uint(t, "underflow");
      g.stats.subnormal = get_uint(t, "subnormal");
      g.stats.overflow = get_uint(t, "overflow");
      g.stats.nonfinite_input = get_uint(t, "nonfinite_input");
      g.amax = amax(t, "amax");
      r.act_grad_tensors.push_back(std::move(g));
    }
  }
  if (j.contains("layers")) {
    const json& a = j["layers"];
    if (!a.is_array()) bad("layers", "an array", a);
    for (const json& t : a) {
      if (!t.is_object()) bad("layers[]", "an object", t);
      StepRecord::LayerScale l;
      l.name = get_string(t, "name");
      l.factor = get_number(t, "factor", false);
      l.chain = get_number(t, "chain", false);
      l.backoff = static_cast<std::int64_t>(get_uint(t, "backoff"));
      l.outcome = get_string(t, "outcome");
      if (!(l.factor > 0) || !(l.chain > 0)) bad("layers[].factor", "numbers > 0", t);
      if (l.outcome != "applied" && l.outcome != "origin" && l.outcome != "victim")
        bad("layers[].outcome", "applied, origin or victim", t["outcome"]);
      r.layers.push_back(std::move(l));
    }
  }
  if (j.contains("optimizer_state")) {
    const json& a = j["optimizer_state"];
    if (!a.is_array()) bad("optimizer_state", "an array", a);
    for (const json& t : a) {
      if (!t.is_object()) bad("optimizer_state[]", "an object", t);
      StepRecord::StateStats x;
      x.name = get_string(t, "name");
      x.m_error = get_number(t, "m_error", true);
      x.v_error = get_number(t, "v_error", true);
      x.meant = get_uint(t, "meant");
      const double f = get_number(t, "lost_fraction", false);
      if (!(f >= 0 && f <= 1)) bad("optimizer_state[].lost_fraction", "a number in [0, 1]", t["lost_fraction"]);
      x.lost = static_cast<std::uint64_t>(std::llround(f * static_cast<double>(x.meant)));
      r.optimizer_state.push_back(std::move(x));
    }
  }
  if (j.contains("params")) {
    const json& a = j["params"];
    if (!a.is_array()) bad("params", "an array", a);
    for (const json& t : a) {
      if (!t.is_object()) bad("params[]", "an object", t);
      r.params.push_back({get_string(t, "name"), amax(t, "grad_amax"), amax(t, "weight_amax")});
    }
  }
  if (j.contains("fp8")) {
    const json& a = j["fp8"];
    if (!a.is_array()) bad("fp8", "an array", a);
    for (const json& t : a) {
      if (!t.is_object()) bad("fp8[]", "an object", t);
      nn::Fp8TensorStats f;
      f.name = get_string(t, "name");
      const std::string role = get_string(t, "role"), dtype = get_string(t, "dtype");
      if (role == lowp::role_name(lowp::Role::forward)) f.role = lowp::Role::forward;
      else if (role == lowp::role_name(lowp::Role::backward)) f.role = lowp::Role::backward;
      else bad("fp8[].role", "forward or backward", t["role"]);
      if (t.contains("recipe")) {  // a low-precision recipe's tensor: any element format
        f.recipe = get_string(t, "recipe");
        if (!lowp::parse_recipe(f.recipe)) bad("fp8[].recipe", "one of " + lowp::recipe_names(), t["recipe"]);
        const lowp::Element elements[] = {lowp::Element::e4m3, lowp::Element::e5m2, lowp::Element::e2m1};
        const auto* e = std::find_if(std::begin(elements), std::end(elements),
                                     [&](lowp::Element x) { return element_dtype(x) == dtype; });
        if (e == std::end(elements)) bad("fp8[].dtype", "E4M3, E5M2 or E2M1", t["dtype"]);
        f.element = *e;
        f.dtype = *e == lowp::Element::e5m2 ? lowp::Element::e5m2 : lowp::Element::e4m3;
      } else if (dtype == lowp::element_label(lowp::Element::e4m3)) {
        f.dtype = lowp::Element::e4m3;
      } else if (dtype == lowp::element_label(lowp::Element::e5m2)) {
        f.dtype = lowp::Element::e5m2;
      } else {
        bad("fp8[].dtype", "E4M3 or E5M2 (E2M1 only with a recipe)", t["dtype"]);
      }
      const double scale = get_number(t, "scale", false);
      if (!(scale >= 0)) bad("fp8[].scale", "a number >= 0", t["scale"]);
      f.scale = static_cast<float>(scale);
      f.amax = amax(t, "amax");
      f.elements = get_uint(t, "elements");
      f.nonzero = get_uint(t, "nonzero");
      f.saturated = get_uint(t, "saturated");
      f.flushed = get_uint(t, "flushed");
      if (t.contains("rel_rms_error")) {
        const double e = get_number(t, "rel_rms_error", false);
        if (!(e >= 0)) bad("fp8[].rel_rms_error", "a number >= 0", t["rel_rms_error"]);
        f.rel_rms_error = e;
      }
      if (!f.counts_consistent()) bad("fp8[].elements", nn::Fp8TensorStats::kElementsRule, t["elements"]);
      // The sampled steps' statistics (absent at the others).
      if (t.contains("kurtosis")) f.kurtosis = within("fp8[].", [&] { return get_number(t, "kurtosis", false); });
      if (t.contains("blocks")) f.blocks = parse_blocks(t["blocks"]);
      if (t.contains("what_if")) f.what_if = parse_what_if(t["what_if"]);
      if (const std::optional<FieldProblem> p = sampled_stats_problem(f))
        throw std::invalid_argument("fp8[]." + p->field + ": expected " + p->rule + ", found " + text::num(p->found));
      r.fp8.push_back(std::move(f));
    }
  }
  if (j.contains("histograms")) {
    const json& h = j["histograms"];
    if (!h.is_object()) bad("histograms", "an object", h);
    if (get_number(h, "min_exp", false) != nn::Log2Histogram::kMinExp) {
      bad("histograms.min_exp", std::to_string(nn::Log2Histogram::kMinExp), h["min_exp"]);
    }
    auto one = [&](const char* key, nn::Log2Histogram& out) {
      const json& o = require(h, key);
      if (!o.is_object()) bad(key, "an object", o);
      const json& c = require(o, "counts");
      if (!c.is_array() || c.size() != out.counts.size()) {
        bad(key, "counts: an array of " + std::to_string(out.counts.size()) + " integers", c);
      }
      for (std::size_t i = 0; i < c.size(); ++i) {
        if (!c[i].is_number_unsigned()) bad(key, "non-negative integer counts", c[i]);
        out.counts[i] = c[i].get<std::uint64_t>();
      }
      out.zeros = get_uint(o, "zeros");
      out.nonfinite = get_uint(o, "nonfinite");
    };
    StepRecord::Histograms hs;
    one("activations", hs.activations);
    one("activation_grads", hs.activation_grads);
    one("weight_grads", hs.weight_grads);
    one("weights", hs.weights);
    r.histograms = std::move(hs);
  }
}

}  // namespace

std::string step_record_json(const StepRecord& r) {
  std::string out;
  out.reserve(640);
  ObjectWriter w(out);
  w.field("step", r.step);
  w.field("lr", r.lr);
  w.field("loss", r.loss);
  w.field("loss_finite", r.loss_finite);
  w.field("forward_nonfinite", r.forward_nonfinite);
  w.field("scale", r.scale);
  w.field("next_scale", r.next_scale);
  w.field("found_inf", r.found_inf);
  w.field("skipped", r.skipped);
  w.field("skip_reason", skip_reason_name(skip_reason_of(r)));
  if (!std::isnan(r.loss_z)) w.field("loss_z", r.loss_z);
  if (!std::isnan(r.grad_z)) w.field("grad_z", r.grad_z);
  w.field("injected", r.injected);
  w.field("grad_norm", r.grad_norm);
  w.field("clip_coef", r.clip_coef);
  w.field("overflow_param", r.overflow_param);
  w.field("overflow_activation", r.overflow_activation);
  w.raw("act_grads", conversion_stats_json(r.act_grads));
  w.field("lost_update_fraction", r.lost_update_fraction);
  w.field("tokens", r.tokens);
  w.field("seconds", r.seconds);
  w.field("scaler_seconds", r.scaler_seconds);
  if (r.val_loss) w.field("val_loss", *r.val_loss);
  if (r.val_loss_ema) w.field("val_loss_ema", *r.val_loss_ema);
  if (!r.recipe_phase.empty()) w.field("recipe_phase", r.recipe_phase);
  
  // Telemetry (docs/telemetry.md); non-finite amax values are written as null.
  w.field("act_grad_amax", r.act_grad_amax);
  w.field("headroom_log2", r.headroom_log2);
  w.raw("act_grad_tensors", tensors_json(r.act_grad_tensors));
  w.raw("params", params_json(r.params));
  if (!r.fp8.empty()) w.raw("fp8", fp8_json(r.fp8));
  if (!r.layers.empty()) w.raw("layers", layers_json(r.layers));
  if (!r.optimizer_state.empty()) w.raw("optimizer_state", state_json(r.optimizer_state));
  if (r.histograms) {
    const StepRecord::Histograms& h = *r.histograms;
    w.raw("histograms", "{\"min_exp\":" + std::to_string(nn::Log2Histogram::kMinExp) +
                            ",\"activations\":" + histogram_json(h.activations) +
                            ",\"activation_grads\":" + histogram_json(h.activation_grads) +
                            ",\"weight_grads\":" + histogram_json(h.weight_grads) +
                            ",\"weights\":" + histogram_json(h.weights) + "}");
  }
  w.close();
  return out;
}

StepRecord parse_step_record(std::string_view line) {
  const json j = io::parse_json(line, "");  // the reader names the file and line
  if (!j.is_object()) throw std::invalid_argument("expected a JSON object, found " + std::string(j.type_name()));
  StepRecord r;
  r.step = get_uint(j, "step");
  if (r.step == 0) throw std::invalid_argument("step: expected an integer >= 1, found 0");
  r.lr = get_number(j, "lr", true);
  r.loss = get_number(j, "loss", true);
  r.loss_finite = get_bool(j, "loss_finite");
  r.forward_nonfinite = get_string(j, "forward_nonfinite");
  r.scale = get_float(j, "scale");
  r.next_scale = get_float(j, "next_scale");
  r.found_inf = get_bool(j, "found_inf");
  r.skipped = get_bool(j, "skipped");
  // The skip reason (logs written before the step guards have none: an overflow was the
  // only reason a step was skipped).
  if (j.contains("skip_reason")) {
    const std::string reason = get_string(j, "skip_reason");
    const std::optional<SkipReason> parsed = parse_skip_reason(reason);
    if (!parsed) {
      std::vector<std::string> names;
      for (std::string_view n : skip_reason_names()) names.emplace_back(n);
      bad("skip_reason", keys::join(names), j["skip_reason"]);
    }
    r.skip_reason = *parsed;
  } else {
    r.skip_reason = r.skipped ? SkipReason::nonfinite_grad : SkipReason::none;
  }
  if ((r.skip_reason != SkipReason::none) != r.skipped)
    bad("skip_reason", r.skipped ? "a reason other than none (the step was skipped)" : "none (the step was applied)",
        j["skip_reason"]);
  if (j.contains("loss_z")) r.loss_z = get_number(j, "loss_z", true);
  if (j.contains("grad_z")) r.grad_z = get_number(j, "grad_z", true);
  r.injected = get_bool(j, "injected");
  r.grad_norm = get_number(j, "grad_norm", true);
  r.clip_coef = get_float(j, "clip_coef");
  r.overflow_param = get_string(j, "overflow_param");
  r.overflow_activation = get_string(j, "overflow_activation");
  const json& a = require(j, "act_grads");
  if (!a.is_object()) bad("act_grads", "an object", a);
  try {
    r.act_grads.elements = get_uint(a, "elements");
    r.act_grads.nonzero = get_uint(a, "nonzero");
    r.act_grads.underflow = get_uint(a, "underflow");
    r.act_grads.subnormal = get_uint(a, "subnormal");
    r.act_grads.overflow = get_uint(a, "overflow");
    r.act_grads.nonfinite_input = get_uint(a, "nonfinite_input");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("act_grads.") + e.what());
  }
  r.lost_update_fraction = get_number(j, "lost_update_fraction", true);
  r.tokens = get_uint(j, "tokens");
  r.seconds = get_number(j, "seconds", false);
  r.scaler_seconds = get_number(j, "scaler_seconds", false);
  if (j.contains("val_loss")) r.val_loss = get_number(j, "val_loss", true);
  if (j.contains("val_loss_ema")) r.val_loss_ema = get_number(j, "val_loss_ema", true);
  if (j.contains("recipe_phase")) {
    r.recipe_phase = get_string(j, "recipe_phase");
    if (r.recipe_phase.empty()) bad("recipe_phase", "a phase label (the field is left out on other steps)", j["recipe_phase"]);
  }
  parse_telemetry(j, r);
  return r;
}

namespace {

// summary.json's "optimizer_state": the schema of the Python door's (docs/telemetry.md), which the
// report reads.
std::string optimizer_state_json(const OptimizerStateSummary& o) {
  auto ratio = [](std::uint64_t part, std::uint64_t whole) {
    return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
  };
  auto mean = [](double sum, std::uint64_t n) {
    return n > 0 ? sum / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN();
  };
  std::string out;
  ObjectWriter w(out);
  w.field("optimizer", o.optimizer);
  std::string group = "[";
  ObjectWriter g(group);
  g.field("master", o.master);
  g.field("m", o.m);
  g.field("v", o.v);
  g.field("block", static_cast<std::uint64_t>(o.block));
  g.field("fp8_per_tensor", o.fp8_per_tensor);
  g.field("rule", o.rule);
  g.close();
  w.raw("formats", group + "]");
  w.field("elements", o.elements);
  std::string bytes;
  ObjectWriter b(bytes);
  b.field("params", o.params_bytes);
  b.field("master", o.master_bytes);
  b.field("m", o.m_bytes);
  b.field("v", o.v_bytes);
  b.close();
  w.raw("bytes_per_param", bytes);
  w.field("sampled_steps", o.sampled_steps);
  std::uint64_t meant = 0, lost = 0;
  for (const OptimizerStateSummary::Tensor& t : o.params) {
    meant += t.totals.meant;
    lost += t.totals.lost;
  }
  if (o.sampled_steps > 0) w.field("lost_update_fraction", ratio(lost, meant));
  std::string params = "[";
  for (std::size_t i = 0; i < o.params.size(); ++i) {
    const OptimizerStateSummary::Tensor& t = o.params[i];
    if (i > 0) params += ',';
    ObjectWriter p(params);
    p.field("name", t.totals.name);
    p.field("elements", t.elements);
    p.field("master", t.master);
    p.field("m", t.m);
    p.field("v", t.v);
    p.field("steps", std::max(t.totals.m_steps, t.totals.v_steps));
    p.field("m_error", mean(t.totals.m_error_sum, t.totals.m_steps));
    p.field("m_error_max", t.totals.m_steps > 0 ? t.totals.m_error_max : std::numeric_limits<double>::quiet_NaN());
    p.field("v_error", mean(t.totals.v_error_sum, t.totals.v_steps));
    p.field("v_error_max", t.totals.v_steps > 0 ? t.totals.v_error_max : std::numeric_limits<double>::quiet_NaN());
    p.field("lost_fraction", ratio(t.totals.lost, t.totals.meant));
    p.field("meant", t.totals.meant);
    p.close();
  }
  w.raw("params", params + "]");
  w.close();
  return out;
}

}  // namespace

std::string summary_json(const TrainSummary& s, const TrainConfig& c) { return summary_json(s, to_json(c)); }

std::string summary_json(const TrainSummary& s, std::string_view config_json) {
  std::string mem;
  ObjectWriter m(mem);
  m.field("parameter_bytes", static_cast<std::uint64_t>(s.memory.parameter_bytes));
  m.field("activation_bytes", static_cast<std::uint64_t>(s.memory.activation_bytes));
  m.field("gradient_bytes", static_cast<std::uint64_t>(s.memory.gradient_bytes));
  m.field("scratch_bytes", static_cast<std::uint64_t>(s.memory.scratch_bytes));
  m.field("fp8_activation_bytes", static_cast<std::uint64_t>(s.memory.fp8_activation_bytes));
  m.field("master_bytes", static_cast<std::uint64_t>(s.memory.master_bytes));
  m.field("optimizer_state_bytes", static_cast<std::uint64_t>(s.memory.optimizer_state_bytes));
  m.close();

  std::string out;
  ObjectWriter w(out);
  w.field("steps", s.steps);
  w.field("applied", s.applied);
  w.field("skipped", s.skipped);
  std::string by;
  ObjectWriter b(by);
  for (std::size_t i = 1; i < kSkipReasons; ++i) b.field(skip_reason_name(static_cast<SkipReason>(i)), s.skipped_by[i]);
  b.close();
  w.raw("skipped_by", by);
  w.field("final_loss", s.final_loss);
  if (s.val_loss) {
    w.field("val_loss", *s.val_loss);
  } else {
    w.raw("val_loss", "null");
  }
  if (s.val_loss_ema) w.field("val_loss_ema", *s.val_loss_ema);
  w.field("final_scale", s.final_scale);
  w.field("underflow_fraction", s.underflow_fraction);
  w.field("subnormal_fraction", s.subnormal_fraction);
  w.field("lost_update_fraction", s.lost_update_fraction);
  w.field("fp8_forward_saturated_fraction", s.fp8_forward_saturated_fraction);
  w.field("fp8_forward_flushed_fraction", s.fp8_forward_flushed_fraction);
  w.field("fp8_backward_saturated_fraction", s.fp8_backward_saturated_fraction);
  w.field("fp8_backward_flushed_fraction", s.fp8_backward_flushed_fraction);
  w.field("seconds", s.seconds);
  w.field("mean_step_ms", s.mean_step_ms);
  w.field("median_step_ms", s.median_step_ms);
  w.field("tokens", s.tokens);
  w.raw("memory", mem);
  if (s.optimizer_state) w.raw("optimizer_state", optimizer_state_json(*s.optimizer_state));
  w.field("param_count", static_cast<std::uint64_t>(s.param_count));
  w.raw("config", config_json);
  w.close();
  // Indent through nlohmann, keeping our number texts: parse, then dump keeps key order
  // only with ordered_json; doubles re-dump in their shortest round-trip form.
  return nlohmann::ordered_json::parse(out).dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

std::vector<StepRecord> parse_run_log(std::string_view text, const std::string& path) {
  std::vector<StepRecord> records;
  std::size_t number = 0;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t nl = text.find('\n', pos);
    const bool complete = nl != std::string_view::npos;
    std::string_view line = text.substr(pos, complete ? nl - pos : std::string_view::npos);
    pos = complete ? nl + 1 : text.size();
    ++number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::string where = path + ":" + std::to_string(number) + ": ";
    if (line.empty()) throw std::runtime_error(where + "empty line; expected one JSON object per step");
    StepRecord r;
    try {
      r = parse_step_record(line);
    } catch (const std::invalid_argument& e) {
      // The last line cut short (no newline: a full disk or a kill stopped the write)
      // is dropped, as a resume drops it; a malformed complete line is an error.
      if (!complete) break;
      throw std::runtime_error(where + e.what());
    }
    if (!records.empty() && r.step <= records.back().step)
      throw std::runtime_error(where + "step " + std::to_string(r.step) + " follows step " +
                               std::to_string(records.back().step) + "; expected increasing steps");
    records.push_back(std::move(r));
  }
  return records;
}

std::vector<StepRecord> read_run_log(const std::string& path) {
  std::string text;
  try {
    text = io::read_regular_file(path);
  } catch (const std::runtime_error& e) {
    std::string m = e.what();
    if (const std::string p = "cannot read " + text::squote(path) + ": "; m.starts_with(p))
      m = "cannot open: " + m.substr(p.size());
    throw std::runtime_error("run log " + text::squote(path) + ": " + m);
  }
  return parse_run_log(text, path);
}

}  // namespace mixprec::train
