// mixprec._core's bindings for the integrations (docs/python.md, "Where PyTorch users train"):
// the TensorBoard scalars of a step record (the tags `mixprec export tensorboard` writes, so
// Telemetry(tensorboard=DIR) shows the same charts) and what `python -m mixprec doctor`
// reports about this build and CPU. Registered from core_module.cpp with register_integrations(m).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/kernel_table.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/report/tensorboard.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/version.hpp"

namespace nb = nanobind;

namespace {

namespace monitor = mixprec::monitor;
namespace train = mixprec::train;
using mixprec::Isa;

// monitor::StepScalars over log lines (the text TelemetryRecorder.record returns).
class PyStepScalars {
 public:
  std::vector<std::pair<std::string, float>> add(std::string_view line) {
    std::vector<std::pair<std::string, float>> out;
    for (monitor::Scalar& s : scalars_.add(train::parse_step_record(line))) out.emplace_back(std::move(s.tag), s.value);
    return out;
  }

 private:
  monitor::StepScalars scalars_;
};

nb::dict platform() {
  nb::dict d;
  d["version"] = mixprec::kVersionString;
  nb::dict isas;
  for (const Isa i : {Isa::scalar, Isa::avx2, Isa::avx512})
    isas[std::string(mixprec::isa_name(i)).c_str()] = mixprec::isa_available(i);
  d["isa_available"] = isas;
  d["best_isa"] = std::string(mixprec::isa_name(mixprec::best_isa()));
  d["avx512_bf16"] = mixprec::cpu_has_avx512_bf16();
  const mixprec::nn::GemmBackendInfo& g = mixprec::nn::gemm_backend_info();
  nb::dict gemm;
  gemm["onednn_version"] = g.onednn_version;
  gemm["cpu_isa"] = g.cpu_isa;
  gemm["bf16_native"] = g.bf16_native;
  gemm["bf16_impl"] = g.bf16_impl;
  gemm["f16_native"] = g.f16_native;
  gemm["f16_impl"] = g.f16_impl;
  gemm["avx512_fp16"] = g.avx512_fp16;
  gemm["amx_fp16"] = g.amx_fp16;
  d["gemm"] = gemm;
  try {
    const Isa active = mixprec::active_isa();
    d["active_isa"] = std::string(mixprec::isa_name(active));
    d["active_isa_error"] = nb::none();
    // The conversion kernels nest: a back end without its own table runs the one below.
    d["format_kernels"] = std::string(mixprec::isa_name(mixprec::kernel_table(active)->isa));
  } catch (const std::exception& e) {  // MIXPREC_ISA names a back end this CPU lacks
    d["active_isa"] = nb::none();
    d["active_isa_error"] = std::string(e.what());
    d["format_kernels"] = nb::none();
  }
  return d;
}

}  // namespace

void register_integrations(nb::module_& m) {
  nb::class_<PyStepScalars>(m, "StepScalars", "monitor::StepScalars: the TensorBoard scalars of each log line")
      .def(nb::init<>())
      .def("add", &PyStepScalars::add, nb::arg("line"));
  m.def("platform", &platform,
        "this build and CPU: version, instruction sets, the back end each kernel family runs, the GEMM's oneDNN");
}
