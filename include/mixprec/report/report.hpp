// `mixprec report`: one self-contained HTML file (inline SVG and CSS, no script, no
// network) of one or several training runs: loss curves (all runs in one chart), the
// loss scale with skipped steps marked, the skip rate, activation-gradient underflow
// (overall and per tensor), log2-magnitude histograms against the ranges of fp16,
// bf16, E4M3 and E5M2, the alerts, the configuration and the summary numbers.
// See docs/report.md.
//
//   std::vector<monitor::ReportRun> runs = {monitor::load_run("runs/a"), monitor::load_run("runs/b")};
//   monitor::write_report("report.html", runs);        // temp file + rename: no partial output
//
// Rendering works from in-memory runs (render_report), so tests and other tools need
// no files. Every text taken from a run (names, config values, alerts) is escaped.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/advise/advise.hpp"
#include "mixprec/run/step_record.hpp"

namespace mixprec::monitor {

// One alert as summary.json carries it ("alerts": [{id, step, last_step, steps,
// message, advice}, ...], monitor::alert_json).
struct ReportAlert {
  std::string id;                     // e.g. "scale-collapse"
  std::optional<std::uint64_t> step;  // first step the rule held, when it refers to one
  std::string severity;               // optional ("warning", "error", ...); shown when set
  std::string message;
  std::string advice;
  std::optional<std::uint64_t> last_step;  // last step it held
  std::optional<std::uint64_t> steps;      // steps on which it held
};

// summary.json's "optimizer_state" (mixprec.torch.Telemetry(optimizer=), docs/telemetry.md):
// the optimizer state's formats, its bytes per parameter and, per tensor, the moments'
// relative quantization error and the lost updates over the sampled steps.
struct ReportOptimizerTensor {
  std::string name;
  std::uint64_t elements = 0;
  std::string master, m, v;       // the formats as stored (small tensors keep fp32 moments)
  std::uint64_t steps = 0;        // sampled steps that measured it (0: none; the rest is NaN)
  double m_error = 0, m_error_max = 0, v_error = 0, v_error_max = 0;  // mean and max over them
  double lost_fraction = 0;       // lost / meant over them
  std::uint64_t meant = 0;        // elements the steps meant to move
};
struct ReportOptimizerState {
  std::string optimizer;          // "mixprec.torch.optim.AdamW"
  // Per parameter group: (key, value text) in file order (master, m, v, block, rule, ...).
  std::vector<std::vector<std::pair<std::string, std::string>>> formats;
  // Bytes per parameter, measured from the state's tensors: the parameters themselves, the
  // master (fp32 copy or remainder), m and v (codes and scales).
  double params_bytes = 0, master_bytes = 0, m_bytes = 0, v_bytes = 0;
  std::uint64_t sampled_steps = 0;
  std::optional<double> lost_update_fraction;  // mean over the sampled steps; nullopt: none
  std::vector<ReportOptimizerTensor> tensors;
};

// One run as the report sees it.
struct ReportRun {
  std::string name;  // legend label, e.g. the run folder's name
  std::string dir;   // where it was read from (shown; may be empty)
  std::vector<train::StepRecord> records;
  // config.json as (key, value text) pairs in file order; empty when there was none.
  std::vector<std::pair<std::string, std::string>> config;
  // summary.json's "alerts": nullopt when not evaluated (no summary.json, or no
  // "alerts" in it), an empty vector when there were none.
  std::optional<std::vector<ReportAlert>> alerts;
  // advice/advice.json (`mixprec advise RUN_DIR`, docs/advisor.md): the precision advisor's
  // choice per layer and every measurement behind it; nullopt when the run has none.
  std::optional<advisor::Advice> advice;
  // summary.json's "optimizer_state"; nullopt when it has none.
  std::optional<ReportOptimizerState> optimizer;
};

// A run's figures, computed from its records (so an interrupted run without
// summary.json has them too): train::RunTotals over the log, final_loss NaN when the
// last step's loss was not finite or there is no step (RunTotals::shown_final_loss).
using RunNumbers = train::TrainSummary;
RunNumbers run_numbers(const std::vector<train::StepRecord>& records);

struct ReportOptions {
  std::string title = "mixprec report";
  int skip_window = 20;  // steps in the rolling skip rate
};

// The whole HTML document. Runs may be empty or have no steps; non-finite values
// are left out of the charts (their lines break there).
std::string render_report(const std::vector<ReportRun>& runs, const ReportOptions& options = {});

// Reads a run folder: log.jsonl (required), config.json, summary.json and advice/advice.json
// (optional). summary.json's "optimizer_state" is checked as it is read ("SUMMARY:
// optimizer_state.params[2].m_error: expected a number, found ...").
// std::runtime_error with a clear message: the folder does not exist or is not a
// folder, it has no log.jsonl, a malformed log line ("FILE:LINE: ..."), malformed JSON
// in config.json or summary.json. `name` empty: the folder's name.
ReportRun load_run(const std::string& dir, const std::string& name = {});

// Gives runs that share a name distinct legend labels (precision + loss scale from the
// config, then the folder path, then a number).
void make_names_unique(std::vector<ReportRun>& runs);

// The report file of `dirs`: `out`, or its default (RUN/report.html for one run, report.html
// for several), checked before anything is written: its folder exists, it is a new
// name or a regular file (io::output_file_problem: never a link, FIFO or folder), and it is
// none of the runs' own files (train::check_output_not_input). std::invalid_argument "KEY:
// ..." otherwise (`key`: "--out" for the CLI, "out" for Python).
std::string report_output(const std::vector<std::string>& dirs, const std::string& out, std::string_view key);

// render_report, written to a temporary file next to `path` and renamed over it, so a
// failure leaves no partial file. std::runtime_error when it cannot be written.
void write_report(const std::string& path, const std::vector<ReportRun>& runs, const ReportOptions& options = {});

}  // namespace mixprec::monitor
