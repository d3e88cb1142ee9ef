// libFuzzer target: the readers of a run folder, over a folder made of the input. The input
// is split at the first two lines that are exactly "--8<--" into config.json, log.jsonl and
// summary.json (a part that is absent is not written: a folder without that file), written
// to a folder of this process, and then read as every reader reads it:
//   - train::check_run_folder (the schema version first) and train::read_run_config;
//   - train::read_resume_config (what `mixprec train --resume` continues with);
//   - monitor::load_run (`mixprec report`, mixprec.report), then monitor::render_report;
//   - train::read_run_log and monitor::simulate under two presets (`mixprec scaler simulate`).
// A rejected folder is a std::exception naming the problem; anything else (a crash, an ASan or
// UBSan report, another exception type, a leak, a timeout) is a bug. Accepted folders must
// agree: a config.json that read_run_config accepts has a schema version 1 or 2; a log that
// load_run accepts has increasing steps, and read_run_log returns the same steps. See
// docs/fuzzing.md.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/report/report.hpp"
#include "mixprec/advise/simulate.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/train/run.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"

namespace {

namespace fs = std::filesystem;
using namespace mixprec;

// This process's folder, removed when the process exits.
struct Folder {
  fs::path path = fs::temp_directory_path() / ("mixprec_fuzz_run_folder_" + std::to_string(::getpid()));
  Folder() { fs::create_directories(path); }
  ~Folder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

const fs::path& folder() {
  static const Folder f;
  return f.path;
}

void put(const fs::path& p, const std::optional<std::string_view>& text) {
  std::error_code ec;
  fs::remove(p, ec);
  if (!text) return;
  std::ofstream(p, std::ios::binary).write(text->data(), static_cast<std::streamsize>(text->size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<std::optional<std::string_view>> parts(3);
  constexpr std::string_view kCut = "\n--8<--\n";
  std::size_t pos = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    const std::size_t cut = i < 2 ? in.find(kCut, pos) : std::string_view::npos;
    parts[i] = in.substr(pos, cut == std::string_view::npos ? std::string_view::npos : cut - pos);
    if (cut == std::string_view::npos) break;
    pos = cut + kCut.size();
  }
  // The first part is config.json unless it is empty; the log is always there when given.
  if (parts[0] && parts[0]->empty()) parts[0].reset();
  const fs::path& dir = folder();
  put(dir / "config.json", parts[0]);
  put(dir / "log.jsonl", parts[1] ? parts[1] : std::optional<std::string_view>(std::string_view()));
  put(dir / "summary.json", parts[2]);

  try {
    train::check_run_folder(dir);
    if (const auto rc = train::read_run_config(dir); rc && (rc->schema < 1 || rc->schema > train::kRunFolderSchema))
      std::abort();
  } catch (const std::exception&) {
  }
  try {
    (void)train::read_resume_config(dir);
  } catch (const std::exception&) {
  }
  std::vector<train::StepRecord> log;
  try {
    const monitor::ReportRun run = monitor::load_run(dir.string());
    for (std::size_t i = 1; i < run.records.size(); ++i)
      if (run.records[i].step <= run.records[i - 1].step) std::abort();
    log = train::read_run_log((dir / "log.jsonl").string());
    if (log.size() != run.records.size()) std::abort();
    for (std::size_t i = 0; i < log.size(); ++i)
      if (log[i].step != run.records[i].step) std::abort();
    (void)monitor::render_report({run});
  } catch (const std::exception&) {
  }
  for (const char* preset : {"torch", "keras"}) {
    try {
      (void)monitor::simulate(log, nn::Precision::fp16, loss_scale_preset(preset));
    } catch (const std::exception&) {
    }
  }
  return 0;
}
