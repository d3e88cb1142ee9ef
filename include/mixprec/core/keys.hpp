// Configuration keys: the one number grammar and the one description of a key that every
// config struct uses (train::TrainConfig, LossScaleConfig). A config is one table of keys,
// each with its name, kind, range or allowed values, a doc line and its member; parsing
// (JSON config files, --set key=value, command-line flags), validation, the echo into logs
// and reports, and every message come from that table (docs/configuration.md).
//
// Every message has one form: "KEY: expected ALLOWED, found VALUE", where ALLOWED is the
// key's whole range ("an integer in [1, 2147483647]", "a finite number > 0", "fp32, fp16 or
// bf16") and VALUE the text as given ('2.9') or the value found (2.9, string "abc").
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace mixprec::keys {

// ---- the number grammar ------------------------------------------------------------------
//
// A number written as text (a flag's value, --set key=value, a Python keyword's text):
//   decimal   [+|-] digits [. digits] [(e|E) [+|-] digits]     3, -2.5, .5, 2e3, 1.5E-7
//   hex       [+|-] 0x hexdigits [. hexdigits] [p [+|-] digits] 0x1p-24, 0x1.8p3
//   special   [+|-] inf | infinity | nan, in any case           (the key's range decides)
// Nothing else: no spaces, no digit separators, no empty text. A value past the double
// range (1e400) or too small to be told from 0 (1e-400) is refused, not rounded to inf or 0
// (`problem` says which refusal it was). -0 keeps its sign here (`mixprec formats --value
// -0` shows it); a config key reads it as 0, having no use for the sign of zero.
enum class NumberProblem : std::uint8_t { none, not_a_number, out_of_range };
std::optional<double> parse_number(std::string_view text, NumberProblem* problem = nullptr) noexcept;

// An integer of either sign over the whole 64-bit range of each sign.
struct Integer {
  bool negative = false;       // never true with magnitude 0
  std::uint64_t magnitude = 0;

  static Integer of(std::int64_t v) noexcept;
  static Integer of(std::uint64_t v) noexcept { return {false, v}; }
  std::string text() const;
  friend bool operator==(const Integer&, const Integer&) = default;
};

// An integer written as text: decimal digits with an optional sign, read exactly over the
// whole 64-bit range; or a decimal number whose value is whole, up to 2^53 in magnitude,
// where a double still holds every integer: 20.0, 2e3, -1e2 (torch.amp keeps
// growth_interval as a Python number: 20.0 means 20). Not integers: 2.9, 1e300, hex
// (0x10: hex is for numbers such as 0x1p-24), inf, nan.
std::optional<Integer> parse_integer(std::string_view text) noexcept;
// The integer a double holds: whole and at most 2^53 in magnitude (JSON's 12.0, 2e5).
std::optional<Integer> integer_of(double v) noexcept;

// true, false, 1, 0.
std::optional<bool> parse_bool(std::string_view text) noexcept;

// ---- a key -----------------------------------------------------------------------------

enum class Kind : std::uint8_t {
  integer,  // Integer, in [int_min, int_max]
  number,   // double, in the range lo..hi
  boolean,  // true or false
  choice,   // one of `choices`
  text,     // any text; a key's own rule (Key::check) may say more
  list,     // comma-separated integers (JSON: an array), each in [int_min, int_max]
};

struct Spec {
  std::string name{};
  Kind kind = Kind::text;
  std::string doc{};   // one line: the CLI's help, the docs' key tables
  std::string type{};  // the value's placeholder in help: N, X, NAME, DIR, ...
  // integer and list: the range of each integer (narrowed to the member's type by the table)
  std::int64_t int_min = std::numeric_limits<std::int64_t>::min();
  std::uint64_t int_max = std::numeric_limits<std::uint64_t>::max();
  // number: lo .. hi, each end open or closed; nan never; +-inf only with allow_inf
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;
  bool allow_inf = false;
  // number: the value the word "none" stands for (JSON null), written back as none
  std::optional<double> none{};
  // choice: the names allowed, in the order messages list them
  std::vector<std::string> choices{};
  // The allowed values in words, when the range above does not say it all (a key's own rule).
  std::string expected{};
};

// What a key holds, as read from text or JSON or taken from a struct.
struct Invalid {  // a struct value no text stands for (an enum out of range): "enum value 9"
  std::string what;
  friend bool operator==(const Invalid&, const Invalid&) = default;
};
using Value = std::variant<Integer, double, bool, std::string, std::vector<Integer>, Invalid>;

// ALLOWED of the key's messages: spec.expected, or words made from the kind and range.
std::string allowed(const Spec& s);
// A list key's elements in words: "integers >= 1".
std::string allowed_items(const Spec& s);
// The value as the key's text reads it back ("none", "1,5,17", "0.001", "true").
std::string text_of(const Spec& s, const Value& v);
// The value in a message: numbers as the shortest text that reads back, text quoted.
std::string found_text(const Value& v);

// The key's text to a value of its kind within its range; std::invalid_argument otherwise:
// "KEY: expected ALLOWED, found 'TEXT'" for a text that is no value of the kind (quoted, with
// a hint where the grammar explains the refusal: an integer written in hex, a number past the
// double range), "KEY: expected ALLOWED, found VALUE" for one out of range (as a config
// file's value or a struct's member is named: 0, 1e-50, not '0').
Value parse_text(const Spec& s, std::string_view text);
// The range check of a value (a struct's member, a JSON value):
// std::invalid_argument "KEY: expected ALLOWED, found VALUE".
void check(const Spec& s, const Value& v);

// "KEY: expected ALLOWED, found FOUND" as std::invalid_argument.
[[noreturn]] void fail(std::string_view key, std::string_view expected, std::string_view found);
// "a, b or c" (last_sep " or ") / "a, b, c" (last_sep ", ").
std::string join(const std::vector<std::string>& names, std::string_view last_sep = " or ");

}  // namespace mixprec::keys
