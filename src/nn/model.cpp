// Model configuration, validation and the factory (include/mixprec/nn/model.hpp).
#include "mixprec/nn/model.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

#include "engine.hpp"
#include "fp8_linear.hpp"
#include "mixprec/scaler/layerwise.hpp"
#include "model_impl.hpp"

namespace mixprec::nn {
namespace {

void check_range(const char* key, std::size_t v, std::size_t lo, std::size_t hi) {
  if (v < lo || v > hi) {
    throw std::invalid_argument(std::string(key) + ": expected an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], found " + std::to_string(v));
  }
}

}  // namespace

std::string_view model_kind_name(ModelKind k) noexcept { return k == ModelKind::gpt ? "gpt" : "mlp"; }

std::optional<ModelKind> parse_model_kind(std::string_view s) noexcept {
  if (s == "gpt") return ModelKind::gpt;
  if (s == "mlp") return ModelKind::mlp;
  return std::nullopt;
}

void validate(const ModelConfig& c) {
  check_range("vocab", c.vocab, 2, 1u << 20);
  check_range("context", c.context, 2, 4096);
  check_range("batch", c.batch, 1, 4096);
  if (c.kind == ModelKind::gpt) {
    check_range("layers", c.layers, 1, 64);
    check_range("channels", c.channels, 1, 4096);
    check_range("heads", c.heads, 1, c.channels);
    if (c.channels % c.heads != 0) {
      throw std::invalid_argument("heads: expected a divisor of channels (" + std::to_string(c.channels) +
                                  "), found " + std::to_string(c.heads));
    }
  } else {
    check_range("channels", c.channels, 1, 4096);
    check_range("depth", c.depth, 1, 64);
    check_range("hidden", c.hidden, 1, 16384);
    if (c.context * c.channels > (1u << 20)) {
      throw std::invalid_argument("context * channels: expected at most 1048576 input features for mlp, found " +
                                  std::to_string(c.context * c.channels));
    }
  }
}

std::unique_ptr<Model> make_model(const ModelConfig& config, Precision precision, unsigned state_slots,
                                  const Fp8Config& fp8) {
  return make_model(config, precision, ModelOptions{.state_slots = state_slots, .fp8 = fp8});
}

std::vector<std::string> quantized_linear_names(const ModelConfig& c) {
  std::vector<std::string> names;
  if (c.kind == ModelKind::gpt) {
    for (std::size_t l = 0; l < c.layers; ++l) {
      const std::string h = std::string("h").append(std::to_string(l)).append(".");
      for (const char* n : {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}) names.push_back(h + n);
    }
  } else {
    for (std::size_t i = 0; i < c.depth; ++i) names.push_back(std::string("fc").append(std::to_string(i)));
  }
  return names;
}

namespace {

// The names quantized_linear_names gives, in words, for messages.
std::string linear_names_text(const ModelConfig& c) {
  if (c.kind == ModelKind::gpt)
    return "h<L>.attn.qkv, h<L>.attn.proj, h<L>.mlp.fc or h<L>.mlp.proj with L from 0 to " +
           std::to_string(c.layers - 1);
  return "fc<I> with I from 0 to " + std::to_string(c.depth - 1);
}

[[noreturn]] void recipe_fail(const std::string& message) { throw std::invalid_argument(message); }

}  // namespace

void check_recipes(const lowp::Assignment& a, const ModelConfig& c, std::uint64_t total_steps) {
  const std::vector<std::string> names = quantized_linear_names(c);
  auto known = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  for (const auto& [name, entry] : a.modules)
    if (!known(name))
      recipe_fail("recipe file: modules[\"" + name + "\"]: expected a Linear of this model (" + linear_names_text(c) +
                  "), found \"" + name + "\"");
  for (std::size_t i = 0; i < a.schedule.size(); ++i) {
    for (std::size_t j = 0; j < a.schedule[i].modules.size(); ++j) {
      const std::string& pattern = a.schedule[i].modules[j];
      const bool hit = std::any_of(names.begin(), names.end(),
                                   [&](const std::string& n) { return lowp::module_matches(pattern, n); });
      if (!hit)
        recipe_fail("recipe file: schedule[" + std::to_string(i) + "].modules[" + std::to_string(j) +
                    "]: expected a name or pattern matching a Linear of this model (" + linear_names_text(c) +
                    "), found \"" + pattern + "\", which matches none");
    }
  }
  (void)a.phase_starts(total_steps);  // a fraction needs the run's length
  if (a.evaluation) {
    const lowp::LinearPlan e = lowp::plan(*a.evaluation, a.options);
    for (const auto& r : e.operands)
      if (r && r->recipe == lowp::Recipe::fp8_delayed)
        recipe_fail("recipe file: evaluation: expected a recipe other than fp8-delayed (its scales come from the amax "
                    "histories of training steps, which an evaluation forward does not record), found fp8-delayed");
  }
  // Every Linear's plan at every phase start, and one delayed-scaling config over them all.
  std::optional<lowp::DelayedScalingConfig> delayed;
  std::string delayed_where;
  for (const std::string& name : names) {
    for (const auto& [step, plan] : detail::recipe_timeline(a, name, total_steps)) {
      for (const auto& r : plan.operands) {
        if (!r || r->recipe != lowp::Recipe::fp8_delayed) continue;
        const lowp::DelayedScalingConfig d{r->margin, r->amax_history_len, r->amax_compute_algo, r->fp8_format};
        const std::string where = name + " from step " + std::to_string(step);
        if (delayed && !(*delayed == d)) {
          auto text = [](const lowp::DelayedScalingConfig& x) {
            return "amax_history_len " + std::to_string(x.amax_history_len) + ", amax_compute_algo " +
                   std::string(lowp::amax_algo_name(x.amax_compute_algo)) + ", margin " + std::to_string(x.margin) +
                   ", fp8_format " + std::string(lowp::format_key(x.format));
          };
          recipe_fail("recipe file: fp8-delayed: expected one set of options for every fp8-delayed Linear (the engine "
                      "keeps one amax-history config), found " + text(*delayed) + " (" + delayed_where + ") and " +
                      text(d) + " (" + where + ")");
        }
        delayed = d;
        delayed_where = where;
      }
    }
  }
}

std::unique_ptr<Model> make_model(const ModelConfig& config, Precision precision, const ModelOptions& options) {
  validate(config);
  PrecisionPolicy p = policy_of(precision);
  p.master = p.master && options.master_weights;
  const std::optional<QuantizedGemms> gemms = quantized_gemms_of(precision);
  const Fp8Config& fp8 = options.fp8;
  std::unique_ptr<detail::Fp8Linears> linears;
  if (options.recipes) {
    if (!gemms)
      throw std::invalid_argument("precision: expected a quantized preset with a recipe file (it gives the rest of the "
                                  "model's precision), found " + std::string(precision_name(precision)));
    check_recipes(*options.recipes, config, options.recipe_steps);
    linears = std::make_unique<detail::Fp8Linears>(options.recipes, options.recipe_steps);
  } else if (gemms) {
    if (gemms->delayed_scaling())
      lowp::validate(lowp::DelayedScalingConfig{fp8.margin, fp8.amax_history_len, fp8.amax_compute_algo, fp8.format});
    linears = std::make_unique<detail::Fp8Linears>(*gemms, fp8);
  }
  return config.kind == ModelKind::gpt
             ? detail::make_gpt(config, p, options.state_slots, options.formats, std::move(linears))
             : detail::make_mlp(config, p, options.state_slots, options.formats, std::move(linears));
}

void Model::scaled_layer(std::string name, std::int64_t fan_in, std::vector<std::size_t> params) {
  scaled_layers_.push_back({std::move(name), fan_in, std::move(params)});
}

void Model::set_layer_scales(LayerwiseScales* scales, bool decide) {
  if (scales != layer_scales_ && scales != nullptr) {
    scaled_index_.clear();
    for (const ScaledLayer& l : scaled_layers_) scaled_index_.push_back(scales->add_layer(l.name, l.fan_in));
  }
  layer_scales_ = scales;
  decide_ = decide;
  if (decide || grad_factors_.size() != store_->tensor_count()) grad_factors_.assign(store_->tensor_count(), 1.0);
}

double Model::scale_layer(std::size_t slot, std::span<float> g, std::span<const float> w, double chain) {
  if (layer_scales_ == nullptr) return 1.0;
  const std::size_t i = scaled_index_.at(slot);
  const TensorMoments gm = moments_of(g);
  double f = 1.0;
  if (decide_) {
    f = layer_scales_->decide(i, gm, moments_of(w), chain);
  } else {
    f = layer_scales_->keep(i, gm.finite);
  }
  for (std::size_t t : scaled_layers_[slot].params) grad_factors_[t] = chain * f;
  rescale(g, f);
  return f;
}

void Model::mark_grad_factor(std::size_t tensor, double factor) noexcept {
  if (layer_scales_ != nullptr) grad_factors_[tensor] = factor;
}

void Model::rescale(std::span<float> v, double f) noexcept {
  if (f == 1.0) return;
  const float k = static_cast<float>(f);
  for (float& x : v) x *= k;
}

std::span<const Fp8TensorStats> Model::fp8_stats() const noexcept {
  const detail::Fp8Linears* f = fp8_linears();
  return f == nullptr ? std::span<const Fp8TensorStats>{} : f->stats();
}

void Model::fp8_step_done(const std::function<void(std::span<float>)>& reduce_amaxes) {
  detail::Fp8Linears* f = fp8_linears();
  if (f == nullptr) return;
  if (lowp::DelayedScaling* d = f->delayed(); d != nullptr && reduce_amaxes) {
    std::vector<float> amaxes = d->current_amaxes();
    reduce_amaxes(amaxes);
    d->set_current_amaxes(amaxes);
  }
  f->step_done();
}

bool Model::set_recipe_step(std::uint64_t step) {
  detail::Fp8Linears* f = fp8_linears();
  return f != nullptr && f->set_step(step);
}

void Model::set_evaluation(bool on) noexcept {
  if (detail::Fp8Linears* f = fp8_linears()) f->set_evaluation(on);
}

const lowp::DelayedScaling* Model::fp8_delayed() const noexcept {
  detail::Fp8Linears* f = fp8_linears();
  return f == nullptr ? nullptr : f->delayed();
}

void Model::load_fp8_delayed(const lowp::DelayedScalingState& state) {
  check_fp8_delayed(state);  // throws unless this model has delayed scaling
  if (detail::Fp8Linears* f = fp8_linears()) {
    if (lowp::DelayedScaling* d = f->delayed()) d->load(state);
  }
}

void Model::check_fp8_delayed(const lowp::DelayedScalingState& state) const {
  detail::Fp8Linears* f = fp8_linears();
  const lowp::DelayedScaling* d = f == nullptr ? nullptr : f->delayed();
  if (d == nullptr) {
    throw std::invalid_argument(std::string("fp8 delayed-scaling state: expected none (this model's precision has "
                                            "no delayed scaling), found a state of ")
                                    .append(std::to_string(state.tensors.size()))
                                    .append(" tensors"));
  }
  const lowp::DelayedScalingState& have = d->state();
  const lowp::DelayedScalingConfig& a = have.config;
  const lowp::DelayedScalingConfig& b = state.config;
  if (!(a == b)) {
    auto text = [](const lowp::DelayedScalingConfig& c) {
      return std::string("margin ").append(std::to_string(c.margin)).append(", amax history ")
          .append(std::to_string(c.amax_history_len)).append(", algorithm ")
          .append(lowp::amax_algo_name(c.amax_compute_algo)).append(", format ").append(lowp::format_name(c.format));
    };
    throw std::invalid_argument("fp8 delayed-scaling config: expected " + text(a) + ", found " + text(b));
  }
  if (state.tensors.size() != have.tensors.size()) {
    throw std::invalid_argument("fp8 delayed-scaling state: expected " + std::to_string(have.tensors.size()) +
                                " tensors, found " + std::to_string(state.tensors.size()));
  }
  for (std::size_t i = 0; i < state.tensors.size(); ++i) {
    const lowp::DelayedTensorState& x = have.tensors[i];
    const lowp::DelayedTensorState& y = state.tensors[i];
    if (x.name != y.name || x.role != y.role) {
      throw std::invalid_argument("fp8 delayed-scaling state: tensor " + std::to_string(i) + ": expected " + x.name +
                                  " (" + std::string(lowp::role_name(x.role)) + "), found " + y.name + " (" +
                                  std::string(lowp::role_name(y.role)) + ")");
    }
    if (y.amax_history.size() != x.amax_history.size()) {
      throw std::invalid_argument("fp8 delayed-scaling state: tensor " + y.name + ": expected an amax history of " +
                                  std::to_string(x.amax_history.size()) + " values, found " +
                                  std::to_string(y.amax_history.size()));
    }
  }
  lowp::validate(state);
}

std::size_t Model::grad_label(std::string name) {
  stats_.tensors.push_back({std::move(name), {}, 0.0f});
  return stats_.tensors.size() - 1;
}

void Model::reset_stats() noexcept {
  if (detail::Fp8Linears* f = fp8_linears()) f->reset_stats();
  stats_.activation_grads = {};
  stats_.first_overflow.clear();
  stats_.stores = 0;
  stats_.amax = 0;
  for (TensorGradStats& t : stats_.tensors) {
    t.stats = {};
    t.amax = 0;
  }
}

void Model::set_histograms(bool on) noexcept {
  histograms_on_ = on;
  // The histogram steps are the engine's sampled steps of the quantized tensors too.
  if (detail::Fp8Linears* f = fp8_linears()) f->set_sampled(on);
  if (on) {
    histograms_.activations.clear();
    histograms_.activation_grads.clear();
  }
  histograms_changed();
}

void Log2Histogram::add(std::span<const float> values, std::size_t stride) noexcept {
  for (std::size_t i = 0; i < values.size(); i += stride) {
    const float x = values[i];
    const std::uint32_t bits = std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
    if (bits == 0) {
      ++zeros;
      continue;
    }
    const int field = static_cast<int>(bits >> 23);
    if (field == 0xff) {
      ++nonfinite;
      continue;
    }
    // floor(log2|x|): the exponent field, or for subnormals the top set mantissa bit.
    const int e = field != 0 ? field - 127 : -127 - std::countl_zero(bits << 9);
    const int bin = std::clamp(e, kMinExp, kMaxExp) - kMinExp;
    ++counts[static_cast<std::size_t>(bin)];
  }
}

void Log2Histogram::clear() noexcept {
  std::fill(counts.begin(), counts.end(), 0);
  zeros = nonfinite = 0;
}

std::uint64_t Log2Histogram::total() const noexcept {
  std::uint64_t t = zeros + nonfinite;
  for (std::uint64_t c : counts) t += c;
  return t;
}

std::uint64_t Model::gemm_flops() const noexcept { return engine().gemm_flops(); }

std::uint64_t attention_flops(const ModelConfig& c) noexcept {
  if (c.kind != ModelKind::gpt) return 0;
  return std::uint64_t{12} * c.layers * c.batch * c.context * c.context * c.channels;
}

void Model::set_fault(const std::string& name, bool backward) {
  detail::Engine& e = engine();
  if (name.empty()) {
    e.set_fault(detail::Engine::kNoFault, detail::Engine::kNoFault);
    return;
  }
  std::vector<std::string> names;
  if (backward) {
    for (std::size_t i = 0; i < stats_.tensors.size(); ++i) {
      if (stats_.tensors[i].name == name) {
        e.set_fault(detail::Engine::kNoFault, i);
        return;
      }
      names.push_back(stats_.tensors[i].name);
    }
  } else {
    for (std::size_t a = 0; a < e.acts().count(); ++a) {
      if (e.acts().act(a).name == name) {
        e.set_fault(a, detail::Engine::kNoFault);
        return;
      }
      names.push_back(e.acts().act(a).name);
    }
  }
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
  throw std::invalid_argument(std::string(backward ? "activation gradient" : "activation") + ": expected one of " +
                              list + ", found '" + name + "'");
}

}  // namespace mixprec::nn
