// Run-log lines and summaries: the exact text of a line, non-finite numbers as null,
// the round trip through parse_step_record, and read_run_log's errors (FILE:LINE).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>

#include "mixprec/run/run_log.hpp"
#include "support.hpp"

namespace mixprec::train {
namespace {

using test::error_of;

namespace fs = std::filesystem;

StepRecord sample() {
  StepRecord r;
  r.step = 7;
  r.lr = 0.003;
  r.loss = 4.25;
  r.scale = 65536;
  r.next_scale = 32768;
  r.found_inf = true;
  r.skipped = true;
  r.injected = true;
  r.grad_norm = std::numeric_limits<double>::quiet_NaN();
  r.clip_coef = 0.1f;
  r.overflow_param = "h0.attn.w";
  r.overflow_activation = "h1.mlp \"gelu\"";
  r.act_grads = {.elements = 100, .nonzero = 90, .nonfinite_input = 1, .underflow = 3, .subnormal = 4, .overflow = 2};
  r.lost_update_fraction = 0.25;
  r.tokens = 2048;
  r.seconds = 0.5;
  r.scaler_seconds = 0.125;
  return r;
}

void expect_same(const StepRecord& a, const StepRecord& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.lr, b.lr);
  if (std::isfinite(a.loss)) {
    EXPECT_EQ(a.loss, b.loss);
  } else {
    EXPECT_TRUE(std::isnan(b.loss));
  }
  EXPECT_EQ(a.loss_finite, b.loss_finite);
  EXPECT_EQ(a.forward_nonfinite, b.forward_nonfinite);
  EXPECT_EQ(a.scale, b.scale);
  EXPECT_EQ(a.next_scale, b.next_scale);
  EXPECT_EQ(a.found_inf, b.found_inf);
  EXPECT_EQ(a.skipped, b.skipped);
  EXPECT_EQ(a.injected, b.injected);
  if (std::isnan(a.grad_norm)) {
    EXPECT_TRUE(std::isnan(b.grad_norm));
  } else {
    EXPECT_EQ(a.grad_norm, b.grad_norm);
  }
  EXPECT_EQ(a.clip_coef, b.clip_coef);
  EXPECT_EQ(a.overflow_param, b.overflow_param);
  EXPECT_EQ(a.overflow_activation, b.overflow_activation);
  EXPECT_EQ(a.act_grads.elements, b.act_grads.elements);
  EXPECT_EQ(a.act_grads.nonzero, b.act_grads.nonzero);
  EXPECT_EQ(a.act_grads.underflow, b.act_grads.underflow);
  EXPECT_EQ(a.act_grads.subnormal, b.act_grads.subnormal);
  EXPECT_EQ(a.act_grads.overflow, b.act_grads.overflow);
  EXPECT_EQ(a.act_grads.nonfinite_input, b.act_grads.nonfinite_input);
  EXPECT_EQ(a.lost_update_fraction, b.lost_update_fraction);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.seconds, b.seconds);
  EXPECT_EQ(a.scaler_seconds, b.scaler_seconds);
  EXPECT_EQ(a.val_loss.has_value(), b.val_loss.has_value());
  if (a.val_loss && b.val_loss) {
    EXPECT_EQ(*a.val_loss, *b.val_loss);
  }
}

TEST(RunLog, LineText) {
  EXPECT_EQ(step_record_json(sample()),
            R"({"step":7,"lr":0.003,"loss":4.25,"loss_finite":true,"forward_nonfinite":"","scale":65536,)"
            R"("next_scale":32768,"found_inf":true,"skipped":true,"skip_reason":"nonfinite_grad","injected":true,"grad_norm":null,"clip_coef":0.1,)"
            R"("overflow_param":"h0.attn.w","overflow_activation":"h1.mlp \"gelu\"","act_grads":{"elements":100,)"
            R"("nonzero":90,"underflow":3,"subnormal":4,"overflow":2,"nonfinite_input":1},"lost_update_fraction":0.25,)"
            R"("tokens":2048,"seconds":0.5,"scaler_seconds":0.125,"act_grad_amax":0,"headroom_log2":0,)"
            R"("act_grad_tensors":[],"params":[]})");
  StepRecord r = sample();
  r.val_loss = 3.5;
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("scaler_seconds":0.125,"val_loss":3.5,)"), std::string::npos) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(RunLog, RoundTrip) {
  StepRecord r = sample();
  expect_same(r, parse_step_record(step_record_json(r)));
  r.val_loss = 1.0 / 3.0;
  r.lr = 1e-300;
  r.scale = 1.17549435e-38f;
  r.clip_coef = 0.333333343f;
  r.grad_norm = 12345.678901234567;
  r.seconds = 2.5e-7;
  expect_same(r, parse_step_record(step_record_json(r)));
  // A forward pass that overflowed: loss inf written as null, read back as NaN.
  r.loss = std::numeric_limits<double>::infinity();
  r.loss_finite = false;
  r.forward_nonfinite = "h0.attn.scores";
  r.val_loss = std::numeric_limits<double>::quiet_NaN();
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("loss":null,"loss_finite":false,"forward_nonfinite":"h0.attn.scores")"), std::string::npos);
  EXPECT_NE(line.find(R"("val_loss":null,)"), std::string::npos);
  const StepRecord back = parse_step_record(line);
  EXPECT_TRUE(std::isnan(back.loss));
  ASSERT_TRUE(back.val_loss.has_value());
  EXPECT_TRUE(std::isnan(*back.val_loss));
}

// A recipe file's switch: the phase labels on the step where they begin, absent on every
// other step; an empty label is no label.
TEST(RunLog, RecipePhaseRoundTrip) {
  StepRecord r = sample();
  EXPECT_EQ(step_record_json(r).find("recipe_phase"), std::string::npos);
  r.val_loss = 3.5;
  r.recipe_phase = "attention to \"fp8-block\", wgrad in bf16";
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("val_loss":3.5,"recipe_phase":"attention to \"fp8-block\", wgrad in bf16",)"),
            std::string::npos)
      << line;
  EXPECT_EQ(parse_step_record(line).recipe_phase, r.recipe_phase);
  std::string empty = line;
  const std::string label = R"("attention to \"fp8-block\", wgrad in bf16")";
  empty.replace(empty.find(label), label.size(), R"("")");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { (void)parse_step_record(empty); }),
            "recipe_phase: expected a phase label (the field is left out on other steps), found string \"\"");
  std::string number = line;
  number.replace(number.find(label), label.size(), "3");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { (void)parse_step_record(number); }),
            "recipe_phase: expected a string, found 3");
}

// Telemetry: per-tensor statistics, per-parameter amax and histograms survive the
// round trip exactly; non-finite amax and infinite headroom are written as null and
// read back as inf.
TEST(RunLog, TelemetryRoundTrip) {
  StepRecord r = sample();
  r.act_grad_amax = std::numeric_limits<float>::infinity();
  r.headroom_log2 = std::numeric_limits<double>::infinity();
  r.act_grad_tensors.push_back({"logits.grad", {100, 90, 1, 3, 4, 5}, 31.5f});
  r.act_grad_tensors.push_back({"h0.ln1.grad", {7, 6, 0, 1, 0, 0}, std::numeric_limits<float>::infinity()});
  r.params.push_back({"wte", 0.125f, 1.5f});
  r.histograms.emplace();
  r.histograms->weights.counts[3] = 17;
  r.histograms->activation_grads.zeros = 4;
  r.histograms->weight_grads.nonfinite = 2;
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("act_grad_amax":null,"headroom_log2":null)"), std::string::npos) << line;
  const StepRecord b = parse_step_record(line);
  EXPECT_EQ(b.act_grad_amax, std::numeric_limits<float>::infinity());
  EXPECT_EQ(b.headroom_log2, std::numeric_limits<double>::infinity());
  ASSERT_EQ(b.act_grad_tensors.size(), 2u);
  EXPECT_EQ(b.act_grad_tensors[0].name, "logits.grad");
  EXPECT_EQ(b.act_grad_tensors[0].stats, r.act_grad_tensors[0].stats);
  EXPECT_EQ(b.act_grad_tensors[0].amax, 31.5f);
  EXPECT_EQ(b.act_grad_tensors[1].amax, std::numeric_limits<float>::infinity());
  ASSERT_EQ(b.params.size(), 1u);
  EXPECT_EQ(b.params[0].name, "wte");
  EXPECT_EQ(b.params[0].grad_amax, 0.125f);
  EXPECT_EQ(b.params[0].weight_amax, 1.5f);
  ASSERT_TRUE(b.histograms.has_value());
  EXPECT_EQ(b.histograms->weights.counts, r.histograms->weights.counts);
  EXPECT_EQ(b.histograms->activation_grads.zeros, 4u);
  EXPECT_EQ(b.histograms->weight_grads.nonfinite, 2u);
  // A histogram with the wrong number of bins is refused.
  std::string bad = line;
  bad.replace(bad.find("\"counts\":[0,"), 11, "\"counts\":[");
  EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument);
}

// The fp8 array of an fp8 preset's step line: written compactly, read back exactly
// (scale and amax as float32's shortest text; a non-finite amax as null, read as inf).
TEST(RunLog, Fp8TensorsRoundTrip) {
  StepRecord r = sample();
  EXPECT_EQ(step_record_json(r).find("\"fp8\""), std::string::npos);  // absent for other presets
  nn::Fp8TensorStats in{"h0.attn.qkv.input", lowp::Role::forward, lowp::Element::e4m3, 106.19259f, 4.21875f,
                        131072, 131000, 3, 111, "", lowp::Element::e4m3, std::nullopt, std::nullopt, std::nullopt,
                        {}};
  nn::Fp8TensorStats dy{"h0.attn.qkv.grad_output", lowp::Role::backward, lowp::Element::e5m2, 3.6442147e8f,
                        std::numeric_limits<float>::infinity(), 393216, 391167, 0, 368644, "", lowp::Element::e5m2,
                        std::nullopt, std::nullopt, std::nullopt, {}};
  r.fp8 = {in, dy};
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("fp8":[{"name":"h0.attn.qkv.input","role":"forward","dtype":"E4M3","scale":106.19259,)"
                      R"("amax":4.21875,"elements":131072,"nonzero":131000,"saturated":3,"flushed":111})"),
            std::string::npos)
      << line;
  const StepRecord b = parse_step_record(line);
  ASSERT_EQ(b.fp8.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(b.fp8[i].name, r.fp8[i].name);
    EXPECT_EQ(b.fp8[i].role, r.fp8[i].role);
    EXPECT_EQ(b.fp8[i].dtype, r.fp8[i].dtype);
    EXPECT_EQ(b.fp8[i].scale, r.fp8[i].scale);
    EXPECT_EQ(b.fp8[i].amax, r.fp8[i].amax);
    EXPECT_EQ(b.fp8[i].elements, r.fp8[i].elements);
    EXPECT_EQ(b.fp8[i].nonzero, r.fp8[i].nonzero);
    EXPECT_EQ(b.fp8[i].saturated, r.fp8[i].saturated);
    EXPECT_EQ(b.fp8[i].flushed, r.fp8[i].flushed);
  }
  EXPECT_EQ(step_record_json(b), line);
  // Bad values are refused, naming the field.
  std::string bad = line;
  bad.replace(bad.find("\"E5M2\""), 6, "\"E3M4\"");
  EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument);
  bad = line;
  bad.replace(bad.find("\"backward\""), 10, "\"sideways\"");
  EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument);
  bad = line;
  bad.replace(bad.find("\"flushed\":111"), 14, "\"flushed\":-1");
  EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument);
}

// A low-precision recipe's tensors (mixprec.torch.Telemetry, the engine's nvfp4): the recipe,
// the element format as dtype (E2M1 too) and the relative RMS error when measured.
TEST(RunLog, LowPrecisionTensorsRoundTrip) {
  StepRecord r = sample();
  nn::Fp8TensorStats x;
  x.name = "blocks.0.mlp.fc.input";
  x.recipe = "nvfp4";
  x.element = lowp::Element::e2m1;
  x.scale = 448.0f * 6.0f / 3.5f;
  x.amax = 3.5f;
  x.elements = 4096;
  x.nonzero = 4000;
  x.saturated = 0;
  x.flushed = 17;
  x.rel_rms_error = 0.0987654321;
  nn::Fp8TensorStats dy = x;
  dy.name = "blocks.0.mlp.fc.grad_output";
  dy.role = lowp::Role::backward;
  dy.recipe = "fp8-delayed";
  dy.element = lowp::Element::e5m2;
  dy.dtype = lowp::Element::e5m2;
  dy.rel_rms_error.reset();  // not measured: no field
  r.fp8 = {x, dy};
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"({"name":"blocks.0.mlp.fc.input","role":"forward","recipe":"nvfp4","dtype":"E2M1",)"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find(R"("flushed":17,"rel_rms_error":0.0987654321})"), std::string::npos) << line;
  EXPECT_NE(line.find(R"("recipe":"fp8-delayed","dtype":"E5M2",)"), std::string::npos) << line;
  const StepRecord b = parse_step_record(line);
  ASSERT_EQ(b.fp8.size(), 2u);
  EXPECT_EQ(b.fp8[0].recipe, "nvfp4");
  EXPECT_EQ(b.fp8[0].element, lowp::Element::e2m1);
  ASSERT_TRUE(b.fp8[0].rel_rms_error.has_value());
  EXPECT_EQ(*b.fp8[0].rel_rms_error, 0.0987654321);
  EXPECT_EQ(b.fp8[1].element, lowp::Element::e5m2);
  EXPECT_EQ(b.fp8[1].dtype, lowp::Element::e5m2);
  EXPECT_FALSE(b.fp8[1].rel_rms_error.has_value());
  EXPECT_EQ(step_record_json(b), line);
  // Refused: E2M1 without a recipe, an unknown recipe, a negative error, counts past elements.
  const std::pair<std::string, std::string> edits[] = {
      {R"("recipe":"nvfp4",)", ""},
      {R"("recipe":"nvfp4")", R"("recipe":"nvfp5")"},
      {R"("rel_rms_error":0.0987654321)", R"("rel_rms_error":-0.5)"},
      {R"("flushed":17,"rel)", R"("flushed":4097,"rel)"},
  };
  for (const auto& [from, to] : edits) {
    std::string bad = line;
    ASSERT_NE(bad.find(from), std::string::npos) << from;
    bad.replace(bad.find(from), from.size(), to);
    EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument) << bad;
  }
}

// A sampled step's statistics of a quantized tensor: the per-block statistics ("blocks", every
// lowp::BlockStats field), the kurtosis and the what-ifs, written only when present and read back
// exactly; a value that breaks a rule is refused with the field's name.
TEST(RunLog, SampledBlockStatsRoundTrip) {
  StepRecord r = sample();
  nn::Fp8TensorStats x;
  x.name = "h0.mlp.fc.input";
  x.recipe = "mxfp8";
  x.scale = 0.25f;
  x.amax = 1000.5f;
  x.elements = 8192;
  x.nonzero = 8100;
  x.saturated = 0;
  x.flushed = 40;
  x.rel_rms_error = 0.0123;
  lowp::BlockStats b;
  b.blocks = 256;
  b.multiplier_blocks = 255;
  b.multiplier_left_out = 1;
  b.log2_multiplier_min = -9.0;
  b.log2_multiplier_max = 3.0;
  b.log2_multiplier_mean = -1.0390625;
  b.log2_multiplier_std = 2.0625;
  b.log2_multiplier_quantiles = {-8.0, -7.0, -2.0, -1.0, 0.0, 2.0, 3.0};
  b.flushed = 40;
  b.saturated = 0;
  b.blocks_with_flush = 7;
  b.blocks_with_saturation = 0;
  b.max_flushed_fraction = 0.40625;
  b.max_saturated_fraction = 0.0;
  b.tensor_amax = 1000.5f;
  b.far_log2 = 8.0;
  b.far_blocks = 12;
  b.zero_blocks = 1;
  b.dynamic_range = 23.25;
  b.max_block_dynamic_range = 11.5;
  x.blocks = b;
  x.kurtosis = 41.75;
  nn::Fp8WhatIf w{"nvfp4", lowp::Element::e2m1, 8192, 3, 610, 0.171875, 512, 40, 2.5, -3.0, 6.0};
  nn::Fp8WhatIf w2{"fp8-current", lowp::Element::e4m3, 8192, 0, 1200, std::nullopt, 1, 0, 0.0, 1.5, 1.5};
  x.what_if = {w, w2};
  nn::Fp8TensorStats plain = x;  // an unsampled step: none of them
  plain.name = "h0.mlp.fc.weight";
  plain.blocks.reset();
  plain.kurtosis.reset();
  plain.what_if.clear();
  r.fp8 = {x, plain};
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("rel_rms_error":0.0123,"kurtosis":41.75,"blocks":{"blocks":256,"multiplier_blocks":255,)"
                      R"("multiplier_left_out":1,"log2_multiplier_min":-9,"log2_multiplier_max":3,)"
                      R"("log2_multiplier_mean":-1.0390625,"log2_multiplier_std":2.0625,)"
                      R"("log2_multiplier_quantiles":{"p01":-8,"p05":-7,"p25":-2,"p50":-1,"p75":0,"p95":2,"p99":3},)"
                      R"("flushed":40,"saturated":0,"blocks_with_flush":7,"blocks_with_saturation":0,)"
                      R"("max_flushed_fraction":0.40625,"max_saturated_fraction":0,"tensor_amax":1000.5,)"
                      R"("far_log2":8,"far_blocks":12,"zero_blocks":1,"dynamic_range":23.25,)"
                      R"("max_block_dynamic_range":11.5},"what_if":[{"recipe":"nvfp4","dtype":"E2M1",)"
                      R"("elements":8192,"saturated":3,"flushed":610,"rel_rms_error":0.171875,"blocks":512,)"
                      R"("far_blocks":40,"log2_multiplier_std":2.5,"log2_multiplier_p01":-3,)"
                      R"("log2_multiplier_p99":6},{"recipe":"fp8-current","dtype":"E4M3","elements":8192,)"
                      R"("saturated":0,"flushed":1200,"blocks":1,"far_blocks":0,"log2_multiplier_std":0,)"
                      R"("log2_multiplier_p01":1.5,"log2_multiplier_p99":1.5}]})"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find(R"({"name":"h0.mlp.fc.weight","role":"forward","recipe":"mxfp8","dtype":"E4M3","scale":0.25,)"
                      R"("amax":1000.5,"elements":8192,"nonzero":8100,"saturated":0,"flushed":40,)"
                      R"("rel_rms_error":0.0123})"),
            std::string::npos)
      << line;
  const StepRecord back = parse_step_record(line);
  ASSERT_EQ(back.fp8.size(), 2u);
  ASSERT_TRUE(back.fp8[0].blocks.has_value());
  EXPECT_EQ(*back.fp8[0].blocks, b);  // every field
  ASSERT_TRUE(back.fp8[0].kurtosis.has_value());
  EXPECT_EQ(*back.fp8[0].kurtosis, 41.75);
  ASSERT_EQ(back.fp8[0].what_if.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    const nn::Fp8WhatIf& want = x.what_if[i];
    const nn::Fp8WhatIf& got = back.fp8[0].what_if[i];
    EXPECT_EQ(got.recipe, want.recipe);
    EXPECT_EQ(got.element, want.element);
    EXPECT_EQ(got.elements, want.elements);
    EXPECT_EQ(got.saturated, want.saturated);
    EXPECT_EQ(got.flushed, want.flushed);
    EXPECT_EQ(got.rel_rms_error, want.rel_rms_error);
    EXPECT_EQ(got.blocks, want.blocks);
    EXPECT_EQ(got.far_blocks, want.far_blocks);
    EXPECT_EQ(got.log2_multiplier_std, want.log2_multiplier_std);
    EXPECT_EQ(got.log2_multiplier_p01, want.log2_multiplier_p01);
    EXPECT_EQ(got.log2_multiplier_p99, want.log2_multiplier_p99);
  }
  EXPECT_FALSE(back.fp8[1].blocks.has_value());
  EXPECT_FALSE(back.fp8[1].kurtosis.has_value());
  EXPECT_TRUE(back.fp8[1].what_if.empty());
  EXPECT_EQ(step_record_json(back), line);
  // An inf value: the tensor's amax is written null and read back as inf.
  r.fp8[0].blocks->tensor_amax = std::numeric_limits<float>::infinity();
  const std::string inf_line = step_record_json(r);
  EXPECT_NE(inf_line.find(R"("tensor_amax":null,)"), std::string::npos) << inf_line;
  EXPECT_EQ(parse_step_record(inf_line).fp8[0].blocks->tensor_amax, std::numeric_limits<float>::infinity());
  // Refused, naming the field: each edit breaks one rule.
  const std::pair<std::string, std::string> edits[] = {
      {R"("kurtosis":41.75)", R"("kurtosis":-1)"},
      {R"("kurtosis":41.75)", R"("kurtosis":null)"},
      {R"("blocks":{"blocks":256)", R"("blocks":{"blocks":-256)"},
      {R"("multiplier_left_out":1)", R"("multiplier_left_out":2)"},
      {R"("log2_multiplier_min":-9)", R"("log2_multiplier_min":-7.5)"},
      {R"("p25":-2,"p50":-1)", R"("p25":-2,"p50":-3)"},
      {R"("p99":3},)", R"("p99":"3"},)"},
      {R"("log2_multiplier_std":2.0625)", R"("log2_multiplier_std":-2)"},
      {R"("blocks_with_flush":7)", R"("blocks_with_flush":41)"},
      {R"("blocks_with_saturation":0)", R"("blocks_with_saturation":1)"},
      {R"("max_flushed_fraction":0.40625)", R"("max_flushed_fraction":1.5)"},
      {R"("far_blocks":12)", R"("far_blocks":256)"},
      {R"("zero_blocks":1)", R"("zero_blocks":300)"},
      {R"("far_log2":8)", R"("far_log2":-1)"},
      {R"("dynamic_range":23.25)", R"("dynamic_range":null)"},
      {R"(,"max_block_dynamic_range":11.5})", R"(})"},
      {R"("what_if":[{"recipe":"nvfp4")", R"("what_if":[{"recipe":"nvfp5")"},
      {R"("recipe":"nvfp4","dtype":"E2M1")", R"("recipe":"nvfp4","dtype":"E3M2")"},
      {R"("saturated":3,"flushed":610)", R"("saturated":3,"flushed":8190)"},
      {R"("rel_rms_error":0.171875)", R"("rel_rms_error":-0.5)"},
      {R"("far_blocks":40)", R"("far_blocks":513)"},
      {R"("log2_multiplier_p99":6})", R"("log2_multiplier_p99":-4})"},
      {R"("what_if":[)", R"("what_if":7,"x":[)"},
  };
  const char* fields[] = {"fp8[].kurtosis",
                          "fp8[].kurtosis",
                          "fp8[].blocks.blocks",
                          "fp8[].blocks.multiplier_left_out",
                          "fp8[].blocks.log2_multiplier_quantiles.p01",
                          "fp8[].blocks.log2_multiplier_quantiles.p50",
                          "fp8[].blocks.log2_multiplier_quantiles.p99",
                          "fp8[].blocks.log2_multiplier_std",
                          "fp8[].blocks.blocks_with_flush",
                          "fp8[].blocks.blocks_with_saturation",
                          "fp8[].blocks.max_flushed_fraction",
                          "fp8[].blocks.far_blocks",
                          "fp8[].blocks.zero_blocks",
                          "fp8[].blocks.far_log2",
                          "fp8[].blocks.dynamic_range",
                          "fp8[].blocks.max_block_dynamic_range",
                          "fp8[].what_if[].recipe",
                          "fp8[].what_if[].dtype",
                          "fp8[].what_if[0].elements",
                          "fp8[].what_if[0].rel_rms_error",
                          "fp8[].what_if[0].far_blocks",
                          "fp8[].what_if[0].log2_multiplier_p99",
                          "fp8[].what_if"};
  static_assert(std::size(edits) == std::size(fields));
  for (std::size_t i = 0; i < std::size(edits); ++i) {
    const auto& [from, to] = edits[i];
    std::string bad = line;
    ASSERT_NE(bad.find(from), std::string::npos) << from;
    bad.replace(bad.find(from), from.size(), to);
    const std::string e = error_of<std::invalid_argument>([&] { (void)parse_step_record(bad); });
    EXPECT_EQ(e.rfind(std::string(fields[i]) + ":", 0), 0u) << fields[i] << " <- " << e;
  }
}

// The layers array of preset layerwise: written only when there are scaled layers, read back exactly.
TEST(RunLog, LayerScalesRoundTrip) {
  StepRecord r = sample();
  EXPECT_EQ(step_record_json(r).find("\"layers\""), std::string::npos);
  r.layers = {{"h0.mlp.fc", 16, 256, 0, "applied"}, {"h1.mlp.fc", 0.5, 0.5, 3, "origin"}};
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("layers":[{"name":"h0.mlp.fc","factor":16,"chain":256,"backoff":0,"outcome":"applied"},)"
                      R"({"name":"h1.mlp.fc","factor":0.5,"chain":0.5,"backoff":3,"outcome":"origin"}])"),
            std::string::npos)
      << line;
  const StepRecord b = parse_step_record(line);
  ASSERT_EQ(b.layers.size(), 2u);
  EXPECT_EQ(b.layers[1].name, "h1.mlp.fc");
  EXPECT_EQ(b.layers[1].factor, 0.5);
  EXPECT_EQ(b.layers[1].backoff, 3);
  EXPECT_EQ(b.layers[1].outcome, "origin");
  EXPECT_EQ(step_record_json(b), line);
  std::string bad = line;
  bad.replace(bad.find("\"origin\""), 8, "\"lost\"");
  EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument);
  bad = line;
  bad.replace(bad.find("\"factor\":16"), 12, "\"factor\":0");
  EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument);
}

// The optimizer state of runs with state formats: written only at the steps that measured it,
// in the Python door's per-parameter schema; read back to the same counts (a non-finite error
// as null, NaN); a lost fraction outside [0, 1] is refused.
TEST(RunLog, OptimizerStateRoundTrip) {
  StepRecord r = sample();
  EXPECT_EQ(step_record_json(r).find("\"optimizer_state\""), std::string::npos);
  r.optimizer_state = {{"wte", 0.0625, 0.5, 4096, 1024},
                       {"wpe", std::numeric_limits<double>::quiet_NaN(), 0, 7, 0}};
  const std::string line = step_record_json(r);
  EXPECT_NE(line.find(R"("optimizer_state":[{"name":"wte","m_error":0.0625,"v_error":0.5,"lost_fraction":0.25,)"
                      R"("meant":4096},{"name":"wpe","m_error":null,"v_error":0,"lost_fraction":0,"meant":7}])"),
            std::string::npos)
      << line;
  const StepRecord b = parse_step_record(line);
  ASSERT_EQ(b.optimizer_state.size(), 2u);
  EXPECT_EQ(b.optimizer_state[0].lost, 1024u);
  EXPECT_EQ(b.optimizer_state[0].meant, 4096u);
  EXPECT_TRUE(std::isnan(b.optimizer_state[1].m_error));
  EXPECT_EQ(step_record_json(b), line);
  std::string bad = line;
  bad.replace(bad.find("\"lost_fraction\":0.25"), 20, "\"lost_fraction\":1.25");
  EXPECT_THROW((void)parse_step_record(bad), std::invalid_argument);
  RunTotals t;
  t.add(r);
  t.add(b);
  ASSERT_EQ(t.optimizer_state.size(), 2u);
  EXPECT_EQ(t.state_steps, 2u);
  EXPECT_EQ(t.optimizer_state[0].lost, 2048u);
  EXPECT_EQ(t.optimizer_state[0].m_error_sum, 0.125);
  EXPECT_EQ(t.optimizer_state[1].m_steps, 0u);  // NaN errors are not averaged
  EXPECT_EQ(t.optimizer_state[1].v_steps, 2u);
}

TEST(RunLog, ParseErrors) {
  const std::string good = step_record_json(sample());
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    s.replace(s.find(from), from.size(), to);
    return error_of<std::invalid_argument>([&] { (void)parse_step_record(s); });
  };
  EXPECT_EQ(with(R"("step":7,)", ""), "step: missing");
  EXPECT_EQ(with(R"("step":7)", R"("step":0)"), "step: expected an integer >= 1, found 0");
  EXPECT_EQ(with(R"("step":7)", R"("step":-7)"), "step: expected a non-negative integer, found -7");
  EXPECT_EQ(with(R"("lr":0.003)", R"("lr":"x")"), "lr: expected a number or null, found string \"x\"");
  EXPECT_EQ(with(R"("skipped":true)", R"("skipped":1)"), "skipped: expected true or false, found 1");
  EXPECT_EQ(with(R"("nonzero":90)", R"("nonzero":9.5)"), "act_grads.nonzero: expected a non-negative integer, found 9.5");
  EXPECT_EQ(with(R"("scale":65536)", R"("scale":1e39)"), "scale: expected a number float32 holds, found 1e+39");
  EXPECT_EQ(with(R"("seconds":0.5)", R"("seconds":null)"), "seconds: expected a number, found null");
  EXPECT_EQ(error_of<std::invalid_argument>([] { (void)parse_step_record("[1]"); }),
            "expected a JSON object, found array");
  EXPECT_EQ(error_of<std::invalid_argument>([] { (void)parse_step_record(R"({"step":)"); })
                .rfind("malformed JSON: parse error at line 1, column 9", 0),
            0u);
  // Unknown fields are ignored.
  expect_same(sample(), parse_step_record(good.substr(0, good.size() - 1) + R"(,"later":{"x":1}})"));
}

class RunLogFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mixprec-run-log-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    path_ = (dir_ / "log.jsonl").string();
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& text) { std::ofstream(path_, std::ios::binary) << text; }
  std::string error() { return error_of<std::runtime_error>([&] { (void)read_run_log(path_); }); }

  fs::path dir_;
  std::string path_;
};

TEST_F(RunLogFile, ReadsEveryLine) {
  std::string text;
  for (std::uint64_t s = 1; s <= 3; ++s) {
    StepRecord r = sample();
    r.step = s;
    if (s == 3) r.val_loss = 2.0;
    text += step_record_json(r) + "\n";
  }
  write(text);
  auto records = read_run_log(path_);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[2].step, 3u);
  EXPECT_EQ(records[2].val_loss, 2.0);
  text.pop_back();  // no final newline
  write(text);
  EXPECT_EQ(read_run_log(path_).size(), 3u);
  write("");
  EXPECT_TRUE(read_run_log(path_).empty());
}

TEST_F(RunLogFile, ErrorsNameFileAndLine) {
  StepRecord a = sample(), b = sample();
  a.step = 1;
  b.step = 2;
  write(step_record_json(a) + "\n" + R"({"step":2,"lr":)" + "\n");
  EXPECT_EQ(error().rfind(path_ + ":2: malformed JSON: parse error at line 1, column 16", 0), 0u) << error();
  write(step_record_json(a) + "\n\n" + step_record_json(b) + "\n");
  EXPECT_EQ(error(), path_ + ":2: empty line; expected one JSON object per step");
  write(step_record_json(b) + "\n" + step_record_json(a) + "\n");
  EXPECT_EQ(error(), path_ + ":2: step 1 follows step 2; expected increasing steps");
  write(step_record_json(a) + "\n" + R"({"step":2})" + "\n");
  EXPECT_EQ(error(), path_ + ":2: lr: missing");
  fs::remove(path_);
  EXPECT_EQ(error().rfind("run log '" + path_ + "': cannot open: ", 0), 0u) << error();
}

// The state a full disk (or a kill) leaves: the last line cut short, without its
// newline. It is dropped, as a resume drops it; a complete malformed line is an error.
TEST_F(RunLogFile, DropsALastLineCutShort) {
  StepRecord a = sample(), b = sample();
  a.step = 1;
  b.step = 2;
  const std::string second = step_record_json(b);
  write(step_record_json(a) + "\n" + second.substr(0, second.size() / 2));
  const auto records = read_run_log(path_);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].step, 1u);
  write(step_record_json(a) + "\n" + second.substr(0, second.size() / 2) + "\n");
  EXPECT_EQ(error().rfind(path_ + ":2: malformed JSON", 0), 0u) << error();
}

// Deep nesting is refused before the JSON library sees it (issue 15: a stack overflow).
TEST_F(RunLogFile, RefusesDeepNesting) {
  write(std::string(100000, '[') + "\n");
  EXPECT_EQ(error(), path_ + ":1: JSON nested deeper than 256 levels (byte 256 opens level 257); the limit is 256");
  const std::string line = R"({"step":1,"note":")" + std::string(1000, '[') + R"("})";  // brackets in a string
  EXPECT_THROW((void)parse_step_record(line), std::invalid_argument);  // an unknown key, not nesting
  EXPECT_EQ(error_of<std::invalid_argument>([&] { (void)parse_step_record(line); }).find("nested"), std::string::npos);
}

TEST(RunSummary, Json) {
  TrainSummary s;
  s.steps = 10;
  s.applied = 9;
  s.skipped = 1;
  s.skipped_by[static_cast<std::size_t>(SkipReason::loss_spike)] = 1;
  s.final_loss = 3.25;
  s.final_scale = 32768;
  s.underflow_fraction = 0.001;
  s.mean_step_ms = 12.5;
  s.tokens = 20480;
  s.memory.parameter_bytes = 1000;
  s.memory.activation_bytes = 2000;
  s.param_count = 62;
  TrainConfig c;
  c.steps = 10;
  std::string j = summary_json(s, c);
  EXPECT_EQ(j.rfind("{\n  \"steps\": 10,\n  \"applied\": 9,\n  \"skipped\": 1,\n  \"skipped_by\": {\n"
                    "    \"nonfinite_grad\": 0,\n    \"nonfinite_loss\": 0,\n    \"loss_spike\": 1,\n"
                    "    \"grad_spike\": 0,\n    \"user\": 0\n  },\n  \"final_loss\": 3.25,\n"
                    "  \"val_loss\": null,\n  \"final_scale\": 32768,\n  \"underflow_fraction\": 0.001,\n",
                    0),
            0u)
      << j;
  EXPECT_NE(j.find("\"memory\": {\n    \"parameter_bytes\": 1000,\n    \"activation_bytes\": 2000,\n"),
            std::string::npos)
      << j;
  EXPECT_NE(j.find("\"param_count\": 62,\n  \"config\": {\n    \"model\": \"gpt\","), std::string::npos) << j;
  EXPECT_NE(j.find("\"steps\": 10,\n    \"accum\": 32,"), std::string::npos) << j;
  EXPECT_EQ(j.back(), '\n');
  s.val_loss = 3.5;
  j = summary_json(s, c);
  EXPECT_NE(j.find("\"val_loss\": 3.5,"), std::string::npos) << j;
  EXPECT_EQ(j.find("\"optimizer_state\""), std::string::npos) << j;
  // State formats: the Python door's "optimizer_state" schema, which the report reads.
  OptimizerStateSummary o;
  o.optimizer = "adamw";
  o.master = "remainder";
  o.m = "fp8";
  o.v = "8bit";
  o.rule = "torch";
  o.elements = 4160;
  o.params_bytes = 2;
  o.master_bytes = 2;
  o.m_bytes = 1.0625;
  o.v_bytes = 1.0625;
  o.sampled_steps = 2;
  o.params.push_back({4096, "remainder", "fp8", "8bit", {"wte", 2, 2, 0.25, 0.125, 0.5, 0.25, 100, 25}});
  o.params.push_back({64, "remainder", "fp32", "fp32", {"wpe", 2, 2, 0, 0, 0, 0, 28, 0}});
  s.optimizer_state = o;
  const auto doc = nlohmann::json::parse(summary_json(s, c));
  const auto& os = doc.at("optimizer_state");
  EXPECT_EQ(os.at("formats").at(0).at("m"), "fp8");
  EXPECT_EQ(os.at("bytes_per_param").at("m"), 1.0625);
  EXPECT_EQ(os.at("lost_update_fraction"), 0.1953125);  // 25 of 128
  EXPECT_EQ(os.at("params").at(0).at("m_error"), 0.125);  // the mean of 2 steps
  EXPECT_EQ(os.at("params").at(0).at("m_error_max"), 0.125);
  EXPECT_EQ(os.at("params").at(0).at("v_error"), 0.25);
  EXPECT_EQ(os.at("params").at(0).at("lost_fraction"), 0.25);
  EXPECT_EQ(os.at("params").at(1).at("m"), "fp32");
}

}  // namespace
}  // namespace mixprec::train
