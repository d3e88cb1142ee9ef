// mixprec._core's per-block statistics of a quantization (lowp::block_stats) and the
// kurtosis of a tensor (lowp::kurtosis), over float32 arrays read in place (NumPy, or a CPU
// torch tensor through DLPack). Registered from core_module.cpp with register_block_stats(m).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <span>
#include <string>

#include "mixprec/lowp/block_stats.hpp"
#include "mixprec/lowp/quantize.hpp"

namespace nb = nanobind;

namespace {

namespace lowp = mixprec::lowp;

using AnyArray = nb::ndarray<nb::ro>;

[[noreturn]] void value_error(const std::string& s) { throw nb::value_error(s.c_str()); }
[[noreturn]] void type_error(const std::string& s) { throw nb::type_error(s.c_str()); }

// A CPU, C-contiguous float32 array, as the caller passed it (never copied).
std::span<const float> float_array(nb::handle h, const char* what, AnyArray& keep) {
  if (!nb::try_cast(h, keep, /*convert=*/false))
    type_error(std::string(what) + ": expected a NumPy array (or a CPU tensor) of float32, found " +
               nb::type_name(h.type()).c_str());
  if (keep.device_type() != nb::device::cpu::value) value_error(std::string(what) + ": expected an array in CPU memory");
  if (keep.dtype() != nb::dtype<float>()) type_error(std::string(what) + ": expected dtype float32 (mixprec reads it in place)");
  std::int64_t expected = 1;
  for (std::size_t i = keep.ndim(); i-- > 0;) {
    if (keep.shape(i) != 1 && keep.size() != 0 && keep.stride(i) != expected)
      value_error(std::string(what) +
                  ": expected a C-contiguous array, found a strided view (pass numpy.ascontiguousarray(...) or "
                  ".contiguous() to copy it once yourself)");
    expected *= static_cast<std::int64_t>(keep.shape(i));
  }
  return {static_cast<const float*>(keep.data()), keep.size()};
}

nb::dict stats_dict(const lowp::BlockStats& s) {
  nb::dict q;
  q["p01"] = s.log2_multiplier_quantiles.p01;
  q["p05"] = s.log2_multiplier_quantiles.p05;
  q["p25"] = s.log2_multiplier_quantiles.p25;
  q["p50"] = s.log2_multiplier_quantiles.p50;
  q["p75"] = s.log2_multiplier_quantiles.p75;
  q["p95"] = s.log2_multiplier_quantiles.p95;
  q["p99"] = s.log2_multiplier_quantiles.p99;
  nb::dict d;
  d["blocks"] = s.blocks;
  d["multiplier_blocks"] = s.multiplier_blocks;
  d["multiplier_left_out"] = s.multiplier_left_out;
  d["log2_multiplier_min"] = s.log2_multiplier_min;
  d["log2_multiplier_max"] = s.log2_multiplier_max;
  d["log2_multiplier_mean"] = s.log2_multiplier_mean;
  d["log2_multiplier_std"] = s.log2_multiplier_std;
  d["log2_multiplier_quantiles"] = q;
  d["flushed"] = s.flushed;
  d["saturated"] = s.saturated;
  d["blocks_with_flush"] = s.blocks_with_flush;
  d["blocks_with_saturation"] = s.blocks_with_saturation;
  d["max_flushed_fraction"] = s.max_flushed_fraction;
  d["max_saturated_fraction"] = s.max_saturated_fraction;
  d["tensor_amax"] = s.tensor_amax;
  d["far_log2"] = s.far_log2;
  d["far_blocks"] = s.far_blocks;
  d["zero_blocks"] = s.zero_blocks;
  d["dynamic_range"] = s.dynamic_range;
  d["max_block_dynamic_range"] = s.max_block_dynamic_range;
  return d;
}

}  // namespace

void register_block_stats(nb::module_& m) {
  // src: the array quantized into q (any shape holding its q.rows * q.cols float32 values).
  m.def("block_stats", [](const lowp::Quantized& q, nb::handle src_obj, double far_log2) {
    AnyArray keep;
    const std::span<const float> src = float_array(src_obj, "src", keep);
    lowp::BlockStats s;  // the core's std::invalid_argument (src's size, far_log2) reaches Python as ValueError
    {
      nb::gil_scoped_release release;
      s = lowp::block_stats(q, src, far_log2);
    }
    return stats_dict(s);
  }, nb::arg("q"), nb::arg("src"), nb::arg("far_log2") = 8.0);
  m.def("kurtosis", [](nb::handle x_obj) {
    AnyArray keep;
    const std::span<const float> x = float_array(x_obj, "x", keep);
    nb::gil_scoped_release release;
    return lowp::kurtosis(x);
  }, nb::arg("x"));
}
