// `mixprec bench optim` (also run by `mixprec bench scaler`): the fused Adam step
// (unscale + skip + update + model-copy refresh in one pass) against a memory copy
// of the same bytes and against the unfused sequence of passes, with a ratio table
// and the targets (docs/performance.md, "Fused optimizer step"); then the fused
// step of one tensor over the state formats (optim/state_format.hpp) against a copy of
// the bytes each combination moves, in paired rounds.
//
// Kept free of Google Benchmark types so that callers need only this header.
#pragma once

namespace mixprec::bench {

// argv[0] is the program name; the rest are Google Benchmark flags, applied after
// this suite's defaults, and the suite's own `--state-formats-only` (only the state
// formats' table) and `--no-state-formats` (without it). Returns 0, or 1 when an
// argument is not recognised.
// Targets are reported, never turned into the exit status.
int run_optim(int argc, char** argv);

}  // namespace mixprec::bench
