// What a tensor would lose in each low-precision format under a static power-of-two
// scale, and which scale to use: the analysis behind `mixprec inspect FILE.npy`.
// See docs/inspect.md.
//
// For each format (f16, bf16, f8e4m3, f8e5m2) and each scale 2^k, k = 0 .. max_scale_log2,
// the finite nonzero values x are counted by what converting x * 2^k does to them under
// the library's default rules (round to nearest even, Overflow::ieee, Subnormals::keep;
// exactly what convert_counted reports with ConvertOptions::scale = 2^k): underflow to
// +-0, a subnormal result, or overflow (inf; NaN for E4M3). Zeros and inf/NaN inputs are
// counted separately and are in none of the fractions.
//
// Recommended static scale, per format: among k in [0, max_scale_log2] with no overflow,
// the k with the fewest values lost to underflow or subnormals; of equally good k, the
// smallest (it keeps the most headroom above amax). Since underflow and subnormal counts
// never grow with k and overflow never shrinks, this is the smallest k that reaches the
// best normal fraction that any overflow-free scale reaches.
//
// Cost: one pass over the values (split over ThreadPool::global()), each value placed
// among the sorted thresholds by binary search; no conversion is run per scale.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "mixprec/formats/types.hpp"

namespace mixprec::monitor {

// Per format: the smallest positive fp32 magnitudes whose conversion (round to nearest
// even, IEEE overflow, gradual underflow) gives a nonzero result, a normal (or
// overflowing) result, and an overflow. Found by search over the scalar reference encode,
// so they are the library's rules by construction. x underflows iff |x| < nonzero, is
// subnormal iff nonzero <= |x| < normal, overflows iff |x| >= overflow.
struct FormatThresholds {
  float nonzero;
  float normal;
  float overflow;
};
// Throws std::invalid_argument for a format without conversion kernels (f32, e8m0).
FormatThresholds format_thresholds(FormatId format);

// The format's label, "fp16", "bf16", "e4m3", "e5m2" (`mixprec inspect --formats` takes it).
std::string_view inspect_format_name(FormatId format) noexcept;

struct InspectOptions {
  std::vector<FormatId> formats = convertible_formats();  // every format with conversion kernels
  int max_scale_log2 = 24;  // scales 2^0 .. 2^max_scale_log2; 0 .. 127
};

// floor(log2|x|) of finite nonzero fp32 values lies in [kMinExponent, kMaxExponent].
inline constexpr int kMinExponent = -149;
inline constexpr int kMaxExponent = 127;

struct TensorStats {
  std::uint64_t count = 0;           // all values
  std::uint64_t zeros = 0;           // +-0
  std::uint64_t nan = 0;             // NaN inputs
  std::uint64_t inf = 0;             // +-inf inputs
  std::uint64_t finite_nonzero = 0;  // what the fractions are of
  float amax = 0.0f;                 // largest finite magnitude (0 when none)
  float min_nonzero = 0.0f;          // smallest nonzero finite magnitude (0 when none)
  // exponent_counts[e - kMinExponent] = number of finite nonzero x with floor(log2|x|) == e.
  std::vector<std::uint64_t> exponent_counts;
  // Of floor(log2|x|) over the finite nonzero values (0 when there are none); the median
  // is the lower median (the ceil(n/2)-th smallest).
  int exponent_min = 0, exponent_median = 0, exponent_max = 0;
};

// Of the finite nonzero values, converted at scale 2^scale_log2.
struct ScaleOutcome {
  int scale_log2 = 0;
  std::uint64_t underflow = 0;  // became +-0
  std::uint64_t subnormal = 0;  // became a subnormal
  std::uint64_t overflow = 0;   // rounded past max finite
  std::uint64_t normal = 0;     // the rest: finite_nonzero - the three above
};

enum class Advice : std::uint8_t {
  scale,             // recommended_log2 is the rule's choice
  no_values,         // no finite nonzero values: nothing to scale
  overflows_always,  // even 2^0 overflows; fitting_log2 < 0 says which scale would not
};

struct FormatInspection {
  FormatId format = FormatId::f16;
  std::vector<ScaleOutcome> scales;  // scales[k] is scale 2^k
  Advice advice = Advice::no_values;
  int recommended_log2 = 0;          // Advice::scale
  double headroom_binades = 0;       // Advice::scale: log2(max_finite / (amax * 2^recommended_log2))
  int fitting_log2 = 0;              // Advice::overflows_always: largest k < 0 with amax * 2^k not overflowing
};

struct InspectReport {
  int max_scale_log2 = 24;
  TensorStats stats;
  std::vector<FormatInspection> formats;  // in the order of InspectOptions::formats
};

// Throws std::invalid_argument for a format other than the four, or max_scale_log2
// outside [0, 127].
InspectReport inspect(std::span<const float> values, const InspectOptions& options = {});

// n / finite_nonzero as a fraction (0 when there are no finite nonzero values).
inline double fraction_of(std::uint64_t n, const TensorStats& s) noexcept {
  return s.finite_nonzero == 0 ? 0.0 : static_cast<double>(n) / static_cast<double>(s.finite_nonzero);
}

}  // namespace mixprec::monitor
