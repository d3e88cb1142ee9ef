// The mixprec command line as an object: every command registered on one CLI::App,
// parsing separate from running. main.cpp parses then runs; the fuzz target
// fuzz/fuzz_cli.cpp only parses (no action runs: no training, no file written).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

#include "mixprec/core/keys.hpp"

namespace mixprec::cli {

// A number a flag gives, read as every config key reads one (keys::parse_text: the number
// grammar, then the flag's range): CLI::ValidationError "FLAG: expected ALLOWED, found 'TEXT'"
// otherwise, which the command line reports with exit 2. spec.name is the flag ("--params").
keys::Value flag_value(const keys::Spec& spec, const std::string& text);

class CommandLine {
 public:
  // Registers every command (add_*_command of cmd_*.hpp).
  CommandLine();
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  // Parses argv (argv[0] is the program). Returns -1 when the command line is good and
  // run() has an action to run; otherwise the exit code, after printing: 0 for --help
  // and --version (on stdout), 2 for a bad command line (the problem on stderr).
  // Messages go through CLI11 and fmt, never through exceptions.
  int parse(int argc, char** argv);

  // Runs the parsed command: its exit code, or 1 with "mixprec: error: ..." on stderr
  // when it throws. Actions refer to this object's options: run while it lives.
  int run();

 private:
  CLI::App app_;
  std::function<int()> action_;
};

}  // namespace mixprec::cli
