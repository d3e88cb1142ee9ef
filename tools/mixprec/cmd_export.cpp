// `mixprec export tensorboard RUN_DIR [--out DIR]`: the steps of any run folder (mixprec
// train, compare rows, the Python and libtorch Telemetry) as one TensorBoard event file,
// written by monitor::event_file (no Python, no TensorFlow).
//
// Exit codes: 0 written, 1 the run folder cannot be read or the output folder is not
// usable (nothing is written then), 2 bad command line.
#include "cmd_export.hpp"

#include <fmt/core.h>
#include <sys/stat.h>

#include <cmath>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/report/tensorboard.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"

namespace mixprec::cli {
namespace {

namespace fs = std::filesystem;

// The suffix of the files this command writes: a later export of the same run replaces
// them (they are derived from the run folder: nothing is lost), and only them.
constexpr std::string_view kExportSuffix = ".mixprec-export";

struct ExportInputs {
  std::string dir;
  std::string out;  // default RUN_DIR/tensorboard
};

bool is_event_file(const std::string& name) { return name.find("tfevents") != std::string::npos && name[0] != '.'; }

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The event files already in `out` that an export wrote; an error for any other writer's
// (TensorBoard would show both runs' points as one).
std::vector<fs::path> previous_exports(const fs::path& out) {
  std::vector<fs::path> mine;
  std::error_code ec;
  if (!fs::exists(out, ec)) return mine;
  if (!fs::is_directory(out, ec))
    throw std::runtime_error("--out: '" + out.string() + "' exists and is not a folder; expected a folder for the event file");
  for (const fs::directory_entry& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    if (!is_event_file(name)) continue;
    if (!ends_with(name, kExportSuffix) || !e.is_regular_file())
      throw std::runtime_error("--out: '" + out.string() + "' holds the event file '" + name +
                               "' of another writer; TensorBoard would mix both into one run: choose another --out");
    mine.push_back(e.path());
  }
  return mine;
}

// The temporaries of exports that were killed: hidden, never loaded, removed here.
void remove_dead_temporaries(const fs::path& out) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(out, ec)) {
    std::string_view target;
    const std::string name = e.path().filename().string();
    const auto pid = io::atomic_temporary_pid(name, &target);
    if (pid && (target == "mixprec-export" || is_event_file(std::string(target))) && io::writer_gone(*pid))
      fs::remove(e.path(), ec);
  }
}

int run_export(const ExportInputs& in) {
  try {
    const fs::path dir(in.dir);
    std::error_code ec;
    train::check_run_folder(dir);  // a folder with a log.jsonl, and a config.json of a schema version this mixprec reads
    const fs::path log = dir / train::run_files::log;
    const std::vector<train::StepRecord> records = train::read_run_log(log.string());
    const fs::path out = in.out.empty() ? dir / "tensorboard" : fs::path(in.out);
    const std::vector<fs::path> old = previous_exports(out);

    // The run's start: the log's last write less the steps' time (the log holds no clock).
    struct stat st {};
    double last_write = 0;
    if (::stat(log.c_str(), &st) == 0)
      last_write = static_cast<double>(st.st_mtim.tv_sec) + 1e-9 * static_cast<double>(st.st_mtim.tv_nsec);
    double seconds = 0;
    for (const train::StepRecord& r : records)
      if (std::isfinite(r.seconds) && r.seconds > 0) seconds += r.seconds;
    const double start = std::max(0.0, last_write - seconds);

    fs::create_directories(out, ec);
    if (ec) throw std::runtime_error("--out: cannot create '" + out.string() + "': " + ec.message());
    // A later export of the run replaces the earlier one under its name, in one rename:
    // TensorBoard then sees the old file or the new one, never both (it would show each
    // step twice). The temporary's name holds no "tfevents", so a killed export leaves
    // nothing TensorBoard loads.
    const fs::path file =
        !old.empty() ? old.front()
                     : out / fmt::format("events.out.tfevents.{:010d}{}", static_cast<long long>(start), kExportSuffix);
    const std::string bytes = monitor::event_file(records, start);
    io::AtomicWriteOptions options;
    options.temporary_name = "mixprec-export";
    io::write_file_atomic(file, bytes, options, "event file '" + file.string() + "'");
    for (const fs::path& p : old)
      if (p != file) fs::remove(p, ec);  // more than one: left by an older mixprec; the new file has every step
    remove_dead_temporaries(out);

    std::size_t scalars = 0;
    monitor::StepScalars count;
    for (const train::StepRecord& r : records) scalars += count.add(r).size();
    fmt::print("tensorboard: {} ({} steps, {} scalars); view with: tensorboard --logdir {}\n", file.string(),
               records.size(), scalars, out.string());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mixprec export tensorboard: error: {}\n", e.what());
    return 1;
  }
}

}  // namespace

void add_export_command(CLI::App& app, std::function<int()>& action) {
  auto* exp = app.add_subcommand("export", "Write a run folder in another tool's format (TensorBoard)");
  exp->require_subcommand(1);
  auto* tb = exp->add_subcommand(
      "tensorboard", "A run folder's steps (loss, scale, skips, grad norm, underflow per layer) as a TensorBoard event file");
  auto in = std::make_shared<ExportInputs>();
  tb->add_option("run_dir", in->dir, "Run folder (mixprec train --out, the Python or libtorch Telemetry)")
      ->required()
      ->type_name("RUN_DIR");
  tb->add_option("--out", in->out, "Folder of the event file (default: RUN_DIR/tensorboard)")->type_name("DIR");
  tb->callback([in, &action] { action = [in] { return run_export(*in); }; });
}

}  // namespace mixprec::cli
