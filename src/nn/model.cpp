// Model configuration, validation and the factory (include/mixprec/nn/model.hpp).
#include "mixprec/nn/model.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

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

std::unique_ptr<Model> make_model(const ModelConfig& config, Precision precision, unsigned state_slots) {
  validate(config);
  const PrecisionPolicy p = policy_of(precision);
  return config.kind == ModelKind::gpt ? detail::make_gpt(config, p, state_slots)
                                       : detail::make_mlp(config, p, state_slots);
}

std::size_t Model::grad_label(std::string name) {
  stats_.tensors.push_back({std::move(name), {}, 0.0f});
  return stats_.tensors.size() - 1;
}

void Model::reset_stats() noexcept {
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

namespace detail {

void write_initial_weights(ParamStore& store, std::span<const float> flat) {
  if (store.has_master()) {
    std::memcpy(store.master_data(), flat.data(), flat.size() * sizeof(float));
    store.refresh_model();
    return;
  }
  switch (store.model_dtype()) {
    case DType::f32: std::memcpy(store.model_data(), flat.data(), flat.size() * sizeof(float)); return;
    case DType::f16: convert(flat, std::span<f16>(static_cast<f16*>(store.model_data()), flat.size())); return;
    case DType::bf16: convert(flat, std::span<bf16>(static_cast<bf16*>(store.model_data()), flat.size())); return;
  }
}

}  // namespace detail
}  // namespace mixprec::nn
