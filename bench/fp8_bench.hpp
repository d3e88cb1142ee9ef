// `mixprec bench fp8`: FP8 quantize (fused amax) / dequantize, per-tensor and MX
// block scaling, judged in the same run against a copy of the same bytes and
// against the scalar references (see docs/performance.md).
#pragma once

namespace mixprec::bench {

// Runs the FP8 benchmarks, then prints the ratio table and the target
// (quantize and dequantize out of cache >= 85% of copy). Arguments as run_formats.
int run_fp8(int argc, char** argv);

}  // namespace mixprec::bench
