#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace mixprec::cli {
// Registers `report RUN_DIR [RUN_DIR ...] [--out FILE.html] [--title TEXT]`: one
// self-contained HTML report of the runs (docs/report.md).
void add_report_command(CLI::App& app, std::function<int()>& action);

// For `mixprec compare`: the report of those of `run_dirs` that have a log.jsonl,
// written to OUT_DIR/report.html; returns its path. std::runtime_error on failure.
std::string write_compare_report(const std::vector<std::string>& run_dirs, const std::string& out_dir);
}  // namespace mixprec::cli
