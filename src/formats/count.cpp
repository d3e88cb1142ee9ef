// The counting pass (mixprec/formats/count.hpp): bounds per source format, the back end
// chosen once, the profile turned into ConversionStats and |max|.
#include "mixprec/formats/count.hpp"

#include <bit>
#include <limits>
#include <stdexcept>
#include <string>

#include "core/select_kernels.hpp"
#include "formats/count_kernels.hpp"

namespace mixprec {
namespace {

using detail::kCountBounds;
using detail::MagnitudeProfile;

// Bounds of the outcome classes of a conversion to fp16 (round to nearest even, scale 1),
// as magnitude bits of the source: {0, U, N - 1, O - 1, I - 1} (count.hpp names them).
//   fp16: its own classes: nothing rounds (U = 0, O = I), subnormal below 2^-14 (0x0400).
//   bf16: U = 2^-25 (0x3300: the tie between 0 and fp16's smallest subnormal 2^-24 goes
//         to 0), N = 2^-14 (0x3880: the largest bf16 below it, 2^-14 - 2^-22, is a
//         subnormal fp16), O = 65536 (0x4780: 65280, the bf16 below, is an fp16),
//         I = 0x7f80.
//   fp32: U = 2^-25 (0x33000000), N = 2^-14 - 2^-25 (0x387fe000: the tie between the
//         largest subnormal and 2^-14 goes to 2^-14, an even code), O = 65520
//         (0x477ff000: the tie between 65504 and 65536 goes to 65536, i.e. inf),
//         I = 0x7f800000.
constexpr std::uint16_t kF16Bounds[kCountBounds] = {0, 0, 0x03ff, 0x7bff, 0x7bff};
constexpr std::uint16_t kBF16Bounds[kCountBounds] = {0, 0x3300, 0x387f, 0x477f, 0x7f7f};
constexpr std::uint32_t kF32Bounds[kCountBounds] = {0, 0x33000000u, 0x387fdfffu, 0x477fefffu, 0x7f7fffffu};

const detail::CountKernels& table_of(Isa isa) {
  const detail::CountKernels* t = detail::select_kernels(isa, &detail::scalar_count_kernels,
                                                         &detail::avx2_count_kernels, &detail::avx512_count_kernels);
  if (t == nullptr)
    throw std::invalid_argument("count: the " + std::string(isa_name(isa)) +
                                " back end is not available on this CPU or build");
  return *t;
}

const detail::CountKernels& active() {
  static const detail::CountKernels& table = table_of(active_isa());
  return table;
}

CountedTensor stats_of(const MagnitudeProfile& p, std::size_t n, float amax) {
  CountedTensor c;
  c.stats.elements = n;
  c.stats.nonzero = p.above[0];
  c.stats.underflow = p.above[0] - p.above[1];
  c.stats.subnormal = p.above[1] - p.above[2];
  c.stats.overflow = p.above[3] - p.above[4];
  c.stats.nonfinite_input = p.above[4];
  c.amax = amax;
  return c;
}

constexpr float kInf = std::numeric_limits<float>::infinity();

CountedTensor count16(const detail::CountKernels& k, const std::uint16_t* src, std::size_t n,
                      const std::uint16_t* bounds, bool is_bf16) {
  MagnitudeProfile p;
  if (n > 0) k.profile16(src, n, bounds, p);
  const auto m = static_cast<std::uint16_t>(p.max);
  float amax;
  if (is_bf16)
    amax = m >= 0x7f80 ? kInf : std::bit_cast<float>(static_cast<std::uint32_t>(m) << 16);
  else
    amax = m >= 0x7c00 ? kInf : static_cast<float>(f16::from_bits(m));
  return stats_of(p, n, amax);
}

CountedTensor count32(const detail::CountKernels& k, const float* src, std::size_t n) {
  MagnitudeProfile p;
  if (n > 0) k.profile32(reinterpret_cast<const std::uint32_t*>(src), n, kF32Bounds, p);
  return stats_of(p, n, p.max >= 0x7f800000u ? kInf : std::bit_cast<float>(p.max));
}

const std::uint16_t* words(std::span<const f16> s) { return reinterpret_cast<const std::uint16_t*>(s.data()); }
const std::uint16_t* words(std::span<const bf16> s) { return reinterpret_cast<const std::uint16_t*>(s.data()); }

}  // namespace

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2, "16-bit formats are read as their codes");

CountedTensor count_f16_as_stored(std::span<const f16> src) {
  return count16(active(), words(src), src.size(), kF16Bounds, false);
}
CountedTensor count_bf16_to_f16(std::span<const bf16> src) {
  return count16(active(), words(src), src.size(), kBF16Bounds, true);
}
CountedTensor count_f32_to_f16(std::span<const float> src) { return count32(active(), src.data(), src.size()); }

CountedTensor count_f16_as_stored(Isa isa, std::span<const f16> src) {
  return count16(table_of(isa), words(src), src.size(), kF16Bounds, false);
}
CountedTensor count_bf16_to_f16(Isa isa, std::span<const bf16> src) {
  return count16(table_of(isa), words(src), src.size(), kBF16Bounds, true);
}
CountedTensor count_f32_to_f16(Isa isa, std::span<const float> src) {
  return count32(table_of(isa), src.data(), src.size());
}

}  // namespace mixprec
