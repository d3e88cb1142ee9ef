// `mixprec bench gemm`: GFLOP/s of the oneDNN matmul behind mixprec::nn::Gemm for
// f32, bf16 (native where oneDNN has a bf16 matmul on this CPU, else widened to f32)
// and f16 (always widened), at layer-like shapes, on 1 and 2 oneDNN threads, with
// the bf16/f32 and f16/f32 ratios from the same run (docs/gemm.md, docs/performance.md).
//
// Kept free of Google Benchmark types so that callers need only this header.
#pragma once

namespace mixprec::bench {

// argv[0] is the program name; the rest are Google Benchmark flags, applied after
// this suite's defaults. Returns 0, or 1 when an argument is not recognised.
// Call at most once per process.
int run_gemm(int argc, char** argv);

}  // namespace mixprec::bench
