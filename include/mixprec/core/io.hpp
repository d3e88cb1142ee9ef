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
#include <vector>
#include <string_view>
#include <utility>

namespace mixprec::io {

struct AtomicWriteOptions {
  // fsync the file before the rename and the folder after it: the new file survives a
  // power loss. Tests and throwaway outputs may turn it off.
  bool fsync = true;
  // Fault injection: fail with ENOSPC once this many bytes have been written.
  std::optional<std::uint64_t> fail_after_bytes;
  // The temporary is ".NAME.tmp-PID-N" with NAME this (default: the target's file name).
  // A TensorBoard event file's temporary must not hold "tfevents": TensorBoard loads any
  // such file, and a crash would leave one behind.
  std::string temporary_name;
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
// A file larger than `max_bytes` is refused before it is read: "'P' is N bytes; the limit
// is M bytes".
std::string read_regular_file(const std::filesystem::path& path, std::uint64_t max_bytes = UINT64_MAX);

// Up to `size` bytes from an open descriptor, in reads of at most 1 GiB, retried on EINTR;
// fewer when the file ends first (it shrank while being read: the caller's parser reports
// what is missing). A failed read throws std::system_error with its errno.
std::vector<std::byte> read_bytes(int fd, std::uint64_t size);

// What kind of file `st_mode` is, in words ("a FIFO (named pipe)", "a folder", ...); nullptr for
// a regular file.
const char* non_regular_kind(unsigned mode) noexcept;

// Why `path` cannot be an output file that is replaced atomically: "" when it can (a new name
// or a regular file). Otherwise "'P' is a FIFO (named pipe); expected a new file name or a
// regular file (it is replaced, never written through)" (a symbolic link, a folder, a device
// too), or "cannot inspect 'P': REASON". Its folder is checked separately.
std::string output_file_problem(const std::string& path);

// Whether the process that made a temporary (its PID from atomic_temporary_pid) is gone, so
// that the temporary can be removed: not this process, and kill(pid, 0) says no such process.
bool writer_gone(long pid) noexcept;

// Folders replaced whole: a command that writes several files that belong together
// (`mixprec advise`: recipe.json and advice.json) fills a staging folder and swaps it in,
// so a crash at any moment leaves the old set or the new one, never a mix.
// make_staging_folder: a new empty folder ".NAME.tmp-PID-N" beside `target` (NAME its
// file name), after removing the staging folders of `target` that dead processes left.
std::filesystem::path make_staging_folder(const std::filesystem::path& target);
// Puts `staged` in the place of `target` in one rename (renameat2 RENAME_EXCHANGE when
// `target` exists, then the old contents are removed), and syncs the parent folder.
void replace_folder(const std::filesystem::path& staged, const std::filesystem::path& target);

// The (device, inode) of what `path` names, symlinks followed; nullopt when it does not exist.
std::optional<std::pair<std::uint64_t, std::uint64_t>> file_identity(const std::filesystem::path& path);

// Whether `name` is a temporary that AtomicFile made for `target` (".TARGET.tmp-PID" or
// ".TARGET.tmp-PID-N", the form older versions used included); the PID is returned.
std::optional<long> atomic_temporary_pid(std::string_view name, std::string_view* target = nullptr);

}  // namespace mixprec::io
