// Run-time choice of the kernel back end (instruction set): made once, at the edge.
//
// The public kernels use active_isa(), picked at first use from what the CPU reports
// (AVX-512 F/BW/DQ/VL with AVX2, F16C and FMA; else AVX2 with F16C and FMA; else
// scalar). The environment variable MIXPREC_ISA=scalar|avx2|avx512 overrides the choice
// (an unavailable or unknown value is an error at first use). Back ends nest: a kernel
// family without AVX-512 kernels runs its AVX2 ones under avx512 (today
// unscale_and_check, the optimizers' update loops, the f16/bf16 encodes, the counting
// pass, lowp::quantize and the layer kernels' GELU and softmax row have AVX-512 kernels;
// docs/performance.md).
// Tests and benchmarks reach each back end directly: the formats through kernel_table()
// (mixprec/formats/kernel_table.hpp), unscale_and_check and the optimizers through their
// Isa arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace mixprec {

enum class Isa : std::uint8_t { scalar, avx2, avx512 };

std::string_view isa_name(Isa isa) noexcept;
std::optional<Isa> parse_isa(std::string_view name) noexcept;
bool isa_available(Isa isa) noexcept;  // compiled in and supported by this CPU
Isa best_isa() noexcept;               // what the CPU supports best
// AVX512-BF16 (vcvtneps2bf16, vdpbf16ps): used inside the avx512 back end where it pays
// (the bf16 store of unscale_and_check) and reported by the GEMM (native bf16 dot products).
bool cpu_has_avx512_bf16() noexcept;
// AVX512-FP16 (fp16 arithmetic, accumulating in fp16) and AMX-FP16 (fp16 tiles accumulating in
// fp32): reported by the GEMM, whose f16 products accumulate in fp32 and so gain from the
// second only (docs/gemm.md).
bool cpu_has_avx512_fp16() noexcept;
bool cpu_has_amx_fp16() noexcept;
Isa active_isa();                      // best_isa(), or MIXPREC_ISA; throws if that is invalid

}  // namespace mixprec
