// Private: the blocked sum of squares behind grad_stats() and the unfused clip pass.
#pragma once

#include <cstddef>
#include <span>

#include "mixprec/core/dtype.hpp"
#include "mixprec/dispatch.hpp"

namespace mixprec {
class ThreadPool;
namespace optim_detail {

// Sum over i in [0, n) of double(u_i)^2, u_i = float(data[i]) * inv_scale, in the
// fixed order of docs/optimizers.md (blocks of ParamStore::kNormBlock elements, 8
// lanes each; block sums added in order). blocks: one double per block (scratch).
double sum_squares_blocked(const void* data, DType dtype, std::size_t n, float inv_scale, std::span<double> blocks,
                           Isa isa, ThreadPool* pool) noexcept;

}  // namespace optim_detail
}  // namespace mixprec
