// Checkpoint files in the safetensors format (https://github.com/huggingface/safetensors):
// an atomic writer and a reader that validates the whole file before handing out any
// byte. See docs/checkpoints.md; a run folder's checkpoints are named in run/run_folder.hpp.
//
// Files are plain safetensors, so Python's safetensors.safe_open reads them. mixprec
// adds two kinds of metadata: "mixprec.format" = "mixprec-safetensors" and, for every
// tensor, "mixprec.checksum.NAME" = the 16 lowercase hex digits of hash64(bytes).
//
// Loading never executes anything from the file and never reads out of bounds: every
// length, offset and type in the header is checked first (the reader is fuzzed).
//
// Errors: std::invalid_argument for bad arguments to the writer (names, shapes, sizes,
// reserved metadata keys), std::runtime_error for a file that cannot be written or read
// or is not a valid checkpoint. Messages start with "checkpoint 'FILE'", name the tensor
// when there is one, and say what was expected and what was found, e.g.
// "checkpoint 'run/ckpt-00000100.safetensors': tensor 'wte': data [1024, 5120) lies
// outside the data section (4096 bytes)".
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec::ckpt {

// ---- element types ---------------------------------------------------------------

// The safetensors dtypes mixprec reads and writes (names as safetensors spells them:
// F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 U64 U32 U8 BOOL). Unlike mixprec::DType
// (what kernels compute in), this is what a file can store.
enum class DType : std::uint8_t { f64, f32, f16, bf16, f8_e4m3, f8_e5m2, i64, i32, u64, u32, u8, boolean };

inline constexpr std::size_t kDTypeCount = 12;

// "F32", ...; "?" for a value outside the enum.
std::string_view dtype_name(DType t) noexcept;
// Exact, case-sensitive safetensors name; nullopt for anything else.
std::optional<DType> parse_dtype(std::string_view name) noexcept;
// Bytes per element (BOOL: 1); 0 for a value outside the enum.
std::size_t dtype_size(DType t) noexcept;

// ---- the checksum ----------------------------------------------------------------

// XXH64 with seed 0 (xxHash's 64-bit hash, https://xxhash.com): fast (several GB/s),
// well mixed, the same on every platform, and checkable from Python with
// `xxhash.xxh64(data).hexdigest()`. Not a cryptographic hash: it detects damage, not
// tampering.
std::uint64_t hash64(std::span<const std::byte> bytes) noexcept;

// ---- writing -----------------------------------------------------------------------

// One tensor to write; non-owning. `bytes` are the little-endian elements, row-major,
// and must be exactly numel(shape) * dtype_size(dtype) long. An empty shape is a scalar
// (one element); a 0 in the shape makes an empty tensor.
struct TensorRef {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::uint64_t> shape;
  std::span<const std::byte> bytes;
};

struct WriteOptions {
  // fsync the file before the rename and the folder after it, so a crash leaves either
  // the old file or the complete new one. Tests may switch it off for speed.
  bool fsync = true;
  // Testing: simulate a failed write (as if the disk were full) once this many bytes of
  // the file have been written.
  std::optional<std::uint64_t> fail_after_bytes;
  // Adds metadata "mixprec.header_checksum": the hash64 of the whole header (every
  // metadata entry, every tensor entry, the padding), computed with 16 zeros in place
  // of its own value. The reader checks it when present (SafetensorsFile::header_checked).
  bool header_checksum = false;
};

// The metadata key of WriteOptions::header_checksum (reserved: write_file adds it).
inline constexpr std::string_view kHeaderChecksumKey = "mixprec.header_checksum";

// Writes `path` atomically: the whole file goes to a temporary in the same folder
// (".NAME.tmp-<pid>-<n>"), which is fsynced, renamed over `path`, then the folder is
// fsynced. On any failure (full disk, no permission, short write, ...) the temporary is
// removed, an existing `path` is left as it was, and std::runtime_error says which step
// failed on which file, with the system's reason.
//
// Tensors are stored in the order given, contiguous. Metadata gets "mixprec.format" and
// one "mixprec.checksum.NAME" per tensor added.
//
// Checked before anything is written (std::invalid_argument): tensor names non-empty,
// unique, valid UTF-8 and not "__metadata__"; dtype valid; numel * size computable
// without overflow and equal to bytes.size(); metadata keys and values valid UTF-8; no
// caller key starting with "mixprec.checksum."; "mixprec.format", if given, equal to
// "mixprec-safetensors".
void write_file(const std::filesystem::path& path, std::span<const TensorRef> tensors,
                const std::map<std::string, std::string>& metadata, const WriteOptions& options = {});

// The exact bytes write_file puts in the file (for tests and for callers that send a
// checkpoint elsewhere). Same checks and exceptions as write_file; of the options only
// header_checksum applies.
std::vector<std::byte> serialize(std::span<const TensorRef> tensors,
                                 const std::map<std::string, std::string>& metadata);
std::vector<std::byte> serialize(std::span<const TensorRef> tensors,
                                 const std::map<std::string, std::string>& metadata, const WriteOptions& options);

// ---- reading -----------------------------------------------------------------------

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;      // byte offsets within the data section
  std::optional<std::uint64_t> checksum;  // from "mixprec.checksum.NAME" (verified at load)
};

struct ReadLimits {
  std::uint64_t max_header_bytes = 100u << 20;
  std::uint64_t max_file_bytes = 64ull << 30;
};

// A validated checkpoint held in memory (our checkpoints are small enough to read
// whole).
//
// Checked at load, std::runtime_error on the first problem: at least 8 bytes; header
// length within the file and the limit; header valid UTF-8 JSON starting with '{';
// every key unique; "__metadata__" an object of strings; every other entry an object
// with exactly "dtype" (a known name), "shape" (array of integers >= 0) and
// "data_offsets" (array of two integers >= 0, begin <= end), nothing else;
// names non-empty; numel * size == end - begin without overflow; offsets within the
// data section; sorted by offset, the tensors cover the data section exactly (no gap,
// no overlap, nothing after the last); "mixprec.format", when present, is
// "mixprec-safetensors", and then every tensor has a checksum; every
// "mixprec.checksum.NAME" names a tensor, is 16 lowercase hex digits and matches the
// hash of its bytes.
class SafetensorsFile {
 public:
  // Reads `path` whole (a regular file of at most limits.max_file_bytes) and validates.
  // The source name in messages is the path as given.
  static SafetensorsFile open(const std::filesystem::path& path, const ReadLimits& limits = {});
  // Validates a buffer; `source` names it in messages. Takes the buffer over (no copy).
  static SafetensorsFile parse(std::vector<std::byte> bytes, std::string source, const ReadLimits& limits = {});
  // The same on a borrowed buffer (copied; e.g. a fuzzer's input).
  static SafetensorsFile parse(std::span<const std::byte> bytes, std::string source, const ReadLimits& limits = {});

  const std::string& source() const noexcept { return source_; }
  // Every metadata entry but "mixprec.header_checksum" (checked on parsing, see below).
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  // Whether the file had a header checksum (WriteOptions::header_checksum); parsing
  // refuses a file whose header does not match it.
  bool header_checked() const noexcept { return header_checked_; }
  std::optional<std::string_view> metadata_value(std::string_view key) const;
  // The value of `key`; std::runtime_error naming the file and the key when missing.
  std::string require_metadata(std::string_view key) const;

  // All tensors in data order (by begin offset; ties in header order).
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  // nullptr when there is no such tensor.
  const TensorInfo* find(std::string_view name) const;
  // The tensor's bytes after checking that it exists with this dtype and shape;
  // std::runtime_error naming the file, the tensor, what was expected and what was found.
  std::span<const std::byte> expect(std::string_view name, DType dtype, std::span<const std::uint64_t> shape) const;
  std::span<const std::byte> expect(std::string_view name, DType dtype, std::initializer_list<std::uint64_t> shape) const {
    return expect(name, dtype, std::span<const std::uint64_t>(shape.begin(), shape.size()));
  }
  // The tensor's bytes; std::runtime_error naming the file and the tensor when missing.
  // Not necessarily aligned for the element type: copy them out (memcpy), do not cast.
  std::span<const std::byte> bytes(std::string_view name) const;
  // The whole file.
  std::span<const std::byte> file_bytes() const noexcept { return buffer_; }

 private:
  SafetensorsFile() = default;
  const TensorInfo& require(std::string_view name) const;

  std::string source_;
  std::vector<std::byte> buffer_;
  std::uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  bool header_checked_ = false;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
};

}  // namespace mixprec::ckpt
