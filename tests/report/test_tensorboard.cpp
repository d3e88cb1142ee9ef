// TensorBoard event files (report/tensorboard.hpp): CRC-32C against RFC 3720's vectors and
// a bit-at-a-time reference, the TFRecord framing and the Event/Summary encoding against
// bytes written by hand from the .proto definitions, the scalars chosen per step, and a
// whole file decoded again by a reader written here. (TensorBoard's own reader reads the
// files in tests/python/test_integration_tensorboard.py.)
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mixprec/report/tensorboard.hpp"

namespace mixprec::monitor {
namespace {

using train::StepRecord;

// CRC-32C one bit at a time: the definition (reflected, init and final xor all ones).
std::uint32_t crc32c_bitwise(const std::string& s) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (const char ch : s) {
    c ^= static_cast<unsigned char>(ch);
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) != 0 ? 0x82F63B78u : 0u);
  }
  return ~c;
}

std::string bytes(std::initializer_list<int> v) {
  std::string s;
  for (const int b : v) s.push_back(static_cast<char>(b));
  return s;
}

std::string hex(const std::string& s) {
  std::string out;
  char buf[4];
  for (const char c : s) {
    std::snprintf(buf, sizeof buf, "%02x ", static_cast<unsigned char>(c));
    out += buf;
  }
  return out;
}

TEST(TensorBoardCrc, Rfc3720Vectors) {
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string up, down;
  for (int i = 0; i < 32; ++i) {
    up.push_back(static_cast<char>(i));
    down.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down), 0x113FDB5Cu);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
}

TEST(TensorBoardCrc, TableEqualsBitwiseDefinition) {
  std::mt19937 rng(7);
  for (int n = 0; n < 300; ++n) {
    std::string s(static_cast<std::size_t>(n), '\0');
    for (char& c : s) c = static_cast<char>(rng() & 0xFF);
    ASSERT_EQ(crc32c(s), crc32c_bitwise(s)) << "length " << n << ": " << hex(s);
  }
}

TEST(TensorBoardCrc, MaskIsTfRecords) {
  const std::uint32_t c = crc32c("123456789");  // 0xE3069283
  const std::uint32_t rotated = (c >> 15) | (c << 17);
  EXPECT_EQ(masked_crc32c("123456789"), static_cast<std::uint32_t>(rotated + 0xa282ead8u));
}

std::uint64_t read_u64(const std::string& s, std::size_t at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}
std::uint32_t read_u32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

TEST(TensorBoardRecord, Framing) {
  const std::string data = "hello event";
  const std::string r = tfrecord(data);
  ASSERT_EQ(r.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(read_u64(r, 0), data.size());
  EXPECT_EQ(read_u32(r, 8), masked_crc32c(r.substr(0, 8)));
  EXPECT_EQ(r.substr(12, data.size()), data);
  EXPECT_EQ(read_u32(r, 12 + data.size()), masked_crc32c(data));
  EXPECT_EQ(tfrecord("").size(), 16u);
}

TEST(TensorBoardEvent, FileVersionBytes) {
  // Event{wall_time = 1.5 (field 1, fixed64), file_version = "brain.Event:2" (field 3, bytes)}
  const std::string expected =
      bytes({0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, 0x1a, 13}) + std::string("brain.Event:2");
  EXPECT_EQ(hex(file_version_event(1.5)), hex(expected));
}

TEST(TensorBoardEvent, ScalarsBytes) {
  // Value{tag "a", simple_value 1.0f}: 0a 01 61 15 00 00 80 3f; Summary{value}: 0a 08 <value>;
  // Event{wall_time 1.5, step 300 (varint ac 02), summary (field 5)}.
  const std::string value = bytes({0x0a, 0x01, 'a', 0x15, 0x00, 0x00, 0x80, 0x3f});
  const std::string value2 = bytes({0x0a, 0x02, 'b', '/', 0x15, 0x00, 0x00, 0xc0, 0x7f});  // NaN stays as given
  const std::string summary = bytes({0x0a, 0x08}) + value + bytes({0x0a, 0x09}) + value2;
  const std::string expected = bytes({0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, 0x10, 0xac, 0x02, 0x2a,
                                      static_cast<int>(summary.size())}) +
                               summary;
  const std::vector<Scalar> s = {{"a", 1.0f}, {"b/", std::numeric_limits<float>::quiet_NaN()}};
  EXPECT_EQ(hex(scalars_event(1.5, 300, s)), hex(expected));
  // A step above 2^35 takes more varint bytes: 2^35 = 0x80 0x80 0x80 0x80 0x80 0x01.
  const std::string big = scalars_event(0.0, std::int64_t{1} << 35, {});
  EXPECT_EQ(hex(big.substr(9)), hex(bytes({0x10, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0x2a, 0x00})));
}

StepRecord step(std::uint64_t n) {
  StepRecord r;
  r.step = n;
  r.lr = 1e-3;
  r.loss = 5.0;
  r.grad_norm = 2.0;
  r.scale = 1024;
  r.next_scale = 1024;
  r.seconds = 0.25;
  return r;
}

std::vector<std::string> tags(const std::vector<Scalar>& v) {
  std::vector<std::string> t;
  for (const Scalar& s : v) t.push_back(s.tag);
  return t;
}

float value_of(const std::vector<Scalar>& v, const std::string& tag) {
  for (const Scalar& s : v)
    if (s.tag == tag) return s.value;
  ADD_FAILURE() << "no scalar " << tag;
  return std::nanf("");
}

TEST(TensorBoardScalars, PlainStep) {
  StepScalars s;
  const std::vector<Scalar> v = s.add(step(1));
  EXPECT_EQ(tags(v), (std::vector<std::string>{"loss", "lr", "grad_norm", "clip_coef", "loss_scale/scale",
                                               "loss_scale/next_scale", "loss_scale/skipped", "loss_scale/skips",
                                               "time/step_seconds"}));
  EXPECT_EQ(value_of(v, "loss"), 5.0f);
  EXPECT_EQ(value_of(v, "lr"), 1e-3f);
  EXPECT_EQ(value_of(v, "loss_scale/scale"), 1024.0f);
  EXPECT_EQ(value_of(v, "loss_scale/skipped"), 0.0f);
  EXPECT_EQ(value_of(v, "time/step_seconds"), 0.25f);
}

TEST(TensorBoardScalars, SkipsCountedNonFiniteLeftOut) {
  StepScalars s;
  StepRecord a = step(1);
  a.skipped = a.found_inf = true;
  a.grad_norm = std::nan("");
  a.next_scale = 512;
  const std::vector<Scalar> v1 = s.add(a);
  EXPECT_EQ(value_of(v1, "loss_scale/skipped"), 1.0f);
  EXPECT_EQ(value_of(v1, "loss_scale/skips"), 1.0f);
  EXPECT_EQ(value_of(v1, "loss_scale/next_scale"), 512.0f);
  for (const Scalar& x : v1) EXPECT_NE(x.tag, "grad_norm");
  StepRecord b = step(2);
  b.loss_finite = false;
  b.loss = std::nan("");
  b.scale = std::numeric_limits<float>::infinity();
  const std::vector<Scalar> v2 = s.add(b);
  EXPECT_EQ(value_of(v2, "loss_scale/skips"), 1.0f);  // cumulative: the first step's skip
  for (const Scalar& x : v2) {
    EXPECT_NE(x.tag, "loss");
    EXPECT_NE(x.tag, "loss_scale/scale");
  }
  StepRecord c = step(3);
  c.skipped = true;
  EXPECT_EQ(value_of(s.add(c), "loss_scale/skips"), 2.0f);
}

TEST(TensorBoardScalars, ActivationGradientsAndEvaluation) {
  StepScalars s;
  StepRecord r = step(4);
  r.val_loss = 4.5;
  r.act_grads.elements = 100;
  r.act_grads.nonzero = 80;
  r.act_grads.underflow = 20;
  r.act_grads.subnormal = 8;
  r.headroom_log2 = 3.5;
  r.act_grad_tensors.push_back({"h0.mlp.fc", {.elements = 50, .nonzero = 40, .underflow = 10}, 1.0f});
  r.act_grad_tensors.push_back({"logits", {.elements = 50, .nonzero = 0}, 0.0f});  // no nonzero: no fraction
  const std::vector<Scalar> v = s.add(r);
  EXPECT_EQ(value_of(v, "val_loss"), 4.5f);
  EXPECT_EQ(value_of(v, "act_grads/underflow_fraction"), 0.25f);
  EXPECT_EQ(value_of(v, "act_grads/subnormal_fraction"), 0.1f);
  EXPECT_EQ(value_of(v, "act_grads/headroom_log2"), 3.5f);
  EXPECT_EQ(value_of(v, "underflow/h0.mlp.fc"), 0.25f);
  for (const Scalar& x : v) EXPECT_NE(x.tag, "underflow/logits");
}

// Quantized tensors at a sampled step: kurtosis, the blocks' log2-multiplier std, the far-block
// fraction, the largest block dynamic range and per what-if recipe the flushed fraction (of the
// tensor's nonzero values) and the error; nothing at an unsampled step.
TEST(TensorBoardScalars, QuantizedTensorsAtSampledSteps) {
  StepScalars s;
  StepRecord r = step(8);
  nn::Fp8TensorStats t;
  t.name = "h0.mlp.fc.input";
  t.recipe = "mxfp8";
  t.elements = 1000;
  t.nonzero = 800;
  nn::Fp8TensorStats plain = t;
  plain.name = "h0.mlp.fc.weight";
  lowp::BlockStats b;
  b.blocks = 40;
  b.far_blocks = 10;
  b.log2_multiplier_std = 1.5;
  b.max_block_dynamic_range = 9.25;
  t.blocks = b;
  t.kurtosis = 12.5;
  t.what_if = {{"nvfp4", lowp::Element::e2m1, 1000, 0, 200, 0.125, 80, 4, 2.0, -1.0, 3.0},
               {"fp8-current", lowp::Element::e4m3, 1000, 0, 8, std::nullopt, 1, 0, 0.0, 0.0, 0.0}};
  r.fp8 = {t, plain};
  const std::vector<Scalar> v = s.add(r);
  EXPECT_EQ(value_of(v, "lowp/h0.mlp.fc.input/kurtosis"), 12.5f);
  EXPECT_EQ(value_of(v, "lowp/h0.mlp.fc.input/log2_multiplier_std"), 1.5f);
  EXPECT_EQ(value_of(v, "lowp/h0.mlp.fc.input/far_block_fraction"), 0.25f);
  EXPECT_EQ(value_of(v, "lowp/h0.mlp.fc.input/max_block_dynamic_range"), 9.25f);
  EXPECT_EQ(value_of(v, "lowp/h0.mlp.fc.input/what_if/nvfp4/flushed"), 0.25f);
  EXPECT_EQ(value_of(v, "lowp/h0.mlp.fc.input/what_if/nvfp4/rel_rms_error"), 0.125f);
  EXPECT_EQ(value_of(v, "lowp/h0.mlp.fc.input/what_if/fp8-current/flushed"), 0.01f);
  for (const Scalar& x : v) {
    EXPECT_NE(x.tag, "lowp/h0.mlp.fc.input/what_if/fp8-current/rel_rms_error");  // not finite: none
    EXPECT_EQ(x.tag.find("lowp/h0.mlp.fc.weight/"), std::string::npos) << x.tag;  // not sampled
  }
}

// A reader written from the format: frames, checks both CRCs, decodes the fields used.
struct DecodedEvent {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;
  std::vector<Scalar> values;
};

std::uint64_t varint(const std::string& s, std::size_t& at) {
  std::uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const auto b = static_cast<unsigned char>(s.at(at++));
    v |= static_cast<std::uint64_t>(b & 0x7F) << shift;
    if ((b & 0x80) == 0) return v;
  }
}

std::vector<DecodedEvent> decode_file(const std::string& f) {
  std::vector<DecodedEvent> out;
  std::size_t at = 0;
  while (at < f.size()) {
    const std::uint64_t n = read_u64(f, at);
    EXPECT_EQ(read_u32(f, at + 8), masked_crc32c(f.substr(at, 8)));
    const std::string data = f.substr(at + 12, n);
    EXPECT_EQ(read_u32(f, at + 12 + n), masked_crc32c(data));
    at += 16 + n;
    DecodedEvent e;
    std::size_t p = 0;
    while (p < data.size()) {
      const std::uint64_t key = varint(data, p);
      if (key == 0x09) {
        e.wall_time = std::bit_cast<double>(read_u64(data, p));
        p += 8;
      } else if (key == 0x10) {
        e.step = static_cast<std::int64_t>(varint(data, p));
      } else if (key == 0x1a) {
        const std::uint64_t len = varint(data, p);
        e.file_version = data.substr(p, len);
        p += len;
      } else if (key == 0x2a) {
        const std::uint64_t len = varint(data, p);
        const std::string summary = data.substr(p, len);
        p += len;
        std::size_t q = 0;
        while (q < summary.size()) {
          EXPECT_EQ(varint(summary, q), 0x0au);
          const std::uint64_t vlen = varint(summary, q);
          const std::string value = summary.substr(q, vlen);
          q += vlen;
          std::size_t k = 0;
          Scalar sc;
          EXPECT_EQ(varint(value, k), 0x0au);
          const std::uint64_t tlen = varint(value, k);
          sc.tag = value.substr(k, tlen);
          k += tlen;
          EXPECT_EQ(varint(value, k), 0x15u);
          sc.value = std::bit_cast<float>(read_u32(value, k));
          e.values.push_back(sc);
        }
      } else {
        ADD_FAILURE() << "unexpected key " << key;
        return out;
      }
    }
    out.push_back(e);
  }
  return out;
}

TEST(TensorBoardFile, EveryStepDecodesBack) {
  std::vector<StepRecord> records;
  for (std::uint64_t n = 1; n <= 5; ++n) records.push_back(step(n));
  records[2].skipped = true;
  records[2].grad_norm = std::nan("");
  records[3].seconds = std::nan("");  // counts as 0
  const std::string f = event_file(records, 1000.0);
  const std::vector<DecodedEvent> events = decode_file(f);
  ASSERT_EQ(events.size(), 6u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_EQ(events[0].wall_time, 1000.0);
  StepScalars expected;
  const double walls[] = {1000.25, 1000.5, 1000.75, 1000.75, 1001.0};
  for (std::size_t i = 0; i < records.size(); ++i) {
    const DecodedEvent& e = events[i + 1];
    EXPECT_EQ(e.step, static_cast<std::int64_t>(i + 1));
    EXPECT_EQ(e.wall_time, walls[i]) << "step " << i + 1;
    const std::vector<Scalar> want = expected.add(records[i]);
    ASSERT_EQ(tags(e.values), tags(want)) << "step " << i + 1;
    for (std::size_t k = 0; k < want.size(); ++k) EXPECT_EQ(e.values[k].value, want[k].value) << want[k].tag;
  }
}

}  // namespace
}  // namespace mixprec::monitor
