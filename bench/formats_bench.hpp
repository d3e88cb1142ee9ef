// `mixprec bench formats`: Google Benchmark cases for the bulk format
// conversions, judged in the same run against a memory copy of the same byte
// volume and against the scalar reference (see docs/performance.md).
//
// Kept free of Google Benchmark types so that callers need only this header.
#pragma once

namespace mixprec::bench {

// Runs the format benchmarks, then prints the ratio table and the issue's
// targets (met / not met). argv[0] is the program name; the other arguments are
// Google Benchmark flags (--benchmark_filter=..., --benchmark_repetitions=N,
// --benchmark_out=file.json, ...), applied after this suite's defaults so they
// override them. Returns 0, or 1 when an argument is not recognised. Targets
// are reported, never turned into the exit status. Call at most once per process.
int run_formats(int argc, char** argv);

}  // namespace mixprec::bench
