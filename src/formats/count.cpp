// The counting pass (mixprec/formats/count.hpp): bounds per source format, the back end
// chosen once, the profile turned into ConversionStats and |max|.
#include "mixprec/formats/count.hpp"

#include <array>
#include <bit>
#include <limits>
#include <stdexcept>
#include <string>

#include "core/select_kernels.hpp"
#include "formats/count_kernels.hpp"
#include "mixprec/formats/kernel_table.hpp"

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
constexpr std::uint32_t kBounds[3][kCountBounds] = {
    {0, 0x33000000u, 0x387fdfffu, 0x477fefffu, 0x7f7fffffu},  // f32
    {0, 0, 0x03ff, 0x7bff, 0x7bff},                           // f16
    {0, 0x3300, 0x387f, 0x477f, 0x7f7f},                      // bf16
};
// The 16-bit kernels take their rows as 16-bit words.
constexpr std::array<std::uint16_t, kCountBounds> narrow(const std::uint32_t (&b)[kCountBounds]) {
  std::array<std::uint16_t, kCountBounds> n{};
  for (int k = 0; k < kCountBounds; ++k) n[static_cast<std::size_t>(k)] = static_cast<std::uint16_t>(b[k]);
  return n;
}
constexpr auto kF16Bounds = narrow(kBounds[1]);
constexpr auto kBF16Bounds = narrow(kBounds[2]);
constexpr float kInf = std::numeric_limits<float>::infinity();

std::size_t row(DType t) noexcept {
  switch (t) {
    case DType::f16: return 1;
    case DType::bf16: return 2;
    case DType::f32: break;
  }
  return 0;
}

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

// The largest magnitude bits as fp32 (exact for every fp16 and bf16 value); inf/NaN: inf.
float amax_from_bits(DType source, std::uint32_t max_bits) {
  switch (source) {
    case DType::f16:
      return max_bits >= 0x7c00u ? kInf : static_cast<float>(f16::from_bits(static_cast<std::uint16_t>(max_bits)));
    case DType::bf16:
      return max_bits >= 0x7f80u ? kInf : std::bit_cast<float>(max_bits << 16);
    case DType::f32:
      break;
  }
  return max_bits >= 0x7f800000u ? kInf : std::bit_cast<float>(max_bits);
}

CountedTensor stats_of(const MagnitudeProfile& p, DType source, std::size_t n) {
  return counted_from_profile(source, n, std::span<const std::uint64_t, kCountBounds>(p.above), p.max);
}

CountedTensor count16(const detail::CountKernels& k, const std::uint16_t* src, std::size_t n, DType source) {
  MagnitudeProfile p;
  if (n > 0) k.profile16(src, n, (source == DType::bf16 ? kBF16Bounds : kF16Bounds).data(), p);
  return stats_of(p, source, n);
}

CountedTensor count32(const detail::CountKernels& k, const float* src, std::size_t n) {
  MagnitudeProfile p;
  if (n > 0) k.profile32(reinterpret_cast<const std::uint32_t*>(src), n, kBounds[0], p);
  return stats_of(p, DType::f32, n);
}

float amax16(const detail::CountKernels& k, const std::uint16_t* src, std::size_t n, DType source) {
  return n == 0 ? 0.0f : amax_from_bits(source, k.max16(src, n));
}

// fp32: the formats table's magnitude-bits max (the FP8 recipes' amax kernel), same back end.
const KernelTable& amax_table(Isa isa) {
  (void)table_of(isa);  // the same availability check and message
  return *kernel_table(isa);
}

float amax32(const KernelTable& k, const float* src, std::size_t n) {
  return n == 0 ? 0.0f : amax_from_bits(DType::f32, k.amax.amax_bits(src, n));
}

const std::uint16_t* words(std::span<const f16> s) { return reinterpret_cast<const std::uint16_t*>(s.data()); }
const std::uint16_t* words(std::span<const bf16> s) { return reinterpret_cast<const std::uint16_t*>(s.data()); }

}  // namespace

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2, "16-bit formats are read as their codes");

std::span<const std::uint32_t, 5> count_bounds(DType source) noexcept {
  return std::span<const std::uint32_t, 5>(kBounds[row(source)]);
}

CountedTensor counted_from_profile(DType source, std::uint64_t elements, std::span<const std::uint64_t, 5> above,
                                   std::uint32_t max_bits) {
  CountedTensor c;
  c.stats.elements = elements;
  c.stats.nonzero = above[0];
  c.stats.underflow = above[0] - above[1];
  c.stats.subnormal = above[1] - above[2];
  c.stats.overflow = above[3] - above[4];
  c.stats.nonfinite_input = above[4];
  c.amax = amax_from_bits(source, max_bits);
  return c;
}

CountedTensor count_f16_as_stored(std::span<const f16> src) {
  return count16(active(), words(src), src.size(), DType::f16);
}
CountedTensor count_bf16_to_f16(std::span<const bf16> src) {
  return count16(active(), words(src), src.size(), DType::bf16);
}
CountedTensor count_f32_to_f16(std::span<const float> src) { return count32(active(), src.data(), src.size()); }

CountedTensor count_f16_as_stored(Isa isa, std::span<const f16> src) {
  return count16(table_of(isa), words(src), src.size(), DType::f16);
}
CountedTensor count_bf16_to_f16(Isa isa, std::span<const bf16> src) {
  return count16(table_of(isa), words(src), src.size(), DType::bf16);
}
CountedTensor count_f32_to_f16(Isa isa, std::span<const float> src) {
  return count32(table_of(isa), src.data(), src.size());
}

float amax_f16(std::span<const f16> src) { return amax16(active(), words(src), src.size(), DType::f16); }
float amax_bf16(std::span<const bf16> src) { return amax16(active(), words(src), src.size(), DType::bf16); }
float amax_f32(std::span<const float> src) {
  static const KernelTable& table = amax_table(active_isa());
  return amax32(table, src.data(), src.size());
}

float amax_f16(Isa isa, std::span<const f16> src) { return amax16(table_of(isa), words(src), src.size(), DType::f16); }
float amax_bf16(Isa isa, std::span<const bf16> src) {
  return amax16(table_of(isa), words(src), src.size(), DType::bf16);
}
float amax_f32(Isa isa, std::span<const float> src) { return amax32(amax_table(isa), src.data(), src.size()); }

}  // namespace mixprec
