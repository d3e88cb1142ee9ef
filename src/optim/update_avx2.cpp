// The update kernels built with AVX2 + FMA enabled (entered only when the CPU has
// them). FMA contraction is off for this file, so results equal the scalar build.
#if defined(__AVX2__)
#define MIXPREC_OPTIM_NS mixprec::optim_detail::avx2_impl
#include "optim/update_impl.hpp"

namespace mixprec::optim_detail {
const UpdateKernels* avx2_update_kernels() noexcept { return &avx2_impl::kTable; }
}  // namespace mixprec::optim_detail
#else
#include "optim/kernels.hpp"
namespace mixprec::optim_detail {
const UpdateKernels* avx2_update_kernels() noexcept { return nullptr; }
}  // namespace mixprec::optim_detail
#endif
