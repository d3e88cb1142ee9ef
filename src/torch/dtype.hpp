// Private to mixprec::torch: ATen's scalar types that the core's kernels read in place.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

#include "mixprec/formats/dtype.hpp"

namespace mixprec::torch::detail {

// fp32, fp16 and bf16 map to the core's DType; any other type has no core kernel.
inline std::optional<DType> mixprec_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::f32;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    default: return std::nullopt;
  }
}

}  // namespace mixprec::torch::detail
