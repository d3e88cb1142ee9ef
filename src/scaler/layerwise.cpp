// Per-layer loss scaling (scaler/layerwise.hpp): the approx_range rule, erfinv, moments, and
// the per-layer state machine (decide, finish_layer, update) with its state format.
#include "mixprec/scaler/layerwise.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <stdexcept>

#include "mixprec/core/json_read.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/formats/types.hpp"

namespace mixprec {
namespace {

using json = nlohmann::json;
using text::num;

[[noreturn]] void bad_config(const std::string& field, const std::string& allowed, const std::string& found) {
  throw std::invalid_argument("layerwise " + field + ": expected " + allowed + ", found " + found);
}

[[noreturn]] void bad_state(const std::string& what) { throw std::invalid_argument("layerwise state: " + what); }

template <class T>
TensorMoments moments_of_values(const T* p, std::size_t n) noexcept {
  TensorMoments m;
  m.count = n;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(static_cast<float>(p[i]));
    if (!std::isfinite(x)) {
      m.finite = false;
      continue;
    }
    m.sum += x;
    m.sum_squares += x * x;
    m.amax = std::max(m.amax, std::fabs(x));
  }
  return m;
}

// "layerwise state: WHERE.KEY: expected ALLOWED, found VALUE" (WHERE: "config." or "layers[i].").
[[noreturn]] void bad_field(const std::string& where, const char* key, const std::string& allowed, const json* found) {
  bad_state(where + key + ": expected " + allowed + ", found " +
            (found == nullptr ? std::string("nothing") : found->dump(-1, ' ', false, json::error_handler_t::replace)));
}

double number_at(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_boolean() || !it->is_number())
    bad_field(where, key, "a number", it == j.end() ? nullptr : &*it);
  return it->get<double>();
}

std::int64_t integer_at(const json& j, const char* key, std::int64_t lo, std::int64_t hi, const std::string& where) {
  const std::string allowed = "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) bad_field(where, key, allowed, it == j.end() ? nullptr : &*it);
  // An unsigned value past int64 (nlohmann keeps it unsigned) is out of every range here.
  if (it->is_number_unsigned() && it->get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
    bad_field(where, key, allowed, &*it);
  const std::int64_t x = it->get<std::int64_t>();
  if (x < lo || x > hi) bad_field(where, key, allowed, &*it);
  return x;
}

constexpr std::int64_t kMaxInt = 2147483647;

}  // namespace

void validate(const LayerwiseConfig& c) {
  auto positive = [](const char* f, double v) {
    if (!(std::isfinite(v) && v > 0)) bad_config(f, "a finite number > 0", num(v));
  };
  positive("u_min", c.u_min);
  positive("u_max", c.u_max);
  if (!(c.u_min < c.u_max)) bad_config("u_min", "below u_max " + num(c.u_max), num(c.u_min));
  if (!(c.n_uf > 0 && c.n_uf < 1)) bad_config("n_uf", "a fraction in (0, 1)", num(c.n_uf));
  if (!(std::isfinite(c.max_factor) && c.max_factor >= 1)) bad_config("max_factor", "a finite number >= 1", num(c.max_factor));
  if (!(std::isfinite(c.max_chain) && c.max_chain >= 1)) bad_config("max_chain", "a finite number >= 1", num(c.max_chain));
  if (c.recovery_interval < 1 || c.recovery_interval > kMaxInt)
    bad_config("recovery_interval", "an integer in [1, 2^31-1]", std::to_string(c.recovery_interval));
  if (c.max_backoff < 0 || c.max_backoff > 64)
    bad_config("max_backoff", "an integer in [0, 64]", std::to_string(c.max_backoff));
}

double erfinv(double x) noexcept {
  if (std::isnan(x) || x < -1.0 || x > 1.0) return std::numeric_limits<double>::quiet_NaN();
  if (x == 1.0) return std::numeric_limits<double>::infinity();
  if (x == -1.0) return -std::numeric_limits<double>::infinity();
  if (x == 0.0) return x;  // keeps the sign of -0
  const double a = std::fabs(x);
  // Start: Winitzki's closed form (relative error about 2e-3), then Halley steps on
  // f(y) = erf(y) - a, f' = 2/sqrt(pi) exp(-y^2), f'' = -2 y f': each step cubes the error.
  // Above 0.5, f is evaluated as (1 - a) - erfc(y) (1 - a is exact there), which keeps its
  // digits where erf(y) is close to 1.
  constexpr double k = 0.147;
  const double ln = std::log1p(-a * a);
  const double t = 2.0 / (std::numbers::pi * k) + 0.5 * ln;
  double y = std::sqrt(std::sqrt(t * t - ln / k) - t);
  const double two_over_sqrt_pi = 2.0 / std::sqrt(std::numbers::pi);
  for (int i = 0; i < 4; ++i) {
    const double f = a <= 0.5 ? std::erf(y) - a : (1.0 - a) - std::erfc(y);
    const double d = two_over_sqrt_pi * std::exp(-y * y);
    if (f == 0.0 || d == 0.0) break;
    y -= f / (d + y * f);
  }
  return x < 0 ? -y : y;
}

double TensorMoments::mean() const noexcept { return count == 0 ? 0.0 : sum / static_cast<double>(count); }

double TensorMoments::mean_square() const noexcept {
  return count == 0 ? 0.0 : sum_squares / static_cast<double>(count);
}

TensorMoments moments_of(std::span<const float> v) noexcept { return moments_of_values(v.data(), v.size()); }

TensorMoments moments_of(const GradTensor& t) noexcept {
  switch (t.dtype) {
    case DType::f32: return moments_of_values(static_cast<const float*>(t.data), t.size);
    case DType::f16: return moments_of_values(static_cast<const f16*>(t.data), t.size);
    case DType::bf16: return moments_of_values(static_cast<const bf16*>(t.data), t.size);
  }
  return {};
}

double approx_range_factor(const TensorMoments& g, const TensorMoments& w, std::int64_t fan_in, double chain,
                           const LayerwiseConfig& c) {
  const double n = static_cast<double>(fan_in);
  // sigma^2 + mu^2 is the second moment: taken as sum_squares / count, which is the same
  // quantity without the cancellation of var + mean^2.
  const double sigma_o = std::sqrt(g.mean_square() * w.mean_square()) * std::sqrt(0.5 * n);
  double s = 1.0;
  if (sigma_o > 0) s = std::max(1.0, c.u_min / (erfinv(c.n_uf) * std::numbers::sqrt2 * sigma_o));
  const double out_max = g.amax * w.amax;
  if (out_max > 0) s = std::min(s, (c.u_max / n) / out_max);
  s = std::min({s, c.max_chain / chain, c.max_factor});
  if (!(s > 0) || !std::isfinite(s)) return 1.0;  // sigma_o or the bound under/overflowed double: no change
  return std::exp2(std::floor(std::log2(s)));
}

std::string_view layer_outcome_name(LayerOutcome o) noexcept {
  switch (o) {
    case LayerOutcome::applied: return "applied";
    case LayerOutcome::origin: return "origin";
    case LayerOutcome::victim: return "victim";
  }
  return "?";
}

LayerwiseScales::LayerwiseScales(const LayerwiseConfig& c) : config_(c) { validate(c); }

std::optional<std::size_t> LayerwiseScales::find(std::string_view name) const noexcept {
  for (std::size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].name == name) return i;
  return std::nullopt;
}

std::size_t LayerwiseScales::add_layer(std::string_view name, std::int64_t fan_in) {
  if (name.empty()) throw std::invalid_argument("layerwise: a layer needs a name");
  if (fan_in < 1 || fan_in > kMaxInt)
    throw std::invalid_argument("layerwise: layer '" + std::string(name) + "': fan_in must be in [1, 2^31-1], found " +
                                std::to_string(fan_in));
  if (const auto i = find(name)) {
    if (layers_[*i].fan_in != fan_in)
      throw std::invalid_argument("layerwise: layer '" + std::string(name) + "' has fan_in " +
                                  std::to_string(layers_[*i].fan_in) + " in the scaler's state, found " +
                                  std::to_string(fan_in));
    return *i;
  }
  LayerState s;
  s.name = std::string(name);
  s.fan_in = fan_in;
  layers_.push_back(std::move(s));
  return layers_.size() - 1;
}

double LayerwiseScales::decide(std::size_t layer, const TensorMoments& g, const TensorMoments& w, double chain) {
  LayerState& s = layers_.at(layer);
  double f = 1.0;
  if (!g.finite || !w.finite) {
    s.incoming_nonfinite = s.incoming_nonfinite || !g.finite;
  } else {
    f = std::ldexp(approx_range_factor(g, w, s.fan_in, chain, config_), static_cast<int>(-s.backoff));
  }
  s.factor = f;
  s.chain = chain * f;
  s.decided = true;
  return f;
}

double LayerwiseScales::keep(std::size_t layer, bool g_finite) {
  LayerState& s = layers_.at(layer);
  s.incoming_nonfinite = s.incoming_nonfinite || !g_finite;
  return s.factor;
}

LayerOutcome LayerwiseScales::finish_layer(std::size_t layer, bool grads_finite) {
  LayerState& s = layers_.at(layer);
  const LayerOutcome o =
      grads_finite ? LayerOutcome::applied : (s.incoming_nonfinite ? LayerOutcome::victim : LayerOutcome::origin);
  s.outcome = o;
  return o;
}

bool LayerwiseScales::any_origin() const noexcept {
  return std::any_of(layers_.begin(), layers_.end(),
                     [](const LayerState& s) { return s.outcome == LayerOutcome::origin; });
}

void LayerwiseScales::update() {
  for (LayerState& s : layers_) {
    if (s.outcome == LayerOutcome::origin) {
      s.backoff = std::min(s.backoff + 1, config_.max_backoff);
      s.clean_steps = 0;
      ++s.overflows;
      ++s.skipped;
    } else if (s.outcome == LayerOutcome::victim) {
      ++s.skipped;
    } else if (s.outcome == LayerOutcome::applied) {
      if (s.backoff > 0 && ++s.clean_steps >= config_.recovery_interval) {
        --s.backoff;
        s.clean_steps = 0;
      }
    }
    s.decided = false;
    s.incoming_nonfinite = false;
    s.outcome.reset();
  }
}

std::string LayerwiseScales::to_json() const {
  json j = json::object();
  j["config"] = {{"u_min", config_.u_min},
                 {"u_max", config_.u_max},
                 {"n_uf", config_.n_uf},
                 {"max_factor", config_.max_factor},
                 {"max_chain", config_.max_chain},
                 {"recovery_interval", config_.recovery_interval},
                 {"max_backoff", config_.max_backoff}};
  json layers = json::array();
  for (const LayerState& s : layers_) {
    layers.push_back({{"name", s.name},
                      {"fan_in", s.fan_in},
                      {"backoff", s.backoff},
                      {"clean_steps", s.clean_steps},
                      {"overflows", s.overflows},
                      {"skipped", s.skipped}});
  }
  j["layers"] = std::move(layers);
  return j.dump();
}

LayerwiseScales LayerwiseScales::from_json(std::string_view text) {
  const json j = io::parse_json(text, "layerwise state");
  if (!j.is_object()) bad_state("expected an object");
  for (const auto& [k, v] : j.items())
    if (k != "config" && k != "layers") bad_state("unknown field '" + k + "'");
  if (!j.contains("config") || !j["config"].is_object())
    bad_field("", "config", "an object", j.contains("config") ? &j["config"] : nullptr);
  const json& c = j["config"];
  static const char* const kConfigKeys[] = {"u_min", "u_max", "n_uf", "max_factor", "max_chain", "recovery_interval",
                                            "max_backoff"};
  for (const auto& item : c.items()) {
    const std::string& k = item.key();  // a named reference: clang 14 lambdas cannot capture a structured binding
    if (std::find_if(std::begin(kConfigKeys), std::end(kConfigKeys), [&](const char* x) { return k == x; }) ==
        std::end(kConfigKeys))
      bad_state("config: unknown field '" + k + "'");
  }
  LayerwiseConfig cfg;
  cfg.u_min = number_at(c, "u_min", "config.");
  cfg.u_max = number_at(c, "u_max", "config.");
  cfg.n_uf = number_at(c, "n_uf", "config.");
  cfg.max_factor = number_at(c, "max_factor", "config.");
  cfg.max_chain = number_at(c, "max_chain", "config.");
  cfg.recovery_interval = integer_at(c, "recovery_interval", 1, kMaxInt, "config.");
  cfg.max_backoff = integer_at(c, "max_backoff", 0, 64, "config.");
  try {
    validate(cfg);
  } catch (const std::invalid_argument& e) {
    bad_state(std::string("config: ") + e.what());
  }
  LayerwiseScales out(cfg);
  if (!j.contains("layers") || !j["layers"].is_array())
    bad_field("", "layers", "an array", j.contains("layers") ? &j["layers"] : nullptr);
  const json& layers = j["layers"];
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const json& l = layers[i];
    const std::string w = "layers[" + std::to_string(i) + "].";
    if (!l.is_object())
      bad_state("layers[" + std::to_string(i) + "]: expected an object, found " + std::string(l.type_name()));
    for (const auto& [k, v] : l.items())
      if (k != "name" && k != "fan_in" && k != "backoff" && k != "clean_steps" && k != "overflows" && k != "skipped")
        bad_state(w.substr(0, w.size() - 1) + ": unknown field '" + k + "'");
    if (!l.contains("name") || !l["name"].is_string() || l["name"].get<std::string>().empty())
      bad_field(w, "name", "a non-empty string", l.contains("name") ? &l["name"] : nullptr);
    const std::string name = l["name"].get<std::string>();
    if (out.find(name)) bad_state(w + "name: layer '" + name + "' appears twice");
    LayerState s;
    s.name = name;
    s.fan_in = integer_at(l, "fan_in", 1, kMaxInt, w);
    s.backoff = integer_at(l, "backoff", 0, cfg.max_backoff, w);
    s.clean_steps = integer_at(l, "clean_steps", 0, cfg.recovery_interval - 1, w);
    s.skipped = integer_at(l, "skipped", 0, std::numeric_limits<std::int64_t>::max(), w);
    s.overflows = integer_at(l, "overflows", 0, s.skipped, w);
    if (s.backoff == 0 && s.clean_steps != 0) bad_state("layer '" + name + "': clean_steps counts only while backoff > 0");
    out.layers_.push_back(std::move(s));
  }
  return out;
}

void LayerwiseScales::check_load(const LayerwiseScales& state) const {
  for (const LayerState& s : state.layers_) {
    if (const auto i = find(s.name); i && layers_[*i].fan_in != s.fan_in)
      bad_state("layer '" + s.name + "' has fan_in " + std::to_string(s.fan_in) + "; the watched layer has " +
                std::to_string(layers_[*i].fan_in));
  }
}

void LayerwiseScales::load_state(const LayerwiseScales& state) {
  check_load(state);
  config_ = state.config_;
  for (LayerState& mine : layers_) {  // registered layers the state does not know start afresh
    mine.backoff = mine.clean_steps = mine.overflows = mine.skipped = 0;
  }
  for (const LayerState& s : state.layers_) {
    const std::size_t i = add_layer(s.name, s.fan_in);
    LayerState& mine = layers_[i];
    mine.backoff = s.backoff;
    mine.clean_steps = s.clean_steps;
    mine.overflows = s.overflows;
    mine.skipped = s.skipped;
  }
}

}  // namespace mixprec
