// The engine's step guards (docs/spike_guards.md): bad batches at known steps are skipped,
// exactly those, with every optimizer, schedule and EMA byte unchanged; the EMA follows
// applied steps only; planted faults are named (forward and backward); a resumed guarded run
// decides the same skips and ends bit for bit where the straight run ends.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "mixprec/train/trainer.hpp"

namespace mixprec::train {
namespace {

TrainConfig guarded(nn::Precision p, std::string scale) {
  TrainConfig c;
  c.precision = p;
  c.loss_scale = std::move(scale);
  c.model.layers = 2;
  c.model.heads = 2;
  c.model.channels = 16;
  c.model.context = 16;
  c.model.batch = 4;
  c.accum = 2;
  c.steps = 100;
  c.warmup = 4;
  c.corpus_tokens = 40000;
  c.vocab = "word:256";
  c.eval_every = 0;
  c.eval_windows = 8;
  // z reaches at most sqrt(47) = 6.86, which a gradient 1000x its usual size reaches; random
  // labels give a loss z of about 4.9; the clean steps of these runs stay below 3.1 (loss) and
  // 5.2 (gradient norm, fp16).
  c.skip_window = 48;
  c.skip_loss_z = 4;
  c.skip_grad_z = 6;
  c.ema = 0.9;
  c.inject_bad_batch_at = {70, 80};
  c.inject_bad_batch = "labels,scaled";
  c.inject_overflow_at = {90};
  return c;
}

std::vector<std::byte> bytes_of(const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  return {b, b + n};
}

// Every byte a skipped step must leave alone.
struct State {
  std::vector<std::byte> weights, model, state0, state1, ema;
  std::int64_t opt_step = 0;
  bool operator==(const State&) const = default;
};

State state_of(Trainer& t) {
  ParamStore& s = t.model().params();
  State r;
  if (s.has_master()) r.weights = bytes_of(s.master_data(), s.flat_size() * 4);
  r.model = bytes_of(s.model_data(), s.flat_size() * dtype_size(s.model_dtype()));
  r.state0 = bytes_of(s.state_data(0), s.flat_size() * 4);
  r.state1 = bytes_of(s.state_data(1), s.flat_size() * 4);
  r.ema = bytes_of(t.ema().data(), t.ema().size() * 4);
  r.opt_step = t.optimizer().step_count();
  return r;
}

TEST(TrainerGuards, BadBatchesAreSkippedExactlyAndTouchNothing) {
  for (const auto& [p, scale] : {std::pair{nn::Precision::bf16, std::string("none")},
                                 std::pair{nn::Precision::fp16, std::string("static:256")},
                                 std::pair{nn::Precision::fp32, std::string("none")}}) {
    SCOPED_TRACE(std::string(nn::precision_name(p)));
    Trainer t(guarded(p, scale));
    std::vector<StepRecord> log;
    while (!t.done()) {
      const State before = state_of(t);
      StepRecord r = t.train_step();
      if (r.skipped) {
        EXPECT_EQ(state_of(t), before) << "step " << r.step << " was skipped and changed optimizer, EMA or weight bytes";
      } else {
        EXPECT_NE(state_of(t).ema, before.ema) << "step " << r.step << " was applied and the EMA did not follow";
      }
      log.push_back(std::move(r));
    }
    std::vector<std::pair<std::uint64_t, SkipReason>> skipped;
    for (const StepRecord& r : log)
      if (r.skipped) skipped.emplace_back(r.step, r.skip_reason);
    const std::vector<std::pair<std::uint64_t, SkipReason>> want = {
        {70, SkipReason::loss_spike}, {80, SkipReason::grad_spike}, {90, SkipReason::nonfinite_grad}};
    EXPECT_EQ(skipped, want);
    // The schedule did not advance over a skipped step: the next step has its learning rate.
    for (std::uint64_t s : {70u, 80u, 90u}) EXPECT_EQ(log[s].lr, log[s - 1].lr) << "after step " << s;
    // A guard's skip leaves a scale as it was (only an overflow backs a dynamic one off).
    EXPECT_EQ(log[69].next_scale, log[69].scale);
    EXPECT_EQ(log[79].next_scale, log[79].scale);
    const TrainSummary sum = t.summary();
    EXPECT_EQ(sum.skipped_by[static_cast<std::size_t>(SkipReason::loss_spike)], 1u);
    EXPECT_EQ(sum.skipped_by[static_cast<std::size_t>(SkipReason::grad_spike)], 1u);
    EXPECT_EQ(sum.skipped_by[static_cast<std::size_t>(SkipReason::nonfinite_grad)], 1u);
  }
}

TEST(TrainerGuards, WithoutGuardsTheBadBatchesAreApplied) {
  TrainConfig c = guarded(nn::Precision::bf16, "none");
  c.skip_loss_z = 0;
  c.skip_grad_z = 0;
  Trainer t(c);
  std::vector<StepRecord> log;
  while (!t.done()) log.push_back(t.train_step());
  EXPECT_FALSE(log[69].skipped);
  EXPECT_FALSE(log[79].skipped);
  EXPECT_TRUE(log[89].skipped) << "inf/NaN is never written into the weights, guards or not";
}

TEST(TrainerGuards, PlantedFaultsAreNamedForwardAndBackward) {
  // Six steps with a fault planted at step 4; the log of the run.
  const auto run_with_fault = [](nn::Precision p, const std::string& fault) {
    TrainConfig c = guarded(p, "dynamic");
    c.steps = 6;
    c.inject_bad_batch_at = {};
    c.inject_bad_batch = "labels";
    c.inject_overflow_at = {};
    c.inject_fault_at = {4};
    c.inject_fault = fault;
    Trainer t(c);
    std::vector<StepRecord> log;
    while (!t.done()) log.push_back(t.train_step());
    return log;
  };
  for (nn::Precision p : {nn::Precision::bf16, nn::Precision::fp16}) {
    for (const char* name : {"h0.mlp.fc", "h1.attn.qkv", "h1.mlp.gelu"}) {
      const std::vector<StepRecord> log = run_with_fault(p, std::string("forward:") + name);
      EXPECT_TRUE(log[3].skipped);
      EXPECT_EQ(log[3].forward_nonfinite, name) << nn::precision_name(p);
      EXPECT_TRUE(log[2].forward_nonfinite.empty());
      EXPECT_FALSE(log[4].skipped) << "the fault was planted at step 4 only";
    }
    for (const char* name : {"h1.mlp.gelu.grad", "h0.attn.grad", "h0.ln1.grad"}) {
      const std::vector<StepRecord> log = run_with_fault(p, std::string("backward:") + name);
      EXPECT_TRUE(log[3].skipped);
      EXPECT_EQ(log[3].overflow_activation, name) << nn::precision_name(p);
      EXPECT_TRUE(log[3].forward_nonfinite.empty());
    }
  }
  TrainConfig c = guarded(nn::Precision::bf16, "none");
  c.inject_fault_at = {4};
  c.inject_fault = "forward:h7.mlp.fc";
  try {
    Trainer t(c);
    ADD_FAILURE() << "an unknown activation was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("inject-fault: activation: expected one of embedding, h0.ln1"), std::string::npos)
        << e.what();
  }
}

TEST(TrainerGuards, ResumedGuardedRunDecidesTheSameAndEndsBitForBit) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec-test-trainer-guards";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "ckpt.safetensors").string();
  TrainConfig c = guarded(nn::Precision::bf16, "none");
  Trainer straight(c);
  std::vector<StepRecord> ref;
  while (!straight.done()) ref.push_back(straight.train_step());
  {
    Trainer first(c);
    for (int i = 0; i < 60; ++i) first.train_step();  // the windows are full: their state must carry over
    first.save_checkpoint(path);
  }
  Trainer resumed(c);
  resumed.load_checkpoint(path);
  std::vector<StepRecord> rest;
  while (!resumed.done()) rest.push_back(resumed.train_step());
  ASSERT_EQ(rest.size(), ref.size() - 60);
  for (std::size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].skip_reason, ref[60 + i].skip_reason) << "step " << rest[i].step;
    EXPECT_EQ(std::memcmp(&rest[i].loss_z, &ref[60 + i].loss_z, sizeof(double)), 0) << "step " << rest[i].step;
  }
  EXPECT_EQ(state_of(resumed), state_of(straight));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mixprec::train
