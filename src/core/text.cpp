// Message and report formatting (include/mixprec/core/text.hpp).
#include "mixprec/core/text.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <system_error>

namespace mixprec::text {

std::string squote(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('\'');
  out.append(s);
  out.push_back('\'');
  return out;
}

namespace {

// The shortest text that reads back as the same T (std::to_chars); nan and the infinities by name.
template <class T>
std::string shortest(T v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace

std::string num(double v) { return shortest(v); }

std::string num_f32(float v) { return shortest(v); }

std::string percent(double fraction, int decimals) {
  if (!std::isfinite(fraction)) return "-";
  char buf[64];
  const double p = fraction * 100;
  if (p != 0 && std::fabs(p) < std::pow(10.0, -decimals)) std::snprintf(buf, sizeof buf, "%.2g%%", p);
  else std::snprintf(buf, sizeof buf, "%.*f%%", decimals, p);
  return buf;
}

std::string json_quote(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string grouped(std::uint64_t v) {
  const std::string s = std::to_string(v);
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i != 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string json_error_detail(std::string_view what) {
  if (const auto pos = what.find("] "); what.starts_with("[json.exception") && pos != std::string_view::npos)
    what.remove_prefix(pos + 2);
  return utf8_shown(what);
}

std::string utf8_shown(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  static constexpr char kHex[] = "0123456789abcdef";
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    // The length of the sequence b starts, and the smallest code point that needs it
    // (overlong forms and surrogates are not valid UTF-8).
    std::size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    bool ok = n > 0 && i + n <= s.size();
    char32_t cp = n == 1 ? b : n == 2 ? (b & 0x1Fu) : n == 3 ? (b & 0x0Fu) : (b & 0x07u);
    for (std::size_t k = 1; ok && k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      ok = (c >> 6) == 0x2;
      cp = (cp << 6) | (c & 0x3Fu);
    }
    if (ok) {
      static constexpr char32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
      ok = cp >= kMin[n] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    }
    if (ok) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\\x").push_back(kHex[b >> 4]);
      out.push_back(kHex[b & 0xF]);
      ++i;
    }
  }
  return out;
}

std::string malformed_json(std::string_view what) { return std::string("malformed JSON: ").append(json_error_detail(what)); }

}  // namespace mixprec::text
