// The one reading path for JSON (include/mixprec/core/json_read.hpp).
#include "mixprec/core/json_read.hpp"

#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/core/json_depth.hpp"
#include "mixprec/core/text.hpp"

namespace mixprec::io {
namespace {

// Where the parser is: one entry per open object or array, with the keys an object has
// given so far, so that a key given twice is found while parsing (the library keeps the
// last value and says nothing).
struct Level {
  bool object = false;
  std::set<std::string> keys;
  std::string key;  // the key being read in an object
};

std::string path_of(const std::vector<Level>& levels) {
  std::string p;
  for (std::size_t i = 0; i + 1 < levels.size(); ++i) {
    if (levels[i].object) {
      if (!p.empty()) p += '.';
      p += levels[i].key;
    } else {
      p += "[]";
    }
  }
  return p;
}

template <class Json>
Json parse_checked(std::string_view text, std::string_view source) {
  const std::string src = source.empty() ? std::string() : std::string(source) + ": ";
  if (const std::string problem = json_text_problem(text); !problem.empty()) throw std::invalid_argument(src + problem);
  std::vector<Level> levels;
  std::string duplicate;
  Json doc;
  try {
    doc = Json::parse(text.begin(), text.end(), [&](int, typename Json::parse_event_t event, Json& parsed) {
      using E = typename Json::parse_event_t;
      switch (event) {
        case E::object_start: levels.push_back({true, {}, {}}); break;
        case E::array_start: levels.push_back({false, {}, {}}); break;
        case E::object_end:
        case E::array_end:
          if (!levels.empty()) levels.pop_back();
          break;
        case E::key:
          if (!levels.empty() && parsed.is_string()) {
            Level& l = levels.back();
            l.key = parsed.template get<std::string>();
            if (!l.keys.insert(l.key).second && duplicate.empty()) {
              const std::string where = path_of(levels);
              duplicate = (where.empty() ? "" : where + ": ") + "key " + text::squote(l.key) + " is given twice";
            }
          }
          break;
        case E::value: break;
      }
      return true;
    });
  } catch (const std::exception& e) {  // parse_error, and out_of_range for a number a double cannot hold (1e400)
    throw std::invalid_argument(src + text::malformed_json(e.what()));
  }
  if (!duplicate.empty()) throw std::invalid_argument(src + duplicate);
  return doc;
}

}  // namespace

std::string json_text_problem(std::string_view text) {
  if (text.starts_with("\xEF\xBB\xBF"))
    return "starts with a UTF-8 byte-order mark (bytes 0xef 0xbb 0xbf); expected JSON text without one";
  if (text.starts_with("\xFF\xFE") || text.starts_with("\xFE\xFF"))
    return "looks like UTF-16 (a byte-order mark at offset 0); expected UTF-8 JSON text";
  // The JSON library takes a NUL byte for the end of the input: "{}\0garbage" would be read as {}.
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
    return "a NUL byte (0x00) at byte " + std::to_string(nul) + "; expected JSON text without one";
  return json_depth_problem(text);
}

nlohmann::json parse_json(std::string_view text, std::string_view source) {
  return parse_checked<nlohmann::json>(text, source);
}

nlohmann::ordered_json parse_ordered_json(std::string_view text, std::string_view source) {
  return parse_checked<nlohmann::ordered_json>(text, source);
}

std::string read_json_text(const std::filesystem::path& path) { return read_regular_file(path, kMaxJsonFileBytes); }

nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view source) {
  const std::string text = read_json_text(path);
  return parse_json(text, source.empty() ? text::squote(path.string()) : std::string(source));
}

}  // namespace mixprec::io
