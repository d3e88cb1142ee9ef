// The files of a run folder as text: one JSON object per optimizer step (log.jsonl)
// and the summary (summary.json). Shared by `mixprec train`, `mixprec compare` and the
// reports, so every tool writes and reads the same fields. See docs/training.md.
//
// A step line holds every StepRecord field under its member name; act_grads is an
// object {elements, nonzero, underflow, subnormal, overflow, nonfinite_input};
// val_loss is present only on steps that evaluated, recipe_phase only on steps where a
// phase of the run's recipe file begins. Numbers JSON cannot hold (inf,
// NaN) are written as null: grad_norm is null on a skipped step, loss on a step whose
// forward pass was not finite. Floats (scale, next_scale, clip_coef) are written with
// float32's shortest text and read back exactly.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "mixprec/run/config.hpp"
#include "mixprec/run/step_record.hpp"

namespace mixprec::train {

// One log line (no newline), compact.
std::string step_record_json(const StepRecord& r);
// Parses one log line; std::invalid_argument naming the field and what was wrong
// (missing, wrong type, negative count, ...). Unknown fields are ignored, so later
// versions may add some.
StepRecord parse_step_record(std::string_view line);

// The whole run as one JSON object: every TrainSummary field, memory as an object
// {parameter_bytes, activation_bytes, gradient_bytes, scratch_bytes, fp8_activation_bytes
// (the part of activation_bytes saved as fp8 codes + scales; 0 outside the fp8 presets), master_bytes and
// optimizer_state_bytes (of parameter_bytes: the masters and the moments in their formats)}, and "config"
// (to_json). Indented by 2.
std::string summary_json(const TrainSummary& s, const TrainConfig& c);
// The same with "config" given as JSON object text (to_json of some keys, for a run
// another front end trained).
std::string summary_json(const TrainSummary& s, std::string_view config_json);

// Reads a log.jsonl written from step_record_json: std::runtime_error when the file
// cannot be read, and "FILE:LINE: ..." for a malformed line (an empty line included)
// or a step not greater than the one before. The file may end without a final newline;
// a last line without one that does not parse was cut short (a full disk, a kill) and
// is dropped, as `mixprec train --resume` drops it.
// A FIFO, a device or a folder in place of the file is refused before anything blocks.
std::vector<StepRecord> read_run_log(const std::string& path);
// The same over the file's text (`path` names it in messages).
std::vector<StepRecord> parse_run_log(std::string_view text, const std::string& path);

}  // namespace mixprec::train
