// The run folder: the one module that creates, locks, resumes, writes and reads the
// folder of a training run. `mixprec train --out DIR`, mixprec::torch::Telemetry and
// `mixprec compare` write it; `mixprec report`, the alerts and `mixprec scaler
// simulate` read it. Its schema (version kRunFolderSchema) is docs/run_folder.md:
//
//   config.json                 the run's configuration: its schema version, its writer,
//                               TrainConfig keys and the loss scale's whole config
//   log.jsonl                   one step record per line (run_log.hpp), flushed per step
//   summary.json                the run's summary, written when it ends
//   ckpt-NNNNNNNN.safetensors   checkpoints (docs/checkpoints.md), the newest kept
//   .lock                       empty; locked (fcntl) by the one process writing the folder
//
// Every file but log.jsonl is replaced atomically (core/io.hpp); log.jsonl is appended
// (a failed append is undone: the log keeps whole lines only) and, on a resume, cut back
// atomically to the newest checkpoint's step. Every reader checks the schema version and
// reads regular files only; an output never lands on a file of an input run folder.
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

#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/run/config.hpp"

namespace mixprec::train {

// Version 2: config.json says its schema version, its writer and the loss scale's whole
// config. Readers read versions 1 and 2 and refuse any other.
inline constexpr int kRunFolderSchema = 2;

// Who wrote a run folder (config.json's "writer"). Only the engine's folders are resumed by
// the engine; a front door's folder is never written by another writer.
enum class RunWriter : std::uint8_t { engine, libtorch, python };
std::string_view run_writer_name(RunWriter w) noexcept;   // "engine", "libtorch", "python"
std::string_view run_writer_title(RunWriter w) noexcept;  // "mixprec train", "mixprec::torch::Telemetry (libtorch)", ...
std::optional<RunWriter> parse_run_writer(std::string_view name) noexcept;

namespace run_files {
inline constexpr std::string_view config = "config.json";
inline constexpr std::string_view log = "log.jsonl";
inline constexpr std::string_view summary = "summary.json";
inline constexpr std::string_view lock = ".lock";
inline constexpr std::string_view optimizer = "optimizer.jsonl";  // mixprec.torch.Telemetry(optimizer=)
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

// ---- config.json --------------------------------------------------------------------------

// config.json's text: {"run_folder_schema": 2, "writer": W, the TrainConfig keys `keys` (all
// when empty), "loss-scale-config": the loss scale's whole config (loss_scale_config_json;
// absent without loss scaling), "recipes": the recipe file the run read (recipes_json, its
// lowp::to_json; absent without one)}, indented by 2, with a final newline. `loss_scale`: the
// config of the run's scaler, overrides included; nullopt: the one c.loss_scale names.
std::string run_config_text(const TrainConfig& c, RunWriter writer, const std::vector<std::string_view>& keys = {},
                            const std::optional<LossScaleConfig>& loss_scale = std::nullopt,
                            std::string_view recipes_json = {});

// What a run folder's config.json says, checked: the schema version first (1 or 2; anything
// else is refused, naming what was found), then its writer, the loss-scale config and the
// TrainConfig keys (apply_json's rules). std::invalid_argument "WHERE: KEY: ..." otherwise.
struct RunConfig {
  int schema = 1;
  // nullopt: a version-1 folder of a front door (Telemetry; version 1 does not say which).
  // A version-1 folder whose config.json has every engine key ("steps") is the engine's.
  std::optional<RunWriter> writer;
  TrainConfig config;                       // the keys given, over TrainConfig's defaults
  std::optional<LossScaleConfig> loss_scale;  // "loss-scale-config", else what config.loss_scale names
  bool loss_scale_stored = false;           // loss_scale came from "loss-scale-config"
  std::optional<std::string> recipes;       // "recipes": the recipe file the run read (JSON text)
};
RunConfig parse_run_config(std::string_view text, std::string_view where);
// dir/config.json parsed; nullopt when it does not exist (a regular file only: see read_run_file).
std::optional<RunConfig> read_run_config(const std::filesystem::path& dir);
// "mixprec train" / "mixprec.torch.Telemetry (Python)" / ... ; for a version-1 front door's
// folder "a Telemetry (libtorch or Python)".
std::string run_writer_text(const RunConfig& c);

// ---- outputs ------------------------------------------------------------------------------

// Refuses an output file that would land on an input: std::invalid_argument "KEY: 'OUT' is
// the run folder 'DIR''s log.jsonl; ..." when `out` resolves (symlinks followed, hard links
// by inode) to a file of one of `run_dirs` or to one of `files`, or names a file a run folder
// owns there (config.json, log.jsonl, summary.json, .lock, a checkpoint or a temporary) even
// before it exists; such a name in any run folder (a folder with a log.jsonl or config.json)
// is refused too. Nothing is written; run it before anything is.
void check_output_not_input(const std::string& out, std::string_view key,
                            const std::vector<std::filesystem::path>& run_dirs,
                            const std::vector<std::filesystem::path>& files = {});

// ---- writing ------------------------------------------------------------------------------

// Whether `dir` exists and holds anything but its lock file (a run killed before it
// wrote config.json leaves only that). std::invalid_argument "KEY: 'DIR' exists and is
// not a folder" when it is a file.
bool run_folder_has_files(const std::filesystem::path& dir, std::string_view key = "out");

// What to tell a writer that found `dir` not empty: "choose a new folder", with ", or continue
// that run with --resume DIR" when the engine would write and the folder is the engine's.
std::string nonempty_folder_advice(const std::filesystem::path& dir, RunWriter writer);

// The writer of one run folder, holding its lock for its lifetime: one writer at a time
// in a folder (a second process is refused, told which process holds it; a second
// RunFolder in this process too; the kernel drops the lock however the holder ends,
// SIGKILL included).
class RunFolder {
 public:
  enum class Mode { create, resume };
  // create: makes `dir` (and its parents), takes the lock and, holding it, requires the
  // folder empty: std::invalid_argument otherwise (a usage error: nothing is touched).
  // resume: `dir` must be a folder; takes the lock. `writer` chooses the advice of the
  // messages (--resume is the engine's).
  RunFolder(std::filesystem::path dir, Mode mode, RunWriter writer = RunWriter::engine);
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
  // Creates log.jsonl, empty, if it does not exist: a folder with no step yet is a run
  // folder too (a Telemetry's, before its first record()).
  void create_log();
  void write_summary(std::string_view json);  // summary.json, atomically
  // Keeps the log lines of steps 1..step (in order, else std::runtime_error naming the
  // line) and drops the rest atomically; a last line cut short after `step` is dropped.
  void truncate_log(std::uint64_t step);
  // Appends one line (no newline in it) to log.jsonl in one write. A failed write (ENOSPC,
  // EFBIG, EIO) is undone: the log is cut back to its length before the call and the error
  // thrown (std::runtime_error naming the file and the system's reason); the next append may
  // succeed. When even the cut fails, every later append is refused (the log would hold a
  // torn line).
  void append_log(std::string_view line);

  std::filesystem::path checkpoint_path(std::uint64_t step) const { return train::checkpoint_path(dir_, step); }
  void prune_checkpoints(std::size_t keep) const { train::prune_checkpoints(dir_, keep); }

 private:
  void release() noexcept;
  std::filesystem::path dir_;
  RunWriter writer_;
  int lock_fd_ = -1;
  std::pair<std::uint64_t, std::uint64_t> held_{};  // the folder's device and inode
  int log_fd_ = -1;
  std::string log_broken_;  // why appends are refused ("": they are not)
};

// ---- reading ------------------------------------------------------------------------------

// Requires a readable run folder: `dir` exists, is a folder and has a log.jsonl, and its
// config.json (when there is one) is of a schema version this mixprec reads.
// std::runtime_error otherwise, saying which and what writes one.
void check_run_folder(const std::filesystem::path& dir);
// The text of one of its JSON files (config.json, summary.json, advice/advice.json); nullopt
// when the file does not exist. A FIFO, a device or a folder in its place is refused
// (std::runtime_error) before anything blocks on it, and so is a file over io::kMaxJsonFileBytes.
std::optional<std::string> read_run_file(const std::filesystem::path& dir, std::string_view name);

}  // namespace mixprec::train
