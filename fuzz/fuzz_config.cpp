// libFuzzer target: the JSON readers of a run, all on the same input text:
//   - train::apply_json on the default TrainConfig, then train::validate (a --config file);
//   - LossScaleState::from_json and GradScaler::load_state_json (checkpoint metadata),
//     into a dynamic and a static scaler;
//   - train::parse_step_record (a log.jsonl line).
// A rejected input is a std::exception naming the problem; anything else (a crash, an ASan
// or UBSan report, an uncaught exception of another type, a leak, a timeout) is a bug.
// Accepted inputs must round-trip through the matching writer (an exception or a
// difference there aborts). See docs/fuzzing.md.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_log.hpp"

namespace {

using namespace mixprec;

void config(std::string_view text) {
  train::TrainConfig c;
  try {
    c = train::apply_json(train::TrainConfig{}, text, "fuzz");
    train::validate(c);
  } catch (const std::exception&) {
    return;
  }
  // A valid config echoes (config.json of a run) and reads back equal.
  if (!(train::apply_json(train::TrainConfig{}, train::to_json(c), "echo") == c)) std::abort();
}

void loss_scale_state(std::string_view text) {
  LossScaleState s;
  try {
    s = LossScaleState::from_json(text);
  } catch (const std::exception&) {
    return;
  }
  if (!(LossScaleState::from_json(s.to_json()) == s)) std::abort();
}

void grad_scaler(std::string_view text, const LossScaleConfig& config) {
  GradScaler scaler(config);
  const std::string before = scaler.state_json();
  try {
    scaler.load_state_json(text);
  } catch (const std::exception&) {
    // "changes nothing on error"
    if (scaler.state_json() != before) std::abort();
    return;
  }
  // A loaded state saves and loads again to the same state.
  const std::string saved = scaler.state_json();
  GradScaler other(config);
  other.load_state_json(saved);  // an exception escapes: libFuzzer reports it
  if (other.state_json() != saved) std::abort();
}

void step_record(std::string_view text) {
  std::string line;
  try {
    line = train::step_record_json(train::parse_step_record(text));
  } catch (const std::exception&) {
    return;
  }
  // What the writer makes of an accepted line reads back to the same line.
  if (train::step_record_json(train::parse_step_record(line)) != line) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  config(text);
  loss_scale_state(text);
  grad_scaler(text, loss_scale_preset("mixprec"));
  grad_scaler(text, loss_scale_preset("static"));
  step_record(text);
  return 0;
}
