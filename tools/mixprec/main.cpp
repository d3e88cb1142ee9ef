// mixprec: the command-line program. Parses once, at the edge, then runs one action.
//
// Exit codes: 0 success, 1 runtime failure, 2 bad command line.
#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "cmd_bench.hpp"
#include "cmd_formats.hpp"
#include "cmd_inspect.hpp"
#include "cmd_memory.hpp"
#include "cmd_scaler.hpp"
#include "cmd_train.hpp"
#include "mixprec/version.hpp"

namespace {

// CLI11 reports an unknown command only as "a subcommand is required": name it,
// at the top level and one level down (mixprec bench NAME, mixprec scaler NAME).
bool reject_unknown_command(const CLI::App& app, int argc, char** argv) {
  const CLI::App* level = &app;
  std::string path = "mixprec";
  for (int i = 1; i < argc && i <= 2; ++i) {
    const std::vector<const CLI::App*> subs = level->get_subcommands({});
    if (subs.empty() || argv[i][0] == '-') return false;
    const CLI::App* found = nullptr;
    std::string known;
    for (const CLI::App* sub : subs) {
      if (sub->check_name(argv[i])) found = sub;
      known += (known.empty() ? "" : ", ") + sub->get_name();
    }
    if (found == nullptr) {
      fmt::print(stderr, "mixprec: error: unknown command '{} {}'; commands of {}: {}\nRun '{} --help' for usage.\n",
                 path, argv[i], path, known, path);
      return true;
    }
    level = found;
    path += " " + found->get_name();
  }
  return false;
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
  mixprec::cli::add_train_commands(app, action);
  mixprec::cli::add_inspect_command(app, action);
  if (reject_unknown_command(app, argc, argv)) return 2;
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
