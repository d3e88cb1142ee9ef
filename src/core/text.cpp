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

std::string num(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

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

std::string_view json_error_detail(std::string_view what) {
  if (const auto pos = what.find("] "); what.starts_with("[json.exception") && pos != std::string_view::npos)
    what.remove_prefix(pos + 2);
  return what;
}

std::string malformed_json(std::string_view what) { return std::string("malformed JSON: ").append(json_error_detail(what)); }

}  // namespace mixprec::text
