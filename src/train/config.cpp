// TrainConfig: validation, JSON config files and the JSON echo of a config.
//
// One table lists every key in flag order with how it is read from JSON, written to
// JSON and checked on its own; validate() runs every single-key check, then the checks
// across keys. apply_json() runs the single-key check of each key it sets.
#include "mixprec/core/json_depth.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/train/config.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include "mixprec/nn/data.hpp"
#include "mixprec/scaler/loss_scale.hpp"

namespace mixprec::train {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// Upper bounds that keep a typo from allocating terabytes.
constexpr std::uint64_t kMaxLayers = 64;
constexpr std::uint64_t kMaxHeads = 4096;
constexpr std::uint64_t kMaxChannels = 4096;
constexpr std::uint64_t kMaxContext = 4096;
constexpr std::uint64_t kMaxBatch = 4096;
constexpr std::uint64_t kMaxTokensPerBatch = 1u << 20;  // batch * context
constexpr std::uint64_t kMaxDepth = 64;
constexpr std::uint64_t kMaxHidden = 16384;
constexpr std::uint64_t kMaxAccum = 1'000'000;
constexpr std::uint64_t kMaxSteps = 1'000'000'000;
constexpr std::uint64_t kMaxThreads = 1024;
constexpr std::uint64_t kMaxAmaxHistory = 1u << 20;
constexpr std::uint64_t kMaxRanks = 1u << 20;
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53
constexpr double kFloatMax = static_cast<double>(std::numeric_limits<float>::max());

[[noreturn]] void fail(std::string_view key, std::string_view expected, std::string_view found) {
  throw std::invalid_argument(std::string(key) + ": expected " + std::string(expected) + ", found " +
                              std::string(found));
}

using text::num;
using text::squote;

// A JSON value for messages: its type, then its text (cut short), e.g. string "abc".
std::string describe(const json& v) {
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  if (v.is_number() || v.is_null()) return text;
  return std::string(v.type_name()) + " " + text;
}

std::string join(const std::vector<std::string>& names, std::string_view last_sep = " or ") {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i != 0) out += i + 1 == names.size() ? std::string(last_sep) : std::string(", ");
    out += names[i];
  }
  return out;
}

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {std::string(nn::model_kind_name(nn::ModelKind::gpt)),
                                                 std::string(nn::model_kind_name(nn::ModelKind::mlp))};
  return names;
}

const std::vector<std::string>& optimizer_names() {
  static const std::vector<std::string> names = {"adamw", "adam", "sgd"};
  return names;
}

// ---- single-key checks -------------------------------------------------------------

void check_range(std::string_view key, std::uint64_t v, std::uint64_t lo, std::uint64_t hi) {
  if (v < lo || v > hi)
    fail(key, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", std::to_string(v));
}

void check_at_least(std::string_view key, std::uint64_t v, std::uint64_t lo) {
  if (v < lo) fail(key, "an integer >= " + std::to_string(lo), std::to_string(v));
}

void check_positive(std::string_view key, double v) {
  if (!(std::isfinite(v) && v > 0)) fail(key, "a finite number > 0", num(v));
}

void check_non_negative(std::string_view key, double v) {
  if (!(std::isfinite(v) && v >= 0)) fail(key, "a finite number >= 0", num(v));
}

void check_beta(std::string_view key, double v) {
  if (!(v >= 0 && v < 1)) fail(key, "a number in [0, 1)", num(v));
}

// The S of "static:S": a number float32 holds, as it holds 1/S (the unscale factor).
double static_loss_scale(const std::string& s) {
  constexpr std::string_view key = "loss-scale";
  const std::string static_form =
      "static:S with S a number > 0 that float32 holds, as it holds 1/S (the unscale factor): S in "
      "(2.9387359e-39, 3.4028235e+38]";
  if (s == "static") fail(key, static_form + " (the static preset needs its scale)", squote(s));
  const char* first = s.data() + 7;
  const char* last = s.data() + s.size();
  double v = 0;
  const auto [ptr, ec] = std::from_chars(first, last, v, std::chars_format::general);
  if (!s.starts_with("static:") || first == last || ec != std::errc() || ptr != last || !std::isfinite(v) ||
      !(v > 0) || v > kFloatMax || static_cast<float>(v) == 0.0f || !std::isfinite(1.0f / static_cast<float>(v)))
    fail(key, static_form, squote(s));
  return v;
}

void check_loss_scale(const std::string& s) {
  constexpr std::string_view key = "loss-scale";
  if (s == "none" || s == "dynamic") return;
  if (s == "static" || s.starts_with("static:")) {
    (void)static_loss_scale(s);
    return;
  }
  for (const std::string& p : loss_scale_preset_names())
    if (p != "static" && s == p) return;
  std::vector<std::string> presets;
  for (const std::string& p : loss_scale_preset_names())
    if (p != "static") presets.push_back(p);
  fail(key, "none, dynamic, static:S (S a finite number > 0) or a preset (" + join(presets, ", ") + ")", squote(s));
}

void check_vocab(const std::string& s) {
  try {
    (void)nn::parse_vocab_spec(s);
  } catch (const std::invalid_argument&) {
    fail("vocab", "char or word:N with N in [" + std::to_string(nn::VocabSpec::kMinWords) + ", " +
                      std::to_string(nn::VocabSpec::kMaxWords) + "]",
         squote(s));
  }
}

// ---- JSON readers ------------------------------------------------------------------

std::uint64_t json_uint(const json& v, std::string_view key, std::uint64_t max) {
  std::uint64_t out = 0;
  if (v.is_number_unsigned()) {
    out = v.get<std::uint64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!(d >= 0 && d <= kMaxExactInteger && d == std::floor(d))) fail(key, "a non-negative integer", describe(v));
    out = static_cast<std::uint64_t>(d);
  } else {
    fail(key, "a non-negative integer", describe(v));
  }
  if (out > max) fail(key, "an integer in [0, " + std::to_string(max) + "]", std::to_string(out));
  return out;
}

double json_double(const json& v, std::string_view key) {
  if (!v.is_number()) fail(key, "a number", describe(v));
  return v.get<double>();
}

std::string json_string(const json& v, std::string_view key) {
  if (!v.is_string()) fail(key, "a string", describe(v));
  return v.get<std::string>();
}

// ---- the table of keys ----------------------------------------------------------------

// How a key is read from JSON, written to it and checked on its own.
struct FieldIo {
  std::string key;
  std::function<void(TrainConfig&, const json&)> read;
  std::function<ordered_json(const TrainConfig&)> write;
  std::function<void(const TrainConfig&)> check;
};

// A key's command-line text as the JSON value its reader takes.
using FromText = std::function<json(std::string_view)>;

struct Field : FieldIo {
  ConfigKey info;     // its command-line description
  FromText from_text;  // empty: by info.kind (text_value)
};

// Appends a key: its description and its JSON handling, the one place both are written;
// `from_text` for a key whose command-line text its kind does not say how to read.
void add(std::vector<Field>& table, const ConfigKey& info, FieldIo io, FromText from_text = {}) {
  if (info.name != io.key)
    throw std::logic_error(std::string("config key table: '").append(io.key).append("' described as '").append(info.name).append("'"));
  table.push_back(Field{std::move(io), info, std::move(from_text)});
}

// A signed integer's command-line text; `expected` names its range in the message.
json signed_text(std::string_view key, std::string_view text, std::string_view expected) {
  std::int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end) fail(key, expected, squote(text));
  return v;
}

// ---- command-line text -------------------------------------------------------------------

using text::parse_number;
using text::parse_uint;

// A key's command-line text as the JSON value its reader takes (the reader then
// checks the range of its member, as for a config file).
json text_value(const Field& f, std::string_view text) {
  if (f.from_text) return f.from_text(text);
  const std::string_view key = f.info.name;
  switch (f.info.kind) {
    case KeyKind::integer:
      return parse_uint(key, text);
    case KeyKind::number:
      return parse_number(key, text);
    case KeyKind::text:
      return std::string(text);
    case KeyKind::boolean:
      if (text.empty() || text == "true") return true;
      if (text == "false") return false;
      fail(key, "no value, true or false", squote(text));
    case KeyKind::flag:
      if (text != "true" && text != "false") fail(key, "true or false", squote(text));
      return text == "true";
    case KeyKind::list: {
      json steps = json::array();
      for (std::size_t start = 0; start <= text.size() && !text.empty();) {
        const std::size_t comma = std::min(text.find(',', start), text.size());
        try {
          steps.push_back(parse_uint(key, text.substr(start, comma - start)));
        } catch (const std::invalid_argument&) {
          fail(key, "step numbers separated by commas (e.g. 5,17)", squote(text));
        }
        start = comma + 1;
      }
      return steps;
    }
  }
  fail(key, "a known kind of key", "enum value " + std::to_string(static_cast<int>(f.info.kind)));
}


// `ref` is a generic lambda returning a reference to the member for a const or non-const config.
template <class Ref>
FieldIo uint_field(std::string key, Ref ref, std::function<void(const TrainConfig&)> check) {
  return {key,
          [key, ref](TrainConfig& c, const json& v) {
            auto& m = ref(c);
            using T = std::remove_reference_t<decltype(m)>;
            m = static_cast<T>(json_uint(v, key, std::numeric_limits<T>::max()));
          },
          [ref](const TrainConfig& c) { return ordered_json(static_cast<std::uint64_t>(ref(c))); }, std::move(check)};
}

template <class Ref>
FieldIo double_field(std::string key, Ref ref, std::function<void(const TrainConfig&)> check) {
  return {key, [key, ref](TrainConfig& c, const json& v) { ref(c) = json_double(v, key); },
          [ref](const TrainConfig& c) { return ordered_json(ref(c)); }, std::move(check)};
}

template <class Ref>
FieldIo string_field(std::string key, Ref ref, std::function<void(const TrainConfig&)> check) {
  return {key, [key, ref](TrainConfig& c, const json& v) { ref(c) = json_string(v, key); },
          [ref](const TrainConfig& c) { return ordered_json(ref(c)); }, std::move(check)};
}

const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> f;
    const auto none = [](const TrainConfig&) {};
    add(f,
        {.name = "model",
         .kind = KeyKind::text,
         .type = "NAME",
         .help = "Model: gpt (decoder-only transformer) or mlp (deep MLP next-token classifier)"},
        {"model",
         [](TrainConfig& c, const json& v) {
           const std::string s = json_string(v, "model");
           const auto k = nn::parse_model_kind(s);
           if (!k) fail("model", join(model_names()), squote(s));
           c.model.kind = *k;
         },
         [](const TrainConfig& c) { return ordered_json(std::string(nn::model_kind_name(c.model.kind))); },
         [](const TrainConfig& c) {
           if (c.model.kind != nn::ModelKind::gpt && c.model.kind != nn::ModelKind::mlp)
             fail("model", join(model_names()), "enum value " + std::to_string(static_cast<int>(c.model.kind)));
         }});
    add(f,
        {.name = "precision",
         .kind = KeyKind::text,
         .type = "NAME",
         .help = "Precision: fp32, fp16 (mixed), bf16 (mixed), fp16-pure, or bf16 with fp8 Linear layers: fp8-noscale, "
                 "fp8-delayed, fp8-current, mxfp8",
         .compare_sets = true},
        {"precision",
         [](TrainConfig& c, const json& v) {
           const std::string s = json_string(v, "precision");
           const auto p = nn::parse_precision(s);
           if (!p) fail("precision", join(nn::precision_names()), squote(s));
           c.precision = *p;
         },
         [](const TrainConfig& c) { return ordered_json(std::string(nn::precision_name(c.precision))); },
         [](const TrainConfig& c) {
           const auto p = static_cast<int>(c.precision);
           if (p < 0 || p > static_cast<int>(nn::Precision::mxfp8))
             fail("precision", join(nn::precision_names()), "enum value " + std::to_string(p));
         }});
    add(f,
        {.name = "loss-scale",
         .kind = KeyKind::text,
         .type = "SPEC",
         .help = "Loss scaling: none, dynamic, static:S or a preset (mixprec, torch, deepspeed, megatron, apex, keras, "
                 "tf-keras, jmp); fp8 presets default to none",
         .compare_sets = true},
        string_field(
            "loss-scale", [](auto& c) -> auto& { return c.loss_scale; },
            [](const TrainConfig& c) { check_loss_scale(c.loss_scale); }));
    add(f,
        {.name = "fp8-format",
         .kind = KeyKind::text,
         .type = "NAME",
         .help = "fp8 presets: hybrid (E4M3 forward, E5M2 gradients) or e4m3",
         .only_for = precision_bits({nn::Precision::fp8_noscale, nn::Precision::fp8_delayed,
                                     nn::Precision::fp8_current, nn::Precision::mxfp8})},
        string_field(
            "fp8-format", [](auto& c) -> auto& { return c.fp8_format; },
            [](const TrainConfig& c) {
              if (c.fp8_format != "hybrid" && c.fp8_format != "e4m3")
                fail("fp8-format", "hybrid or e4m3", squote(c.fp8_format));
            }));
    add(f,
        {.name = "fp8-amax-history", .kind = KeyKind::integer, .type = "N", .help = "fp8-delayed: amax history length",
         .only_for = precision_bits({nn::Precision::fp8_delayed})},
        uint_field(
            "fp8-amax-history", [](auto& c) -> auto& { return c.fp8_amax_history; },
            [](const TrainConfig& c) { check_range("fp8-amax-history", c.fp8_amax_history, 1, kMaxAmaxHistory); }));
    add(f, {.name = "fp8-amax-algo", .kind = KeyKind::text, .type = "NAME", .help = "fp8-delayed: max or most_recent",
         .only_for = precision_bits({nn::Precision::fp8_delayed})},
        string_field(
            "fp8-amax-algo", [](auto& c) -> auto& { return c.fp8_amax_algo; },
            [](const TrainConfig& c) {
              if (c.fp8_amax_algo != "max" && c.fp8_amax_algo != "most_recent")
                fail("fp8-amax-algo", "max or most_recent", squote(c.fp8_amax_algo));
            }));
    add(f,
        {.name = "fp8-margin",
         .kind = KeyKind::integer,
         .type = "M",
         .help = "fp8-delayed: scale = fp8_max * 2^-M / amax, M in [-64, 64]",
         .only_for = precision_bits({nn::Precision::fp8_delayed})},
        {"fp8-margin",
         [](TrainConfig& c, const json& v) {
           if (v.is_number_integer())
             c.fp8_margin = v.get<std::int64_t>();
           else
             fail("fp8-margin", "an integer in [-64, 64]", describe(v));
         },
         [](const TrainConfig& c) { return ordered_json(c.fp8_margin); },
         [](const TrainConfig& c) {
           if (c.fp8_margin < -64 || c.fp8_margin > 64)
             fail("fp8-margin", "an integer in [-64, 64]", std::to_string(c.fp8_margin));
         }},
        [](std::string_view text) { return signed_text("fp8-margin", text, "an integer in [-64, 64]"); });
    add(f,
        {.name = "fp8-power2-scales",
         .kind = KeyKind::boolean,
         .type = "[BOOL]",
         .help = "fp8-current: scales rounded down to powers of two",
         .only_for = precision_bits({nn::Precision::fp8_current})},
        {"fp8-power2-scales",
         [](TrainConfig& c, const json& v) {
           if (!v.is_boolean()) fail("fp8-power2-scales", "true or false", describe(v));
           c.fp8_power2_scales = v.get<bool>();
         },
         [](const TrainConfig& c) { return ordered_json(c.fp8_power2_scales); }, none});
    add(f, {.name = "fp8-amax-epsilon", .kind = KeyKind::number, .type = "X", .help = "fp8-current: amax floor",
         .only_for = precision_bits({nn::Precision::fp8_current})},
        double_field(
            "fp8-amax-epsilon", [](auto& c) -> auto& { return c.fp8_amax_epsilon; },
            [](const TrainConfig& c) {
              check_non_negative("fp8-amax-epsilon", c.fp8_amax_epsilon);
              // float32 must hold it: neither past its max nor so small that it
              // would round to 0 (no silent clamp to "no floor").
              if (c.fp8_amax_epsilon > kFloatMax ||
                  (c.fp8_amax_epsilon > 0 && static_cast<float>(c.fp8_amax_epsilon) == 0.0f))
                fail("fp8-amax-epsilon", "0, or a finite number float32 holds (1.4e-45 to 3.4e38)",
                     num(c.fp8_amax_epsilon));
            }));
    add(f,
        {.name = "mx-rounding",
         .kind = KeyKind::text,
         .type = "NAME",
         .help = "mxfp8: E8M0 block-scale rounding, te (round up) or ocp (floor)",
         .only_for = precision_bits({nn::Precision::mxfp8})},
        string_field(
            "mx-rounding", [](auto& c) -> auto& { return c.mx_rounding; },
            [](const TrainConfig& c) {
              if (c.mx_rounding != "te" && c.mx_rounding != "ocp")
                fail("mx-rounding", "te or ocp", squote(c.mx_rounding));
            }));
    add(f, {.name = "layers", .kind = KeyKind::integer, .type = "N", .help = "gpt: transformer blocks"},
        uint_field(
            "layers", [](auto& c) -> auto& { return c.model.layers; },
            [](const TrainConfig& c) { check_range("layers", c.model.layers, 1, kMaxLayers); }));
    add(f,
        {.name = "heads",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "gpt: attention heads (must divide --channels)"},
        uint_field(
            "heads", [](auto& c) -> auto& { return c.model.heads; },
            [](const TrainConfig& c) { check_range("heads", c.model.heads, 1, kMaxHeads); }));
    add(f,
        {.name = "channels",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "gpt: width (also the mlp's embedding width per context token)"},
        uint_field(
            "channels", [](auto& c) -> auto& { return c.model.channels; },
            [](const TrainConfig& c) { check_range("channels", c.model.channels, 1, kMaxChannels); }));
    add(f, {.name = "context", .kind = KeyKind::integer, .type = "N", .help = "Tokens per sequence"},
        uint_field(
            "context", [](auto& c) -> auto& { return c.model.context; },
            [](const TrainConfig& c) { check_range("context", c.model.context, 2, kMaxContext); }));
    add(f, {.name = "batch", .kind = KeyKind::integer, .type = "N", .help = "Sequences per micro-batch"},
        uint_field(
            "batch", [](auto& c) -> auto& { return c.model.batch; },
            [](const TrainConfig& c) { check_range("batch", c.model.batch, 1, kMaxBatch); }));
    add(f, {.name = "depth", .kind = KeyKind::integer, .type = "N", .help = "mlp: hidden layers"},
        uint_field(
            "depth", [](auto& c) -> auto& { return c.model.depth; },
            [](const TrainConfig& c) { check_range("depth", c.model.depth, 1, kMaxDepth); }));
    add(f, {.name = "hidden", .kind = KeyKind::integer, .type = "N", .help = "mlp: hidden width"},
        uint_field(
            "hidden", [](auto& c) -> auto& { return c.model.hidden; },
            [](const TrainConfig& c) { check_range("hidden", c.model.hidden, 1, kMaxHidden); }));
    add(f,
        {.name = "data",
         .kind = KeyKind::text,
         .type = "FILE",
         .help = "UTF-8 training text (default: the embedded corpus)",
         .resume_may_change = true},
        string_field(
            "data", [](auto& c) -> auto& { return c.data; }, none));
    add(f, {.name = "vocab", .kind = KeyKind::text, .type = "SPEC", .help = "Tokeniser: char or word:N"},
        string_field(
            "vocab", [](auto& c) -> auto& { return c.vocab; }, [](const TrainConfig& c) { check_vocab(c.vocab); }));
    add(f,
        {.name = "corpus-tokens",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Size of the embedded corpus in word tokens"},
        uint_field(
            "corpus-tokens", [](auto& c) -> auto& { return c.corpus_tokens; },
            [](const TrainConfig& c) {
              check_range("corpus-tokens", c.corpus_tokens, 1, nn::CorpusOptions::kMaxTokens);
            }));
    add(f,
        {.name = "val-fraction",
         .kind = KeyKind::number,
         .type = "X",
         .help = "Held-out tail of the token stream, in (0, 0.5]"},
        double_field(
            "val-fraction", [](auto& c) -> auto& { return c.val_fraction; },
            [](const TrainConfig& c) {
              if (!(c.val_fraction > 0 && c.val_fraction <= 0.5))
                fail("val-fraction", "a number in (0, 0.5]", num(c.val_fraction));
            }));
    add(f, {.name = "optimizer", .kind = KeyKind::text, .type = "NAME", .help = "adamw, adam or sgd"},
        string_field(
            "optimizer", [](auto& c) -> auto& { return c.optimizer; },
            [](const TrainConfig& c) {
              for (const std::string& n : optimizer_names())
                if (c.optimizer == n) return;
              fail("optimizer", join(optimizer_names()), squote(c.optimizer));
            }));
    add(f, {.name = "lr", .kind = KeyKind::number, .type = "X", .help = "Peak learning rate"},
        double_field(
            "lr", [](auto& c) -> auto& { return c.lr; }, [](const TrainConfig& c) { check_positive("lr", c.lr); }));
    add(f, {.name = "min-lr", .kind = KeyKind::number, .type = "X", .help = "Floor of the cosine schedule"},
        double_field(
            "min-lr", [](auto& c) -> auto& { return c.min_lr; },
            [](const TrainConfig& c) { check_non_negative("min-lr", c.min_lr); }));
    add(f,
        {.name = "warmup",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Linear warmup steps; the default is at most --steps"},
        uint_field(
            "warmup", [](auto& c) -> auto& { return c.warmup; }, none));
    add(f, {.name = "weight-decay", .kind = KeyKind::number, .type = "X", .help = "Weight decay"},
        double_field(
            "weight-decay", [](auto& c) -> auto& { return c.weight_decay; },
            [](const TrainConfig& c) { check_non_negative("weight-decay", c.weight_decay); }));
    add(f, {.name = "beta1", .kind = KeyKind::number, .type = "X", .help = "Adam beta1"},
        double_field(
            "beta1", [](auto& c) -> auto& { return c.beta1; },
            [](const TrainConfig& c) { check_beta("beta1", c.beta1); }));
    add(f, {.name = "beta2", .kind = KeyKind::number, .type = "X", .help = "Adam beta2"},
        double_field(
            "beta2", [](auto& c) -> auto& { return c.beta2; },
            [](const TrainConfig& c) { check_beta("beta2", c.beta2); }));
    add(f, {.name = "eps", .kind = KeyKind::number, .type = "X", .help = "Adam epsilon"},
        double_field(
            "eps", [](auto& c) -> auto& { return c.eps; }, [](const TrainConfig& c) { check_positive("eps", c.eps); }));
    add(f, {.name = "clip", .kind = KeyKind::number, .type = "X", .help = "Max global gradient norm; 0 = no clipping"},
        double_field(
            "clip", [](auto& c) -> auto& { return c.clip; },
            [](const TrainConfig& c) { check_non_negative("clip", c.clip); }));
    add(f,
        {.name = "steps",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Optimizer steps, applied or skipped",
         .resume_may_change = true},
        uint_field(
            "steps", [](auto& c) -> auto& { return c.steps; },
            [](const TrainConfig& c) { check_range("steps", c.steps, 1, kMaxSteps); }));
    add(f,
        {.name = "accum",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Micro-batches per step (gradient accumulation)"},
        uint_field(
            "accum", [](auto& c) -> auto& { return c.accum; },
            [](const TrainConfig& c) { check_range("accum", c.accum, 1, kMaxAccum); }));
    add(f,
        {.name = "seed",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Seed of the weights, the batch order and the corpus"},
        uint_field(
            "seed", [](auto& c) -> auto& { return c.seed; }, none));
    add(f,
        {.name = "eval-every",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Validation loss every N steps and at the end; 0 = only at the end"},
        uint_field(
            "eval-every", [](auto& c) -> auto& { return c.eval_every; }, none));
    add(f,
        {.name = "eval-windows",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Validation windows per evaluation; 0 = the whole split"},
        uint_field(
            "eval-windows", [](auto& c) -> auto& { return c.eval_windows; }, none));
    add(f,
        {.name = "histogram-every",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Log2-magnitude histograms at step 1, every N steps and the last; 0 = never"},
        uint_field(
            "histogram-every", [](auto& c) -> auto& { return c.histogram_every; }, none));
    add(f,
        {.name = "out",
         .kind = KeyKind::text,
         .type = "DIR",
         .help = "Run folder: config.json, log.jsonl, checkpoints, summary.json (default: none)",
         .resume_may_change = true,
         .compare_sets = true},
        string_field(
            "out", [](auto& c) -> auto& { return c.out; }, none));
    add(f,
        {.name = "checkpoint-every",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Checkpoint every N steps (needs --out); 0 = only at the end",
         .compare_sets = true},
        uint_field(
            "checkpoint-every", [](auto& c) -> auto& { return c.checkpoint_every; }, none));
    add(f,
        {.name = "keep-checkpoints",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Newest checkpoints kept in the run folder",
         .compare_sets = true},
        uint_field(
            "keep-checkpoints", [](auto& c) -> auto& { return c.keep_checkpoints; },
            [](const TrainConfig& c) { check_at_least("keep-checkpoints", c.keep_checkpoints, 1); }));
    add(f,
        {.name = "resume",
         .kind = KeyKind::text,
         .type = "DIR",
         .help = "Continue the run in DIR from its newest checkpoint; --steps may extend it",
         .resume_may_change = true,
         .compare_sets = true},
        string_field(
            "resume", [](auto& c) -> auto& { return c.resume; }, none));
    add(f,
        {.name = "distributed",
         .kind = KeyKind::flag,
         .type = "",
         .help = "Data-parallel over the ranks of mpirun -np N: each runs --accum micro-batches of the step",
         .resume_may_change = true,
         .compare_sets = true},
        {"distributed",
         [](TrainConfig& c, const json& v) {
           if (!v.is_boolean()) fail("distributed", "true or false", describe(v));
           c.distributed = v.get<bool>();
         },
         [](const TrainConfig& c) { return ordered_json(c.distributed); }, none});
    add(f,
        {.name = "zero",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Distributed: 1 = ZeRO stage 1 (master weights and optimizer state sharded); 0 = off",
         .resume_may_change = true,
         .compare_sets = true},
        uint_field(
            "zero", [](auto& c) -> auto& { return c.zero; },
            [](const TrainConfig& c) { check_range("zero", c.zero, 0, 1); }));
    add(f,
        {.name = "grad-reduce",
         .kind = KeyKind::text,
         .type = "MODE",
         .help = "Distributed gradient all-reduce: fp32 (fixed-order sums, bitwise reproducible) or low (f16/bf16, "
                 "half the bytes)",
         .resume_may_change = true,
         .compare_sets = true},
        string_field(
            "grad-reduce", [](auto& c) -> auto& { return c.grad_reduce; },
            [](const TrainConfig& c) {
              if (c.grad_reduce != "fp32" && c.grad_reduce != "low")
                fail("grad-reduce", "fp32 or low", squote(c.grad_reduce));
            }));
    add(f,
        {.name = "dist-timeout",
         .kind = KeyKind::number,
         .type = "S",
         .help = "Distributed: seconds a collective may take before the job is aborted",
         .resume_may_change = true,
         .compare_sets = true},
        double_field(
            "dist-timeout", [](auto& c) -> auto& { return c.dist_timeout; },
            [](const TrainConfig& c) {
              if (!(std::isfinite(c.dist_timeout) && c.dist_timeout > 0 && c.dist_timeout <= 86400))
                fail("dist-timeout", "a number of seconds in (0, 86400]", num(c.dist_timeout));
            }));
    add(f,
        {.name = "inject-overflow-rank",
         .kind = KeyKind::integer,
         .type = "R",
         .help = "Testing: --inject-overflow-at on rank R only; -1 = every rank",
         .resume_may_change = true,
         .compare_sets = true},
        {"inject-overflow-rank",
         [](TrainConfig& c, const json& v) {
           if (v.is_number_integer() && v.get<std::int64_t>() == -1) {
             c.inject_overflow_rank = -1;
             return;
           }
           c.inject_overflow_rank = static_cast<std::int64_t>(json_uint(v, "inject-overflow-rank", kMaxRanks - 1));
         },
         [](const TrainConfig& c) { return ordered_json(c.inject_overflow_rank); },
         [](const TrainConfig& c) {
           if (c.inject_overflow_rank < -1 || c.inject_overflow_rank >= static_cast<std::int64_t>(kMaxRanks))
             fail("inject-overflow-rank", "-1 (every rank) or a rank in [0, " + std::to_string(kMaxRanks) + ")",
                  std::to_string(c.inject_overflow_rank));
         }},
        [](std::string_view text) {
          return text == "-1" ? json(-1) : json(text::parse_uint("inject-overflow-rank", text));
        });
    add(f,
        {.name = "inject-overflow-at",
         .kind = KeyKind::list,
         .type = "LIST",
         .help = "Testing: +inf into a gradient at these steps (1-based), e.g. 5,17"},
        {"inject-overflow-at",
         [](TrainConfig& c, const json& v) {
           constexpr std::string_view key = "inject-overflow-at";
           if (!v.is_array()) fail(key, "an array of step numbers", describe(v));
           std::vector<std::size_t> steps;
           for (const json& e : v) steps.push_back(json_uint(e, key, std::numeric_limits<std::size_t>::max()));
           c.inject_overflow_at = std::move(steps);
         },
         [](const TrainConfig& c) {
           ordered_json a = ordered_json::array();
           for (const std::size_t s : c.inject_overflow_at) a.push_back(static_cast<std::uint64_t>(s));
           return a;
         },
         [](const TrainConfig& c) {
           for (const std::size_t s : c.inject_overflow_at) check_at_least("inject-overflow-at", s, 1);
         }});
    add(f,
        {.name = "threads",
         .kind = KeyKind::integer,
         .type = "N",
         .help = "Threads; 0 = all cores (MIXPREC_THREADS / OMP_NUM_THREADS respected)"},
        uint_field(
            "threads", [](auto& c) -> auto& { return c.threads; },
            [](const TrainConfig& c) { check_range("threads", c.threads, 0, kMaxThreads); }));
    return f;
  }();
  return table;
}

std::string known_keys() {
  std::string out;
  for (const Field& f : fields()) out += (out.empty() ? "" : ", ") + f.key;
  return out;
}

const Field& field_of(std::string_view key) {
  for (const Field& f : fields())
    if (f.key == key) return f;
  throw std::invalid_argument("unknown config key '" + std::string(key) + "'; known keys: " + known_keys());
}

}  // namespace

std::optional<LossScaleConfig> loss_scale_config(const std::string& spec) {
  check_loss_scale(spec);
  if (spec == "none") return std::nullopt;
  if (spec == "dynamic") return loss_scale_preset("mixprec");
  if (spec.starts_with("static:")) {
    LossScaleConfig c = loss_scale_preset("static");
    c.init_scale = static_loss_scale(spec);
    return c;
  }
  return loss_scale_preset(spec);
}

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> k;
    for (const Field& f : fields()) k.push_back(f.info);
    return k;
  }();
  return keys;
}

const ConfigKey* find_config_key(std::string_view name) {
  for (const Field& f : fields())
    if (f.key == name) return &f.info;
  return nullptr;
}

void set_config_key(TrainConfig& c, std::string_view key, std::string_view text) {
  const Field& f = field_of(key);
  f.read(c, text_value(f, text));
}

std::string config_key_text(const TrainConfig& c, std::string_view key) {
  const ordered_json v = field_of(key).write(c);
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    std::string out;
    for (const ordered_json& e : v) out.append(out.empty() ? "" : ",").append(e.dump());
    return out;
  }
  return v.dump();
}

const std::vector<std::string>& fp8_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const Field& f : fields())
      if (f.info.only_for != 0) k.push_back(f.key);
    return k;
  }();
  return keys;
}

nn::Fp8Config fp8_config(const TrainConfig& c) {
  nn::Fp8Config f;
  f.format = c.fp8_format == "e4m3" ? fp8::Format::e4m3 : fp8::Format::hybrid;
  f.margin = static_cast<int>(c.fp8_margin);
  f.amax_history_len = c.fp8_amax_history;
  f.amax_compute_algo = c.fp8_amax_algo == "most_recent" ? fp8::AmaxAlgo::most_recent : fp8::AmaxAlgo::max;
  f.power_of_2_scales = c.fp8_power2_scales;
  f.amax_epsilon = static_cast<float>(c.fp8_amax_epsilon);
  f.mx_rounding = c.mx_rounding == "ocp" ? fp8::MxRounding::ocp : fp8::MxRounding::transformer_engine;
  return f;
}

bool fp8_key_applies(std::string_view key, nn::Precision p) {
  const std::uint32_t only = field_of(key).info.only_for;
  return only == 0 || (only & (1u << static_cast<unsigned>(p))) != 0;
}

TrainConfig with_fp8_options_for(TrainConfig c, nn::Precision p) {
  const TrainConfig defaults;
  for (const Field& f : fields()) {
    const auto& keys = fp8_keys();
    if (std::find(keys.begin(), keys.end(), f.key) == keys.end() || fp8_key_applies(f.key, p)) continue;
    f.read(c, json::parse(f.write(defaults).dump()));
  }
  return c;
}

void validate(const TrainConfig& c) {
  for (const Field& f : fields()) f.check(c);
  // An fp8 option away from its default with a precision that does not use it would be
  // silently ignored: refuse it.
  {
    const ordered_json defaults = ordered_json::parse(to_json(TrainConfig{}));
    const ordered_json given = ordered_json::parse(to_json(c));
    for (const std::string& key : fp8_keys()) {
      if (given[key] == defaults[key]) continue;
      if (fp8_key_applies(key, c.precision)) continue;
      std::vector<std::string> names;
      for (const std::string& name : nn::precision_names())
        if (fp8_key_applies(key, *nn::parse_precision(name))) names.push_back(name);
      fail(key, "the default (" + defaults[key].dump() + ") with --precision " +
                    std::string(nn::precision_name(c.precision)) + "; it applies to --precision " + join(names),
           given[key].dump());
    }
  }
  // Across keys.
  if (c.model.channels % c.model.heads != 0)
    fail("heads", "a divisor of channels (" + std::to_string(c.model.channels) + ")", std::to_string(c.model.heads));
  if (c.model.batch * c.model.context > kMaxTokensPerBatch)
    fail("batch", "batch * context <= " + std::to_string(kMaxTokensPerBatch) + " tokens per micro-batch",
         std::to_string(c.model.batch) + " * " + std::to_string(c.model.context));
  if (c.min_lr > c.lr) fail("min-lr", "a number <= lr (" + num(c.lr) + ")", num(c.min_lr));
  if (c.warmup > c.steps) fail("warmup", "an integer <= steps (" + std::to_string(c.steps) + ")", std::to_string(c.warmup));
  for (const std::size_t s : c.inject_overflow_at)
    check_range("inject-overflow-at", s, 1, c.steps);
  if (c.grad_reduce == "low") {
    if (!c.distributed) fail("grad-reduce", "fp32 unless --distributed (low is a way of all-reducing)", "low");
    if (nn::policy_of(c.precision).weights == DType::f32)
      fail("grad-reduce", std::string("fp32 with precision ").append(nn::precision_name(c.precision)) +
                              " (low all-reduces in the model's f16/bf16 format; this precision has none)",
           "low");
  }
  if (c.zero == 1 && !c.distributed) fail("zero", "0 unless --distributed (ZeRO shards across ranks)", "1");
  if (c.zero == 1 && c.grad_reduce != "fp32")
    fail("grad-reduce", "fp32 with --zero 1 (its reduce-scatter sums in fp32)", squote(c.grad_reduce));
  if (c.inject_overflow_rank >= 0 && !c.distributed)
    fail("inject-overflow-rank", "-1 unless --distributed", std::to_string(c.inject_overflow_rank));
  if (c.data.empty()) {
    const std::size_t need = nn::min_tokens_for(c.model.context, c.val_fraction);
    if (c.corpus_tokens < need)
      fail("corpus-tokens", "at least " + std::to_string(need) + " (context " + std::to_string(c.model.context) +
                                " and val-fraction " + num(c.val_fraction) +
                                " need context + 1 tokens in each split)",
           std::to_string(c.corpus_tokens));
  }
}

TrainConfig apply_json(const TrainConfig& base, std::string_view json_text, std::string_view source) {
  const std::string src(source);
  json doc;
  std::set<std::string> seen;
  std::string duplicate;
  if (const std::string deep = json_depth_problem(json_text); !deep.empty())
    throw std::invalid_argument(src + ": " + deep);
  try {
    doc = json::parse(json_text, [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth == 1 && event == json::parse_event_t::key && parsed.is_string() &&
          !seen.insert(parsed.get<std::string>()).second && duplicate.empty())
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number a double cannot hold (1e400)
    throw std::invalid_argument(src + ": " + text::malformed_json(e.what()));
  }
  if (!doc.is_object())
    throw std::invalid_argument(src + ": expected a JSON object of settings (flag names without the dashes), found " +
                                std::string(doc.type_name()));
  if (!duplicate.empty()) throw std::invalid_argument(src + ": key '" + duplicate + "' is given twice");
  TrainConfig c = base;
  for (const auto& [key, value] : doc.items()) {
    const Field* field = nullptr;
    for (const Field& f : fields())
      if (f.key == key) field = &f;
    if (field == nullptr)
      throw std::invalid_argument(src + ": unknown key '" + key + "'; known keys: " + known_keys());
    try {
      field->read(c, value);
      field->check(c);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(src + ": " + e.what());
    }
  }
  return c;
}

std::string to_json(const TrainConfig& c, int indent) {
  ordered_json j = ordered_json::object();
  for (const Field& f : fields()) j[f.key] = f.write(c);
  return j.dump(indent, ' ', false, ordered_json::error_handler_t::replace);
}

std::string to_json(const TrainConfig& c, const std::vector<std::string_view>& keys, int indent) {
  for (const std::string_view k : keys) (void)field_of(k);
  ordered_json j = ordered_json::object();
  for (const Field& f : fields())
    if (std::find(keys.begin(), keys.end(), f.key) != keys.end()) j[f.key] = f.write(c);
  return j.dump(indent, ' ', false, ordered_json::error_handler_t::replace);
}

}  // namespace mixprec::train
