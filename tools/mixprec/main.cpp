// mixprec: the command-line program. Parses once, at the edge, then runs one action.
// The commands are registered in cli_app.cpp (CommandLine::CommandLine, one
// add_*_command line each), which the fuzz target fuzz/fuzz_cli.cpp parses with too.
//
// Exit codes: 0 success, 1 runtime failure, 2 bad command line.
#include <cstdlib>

#include <unistd.h>

#include "cli_app.hpp"

int main(int argc, char** argv) {
  // How OpenMP's waiting threads (oneDNN's and the layers') wait between parallel regions.
  // libgomp's default spins 300000 iterations before sleeping: fastest on an idle machine,
  // 10-20x slower `mixprec train` beside one busy process on two cores (the spinners take the
  // core the other process needs). Sleeping at once (spin count 0) holds the busy case but is
  // 1.8x slower on an idle machine (a wake-up per region). 1000 iterations, libgomp's own spin
  // count for an oversubscribed machine, measured 1.2x the idle optimum and 1.8x its own idle
  // time beside a busy process (docs/training.md; bench/scripts/busy_machine.sh).
  // libgomp reads its environment when the library loads, before main: setting it here alone
  // would change nothing, so the program runs itself again with it set (once: the second image
  // finds it set), unless the user chose a policy or a spin count.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    ::setenv("GOMP_SPINCOUNT", "1000", 1);
    char self[4096];  // the path itself, not /proc/self/exe: valgrind and others answer readlink for their client
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
      self[n] = '\0';
      ::execv(self, argv);  // returns only on failure: then run with the runtime's default
    }
  }
  mixprec::cli::CommandLine command_line;
  if (const int code = command_line.parse(argc, argv); code >= 0) return code;
  return command_line.run();
}
