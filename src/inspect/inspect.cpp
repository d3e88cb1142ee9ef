// The analysis behind `mixprec inspect`: one pass places every finite nonzero value among
// the sorted thresholds of all formats and scales; the counts per format and scale are
// prefix sums of that histogram (docs/inspect.md).
#include "mixprec/inspect/inspect.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "mixprec/core/parallel.hpp"

namespace mixprec::monitor {
namespace {

enum class Outcome { zero, subnormal, normal, overflow };

template <LowPrecisionFormat T>
Outcome outcome_of(float x) {
  const float r = decode(encode<T>(x));
  if (!std::isfinite(r)) return Outcome::overflow;
  if (r == 0.0f) return Outcome::zero;
  if (std::fabs(r) < format_traits<T>::min_normal) return Outcome::subnormal;
  return Outcome::normal;
}

// Smallest positive finite fp32 x with outcome_of(x) >= at_least (outcomes grow with |x|).
template <LowPrecisionFormat T>
float smallest_with(Outcome at_least) {
  std::uint32_t lo = 1, hi = 0x7f7fffffu;  // answer in [lo, hi]; hi qualifies for every outcome
  while (lo < hi) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (outcome_of<T>(std::bit_cast<float>(mid)) >= at_least) hi = mid;
    else lo = mid + 1;
  }
  return std::bit_cast<float>(lo);
}

template <LowPrecisionFormat T>
FormatThresholds thresholds_of() {
  return {smallest_with<T>(Outcome::subnormal), smallest_with<T>(Outcome::normal), smallest_with<T>(Outcome::overflow)};
}

float max_finite_of(FormatId f) { return format_row(f).max_finite; }

bool supported(FormatId f) { return static_cast<std::size_t>(f) < std::size(kFormatTable) && format_row(f).converts; }

// floor(log2 |x|) for finite nonzero x.
int exponent_of(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
  const auto e = static_cast<int>(b >> 23);
  if (e != 0) return e - 127;
  return kMinExponent + (31 - std::countl_zero(b));
}

struct Partial {
  std::uint64_t zeros = 0, nan = 0, inf = 0, finite_nonzero = 0;
  float amax = 0.0f, min_nonzero = std::numeric_limits<float>::infinity();
  std::vector<std::uint64_t> exponents;
  std::vector<std::uint64_t> buckets;
};

}  // namespace

std::string_view inspect_format_name(FormatId format) noexcept {
  return supported(format) ? format_row(format).label : "?";
}

FormatThresholds format_thresholds(FormatId format) {
  if (!supported(format))
    throw std::invalid_argument("format_thresholds: expected " + format_names(convertible_formats()));
  // Each format's thresholds, found once (a binary search over fp32 per threshold).
  static const std::vector<FormatThresholds> all = [] {
    std::vector<FormatThresholds> t(std::size(kFormatTable));
    for (const FormatId f : convertible_formats())
      t[static_cast<std::size_t>(f)] = visit_format(f, []<class T>(T) { return thresholds_of<T>(); });
    return t;
  }();
  return all[static_cast<std::size_t>(format)];
}

InspectReport inspect(std::span<const float> values, const InspectOptions& options) {
  if (options.max_scale_log2 < 0 || options.max_scale_log2 > 127)
    throw std::invalid_argument(std::string("inspect: max_scale_log2 must be in [0, 127], found ")
                                    .append(std::to_string(options.max_scale_log2)));
  for (const FormatId f : options.formats)
    if (!supported(f)) throw std::invalid_argument("inspect: formats must be " + format_names(convertible_formats()));
  const int kmax = options.max_scale_log2;
  const std::size_t nscales = static_cast<std::size_t>(kmax) + 1;

  // Every threshold of every format at every scale: |x| * 2^k >= t  <=>  |x| >= t * 2^-k,
  // exact in double (x * 2^k is exact in fp32 for k >= 0 unless it overflows fp32, and
  // then it is past every overflow threshold either way).
  std::vector<FormatThresholds> fth;
  std::vector<double> cuts;
  for (const FormatId f : options.formats) {
    fth.push_back(format_thresholds(f));
    for (int k = 0; k <= kmax; ++k) {
      cuts.push_back(std::ldexp(static_cast<double>(fth.back().nonzero), -k));
      cuts.push_back(std::ldexp(static_cast<double>(fth.back().normal), -k));
      cuts.push_back(std::ldexp(static_cast<double>(fth.back().overflow), -k));
    }
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  const std::size_t nbuckets = cuts.size() + 1;  // bucket b: exactly b cuts are <= |x|
  const std::size_t nexp = static_cast<std::size_t>(kMaxExponent - kMinExponent + 1);

  ThreadPool& pool = ThreadPool::global();
  std::vector<Partial> parts(pool.size());
  for (Partial& p : parts) {
    p.exponents.assign(nexp, 0);
    p.buckets.assign(nbuckets, 0);
  }
  pool.parallel_for(values.size(), 1024, std::size_t{1} << 16, [&](std::size_t begin, std::size_t end, unsigned w) {
    Partial& p = parts[w];
    for (std::size_t i = begin; i < end; ++i) {
      const float x = values[i];
      if (std::isnan(x)) {
        ++p.nan;
        continue;
      }
      if (std::isinf(x)) {
        ++p.inf;
        continue;
      }
      if (x == 0.0f) {
        ++p.zeros;
        continue;
      }
      const float a = std::fabs(x);
      ++p.finite_nonzero;
      p.amax = std::max(p.amax, a);
      p.min_nonzero = std::min(p.min_nonzero, a);
      ++p.exponents[static_cast<std::size_t>(exponent_of(a) - kMinExponent)];
      const auto b = std::upper_bound(cuts.begin(), cuts.end(), static_cast<double>(a)) - cuts.begin();
      ++p.buckets[static_cast<std::size_t>(b)];
    }
  });

  InspectReport r;
  r.max_scale_log2 = kmax;
  TensorStats& s = r.stats;
  s.count = values.size();
  s.exponent_counts.assign(nexp, 0);
  std::vector<std::uint64_t> buckets(nbuckets, 0);
  float min_nonzero = std::numeric_limits<float>::infinity();
  for (const Partial& p : parts) {
    s.zeros += p.zeros;
    s.nan += p.nan;
    s.inf += p.inf;
    s.finite_nonzero += p.finite_nonzero;
    s.amax = std::max(s.amax, p.amax);
    min_nonzero = std::min(min_nonzero, p.min_nonzero);
    for (std::size_t i = 0; i < nexp; ++i) s.exponent_counts[i] += p.exponents[i];
    for (std::size_t i = 0; i < nbuckets; ++i) buckets[i] += p.buckets[i];
  }
  if (s.finite_nonzero > 0) {
    s.min_nonzero = min_nonzero;
    const std::uint64_t half = (s.finite_nonzero + 1) / 2;
    std::uint64_t seen = 0;
    bool have_min = false, have_median = false;
    for (std::size_t i = 0; i < nexp; ++i) {
      if (s.exponent_counts[i] == 0) continue;
      const int e = static_cast<int>(i) + kMinExponent;
      if (!have_min) s.exponent_min = e;
      have_min = true;
      seen += s.exponent_counts[i];
      if (!have_median && seen >= half) {
        s.exponent_median = e;
        have_median = true;
      }
      s.exponent_max = e;
    }
  }

  // below[j] = number of values with |x| < cuts[j].
  std::vector<std::uint64_t> below(cuts.size(), 0);
  std::uint64_t acc = 0;
  for (std::size_t j = 0; j < cuts.size(); ++j) {
    acc += buckets[j];
    below[j] = acc;
  }
  auto count_below = [&](double t) {
    const auto j = std::lower_bound(cuts.begin(), cuts.end(), t) - cuts.begin();
    return below[static_cast<std::size_t>(j)];
  };

  for (std::size_t fi = 0; fi < options.formats.size(); ++fi) {
    FormatInspection fr;
    fr.format = options.formats[fi];
    const FormatThresholds& t = fth[fi];
    fr.scales.resize(nscales);
    for (int k = 0; k <= kmax; ++k) {
      ScaleOutcome& o = fr.scales[static_cast<std::size_t>(k)];
      o.scale_log2 = k;
      const std::uint64_t under = count_below(std::ldexp(static_cast<double>(t.nonzero), -k));
      const std::uint64_t not_normal = count_below(std::ldexp(static_cast<double>(t.normal), -k));
      const std::uint64_t fits = count_below(std::ldexp(static_cast<double>(t.overflow), -k));
      o.underflow = under;
      o.subnormal = not_normal - under;
      o.overflow = s.finite_nonzero - fits;
      o.normal = fits - not_normal;
    }
    const double maxf = static_cast<double>(max_finite_of(fr.format));
    if (s.finite_nonzero == 0) {
      fr.advice = Advice::no_values;
    } else if (fr.scales[0].overflow > 0) {
      fr.advice = Advice::overflows_always;
      int j = -1;
      while (std::ldexp(static_cast<double>(s.amax), j) >= static_cast<double>(t.overflow)) --j;
      fr.fitting_log2 = j;
    } else {
      fr.advice = Advice::scale;
      int best = 0;
      for (int k = 1; k <= kmax; ++k) {
        const ScaleOutcome& o = fr.scales[static_cast<std::size_t>(k)];
        if (o.overflow > 0) break;  // overflow never shrinks as k grows
        const ScaleOutcome& b = fr.scales[static_cast<std::size_t>(best)];
        if (o.underflow + o.subnormal < b.underflow + b.subnormal) best = k;
      }
      fr.recommended_log2 = best;
      fr.headroom_binades = std::log2(maxf / std::ldexp(static_cast<double>(s.amax), best));
    }
    r.formats.push_back(std::move(fr));
  }
  return r;
}

}  // namespace mixprec::monitor
