// The one reading path for JSON (core/json_read.hpp): the reader's own guards, then every
// JSON reader of mixprec given the same hostile texts. Each must refuse with
// std::invalid_argument naming its source, never crash, hang or pass the library's text.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "../support.hpp"
#include "../temp_dir.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/lowp/scaling.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/advise/advise.hpp"
#include "mixprec/scaler/layerwise.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/scaler/protocol.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"

namespace mixprec {
namespace {

using test::error_of;

std::string deep(std::size_t levels) { return std::string(levels, '[') + std::string(levels, ']'); }

TEST(JsonRead, ParsesPlainJson) {
  const nlohmann::json j = io::parse_json(R"({"a": [1, {"b": "x"}], "c": null})", "f");
  EXPECT_EQ(j["a"][1]["b"], "x");
  EXPECT_EQ(io::parse_ordered_json(R"({"z": 1, "a": 2})", "f").begin().key(), "z");
  // The same key in two objects is not a duplicate.
  EXPECT_NO_THROW(io::parse_json(R"({"a": {"k": 1}, "b": {"k": 2}, "l": [{"k": 1}, {"k": 2}]})", "f"));
}

TEST(JsonRead, RefusesWhatTheLibraryWouldTakeOrCrashOn) {
  auto err = [](const std::string& text) { return error_of<std::invalid_argument>([&] { io::parse_json(text, "f.json"); }); };
  EXPECT_EQ(err(deep(100000)),
            "f.json: JSON nested deeper than 256 levels (byte 256 opens level 257); the limit is 256");
  EXPECT_NO_THROW(io::parse_json(deep(256), "f.json"));  // the limit itself is read
  EXPECT_EQ(err("\xEF\xBB\xBF{}"),
            "f.json: starts with a UTF-8 byte-order mark (bytes 0xef 0xbb 0xbf); expected JSON text without one");
  EXPECT_EQ(err("\xFF\xFE{\0}\0"), "f.json: looks like UTF-16 (a byte-order mark at offset 0); expected UTF-8 JSON text");
  EXPECT_EQ(err(R"({"a": 1, "a": 2})"), "f.json: key 'a' is given twice");
  EXPECT_EQ(err(R"({"m": {"x": {"k": 1, "k": 2}}})"), "f.json: m.x: key 'k' is given twice");
  EXPECT_EQ(err(R"({"l": [{"k": 1, "k": 2}]})"), "f.json: l[]: key 'k' is given twice");
  EXPECT_TRUE(err("{\"a\": \"\xE9t\xE9\"}")
                  .starts_with("f.json: malformed JSON: parse error at line 1, column 9: syntax error while parsing "
                               "value - invalid string: ill-formed UTF-8 byte"))
      << err("{\"a\": \"\xE9t\xE9\"}");
  // The bytes the parser quotes are shown as \xNN: the message stays valid UTF-8.
  EXPECT_NE(err("{\"a\": \"\xE9t\xE9\"}").find("last read: '\"\\xe9t'"), std::string::npos)
      << err("{\"a\": \"\xE9t\xE9\"}");
  EXPECT_EQ(text::utf8_shown("ok \xC3\xA9 \xE9 \xC0\x80 \xED\xA0\x80 \xF0\x9F\x98\x80"),
            "ok \xC3\xA9 \\xe9 \\xc0\\x80 \\xed\\xa0\\x80 \xF0\x9F\x98\x80");
  EXPECT_TRUE(err("{\"a\": 1e400}").starts_with("f.json: malformed JSON: ")) << err("{\"a\": 1e400}");
  EXPECT_NE(err("{\"a\": 1e400}").find("1e400"), std::string::npos);
  EXPECT_EQ(err("{\n  \"a\": x}"), "f.json: malformed JSON: parse error at line 2, column 8: syntax error while parsing "
                                   "value - invalid literal; last read: '\"a\": x'");
  // No source: the caller names the place.
  EXPECT_EQ(error_of<std::invalid_argument>([] { io::parse_json("[", ""); }).substr(0, 15), "malformed JSON:");
}

TEST(JsonRead, FilesMustBeRegularAndBounded) {
  test::TempDir dir("json_read");
  const auto fifo = dir.path() / "pipe.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No writer: a reader that opened it for reading would wait forever.
  EXPECT_EQ(error_of<std::runtime_error>([&] { io::read_json_file(fifo); }),
            "'" + fifo.string() + "' is a FIFO (named pipe), not a regular file");
  EXPECT_EQ(error_of<std::runtime_error>([] { io::read_json_file("/dev/zero"); }),
            "'/dev/zero' is a character device, not a regular file");
  EXPECT_EQ(error_of<std::runtime_error>([&] { io::read_json_file(dir.path()); }),
            "'" + dir.path().string() + "' is a folder, not a regular file");
  const auto big = dir.path() / "big.json";
  std::ofstream(big) << "{}";
  std::filesystem::resize_file(big, io::kMaxJsonFileBytes + 1);  // sparse: no 64 MiB written
  EXPECT_EQ(error_of<std::runtime_error>([&] { io::read_json_file(big); }),
            "'" + big.string() + "' is " + std::to_string(io::kMaxJsonFileBytes + 1) + " bytes; the limit is " +
                std::to_string(io::kMaxJsonFileBytes) + " bytes");
  const auto ok = dir.path() / "ok.json";
  std::ofstream(ok) << R"({"a": 1, "a": 2})";
  EXPECT_EQ(error_of<std::invalid_argument>([&] { io::read_json_file(ok); }), "'" + ok.string() + "': key 'a' is given twice");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { io::read_json_file(ok, "recipe file"); }),
            "recipe file: key 'a' is given twice");
}

// Every reader of JSON text, by the source its messages name.
struct Reader {
  const char* name;
  const char* source;  // what its message starts with or holds
  std::function<void(const std::string&)> read;
};

std::vector<Reader> readers() {
  return {
      {"recipe file", "recipe file", [](const std::string& t) { (void)lowp::parse_assignment(t); }},
      {"advisor config", "cfg.json", [](const std::string& t) { (void)monitor::advisor::parse_config(t, "cfg.json"); }},
      {"train config", "run.json", [](const std::string& t) { (void)train::apply_json({}, t, "run.json"); }},
      {"run config", "R/config.json", [](const std::string& t) { (void)train::parse_run_config(t, "R/config.json"); }},
      {"log line", "", [](const std::string& t) { (void)train::parse_step_record(t); }},
      {"loss-scale state", "loss-scale state", [](const std::string& t) { (void)LossScaleState::from_json(t); }},
      {"loss-scale config", "", [](const std::string& t) { (void)loss_scale_config_from_json(t); }},
      {"layerwise state", "layerwise state", [](const std::string& t) { (void)LayerwiseScales::from_json(t); }},
      {"fp8 state", "fp8 delayed-scaling state", [](const std::string& t) { (void)lowp::DelayedScalingState::from_json(t); }},
      {"GradScaler state", "GradScaler state", [](const std::string& t) {
         ScalerProtocol p;
         p.load_state_json(t);
       }},
  };
}

TEST(JsonRead, EveryReaderRefusesHostileTextByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {deep(100000), "JSON nested deeper than 256 levels"},
      {"{" + std::string(50000, ' ') + deep(300) + "}", "JSON nested deeper than 256 levels"},
      {"\xEF\xBB\xBF{}", "byte-order mark"},
      {R"({"format": 1, "format": 2})", "key 'format' is given twice"},
      {"{\"a\": \"\xFF\"}", "malformed JSON: parse error at line 1, column 8"},
      {R"({"a": 1e400})", "malformed JSON"},
      {"{", "malformed JSON: parse error at line 1, column 2"},
  };
  for (const Reader& r : readers()) {
    for (const auto& [text, says] : cases) {
      const std::string e = error_of<std::invalid_argument>([&] { r.read(text); });
      EXPECT_NE(e.find(says), std::string::npos) << r.name << " given " << text.substr(0, 40) << ": " << e;
      EXPECT_NE(e.find(r.source), std::string::npos) << r.name << ": " << e;
      EXPECT_EQ(e.find("[json.exception"), std::string::npos) << r.name << ": the library's text: " << e;
    }
  }
}

TEST(JsonRead, TheRecipeFileReaderRefusesFifosAndDevices) {
  test::TempDir dir("json_read_recipe");
  const auto fifo = dir.path() / "recipe.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of<std::runtime_error>([&] { lowp::read_assignment(fifo.string()); }),
            "'" + fifo.string() + "' is a FIFO (named pipe), not a regular file");
  EXPECT_EQ(error_of<std::runtime_error>([] { lowp::read_assignment("/dev/zero"); }),
            "'/dev/zero' is a character device, not a regular file");
  const auto file = dir.path() / "deep.json";
  std::ofstream(file) << deep(100000);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { lowp::read_assignment(file.string()); }),
            file.string() + ": recipe file: JSON nested deeper than 256 levels (byte 256 opens level 257); the limit is 256");
}

}  // namespace
}  // namespace mixprec
