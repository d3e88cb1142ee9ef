// Private to mixprec::torch: Telemetry's counting with ATen operations, on the device where a
// tensor lies (CUDA): the numbers the core's counting pass computes from CPU memory
// (mixprec/formats/count.hpp), kept on the device as small int64 tensors until record() reads
// them all in one host copy. The Python package's mixprec/torch/_device_counts.py is the same
// algorithm in torch's Python operations; both are tested against the core on CPU tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "mixprec/formats/dtype.hpp"

namespace mixprec::torch::detail {

// t detached, as the counting reads it: fp32/fp16/bf16 as it is, any other dtype as fp32.
at::Tensor counted(const at::Tensor& t);
DType counted_dtype(const at::Tensor& counted);

// int64[6]: how many magnitudes lie above each of count_bounds' five bounds, then the largest.
at::Tensor profile(const at::Tensor& counted);
// (bits, order): bits[j] is tensors[order[j]]'s largest |value| as fp32 magnitude bits (above
// inf's for NaN); empty tensors left out. One _foreach_norm(inf) per dtype.
std::pair<at::Tensor, std::vector<std::size_t>> amax_bits(const std::vector<at::Tensor>& counted);
// int64[bins + 2]: the core's Log2Histogram of every stride-th value (bins, zeros, nonfinite).
at::Tensor histogram(const at::Tensor& counted, std::int64_t stride);
// An fp32 magnitude from its bits; inf for inf/NaN (the core's amax convention).
float f32_from_bits(std::uint32_t bits) noexcept;

}  // namespace mixprec::torch::detail
