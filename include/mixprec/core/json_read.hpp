// The one reading path for JSON that a user hands in: recipe files, advisor and
// layerwise configs, fp8 and loss-scale state, run-folder files, checkpoint metadata,
// config files. Every JSON reader of mixprec parses through here, so each gets the
// same guards and the same messages:
// - a file must be a regular file (a FIFO, a device or a folder is refused before
//   anything blocks on it) of at most kMaxJsonFileBytes;
// - the text must nest at most kMaxJsonDepth levels (checked before the parser, which
//   recurses per level), must not start with a byte-order mark, must hold no NUL byte
//   (the parser would stop there and take what came before), and must be UTF-8 (the
//   parser checks its strings);
// - an object must not give a key twice (the JSON library would keep the last one);
// - a number a double cannot hold (1e400) is an error, not an infinity.
// Errors are std::invalid_argument "SOURCE: what" for the text, with the parser's
// line and column for bad JSON ("SOURCE: malformed JSON: parse error at line 1,
// column 7: ..."), and std::runtime_error "cannot read 'P': ..." / "'P' is a FIFO
// (named pipe), not a regular file" for the file. No library's exception escapes.
#pragma once

#include <cstddef>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace mixprec::io {

// The largest JSON file a reader takes: far above any file mixprec writes or a user
// writes by hand, far below what would exhaust memory when parsed.
inline constexpr std::size_t kMaxJsonFileBytes = std::size_t{64} << 20;

// "" when the text can be handed to the parser; otherwise what is wrong (a BOM, a NUL
// byte, too deep), for the caller to prefix with its source.
std::string json_text_problem(std::string_view text);

// One JSON document; std::invalid_argument "SOURCE: ..." otherwise (see above); without the
// prefix when `source` is empty (a caller that names the place itself).
nlohmann::json parse_json(std::string_view text, std::string_view source);
// The same, keeping the order of keys (files that are echoed or rewritten).
nlohmann::ordered_json parse_ordered_json(std::string_view text, std::string_view source);

// The text of a JSON file: a regular file of at most kMaxJsonFileBytes, else
// std::runtime_error naming it.
std::string read_json_text(const std::filesystem::path& path);
// read_json_text, then parse_json with `source` (default: the quoted path).
nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view source = {});

}  // namespace mixprec::io
