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

// The optimizer state measured inside the fused step at histogram steps, against plain counts:
// fp32 masters with fp32 first moments and fp8 second moments, at a learning rate where some
// updates round away in fp32. Per tensor at every sampled step: m_error is 0 (m is stored exactly),
// v_error is above 0 exactly where v is stored in fp8 (tensors of 4096 elements and more), and
// meant / lost equal a count over the masters before and after the step and the stored m. Steps
// between histogram steps measure nothing; the summary holds the per-tensor sums.
TEST(TrainerStateFormats, OptimizerStateAtHistogramStepsEqualsPlainCounts) {
  TrainConfig c = small("fp32", "fp32,fp8");
  c.steps = 6;
  c.histogram_every = 2;
  c.inject_overflow_at = {};
  c.lr = 1e-9;  // below half an fp32 ulp of the larger weights: some updates are lost
  c.min_lr = c.lr;
  c.warmup = 0;
  Trainer t(c);
  ParamStore& s = t.model().params();
  std::uint64_t sampled = 0, meant_total = 0, lost_total = 0;
  while (!t.done()) {
    const std::vector<float> before(s.master_data(), s.master_data() + s.flat_size());
    const StepRecord r = t.train_step();
    ASSERT_FALSE(r.skipped);
    const bool histogram = r.step == 1 || r.step % 2 == 0 || r.step == c.steps;
    if (!histogram) {
      EXPECT_TRUE(r.optimizer_state.empty()) << "step " << r.step;
      continue;
    }
    ++sampled;
    ASSERT_EQ(r.optimizer_state.size(), s.tensor_count()) << "step " << r.step;
    for (std::size_t i = 0; i < s.tensor_count(); ++i) {
      const StepRecord::StateStats& x = r.optimizer_state[i];
      const std::string what = "step " + std::to_string(r.step) + " " + s.spec(i).name;
      EXPECT_EQ(x.name, s.spec(i).name);
      EXPECT_EQ(x.m_error, 0.0) << what;
      if (s.moment(1, i).layout.format == MomentFormat::fp8) {
        EXPECT_GT(x.v_error, 0.0) << what;
        EXPECT_LT(x.v_error, 0.2) << what;
      } else {
        EXPECT_EQ(x.v_error, 0.0) << what;
      }
      const float* m = static_cast<const float*>(s.moment(0, i).codes);
      std::uint64_t meant = 0, lost = 0;
      for (std::size_t k = 0; k < s.numel(i); ++k) {
        const float b = before[s.offset(i) + k], a = s.master_data()[s.offset(i) + k];
        const bool moves = m[k] != 0.0f || (c.weight_decay > 0 && b != 0.0f);
        meant += moves;
        lost += moves && std::memcmp(&a, &b, 4) == 0;
      }
      EXPECT_EQ(x.meant, meant) << what;
      EXPECT_EQ(x.lost, lost) << what;
      meant_total += meant;
      lost_total += lost;
    }
  }
  EXPECT_EQ(sampled, 4u);  // steps 1, 2, 4, 6
  EXPECT_GT(lost_total, 0u);
  EXPECT_LT(lost_total, meant_total);
  const TrainSummary sum = t.summary();
  ASSERT_TRUE(sum.optimizer_state.has_value());
  EXPECT_EQ(sum.optimizer_state->sampled_steps, sampled);
  std::uint64_t meant_summed = 0, lost_summed = 0;
  for (const OptimizerStateSummary::Tensor& x : sum.optimizer_state->params) {
    meant_summed += x.totals.meant;
    lost_summed += x.totals.lost;
  }
  EXPECT_EQ(meant_summed, meant_total);
  EXPECT_EQ(lost_summed, lost_total);
}

}  // namespace
}  // namespace mixprec::train
