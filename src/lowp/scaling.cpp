// FP8 scaling recipes: delayed scaling state and JSON, current and MX scales.
#include "mixprec/lowp/scaling.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/text.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>

namespace mixprec::lowp {

namespace {

constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr int kMaxMargin = 64;

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string str(std::string_view s) { return std::string(s); }

// An amax that can be recorded: >= 0 (either zero), +inf or NaN.
bool valid_amax(float a) noexcept { return std::isnan(a) || a >= 0.0f; }

bool same_bits(float a, float b) noexcept {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

}  // namespace

std::string_view element_label(Element e) noexcept {
  return e == Element::e4m3 ? "E4M3" : e == Element::e5m2 ? "E5M2" : "E2M1";
}
std::string_view format_name(Format f) noexcept { return f == Format::e4m3 ? "E4M3" : "HYBRID"; }
std::string_view role_name(Role r) noexcept { return r == Role::forward ? "forward" : "backward"; }
std::string_view amax_algo_name(AmaxAlgo a) noexcept { return a == AmaxAlgo::max ? "max" : "most_recent"; }

std::string_view format_key(Format f) noexcept { return f == Format::e4m3 ? "e4m3" : "hybrid"; }

std::optional<Format> parse_format(std::string_view s) noexcept {
  for (const Format f : {Format::e4m3, Format::hybrid})
    if (s == format_name(f) || s == format_key(f)) return f;
  return std::nullopt;
}

std::optional<AmaxAlgo> parse_amax_algo(std::string_view s) noexcept {
  for (const AmaxAlgo a : {AmaxAlgo::max, AmaxAlgo::most_recent})
    if (s == amax_algo_name(a)) return a;
  return std::nullopt;
}
// ---- delayed scaling -----------------------------------------------------------

void validate(const DelayedScalingConfig& c) {
  if (c.margin < -kMaxMargin || c.margin > kMaxMargin)
    fail("margin: expected an integer in [-64, 64], found " + std::to_string(c.margin));
  if (c.amax_history_len < 1) fail("amax_history_len: expected at least 1, found 0");
  if (c.amax_compute_algo != AmaxAlgo::max && c.amax_compute_algo != AmaxAlgo::most_recent)
    fail("amax_compute_algo: expected \"max\" or \"most_recent\"");
  if (c.format != Format::e4m3 && c.format != Format::hybrid)
    fail("fp8_format: expected \"E4M3\" or \"HYBRID\"");
}

float fold_amax(float slot, float amax) noexcept {
  if (std::isnan(slot) || std::isnan(amax)) return std::numeric_limits<float>::quiet_NaN();
  return slot < amax ? amax : slot;
}

float delayed_scale(float amax, float previous_scale, float fp8_max, int margin) noexcept {
  // TE: scaled_max = fp8_dtype_max * std::pow(2.f, -margin); exact for |margin| <= 64.
  const float scaled_max = std::ldexp(fp8_max, -margin);
  float scale = previous_scale;
  if (std::isfinite(amax) && amax > 0.0f) scale = scaled_max / amax;
  if (std::isinf(scale)) scale = kFltMax;
  return scale;
}

float roll_history(std::span<float> h, AmaxAlgo algo) noexcept {
  const std::size_t n = h.size();
  if (n == 0) return 0.0f;
  const float last = h[0];
  float amax = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = i + 1 < n ? h[i + 1] : last;
    amax = std::fmax(amax, a);  // CUDA fmaxf: a NaN operand is ignored
    h[i] = i > 0 ? a : 0.0f;
  }
  return algo == AmaxAlgo::most_recent ? last : amax;
}

bool operator==(const DelayedTensorState& a, const DelayedTensorState& b) noexcept {
  // Bitwise on the floats, so that NaN histories compare equal to themselves.
  return a.name == b.name && a.role == b.role && same_bits(a.scale, b.scale) &&
         same_bits(a.scale_inv, b.scale_inv) &&
         std::equal(a.amax_history.begin(), a.amax_history.end(), b.amax_history.begin(),
                    b.amax_history.end(), same_bits);
}

void validate(const DelayedScalingState& s) {
  validate(s.config);
  for (std::size_t i = 0; i < s.tensors.size(); ++i) {
    const DelayedTensorState& t = s.tensors[i];
    const std::string at = std::string("tensors[").append(std::to_string(i)).append("].");
    if (t.role != Role::forward && t.role != Role::backward) fail(at + "role: expected forward or backward");
    if (t.amax_history.size() != s.config.amax_history_len)
      fail(at + "amax_history: expected " + std::to_string(s.config.amax_history_len) + " values, found " +
           std::to_string(t.amax_history.size()));
    for (float a : t.amax_history)
      if (!valid_amax(a)) fail(at + "amax_history: values must be >= 0, inf or nan");
    if (!(std::isfinite(t.scale) && t.scale > 0.0f)) fail(at + "scale: expected a finite number > 0");
    if (!same_bits(t.scale_inv, 1.0f / t.scale)) fail(at + "scale_inv: expected 1 / scale");
    for (std::size_t j = 0; j < i; ++j)
      if (s.tensors[j].name == t.name) fail(at + "name: \"" + t.name + "\" appears twice");
  }
}

DelayedScaling::DelayedScaling(const DelayedScalingConfig& config) {
  validate(config);
  state_.config = config;
}

std::size_t DelayedScaling::add_tensor(std::string name, Role role) {
  for (const auto& t : state_.tensors)
    if (t.name == name) fail("DelayedScaling::add_tensor: \"" + name + "\" exists already");
  if (role != Role::forward && role != Role::backward) fail("DelayedScaling::add_tensor: bad role");
  DelayedTensorState t;
  t.name = std::move(name);
  t.role = role;
  t.amax_history.assign(state_.config.amax_history_len, 0.0f);
  state_.tensors.push_back(std::move(t));
  return state_.tensors.size() - 1;
}

const DelayedTensorState& DelayedScaling::at(std::size_t tensor) const {
  if (tensor >= state_.tensors.size())
    fail("DelayedScaling: tensor index " + std::to_string(tensor) + " out of range (" +
         std::to_string(state_.tensors.size()) + " tensors)");
  return state_.tensors[tensor];
}

Element DelayedScaling::dtype(std::size_t tensor) const { return dtype_for(state_.config.format, at(tensor).role); }

void DelayedScaling::record_amax(std::size_t tensor, float amax) {
  at(tensor);
  if (!valid_amax(amax)) fail("DelayedScaling::record_amax: amax must be >= 0, inf or nan");
  float& slot = state_.tensors[tensor].amax_history[0];
  slot = fold_amax(slot, amax);
}

std::vector<float> DelayedScaling::current_amaxes() const {
  std::vector<float> out;
  out.reserve(state_.tensors.size());
  for (const auto& t : state_.tensors) out.push_back(t.amax_history[0]);
  return out;
}

void DelayedScaling::set_current_amaxes(std::span<const float> amaxes) {
  if (amaxes.size() != state_.tensors.size())
    fail("DelayedScaling::set_current_amaxes: expected " + std::to_string(state_.tensors.size()) +
         " values, found " + std::to_string(amaxes.size()));
  for (float a : amaxes)
    if (!valid_amax(a)) fail("DelayedScaling::set_current_amaxes: amax must be >= 0, inf or nan");
  for (std::size_t i = 0; i < amaxes.size(); ++i) state_.tensors[i].amax_history[0] = amaxes[i];
}

void DelayedScaling::update() {
  for (auto& t : state_.tensors) {
    const float amax = roll_history(t.amax_history, state_.config.amax_compute_algo);
    t.scale = delayed_scale(amax, t.scale, max_finite(dtype_for(state_.config.format, t.role)),
                            state_.config.margin);
    t.scale_inv = 1.0f / t.scale;
  }
}

void DelayedScaling::load(const DelayedScalingState& state) {
  validate(state);
  state_ = state;
}

// ---- JSON ----------------------------------------------------------------------

namespace {

using nlohmann::json;

json float_json(float f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  return static_cast<double>(f);  // 17 significant digits: reads back to the same float
}

float json_float(const json& v, const std::string& where) {
  if (v.is_string()) {
    const auto s = v.get<std::string>();
    if (s == "nan") return std::numeric_limits<float>::quiet_NaN();
    if (s == "inf") return std::numeric_limits<float>::infinity();
    if (s == "-inf") return -std::numeric_limits<float>::infinity();
  } else if (v.is_number()) {
    const double d = v.get<double>();
    const float f = static_cast<float>(d);
    if (static_cast<double>(f) == d) return f;
    fail(where + "not an fp32 value: " + v.dump());
  }
  fail(where + "expected a number, \"inf\" or \"nan\", found " + v.dump());
}

const json& field(const json& obj, const char* key, const std::string& where) {
  if (!obj.is_object()) fail(where + "expected an object");
  const auto it = obj.find(key);
  if (it == obj.end()) fail(where + key + ": missing");
  return *it;
}

void only_fields(const json& obj, std::initializer_list<const char*> keys, const std::string& where) {
  for (const auto& item : obj.items())
    if (std::none_of(keys.begin(), keys.end(), [&](const char* k) { return item.key() == k; }))
      fail(where + item.key() + ": unknown field");
}

std::string text_field(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  if (!v.is_string()) fail(where + key + ": expected a string, found " + v.dump());
  return v.get<std::string>();
}

std::int64_t int_field(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  if (!v.is_number_integer()) fail(where + key + ": expected an integer, found " + v.dump());
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > (std::uint64_t{1} << 40))
    fail(where + key + ": too large: " + v.dump());
  return v.get<std::int64_t>();
}

}  // namespace

std::string DelayedScalingState::to_json() const {
  json j = json::object();
  j["format"] = "mixprec.fp8_delayed_scaling";
  j["version"] = 1;
  json c = json::object();
  c["margin"] = config.margin;
  c["amax_history_len"] = config.amax_history_len;
  c["amax_compute_algo"] = str(amax_algo_name(config.amax_compute_algo));
  c["fp8_format"] = str(format_name(config.format));
  j["config"] = c;
  json ts = json::array();
  for (const auto& t : tensors) {
    json o = json::object();
    o["name"] = t.name;
    o["role"] = str(role_name(t.role));
    o["scale"] = float_json(t.scale);
    o["scale_inv"] = float_json(t.scale_inv);
    json h = json::array();
    for (float a : t.amax_history) h.push_back(float_json(a));
    o["amax_history"] = std::move(h);
    ts.push_back(std::move(o));
  }
  j["tensors"] = std::move(ts);
  return j.dump();
}

DelayedScalingState DelayedScalingState::from_json(std::string_view text) {
  const std::string top = "fp8 delayed-scaling state: ";
  const json j = io::parse_json(text, "fp8 delayed-scaling state");
  if (!j.is_object()) fail(top + "expected an object");
  only_fields(j, {"format", "version", "config", "tensors"}, top);
  const std::string format = text_field(j, "format", top);
  if (format != "mixprec.fp8_delayed_scaling")
    fail(top + "format: expected \"mixprec.fp8_delayed_scaling\", found \"" + format + "\"");
  const std::int64_t version = int_field(j, "version", top);
  if (version != 1) fail(top + "version: expected 1, found " + std::to_string(version));

  DelayedScalingState s;
  const std::string cw = top + "config.";
  const json& c = field(j, "config", top);
  if (!c.is_object()) fail(cw + "expected an object");
  only_fields(c, {"margin", "amax_history_len", "amax_compute_algo", "fp8_format"}, cw);
  const std::int64_t margin = int_field(c, "margin", cw);
  if (margin < -kMaxMargin || margin > kMaxMargin)
    fail(cw + "margin: expected an integer in [-64, 64], found " + std::to_string(margin));
  s.config.margin = static_cast<int>(margin);
  const std::int64_t len = int_field(c, "amax_history_len", cw);
  if (len < 1 || len > (std::int64_t{1} << 24))
    fail(cw + "amax_history_len: expected an integer in [1, 2^24], found " + std::to_string(len));
  s.config.amax_history_len = static_cast<std::size_t>(len);
  const std::string algo = text_field(c, "amax_compute_algo", cw);
  const std::optional<AmaxAlgo> a = parse_amax_algo(algo);
  if (!a) fail(cw + "amax_compute_algo: expected \"max\" or \"most_recent\", found \"" + algo + "\"");
  s.config.amax_compute_algo = *a;
  const std::string fmt = text_field(c, "fp8_format", cw);
  const std::optional<Format> f = parse_format(fmt);
  if (!f) fail(cw + "fp8_format: expected \"E4M3\" or \"HYBRID\", found \"" + fmt + "\"");
  s.config.format = *f;

  const json& ts = field(j, "tensors", top);
  if (!ts.is_array()) fail(top + "tensors: expected an array");
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const std::string tw = top + std::string("tensors[").append(std::to_string(i)).append("].");
    const json& o = ts[i];
    if (!o.is_object()) fail(tw + "expected an object");
    only_fields(o, {"name", "role", "scale", "scale_inv", "amax_history"}, tw);
    DelayedTensorState t;
    t.name = text_field(o, "name", tw);
    const std::string role = text_field(o, "role", tw);
    if (role == "forward") t.role = Role::forward;
    else if (role == "backward") t.role = Role::backward;
    else fail(tw + "role: expected \"forward\" or \"backward\", found \"" + role + "\"");
    t.scale = json_float(field(o, "scale", tw), tw + "scale: ");
    t.scale_inv = json_float(field(o, "scale_inv", tw), tw + "scale_inv: ");
    const json& h = field(o, "amax_history", tw);
    if (!h.is_array()) fail(tw + "amax_history: expected an array");
    for (const auto& v : h) t.amax_history.push_back(json_float(v, tw + "amax_history: "));
    s.tensors.push_back(std::move(t));
  }
  try {
    validate(s);
  } catch (const std::invalid_argument& e) {
    fail(top + e.what());
  }
  return s;
}

// ---- current scaling ------------------------------------------------------------

void validate(const CurrentScalingConfig& c) {
  if (c.format != Format::e4m3 && c.format != Format::hybrid)
    fail("fp8_format: expected \"E4M3\" or \"HYBRID\"");
  if (!(std::isfinite(c.amax_epsilon) && c.amax_epsilon >= 0.0f))
    fail("amax_epsilon: expected a finite number >= 0");
}

// ---- MX -------------------------------------------------------------------------

e8m0 mx_scale(float amax, Element element, ScaleRounding rounding) noexcept {
  return mx_scale(amax, max_finite(element), max_exponent(element), rounding);
}

e8m0 mx_scale(float amax, float elem_max, int emax_elem, ScaleRounding rounding) noexcept {
  if (rounding == ScaleRounding::rceil) {
    return e8m0::from_bits(mx_scale_code_te(amax, mx_max_norm_rcp(elem_max)));
  }
  // OCP MX emulation (microxcaling _shared_exponents, method "max").
  if (!std::isfinite(amax)) return e8m0::from_bits(0xFF);
  const float a = amax == 0.0f ? 0x1p-126f : amax;
  const int e = std::ilogb(a) - emax_elem;  // floor(log2(a)), exact for normal and subnormal a
  return e8m0::from_exponent(std::max(e, -127));  // > 127 cannot happen for a finite amax
}

float mx_quantize_factor(e8m0 scale, ScaleRounding rounding) noexcept {
  const std::uint32_t code = scale.bits();
  if (rounding == ScaleRounding::rceil) return mx_factor_te(static_cast<std::uint8_t>(code));
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, -scale.exponent());
}

}  // namespace mixprec::lowp
