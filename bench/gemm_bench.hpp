// `mixprec bench gemm`: GFLOP/s of the oneDNN matmul behind mixprec::nn::Gemm for
// f32, bf16 and f16 (each native where the linked oneDNN has a fast matmul of that type on
// this CPU, and then also widened to f32 for comparison), at layer-like shapes and one
// attention head's, on 1 and 2 oneDNN threads, with the ratios to f32 from the same run
// (docs/gemm.md, docs/performance.md).
//
// Kept free of Google Benchmark types so that callers need only this header.
#pragma once

namespace mixprec::bench {

// argv[0] is the program name; the rest are Google Benchmark flags, applied after
// this suite's defaults. Returns 0, or 1 when an argument is not recognised.
// Call at most once per process.
int run_gemm(int argc, char** argv);

}  // namespace mixprec::bench
