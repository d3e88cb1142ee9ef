// What converting a tensor to fp16 would do to it, counted without converting it: the
// ConversionStats of convert_counted<f16> (bulk.hpp) and the tensor's |max|, from the
// tensor's own codes in one read-only pass. fp16 and bf16 tensors are read as their 16-bit
// codes (never widened to fp32); fp32 as its 32-bit words.
//
// Why it needs no conversion: rounding to nearest even is monotonic in |x|, so each
// outcome class of a conversion to fp16 (zero, underflow to zero, subnormal, normal,
// overflow, inf/NaN input) is a range of the source's magnitude bits (the code with its
// sign bit cleared, ordered as the magnitudes are). A pass counts, for five bounds of those
// ranges, how many magnitudes lie above each, and the largest magnitude:
//   nonzero = above(0), underflow = above(0) - above(U), subnormal = above(U) - above(N - 1),
//   overflow = above(O - 1) - above(I - 1), nonfinite_input = above(I - 1),
// with U the largest magnitude that rounds to 0, N the smallest that rounds to a normal
// fp16, O the smallest that rounds past 65504, I the magnitude bits of inf (table in
// src/formats/count.cpp; tests/formats/test_count.cpp checks every 16-bit code of both
// formats and the fp32 words around each bound against convert_counted, on every back end).
//
//   fp16 tensor: its values as stored (underflow and overflow are 0: it is fp16 already);
//   bf16, fp32:  what fp16 would flush or overflow at scale 1.
//
// amax: the largest |x| as fp32 (exact: every fp16 and bf16 value is one), +inf when the
// tensor holds inf or NaN, 0 for an empty one: measure_amax's convention.
//
// Back end: chosen once through active_isa() (scalar reference, AVX2, AVX-512 BW); the
// overloads taking an Isa run a named one (tests, benchmarks) and throw
// std::invalid_argument when it is not available.
#pragma once

#include <cstdint>
#include <span>

#include "mixprec/formats/dtype.hpp"
#include "mixprec/core/isa.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/types.hpp"

namespace mixprec {

struct CountedTensor {
  ConversionStats stats;
  float amax = 0.0f;
  friend bool operator==(const CountedTensor&, const CountedTensor&) = default;
};

CountedTensor count_f16_as_stored(std::span<const f16> src);
CountedTensor count_bf16_to_f16(std::span<const bf16> src);
CountedTensor count_f32_to_f16(std::span<const float> src);

// The same numbers from a profile measured elsewhere (a GPU, with its own operations):
// `above[k]` = how many of the `elements` magnitudes (the source's words with the sign bit
// cleared) lie above count_bounds(source)[k], `max_bits` the largest magnitude. One
// definition of the counts, wherever the tensor lies.
std::span<const std::uint32_t, 5> count_bounds(DType source) noexcept;
CountedTensor counted_from_profile(DType source, std::uint64_t elements, std::span<const std::uint64_t, 5> above,
                                   std::uint32_t max_bits);

CountedTensor count_f16_as_stored(Isa isa, std::span<const f16> src);
CountedTensor count_bf16_to_f16(Isa isa, std::span<const bf16> src);
CountedTensor count_f32_to_f16(Isa isa, std::span<const float> src);

// The |max| alone, as CountedTensor::amax (exact; +inf when the tensor holds inf or NaN, 0
// when empty): one read-only pass of an unsigned max over the magnitude bits and no counts,
// 3-4x the counting pass's rate in cache, the same from memory (bench_count). The check for
// inf/NaN where no count is wanted: a tensor holds one iff its amax is inf (Telemetry's
// forward check).
float amax_f16(std::span<const f16> src);
float amax_bf16(std::span<const bf16> src);
float amax_f32(std::span<const float> src);

float amax_f16(Isa isa, std::span<const f16> src);
float amax_bf16(Isa isa, std::span<const bf16> src);
float amax_f32(Isa isa, std::span<const float> src);

}  // namespace mixprec
