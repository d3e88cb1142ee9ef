// mixprec: the command-line program. Parses once, at the edge, then runs one action.
// The commands are registered in cli_app.cpp (CommandLine::CommandLine, one
// add_*_command line each), which the fuzz target fuzz/fuzz_cli.cpp parses with too.
//
// Exit codes: 0 success, 1 runtime failure, 2 bad command line.
#include <cstdlib>

#include <unistd.h>

#include "cli_app.hpp"

int main(int argc, char** argv) {
  // OpenMP threads (oneDNN's and the layers') that spin while waiting starve each other
  // as soon as the machine is busy: `mixprec train` ran 13x slower beside one busy
  // process. Sleeping waiters cost about 10% on a quiet machine; OMP_WAIT_POLICY=active
  // restores spinning. GNU libgomp reads its environment when the library loads, before
  // main, so setting the variable here would change nothing: the program runs itself
  // again with it set (once: the second image finds it set), unless the user chose a policy.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
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
