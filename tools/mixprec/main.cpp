// mixprec: the command-line program. Parses once, at the edge, then runs one action.
//
// Exit codes: 0 success, 1 runtime failure, 2 bad command line.
#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <exception>
#include <functional>
#include <string>

#include "cmd_bench.hpp"
#include "cmd_formats.hpp"
#include "cmd_memory.hpp"
#include "cmd_scaler.hpp"
#include "mixprec/version.hpp"

namespace {

// CLI11 reports an unknown command only as "a subcommand is required": name it.
bool reject_unknown_command(const CLI::App& app, const char* word) {
  std::string known;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->check_name(word)) return false;
    known += (known.empty() ? "" : ", ") + sub->get_name();
  }
  fmt::print(stderr, "mixprec: error: unknown command '{}'; commands: {}\nRun 'mixprec --help' for usage.\n", word,
             known);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mixprec: mixed-precision training toolkit", "mixprec"};
  app.set_version_flag("--version", mixprec::kVersionString);
  app.require_subcommand(1);
  std::function<int()> action;
  mixprec::cli::add_formats_command(app, action);
  mixprec::cli::add_bench_command(app, action);
  mixprec::cli::add_memory_command(app, action);
  mixprec::cli::add_scaler_command(app, action);
  if (argc > 1 && argv[1][0] != '-' && reject_unknown_command(app, argv[1])) return 2;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "mixprec: error: {}\nRun 'mixprec --help' for usage.\n", e.what());
    return 2;
  }
  try {
    return action ? action() : 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mixprec: error: {}\n", e.what());
    return 1;
  }
}
