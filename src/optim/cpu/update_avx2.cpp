// The update kernels compiled for AVX2, F16C and FMA by the target pragma below
// (entered only when the CPU has them). FMA contraction is off for this file
// (src/CMakeLists.txt), so results equal the scalar build.
//
// The headers the kernels use are included first, for the baseline ISA; only the
// functions of update_impl.hpp are compiled for AVX2 (#pragma GCC target), so no
// inline function from a header gets an AVX2 copy the linker could pick for
// baseline code (see src/formats/cpu/bulk_avx2.cpp).
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "optim/kernels.hpp"

#if defined(__x86_64__)
// clang has no #pragma GCC target: the same per-function target through its attribute pragma
// (fuzz builds use clang, docs/fuzzing.md).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
#endif
#define MIXPREC_OPTIM_NS mixprec::optim_detail::avx2_impl
#include "optim/update_impl.hpp"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace mixprec::optim_detail {
const UpdateKernels* avx2_update_kernels() noexcept { return &avx2_impl::kTable; }
}  // namespace mixprec::optim_detail
#else
namespace mixprec::optim_detail {
const UpdateKernels* avx2_update_kernels() noexcept { return nullptr; }
}  // namespace mixprec::optim_detail
#endif
