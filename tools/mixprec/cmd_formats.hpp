#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `formats`; on a successful parse, sets action to the work to run.
void add_formats_command(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
