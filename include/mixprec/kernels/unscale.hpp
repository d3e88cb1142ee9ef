// Fused gradient unscale + overflow check, the first step of a loss-scaled
// optimizer step (docs/performance.md, "Unscale and check").
//
// unscale_and_check() makes ONE pass over a list of gradient tensors of mixed
// dtypes (f32, f16, bf16; PyTorch refuses f16 and, on CUDA, bf16 gradients,
// mixprec accepts them) and, in the same pass:
//   - reads each element g and flags found_inf when g is inf or NaN. The check
//     reads the value BEFORE the multiply (torch.amp.GradScaler semantics), so
//     a finite g whose product overflows does not set found_inf (that only
//     happens with inv_scale > 1, i.e. a loss scale below 1);
//   - when options.write, stores y = float(g) * inv_scale in place: f32 as is,
//     f16/bf16 rounded back to the same format, to nearest even, exactly as
//     mixprec::f16(y) / mixprec::bf16(y). When inv_scale == 1 nothing is written
//     (PyTorch skips the multiply too; the values would not change);
//   - records the index (in the list) of the first tensor holding a non-finite
//     value;
//   - on request, the sum of squares of the f32 products y (options.sum_squares)
//     and each tensor's max |y| (options.amax, into amax_out).
//
// On found_inf the tensors are still multiplied, as PyTorch does (inf and NaN
// stay inf and NaN; finite elements are unscaled as usual). The caller must
// then skip the optimizer update: found_inf is the contract, and the sum of
// squares is then inf or NaN, never finite, so a clip coefficient computed
// from it cannot hide the overflow.
//
// Sum of squares, exactly and deterministically: every product y is an f32;
// y*y is exact in double. Each tensor is cut into chunks of kUnscaleChunk
// elements from its start; inside a chunk, element i goes to double lane
// i % 16, each lane summed in index order (y*y + lane, one rounding per
// element). At the end of a chunk the 16 lane values are added EXACTLY (a
// fixed-point accumulator; addition of integers is associative), and the total
// is rounded to double once, to nearest even. The result is therefore the same
// for the scalar reference and the AVX2 back end, bit for bit, and for any
// number of threads (threads split the list only at chunk boundaries). If
// some y is NaN the sum is NaN; else if some y is inf it is +inf. When not
// requested, sum_squares is NaN (never a value a caller could mistake for a
// norm).
//
// amax: max |y| over the tensor, as f32; 0 for an empty tensor; NaN (the
// canonical quiet NaN 0x7fc00000) if the tensor holds a NaN, +inf if it holds
// an inf and no NaN. Computed on the f32 products, also for f16/bf16 tensors
// and in check-only mode (a written f16/bf16 value is that product rounded).
//
// Check-only mode (options.write = false): nothing is written; found_inf,
// first_nonfinite, sum_squares and amax are those of y = float(g) * inv_scale,
// so a fused optimizer step can read the still-scaled gradients itself and
// multiply by inv_scale on the fly.
//
// Threads: tensors are processed as one list. When the total element count is
// at least options.min_parallel_elements, the concatenated element range is
// split into one contiguous range per thread of `pool` (ThreadPool::global()
// when nullptr), cut at chunk boundaries, and the per-thread results are merged
// in order. Results do not depend on the thread count (a busy pool runs the split
// inline on the caller: concurrent calls from independent threads are safe).
//
// Back end: chosen once through active_isa() (AVX2 + F16C when the CPU has it,
// else the scalar reference; MIXPREC_ISA overrides). The overload taking an
// Isa runs a named back end (tests, benchmarks).
//
// Tensors must not overlap. Errors (std::invalid_argument, before anything is
// touched): a null data pointer with size > 0, data not aligned to its dtype,
// an unknown dtype, inv_scale not finite or not > 0, amax_out.size() !=
// grads.size() when options.amax (or amax_out non-empty without it), an
// unavailable Isa.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "mixprec/formats/dtype.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/core/isa.hpp"
#include "mixprec/kernels/exact_sum.hpp"

namespace mixprec {

// Chunk length (elements) of the fixed summation order, and the unit of the
// thread split inside a tensor.
inline constexpr std::size_t kUnscaleChunk = std::size_t{16} << 10;
// Default total (elements, all dtypes together) from which the list is split
// across threads: below it, waking the pool costs more than it saves.
inline constexpr std::size_t kUnscaleParallelElements = std::size_t{1} << 19;

struct UnscaleOptions {
  bool write = true;         // false: check only, nothing is written
  bool sum_squares = false;  // sum of y*y over all tensors (UnscaleResult::sum_squares)
  bool amax = false;         // max |y| per tensor into amax_out
  std::size_t min_parallel_elements = kUnscaleParallelElements;  // 0: always split
};

struct UnscaleResult {
  bool found_inf = false;             // some element read was inf or NaN
  std::int64_t first_nonfinite = -1;  // index in grads of the first such tensor; -1 when none
  double sum_squares = 0;             // of the f32 products y; NaN when not requested; inf/NaN when found_inf
};

// float(1 / double(scale)), as torch.amp.GradScaler computes it.
constexpr float inv_scale_of(float scale) noexcept {
  return static_cast<float>(1.0 / static_cast<double>(scale));
}

// Whether unscale_and_check accepts inv_scale (finite and > 0). A loss scale without floor or
// guard (the keras and torch presets) can reach values whose inverse is not one: inf (inverse
// 0), 0, or below about 2^-128 (inverse beyond float32): gradients scaled by them cannot be
// unscaled, and GradScaler treats every such step as an overflow (docs/loss_scaling.md).
constexpr bool can_unscale(float inv_scale) noexcept {
  return inv_scale > 0.0f && inv_scale <= std::numeric_limits<float>::max();
}

UnscaleResult unscale_and_check(std::span<const GradTensor> grads, float inv_scale,
                                const UnscaleOptions& options = {}, std::span<float> amax_out = {},
                                ThreadPool* pool = nullptr);

// The same with a named back end; throws std::invalid_argument if it is not
// available on this CPU or build.
UnscaleResult unscale_and_check(Isa isa, std::span<const GradTensor> grads, float inv_scale,
                                const UnscaleOptions& options = {}, std::span<float> amax_out = {},
                                ThreadPool* pool = nullptr);

// The unrounded sum of squares of unscale_and_check (check only) over `grads`, added
// to `sum`, on the active back end, one thread; found_inf set when an element read is
// inf/NaN. Each tensor's chunks start at its first element, so a piece of a tensor
// that starts at a chunk boundary of that tensor adds exactly what the whole tensor's
// pass adds for those chunks: ZeRO's slices add up to the unsharded norm
// (docs/distributed.md). Errors as unscale_and_check's.
void sum_squares_exact(std::span<const GradTensor> grads, float inv_scale, ExactSum& sum, bool& found_inf);

}  // namespace mixprec
