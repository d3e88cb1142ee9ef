// lowp::resolve and the recipe file (include/mixprec/lowp/assignment.hpp): nlohmann stays
// private to the library.
#include "mixprec/lowp/assignment.hpp"

#include "mixprec/core/json_read.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>

namespace mixprec::lowp {

namespace {

using json = nlohmann::ordered_json;

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

constexpr std::string_view kHigh = "bf16";
const std::set<std::string> kOptionKeys = {"fp8_format", "amax_history_len", "amax_compute_algo", "margin",
                                           "power_of_2_scales", "scale_rounding", "weight_2d", "rht",
                                           "stochastic_rounding", "flavour"};

std::string dump(const json& j) { return j.dump(); }

bool get_bool(const json& v, const std::string& where) {
  if (!v.is_boolean()) fail(where + ": expected true or false, found " + dump(v));
  return v.get<bool>();
}

std::string get_string(const json& v, const std::string& where) {
  if (!v.is_string()) fail(where + ": expected a string, found " + dump(v));
  return v.get<std::string>();
}

long long get_int(const json& v, const std::string& where) {
  if (!v.is_number_integer()) fail(where + ": expected an integer, found " + dump(v));
  return v.get<long long>();
}

lowp::Format format_of(const std::string& s, const std::string& where) {
  const std::optional<lowp::Format> f = lowp::parse_format(s);
  if (!f) fail(where + ": expected \"hybrid\" or \"e4m3\", found \"" + s + "\"");
  return *f;
}

// Where an entry is read: the file's shared options (no recipe), a module's entry (a recipe,
// or a zoo name), one operand's (a recipe, no zoo, no per-direction fields), or a phase's
// change (every field optional).
enum class EntryKind { options, module, operand, change };

constexpr std::string_view kDirectionKeys[] = {"fprop", "dgrad", "wgrad", "backward_override", "columnwise_source"};

bool is_direction_key(std::string_view k) {
  for (const auto d : kDirectionKeys)
    if (k == d) return true;
  return false;
}

RecipeChoice choice_from(const json& entry, const std::string& where, EntryKind kind);

// Sets operand o's choice, keeping the operands in their enum order (one way to hold a set,
// so that equal choices compare equal whatever order they were written in).
void put_operand(RecipeChoice& c, Operand o, RecipeChoice oc) {
  std::size_t i = 0;
  while (i < c.operand_ids.size() && c.operand_ids[i] < o) ++i;
  if (i < c.operand_ids.size() && c.operand_ids[i] == o) {
    c.operand_choices[i] = std::move(oc);
    return;
  }
  c.operand_ids.insert(c.operand_ids.begin() + static_cast<std::ptrdiff_t>(i), o);
  c.operand_choices.insert(c.operand_choices.begin() + static_cast<std::ptrdiff_t>(i), std::move(oc));
}

bool has_options(const RecipeChoice& c) {
  return c.fp8_format || c.amax_history_len || c.amax_compute_algo || c.margin || c.power_of_2_scales ||
         c.scale_rounding || c.weight_2d || c.rht || c.stochastic_rounding || c.flavour;
}

// The option fields of c alone (no recipe, no per-operand fields).
RecipeChoice options_of(const RecipeChoice& c) {
  RecipeChoice o;
  o.fp8_format = c.fp8_format;
  o.amax_history_len = c.amax_history_len;
  o.amax_compute_algo = c.amax_compute_algo;
  o.margin = c.margin;
  o.power_of_2_scales = c.power_of_2_scales;
  o.scale_rounding = c.scale_rounding;
  o.weight_2d = c.weight_2d;
  o.rht = c.rht;
  o.stochastic_rounding = c.stochastic_rounding;
  o.flavour = c.flavour;
  return o;
}

std::string recipe_expectation(EntryKind kind) {
  std::string e = "one of " + recipe_names() + ", \"bf16\"";
  if (kind == EntryKind::module || kind == EntryKind::change) e += " or a zoo name (" + zoo_names() + ")";
  return e;
}

// A recipe name, "bf16" (recipe unset) or, where allowed, a zoo name, into c.
void take_recipe_name(RecipeChoice& c, const std::string& name, const std::string& where, EntryKind kind) {
  if (name == kHigh) return;
  if (const auto r = parse_recipe(name)) {
    c.recipe = r;
    return;
  }
  if (const auto z = parse_zoo(name); z && (kind == EntryKind::module || kind == EntryKind::change)) {
    c = zoo_choice(*z);
    return;
  }
  fail(where + ": expected " + recipe_expectation(kind) + ", found \"" + name + "\"");
}

void set_operand(RecipeChoice& c, Operand o, RecipeChoice oc, const std::string& where) {
  for (const Operand have : c.operand_ids)
    if (have == o) fail(where + ": " + std::string(operand_name(o)) + " is given twice");
  put_operand(c, o, std::move(oc));
}

// "fprop" / "dgrad" / "wgrad": an entry for both operands, or {"x"|"w"|"dy": entry}.
void take_direction(RecipeChoice& c, const std::string& direction, const json& v, const std::string& where) {
  const std::string a = direction == "dgrad" ? "dy" : "x", b = direction == "wgrad" ? "dy" : "w";
  const Operand oa = *parse_operand(direction + "." + a), ob = *parse_operand(direction + "." + b);
  const bool per_operand = v.is_object() && !v.contains("recipe");
  if (!per_operand) {
    const RecipeChoice oc = choice_from(v, where, EntryKind::operand);
    set_operand(c, oa, oc, where);
    set_operand(c, ob, oc, where);
    return;
  }
  if (v.empty()) fail(where + ": expected \"" + a + "\" and/or \"" + b + "\" (or an entry with \"recipe\"), found {}");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != a && it.key() != b)
      fail(where + "." + it.key() + ": unknown operand; expected \"" + a + "\", \"" + b +
           "\" or \"recipe\" (an entry for both)");
    set_operand(c, it.key() == a ? oa : ob, choice_from(it.value(), where + "." + it.key(), EntryKind::operand),
                where + "." + it.key());
  }
}

Source source_of(const json& v, const std::string& where) {
  const std::string s = get_string(v, where);
  if (s == "original") return Source::original;
  if (s == "dequantized") return Source::dequantized;
  fail(where + ": expected \"original\" or \"dequantized\", found \"" + s + "\"");
}

RecipeChoice choice_from(const json& entry, const std::string& where, EntryKind kind) {
  const bool recipe_allowed = kind != EntryKind::options;
  RecipeChoice c;
  if (entry.is_string()) {
    if (!recipe_allowed) fail(where + ": expected an object of options, found " + dump(entry));
    take_recipe_name(c, entry.get<std::string>(), where, kind);
    return c;
  }
  if (!entry.is_object())
    fail(where + ": expected a recipe name, \"bf16\" or an object with \"recipe\", found " + dump(entry));
  bool has_recipe = false;
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    const std::string w = where + "." + k;
    if (is_direction_key(k) && kind != EntryKind::module && kind != EntryKind::change)
      fail(w + ": not allowed here (" + (kind == EntryKind::options ? std::string("options apply to every entry")
                                                                    : std::string("an operand's own entry")) +
           ")");
    if (k == "recipe") {
      if (!recipe_allowed) fail(w + ": not allowed here (options apply to every entry)");
      const std::string name = get_string(v, w);
      has_recipe = true;
      if (name == kHigh) continue;  // options are refused below; per-direction fields may quantize operands
      if (parse_zoo(name) && (kind == EntryKind::module || kind == EntryKind::change)) {
        if (entry.size() != 1) fail(where + ": a zoo name (\"" + name + "\") takes no other fields");
        take_recipe_name(c, name, w, kind);
        return c;
      }
      take_recipe_name(c, name, w, kind);
    } else if (k == "fprop" || k == "dgrad" || k == "wgrad") {
      take_direction(c, k, v, w);
    } else if (k == "backward_override") {
      const std::string s = get_string(v, w);
      if (s == "high_precision") c.backward_override = BackwardOverride::high_precision;
      else if (s == "dequantized") c.backward_override = BackwardOverride::dequantized;
      else fail(w + ": expected \"high_precision\" or \"dequantized\", found \"" + s + "\"");
    } else if (k == "columnwise_source") {
      if (v.is_object()) {
        for (auto s = v.begin(); s != v.end(); ++s) {
          if (s.key() == "x") c.x_source = source_of(s.value(), w + ".x");
          else if (s.key() == "w") c.w_source = source_of(s.value(), w + ".w");
          else fail(w + "." + s.key() + ": unknown tensor; expected \"x\" or \"w\"");
        }
      } else {
        c.x_source = c.w_source = source_of(v, w);
      }
    } else if (k == "fp8_format") {
      c.fp8_format = format_of(get_string(v, w), w);
    } else if (k == "amax_history_len") {
      const long long n = get_int(v, w);
      if (n < 1 || n > (1 << 20)) fail(w + ": expected an integer in [1, 1048576], found " + dump(v));
      c.amax_history_len = static_cast<std::size_t>(n);
    } else if (k == "amax_compute_algo") {
      const std::string s = get_string(v, w);
      c.amax_compute_algo = lowp::parse_amax_algo(s);
      if (!c.amax_compute_algo) fail(w + ": expected \"max\" or \"most_recent\", found \"" + s + "\"");
    } else if (k == "margin") {
      const long long m = get_int(v, w);
      if (m < -64 || m > 64) fail(w + ": expected an integer in [-64, 64], found " + dump(v));
      c.margin = static_cast<int>(m);
    } else if (k == "power_of_2_scales") {
      c.power_of_2_scales = get_bool(v, w);
    } else if (k == "scale_rounding") {
      const std::string s = get_string(v, w);
      c.scale_rounding = parse_scale_rounding(s);
      if (!c.scale_rounding) fail(w + ": expected \"rceil\" or \"floor\", found \"" + s + "\"");
    } else if (k == "weight_2d") {
      c.weight_2d = get_bool(v, w);
    } else if (k == "rht") {
      c.rht = get_bool(v, w);
    } else if (k == "stochastic_rounding") {
      c.stochastic_rounding = get_bool(v, w);
    } else if (k == "flavour") {
      const std::string s = get_string(v, w);
      c.flavour = parse_flavour(s);
      if (!c.flavour) fail(w + ": expected \"te\" or \"torchao\", found \"" + s + "\"");
    } else {
      std::string known = "recipe";
      for (const auto& o : kOptionKeys) known += ", " + o;
      if (kind == EntryKind::module || kind == EntryKind::change)
        for (const auto d : kDirectionKeys) known += ", " + std::string(d);
      fail(w + ": unknown option; expected one of " + known);
    }
  }
  if ((kind == EntryKind::module || kind == EntryKind::operand) && !has_recipe)
    fail(where + ": expected \"recipe\" in the object");
  if (has_recipe && !c.recipe && has_options(c)) fail(where + ": \"bf16\" takes no options");
  return c;
}

template <class T>
void overlay(std::optional<T>& into, const std::optional<T>& from) {
  if (from) into = from;
}

json choice_to_json(const RecipeChoice& c, bool with_recipe) {
  if (c.zoo) return std::string(zoo_name(*c.zoo));
  const bool only_recipe = !has_options(c) && !c.directional();
  const std::string name = c.recipe ? std::string(recipe_name(*c.recipe)) : std::string(kHigh);
  if (with_recipe && only_recipe) return name;
  json o = json::object();
  if (with_recipe) o["recipe"] = name;
  for (std::size_t i = 0; i < c.operand_ids.size(); ++i) {
    const std::string op(operand_name(c.operand_ids[i]));
    const std::size_t dot = op.find('.');
    o[op.substr(0, dot)][op.substr(dot + 1)] = choice_to_json(c.operand_choices[i], true);
  }
  if (c.backward_override) o["backward_override"] = std::string(backward_override_name(*c.backward_override));
  if (c.x_source) o["columnwise_source"]["x"] = std::string(source_name(*c.x_source));
  if (c.w_source) o["columnwise_source"]["w"] = std::string(source_name(*c.w_source));
  if (c.fp8_format) o["fp8_format"] = std::string(lowp::format_key(*c.fp8_format));
  if (c.amax_history_len) o["amax_history_len"] = *c.amax_history_len;
  if (c.amax_compute_algo) o["amax_compute_algo"] = std::string(lowp::amax_algo_name(*c.amax_compute_algo));
  if (c.margin) o["margin"] = *c.margin;
  if (c.power_of_2_scales) o["power_of_2_scales"] = *c.power_of_2_scales;
  if (c.scale_rounding) o["scale_rounding"] = std::string(scale_rounding_name(*c.scale_rounding));
  if (c.weight_2d) o["weight_2d"] = *c.weight_2d;
  if (c.rht) o["rht"] = *c.rht;
  if (c.stochastic_rounding) o["stochastic_rounding"] = *c.stochastic_rounding;
  if (c.flavour) o["flavour"] = std::string(flavour_name(*c.flavour));
  return o;
}

}  // namespace

namespace {
constexpr std::string_view kOperandNames[kOperands] = {"fprop.x", "fprop.w", "dgrad.dy", "dgrad.w", "wgrad.x", "wgrad.dy"};
constexpr std::string_view kZooNames[] = {"high_precision_fwd_mxfp8_bwd", "mxfp8_fwd_high_precision_bwd",
                                          "mxfp8_fwd_nvfp4_bwd", "nvfp4_1d_weight"};
}  // namespace

std::string_view operand_name(Operand o) noexcept { return kOperandNames[static_cast<std::size_t>(o)]; }
std::optional<Operand> parse_operand(std::string_view s) noexcept {
  for (std::size_t i = 0; i < kOperands; ++i)
    if (s == kOperandNames[i]) return static_cast<Operand>(i);
  return std::nullopt;
}
std::string_view source_name(Source s) noexcept { return s == Source::original ? "original" : "dequantized"; }
std::string_view backward_override_name(BackwardOverride b) noexcept {
  return b == BackwardOverride::high_precision ? "high_precision" : "dequantized";
}
std::string_view zoo_name(Zoo z) noexcept { return kZooNames[static_cast<std::size_t>(z)]; }
std::optional<Zoo> parse_zoo(std::string_view s) noexcept {
  for (std::size_t i = 0; i < std::size(kZooNames); ++i)
    if (s == kZooNames[i]) return static_cast<Zoo>(i);
  return std::nullopt;
}
std::string zoo_names() {
  std::string out;
  for (const auto n : kZooNames) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

Element LinearRecipe::element(bool gradient) const noexcept {
  if (recipe == Recipe::nvfp4 || recipe == Recipe::mxfp4) return Element::e2m1;
  return lowp::dtype_for(fp8_format, gradient ? lowp::Role::backward : lowp::Role::forward) == lowp::Element::e5m2
             ? Element::e5m2
             : Element::e4m3;
}

QuantizeConfig LinearRecipe::config(bool gradient, bool weight, Layout layout) const {
  QuantizeConfig c;
  c.recipe = recipe;
  c.element = element(gradient);
  c.layout = layout;
  c.tile_2d = weight && weight_2d;
  c.scale_rounding = scale_rounding;
  c.power_of_2_scales = power_of_2_scales;
  c.flavour = flavour;
  return c;
}

// Shared options (a file's "options", the keyword options of a door) reach only the recipes
// that have them; an entry's own options must fit its recipe.
namespace {
RecipeChoice shared_for(RecipeChoice d, Recipe r) {
  const bool fp4 = r == Recipe::nvfp4 || r == Recipe::mxfp4, mx = r == Recipe::mxfp8 || r == Recipe::mxfp4;
  if (fp4) d.fp8_format.reset();
  if (r != Recipe::fp8_delayed) {
    d.amax_history_len.reset();
    d.amax_compute_algo.reset();
    d.margin.reset();
  }
  if (r != Recipe::fp8_current && r != Recipe::fp8_block) d.power_of_2_scales.reset();
  if (!mx) d.scale_rounding.reset();
  if (r != Recipe::fp8_block && r != Recipe::nvfp4) d.weight_2d.reset();
  if (r != Recipe::nvfp4) d.rht.reset();
  if (!fp4) d.stochastic_rounding.reset();
  if (!mx && r != Recipe::nvfp4) d.flavour.reset();
  return d;
}

}  // namespace

std::optional<LinearRecipe> resolve(const RecipeChoice& choice, const RecipeChoice& defaults) {
  if (!choice.recipe) return std::nullopt;
  RecipeChoice m = shared_for(defaults, *choice.recipe);
  m.recipe = choice.recipe;
  overlay(m.fp8_format, choice.fp8_format);
  overlay(m.amax_history_len, choice.amax_history_len);
  overlay(m.amax_compute_algo, choice.amax_compute_algo);
  overlay(m.margin, choice.margin);
  overlay(m.power_of_2_scales, choice.power_of_2_scales);
  overlay(m.scale_rounding, choice.scale_rounding);
  overlay(m.weight_2d, choice.weight_2d);
  overlay(m.rht, choice.rht);
  overlay(m.stochastic_rounding, choice.stochastic_rounding);
  overlay(m.flavour, choice.flavour);
  const Recipe r = *m.recipe;
  const std::string name(recipe_name(r));
  const bool fp4 = r == Recipe::nvfp4 || r == Recipe::mxfp4;
  auto only = [&](bool set, bool allowed, const char* option, const char* which) {
    if (set && !allowed) fail(std::string(option) + ": only " + which + " have it, found it with " + name);
  };
  LinearRecipe o;
  o.recipe = r;
  only(m.fp8_format.has_value(), !fp4, "fp8_format", "the fp8 recipes");
  o.fp8_format = m.fp8_format.value_or(r == Recipe::fp8_delayed || r == Recipe::fp8_current ? lowp::Format::hybrid
                                                                                             : lowp::Format::e4m3);
  const bool delayed = r == Recipe::fp8_delayed;
  only(m.amax_history_len.has_value() || m.amax_compute_algo.has_value() || m.margin.has_value(), delayed,
       "amax_history_len/amax_compute_algo/margin", "fp8-delayed");
  o.amax_history_len = m.amax_history_len.value_or(1024);
  o.amax_compute_algo = m.amax_compute_algo.value_or(lowp::AmaxAlgo::max);
  o.margin = m.margin.value_or(0);
  only(m.power_of_2_scales.has_value(), r == Recipe::fp8_current || r == Recipe::fp8_block, "power_of_2_scales",
       "fp8-current and fp8-block");
  o.power_of_2_scales = m.power_of_2_scales;
  only(m.scale_rounding.has_value() && *m.scale_rounding != ScaleRounding::rceil,
       r == Recipe::mxfp8 || r == Recipe::mxfp4, "scale_rounding", "mxfp8 and mxfp4");
  o.scale_rounding = m.scale_rounding.value_or(ScaleRounding::rceil);
  o.flavour = m.flavour.value_or(Flavour::te);
  only(o.flavour == Flavour::torchao, r == Recipe::mxfp8 || r == Recipe::mxfp4 || r == Recipe::nvfp4,
       "flavour torchao", "mxfp8, mxfp4 and nvfp4");
  const bool te = o.flavour == Flavour::te;
  o.weight_2d = m.weight_2d.value_or(te && (r == Recipe::fp8_block || r == Recipe::nvfp4));
  o.rht = m.rht.value_or(te && r == Recipe::nvfp4);
  o.stochastic_rounding = m.stochastic_rounding.value_or(te && r == Recipe::nvfp4);
  only(o.weight_2d, r == Recipe::fp8_block || r == Recipe::nvfp4, "weight_2d", "fp8-block and nvfp4");
  only(o.rht, r == Recipe::nvfp4, "rht", "nvfp4");
  only(o.stochastic_rounding, fp4, "stochastic_rounding", "nvfp4 and mxfp4");
  if (!te && (o.weight_2d || o.rht || o.stochastic_rounding))
    fail("flavour torchao: weight_2d, rht and stochastic_rounding are TE's (leave them unset or false)");
  return o;
}

// ---- per-operand plans ------------------------------------------------------------------

RecipeChoice zoo_choice(Zoo z) {
  RecipeChoice c;
  c.zoo = z;
  auto put = [&](Operand o, RecipeChoice oc) { put_operand(c, o, std::move(oc)); };
  RecipeChoice plain_nvfp4 = RecipeChoice::of(Recipe::nvfp4);  // TE's _plain_nvfp4_quantizer
  plain_nvfp4.weight_2d = false;
  plain_nvfp4.rht = false;
  plain_nvfp4.stochastic_rounding = false;
  switch (z) {
    case Zoo::high_precision_fwd_mxfp8_bwd:
      c.recipe = Recipe::mxfp8;
      put(Operand::fprop_x, {});
      put(Operand::fprop_w, {});
      break;
    case Zoo::mxfp8_fwd_high_precision_bwd:
      c.recipe = Recipe::mxfp8;
      c.backward_override = BackwardOverride::dequantized;
      break;
    case Zoo::mxfp8_fwd_nvfp4_bwd:
      c.recipe = Recipe::mxfp8;
      put(Operand::dgrad_dy, RecipeChoice::of(Recipe::nvfp4));
      put(Operand::dgrad_w, plain_nvfp4);
      put(Operand::wgrad_x, RecipeChoice::of(Recipe::nvfp4));
      put(Operand::wgrad_dy, RecipeChoice::of(Recipe::nvfp4));
      c.w_source = Source::dequantized;
      break;
    case Zoo::nvfp4_1d_weight:
      c.recipe = Recipe::nvfp4;
      put(Operand::fprop_w, plain_nvfp4);
      put(Operand::dgrad_w, plain_nvfp4);
      c.w_source = Source::dequantized;
      break;
  }
  return c;
}

QuantizeConfig LinearPlan::config(Operand o) const {
  const std::optional<LinearRecipe>& r = at(o);
  if (!r) throw std::logic_error("LinearPlan::config: " + std::string(operand_name(o)) + " is high precision");
  QuantizeConfig c = r->config(is_gradient(o), is_weight(o), layout_of(o));
  const bool fp4 = r->recipe == Recipe::nvfp4 || r->recipe == Recipe::mxfp4;
  c.stochastic_rounding = fp4 && r->stochastic_rounding && is_gradient(o);
  c.rht = r->recipe == Recipe::nvfp4 && r->rht && (o == Operand::wgrad_x || o == Operand::wgrad_dy);
  return c;
}

std::optional<LinearRecipe> LinearPlan::uniform() const {
  if (x_source != Source::original || w_source != Source::original || !operands[0]) return std::nullopt;
  for (const auto& r : operands)
    if (r != operands[0]) return std::nullopt;
  return operands[0];
}

bool LinearPlan::any_quantized() const noexcept {
  for (const auto& r : operands)
    if (r) return true;
  return false;
}

std::optional<LinearRecipe> LinearPlan::primary() const {
  for (const auto& r : operands)
    if (r) return r;
  return std::nullopt;
}

LinearPlan plan(const RecipeChoice& choice, const RecipeChoice& defaults) {
  LinearPlan p;
  const std::optional<LinearRecipe> base = resolve(choice, defaults);
  p.operands.fill(base);
  constexpr Operand kBackward[] = {Operand::dgrad_dy, Operand::dgrad_w, Operand::wgrad_x, Operand::wgrad_dy};
  if (choice.backward_override) {
    for (const Operand o : choice.operand_ids)
      for (const Operand b : kBackward)
        if (o == b)
          fail(std::string(operand_name(o)) + ": backward_override sets every backward operand (remove one of the two)");
    if (choice.x_source || choice.w_source)
      fail("columnwise_source: backward_override sets it (\"dequantized\": both from fprop; \"high_precision\": "
           "both original)");
    for (const Operand b : kBackward) p.operands[static_cast<std::size_t>(b)].reset();
    if (*choice.backward_override == BackwardOverride::dequantized) p.x_source = p.w_source = Source::dequantized;
  }
  // An operand's own options first, then the Linear's, then the shared ones.
  RecipeChoice entry_defaults = defaults;
  const RecipeChoice own = options_of(choice);
  overlay(entry_defaults.fp8_format, own.fp8_format);
  overlay(entry_defaults.amax_history_len, own.amax_history_len);
  overlay(entry_defaults.amax_compute_algo, own.amax_compute_algo);
  overlay(entry_defaults.margin, own.margin);
  overlay(entry_defaults.power_of_2_scales, own.power_of_2_scales);
  overlay(entry_defaults.scale_rounding, own.scale_rounding);
  overlay(entry_defaults.weight_2d, own.weight_2d);
  overlay(entry_defaults.rht, own.rht);
  overlay(entry_defaults.stochastic_rounding, own.stochastic_rounding);
  overlay(entry_defaults.flavour, own.flavour);
  for (std::size_t i = 0; i < choice.operand_ids.size(); ++i) {
    const Operand o = choice.operand_ids[i];
    try {
      p.operands[static_cast<std::size_t>(o)] = resolve(choice.operand_choices[i], entry_defaults);
    } catch (const std::invalid_argument& e) {
      fail(std::string(operand_name(o)) + ": " + e.what());
    }
  }
  if (choice.x_source) p.x_source = *choice.x_source;
  if (choice.w_source) p.w_source = *choice.w_source;
  // fp8-delayed keeps one amax history per tensor, shared by its operands.
  const LinearRecipe* delayed = nullptr;
  for (std::size_t i = 0; i < kOperands; ++i)
    if (p.operands[i] && p.operands[i]->recipe == Recipe::fp8_delayed) delayed = &*p.operands[i];
  if (delayed) {
    for (std::size_t i = 0; i < kOperands; ++i)
      if (p.operands[i] && *p.operands[i] != *delayed)
        fail(std::string(kOperandNames[i]) + ": fp8-delayed keeps one amax history per tensor, so it combines only "
             "with high precision; found " + std::string(recipe_name(p.operands[i]->recipe)) +
             (p.operands[i]->recipe == Recipe::fp8_delayed ? " with other options" : "") + " beside it");
  }
  if (p.operands[static_cast<std::size_t>(Operand::wgrad_x)] && p.operands[static_cast<std::size_t>(Operand::wgrad_dy)]) {
    const bool rx = p.config(Operand::wgrad_x).rht, rdy = p.config(Operand::wgrad_dy).rht;
    if (rx != rdy)
      fail(std::string("wgrad: the Hadamard transform cancels only when both operands have it; found it on ") +
           (rx ? "x" : "dy") + " alone (set rht the same on wgrad.x and wgrad.dy)");
  } else if ((p.at(Operand::wgrad_x) && p.config(Operand::wgrad_x).rht) ||
             (p.at(Operand::wgrad_dy) && p.config(Operand::wgrad_dy).rht)) {
    fail("wgrad: the Hadamard transform cancels only when both operands have it; found one operand in high "
         "precision (set rht false on the quantized one)");
  }
  if (p.x_source == Source::dequantized && !p.at(Operand::fprop_x))
    fail("columnwise_source.x: \"dequantized\" takes the values fprop multiplied, but fprop.x is high precision");
  if (p.w_source == Source::dequantized && !p.at(Operand::fprop_w))
    fail("columnwise_source.w: \"dequantized\" takes the values fprop multiplied, but fprop.w is high precision");
  return p;
}

RecipeChoice apply_change(const RecipeChoice& base, const RecipeChoice& change) {
  RecipeChoice out = base;
  out.zoo.reset();  // no longer the zoo's assignment as written
  overlay(out.fp8_format, change.fp8_format);
  overlay(out.amax_history_len, change.amax_history_len);
  overlay(out.amax_compute_algo, change.amax_compute_algo);
  overlay(out.margin, change.margin);
  overlay(out.power_of_2_scales, change.power_of_2_scales);
  overlay(out.scale_rounding, change.scale_rounding);
  overlay(out.weight_2d, change.weight_2d);
  overlay(out.rht, change.rht);
  overlay(out.stochastic_rounding, change.stochastic_rounding);
  overlay(out.flavour, change.flavour);
  auto drop = [&](auto&& pred) {
    for (std::size_t i = out.operand_ids.size(); i-- > 0;) {
      if (pred(out.operand_ids[i])) {
        out.operand_ids.erase(out.operand_ids.begin() + static_cast<std::ptrdiff_t>(i));
        out.operand_choices.erase(out.operand_choices.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
  };
  auto backward = [](Operand o) { return o != Operand::fprop_x && o != Operand::fprop_w; };
  if (change.backward_override) {  // the later word on the backward wins
    drop(backward);
    out.x_source.reset();
    out.w_source.reset();
    out.backward_override = change.backward_override;
  }
  for (std::size_t i = 0; i < change.operand_ids.size(); ++i) {
    const Operand o = change.operand_ids[i];
    if (backward(o)) out.backward_override.reset();
    put_operand(out, o, change.operand_choices[i]);
  }
  overlay(out.x_source, change.x_source);
  overlay(out.w_source, change.w_source);
  return out;
}

bool module_matches(std::string_view pattern, std::string_view name) noexcept {
  // Iterative wildcard match: remember the last '*' and where it started matching.
  std::size_t p = 0, n = 0, star = std::string_view::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

const RecipeChoice& Assignment::entry(std::string_view module) const {
  for (const auto& [n, c] : modules)
    if (n == module) return c;
  return default_choice;
}

std::vector<std::uint64_t> Assignment::phase_starts(std::uint64_t total_steps) const {
  std::vector<std::uint64_t> out;
  for (std::size_t i = 0; i < schedule.size(); ++i) {
    const Phase& ph = schedule[i];
    if (ph.from_step) {
      out.push_back(*ph.from_step);
    } else {
      if (total_steps == 0)
        fail("recipe file: schedule[" + std::to_string(i) + "].from_fraction: the run's length is needed to turn a "
             "fraction into a step; give the door the number of steps (or use from_step)");
      out.push_back(static_cast<std::uint64_t>(std::ceil(*ph.from_fraction * static_cast<double>(total_steps))));
    }
  }
  return out;
}

std::size_t Assignment::phases_begun(std::uint64_t step, std::uint64_t total_steps) const {
  std::size_t n = 0;
  for (const std::uint64_t s : phase_starts(total_steps)) n += step >= s ? 1 : 0;
  return n;
}

RecipeChoice Assignment::choice_at(std::string_view module, std::uint64_t step, std::uint64_t total_steps) const {
  RecipeChoice c = entry(module);
  const std::vector<std::uint64_t> starts = phase_starts(total_steps);
  // In order of their first step (file order among equals): a later switch is written last.
  std::vector<std::size_t> order(schedule.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t x, std::size_t y) { return starts[x] < starts[y] || (starts[x] == starts[y] && x < y); });
  for (const std::size_t i : order) {
    if (step < starts[i]) continue;
    bool hit = schedule[i].modules.empty();
    for (const auto& pat : schedule[i].modules) hit = hit || module_matches(pat, module);
    if (!hit) continue;
    c = schedule[i].replace_entry ? schedule[i].change : apply_change(c, schedule[i].change);
  }
  return c;
}

namespace {

std::vector<Phase> parse_schedule(const json& sched, const Assignment& a) {
  if (!sched.is_array()) fail("recipe file: schedule: expected an array of phases, found " + dump(sched));
  std::vector<Phase> out;
  for (std::size_t i = 0; i < sched.size(); ++i) {
    const std::string where = "recipe file: schedule[" + std::to_string(i) + "]";
    const json& ph = sched[i];
    if (!ph.is_object()) fail(where + ": expected an object (from_step or from_fraction, and what changes), found " + dump(ph));
    Phase p;
    json change = json::object();
    for (auto it = ph.begin(); it != ph.end(); ++it) {
      const std::string& k = it.key();
      const json& v = it.value();
      if (k == "from_step") {
        if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<long long>() >= 0))
          fail(where + ".from_step: expected an integer >= 0, found " + dump(v));
        p.from_step = v.get<std::uint64_t>();
      } else if (k == "from_fraction") {
        if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() < 1.0))
          fail(where + ".from_fraction: expected a number in [0, 1), found " + dump(v));
        p.from_fraction = v.get<double>();
      } else if (k == "modules") {
        if (!v.is_array() || v.empty()) fail(where + ".modules: expected a non-empty array of module names or patterns, found " + dump(v));
        for (const json& m : v) p.modules.push_back(get_string(m, where + ".modules[]"));
      } else if (k == "label") {
        p.label = get_string(v, where + ".label");
      } else {
        change[k] = v;
      }
    }
    if (p.from_step.has_value() == p.from_fraction.has_value())
      fail(where + ": expected exactly one of from_step and from_fraction, found " +
           (p.from_step ? std::string("both") : std::string("neither")));
    if (change.empty()) fail(where + ": expected what the phase changes (recipe, fprop, dgrad, wgrad, backward_override, "
                             "columnwise_source or an option), found nothing");
    p.replace_entry = change.contains("recipe");
    p.change = choice_from(change, where, EntryKind::change);
    if (p.label.empty()) p.label = "phase " + std::to_string(i + 1);
    // The change must make a valid plan over every entry it may reach (alone).
    auto check = [&](const std::string& name, const RecipeChoice& entry) {
      try {
        plan(p.replace_entry ? p.change : apply_change(entry, p.change), a.options);
      } catch (const std::invalid_argument& e) {
        fail(where + ": over " + name + ": " + e.what());
      }
    };
    check("the default", a.default_choice);
    for (const auto& [name, c] : a.modules) {
      bool hit = p.modules.empty();
      for (const auto& pat : p.modules) hit = hit || module_matches(pat, name);
      if (hit) check("modules[\"" + name + "\"]", c);
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

Assignment parse_assignment(std::string_view text) {
  const json j = io::parse_json(text, "recipe file");
  if (!j.is_object()) fail("recipe file: expected a JSON object, found " + dump(j));
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k != "format" && k != "version" && k != "default" && k != "options" && k != "modules" && k != "notes" &&
        k != "schedule" && k != "evaluation")
      fail("recipe file: " + k + ": unknown field; expected format, version, default, options, modules, schedule, "
           "evaluation, notes");
  }
  if (!j.contains("format") || j["format"] != std::string(kAssignmentFormat))
    fail("recipe file: format: expected \"" + std::string(kAssignmentFormat) + "\", found " +
         (j.contains("format") ? dump(j["format"]) : std::string("nothing")));
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<long long>() != kAssignmentVersion)
    fail("recipe file: version: expected " + std::to_string(kAssignmentVersion) + ", found " +
         (j.contains("version") ? dump(j["version"]) : std::string("nothing")));
  Assignment a;
  if (j.contains("options")) a.options = choice_from(j["options"], "recipe file: options", EntryKind::options);
  if (j.contains("default")) {
    a.default_choice = choice_from(j["default"], "recipe file: default", EntryKind::module);
    try {
      plan(a.default_choice, a.options);
    } catch (const std::invalid_argument& e) {
      fail(std::string("recipe file: default: ") + e.what());
    }
  }
  if (!j.contains("modules") || !j["modules"].is_object())
    fail("recipe file: modules: expected an object (module name -> recipe)");
  for (auto it = j["modules"].begin(); it != j["modules"].end(); ++it) {
    const std::string where = "recipe file: modules[\"" + it.key() + "\"]";
    RecipeChoice c = choice_from(it.value(), where, EntryKind::module);
    try {
      plan(c, a.options);
    } catch (const std::invalid_argument& e) {
      fail(where + ": " + e.what());
    }
    a.modules.emplace_back(it.key(), c);
  }
  if (j.contains("schedule")) a.schedule = parse_schedule(j["schedule"], a);
  if (j.contains("evaluation")) {
    a.evaluation = choice_from(j["evaluation"], "recipe file: evaluation", EntryKind::module);
    try {
      plan(*a.evaluation, a.options);
    } catch (const std::invalid_argument& e) {
      fail(std::string("recipe file: evaluation: ") + e.what());
    }
  }
  if (j.contains("notes")) a.notes = get_string(j["notes"], "recipe file: notes");
  // A shared option must reach some module: one that fits no recipe in use is a mistake.
  if (j.contains("options")) {
    const json& opts = j["options"];
    for (auto it = opts.begin(); it != opts.end(); ++it) {
      const RecipeChoice only = choice_from(json::object({{it.key(), it.value()}}), "recipe file: options", EntryKind::options);
      bool reaches = false;
      auto check = [&](const RecipeChoice& c, auto&& self) -> void {
        if (c.recipe) reaches = reaches || shared_for(only, *c.recipe) != RecipeChoice{};
        for (const RecipeChoice& oc : c.operand_choices) self(oc, self);
      };
      check(a.default_choice, check);
      for (const auto& m : a.modules) check(m.second, check);
      for (const auto& ph : a.schedule) check(ph.change, check);
      if (a.evaluation) check(*a.evaluation, check);
      if (!reaches) fail("recipe file: options." + it.key() + ": no module's recipe has this option");
    }
  }
  return a;
}

Assignment read_assignment(const std::string& path) {
  const std::string text = io::read_json_text(path);  // std::runtime_error names the path
  try {
    return parse_assignment(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
}

std::string to_json(const Assignment& a) {
  json j = json::object();
  j["format"] = std::string(kAssignmentFormat);
  j["version"] = kAssignmentVersion;
  j["default"] = choice_to_json(a.default_choice, true);
  const json opts = choice_to_json(a.options, false);
  if (!opts.empty()) j["options"] = opts;
  json mods = json::object();
  for (const auto& [name, c] : a.modules) mods[name] = choice_to_json(c, true);
  j["modules"] = mods;
  if (!a.schedule.empty()) {
    json sched = json::array();
    for (const Phase& ph : a.schedule) {
      json o = json::object();
      if (ph.from_step) o["from_step"] = *ph.from_step;
      if (ph.from_fraction) o["from_fraction"] = *ph.from_fraction;
      if (!ph.modules.empty()) o["modules"] = ph.modules;
      if (!ph.label.empty()) o["label"] = ph.label;
      json change = choice_to_json(ph.change, ph.replace_entry);
      if (change.is_string()) change = json::object({{"recipe", change}});
      for (auto it = change.begin(); it != change.end(); ++it) o[it.key()] = it.value();
      sched.push_back(o);
    }
    j["schedule"] = sched;
  }
  if (a.evaluation) j["evaluation"] = choice_to_json(*a.evaluation, true);
  if (!a.notes.empty()) j["notes"] = a.notes;
  return j.dump(2) + "\n";
}

}  // namespace mixprec::lowp
