// The number grammar and the key descriptions of every config (include/mixprec/core/keys.hpp).
#include "mixprec/core/keys.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <stdexcept>
#include <system_error>

#include "mixprec/core/text.hpp"

namespace mixprec::keys {
namespace {

constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53: a double holds every integer up to here
constexpr std::uint64_t kUnboundedMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

struct Sign {
  bool negative = false;
  std::string_view rest;
};

// One optional sign, and the text after it (which must not start with another).
std::optional<Sign> split_sign(std::string_view s) noexcept {
  Sign out;
  if (!s.empty() && (s.front() == '+' || s.front() == '-')) {
    out.negative = s.front() == '-';
    s.remove_prefix(1);
  }
  if (s.empty() || s.front() == '+' || s.front() == '-') return std::nullopt;
  out.rest = s;
  return out;
}

bool is_hex(std::string_view rest) noexcept { return rest.size() >= 2 && rest[0] == '0' && (rest[1] == 'x' || rest[1] == 'X'); }

std::optional<double> read_number(std::string_view text, NumberProblem& problem) noexcept {
  problem = NumberProblem::not_a_number;
  const auto sign = split_sign(text);
  if (!sign) return std::nullopt;
  std::string_view s = sign->rest;
  auto format = std::chars_format::general;
  if (is_hex(s)) {
    s.remove_prefix(2);
    // from_chars would take "inf" after the prefix: hex digits or a point only
    if (s.empty() || !(std::isxdigit(static_cast<unsigned char>(s.front())) || s.front() == '.')) return std::nullopt;
    format = std::chars_format::hex;
  }
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, format);
  if (end != s.data() + s.size()) return std::nullopt;
  if (ec == std::errc::result_out_of_range) {
    problem = NumberProblem::out_of_range;
    return std::nullopt;
  }
  if (ec != std::errc{}) return std::nullopt;
  problem = NumberProblem::none;
  return sign->negative ? -v : v;
}

bool all_digits(std::string_view s) noexcept {
  if (s.empty()) return false;
  for (const char ch : s)
    if (ch < '0' || ch > '9') return false;
  return true;
}

// Why a text is not an integer, for the message; "" when the key's range says enough.
std::string integer_hint(std::string_view text) {
  const auto sign = split_sign(text);
  if (!sign) return "";
  if (is_hex(sign->rest)) return " (integers are written in decimal: digits, or a whole number such as 2e6 or 20.0)";
  if (all_digits(sign->rest)) return " (past the 64-bit range)";
  NumberProblem p{};
  const auto v = read_number(text, p);
  if (p == NumberProblem::out_of_range) return " (past the range of a double)";
  if (v && std::isfinite(*v) && *v == std::floor(*v) && std::fabs(*v) > kMaxExactInteger)
    return " (an integer past 2^53 is written in digits: a double does not hold every integer there)";
  return "";
}

std::string int_bound_text(std::int64_t lo, std::uint64_t hi) {
  const bool lo_open = lo == std::numeric_limits<std::int64_t>::min();
  const bool hi_open = hi >= kUnboundedMax;
  if (lo_open && hi_open) return "an integer";
  if (hi_open) return lo == 0 ? "a non-negative integer" : "an integer >= " + std::to_string(lo);
  if (lo_open) return "an integer <= " + std::to_string(hi);
  return "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

// "an integer >= 1" -> "integers >= 1" (a list's elements).
std::string plural(std::string one) {
  if (one.starts_with("an integer")) return std::string("integers").append(one, 10);
  if (one.starts_with("a non-negative integer")) return std::string("non-negative integers").append(one, 22);
  return one;
}

bool in_range(const Spec& s, const Integer& v) noexcept {
  if (v.negative) {
    if (s.int_min >= 0) return false;
    // -int_min as unsigned, without overflow for INT64_MIN
    const std::uint64_t limit = static_cast<std::uint64_t>(-(s.int_min + 1)) + 1;
    return v.magnitude <= limit;
  }
  return (s.int_min <= 0 || v.magnitude >= static_cast<std::uint64_t>(s.int_min)) && v.magnitude <= s.int_max;
}

bool in_range(const Spec& s, double v) noexcept {
  if (std::isnan(v)) return false;
  if (s.none && v == *s.none) return true;
  if (std::isinf(v) && !s.allow_inf) return false;
  if (s.lo_open ? !(v > s.lo) : !(v >= s.lo)) return false;
  if (s.hi_open ? !(v < s.hi) : !(v <= s.hi)) return false;
  return true;
}

std::string list_allowed(const Spec& s) { return allowed_items(s) + " separated by commas (e.g. 5,17)"; }

}  // namespace

// ---- the grammar ---------------------------------------------------------------------

std::optional<double> parse_number(std::string_view text, NumberProblem* problem) noexcept {
  NumberProblem p{};
  const auto v = read_number(text, p);
  if (problem != nullptr) *problem = p;
  return v;
}

Integer Integer::of(std::int64_t v) noexcept {
  if (v >= 0) return {false, static_cast<std::uint64_t>(v)};
  return {true, static_cast<std::uint64_t>(-(v + 1)) + 1};
}

std::string Integer::text() const { return std::string(negative ? "-" : "").append(std::to_string(magnitude)); }

std::optional<Integer> integer_of(double v) noexcept {
  if (!std::isfinite(v) || v != std::floor(v) || std::fabs(v) > kMaxExactInteger) return std::nullopt;
  const auto m = static_cast<std::uint64_t>(std::fabs(v));
  return Integer{v < 0 && m != 0, m};
}

std::optional<Integer> parse_integer(std::string_view text) noexcept {
  const auto sign = split_sign(text);
  if (!sign) return std::nullopt;
  if (all_digits(sign->rest)) {
    std::uint64_t m = 0;
    const auto [end, ec] = std::from_chars(sign->rest.data(), sign->rest.data() + sign->rest.size(), m);
    if (ec != std::errc{} || end != sign->rest.data() + sign->rest.size()) return std::nullopt;
    return Integer{sign->negative && m != 0, m};
  }
  if (is_hex(sign->rest)) return std::nullopt;
  const auto v = parse_number(text);
  if (!v) return std::nullopt;
  return integer_of(*v);
}

std::optional<bool> parse_bool(std::string_view text) noexcept {
  if (text == "true" || text == "1") return true;
  if (text == "false" || text == "0") return false;
  return std::nullopt;
}

// ---- keys ------------------------------------------------------------------------------

void fail(std::string_view key, std::string_view expected, std::string_view found) {
  throw std::invalid_argument(std::string(key).append(": expected ").append(expected).append(", found ").append(found));
}

std::string join(const std::vector<std::string>& names, std::string_view last_sep) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i != 0) out += i + 1 == names.size() ? std::string(last_sep) : std::string(", ");
    out += names[i];
  }
  return out;
}

std::string allowed_items(const Spec& s) { return plural(int_bound_text(s.int_min, s.int_max)); }

std::string allowed(const Spec& s) {
  if (!s.expected.empty()) return s.expected;
  switch (s.kind) {
    case Kind::integer:
      return int_bound_text(s.int_min, s.int_max);
    case Kind::number: {
      const char* kind = s.allow_inf ? "a number" : "a finite number";
      const bool lo = std::isfinite(s.lo), hi = std::isfinite(s.hi);
      std::string base;
      if (lo && hi)
        base = std::string("a number in ") + (s.lo_open ? "(" : "[") + text::num(s.lo) + ", " + text::num(s.hi) +
               (s.hi_open ? ")" : "]");
      else if (lo)
        base = std::string(kind) + (s.lo_open ? " > " : " >= ") + text::num(s.lo);
      else if (hi)
        base = std::string(kind) + (s.hi_open ? " < " : " <= ") + text::num(s.hi);
      else
        base = kind;
      std::vector<std::string> parts{base};
      if (s.allow_inf && !hi) parts.emplace_back("inf");
      if (s.none) parts.emplace_back("none");
      return join(parts);
    }
    case Kind::boolean:
      return "true or false";
    case Kind::choice:
      return join(s.choices);
    case Kind::text:
      return "a string";
    case Kind::list:
      return list_allowed(s);
  }
  return "?";
}

std::string text_of(const Spec& s, const Value& v) {
  if (const auto* i = std::get_if<Integer>(&v)) return i->text();
  if (const auto* d = std::get_if<double>(&v)) return s.none && *d == *s.none ? std::string("none") : text::num(*d);
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const auto* t = std::get_if<std::string>(&v)) return *t;
  if (const auto* l = std::get_if<std::vector<Integer>>(&v)) {
    std::string out;
    for (const Integer& e : *l) out.append(out.empty() ? "" : ",").append(e.text());
    return out;
  }
  return std::get<Invalid>(v).what;
}

std::string found_text(const Value& v) {
  if (const auto* i = std::get_if<Integer>(&v)) return i->text();
  if (const auto* d = std::get_if<double>(&v)) return text::num(*d);
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const auto* t = std::get_if<std::string>(&v)) return text::squote(*t);
  if (const auto* l = std::get_if<std::vector<Integer>>(&v)) {
    std::string out = "[";
    for (const Integer& e : *l) out.append(out.size() == 1 ? "" : ", ").append(e.text());
    return out + "]";
  }
  return std::get<Invalid>(v).what;
}

Value parse_text(const Spec& s, std::string_view text) {
  const auto refuse = [&](const std::string& hint = "") { fail(s.name, allowed(s), text::squote(text) + hint); };
  Value v;
  switch (s.kind) {
    case Kind::integer: {
      const auto i = parse_integer(text);
      if (!i) refuse(integer_hint(text));
      v = *i;
      break;
    }
    case Kind::number: {
      if (s.none && text == "none") {
        v = *s.none;
        break;
      }
      NumberProblem p{};
      const auto d = read_number(text, p);
      if (!d) refuse(p == NumberProblem::out_of_range ? " (past the range of a double)" : "");
      v = *d == 0 ? 0.0 : *d;  // -0 reads as 0
      break;
    }
    case Kind::boolean: {
      const auto b = parse_bool(text);
      if (!b) refuse();
      v = *b;
      break;
    }
    case Kind::choice:
    case Kind::text:
      v = std::string(text);
      break;
    case Kind::list: {
      std::vector<Integer> items;
      for (std::size_t start = 0; !text.empty() && start <= text.size();) {
        const std::size_t comma = std::min(text.find(',', start), text.size());
        const auto i = parse_integer(text.substr(start, comma - start));
        if (!i) refuse();
        items.push_back(*i);
        start = comma + 1;
      }
      v = std::move(items);
      break;
    }
  }
  check(s, v);  // a value out of range is named as a config file's would be: 0, not '0'

  return v;
}

void check(const Spec& s, const Value& v) {
  if (const auto* bad = std::get_if<Invalid>(&v)) fail(s.name, allowed(s), bad->what);
  switch (s.kind) {
    case Kind::integer:
      if (!in_range(s, std::get<Integer>(v))) fail(s.name, allowed(s), found_text(v));
      return;
    case Kind::number:
      if (!in_range(s, std::get<double>(v))) fail(s.name, allowed(s), found_text(v));
      return;
    case Kind::choice: {
      const std::string& name = std::get<std::string>(v);
      for (const std::string& c : s.choices)
        if (c == name) return;
      fail(s.name, allowed(s), found_text(v));
    }
    case Kind::list:
      for (const Integer& e : std::get<std::vector<Integer>>(v))
        if (!in_range(s, e)) fail(s.name, int_bound_text(s.int_min, s.int_max), e.text());
      return;
    case Kind::boolean:
    case Kind::text:
      return;
  }
}

}  // namespace mixprec::keys
