// mixprec::torch::AdamW: the core's fused AdamW step (optim/state_format.hpp) over libtorch
// parameters and state tensors; the state and the checkpoint keys are Python's
// mixprec.torch.optim.AdamW's. This file checks, allocates and points: no arithmetic of its own.
#include "mixprec/torch/optim.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "dtype.hpp"
#include "mixprec/core/parallel.hpp"

namespace mixprec::torch {
namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument("AdamW: " + message); }

std::string num(double x) {
  std::ostringstream os;
  os << std::setprecision(9) << x;
  return os.str();
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kByte: return "uint8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

void check_real(const char* name, double x) {
  if (!(std::isfinite(x) && x >= 0)) fail(std::string(name) + ": expected a finite number >= 0, found " + num(x));
}

// The dtype a moment's codes are stored in: the plain formats as torch tensors shaped as the
// parameter, the coded ones as bytes.
std::optional<at::ScalarType> plain_dtype(MomentFormat f) {
  switch (f) {
    case MomentFormat::fp32: return at::kFloat;
    case MomentFormat::bf16: return at::kBFloat16;
    case MomentFormat::fp16: return at::kHalf;
    default: return std::nullopt;
  }
}

MomentLayout layout_of(MomentFormat f, bool is_signed, const at::Tensor& p, const StateFormats& formats) {
  return moment_layout(f, is_signed, static_cast<std::size_t>(p.numel()), formats);
}

MomentView view_of(const MomentLayout& l, const at::Tensor& codes, const at::Tensor& scales) {
  MomentView mv;
  mv.layout = l;
  mv.codes = codes.numel() > 0 ? codes.data_ptr() : nullptr;
  mv.scales = l.scale_count() > 0 ? scales.data_ptr<float>() : nullptr;
  return mv;
}

MasterFormat master_kind(const at::Tensor& p, MasterFormat master) {
  return p.scalar_type() == at::kFloat ? MasterFormat::fp32 : master;  // fp32 weights are their own master
}

// The formats in the checkpoint: names as uint8 bytes, numbers and flags as 0-dim tensors.
at::Tensor text(std::string_view s) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

// A format entry as a message shows it (and as load_state_dict compares it).
std::string shown(const at::Tensor& x) {
  if (!x.defined()) return "nothing";
  const at::Tensor c = x.detach().to(at::kCPU).contiguous();
  if (c.scalar_type() == at::kByte && c.dim() == 1)
    return "'" + std::string(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel())) + "'";
  if (c.scalar_type() == at::kLong && c.numel() == 1) return std::to_string(c.item<std::int64_t>());
  if (c.scalar_type() == at::kBool && c.numel() == 1) return c.item<bool>() ? "true" : "false";
  return "a " + dtype_name(c.scalar_type()) + " tensor of " + std::to_string(c.numel()) + " elements";
}

std::string described(const at::Tensor& x) {
  if (!x.defined()) return "nothing";
  return "a " + dtype_name(x.scalar_type()) + " tensor of " + std::to_string(x.numel()) + " elements";
}

constexpr const char* kFormatKeys[] = {"master", "moments", "block", "fp8_per_tensor", "rule", "stochastic_rounding",
                                       "seed"};
constexpr std::string_view kGroup = "param_groups.0.";
constexpr std::string_view kState = "state.";

std::map<std::string, at::Tensor> format_entries(const AdamWOptions& o) {
  std::map<std::string, at::Tensor> out;
  const std::string g(kGroup);
  out[g + "master"] = text(master_format_name(o.master));
  out[g + "moments"] = text(std::string(moment_format_name(o.m)) + "," + std::string(moment_format_name(o.v)));
  out[g + "block"] = at::scalar_tensor(static_cast<std::int64_t>(o.block), at::kLong);
  out[g + "fp8_per_tensor"] = at::scalar_tensor(o.fp8_per_tensor, at::kBool);
  out[g + "rule"] = text(adam_rule_name(o.rule));
  out[g + "stochastic_rounding"] = at::scalar_tensor(o.stochastic_rounding, at::kBool);
  out[g + "seed"] = at::scalar_tensor(static_cast<std::int64_t>(o.seed), at::kLong);  // the seed's bits
  return out;
}

}  // namespace

AdamW::AdamW(std::vector<at::Tensor> params, const AdamWOptions& options) : params_(std::move(params)), options_(options) {
  const AdamWOptions& o = options_;
  check_real("lr", o.lr);
  check_real("eps", o.eps);
  check_real("weight_decay", o.weight_decay);
  if (!(o.betas.first >= 0 && o.betas.first < 1))
    fail("betas.first: expected a number in [0, 1), found " + num(o.betas.first));
  if (!(o.betas.second >= 0 && o.betas.second < 1))
    fail("betas.second: expected a number in [0, 1), found " + num(o.betas.second));
  if (o.master > MasterFormat::none)
    fail("master: expected one of " + master_format_names() + ", found " + std::to_string(static_cast<int>(o.master)));
  if (o.m > MomentFormat::q4)
    fail("m: expected one of " + moment_format_names() + ", found " + std::to_string(static_cast<int>(o.m)));
  if (o.v > MomentFormat::q4)
    fail("v: expected one of " + moment_format_names() + ", found " + std::to_string(static_cast<int>(o.v)));
  if (o.rule > AdamRule::te)
    fail("rule: expected one of torch, torchao, te, found " + std::to_string(static_cast<int>(o.rule)));
  try {
    validate(o.formats());
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  if (o.stochastic_rounding && o.master != MasterFormat::none)
    fail("stochastic_rounding: expected master none (the 16-bit weights are the only copy), found master " +
         std::string(master_format_name(o.master)));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const std::string where = "params[" + std::to_string(i) + "]";
    if (!p.defined()) fail(where + ": expected a defined tensor, found an undefined one");
    if (!detail::mixprec_dtype(p.scalar_type()))
      fail(where + ": expected a float32, float16 or bfloat16 parameter, found " + dtype_name(p.scalar_type()));
    if (p.device().type() != at::kCPU)
      fail(where + ": expected a CPU parameter (the fused step runs in the CPU core), found " + p.device().str());
    if (p.layout() != at::kStrided || !p.is_contiguous())
      fail(where + ": expected a contiguous parameter (the step writes it in place), found a non-contiguous one");
    if (o.master == MasterFormat::remainder && p.scalar_type() == at::kHalf)
      fail(where + ": master remainder expected bfloat16 (or float32) parameters, found float16");
    if (o.stochastic_rounding && p.scalar_type() == at::kFloat)
      fail(where + ": stochastic_rounding expected 16-bit parameters, found float32");
    for (std::size_t j = 0; j < i; ++j)
      if (params_[j].is_same(p) || (p.numel() > 0 && params_[j].numel() > 0 && params_[j].data_ptr() == p.data_ptr()))
        fail(where + ": expected distinct parameters, found the memory of params[" + std::to_string(j) + "] again");
  }
  state_.resize(params_.size());
}

void AdamW::set_lr(double lr) {
  check_real("lr", lr);
  options_.lr = lr;
}

std::map<std::string, at::Tensor> AdamW::init_state(std::size_t i) const {
  const at::Tensor p = params_[i].detach();
  const StateFormats f = options_.formats();
  std::map<std::string, at::Tensor> st;
  st["step"] = at::zeros({}, at::kFloat);
  auto moment = [&](const char* name, MomentFormat fmt, bool is_signed) {
    const MomentLayout l = layout_of(fmt, is_signed, p, f);
    const auto plain = plain_dtype(l.format);
    st[name] = plain ? at::zeros(p.sizes(), *plain) : at::zeros({static_cast<std::int64_t>(l.code_bytes())}, at::kByte);
    st[std::string(name) + "_scale"] = at::zeros({static_cast<std::int64_t>(l.scale_count())}, at::kFloat);
  };
  moment("exp_avg", options_.m, true);
  moment("exp_avg_sq", options_.v, false);
  const MasterFormat kind = master_kind(p, options_.master);
  if (kind == MasterFormat::fp32 && p.scalar_type() != at::kFloat) st["master"] = p.to(at::kFloat).contiguous();
  if (kind == MasterFormat::remainder) st["master_remainder"] = at::zeros(p.sizes(), at::kShort);  // the bf16 weight exactly
  return st;
}

void AdamW::step(float inv_scale, bool skip) {
  if (skip) return;  // the scaler found inf/NaN: nothing is written, the step counts stay
  const StateFormats f = options_.formats();
  struct Work {
    std::size_t i = 0;
    at::Tensor grad;
    std::map<std::string, at::Tensor> fresh;  // state created by this step, kept only if every check passes
    AdamTensor t;
    AdamStepArgs a;
  };
  std::vector<Work> work;
  work.reserve(params_.size());
  std::uint64_t first_index = 0;  // stochastic rounding: element indices count all parameters in order
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const auto n = static_cast<std::uint64_t>(p.numel());
    const at::Tensor& g0 = p.grad();
    if (!g0.defined()) {
      first_index += n;
      continue;
    }
    const std::string where = "params[" + std::to_string(i) + "].grad()";
    if (g0.layout() != at::kStrided) fail(where + ": expected a dense gradient, found layout " + c10::str(g0.layout()));
    if (g0.device().type() != at::kCPU) fail(where + ": expected a CPU gradient, found " + g0.device().str());
    const auto gdt = detail::mixprec_dtype(g0.scalar_type());
    if (!gdt) fail(where + ": expected float32, float16 or bfloat16, found " + dtype_name(g0.scalar_type()));
    if (static_cast<std::uint64_t>(g0.numel()) != n)
      fail(where + ": expected " + std::to_string(n) + " elements, found " + std::to_string(g0.numel()));
    Work w;
    w.i = i;
    w.grad = g0.detach().contiguous();
    if (state_[i].empty()) w.fresh = init_state(i);
    const auto& st = state_[i].empty() ? w.fresh : state_[i];
    AdamTensor& t = w.t;
    t.n = static_cast<std::size_t>(n);
    t.grad_dtype = *gdt;
    t.grad = n ? w.grad.data_ptr() : nullptr;
    t.weight_dtype = *detail::mixprec_dtype(p.scalar_type());
    t.weight = n ? p.data_ptr() : nullptr;
    t.master = master_kind(p, options_.master);
    if (auto it = st.find("master"); it != st.end()) t.master_f32 = it->second.data_ptr<float>();
    if (auto it = st.find("master_remainder"); it != st.end()) t.remainder = it->second.data_ptr<std::int16_t>();
    t.m = view_of(layout_of(options_.m, true, p, f), st.at("exp_avg"), st.at("exp_avg_scale"));
    t.v = view_of(layout_of(options_.v, false, p, f), st.at("exp_avg_sq"), st.at("exp_avg_sq_scale"));
    t.first_index = first_index;
    AdamStepArgs& a = w.a;
    a.hyper = AdamHyper{options_.lr, options_.betas.first, options_.betas.second, options_.eps, options_.weight_decay,
                        options_.decoupled};
    a.step = static_cast<std::int64_t>(st.at("step").item<float>()) + 1;
    a.inv_scale = inv_scale;
    a.rule = options_.rule;
    a.stochastic = options_.stochastic_rounding;
    a.seed = options_.seed;
    try {
      validate(t, a);
    } catch (const std::invalid_argument& e) {
      fail("params[" + std::to_string(i) + "]: " + e.what());
    }
    work.push_back(std::move(w));
    first_index += n;
  }
  // The pieces of each tensor split over ATen's intra-op threads, as the Python door splits them
  // over torch.get_num_threads() (the bits do not depend on the count).
  ThreadPool* pool = ThreadPool::of_size(static_cast<unsigned>(std::max(1, at::get_num_threads())));
  for (Work& w : work) {
    if (!w.fresh.empty()) state_[w.i] = std::move(w.fresh);  // the tensors the views point into move along
    adam_tensor_step(w.t, w.a, active_isa(), nullptr, pool);
    state_[w.i].at("step").add_(1);
  }
}

void AdamW::zero_grad() {
  for (at::Tensor& p : params_)
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

const std::map<std::string, at::Tensor>& AdamW::state(std::size_t i) const {
  if (i >= params_.size())
    fail("state: i: expected an index below " + std::to_string(params_.size()) + ", found " + std::to_string(i));
  return state_[i];
}

at::Tensor AdamW::master_weights(std::size_t i) const {
  if (i >= params_.size())
    fail("master_weights: i: expected an index below " + std::to_string(params_.size()) + ", found " +
         std::to_string(i));
  const at::Tensor p = params_[i].detach();
  const auto& st = state_[i];
  if (auto it = st.find("master"); it != st.end()) return it->second.clone();
  if (auto it = st.find("master_remainder"); it != st.end()) {
    at::Tensor out = at::empty(p.sizes(), at::kFloat);
    join_master(static_cast<const std::uint16_t*>(p.data_ptr()), it->second.data_ptr<std::int16_t>(),
                out.data_ptr<float>(), static_cast<std::size_t>(p.numel()));
    return out;
  }
  return p.to(at::kFloat).clone();
}

AdamWStateBytes AdamW::state_bytes() const {
  AdamWStateBytes b;
  auto bytes = [](const at::Tensor& x) { return static_cast<std::uint64_t>(x.numel()) * x.element_size(); };
  for (std::size_t i = 0; i < params_.size(); ++i) {
    b.params += bytes(params_[i]);
    for (const auto& [key, x] : state_[i]) {
      if (key == "master" || key == "master_remainder") b.master += bytes(x);
      else if (key.starts_with("exp_avg_sq")) b.v += bytes(x);
      else if (key.starts_with("exp_avg")) b.m += bytes(x);
    }
  }
  return b;
}

AdamW::StateDict AdamW::state_dict() const {
  StateDict sd = format_entries(options_);
  for (std::size_t i = 0; i < params_.size(); ++i)
    for (const auto& [key, x] : state_[i]) sd["state." + std::to_string(i) + "." + key] = x.clone();
  return sd;
}

void AdamW::load_state_dict(const StateDict& sd) {
  const std::string prefix = "load_state_dict: ";
  for (const auto& [key, want] : format_entries(options_)) {  // fixed order: the first mismatch is named
    const auto it = sd.find(key);
    const std::string found = it == sd.end() ? "nothing" : shown(it->second);
    if (found != shown(want))
      fail(prefix + key + ": expected " + shown(want) + " (this optimizer's formats), found " + found);
  }
  // Parameter index -> its saved tensors by name, every key accounted for.
  const auto formats = format_entries(options_);
  std::map<std::size_t, std::map<std::string, at::Tensor>> saved;
  for (const auto& [key, x] : sd) {
    if (formats.count(key)) continue;
    std::size_t i = 0;
    const std::string_view rest = std::string_view(key).substr(std::min(key.size(), kState.size()));
    const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), i);
    if (!key.starts_with(kState) || ec != std::errc{} || end == rest.data() || end == rest.data() + rest.size() ||
        *end != '.' || i >= params_.size())
      fail(prefix + "key '" + key + "': expected state.<i>.<name> with i below " + std::to_string(params_.size()) +
           ", or param_groups.0.<master|moments|block|fp8_per_tensor|rule|stochastic_rounding|seed>");
    saved[i][std::string(end + 1, rest.data() + rest.size())] = x;
  }
  // Everything is checked against the state this optimizer would create before anything changes.
  std::vector<std::map<std::string, at::Tensor>> next(params_.size());
  for (const auto& [i, tensors] : saved) {
    const auto like = init_state(i);
    const std::string base = prefix + "state." + std::to_string(i) + ".";
    for (const auto& [name, x] : tensors)
      if (!like.count(name))
        fail(base + name + ": expected no such tensor (parameter " + std::to_string(i) + " stores " +
             [&] {
               std::string names;
               for (const auto& [n, _] : like) names += (names.empty() ? "" : ", ") + n;
               return names;
             }() + "), found " + described(x));
    for (const auto& [name, want] : like) {
      const auto it = tensors.find(name);
      const at::Tensor x = it == tensors.end() ? at::Tensor() : it->second;
      if (!x.defined() || x.scalar_type() != want.scalar_type() || x.numel() != want.numel())
        fail(base + name + ": expected " + described(want) + ", found " + described(x));
      at::Tensor copy = x.detach().to(at::kCPU).reshape(want.sizes()).clone(at::MemoryFormat::Contiguous);
      if (name == "step") {
        const float s = copy.item<float>();
        if (!(std::isfinite(s) && s >= 0 && s == std::floor(s)))
          fail(base + name + ": expected a whole number >= 0, found " + num(s));
      }
      next[i][name] = std::move(copy);
    }
  }
  state_ = std::move(next);
}

}  // namespace mixprec::torch
