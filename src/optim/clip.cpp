#include "mixprec/optim/clip.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "mixprec/core/parallel.hpp"
#include "mixprec/formats/scalar.hpp"
#include "optim/kernels.hpp"
#include "optim/norm.hpp"

namespace mixprec {
namespace optim_detail {

double sum_squares_blocked(const void* data, DType dtype, std::size_t n, float inv_scale, std::span<double> blocks,
                           Isa isa, ThreadPool* pool) noexcept {
  constexpr std::size_t K = ParamStore::kNormBlock;
  const std::size_t nblocks = (n + K - 1) / K;
  const UpdateKernels& k = update_kernels(isa);
  const KernelTable* table = kernel_table(isa);
  const auto* bytes = static_cast<const std::byte*>(data);
  auto run = [&](std::size_t b0, std::size_t b1, unsigned) {
    alignas(64) float buf[kChunk];
    const ConvertOptions opt{Overflow::ieee, Subnormals::keep, inv_scale};
    for (std::size_t b = b0; b < b1; ++b) {
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const std::size_t end = std::min(n, (b + 1) * K);
      for (std::size_t i = b * K; i < end; i += kChunk) {
        const std::size_t m = std::min(kChunk, end - i);
        switch (dtype) {
          case DType::f32: k.scale(reinterpret_cast<const float*>(bytes) + i, buf, m, inv_scale); break;
          case DType::f16: table->f16.decode(bytes + 2 * i, buf, m, opt); break;
          case DType::bf16: table->bf16.decode(bytes + 2 * i, buf, m, opt); break;
        }
        k.accumulate_squares(buf, m, acc);
      }
      blocks[b] = combine_lanes(acc);
    }
  };
  if (pool != nullptr) pool->parallel_for(nblocks, 1, 4, run);
  else run(0, nblocks, 0);
  double total = 0.0;
  for (std::size_t b = 0; b < nblocks; ++b) total += blocks[b];
  return total;
}

}  // namespace optim_detail

namespace {
void check_inv_scale(float inv_scale, const char* who) {
  if (!std::isfinite(inv_scale) || !(inv_scale > 0.0f))
    throw std::invalid_argument(std::string(who) + ": expected inv_scale finite and > 0, found " +
                                std::to_string(inv_scale));
}

// The reference order, element by element.
struct RefSum {
  double total = 0.0, acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::size_t in_block = 0;
  void add(float u) {
    const double x = static_cast<double>(u);
    acc[in_block % 8] += x * x;
    if (++in_block == ParamStore::kNormBlock) flush();
  }
  void flush() {
    if (in_block == 0) return;
    total += optim_detail::combine_lanes(acc);
    std::fill(acc, acc + 8, 0.0);
    in_block = 0;
  }
};
}  // namespace

GradStats grad_stats(const ParamStore& store, float inv_scale, ThreadPool* pool) {
  check_inv_scale(inv_scale, "grad_stats");
  GradStats st;
  st.sum_squares = optim_detail::sum_squares_blocked(store.grad_data(), store.grad_dtype(), store.flat_size(),
                                                     inv_scale, store.norm_scratch(), active_isa(), pool);
  // A sum of squares of finite floats cannot overflow a double, so a non-finite
  // sum means some unscaled gradient was inf or NaN.
  st.found_inf = !std::isfinite(st.sum_squares);
  st.norm = std::sqrt(st.sum_squares);
  return st;
}

double global_grad_norm(const ParamStore& store, float inv_scale) {
  check_inv_scale(inv_scale, "global_grad_norm");
  RefSum s;
  const std::size_t n = store.flat_size();
  const void* d = store.grad_data();
  for (std::size_t i = 0; i < n; ++i) {
    float g = 0.0f;
    switch (store.grad_dtype()) {
      case DType::f32: g = static_cast<const float*>(d)[i]; break;
      case DType::f16: g = decode(static_cast<const f16*>(d)[i]); break;
      case DType::bf16: g = decode(static_cast<const bf16*>(d)[i]); break;
    }
    s.add(g * inv_scale);
  }
  s.flush();
  return std::sqrt(s.total);
}

double global_grad_norm(std::span<const float> unscaled) {
  RefSum s;
  for (float u : unscaled) s.add(u);
  s.flush();
  return std::sqrt(s.total);
}

float clip_coefficient(double total_norm, float max_norm) {
  if (!std::isfinite(max_norm) || !(max_norm > 0.0f))
    throw std::invalid_argument("clip_coefficient: expected max_norm finite and > 0, found " + std::to_string(max_norm));
  if (!std::isfinite(total_norm)) return std::numeric_limits<float>::quiet_NaN();
  const double coef = static_cast<double>(max_norm) / (total_norm + 1e-6);
  return static_cast<float>(std::min(coef, 1.0));
}

}  // namespace mixprec
