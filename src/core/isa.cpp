#include "mixprec/core/isa.hpp"

#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>  // __get_cpuid, __get_cpuid_count, bit_F16C
#endif

namespace mixprec {

std::string_view isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "unknown";
}

std::optional<Isa> parse_isa(std::string_view name) noexcept {
  if (name == "scalar") return Isa::scalar;
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  return std::nullopt;
}

static bool cpu_has_avx2_f16c_fma() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
#if defined(__clang__)
  // clang 14's __builtin_cpu_supports does not know "f16c": CPUID leaf 1, ECX bit 29.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
#else
  const bool f16c = __builtin_cpu_supports("f16c");
#endif
  return __builtin_cpu_supports("avx2") && f16c && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

static bool cpu_has_avx512() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return cpu_has_avx2_f16c_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// Bit `bit` of register `reg` (0 EAX .. 3 EDX) of CPUID leaf 7, sub-leaf `sub`. Callers keep the
// answer in a static: CPUID traps to the hypervisor in a VM (microseconds), and
// kernel_table(avx512) asks on every call.
[[maybe_unused]] static bool cpuid7_bit(unsigned sub, int reg, unsigned bit) noexcept {
#if defined(__x86_64__)
  unsigned r[4] = {};
  if (__get_cpuid_count(7, sub, &r[0], &r[1], &r[2], &r[3]) == 0) return false;
  return (r[reg] >> bit & 1u) != 0;
#else
  (void)sub, (void)reg, (void)bit;
  return false;
#endif
}

bool cpu_has_avx512_bf16() noexcept {
  static const bool has = cpuid7_bit(1, 0, 5);  // CPUID.(EAX=7,ECX=1):EAX[5] = AVX512_BF16
  return has;
}

bool cpu_has_avx512_fp16() noexcept {
  static const bool has = cpuid7_bit(0, 3, 23);  // CPUID.(EAX=7,ECX=0):EDX[23] = AVX512_FP16
  return has;
}

bool cpu_has_amx_fp16() noexcept {
  static const bool has = cpuid7_bit(1, 0, 21);  // CPUID.(EAX=7,ECX=1):EAX[21] = AMX_FP16
  return has;
}

bool isa_available(Isa isa) noexcept {
  switch (isa) {
    case Isa::scalar: return true;
    // The AVX2 back ends (src/*/cpu/*_avx2.cpp) are compiled in on x86-64, the only
    // target where the CPU check can succeed.
    case Isa::avx2: return cpu_has_avx2_f16c_fma();
    // The AVX-512 kernels (src/*/cpu/*_avx512.cpp) likewise; they include AVX2's.
    case Isa::avx512: return cpu_has_avx512();
  }
  return false;
}

Isa best_isa() noexcept {
  if (isa_available(Isa::avx512)) return Isa::avx512;
  return isa_available(Isa::avx2) ? Isa::avx2 : Isa::scalar;
}

static Isa choose_isa() {
  const char* env = std::getenv("MIXPREC_ISA");
  if (env == nullptr || *env == '\0') return best_isa();
  const auto isa = parse_isa(env);
  if (!isa) {
    throw std::invalid_argument(std::string("MIXPREC_ISA='") + env +
                                "' is not a back end; allowed: scalar, avx2, avx512");
  }
  if (!isa_available(*isa)) {
    throw std::invalid_argument(std::string("MIXPREC_ISA='") + env +
                                "' is not available on this CPU or build; best here is " +
                                std::string(isa_name(best_isa())));
  }
  return *isa;
}

Isa active_isa() {
  static const Isa isa = choose_isa();
  return isa;
}

}  // namespace mixprec
