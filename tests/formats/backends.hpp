// The format kernels' back ends a test runs against the scalar reference: AVX2 and
// AVX-512 where the CPU has them, and on CPUs with AVX512-BF16 also the AVX-512 table
// without its bf16 instructions (what AVX-512 CPUs without AVX512-BF16 run), so both of
// its bf16 encodes are tested here. Those this CPU lacks are named in `missing`.
#pragma once

#include <string>
#include <vector>

#include "formats/kernels.hpp"  // private: both AVX-512 tables
#include "mixprec/core/isa.hpp"
#include "mixprec/formats/kernel_table.hpp"

namespace mixprec::test {

struct Backend {
  std::string name;
  const KernelTable* table;
};

// with_avx512: false leaves AVX-512 out (its table has its own kernels for f16/bf16 only).
inline std::vector<Backend> simd_backends(std::string& missing, bool with_avx512 = true) {
  std::vector<Backend> v;
  auto add_missing = [&](const std::string& what) { missing += (missing.empty() ? "" : ", ") + what; };
  if (const KernelTable* t = kernel_table(Isa::avx2)) v.push_back({"avx2", t});
  else add_missing("avx2");
  if (!with_avx512) return v;
  if (const KernelTable* t = kernel_table(Isa::avx512)) {
    v.push_back({cpu_has_avx512_bf16() ? "avx512 (AVX512-BF16)" : "avx512", t});
    if (cpu_has_avx512_bf16()) v.push_back({"avx512 (integer bf16)", detail::avx512_kernels(false)});
    else add_missing("avx512 with AVX512-BF16");
  } else {
    add_missing("avx512");
  }
  return v;
}

}  // namespace mixprec::test
