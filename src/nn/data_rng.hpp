// splitmix64: the one PRNG of the data layer (corpus generator and batch sampler).
// Integer-only, so every platform draws the same numbers.
#pragma once

#include <cstdint>

namespace mixprec::nn::detail {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ull;

constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The k-th output (k = 0, 1, ...) of splitmix64 whose state starts at mix64(seed).
constexpr std::uint64_t splitmix_at(std::uint64_t seed, std::uint64_t k) noexcept {
  return mix64(mix64(seed) + (k + 1) * kGolden);
}

class SplitMix {
 public:
  explicit constexpr SplitMix(std::uint64_t seed) noexcept : state_(mix64(seed)) {}
  constexpr std::uint64_t next() noexcept {
    state_ += kGolden;
    return mix64(state_);
  }
  // Uniform in [0, n) up to a bias below n / 2^64 (n > 0).
  constexpr std::uint64_t below(std::uint64_t n) noexcept { return next() % n; }
  // True with probability num / den.
  constexpr bool chance(std::uint64_t num, std::uint64_t den) noexcept { return below(den) < num; }

 private:
  std::uint64_t state_;
};

}  // namespace mixprec::nn::detail
