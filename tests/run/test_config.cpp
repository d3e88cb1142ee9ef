// TrainConfig: every validation rule with a passing and a failing value (message
// checked), JSON config files (types, integers, unknown keys, malformed text, the
// source in messages) and the to_json / apply_json round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/run/config.hpp"

namespace mixprec::train {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

std::string validate_error(const std::function<void(TrainConfig&)>& change) {
  TrainConfig c;
  change(c);
  return error_of([&] { validate(c); });
}

struct Rule {
  std::string name;
  std::function<void(TrainConfig&)> good;
  std::function<void(TrainConfig&)> bad;
  std::string message;  // the whole message of the failing case
};

std::vector<Rule> rules() {
  using C = TrainConfig;
  return {
      {"model", [](C& c) { c.model.kind = nn::ModelKind::mlp; },
       [](C& c) { c.model.kind = static_cast<nn::ModelKind>(7); }, "model: expected gpt or mlp, found enum value 7"},
      {"precision", [](C& c) { c.precision = nn::Precision::fp16_pure; },
       [](C& c) { c.precision = static_cast<nn::Precision>(12); },
       "precision: expected fp32, fp16, bf16, fp16-pure, bf16-pure, fp8-noscale, fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4 or mxfp4, found enum value 12"},
      {"loss_scale_none", [](C& c) { c.loss_scale = "none"; }, [](C& c) { c.loss_scale = "nope"; },
       "loss-scale: expected none, dynamic, static:S (S a finite number > 0) or a preset (mixprec, torch, deepspeed, "
       "megatron, apex, keras, tf-keras, jmp, layerwise), found 'nope'"},
      {"loss_scale_static", [](C& c) { c.loss_scale = "static:1024"; }, [](C& c) { c.loss_scale = "static:0"; },
       "loss-scale: expected static:S with S a number > 0 that float32 holds, as it holds 1/S (the unscale factor): "
       "S in (2.9387359e-39, 3.4028235e+38], found 'static:0'"},
      {"loss_scale_static_exp", [](C& c) { c.loss_scale = "static:1e3"; }, [](C& c) { c.loss_scale = "static:1e3x"; },
       "found 'static:1e3x'"},
      {"loss_scale_static_negative", [](C& c) { c.loss_scale = "static:0.5"; },
       [](C& c) { c.loss_scale = "static:-1"; }, "found 'static:-1'"},
      {"loss_scale_static_inf", [](C& c) { c.loss_scale = "static:3.4e38"; },
       [](C& c) { c.loss_scale = "static:inf"; }, "found 'static:inf'"},
      {"loss_scale_static_too_big", [](C& c) { c.loss_scale = "static:65536"; },
       [](C& c) { c.loss_scale = "static:1e39"; }, "found 'static:1e39'"},
      {"loss_scale_static_rounds_to_zero", [](C& c) { c.loss_scale = "static:3e-39"; },
       [](C& c) { c.loss_scale = "static:1e-50"; }, "found 'static:1e-50'"},
      // float32 holds 1e-40 (a subnormal), but not 1/1e-40: the first step would fail.
      {"loss_scale_static_reciprocal_overflows", [](C& c) { c.loss_scale = "static:2.94e-39"; },
       [](C& c) { c.loss_scale = "static:1e-40"; }, "S in (2.9387359e-39, 3.4028235e+38], found 'static:1e-40'"},
      {"loss_scale_static_nan", [](C& c) { c.loss_scale = "static:2"; }, [](C& c) { c.loss_scale = "static:nan"; },
       "found 'static:nan'"},
      {"loss_scale_static_empty", [](C& c) { c.loss_scale = "static:8"; }, [](C& c) { c.loss_scale = "static:"; },
       "found 'static:'"},
      {"loss_scale_static_alone", [](C& c) { c.loss_scale = "deepspeed"; }, [](C& c) { c.loss_scale = "static"; },
       "(the static preset needs its scale), found 'static'"},
      {"loss_scale_dynamic", [](C& c) { c.loss_scale = "dynamic"; }, [](C& c) { c.loss_scale = "Dynamic"; },
       "found 'Dynamic'"},
      {"loss_scale_preset", [](C& c) { c.loss_scale = "jmp"; }, [](C& c) { c.loss_scale = "pytorch"; },
       "found 'pytorch'"},
      {"layers", [](C& c) { c.model.layers = 64; }, [](C& c) { c.model.layers = 0; },
       "layers: expected an integer in [1, 64], found 0"},
      {"layers_max", [](C& c) { c.model.layers = 1; }, [](C& c) { c.model.layers = 65; },
       "layers: expected an integer in [1, 64], found 65"},
      {"heads", [](C& c) { c.model.heads = 1; }, [](C& c) { c.model.heads = 0; },
       "heads: expected an integer in [1, 4096], found 0"},
      {"heads_divide_channels", [](C& c) { c.model.heads = 8; }, [](C& c) { c.model.heads = 3; },
       "heads: expected a divisor of channels (64), found 3"},
      {"channels", [](C& c) { c.model.channels = 4096; }, [](C& c) { c.model.channels = 4097; },
       "channels: expected an integer in [1, 4096], found 4097"},
      {"context", [](C& c) { c.model.context = 2; }, [](C& c) { c.model.context = 1; },
       "context: expected an integer in [2, 4096], found 1"},
      {"context_max", [](C& c) { c.model.context = 4096; }, [](C& c) { c.model.context = 5000; },
       "context: expected an integer in [2, 4096], found 5000"},
      {"batch", [](C& c) { c.model.batch = 1; }, [](C& c) { c.model.batch = 0; },
       "batch: expected an integer in [1, 4096], found 0"},
      {"batch_max", [](C& c) { c.model.batch = 4096; }, [](C& c) { c.model.batch = 4097; },
       "batch: expected an integer in [1, 4096], found 4097"},
      {"tokens_per_batch",
       [](C& c) {
         c.model.batch = 256;
         c.model.context = 4096;
       },
       [](C& c) {
         c.model.batch = 257;
         c.model.context = 4096;
       },
       "batch: expected batch * context <= 1048576 tokens per micro-batch, found 257 * 4096"},
      {"depth", [](C& c) { c.model.depth = 64; }, [](C& c) { c.model.depth = 0; },
       "depth: expected an integer in [1, 64], found 0"},
      {"hidden", [](C& c) { c.model.hidden = 16384; }, [](C& c) { c.model.hidden = 16385; },
       "hidden: expected an integer in [1, 16384], found 16385"},
      {"vocab_char", [](C& c) { c.vocab = "char"; }, [](C& c) { c.vocab = "word:0"; },
       "vocab: expected char or word:N with N in [16, 65536], found 'word:0'"},
      {"vocab_words", [](C& c) { c.vocab = "word:65536"; }, [](C& c) { c.vocab = "bytes"; },
       "vocab: expected char or word:N with N in [16, 65536], found 'bytes'"},
      {"corpus_tokens", [](C& c) { c.corpus_tokens = 1'000'000'000; },
       [](C& c) { c.corpus_tokens = 1'000'000'001; }, "corpus-tokens: expected an integer in [1, 1000000000], found 1000000001"},
      {"corpus_tokens_enough",
       [](C& c) {
         c.model.context = 16;
         c.corpus_tokens = 170;
       },
       [](C& c) {
         c.model.context = 16;
         c.corpus_tokens = 100;
       },
       "corpus-tokens: expected at least 170 (context 16 and val-fraction 0.1 need context + 1 tokens in each split), "
       "found 100"},
      {"corpus_tokens_unused_with_data",
       [](C& c) {
         c.data = "file.txt";
         c.corpus_tokens = 1;
       },
       [](C& c) { c.corpus_tokens = 0; }, "corpus-tokens: expected an integer in [1, 1000000000], found 0"},
      {"val_fraction", [](C& c) { c.val_fraction = 0.5; }, [](C& c) { c.val_fraction = 0.51; },
       "val-fraction: expected a number in (0, 0.5], found 0.51"},
      {"val_fraction_zero", [](C& c) { c.val_fraction = 1e-3; }, [](C& c) { c.val_fraction = 0; },
       "val-fraction: expected a number in (0, 0.5], found 0"},
      {"val_fraction_nan", [](C& c) { c.val_fraction = 0.2; }, [](C& c) { c.val_fraction = kNaN; },
       "val-fraction: expected a number in (0, 0.5], found nan"},
      {"optimizer", [](C& c) { c.optimizer = "sgd"; }, [](C& c) { c.optimizer = "lamb"; },
       "optimizer: expected adamw, adam or sgd, found 'lamb'"},
      {"lr", [](C& c) { c.lr = 1e-3; }, [](C& c) { c.lr = 0; }, "lr: expected a finite number > 0, found 0"},
      {"lr_negative", [](C& c) { c.lr = 10; }, [](C& c) { c.lr = -1; }, "lr: expected a finite number > 0, found -1"},
      {"lr_nan", [](C& c) { c.lr = 0.1; }, [](C& c) { c.lr = kNaN; }, "lr: expected a finite number > 0, found nan"},
      {"lr_inf", [](C& c) { c.lr = 0.5; }, [](C& c) { c.lr = kInf; }, "lr: expected a finite number > 0, found inf"},
      {"min_lr", [](C& c) { c.min_lr = 0; }, [](C& c) { c.min_lr = -0.01; },
       "min-lr: expected a finite number >= 0, found -0.01"},
      {"min_lr_le_lr", [](C& c) { c.min_lr = c.lr; }, [](C& c) { c.min_lr = 0.01; },
       "min-lr: expected a number <= lr (0.003), found 0.01"},
      {"min_lr_nan", [](C& c) { c.min_lr = 1e-4; }, [](C& c) { c.min_lr = kNaN; },
       "min-lr: expected a finite number >= 0, found nan"},
      {"warmup", [](C& c) { c.warmup = c.steps; }, [](C& c) { c.warmup = 151; },
       "warmup: expected an integer <= steps (150), found 151"},
      {"weight_decay", [](C& c) { c.weight_decay = 0; }, [](C& c) { c.weight_decay = -0.1; },
       "weight-decay: expected a finite number >= 0, found -0.1"},
      {"weight_decay_inf", [](C& c) { c.weight_decay = 2; }, [](C& c) { c.weight_decay = kInf; },
       "weight-decay: expected a finite number >= 0, found inf"},
      {"beta1", [](C& c) { c.beta1 = 0; }, [](C& c) { c.beta1 = 1; }, "beta1: expected a number in [0, 1), found 1"},
      {"beta1_negative", [](C& c) { c.beta1 = 0.999; }, [](C& c) { c.beta1 = -0.1; },
       "beta1: expected a number in [0, 1), found -0.1"},
      {"beta2", [](C& c) { c.beta2 = 0.999; }, [](C& c) { c.beta2 = kNaN; },
       "beta2: expected a number in [0, 1), found nan"},
      {"eps", [](C& c) { c.eps = 1e-12; }, [](C& c) { c.eps = 0; }, "eps: expected a finite number > 0, found 0"},
      {"eps_inf", [](C& c) { c.eps = 1; }, [](C& c) { c.eps = kInf; }, "eps: expected a finite number > 0, found inf"},
      {"clip", [](C& c) { c.clip = 0; }, [](C& c) { c.clip = -1; }, "clip: expected a finite number >= 0, found -1"},
      {"clip_nan", [](C& c) { c.clip = 5; }, [](C& c) { c.clip = kNaN; },
       "clip: expected a finite number >= 0, found nan"},
      {"steps", [](C& c) {
         c.steps = 1;
         c.warmup = 0;
       },
       [](C& c) { c.steps = 0; }, "steps: expected an integer in [1, 1000000000], found 0"},
      {"steps_max", [](C& c) { c.steps = 1'000'000'000; }, [](C& c) { c.steps = 1'000'000'001; },
       "steps: expected an integer in [1, 1000000000], found 1000000001"},
      {"accum", [](C& c) { c.accum = 1'000'000; }, [](C& c) { c.accum = 0; },
       "accum: expected an integer in [1, 1000000], found 0"},
      {"accum_max", [](C& c) { c.accum = 1; }, [](C& c) { c.accum = 1'000'001; },
       "accum: expected an integer in [1, 1000000], found 1000001"},
      {"keep_checkpoints", [](C& c) { c.keep_checkpoints = 1; }, [](C& c) { c.keep_checkpoints = 0; },
       "keep-checkpoints: expected an integer >= 1, found 0"},
      {"inject_overflow_at", [](C& c) { c.inject_overflow_at = {1, 5, 150}; },
       [](C& c) { c.inject_overflow_at = {5, 0}; }, "inject-overflow-at: expected an integer >= 1, found 0"},
      {"inject_overflow_at_steps", [](C& c) { c.inject_overflow_at = {150}; },
       [](C& c) { c.inject_overflow_at = {151}; }, "inject-overflow-at: expected an integer in [1, 150], found 151"},
      {"threads", [](C& c) { c.threads = 1024; }, [](C& c) { c.threads = 1025; },
       "threads: expected an integer in [0, 1024], found 1025"},
      // fp8 options: their values, and only with a precision that uses them.
      {"fp8_format", [](C& c) { c.precision = nn::Precision::fp8_current, c.fp8_format = "e4m3"; },
       [](C& c) { c.precision = nn::Precision::fp8_current, c.fp8_format = "e5m2"; },
       "fp8-format: expected hybrid or e4m3, found 'e5m2'"},
      {"fp8_amax_history", [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_amax_history = 1; },
       [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_amax_history = 0; },
       "fp8-amax-history: expected an integer in [1, 1048576], found 0"},
      {"fp8_amax_algo", [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_amax_algo = "most_recent"; },
       [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_amax_algo = "mean"; },
       "fp8-amax-algo: expected max or most_recent, found 'mean'"},
      {"fp8_margin", [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_margin = -64; },
       [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_margin = 65; },
       "fp8-margin: expected an integer in [-64, 64], found 65"},
      {"fp8_amax_epsilon", [](C& c) { c.precision = nn::Precision::fp8_current, c.fp8_amax_epsilon = 1e-12; },
       [](C& c) { c.precision = nn::Precision::fp8_current, c.fp8_amax_epsilon = -1; },
       "fp8-amax-epsilon: expected a finite number >= 0, found -1"},
      {"fp8_amax_epsilon_below_float", [](C& c) { c.precision = nn::Precision::fp8_current, c.fp8_amax_epsilon = 1e-45; },
       [](C& c) { c.precision = nn::Precision::fp8_current, c.fp8_amax_epsilon = 1e-50; },
       "fp8-amax-epsilon: expected 0, or a finite number float32 holds (1.4e-45 to 3.4e38), found 1e-50"},
      {"mx_rounding", [](C& c) { c.precision = nn::Precision::mxfp8, c.mx_rounding = "ocp"; },
       [](C& c) { c.precision = nn::Precision::mxfp8, c.mx_rounding = "floor"; },
       "mx-rounding: expected te or ocp, found 'floor'"},
      {"fp8_option_with_another_precision", [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_margin = 2; },
       [](C& c) { c.precision = nn::Precision::bf16, c.fp8_margin = 2; },
       "fp8-margin: expected the default (0) with --precision bf16; it applies to --precision fp8-delayed, found 2"},
      {"fp8_option_with_another_fp8_recipe", [](C& c) { c.precision = nn::Precision::fp8_current, c.fp8_power2_scales = true; },
       [](C& c) { c.precision = nn::Precision::fp8_delayed, c.fp8_power2_scales = true; },
       "fp8-power2-scales: expected the default (false) with --precision fp8-delayed; it applies to --precision "
       "fp8-current, found true"},
  };
}

TEST(TrainConfig, DefaultIsValid) { EXPECT_EQ(validate_error([](TrainConfig&) {}), ""); }

TEST(TrainConfig, EveryRulePassesAndFails) {
  for (const Rule& r : rules()) {
    SCOPED_TRACE(r.name);
    EXPECT_EQ(validate_error(r.good), "");
    const std::string e = validate_error(r.bad);
    EXPECT_NE(e.find(r.message), std::string::npos) << "message: " << e << "\nexpected: " << r.message;
  }
}

TEST(TrainConfig, AnythingGoesWhereAnythingIsAllowed) {
  // seed, eval-every, eval-windows, checkpoint-every, out, resume, data: no constraint.
  EXPECT_EQ(validate_error([](TrainConfig& c) {
              c.seed = std::numeric_limits<std::uint64_t>::max();
              c.eval_every = 0;
              c.eval_windows = 0;
              c.checkpoint_every = 1'000'000;
              c.out = "runs/x";
              c.resume = "runs/y";
              c.data = "some file.txt";
            }),
            "");
  // Loss scaling with fp32 or bf16 just works.
  for (const nn::Precision p : {nn::Precision::fp32, nn::Precision::bf16})
    for (const char* ls : {"dynamic", "static:128", "deepspeed"})
      EXPECT_EQ(validate_error([&](TrainConfig& c) {
                  c.precision = p;
                  c.loss_scale = ls;
                }),
                "");
  // Every preset except the bare static one.
  for (const char* ls : {"mixprec", "torch", "deepspeed", "megatron", "apex", "keras", "tf-keras", "jmp"})
    EXPECT_EQ(validate_error([&](TrainConfig& c) { c.loss_scale = ls; }), "") << ls;
}

// ---- JSON --------------------------------------------------------------------------

std::string json_error(std::string_view text) {
  return error_of([&] { (void)apply_json(TrainConfig{}, text, "config 'x.json'"); });
}

TEST(TrainConfigJson, AppliesKeysOnTopOfTheBase) {
  TrainConfig base;
  base.steps = 40;
  const TrainConfig c = apply_json(base, R"({"lr": 0.01, "model": "mlp", "precision": "bf16", "loss-scale":
      "static:512", "inject-overflow-at": [3, 7], "vocab": "char", "seed": 18446744073709551615, "threads": 2,
      "corpus-tokens": 2e5})",
                                   "x");
  EXPECT_EQ(c.lr, 0.01);
  EXPECT_EQ(c.model.kind, nn::ModelKind::mlp);
  EXPECT_EQ(c.precision, nn::Precision::bf16);
  EXPECT_EQ(c.loss_scale, "static:512");
  EXPECT_EQ(c.inject_overflow_at, (std::vector<std::size_t>{3, 7}));
  EXPECT_EQ(c.vocab, "char");
  EXPECT_EQ(c.seed, std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(c.threads, 2u);
  EXPECT_EQ(c.corpus_tokens, 200'000u);  // a whole number written with an exponent
  EXPECT_EQ(c.steps, 40u);               // from the base
  EXPECT_EQ(apply_json(base, "{}", "x"), base);
  EXPECT_EQ(apply_json(base, " {\n}\n", "x"), base);
}

TEST(TrainConfigJson, MustBeAnObject) {
  EXPECT_EQ(json_error("[1, 2]"),
            "config 'x.json': expected a JSON object of settings (flag names without the dashes), found array");
  EXPECT_EQ(json_error("3"),
            "config 'x.json': expected a JSON object of settings (flag names without the dashes), found number");
}

TEST(TrainConfigJson, UnknownKeysListTheKnownOnes) {
  const std::string e = json_error(R"({"lr": 0.1, "learning_rate": 0.1})");
  EXPECT_EQ(e.rfind("config 'x.json': unknown key 'learning_rate'; known keys: model, precision, loss-scale, fp8-format, "
                    "fp8-amax-history, fp8-amax-algo, fp8-margin, fp8-power2-scales, fp8-amax-epsilon, mx-rounding, "
                    "recipe-file, layers, "
                    "heads, channels, context, batch, depth, hidden, data, vocab, corpus-tokens, val-fraction, "
                    "optimizer, lr, min-lr, warmup, weight-decay, beta1, beta2, eps, clip, master, moments, moment-block, "
                    "skip-loss-z, skip-grad-z, "
                    "skip-window, ema, steps, accum, seed, "
                    "eval-every, eval-windows, histogram-every, out, checkpoint-every, keep-checkpoints, resume, distributed, "
                    "zero, grad-reduce, dist-timeout, inject-overflow-rank, inject-overflow-at, inject-overflow-tensor, "
                    "inject-bad-batch-at, inject-bad-batch, inject-fault-at, inject-fault, threads",
                    0),
            0u)
      << e;
}

TEST(TrainConfigJson, DuplicateKeys) {
  EXPECT_EQ(json_error(R"({"lr": 0.1, "lr": 0.2})"), "config 'x.json': key 'lr' is given twice");
}

TEST(TrainConfigJson, WrongTypes) {
  // The key's whole range is what it expects, whatever was wrong with the value.
  EXPECT_EQ(json_error(R"({"lr": "abc"})"), "config 'x.json': lr: expected a finite number > 0, found string \"abc\"");
  EXPECT_EQ(json_error(R"({"lr": null})"), "config 'x.json': lr: expected a finite number > 0, found null");
  EXPECT_EQ(json_error(R"({"steps": "10"})"),
            "config 'x.json': steps: expected an integer in [1, 1000000000], found string \"10\"");
  EXPECT_EQ(json_error(R"({"precision": 16})"),
            "config 'x.json': precision: expected fp32, fp16, bf16, fp16-pure, bf16-pure, fp8-noscale, fp8-delayed, fp8-current, "
            "mxfp8, fp8-block, nvfp4 or mxfp4, found 16");
  EXPECT_EQ(json_error(R"({"data": ["a"]})"), "config 'x.json': data: expected a string, found array [\"a\"]");
  EXPECT_EQ(json_error(R"({"inject-overflow-at": 5})"),
            "config 'x.json': inject-overflow-at: expected an array of integers >= 1, found 5");
  EXPECT_EQ(json_error(R"({"inject-overflow-at": [5, "6"]})"),
            "config 'x.json': inject-overflow-at: expected an integer >= 1, found string \"6\"");
  EXPECT_EQ(json_error(R"({"out": true})"), "config 'x.json': out: expected a string, found boolean true");
}

TEST(TrainConfigJson, IntegersAreWholeNumbersInTheKeysRange) {
  EXPECT_EQ(json_error(R"({"steps": 1.5})"), "config 'x.json': steps: expected an integer in [1, 1000000000], found 1.5");
  EXPECT_EQ(json_error(R"({"batch": -3})"), "config 'x.json': batch: expected an integer in [1, 4096], found -3");
  EXPECT_EQ(json_error(R"({"seed": -1})"), "config 'x.json': seed: expected a non-negative integer, found -1");
  EXPECT_EQ(json_error(R"({"accum": 1e300})"),
            "config 'x.json': accum: expected an integer in [1, 1000000], found 1e+300");
  EXPECT_EQ(json_error(R"({"threads": 4294967296})"),
            "config 'x.json': threads: expected an integer in [0, 1024], found 4294967296");
  EXPECT_EQ(json_error(R"({"seed": 18446744073709551616})"),
            "config 'x.json': seed: expected a non-negative integer, found 1.8446744073709552e+19");
  EXPECT_EQ(apply_json(TrainConfig{}, R"({"steps": 12.0})", "x").steps, 12u);
  EXPECT_EQ(apply_json(TrainConfig{}, R"({"fp8-margin": -2.0})", "x").fp8_margin, -2);
  EXPECT_EQ(apply_json(TrainConfig{}, R"({"inject-overflow-rank": -1})", "x").inject_overflow_rank, -1);
  EXPECT_EQ(apply_json(TrainConfig{}, R"({"weight-decay": -0.0})", "x").weight_decay, 0.0);
  EXPECT_FALSE(std::signbit(apply_json(TrainConfig{}, R"({"weight-decay": -0.0})", "x").weight_decay));
}

TEST(TrainConfigJson, ValuesAreCheckedPerKey) {
  EXPECT_EQ(json_error(R"({"model": "cnn"})"), "config 'x.json': model: expected gpt or mlp, found 'cnn'");
  EXPECT_EQ(json_error(R"({"precision": "fp12"})"),
            "config 'x.json': precision: expected fp32, fp16, bf16, fp16-pure, bf16-pure, fp8-noscale, fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4 or mxfp4, found 'fp12'");
  EXPECT_EQ(json_error(R"({"steps": 0})"), "config 'x.json': steps: expected an integer in [1, 1000000000], found 0");
  EXPECT_EQ(json_error(R"({"lr": -1})"), "config 'x.json': lr: expected a finite number > 0, found -1");
  EXPECT_NE(json_error(R"({"loss-scale": "static:abc"})").find("config 'x.json': loss-scale: expected static:S"),
            std::string::npos);
  EXPECT_EQ(json_error(R"({"inject-overflow-at": [0]})"),
            "config 'x.json': inject-overflow-at: expected an integer >= 1, found 0");
  // Across keys is validate()'s job: heads 3 with channels 64 passes apply_json.
  const TrainConfig c = apply_json(TrainConfig{}, R"({"heads": 3})", "x");
  EXPECT_EQ(error_of([&] { validate(c); }), "heads: expected a divisor of channels (64), found 3");
}

TEST(TrainConfigJson, MalformedTextGivesThePosition) {
  const std::string e = json_error("{\n  \"lr\": 0.1,\n  \"steps\": }\n");
  EXPECT_EQ(e.rfind("config 'x.json': malformed JSON: parse error at line 3, column 12", 0), 0u) << e;
  const std::string t = json_error("{\"lr\": 0.1");
  EXPECT_EQ(t.rfind("config 'x.json': malformed JSON: parse error at line 1, column 11", 0), 0u) << t;
  const std::string empty = json_error("");
  EXPECT_EQ(empty.rfind("config 'x.json': malformed JSON: parse error at line 1, column 1", 0), 0u) << empty;
  // No comments and no trailing commas: JSON is JSON.
  EXPECT_NE(json_error("{\"lr\": 0.1,}").find("malformed JSON"), std::string::npos);
}

TEST(TrainConfigJson, RoundTripsExactly) {
  const TrainConfig d;
  EXPECT_EQ(apply_json(TrainConfig{}, to_json(d), "x"), d);
  EXPECT_EQ(apply_json(TrainConfig{}, to_json(d, 2), "x"), d);

  TrainConfig c;
  c.model.kind = nn::ModelKind::mlp;
  c.model.context = 17;
  c.model.batch = 3;
  c.model.layers = 5;
  c.model.heads = 2;
  c.model.channels = 34;
  c.model.depth = 7;
  c.model.hidden = 99;
  c.precision = nn::Precision::fp16_pure;
  c.loss_scale = "static:0.1";
  c.data = "data/ünïcode \"quoted\" \\ path.txt";
  c.vocab = "char";
  c.corpus_tokens = 123'457;
  c.val_fraction = 0.1 + 0.2;  // 0.30000000000000004
  c.optimizer = "sgd";
  c.lr = 1.0 / 3.0;
  c.min_lr = 1e-300;
  c.warmup = 3;
  c.weight_decay = 0;
  c.beta1 = 0.123456789012345678;
  c.beta2 = 0.999999999999;
  c.eps = 4.9e-324;
  c.clip = 0;
  c.steps = 1234;
  c.accum = 9;
  c.seed = std::numeric_limits<std::uint64_t>::max();
  c.eval_every = 0;
  c.eval_windows = 7;
  c.out = "runs/a";
  c.checkpoint_every = 11;
  c.keep_checkpoints = 2;
  c.resume = "runs/b";
  c.inject_overflow_at = {1, 2, 1234};
  c.threads = 3;
  ASSERT_EQ(error_of([&] { validate(c); }), "");
  ASSERT_FALSE(c == d);
  EXPECT_EQ(apply_json(TrainConfig{}, to_json(c), "x"), c);
  EXPECT_EQ(apply_json(TrainConfig{}, to_json(c, 4), "x"), c);
  EXPECT_EQ(to_json(apply_json(TrainConfig{}, to_json(c), "x")), to_json(c));
}

TEST(TrainConfigJson, KeysInFlagOrder) {
  const std::string j = to_json(TrainConfig{});
  EXPECT_EQ(j.rfind(R"({"model":"gpt","precision":"fp16","loss-scale":"dynamic","fp8-format":"hybrid",)"
                    R"("fp8-amax-history":1024,"fp8-amax-algo":"max","fp8-margin":0,"fp8-power2-scales":false,)"
                    R"("fp8-amax-epsilon":0.0,"mx-rounding":"te","recipe-file":"","layers":2,)",
                    0),
            0u)
      << j;
  EXPECT_NE(j.find(R"("lr":0.003,"min-lr":0.0003,)"), std::string::npos) << j;
  EXPECT_NE(j.find(R"("inject-overflow-at":[],"inject-overflow-tensor":"","inject-bad-batch-at":[],)"
                   R"("inject-bad-batch":"labels","inject-fault-at":[],"inject-fault":"","threads":0})"),
            std::string::npos)
      << j;
  EXPECT_NE(j.find(R"("clip":1.0,"master":"fp32","moments":"fp32","moment-block":0,"skip-loss-z":0.0,)"
                   R"("skip-grad-z":0.0,"skip-window":128,"ema":0.0,"steps":150,)"),
            std::string::npos)
      << j;
  EXPECT_NE(to_json(TrainConfig{}, 2).find("{\n  \"model\": \"gpt\",\n"), std::string::npos);
}

// ---- every key: a valid value, one out of range, one of the wrong kind ------------------

struct KeyCase {
  std::string key;
  std::string good;       // command-line text of a valid value
  std::string canonical;  // how config_key_text writes it back ("" = as given)
  std::string bad;        // text of a value out of range or not allowed ("" = the key has none)
  std::string bad_message;
  std::string wrong;        // command-line text that is no value of the key's kind ("" = any text is)
  std::string wrong_json;   // a JSON value of the wrong type
  std::string json_message;
};

const std::string kPrecisions =
    "fp32, fp16, bf16, fp16-pure, bf16-pure, fp8-noscale, fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4 or mxfp4";

std::vector<KeyCase> key_cases() {
  const std::string ls_static =
      "loss-scale: expected static:S with S a number > 0 that float32 holds, as it holds 1/S (the unscale factor): "
      "S in (2.9387359e-39, 3.4028235e+38], found 'static:0'";
  const std::string ls_any =
      "loss-scale: expected none, dynamic, static:S (S a finite number > 0) or a preset (mixprec, torch, deepspeed, "
      "megatron, apex, keras, tf-keras, jmp, layerwise), found 5";
  return {
      {"model", "mlp", "", "cnn", "model: expected gpt or mlp, found 'cnn'", "", "5", "model: expected gpt or mlp, found 5"},
      {"precision", "bf16", "", "fp12", "precision: expected " + kPrecisions + ", found 'fp12'", "", "true",
       "precision: expected " + kPrecisions + ", found boolean true"},
      {"loss-scale", "static:0x1p10", "", "static:0", ls_static, "", "5", ls_any},
      {"fp8-format", "e4m3", "", "e5m2", "fp8-format: expected hybrid or e4m3, found 'e5m2'", "", "1",
       "fp8-format: expected hybrid or e4m3, found 1"},
      {"fp8-amax-history", "16.0", "16", "0", "fp8-amax-history: expected an integer in [1, 1048576], found 0", "2.9",
       R"("16")", "fp8-amax-history: expected an integer in [1, 1048576], found string \"16\""},
      {"fp8-amax-algo", "most_recent", "", "mean", "fp8-amax-algo: expected max or most_recent, found 'mean'", "", "null",
       "fp8-amax-algo: expected max or most_recent, found null"},
      {"fp8-margin", "-3", "", "65", "fp8-margin: expected an integer in [-64, 64], found 65", "1.5", "1.5",
       "fp8-margin: expected an integer in [-64, 64], found 1.5"},
      {"fp8-power2-scales", "1", "true", "", "", "yes", "1", "fp8-power2-scales: expected true or false, found 1"},
      {"fp8-amax-epsilon", "1e-12", "", "1e-50",
       "fp8-amax-epsilon: expected 0, or a finite number float32 holds (1.4e-45 to 3.4e38), found 1e-50", "1e-12x",
       R"("x")", "fp8-amax-epsilon: expected a finite number >= 0, found string \"x\""},
      {"mx-rounding", "ocp", "", "floor", "mx-rounding: expected te or ocp, found 'floor'", "", "false",
       "mx-rounding: expected te or ocp, found boolean false"},
      {"recipe-file", "recipes/a b.json", "", "", "", "", "5", "recipe-file: expected a string, found 5"},
      {"layers", "64", "", "65", "layers: expected an integer in [1, 64], found 65", "x", R"("2")",
       "layers: expected an integer in [1, 64], found string \"2\""},
      {"heads", "8", "", "0", "heads: expected an integer in [1, 4096], found 0", "8.5", "8.5",
       "heads: expected an integer in [1, 4096], found 8.5"},
      {"channels", "4096", "", "4097", "channels: expected an integer in [1, 4096], found 4097", "0x10", "[64]",
       "channels: expected an integer in [1, 4096], found array [64]"},
      {"context", "2", "", "1", "context: expected an integer in [2, 4096], found 1", "", "true",
       "context: expected an integer in [2, 4096], found boolean true"},
      {"batch", "4096", "", "4097", "batch: expected an integer in [1, 4096], found 4097", "", "-1",
       "batch: expected an integer in [1, 4096], found -1"},
      {"depth", "1", "", "65", "depth: expected an integer in [1, 64], found 65", "", "{}",
       "depth: expected an integer in [1, 64], found object {}"},
      {"hidden", "16384", "", "16385", "hidden: expected an integer in [1, 16384], found 16385", "", R"("16")",
       "hidden: expected an integer in [1, 16384], found string \"16\""},
      {"data", "a b.txt", "", "", "", "", "5", "data: expected a string, found 5"},
      {"vocab", "char", "", "word:0", "vocab: expected char or word:N with N in [16, 65536], found 'word:0'", "", "1024",
       "vocab: expected char or word:N with N in [16, 65536], found 1024"},
      {"corpus-tokens", "2e5", "200000", "0", "corpus-tokens: expected an integer in [1, 1000000000], found 0", "2e5.5",
       "[1]", "corpus-tokens: expected an integer in [1, 1000000000], found array [1]"},
      {"val-fraction", "0.5", "", "0.51", "val-fraction: expected a number in (0, 0.5], found 0.51", "half", R"("0.1")",
       "val-fraction: expected a number in (0, 0.5], found string \"0.1\""},
      {"optimizer", "sgd", "", "lamb", "optimizer: expected adamw, adam or sgd, found 'lamb'", "", "0",
       "optimizer: expected adamw, adam or sgd, found 0"},
      {"lr", "0x1p-10", "0.0009765625", "0", "lr: expected a finite number > 0, found 0", "3e-3x", R"("abc")",
       "lr: expected a finite number > 0, found string \"abc\""},
      {"min-lr", "0", "", "-0.01", "min-lr: expected a finite number >= 0, found -0.01", "", "null",
       "min-lr: expected a finite number >= 0, found null"},
      {"warmup", "10", "", "-1", "warmup: expected a non-negative integer, found -1", "1e", "false",
       "warmup: expected a non-negative integer, found boolean false"},
      {"weight-decay", "-0", "0", "inf", "weight-decay: expected a finite number >= 0, found inf", "", "[]",
       "weight-decay: expected a finite number >= 0, found array []"},
      {"beta1", "0", "", "1", "beta1: expected a number in [0, 1), found 1", "", "true",
       "beta1: expected a number in [0, 1), found boolean true"},
      {"beta2", "0.999", "", "nan", "beta2: expected a number in [0, 1), found nan", "", "null",
       "beta2: expected a number in [0, 1), found null"},
      {"eps", "1e-12", "", "0", "eps: expected a finite number > 0, found 0", "", R"("1e-8")",
       "eps: expected a finite number > 0, found string \"1e-8\""},
      {"clip", "0", "", "-1", "clip: expected a finite number >= 0, found -1", "", "false",
       "clip: expected a finite number >= 0, found boolean false"},
      {"master", "remainder", "", "fp16", "master: expected fp32 or remainder, found 'fp16'", "", "2",
       "master: expected fp32 or remainder, found 2"},
      {"moments", "fp8,8bit", "", "int8", "moments: expected fp32, bf16, fp16, fp8, 8bit, 4bit (or M,V), found 'int8'", "",
       "[]", "moments: expected fp32, bf16, fp16, fp8, 8bit, 4bit (or M,V), found array []"},
      {"moment-block", "128", "", "2000", "moment-block: expected an integer in [0, 1024], found 2000", "x", "1.5",
       "moment-block: expected an integer in [0, 1024], found 1.5"},
      {"skip-loss-z", "3.5", "", "-1", "skip-loss-z: expected a finite number >= 0, found -1", "z", R"("3")",
       "skip-loss-z: expected a finite number >= 0, found string \"3\""},
      {"skip-grad-z", "0", "", "inf", "skip-grad-z: expected a finite number >= 0, found inf", "", "null",
       "skip-grad-z: expected a finite number >= 0, found null"},
      {"skip-window", "1000000", "", "1", "skip-window: expected an integer in [2, 1000000], found 1", "", "64.5",
       "skip-window: expected an integer in [2, 1000000], found 64.5"},
      {"ema", "0.999", "", "1", "ema: expected a number in [0, 1), found 1", "", "true",
       "ema: expected a number in [0, 1), found boolean true"},
      {"steps", "20.0", "20", "0", "steps: expected an integer in [1, 1000000000], found 0", "2.9", R"("10")",
       "steps: expected an integer in [1, 1000000000], found string \"10\""},
      {"accum", "1e6", "1000000", "1000001", "accum: expected an integer in [1, 1000000], found 1000001", "", "1e300",
       "accum: expected an integer in [1, 1000000], found 1e+300"},
      {"seed", "18446744073709551615", "", "-1", "seed: expected a non-negative integer, found -1", "18446744073709551616",
       "-1", "seed: expected a non-negative integer, found -1"},
      {"eval-every", "0", "", "-1", "eval-every: expected a non-negative integer, found -1", "", "0.5",
       "eval-every: expected a non-negative integer, found 0.5"},
      {"eval-windows", "7", "", "-2", "eval-windows: expected a non-negative integer, found -2", "", "null",
       "eval-windows: expected a non-negative integer, found null"},
      {"histogram-every", "0", "", "-1", "histogram-every: expected a non-negative integer, found -1", "", "true",
       "histogram-every: expected a non-negative integer, found boolean true"},
      {"out", "runs/a", "", "", "", "", "true", "out: expected a string, found boolean true"},
      {"checkpoint-every", "5", "", "-1", "checkpoint-every: expected a non-negative integer, found -1", "", R"("5")",
       "checkpoint-every: expected a non-negative integer, found string \"5\""},
      {"keep-checkpoints", "1", "", "0", "keep-checkpoints: expected an integer >= 1, found 0", "", "2.5",
       "keep-checkpoints: expected an integer >= 1, found 2.5"},
      {"resume", "runs/b", "", "", "", "", "[]", "resume: expected a string, found array []"},
      {"distributed", "true", "", "", "", "maybe", R"("true")", "distributed: expected true or false, found string \"true\""},
      {"zero", "1", "", "2", "zero: expected an integer in [0, 1], found 2", "", "true",
       "zero: expected an integer in [0, 1], found boolean true"},
      {"grad-reduce", "low", "", "fp8", "grad-reduce: expected fp32 or low, found 'fp8'", "", "32",
       "grad-reduce: expected fp32 or low, found 32"},
      {"dist-timeout", "86400", "", "0", "dist-timeout: expected a number of seconds in (0, 86400], found 0", "", R"("60")",
       "dist-timeout: expected a number of seconds in (0, 86400], found string \"60\""},
      {"inject-overflow-rank", "-1", "", "-2",
       "inject-overflow-rank: expected -1 (every rank) or a rank in [0, 1048576), found -2", "x", "0.5",
       "inject-overflow-rank: expected -1 (every rank) or a rank in [0, 1048576), found 0.5"},
      {"inject-overflow-at", "5,17", "", "5,0", "inject-overflow-at: expected an integer >= 1, found 0", "5,x", "5",
       "inject-overflow-at: expected an array of integers >= 1, found 5"},
      {"inject-overflow-tensor", "h0.mlp.fc.weight", "", "", "", "", "7",
       "inject-overflow-tensor: expected a string, found 7"},
      {"inject-bad-batch-at", "3,9", "", "0", "inject-bad-batch-at: expected an integer >= 1, found 0", "3;9", "3",
       "inject-bad-batch-at: expected an array of integers >= 1, found 3"},
      {"inject-bad-batch", "labels,scaled", "", "labels,gradients",
       "inject-bad-batch: expected labels or scaled, one or one per --inject-bad-batch-at step, comma-separated, found "
       "'labels,gradients'",
       "", "[]",
       "inject-bad-batch: expected labels or scaled, one or one per --inject-bad-batch-at step, comma-separated, found "
       "array []"},
      {"inject-fault-at", "4", "", "-4", "inject-fault-at: expected an integer >= 1, found -4", "", "{}",
       "inject-fault-at: expected an array of integers >= 1, found object {}"},
      {"inject-fault", "backward:h0.attn.grad", "", "sideways:h0", "inject-fault: expected forward:NAME or backward:NAME, "
       "found 'sideways:h0'", "", "1", "inject-fault: expected forward:NAME or backward:NAME, found 1"},
      {"threads", "1024", "", "1025", "threads: expected an integer in [0, 1024], found 1025", "", "-1",
       "threads: expected an integer in [0, 1024], found -1"},
  };
}

std::string set_error(std::string_view key, std::string_view text) {
  TrainConfig c;
  const std::string e = error_of([&] { set_config_key(c, key, text); });
  EXPECT_TRUE(e.empty() || c == TrainConfig{}) << key << ": a refused value changed the config";
  return e;
}

TEST(TrainConfigKeys, EveryKeyHasACase) {
  const auto cases = key_cases();
  ASSERT_EQ(cases.size(), config_keys().size());
  for (std::size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(cases[i].key, config_keys()[i].name) << "case " << i;
}

TEST(TrainConfigKeys, ValidOutOfRangeAndWrongKindWithTheirMessages) {
  for (const KeyCase& k : key_cases()) {
    SCOPED_TRACE(k.key);
    // A valid value is taken and written back.
    TrainConfig c;
    EXPECT_EQ(error_of([&] { set_config_key(c, k.key, k.good); }), "");
    EXPECT_EQ(config_key_text(c, k.key), k.canonical.empty() ? k.good : k.canonical);
    // The same value through a config file and the echo.
    const std::vector<std::string_view> one{k.key};
    EXPECT_EQ(apply_json(TrainConfig{}, to_json(c, one), "x"), c) << to_json(c, one);
    // Out of range (or not allowed): the value named as a config file's would be.
    if (!k.bad.empty()) {
      EXPECT_EQ(set_error(k.key, k.bad), k.bad_message);
    }
    // Text that is no value of the key's kind: the text quoted.
    if (!k.wrong.empty()) {
      const std::string e = set_error(k.key, k.wrong);
      EXPECT_EQ(e.rfind(k.key + ": expected ", 0), 0u) << e;
      EXPECT_NE(e.find(", found '" + k.wrong + "'"), std::string::npos) << e;
    }
    // A JSON value of the wrong type.
    EXPECT_EQ(json_error("{\"" + k.key + "\": " + k.wrong_json + "}"), "config 'x.json': " + k.json_message);
  }
}

TEST(TrainConfigKeys, TextMessagesSayWhatTheGrammarRefused) {
  EXPECT_EQ(set_error("steps", "2.9"), "steps: expected an integer in [1, 1000000000], found '2.9'");
  EXPECT_EQ(set_error("steps", "0x10"),
            "steps: expected an integer in [1, 1000000000], found '0x10' (integers are written in decimal: digits, or a "
            "whole number such as 2e6 or 20.0)");
  EXPECT_EQ(set_error("seed", "18446744073709551616"),
            "seed: expected a non-negative integer, found '18446744073709551616' (past the 64-bit range)");
  EXPECT_EQ(set_error("seed", "1e17"),
            "seed: expected a non-negative integer, found '1e17' (an integer past 2^53 is written in digits: a double "
            "does not hold every integer there)");
  EXPECT_EQ(set_error("lr", "1e400"), "lr: expected a finite number > 0, found '1e400' (past the range of a double)");
  EXPECT_EQ(set_error("lr", "1e-400"), "lr: expected a finite number > 0, found '1e-400' (past the range of a double)");
  EXPECT_EQ(set_error("lr", " 0.1"), "lr: expected a finite number > 0, found ' 0.1'");
  EXPECT_EQ(set_error("lr", ""), "lr: expected a finite number > 0, found ''");
  EXPECT_EQ(set_error("fp8-power2-scales", "yes"), "fp8-power2-scales: expected true or false, found 'yes'");
  EXPECT_EQ(set_error("inject-overflow-at", "5,x"),
            "inject-overflow-at: expected integers >= 1 separated by commas (e.g. 5,17), found '5,x'");
  EXPECT_EQ(set_error("learning-rate", "1").rfind("unknown key 'learning-rate'; known keys: model, precision, ", 0), 0u);
}

// ---- recipe-file: read and checked before anything starts ----------------------------------

class RecipeFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("mixprec-test-recipes-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // A recipe file of `body` (the fields after format and version); its path.
  std::string file(const std::string& body, const std::string& name = "r.json") {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << R"({"format":"mixprec.low_precision","version":1,)" << body << "}";
    return path;
  }
  // The error of validating the default config (gpt of 2 layers) with precision mxfp8 and
  // recipe-file `path`, after `change`.
  std::string error(const std::string& path, const std::function<void(TrainConfig&)>& change = {}) {
    return validate_error([&](TrainConfig& c) {
      c.precision = nn::Precision::mxfp8;
      c.recipe_file = path;
      if (change) change(c);
    });
  }
  std::filesystem::path dir_;
};

TEST_F(RecipeFile, AFileOfTheModelsLinearsIsTaken) {
  const std::string gpt = file(R"("default":"mxfp8","modules":{"h1.mlp.fc":{"recipe":"nvfp4","fprop":"bf16"}},)"
                               R"("schedule":[{"from_fraction":0.5,"modules":["h*.attn.*"],"recipe":"fp8-block"}],)"
                               R"("evaluation":"bf16")");
  EXPECT_EQ(error(gpt), "");
  const auto a = recipe_assignment([&] {
    TrainConfig c;
    c.recipe_file = gpt;
    c.steps = 8;
    return c;
  }());
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->phase_starts(8), std::vector<std::uint64_t>{4});  // a fraction of the run's steps: ceil(0.5 * 8)
  EXPECT_EQ(recipe_assignment(TrainConfig{}), nullptr);
  // Every quantized preset gives the rest of the model's precision.
  for (const nn::Precision p : nn::all_precisions()) {
    if (nn::is_fp8(p)) {
      EXPECT_EQ(error(gpt, [&](TrainConfig& c) { c.precision = p; }), "") << nn::precision_name(p);
    }
  }
  // The mlp's Linears are fc<i>.
  EXPECT_EQ(error(file(R"("modules":{"fc3":"mxfp4"})", "mlp.json"), [](TrainConfig& c) { c.model.kind = nn::ModelKind::mlp; }),
            "");
}

TEST_F(RecipeFile, BadInputsAreRefusedNamingTheFieldAndWhatIsAllowed) {
  const std::string gpt_names = "h<L>.attn.qkv, h<L>.attn.proj, h<L>.mlp.fc or h<L>.mlp.proj with L from 0 to 1";
  const std::string unknown = file(R"("modules":{"h2.attn.qkv":"nvfp4"})", "unknown.json");
  EXPECT_EQ(error(unknown), "recipe-file: " + unknown + ": recipe file: modules[\"h2.attn.qkv\"]: expected a Linear of "
                            "this model (" + gpt_names + "), found \"h2.attn.qkv\"");
  const std::string pattern = file(R"("modules":{},"schedule":[{"from_step":2,"modules":["h0.mlp.fc","h*.attn.qk"],)"
                                   R"("recipe":"mxfp8"}])", "pattern.json");
  EXPECT_EQ(error(pattern), "recipe-file: " + pattern + ": recipe file: schedule[0].modules[1]: expected a name or "
                            "pattern matching a Linear of this model (" + gpt_names + "), found \"h*.attn.qk\", "
                            "which matches none");
  const std::string mlp = file(R"("modules":{"fc4":"mxfp4"})", "mlp.json");
  EXPECT_EQ(error(mlp, [](TrainConfig& c) { c.model.kind = nn::ModelKind::mlp; }),
            "recipe-file: " + mlp + ": recipe file: modules[\"fc4\"]: expected a Linear of this model (fc<I> with I "
            "from 0 to 3), found \"fc4\"");
  // A precision without quantized Linears: the key applies to the quantized presets only.
  const std::string good = file(R"("default":"mxfp8","modules":{})", "good.json");
  EXPECT_EQ(error(good, [](TrainConfig& c) { c.precision = nn::Precision::bf16; }),
            "recipe-file: expected the default (\"\") with --precision bf16; it applies to --precision fp8-noscale, "
            "fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4 or mxfp4, found \"" + good + "\"");
  // The file sets its recipes' options: the preset's would be ignored.
  EXPECT_EQ(error(good, [](TrainConfig& c) { c.mx_rounding = "ocp"; }),
            "mx-rounding: expected the default (\"te\") with --recipe-file (the recipe file's \"options\" and entries "
            "set its recipes' options), found \"ocp\"");
  // Malformed, missing, or wrong in the file's own rules: lowp::read_assignment's message.
  const std::string truncated = (dir_ / "truncated.json").string();
  std::ofstream(truncated) << R"({"format":"mixprec.low_precision","version":1,"modules":{)";
  const std::string e = error(truncated);
  EXPECT_EQ(e.rfind("recipe-file: " + truncated + ": recipe file: ", 0), 0u) << e;
  const std::string missing = (dir_ / "missing.json").string();
  EXPECT_NE(error(missing).find("recipe-file: "), std::string::npos);
  EXPECT_NE(error(missing).find(missing), std::string::npos) << error(missing);
  const std::string version = file(R"("version":2)", "v.json");
  EXPECT_NE(error(version).find("recipe-file: "), std::string::npos) << error(version);
  // fp8-delayed: one amax-history config for the model; never in the evaluation entry.
  const std::string delayed = file(R"("default":"fp8-delayed","modules":{"h0.attn.qkv":)"
                                   R"({"recipe":"fp8-delayed","amax_history_len":16}})", "delayed.json");
  EXPECT_EQ(error(delayed), "recipe-file: " + delayed + ": recipe file: fp8-delayed: expected one set of options for "
                            "every fp8-delayed Linear (the engine keeps one amax-history config), found "
                            "amax_history_len 16, amax_compute_algo max, margin 0, fp8_format hybrid (h0.attn.qkv from "
                            "step 0) and amax_history_len 1024, amax_compute_algo max, margin 0, fp8_format hybrid "
                            "(h0.attn.proj from step 0)");
  const std::string evaluation = file(R"("default":"mxfp8","modules":{},"evaluation":"fp8-delayed")", "eval.json");
  EXPECT_EQ(error(evaluation), "recipe-file: " + evaluation + ": recipe file: evaluation: expected a recipe other than "
                               "fp8-delayed (its scales come from the amax histories of training steps, which an "
                               "evaluation forward does not record), found fp8-delayed");
}

}  // namespace
}  // namespace mixprec::train
