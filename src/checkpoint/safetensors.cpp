// safetensors checkpoints: XXH64, the writer (through the atomic file of core/io) and
// the validating reader (docs/checkpoints.md).
#include "mixprec/checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "mixprec/core/io.hpp"
#include "mixprec/core/text.hpp"

namespace mixprec::ckpt {

// Tensor bytes are written and handed out as they are in memory, and the format is
// little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors checkpoints need a little-endian host");

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kFormatKey = "mixprec.format";
constexpr std::string_view kFormatValue = "mixprec-safetensors";
constexpr std::string_view kChecksumPrefix = "mixprec.checksum.";
// The header checksum (WriteOptions::header_checksum): the key, as it appears in the
// header, and the placeholder its value holds while the header is hashed.
constexpr std::string_view kHeaderChecksumField = "\"mixprec.header_checksum\":\"";
constexpr std::string_view kHeaderChecksumPlaceholder = "0000000000000000";

struct DTypeEntry {
  DType type;
  std::string_view name;
  std::size_t size;
};
constexpr std::array<DTypeEntry, kDTypeCount> kDTypes{{
    {DType::f64, "F64", 8},
    {DType::f32, "F32", 4},
    {DType::f16, "F16", 2},
    {DType::bf16, "BF16", 2},
    {DType::f8_e4m3, "F8_E4M3", 1},
    {DType::f8_e5m2, "F8_E5M2", 1},
    {DType::i64, "I64", 8},
    {DType::i32, "I32", 4},
    {DType::u64, "U64", 8},
    {DType::u32, "U32", 4},
    {DType::u8, "U8", 1},
    {DType::boolean, "BOOL", 1},
}};

std::string known_dtypes() {
  std::string s;
  for (const auto& e : kDTypes) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

// ---- small helpers ---------------------------------------------------------------

// Names and values come from untrusted files: cut them so a message stays readable.
std::string clip(std::string_view s, std::size_t max = 120) {
  if (s.size() <= max) return std::string(s);
  return std::string(s.substr(0, max)) + "...(" + std::to_string(s.size()) + " bytes)";
}
std::string in_quotes(std::string_view s) { return "'" + clip(s) + "'"; }

std::string shape_text(std::span<const std::uint64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
std::string range_text(std::uint64_t b, std::uint64_t e) {
  return "[" + std::to_string(b) + ", " + std::to_string(e) + ")";
}
std::string hex16(std::uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}
std::optional<std::uint64_t> parse_hex16(std::string_view s) {
  if (s.size() != 16) return std::nullopt;
  std::uint64_t v = 0;
  for (const char c : s) {
    unsigned d = 0;
    if (c >= '0' && c <= '9') d = static_cast<unsigned>(c - '0');
    else if (c >= 'a' && c <= 'f') d = static_cast<unsigned>(c - 'a' + 10);
    else return std::nullopt;  // lowercase only: one spelling per value
    v = (v << 4) | d;
  }
  return v;
}

// numel(shape) * elem without overflow.
std::optional<std::uint64_t> byte_count(std::span<const std::uint64_t> shape, std::size_t elem) {
  std::uint64_t n = elem;
  for (const std::uint64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  return n;
}

// Strict UTF-8 (no overlong forms, surrogates or code points above U+10FFFF), as JSON
// strings in the header must be.
bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) len = 2;
    else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (s.size() - i < len) return false;
    const auto b1 = static_cast<unsigned char>(s[i + 1]);
    if (b1 < lo || b1 > hi) return false;
    for (std::size_t k = 2; k < len; ++k) {
      const auto bk = static_cast<unsigned char>(s[i + k]);
      if (bk < 0x80 || bk > 0xBF) return false;
    }
    i += len;
  }
  return true;
}

// JSON string as serde_json (the reference implementation) writes it: only '"', '\\'
// and control characters escaped, everything else raw UTF-8.
void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void put_u64_le(std::byte* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}
std::uint64_t get_u64_le(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | std::to_integer<std::uint64_t>(p[i]);
  return v;
}

// ---- XXH64 ------------------------------------------------------------------------

constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kP3 = 0x165667B19E3779F9ULL;
constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ULL;

inline std::uint64_t read64(const std::byte* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian host (static_assert above)
}
inline std::uint64_t read32(const std::byte* p) noexcept {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline std::uint64_t xxh_round(std::uint64_t acc, std::uint64_t input) noexcept {
  acc += input * kP2;
  acc = std::rotl(acc, 31);
  return acc * kP1;
}
inline std::uint64_t xxh_merge(std::uint64_t acc, std::uint64_t v) noexcept {
  acc ^= xxh_round(0, v);
  return acc * kP1 + kP4;
}

// ---- writer ------------------------------------------------------------------------

std::string writer_source(const fs::path* path) {
  return path ? "checkpoint '" + path->string() + "'" : std::string("checkpoint (in memory)");
}

// Checks the caller's tensors and metadata; returns the header (padded to 8 bytes)
// and the size of the data section.
std::pair<std::string, std::uint64_t> build_header(std::span<const TensorRef> tensors,
                                                   const std::map<std::string, std::string>& metadata,
                                                   const std::string& src, bool header_checksum = false) {
  auto bad = [&](const std::string& what) { return std::invalid_argument(src + ": " + what); };
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : metadata) {
    if (!valid_utf8(k)) throw bad("metadata key " + in_quotes(k) + " is not valid UTF-8");
    if (!valid_utf8(v)) throw bad("metadata " + in_quotes(k) + ": the value is not valid UTF-8");
    if (k.starts_with(kChecksumPrefix))
      throw bad("metadata key " + in_quotes(k) + " is reserved: write_file adds the '" + std::string(kChecksumPrefix) +
                "NAME' keys itself");
    if (k == kHeaderChecksumKey)
      throw bad("metadata key " + in_quotes(k) + " is reserved: write_file adds it (WriteOptions::header_checksum)");
    if (k == kFormatKey && v != kFormatValue)
      throw bad("metadata '" + std::string(kFormatKey) + "': expected '" + std::string(kFormatValue) +
                "' (or nothing), found " + in_quotes(v));
    meta.emplace(k, v);
  }
  meta[std::string(kFormatKey)] = std::string(kFormatValue);
  if (header_checksum) meta[std::string(kHeaderChecksumKey)] = std::string(kHeaderChecksumPlaceholder);

  std::map<std::string_view, std::size_t> seen;
  std::uint64_t offset = 0;
  std::string entries;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorRef& t = tensors[i];
    const std::string what = "tensor " + in_quotes(t.name);
    if (t.name.empty()) throw bad("tensor " + std::to_string(i) + ": the name is empty");
    if (t.name == kMetadataKey) throw bad("tensor '__metadata__': the name is reserved for the metadata");
    if (!valid_utf8(t.name)) throw bad(what + ": the name is not valid UTF-8");
    if (const auto [it, fresh] = seen.emplace(t.name, i); !fresh)
      throw bad(what + ": the name is used twice (tensors " + std::to_string(it->second) + " and " +
                std::to_string(i) + ")");
    const std::size_t elem = dtype_size(t.dtype);
    if (elem == 0)
      throw bad(what + ": dtype " + std::to_string(static_cast<unsigned>(t.dtype)) + " is not a DType value");
    const auto n = byte_count(t.shape, elem);
    if (!n)
      throw bad(what + ": " + std::string(dtype_name(t.dtype)) + " " + shape_text(t.shape) +
                " has more than 2^64 bytes");
    if (*n != t.bytes.size())
      throw bad(what + ": expected " + std::to_string(*n) + " bytes (" + std::string(dtype_name(t.dtype)) + " " +
                shape_text(t.shape) + "), found " + std::to_string(t.bytes.size()));
    meta[std::string(kChecksumPrefix) + t.name] = hex16(hash64(t.bytes));

    entries += ',';
    append_json_string(entries, t.name);
    // Field order and compact form as the reference writer (serde_json) emits them.
    entries.append(":{\"dtype\":\"").append(dtype_name(t.dtype)).append("\",\"shape\":[");
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (d) entries.push_back(',');
      entries.append(std::to_string(t.shape[d]));
    }
    entries.append("],\"data_offsets\":[").append(std::to_string(offset)).push_back(',');
    entries.append(std::to_string(offset + *n)).append("]}");
    offset += *n;  // cannot wrap: the bytes are in memory
  }

  std::string header = "{";
  append_json_string(header, kMetadataKey);
  header += ":{";
  bool first = true;
  for (const auto& [k, v] : meta) {
    if (!first) header += ',';
    first = false;
    append_json_string(header, k);
    header += ':';
    append_json_string(header, v);
  }
  header += '}';
  header += entries;
  header += '}';
  // Spaces, as the reference writer pads: the data section starts 8-byte aligned.
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header_checksum) {  // the hash of the whole header, padding included, with the placeholder in its value
    const std::size_t at = header.find(kHeaderChecksumField) + kHeaderChecksumField.size();
    header.replace(at, kHeaderChecksumPlaceholder.size(),
                   hex16(hash64(std::as_bytes(std::span<const char>(header.data(), header.size())))));
  }
  return {std::move(header), offset};
}

// A file descriptor closed on every path.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  int release() { return std::exchange(fd, -1); }
};

std::string errno_text(int e) { return std::strerror(e); }

// Sequential writer with the fail_after_bytes test hook.

// ---- reader: a SAX handler that checks the header's shape while it is parsed --------

// Builds the metadata and the tensor entries directly, refusing anything the format
// does not allow as soon as it appears (so nesting never gets deep and duplicate keys,
// which a JSON object would silently merge, are caught).
class HeaderHandler {
 public:
  using json = nlohmann::json;

  struct Entry {
    std::string name;
    std::optional<DType> dtype;
    std::optional<std::vector<std::uint64_t>> shape;
    std::optional<std::vector<std::uint64_t>> offsets;
  };

  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;
  std::string error;  // set when a callback refused the input

  bool null() { return value("null"); }
  bool boolean(bool v) { return value(v ? "true" : "false"); }
  bool number_integer(json::number_integer_t v) {
    if (state_ == State::array && v >= 0) return element(static_cast<std::uint64_t>(v));
    return value(std::to_string(v));
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (state_ == State::array) return element(v);
    return value(std::to_string(v));
  }
  bool number_float(json::number_float_t, const json::string_t& text) { return value(clip(text, 40)); }
  bool binary(json::binary_t&) { return value("binary data"); }

  bool string(json::string_t& s) {
    switch (state_) {
      case State::metadata_value:
        metadata.emplace(std::move(key_), std::move(s));
        state_ = State::metadata;
        return true;
      case State::field_value:
        if (field_ == Field::dtype) {
          const auto t = parse_dtype(s);
          if (!t) return fail(where() + "unknown dtype " + in_quotes(s) + "; expected one of " + known_dtypes());
          entries.back().dtype = t;
          state_ = State::entry;
          return true;
        }
        [[fallthrough]];
      default:
        return value("the string " + in_quotes(s));
    }
  }

  bool start_object(std::size_t) {
    switch (state_) {
      case State::start:
        state_ = State::top;
        return true;
      case State::top_value:
        if (key_ == kMetadataKey) {
          state_ = State::metadata;
        } else {
          entries.push_back({std::move(key_), {}, {}, {}});
          state_ = State::entry;
        }
        return true;
      default:
        return value("an object");
    }
  }
  bool end_object() {
    switch (state_) {
      case State::top:
        state_ = State::done;
        return true;
      case State::metadata:
        state_ = State::top;
        return true;
      case State::entry: {
        const Entry& e = entries.back();
        const char* missing = !e.dtype ? "dtype" : !e.shape ? "shape" : !e.offsets ? "data_offsets" : nullptr;
        if (missing)
          return fail("tensor " + in_quotes(e.name) + ": the field '" + missing +
                      "' is missing; expected \"dtype\", \"shape\" and \"data_offsets\"");
        state_ = State::top;
        return true;
      }
      default:
        return fail("unexpected end of an object");  // the parser does not let this happen
    }
  }

  bool start_array(std::size_t) {
    if (state_ == State::field_value && (field_ == Field::shape || field_ == Field::offsets)) {
      array_.clear();
      state_ = State::array;
      return true;
    }
    return value("an array");
  }
  bool end_array() {
    if (state_ != State::array) return fail("unexpected end of an array");
    Entry& e = entries.back();
    if (field_ == Field::shape) {
      e.shape = std::move(array_);
    } else {
      if (array_.size() != 2)
        return fail(where() + "expected 2 integers [begin, end], found " + std::to_string(array_.size()));
      e.offsets = std::move(array_);
    }
    array_ = {};
    state_ = State::entry;
    return true;
  }

  bool key(json::string_t& k) {
    switch (state_) {
      case State::top:
        if (k == kMetadataKey) {
          if (seen_metadata_) return fail("the key '__metadata__' appears twice");
          seen_metadata_ = true;
        } else {
          if (k.empty()) return fail("a tensor has an empty name");
          if (!names_.emplace(k).second) return fail("tensor " + in_quotes(k) + " appears twice in the header");
        }
        key_ = std::move(k);
        state_ = State::top_value;
        return true;
      case State::metadata:
        if (metadata.count(k)) return fail("metadata key " + in_quotes(k) + " appears twice");
        key_ = std::move(k);
        state_ = State::metadata_value;
        return true;
      case State::entry: {
        Entry& e = entries.back();
        if (k == "dtype") field_ = Field::dtype;
        else if (k == "shape") field_ = Field::shape;
        else if (k == "data_offsets") field_ = Field::offsets;
        else
          return fail("tensor " + in_quotes(e.name) + ": unexpected field " + in_quotes(k) +
                      "; expected only \"dtype\", \"shape\" and \"data_offsets\"");
        const bool dup = (field_ == Field::dtype && e.dtype) ||
                         (field_ == Field::shape && e.shape) || (field_ == Field::offsets && e.offsets);
        if (dup) return fail("tensor " + in_quotes(e.name) + ": the field " + in_quotes(k) + " appears twice");
        state_ = State::field_value;
        return true;
      }
      default:
        return fail("unexpected key");  // the parser does not let this happen
    }
  }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::json::exception& ex) {
    const std::string msg(text::json_error_detail(ex.what()));
    error = "the header is not valid JSON (at byte " + std::to_string(position) + " of the header): " + clip(msg, 300);
    return false;
  }

  bool complete() const { return state_ == State::done; }

 private:
  enum class State : std::uint8_t { start, top, top_value, metadata, metadata_value, entry, field_value, array, done };
  enum class Field : std::uint8_t { dtype, shape, offsets };

  bool fail(std::string msg) {
    error = std::move(msg);
    return false;
  }
  std::string field_name() const {
    return field_ == Field::dtype ? "dtype" : field_ == Field::shape ? "shape" : "data_offsets";
  }
  std::string where() const { return "tensor " + in_quotes(entries.back().name) + ": " + field_name() + ": "; }

  // A value of a type the current position does not allow.
  bool value(const std::string& found) {
    switch (state_) {
      case State::start: return fail("the header is not a JSON object; found " + found);
      case State::top_value:
        if (key_ == kMetadataKey) return fail("'__metadata__': expected an object of strings, found " + found);
        return fail("tensor " + in_quotes(key_) + ": expected an object {\"dtype\", \"shape\", \"data_offsets\"}, found " +
                    found);
      case State::metadata_value:
        return fail("metadata " + in_quotes(key_) + ": expected a string value, found " + found);
      case State::field_value:
        if (field_ == Field::dtype) return fail(where() + "expected a string such as \"F32\", found " + found);
        return fail(where() + "expected an array of integers >= 0, found " + found);
      case State::array: return fail(where() + "expected integers >= 0, found " + found);
      default: return fail("unexpected " + found);  // the parser does not let this happen
    }
  }
  bool element(std::uint64_t v) {
    array_.push_back(v);
    return true;
  }

  State state_ = State::start;
  Field field_ = Field::dtype;
  bool seen_metadata_ = false;
  std::string key_;
  std::vector<std::uint64_t> array_;
  std::set<std::string, std::less<>> names_;
};

}  // namespace

// ---- dtypes ------------------------------------------------------------------------

std::string_view dtype_name(DType t) noexcept {
  const auto i = static_cast<std::size_t>(t);
  return i < kDTypes.size() ? kDTypes[i].name : std::string_view("?");
}

std::optional<DType> parse_dtype(std::string_view name) noexcept {
  for (const auto& e : kDTypes)
    if (e.name == name) return e.type;
  return std::nullopt;
}

std::size_t dtype_size(DType t) noexcept {
  const auto i = static_cast<std::size_t>(t);
  return i < kDTypes.size() ? kDTypes[i].size : 0;
}

// ---- hash --------------------------------------------------------------------------

std::uint64_t hash64(std::span<const std::byte> bytes) noexcept {
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  std::uint64_t h;
  if (n >= 32) {
    std::uint64_t v1 = kP1 + kP2, v2 = kP2, v3 = 0, v4 = 0 - kP1;  // seed 0
    do {
      v1 = xxh_round(v1, read64(p));
      v2 = xxh_round(v2, read64(p + 8));
      v3 = xxh_round(v3, read64(p + 16));
      v4 = xxh_round(v4, read64(p + 24));
      p += 32;
      n -= 32;
    } while (n >= 32);
    h = std::rotl(v1, 1) + std::rotl(v2, 7) + std::rotl(v3, 12) + std::rotl(v4, 18);
    h = xxh_merge(h, v1);
    h = xxh_merge(h, v2);
    h = xxh_merge(h, v3);
    h = xxh_merge(h, v4);
  } else {
    h = kP5;
  }
  h += static_cast<std::uint64_t>(bytes.size());
  for (; n >= 8; n -= 8, p += 8) {
    h ^= xxh_round(0, read64(p));
    h = std::rotl(h, 27) * kP1 + kP4;
  }
  if (n >= 4) {
    h ^= read32(p) * kP1;
    h = std::rotl(h, 23) * kP2 + kP3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; --n, ++p) {
    h ^= std::to_integer<std::uint64_t>(*p) * kP5;
    h = std::rotl(h, 11) * kP1;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

// ---- writing -----------------------------------------------------------------------

std::vector<std::byte> serialize(std::span<const TensorRef> tensors, const std::map<std::string, std::string>& metadata) {
  return serialize(tensors, metadata, WriteOptions{});
}

std::vector<std::byte> serialize(std::span<const TensorRef> tensors, const std::map<std::string, std::string>& metadata,
                                 const WriteOptions& options) {
  const auto [header, data_size] = build_header(tensors, metadata, writer_source(nullptr), options.header_checksum);
  std::vector<std::byte> out(8 + header.size() + data_size);
  put_u64_le(out.data(), header.size());
  std::memcpy(out.data() + 8, header.data(), header.size());
  std::byte* p = out.data() + 8 + header.size();
  for (const TensorRef& t : tensors) {
    if (!t.bytes.empty()) std::memcpy(p, t.bytes.data(), t.bytes.size());
    p += t.bytes.size();
  }
  return out;
}

void write_file(const fs::path& path, std::span<const TensorRef> tensors,
                const std::map<std::string, std::string>& metadata, const WriteOptions& options) {
  const std::string src = writer_source(&path);
  const std::string header = build_header(tensors, metadata, src, options.header_checksum).first;
  if (path.filename().empty()) throw std::invalid_argument(src + ": expected a file name, found a folder path");

  io::AtomicFile file(path, io::AtomicWriteOptions{options.fsync, options.fail_after_bytes, {}}, src);
  std::byte len[8];
  put_u64_le(len, header.size());
  file.write(len, sizeof len);
  file.write(header.data(), header.size());
  for (const TensorRef& t : tensors)
    if (!t.bytes.empty()) file.write(t.bytes.data(), t.bytes.size());
  file.commit();
}

// ---- reading -----------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const fs::path& path, const ReadLimits& limits) {
  const std::string src = "checkpoint '" + path.string() + "'";
  // O_NONBLOCK: opening a FIFO does not wait for a writer; fstat then refuses it.
  Fd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (fd.fd < 0) throw std::runtime_error(src + " cannot be opened: " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) throw std::runtime_error(src + " cannot be read: " + errno_text(errno));
  if (const char* kind = io::non_regular_kind(st.st_mode))
    throw std::runtime_error(src + " is " + kind + "; expected a safetensors file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > limits.max_file_bytes)
    throw std::runtime_error(src + " is " + std::to_string(size) + " bytes; the limit is " +
                             std::to_string(limits.max_file_bytes) + " (ReadLimits::max_file_bytes)");
  try {
    return parse(io::read_bytes(fd.fd, size), path.string(), limits);  // a short read: parse says what is missing
  } catch (const std::system_error& e) {
    throw std::runtime_error(src + " cannot be read: " + errno_text(e.code().value()));
  }
}

SafetensorsFile SafetensorsFile::parse(std::span<const std::byte> bytes, std::string source, const ReadLimits& limits) {
  return parse(std::vector<std::byte>(bytes.begin(), bytes.end()), std::move(source), limits);
}

SafetensorsFile SafetensorsFile::parse(std::vector<std::byte> bytes, std::string source, const ReadLimits& limits) {
  const std::string src = "checkpoint '" + source + "'";
  auto bad = [&](const std::string& what) { return std::runtime_error(src + ": " + what); };
  const std::uint64_t size = bytes.size();
  if (size > limits.max_file_bytes)
    throw bad("the file is " + std::to_string(size) + " bytes; the limit is " + std::to_string(limits.max_file_bytes) +
              " (ReadLimits::max_file_bytes)");
  if (size < 8)
    throw bad("the file is " + std::to_string(size) +
              " bytes; expected at least 8 (the little-endian header length)");
  const std::uint64_t n = get_u64_le(bytes.data());
  if (n > limits.max_header_bytes)
    throw bad("the header length is " + std::to_string(n) + " bytes; the limit is " +
              std::to_string(limits.max_header_bytes) + " (ReadLimits::max_header_bytes)");
  if (n > size - 8)
    throw bad("the header length is " + std::to_string(n) + " bytes, but the file has only " +
              std::to_string(size - 8) + " bytes after the length (truncated, or not a safetensors file)");
  if (n == 0) throw bad("the header is empty; expected a JSON object");
  const auto* hdr = reinterpret_cast<const char*>(bytes.data() + 8);
  if (hdr[0] != '{') {
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02x", static_cast<unsigned>(static_cast<unsigned char>(hdr[0])));
    throw bad("the header does not start with '{'; found byte " + std::string(buf));
  }

  HeaderHandler h;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(hdr, hdr + n, &h, nlohmann::json::input_format_t::json, /*strict=*/true,
                                   /*ignore_comments=*/false);
  } catch (const nlohmann::json::exception& e) {
    // sax_parse reports through the handler; this is only a safety net.
    throw bad(std::string("the header is not valid JSON: ") + clip(text::json_error_detail(e.what()), 300));
  }
  if (!ok || !h.complete()) throw bad(h.error.empty() ? "the header is not a complete JSON object" : h.error);
  // The JSON library takes a NUL byte outside a string for the end of its input: what follows
  // would go unread ("{...}\0junk" read as "{...}").
  if (const void* nul = std::memchr(hdr, 0, static_cast<std::size_t>(n)))
    throw bad("the header holds a NUL byte (0x00) at byte " + std::to_string(static_cast<const char*>(nul) - hdr) +
              " of the header; expected JSON text without one");

  SafetensorsFile f;
  if (const auto hc = h.metadata.find(std::string(kHeaderChecksumKey)); hc != h.metadata.end()) {
    // The hash of the header as written: the whole header with the placeholder in the
    // checksum's value. The key must appear once, exactly as the writer spells it.
    const std::string_view header(hdr, static_cast<std::size_t>(n));
    const auto sum = parse_hex16(hc->second);
    if (!sum)
      throw bad("metadata '" + std::string(kHeaderChecksumKey) + "': expected 16 lowercase hex digits, found " +
                in_quotes(hc->second));
    const std::size_t at = header.find(kHeaderChecksumField);
    if (at == std::string_view::npos || header.find(kHeaderChecksumField, at + 1) != std::string_view::npos ||
        header.substr(at + kHeaderChecksumField.size(), kHeaderChecksumPlaceholder.size()) != hc->second)
      throw bad("metadata '" + std::string(kHeaderChecksumKey) +
                "': expected the key once, as the writer spells it (the header was edited)");
    std::string copy(header);
    copy.replace(at + kHeaderChecksumField.size(), kHeaderChecksumPlaceholder.size(), kHeaderChecksumPlaceholder);
    const std::uint64_t got = hash64(std::as_bytes(std::span<const char>(copy.data(), copy.size())));
    if (got != *sum)
      throw bad("header checksum mismatch: the metadata says " + hex16(*sum) + ", the header (bytes [8, " +
                std::to_string(8 + n) + ")) hashes to " + hex16(got) + " (the file is damaged or was edited)");
    h.metadata.erase(hc);
    f.header_checked_ = true;
  }
  f.source_ = std::move(source);
  f.data_start_ = 8 + n;
  const std::uint64_t data_size = size - f.data_start_;
  f.metadata_ = std::move(h.metadata);
  f.tensors_.reserve(h.entries.size());
  for (auto& e : h.entries) {
    const std::string what = "tensor " + in_quotes(e.name) + ": ";
    const std::uint64_t b = (*e.offsets)[0], end = (*e.offsets)[1];
    if (b > end) throw bad(what + "data_offsets " + range_text(b, end) + ": expected begin <= end");
    const auto need = byte_count(*e.shape, dtype_size(*e.dtype));
    if (!need)
      throw bad(what + std::string(dtype_name(*e.dtype)) + " " + shape_text(*e.shape) + " has more than 2^64 bytes");
    if (*need != end - b)
      throw bad(what + std::string(dtype_name(*e.dtype)) + " " + shape_text(*e.shape) + " needs " +
                std::to_string(*need) + " bytes, but data_offsets " + range_text(b, end) + " hold " +
                std::to_string(end - b));
    if (end > data_size)
      throw bad(what + "data " + range_text(b, end) + " lies outside the data section (" + std::to_string(data_size) +
                " bytes)");
    f.tensors_.push_back({std::move(e.name), *e.dtype, std::move(*e.shape), b, end, std::nullopt});
  }
  // Data order; stable so that empty tensors at one offset keep their header order.
  std::stable_sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& c) {
    return a.begin != c.begin ? a.begin < c.begin : a.end < c.end;
  });
  std::uint64_t pos = 0;
  for (std::size_t i = 0; i < f.tensors_.size(); ++i) {
    const TensorInfo& t = f.tensors_[i];
    if (t.begin > pos)
      throw bad("bytes " + range_text(pos, t.begin) + " of the data section belong to no tensor (a gap before tensor " +
                in_quotes(t.name) + " at " + range_text(t.begin, t.end) + "); expected the tensors to be contiguous");
    if (t.begin < pos) {
      const TensorInfo& prev = f.tensors_[i - 1];
      throw bad("tensor " + in_quotes(t.name) + ": data " + range_text(t.begin, t.end) + " overlaps tensor " +
                in_quotes(prev.name) + " at " + range_text(prev.begin, prev.end));
    }
    pos = t.end;
  }
  if (pos != data_size)
    throw bad("bytes " + range_text(pos, data_size) + " at the end of the data section (" + std::to_string(data_size) +
              " bytes) belong to no tensor; expected the tensors to end at " + std::to_string(data_size));
  for (std::size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);

  const auto format = f.metadata_.find(std::string(kFormatKey));
  if (format != f.metadata_.end() && format->second != kFormatValue)
    throw bad("metadata '" + std::string(kFormatKey) + "': expected '" + std::string(kFormatValue) + "', found " +
              in_quotes(format->second));
  for (const auto& [k, v] : f.metadata_) {
    if (!k.starts_with(kChecksumPrefix)) continue;
    const std::string_view name = std::string_view(k).substr(kChecksumPrefix.size());
    const auto it = f.index_.find(name);
    if (it == f.index_.end()) throw bad("metadata " + in_quotes(k) + " is the checksum of tensor " + in_quotes(name) + ", which is not in the file");
    const auto sum = parse_hex16(v);
    if (!sum) throw bad("tensor " + in_quotes(name) + ": checksum: expected 16 lowercase hex digits, found " + in_quotes(v));
    f.tensors_[it->second].checksum = sum;
  }
  f.buffer_ = std::move(bytes);
  for (const TensorInfo& t : f.tensors_) {
    if (!t.checksum) {
      if (format != f.metadata_.end())
        throw bad("tensor " + in_quotes(t.name) + ": no checksum ('" + std::string(kChecksumPrefix) + clip(t.name) +
                  "'); a mixprec-safetensors file has one for every tensor");
      continue;
    }
    const std::uint64_t got = hash64(f.bytes(t.name));
    if (got != *t.checksum)
      throw bad("tensor " + in_quotes(t.name) + ": checksum mismatch: the metadata says " + hex16(*t.checksum) +
                ", the data " + range_text(t.begin, t.end) + " hashes to " + hex16(got) + " (the file is damaged)");
  }
  return f;
}

std::optional<std::string_view> SafetensorsFile::metadata_value(std::string_view key) const {
  const auto it = metadata_.find(std::string(key));
  if (it == metadata_.end()) return std::nullopt;
  return std::string_view(it->second);
}

std::string SafetensorsFile::require_metadata(std::string_view key) const {
  const auto v = metadata_value(key);
  if (!v) throw std::runtime_error("checkpoint '" + source_ + "': no metadata " + in_quotes(key));
  return std::string(*v);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::require(std::string_view name) const {
  if (const TensorInfo* t = find(name)) return *t;
  std::string names;
  for (std::size_t i = 0; i < tensors_.size() && i < 8; ++i) names += (i ? ", " : "") + clip(tensors_[i].name, 40);
  if (tensors_.size() > 8) names += ", ... (" + std::to_string(tensors_.size()) + " in all)";
  throw std::runtime_error("checkpoint '" + source_ + "': no tensor " + in_quotes(name) +
                           (tensors_.empty() ? std::string("; the file has no tensors") : "; the file has " + names));
}

std::span<const std::byte> SafetensorsFile::bytes(std::string_view name) const {
  const TensorInfo& t = require(name);
  return std::span<const std::byte>(buffer_).subspan(static_cast<std::size_t>(data_start_ + t.begin),
                                                     static_cast<std::size_t>(t.end - t.begin));
}

std::span<const std::byte> SafetensorsFile::expect(std::string_view name, DType dtype,
                                                   std::span<const std::uint64_t> shape) const {
  const TensorInfo& t = require(name);
  if (t.dtype != dtype || !std::equal(t.shape.begin(), t.shape.end(), shape.begin(), shape.end()))
    throw std::runtime_error("checkpoint '" + source_ + "': tensor " + in_quotes(name) + ": expected " +
                             std::string(dtype_name(dtype)) + " " + shape_text(shape) + ", found " +
                             std::string(dtype_name(t.dtype)) + " " + shape_text(t.shape));
  return bytes(name);
}

}  // namespace mixprec::ckpt
