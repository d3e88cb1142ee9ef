#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `advise RUN_DIR [--config FILE.json] [--candidates A,B,...] [--budget X] [--out DIR]`:
// the precision advisor over the samples a run folder holds (docs/advisor.md).
void add_advise_command(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
