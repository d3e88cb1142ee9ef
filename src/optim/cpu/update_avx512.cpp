// The update kernels compiled for AVX-512 F/BW/DQ/VL (with AVX2, F16C and FMA), 512-bit
// vectors preferred, by the target pragma below; entered only when
// isa_available(Isa::avx512). FMA contraction is off for this file (src/CMakeLists.txt),
// so results equal the scalar build. Why a third copy of the same loops: the fused Adam
// step is bound by memory, and on one thread a core keeps only so many loads in flight;
// 64-byte vectors move a cache line per load and store (as for unscale_and_check).
//
// The headers the kernels use are included first, for the baseline ISA; only the
// functions of update_impl.hpp are compiled for AVX-512 (#pragma GCC target), so no
// inline function from a header gets an AVX-512 copy the linker could pick for
// baseline code (see src/formats/cpu/bulk_avx2.cpp).
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "optim/kernels.hpp"

#if defined(__x86_64__)
// clang has no #pragma GCC target: the same per-function target through its attribute pragma
// (fuzz builds use clang, docs/fuzzing.md).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#endif
#define MIXPREC_OPTIM_NS mixprec::optim_detail::avx512_impl
#include "optim/update_impl.hpp"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace mixprec::optim_detail {
const UpdateKernels* avx512_update_kernels() noexcept { return &avx512_impl::kTable; }
}  // namespace mixprec::optim_detail
#else
namespace mixprec::optim_detail {
const UpdateKernels* avx512_update_kernels() noexcept { return nullptr; }
}  // namespace mixprec::optim_detail
#endif
