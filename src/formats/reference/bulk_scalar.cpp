// The scalar reference back end: one element at a time through scalar.hpp.
#include "formats/kernels.hpp"

namespace mixprec::detail {
namespace {

template <const MiniFloatSpec& S, class Storage>
FormatKernels make_scalar() {
  return FormatKernels{
      [](const float* s, void* d, std::size_t n, const ConvertOptions& o) {
        encode_range<S>(s, static_cast<Storage*>(d), n, o);
      },
      [](const float* s, void* d, const std::uint32_t* r, std::size_t n, const ConvertOptions& o) {
        encode_stochastic_range<S>(s, static_cast<Storage*>(d), r, n, o);
      },
      [](const float* s, void* d, std::size_t n, const ConvertOptions& o) {
        ConversionStats st;
        encode_counted_range<S>(s, static_cast<Storage*>(d), n, o, st);
        return st;
      },
      [](const void* s, float* d, std::size_t n, const ConvertOptions& o) {
        decode_range<S>(static_cast<const Storage*>(s), d, n, o);
      },
      [](const float* s, void* d, std::size_t n, const ConvertOptions& o) {
        return encode_amax_range<S>(s, static_cast<Storage*>(d), n, o);
      },
      [](const float* s, void* d, std::size_t n, std::size_t block, const float* f, const ConvertOptions& o) {
        encode_block_scaled_range<S>(s, static_cast<Storage*>(d), 0, n, block, f, o);
      },
      [](const void* s, float* d, std::size_t n, std::size_t block, const float* f, const ConvertOptions& o) {
        decode_block_scaled_range<S>(static_cast<const Storage*>(s), d, 0, n, block, f, o);
      },
      [](float* v, void* d, std::size_t n, const ConvertOptions& o) {
        encode_round_range<S>(v, static_cast<Storage*>(d), n, o);
      },
      [](float* v, void* d, std::size_t n, const ConvertOptions& o, std::uint32_t* amax_bits) {
        ConversionStats st;
        std::uint32_t m = 0;
        encode_round_counted_range<S>(v, static_cast<Storage*>(d), n, o, st, m);
        *amax_bits = m;
        return st;
      },
  };
}

}  // namespace

const KernelTable& scalar_kernels() noexcept {
  static const KernelTable table{
      Isa::scalar,
      make_scalar<kF16Spec, std::uint16_t>(),
      make_scalar<kBF16Spec, std::uint16_t>(),
      make_scalar<kE4M3Spec, std::uint8_t>(),
      make_scalar<kE5M2Spec, std::uint8_t>(),
      AmaxKernels{&amax_bits_range, &block_amax_range},
  };
  return table;
}

}  // namespace mixprec::detail
