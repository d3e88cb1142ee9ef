#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `train` (one run: flags or a JSON config, run folder, checkpoints, resume)
// and `compare` (the same run under each precision / loss-scale arrangement); on a
// successful parse, sets action to the work to run.
void add_train_commands(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
