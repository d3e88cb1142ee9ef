// TensorBoard event files of a run, written natively: `mixprec export tensorboard RUN_DIR`
// and the Python Telemetry(tensorboard=DIR) (which writes through torch.utils.tensorboard
// but takes its tags and values from StepScalars below, so both show the same charts).
// See docs/telemetry.md, "TensorBoard".
//
// The file format is TensorBoard's: a sequence of TFRecords (uint64 length, masked
// CRC32C of the length, the bytes, masked CRC32C of the bytes; little-endian), each an
// `Event` protocol buffer. The first event holds file_version "brain.Event:2"; then one
// event per optimizer step, its `Summary` holding one `simple_value` per scalar. Only
// the handful of protobuf fields this needs are encoded here (no protobuf library).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/run/step_record.hpp"

namespace mixprec::monitor {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `bytes`, and TFRecord's mask
// of it: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t crc32c(std::string_view bytes) noexcept;
std::uint32_t masked_crc32c(std::string_view bytes) noexcept;

// One TFRecord: the framing around `data`.
std::string tfrecord(std::string_view data);

struct Scalar {
  std::string tag;
  float value = 0;
};

// The scalars of each step, in the order written (tags: docs/telemetry.md, "TensorBoard"):
//   loss, val_loss (evaluation steps), lr, grad_norm, clip_coef,
//   loss_scale/scale, loss_scale/next_scale, loss_scale/skipped (0 or 1),
//   loss_scale/skips (skipped steps so far, this one included),
//   act_grads/underflow_fraction, act_grads/subnormal_fraction, act_grads/headroom_log2
//     (steps that counted activation gradients),
//   underflow/<tensor> (per activation-gradient tensor with nonzero values: underflow / nonzero),
//   lowp/<tensor>/kurtosis, lowp/<tensor>/log2_multiplier_std, lowp/<tensor>/far_block_fraction
//     (far_blocks / blocks), lowp/<tensor>/max_block_dynamic_range (quantized tensors at their
//     sampled steps), lowp/<tensor>/what_if/<recipe>/flushed (flushed / the tensor's nonzero),
//     lowp/<tensor>/what_if/<recipe>/rel_rms_error,
//   time/step_seconds.
// A value that is not finite (a skipped step's grad_norm, a non-finite loss, an inf scale)
// is left out: TensorBoard draws no point there, and loss_scale/skipped says why.
// Stateful because of loss_scale/skips: feed it the run's records in order.
class StepScalars {
 public:
  std::vector<Scalar> add(const train::StepRecord& r);

 private:
  std::uint64_t skips_ = 0;
};

// Event protocol buffers, serialized.
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, std::int64_t step, const std::vector<Scalar>& scalars);

// A whole event file for `records` (in step order): the file_version event at
// `start_wall_time`, then one event per step at start_wall_time + the steps' cumulative
// `seconds` (non-finite or negative seconds count as 0). Framed, ready to write.
std::string event_file(const std::vector<train::StepRecord>& records, double start_wall_time);

}  // namespace mixprec::monitor
