// The training loop: overflow skipping, accumulation, lost updates, and exact resume
// from a checkpoint (including a skipped step in between).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "mixprec/lowp/scaling.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::train {
namespace {

TrainConfig tiny(nn::Precision p = nn::Precision::fp16, std::string scale = "dynamic") {
  TrainConfig c;
  c.precision = p;
  c.loss_scale = std::move(scale);
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.channels = 16;
  c.model.context = 16;
  c.model.batch = 4;
  c.accum = 2;
  c.steps = 8;
  c.warmup = 2;
  c.corpus_tokens = 20000;
  c.vocab = "word:256";
  c.eval_every = 0;
  c.eval_windows = 8;
  return c;
}

std::vector<std::byte> bytes_of(const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  return {b, b + n};
}

// Everything a resumed run must reproduce bitwise: weights of record, model copy,
// optimizer state arrays and counters, the scaler's state.
struct Snapshot {
  std::vector<std::byte> weights, model, state0, state1;
  std::int64_t opt_step = 0;
  std::string scaler;
  std::string fp8;  // fp8-delayed: amax histories and scales as JSON (exact float text)
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(Trainer& t) {
  ParamStore& s = t.model().params();
  Snapshot r;
  if (s.has_master()) r.weights = bytes_of(s.master_data(), s.flat_size() * 4);
  r.model = bytes_of(s.model_data(), s.flat_size() * dtype_size(s.model_dtype()));
  r.state0 = bytes_of(s.state_data(0), s.flat_size() * 4);
  r.state1 = bytes_of(s.state_data(1), s.flat_size() * 4);
  r.opt_step = t.optimizer().step_count();
  r.scaler = t.scaler().state_json();
  if (const lowp::DelayedScaling* d = t.model().fp8_delayed()) r.fp8 = d->to_json();
  return r;
}

TEST(Trainer, InjectedOverflowSkipsExactlyThoseStepsAndHalvesTheScale) {
  TrainConfig c = tiny();
  c.inject_overflow_at = {3, 4, 7};
  Trainer t(c);
  std::vector<StepRecord> log;
  while (!t.done()) log.push_back(t.train_step());
  ASSERT_EQ(log.size(), 8u);
  for (const StepRecord& r : log) {
    const bool injected = r.step == 3 || r.step == 4 || r.step == 7;
    EXPECT_EQ(r.skipped, injected) << "step " << r.step;
    EXPECT_EQ(r.found_inf, injected) << "step " << r.step;
    EXPECT_EQ(r.injected, injected) << "step " << r.step;
    EXPECT_EQ(r.next_scale, injected ? r.scale / 2 : r.scale) << "step " << r.step;
    if (injected) {
      EXPECT_EQ(r.overflow_param, "wte");
    }
    EXPECT_TRUE(std::isfinite(r.loss));
  }
  EXPECT_EQ(t.optimizer().step_count(), 5);  // skipped steps do not advance Adam
  const TrainSummary s = t.summary();
  EXPECT_EQ(s.skipped, 3u);
  EXPECT_EQ(s.applied, 5u);
  EXPECT_EQ(s.final_scale, 65536.0f / 8);
  ASSERT_TRUE(s.val_loss.has_value());
  EXPECT_TRUE(std::isfinite(*s.val_loss));
}

TEST(Trainer, TrainingLowersTheLossInEveryPrecision) {
  for (nn::Precision p : {nn::Precision::fp32, nn::Precision::fp16, nn::Precision::bf16, nn::Precision::fp16_pure,
                          nn::Precision::fp8_delayed, nn::Precision::fp8_current, nn::Precision::mxfp8}) {
    const bool unscaled = p == nn::Precision::fp32 || p == nn::Precision::bf16 || nn::is_fp8(p);
    TrainConfig c = tiny(p, unscaled ? "none" : "dynamic");
    c.steps = 12;
    Trainer t(c);
    const double before = t.evaluate();
    while (!t.done()) t.train_step();
    EXPECT_LT(*t.summary().val_loss, before - 0.3) << nn::precision_name(p);
  }
}

// The loss is averaged over the whole effective batch: accum 2 x batch 4 computes the
// same update as accum 1 x batch 8 over the same sequences (up to summation order).
TEST(Trainer, AccumulationMatchesOneLargeBatch) {
  TrainConfig a = tiny(nn::Precision::fp32, "none");
  a.steps = 1;
  a.warmup = 0;
  TrainConfig b = a;
  b.accum = 1;
  b.model.batch = 8;
  Trainer ta(a), tb(b);
  const StepRecord ra = ta.train_step(), rb = tb.train_step();
  EXPECT_NEAR(ra.loss, rb.loss, 1e-6 * rb.loss);
  EXPECT_NEAR(ra.grad_norm, rb.grad_norm, 1e-5 * rb.grad_norm);
  const std::span<const float> wa = ta.model().params().model<float>(0), wb = tb.model().params().model<float>(0);
  for (std::size_t i = 0; i < wa.size(); ++i) ASSERT_NEAR(wa[i], wb[i], 1e-6f) << i;
}

TEST(Trainer, PureFp16LosesUpdatesAtLowLearningRatesAndMasterWeightsDoNot) {
  TrainConfig c = tiny(nn::Precision::fp16_pure);
  c.lr = 1e-6;  // a fine-tuning rate: Adam moves each weight by about 1e-6
  c.min_lr = 1e-6;
  c.steps = 3;
  c.warmup = 0;
  Trainer pure(c);
  double lost_pure = 0;
  while (!pure.done()) lost_pure = pure.train_step().lost_update_fraction;
  c.precision = nn::Precision::fp16;
  Trainer mixed(c);
  double lost_mixed = 1;
  while (!mixed.done()) lost_mixed = mixed.train_step().lost_update_fraction;
  EXPECT_GT(lost_pure, 0.5);   // 1e-6 is below half an fp16 ulp of any weight above 2^-10
  EXPECT_LT(lost_mixed, 1e-3);  // fp32 master weights keep them
}

// The step's lost-update fraction against a plain count over the weights before and
// after the step: Adam meant to move a weight when its first moment is nonzero or decay
// acts on it (nonzero), and lost it when the stored bits did not change. Pure fp16
// (2-byte model copy) at a rate where some but not all updates round away, and mixed
// fp16 (4-byte master).
TEST(Trainer, LostUpdateFractionEqualsAPlainCountOverTheStep) {
  for (nn::Precision p : {nn::Precision::fp16_pure, nn::Precision::fp16}) {
    TrainConfig c = tiny(p, "static:1024");
    c.lr = p == nn::Precision::fp16_pure ? 3e-4 : 1e-6;
    c.min_lr = c.lr;
    c.warmup = 0;
    c.steps = 3;
    Trainer t(c);
    (void)t.train_step();  // Adam's moments are nonzero from here on
    const ParamStore& store = t.model().params();
    const std::size_t n = store.flat_size();
    const std::size_t w = store.has_master() ? 4 : 2;
    const auto weights = [&] {
      return store.has_master() ? static_cast<const std::byte*>(static_cast<const void*>(store.master_data()))
                                : static_cast<const std::byte*>(store.model_data());
    };
    const std::vector<std::byte> before(weights(), weights() + n * w);
    const StepRecord r = t.train_step();
    ASSERT_FALSE(r.skipped);
    const float* m1 = const_cast<ParamStore&>(store).state_data(0);
    std::uint64_t meant = 0, lost = 0;
    for (std::size_t i = 0; i < n; ++i) {
      bool nonzero = false;  // the weight before the step, sign bit ignored
      for (std::size_t k = 0; k < w; ++k) {
        const auto byte = static_cast<unsigned>(before[i * w + k]);
        nonzero = nonzero || (k + 1 == w ? (byte & 0x7fu) != 0 : byte != 0);
      }
      const bool moves = m1[i] != 0.0f || (c.weight_decay > 0 && nonzero);
      const bool same = std::memcmp(&before[i * w], weights() + i * w, w) == 0;
      meant += moves ? 1 : 0;
      lost += moves && same ? 1 : 0;
    }
    ASSERT_GT(meant, 0u);
    const double expected = static_cast<double>(lost) / static_cast<double>(meant);
    EXPECT_EQ(r.lost_update_fraction, expected) << nn::precision_name(p) << ": " << lost << " of " << meant;
    if (p == nn::Precision::fp16_pure) {
      EXPECT_GT(expected, 0.0);  // the case is not trivial: some updates are lost,
      EXPECT_LT(expected, 1.0);  // and some are not
    }
  }
}

class TrainerResume : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("mixprec-test-resume-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(TrainerResume, ResumedRunIsBitwiseIdentical) {
  for (nn::Precision p : {nn::Precision::fp16, nn::Precision::fp16_pure, nn::Precision::bf16,
                          nn::Precision::fp8_delayed}) {
    TrainConfig c = tiny(p);
    if (p == nn::Precision::fp8_delayed) c.fp8_amax_history = 3;  // short: the history wraps before the checkpoint
    c.inject_overflow_at = {2, 6};  // one skip before the checkpoint, one after
    Trainer straight(c);
    std::vector<StepRecord> ref;
    while (!straight.done()) ref.push_back(straight.train_step());

    const std::string path = (dir_ / "ckpt.safetensors").string();
    {
      Trainer first(c);
      for (int i = 0; i < 4; ++i) first.train_step();
      first.save_checkpoint(path);
    }
    Trainer resumed(c);
    resumed.load_checkpoint(path);
    EXPECT_EQ(resumed.steps_done(), 4u);
    std::vector<StepRecord> rest;
    while (!resumed.done()) rest.push_back(resumed.train_step());
    ASSERT_EQ(rest.size(), 4u);
    for (std::size_t i = 0; i < rest.size(); ++i) {
      const StepRecord& a = ref[4 + i];
      const StepRecord& b = rest[i];
      EXPECT_EQ(a.step, b.step);
      EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof a.loss), 0) << "step " << a.step;
      EXPECT_EQ(a.scale, b.scale);
      EXPECT_EQ(a.skipped, b.skipped);
      EXPECT_EQ(a.lr, b.lr);
      EXPECT_EQ(a.act_grads, b.act_grads);
      ASSERT_EQ(a.fp8.size(), b.fp8.size());
      for (std::size_t k = 0; k < a.fp8.size(); ++k) {
        EXPECT_EQ(a.fp8[k].name, b.fp8[k].name);
        EXPECT_EQ(std::memcmp(&a.fp8[k].scale, &b.fp8[k].scale, sizeof(float)), 0) << a.fp8[k].name;
        EXPECT_EQ(std::memcmp(&a.fp8[k].amax, &b.fp8[k].amax, sizeof(float)), 0) << a.fp8[k].name;
        EXPECT_EQ(a.fp8[k].saturated, b.fp8[k].saturated);
        EXPECT_EQ(a.fp8[k].flushed, b.fp8[k].flushed);
        EXPECT_EQ(a.fp8[k].nonzero, b.fp8[k].nonzero);
      }
    }
    EXPECT_EQ(ref.front().fp8.empty(), p != nn::Precision::fp8_delayed);
    EXPECT_TRUE(snapshot(straight) == snapshot(resumed)) << nn::precision_name(p);
    const TrainSummary s1 = straight.summary(), s2 = resumed.summary();
    EXPECT_EQ(s1.applied, s2.applied);
    EXPECT_EQ(s1.skipped, s2.skipped);
    EXPECT_EQ(s1.val_loss, s2.val_loss);
    EXPECT_EQ(s1.fp8_forward_flushed_fraction, s2.fp8_forward_flushed_fraction);
    EXPECT_EQ(s1.fp8_backward_flushed_fraction, s2.fp8_backward_flushed_fraction);
    EXPECT_EQ(s1.fp8_backward_saturated_fraction, s2.fp8_backward_saturated_fraction);
  }
}

// The delayed-scaling state is checked before anything changes: a run whose fp8 recipe
// differs (history length) refuses the checkpoint, naming what it expected and found.
TEST_F(TrainerResume, Fp8DelayedStateIsValidatedBeforeAnyChange) {
  TrainConfig c = tiny(nn::Precision::fp8_delayed, "none");
  c.fp8_amax_history = 4;
  const std::string path = (dir_ / "ckpt.safetensors").string();
  {
    Trainer t(c);
    t.train_step();
    t.train_step();
    t.save_checkpoint(path);
  }
  // The config check names the option first.
  TrainConfig other = c;
  other.fp8_amax_history = 5;
  Trainer t(other);
  const Snapshot before = snapshot(t);
  try {
    t.load_checkpoint(path);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8-amax-history"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(snapshot(t) == before);
  EXPECT_EQ(t.steps_done(), 0u);

  // The model-level check: a state of another shape is refused with what was expected.
  Trainer same(c);
  lowp::DelayedScalingState bad = same.model().fp8_delayed()->state();
  bad.tensors.pop_back();
  try {
    same.model().load_fp8_delayed(bad);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected 12 tensors, found 11"), std::string::npos) << e.what();
  }
  bad = same.model().fp8_delayed()->state();
  bad.tensors[0].amax_history.push_back(0.0f);
  EXPECT_THROW(same.model().load_fp8_delayed(bad), std::invalid_argument);
  bad = same.model().fp8_delayed()->state();
  bad.tensors[1].name = "h0.attn.qkv.bias";
  try {
    same.model().load_fp8_delayed(bad);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected h0.attn.qkv.weight (forward), found h0.attn.qkv.bias"),
              std::string::npos)
        << e.what();
  }
  const std::string unchanged = same.model().fp8_delayed()->to_json();
  EXPECT_EQ(unchanged, Trainer(c).model().fp8_delayed()->to_json());
  // And the right one loads.
  same.load_checkpoint(path);
  EXPECT_EQ(same.steps_done(), 2u);
  EXPECT_NE(same.model().fp8_delayed()->to_json(), unchanged);
}

TEST_F(TrainerResume, RejectsCheckpointsOfAnotherRunWithoutChangingState) {
  TrainConfig c = tiny();
  const std::string path = (dir_ / "ckpt.safetensors").string();
  {
    Trainer t(c);
    t.train_step();
    t.save_checkpoint(path);
  }
  TrainConfig other = c;
  other.model.channels = 32;
  Trainer t(other);
  const Snapshot before = snapshot(t);
  try {
    t.load_checkpoint(path);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("channels"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ckpt.safetensors"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(snapshot(t) == before);
  EXPECT_EQ(t.steps_done(), 0u);

  // A flipped byte in a tensor fails the checksum.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char ch = 0;
    f.get(ch);
    f.seekp(-5, std::ios::end);
    f.put(static_cast<char>(ch ^ 0x10));
  }
  Trainer same(c);
  EXPECT_THROW(same.load_checkpoint(path), std::runtime_error);
  EXPECT_EQ(same.steps_done(), 0u);
}

// ---- recipe files (--recipe-file) -----------------------------------------------------------

// A recipe file in `dir` of `body` (the fields after format and version); its path.
std::string recipe_file(const std::filesystem::path& dir, const std::string& name, const std::string& body) {
  const std::string path = (dir / name).string();
  std::ofstream(path) << R"({"format":"mixprec.low_precision","version":1,)" << body << "}";
  return path;
}

std::vector<StepRecord> train_all(Trainer& t) {
  std::vector<StepRecord> r;
  while (!t.done()) r.push_back(t.train_step());
  return r;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// A schedule switches the Linears it names at its phase starts (from_step 4: the fifth step;
// from_fraction 0.75 of 8 steps: the seventh): the loss curve is the entry plan's before and
// differs from the switch on; the step's log line carries the phase's label, no other line
// has the field. The evaluation entry serves the validation loss only.
TEST_F(TrainerResume, RecipeScheduleSwitchesAtItsPhaseStartsAndTheLogMarksThem) {
  const std::string entry = R"("default":"mxfp8","modules":{"h0.mlp.fc":{"recipe":"nvfp4","fprop":"bf16"}})";
  TrainConfig c = tiny(nn::Precision::mxfp8, "none");
  c.eval_every = 4;
  c.recipe_file = recipe_file(dir_, "entry.json", entry);
  Trainer plain(c);
  const std::vector<StepRecord> a = train_all(plain);
  c.recipe_file = recipe_file(dir_, "schedule.json",
                              entry + R"(,"schedule":[{"from_step":4,"modules":["h0.attn.*"],"recipe":"mxfp4",)"
                                      R"("label":"attention to mxfp4"},)"
                                      R"({"from_fraction":0.75,"wgrad":"bf16","label":"wgrad in bf16"}])");
  Trainer switched(c);
  const std::vector<StepRecord> b = train_all(switched);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(same_bits(a[i].loss, b[i].loss), i < 4);
    EXPECT_EQ(a[i].recipe_phase, "");
    EXPECT_EQ(b[i].recipe_phase, i == 4 ? "attention to mxfp4" : i == 6 ? "wgrad in bf16" : "");
    const std::string line = step_record_json(b[i]);
    EXPECT_EQ(line.find("recipe_phase") != std::string::npos, i == 4 || i == 6) << line;
    EXPECT_EQ(parse_step_record(line).recipe_phase, b[i].recipe_phase);
  }
  EXPECT_NE(step_record_json(b[4]).find(R"("recipe_phase":"attention to mxfp4")"), std::string::npos);
  // The log names each tensor's recipe as its plan has it at that step; h0.mlp.fc's X is
  // quantized by wgrad only (fprop bf16), its dY by both.
  auto recipe_of = [](const StepRecord& r, const std::string& name) -> std::string {
    for (const nn::Fp8TensorStats& s : r.fp8)
      if (s.name == name) return s.recipe;
    return "(absent)";
  };
  EXPECT_EQ(recipe_of(b[3], "h0.attn.qkv.input"), "mxfp8");
  EXPECT_EQ(recipe_of(b[4], "h0.attn.qkv.input"), "mxfp4");
  EXPECT_EQ(recipe_of(b[4], "h0.attn.proj.grad_output"), "mxfp4");
  EXPECT_EQ(recipe_of(b[4], "h0.mlp.fc.input"), "nvfp4");
  EXPECT_EQ(recipe_of(b[4], "h0.mlp.proj.weight"), "mxfp8");
  // From step 7 h0.mlp.fc has no quantized X (fprop and wgrad in bf16): no entry.
  EXPECT_EQ(recipe_of(b[6], "h0.mlp.fc.input"), "(absent)");
  EXPECT_EQ(recipe_of(b[6], "h0.mlp.fc.grad_output"), "nvfp4");
  // An evaluation entry changes the validation loss, not the training.
  c.recipe_file = recipe_file(dir_, "evaluation.json", entry + R"(,"evaluation":"bf16")");
  Trainer evaluated(c);
  const std::vector<StepRecord> e = train_all(evaluated);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_TRUE(same_bits(a[i].loss, e[i].loss)) << "step " << i + 1;
  ASSERT_TRUE(a[3].val_loss && e[3].val_loss);
  EXPECT_FALSE(same_bits(*a[3].val_loss, *e[3].val_loss));
}

// A run resumed from a checkpoint before or after a recipe switch continues the schedule:
// bitwise the uninterrupted run (mxfp8 to mxfp4; fp8-delayed with its amax histories,
// then wgrad in bf16 keeping X in fp32).
TEST_F(TrainerResume, ResumedAcrossARecipeSwitchIsBitwiseIdentical) {
  const std::string bodies[] = {
      R"("default":"mxfp8","modules":{},"schedule":[{"from_step":3,"recipe":"mxfp4","label":"fp4"}])",
      R"("default":{"recipe":"fp8-delayed","amax_history_len":3},"modules":{},)"
      R"("schedule":[{"from_fraction":0.5,"modules":["h0.mlp.*"],"wgrad":"bf16","label":"hp wgrad"}])",
  };
  for (const std::string& body : bodies) {
    SCOPED_TRACE(body);
    TrainConfig c = tiny(nn::Precision::fp8_current, "none");
    c.recipe_file = recipe_file(dir_, "r.json", body);
    c.inject_overflow_at = {2};
    Trainer straight(c);
    const std::vector<StepRecord> ref = train_all(straight);
    for (const std::uint64_t at : {2u, 5u}) {
      const std::string path = (dir_ / ("ckpt-" + std::to_string(at) + ".safetensors")).string();
      {
        Trainer first(c);
        for (std::uint64_t i = 0; i < at; ++i) first.train_step();
        first.save_checkpoint(path);
      }
      Trainer resumed(c);
      resumed.load_checkpoint(path);
      const std::vector<StepRecord> rest = train_all(resumed);
      ASSERT_EQ(rest.size(), 8 - at);
      for (std::size_t i = 0; i < rest.size(); ++i) {
        const StepRecord& x = ref[at + i];
        const StepRecord& y = rest[i];
        EXPECT_TRUE(same_bits(x.loss, y.loss)) << "step " << x.step << " resumed at " << at;
        EXPECT_EQ(x.recipe_phase, y.recipe_phase);
        ASSERT_EQ(x.fp8.size(), y.fp8.size());
        for (std::size_t k = 0; k < x.fp8.size(); ++k) {
          EXPECT_EQ(x.fp8[k].recipe, y.fp8[k].recipe);
          EXPECT_EQ(std::memcmp(&x.fp8[k].scale, &y.fp8[k].scale, sizeof(float)), 0) << x.fp8[k].name;
          EXPECT_EQ(x.fp8[k].flushed, y.fp8[k].flushed);
        }
      }
      EXPECT_TRUE(snapshot(straight) == snapshot(resumed)) << "resumed at " << at;
    }
    EXPECT_EQ(ref[3].recipe_phase + ref[4].recipe_phase, body == bodies[0] ? "fp4" : "hp wgrad");
  }
}

// The checkpoint holds the recipes: a resume reads the same ones (the file may move), keeps
// the steps its fractions are placed in, and has a recipe file exactly when the run had one.
TEST_F(TrainerResume, RecipesOfTheCheckpointAreChecked) {
  TrainConfig c = tiny(nn::Precision::mxfp8, "none");
  c.recipe_file = recipe_file(dir_, "r.json", R"("default":"mxfp8","modules":{},)"
                                             R"("schedule":[{"from_fraction":0.5,"recipe":"fp8-block"}])");
  const std::string path = (dir_ / "ckpt.safetensors").string();
  {
    Trainer t(c);
    t.train_step();
    t.save_checkpoint(path);
  }
  auto error = [&](const TrainConfig& other) {
    Trainer t(other);
    const Snapshot before = snapshot(t);
    try {
      t.load_checkpoint(path);
    } catch (const std::runtime_error& e) {
      EXPECT_TRUE(snapshot(t) == before);
      EXPECT_EQ(t.steps_done(), 0u);
      return std::string(e.what());
    }
    return std::string();
  };
  TrainConfig moved = c;  // the same recipes by another path
  moved.recipe_file = recipe_file(dir_, "moved.json", R"("default":"mxfp8","modules":{},)"
                                                      R"("schedule":[{"from_fraction":0.5,"recipe":"fp8-block"}])");
  EXPECT_EQ(error(moved), "");
  TrainConfig edited = c;
  edited.recipe_file = recipe_file(dir_, "edited.json", R"("default":"mxfp8","modules":{},)"
                                                        R"("schedule":[{"from_fraction":0.5,"recipe":"nvfp4"}])");
  EXPECT_NE(error(edited).find("recipes: the recipe file '" + edited.recipe_file + "' differs from the recipes the run "
                               "was started with"),
            std::string::npos)
      << error(edited);
  TrainConfig longer = c;
  longer.steps = 12;
  EXPECT_NE(error(longer).find("steps: the recipe file places schedule[0] at a fraction of the run's steps "
                               "(from_fraction); expected the run's 8 steps, found 12"),
            std::string::npos)
      << error(longer);
  TrainConfig none = c;
  none.recipe_file.clear();
  EXPECT_NE(error(none).find("recipes: expected none (this run has no --recipe-file)"), std::string::npos)
      << error(none);
}

}  // namespace
}  // namespace mixprec::train
