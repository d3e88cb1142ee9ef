// The one gradient check of every front door (docs/loss_scaling.md, "The gradient check"):
// found_inf, the first tensor at fault, the sum of squares of the unscaled values, and
// (write) the gradients unscaled in place, over CPU views of f32/f16/bf16 memory.
//
//   inv = float(1 / double(scale)), as torch.amp.GradScaler computes it.
//   - inv not finite or not > 0 (scale inf, 0, or below about 2^-128: presets without a
//     floor reach them): nothing can be unscaled. found_inf, nothing written, the first
//     tensor holding inf/NaN named (or -1), sum_squares NaN.
//   - inv <= 1 (scale >= 1): one fused pass of unscale_and_check. An unscaled value is never
//     larger than the scaled one, so no product can overflow its dtype; on found_inf the
//     tensors are still written, as torch does (the step is skipped).
//   - inv > 1 (scale < 1): one read-only pass first, with each tensor's max |g * inv|. A
//     product that rounds to inf in the tensor's own dtype (fp16 above 65504, bf16 and f32
//     above their largest finite) is an overflow: found_inf, that tensor named, and nothing
//     written anywhere. torch writes the inf and steps; mixprec skips the step. Only when
//     every product is finite does a second pass write (the same values the fused pass would).
// carried_inv_scale: 1 when the gradients were unscaled here (or need no unscale), else inv
// (write = false: the optimizer multiplies by it as it reads them).
// amax_out (optional; empty, or one float per tensor): each tensor's unscaled |max| as its
// dtype stores it, max |dtype(g * inv)| (an f16/bf16 product rounded as the write rounds
// it), measured in the same pass: what telemetry records as the gradient |max| without a
// second read. inf/NaN as unscale_and_check's amax; NaN for every tensor when the scale
// cannot be inverted (nothing was unscaled). Its size is checked first
// (std::invalid_argument).
#pragma once

#include <span>

#include "mixprec/kernels/unscale.hpp"
#include "mixprec/scaler/protocol.hpp"

namespace mixprec {

class ThreadPool;

GradientCheck check_gradients(std::span<const GradTensor> grads, float scale, bool write, ThreadPool* pool = nullptr,
                              std::span<float> amax_out = {});

// Whether `value` (an unscaled f32 product) rounds to inf or NaN in `dtype`: the rule of the
// inv > 1 branch, for one value (the tests' reference, and a door's ATen path).
bool overflows_in(DType dtype, float value) noexcept;

}  // namespace mixprec
