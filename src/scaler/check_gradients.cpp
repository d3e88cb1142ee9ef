// The one gradient check (scaler/check_gradients.hpp): unscale_and_check plus the two rules
// the kernel does not know, unscalable scales and products that overflow at scales below 1.
#include "mixprec/scaler/check_gradients.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <limits>
#include <vector>

#include "mixprec/formats/types.hpp"

namespace mixprec {

bool overflows_in(DType dtype, float value) noexcept {
  switch (dtype) {
    case DType::f32: return !std::isfinite(value);
    case DType::f16: return !std::isfinite(static_cast<float>(f16(value)));
    case DType::bf16: return !std::isfinite(static_cast<float>(bf16(value)));
  }
  return true;
}

namespace {

// An unscaled |max| (an f32 product) as `dtype` stores it: rounding is monotonic, so the
// largest stored value is the largest product rounded.
float stored(DType dtype, float value) noexcept {
  switch (dtype) {
    case DType::f16: return static_cast<float>(f16(value));
    case DType::bf16: return static_cast<float>(bf16(value));
    case DType::f32: break;
  }
  return value;
}

void round_as_stored(std::span<const GradTensor> grads, std::span<float> amax) noexcept {
  for (std::size_t i = 0; i < amax.size(); ++i) amax[i] = stored(grads[i].dtype, amax[i]);
}

}  // namespace

GradientCheck check_gradients(std::span<const GradTensor> grads, float scale, bool write, ThreadPool* pool,
                              std::span<float> amax_out) {
  if (!amax_out.empty() && amax_out.size() != grads.size())
    throw std::invalid_argument("check_gradients: amax_out has " + std::to_string(amax_out.size()) +
                                " elements for " + std::to_string(grads.size()) + " tensors; expected one per tensor");
  GradientCheck c;
  c.checked = !grads.empty();
  const float inv = inv_scale_of(scale);
  if (!can_unscale(inv)) {
    std::fill(amax_out.begin(), amax_out.end(), std::numeric_limits<float>::quiet_NaN());
    // Read as they are (inv 1) only to name the first tensor holding inf/NaN.
    UnscaleOptions o;
    o.write = false;
    c.first_overflow = unscale_and_check(grads, 1.0f, o, {}, pool).first_nonfinite;
    c.found_inf = true;
    return c;
  }
  UnscaleOptions o;
  o.sum_squares = true;
  if (inv <= 1.0f) {
    o.write = write;  // the kernel itself writes nothing at inv 1
    o.amax = !amax_out.empty();
    const UnscaleResult r = unscale_and_check(grads, inv, o, amax_out, pool);
    round_as_stored(grads, amax_out);
    c.found_inf = r.found_inf;
    c.first_overflow = r.first_nonfinite;
    c.sum_squares = r.sum_squares;
    c.carried_inv_scale = write ? 1.0f : inv;
    return c;
  }
  // Scale below 1: read everything before writing anything.
  o.write = false;
  o.amax = true;
  std::vector<float> amax(grads.size());  // host code: the kernels themselves never allocate
  const UnscaleResult r = unscale_and_check(grads, inv, o, amax, pool);
  if (!amax_out.empty()) {
    std::copy(amax.begin(), amax.end(), amax_out.begin());
    round_as_stored(grads, amax_out);
  }
  c.found_inf = r.found_inf;
  c.first_overflow = r.first_nonfinite;
  c.sum_squares = r.sum_squares;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const auto at = static_cast<std::int64_t>(i);
    if (c.first_overflow >= 0 && c.first_overflow <= at) break;
    if (overflows_in(grads[i].dtype, amax[i])) {
      c.found_inf = true;
      c.first_overflow = at;
      break;
    }
  }
  if (c.found_inf) {
    c.sum_squares = std::numeric_limits<double>::infinity();  // never a finite norm for an overflow step
    return c;  // nothing written
  }
  if (write) {
    UnscaleOptions w;
    w.write = true;
    (void)unscale_and_check(grads, inv, w, {}, pool);
  }
  c.carried_inv_scale = write ? 1.0f : inv;
  return c;
}

}  // namespace mixprec
