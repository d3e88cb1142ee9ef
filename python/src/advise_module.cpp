// mixprec._core's precision advisor (mixprec.torch.advise, python/mixprec/torch/advise.py):
// the core's monitor::advisor over samples handed in as float32 arrays read in place, the
// configuration as the JSON text the core parses (one parser for every door), and run-folder
// samples written and read by the core. Registered from core_module.cpp with register_advise(m).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mixprec/advise/advise.hpp"

namespace nb = nanobind;

namespace {

namespace adv = mixprec::monitor::advisor;

[[noreturn]] void value_error(const std::string& s) { throw nb::value_error(s.c_str()); }

// One sample: (layer, role, step, loss_scale, rows_total, values [rows, cols] float32 C-contiguous).
struct Held {
  std::string layer;
  nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu> values;
  adv::SampleView view;
};

std::vector<Held> samples_of(nb::handle list) {
  if (!nb::isinstance<nb::list>(list)) value_error("samples: expected a list of sample tuples");
  std::vector<Held> held;
  const nb::list l = nb::borrow<nb::list>(list);
  held.reserve(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) {
    const std::string where = "samples[" + std::to_string(i) + "]";
    nb::tuple t;
    if (!nb::try_cast(l[i], t) || t.size() != 6)
      value_error(where + ": expected (layer, role, step, loss_scale, rows_total, values)");
    Held h;
    if (!nb::try_cast(t[0], h.layer)) value_error(where + ": layer: expected a string");
    std::string role;
    if (!nb::try_cast(t[1], role)) value_error(where + ": role: expected a string");
    const auto r = adv::parse_role(role);
    if (!r) value_error(where + ": role: expected x, w, dy or dw, found '" + role + "'");
    std::uint64_t step = 0;
    float loss_scale = 1.0f;
    std::size_t rows_total = 0;
    if (!nb::try_cast(t[2], step)) value_error(where + ": step: expected an int >= 0");
    if (!nb::try_cast(t[3], loss_scale)) value_error(where + ": loss_scale: expected a number");
    if (!nb::try_cast(t[4], rows_total)) value_error(where + ": rows_total: expected an int >= 0");
    if (!nb::try_cast(t[5], h.values, /*convert=*/false))
      value_error(where + ": values: expected a 2-D C-contiguous float32 array on the CPU");
    h.view = adv::SampleView{{}, *r, step, loss_scale, h.values.shape(0), h.values.shape(1), rows_total,
                             {h.values.data(), h.values.size()}};
    held.push_back(std::move(h));
  }
  for (Held& h : held) h.view.layer = h.layer;  // after the vector stopped moving
  return held;
}

std::vector<adv::SampleView> views(const std::vector<Held>& held) {
  std::vector<adv::SampleView> v;
  v.reserve(held.size());
  for (const Held& h : held) v.push_back(h.view);
  return v;
}

}  // namespace

void register_advise(nb::module_& m) {
  nb::class_<adv::Advice>(m, "Advice", "The precision advisor's result (mixprec::monitor::advisor::Advice)")
      .def("json", [](const adv::Advice& a) { return adv::advice_json(a); }, "every measurement, cost, choice and reason")
      .def("recipe_file", [](const adv::Advice& a) { return adv::recipe_file_json(a); },
           "the assignment as the recipe file mixprec.torch.low_precision reads")
      .def("directional_recipe_file", [](const adv::Advice& a) { return adv::directional_recipe_file_json(a); },
           "the directional proposal (a recipe per GEMM direction, the late forward switch) as a recipe file")
      .def("table", [](const adv::Advice& a) { return adv::advice_table(a); });
  m.def("advise", [](nb::handle samples, std::string_view config_json) {
    const adv::AdviseConfig config = adv::parse_config(config_json, "config");
    const std::vector<Held> held = samples_of(samples);
    const std::vector<adv::SampleView> v = views(held);
    nb::gil_scoped_release release;
    return adv::advise(v, config);
  }, nb::arg("samples"), nb::arg("config_json"));
  m.def("advise_run", [](const std::string& run_dir, std::string_view config_json) {
    const adv::AdviseConfig config = adv::parse_config(config_json, "config");
    nb::gil_scoped_release release;
    const std::vector<adv::OwnedSample> owned = adv::read_samples(run_dir);
    std::vector<adv::SampleView> v;
    for (const auto& s : owned) v.push_back(s.view());
    return adv::advise(v, config);
  }, nb::arg("run_dir"), nb::arg("config_json"));
  m.def("advice_from_json", [](std::string_view text) { return adv::parse_advice_json(text); }, nb::arg("text"));
  m.def("advise_write_samples", [](const std::string& run_dir, std::uint64_t step, float loss_scale, nb::handle samples) {
    const std::vector<Held> held = samples_of(samples);
    const std::vector<adv::SampleView> v = views(held);
    nb::gil_scoped_release release;
    adv::write_step_samples(run_dir, step, loss_scale, v);
  }, nb::arg("run_dir"), nb::arg("step"), nb::arg("loss_scale"), nb::arg("samples"));
  m.def("advise_candidates", [] {
    nb::list l;
    for (const adv::CandidateInfo& c : adv::candidate_table()) l.append(std::string(c.name));
    return l;
  });
}
