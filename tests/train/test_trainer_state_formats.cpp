// The engine over optimizer state formats (docs/optimizers.md, "State formats"): remainder
// masters start from the fp32 masters' weights of record bit for bit; compact moments train, checkpoint and resume bit for bit;
// skipped steps write nothing; the summary counts the bytes the store allocated; misuses are
// refused before a run starts.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "mixprec/train/trainer.hpp"

namespace mixprec::train {
namespace {

TrainConfig small(std::string master, std::string moments) {
  TrainConfig c;
  c.precision = nn::Precision::bf16;
  c.loss_scale = "none";
  c.master = std::move(master);
  c.moments = std::move(moments);
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.channels = 64;  // 64 x 64 and larger weights: at least 4096 elements, so they quantize
  c.model.context = 16;
  c.model.batch = 4;
  c.accum = 1;
  c.steps = 20;
  c.warmup = 4;
  c.corpus_tokens = 40000;
  c.vocab = "word:256";
  c.eval_every = 0;
  c.eval_windows = 8;
  c.inject_overflow_at = {12};  // a skipped step
  return c;
}

std::vector<std::byte> state_bytes(Trainer& t) {
  ParamStore& s = t.model().params();
  std::vector<float> w(s.flat_size());
  s.weights_of_record(w);
  std::vector<std::byte> out(reinterpret_cast<const std::byte*>(w.data()),
                             reinterpret_cast<const std::byte*>(w.data()) + w.size() * 4);
  for (unsigned k = 0; k < s.state_slots(); ++k)
    for (std::size_t i = 0; i < s.tensor_count(); ++i) {
      const MomentView v = s.moment(k, i);
      const auto* c = static_cast<const std::byte*>(v.codes);
      out.insert(out.end(), c, c + v.layout.code_bytes());
      if (v.scales != nullptr) {
        const auto* sc = reinterpret_cast<const std::byte*>(v.scales);
        out.insert(out.end(), sc, sc + 4 * v.layout.scale_count());
      }
    }
  return out;
}

TEST(TrainerStateFormats, CompactStateTrainsSkipsAndResumesBitForBit) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec-test-trainer-state-formats";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "ckpt.safetensors").string();
  const TrainConfig c = small("remainder", "fp8,8bit");
  Trainer straight(c);
  EXPECT_TRUE(straight.model().params().compact_moments());
  std::vector<StepRecord> ref;
  std::vector<std::byte> before_skip;
  while (!straight.done()) {
    if (ref.size() == 11) before_skip = state_bytes(straight);
    ref.push_back(straight.train_step());
    if (ref.size() == 12) {
      EXPECT_TRUE(ref.back().skipped) << "the injected overflow is skipped";
      EXPECT_EQ(state_bytes(straight), before_skip) << "a skipped step wrote state";
    }
  }
  {
    Trainer first(c);
    for (int i = 0; i < 15; ++i) first.train_step();
    first.save_checkpoint(path);
  }
  Trainer resumed(c);
  resumed.load_checkpoint(path);
  std::vector<StepRecord> rest;
  while (!resumed.done()) rest.push_back(resumed.train_step());
  ASSERT_EQ(rest.size(), ref.size() - 15);
  for (std::size_t i = 0; i < rest.size(); ++i)
    EXPECT_EQ(std::memcmp(&rest[i].loss, &ref[15 + i].loss, sizeof(double)), 0) << "step " << rest[i].step;
  EXPECT_EQ(state_bytes(resumed), state_bytes(straight));
  // The summary counts what the store allocated: int16 remainders, codes and scales.
  const TrainSummary s = straight.summary();
  const ParamStore& st = straight.model().params();
  EXPECT_EQ(s.memory.master_bytes, st.flat_size() * 2);
  EXPECT_LT(s.memory.optimizer_state_bytes, st.flat_size() * 8 / 3);
  std::filesystem::remove_all(dir);
}

TEST(TrainerStateFormats, RemainderMastersHoldTheFp32MastersWithTiesRoundedAway) {
  // The same initial fp32 masters: bit for bit the same weights of record. The bf16 weights the
  // model reads differ exactly where a master lies on a bf16 tie (remainder: away from zero;
  // an fp32 master's copy: to even), so the two runs train close, not equal.
  TrainConfig fa = small("fp32", "fp32"), fb = small("remainder", "fp32");
  fa.steps = fb.steps = 10;
  fa.inject_overflow_at = fb.inject_overflow_at = {};
  Trainer a(fa), b(fb);
  const ParamStore& sa = a.model().params();
  const ParamStore& sb = b.model().params();
  std::vector<float> wa(sa.flat_size()), wb(wa.size());
  sa.weights_of_record(wa);
  sb.weights_of_record(wb);
  EXPECT_EQ(std::memcmp(wa.data(), wb.data(), wa.size() * 4), 0);
  const auto* ma = static_cast<const std::uint16_t*>(sa.model_data());
  const auto* mb = static_cast<const std::uint16_t*>(sb.model_data());
  std::size_t ties = 0;
  for (std::size_t i = 0; i < wa.size(); ++i) {
    if (ma[i] == mb[i]) continue;
    std::uint32_t bits = 0;
    std::memcpy(&bits, &wa[i], 4);
    EXPECT_EQ(bits & 0xFFFFu, 0x8000u) << "element " << i << " differs off a tie";
    ++ties;
  }
  EXPECT_LT(ties, wa.size() / 1000);
  double la = 0, lb = 0;
  while (!a.done()) la = a.train_step().loss;
  while (!b.done()) lb = b.train_step().loss;
  EXPECT_NEAR(la, lb, 0.02);
}

TEST(TrainerStateFormats, MisusesAreRefusedBeforeTheRun) {
  auto error = [](TrainConfig c) {
    try {
      validate(c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  TrainConfig c = small("remainder", "fp32");
  c.precision = nn::Precision::fp16;
  EXPECT_EQ(error(c), "master: expected fp32 with precision fp16 (remainder needs master weights and bf16 model "
                      "weights: --precision bf16), found remainder");
  c = small("fp32", "int8");
  EXPECT_EQ(error(c), "moments: expected fp32, bf16, fp16, fp8, 8bit, 4bit (or M,V), found 'int8'");
  c = small("fp32", "8bit");
  c.optimizer = "sgd";
  EXPECT_EQ(error(c), "optimizer: expected adam or adamw with --master/--moments other than fp32 (the state formats "
                      "are Adam's), found sgd");
  c = small("fp32", "8bit");
  c.moment_block = 100;
  EXPECT_EQ(error(c), "moment-block: expected 0 or a power of two in [32, 1024], found 100");
}

}  // namespace
}  // namespace mixprec::train
