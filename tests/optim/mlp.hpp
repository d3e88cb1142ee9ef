// A 2-layer MLP (in -> hidden (ReLU) -> out) in fp32 with a hand-written backward,
// over a ParamStore with f32 model weights and f32 grads. Loss: 0.5 * mean squared
// error, multiplied by `loss_scale` before the backward (so every gradient is
// exactly loss_scale times the unscaled one when loss_scale is a power of two).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "mixprec/optim/param_store.hpp"

namespace mixprec::test {

struct Mlp {
  static constexpr std::size_t kIn = 7, kHidden = 13, kOut = 3, kBatch = 5;

  static std::vector<ParamSpec> specs() {
    return {{"w1", {kHidden, kIn}}, {"b1", {kHidden}}, {"w2", {kOut, kHidden}}, {"b2", {kOut}}};
  }

  static void init(ParamStore& s, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 0.4f);
    for (std::size_t t = 0; t < s.tensor_count(); ++t)
      for (float& w : s.master(t)) w = nd(rng);
    s.refresh_model();
  }

  struct Batch {
    std::vector<float> x, y;
  };
  static Batch batch(std::uint32_t index) {
    std::mt19937 rng(1000 + index);
    std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
    Batch b;
    b.x.resize(kBatch * kIn);
    b.y.resize(kBatch * kOut);
    for (float& v : b.x) v = ud(rng);
    for (float& v : b.y) v = ud(rng);
    return b;
  }

  // Writes the gradients of loss_scale * loss into the store's f32 grads.
  static void backward(ParamStore& s, const Batch& b, float loss_scale) {
    auto w1 = s.model<float>("w1"), b1 = s.model<float>("b1"), w2 = s.model<float>("w2"), b2 = s.model<float>("b2");
    auto gw1 = s.grads<float>("w1"), gb1 = s.grads<float>("b1"), gw2 = s.grads<float>("w2"), gb2 = s.grads<float>("b2");
    s.zero_grads();
    for (std::size_t n = 0; n < kBatch; ++n) {
      const float* x = &b.x[n * kIn];
      float h[kHidden], a[kHidden], out[kOut], dout[kOut], dh[kHidden];
      for (std::size_t j = 0; j < kHidden; ++j) {
        float z = b1[j];
        for (std::size_t i = 0; i < kIn; ++i) z += w1[j * kIn + i] * x[i];
        h[j] = z;
        a[j] = z > 0.0f ? z : 0.0f;
      }
      for (std::size_t k = 0; k < kOut; ++k) {
        float z = b2[k];
        for (std::size_t j = 0; j < kHidden; ++j) z += w2[k * kHidden + j] * a[j];
        out[k] = z;
        // d(scale * 0.5 * mean((out - y)^2)) / d out; 1/(B*O) is not a power of two, so
        // scale first: (scale * diff) / (B*O) is exactly scale * (diff / (B*O)).
        dout[k] = (loss_scale * (out[k] - b.y[n * kOut + k])) / static_cast<float>(kBatch * kOut);
      }
      for (std::size_t j = 0; j < kHidden; ++j) dh[j] = 0.0f;
      for (std::size_t k = 0; k < kOut; ++k) {
        gb2[k] += dout[k];
        for (std::size_t j = 0; j < kHidden; ++j) {
          gw2[k * kHidden + j] += dout[k] * a[j];
          dh[j] += dout[k] * w2[k * kHidden + j];
        }
      }
      for (std::size_t j = 0; j < kHidden; ++j) {
        const float dz = h[j] > 0.0f ? dh[j] : 0.0f;
        gb1[j] += dz;
        for (std::size_t i = 0; i < kIn; ++i) gw1[j * kIn + i] += dz * x[i];
      }
    }
  }
};

// Bytes of a region, for bitwise comparisons.
inline std::vector<std::uint8_t> bytes_of(const void* p, std::size_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  return {b, b + n};
}

// Everything an optimizer step may write: master, model copy, state arrays.
inline std::vector<std::uint8_t> snapshot(const ParamStore& s) {
  std::vector<std::uint8_t> out;
  const std::size_t n = s.flat_size();
  auto add = [&](const void* p, std::size_t bytes) {
    const auto v = bytes_of(p, bytes);
    out.insert(out.end(), v.begin(), v.end());
  };
  if (s.has_master()) add(s.master_data(), n * 4);
  add(s.model_data(), n * dtype_size(s.model_dtype()));
  for (unsigned k = 0; k < s.state_slots(); ++k) add(s.state_data(k), n * 4);
  return out;
}

}  // namespace mixprec::test
