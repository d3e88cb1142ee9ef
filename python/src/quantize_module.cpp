// mixprec._core's low-precision recipes (mixprec.quantize / mixprec.dequantize, python/mixprec/
// quantize.py): the core's lowp::quantize over a float32 array read in place (NumPy, or a CPU
// torch tensor through DLPack), and the Quantized result, whose codes and scales are NumPy
// views of the core's buffers (each view keeps the result alive). Registered from
// core_module.cpp with register_quantize(m).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "mixprec/core/text.hpp"
#include "mixprec/lowp/scaling.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/quantize.hpp"

namespace nb = nanobind;

namespace {

namespace lowp = mixprec::lowp;

using AnyArray = nb::ndarray<nb::ro>;
using MutArray = nb::ndarray<>;

[[noreturn]] void value_error(const std::string& s) { throw nb::value_error(s.c_str()); }
[[noreturn]] void type_error(const std::string& s) { throw nb::type_error(s.c_str()); }

// A CPU, C-contiguous array of `dtype`, as the caller passed it (never copied).
template <class A>
A array_arg(nb::handle h, const char* what, nb::dlpack::dtype dtype, const char* dtype_text) {
  A a;
  if (!nb::try_cast(h, a, /*convert=*/false)) {
    if constexpr (std::is_same_v<A, MutArray>) {
      AnyArray ro;
      if (nb::try_cast(h, ro, false)) value_error(std::string(what) + ": expected a writable array, found a read-only one");
    }
    type_error(std::string(what) + ": expected a NumPy array (or a CPU tensor) of " + dtype_text + ", found " +
               nb::type_name(h.type()).c_str());
  }
  if (a.device_type() != nb::device::cpu::value) value_error(std::string(what) + ": expected an array in CPU memory");
  if (a.dtype() != dtype) type_error(std::string(what) + ": expected dtype " + dtype_text + " (mixprec reads it in place)");
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.size() != 0 && a.stride(i) != expected)
      value_error(std::string(what) +
                  ": expected a C-contiguous array, found a strided view (pass numpy.ascontiguousarray(...) or "
                  ".contiguous() to copy it once yourself)");
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return a;
}

template <class E>
E parse(std::optional<E> v, const char* what, std::string_view found, const char* allowed) {
  if (!v) value_error(std::string(what) + ": expected " + allowed + ", found '" + std::string(found) + "'");
  return *v;
}

std::string_view scale_format_name(lowp::ScaleFormat f) {
  switch (f) {
    case lowp::ScaleFormat::f32: return "float32";
    case lowp::ScaleFormat::e8m0: return "e8m0";
    case lowp::ScaleFormat::e4m3: return "e4m3";
  }
  return "?";
}

template <class T>
nb::object view(nb::handle owner, T* data, std::size_t rows, std::size_t cols) {
  const std::size_t shape[2] = {rows, cols};
  return nb::cast(nb::ndarray<nb::numpy, T>(data, 2, shape, owner));
}

lowp::Quantized quantize(nb::handle x_obj, std::string_view recipe, std::optional<std::string_view> element,
                         std::string_view layout, bool tile_2d, std::string_view scale_rounding,
                         std::optional<bool> power_of_2_scales, double amax_epsilon, double value_for_inf, double scale,
                         bool rht, nb::handle random_obj, std::string_view flavour) {
  const AnyArray x = array_arg<AnyArray>(x_obj, "x", nb::dtype<float>(), "float32");
  if (x.ndim() == 0) value_error("x: expected an array of at least one dimension (rows = the product of all but the last)");
  lowp::QuantizeConfig c;
  c.recipe = parse(lowp::parse_recipe(recipe), "recipe", recipe, ("one of " + lowp::recipe_names()).c_str());
  c.element = element ? parse(lowp::parse_element(*element), "element", *element, "e4m3, e5m2 or e2m1")
                      : lowp::recipe_info(c.recipe).element;
  if (layout == "rowwise") c.layout = lowp::Layout::rowwise;
  else if (layout == "columnwise") c.layout = lowp::Layout::columnwise;
  else value_error("layout: expected 'rowwise' or 'columnwise', found '" + std::string(layout) + "'");
  c.tile_2d = tile_2d;
  c.scale_rounding = parse(lowp::parse_scale_rounding(scale_rounding), "scale_rounding", scale_rounding, "'rceil' or 'floor'");
  c.power_of_2_scales = power_of_2_scales;
  c.flavour = parse(lowp::parse_flavour(flavour), "flavour", flavour, "'te' or 'torchao'");
  // A Python float becomes the nearest float32, as TE's float parameters take it (0.1, 1e-12);
  // a finite value beyond float32's range would become inf: refused, shown as given.
  auto to_float = [](double v, const char* what) {
    if (std::isfinite(v) && std::fabs(v) > static_cast<double>(std::numeric_limits<float>::max()))
      value_error(std::string(what) + ": expected a number within float32's range (|x| <= 3.40282347e+38), found " +
                  mixprec::text::num(v));
    return static_cast<float>(v);
  };
  c.amax_epsilon = to_float(amax_epsilon, "amax_epsilon");
  c.value_for_inf = to_float(value_for_inf, "value_for_inf");
  c.scale = to_float(scale, "scale");
  c.rht = rht;
  std::span<const std::uint32_t> random;
  AnyArray r;
  if (!random_obj.is_none()) {
    r = array_arg<AnyArray>(random_obj, "random", nb::dtype<std::uint32_t>(), "uint32");
    random = {static_cast<const std::uint32_t*>(r.data()), r.size()};
    c.stochastic_rounding = true;
  }
  const std::size_t cols = x.shape(x.ndim() - 1);
  std::size_t rows = 1;  // the product of all but the last dimension
  for (std::size_t i = 0; i + 1 < x.ndim(); ++i) rows *= x.shape(i);
  const std::span<const float> src(static_cast<const float*>(x.data()), x.size());
  lowp::validate(c);
  nb::gil_scoped_release release;
  return lowp::quantize(src, rows, cols, c, random);
}

// A resolved recipe as RecipeOptions fields; options the recipe does not have are None, so
// the dict reads back through plan_assignment unchanged.
nb::object recipe_dict(const std::optional<lowp::LinearRecipe>& r) {
  if (!r) return nb::none();
  using R = lowp::Recipe;
  const R k = r->recipe;
  const bool fp4 = k == R::nvfp4 || k == R::mxfp4, mx = k == R::mxfp8 || k == R::mxfp4;
  auto when = [](bool has, nb::object v) { return has ? v : nb::none(); };
  nb::dict d;
  d["recipe"] = std::string(lowp::recipe_name(k));
  d["fp8_format"] = when(!fp4, nb::str(std::string(mixprec::lowp::format_key(r->fp8_format)).c_str()));
  d["amax_history_len"] = when(k == R::fp8_delayed, nb::int_(r->amax_history_len));
  d["amax_compute_algo"] = when(k == R::fp8_delayed, nb::str(std::string(mixprec::lowp::amax_algo_name(r->amax_compute_algo)).c_str()));
  d["margin"] = when(k == R::fp8_delayed, nb::int_(r->margin));
  d["power_of_2_scales"] = r->power_of_2_scales ? nb::object(nb::bool_(*r->power_of_2_scales)) : nb::none();
  d["scale_rounding"] = when(mx, nb::str(std::string(lowp::scale_rounding_name(r->scale_rounding)).c_str()));
  d["weight_2d"] = when(k == R::fp8_block || k == R::nvfp4, nb::bool_(r->weight_2d));
  d["rht"] = when(k == R::nvfp4, nb::bool_(r->rht));
  d["stochastic_rounding"] = when(fp4, nb::bool_(r->stochastic_rounding));
  d["flavour"] = when(mx || k == R::nvfp4, nb::str(std::string(lowp::flavour_name(r->flavour)).c_str()));
  return d;
}

// One Linear's plan (lowp::LinearPlan): per operand ("fprop.x", ...) its recipe (a recipe dict
// or None: high precision) and the QuantizeConfig the core derives for it; the sources of the
// backward copies of x and w; the uniform recipe (None unless every operand runs one recipe
// from the originals) and the primary one (the door's name for the Linear).
nb::dict plan_dict(const lowp::LinearPlan& p) {
  nb::dict recipes, configs;
  for (std::size_t i = 0; i < lowp::kOperands; ++i) {
    const auto o = static_cast<lowp::Operand>(i);
    const std::string name(lowp::operand_name(o));
    recipes[name.c_str()] = recipe_dict(p.at(o));
    if (!p.at(o)) {
      configs[name.c_str()] = nb::none();
      continue;
    }
    const lowp::QuantizeConfig c = p.config(o);
    nb::dict d;
    d["recipe"] = std::string(lowp::recipe_name(c.recipe));
    d["element"] = std::string(lowp::element_name(c.element));
    d["layout"] = std::string(lowp::layout_name(c.layout));
    d["tile_2d"] = c.tile_2d;
    d["scale_rounding"] = std::string(lowp::scale_rounding_name(c.scale_rounding));
    d["power_of_2_scales"] = c.power_of_2_scales ? nb::object(nb::bool_(*c.power_of_2_scales)) : nb::none();
    d["rht"] = c.rht;
    d["stochastic_rounding"] = c.stochastic_rounding;
    d["flavour"] = std::string(lowp::flavour_name(c.flavour));
    configs[name.c_str()] = d;
  }
  nb::dict out;
  out["recipes"] = recipes;
  out["configs"] = configs;
  out["x_source"] = std::string(lowp::source_name(p.x_source));
  out["w_source"] = std::string(lowp::source_name(p.w_source));
  out["uniform"] = recipe_dict(p.uniform());
  out["primary"] = recipe_dict(p.primary());
  return out;
}

nb::dict counts_dict(const lowp::Counts& k) {
  nb::dict d;
  d["elements"] = k.elements;
  d["saturated"] = k.saturated;
  d["flushed"] = k.flushed;
  d["nonfinite"] = k.nonfinite;
  d["amax"] = k.amax;
  return d;
}

}  // namespace

void register_quantize(nb::module_& m) {
  nb::class_<lowp::Quantized>(m, "Quantized", "A tensor quantized by a low-precision recipe (mixprec::lowp::Quantized)")
      .def_prop_ro("recipe", [](const lowp::Quantized& q) { return std::string(lowp::recipe_name(q.config.recipe)); })
      .def_prop_ro("element", [](const lowp::Quantized& q) { return std::string(lowp::element_name(q.config.element)); })
      .def_prop_ro("layout", [](const lowp::Quantized& q) { return std::string(lowp::layout_name(q.config.layout)); })
      .def_prop_ro("flavour", [](const lowp::Quantized& q) { return std::string(lowp::flavour_name(q.config.flavour)); })
      .def_prop_ro("tile_2d", [](const lowp::Quantized& q) { return q.config.tile_2d; })
      .def_prop_ro("rht", [](const lowp::Quantized& q) { return q.config.rht; })
      .def_prop_ro("scale_rounding", [](const lowp::Quantized& q) { return std::string(lowp::scale_rounding_name(q.config.scale_rounding)); })
      .def_prop_ro("rows", [](const lowp::Quantized& q) { return q.rows; })
      .def_prop_ro("cols", [](const lowp::Quantized& q) { return q.cols; })
      .def_prop_ro("code_shape", [](const lowp::Quantized& q) { return nb::make_tuple(q.code_rows, q.code_cols); })
      .def_prop_ro("codes", [](nb::handle self) {
        auto& q = nb::cast<lowp::Quantized&>(self);
        return view(self, q.codes.data(), q.code_rows, q.row_bytes);
      }, "uint8 [code_rows, row_bytes]: one byte per element (fp8), two per byte low nibble first (fp4)")
      .def_prop_ro("scale_format", [](const lowp::Quantized& q) { return std::string(scale_format_name(q.scale_format)); })
      .def_prop_ro("scales", [](nb::handle self) -> nb::object {
        auto& q = nb::cast<lowp::Quantized&>(self);
        if (q.scale_format == lowp::ScaleFormat::f32) return view(self, q.scale_inv.data(), q.scale_rows, q.scale_cols);
        return view(self, q.scale_codes.data(), q.scale_rows, q.scale_cols);
      }, "float32 scale_inv (fp8 per tensor, fp8-block) or uint8 E8M0 / E4M3 codes, [scale_rows, scale_cols]")
      .def_prop_ro("tensor_scale", [](const lowp::Quantized& q) { return q.tensor_scale; })
      .def_prop_ro("tensor_amax", [](const lowp::Quantized& q) { return q.tensor_amax; })
      .def_prop_ro("counts", [](const lowp::Quantized& q) { return counts_dict(q.counts); });

  m.def("quantize", &quantize, nb::arg("x"), nb::arg("recipe"), nb::arg("element").none(), nb::arg("layout"),
        nb::arg("tile_2d"), nb::arg("scale_rounding"), nb::arg("power_of_2_scales").none(), nb::arg("amax_epsilon"),
        nb::arg("value_for_inf"), nb::arg("scale"), nb::arg("rht"), nb::arg("random").none(), nb::arg("flavour"));
  m.def("dequantize", [](const lowp::Quantized& q, nb::handle out_obj) -> nb::object {
    nb::object result;
    MutArray out;
    if (out_obj.is_none()) {
      auto* data = new float[q.rows * q.cols == 0 ? 1 : q.rows * q.cols];
      nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
      const std::size_t shape[2] = {q.rows, q.cols};
      result = nb::cast(nb::ndarray<nb::numpy, float>(data, 2, shape, owner));
      out = nb::cast<MutArray>(result, false);
    } else {
      out = array_arg<MutArray>(out_obj, "out", nb::dtype<float>(), "float32");
      if (out.size() != q.rows * q.cols)
        value_error("out: expected " + std::to_string(q.rows * q.cols) + " elements, found " + std::to_string(out.size()));
      result = nb::borrow(out_obj);
    }
    const std::span<float> dst(static_cast<float*>(out.data()), out.size());
    {
      nb::gil_scoped_release release;
      lowp::dequantize(q, dst);
    }
    return result;
  }, nb::arg("q"), nb::arg("out").none());
  // One step of TE's delayed scaling for one tensor (docs/fp8.md): fold this step's amax into
  // history[0], roll the history, and return the new scale from the chosen amax.
  m.def("delayed_update", [](nb::handle history_obj, double amax, std::string_view algo, std::string_view element,
                             int margin, float previous_scale) {
    MutArray h = array_arg<MutArray>(history_obj, "amax_history", nb::dtype<float>(), "float32");
    if (h.size() == 0) value_error("amax_history: expected at least one slot, found 0");
    if (!(amax >= 0.0 || std::isnan(amax))) value_error("amax: expected >= 0, inf or NaN, found " + mixprec::text::num(amax));
    if (margin < -64 || margin > 64) value_error("margin: expected an integer in [-64, 64], found " + std::to_string(margin));
    const std::optional<mixprec::lowp::AmaxAlgo> a = mixprec::lowp::parse_amax_algo(algo);
    if (!a) value_error("amax_compute_algo: expected 'max' or 'most_recent', found '" + std::string(algo) + "'");
    const std::optional<mixprec::lowp::Element> e = mixprec::lowp::parse_element(element);
    if (!e || *e == mixprec::lowp::Element::e2m1)
      value_error("element: expected 'e4m3' or 'e5m2', found '" + std::string(element) + "'");
    const float fp8_max = mixprec::lowp::max_finite(*e);  // the format table's
    const std::span<float> hist(static_cast<float*>(h.data()), h.size());
    hist[0] = mixprec::lowp::fold_amax(hist[0], static_cast<float>(amax));
    const float chosen = mixprec::lowp::roll_history(hist, *a);
    return mixprec::lowp::delayed_scale(chosen, previous_scale, fp8_max, margin);
  }, nb::arg("amax_history"), nb::arg("amax"), nb::arg("algo"), nb::arg("element"), nb::arg("margin"),
     nb::arg("previous_scale"));
  // A recipe file's text (or a dict assignment written as one), checked whole, every entry
  // resolved with TE's defaults: {"default": recipe or None, "modules": [(name, recipe or
  // None)], "notes": str}; None is "bf16".
  m.def("plan_assignment", [](std::string_view text) {
    const lowp::Assignment a = lowp::parse_assignment(text);
    nb::dict out;
    out["default"] = recipe_dict(lowp::resolve(a.default_choice, a.options));
    nb::list mods;
    for (const auto& [name, c] : a.modules) mods.append(nb::make_tuple(name, recipe_dict(lowp::resolve(c, a.options))));
    out["modules"] = mods;
    out["notes"] = a.notes;
    return out;
  }, nb::arg("text"));
  // A recipe file checked whole (lowp::parse_assignment), asked for the plan of each Linear:
  // its entry's, at a step of the schedule, or for evaluation forwards.
  nb::class_<lowp::Assignment>(m, "RecipeFile", "A checked recipe file (mixprec::lowp::Assignment)")
      .def("__init__", [](lowp::Assignment* self, std::string_view text) {
        new (self) lowp::Assignment(lowp::parse_assignment(text));
      }, nb::arg("text"))
      .def("plan", [](const lowp::Assignment& a, std::string_view module) {
        return plan_dict(lowp::plan(a.entry(module), a.options));
      }, nb::arg("module"))
      .def("plan_at", [](const lowp::Assignment& a, std::string_view module, std::uint64_t step,
                         std::uint64_t total_steps) {
        return plan_dict(lowp::plan(a.choice_at(module, step, total_steps), a.options));
      }, nb::arg("module"), nb::arg("step"), nb::arg("total_steps"))
      .def("evaluation_plan", [](const lowp::Assignment& a, std::string_view module) -> nb::object {
        if (!a.evaluation) return nb::none();
        // Evaluation runs its recipe on the Linears the run quantizes; the others stay high.
        if (!lowp::plan(a.entry(module), a.options).any_quantized()) return plan_dict(lowp::LinearPlan{});
        return plan_dict(lowp::plan(*a.evaluation, a.options));
      }, nb::arg("module"))
      .def("phase_starts", &lowp::Assignment::phase_starts, nb::arg("total_steps"))
      .def("phases_begun", &lowp::Assignment::phases_begun, nb::arg("step"), nb::arg("total_steps"))
      .def_prop_ro("phases", [](const lowp::Assignment& a) {
        nb::list l;
        for (const lowp::Phase& ph : a.schedule) {
          nb::dict d;
          d["label"] = ph.label;
          nb::list mods;
          for (const auto& n : ph.modules) mods.append(n);
          d["modules"] = mods;
          d["from_step"] = ph.from_step ? nb::object(nb::int_(*ph.from_step)) : nb::none();
          d["from_fraction"] = ph.from_fraction ? nb::object(nb::float_(*ph.from_fraction)) : nb::none();
          l.append(d);
        }
        return l;
      })
      .def_prop_ro("has_evaluation", [](const lowp::Assignment& a) { return a.evaluation.has_value(); })
      .def("matches", [](const lowp::Assignment&, std::string_view pattern, std::string_view name) {
        return lowp::module_matches(pattern, name);
      }, nb::arg("pattern"), nb::arg("name"));
  m.def("zoo_names", [] {
    nb::list l;
    for (std::size_t i = 0; i < 4; ++i) l.append(std::string(lowp::zoo_name(static_cast<lowp::Zoo>(i))));
    return l;
  });
  m.def("recipe_table", [] {
    nb::list l;
    for (const lowp::RecipeInfo& r : lowp::recipe_table()) {
      nb::dict d;
      d["name"] = std::string(r.name);
      d["te_recipe"] = std::string(r.te_recipe);
      d["element"] = std::string(lowp::element_name(r.element));
      d["block"] = r.block;
      d["tile_rows"] = r.tile_rows;
      d["scale_format"] = std::string(scale_format_name(r.scale_format));
      d["tensor_scale"] = r.tensor_scale;
      d["summary"] = std::string(r.summary);
      l.append(d);
    }
    return l;
  });
}
