// The update kernels compiled for AVX-512 (F/BW/DQ/VL, with AVX2, F16C and FMA) by the
// target pragma below, 512-bit vectors preferred (entered only when the CPU has them).
// FMA contraction is off for this file (src/CMakeLists.txt), so results equal the scalar
// build bit for bit, as the AVX2 build's do (tests/optim/test_kernels.cpp).
//
// Why: the fused Adam step reads and writes 28 bytes per parameter; with one thread a
// core keeps only so many lines in flight, and 64-byte vectors move a line per load and
// per store (docs/optimizers.md, "Speed").
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "optim/kernels.hpp"

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
// GCC 12's avx512fintrin.h builds its "undefined" vectors from a self-initialised
// variable, which -W(maybe-)uninitialized reports in every caller.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define MIXPREC_OPTIM_NS mixprec::optim_detail::avx512_impl
#include "optim/update_impl.hpp"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
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
