// mixprec: the command-line program. Parses once, at the edge, then runs one action.
// The commands are registered in cli_app.cpp (CommandLine::CommandLine, one
// add_*_command line each), which the fuzz target fuzz/fuzz_cli.cpp parses with too.
//
// Exit codes: 0 success, 1 runtime failure, 2 bad command line.
#include <cstdlib>

#include "cli_app.hpp"

int main(int argc, char** argv) {
  // OpenMP threads (oneDNN's and the layers') that spin while waiting starve each other
  // as soon as the machine is busy: steps ran 2-8x slower in our measurements. Sleeping
  // waiters cost about 10% on a quiet machine. OMP_WAIT_POLICY=active restores spinning.
  // Set before the OpenMP runtime reads its environment (its first parallel region).
  setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
  mixprec::cli::CommandLine command_line;
  if (const int code = command_line.parse(argc, argv); code >= 0) return code;
  return command_line.run();
}
