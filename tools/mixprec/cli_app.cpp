// The mixprec command line: registration, parsing and running (see cli_app.hpp).
//
// Exit codes: 0 success, 1 runtime failure, 2 bad command line.
#include "cli_app.hpp"

#include <fmt/core.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cmd_bench.hpp"
#include "cmd_export.hpp"
#include "cmd_formats.hpp"
#include "cmd_inspect.hpp"
#include "cmd_memory.hpp"
#include "cmd_advise.hpp"
#include "cmd_report.hpp"
#include "cmd_scaler.hpp"
#include "cmd_train.hpp"
#include "mixprec/version.hpp"

namespace mixprec::cli {
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

CommandLine::CommandLine() : app_{"mixprec: mixed-precision training toolkit", "mixprec"} {
  app_.set_version_flag("--version", mixprec::kVersionString);
  app_.require_subcommand(1);
  // The commands, in the order `mixprec --help` lists them.
  add_formats_command(app_, action_);
  add_bench_command(app_, action_);
  add_memory_command(app_, action_);
  add_scaler_command(app_, action_);
  add_train_commands(app_, action_);
  add_inspect_command(app_, action_);
  add_report_command(app_, action_);
  add_export_command(app_, action_);
  add_advise_command(app_, action_);
}

int CommandLine::parse(int argc, char** argv) {
  if (reject_unknown_command(app_, argc, argv)) return 2;
  try {
    app_.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app_.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app_.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app_.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "mixprec: error: {}\nRun 'mixprec --help' for usage.\n", e.what());
    return 2;
  }
  return action_ ? -1 : 2;
}

keys::Value flag_value(const keys::Spec& spec, const std::string& text) {
  try {
    return keys::parse_text(spec, text);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(e.what());
  }
}

int CommandLine::run() {
  try {
    return action_ ? action_() : 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mixprec: error: {}\n", e.what());
    return 1;
  }
}

}  // namespace mixprec::cli
