// lowp::resolve and the recipe file (include/mixprec/lowp/assignment.hpp): nlohmann stays
// private to the library.
#include "mixprec/lowp/assignment.hpp"

#include "mixprec/core/json_read.hpp"

#include <nlohmann/json.hpp>

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

RecipeChoice choice_from(const json& entry, const std::string& where, bool recipe_allowed) {
  RecipeChoice c;
  if (entry.is_string()) {
    if (!recipe_allowed) fail(where + ": expected an object of options, found " + dump(entry));
    const std::string name = entry.get<std::string>();
    if (name == kHigh) return c;
    const auto r = parse_recipe(name);
    if (!r) fail(where + ": expected one of " + recipe_names() + " or \"bf16\", found \"" + name + "\"");
    c.recipe = r;
    return c;
  }
  if (!entry.is_object())
    fail(where + ": expected a recipe name, \"bf16\" or an object with \"recipe\", found " + dump(entry));
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    const std::string w = where + "." + k;
    if (k == "recipe") {
      if (!recipe_allowed) fail(w + ": not allowed here (options apply to every entry)");
      const std::string name = get_string(v, w);
      if (name == kHigh) {
        if (entry.size() != 1) fail(where + ": \"bf16\" takes no options");
        return c;
      }
      const auto r = parse_recipe(name);
      if (!r) fail(w + ": expected one of " + recipe_names() + " or \"bf16\", found \"" + name + "\"");
      c.recipe = r;
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
      fail(w + ": unknown option; expected one of " + known);
    }
  }
  if (recipe_allowed && !c.recipe) fail(where + ": expected \"recipe\" in the object");
  return c;
}

template <class T>
void overlay(std::optional<T>& into, const std::optional<T>& from) {
  if (from) into = from;
}

json choice_to_json(const RecipeChoice& c, bool with_recipe) {
  const bool only_recipe = !c.fp8_format && !c.amax_history_len && !c.amax_compute_algo && !c.margin &&
                           !c.power_of_2_scales && !c.scale_rounding && !c.weight_2d && !c.rht &&
                           !c.stochastic_rounding && !c.flavour;
  const std::string name = c.recipe ? std::string(recipe_name(*c.recipe)) : std::string(kHigh);
  if (with_recipe && only_recipe) return name;
  json o = json::object();
  if (with_recipe) o["recipe"] = name;
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

Assignment parse_assignment(std::string_view text) {
  const json j = io::parse_json(text, "recipe file");
  if (!j.is_object()) fail("recipe file: expected a JSON object, found " + dump(j));
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k != "format" && k != "version" && k != "default" && k != "options" && k != "modules" && k != "notes")
      fail("recipe file: " + k + ": unknown field; expected format, version, default, options, modules, notes");
  }
  if (!j.contains("format") || j["format"] != std::string(kAssignmentFormat))
    fail("recipe file: format: expected \"" + std::string(kAssignmentFormat) + "\", found " +
         (j.contains("format") ? dump(j["format"]) : std::string("nothing")));
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<long long>() != kAssignmentVersion)
    fail("recipe file: version: expected " + std::to_string(kAssignmentVersion) + ", found " +
         (j.contains("version") ? dump(j["version"]) : std::string("nothing")));
  Assignment a;
  if (j.contains("options")) a.options = choice_from(j["options"], "recipe file: options", false);
  if (j.contains("default")) {
    a.default_choice = choice_from(j["default"], "recipe file: default", true);
    resolve(a.default_choice, a.options);
  }
  if (!j.contains("modules") || !j["modules"].is_object())
    fail("recipe file: modules: expected an object (module name -> recipe)");
  for (auto it = j["modules"].begin(); it != j["modules"].end(); ++it) {
    const std::string where = "recipe file: modules[\"" + it.key() + "\"]";
    RecipeChoice c = choice_from(it.value(), where, true);
    try {
      resolve(c, a.options);
    } catch (const std::invalid_argument& e) {
      fail(where + ": " + e.what());
    }
    a.modules.emplace_back(it.key(), c);
  }
  if (j.contains("notes")) a.notes = get_string(j["notes"], "recipe file: notes");
  // A shared option must reach some module: one that fits no recipe in use is a mistake.
  if (j.contains("options")) {
    const json& opts = j["options"];
    for (auto it = opts.begin(); it != opts.end(); ++it) {
      const RecipeChoice only = choice_from(json::object({{it.key(), it.value()}}), "recipe file: options", false);
      bool reaches = false;
      auto check = [&](const RecipeChoice& c) {
        if (c.recipe) reaches = reaches || shared_for(only, *c.recipe) != RecipeChoice{};
      };
      check(a.default_choice);
      for (const auto& m : a.modules) check(m.second);
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
  if (!a.notes.empty()) j["notes"] = a.notes;
  return j.dump(2) + "\n";
}

}  // namespace mixprec::lowp
