// The update kernels built for the baseline ISA (the reference back end).
#define MIXPREC_OPTIM_NS mixprec::optim_detail::scalar_impl
#include "optim/update_impl.hpp"

namespace mixprec::optim_detail {
const UpdateKernels& scalar_update_kernels() noexcept { return scalar_impl::kTable; }
}  // namespace mixprec::optim_detail
