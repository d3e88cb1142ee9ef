// Per-layer loss scaling for mixprec.torch (python/mixprec/torch/layerwise.py): the core's
// LayerwiseScales (held by a preset-"layerwise" ScalerProtocol), the moments of a tensor read
// in place (a torch tensor through DLPack), erfinv and the rule itself (for tests).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <string>
#include <vector>

#include "binding.hpp"
#include "mixprec/scaler/layerwise.hpp"

namespace nb = nanobind;

namespace {

using mixprec::LayerwiseScales;
using mixprec::TensorMoments;

// The moments of a C-contiguous CPU float32/float16/bfloat16 tensor (mixprec.torch passes
// contiguous ones), read in place (binding.hpp's view), without the GIL.
TensorMoments array_moments(nb::handle a, const std::string& what) {
  std::vector<nb::ndarray<nb::ro>> keep;
  const mixprec::GradTensor v = mixprec_python::tensor_view(a, what, keep);
  nb::gil_scoped_release unlocked;
  return mixprec::moments_of(v);
}

nb::dict layer_dict(const mixprec::LayerState& s) {
  nb::dict d;
  d["name"] = s.name;
  d["fan_in"] = s.fan_in;
  d["backoff"] = s.backoff;
  d["clean_steps"] = s.clean_steps;
  d["overflows"] = s.overflows;
  d["skipped"] = s.skipped;
  d["factor"] = s.factor;
  d["chain"] = s.chain;
  d["outcome"] = s.outcome ? nb::cast(std::string(mixprec::layer_outcome_name(*s.outcome))) : nb::none();
  return d;
}

}  // namespace

void register_layerwise(nb::module_& m) {
  nb::class_<TensorMoments>(m, "TensorMoments", "Sums over one tensor (mixprec::TensorMoments)")
      .def_ro("count", &TensorMoments::count)
      .def_ro("sum", &TensorMoments::sum)
      .def_ro("sum_squares", &TensorMoments::sum_squares)
      .def_ro("amax", &TensorMoments::amax)
      .def_ro("finite", &TensorMoments::finite);
  m.def("tensor_moments", &array_moments, nb::arg("tensor"), nb::arg("what") = "tensor");
  m.def("erfinv", &mixprec::erfinv, nb::arg("x"));
  m.def(
      "approx_range_factor",
      [](const TensorMoments& g, const TensorMoments& w, std::int64_t fan_in, double chain) {
        return mixprec::approx_range_factor(g, w, fan_in, chain, mixprec::LayerwiseConfig{});
      },
      nb::arg("g"), nb::arg("w"), nb::arg("fan_in"), nb::arg("chain"),
      "the approx_range rule with the default config, before a layer's backoff");

  nb::class_<LayerwiseScales>(m, "LayerwiseScales", "A preset-layerwise scaler's per-layer scaling (the core's)")
      .def("add_layer", &LayerwiseScales::add_layer, nb::arg("name"), nb::arg("fan_in"))
      .def_prop_ro("layer_count", &LayerwiseScales::layer_count)
      .def("layer", [](const LayerwiseScales& s, std::size_t i) { return layer_dict(s.layer(i)); }, nb::arg("index"))
      .def(
          "decide",
          [](LayerwiseScales& s, std::size_t layer, nb::handle g, const TensorMoments& w, double chain) {
            return s.decide(layer, array_moments(g, "the gradient of layer '" + s.layer(layer).name + "'"), w, chain);
          },
          nb::arg("layer"), nb::arg("g"), nb::arg("w"), nb::arg("chain"))
      .def("keep", &LayerwiseScales::keep, nb::arg("layer"), nb::arg("g_finite"))
      .def(
          "finish_layer",
          [](LayerwiseScales& s, std::size_t layer, bool finite) {
            return std::string(mixprec::layer_outcome_name(s.finish_layer(layer, finite)));
          },
          nb::arg("layer"), nb::arg("grads_finite"))
      .def("any_origin", &LayerwiseScales::any_origin)
      .def("to_json", &LayerwiseScales::to_json);
}
