// Public bulk conversions: validate on the host, then call the active back end.
#include "mixprec/formats/bulk.hpp"

#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "mixprec/core/text.hpp"
#include "core/select_kernels.hpp"
#include "formats/kernels.hpp"
#include "mixprec/formats/kernel_table.hpp"

namespace mixprec {
namespace {

void check(std::size_t src_n, std::size_t dst_n, const ConvertOptions& o, const char* what) {
  if (src_n != dst_n) {
    throw std::invalid_argument(std::string(what) + ": source has " + std::to_string(src_n) +
                                " elements but destination has " + std::to_string(dst_n) +
                                "; they must match");
  }
  if (!std::isfinite(o.scale) || !(o.scale > 0.0f)) {
    throw std::invalid_argument(std::string(what) + ": scale " + text::num_f32(o.scale) +
                                " is not allowed; it must be finite and > 0");
  }
}

template <LowPrecisionFormat T>
const FormatKernels& active() {
  static const KernelTable* table = kernel_table(active_isa());
  return table->get<T>();
}

}  // namespace

const KernelTable* kernel_table(Isa isa) noexcept {
  return detail::select_kernels(isa, &detail::scalar_kernels, &detail::avx2_kernels, &detail::avx512_kernels);
}

template <LowPrecisionFormat T>
void convert(std::span<const float> src, std::span<T> dst, const ConvertOptions& o) {
  check(src.size(), dst.size(), o, "convert(f32 -> low)");
  active<T>().encode(src.data(), dst.data(), src.size(), o);
}

template <LowPrecisionFormat T>
void convert(std::span<const T> src, std::span<float> dst, const ConvertOptions& o) {
  check(src.size(), dst.size(), o, "convert(low -> f32)");
  active<T>().decode(src.data(), dst.data(), src.size(), o);
}

template <LowPrecisionFormat T>
void convert_stochastic(std::span<const float> src, std::span<T> dst,
                        std::span<const std::uint32_t> random, const ConvertOptions& o) {
  check(src.size(), dst.size(), o, "convert_stochastic");
  if (random.size() != src.size()) {
    throw std::invalid_argument("convert_stochastic: " + std::to_string(random.size()) +
                                " random words for " + std::to_string(src.size()) +
                                " elements; need one per element");
  }
  active<T>().encode_stochastic(src.data(), dst.data(), random.data(), src.size(), o);
}

template <LowPrecisionFormat T>
ConversionStats convert_counted(std::span<const float> src, std::span<T> dst, const ConvertOptions& o) {
  check(src.size(), dst.size(), o, "convert_counted");
  return active<T>().encode_counted(src.data(), dst.data(), src.size(), o);
}

template <LowPrecisionFormat T>
void encode_and_round(std::span<float> v, std::span<T> dst, const ConvertOptions& o) {
  check(v.size(), dst.size(), o, "encode_and_round");
  active<T>().encode_round(v.data(), dst.data(), v.size(), o);
}

template <LowPrecisionFormat T>
RoundedStats encode_and_round_counted(std::span<float> v, std::span<T> dst, const ConvertOptions& o) {
  check(v.size(), dst.size(), o, "encode_and_round_counted");
  std::uint32_t bits = 0;
  RoundedStats r;
  r.stats = active<T>().encode_round_counted(v.data(), dst.data(), v.size(), o, &bits);
  // Magnitude bits at or above inf's are inf or NaN: either makes the amax infinite.
  r.amax = bits >= 0x7f800000u ? std::numeric_limits<float>::infinity() : std::bit_cast<float>(bits);
  return r;
}

#define MIXPREC_INSTANTIATE(T)                                                                    \
  template void convert<T>(std::span<const float>, std::span<T>, const ConvertOptions&);          \
  template void convert<T>(std::span<const T>, std::span<float>, const ConvertOptions&);          \
  template void convert_stochastic<T>(std::span<const float>, std::span<T>,                       \
                                      std::span<const std::uint32_t>, const ConvertOptions&);     \
  template ConversionStats convert_counted<T>(std::span<const float>, std::span<T>,               \
                                              const ConvertOptions&);                             \
  template void encode_and_round<T>(std::span<float>, std::span<T>, const ConvertOptions&);       \
  template RoundedStats encode_and_round_counted<T>(std::span<float>, std::span<T>, const ConvertOptions&);
MIXPREC_INSTANTIATE(f16)
MIXPREC_INSTANTIATE(bf16)
MIXPREC_INSTANTIATE(f8e4m3)
MIXPREC_INSTANTIATE(f8e5m2)
#undef MIXPREC_INSTANTIATE

}  // namespace mixprec
