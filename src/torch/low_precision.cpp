// mixprec::torch::LowPrecisionLinear and LowPrecision (include/mixprec/torch/low_precision.hpp):
// the per-GEMM quantization of TE's recipes through the core's lowp::quantize, as a libtorch
// autograd function. The same GEMMs as python/mixprec/torch/low_precision.py.
#include "mixprec/torch/low_precision.hpp"

#include <ATen/autocast_mode.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "mixprec/lowp/scaling.hpp"

namespace mixprec::torch {

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

at::Tensor as_fp32_2d(const at::Tensor& t, std::int64_t cols) {
  return t.detach().reshape({-1, cols}).to(at::kFloat).contiguous();
}

int index_of(OperandRole r) { return static_cast<int>(r); }

class LowPrecisionFn : public ::torch::autograd::Function<LowPrecisionFn> {
 public:
  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, LowPrecisionLinearImpl* self) {
    const lowp::LinearRecipe& r = self->recipe();
    const std::int64_t k = x.size(-1);
    const at::Tensor x2 = as_fp32_2d(x, k);
    const at::Tensor w = weight.detach().to(at::kFloat).contiguous();
    const bool sample = self->sampling();
    const float sx = self->role_scale(OperandRole::x), sw = self->role_scale(OperandRole::w);
    lowp::QuantizeConfig cx = r.config(false, false, lowp::Layout::rowwise);
    lowp::QuantizeConfig cw = r.config(false, true, lowp::Layout::rowwise);
    if (r.recipe == lowp::Recipe::fp8_delayed) {
      cx.scale = sx;
      cw.scale = sw;
    }
    lowp::Quantized qx, qw;
    const at::Tensor xq = fake_quantize(x2, cx, {}, &qx);
    const at::Tensor wq = fake_quantize(w, cw, {}, &qw);
    self->record(OperandRole::x, qx, sx, sample ? x2 : at::Tensor(), xq);
    self->record(OperandRole::w, qw, sw, sample ? w : at::Tensor(), wq);
    at::Tensor y = at::matmul(xq, wq.t());
    if (bias.defined()) y = y + bias.detach().to(at::kFloat);
    // x's wgrad copy, kept for the backward (per-tensor scaling: the same values).
    const bool rht_x = r.rht && x2.size(0) % 16 == 0;
    at::Tensor xc = xq;
    if (!r.per_tensor()) {
      lowp::QuantizeConfig cc = r.config(false, false, lowp::Layout::columnwise);
      cc.rht = rht_x;
      xc = fake_quantize(x2, cc);
    }
    ctx->save_for_backward({xc});
    ctx->saved_data["self"] = reinterpret_cast<std::int64_t>(self);
    ctx->saved_data["sw"] = static_cast<double>(sw);
    ctx->saved_data["rht_x"] = rht_x;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<std::int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<std::int64_t>(weight.scalar_type());
    ctx->saved_data["has_bias"] = bias.defined();
    std::vector<std::int64_t> out_sizes = x.sizes().vec();
    out_sizes.back() = y.size(1);
    return y.to(x.scalar_type()).reshape(out_sizes);
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    auto* self = reinterpret_cast<LowPrecisionLinearImpl*>(ctx->saved_data["self"].toInt());
    const lowp::LinearRecipe& r = self->recipe();
    const at::Tensor xc = ctx->get_saved_variables()[0];
    const float sw = static_cast<float>(ctx->saved_data["sw"].toDouble());
    const bool rht_x = ctx->saved_data["rht_x"].toBool();
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    const at::Tensor dy2 = as_fp32_2d(grads[0], grads[0].size(-1));
    const at::Tensor w = self->weight.detach().to(at::kFloat).contiguous();
    const float sdy = self->role_scale(OperandRole::dy);
    lowp::QuantizeConfig cdy = r.config(true, false, lowp::Layout::rowwise);
    if (r.recipe == lowp::Recipe::fp8_delayed) cdy.scale = sdy;
    std::vector<std::uint32_t> random;
    if (r.stochastic_rounding) {
      random = self->random_words(static_cast<std::size_t>(dy2.numel()));
      cdy.stochastic_rounding = true;
    }
    lowp::Quantized qdy;
    const at::Tensor dyq = fake_quantize(dy2, cdy, random, &qdy);
    self->record(OperandRole::dy, qdy, sdy, self->sampling() ? dy2 : at::Tensor(), dyq);
    // dgrad: W along its output dimension, quantized again with the forward's scale.
    lowp::QuantizeConfig cwc = r.config(false, true, r.per_tensor() ? lowp::Layout::rowwise : lowp::Layout::columnwise);
    if (r.recipe == lowp::Recipe::fp8_delayed) cwc.scale = sw;
    const at::Tensor wc = fake_quantize(w, cwc);
    at::Tensor dx = at::matmul(dyq, wc).to(x_dtype).reshape(ctx->saved_data["x_sizes"].toIntVector());
    // wgrad: both operands along the batch, RHT on both or on neither.
    at::Tensor dyc = dyq;
    if (!r.per_tensor()) {
      lowp::QuantizeConfig cc = r.config(true, false, lowp::Layout::columnwise);
      cc.rht = rht_x && dy2.size(0) % 16 == 0;
      if (r.stochastic_rounding) {
        random = self->random_words(static_cast<std::size_t>(dy2.numel()));
        cc.stochastic_rounding = true;
      } else {
        random.clear();
      }
      dyc = fake_quantize(dy2, cc, random);
    }
    at::Tensor dw = at::matmul(dyc.t(), xc).to(w_dtype);
    at::Tensor db = ctx->saved_data["has_bias"].toBool() ? dy2.sum(0).to(w_dtype) : at::Tensor();
    self->end_sample();
    return {dx, dw, db, at::Tensor()};
  }
};

// splitmix64: the caller-supplied random words of stochastic rounding, a fixed stream per module.
std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

at::Tensor fake_quantize(const at::Tensor& t, const lowp::QuantizeConfig& config, std::span<const std::uint32_t> random,
                         lowp::Quantized* out) {
  if (t.dim() != 2) fail("fake_quantize: expected a 2-D tensor, found " + std::to_string(t.dim()) + " dimensions");
  if (t.device().type() != c10::DeviceType::CPU) fail("fake_quantize: expected a CPU tensor");
  const at::Tensor a = t.detach().to(at::kFloat).contiguous();
  const auto rows = static_cast<std::size_t>(a.size(0)), cols = static_cast<std::size_t>(a.size(1));
  lowp::Quantized q = lowp::quantize({a.data_ptr<float>(), rows * cols}, rows, cols, config, random);
  at::Tensor result = at::empty({a.size(0), a.size(1)}, at::kFloat);
  lowp::dequantize(q, {result.data_ptr<float>(), rows * cols});
  if (out != nullptr) *out = std::move(q);
  return result;
}

LowPrecisionLinearImpl::LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features,
                                               const lowp::LinearRecipe& recipe, bool with_bias, std::uint64_t seed)
    : recipe_(recipe), seed_(seed) {
  ::torch::nn::Linear lin(::torch::nn::LinearOptions(in_features, out_features).bias(with_bias));
  weight = register_parameter("weight", lin->weight);
  if (with_bias) bias = register_parameter("bias", lin->bias);
  init_buffers();
}

LowPrecisionLinearImpl::LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, const lowp::LinearRecipe& recipe,
                                               std::uint64_t seed)
    : recipe_(recipe), seed_(seed) {
  weight = register_parameter("weight", linear->weight);
  if (linear->bias.defined()) bias = register_parameter("bias", linear->bias);
  init_buffers();
}

void LowPrecisionLinearImpl::init_buffers() {
  lowp::resolve(lowp::RecipeChoice::of(recipe_.recipe));  // the recipe must be one of the table's
  if (recipe_.recipe == lowp::Recipe::fp8_delayed) {
    amax_history = register_buffer("amax_history", at::zeros({3, static_cast<std::int64_t>(recipe_.amax_history_len)}, at::kFloat));
    scale = register_buffer("scale", at::ones({3}, at::kFloat));
  }
}

at::Tensor LowPrecisionLinearImpl::forward(const at::Tensor& x) {
  at::autocast::set_autocast_enabled(at::kCPU, false);  // restored below: the GEMMs are ours
  struct Restore {
    bool cpu;
    ~Restore() { at::autocast::set_autocast_enabled(at::kCPU, cpu); }
  } restore{at::autocast::is_autocast_enabled(at::kCPU)};
  return LowPrecisionFn::apply(x, weight, bias, this);
}

float LowPrecisionLinearImpl::role_scale(OperandRole r) const {
  if (recipe_.recipe != lowp::Recipe::fp8_delayed) return 1.0f;
  return scale.data_ptr<float>()[index_of(r)];
}

void LowPrecisionLinearImpl::record(OperandRole r, const lowp::Quantized& q, float scale_used, const at::Tensor& exact,
                                    const at::Tensor& approx) {
  RoleStats& s = stats_[index_of(r)];
  s.amax = q.counts.amax;
  s.scale = recipe_.recipe == lowp::Recipe::fp8_delayed ? scale_used : q.tensor_scale;
  s.elements = q.counts.elements;
  s.saturated = q.counts.saturated;
  s.flushed = q.counts.flushed;
  s.nonfinite = q.counts.nonfinite;
  s.rel_rms_error.reset();
  if (exact.defined()) {
    const double den = exact.to(at::kDouble).norm().item<double>();
    const double num = (approx - exact).to(at::kDouble).norm().item<double>();
    s.rel_rms_error = den > 0 ? num / den : 0.0;
  }
  if (recipe_.recipe == lowp::Recipe::fp8_delayed && is_training()) {
    // TE's delayed scaling: this step's amax enters the history, the next scale comes from it.
    const int i = index_of(r);
    float* h = amax_history[i].data_ptr<float>();
    const std::span<float> hist(h, recipe_.amax_history_len);
    hist[0] = lowp::fold_amax(hist[0], q.counts.amax);
    const float chosen = lowp::roll_history(hist, recipe_.amax_compute_algo);
    const float fp8_max = lowp::max_finite(recipe_.element(r == OperandRole::dy));
    float* sc = scale.data_ptr<float>();
    sc[i] = lowp::delayed_scale(chosen, sc[i], fp8_max, recipe_.margin);
  }
}

std::vector<std::uint32_t> LowPrecisionLinearImpl::random_words(std::size_t n) {
  std::uint64_t state = seed_ * 0x100000001B3ull + draws_++;
  std::vector<std::uint32_t> r(n);
  for (auto& w : r) w = static_cast<std::uint32_t>(splitmix64(state) >> 32);
  return r;
}

// ---- LowPrecision ----------------------------------------------------------------------

LowPrecision LowPrecision::uniform(const lowp::LinearRecipe& recipe) {
  LowPrecision p;
  p.uniform_ = recipe;
  return p;
}

LowPrecision LowPrecision::uniform(std::string_view recipe_name) {
  const auto r = lowp::parse_recipe(recipe_name);
  if (!r) fail("recipe: expected one of " + lowp::recipe_names() + ", found '" + std::string(recipe_name) + "'");
  return uniform(*lowp::resolve(lowp::RecipeChoice::of(r)));
}

LowPrecision LowPrecision::from_assignment(lowp::Assignment assignment) {
  LowPrecision p;
  p.assignment_ = std::move(assignment);
  return p;
}

LowPrecision LowPrecision::from_file(const std::string& path) {
  try {
    return from_assignment(lowp::read_assignment(path));
  } catch (const std::runtime_error& e) {  // the file itself: missing, a FIFO, too large
    fail(std::string("recipe file: ") + e.what());
  }
}

std::optional<lowp::LinearRecipe> LowPrecision::recipe_for(std::string_view name, std::size_t index,
                                                           std::size_t count) const {
  if (uniform_) {
    if (index == 0 || index + 1 >= count) return std::nullopt;
    return uniform_;
  }
  for (const auto& [n, c] : assignment_.modules) {
    if (n == name) return lowp::resolve(c, assignment_.options);
  }
  return lowp::resolve(assignment_.default_choice, assignment_.options);
}

::torch::nn::AnyModule LowPrecision::linear(std::string_view name, std::size_t index, std::size_t count,
                                            std::int64_t in_features, std::int64_t out_features, bool bias,
                                            std::uint64_t seed) const {
  if (const auto r = recipe_for(name, index, count)) {
    return ::torch::nn::AnyModule(LowPrecisionLinear(in_features, out_features, *r, bias, seed));
  }
  return ::torch::nn::AnyModule(::torch::nn::Linear(::torch::nn::LinearOptions(in_features, out_features).bias(bias)));
}

void LowPrecision::check_names(const std::vector<std::string>& linear_names) const {
  for (const auto& [n, c] : assignment_.modules) {
    bool found = false;
    for (const auto& l : linear_names) found = found || l == n;
    if (!found) fail("recipe file: module '" + n + "': expected a Linear of the model, found no such Linear");
  }
}

}  // namespace mixprec::torch
