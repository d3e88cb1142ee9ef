// `mixprec report RUN_DIR [RUN_DIR ...] [--out FILE.html]`: one self-contained HTML
// file (inline SVG, no script, no network) of one or several run folders.
//
// Exit codes: 0 written, 1 a run folder cannot be read (missing, no log.jsonl, a
// malformed log line) or the report cannot be written (nothing is left behind then),
// 2 bad command line.
#include "cmd_report.hpp"
#include "cli_app.hpp"

#include <fmt/core.h>

#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "mixprec/report/report.hpp"
#include "mixprec/run/run_folder.hpp"

namespace mixprec::cli {
namespace {

namespace fs = std::filesystem;

struct ReportInputs {
  std::vector<std::string> dirs;
  std::string out;
  std::string title = "mixprec report";
};

int run_report(const ReportInputs& in) {
  try {
    std::vector<monitor::ReportRun> runs;
    for (const std::string& d : in.dirs) runs.push_back(monitor::load_run(d));
    monitor::make_names_unique(runs);
    // Before anything is written: a report never replaces a file of the runs it reads.
    const std::string out = monitor::report_output(in.dirs, in.out, "--out");
    monitor::ReportOptions o;
    o.title = in.title;
    monitor::write_report(out, runs, o);
    std::size_t steps = 0;
    for (const monitor::ReportRun& r : runs) steps += r.records.size();
    fmt::print("report: {} ({} run{}, {} steps)\n", out, runs.size(), runs.size() == 1 ? "" : "s", steps);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mixprec report: error: {}\n", e.what());
    return 1;
  }
}

}  // namespace

std::string write_compare_report(const std::vector<std::string>& run_dirs, const std::string& out_dir) {
  std::vector<monitor::ReportRun> runs;
  std::error_code ec;
  for (const std::string& d : run_dirs)
    if (fs::exists(fs::path(d) / train::run_files::log, ec)) runs.push_back(monitor::load_run(d));
  monitor::make_names_unique(runs);
  const std::string out = (fs::path(out_dir) / "report.html").string();
  monitor::ReportOptions o;
  o.title = "mixprec compare";
  monitor::write_report(out, runs, o);
  return out;
}

void add_report_command(CLI::App& app, std::function<int()>& action) {
  auto* cmd = app.add_subcommand(
      "report",
      "One self-contained HTML report of runs: loss, loss scale, skips, underflow, histograms, alerts, config");
  auto in = std::make_shared<ReportInputs>();
  cmd->add_option("run_dir", in->dirs, "Run folders written by mixprec train --out (or mixprec compare)")
      ->required()
      ->type_name("RUN_DIR");
  cmd->add_option("--out", in->out,
                  "The HTML file (default: RUN_DIR/report.html for one run, report.html for several)")
      ->type_name("FILE.html");
  cmd->add_option("--title", in->title, "Title of the report")->capture_default_str();
  cmd->callback([in, &action] { action = [in] { return run_report(*in); }; });
}

}  // namespace mixprec::cli
