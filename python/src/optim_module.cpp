// The optimizer state formats for mixprec.torch.optim.AdamW (python/mixprec/torch/optim.py): the
// core's moment layouts, codecs and fused step of one tensor (optim/state_format.hpp), over torch
// tensors handed in through DLPack and written in place.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>

#include <optional>
#include <stdexcept>
#include <vector>
#include <string>

#include "binding.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/optim/state_format.hpp"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<>;
using RoArray = nb::ndarray<nb::ro>;

template <class A>
A cpu_array(nb::handle h, const std::string& what) {
  A a;
  if (!nb::try_cast(h, a, false))
    throw nb::type_error((what + ": expected a writable CPU tensor (DLPack), found " +
                          std::string(nb::type_name(h.type()).c_str())).c_str());
  if (a.device_type() != nb::device::cpu::value) throw nb::value_error((what + ": expected a CPU tensor").c_str());
  return a;
}

template <class A>
mixprec::DType float_dtype(const A& a, const std::string& what) {
  if (a.dtype() == nb::dtype<float>()) return mixprec::DType::f32;
  if (a.dtype() == nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1})
    return mixprec::DType::f16;
  if (a.dtype() == nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1})
    return mixprec::DType::bf16;
  throw nb::type_error((what + ": expected float32, float16 or bfloat16").c_str());
}

template <class T>
T parsed(std::optional<T> v, std::string_view s, const char* what, const std::string& allowed) {
  if (!v) throw nb::value_error((std::string(what) + ": expected one of " + allowed + ", found '" + std::string(s) + "'").c_str());
  return *v;
}

mixprec::StateFormats formats_of(std::string_view master, std::string_view m, std::string_view v, std::size_t block,
                                 bool fp8_per_tensor, std::string_view rule) {
  mixprec::StateFormats f;
  f.master = parsed(mixprec::parse_master_format(master), master, "master", mixprec::master_format_names());
  f.m = parsed(mixprec::parse_moment_format(m), m, "moments (m)", mixprec::moment_format_names());
  f.v = parsed(mixprec::parse_moment_format(v), v, "moments (v)", mixprec::moment_format_names());
  f.block = block;
  f.fp8_per_tensor = fp8_per_tensor;
  f.rule = parsed(mixprec::parse_adam_rule(rule), rule, "rule", "torch, torchao, te");
  mixprec::validate(f);
  return f;
}

// The moment's storage: `codes` of exactly code_bytes() bytes, `scales` float32 of scale_count().
mixprec::MomentView moment_view(const mixprec::MomentLayout& l, nb::handle codes, nb::handle scales, const char* name,
                                std::vector<Array>& keep) {
  mixprec::MomentView mv;
  mv.layout = l;
  Array c = cpu_array<Array>(codes, std::string(name) + " codes");
  const std::size_t bytes = c.size() * c.itemsize();
  if (bytes != l.code_bytes())
    throw nb::value_error((std::string(name) + " codes: expected " + std::to_string(l.code_bytes()) + " bytes, found " +
                           std::to_string(bytes)).c_str());
  mv.codes = c.size() ? c.data() : nullptr;
  keep.push_back(std::move(c));
  if (l.scale_count() > 0) {
    Array s = cpu_array<Array>(scales, std::string(name) + " scales");
    if (s.dtype() != nb::dtype<float>() || s.size() != l.scale_count())
      throw nb::value_error((std::string(name) + " scales: expected " + std::to_string(l.scale_count()) +
                             " float32 values, found " + std::to_string(s.size())).c_str());
    mv.scales = static_cast<float*>(s.data());
    keep.push_back(std::move(s));
  }
  return mv;
}

}  // namespace

namespace mixprec_python {

void register_optim(nb::module_& m) {
  m.def("master_format_names", [] { return mixprec::master_format_names(); });
  m.def("moment_format_names", [] { return mixprec::moment_format_names(); });

  // (format after torchao's fallback, per_tensor, code_bytes, scale_count)
  m.def(
      "moment_layout",
      [](std::string_view format, bool is_signed, std::size_t numel, std::size_t block, bool fp8_per_tensor) {
        const mixprec::StateFormats f = formats_of("fp32", format, format, block, fp8_per_tensor, "torch");
        const mixprec::MomentLayout l = mixprec::moment_layout(f.m, is_signed, numel, f);
        return nb::make_tuple(std::string(mixprec::moment_format_name(l.format)), l.per_tensor, l.code_bytes(),
                              l.scale_count());
      },
      nb::arg("format"), nb::arg("is_signed"), nb::arg("numel"), nb::arg("block") = 0, nb::arg("fp8_per_tensor") = false);

  m.def(
      "state_bytes_per_param",
      [](std::string_view master, std::string_view mf, std::string_view vf, std::size_t block, bool fp8_per_tensor) {
        const mixprec::StateBytes b = mixprec::state_bytes_per_param(formats_of(master, mf, vf, block, fp8_per_tensor, "torch"));
        return nb::make_tuple(b.master, b.m, b.v);
      },
      nb::arg("master"), nb::arg("m"), nb::arg("v"), nb::arg("block") = 0, nb::arg("fp8_per_tensor") = false);

  m.def("moment_code_map", [](std::string_view format, bool is_signed) {
    const mixprec::StateFormats f = formats_of("fp32", format, format, 0, false, "torch");
    nb::list out;
    for (float x : mixprec::moment_code_map(f.m, is_signed)) out.append(x);
    return out;
  });

  // Quantize float32 `x` (numel values) into codes + scales, or dequantize them into `x`.
  auto codec = [](bool quantize) {
    return [quantize](nb::handle x, std::string_view format, bool is_signed, std::size_t block, bool fp8_per_tensor,
                      nb::handle codes, nb::handle scales) {
      const mixprec::StateFormats f = formats_of("fp32", format, format, block, fp8_per_tensor, "torch");
      Array xs = cpu_array<Array>(x, "x");
      if (xs.dtype() != nb::dtype<float>()) throw nb::type_error("x: expected float32");
      const mixprec::MomentLayout l = mixprec::moment_layout(f.m, is_signed, xs.size(), f);
      std::vector<Array> keep;
      const mixprec::MomentView mv = moment_view(l, codes, scales, "state", keep);
      nb::gil_scoped_release unlocked;
      if (quantize) mixprec::quantize_moment(static_cast<const float*>(xs.data()), mv);
      else mixprec::dequantize_moment(mv, static_cast<float*>(xs.data()));
    };
  };
  m.def("quantize_moment", codec(true), nb::arg("x"), nb::arg("format"), nb::arg("is_signed"), nb::arg("block"),
        nb::arg("fp8_per_tensor"), nb::arg("codes"), nb::arg("scales").none());
  m.def("dequantize_moment", codec(false), nb::arg("x"), nb::arg("format"), nb::arg("is_signed"), nb::arg("block"),
        nb::arg("fp8_per_tensor"), nb::arg("codes"), nb::arg("scales").none());

  m.def(
      "split_master",
      [](nb::handle master, nb::handle weight, nb::handle remainder) {
        Array p = cpu_array<Array>(master, "master"), w = cpu_array<Array>(weight, "weight"),
              r = cpu_array<Array>(remainder, "remainder");
        if (p.dtype() != nb::dtype<float>() || float_dtype(w, "weight") != mixprec::DType::bf16 ||
            r.dtype() != nb::dtype<std::int16_t>() || w.size() != p.size() || r.size() != p.size())
          throw nb::value_error("split_master: expected float32 master, bfloat16 weight and int16 remainder of one size");
        mixprec::split_master(static_cast<const float*>(p.data()), static_cast<std::uint16_t*>(w.data()),
                              static_cast<std::int16_t*>(r.data()), p.size());
      },
      nb::arg("master"), nb::arg("weight"), nb::arg("remainder"));
  m.def(
      "join_master",
      [](nb::handle weight, nb::handle remainder, nb::handle master) {
        Array p = cpu_array<Array>(master, "master"), w = cpu_array<Array>(weight, "weight"),
              r = cpu_array<Array>(remainder, "remainder");
        if (p.dtype() != nb::dtype<float>() || float_dtype(w, "weight") != mixprec::DType::bf16 ||
            r.dtype() != nb::dtype<std::int16_t>() || w.size() != p.size() || r.size() != p.size())
          throw nb::value_error("join_master: expected bfloat16 weight, int16 remainder and float32 master of one size");
        mixprec::join_master(static_cast<const std::uint16_t*>(w.data()), static_cast<const std::int16_t*>(r.data()),
                             static_cast<float*>(p.data()), p.size());
      },
      nb::arg("weight"), nb::arg("remainder"), nb::arg("master"));

  // The fused step of one tensor, in place. Everything is checked before anything is written.
  // threads: the workers its pieces split over (the caller passes torch.get_num_threads()).
  m.def(
      "adam_tensor_step",
      [](nb::handle weight, nb::handle grad, std::string_view master, nb::handle master_buf, std::string_view mf,
         nb::handle m_codes, nb::handle m_scales, std::string_view vf, nb::handle v_codes, nb::handle v_scales,
         std::size_t block, bool fp8_per_tensor, std::string_view rule, double lr, double beta1, double beta2,
         double eps, double weight_decay, bool decoupled, std::int64_t step, float inv_scale, float clip_coef,
         bool stochastic, std::uint64_t seed, std::uint64_t first_index, bool want_stats,
         unsigned threads) -> nb::object {
        const mixprec::StateFormats f = formats_of(master, mf, vf, block, fp8_per_tensor, rule);
        std::vector<Array> keep;
        Array w = cpu_array<Array>(weight, "weight");
        RoArray g;
        if (!nb::try_cast(grad, g, false) || g.device_type() != nb::device::cpu::value)
          throw nb::type_error("grad: expected a CPU tensor (DLPack)");
        mixprec::AdamTensor t;
        t.n = w.size();
        if (g.size() != t.n)
          throw nb::value_error(("grad: expected " + std::to_string(t.n) + " elements, found " + std::to_string(g.size())).c_str());
        t.weight_dtype = float_dtype(w, "weight");
        t.weight = w.size() ? w.data() : nullptr;
        t.grad_dtype = float_dtype(g, "grad");
        t.grad = g.size() ? g.data() : nullptr;
        t.master = f.master;
        if (!master_buf.is_none()) {
          Array mb = cpu_array<Array>(master_buf, "master");
          if (mb.size() != t.n)
            throw nb::value_error(("master: expected " + std::to_string(t.n) + " elements, found " + std::to_string(mb.size())).c_str());
          if (f.master == mixprec::MasterFormat::remainder) {
            if (mb.dtype() != nb::dtype<std::int16_t>()) throw nb::type_error("master: expected int16 remainders");
            t.remainder = static_cast<std::int16_t*>(mb.data());
          } else {
            if (mb.dtype() != nb::dtype<float>()) throw nb::type_error("master: expected float32");
            t.master_f32 = static_cast<float*>(mb.data());
          }
          keep.push_back(std::move(mb));
        }
        t.m = moment_view(mixprec::moment_layout(f.m, true, t.n, f), m_codes, m_scales, "exp_avg", keep);
        t.v = moment_view(mixprec::moment_layout(f.v, false, t.n, f), v_codes, v_scales, "exp_avg_sq", keep);
        t.first_index = first_index;
        mixprec::AdamStepArgs a;
        a.hyper = mixprec::AdamHyper{lr, beta1, beta2, eps, weight_decay, decoupled};
        a.step = step;
        a.inv_scale = inv_scale;
        a.clip_coef = clip_coef;
        a.rule = f.rule;
        a.stochastic = stochastic;
        a.seed = seed;
        mixprec::validate(t, a);
        mixprec::AdamStepStats st;
        {
          nb::gil_scoped_release unlocked;
          mixprec::adam_tensor_step(t, a, mixprec::active_isa(), want_stats ? &st : nullptr,
                                    mixprec::ThreadPool::of_size(threads));
        }
        if (!want_stats) return nb::none();
        // (m_err_sq, m_sq, v_err_sq, v_sq, meant, lost): AdamStepStats's sums
        return nb::make_tuple(st.m_err_sq, st.m_sq, st.v_err_sq, st.v_sq, st.meant, st.lost);
      },
      nb::arg("weight"), nb::arg("grad"), nb::arg("master"), nb::arg("master_buf").none(), nb::arg("m"),
      nb::arg("m_codes"), nb::arg("m_scales").none(), nb::arg("v"), nb::arg("v_codes"), nb::arg("v_scales").none(),
      nb::arg("block"), nb::arg("fp8_per_tensor"), nb::arg("rule"), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"),
      nb::arg("eps"), nb::arg("weight_decay"), nb::arg("decoupled"), nb::arg("step"), nb::arg("inv_scale"),
      nb::arg("clip_coef"), nb::arg("stochastic"), nb::arg("seed"), nb::arg("first_index"), nb::arg("stats") = false,
      nb::arg("threads") = 1);
}

}  // namespace mixprec_python
