// What the files of the mixprec._core binding share (python/src/*_module.cpp): the view of a
// tensor handed in by mixprec.torch, and each file's registration function.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>
#include <vector>

#include "mixprec/kernels/unscale.hpp"

namespace mixprec_python {

// A read-only view of a CPU float32/float16/bfloat16 C-contiguous array (a NumPy array, a
// torch tensor, or the capsule of torch.utils.dlpack.to_dlpack: the cheapest way in, with
// the same checks); `what` names it in messages, `keep` holds the import alive while the
// view is used. Empty arrays give {nullptr, 0, dtype}.
mixprec::GradTensor tensor_view(nanobind::handle h, const std::string& what,
                                std::vector<nanobind::ndarray<nanobind::ro>>& keep);

// python/src/telemetry_module.cpp: TelemetryRecorder and the counting functions.
void register_telemetry(nanobind::module_& m);
// python/src/optim_module.cpp: the optimizer state formats and the fused step of one tensor.
void register_optim(nanobind::module_& m);

}  // namespace mixprec_python
