// The precision table (nn/precision.hpp): its rows are consistent (names, policies, fp8
// recipes), the memory planner's bytes are what a parameter store of each row's policy
// allocates, and every row trains in the engine, bf16-pure included (weights bf16 with no
// fp32 copy anywhere).
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>

#include "mixprec/nn/precision.hpp"
#include "mixprec/nn/memory.hpp"
#include "mixprec/optim/param_store.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::nn {
namespace {

TEST(PrecisionTable, RowsAreConsistent) {
  ASSERT_EQ(all_precisions().size(), precision_names().size());
  std::set<std::string> names;
  for (std::size_t i = 0; i < all_precisions().size(); ++i) {
    const Precision p = all_precisions()[i];
    const std::string name(precision_name(p));
    SCOPED_TRACE(name);
    EXPECT_EQ(name, precision_names()[i]);
    EXPECT_TRUE(names.insert(name).second) << "listed twice";
    EXPECT_EQ(parse_precision(name), p);
    EXPECT_NE(precision_doc(p), "?");
    const PrecisionPolicy pol = policy_of(p);
    if (pol.master) {
      // mixed: fp32 master and fp32 gradients, a low-precision copy for the forward pass
      EXPECT_EQ(pol.weight_grads, DType::f32);
      EXPECT_NE(pol.weights, DType::f32);
    } else if (pol.weights != DType::f32) {
      // pure: one low format everywhere the model lives
      EXPECT_EQ(pol.weight_grads, pol.weights);
      EXPECT_EQ(pol.activations, pol.weights);
    }
    EXPECT_EQ(is_fp8(p), quantized_gemms_of(p).has_value());
    if (is_fp8(p)) {
      EXPECT_EQ(pol, policy_of(Precision::bf16));  // bf16 mixed with fp8 GEMM operands
    }
  }
  EXPECT_EQ(parse_precision("bf16-pure"), Precision::bf16_pure);
  EXPECT_EQ(parse_precision("fp8"), std::nullopt);
  EXPECT_EQ(precision_name(static_cast<Precision>(200)), "?");
}

TEST(PrecisionTable, MemoryPlanIsWhatAStoreOfTheRowAllocates) {
  // A store padded to 32 elements holds exactly the plan's bytes, for every row.
  const std::size_t n = 4096;
  for (const Precision p : all_precisions()) {
    SCOPED_TRACE(std::string(precision_name(p)));
    const PrecisionPolicy pol = policy_of(p);
    for (const OptimizerKind opt : {OptimizerKind::sgd, OptimizerKind::sgd_momentum, OptimizerKind::adamw}) {
      const ParamStore s({{"w", {n}}}, {.model = pol.weights,
                                        .grads = pol.weight_grads,
                                        .master = pol.master,
                                        .state_slots = optimizer_state_slots(opt)});
      EXPECT_EQ(s.bytes(), memory_plan(n, opt, p).total);
    }
  }
  // The seed's figures: Adam + fp16 is 18 bytes a parameter, Adam + bf16-pure 12.
  EXPECT_EQ(memory_plan(1, OptimizerKind::adam, Precision::fp16).total, 18u);
  EXPECT_EQ(memory_plan(1, OptimizerKind::adam, Precision::bf16_pure).total, 12u);
  EXPECT_EQ(memory_plan(1, OptimizerKind::adam, Precision::fp32).total, 16u);
  EXPECT_EQ(memory_plan(1, OptimizerKind::adam, Precision::mxfp8).total, 18u);
}

TEST(PrecisionTable, Bf16PureTrainsWithNoFp32Copy) {
  train::TrainConfig c;
  c.precision = Precision::bf16_pure;
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.channels = 16;
  c.model.context = 16;
  c.model.batch = 4;
  c.accum = 2;
  c.steps = 12;
  c.warmup = 2;
  c.lr = 1e-2;
  c.corpus_tokens = 20000;
  c.vocab = "word:256";
  c.eval_every = 0;
  c.eval_windows = 8;
  train::validate(c);
  train::Trainer t(c);
  const ParamStore& s = t.model().params();
  EXPECT_FALSE(s.has_master());
  EXPECT_EQ(s.model_dtype(), DType::bf16);
  EXPECT_EQ(s.grad_dtype(), DType::bf16);
  double first = 0, last = 0;
  while (!t.done()) {
    const train::StepRecord r = t.train_step();
    ASSERT_TRUE(std::isfinite(r.loss)) << "step " << r.step;
    if (r.step == 1) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, first);
}

}  // namespace
}  // namespace mixprec::nn
