#include "mixprec/optim/clip.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "mixprec/core/text.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/kernels/unscale.hpp"

namespace mixprec {
namespace {

void check_inv_scale(float inv_scale, const char* who) {
  if (!std::isfinite(inv_scale) || !(inv_scale > 0.0f))
    throw std::invalid_argument(std::string(who) + ": expected inv_scale finite and > 0, found " +
                                text::num_f32(inv_scale));
}

// The norm is unscale_and_check's sum of squares (check only): one definition
// of the order for the whole library (kernels/unscale.hpp).
UnscaleResult check_norm(Isa isa, std::span<const GradTensor> grads, float inv_scale, ThreadPool* pool) {
  UnscaleOptions o;
  o.write = false;
  o.sum_squares = true;
  return unscale_and_check(isa, grads, inv_scale, o, {}, pool);
}

}  // namespace

GradStats grad_stats(const ParamStore& store, float inv_scale, ThreadPool* pool) {
  check_inv_scale(inv_scale, "grad_stats");
  const UnscaleResult r = check_norm(active_isa(), store.grad_tensors(), inv_scale, pool);
  GradStats st;
  st.sum_squares = r.sum_squares;
  // Non-finite sum: some gradient was inf/NaN, or overflowed when unscaled.
  st.found_inf = r.found_inf || !std::isfinite(st.sum_squares);
  st.norm = std::sqrt(st.sum_squares);
  return st;
}

double global_grad_norm(const ParamStore& store, float inv_scale) {
  check_inv_scale(inv_scale, "global_grad_norm");
  return std::sqrt(check_norm(Isa::scalar, store.grad_tensors(), inv_scale, nullptr).sum_squares);
}

double global_grad_norm(std::span<const GradTensor> unscaled) {
  return std::sqrt(check_norm(Isa::scalar, unscaled, 1.0f, nullptr).sum_squares);
}

float clip_coefficient(double total_norm, float max_norm) {
  if (!std::isfinite(max_norm) || !(max_norm > 0.0f))
    throw std::invalid_argument("clip_coefficient: expected max_norm finite and > 0, found " + text::num_f32(max_norm));
  if (!std::isfinite(total_norm)) return std::numeric_limits<float>::quiet_NaN();
  const double coef = static_cast<double>(max_norm) / (total_norm + 1e-6);
  return static_cast<float>(std::min(coef, 1.0));
}

}  // namespace mixprec
