// Files: the one atomic writer and the one whole-file reader of mixprec. Checkpoints,
// run folders (config.json, log.jsonl rewrites, summary.json), reports and `--json`
// outputs are all written through AtomicFile, so every file mixprec writes is either
// absent, its previous version or complete, even across a crash or power loss.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace mixprec::io {

struct AtomicWriteOptions {
  // fsync the file before the rename and the folder after it: the new file survives a
  // power loss. Tests and throwaway outputs may turn it off.
  bool fsync = true;
  // Fault injection: fail with ENOSPC once this many bytes have been written.
  std::optional<std::uint64_t> fail_after_bytes;
};

// A new version of `path`, written to a temporary ".NAME.tmp-PID-N" in the same folder
// (so the rename stays on one file system; the leading dot keeps it out of listings)
// and renamed over `path` by commit(). Destroyed without commit() (an error, an
// exception), it removes the temporary: `path` is left as it was.
// Errors are std::runtime_error prefixed with `source` ("checkpoint 'x'"; default: the
// quoted path), naming the temporary and the system's reason.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path path, AtomicWriteOptions options = {}, std::string source = "");
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // fsync (when asked), close, rename over the target, fsync the folder (when asked).
  void commit();

 private:
  [[noreturn]] void fail_write(const std::string& why) const;
  std::filesystem::path path_, tmp_;
  AtomicWriteOptions options_;
  std::string source_;
  int fd_ = -1;
  std::uint64_t written_ = 0;
  bool committed_ = false;
};

// Replaces `path` with `bytes` through an AtomicFile.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes, const AtomicWriteOptions& options = {},
                       const std::string& source = "");

// The whole file as bytes. std::runtime_error "cannot read 'P': REASON" (or "'P' is a
// folder, not a file") otherwise.
std::string read_file(const std::filesystem::path& path);

// The same for a file that must be a regular file (symlinks followed): a FIFO, a device, a
// socket or a folder is refused before anything blocks on it (the open does not wait for a
// FIFO's writer), with std::runtime_error "'P' is a FIFO (named pipe), not a regular file".
// The run folder's readers use it: a FIFO or /dev/zero in a run folder would hang them.
std::string read_regular_file(const std::filesystem::path& path);

// What kind of file `st_mode` is, in words ("a FIFO (named pipe)", "a folder", ...); nullptr for
// a regular file.
const char* non_regular_kind(unsigned mode) noexcept;

// Why `path` cannot be an output file that is replaced atomically: "" when it can (a new name
// or a regular file). Otherwise "'P' is a FIFO (named pipe); expected a new file name or a
// regular file (it is replaced, never written through)" (a symbolic link, a folder, a device
// too), or "cannot inspect 'P': REASON". Its folder is checked separately.
std::string output_file_problem(const std::string& path);

// The (device, inode) of what `path` names, symlinks followed; nullopt when it does not exist.
std::optional<std::pair<std::uint64_t, std::uint64_t>> file_identity(const std::filesystem::path& path);

// Whether `name` is a temporary that AtomicFile made for `target` (".TARGET.tmp-PID" or
// ".TARGET.tmp-PID-N", the form older versions used included); the PID is returned.
std::optional<long> atomic_temporary_pid(std::string_view name, std::string_view* target = nullptr);

}  // namespace mixprec::io
