// Gradient norm and clipping on the unscaled gradients.
//
// The norm is sqrt(sum of squares) of u = float(g) * inv_scale (fp32 product,
// then squared and summed exactly in the order of unscale_and_check
// (kernels/unscale.hpp: per tensor, chunks of 16 double lanes, chunk sums added
// exactly), so it is bitwise the same for any thread count, back end, and for the
// GradScaler, the fused and the reference paths.
// With a power-of-two loss scale u is exact, so the norm of scaled-then-unscaled
// gradients equals the norm of unscaled ones, bit for bit.
#pragma once

#include <cstdint>
#include <span>

#include "mixprec/optim/param_store.hpp"

namespace mixprec {

class ThreadPool;

struct GradStats {
  bool found_inf = false;  // some u (or g) is inf or NaN
  double sum_squares = 0;  // inf or NaN when found_inf
  double norm = 0;         // sqrt(sum_squares)
};

// One read of the grads region: found_inf and the norm of the unscaled gradients.
// Throws std::invalid_argument when inv_scale is not finite and > 0.
GradStats grad_stats(const ParamStore& store, float inv_scale, ThreadPool* pool = nullptr);

// The same through the scalar reference back end of unscale_and_check.
double global_grad_norm(const ParamStore& store, float inv_scale = 1.0f);
// The norm of any gradient list (read as is), scalar reference, the same order.
double global_grad_norm(std::span<const GradTensor> unscaled);

// PyTorch's clip_grad_norm_ coefficient: min(1, max_norm / (total_norm + 1e-6)),
// returned as float. A non-finite total_norm gives NaN (never a finite number that
// would hide an overflow; PyTorch would give 0 for inf). Throws std::invalid_argument
// when max_norm is not finite and > 0.
float clip_coefficient(double total_norm, float max_norm);

}  // namespace mixprec
