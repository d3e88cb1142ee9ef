// Step guards (scaler/step_guard.hpp): the skip reasons, llm.c's z-score detector, the guard
// config's key table.
#include "mixprec/scaler/step_guard.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <stdexcept>
#include <utility>

#include "../core/key_table.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/text.hpp"

namespace mixprec {
namespace {

using json = nlohmann::json;

const keys::KeyTable<GuardConfig>& guard_table() {
  using keys::Spec;
  using C = GuardConfig;
  static const keys::KeyTable<C> table([] {
    const auto z = [](std::string name, std::string doc) {
      return Spec{.name = std::move(name), .doc = std::move(doc), .type = "Z", .lo = 0};
    };
    std::vector<keys::Key<C>> k;
    k.push_back(keys::bool_key<C>(
        Spec{.name = "skip_nonfinite",
             .doc = "Without loss scaling too: check the gradients and skip a step that holds inf/NaN",
             .type = "BOOL"},
        [](auto& c) -> auto& { return c.nonfinite; }));
    k.push_back(keys::number_key<C>(
        z("skip_loss_z", "Skip a step whose loss is more than Z standard deviations above the window's mean (0: off)"),
        [](auto& c) -> auto& { return c.loss_z; }));
    k.push_back(keys::number_key<C>(
        z("skip_grad_z", "Skip a step whose gradient norm is more than Z standard deviations above the window's mean "
                         "(0: off)"),
        [](auto& c) -> auto& { return c.grad_z; }));
    k.push_back(keys::integer_key<C>(
        Spec{.name = "skip_window",
             .doc = "Steps in the loss and gradient-norm windows of the z-scores (llm.c: 128)",
             .type = "N",
             .int_min = 2,
             .int_max = kMaxGuardWindow},
        [](auto& c) -> auto& { return c.window; }));
    return k;
  }());
  return table;
}

[[noreturn]] void bad_detector(std::string_view where, const std::string& what) {
  throw std::invalid_argument(std::string(where) + ": " + what);
}

// One JSON object of a saved state (`where` opens every message).
json object_of(std::string_view text, std::string_view where) {
  json j;
  try {
    j = io::parse_json(text, "");
  } catch (const std::invalid_argument& e) {
    bad_detector(where, e.what());
  }
  if (!j.is_object()) bad_detector(where, "expected an object, found " + std::string(j.type_name()));
  return j;
}

}  // namespace

std::string_view skip_reason_name(SkipReason r) noexcept {
  switch (r) {
    case SkipReason::none: return "none";
    case SkipReason::nonfinite_grad: return "nonfinite_grad";
    case SkipReason::nonfinite_loss: return "nonfinite_loss";
    case SkipReason::loss_spike: return "loss_spike";
    case SkipReason::grad_spike: return "grad_spike";
    case SkipReason::user: return "user";
  }
  return "?";
}

const std::vector<std::string_view>& skip_reason_names() {
  static const std::vector<std::string_view> names = {
      skip_reason_name(SkipReason::none),       skip_reason_name(SkipReason::nonfinite_grad),
      skip_reason_name(SkipReason::nonfinite_loss), skip_reason_name(SkipReason::loss_spike),
      skip_reason_name(SkipReason::grad_spike), skip_reason_name(SkipReason::user)};
  return names;
}

std::optional<SkipReason> parse_skip_reason(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kSkipReasons; ++i)
    if (skip_reason_name(static_cast<SkipReason>(i)) == name) return static_cast<SkipReason>(i);
  return std::nullopt;
}

// ---- the detector ----------------------------------------------------------------------

ZScoreDetector::ZScoreDetector(int window) : window_(window) {
  if (window < 2 || window > kMaxGuardWindow)
    throw std::invalid_argument("skip_window: expected an integer in [2, " + std::to_string(kMaxGuardWindow) + "], found " +
                                std::to_string(window));
  buffer_.assign(static_cast<std::size_t>(window), 0.0);
}

namespace {
// llm.c's z-score of x over a full window of n values with running sums sum, sum_sq (x among them).
double z_score(double x, double sum, double sum_sq, int n) noexcept {
  const double mean = sum / static_cast<double>(n);
  const double deviation = std::sqrt(sum_sq / static_cast<double>(n) - mean * mean);
  if (deviation == 0.0) return 0.0;
  return (x - mean) / deviation;
}
}  // namespace

double ZScoreDetector::peek(double x) const noexcept {
  // push()'s arithmetic in the same order, on copies of the sums (no copy of the window).
  if (!std::isfinite(x) || count_ < window_) return std::numeric_limits<double>::quiet_NaN();
  const double old = buffer_[static_cast<std::size_t>(index_)];
  double sum = sum_, sum_sq = sum_sq_;
  sum -= old;
  sum_sq -= old * old;
  sum += x;
  sum_sq += x * x;
  return z_score(x, sum, sum_sq, window_);
}

double ZScoreDetector::push(double x) noexcept {
  if (!std::isfinite(x)) return std::numeric_limits<double>::quiet_NaN();
  if (count_ < window_) {  // the window still fills: no z-score yet
    buffer_[static_cast<std::size_t>(count_)] = x;
    sum_ += x;
    sum_sq_ += x * x;
    ++count_;
    return std::numeric_limits<double>::quiet_NaN();
  }
  // The oldest value out, the new one in (running sums, as llm.c keeps them), then the
  // z-score of the new value over the window that now holds it.
  const double old = buffer_[static_cast<std::size_t>(index_)];
  sum_ -= old;
  sum_sq_ -= old * old;
  buffer_[static_cast<std::size_t>(index_)] = x;
  sum_ += x;
  sum_sq_ += x * x;
  index_ = (index_ + 1) % window_;
  return z_score(x, sum_, sum_sq_, window_);
}

std::string ZScoreDetector::to_json() const {
  json j = json::object();
  j["window"] = window_;
  j["count"] = count_;
  j["index"] = index_;
  j["sum"] = sum_;
  j["sum_sq"] = sum_sq_;
  j["values"] = std::vector<double>(buffer_.begin(), buffer_.begin() + count_);
  return j.dump();
}

ZScoreDetector ZScoreDetector::from_json(std::string_view text, std::string_view where) {
  const json j = object_of(text, where);
  for (const auto& item : j.items()) {
    const std::string& k = item.key();
    if (k != "window" && k != "count" && k != "index" && k != "sum" && k != "sum_sq" && k != "values")
      bad_detector(where, "unknown field '" + k + "'");
  }
  const auto integer = [&](const char* key, long lo, long hi) {
    if (!j.contains(key) || !j[key].is_number_integer()) bad_detector(where, std::string(key) + ": expected an integer");
    const long v = j[key].get<long>();
    if (v < lo || v > hi)
      bad_detector(where, std::string(key) + ": expected an integer in [" + std::to_string(lo) + ", " +
                              std::to_string(hi) + "], found " + std::to_string(v));
    return static_cast<int>(v);
  };
  const auto number = [&](const char* key) {
    if (!j.contains(key) || !j[key].is_number()) bad_detector(where, std::string(key) + ": expected a number");
    const double v = j[key].get<double>();
    if (!std::isfinite(v)) bad_detector(where, std::string(key) + ": expected a finite number");
    return v;
  };
  ZScoreDetector d(integer("window", 2, kMaxGuardWindow));
  d.count_ = integer("count", 0, d.window_);
  d.index_ = integer("index", 0, d.window_ - 1);
  if (d.count_ < d.window_ && d.index_ != 0) bad_detector(where, "index: expected 0 while the window fills");
  d.sum_ = number("sum");
  d.sum_sq_ = number("sum_sq");
  if (!j.contains("values") || !j["values"].is_array() || j["values"].size() != static_cast<std::size_t>(d.count_))
    bad_detector(where, "values: expected an array of count (" + std::to_string(d.count_) + ") numbers");
  for (std::size_t i = 0; i < j["values"].size(); ++i) {
    const json& v = j["values"][i];
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      bad_detector(where, "values[" + std::to_string(i) + "]: expected a finite number");
    d.buffer_[i] = v.get<double>();
  }
  return d;
}

// ---- the config ------------------------------------------------------------------------

void check_guard_reach(double z, int window, std::string_view z_key, std::string_view window_key) {
  // The z-score of a value over a window that holds it is at most sqrt(window - 1) (one
  // outlier among window - 1 equal values): a threshold at or above it could never fire.
  const double reach = std::sqrt(static_cast<double>(window) - 1.0);
  if (z > 0 && z >= reach) {
    const std::string w(window_key);
    keys::fail(z_key,
               "0 (off) or a number below sqrt(" + w + " - 1) = " + text::num(reach) + " (" + w + " " +
                   std::to_string(window) + ": no z-score reaches it, the guard would never fire)",
               text::num(z));
  }
}

void validate(const GuardConfig& c) {
  guard_table().check(c);
  check_guard_reach(c.loss_z, c.window, "skip_loss_z", "skip_window");
  check_guard_reach(c.grad_z, c.window, "skip_grad_z", "skip_window");
}

void set(GuardConfig& c, std::string_view key, std::string_view value) { guard_table().set_text(c, key, value); }

const std::vector<std::string_view>& guard_config_keys() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> n;
    for (const auto& k : guard_table().keys()) n.push_back(k.spec.name);
    return n;
  }();
  return names;
}

std::string guard_config_json(const GuardConfig& c) { return guard_table().to_json<json>(c).dump(); }

GuardConfig guard_config_from_json(std::string_view text, std::string_view where) {
  const json j = object_of(text, where);
  GuardConfig c;
  for (const auto& item : j.items())
    if (guard_table().find(item.key()) == nullptr) bad_detector(where, "unknown field '" + item.key() + "'");
  for (const auto& k : guard_table().keys()) {
    if (!j.contains(k.spec.name)) bad_detector(where, k.spec.name + ": missing");
    try {
      guard_table().set_json(c, k, j[k.spec.name]);
    } catch (const std::invalid_argument& e) {
      bad_detector(where, e.what());
    }
  }
  try {
    validate(c);
  } catch (const std::invalid_argument& e) {
    bad_detector(where, e.what());
  }
  return c;
}

}  // namespace mixprec
