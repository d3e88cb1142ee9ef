// Writes the generated part of the seed corpora (fuzz/corpus/), made by the library's
// own writers so the seeds are valid files of today's formats:
//   corpus/safetensors/  checkpoints from ckpt::serialize (with and without mixprec's
//                        metadata, scalar, empty and multi-tensor, with the header
//                        checksum), and near-valid variants (a flipped data byte, a cut
//                        file, a bad header length, a changed header, deep nesting);
//   corpus/config/       GradScaler/LossScale states of every preset, step-log lines,
//                        the default config echoed by train::to_json, deep nesting.
// The hand-written seeds (npy, cli, JSON configs) live beside them. Usage:
//   fuzz_make_seeds fuzz/corpus     (build/fuzz/fuzz/fuzz_make_seeds; see docs/fuzzing.md)
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "mixprec/checkpoint/safetensors.hpp"
#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_log.hpp"

namespace {

namespace fs = std::filesystem;
using namespace mixprec;

void write(const fs::path& path, const void* data, std::size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!f) {
    std::fprintf(stderr, "fuzz_make_seeds: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}
void write(const fs::path& path, const std::vector<std::byte>& bytes) { write(path, bytes.data(), bytes.size()); }
void write(const fs::path& path, const std::string& text) { write(path, text.data(), text.size()); }

template <typename T>
std::span<const std::byte> as_bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span(v));
}

void safetensors_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  const std::vector<float> w = {1.0f, -2.5f, 0.0f, 3.0e-8f, 65504.0f, -0.0f};
  const std::vector<std::uint16_t> h = {0x3c00, 0x0001, 0x7bff, 0xfc00};
  const std::vector<std::int64_t> step = {42};
  const std::vector<std::uint8_t> flags = {1, 0, 1};
  const std::vector<ckpt::TensorRef> tensors = {
      {"w", ckpt::DType::f32, {2, 3}, as_bytes(w)},
      {"h", ckpt::DType::f16, {4}, as_bytes(h)},
      {"step", ckpt::DType::i64, {}, as_bytes(step)},
      {"flags", ckpt::DType::boolean, {3}, as_bytes(flags)},
      {"empty", ckpt::DType::bf16, {0, 5}, {}},
  };
  const std::map<std::string, std::string> meta = {{"mixprec.step", "42"}, {"note", "seed \xc3\xa9"}};
  const std::vector<std::byte> full = ckpt::serialize(tensors, meta);
  write(dir / "valid_mixprec.safetensors", full);
  write(dir / "valid_one_tensor.safetensors", ckpt::serialize(std::span(tensors).first(1), {}));
  write(dir / "valid_empty.safetensors", ckpt::serialize({}, {}));

  // Plain safetensors (no mixprec metadata, as Python's safetensors writes it).
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[1,2],"data_offsets":[8,10]}})";
  std::vector<std::byte> plain(8 + header.size() + 10);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) plain[static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(plain.data() + 8, header.data(), header.size());
  write(dir / "valid_plain.safetensors", plain);

  // Near-valid: one data byte flipped (checksum mismatch), the last byte cut, the header
  // length one too large.
  std::vector<std::byte> flipped = full;
  flipped.back() ^= std::byte{0x01};
  write(dir / "bad_checksum.safetensors", flipped);
  write(dir / "bad_truncated.safetensors", std::vector<std::byte>(full.begin(), full.end() - 1));
  std::vector<std::byte> long_header = full;
  long_header[0] = static_cast<std::byte>(static_cast<unsigned>(long_header[0]) + 1);
  write(dir / "bad_header_length.safetensors", long_header);

  // A trainer-like checkpoint with the header checksum (format version 2), and the same
  // with one digit of the loss scale changed in the header (a checksum mismatch).
  ckpt::WriteOptions checked;
  checked.header_checksum = true;
  const std::map<std::string, std::string> trainer_meta = {
      {"mixprec.version", "2"},
      {"mixprec.scaler", GradScaler(loss_scale_preset("mixprec")).state_json()},
      {"mixprec.totals", R"({"steps":3,"final_loss":"nan","val_loss":"inf","seconds":0.5})"}};
  const std::vector<std::byte> with_sum = ckpt::serialize(std::span(tensors).first(2), trainer_meta, checked);
  write(dir / "valid_header_checksum.safetensors", with_sum);
  std::vector<std::byte> tampered = with_sum;
  const std::string text(reinterpret_cast<const char*>(with_sum.data()), with_sum.size());
  if (const std::size_t at = text.find("65536"); at != std::string::npos) tampered[at] = static_cast<std::byte>('9');
  write(dir / "bad_header_checksum.safetensors", tampered);

  // Deep nesting in the header (the reader refuses it at once).
  const std::string deep = R"({"__metadata__":{"k":)" + std::string(5000, '[') + "}";
  std::vector<std::byte> nested(8 + deep.size());
  for (int i = 0; i < 8; ++i)
    nested[static_cast<std::size_t>(i)] = static_cast<std::byte>((deep.size() >> (8 * i)) & 0xff);
  std::memcpy(nested.data() + 8, deep.data(), deep.size());
  write(dir / "bad_deep_nesting.safetensors", nested);
}

void config_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  // Scaler states: a GradScaler's JSON and the bare LossScale state, for every preset,
  // after a few updates (counters, hysteresis) so no field holds only its default.
  for (const std::string& name : loss_scale_preset_names()) {
    GradScaler scaler(loss_scale_preset(name));
    write(dir / ("grad_scaler_" + name + ".json"), scaler.state_json());
    auto ls = make_loss_scale(loss_scale_preset(name));
    for (bool found_inf : {false, true, false, false, true}) {
      try {
        ls->update(found_inf);
      } catch (const std::exception&) {
        break;
      }
    }
    write(dir / ("loss_scale_" + name + ".json"), ls->to_json());
  }
  GradScaler disabled(loss_scale_preset("torch"), false);
  write(dir / "grad_scaler_disabled.json", disabled.state_json());

  // Step-log lines: a plain step, and a skipped one with every optional part present.
  train::StepRecord r;
  r.step = 7;
  r.lr = 3e-3;
  r.loss = 4.25;
  r.scale = 65536.0f;
  r.next_scale = 65536.0f;
  r.grad_norm = 0.75;
  r.tokens = 32768;
  r.seconds = 1.5;
  r.scaler_seconds = 0.01;
  r.act_grads.elements = 1000;
  r.act_grads.underflow = 3;
  r.act_grad_amax = 12.5f;
  r.headroom_log2 = 12.3;
  write(dir / "step_plain.jsonl", train::step_record_json(r));
  r.found_inf = true;
  r.skipped = true;
  r.injected = true;
  r.grad_norm = std::numeric_limits<double>::quiet_NaN();
  r.next_scale = 32768.0f;
  r.overflow_param = "h0.attn.qkv.w";
  r.overflow_activation = "h1.mlp.fc.grad";
  r.loss_finite = false;
  r.forward_nonfinite = "h1.mlp.act";
  r.val_loss = 4.5;
  r.act_grad_tensors.push_back({"h1.mlp.fc.grad", r.act_grads, 12.5f});
  r.params.push_back({"wte", 0.5f, 0.25f});
  train::StepRecord::Histograms hist;
  hist.activations.counts[64] = 10;
  hist.activation_grads.zeros = 2;
  hist.weight_grads.nonfinite = 1;
  hist.weights.counts[0] = 1;
  r.histograms = hist;
  write(dir / "step_skipped.jsonl", train::step_record_json(r));

  // The default config echoed (config.json of a run), and a few hand-picked settings.
  write(dir / "config_default.json", train::to_json(train::TrainConfig{}, 2));
  train::TrainConfig c;
  c.precision = nn::Precision::bf16;
  c.loss_scale = "static:1024";
  c.steps = 3;
  c.warmup = 1;
  c.inject_overflow_at = {2, 3};
  c.vocab = "char";
  write(dir / "config_small.json", train::to_json(c));

  // Deep nesting (every JSON reader refuses more than kMaxJsonDepth levels): complete
  // documents (a value nested 20,000 arrays deep crashed the readers before), objects,
  // inside a step line, and brackets inside a string (not nesting at all).
  write(dir / "deep_array.json", R"({"lr":)" + std::string(20000, '[') + std::string(20000, ']') + "}");
  std::string objects;
  for (int i = 0; i < 2000; ++i) objects += R"({"a":)";
  write(dir / "deep_object.json", objects + "1" + std::string(2000, '}'));
  write(dir / "deep_step.jsonl", R"({"step":1,"lr":)" + std::string(2000, '[') + std::string(2000, ']') + "}");
  write(dir / "deep_in_string.json", R"({"data":")" + std::string(2000, '[') + R"("})");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds CORPUS_DIR (fuzz/corpus)\n");
    return 2;
  }
  const fs::path root = argv[1];
  safetensors_seeds(root / "safetensors");
  config_seeds(root / "config");
  std::printf("fuzz_make_seeds: wrote seeds under %s\n", root.c_str());
  return 0;
}
