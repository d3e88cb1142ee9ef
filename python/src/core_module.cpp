// mixprec._core: the nanobind extension module behind the `mixprec` Python package
// (docs/python.md). Thin: every conversion and every loss-scale step is the core's own
// function; this file only checks Python arguments, names what it expected and what it
// found, and moves buffers across without copying them (nanobind ndarray: the buffer
// protocol or DLPack, so NumPy arrays today and CPU tensors later, without importing torch).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "mixprec/report/report.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/scaler/check_gradients.hpp"
#include "mixprec/scaler/grad_route.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/scaler/protocol.hpp"
#include "binding.hpp"
#include "mixprec/run/run_log.hpp"

namespace nb = nanobind;

namespace {

using mixprec::ConversionStats;
using mixprec::ConvertOptions;

// ---- arrays: what the caller passed, checked without copying -------------------------

using AnyArray = nb::ndarray<nb::ro>;  // any dtype, layout or device: checked below
using MutArray = nb::ndarray<>;

std::string dtype_name(nb::dlpack::dtype t) {
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  std::string kind;
  switch (code) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: kind = "dtype code " + std::to_string(t.code) + " of "; break;
  }
  return kind + std::to_string(t.bits) + (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

std::string python_type_name(nb::handle h) { return nb::type_name(h.type()).c_str(); }

// True when the elements lie in row-major (C) order without gaps; size-1 dimensions may
// carry any stride, and an empty array any strides (as NumPy's C_CONTIGUOUS flag allows).
template <class A>
bool c_contiguous(const A& a) {
  if (a.size() == 0) return true;
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

// `what` names the argument in messages: "x", "out", "random", "codes".
template <class A>
A as_array(nb::handle h, const char* what, std::string_view expected) {
  A a;
  if (!nb::try_cast(h, a, /*convert=*/false)) {
    if constexpr (std::is_same_v<A, MutArray>) {
      AnyArray ro;
      if (nb::try_cast(h, ro, false))
        throw nb::value_error((std::string(what) + ": expected a writable array of " + std::string(expected) +
                               ", found a read-only array")
                                  .c_str());
    }
    throw nb::type_error((std::string(what) + ": expected a NumPy array (or DLPack CPU tensor) of " +
                          std::string(expected) + ", found " + python_type_name(h))
                             .c_str());
  }
  if (a.device_type() != nb::device::cpu::value)
    throw nb::value_error((std::string(what) + ": expected an array in CPU memory, found device type " +
                           std::to_string(a.device_type()))
                              .c_str());
  return a;
}

// The array's dtype must be one of `allowed`; the message lists them.
template <class A>
void require_dtype(const A& a, const char* what, const std::vector<nb::dlpack::dtype>& allowed,
                   std::string_view expected) {
  for (const auto& t : allowed)
    if (a.dtype() == t) return;
  throw nb::type_error((std::string(what) + ": expected dtype " + std::string(expected) + ", found " +
                        dtype_name(a.dtype()) + " (mixprec converts in place and never copies or casts)")
                           .c_str());
}

template <class A>
void require_c_contiguous(const A& a, const char* what) {
  if (!c_contiguous(a))
    throw nb::value_error((std::string(what) +
                           ": expected a C-contiguous array, found a strided view (pass "
                           "numpy.ascontiguousarray(...) to copy it once yourself)")
                              .c_str());
}

template <class A, class B>
void require_same_size(const A& a, const char* what_a, const B& b, const char* what_b) {
  if (a.size() != b.size())
    throw nb::value_error((std::string(what_b) + ": expected " + std::to_string(a.size()) + " elements (as " +
                           what_a + "), found " + std::to_string(b.size()))
                              .c_str());
}

// The core reads one array while it writes the other: they must not share memory.
template <class A, class B>
void require_apart(const A& a, const char* what_a, const B& b, const char* what_b) {
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.data()), a1 = a0 + a.size() * a.itemsize();
  const auto b0 = reinterpret_cast<std::uintptr_t>(b.data()), b1 = b0 + b.size() * b.itemsize();
  if (a0 < b1 && b0 < a1)
    throw nb::value_error((std::string(what_b) + ": expected memory apart from " + what_a +
                           ", found the two overlapping (the conversion is not in place)")
                              .c_str());
}

std::vector<std::size_t> shape_of(const AnyArray& a) {
  std::vector<std::size_t> s(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) s[i] = a.shape(i);
  return s;
}

// A fresh C-contiguous NumPy array of `Storage` with the given shape (owned by a capsule).
template <class Storage>
nb::object new_numpy(const std::vector<std::size_t>& shape, std::size_t n, MutArray& view) {
  auto* data = new Storage[n == 0 ? 1 : n];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<Storage*>(p); });
  nb::ndarray<nb::numpy, Storage> arr(data, shape.size(), shape.data(), owner);
  nb::object obj = nb::cast(arr);
  view = nb::cast<MutArray>(obj, false);
  return obj;
}

// ---- formats ---------------------------------------------------------------------------

// A format with conversion kernels, by its name in the format table (f16, bf16, f8e4m3, f8e5m2).
mixprec::FormatId parse_format(std::string_view name) {
  for (const mixprec::FormatId f : mixprec::convertible_formats())
    if (mixprec::format_row(f).name == name) return f;
  throw nb::value_error(("format: expected one of " + mixprec::format_names(mixprec::convertible_formats()) +
                         ", found '" + std::string(name) + "'")
                            .c_str());
}

mixprec::Overflow parse_overflow(std::string_view s) {
  if (s == "ieee") return mixprec::Overflow::ieee;
  if (s == "saturate") return mixprec::Overflow::saturate;
  throw nb::value_error(("overflow: expected 'ieee' or 'saturate', found '" + std::string(s) + "'").c_str());
}

mixprec::Subnormals parse_subnormals(std::string_view s) {
  if (s == "keep") return mixprec::Subnormals::keep;
  if (s == "flush") return mixprec::Subnormals::flush;
  throw nb::value_error(("subnormals: expected 'keep' or 'flush', found '" + std::string(s) + "'").c_str());
}

// Code dtypes: the format's storage as unsigned integers; f16 codes may also be float16.
template <class T>
std::vector<nb::dlpack::dtype> code_dtypes() {
  if constexpr (std::is_same_v<T, mixprec::f16>)
    return {nb::dtype<std::uint16_t>(), {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}};
  else if constexpr (sizeof(typename T::storage_type) == 2) return {nb::dtype<std::uint16_t>()};
  else return {nb::dtype<std::uint8_t>()};
}

template <class T>
std::string code_dtype_text() {
  if constexpr (std::is_same_v<T, mixprec::f16>) return "uint16 or float16 (f16 codes)";
  else if constexpr (sizeof(typename T::storage_type) == 2) return "uint16 (" + std::string(mixprec::format_traits<T>::name) + " codes)";
  else return "uint8 (" + std::string(mixprec::format_traits<T>::name) + " codes)";
}

const nb::dlpack::dtype kF32 = nb::dtype<float>();

AnyArray checked_f32(nb::handle x, const char* what) {
  AnyArray a = as_array<AnyArray>(x, what, "float32");
  require_dtype(a, what, {kF32}, "float32");
  require_c_contiguous(a, what);
  return a;
}

// The destination for codes: `out` checked, or a new array shaped like `like`.
template <class T>
std::pair<nb::object, MutArray> code_destination(nb::handle out, const AnyArray& like, const char* like_name) {
  using S = typename T::storage_type;
  MutArray view;
  if (out.is_none()) {
    nb::object obj = new_numpy<S>(shape_of(like), like.size(), view);
    return {obj, view};
  }
  view = as_array<MutArray>(out, "out", code_dtype_text<T>());
  require_dtype(view, "out", code_dtypes<T>(), code_dtype_text<T>());
  require_c_contiguous(view, "out");
  require_same_size(like, like_name, view, "out");
  return {nb::borrow(out), view};
}

template <class T>
std::span<T> code_span(const MutArray& a) {
  return {static_cast<T*>(a.data()), a.size()};
}

template <class T>
nb::tuple encode_as(nb::handle x, nb::handle out, const ConvertOptions& opts) {
  const AnyArray src = checked_f32(x, "x");
  auto [obj, dst] = code_destination<T>(out, src, "x");
  require_apart(src, "x", dst, "out");
  const std::span<const float> in(static_cast<const float*>(src.data()), src.size());
  ConversionStats stats;
  {
    nb::gil_scoped_release release;
    stats = mixprec::convert_counted<T>(in, code_span<T>(dst), opts);
  }
  return nb::make_tuple(obj, stats);
}

template <class T>
nb::object encode_stochastic_as(nb::handle x, nb::handle random, nb::handle out, const ConvertOptions& opts) {
  const AnyArray src = checked_f32(x, "x");
  const AnyArray bits = as_array<AnyArray>(random, "random", "uint32");
  require_dtype(bits, "random", {nb::dtype<std::uint32_t>()}, "uint32 (32 random bits per element)");
  require_c_contiguous(bits, "random");
  require_same_size(src, "x", bits, "random");
  auto [obj, dst] = code_destination<T>(out, src, "x");
  require_apart(src, "x", dst, "out");
  require_apart(bits, "random", dst, "out");
  const std::span<const float> in(static_cast<const float*>(src.data()), src.size());
  const std::span<const std::uint32_t> words(static_cast<const std::uint32_t*>(bits.data()), bits.size());
  {
    nb::gil_scoped_release release;
    mixprec::convert_stochastic<T>(in, code_span<T>(dst), words, opts);
  }
  return obj;
}

template <class T>
nb::object decode_as(nb::handle codes, nb::handle out, const ConvertOptions& opts) {
  const AnyArray src = as_array<AnyArray>(codes, "codes", code_dtype_text<T>());
  require_dtype(src, "codes", code_dtypes<T>(), code_dtype_text<T>());
  require_c_contiguous(src, "codes");
  MutArray dst;
  nb::object obj;
  if (out.is_none()) {
    obj = new_numpy<float>(shape_of(src), src.size(), dst);
  } else {
    dst = as_array<MutArray>(out, "out", "float32");
    require_dtype(dst, "out", {kF32}, "float32");
    require_c_contiguous(dst, "out");
    require_same_size(src, "codes", dst, "out");
    require_apart(src, "codes", dst, "out");
    obj = nb::borrow(out);
  }
  const std::span<const T> in(static_cast<const T*>(src.data()), src.size());
  const std::span<float> result(static_cast<float*>(dst.data()), dst.size());
  {
    nb::gil_scoped_release release;
    mixprec::convert<T>(in, result, opts);
  }
  return obj;
}

ConvertOptions make_options(std::string_view overflow, std::string_view subnormals, float scale) {
  ConvertOptions o;
  o.overflow = parse_overflow(overflow);
  o.subnormals = parse_subnormals(subnormals);
  o.scale = scale;  // the core checks it (finite, > 0) and names it
  return o;
}

template <class F>
auto dispatch(std::string_view format, F&& f) {
  return mixprec::visit_format(parse_format(format), std::forward<F>(f));
}

// ---- loss scale --------------------------------------------------------------------------

// One loss-scale policy (mixprec::LossScale) made from a preset and `--set`-style overrides.
class PyLossScale {
 public:
  PyLossScale(std::string_view preset, const std::vector<std::pair<std::string, std::string>>& overrides)
      : scale_(mixprec::make_loss_scale(mixprec::make_loss_scale_config(preset, overrides))) {}

  float scale() const { return scale_->scale(); }
  double exact_scale() const { return scale_->state().scale; }

  // ("grew" | "backed_off" | "unchanged", scale before, scale after).
  nb::tuple update(bool found_inf) {
    const mixprec::LossScaleCounters before = scale_->counters();
    const float old_scale = scale_->scale();
    scale_->update(found_inf);  // ScaleCollapseError: the scale is left as it was
    const mixprec::LossScaleCounters after = scale_->counters();
    const char* action = after.growths > before.growths     ? "grew"
                         : after.backoffs > before.backoffs ? "backed_off"
                                                            : "unchanged";
    return nb::make_tuple(action, old_scale, scale_->scale());
  }

  std::vector<float> replay(const std::vector<bool>& overflows) {
    std::vector<float> scales;
    scales.reserve(overflows.size());
    for (std::size_t i = 0; i < overflows.size(); ++i) {
      try {
        scale_->update(overflows[i]);
      } catch (const mixprec::ScaleCollapseError& e) {
        throw mixprec::ScaleCollapseError("replay step " + std::to_string(i) + " (0-based; " +
                                          std::to_string(scales.size()) + " steps applied): " + e.what());
      }
      scales.push_back(scale_->scale());
    }
    return scales;
  }

  std::string to_json() const { return scale_->to_json(); }
  void load_json(std::string_view json) { scale_->load_json(json); }
  std::string describe() const { return mixprec::describe(scale_->config()); }

 private:
  std::unique_ptr<mixprec::LossScale> scale_;
};

// ---- gradients: the core's fused check + unscale over CPU tensors (mixprec.torch) -------

// The core's DType of a float32, float16 or bfloat16 array; TypeError naming `what` (and
// `why`, appended) for any other dtype.
template <class A>
mixprec::DType gradient_dtype(const A& a, const std::string& what, const char* why) {
  if (a.dtype() == nb::dtype<float>()) return mixprec::DType::f32;
  if (a.dtype() == nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1})
    return mixprec::DType::f16;
  if (a.dtype() == nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1})
    return mixprec::DType::bf16;
  throw nb::type_error(
      (what + ": expected dtype float32, float16 or bfloat16, found " + dtype_name(a.dtype()) + why).c_str());
}


// One pass of mixprec::unscale_and_check over `tensors` (a list of C-contiguous CPU arrays of
// float32, float16 or bfloat16: torch tensors arrive through DLPack, without importing torch),
// in place, on the arrays' own memory. Every tensor is checked before anything is written.
// Returns (found_inf, index of the first tensor holding inf/NaN or -1, sum of squares of the
// unscaled values; NaN when not asked). mixprec.torch validates first and names parameters;
// these messages (tensors[i]) are the backstop.
// Writable views of `tensors` (C-contiguous CPU float32/float16/bfloat16 arrays: torch tensors
// through DLPack); `keep` holds every export alive while the views are used.
std::vector<mixprec::GradTensor> gradient_views(nb::list tensors, std::vector<MutArray>& keep) {
  std::vector<mixprec::GradTensor> views;
  keep.reserve(tensors.size());
  views.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "]";
    MutArray a = as_array<MutArray>(tensors[i], what.c_str(), "float32, float16 or bfloat16");
    const mixprec::DType t = gradient_dtype(a, what, " (gradients are unscaled in place, never copied or cast)");
    require_c_contiguous(a, what.c_str());
    views.push_back({a.size() ? a.data() : nullptr, a.size(), t});
    keep.push_back(std::move(a));
  }
  return views;
}

std::tuple<bool, std::int64_t, double> unscale_tensors(nb::list tensors, float inv_scale, bool write,
                                                       bool sum_squares) {
  std::vector<MutArray> keep;
  const std::vector<mixprec::GradTensor> views = gradient_views(tensors, keep);
  if (!(std::isfinite(inv_scale) && inv_scale > 0.0f))
    throw nb::value_error(("inv_scale: expected a finite value > 0, found " + std::to_string(inv_scale)).c_str());
  mixprec::UnscaleOptions o;
  o.write = write;
  o.sum_squares = sum_squares;
  mixprec::UnscaleResult r;
  {
    nb::gil_scoped_release unlocked;
    r = mixprec::unscale_and_check(views, inv_scale, o);
  }
  return {r.found_inf, r.first_nonfinite, r.sum_squares};
}

// ---- the GradScaler protocol (mixprec.torch.GradScaler is an adapter over it) -------------

// A GradientCheck as Python holds it: (checked, found_inf, first_overflow or -1, sum_squares,
// carried_inv_scale).
mixprec::GradientCheck gradient_check_of(nb::handle check) {
  const nb::tuple t = nb::cast<nb::tuple>(check);
  mixprec::GradientCheck c;
  c.checked = nb::cast<bool>(t[0]);
  c.found_inf = nb::cast<bool>(t[1]);
  c.first_overflow = nb::cast<std::int64_t>(t[2]);
  c.sum_squares = nb::cast<double>(t[3]);
  c.carried_inv_scale = nb::cast<float>(t[4]);
  return c;
}

nb::tuple tuple_of(const mixprec::GradientCheck& c) {
  return nb::make_tuple(c.checked, c.found_inf, c.first_overflow, c.sum_squares, c.carried_inv_scale);
}

// A gradient as mixprec.torch describes it (grad_scaler.py's _describe): (str(dtype),
// dtype.is_floating_point, str(layout), str(device), sizes, strides), torch's own words.
using PyGradDescriptor = std::tuple<std::string, bool, std::string, std::string, std::vector<std::int64_t>,
                                    std::vector<std::int64_t>>;

mixprec::GradDescriptor descriptor_of(const PyGradDescriptor& g) {
  mixprec::GradDescriptor d;
  d.dtype = std::get<0>(g);
  if (d.dtype.starts_with("torch.")) d.dtype.remove_prefix(6);
  d.floating_point = std::get<1>(g);
  d.layout = mixprec::layout_from_torch_name(std::get<2>(g));
  d.device = std::get<3>(g);
  d.sizes = std::get<4>(g);
  d.strides = std::get<5>(g);
  return d;
}

// (route name, coalesce first)
std::pair<std::string, bool> route_tuple(const mixprec::GradRouting& r) {
  return {std::string(mixprec::route_name(r.route)), r.coalesce};
}

// mixprec::route_gradients over one optimizer's gradients; a refused one raises TypeError (its
// dtype) or ValueError with the core's message, names from name_of(index).
std::vector<std::pair<std::string, bool>> route_gradient_list(const std::vector<PyGradDescriptor>& grads,
                                                              const std::vector<std::int64_t>& index, bool aten_only,
                                                              nb::callable name_of) {
  std::vector<mixprec::GradDescriptor> d;
  d.reserve(grads.size());
  for (const PyGradDescriptor& g : grads) d.push_back(descriptor_of(g));
  std::vector<mixprec::GradRouting> routes;
  try {
    routes = mixprec::route_gradients(d, index, aten_only,
                                      [&](std::int64_t i) { return nb::cast<std::string>(name_of(i)); });
  } catch (const mixprec::GradientRefused& e) {
    if (e.wrong_type()) throw nb::type_error(e.what());
    throw nb::value_error(e.what());
  }
  std::vector<std::pair<std::string, bool>> out;
  out.reserve(routes.size());
  for (const mixprec::GradRouting& r : routes) out.push_back(route_tuple(r));
  return out;
}

// mixprec::check_in_two_reads with the door's reader read(core, write) -> a check tuple.
nb::tuple check_in_two_reads(float scale, const std::vector<std::int64_t>& core_index,
                             const std::vector<std::int64_t>& aten_index, nb::callable read) {
  return tuple_of(mixprec::check_in_two_reads(scale, core_index, aten_index, [&](bool core, bool write) {
    return gradient_check_of(read(core, write));
  }));
}

// mixprec::ScalerProtocol, torch dialect: the Python drop-in keeps only torch's API shape,
// the device routing of gradients and the torch.distributed callback.
class PyScalerProtocol {
 public:
  PyScalerProtocol(std::string preset, const std::vector<std::pair<std::string, std::string>>& overrides,
                   bool enabled)
      : p_(mixprec::make_loss_scale_config(preset, overrides), enabled, mixprec::Dialect::torch, preset) {}

  mixprec::ScalerProtocol& get() { return p_; }

  // found_inf, checked -> (found_inf, checked) over every rank; None: this rank alone.
  void set_rank_agreement(nb::object fn) {
    if (fn.is_none()) {
      p_.set_rank_agreement({});
      return;
    }
    p_.set_rank_agreement([fn](mixprec::RankFlags local) {
      nb::gil_scoped_acquire held;
      nb::tuple r = nb::cast<nb::tuple>(fn(local.found_inf, local.checked));
      return mixprec::RankFlags{nb::cast<bool>(r[0]), nb::cast<bool>(r[1])};
    });
  }

  // (applied?, found_inf, scale, first_overflow or -1, grad_norm, skip reason, (loss, loss_z, grad_z))
  nb::tuple decide(std::uint64_t id, bool user_skip) {
    mixprec::DecideOptions o;
    o.user_skip = user_skip;
    const mixprec::StepDecision d = p_.decide(id, o);
    return nb::make_tuple(d.apply, d.found_inf, d.scale, d.first_overflow, d.grad_norm,
                          std::string(mixprec::skip_reason_name(d.reason)),
                          nb::make_tuple(d.guard.loss, d.guard.loss_z, d.guard.grad_z));
  }

  // (loss, grad_norm, loss_z, grad_z): what decide() would give the guards.
  nb::tuple guard_view(std::uint64_t id) const {
    const mixprec::GuardView v = p_.guard_view(id);
    return nb::make_tuple(v.loss, v.grad_norm, v.loss_z, v.grad_z);
  }

  // The guard keys (skip_nonfinite, skip_loss_z, skip_grad_z, skip_window) as text.
  void set_guard(const std::vector<std::pair<std::string, std::string>>& pairs) {
    mixprec::GuardConfig c = p_.guard();
    for (const auto& [k, v] : pairs) mixprec::set(c, k, v);
    mixprec::validate(c);
    p_.set_guard(c);
  }

  void record(std::uint64_t id, nb::tuple check) { p_.record(id, gradient_check_of(check)); }

 private:
  mixprec::ScalerProtocol p_;
};

// mixprec::check_gradients over CPU arrays (torch tensors through DLPack, one block of memory
// each: mixprec.torch passes a dense tensor of any layout as its flat storage view), in
// place. Returns (checked, found_inf, first_overflow or -1, sum_squares, carried_inv_scale),
// and with amax=True a sixth item: each tensor's unscaled |max| as stored (amax_out).
nb::tuple check_gradient_arrays(nb::list tensors, float scale, bool write, bool amax) {
  std::vector<MutArray> keep;
  const std::vector<mixprec::GradTensor> views = gradient_views(tensors, keep);
  std::vector<float> amax_out(amax ? views.size() : 0);
  mixprec::GradientCheck c;
  {
    nb::gil_scoped_release unlocked;
    c = mixprec::check_gradients(views, scale, write, nullptr, amax_out);
  }
  if (amax)
    return nb::make_tuple(c.checked, c.found_inf, c.first_overflow, c.sum_squares, c.carried_inv_scale, amax_out);
  return tuple_of(c);
}

PyObject* g_misuse_runtime = nullptr;    // mixprec._core.ScalerMisuseError(RuntimeError)
PyObject* g_misuse_assertion = nullptr;  // mixprec._core.ScalerMisuseAssertion(AssertionError)

// `mixprec report`'s function: one HTML file of the run folders (`out` "": the default, checked
// as the CLI checks --out); returns (the file written, the steps shown).
std::pair<std::string, std::size_t> write_report(const std::vector<std::string>& dirs, const std::string& out_,
                                                 const std::string& title) {
  std::vector<mixprec::monitor::ReportRun> runs;
  for (const std::string& d : dirs) runs.push_back(mixprec::monitor::load_run(d));
  mixprec::monitor::make_names_unique(runs);
  const std::string out = mixprec::monitor::report_output(dirs, out_, "out");
  mixprec::monitor::ReportOptions o;
  o.title = title;
  mixprec::monitor::write_report(out, runs, o);
  std::size_t steps = 0;
  for (const auto& r : runs) steps += r.records.size();
  return {out, steps};
}

// The embedded corpus (or a text) as token ids: (train, validation, vocabulary, source).
nb::tuple dataset(std::optional<std::string> text, std::uint64_t seed, std::size_t tokens, std::string_view vocab,
                  double validation_fraction, std::size_t context) {
  mixprec::nn::DataOptions o;
  o.vocab = mixprec::nn::parse_vocab_spec(vocab);
  o.validation_fraction = validation_fraction;
  o.context = context;
  const mixprec::nn::Dataset d = text ? mixprec::nn::Dataset::from_text(*text, o)
                                      : mixprec::nn::Dataset::from_corpus({.seed = seed, .tokens = tokens}, o);
  auto ids = [](std::span<const mixprec::nn::TokenId> v) {
    auto* owned = new std::vector<std::uint32_t>(v.begin(), v.end());
    nb::capsule free_it(owned, [](void* p) noexcept { delete static_cast<std::vector<std::uint32_t>*>(p); });
    return nb::ndarray<nb::numpy, std::uint32_t, nb::ndim<1>>(owned->data(), {owned->size()}, free_it);
  };
  std::vector<std::string> words;
  for (std::size_t i = 0; i < d.vocab().size(); ++i)
    words.push_back(d.vocab().token(static_cast<mixprec::nn::TokenId>(i)));
  return nb::make_tuple(ids(d.train()), ids(d.validation()), words, d.source());
}

}  // namespace

void register_quantize(nb::module_& m);      // quantize_module.cpp
void register_block_stats(nb::module_& m);   // block_stats_module.cpp
void register_integrations(nb::module_& m);  // integrations_module.cpp
void register_advise(nb::module_& m);        // advise_module.cpp
void register_layerwise(nb::module_& m);     // layerwise_module.cpp
// binding.hpp: the one view of a tensor handed in for reading.
mixprec::GradTensor mixprec_python::tensor_view(nb::handle h, const std::string& what, std::vector<AnyArray>& keep) {
  AnyArray a = as_array<AnyArray>(h, what.c_str(), "float32, float16 or bfloat16");
  const mixprec::DType t = gradient_dtype(a, what, "");
  require_c_contiguous(a, what.c_str());
  mixprec::GradTensor v{a.size() ? const_cast<void*>(a.data()) : nullptr, a.size(), t};
  keep.push_back(std::move(a));
  return v;
}

NB_MODULE(_core, m) {
  m.doc() = "mixprec's C++ core (nanobind); use the `mixprec` package, not this module";
  register_quantize(m);
  register_block_stats(m);
  register_integrations(m);
  register_advise(m);

  nb::exception<mixprec::ScaleCollapseError>(m, "ScaleCollapseError", PyExc_RuntimeError);
  // Protocol misuse: torch's exception class (RuntimeError or AssertionError, the protocol's
  // table says which), with .kind naming the misuse (mixprec::misuse_name).
  g_misuse_runtime = PyErr_NewException("mixprec._core.ScalerMisuseError", PyExc_RuntimeError, nullptr);
  g_misuse_assertion = PyErr_NewException("mixprec._core.ScalerMisuseAssertion", PyExc_AssertionError, nullptr);
  m.attr("ScalerMisuseError") = nb::handle(g_misuse_runtime);
  m.attr("ScalerMisuseAssertion") = nb::handle(g_misuse_assertion);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mixprec::ScalerMisuse& e) {
      PyObject* cls = mixprec::python_error(e.kind()) == mixprec::PythonError::assertion_error ? g_misuse_assertion
                                                                                              : g_misuse_runtime;
      PyObject* err = PyObject_CallFunction(cls, "s", e.what());
      if (err == nullptr) return;  // the call set its own error
      const std::string kind(mixprec::misuse_name(e.kind()));
      PyObject* k = PyUnicode_FromString(kind.c_str());
      PyObject_SetAttrString(err, "kind", k);
      Py_XDECREF(k);
      PyErr_SetObject(cls, err);
      Py_DECREF(err);
    }
  });

  nb::class_<ConversionStats>(m, "ConversionStats",
                              "What a conversion destroyed, counted by the core (mixprec::ConversionStats)")
      .def_ro("elements", &ConversionStats::elements)
      .def_ro("nonzero", &ConversionStats::nonzero, "inputs != +-0 (finite or not)")
      .def_ro("nonfinite_input", &ConversionStats::nonfinite_input, "inputs that were inf or NaN")
      .def_ro("underflow", &ConversionStats::underflow, "nonzero inputs that became +-0")
      .def_ro("subnormal", &ConversionStats::subnormal, "nonzero inputs that became subnormal")
      .def_ro("overflow", &ConversionStats::overflow, "finite inputs rounded past max finite")
      .def("__eq__", [](const ConversionStats& a, const ConversionStats& b) { return a == b; })
      .def("__repr__", [](const ConversionStats& s) {
        return "ConversionStats(elements=" + std::to_string(s.elements) + ", nonzero=" + std::to_string(s.nonzero) +
               ", nonfinite_input=" + std::to_string(s.nonfinite_input) + ", underflow=" +
               std::to_string(s.underflow) + ", subnormal=" + std::to_string(s.subnormal) +
               ", overflow=" + std::to_string(s.overflow) + ")";
      });

  {
    nb::list names;
    for (const mixprec::FormatId f : mixprec::convertible_formats()) names.append(mixprec::format_row(f).name);
    m.attr("FORMATS") = nb::steal<nb::tuple>(PySequence_Tuple(names.ptr()));
  }

  m.def(
      "encode",
      [](nb::handle x, std::string_view format, std::string_view overflow, std::string_view subnormals, float scale,
         nb::handle out) {
        const ConvertOptions o = make_options(overflow, subnormals, scale);
        return dispatch(format, [&](auto t) { return encode_as<decltype(t)>(x, out, o); });
      },
      nb::arg("x").none(), nb::arg("format"), nb::arg("overflow"), nb::arg("subnormals"), nb::arg("scale"),
      nb::arg("out").none());

  m.def(
      "encode_stochastic",
      [](nb::handle x, std::string_view format, nb::handle random, std::string_view overflow,
         std::string_view subnormals, float scale, nb::handle out) {
        const ConvertOptions o = make_options(overflow, subnormals, scale);
        return dispatch(format, [&](auto t) { return encode_stochastic_as<decltype(t)>(x, random, out, o); });
      },
      nb::arg("x").none(), nb::arg("format"), nb::arg("random").none(), nb::arg("overflow"), nb::arg("subnormals"),
      nb::arg("scale"), nb::arg("out").none());

  m.def(
      "decode",
      [](nb::handle codes, std::string_view format, std::string_view subnormals, float scale, nb::handle out) {
        const ConvertOptions o = make_options("ieee", subnormals, scale);
        return dispatch(format, [&](auto t) { return decode_as<decltype(t)>(codes, out, o); });
      },
      nb::arg("codes").none(), nb::arg("format"), nb::arg("subnormals"), nb::arg("scale"), nb::arg("out").none());

  // The address nanobind hands to the core for `x`: the tests compare it with NumPy's.
  m.def("buffer_address", [](nb::handle x) {
    const AnyArray a = as_array<AnyArray>(x, "x", "any dtype");
    return reinterpret_cast<std::uintptr_t>(a.data());
  });

  m.def("unscale_and_check", &unscale_tensors, nb::arg("tensors"), nb::arg("inv_scale"), nb::arg("write") = true,
        nb::arg("sum_squares") = true,
        "The core's fused check + unscale (mixprec::unscale_and_check) in place over CPU tensors; "
        "returns (found_inf, first_nonfinite, sum_squares)");

  // The core's one reader of JSON files (core/json_read.hpp): a regular file of at most 64 MiB (a
  // FIFO or a device is refused, not waited on); Python then parses what the core checked.
  m.def(
      "read_json_text",
      [](const std::string& path) {
        const std::string text = mixprec::io::read_json_text(path);
        return nb::bytes(text.data(), text.size());  // bytes: Python decodes them and says where UTF-8 fails
      },
      nb::arg("path"));
  // Why a path cannot be an output replaced atomically ("" when it can): the CLI's rule
  // (core/io.hpp), for the Python doors' outputs.
  m.def("output_file_problem", &mixprec::io::output_file_problem, nb::arg("path"));
  m.def("loss_scale_preset_names", [] { return mixprec::loss_scale_preset_names(); });
  m.def("loss_scale_config_keys", [] { return mixprec::loss_scale_config_keys(); });

  nb::class_<PyLossScale>(m, "LossScale")
      .def(nb::init<std::string_view, const std::vector<std::pair<std::string, std::string>>&>(), nb::arg("preset"),
           nb::arg("overrides"))
      .def_prop_ro("scale", &PyLossScale::scale)
      .def_prop_ro("exact_scale", &PyLossScale::exact_scale)
      .def("update", &PyLossScale::update, nb::arg("found_inf"))
      .def("replay", &PyLossScale::replay, nb::arg("overflows"))
      .def("to_json", &PyLossScale::to_json)
      .def("load_json", &PyLossScale::load_json, nb::arg("json"))
      .def("describe", &PyLossScale::describe);

  m.def("check_gradients", &check_gradient_arrays, nb::arg("tensors"), nb::arg("scale"), nb::arg("write"),
        nb::arg("amax") = false,
        "mixprec::check_gradients in place over CPU arrays; returns (checked, found_inf, first_overflow, "
        "sum_squares, carried_inv_scale[, amax per tensor])");

  // How mixprec.torch.GradScaler reads each gradient (scaler/grad_route.hpp).
  m.def("route_gradients", &route_gradient_list, nb::arg("grads"), nb::arg("index"), nb::arg("aten_only"),
        nb::arg("name_of"),
        "mixprec::route_gradients: each (dtype, is_floating_point, layout, device, sizes, strides) validated, "
        "then [(route, coalesce)]; TypeError or ValueError with the core's message for a refused one");
  m.def("route_gradient",
        [](const PyGradDescriptor& g, bool aten_only) { return route_tuple(mixprec::route_gradient(descriptor_of(g), aten_only)); },
        nb::arg("grad"), nb::arg("aten_only") = false, "mixprec::route_gradient: (route, coalesce)");
  m.def("check_in_two_reads", &check_in_two_reads, nb::arg("scale"), nb::arg("core_index"), nb::arg("aten_index"),
        nb::arg("read"), "mixprec::check_in_two_reads with read(core, write) -> a check tuple");
  m.def("default_parameter_name", &mixprec::default_parameter_name, nb::arg("index"));

  using P = PyScalerProtocol;
  nb::class_<PyScalerProtocol>(m, "ScalerProtocol")
      .def(nb::init<std::string, const std::vector<std::pair<std::string, std::string>>&, bool>(), nb::arg("preset"),
           nb::arg("overrides"), nb::arg("enabled"))
      .def_prop_ro("enabled", [](P& p) { return p.get().enabled(); })
      .def_prop_ro("scale", [](P& p) { return p.get().scale(); })
      .def_prop_ro("preset", [](P& p) { return p.get().preset(); })
      .def_prop_ro("run_spec", [](P& p) { return p.get().run_spec(); })
      .def("set_rank_agreement", &P::set_rank_agreement, nb::arg("fn").none())
      .def("begin_unscale", [](P& p, std::uint64_t id) { p.get().begin_unscale(id); }, nb::arg("id"))
      .def("begin_step",
           [](P& p, std::uint64_t id) {
             switch (p.get().begin_step(id)) {
               case mixprec::StepPlan::pass_through: return "pass_through";
               case mixprec::StepPlan::check: return "check";
               case mixprec::StepPlan::step_only: return "step_only";
             }
             return "?";
           },
           nb::arg("id"))
      .def("record", &P::record, nb::arg("id"), nb::arg("check"))
      .def("decide", &P::decide, nb::arg("id"), nb::arg("user_skip") = false)
      .def("guard_view", &P::guard_view, nb::arg("id"))
      .def("set_guard", &P::set_guard, nb::arg("pairs"))
      .def("guard_json", [](P& p) { return mixprec::guard_config_json(p.get().guard()); })
      .def("observe_loss", [](P& p, double loss) { p.get().observe_loss(loss); }, nb::arg("loss"))
      .def("step_done", [](P& p, std::uint64_t id) { p.get().step_done(id); }, nb::arg("id"))
      .def("stage", [](P& p, std::uint64_t id) { return std::string(mixprec::stage_name(p.get().stage(id))); },
           nb::arg("id"))
      .def("between_steps", [](P& p) { return p.get().between_steps(); })
      .def("update", [](P& p) { p.get().update(); })
      .def("update_to", [](P& p, double s) { p.get().update_to(s); }, nb::arg("new_scale"))
      .def("next_scale", [](P& p) { return p.get().next_scale(); })
      .def("set_accumulation_steps", [](P& p, int k) { p.get().set_accumulation_steps(k); }, nb::arg("k"))
      .def_prop_ro("accumulation_steps", [](P& p) { return p.get().accumulation_steps(); })
      .def("backward_done", [](P& p) { p.get().backward_done(); })
      .def_prop_ro("backward_passes", [](P& p) { return p.get().backward_passes(); })
      .def("reconfigure", [](P& p, std::string_view k, std::string_view v) { p.get().reconfigure(k, v); },
           nb::arg("key"), nb::arg("value"))
      .def("loss_scale_json", [](P& p) { return p.get().loss_scale().to_json(); })
      .def("state_json", [](P& p) { return p.get().state_json(); })
      .def("load_state_json", [](P& p, std::string_view s) { p.get().load_state_json(s); }, nb::arg("json"))
      .def_prop_ro("layerwise", [](P& p) { return p.get().layerwise(); }, nb::rv_policy::reference_internal);

  mixprec_python::register_telemetry(m);
  mixprec_python::register_optim(m);

  register_layerwise(m);
  m.def("write_report", &write_report, nb::arg("dirs"), nb::arg("out"), nb::arg("title"));
  // The step guards' vocabulary (scaler/step_guard.hpp): the skip reasons and the config keys.
  m.def("skip_reason_names", [] {
    std::vector<std::string> v;
    for (std::string_view n : mixprec::skip_reason_names()) v.emplace_back(n);
    return v;
  });
  m.def("guard_config_keys", [] {
    std::vector<std::string> v;
    for (std::string_view n : mixprec::guard_config_keys()) v.emplace_back(n);
    return v;
  });
  m.def("dataset", &dataset, nb::arg("text").none(), nb::arg("seed"), nb::arg("tokens"), nb::arg("vocab"),
        nb::arg("validation_fraction"), nb::arg("context"));
}
