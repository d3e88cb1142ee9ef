// `mixprec bench train`: the time of one training step of the default `gpt` in each
// precision preset (fp32, fp16, bf16, fp16-pure), the ratios to fp32 from the same
// run, and the share of the step spent in loss-scaling work (check, unscale, clip,
// optimizer step, scale update) at the default 32 micro-batches (docs/performance.md).
#pragma once

namespace mixprec::bench {

// argv[0] is the program name; the rest are Google Benchmark flags, applied after
// this suite's defaults. Returns 0, or 1 when an argument is not recognised.
int run_train(int argc, char** argv);

}  // namespace mixprec::bench
