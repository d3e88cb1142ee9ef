#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `memory --params N [--optimizer adam|adamw|sgd|sgd-momentum]
// [--precision P]` (any precision preset, nn/precision.hpp): the bytes of each training buffer.
void add_memory_command(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
