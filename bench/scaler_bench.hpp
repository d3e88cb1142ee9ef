// `mixprec bench scaler`: the loss-scaling kernels (unscale_and_check), each
// judged in the same run against a plain in-place multiply of the same bytes,
// the memory limit of an in-place update (see docs/performance.md).
//
// Kept free of Google Benchmark types so that callers need only this header.
#pragma once

namespace mixprec::bench {

// Runs the scaler benchmarks, then prints the ratio table and the issue's
// targets (met / not met). argv[0] is the program name; the other arguments
// are Google Benchmark flags, applied after this suite's defaults. Returns 0,
// or 1 when an argument is not recognised. Call at most once per process.
//
// To add cases (e.g. fused optimizer steps), add a register/report pair next
// to the unscale ones in scaler_bench.cpp: register with
// benchmark::RegisterBenchmark inside run_scaler, read the medians from the
// shared Collector after the run, and print a table of your own.
int run_scaler(int argc, char** argv);

}  // namespace mixprec::bench
