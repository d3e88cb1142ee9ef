// Private: the ISA regions of the SIMD back ends (*/cpu/*_avx2.cpp, *_avx512.cpp), the one
// place that names their target features. A back end includes every header it needs first,
// then opens one region around its kernels:
//
//   #include "core/simd_target.hpp"
//   #include "core/simd_reduce.hpp"
//   MIXPREC_TARGET_AVX2_F16C_FMA_BEGIN
//   ... kernels ...
//   MIXPREC_TARGET_END
//
// Why per function and not per file (the back-end files get no -m flags): only the
// functions defined inside a region are compiled for its ISA. The inline code of the headers
// included before it (the scalar reference that heads and tails run, std::) stays baseline
// code, so the linker can never hand an AVX2 or AVX-512 copy of it to the scalar back end.
// The kernels are entered only after isa_available() has checked the CPU.
//
// GCC selects the ISA with #pragma GCC target between push_options and pop_options. clang
// has no #pragma GCC target: it gets the same per-function target through its attribute
// pragma (fuzz builds use clang, docs/fuzzing.md).
//
// One macro per feature set a back end is compiled for, named for what it enables.
// avx2 brings popcnt (SSE4.2) in GCC and clang, so no set spells it out.
#pragma once

#if defined(__x86_64__)

#define MIXPREC_PRAGMA_(x) _Pragma(#x)

#if defined(__clang__)
#define MIXPREC_TARGET_BEGIN_(features) \
  MIXPREC_PRAGMA_(clang attribute push(__attribute__((target(features))), apply_to = function))
#define MIXPREC_TARGET_AVX512_BEGIN_(features) MIXPREC_TARGET_BEGIN_(features)
#define MIXPREC_TARGET_END MIXPREC_PRAGMA_(clang attribute pop)
#else
#define MIXPREC_TARGET_BEGIN_(features) \
  MIXPREC_PRAGMA_(GCC push_options) MIXPREC_PRAGMA_(GCC target(features)) MIXPREC_PRAGMA_(GCC diagnostic push)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), a self-initialised variable
// (__Y = __Y) that -W(maybe-)uninitialized reports in every caller. GCC only: clang knows no
// -Wmaybe-uninitialized (and -Werror rejects the unknown group).
#define MIXPREC_TARGET_AVX512_BEGIN_(features) \
  MIXPREC_TARGET_BEGIN_(features)               \
  MIXPREC_PRAGMA_(GCC diagnostic ignored "-Wmaybe-uninitialized") MIXPREC_PRAGMA_(GCC diagnostic ignored "-Wuninitialized")
#define MIXPREC_TARGET_END MIXPREC_PRAGMA_(GCC diagnostic pop) MIXPREC_PRAGMA_(GCC pop_options)
#endif

// AVX2 alone (formats/cpu/count_avx2.cpp; the AVX2 reductions of core/simd_reduce.hpp and the
// 8-lane minifloat encoder of formats/cpu/minifloat_simd.hpp).
#define MIXPREC_TARGET_AVX2_BEGIN MIXPREC_TARGET_BEGIN_("avx2")
// AVX2 and FMA (nn/cpu/layer_kernels_avx2.cpp, lowp/cpu/quantize_avx2.cpp).
#define MIXPREC_TARGET_AVX2_FMA_BEGIN MIXPREC_TARGET_BEGIN_("avx2,fma")
// AVX2, F16C and FMA (formats/cpu/bulk_avx2.cpp, kernels/cpu/unscale_avx2.cpp,
// optim/cpu/update_avx2.cpp).
#define MIXPREC_TARGET_AVX2_F16C_FMA_BEGIN MIXPREC_TARGET_BEGIN_("avx2,f16c,fma")

// AVX-512 F and BW with AVX2 (formats/cpu/count_avx512.cpp; the AVX-512 reductions of
// core/simd_reduce.hpp).
#define MIXPREC_TARGET_AVX512F_BW_BEGIN MIXPREC_TARGET_AVX512_BEGIN_("avx2,avx512f,avx512bw")
// AVX-512 F/BW/DQ/VL with AVX2 and FMA (nn/cpu/layer_kernels_avx512.cpp,
// lowp/cpu/quantize_avx512.cpp).
#define MIXPREC_TARGET_AVX512_FMA_BEGIN \
  MIXPREC_TARGET_AVX512_BEGIN_("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl")
// AVX-512 F/BW/DQ/VL and BF16 with AVX2, F16C and FMA (formats/cpu/bulk_avx512.cpp,
// kernels/cpu/unscale_avx512.cpp; their kernels that use an AVX512-BF16 instruction are
// only entered where the CPU has it).
#define MIXPREC_TARGET_AVX512_BF16_F16C_FMA_BEGIN \
  MIXPREC_TARGET_AVX512_BEGIN_("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
// AVX-512 F/BW/DQ/VL with AVX2, F16C and FMA, 512-bit vectors preferred where GCC
// vectorizes loops itself (optim/cpu/update_avx512.cpp; clang takes no such feature).
#if defined(__clang__)
#define MIXPREC_TARGET_AVX512_F16C_FMA_PREFER512_BEGIN \
  MIXPREC_TARGET_AVX512_BEGIN_("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl")
#else
#define MIXPREC_TARGET_AVX512_F16C_FMA_PREFER512_BEGIN \
  MIXPREC_TARGET_AVX512_BEGIN_("avx2,f16c,fma,avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#endif

#endif  // __x86_64__
