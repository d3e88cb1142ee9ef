#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `scaler` (subcommand `replay`); on a successful parse, sets action to the work to run.
void add_scaler_command(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
