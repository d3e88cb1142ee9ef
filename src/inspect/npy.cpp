// NumPy .npy reader: the preamble, a strict parser for the header's dict literal, and the
// float decoders (docs/inspect.md).
#include "mixprec/inspect/npy.hpp"
#include "mixprec/core/io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>

#include "mixprec/formats/types.hpp"

namespace mixprec::monitor {
namespace {

constexpr std::array<unsigned char, 6> kMagic{0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr std::string_view kAllowedDtypes = "'<f4', '>f4', '<f2', '>f2', '<f8', '>f8'";
constexpr std::size_t kMaxDimension = std::numeric_limits<std::int64_t>::max();  // NumPy's intp

std::string at_byte(std::size_t offset) { return std::string(" at byte ").append(std::to_string(offset)); }

// Text from an untrusted file, made printable: non-ASCII and control bytes as \xNN.
std::string printable(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (const char ch : s) {
    const auto b = static_cast<unsigned char>(ch);
    if (b == '\\') {
      out += "\\\\";
    } else if (b >= 0x20 && b < 0x7f) {
      out += ch;
    } else if (b == '\n') {
      out += "\\n";
    } else {
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
    }
  }
  return out;
}

// Quoted for a message: '...' unless the text holds a single quote.
std::string in_quotes(std::string_view s, std::size_t max = 40) {
  std::string body = printable(s.substr(0, max));
  if (s.size() > max) body += "...";
  const char q = s.find('\'') == std::string_view::npos ? '\'' : '"';
  return std::string(1, q).append(body).append(1, q);
}

std::string_view as_text(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_word(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == '.' ||
         c == '+' || c == '-';
}

// What a dtype string that is not accepted means, for the message.
std::string dtype_kind(std::string_view d) {
  const bool has_order = !d.empty() && (d[0] == '<' || d[0] == '>' || d[0] == '|' || d[0] == '=');
  const std::string_view rest = has_order ? d.substr(1) : d;
  // A NumPy type string: byte order, one kind letter, the item size in digits.
  bool typestr = !rest.empty();
  for (std::size_t i = 1; i < rest.size(); ++i) typestr = typestr && rest[i] >= '0' && rest[i] <= '9';
  if (!typestr) return "not a NumPy type string";
  switch (rest[0]) {
    case 'i': return "signed integers";
    case 'u': return "unsigned integers";
    case 'b': return "booleans";
    case 'c': return "complex numbers";
    case 'O': return "Python objects";
    case 'U': return "unicode strings";
    case 'S': case 'a': return "byte strings";
    case 'M': return "datetimes";
    case 'm': return "timedeltas";
    case 'V': return "raw bytes (void; ml_dtypes' bfloat16 and float8 are saved this way: convert to float32 first)";
    case 'f':
      if (rest == "f2" || rest == "f4" || rest == "f8") {
        if (!has_order) return "no byte order; expected '<' (little-endian) or '>' (big-endian) before it";
        return std::string("byte order '").append(1, d[0]).append("'; expected '<' (little-endian) or '>' (big-endian)");
      }
      return "floats of an unsupported size";
    default: return "not a NumPy type string";
  }
}

struct DtypeInfo {
  std::size_t itemsize;
  bool big_endian;
};

std::optional<DtypeInfo> accepted_dtype(std::string_view d) {
  if (d.size() != 3 || (d[0] != '<' && d[0] != '>') || d[1] != 'f') return std::nullopt;
  const bool big = d[0] == '>';
  switch (d[2]) {
    case '2': return DtypeInfo{2, big};
    case '4': return DtypeInfo{4, big};
    case '8': return DtypeInfo{8, big};
    default: return std::nullopt;
  }
}

// The header dict: {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::size_t> shape;
};

class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::size_t base, const std::string& src) : t_(text), base_(base), src_(src) {}

  Header parse() {
    Header h;
    bool seen_descr = false, seen_order = false, seen_shape = false;
    skip_space();
    if (peek() != '{') fail("expected '{' (the header is a dict literal)", pos_);
    ++pos_;
    for (;;) {
      skip_space();
      if (peek() == '}') break;
      const std::size_t key_at = pos_;
      if (peek() != '\'' && peek() != '"') fail("expected a quoted key or '}'", pos_);
      const std::string key = parse_string();
      bool* seen = nullptr;
      if (key == "descr") seen = &seen_descr;
      else if (key == "fortran_order") seen = &seen_order;
      else if (key == "shape") seen = &seen_shape;
      else
        fail_here(std::string("unknown key ").append(in_quotes(key)).append("; expected 'descr', 'fortran_order' and 'shape'"),
                  key_at);
      if (*seen) fail_here(std::string("duplicate key ").append(in_quotes(key)), key_at);
      *seen = true;
      skip_space();
      if (peek() != ':') fail(std::string("expected ':' after key ").append(in_quotes(key)), pos_);
      ++pos_;
      skip_space();
      if (key == "descr") h.descr = parse_descr();
      else if (key == "fortran_order") h.fortran_order = parse_bool();
      else h.shape = parse_shape();
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') break;
      fail(std::string("expected ',' or '}' after the value of ").append(in_quotes(key)), pos_);
    }
    ++pos_;  // '}'
    while (pos_ < t_.size() && t_[pos_] == ' ') ++pos_;
    if (pos_ + 1 < t_.size() || (pos_ < t_.size() && t_[pos_] != '\n'))
      fail("expected only spaces and a final newline after '}'", pos_);
    if (t_.empty() || t_.back() != '\n') fail("expected the header to end with a newline", t_.size());
    for (const auto& [seen, name] : {std::pair{seen_descr, "'descr'"}, std::pair{seen_order, "'fortran_order'"},
                                     std::pair{seen_shape, "'shape'"}}) {
      if (!seen)
        throw std::runtime_error(
            std::string(src_).append(": npy header: missing key ").append(name).append(
                " (a header has 'descr', 'fortran_order' and 'shape')"));
    }
    return h;
  }

 private:
  char peek() const { return pos_ < t_.size() ? t_[pos_] : '\0'; }
  bool at_end() const { return pos_ >= t_.size(); }
  void skip_space() {
    while (pos_ < t_.size() && is_space(t_[pos_])) ++pos_;
  }

  // The token at `at`, quoted, for "found ..." (or "the end of the header").
  std::string found(std::size_t at) const {
    if (at >= t_.size()) return "the end of the header";
    std::size_t end = at;
    while (end < t_.size() && end - at < 24 && is_word(t_[end])) ++end;
    if (end == at) end = at + 1;
    return in_quotes(t_.substr(at, end - at));
  }

  [[noreturn]] void fail(const std::string& expected, std::size_t at) const {
    throw std::runtime_error(std::string(src_).append(": npy header: ").append(expected).append(", found ")
                                 .append(found(at)).append(at_byte(base_ + at)));
  }
  [[noreturn]] void fail_here(const std::string& what, std::size_t at) const {
    throw std::runtime_error(std::string(src_).append(": npy header: ").append(what).append(at_byte(base_ + at)));
  }

  // A Python string literal in single or double quotes, without escapes.
  std::string parse_string() {
    const std::size_t start = pos_;
    const char q = t_[pos_++];
    std::string s;
    for (;;) {
      if (at_end() || t_[pos_] == '\n') fail_here("unterminated string", start);
      const char c = t_[pos_];
      if (c == '\\') fail("expected a string without escape sequences", pos_);
      ++pos_;
      if (c == q) return s;
      s += c;
    }
  }

  std::string parse_descr() {
    const std::size_t at = pos_;
    if (peek() == '[')
      fail_here(std::string("structured dtype (a list of fields) is not supported; expected one of ").append(kAllowedDtypes),
                at);
    if (peek() != '\'' && peek() != '"')
      fail(std::string("expected the dtype as a quoted string, one of ").append(kAllowedDtypes), at);
    std::string d = parse_string();
    if (!accepted_dtype(d))
      fail_here(std::string("unsupported dtype ")
                    .append(in_quotes(d))
                    .append(" (")
                    .append(dtype_kind(d))
                    .append("); expected one of ")
                    .append(kAllowedDtypes),
                at);
    return d;
  }

  std::string_view word() {
    const std::size_t start = pos_;
    while (pos_ < t_.size() && is_word(t_[pos_])) ++pos_;
    return t_.substr(start, pos_ - start);
  }

  bool parse_bool() {
    const std::size_t at = pos_;
    const std::string_view w = word();
    if (w == "True") return true;
    if (w == "False") return false;
    fail("expected True or False for 'fortran_order'", at);
  }

  std::size_t parse_dim() {
    const std::size_t at = pos_;
    std::string_view w = word();
    if (w.size() > 1 && w.back() == 'L') w.remove_suffix(1);  // Python 2's long literals: (3L, 4L)
    bool digits = !w.empty() && (w.size() == 1 || w[0] != '0');
    for (const char c : w) digits = digits && c >= '0' && c <= '9';
    if (!digits) fail("expected a non-negative integer dimension in 'shape'", at);
    std::size_t v = 0;
    for (const char c : w) {
      if (__builtin_mul_overflow(v, std::size_t{10}, &v) ||
          __builtin_add_overflow(v, static_cast<std::size_t>(c - '0'), &v) || v > kMaxDimension)
        fail_here(std::string("dimension ").append(in_quotes(w)).append(" in 'shape' is too large (the limit is 2^63 - 1)"),
                  at);
    }
    return v;
  }

  std::vector<std::size_t> parse_shape() {
    const std::size_t open = pos_;
    if (peek() != '(') fail("expected a tuple such as (3, 4), (5,) or () for 'shape'", open);
    ++pos_;
    std::vector<std::size_t> dims;
    skip_space();
    if (peek() == ')') {
      ++pos_;
      return dims;
    }
    for (;;) {
      skip_space();
      dims.push_back(parse_dim());
      if (dims.size() > kNpyMaxDims)
        fail_here(std::string("'shape' has more than ").append(std::to_string(kNpyMaxDims)).append(" dimensions"), open);
      skip_space();
      if (peek() == ',') {
        ++pos_;
        skip_space();
        if (peek() == ')') break;
        continue;
      }
      if (peek() == ')') {
        if (dims.size() == 1) fail("expected ',' after the only dimension of 'shape' ((5,) is a tuple, (5) is not)", pos_);
        break;
      }
      fail("expected ',' or ')' in 'shape'", pos_);
    }
    ++pos_;  // ')'
    return dims;
  }

  std::string_view t_;
  std::size_t base_;
  const std::string& src_;
  std::size_t pos_ = 0;
};

template <class U>
U load(const std::byte* p, bool big_endian) {
  U v;
  std::memcpy(&v, p, sizeof v);
  if (big_endian != (std::endian::native == std::endian::big)) {
    if constexpr (sizeof(U) == 2) v = __builtin_bswap16(v);
    else if constexpr (sizeof(U) == 4) v = __builtin_bswap32(v);
    else v = __builtin_bswap64(v);
  }
  return v;
}

// float64 -> float32, round to nearest even, without the undefined behaviour of a cast
// out of range: counts what the rounding turned into 0 or inf.
float narrow(double d, NpyArray& a) {
  if (std::isnan(d)) return std::copysign(std::numeric_limits<float>::quiet_NaN(), std::signbit(d) ? -1.0f : 1.0f);
  if (std::isinf(d)) return static_cast<float>(d);
  const double m = std::fabs(d);
  constexpr double kOverflow = 0x1.ffffffp127;  // midpoint above FLT_MAX; the tie rounds to even = inf
  if (m >= kOverflow) {
    ++a.narrowed_to_inf;
    return d < 0 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
  }
  constexpr float kMax = std::numeric_limits<float>::max();
  if (m > static_cast<double>(kMax)) return d < 0 ? -kMax : kMax;  // below the midpoint: rounds to FLT_MAX
  const float f = static_cast<float>(d);
  if (f == 0.0f && d != 0.0) ++a.narrowed_to_zero;
  return f;
}

}  // namespace

std::string shape_text(std::span<const std::size_t> shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s.append(i ? ", " : "").append(std::to_string(shape[i]));
  if (shape.size() == 1) s += ',';
  return s + ")";
}

std::string npy_f32_image(std::span<const std::size_t> shape, std::span<const float> values) {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  if (n != values.size())
    throw std::invalid_argument("npy_f32_image: shape " + shape_text(shape) + " holds " + std::to_string(n) +
                                " values, found " + std::to_string(values.size()));
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text(shape) + ", }";
  // magic (6) + version (2) + header length (2) + header + '\n', padded to a multiple of 64.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ').push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xFF));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  static_assert(std::endian::native == std::endian::little, "npy_f32_image writes '<f4' from memory");
  out.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return out;
}

NpyArray parse_npy(std::span<const std::byte> bytes, std::string_view source) {
  const std::string src(source);
  auto error = [&](const std::string& what) { return std::runtime_error(std::string(src).append(": ").append(what)); };
  const std::size_t size = bytes.size();
  const std::string_view text = as_text(bytes);

  // Preamble: magic, version, header length.
  const std::size_t magic_seen = std::min(size, kMagic.size());
  if (size == 0 || std::memcmp(bytes.data(), kMagic.data(), magic_seen) != 0) {
    throw error(std::string("not an npy file: expected the magic string \\x93NUMPY at byte 0, found ")
                    .append(size == 0 ? std::string("an empty file") : in_quotes(text.substr(0, 8))));
  }
  if (size < 8)
    throw error(std::string("npy preamble: the file ends at byte ").append(std::to_string(size))
                    .append(", before the format version (bytes 6-7)"));
  const auto major = std::to_integer<int>(bytes[6]);
  const auto minor = std::to_integer<int>(bytes[7]);
  if (major < 1 || major > 3 || minor != 0)
    throw error(std::string("npy preamble: unsupported format version ")
                    .append(std::to_string(major)).append(".").append(std::to_string(minor))
                    .append(" at byte 6; expected 1.0, 2.0 or 3.0"));
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  const std::size_t header_start = 8 + len_bytes;
  if (size < header_start)
    throw error(std::string("npy preamble: the file ends at byte ").append(std::to_string(size))
                    .append(", inside the header length (bytes 8-").append(std::to_string(header_start - 1)).append(")"));
  std::size_t header_len = 0;
  for (std::size_t i = 0; i < len_bytes; ++i) header_len |= std::to_integer<std::size_t>(bytes[8 + i]) << (8 * i);
  if (header_len > size - header_start)
    throw error(std::string("npy header: the header length ").append(std::to_string(header_len))
                    .append(" (bytes 8-").append(std::to_string(header_start - 1))
                    .append(") runs past the end of the file: expected at most ")
                    .append(std::to_string(size - header_start)).append(", found ").append(std::to_string(header_len)));

  const Header h = HeaderParser(text.substr(header_start, header_len), header_start, src).parse();

  NpyArray a;
  a.version_major = major;
  a.version_minor = minor;
  a.dtype = h.descr;
  a.fortran_order = h.fortran_order;
  a.shape = h.shape;
  const DtypeInfo info = *accepted_dtype(h.descr);

  // Element count and data size, without overflow (a zero dimension makes it 0 whatever the rest).
  std::size_t count = 1;
  bool zero = false;
  for (const std::size_t d : h.shape) zero = zero || d == 0;
  std::size_t data_bytes = 0;
  if (zero) {
    count = 0;
  } else {
    bool overflow = false;
    for (const std::size_t d : h.shape) overflow = overflow || __builtin_mul_overflow(count, d, &count);
    if (overflow || __builtin_mul_overflow(count, info.itemsize, &data_bytes))
      throw error(std::string("npy header: shape ").append(shape_text(h.shape))
                      .append(" is too large: its size in bytes does not fit in 64 bits"));
  }
  data_bytes = count * info.itemsize;
  const std::size_t data_start = header_start + header_len;
  const std::size_t found = size - data_start;
  if (found != data_bytes) {
    std::string what = std::string("npy data: expected ").append(std::to_string(data_bytes))
                           .append(" bytes after byte ").append(std::to_string(data_start))
                           .append(" (shape ").append(shape_text(h.shape)).append(", ")
                           .append(std::to_string(count)).append(" values of ").append(std::to_string(info.itemsize))
                           .append(" bytes, dtype '").append(h.descr).append("'), found ").append(std::to_string(found));
    if (found < data_bytes) what.append(": the file is truncated");
    else what.append(": ").append(std::to_string(found - data_bytes)).append(" extra bytes at the end");
    throw error(what);
  }

  a.values.resize(count);
  const std::byte* p = bytes.data() + data_start;
  switch (info.itemsize) {
    case 2:
      for (std::size_t i = 0; i < count; ++i)
        a.values[i] = static_cast<float>(f16::from_bits(load<std::uint16_t>(p + 2 * i, info.big_endian)));
      break;
    case 4:
      for (std::size_t i = 0; i < count; ++i)
        a.values[i] = std::bit_cast<float>(load<std::uint32_t>(p + 4 * i, info.big_endian));
      break;
    default:
      for (std::size_t i = 0; i < count; ++i)
        a.values[i] = narrow(std::bit_cast<double>(load<std::uint64_t>(p + 8 * i, info.big_endian)), a);
      break;
  }
  return a;
}

NpyArray read_npy(const std::filesystem::path& path, std::uint64_t max_file_bytes) {
  const std::string src = path.string();
  auto error = [&](const std::string& what) { return std::runtime_error(std::string(src).append(": ").append(what)); };
  auto errno_text = [](int e) { return std::generic_category().message(e); };
  struct Fd {
    int fd;
    ~Fd() {
      if (fd >= 0) ::close(fd);
    }
  } fd{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};  // a FIFO: no wait for a writer; fstat refuses it
  if (fd.fd < 0) throw error(std::string("cannot be opened: ").append(errno_text(errno)));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) throw error(std::string("cannot be read: ").append(errno_text(errno)));
  if (S_ISDIR(st.st_mode)) throw error("is a folder; expected an .npy file");
  if (!S_ISREG(st.st_mode)) throw error("is not a regular file; expected an .npy file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_file_bytes)
    throw error(std::string("the file is ").append(std::to_string(size)).append(" bytes; the limit is ")
                    .append(std::to_string(max_file_bytes)).append(" bytes"));
  std::vector<std::byte> buf;
  try {
    buf = io::read_bytes(fd.fd, size);  // a short read: parse_npy says what is missing
  } catch (const std::system_error& e) {
    throw error(std::string("cannot be read: ").append(errno_text(e.code().value())));
  }
  return parse_npy(buf, src);
}

}  // namespace mixprec::monitor
