#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace mixprec::cli {
// Registers `inspect FILE.npy [--json] [--formats fp16,bf16,e4m3,e5m2] [--max-scale-log2 24]
// [--every N]`: what each format would lose at static scales 2^0 .. 2^max, and which to use.
void add_inspect_command(CLI::App& app, std::function<int()>& action);
}  // namespace mixprec::cli
