// The run folder: the one module that creates, locks, resumes, writes and reads the
// folder of a training run. `mixprec train --out DIR`, mixprec::torch::Telemetry and
// `mixprec compare` write it; `mixprec report`, the alerts and `mixprec scaler
// simulate` read it. Its schema (version kRunFolderSchema) is docs/run_folder.md:
//
//   config.json                 the run's configuration: a JSON object of TrainConfig keys
//   log.jsonl                   one step record per line (run_log.hpp), flushed per step
//   summary.json                the run's summary, written when it ends
//   ckpt-NNNNNNNN.safetensors   checkpoints (docs/checkpoints.md), the newest kept
//   .lock                       empty; locked (fcntl) by the one process writing the folder
//
// Every file but log.jsonl is replaced atomically (core/io.hpp); log.jsonl is appended
// and, on a resume, cut back atomically to the newest checkpoint's step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec::train {

inline constexpr int kRunFolderSchema = 1;

namespace run_files {
inline constexpr std::string_view config = "config.json";
inline constexpr std::string_view log = "log.jsonl";
inline constexpr std::string_view summary = "summary.json";
inline constexpr std::string_view lock = ".lock";
}  // namespace run_files

// ---- checkpoints ------------------------------------------------------------------------

// dir / "ckpt-<step, at least 8 digits>.safetensors".
std::filesystem::path checkpoint_path(const std::filesystem::path& dir, std::uint64_t step);
// The checkpoints in `dir`, ascending by step: regular files whose name is exactly what
// checkpoint_path gives for some step. Temporaries and other files are ignored; a
// missing folder has none. std::runtime_error when `dir` cannot be listed.
std::vector<std::pair<std::uint64_t, std::filesystem::path>> list_checkpoints(const std::filesystem::path& dir);
// Deletes all but the newest `keep` checkpoints of list_checkpoints(dir); nothing else.
// std::invalid_argument for keep == 0; std::runtime_error naming a file it cannot delete.
void prune_checkpoints(const std::filesystem::path& dir, std::size_t keep);

// ---- writing ------------------------------------------------------------------------------

// Whether `dir` exists and holds anything but its lock file (a run killed before it
// wrote config.json leaves only that). std::invalid_argument "KEY: 'DIR' exists and is
// not a folder" when it is a file.
bool run_folder_has_files(const std::filesystem::path& dir, std::string_view key = "out");

// The writer of one run folder, holding its lock for its lifetime: one writer at a time
// in a folder (a second process is refused, told which process holds it; a second
// RunFolder in this process too; the kernel drops the lock however the holder ends,
// SIGKILL included).
class RunFolder {
 public:
  enum class Mode { create, resume };
  // create: makes `dir` (and its parents), takes the lock and, holding it, requires the
  // folder empty: std::invalid_argument otherwise (a usage error: nothing is touched).
  // resume: `dir` must be a folder; takes the lock. `instead` ends create's message (what
  // the user may do instead of choosing a new folder); empty: mixprec train's --resume.
  RunFolder(std::filesystem::path dir, Mode mode, std::string_view instead = {});
  ~RunFolder();
  RunFolder(const RunFolder&) = delete;
  RunFolder& operator=(const RunFolder&) = delete;

  const std::filesystem::path& dir() const noexcept { return dir_; }
  std::filesystem::path file(std::string_view name) const { return dir_ / name; }

  // A process killed inside an atomic write leaves its temporary ".NAME.tmp-PID[-N]".
  // Removes those of the folder's own files whose process is gone (a resume calls it, so
  // repeated crashes do not fill the disk); returns what it removed.
  std::vector<std::filesystem::path> remove_stale_temporaries();

  void write_config(std::string_view json);   // config.json, atomically
  void write_summary(std::string_view json);  // summary.json, atomically
  // Keeps the log lines of steps 1..step (in order, else std::runtime_error naming the
  // line) and drops the rest atomically; a last line cut short after `step` is dropped.
  void truncate_log(std::uint64_t step);
  // Appends one line (no newline in it) to log.jsonl and flushes it.
  void append_log(std::string_view line);

  std::filesystem::path checkpoint_path(std::uint64_t step) const { return train::checkpoint_path(dir_, step); }
  void prune_checkpoints(std::size_t keep) const { train::prune_checkpoints(dir_, keep); }

 private:
  void release() noexcept;
  std::filesystem::path dir_;
  int lock_fd_ = -1;
  std::pair<std::uint64_t, std::uint64_t> held_{};  // the folder's device and inode
  std::FILE* log_ = nullptr;
};

// ---- reading ------------------------------------------------------------------------------

// Requires a readable run folder: `dir` exists, is a folder and has a log.jsonl.
// std::runtime_error otherwise, saying which and what writes one.
void check_run_folder(const std::filesystem::path& dir);
// The text of one of its files; nullopt when the file does not exist.
std::optional<std::string> read_run_file(const std::filesystem::path& dir, std::string_view name);

}  // namespace mixprec::train
