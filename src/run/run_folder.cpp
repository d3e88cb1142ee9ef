// The run folder (include/mixprec/run/run_folder.hpp, docs/run_folder.md).
#include "mixprec/run/run_folder.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <map>
#include <stdexcept>

#include "mixprec/core/json_read.hpp"
#include "mixprec/core/io.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/run/run_log.hpp"

namespace mixprec::train {
namespace fs = std::filesystem;
using text::squote;
using ojson = nlohmann::ordered_json;

namespace {
constexpr std::string_view kSchemaKey = "run_folder_schema", kWriterKey = "writer",
                           kLossScaleConfigKey = "loss-scale-config", kRecipesKey = "recipes";
}  // namespace

// ---- writers ------------------------------------------------------------------------------

std::string_view run_writer_name(RunWriter w) noexcept {
  switch (w) {
    case RunWriter::engine: return "engine";
    case RunWriter::libtorch: return "libtorch";
    case RunWriter::python: return "python";
  }
  return "?";
}

std::string_view run_writer_title(RunWriter w) noexcept {
  switch (w) {
    case RunWriter::engine: return "mixprec train";
    case RunWriter::libtorch: return "mixprec::torch::Telemetry (libtorch)";
    case RunWriter::python: return "mixprec.torch.Telemetry (Python)";
  }
  return "?";
}

std::optional<RunWriter> parse_run_writer(std::string_view name) noexcept {
  for (const RunWriter w : {RunWriter::engine, RunWriter::libtorch, RunWriter::python})
    if (run_writer_name(w) == name) return w;
  return std::nullopt;
}

// ---- checkpoints ------------------------------------------------------------------------

fs::path checkpoint_path(const fs::path& dir, std::uint64_t step) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "ckpt-%08llu.safetensors", static_cast<unsigned long long>(step));
  return dir / buf;
}

namespace {

// The step of a file named as checkpoint_path names it (only that spelling, so no step
// appears twice); nullopt for any other name.
std::optional<std::uint64_t> checkpoint_step(std::string_view name) {
  constexpr std::string_view pre = "ckpt-", post = ".safetensors";
  if (!name.starts_with(pre) || !name.ends_with(post)) return std::nullopt;
  const std::string_view digits = name.substr(pre.size(), name.size() - pre.size() - post.size());
  if (digits.size() < 8 || digits.size() > 20) return std::nullopt;
  std::uint64_t step = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9' || __builtin_mul_overflow(step, 10u, &step) ||
        __builtin_add_overflow(step, static_cast<unsigned>(c - '0'), &step))
      return std::nullopt;
  }
  if (checkpoint_path("", step).filename() != name) return std::nullopt;
  return step;
}

}  // namespace

std::vector<std::pair<std::uint64_t, fs::path>> list_checkpoints(const fs::path& dir) {
  std::vector<std::pair<std::uint64_t, fs::path>> out;
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw std::runtime_error("checkpoint folder '" + dir.string() + "' cannot be read: " + ec.message());
  if (!fs::exists(st)) return out;
  if (!fs::is_directory(st))
    throw std::runtime_error("checkpoint folder '" + dir.string() + "' is not a folder");
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::optional<std::uint64_t> step = checkpoint_step(it->path().filename().string());
    if (!step) continue;
    // A folder (or device, ...) with a checkpoint's name would be skipped here and hit
    // when that checkpoint is written: refused at once, by name.
    std::error_code fec;
    if (!it->is_regular_file(fec))
      throw std::runtime_error("checkpoint '" + it->path().string() +
                               "' is not a regular file (a folder?); remove it: a checkpoint is "
                               "a file written by mixprec train");
    out.emplace_back(*step, it->path());
  }
  if (ec) throw std::runtime_error("checkpoint folder '" + dir.string() + "' cannot be listed: " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

void prune_checkpoints(const fs::path& dir, std::size_t keep) {
  if (keep == 0)
    throw std::invalid_argument("prune_checkpoints('" + dir.string() + "'): expected keep >= 1, found 0");
  const auto all = list_checkpoints(dir);
  if (all.size() <= keep) return;
  for (std::size_t i = 0; i < all.size() - keep; ++i) {
    std::error_code ec;
    fs::remove(all[i].second, ec);
    if (ec) throw std::runtime_error("cannot delete checkpoint '" + all[i].second.string() + "': " + ec.message());
  }
}

// ---- config.json --------------------------------------------------------------------------

std::string run_config_text(const TrainConfig& c, RunWriter writer, const std::vector<std::string_view>& keys,
                            const std::optional<LossScaleConfig>& loss_scale, std::string_view recipes_json) {
  ojson j = ojson::object();
  j[std::string(kSchemaKey)] = kRunFolderSchema;
  j[std::string(kWriterKey)] = std::string(run_writer_name(writer));
  const ojson config = ojson::parse(keys.empty() ? to_json(c) : to_json(c, keys));
  for (const auto& [k, v] : config.items()) j[k] = v;
  const std::optional<LossScaleConfig> ls = loss_scale ? loss_scale : loss_scale_config(c.loss_scale);
  if (ls) j[std::string(kLossScaleConfigKey)] = ojson::parse(loss_scale_config_json(*ls));
  if (!recipes_json.empty()) j[std::string(kRecipesKey)] = ojson::parse(recipes_json);
  return j.dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
}

RunConfig parse_run_config(std::string_view text, std::string_view where_) {
  const std::string where(where_);
  ojson doc = io::parse_ordered_json(text, where);
  if (!doc.is_object())
    throw std::invalid_argument(where + ": expected a JSON object of settings, found " + std::string(doc.type_name()));
  RunConfig rc;
  // The version first: a newer layout may mean anything by the other keys.
  if (const auto it = doc.find(kSchemaKey); it != doc.end()) {
    const std::string found = it->dump(-1, ' ', false, ojson::error_handler_t::replace);
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1 || it->get<std::int64_t>() > kRunFolderSchema)
      throw std::invalid_argument(where + ": " + std::string(kSchemaKey) + ": this mixprec reads run folders of " +
                                  "schema versions 1 to " + std::to_string(kRunFolderSchema) + ", found " + found +
                                  (it->is_number_integer() && it->get<std::int64_t>() > kRunFolderSchema
                                       ? " (written by a newer mixprec: read it with that version)"
                                       : ""));
    rc.schema = static_cast<int>(it->get<std::int64_t>());
    doc.erase(it);
  }
  if (const auto it = doc.find(kWriterKey); it != doc.end()) {
    const std::optional<RunWriter> w = it->is_string() ? parse_run_writer(it->get<std::string>()) : std::nullopt;
    if (!w)
      throw std::invalid_argument(where + ": " + std::string(kWriterKey) + ": expected \"engine\", \"libtorch\" or " +
                                  "\"python\", found " + it->dump(-1, ' ', false, ojson::error_handler_t::replace));
    rc.writer = w;
    doc.erase(it);
  } else if (rc.schema >= 2) {
    throw std::invalid_argument(where + ": " + std::string(kWriterKey) + ": missing (schema version " +
                                std::to_string(rc.schema) + " names the folder's writer)");
  } else if (doc.contains("steps")) {
    rc.writer = RunWriter::engine;  // version 1: the engine wrote every key, the front doors a few
  }
  std::optional<LossScaleConfig> stored;
  if (const auto it = doc.find(kLossScaleConfigKey); it != doc.end()) {
    try {
      stored = loss_scale_config_from_json(it->dump());
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(where + ": " + std::string(kLossScaleConfigKey) + "." + e.what());
    }
    doc.erase(it);
  }
  if (const auto it = doc.find(kRecipesKey); it != doc.end()) {
    if (!it->is_object())
      throw std::invalid_argument(where + ": " + std::string(kRecipesKey) + ": expected the recipe file's object, found " +
                                  std::string(it->type_name()));
    rc.recipes = it->dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
    doc.erase(it);
  }
  rc.config = apply_json(TrainConfig{}, doc.dump(), where);
  if (stored && rc.config.loss_scale == "none")
    throw std::invalid_argument(where + ": " + std::string(kLossScaleConfigKey) +
                                ": given for a run without loss scaling (loss-scale \"none\")");
  rc.loss_scale_stored = stored.has_value();
  rc.loss_scale = stored ? stored : loss_scale_config(rc.config.loss_scale);
  return rc;
}

std::optional<RunConfig> read_run_config(const fs::path& dir) {
  const std::optional<std::string> text = read_run_file(dir, run_files::config);
  if (!text) return std::nullopt;
  return parse_run_config(*text, "run config " + squote((dir / run_files::config).string()));
}

std::string run_writer_text(const RunConfig& c) {
  return c.writer ? std::string(run_writer_title(*c.writer)) : "a Telemetry (libtorch or Python)";
}

// ---- outputs ------------------------------------------------------------------------------

namespace {

// Whether `name` is a file a run folder owns (one the writers create there).
bool run_file_name(std::string_view name) {
  if (name == run_files::config || name == run_files::log || name == run_files::summary || name == run_files::lock ||
      name == run_files::optimizer)
    return true;
  if (checkpoint_step(name)) return true;
  std::string_view target;
  if (io::atomic_temporary_pid(name, &target)) return run_file_name(target);
  return false;
}

}  // namespace

void check_output_not_input(const std::string& out, std::string_view key, const std::vector<fs::path>& run_dirs,
                            const std::vector<fs::path>& files) {
  const std::string k(key);
  const auto out_id = io::file_identity(out);
  const fs::path out_path(out);
  const auto parent_id = io::file_identity(out_path.has_parent_path() ? out_path.parent_path() : fs::path("."));
  for (const fs::path& f : files) {
    if (out_id && io::file_identity(f) == out_id)
      throw std::invalid_argument(k + ": " + squote(out) + " is the input file " + squote(f.string()) +
                                  "; an output never replaces an input: choose another file name");
  }
  for (const fs::path& dir : run_dirs) {
    const auto dir_id = io::file_identity(dir);
    if (!dir_id) continue;
    const std::string advice =
        "; an output never replaces a file of a run folder: choose another file name (the report's default is " +
        (dir / "report.html").string() + ")";
    // Named there by one of the folder's own names, whether or not it exists yet.
    if (parent_id == dir_id && run_file_name(out_path.filename().string()))
      throw std::invalid_argument(k + ": " + squote(out) + " is " + out_path.filename().string() +
                                  " of the run folder " + squote(dir.string()) + advice);
    if (!out_id) continue;
    if (out_id == dir_id)
      throw std::invalid_argument(k + ": " + squote(out) + " is the run folder " + squote(dir.string()) + " itself" +
                                  advice);
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      if (io::file_identity(it->path()) == out_id)  // a link to it, a hard link, the file itself
        throw std::invalid_argument(k + ": " + squote(out) + " is " + it->path().filename().string() +
                                    " of the run folder " + squote(dir.string()) + advice);
    }
  }
  // A run folder's own file, whichever run it belongs to (a folder with a log or a config).
  const fs::path parent = out_path.has_parent_path() ? out_path.parent_path() : fs::path(".");
  if (run_file_name(out_path.filename().string()) &&
      (io::file_identity(parent / run_files::log) || io::file_identity(parent / run_files::config)))
    throw std::invalid_argument(k + ": " + squote(out) + " is " + out_path.filename().string() +
                                " of the run folder " + squote(parent.string()) +
                                "; an output never replaces a file of a run folder: choose another file name");
}

// ---- writing ------------------------------------------------------------------------------

std::string nonempty_folder_advice(const fs::path& dir, RunWriter writer) {
  std::string advice = "choose a new folder";
  if (writer != RunWriter::engine) return advice;
  try {
    const std::optional<RunConfig> rc = read_run_config(dir);
    if (rc && rc->writer != RunWriter::engine) return advice;  // the engine never resumes another writer's run
  } catch (const std::exception&) {
    return advice;
  }
  return advice + ", or continue that run with --resume " + dir.string();
}

bool run_folder_has_files(const fs::path& dir, std::string_view key) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return false;
  if (!fs::is_directory(dir, ec))
    throw std::invalid_argument(std::string(key) + ": " + squote(dir.string()) + " exists and is not a folder");
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec))
    if (e.path().filename() != run_files::lock) return true;
  return false;
}

namespace {

// A POSIX record lock (fcntl F_SETLK) on the whole of DIR/.lock. The file stays empty:
// taking the lock changes nothing in the folder. Returns the open descriptor.
int lock_folder(const fs::path& dir, RunWriter writer) {
  const fs::path path = dir / run_files::lock;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0)
    throw std::runtime_error("cannot open the lock file " + squote(path.string()) + " of the run folder: " +
                             std::strerror(errno));
  struct flock want {};
  want.l_type = F_WRLCK;
  want.l_whence = SEEK_SET;
  if (::fcntl(fd, F_SETLK, &want) == 0) return fd;
  const int err = errno;
  std::string holder = "another process";
  struct flock held {};
  held.l_type = F_WRLCK;
  held.l_whence = SEEK_SET;
  if ((err == EACCES || err == EAGAIN) && ::fcntl(fd, F_GETLK, &held) == 0 && held.l_type != F_UNLCK &&
      held.l_pid > 0)
    holder = "process " + std::to_string(held.l_pid);
  ::close(fd);
  if (err != EACCES && err != EAGAIN)
    throw std::runtime_error("cannot lock the run folder " + squote(dir.string()) + " (" + squote(path.string()) +
                             "): " + std::strerror(err));
  std::string msg = "run folder " + squote(dir.string()) + " is in use by " + holder + " (it holds the lock on " +
                    squote(path.string()) + "); one writer at a time may write a run folder: ";
  if (writer == RunWriter::engine)
    msg += "wait for it to end, or stop it and continue with --resume " + dir.string() +
           " (when it is a mixprec train run)";
  else
    msg += "wait for that run to end (a Telemetry's close() releases it), or give this run a new folder";
  throw std::runtime_error(msg);
}

// fcntl locks belong to the process: a second lock of the same file by this process
// succeeds, and closing either descriptor drops both. So the folders this process holds
// are kept here too (by device and inode, with the holder's pid: a child made by fork
// inherits the table but not the locks), and a second RunFolder of one is refused.
std::mutex g_held_mutex;
std::map<std::pair<std::uint64_t, std::uint64_t>, pid_t> g_held;

// A folder to create or use: a file, a dangling link or a file among its parents is named
// as such, before create_directories would say only "File exists" or "Not a directory".
void check_new_folder(const fs::path& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode) && ::stat(dir.c_str(), &st) != 0) {
      std::error_code ec;
      throw std::invalid_argument("out: " + squote(dir.string()) + " is a symbolic link to " +
                                  squote(fs::read_symlink(dir, ec).string()) +
                                  ", which does not exist; expected a new folder, an empty folder or a link to one");
    }
    if (!S_ISDIR(st.st_mode)) {
      const char* kind = io::non_regular_kind(st.st_mode);
      throw std::invalid_argument("out: " + squote(dir.string()) + " exists and is not a folder (" +
                                  (kind ? kind : "a file") + "); expected a new folder or an empty one");
    }
    return;
  }
  for (fs::path p = dir.parent_path(); !p.empty() && p != p.root_path(); p = p.parent_path()) {
    if (::stat(p.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode))
        throw std::runtime_error("cannot create run folder " + squote(dir.string()) + ": " +
                                 std::strerror(ENOTDIR) + " (" + squote(p.string()) + " is not a folder)");
      return;
    }
  }
}

std::pair<std::uint64_t, std::uint64_t> identity(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw std::runtime_error("cannot read the run folder " + squote(dir.string()) + ": " + std::strerror(errno));
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

}  // namespace

RunFolder::RunFolder(fs::path dir, Mode mode, RunWriter writer) : dir_(std::move(dir)), writer_(writer) {
  std::error_code ec;
  if (mode == Mode::create) {
    check_new_folder(dir_);
    fs::create_directories(dir_, ec);
    if (ec) throw std::runtime_error("cannot create run folder " + squote(dir_.string()) + ": " + ec.message());
  } else if (!fs::is_directory(dir_, ec)) {
    throw std::invalid_argument("resume: " + squote(dir_.string()) + " is not a folder");
  }
  const auto id = identity(dir_);
  {
    const std::lock_guard guard(g_held_mutex);
    const auto [it, inserted] = g_held.emplace(id, ::getpid());
    if (!inserted && it->second != ::getpid()) it->second = ::getpid();  // the parent's entry, in a forked child
    else if (!inserted)
      throw std::runtime_error("run folder " + squote(dir_.string()) + " is in use by this process (another writer "
                               "of it is still open)");
  }
  try {
    lock_fd_ = lock_folder(dir_, writer_);
  } catch (...) {
    const std::lock_guard guard(g_held_mutex);
    g_held.erase(id);
    throw;
  }
  held_ = id;
  // Holding the lock, check again: another run may have used the folder since the
  // caller's own check.
  if (mode == Mode::create && run_folder_has_files(dir_, "out")) {
    release();
    throw std::invalid_argument("out: " + squote(dir_.string()) + " exists and is not empty; " +
                                nonempty_folder_advice(dir_, writer_) + " (a finished run is never overwritten)");
  }
}

RunFolder::~RunFolder() {
  if (log_fd_ >= 0) ::close(log_fd_);
  release();
}

void RunFolder::release() noexcept {
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = -1;
  const std::lock_guard guard(g_held_mutex);
  g_held.erase(held_);
}

std::vector<fs::path> RunFolder::remove_stale_temporaries() {
  std::vector<fs::path> removed;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    std::string_view target;
    const std::optional<long> pid = io::atomic_temporary_pid(name, &target);
    if (!pid || !e.is_regular_file(ec)) continue;
    const bool ours = target == run_files::config || target == run_files::log || target == run_files::summary ||
                      checkpoint_step(target).has_value();
    if (!ours) continue;
    if (!io::writer_gone(*pid)) continue;  // its writer may still run
    std::error_code rm;
    if (fs::remove(e.path(), rm)) removed.push_back(e.path());
  }
  return removed;
}

void RunFolder::write_config(std::string_view json) { io::write_file_atomic(file(run_files::config), json); }

void RunFolder::write_summary(std::string_view json) { io::write_file_atomic(file(run_files::summary), json); }

void RunFolder::truncate_log(std::uint64_t step) {
  const fs::path path = file(run_files::log);
  std::string text;
  std::error_code ec;
  if (fs::exists(path, ec)) text = io::read_regular_file(path);
  std::string kept;
  std::uint64_t last = 0;
  std::size_t line_no = 0;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t nl = std::min(text.find('\n', pos), text.size());
    const std::string_view line = std::string_view(text).substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    StepRecord r;
    try {
      r = parse_step_record(line);
    } catch (const std::invalid_argument& e) {
      if (last == step) break;  // after the checkpoint: a line cut short by a crash is dropped with the rest
      throw std::runtime_error(path.string() + ":" + std::to_string(line_no) + ": " + e.what());
    }
    if (r.step > step) break;
    if (r.step != last + 1)
      throw std::runtime_error(path.string() + ":" + std::to_string(line_no) + ": step " + std::to_string(r.step) +
                               " follows step " + std::to_string(last) + "; expected consecutive steps");
    last = r.step;
    kept.append(line);
    kept += '\n';
  }
  if (last != step)
    throw std::runtime_error(squote(path.string()) + " ends at step " + std::to_string(last) +
                             " but the newest checkpoint is at step " + std::to_string(step) +
                             "; the run folder is inconsistent");
  if (log_fd_ >= 0) {  // appends continue after the kept lines
    ::close(log_fd_);
    log_fd_ = -1;
  }
  io::write_file_atomic(path, kept);
}

void RunFolder::create_log() {
  if (log_fd_ >= 0) return;
  const fs::path path = file(run_files::log);
  log_fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (log_fd_ < 0) throw std::runtime_error("cannot open " + squote(path.string()) + ": " + std::strerror(errno));
}

void RunFolder::append_log(std::string_view line) {
  const fs::path path = file(run_files::log);
  if (!log_broken_.empty())
    throw std::runtime_error("cannot append to " + squote(path.string()) + ": " + log_broken_);
  create_log();
  // The length before: a write that fails part way is cut back to it, so the log never
  // holds a torn line that the next record would be glued onto.
  const off_t before = ::lseek(log_fd_, 0, SEEK_END);
  if (before < 0) throw std::runtime_error("cannot append to " + squote(path.string()) + ": " + std::strerror(errno));
  std::string buf;
  buf.reserve(line.size() + 1);
  buf.append(line).push_back('\n');
  const char* p = buf.data();
  std::size_t left = buf.size();
  while (left > 0) {
    const ssize_t w = ::write(log_fd_, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : EIO;
      std::string msg = "cannot write " + squote(path.string()) + ": " + std::strerror(err);
      if (::ftruncate(log_fd_, before) == 0) {
        msg += " (the log is as it was before this record: " + std::to_string(before) + " bytes)";
      } else {
        log_broken_ = "an earlier append failed (" + std::string(std::strerror(err)) +
                      ") and its partial line could not be cut back (" + std::strerror(errno) +
                      "); the log's last line is torn: a resume or a reader drops it";
        msg += "; " + log_broken_;
      }
      throw std::runtime_error(msg);
    }
    p += w;
    left -= static_cast<std::size_t>(w);
  }
}

// ---- reading ------------------------------------------------------------------------------

void check_run_folder(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw std::runtime_error("run folder " + squote(dir.string()) + " does not exist");
  if (!fs::is_directory(dir, ec)) throw std::runtime_error(squote(dir.string()) + " is not a folder");
  if (!fs::exists(dir / run_files::log, ec))
    throw std::runtime_error(squote(dir.string()) + " has no log.jsonl: not a run folder (mixprec train --out DIR "
                             "writes one)");
  try {
    (void)read_run_config(dir);  // the schema version before anything else is read
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(e.what());
  }
}

std::optional<std::string> read_run_file(const fs::path& dir, std::string_view name) {
  const fs::path p = dir / name;
  std::error_code ec;
  if (!fs::exists(p, ec)) return std::nullopt;
  return io::read_json_text(p);  // every caller reads JSON: the JSON reader's size limit
}

}  // namespace mixprec::train
