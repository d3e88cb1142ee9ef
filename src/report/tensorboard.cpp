// TensorBoard event files (include/mixprec/report/tensorboard.hpp). The protobuf fields
// used, from TensorBoard's event.proto and summary.proto:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
#include "mixprec/report/tensorboard.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>

namespace mixprec::monitor {
namespace {

// One table, built at compile time: event files are small, a byte-at-a-time CRC is plenty.
constexpr std::array<std::uint32_t, 256> make_crc32c_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) != 0 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<std::uint32_t, 256> kCrc32cTable = make_crc32c_table();

// ---- protobuf wire format: the three wire types used -----------------------------------

enum class Wire : std::uint8_t { varint = 0, fixed64 = 1, bytes = 2, fixed32 = 5 };

void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, std::uint32_t field, Wire w) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint64_t>(w));
}

template <typename U>
void put_little_endian(std::string& out, U v) {
  for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_double(std::string& out, std::uint32_t field, double v) {
  put_key(out, field, Wire::fixed64);
  put_little_endian(out, std::bit_cast<std::uint64_t>(v));
}

void put_float(std::string& out, std::uint32_t field, float v) {
  put_key(out, field, Wire::fixed32);
  put_little_endian(out, std::bit_cast<std::uint32_t>(v));
}

void put_bytes(std::string& out, std::uint32_t field, std::string_view bytes) {
  put_key(out, field, Wire::bytes);
  put_varint(out, bytes.size());
  out.append(bytes);
}

void put_int64(std::string& out, std::uint32_t field, std::int64_t v) {
  put_key(out, field, Wire::varint);
  put_varint(out, static_cast<std::uint64_t>(v));  // int64: two's complement, 10 bytes when negative
}

double fraction(std::uint64_t part, std::uint64_t whole) {
  return whole == 0 ? std::nan("") : static_cast<double>(part) / static_cast<double>(whole);
}

}  // namespace

std::uint32_t crc32c(std::string_view bytes) noexcept {
  std::uint32_t c = 0xFFFFFFFFu;
  for (const char ch : bytes) c = kCrc32cTable[(c ^ static_cast<unsigned char>(ch)) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(std::string_view bytes) noexcept {
  const std::uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string length;
  put_little_endian(length, static_cast<std::uint64_t>(data.size()));
  std::string out = length;
  put_little_endian(out, masked_crc32c(length));
  out.append(data);
  put_little_endian(out, masked_crc32c(data));
  return out;
}

std::vector<Scalar> StepScalars::add(const train::StepRecord& r) {
  if (r.skipped) ++skips_;
  std::vector<Scalar> out;
  const auto put = [&out](std::string tag, double v) {
    if (std::isfinite(v)) out.push_back({std::move(tag), static_cast<float>(v)});
  };
  if (r.loss_finite) put("loss", r.loss);
  if (r.val_loss) put("val_loss", *r.val_loss);
  put("lr", r.lr);
  put("grad_norm", r.grad_norm);
  put("clip_coef", r.clip_coef);
  put("loss_scale/scale", r.scale);
  put("loss_scale/next_scale", r.next_scale);
  put("loss_scale/skipped", r.skipped ? 1.0 : 0.0);
  put("loss_scale/skips", static_cast<double>(skips_));
  if (r.act_grads.elements > 0) {  // a step that counted activation gradients
    put("act_grads/underflow_fraction", fraction(r.act_grads.underflow, r.act_grads.nonzero));
    put("act_grads/subnormal_fraction", fraction(r.act_grads.subnormal, r.act_grads.nonzero));
    put("act_grads/headroom_log2", r.headroom_log2);
  }
  for (const nn::TensorGradStats& t : r.act_grad_tensors)
    put("underflow/" + t.name, fraction(t.stats.underflow, t.stats.nonzero));
  // Quantized tensors at their sampled steps: the per-block statistics and the what-ifs.
  for (const nn::Fp8TensorStats& t : r.fp8) {
    const std::string tag = "lowp/" + t.name + "/";
    if (t.kurtosis) put(tag + "kurtosis", *t.kurtosis);
    if (t.blocks) {
      put(tag + "log2_multiplier_std", t.blocks->log2_multiplier_std);
      put(tag + "far_block_fraction", fraction(t.blocks->far_blocks, t.blocks->blocks));
      put(tag + "max_block_dynamic_range", t.blocks->max_block_dynamic_range);
    }
    for (const nn::Fp8WhatIf& w : t.what_if) {
      put(tag + "what_if/" + w.recipe + "/flushed", fraction(w.flushed, t.nonzero));
      if (w.rel_rms_error) put(tag + "what_if/" + w.recipe + "/rel_rms_error", *w.rel_rms_error);
    }
  }
  put("time/step_seconds", r.seconds);
  return out;
}

std::string file_version_event(double wall_time) {
  std::string e;
  put_double(e, 1, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string scalars_event(double wall_time, std::int64_t step, const std::vector<Scalar>& scalars) {
  std::string summary;
  for (const Scalar& s : scalars) {
    std::string value;
    put_bytes(value, 1, s.tag);
    put_float(value, 2, s.value);
    put_bytes(summary, 1, value);
  }
  std::string e;
  put_double(e, 1, wall_time);
  put_int64(e, 2, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string event_file(const std::vector<train::StepRecord>& records, double start_wall_time) {
  std::string out = tfrecord(file_version_event(start_wall_time));
  StepScalars scalars;
  double elapsed = 0;
  for (const train::StepRecord& r : records) {
    if (std::isfinite(r.seconds) && r.seconds > 0) elapsed += r.seconds;
    out += tfrecord(scalars_event(start_wall_time + elapsed, static_cast<std::int64_t>(r.step), scalars.add(r)));
  }
  return out;
}

}  // namespace mixprec::monitor
