// The update kernels compiled for AVX2, F16C and FMA (entered only when the CPU has
// them). FMA contraction is off for this file (src/CMakeLists.txt), so results equal
// the scalar build.
//
// The headers the kernels use are included first, for the baseline ISA; only the
// functions of update_impl.hpp are compiled for AVX2 (core/simd_target.hpp says why).
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

MIXPREC_TARGET_AVX2_F16C_FMA_BEGIN
#define MIXPREC_OPTIM_AVX2 1
#define MIXPREC_OPTIM_NS mixprec::optim_detail::avx2_impl
#include "optim/update_impl.hpp"
MIXPREC_TARGET_END

namespace mixprec::optim_detail {
const UpdateKernels* avx2_update_kernels() noexcept { return &avx2_impl::kTable; }
}  // namespace mixprec::optim_detail
#else
namespace mixprec::optim_detail {
const UpdateKernels* avx2_update_kernels() noexcept { return nullptr; }
}  // namespace mixprec::optim_detail
#endif
