#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `export` (subcommand `tensorboard RUN_DIR [--out DIR]`): a run folder's steps as
// a TensorBoard event file, written natively (docs/telemetry.md, "TensorBoard").
void add_export_command(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
