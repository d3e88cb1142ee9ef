// mixprec._core's telemetry: the core's train::TelemetryRecorder over the tensors that
// mixprec.torch.Telemetry hands in (docs/python.md, "Telemetry"), and the counting functions
// its device path and its tests use. Thin: the counts, the log line, the alerts and the
// summary are the core's.
//
// The per-step cost is what this file is shaped by: parameters are registered once and their
// weights exported once (a view kept while the recorder lives; mixprec.torch re-exports one
// whose data pointer changed), gradient |max| measured elsewhere (the scaler's check pass, a
// device) comes in as floats, and tensors come in as DLPack capsules
// (torch.utils.dlpack.to_dlpack: a tenth of what importing a torch tensor costs).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "binding.hpp"
#include "mixprec/formats/count.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/train/telemetry_recorder.hpp"

namespace nb = nanobind;

namespace {

using AnyArray = nb::ndarray<nb::ro>;
using mixprec_python::tensor_view;
using Counts = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t,
                          float>;

mixprec::DType parse_dtype(std::string_view name) {
  if (name == "float32") return mixprec::DType::f32;
  if (name == "float16") return mixprec::DType::f16;
  if (name == "bfloat16") return mixprec::DType::bf16;
  throw nb::value_error(("dtype: expected float32, float16 or bfloat16, found '" + std::string(name) + "'").c_str());
}

// (elements, nonzero, nonfinite_input, underflow, subnormal, overflow, amax)
Counts as_tuple(const mixprec::CountedTensor& c) {
  const mixprec::ConversionStats& s = c.stats;
  return {s.elements, s.nonzero, s.nonfinite_input, s.underflow, s.subnormal, s.overflow, c.amax};
}

// d[key] as T, for the dicts of record()'s quantized tensors: a missing key or a value of
// another type is an error naming `where`.key.
template <class T>
T dict_value(nb::handle d, const char* key, const std::string& where) {
  nb::object v;
  try {
    v = d[key];
  } catch (const nb::python_error&) {
    throw nb::value_error((where + "." + key + ": missing").c_str());
  }
  T out{};
  if (!nb::try_cast(v, out))
    throw nb::type_error((where + "." + key + ": expected a " + (std::is_same_v<T, std::string> ? "str" : "number") +
                          ", found " + nb::type_name(v.type()).c_str())
                             .c_str());
  return out;
}

void require_dict(nb::handle d, const std::string& where) {
  if (!nb::isinstance<nb::dict>(d))
    throw nb::type_error((where + ": expected a dict, found " + std::string(nb::type_name(d.type()).c_str())).c_str());
}

// The dict of _core.block_stats (block_stats_module.cpp) back as the core's struct.
mixprec::lowp::BlockStats block_stats_of(nb::handle d, const std::string& where) {
  require_dict(d, where);
  mixprec::lowp::BlockStats b;
  b.blocks = dict_value<std::uint64_t>(d, "blocks", where);
  b.multiplier_blocks = dict_value<std::uint64_t>(d, "multiplier_blocks", where);
  b.multiplier_left_out = dict_value<std::uint64_t>(d, "multiplier_left_out", where);
  b.log2_multiplier_min = dict_value<double>(d, "log2_multiplier_min", where);
  b.log2_multiplier_max = dict_value<double>(d, "log2_multiplier_max", where);
  b.log2_multiplier_mean = dict_value<double>(d, "log2_multiplier_mean", where);
  b.log2_multiplier_std = dict_value<double>(d, "log2_multiplier_std", where);
  const std::string qw = where + ".log2_multiplier_quantiles";
  nb::object q;
  try {
    q = d["log2_multiplier_quantiles"];
  } catch (const nb::python_error&) {
    throw nb::value_error((qw + ": missing").c_str());
  }
  require_dict(q, qw);
  mixprec::lowp::BlockQuantiles& p = b.log2_multiplier_quantiles;
  p.p01 = dict_value<double>(q, "p01", qw);
  p.p05 = dict_value<double>(q, "p05", qw);
  p.p25 = dict_value<double>(q, "p25", qw);
  p.p50 = dict_value<double>(q, "p50", qw);
  p.p75 = dict_value<double>(q, "p75", qw);
  p.p95 = dict_value<double>(q, "p95", qw);
  p.p99 = dict_value<double>(q, "p99", qw);
  b.flushed = dict_value<std::uint64_t>(d, "flushed", where);
  b.saturated = dict_value<std::uint64_t>(d, "saturated", where);
  b.blocks_with_flush = dict_value<std::uint64_t>(d, "blocks_with_flush", where);
  b.blocks_with_saturation = dict_value<std::uint64_t>(d, "blocks_with_saturation", where);
  b.max_flushed_fraction = dict_value<double>(d, "max_flushed_fraction", where);
  b.max_saturated_fraction = dict_value<double>(d, "max_saturated_fraction", where);
  b.tensor_amax = dict_value<float>(d, "tensor_amax", where);
  b.far_log2 = dict_value<double>(d, "far_log2", where);
  b.far_blocks = dict_value<std::uint64_t>(d, "far_blocks", where);
  b.zero_blocks = dict_value<std::uint64_t>(d, "zero_blocks", where);
  b.dynamic_range = dict_value<double>(d, "dynamic_range", where);
  b.max_block_dynamic_range = dict_value<double>(d, "max_block_dynamic_range", where);
  return b;
}

// One what-if of a tensor (mixprec.torch.low_precision's _what_if): {recipe, element, elements,
// saturated, flushed, rel_rms_error (None: not finite), blocks, far_blocks, log2_multiplier_std,
// log2_multiplier_p01, log2_multiplier_p99}.
mixprec::nn::Fp8WhatIf what_if_of(nb::handle d, const std::string& where) {
  require_dict(d, where);
  mixprec::nn::Fp8WhatIf w;
  w.recipe = dict_value<std::string>(d, "recipe", where);
  const std::string element = dict_value<std::string>(d, "element", where);
  const auto e = mixprec::lowp::parse_element(element);
  if (!e) throw nb::value_error((where + ".element: expected e4m3, e5m2 or e2m1, found '" + element + "'").c_str());
  w.element = *e;
  w.elements = dict_value<std::uint64_t>(d, "elements", where);
  w.saturated = dict_value<std::uint64_t>(d, "saturated", where);
  w.flushed = dict_value<std::uint64_t>(d, "flushed", where);
  w.rel_rms_error = dict_value<std::optional<double>>(d, "rel_rms_error", where);
  w.blocks = dict_value<std::uint64_t>(d, "blocks", where);
  w.far_blocks = dict_value<std::uint64_t>(d, "far_blocks", where);
  w.log2_multiplier_std = dict_value<double>(d, "log2_multiplier_std", where);
  w.log2_multiplier_p01 = dict_value<double>(d, "log2_multiplier_p01", where);
  w.log2_multiplier_p99 = dict_value<double>(d, "log2_multiplier_p99", where);
  return w;
}

mixprec::CountedTensor count_view(const mixprec::GradTensor& v) {
  switch (v.dtype) {
    case mixprec::DType::f16:
      return mixprec::count_f16_as_stored({static_cast<const mixprec::f16*>(v.data), v.size});
    case mixprec::DType::bf16:
      return mixprec::count_bf16_to_f16({static_cast<const mixprec::bf16*>(v.data), v.size});
    case mixprec::DType::f32: break;
  }
  return mixprec::count_f32_to_f16({static_cast<const float*>(v.data), v.size});
}

// The layout of a histogram handed in as a list: Log2Histogram's bins, then zeros, nonfinite.
std::vector<std::uint64_t> histogram_list(const mixprec::nn::Log2Histogram& h) {
  std::vector<std::uint64_t> v = h.counts;
  v.push_back(h.zeros);
  v.push_back(h.nonfinite);
  return v;
}

mixprec::nn::Log2Histogram histogram_of(const std::vector<std::uint64_t>& v) {
  mixprec::nn::Log2Histogram h;
  if (v.size() != h.counts.size() + 2)
    throw nb::value_error(("histogram: expected " + std::to_string(h.counts.size() + 2) + " counts (bins, zeros, "
                           "nonfinite), found " + std::to_string(v.size()))
                              .c_str());
  std::copy(v.begin(), v.end() - 2, h.counts.begin());
  h.zeros = v[v.size() - 2];
  h.nonfinite = v.back();
  return h;
}

class PyTelemetryRecorder {
 public:
  // loss_scale_state: the scaler's LossScale state JSON (its whole config goes to config.json).
  PyTelemetryRecorder(std::string dir, std::string precision, std::string loss_scale, std::size_t histogram_every,
                      std::optional<std::string> loss_scale_state)
      : rec_(std::move(dir), {.precision = std::move(precision),
                              .loss_scale = std::move(loss_scale),
                              .histogram_every = histogram_every,
                              .loss_scale_config = config_of(loss_scale_state),
                              .writer = mixprec::train::RunWriter::python}) {}

  bool histogram_step() const { return rec_.histogram_step(); }

  void count_activation_grad(const std::string& name, nb::handle grad) {
    std::vector<AnyArray> keep;
    const mixprec::GradTensor v = tensor_view(grad, "gradient of '" + name + "'", keep);
    nb::gil_scoped_release unlocked;
    rec_.count_activation_grad(name, v);
  }

  bool check_activation(const std::string& name, nb::handle output) {
    std::vector<AnyArray> keep;
    const mixprec::GradTensor v = tensor_view(output, "output of '" + name + "'", keep);
    nb::gil_scoped_release unlocked;
    return rec_.check_activation(name, v);
  }

  // What a device counted (mixprec.torch's device path): the profile count_bounds defines.
  void add_activation_grad_profile(const std::string& name, std::string_view dtype, std::uint64_t elements,
                                   const std::array<std::uint64_t, 5>& above, std::uint32_t max_bits) {
    const mixprec::DType t = parse_dtype(dtype);
    rec_.add_activation_grad(name, mixprec::counted_from_profile(t, elements, above, max_bits), t);
  }

  void forward_nonfinite(const std::string& name) { rec_.forward_nonfinite(name); }

  // kind: activations, activation_grads, weight_grads or weights.
  void add_histogram(std::string_view kind, const std::vector<std::uint64_t>& counts) {
    mixprec::train::StepRecord::Histograms h;
    mixprec::nn::Log2Histogram* into = kind == "activations"        ? &h.activations
                                       : kind == "activation_grads" ? &h.activation_grads
                                       : kind == "weight_grads"     ? &h.weight_grads
                                       : kind == "weights"          ? &h.weights
                                                                    : nullptr;
    if (into == nullptr)
      throw nb::value_error(("histogram kind: expected activations, activation_grads, weight_grads or weights, "
                             "found '" + std::string(kind) + "'")
                                .c_str());
    *into = histogram_of(counts);
    rec_.add_histograms(h);
  }

  // The parameters, once: their names in record()'s order.
  void set_params(const std::vector<std::string>& names) {
    names_ = names;
    weights_.assign(names.size(), {});
    keep_.assign(names.size(), std::nullopt);
  }

  // Parameter i's weight: a CPU array, exported once and kept (None: on a device, `numel`
  // elements, its |max| passed to record()).
  void set_weight(std::size_t i, nb::handle weight, std::size_t numel) {
    if (i >= names_.size())
      throw nb::index_error(("parameter " + std::to_string(i) + ": expected an index below " +
                             std::to_string(names_.size()))
                                .c_str());
    if (weight.is_none()) {
      weights_[i] = {nullptr, numel, mixprec::DType::f32};
      keep_[i].reset();
      return;
    }
    std::vector<AnyArray> keep;
    weights_[i] = tensor_view(weight, "parameter '" + names_[i] + "'", keep);
    keep_[i] = std::move(keep.front());
  }

  // One log line. unclipped_grad_amax / grad_amax / weight_amax (NamedParam's): empty, or one
  // entry per parameter (None: measure here); grads: empty, or one entry per parameter (None:
  // no gradient, or not to be read); layers: preset layerwise's (name, factor, chain, backoff,
  // outcome) per watched layer. Returns the line written.
  std::string record(double loss, double lr, std::uint64_t tokens, double seconds, std::optional<double> val_loss,
                     float scale, float next_scale, bool found_inf, bool applied, double grad_norm, float clip_coef,
                     std::string overflow_param, const std::vector<std::optional<float>>& unclipped_grad_amax,
                     const std::vector<std::optional<float>>& grad_amax, nb::list grads,
                     const std::vector<std::optional<float>>& weight_amax, nb::list layers, nb::list quantized,
                     std::uint64_t step, std::string skip_reason, double loss_z, double grad_z,
                     std::string recipe_phase) {
    const std::size_t n = names_.size();
    auto sized = [n](std::size_t size, const char* what) {
      if (size != 0 && size != n)
        throw nb::value_error((std::string(what) + ": expected 0 or " + std::to_string(n) + " entries, found " +
                               std::to_string(size))
                                  .c_str());
    };
    sized(unclipped_grad_amax.size(), "unclipped_grad_amax");
    sized(grad_amax.size(), "grad_amax");
    sized(grads.size(), "grads");
    sized(weight_amax.size(), "weight_amax");
    std::vector<AnyArray> keep;
    std::vector<mixprec::train::NamedParam> views(n);
    for (std::size_t i = 0; i < n; ++i) {
      mixprec::train::NamedParam& p = views[i];
      p.name = names_[i];
      p.weight = weights_[i];
      if (!unclipped_grad_amax.empty()) p.unclipped_grad_amax = unclipped_grad_amax[i];
      if (!grad_amax.empty()) p.grad_amax = grad_amax[i];
      if (!weight_amax.empty()) p.weight_amax = weight_amax[i];
      if (grads.size() != 0 && !grads[i].is_none()) p.grad = tensor_view(grads[i], "gradient of '" + names_[i] + "'", keep);
    }
    mixprec::train::TelemetryStep s;
    s.loss = loss;
    s.lr = lr;
    s.tokens = tokens;
    s.seconds = seconds;
    s.val_loss = val_loss;
    s.scale = scale;
    s.next_scale = next_scale;
    s.found_inf = found_inf;
    s.applied = applied;
    s.grad_norm = grad_norm;
    s.clip_coef = clip_coef;
    s.overflow_param = std::move(overflow_param);
    s.step = step;  // 0: after the previous record
    s.skip_reason = std::move(skip_reason);
    s.loss_z = loss_z;
    s.grad_z = grad_z;
    s.recipe_phase = std::move(recipe_phase);
    for (nb::handle item : layers) {  // preset layerwise: (name, factor, chain, backoff, outcome)
      const auto [name, factor, chain, backoff, outcome] =
          nb::cast<std::tuple<std::string, double, double, std::int64_t, std::string>>(item);
      s.layers.push_back({name, factor, chain, backoff, outcome});
    }
    // Low-precision tensors: (name, role, recipe, element, scale, amax, elements, nonzero,
    // saturated, flushed, rel_rms_error or None), and at sampled steps three more: blocks (the
    // dict of _core.block_stats) or None, kurtosis or None, what_if (a list of what_if_of's
    // dicts). The core checks the values.
    for (nb::handle item : quantized) {
      const auto f = nb::cast<std::vector<nb::object>>(item);
      if (f.size() != 11 && f.size() != 14)
        throw nb::value_error(("quantized: expected tuples of 11 fields (14 with the sampled statistics), found " +
                               std::to_string(f.size()))
                                  .c_str());
      const auto [name, role, recipe, element, scale, amax, elements, nonzero, saturated, flushed, error] =
          nb::cast<std::tuple<std::string, std::string, std::string, std::string, float, float, std::uint64_t,
                              std::uint64_t, std::uint64_t, std::uint64_t, std::optional<double>>>(
              nb::make_tuple(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10]));
      const bool sampled = f.size() == 14;
      const nb::object blocks = sampled ? f[11] : nb::none();
      const auto kurtosis = sampled ? nb::cast<std::optional<double>>(f[12]) : std::nullopt;
      const nb::object what_if = sampled ? f[13] : nb::none();
      mixprec::nn::Fp8TensorStats t;
      t.name = name;
      if (role != "forward" && role != "backward")
        throw nb::value_error(("quantized '" + name + "': role: expected forward or backward, found '" + role + "'").c_str());
      t.role = role == "forward" ? mixprec::lowp::Role::forward : mixprec::lowp::Role::backward;
      t.recipe = recipe;
      const auto e = mixprec::lowp::parse_element(element);
      if (!e) throw nb::value_error(("quantized '" + name + "': element: expected e4m3, e5m2 or e2m1, found '" + element + "'").c_str());
      t.element = *e;
      t.dtype = *e == mixprec::lowp::Element::e5m2 ? mixprec::lowp::Element::e5m2 : mixprec::lowp::Element::e4m3;
      t.scale = scale;
      t.amax = amax;
      t.elements = elements;
      t.nonzero = nonzero;
      t.saturated = saturated;
      t.flushed = flushed;
      t.rel_rms_error = error;
      if (!blocks.is_none()) t.blocks = block_stats_of(blocks, "quantized '" + name + "': blocks");
      t.kurtosis = kurtosis;
      if (!what_if.is_none())
        for (nb::handle w : what_if) t.what_if.push_back(what_if_of(w, "quantized '" + name + "': what_if"));
      s.quantized.push_back(std::move(t));
    }
    mixprec::train::StepRecord r;
    {
      nb::gil_scoped_release unlocked;
      r = rec_.record(s, views);
    }
    return mixprec::train::step_record_json(r);
  }

  // The alerts raised: (id, step, message, advice, tensor) each; tensor: the per-tensor kinds'
  // tensor, "" for the others.
  std::vector<std::tuple<std::string, std::uint64_t, std::string, std::string, std::string>> finish() {
    std::vector<std::tuple<std::string, std::uint64_t, std::string, std::string, std::string>> out;
    for (const auto& a : rec_.finish()) out.emplace_back(a.id, a.step, a.message, a.advice, a.tensor);
    return out;
  }

  double seconds() { return rec_.seconds(); }
  void add_seconds(double s) { rec_.add_seconds(s); }
  std::uint64_t steps() const { return rec_.steps(); }
  const std::string& dir() const { return rec_.dir(); }

 private:
  mixprec::train::TelemetryRecorder rec_;
  static std::optional<mixprec::LossScaleConfig> config_of(const std::optional<std::string>& state) {
    if (!state) return std::nullopt;
    return mixprec::LossScaleState::from_json(*state).config;
  }
  std::vector<std::string> names_;
  std::vector<mixprec::GradTensor> weights_;  // views of the exported weights (data null: on a device)
  std::vector<std::optional<AnyArray>> keep_;  // the exports behind them
};

}  // namespace

void mixprec_python::register_telemetry(nb::module_& m) {
  nb::class_<PyTelemetryRecorder>(m, "TelemetryRecorder")
      .def(nb::init<std::string, std::string, std::string, std::size_t, std::optional<std::string>>(), nb::arg("dir"),
           nb::arg("precision"), nb::arg("loss_scale"), nb::arg("histogram_every"),
           nb::arg("loss_scale_state").none() = nb::none())
      .def("histogram_step", &PyTelemetryRecorder::histogram_step)
      .def("count_activation_grad", &PyTelemetryRecorder::count_activation_grad, nb::arg("name"), nb::arg("grad"))
      .def("check_activation", &PyTelemetryRecorder::check_activation, nb::arg("name"), nb::arg("output"))
      .def("add_activation_grad_profile", &PyTelemetryRecorder::add_activation_grad_profile, nb::arg("name"),
           nb::arg("dtype"), nb::arg("elements"), nb::arg("above"), nb::arg("max_bits"))
      .def("forward_nonfinite", &PyTelemetryRecorder::forward_nonfinite, nb::arg("name"))
      .def("add_histogram", &PyTelemetryRecorder::add_histogram, nb::arg("kind"), nb::arg("counts"))
      .def("set_params", &PyTelemetryRecorder::set_params, nb::arg("names"))
      .def("set_weight", &PyTelemetryRecorder::set_weight, nb::arg("index"), nb::arg("weight").none(),
           nb::arg("numel"))
      .def("record", &PyTelemetryRecorder::record, nb::arg("loss"), nb::arg("lr"), nb::arg("tokens"),
           nb::arg("seconds"), nb::arg("val_loss").none(), nb::arg("scale"), nb::arg("next_scale"),
           nb::arg("found_inf"), nb::arg("applied"), nb::arg("grad_norm"), nb::arg("clip_coef"),
           nb::arg("overflow_param"), nb::arg("unclipped_grad_amax"), nb::arg("grad_amax"), nb::arg("grads"),
           nb::arg("weight_amax"), nb::arg("layers") = nb::list(), nb::arg("quantized") = nb::list(),
           nb::arg("step") = 0, nb::arg("skip_reason") = "", nb::arg("loss_z") = std::nan(""),
           nb::arg("grad_z") = std::nan(""), nb::arg("recipe_phase") = "")
      .def("finish", &PyTelemetryRecorder::finish)
      .def("seconds", &PyTelemetryRecorder::seconds)
      .def("add_seconds", &PyTelemetryRecorder::add_seconds, nb::arg("seconds"))
      .def_prop_ro("steps", &PyTelemetryRecorder::steps)
      .def_prop_ro("dir", &PyTelemetryRecorder::dir);

  m.def(
      "count_to_f16",
      [](nb::handle x) {
        std::vector<AnyArray> keep;
        const mixprec::GradTensor v = tensor_view(x, "x", keep);
        return as_tuple(count_view(v));
      },
      nb::arg("x"),
      "The core's counting pass (formats/count.hpp) over a CPU array: (elements, nonzero, nonfinite_input, "
      "underflow, subnormal, overflow, amax)");
  m.def(
      "count_from_profile",
      [](std::string_view dtype, std::uint64_t elements, const std::array<std::uint64_t, 5>& above,
         std::uint32_t max_bits) {
        return as_tuple(mixprec::counted_from_profile(parse_dtype(dtype), elements, above, max_bits));
      },
      nb::arg("dtype"), nb::arg("elements"), nb::arg("above"), nb::arg("max_bits"),
      "The same counts from a profile measured elsewhere (mixprec.torch's device path)");
  m.def(
      "count_bounds",
      [](std::string_view dtype) {
        const auto b = mixprec::count_bounds(parse_dtype(dtype));
        return std::array<std::uint32_t, 5>{b[0], b[1], b[2], b[3], b[4]};
      },
      nb::arg("dtype"), "The magnitude bounds of the counting pass's classes for a source dtype (count.hpp)");
  m.def(
      "log2_histogram",
      [](nb::handle x, std::size_t stride) {
        std::vector<AnyArray> keep;
        const mixprec::GradTensor v = tensor_view(x, "x", keep);
        std::vector<float> widened(v.size);
        for (std::size_t i = 0; i < v.size; ++i) {
          switch (v.dtype) {
            case mixprec::DType::f32: widened[i] = static_cast<const float*>(v.data)[i]; break;
            case mixprec::DType::f16: widened[i] = static_cast<float>(static_cast<const mixprec::f16*>(v.data)[i]); break;
            case mixprec::DType::bf16: widened[i] = static_cast<float>(static_cast<const mixprec::bf16*>(v.data)[i]); break;
          }
        }
        if (stride == 0) throw nb::value_error("stride: expected an int >= 1, found 0");
        mixprec::nn::Log2Histogram h;
        h.add(widened, stride);
        return histogram_list(h);
      },
      nb::arg("x"), nb::arg("stride"), "The core's log2 histogram of a CPU array (bins, zeros, nonfinite)");
  m.attr("HISTOGRAM_LAYOUT") = nb::make_tuple(mixprec::nn::Log2Histogram::kMinExp,
                                              mixprec::nn::Log2Histogram::kMaxExp, mixprec::nn::kHistogramStride);
}
