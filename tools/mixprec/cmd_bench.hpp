#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `bench formats|scaler|optim [benchmark flags...]`.
void add_bench_command(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
