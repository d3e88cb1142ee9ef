// The update kernels compiled for AVX-512 F/BW/DQ/VL (with AVX2, F16C and FMA), 512-bit
// vectors preferred; entered only when isa_available(Isa::avx512). FMA contraction is off
// for this file (src/CMakeLists.txt), so results equal the scalar build. Why a third copy
// of the same loops: the fused Adam step is bound by memory, and on one thread a core keeps
// only so many loads in flight; 64-byte vectors move a cache line per load and store (as for
// unscale_and_check).
//
// The headers the kernels use are included first, for the baseline ISA; only the
// functions of update_impl.hpp are compiled for AVX-512 (core/simd_target.hpp says why).
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "formats/kernels.hpp"
#include "mixprec/formats/scalar.hpp"
#include "optim/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/simd_reduce.hpp"
#include "core/simd_target.hpp"
#include "formats/cpu/minifloat_simd.hpp"

MIXPREC_TARGET_AVX512_F16C_FMA_PREFER512_BEGIN
#define MIXPREC_OPTIM_AVX512 1
#define MIXPREC_OPTIM_NS mixprec::optim_detail::avx512_impl
#include "optim/update_impl.hpp"
MIXPREC_TARGET_END

namespace mixprec::optim_detail {
const UpdateKernels* avx512_update_kernels() noexcept { return &avx512_impl::kTable; }
}  // namespace mixprec::optim_detail
#else
namespace mixprec::optim_detail {
const UpdateKernels* avx512_update_kernels() noexcept { return nullptr; }
}  // namespace mixprec::optim_detail
#endif
