// A limit on the nesting depth of JSON text, shared by every JSON reader of mixprec
// (config files, run folders, log lines, checkpoint metadata, scaler and fp8 state).
// Deeply nested input ("[[[[...") would otherwise make the JSON library, and code that
// walks or compares its values, recurse once per level and overflow the stack. The
// readers call json_depth_problem on the text before they parse it and refuse it with
// the message, naming their file.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace mixprec {

// The deepest nesting (objects and arrays) a mixprec JSON reader accepts. Every file
// mixprec writes nests at most 4 levels.
inline constexpr std::size_t kMaxJsonDepth = 256;

// The offset of the '[' or '{' that opens level limit + 1 (brackets inside strings do
// not count), or npos when the text nests at most `limit` levels. A linear scan of
// the bytes: it does not check that the text is JSON (the parser does that next).
inline std::size_t json_depth_exceeded_at(std::string_view text, std::size_t limit = kMaxJsonDepth) noexcept {
  std::size_t depth = 0;
  bool in_string = false, escape = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escape) escape = false;
      else if (c == '\\') escape = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return i;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return std::string_view::npos;
}

// "" when the text nests at most `limit` levels; otherwise what is wrong, for the
// reader to prefix with its file: "JSON nested deeper than 256 levels (byte 256 opens
// level 257); the limit is 256".
inline std::string json_depth_problem(std::string_view text, std::size_t limit = kMaxJsonDepth) {
  const std::size_t at = json_depth_exceeded_at(text, limit);
  if (at == std::string_view::npos) return {};
  return "JSON nested deeper than " + std::to_string(limit) + " levels (byte " + std::to_string(at) + " opens level " +
         std::to_string(limit + 1) + "); the limit is " + std::to_string(limit);
}

}  // namespace mixprec
