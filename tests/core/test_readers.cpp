// Every reader of what a user hands in, given the same hostile inputs: 100,000-deep
// nesting, a FIFO, /dev/zero, a non-UTF-8 byte inside a string, a UTF-8 byte-order mark,
// a key given twice, a number out of range for one of its keys, a NUL byte and a file over
// the JSON reader's 64 MiB. Each must refuse within 20 s with a message that names the file
// (or the text's source) and the key, never crash, hang or pass the JSON library's own text.
// The one exception by design: a data file (`--data`, plain text) may start with a BOM,
// which the reader drops.
//
// One test per reader (Reader/Refuses.HostileInputs/READER), one row of rows() each; a row
// marks the inputs that do not apply to its format, with the reason.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../temp_dir.hpp"
#include "mixprec/advise/advise.hpp"
#include "mixprec/checkpoint/safetensors.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/inspect/npy.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/scaling.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/report/report.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/scaler/layerwise.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/scaler/protocol.hpp"
#include "mixprec/scaler/step_guard.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec {
namespace {

namespace fs = std::filesystem;
namespace adv = monitor::advisor;
using ojson = nlohmann::ordered_json;

// ---- the hostile inputs -------------------------------------------------------------------

std::string deep(std::size_t levels) { return std::string(levels, '[') + std::string(levels, ']'); }

// JSON text of `valid` with the value at `pointer` replaced.
std::string with_value(const std::string& valid, const std::string& pointer, const ojson& value) {
  ojson j = ojson::parse(valid);
  const ojson::json_pointer p(pointer);
  if (!j.contains(p)) throw std::logic_error("the test's document has no " + pointer);
  j[p] = value;
  return j.dump();
}

// `valid` (an object) with `"KEY": VALUE` put first, KEY a key it already has at the top.
std::string with_first(const std::string& valid, const std::string& member) {
  const std::size_t brace = valid.find('{');
  if (brace == std::string::npos) throw std::logic_error("the test's document is not an object");
  return valid.substr(0, brace + 1) + member + "," + valid.substr(brace + 1);
}

// What one hostile input is and what the refusal must say (each fragment, besides the
// reader's own names).
struct Variant {
  std::string text;               // the JSON text (or, for a reader's own variants, the bytes)
  std::vector<std::string> says;  // fragments the message must hold
  bool accepted = false;          // read as a good input (a BOM in a data file)
};

// nul: a NUL byte after the document, then more (the JSON library stops at a NUL);
// huge: a (sparse) file one byte over the JSON reader's limit, io::kMaxJsonFileBytes.
enum class Kind { deep, bom, duplicate, non_utf8, out_of_range, fifo, dev_zero, nul, huge };
constexpr Kind kKinds[] = {Kind::deep, Kind::bom,      Kind::duplicate, Kind::non_utf8, Kind::out_of_range,
                           Kind::fifo, Kind::dev_zero, Kind::nul,       Kind::huge};
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::deep:
      return "100,000-deep nesting";
    case Kind::bom:
      return "a byte-order mark";
    case Kind::duplicate:
      return "a key given twice";
    case Kind::non_utf8:
      return "a non-UTF-8 byte";
    case Kind::out_of_range:
      return "a number out of range";
    case Kind::fifo:
      return "a FIFO";
    case Kind::dev_zero:
      return "/dev/zero";
    case Kind::nul:
      return "a NUL byte";
    case Kind::huge:
      return "a file over 64 MiB";
  }
  return "?";
}

// One reader of user input. A text reader (no `file`) is given the text; a file reader
// finds its file under a fresh folder `dir` (setup writes what else it needs there).
struct Reader {
  std::string name;
  std::string valid;  // a document it reads without error
  // The key the duplicate case gives twice (at the top level: its value is copied), the
  // number out of range (JSON pointer, value) and what the message says of it (the key,
  // the range and the value found).
  std::string duplicate_key;
  std::string range_pointer;
  ojson range_value;
  std::vector<std::string> range_says;
  // What every message of the reader names: its source (a text reader's name for its
  // text; a file reader's message holds the file's path as well).
  std::vector<std::string> names;
  // File readers only.
  std::function<fs::path(const fs::path& dir)> file;
  std::function<void(const fs::path& dir)> setup = [](const fs::path&) {};
  std::function<std::string(const std::string& text)> bytes = [](const std::string& t) { return t; };
  // Reads: the text (a text reader) or the folder (a file reader).
  std::function<void(const std::string& text_or_dir)> read;
  // Variants this reader replaces (a format that is not JSON) and kinds that do not apply.
  std::map<Kind, Variant> own;
  std::map<Kind, std::string> not_applicable;
};

Variant variant_of(const Reader& r, Kind k) {
  if (const auto it = r.own.find(k); it != r.own.end()) return it->second;
  switch (k) {
    case Kind::deep:
      return {"{\"k\": " + deep(100000) + "}", {"JSON nested deeper than 256 levels"}};
    case Kind::bom:
      return {"\xEF\xBB\xBF" + r.valid, {"byte-order mark"}};
    case Kind::duplicate: {
      const ojson j = ojson::parse(r.valid);
      const std::string member = "\"" + r.duplicate_key + "\": " + j.at(r.duplicate_key).dump();
      return {with_first(r.valid, member), {"'" + r.duplicate_key + "' is given twice"}};
    }
    case Kind::non_utf8:
      return {with_first(r.valid, "\"k\xFFy\": 1"), {"ill-formed UTF-8 byte", "line 1, column"}};
    case Kind::out_of_range:
      return {with_value(r.valid, r.range_pointer, r.range_value), r.range_says};
    case Kind::fifo:
      return {"", {"is a FIFO (named pipe)"}};
    case Kind::dev_zero:
      return {"", {"is a character device"}};
    case Kind::nul:
      return {r.valid + std::string(1, '\0') + "{\"junk\": 1}",
              {"a NUL byte (0x00) at byte " + std::to_string(r.valid.size())}};
    case Kind::huge:
      return {r.valid,
              {"is " + std::to_string(io::kMaxJsonFileBytes + 1) + " bytes; the limit is " +
               std::to_string(io::kMaxJsonFileBytes) + " bytes"}};
  }
  return {};
}

// ---- a read that must return ----------------------------------------------------------------

constexpr auto kPatience = std::chrono::seconds(20);

struct Outcome {
  bool returned = false;  // within kPatience
  bool threw = false;
  std::string message;
};

// Runs `read` on a thread of its own. One that has not returned after kPatience fails the
// test; a FIFO it waits on is then given a writer (so that it returns), and a read that still
// does not return ends the test program (a thread stuck in read() cannot be stopped).
Outcome bounded(const std::function<void()>& read, const fs::path& fifo) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Outcome out;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, read] {
    Outcome o;
    try {
      read();
    } catch (const std::exception& e) {
      o.threw = true;
      o.message = e.what();
    } catch (...) {
      o.threw = true;
      o.message = "(an exception that is not a std::exception)";
    }
    o.returned = true;
    const std::lock_guard lock(shared->mu);
    shared->out = std::move(o);
    shared->done = true;
    shared->cv.notify_all();
  }).detach();
  std::unique_lock lock(shared->mu);
  if (shared->cv.wait_for(lock, kPatience, [&] { return shared->done; })) return shared->out;
  lock.unlock();
  if (!fifo.empty()) {  // a reader blocked in open() or read() of the FIFO: let it go
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) ::close(fd);
  }
  lock.lock();
  if (!shared->cv.wait_for(lock, std::chrono::seconds(5), [&] { return shared->done; })) {
    std::fprintf(stderr, "FATAL: a read did not return after %lld s and cannot be stopped\n",
                 static_cast<long long>(kPatience.count() + 5));
    std::fflush(stderr);
    std::_Exit(1);
  }
  Outcome o;  // it returned, but only once the FIFO had a writer: a hang
  o.message = "(returned only after the FIFO was given a writer: " + shared->out.message + ")";
  return o;
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// ---- the readers --------------------------------------------------------------------------------

constexpr const char* kRecipe = R"({
  "format": "mixprec.low_precision", "version": 1, "default": "nvfp4",
  "options": {"amax_history_len": 32},
  "modules": {"h.0.fc": "bf16", "h.0.proj": {"recipe": "fp8-delayed", "margin": 1}},
  "notes": "by hand"})";

constexpr const char* kAdvisorConfig = R"({"candidates": ["nvfp4", "bf16"], "budget": {"x": 0.1}, "margin": 0})";

std::string step_record_line() {
  train::StepRecord r;
  r.step = 1;
  r.tokens = 64;
  return train::step_record_json(r);
}

std::string layerwise_state() {
  ojson j = ojson::parse(LayerwiseScales().to_json());
  j["layers"].push_back(
      {{"name", "fc"}, {"fan_in", 4}, {"backoff", 0}, {"clean_steps", 0}, {"overflows", 0}, {"skipped", 0}});
  return j.dump();
}

std::string fp8_state() {
  lowp::DelayedScalingConfig c;
  c.amax_history_len = 2;
  lowp::DelayedScaling d(c);
  d.add_tensor("w", lowp::Role::forward);
  return d.to_json();
}

// Advisor samples of one step: the input and the weight of one small layer.
void write_samples(const fs::path& dir) {
  static const std::vector<float> values = [] {
    std::vector<float> v(64 * 16);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
    return v;
  }();
  const adv::SampleView s[] = {{"fc", adv::Role::x, 1, 1.0f, 64, 16, 64, values},
                               {"fc", adv::Role::w, 1, 1.0f, 8, 16, 8, std::span(values).first(8 * 16)}};
  adv::write_step_samples(dir, 1, 1.0f, s);
}

std::string advice_text() {
  test::TempDir dir("readers_advice");
  write_samples(dir.path());
  const std::vector<adv::OwnedSample> owned = adv::read_samples(dir.path());
  std::vector<adv::SampleView> views;
  for (const adv::OwnedSample& s : owned) views.push_back(s.view());
  return adv::advice_json(adv::advise(views, adv::AdviseConfig{}));
}

constexpr const char* kSummary =
    R"({"config": {"steps": 2}, "alerts": [{"id": "scale-collapse", "message": "m", "advice": "a",)"
    R"( "severity": "warning", "step": 3, "last_step": 4, "steps": 2}]})";

// A safetensors file: the 8-byte header length, the header, then the data.
std::string safetensors_bytes(const std::string& header, std::size_t data_bytes) {
  std::string out(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\0');
}
constexpr const char* kSafetensorsHeader =
    R"({"__metadata__": {"note": "x"}, "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";

// A .npy file of float32 values with `dict` as its header (padded as NumPy pads it).
std::string npy_bytes(const std::string& dict, std::size_t data_bytes) {
  std::string header = dict;
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  return out + header + std::string(data_bytes, '\0');
}

// A checkpoint of a tiny run, written once; each case changes one metadata entry.
train::TrainConfig tiny_run() {
  train::TrainConfig c;
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.channels = 16;
  c.model.context = 16;
  c.model.batch = 2;
  c.accum = 1;
  c.steps = 4;
  c.warmup = 1;
  c.corpus_tokens = 20000;
  c.vocab = "word:256";
  c.eval_every = 0;
  c.eval_windows = 8;
  return c;
}

struct Checkpoint {
  std::vector<ckpt::TensorInfo> infos;
  std::vector<std::vector<std::byte>> data;
  std::map<std::string, std::string> metadata;
};

const Checkpoint& tiny_checkpoint() {
  static const Checkpoint c = [] {
    test::TempDir dir("readers_ckpt");
    const fs::path p = dir.path() / "ckpt.safetensors";
    {
      train::Trainer t(tiny_run());
      t.train_step();
      t.save_checkpoint(p.string());
    }
    const ckpt::SafetensorsFile f = ckpt::SafetensorsFile::open(p);
    Checkpoint out;
    for (const ckpt::TensorInfo& t : f.tensors()) {
      out.infos.push_back(t);
      const auto b = f.bytes(t.name);
      out.data.emplace_back(b.begin(), b.end());
    }
    for (const auto& [k, v] : f.metadata())
      if (k.rfind("mixprec.checksum.", 0) != 0) out.metadata[k] = v;
    return out;
  }();
  return c;
}

// The checkpoint with metadata `key` = `text`. A byte 0xff in `text` is written through a
// marker of the same length (the writer would refuse it), so the header holds it as given.
std::string checkpoint_with(const std::string& key, std::string text) {
  const Checkpoint& c = tiny_checkpoint();
  const bool raw = text.find('\xFF') != std::string::npos;
  for (std::size_t at; (at = text.find('\xFF')) != std::string::npos;) text.replace(at, 1, "@FF@");
  std::map<std::string, std::string> meta = c.metadata;
  meta[key] = text;
  std::vector<ckpt::TensorRef> tensors;
  for (std::size_t i = 0; i < c.infos.size(); ++i)
    tensors.push_back({c.infos[i].name, c.infos[i].dtype, c.infos[i].shape, c.data[i]});
  ckpt::WriteOptions o;
  o.header_checksum = true;
  const std::vector<std::byte> b = ckpt::serialize(tensors, meta, o);
  std::string out(reinterpret_cast<const char*>(b.data()), b.size());
  if (raw)
    for (std::size_t at; (at = out.find("@FF@")) != std::string::npos;)
      out.replace(at, 4,
                  "\xFF"
                  "FF@");
  return out;
}

Reader checkpoint_metadata(const std::string& key, std::string pointer, ojson value, std::vector<std::string> says,
                           std::string duplicate) {
  Reader r;
  r.name = "checkpoint metadata " + key;
  r.valid = tiny_checkpoint().metadata.at(key);
  r.duplicate_key = std::move(duplicate);
  r.range_pointer = std::move(pointer);
  r.range_value = std::move(value);
  r.range_says = std::move(says);
  r.names = {"checkpoint '"};
  r.file = [](const fs::path& dir) { return dir / "ckpt.safetensors"; };
  r.bytes = [key](const std::string& t) { return checkpoint_with(key, t); };
  r.not_applicable[Kind::huge] = "a checkpoint's limits are ckpt::ReadLimits (64 GiB, a 100 MiB header)";
  r.read = [](const std::string& dir) {
    train::Trainer t(tiny_run());
    t.load_checkpoint((fs::path(dir) / "ckpt.safetensors").string());
  };
  // In the header the metadata value is a JSON string: the byte 0xff breaks the header itself.
  r.own[Kind::non_utf8] = {checkpoint_with(key, with_first(r.valid, "\"k\xFFy\": 1")),
                           {"the header is not valid JSON", "ill-formed UTF-8"}};
  return r;
}

// The table: each row's name and how to make it (made in its own test: some write files).
struct Row {
  std::string name;
  std::function<Reader()> make;
};

Reader text_reader(std::string name, std::string source, std::string valid, std::string duplicate, std::string pointer,
                   ojson value, std::vector<std::string> says, std::function<void(const std::string&)> read) {
  Reader r;
  r.name = std::move(name);
  r.valid = std::move(valid);
  r.duplicate_key = std::move(duplicate);
  r.range_pointer = std::move(pointer);
  r.range_value = std::move(value);
  r.range_says = std::move(says);
  if (!source.empty()) r.names = {std::move(source)};
  r.read = std::move(read);
  return r;
}

// A JSON file reader: its file under the folder, the key given twice, the number out of range.
Reader file_reader(std::string name, std::string valid, std::function<fs::path(const fs::path&)> file,
                   std::function<void(const fs::path&)> read, std::string duplicate, std::string pointer, ojson value,
                   std::vector<std::string> says) {
  Reader r;
  r.name = std::move(name);
  r.valid = std::move(valid);
  r.duplicate_key = std::move(duplicate);
  r.range_pointer = std::move(pointer);
  r.range_value = std::move(value);
  r.range_says = std::move(says);
  r.file = std::move(file);
  r.read = [read = std::move(read)](const std::string& dir) { read(fs::path(dir)); };
  return r;
}

std::vector<Row> rows() {
  using S = std::vector<std::string>;
  return {
      // ---- texts: the door that hands one in (Python, libtorch, a checkpoint) names it ----
      {"recipe text",
       [] {
         return text_reader("recipe text", "recipe file", kRecipe, "default", "/options/amax_history_len", 0,
                            S{"options.amax_history_len: expected an integer in [1, ", "found 0"},
                            [](const std::string& t) { (void)lowp::parse_assignment(t); });
       }},
      {"advisor config text",
       [] {
         return text_reader("advisor config text", "cfg.json", kAdvisorConfig, "margin", "/budget/x", -1,
                            S{"budget.x: expected a number in [0, 1e+300], found -1"},
                            [](const std::string& t) { (void)adv::parse_config(t, "cfg.json"); });
       }},
      {"advice text",
       [] {
         return text_reader("advice text", "advice.json", advice_text(), "version", "/steps/first", -1,
                            S{"steps.first: expected", "found -1"},
                            [](const std::string& t) { (void)adv::parse_advice_json(t, "advice.json"); });
       }},
      {"train config text",
       [] {
         return text_reader("train config text", "run.json", R"({"steps": 10, "precision": "bf16"})", "steps", "/steps",
                            0, S{"steps: expected an integer in [1, 1000000000], found 0"},
                            [](const std::string& t) { (void)train::apply_json({}, t, "run.json"); });
       }},
      {"run config text",
       [] {
         return text_reader("run config text", "R/config.json", train::run_config_text({}, train::RunWriter::engine),
                            "steps", "/steps", 0, S{"steps: expected an integer in [1, 1000000000], found 0"},
                            [](const std::string& t) { (void)train::parse_run_config(t, "R/config.json"); });
       }},
      {"step record",
       [] {
         return text_reader("step record", "", step_record_line(), "step", "/tokens", -1,
                            S{"tokens: expected", "found -1"},
                            [](const std::string& t) { (void)train::parse_step_record(t); });
       }},
      {"loss-scale state",
       [] {
         return text_reader("loss-scale state", "loss-scale state",
                            initial_loss_scale_state(loss_scale_preset("mixprec")).to_json(), "version",
                            "/counters/steps", -1, S{"counters.steps: expected", "found -1"},
                            [](const std::string& t) { (void)LossScaleState::from_json(t); });
       }},
      {"loss-scale config",
       [] {
         return text_reader("loss-scale config", "", loss_scale_config_json(loss_scale_preset("mixprec")), "rule",
                            "/growth_interval", 0, S{"growth_interval: expected an integer in [1, ", "found 0"},
                            [](const std::string& t) { (void)loss_scale_config_from_json(t); });
       }},
      {"layerwise state",
       [] {
         return text_reader("layerwise state", "layerwise state", layerwise_state(), "config", "/layers/0/fan_in", 0,
                            S{"fan_in", "expected an integer in [1, 2147483647], found 0"},
                            [](const std::string& t) { (void)LayerwiseScales::from_json(t); });
       }},
      {"fp8 state",
       [] {
         return text_reader("fp8 state", "fp8 delayed-scaling state", fp8_state(), "version", "/config/margin", 65,
                            S{"config.margin: expected an integer in [-64, 64], found 65"},
                            [](const std::string& t) { (void)lowp::DelayedScalingState::from_json(t); });
       }},
      {"GradScaler state",
       [] {
         return text_reader("GradScaler state", "GradScaler state", ScalerProtocol().state_json(), "version",
                            "/accumulation_steps", 0, S{"accumulation_steps", "[1, ", "found 0"},
                            [](const std::string& t) {
                              ScalerProtocol p;
                              p.load_state_json(t);
                            });
       }},
      {"guard config",
       [] {
         return text_reader("guard config", "guard.config", guard_config_json(GuardConfig{}), "skip_window",
                            "/skip_window", 1, S{"skip_window: expected an integer in [2, 1000000], found 1"},
                            [](const std::string& t) { (void)guard_config_from_json(t, "guard.config"); });
       }},
      {"z-score detector",
       [] {
         return text_reader("z-score detector", "guard.loss", ZScoreDetector(8).to_json(), "window", "/window", 0,
                            S{"window", "expected", "found 0"},
                            [](const std::string& t) { (void)ZScoreDetector::from_json(t, "guard.loss"); });
       }},

      // ---- files ----
      {"recipe file",
       [] {
         return file_reader(
             "recipe file", kRecipe, [](const fs::path& d) { return d / "recipe.json"; },
             [](const fs::path& d) { (void)lowp::read_assignment((d / "recipe.json").string()); }, "default",
             "/options/amax_history_len", 0, S{"options.amax_history_len: expected an integer in [1, ", "found 0"});
       }},
      {"advisor config file",  // `mixprec advise --config FILE` (tools/mixprec/cmd_advise.cpp reads it so)
       [] {
         return file_reader(
             "advisor config file", kAdvisorConfig, [](const fs::path& d) { return d / "advise.json"; },
             [](const fs::path& d) {
               (void)adv::parse_config(io::read_json_text(d / "advise.json"), (d / "advise.json").string());
             },
             "margin", "/budget/x", -1, S{"budget.x: expected a number in [0, 1e+300], found -1"});
       }},
      {"train config file",  // `mixprec train --config FILE` (tools/mixprec/cmd_train.cpp reads it so)
       [] {
         return file_reader(
             "train config file", R"({"steps": 10, "precision": "bf16"})",
             [](const fs::path& d) { return d / "train.json"; },
             [](const fs::path& d) {
               (void)train::apply_json({}, io::read_json_text(d / "train.json"), (d / "train.json").string());
             },
             "steps", "/steps", 0, S{"steps: expected an integer in [1, 1000000000], found 0"});
       }},
      {"run folder config.json",  // every reader of a run folder: report, simulate, resume, export
       [] {
         Reader r = file_reader(
             "run folder config.json", train::run_config_text({}, train::RunWriter::engine),
             [](const fs::path& d) { return d / "config.json"; },
             [](const fs::path& d) { (void)train::read_run_config(d); }, "steps", "/steps", 0,
             S{"run config '", "steps: expected an integer in [1, 1000000000], found 0"});
         return r;
       }},
      {"run folder log.jsonl",
       [] {
         Reader r = file_reader(
             "run folder log.jsonl", step_record_line(), [](const fs::path& d) { return d / "log.jsonl"; },
             [](const fs::path& d) { (void)train::read_run_log((d / "log.jsonl").string()); }, "step", "/tokens", -1,
             S{"log.jsonl:1: tokens: expected", "found -1"});
         r.bytes = [](const std::string& t) { return t + "\n"; };
         r.not_applicable[Kind::huge] = "a log grows with the run: no size limit";
         return r;
       }},
      {"run folder summary.json",  // `mixprec report RUN_DIR`
       [] {
         Reader r = file_reader(
             "run folder summary.json", kSummary, [](const fs::path& d) { return d / "summary.json"; },
             [](const fs::path& d) { (void)monitor::load_run(d.string()); }, "alerts", "/alerts/0/step", -1,
             S{"alerts[0].step: expected an integer >= 0, found -1"});
         r.setup = [](const fs::path& d) { write_bytes(d / "log.jsonl", ""); };
         return r;
       }},
      {"run folder advice.json",  // `mixprec report RUN_DIR`: the advisor's evidence
       [] {
         Reader r = file_reader(
             "run folder advice.json", advice_text(), [](const fs::path& d) { return d / "advice" / "advice.json"; },
             [](const fs::path& d) { (void)monitor::load_run(d.string()); }, "version", "/steps/first", -1,
             S{"steps.first: expected", "found -1"});
         r.setup = [](const fs::path& d) { write_bytes(d / "log.jsonl", ""); };
         return r;
       }},
      {"advisor samples index.json",  // `mixprec advise RUN_DIR`
       [] {
         std::string valid;
         {
           test::TempDir dir("readers_samples");
           write_samples(dir.path());
           valid = io::read_json_text(adv::samples_dir(dir.path()) / "step-00000001" / "index.json");
         }
         Reader r = file_reader(
             "advisor samples index.json", valid,
             [](const fs::path& d) { return adv::samples_dir(d) / "step-00000001" / "index.json"; },
             [](const fs::path& d) { (void)adv::read_samples(d); }, "version", "/loss_scale", -1,
             S{"loss_scale: expected a finite number > 0, found -1"});
         r.setup = [](const fs::path& d) { write_samples(d); };
         return r;
       }},
      {"checkpoint header",  // `mixprec train --resume`, ckpt::SafetensorsFile::open
       [] {
         Reader r = file_reader(
             "checkpoint header", kSafetensorsHeader, [](const fs::path& d) { return d / "ckpt.safetensors"; },
             [](const fs::path& d) { (void)ckpt::SafetensorsFile::open(d / "ckpt.safetensors"); }, "t",
             "/t/data_offsets/1", 8, S{"tensor 't': F32 [1] needs 4 bytes, but data_offsets [0, 8) hold 8"});
         r.names = {"checkpoint '"};
         r.bytes = [](const std::string& t) { return safetensors_bytes(t, 4); };
         r.not_applicable[Kind::huge] = "a checkpoint's limits are ckpt::ReadLimits (64 GiB, a 100 MiB header)";
         // The header is parsed by a streaming reader of its own (one object of tensor entries):
         // the first nested array is refused where it opens, and a BOM is not the header's '{'.
         r.own[Kind::deep] = {safetensors_bytes("{\"k\": " + deep(100000) + "}", 4),
                              {"tensor 'k'", "expected an object"}};
         r.own[Kind::bom] = {safetensors_bytes("\xEF\xBB\xBF" + r.valid, 4),
                             {"the header does not start with '{'; found byte 0xef"}};
         r.own[Kind::duplicate] = {
             safetensors_bytes(with_first(r.valid, R"("t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})"),
                               4),
             {"tensor 't' appears twice in the header"}};
         r.own[Kind::non_utf8] = {safetensors_bytes(with_first(r.valid, "\"k\xFFy\": 1"), 4),
                                  {"the header is not valid JSON", "ill-formed UTF-8"}};
         r.own[Kind::nul] = {
             safetensors_bytes(r.valid + std::string(1, '\0') + "junk", 4),
             {"the header holds a NUL byte (0x00) at byte " + std::to_string(r.valid.size()) + " of the header"}};
         return r;
       }},
      // a checkpoint's metadata (`mixprec train --resume`, Trainer::load_checkpoint)
      {"checkpoint metadata optimizer",
       [] {
         return checkpoint_metadata("mixprec.optimizer", "/step", -1,
                                    {"metadata 'mixprec.optimizer'", "step: expected an integer >= 0, found -1"},
                                    "kind");
       }},
      {"checkpoint metadata sampler",
       [] {
         return checkpoint_metadata("mixprec.sampler", "/counter", -1,
                                    {"metadata 'mixprec.sampler'", "counter: expected an integer >= 0, found -1"},
                                    "seed");
       }},
      {"checkpoint metadata totals",
       [] {
         return checkpoint_metadata("mixprec.totals", "/tokens", 1e30,
                                    {"metadata 'mixprec.totals'", "tokens: expected an integer >= 0, found 1e+30"},
                                    "steps");
       }},
      {"checkpoint metadata scaler",
       [] {
         return checkpoint_metadata("mixprec.scaler", "/accumulation_steps", 0,
                                    {"scaler state: GradScaler state", "accumulation_steps", "found 0"}, "version");
       }},
      {"checkpoint metadata config",
       [] {
         return checkpoint_metadata(
             "mixprec.config", "/steps", 0,
             {"config: checkpoint config: steps: expected an integer in [1, 1000000000], found 0"}, "steps");
       }},
      {"npy file",  // `mixprec inspect FILE.npy`, the advisor's samples: the header is a Python dict, not JSON
       [] {
         Reader r;
         r.name = "npy file";
         r.valid = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 4);
         r.file = [](const fs::path& d) { return d / "t.npy"; };
         r.read = [](const std::string& d) { (void)monitor::read_npy(fs::path(d) / "t.npy"); };
         const std::string nested = "{'descr': '<f4', 'fortran_order': False, 'shape': " + std::string(100000, '(') +
                                    "1" + std::string(100000, ')') + ", }";
         r.own[Kind::deep] = {npy_bytes(nested, 4), {"'shape'"}};
         r.own[Kind::bom] = {"\xEF\xBB\xBF" + r.valid, {"magic"}};
         r.own[Kind::duplicate] = {
             npy_bytes("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 4),
             {"duplicate key 'descr'"}};
         r.own[Kind::non_utf8] = {npy_bytes("{'descr': '<f\xFF', 'fortran_order': False, 'shape': (1,), }", 4),
                                  {"unsupported dtype '<f\\xff'"}};
         r.own[Kind::fifo] = {"", {"is not a regular file; expected an .npy file"}};
         r.own[Kind::dev_zero] = r.own[Kind::fifo];
         r.own[Kind::out_of_range] = {
             npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 4), {"shape"}};
         r.not_applicable[Kind::huge] = "an array's limit is kNpyMaxFileBytes (4 GiB)";
         r.not_applicable[Kind::nul] = "binary: the data after the header is any bytes";
         return r;
       }},
      {"data file",  // `mixprec train --data FILE`: UTF-8 text, not JSON
       [] {
         Reader r;
         r.name = "data file";
         r.valid = "the cat sat on the mat.\n";
         r.file = [](const fs::path& d) { return d / "data.txt"; };
         r.read = [](const std::string& d) {
           const std::string text = nn::load_text_file((fs::path(d) / "data.txt").string());
           if (text != "the cat sat on the mat.\n") throw std::logic_error("read as '" + text + "'");
         };
         r.names = {"data file '"};
         r.own[Kind::bom] = {"\xEF\xBB\xBF" + r.valid, {}, true};  // dropped, as editors write it
         r.own[Kind::non_utf8] = {"the cat \xFF sat on the mat.\n", {"UTF-8"}};
         r.own[Kind::fifo] = {"", {"is not a regular file; expected a UTF-8 text file"}};
         r.own[Kind::dev_zero] = r.own[Kind::fifo];
         r.not_applicable[Kind::deep] = "plain text: no nesting";
         r.not_applicable[Kind::duplicate] = "plain text: no keys";
         r.not_applicable[Kind::out_of_range] = "plain text: no numbers";
         r.not_applicable[Kind::huge] = "a corpus's limit is 4 GiB";
         r.own[Kind::nul] = {r.valid + std::string(1, '\0'), {"data file '"}};
         return r;
       }},
  };
}

// ---- the test -----------------------------------------------------------------------------------

class Refuses : public ::testing::TestWithParam<std::size_t> {};

const std::vector<Row>& all_rows() {
  static const std::vector<Row> r = rows();
  return r;
}

TEST_P(Refuses, HostileInputs) {
  const Reader r = all_rows()[GetParam()].make();
  // The good document is read: every case below differs from it in one place only.
  {
    test::TempDir dir("readers");
    if (r.file) {
      r.setup(dir.path());
      write_bytes(r.file(dir.path()), r.bytes(r.valid));
    }
    const Outcome o = bounded([&] { r.read(r.file ? dir.path().string() : r.valid); }, {});
    ASSERT_TRUE(o.returned && !o.threw) << r.name << ": the valid document is refused: " << o.message;
  }
  for (const Kind k : kKinds) {
    if (r.not_applicable.contains(k)) continue;
    if (!r.file && (k == Kind::fifo || k == Kind::dev_zero || k == Kind::huge)) continue;  // a text reader has no file
    const Variant v = variant_of(r, k);
    test::TempDir dir("readers");
    fs::path fifo;
    std::vector<std::string> names = r.names;
    if (r.file) {
      r.setup(dir.path());
      const fs::path p = r.file(dir.path());
      fs::create_directories(p.parent_path());
      fs::remove(p);
      if (k == Kind::fifo) {
        ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0);
        fifo = p;
      } else if (k == Kind::dev_zero) {
        fs::create_symlink("/dev/zero", p);
      } else {
        write_bytes(p, r.own.contains(k) ? v.text : r.bytes(v.text));
        if (k == Kind::huge) fs::resize_file(p, io::kMaxJsonFileBytes + 1);  // sparse: nothing written
      }
      names.push_back(p.string());
    }
    const Outcome o = bounded([&] { r.read(r.file ? dir.path().string() : v.text); }, fifo);
    const std::string what = r.name + " given " + kind_name(k);
    if (!o.returned) {
      ADD_FAILURE() << what << ": did not return within " << kPatience.count() << " s " << o.message;
      continue;
    }
    if (v.accepted) {
      EXPECT_FALSE(o.threw) << what << ": refused: " << o.message;
      continue;
    }
    if (!o.threw) {
      ADD_FAILURE() << what << ": accepted";
      continue;
    }
    for (const std::string& s : v.says)
      EXPECT_NE(o.message.find(s), std::string::npos) << what << ": lacks '" << s << "': " << o.message;
    for (const std::string& s : names)
      EXPECT_NE(o.message.find(s), std::string::npos) << what << ": does not name '" << s << "': " << o.message;
    EXPECT_EQ(o.message.find("[json.exception"), std::string::npos)
        << what << ": the JSON library's text: " << o.message;
  }
}

// A number a checkpoint holds as text (metadata "mixprec.schedule_position"): the number grammar
// of every key, not strtoll (which took " 1").
TEST(CheckpointMetadata, SchedulePositionFollowsTheNumberGrammar) {
  test::TempDir dir("readers_position");
  const fs::path p = dir.path() / "ckpt.safetensors";
  const std::string valid = tiny_checkpoint().metadata.at("mixprec.schedule_position");
  for (const std::string& v :
       std::vector<std::string>{" " + valid, valid + " ", "-1", "abc", "nan", "1e999", "0x1", ""}) {
    write_bytes(p, checkpoint_with("mixprec.schedule_position", v));
    const Outcome o = bounded([&] { train::Trainer(tiny_run()).load_checkpoint(p.string()); }, {});
    ASSERT_TRUE(o.returned);
    EXPECT_TRUE(o.threw) << "'" << v << "' accepted";
    EXPECT_EQ(o.message, "checkpoint '" + p.string() +
                             "': metadata 'mixprec.schedule_position': expected an integer in [0, 2^63 - 1], found '" +
                             v + "'");
  }
  write_bytes(p, checkpoint_with("mixprec.schedule_position", valid));
  EXPECT_NO_THROW(train::Trainer(tiny_run()).load_checkpoint(p.string()));
}

std::string test_name(const ::testing::TestParamInfo<std::size_t>& info) {
  std::string n;
  for (const char ch : all_rows()[info.param].name) n += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(Reader, Refuses, ::testing::Range<std::size_t>(0, all_rows().size()), test_name);

}  // namespace
}  // namespace mixprec
