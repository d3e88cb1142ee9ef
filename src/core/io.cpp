// The atomic writer and the whole-file reader (include/mixprec/core/io.hpp).
#include "mixprec/core/io.hpp"

#include <algorithm>
#include <system_error>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mixprec/core/text.hpp"

namespace mixprec::io {
namespace fs = std::filesystem;
namespace {

std::atomic<std::uint64_t> g_tmp_counter{0};

std::string errno_text(int e) { return std::strerror(e); }

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

}  // namespace

AtomicFile::AtomicFile(fs::path path, AtomicWriteOptions options, std::string source)
    : path_(std::move(path)), options_(options), source_(std::move(source)) {
  if (source_.empty()) source_ = text::squote(path_.string());
  if (path_.filename().empty()) throw std::invalid_argument(source_ + ": expected a file name, found a folder path");
  const fs::path dir = path_.has_parent_path() ? path_.parent_path() : fs::path(".");
  // Built by append: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string at -O3.
  std::string stem(1, '.');
  stem.append(options_.temporary_name.empty() ? path_.filename().string() : options_.temporary_name).append(".tmp-").append(std::to_string(::getpid())).append("-");
  for (int attempt = 0;; ++attempt) {
    tmp_ = dir / (stem + std::to_string(g_tmp_counter.fetch_add(1)));
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0) break;
    const int e = errno;
    if (e == EINTR || (e == EEXIST && attempt < 100)) continue;  // EEXIST: a crashed process with our pid left one
    throw std::runtime_error(source_ + ": cannot create the temporary file '" + tmp_.string() + "': " + errno_text(e));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::fail_write(const std::string& why) const {
  throw std::runtime_error(source_ + ": cannot write the temporary file '" + tmp_.string() + "' after " +
                           std::to_string(written_) + " bytes: " + why);
}

void AtomicFile::write(const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  bool simulate = false;
  if (options_.fail_after_bytes && written_ + n > *options_.fail_after_bytes) {
    n = static_cast<std::size_t>(*options_.fail_after_bytes - std::min(written_, *options_.fail_after_bytes));
    simulate = true;
  }
  while (n > 0) {
    const ssize_t r = ::write(fd_, p, std::min<std::size_t>(n, std::size_t{1} << 30));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_write(errno_text(errno));
    }
    if (r == 0) fail_write("the system wrote 0 bytes");
    p += r;
    n -= static_cast<std::size_t>(r);
    written_ += static_cast<std::uint64_t>(r);
  }
  if (simulate)
    fail_write(errno_text(ENOSPC) + " (simulated by WriteOptions::fail_after_bytes = " +
               std::to_string(*options_.fail_after_bytes) + ")");
}

void AtomicFile::commit() {
  if (options_.fsync && ::fsync(fd_) != 0)
    throw std::runtime_error(source_ + ": cannot fsync the temporary file '" + tmp_.string() + "': " + errno_text(errno));
  // close() can report a delayed write error (NFS); count it as a failed write.
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0)
    throw std::runtime_error(source_ + ": cannot close the temporary file '" + tmp_.string() + "': " + errno_text(errno));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw std::runtime_error(source_ + ": cannot rename the temporary file '" + tmp_.string() + "' to it: " +
                             errno_text(errno));
  committed_ = true;
  if (options_.fsync) {
    // Makes the rename itself durable. File systems that cannot sync a folder say
    // EINVAL; there is nothing more to do on those.
    const fs::path dir = path_.has_parent_path() ? path_.parent_path() : fs::path(".");
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const bool ok = dfd >= 0 && (::fsync(dfd) == 0 || errno == EINVAL);
    const int err = errno;
    if (dfd >= 0) ::close(dfd);
    if (!ok)
      throw std::runtime_error(source_ + ": the new file is in place, but the folder '" + dir.string() +
                               "' cannot be synced, so the rename may not survive a crash: " + errno_text(err));
  }
}

void write_file_atomic(const fs::path& path, std::string_view bytes, const AtomicWriteOptions& options,
                       const std::string& source) {
  AtomicFile f(path, options, source);
  f.write(bytes);
  f.commit();
}

std::string read_file(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw std::runtime_error(text::squote(path.string()) + " is a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + text::squote(path.string()) + ": " + errno_text(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::runtime_error("cannot read " + text::squote(path.string()) + ": " + errno_text(errno));
  return ss.str();
}

const char* non_regular_kind(unsigned mode) noexcept {
  const auto m = static_cast<mode_t>(mode);
  return S_ISREG(m)    ? nullptr
         : S_ISLNK(m)  ? "a symbolic link"
         : S_ISDIR(m)  ? "a folder"
         : S_ISFIFO(m) ? "a FIFO (named pipe)"
         : S_ISCHR(m)  ? "a character device"
         : S_ISBLK(m)  ? "a block device"
         : S_ISSOCK(m) ? "a socket"
                       : "not a regular file";
}

std::vector<std::byte> read_bytes(int fd, std::uint64_t size) {
  std::vector<std::byte> buf(static_cast<std::size_t>(size));
  std::size_t got = 0;
  while (got < buf.size()) {
    const ssize_t r = ::read(fd, buf.data() + got, std::min<std::size_t>(buf.size() - got, std::size_t{1} << 30));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw std::system_error(errno, std::generic_category());
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
  }
  buf.resize(got);
  return buf;
}

std::string read_regular_file(const fs::path& path, std::uint64_t max_bytes) {
  const std::string q = text::squote(path.string());
  // O_NONBLOCK: opening a FIFO for reading does not wait for a writer; fstat then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) throw std::runtime_error("cannot read " + q + ": " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw std::runtime_error("cannot read " + q + ": " + errno_text(e));
  }
  if (const char* kind = non_regular_kind(st.st_mode)) {
    ::close(fd);
    throw std::runtime_error(q + " is " + kind + ", not a regular file");
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw std::runtime_error(q + " is " + std::to_string(st.st_size) + " bytes; the limit is " +
                             std::to_string(max_bytes) + " bytes");
  }
  std::string out;
  out.reserve(static_cast<std::size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int e = errno;
      ::close(fd);
      throw std::runtime_error("cannot read " + q + ": " + errno_text(e));
    }
    if (r == 0) break;
    out.append(buf, static_cast<std::size_t>(r));
    if (out.size() > max_bytes) {  // grew while being read
      ::close(fd);
      throw std::runtime_error(q + " is more than " + std::to_string(max_bytes) + " bytes; the limit is " +
                               std::to_string(max_bytes) + " bytes");
    }
  }
  ::close(fd);
  return out;
}

std::string output_file_problem(const std::string& path) {
  struct stat st {};
  const std::string q = text::squote(path);
  if (path.empty()) return "expected a file name, found ''";
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {};  // a new file (its folder is checked separately)
    return "cannot inspect " + q + ": " + errno_text(errno);
  }
  const char* kind = non_regular_kind(st.st_mode);
  if (kind == nullptr) return {};
  return q + " is " + kind + "; expected a new file name or a regular file (it is replaced, never written through)";
}

std::optional<std::pair<std::uint64_t, std::uint64_t>> file_identity(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return std::pair<std::uint64_t, std::uint64_t>{static_cast<std::uint64_t>(st.st_dev),
                                                 static_cast<std::uint64_t>(st.st_ino)};
}

std::optional<long> atomic_temporary_pid(std::string_view name, std::string_view* target) {
  const std::size_t tmp = name.rfind(".tmp-");
  if (name.empty() || name[0] != '.' || tmp == std::string_view::npos || tmp < 2) return std::nullopt;
  const std::string_view tail = name.substr(tmp + 5);
  const std::string_view pid_text = tail.substr(0, tail.find('-'));
  if (!all_digits(pid_text) || pid_text.size() > 9 ||
      (pid_text.size() < tail.size() && !all_digits(tail.substr(pid_text.size() + 1))))
    return std::nullopt;
  if (target != nullptr) *target = name.substr(1, tmp - 1);
  return std::stol(std::string(pid_text));
}

namespace {

void sync_folder(const fs::path& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);  // best effort: the swap itself is atomic either way
    ::close(dfd);
  }
}

}  // namespace

bool writer_gone(long pid) noexcept {
  return pid != ::getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

fs::path make_staging_folder(const fs::path& target) {
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string name = target.filename().string();
  std::error_code ec;
  // Staging folders of this target whose process is gone (killed mid-write): never read by
  // anything, removed here so that they do not pile up.
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    std::string_view of;
    const std::string entry = e.path().filename().string();
    const std::optional<long> pid = atomic_temporary_pid(entry, &of);
    if (pid && of == name && writer_gone(*pid)) fs::remove_all(e.path(), ec);
  }
  const std::string stem = "." + name + ".tmp-" + std::to_string(::getpid()) + "-";
  for (int attempt = 0;; ++attempt) {
    const fs::path p = dir / (stem + std::to_string(g_tmp_counter.fetch_add(1)));
    if (::mkdir(p.c_str(), 0777) == 0) return p;
    const int e = errno;
    if (e == EINTR || (e == EEXIST && attempt < 100)) continue;
    throw std::runtime_error("cannot create the staging folder '" + p.string() + "': " + errno_text(e));
  }
}

void replace_folder(const fs::path& staged, const fs::path& target) {
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(target, ec))) {
    if (::rename(staged.c_str(), target.c_str()) != 0)
      throw std::runtime_error("cannot rename '" + staged.string() + "' to '" + target.string() + "': " + errno_text(errno));
  } else {
    if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      fs::remove_all(staged, ec);  // now the old contents; a crash here leaves a staging folder, removed next time
    } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
      // A file system without the exchange (NFS, some FUSE): the old folder is moved aside
      // first, so for a moment there is neither; still never a mix of the two.
      const fs::path aside = make_staging_folder(target);
      fs::remove(aside, ec);
      if (::rename(target.c_str(), aside.c_str()) != 0 || ::rename(staged.c_str(), target.c_str()) != 0)
        throw std::runtime_error("cannot replace '" + target.string() + "' with '" + staged.string() + "': " +
                                 errno_text(errno));
      fs::remove_all(aside, ec);
    } else {
      throw std::runtime_error("cannot swap '" + staged.string() + "' with '" + target.string() + "': " +
                               errno_text(errno));
    }
  }
  sync_folder(dir);
}

}  // namespace mixprec::io
