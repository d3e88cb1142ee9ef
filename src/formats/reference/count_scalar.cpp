// Scalar reference of the counting pass (formats/count_kernels.hpp).
#include "formats/count_kernels.hpp"

namespace mixprec::detail {

const CountKernels& scalar_count_kernels() noexcept {
  static const CountKernels table{
      Isa::scalar,
      [](const std::uint16_t* s, std::size_t n, const std::uint16_t* b, MagnitudeProfile& out) {
        profile_range(s, n, b, out);
      },
      [](const std::uint32_t* s, std::size_t n, const std::uint32_t* b, MagnitudeProfile& out) {
        profile_range(s, n, b, out);
      },
      [](const std::uint16_t* s, std::size_t n) { return max_range(s, n); },
  };
  return table;
}

}  // namespace mixprec::detail
