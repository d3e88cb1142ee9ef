// Text for messages and reports: the one definition of each small formatting rule that
// errors, the CLI, alerts and the report share.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mixprec::text {

// 'text': how every message quotes a file name, a key's value or a name.
std::string squote(std::string_view s);

// The shortest text that reads back as the same double (std::to_chars): "10", "0.0003",
// "1e-05", "-1", "nan", "inf".
std::string num(double v);
// The same for a float: its own shortest text ("1e-12", "0.1"), not the double's
// ("9.999999960041972e-13"); never std::to_string's six decimals ("0.000000").
std::string num_f32(float v);

// A fraction as a percentage with `decimals` decimals ("12.50%"); a nonzero fraction
// that would print as zero gets two significant digits instead ("0.0012%"); NaN and
// infinities print as "-".
std::string percent(double fraction, int decimals = 2);

// A JSON string literal of s: quotes, backslash escapes, control characters as \u00XX.
std::string json_quote(std::string_view s);

// 1234567 -> "1,234,567".
std::string grouped(std::uint64_t v);

// A JSON parser's exception text as messages show it: "malformed JSON: parse error at
// line 1, column 7: ..." (the library's "[json.exception.parse_error.101] " prefix
// dropped, and the bytes it quotes ("last read: '...'") as valid UTF-8: see utf8_shown).
// Every JSON reader of mixprec reports bad JSON through this.
std::string malformed_json(std::string_view exception_what);
// The same text without "malformed JSON: ", for readers that say it their own way.
std::string json_error_detail(std::string_view exception_what);

// s with every byte that is not part of a valid UTF-8 sequence written as \xNN: a message
// that quotes a file's bytes stays text (Python could not even raise it otherwise).
std::string utf8_shown(std::string_view s);

}  // namespace mixprec::text
