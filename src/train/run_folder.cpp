// The run folder (include/mixprec/train/run_folder.hpp, docs/run_folder.md).
#include "mixprec/train/run_folder.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <map>
#include <stdexcept>

#include "mixprec/core/io.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/train/run_log.hpp"

namespace mixprec::train {
namespace fs = std::filesystem;
using text::squote;

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

// ---- writing ------------------------------------------------------------------------------

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
int lock_folder(const fs::path& dir) {
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
  throw std::runtime_error("run folder " + squote(dir.string()) + " is in use by " + holder +
                           " (it holds the lock on " + squote(path.string()) +
                           "); one mixprec train at a time may run in a folder: wait for it to end, or stop it "
                           "and continue with --resume " + dir.string());
}

// fcntl locks belong to the process: a second lock of the same file by this process
// succeeds, and closing either descriptor drops both. So the folders this process holds
// are kept here too (by device and inode, with the holder's pid: a child made by fork
// inherits the table but not the locks), and a second RunFolder of one is refused.
std::mutex g_held_mutex;
std::map<std::pair<std::uint64_t, std::uint64_t>, pid_t> g_held;

std::pair<std::uint64_t, std::uint64_t> identity(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw std::runtime_error("cannot read the run folder " + squote(dir.string()) + ": " + std::strerror(errno));
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

}  // namespace

RunFolder::RunFolder(fs::path dir, Mode mode, std::string_view instead) : dir_(std::move(dir)) {
  std::error_code ec;
  if (mode == Mode::create) {
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
    lock_fd_ = lock_folder(dir_);
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
    std::string msg = "out: " + squote(dir_.string()) + " exists and is not empty; choose a new folder";
    if (instead.empty())
      msg.append(", or continue that run with --resume ").append(dir_.string());
    else
      msg.append(" (").append(instead).append(")");
    throw std::invalid_argument(msg);
  }
}

RunFolder::~RunFolder() {
  if (log_ != nullptr) std::fclose(log_);
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
    if (*pid != ::getpid() && !(::kill(static_cast<pid_t>(*pid), 0) != 0 && errno == ESRCH))
      continue;  // its writer may still run
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
  if (fs::exists(path, ec)) text = io::read_file(path);
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
  if (log_ != nullptr) {  // appends continue after the kept lines
    std::fclose(log_);
    log_ = nullptr;
  }
  io::write_file_atomic(path, kept);
}

void RunFolder::append_log(std::string_view line) {
  const fs::path path = file(run_files::log);
  if (log_ == nullptr) {
    log_ = std::fopen(path.c_str(), "ab");
    if (log_ == nullptr) throw std::runtime_error("cannot open " + squote(path.string()) + ": " + std::strerror(errno));
  }
  if (std::fwrite(line.data(), 1, line.size(), log_) != line.size() || std::fputc('\n', log_) == EOF ||
      std::fflush(log_) != 0)
    throw std::runtime_error("cannot write " + squote(path.string()) + ": " + std::strerror(errno));
}

// ---- reading ------------------------------------------------------------------------------

void check_run_folder(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw std::runtime_error("run folder " + squote(dir.string()) + " does not exist");
  if (!fs::is_directory(dir, ec)) throw std::runtime_error(squote(dir.string()) + " is not a folder");
  if (!fs::exists(dir / run_files::log, ec))
    throw std::runtime_error(squote(dir.string()) + " has no log.jsonl: not a run folder (mixprec train --out DIR "
                             "writes one)");
}

std::optional<std::string> read_run_file(const fs::path& dir, std::string_view name) {
  const fs::path p = dir / name;
  std::error_code ec;
  if (!fs::exists(p, ec)) return std::nullopt;
  return io::read_file(p);
}

}  // namespace mixprec::train
