// TrainConfig: its key table, validation, JSON config files and the JSON echo of a config.
//
// One table (table()) lists every key in flag order: its description (kind, range or
// allowed values, doc line, the CLI's placeholder) and its member, through the key-table
// mechanism every config shares (src/core/key_table.hpp). Reading a key from text or JSON
// checks its range; validate() runs every key's check, then the checks across keys.
#include "mixprec/run/config.hpp"
#include "mixprec/scaler/step_guard.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "../core/key_table.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/scaler/loss_scale.hpp"

namespace mixprec::train {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
using keys::fail;
using keys::join;
using keys::Spec;
using text::num;
using text::squote;

// Upper bounds that keep a typo from allocating terabytes.
constexpr std::uint64_t kMaxLayers = 64;
constexpr std::uint64_t kMaxHeads = 4096;
constexpr std::uint64_t kMaxChannels = 4096;
constexpr std::uint64_t kMaxContext = 4096;
constexpr std::uint64_t kMaxBatch = 4096;
constexpr std::uint64_t kMaxTokensPerBatch = 1u << 20;  // batch * context
constexpr std::uint64_t kMaxDepth = 64;
constexpr std::uint64_t kMaxHidden = 16384;
constexpr std::uint64_t kMaxAccum = 1'000'000;
constexpr std::uint64_t kMaxSteps = 1'000'000'000;
constexpr std::uint64_t kMaxThreads = 1024;
constexpr std::uint64_t kMaxAmaxHistory = 1u << 20;
constexpr std::int64_t kMaxRanks = 1 << 20;
constexpr double kFloatMax = static_cast<double>(std::numeric_limits<float>::max());

// ---- the rules of single keys that a range does not say ----------------------------------

// The S of "static:S": a number float32 holds, as it holds 1/S (the unscale factor), in the
// number grammar of every key (keys::parse_number).
double static_loss_scale(const std::string& s) {
  constexpr std::string_view key = "loss-scale";
  const std::string static_form =
      std::string("static:S with S a number > 0 that float32 holds, as it holds 1/S (the unscale factor): S in ") +
      kStartingScaleRange;
  if (s == "static") fail(key, static_form + " (the static preset needs its scale)", squote(s));
  const auto v = s.starts_with("static:") ? keys::parse_number(std::string_view(s).substr(7)) : std::nullopt;
  if (!v || !starting_scale_ok(*v)) fail(key, static_form, squote(s));
  return *v;
}

std::vector<std::string> dynamic_presets() {
  std::vector<std::string> presets;
  for (const std::string& p : loss_scale_preset_names())
    if (p != "static") presets.push_back(p);
  return presets;
}

const std::string& loss_scale_allowed() {
  static const std::string text =
      "none, dynamic, static:S (S a finite number > 0) or a preset (" + join(dynamic_presets(), ", ") + ")";
  return text;
}

void check_loss_scale(const std::string& s) {
  if (s == "none" || s == "dynamic") return;
  if (s == "static" || s.starts_with("static:")) {
    (void)static_loss_scale(s);
    return;
  }
  for (const std::string& p : dynamic_presets())
    if (s == p) return;
  fail("loss-scale", loss_scale_allowed(), squote(s));
}

const std::string& vocab_allowed() {
  static const std::string text = "char or word:N with N in [" + std::to_string(nn::VocabSpec::kMinWords) + ", " +
                                  std::to_string(nn::VocabSpec::kMaxWords) + "]";
  return text;
}

void check_vocab(const std::string& s) {
  try {
    (void)nn::parse_vocab_spec(s);
  } catch (const std::invalid_argument&) {
    fail("vocab", vocab_allowed(), squote(s));
  }
}

// ---- the key table ----------------------------------------------------------------------

// What TrainConfig adds to a key: how the CLI and resume treat it.
struct TrainExtra {
  bool flag = false;               // a boolean the CLI gives as --KEY alone (no value)
  bool resume_may_change = false;  // ConfigKey::resume_may_change
  bool compare_sets = false;       // ConfigKey::compare_sets
  std::uint32_t only_for = 0;      // ConfigKey::only_for
};

using Key = keys::Key<TrainConfig, TrainExtra>;
using Table = keys::KeyTable<TrainConfig, TrainExtra>;
using Check = std::function<void(const TrainConfig&)>;

// Which keys `mixprec compare` sets per row, a resume may change, or both.
constexpr TrainExtra kRun{.compare_sets = true};
constexpr TrainExtra kMoves{.resume_may_change = true};
constexpr TrainExtra kDistributed{.resume_may_change = true, .compare_sets = true};

Spec integer(std::string name, std::string type, std::string doc, std::uint64_t lo = 0,
             std::uint64_t hi = std::numeric_limits<std::uint64_t>::max()) {
  return {.name = std::move(name), .doc = std::move(doc), .type = std::move(type),
          .int_min = static_cast<std::int64_t>(lo), .int_max = hi};
}

Spec number(std::string name, std::string doc, double lo, bool lo_open, double hi = HUGE_VAL, bool hi_open = false) {
  return {.name = std::move(name), .doc = std::move(doc), .type = "X", .lo = lo, .hi = hi, .lo_open = lo_open,
          .hi_open = hi_open};
}

Spec text_spec(std::string name, std::string type, std::string doc) {
  return {.name = std::move(name), .doc = std::move(doc), .type = std::move(type)};
}

Spec choice(std::string name, std::string doc, std::vector<std::string> choices) {
  return {.name = std::move(name), .kind = keys::Kind::choice, .doc = std::move(doc), .type = "NAME",
          .choices = std::move(choices)};
}

// ConfigKey::only_for of an fp8 option: the precisions whose fp8 recipe is one of `recipes`
// (every fp8 precision when empty), read from the precision table.
template <class Pred>
std::uint32_t fp8_only(Pred takes) {
  std::uint32_t bits = 0;
  for (const nn::Precision p : nn::all_precisions()) {
    const std::optional<nn::QuantizedGemms> g = nn::quantized_gemms_of(p);
    if (g && takes(*g)) bits |= precision_bits({p});
  }
  return bits;
}
// The presets of one lowp recipe (fp8-delayed: only the scaled one).
std::uint32_t fp8_only(lowp::Recipe r) {
  return fp8_only([r](const nn::QuantizedGemms& g) { return g.recipe == r && !g.unit_scale; });
}

// The key-table binders for a TrainConfig row: (spec, member, own rule, TrainExtra).
template <class Ref>
Key int_row(Spec s, Ref ref, Check check = {}, TrainExtra x = {}) {
  return keys::integer_key<TrainConfig, TrainExtra>(std::move(s), ref, std::move(check), x);
}
template <class Ref>
Key num_row(Spec s, Ref ref, Check check = {}, TrainExtra x = {}) {
  return keys::number_key<TrainConfig, TrainExtra>(std::move(s), ref, std::move(check), x);
}
template <class Ref>
Key bool_row(Spec s, Ref ref, Check check = {}, TrainExtra x = {}) {
  return keys::bool_key<TrainConfig, TrainExtra>(std::move(s), ref, std::move(check), x);
}
template <class Ref>
Key text_row(Spec s, Ref ref, Check check = {}, TrainExtra x = {}) {  // free text, or spec.choices
  return keys::string_key<TrainConfig, TrainExtra>(std::move(s), ref, std::move(check), x);
}
template <class Ref>
Key list_row(Spec s, Ref ref, Check check = {}, TrainExtra x = {}) {
  return keys::list_key<TrainConfig, TrainExtra>(std::move(s), ref, std::move(check), x);
}
template <class Ref, class Parse>
Key enum_row(Spec s, Ref ref, Parse parse, Check check = {}, TrainExtra x = {}) {
  return keys::enum_key<TrainConfig, TrainExtra>(std::move(s), ref, parse, std::move(check), x);
}

}  // namespace

std::vector<std::string> bad_batch_kinds(const std::string& text) {
  std::vector<std::string> kinds;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    kinds.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return kinds;
}

namespace {

// "M" or "M,V": the two moment formats; fail() names the key otherwise.
std::pair<MomentFormat, MomentFormat> moment_pair(const std::string& text) {
  const std::size_t comma = text.find(',');
  const std::string m = text.substr(0, comma), v = comma == std::string::npos ? m : text.substr(comma + 1);
  const auto fm = parse_moment_format(m), fv = parse_moment_format(v);
  if (!fm || !fv) fail("moments", moment_format_names() + " (or M,V)", squote(text));
  return {*fm, *fv};
}

const Table& table() {
  static const Table t([] {
    std::vector<Key> k;
    // model
    k.push_back(enum_row(
        choice("model", "Model: gpt (decoder-only transformer) or mlp (deep MLP next-token classifier)",
               {std::string(nn::model_kind_name(nn::ModelKind::gpt)), std::string(nn::model_kind_name(nn::ModelKind::mlp))}),
        [](auto& c) -> auto& { return c.model.kind; }, [](std::string_view s) { return nn::parse_model_kind(s); }));
    k.push_back(enum_row(
        choice("precision", "Precision preset (docs/training.md): " + join(nn::precision_names(), ", "),
               nn::precision_names()),
        [](auto& c) -> auto& { return c.precision; }, [](std::string_view s) { return nn::parse_precision(s); }, {},
        kRun));
    {
      Spec s = text_spec("loss-scale", "SPEC",
                         "Loss scaling: none, dynamic, static:S or a preset (" + join(dynamic_presets(), ", ") +
                             "); fp8 presets default to none");
      s.expected = loss_scale_allowed();
      k.push_back(text_row(
          s, [](auto& c) -> auto& { return c.loss_scale; }, [](const TrainConfig& c) { check_loss_scale(c.loss_scale); },
          kRun));
    }
    // fp8 recipe options
    // The fp4 presets (nvfp4, mxfp4) have E2M1 operands everywhere: no fp8 format to choose.
    const std::uint32_t fp8_elements = fp8_only([](const nn::QuantizedGemms& g) {
      return lowp::recipe_info(g.recipe).element != lowp::Element::e2m1;  // the FP8 presets
    });
    k.push_back(text_row(
        choice("fp8-format", "fp8 presets: hybrid (E4M3 forward, E5M2 gradients) or e4m3", {"hybrid", "e4m3"}),
        [](auto& c) -> auto& { return c.fp8_format; }, {}, {.only_for = fp8_elements}));
    k.push_back(int_row(
        integer("fp8-amax-history", "N", "fp8-delayed: amax history length", 1, kMaxAmaxHistory),
        [](auto& c) -> auto& { return c.fp8_amax_history; }, {}, {.only_for = fp8_only(lowp::Recipe::fp8_delayed)}));
    k.push_back(text_row(
        choice("fp8-amax-algo", "fp8-delayed: max or most_recent", {"max", "most_recent"}),
        [](auto& c) -> auto& { return c.fp8_amax_algo; }, {}, {.only_for = fp8_only(lowp::Recipe::fp8_delayed)}));
    {
      Spec s = integer("fp8-margin", "M", "fp8-delayed: scale = fp8_max * 2^-M / amax, M in [-64, 64]");
      s.int_min = -64;
      s.int_max = 64;
      k.push_back(int_row(
          s, [](auto& c) -> auto& { return c.fp8_margin; }, {}, {.only_for = fp8_only(lowp::Recipe::fp8_delayed)}));
    }
    {
      Spec s = text_spec("fp8-power2-scales", "[BOOL]", "fp8-current: scales rounded down to powers of two");
      k.push_back(bool_row(
          s, [](auto& c) -> auto& { return c.fp8_power2_scales; }, {},
          {.only_for = fp8_only(lowp::Recipe::fp8_current)}));
    }
    k.push_back(num_row(
        number("fp8-amax-epsilon", "fp8-current: amax floor", 0, false), [](auto& c) -> auto& { return c.fp8_amax_epsilon; },
        [](const TrainConfig& c) {
          // float32 must hold it: neither past its max nor so small that it would round to 0
          // (no silent clamp to "no floor").
          if (c.fp8_amax_epsilon > kFloatMax || (c.fp8_amax_epsilon > 0 && static_cast<float>(c.fp8_amax_epsilon) == 0.0f))
            fail("fp8-amax-epsilon", "0, or a finite number float32 holds (1.4e-45 to 3.4e38)", num(c.fp8_amax_epsilon));
        },
        {.only_for = fp8_only(lowp::Recipe::fp8_current)}));
    k.push_back(text_row(
        choice("mx-rounding", "mxfp8: E8M0 block-scale rounding, te (round up) or ocp (floor)", {"te", "ocp"}),
        [](auto& c) -> auto& { return c.mx_rounding; }, {}, {.only_for = fp8_only(lowp::Recipe::mxfp8)}));
    // The file may move (a resume may give it by another path): the checkpoint holds its
    // recipes and a resume must read the same ones. `mixprec compare` runs presets only.
    k.push_back(text_row(
        text_spec("recipe-file", "FILE",
                  "Quantized presets: a recipe file deciding each block Linear's recipe per GEMM operand and its "
                  "schedule (docs/low_precision.md)"),
        [](auto& c) -> auto& { return c.recipe_file; }, {},
        {.resume_may_change = true, .compare_sets = true,
         .only_for = fp8_only([](const nn::QuantizedGemms&) { return true; })}));
    // the model's shape
    k.push_back(int_row(integer("layers", "N", "gpt: transformer blocks", 1, kMaxLayers),
                                                          [](auto& c) -> auto& { return c.model.layers; }));
    k.push_back(int_row(
        integer("heads", "N", "gpt: attention heads (must divide --channels)", 1, kMaxHeads),
        [](auto& c) -> auto& { return c.model.heads; }));
    k.push_back(int_row(
        integer("channels", "N", "gpt: width (also the mlp's embedding width per context token)", 1, kMaxChannels),
        [](auto& c) -> auto& { return c.model.channels; }));
    k.push_back(int_row(integer("context", "N", "Tokens per sequence", 2, kMaxContext),
                                                          [](auto& c) -> auto& { return c.model.context; }));
    k.push_back(int_row(integer("batch", "N", "Sequences per micro-batch", 1, kMaxBatch),
                                                          [](auto& c) -> auto& { return c.model.batch; }));
    k.push_back(int_row(integer("depth", "N", "mlp: hidden layers", 1, kMaxDepth),
                                                          [](auto& c) -> auto& { return c.model.depth; }));
    k.push_back(int_row(integer("hidden", "N", "mlp: hidden width", 1, kMaxHidden),
                                                          [](auto& c) -> auto& { return c.model.hidden; }));
    // data
    k.push_back(text_row(
        text_spec("data", "FILE", "UTF-8 training text (default: the embedded corpus)"),
        [](auto& c) -> auto& { return c.data; }, {}, kMoves));
    {
      Spec s = text_spec("vocab", "SPEC", "Tokeniser: char or word:N");
      s.expected = vocab_allowed();
      k.push_back(text_row(s, [](auto& c) -> auto& { return c.vocab; },
                                                           [](const TrainConfig& c) { check_vocab(c.vocab); }));
    }
    k.push_back(int_row(
        integer("corpus-tokens", "N", "Size of the embedded corpus in word tokens", 1, nn::CorpusOptions::kMaxTokens),
        [](auto& c) -> auto& { return c.corpus_tokens; }));
    k.push_back(num_row(
        number("val-fraction", "Held-out tail of the token stream, in (0, 0.5]", 0, true, 0.5, false),
        [](auto& c) -> auto& { return c.val_fraction; }));
    // optimisation
    k.push_back(text_row(choice("optimizer", "adamw, adam or sgd", {"adamw", "adam", "sgd"}),
                                                         [](auto& c) -> auto& { return c.optimizer; }));
    k.push_back(num_row(number("lr", "Peak learning rate", 0, true),
                                                         [](auto& c) -> auto& { return c.lr; }));
    k.push_back(num_row(number("min-lr", "Floor of the cosine schedule", 0, false),
                                                         [](auto& c) -> auto& { return c.min_lr; }));
    k.push_back(int_row(
        integer("warmup", "N", "Linear warmup steps; the default is at most --steps"),
        [](auto& c) -> auto& { return c.warmup; }));
    k.push_back(num_row(number("weight-decay", "Weight decay", 0, false),
                                                         [](auto& c) -> auto& { return c.weight_decay; }));
    k.push_back(num_row(number("beta1", "Adam beta1", 0, false, 1, true),
                                                         [](auto& c) -> auto& { return c.beta1; }));
    k.push_back(num_row(number("beta2", "Adam beta2", 0, false, 1, true),
                                                         [](auto& c) -> auto& { return c.beta2; }));
    k.push_back(num_row(number("eps", "Adam epsilon", 0, true),
                                                         [](auto& c) -> auto& { return c.eps; }));
    k.push_back(num_row(
        number("clip", "Max global gradient norm; 0 = no clipping", 0, false), [](auto& c) -> auto& { return c.clip; }));
    // optimizer state formats
    k.push_back(text_row(
        choice("master", "Master weights: fp32 or remainder (bf16 weights + 16 bits that rebuild fp32; bf16 presets)",
               {"fp32", "remainder"}),
        [](auto& c) -> auto& { return c.master; }));
    {
      Spec s = text_spec("moments", "F[,F]", "Adam's moments: " + moment_format_names() + " (or M,V: one for each)");
      s.expected = moment_format_names() + " (or M,V)";
      k.push_back(text_row(s, [](auto& c) -> auto& { return c.moments; },
                           [](const TrainConfig& c) { (void)moment_pair(c.moments); }));
    }
    k.push_back(int_row(
        integer("moment-block", "N", "Elements per scale of fp8/8bit/4bit moments: 0 (256, 256, 128) or a power of two "
                                      "in [32, 1024]", 0, 1024),
        [](auto& c) -> auto& { return c.moment_block; }, [](const TrainConfig& c) {
          if (c.moment_block != 0 && (c.moment_block < 32 || !std::has_single_bit(c.moment_block)))
            fail("moment-block", "0 or a power of two in [32, 1024]", std::to_string(c.moment_block));
        }));
    // step guards and the EMA
    k.push_back(num_row(number("skip-loss-z", "Skip a step whose loss z-score over the window exceeds Z; 0 = off", 0,
                               false),
                        [](auto& c) -> auto& { return c.skip_loss_z; }));
    k.push_back(num_row(number("skip-grad-z", "Skip a step whose gradient-norm z-score over the window exceeds Z; 0 = off",
                               0, false),
                        [](auto& c) -> auto& { return c.skip_grad_z; }));
    k.push_back(int_row(integer("skip-window", "N", "Steps in the z-score windows of --skip-loss-z and --skip-grad-z", 2,
                                kMaxGuardWindow),
                        [](auto& c) -> auto& { return c.skip_window; }));
    k.push_back(num_row(number("ema", "Decay of an EMA of the weights over applied steps, in [0, 1); 0 = none", 0, false,
                               1, true),
                        [](auto& c) -> auto& { return c.ema; }));
    k.push_back(int_row(
        integer("steps", "N", "Optimizer steps, applied or skipped", 1, kMaxSteps), [](auto& c) -> auto& { return c.steps; },
        {}, kMoves));
    k.push_back(int_row(
        integer("accum", "N", "Micro-batches per step (gradient accumulation)", 1, kMaxAccum),
        [](auto& c) -> auto& { return c.accum; }));
    k.push_back(int_row(
        integer("seed", "N", "Seed of the weights, the batch order and the corpus"), [](auto& c) -> auto& { return c.seed; }));
    // evaluation
    k.push_back(int_row(
        integer("eval-every", "N", "Validation loss every N steps and at the end; 0 = only at the end"),
        [](auto& c) -> auto& { return c.eval_every; }));
    k.push_back(int_row(
        integer("eval-windows", "N", "Validation windows per evaluation; 0 = the whole split"),
        [](auto& c) -> auto& { return c.eval_windows; }));
    k.push_back(int_row(
        integer("histogram-every", "N", "Log2-magnitude histograms at step 1, every N steps and the last; 0 = never"),
        [](auto& c) -> auto& { return c.histogram_every; }));
    // outputs
    k.push_back(text_row(
        text_spec("out", "DIR", "Run folder: config.json, log.jsonl, checkpoints, summary.json (default: none)"),
        [](auto& c) -> auto& { return c.out; }, {}, kDistributed));
    k.push_back(int_row(
        integer("checkpoint-every", "N", "Checkpoint every N steps (needs --out); 0 = only at the end"),
        [](auto& c) -> auto& { return c.checkpoint_every; }, {}, kRun));
    k.push_back(int_row(
        integer("keep-checkpoints", "N", "Newest checkpoints kept in the run folder", 1),
        [](auto& c) -> auto& { return c.keep_checkpoints; }, {}, kRun));
    k.push_back(text_row(
        text_spec("resume", "DIR", "Continue the run in DIR from its newest checkpoint; --steps may extend it"),
        [](auto& c) -> auto& { return c.resume; }, {}, kDistributed));
    // data parallelism
    k.push_back(bool_row(
        text_spec("distributed", "",
                  "Data-parallel over the ranks of mpirun -np N: each runs --accum micro-batches of the step"),
        [](auto& c) -> auto& { return c.distributed; }, {},
        {.flag = true, .resume_may_change = true, .compare_sets = true}));
    k.push_back(int_row(
        integer("zero", "N", "Distributed: 1 = ZeRO stage 1 (master weights and optimizer state sharded); 0 = off", 0, 1),
        [](auto& c) -> auto& { return c.zero; }, {}, kDistributed));
    {
      Spec s = choice("grad-reduce",
                      "Distributed gradient all-reduce: fp32 (fixed-order sums, bitwise reproducible) or low (f16/bf16, "
                      "half the bytes)",
                      {"fp32", "low"});
      s.type = "MODE";
      k.push_back(text_row(s, [](auto& c) -> auto& { return c.grad_reduce; }, {},
                                                           kDistributed));
    }
    {
      Spec s = number("dist-timeout", "Distributed: seconds a collective may take before the job is aborted", 0, true,
                      86400, false);
      s.type = "S";
      s.expected = "a number of seconds in (0, 86400]";
      k.push_back(num_row(s, [](auto& c) -> auto& { return c.dist_timeout; }, {},
                                                           kDistributed));
    }
    {
      Spec s = integer("inject-overflow-rank", "R", "Testing: --inject-overflow-at on rank R only; -1 = every rank");
      s.int_min = -1;
      s.int_max = kMaxRanks - 1;
      s.expected = "-1 (every rank) or a rank in [0, " + std::to_string(kMaxRanks) + ")";
      k.push_back(int_row(s, [](auto& c) -> auto& { return c.inject_overflow_rank; },
                                                            {}, kDistributed));
    }
    {
      Spec s = integer("inject-overflow-at", "LIST", "Testing: +inf into a gradient at these steps (1-based), e.g. 5,17", 1);
      k.push_back(list_row(s, [](auto& c) -> auto& { return c.inject_overflow_at; }));
    }
    k.push_back(text_row(
        text_spec("inject-overflow-tensor", "NAME",
                  "Testing: the parameter whose gradient --inject-overflow-at writes (default: the first)"),
        [](auto& c) -> auto& { return c.inject_overflow_tensor; }, {}, kMoves));
    {
      Spec s = integer("inject-bad-batch-at", "LIST", "Testing: a bad batch (--inject-bad-batch) at these steps", 1);
      k.push_back(list_row(s, [](auto& c) -> auto& { return c.inject_bad_batch_at; }, {}, kMoves));
    }
    {
      Spec s = text_spec("inject-bad-batch", "KINDS",
                         "Testing: the kind of each --inject-bad-batch-at step: labels (random targets) or scaled "
                         "(loss gradient x1000), one for all or one per step, comma-separated");
      s.expected = "labels or scaled, one or one per --inject-bad-batch-at step, comma-separated";
      k.push_back(text_row(
          s, [](auto& c) -> auto& { return c.inject_bad_batch; },
          [](const TrainConfig& c) {
            const std::vector<std::string> kinds = bad_batch_kinds(c.inject_bad_batch);
            for (const std::string& kind : kinds)
              if (kind != "labels" && kind != "scaled")
                fail("inject-bad-batch", "labels or scaled, one or one per --inject-bad-batch-at step, comma-separated",
                     squote(c.inject_bad_batch));
          },
          kMoves));
    }
    {
      Spec s = integer("inject-fault-at", "LIST", "Testing: a planted fault (--inject-fault) at these steps", 1);
      k.push_back(list_row(s, [](auto& c) -> auto& { return c.inject_fault_at; }, {}, kMoves));
    }
    {
      Spec s = text_spec("inject-fault", "SPEC",
                         "Testing: forward:NAME (NaN into activation NAME) or backward:NAME (+inf into activation "
                         "gradient NAME)");
      s.expected = "forward:NAME or backward:NAME";
      k.push_back(text_row(
          s, [](auto& c) -> auto& { return c.inject_fault; },
          [](const TrainConfig& c) {
            const std::string& f = c.inject_fault;
            if (!f.empty() && !((f.starts_with("forward:") && f.size() > 8) || (f.starts_with("backward:") && f.size() > 9)))
              fail("inject-fault", "forward:NAME or backward:NAME", squote(f));
          },
          kMoves));
    }
    k.push_back(int_row(
        integer("threads", "N", "Threads; 0 = all cores (MIXPREC_THREADS / OMP_NUM_THREADS respected)", 0, kMaxThreads),
        [](auto& c) -> auto& { return c.threads; }));
    return k;
  }());
  return t;
}

KeyKind cli_kind(const Key& k) {
  switch (k.spec.kind) {
    case keys::Kind::integer: return KeyKind::integer;
    case keys::Kind::number: return KeyKind::number;
    case keys::Kind::boolean: return k.extra.flag ? KeyKind::flag : KeyKind::boolean;
    case keys::Kind::list: return KeyKind::list;
    case keys::Kind::choice:
    case keys::Kind::text: return KeyKind::text;
  }
  return KeyKind::text;
}

}  // namespace

std::optional<LossScaleConfig> loss_scale_config(const std::string& spec) {
  check_loss_scale(spec);
  if (spec == "none") return std::nullopt;
  if (spec == "dynamic") return loss_scale_preset("mixprec");
  if (spec.starts_with("static:")) {
    LossScaleConfig c = loss_scale_preset("static");
    c.init_scale = static_loss_scale(spec);
    return c;
  }
  return loss_scale_preset(spec);
}

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> out;
    for (const Key& k : table().keys())
      out.push_back({.name = k.spec.name,
                     .kind = cli_kind(k),
                     .type = k.spec.type,
                     .help = k.spec.doc,
                     .resume_may_change = k.extra.resume_may_change,
                     .compare_sets = k.extra.compare_sets,
                     .only_for = k.extra.only_for,
                     .spec = &k.spec});
    return out;
  }();
  return keys;
}

const ConfigKey* find_config_key(std::string_view name) {
  for (const ConfigKey& k : config_keys())
    if (k.name == name) return &k;
  return nullptr;
}

void set_config_key(TrainConfig& c, std::string_view key, std::string_view text) { table().set_text(c, key, text); }

std::string config_key_text(const TrainConfig& c, std::string_view key) { return table().text(c, key); }

const std::vector<std::string>& fp8_keys() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const Key& k : table().keys())
      if (k.extra.only_for != 0) n.push_back(k.spec.name);
    return n;
  }();
  return names;
}

nn::Fp8Config fp8_config(const TrainConfig& c) {
  nn::Fp8Config f;
  f.format = lowp::parse_format(c.fp8_format).value_or(lowp::Format::hybrid);  // checked by the key table
  f.margin = static_cast<int>(c.fp8_margin);
  f.amax_history_len = c.fp8_amax_history;
  f.amax_compute_algo = lowp::parse_amax_algo(c.fp8_amax_algo).value_or(lowp::AmaxAlgo::max);  // checked by the key table
  f.power_of_2_scales = c.fp8_power2_scales;
  f.amax_epsilon = static_cast<float>(c.fp8_amax_epsilon);
  f.mx_rounding = c.mx_rounding == "ocp" ? lowp::ScaleRounding::floor : lowp::ScaleRounding::rceil;
  return f;
}

bool fp8_key_applies(std::string_view key, nn::Precision p) {
  const std::uint32_t only = table().at(key).extra.only_for;
  return only == 0 || (only & (1u << static_cast<unsigned>(p))) != 0;
}

TrainConfig with_fp8_options_for(TrainConfig c, nn::Precision p) {
  const TrainConfig defaults;
  for (const Key& k : table().keys())
    if (k.extra.only_for != 0 && !fp8_key_applies(k.spec.name, p)) k.set(c, k.get(defaults));
  return c;
}

void validate(const TrainConfig& c) {
  table().check(c);
  // An fp8 option away from its default with a precision that does not use it would be
  // silently ignored: refuse it.
  const TrainConfig defaults;
  for (const Key& k : table().keys()) {
    if (k.extra.only_for == 0 || k.get(c) == k.get(defaults) || fp8_key_applies(k.spec.name, c.precision)) continue;
    std::vector<std::string> names;
    for (const std::string& name : nn::precision_names())
      if (fp8_key_applies(k.spec.name, *nn::parse_precision(name))) names.push_back(name);
    fail(k.spec.name,
         "the default (" + keys::to_json<json>(k.spec, k.get(defaults)).dump() + ") with --precision " +
             std::string(nn::precision_name(c.precision)) + "; it applies to --precision " + join(names),
         keys::to_json<json>(k.spec, k.get(c)).dump());
  }
  // A recipe file sets its recipes' options itself ("options" and each entry's): the preset's
  // fp8 options would be ignored.
  if (!c.recipe_file.empty()) {
    for (const Key& k : table().keys()) {
      if (k.extra.only_for == 0 || k.spec.name == "recipe-file" || k.get(c) == k.get(defaults)) continue;
      fail(k.spec.name,
           "the default (" + keys::to_json<json>(k.spec, k.get(defaults)).dump() +
               ") with --recipe-file (the recipe file's \"options\" and entries set its recipes' options)",
           keys::to_json<json>(k.spec, k.get(c)).dump());
    }
  }
  // Across keys.
  if (c.model.channels % c.model.heads != 0)
    fail("heads", "a divisor of channels (" + std::to_string(c.model.channels) + ")", std::to_string(c.model.heads));
  if (c.model.batch * c.model.context > kMaxTokensPerBatch)
    fail("batch", "batch * context <= " + std::to_string(kMaxTokensPerBatch) + " tokens per micro-batch",
         std::to_string(c.model.batch) + " * " + std::to_string(c.model.context));
  if (c.min_lr > c.lr) fail("min-lr", "a number <= lr (" + num(c.lr) + ")", num(c.min_lr));
  if (c.warmup > c.steps) fail("warmup", "an integer <= steps (" + std::to_string(c.steps) + ")", std::to_string(c.warmup));
  for (const std::size_t s : c.inject_overflow_at)
    if (s > c.steps)
      fail("inject-overflow-at", "an integer in [1, " + std::to_string(c.steps) + "]", std::to_string(s));
  // The guards' rule across keys (a threshold below the reach of its window), in the flags' names.
  check_guard_reach(c.skip_loss_z, static_cast<int>(c.skip_window), "skip-loss-z", "skip-window");
  check_guard_reach(c.skip_grad_z, static_cast<int>(c.skip_window), "skip-grad-z", "skip-window");
  if (const std::size_t n = bad_batch_kinds(c.inject_bad_batch).size(); n != 1 && n != c.inject_bad_batch_at.size())
    fail("inject-bad-batch", "one kind, or one per --inject-bad-batch-at step (" +
                                 std::to_string(c.inject_bad_batch_at.size()) + ")",
         squote(c.inject_bad_batch));
  if (c.inject_fault.empty() != c.inject_fault_at.empty())
    fail(c.inject_fault.empty() ? "inject-fault" : "inject-fault-at",
         "both --inject-fault and --inject-fault-at, or neither",
         c.inject_fault.empty() ? "--inject-fault-at without --inject-fault" : "--inject-fault without --inject-fault-at");
  for (const std::size_t s : c.inject_fault_at)
    if (s > c.steps) fail("inject-fault-at", "an integer in [1, " + std::to_string(c.steps) + "]", std::to_string(s));
  for (const std::size_t s : c.inject_bad_batch_at)
    if (s > c.steps)
      fail("inject-bad-batch-at", "an integer in [1, " + std::to_string(c.steps) + "]", std::to_string(s));
  if (c.grad_reduce == "low") {
    if (!c.distributed) fail("grad-reduce", "fp32 unless --distributed (low is a way of all-reducing)", "low");
    if (nn::policy_of(c.precision).weights == DType::f32)
      fail("grad-reduce", std::string("fp32 with precision ").append(nn::precision_name(c.precision)) +
                              " (low all-reduces in the model's f16/bf16 format; this precision has none)",
           "low");
  }
  {
    const StateFormats f = state_formats(c);
    const bool formats = f.master != MasterFormat::fp32 || f.m != MomentFormat::fp32 || f.v != MomentFormat::fp32;
    if (formats && c.optimizer == "sgd")
      fail("optimizer", "adam or adamw with --master/--moments other than fp32 (the state formats are Adam's)", "sgd");
    const nn::PrecisionPolicy pol = nn::policy_of(c.precision);
    if (f.master == MasterFormat::remainder && !(pol.master && pol.weights == DType::bf16))
      fail("master", std::string("fp32 with precision ").append(nn::precision_name(c.precision)) +
                         " (remainder needs master weights and bf16 model weights: --precision bf16)",
           "remainder");
    if (formats && c.loss_scale == "layerwise")
      fail("loss-scale", "a preset other than layerwise with --master/--moments other than fp32 (its per-layer "
                         "skips restore fp32 state)", "layerwise");
  }
  if (c.zero == 1 && !c.distributed) fail("zero", "0 unless --distributed (ZeRO shards across ranks)", "1");
  if (c.zero == 1 && c.grad_reduce != "fp32")
    fail("grad-reduce", "fp32 with --zero 1 (its reduce-scatter sums in fp32)", squote(c.grad_reduce));
  if (c.inject_overflow_rank >= 0 && !c.distributed)
    fail("inject-overflow-rank", "-1 unless --distributed", std::to_string(c.inject_overflow_rank));
  (void)recipe_assignment(c);  // read and checked before anything starts
  if (c.data.empty()) {
    const std::size_t need = nn::min_tokens_for(c.model.context, c.val_fraction);
    if (c.corpus_tokens < need)
      fail("corpus-tokens", "at least " + std::to_string(need) + " (context " + std::to_string(c.model.context) +
                                " and val-fraction " + num(c.val_fraction) +
                                " need context + 1 tokens in each split)",
           std::to_string(c.corpus_tokens));
  }
}

TrainConfig apply_json(const TrainConfig& base, std::string_view json_text, std::string_view source) {
  const std::string src(source);
  const json doc = io::parse_json(json_text, src);  // depth, duplicate keys, BOM, malformed JSON
  if (!doc.is_object())
    throw std::invalid_argument(src + ": expected a JSON object of settings (flag names without the dashes), found " +
                                std::string(doc.type_name()));
  TrainConfig c = base;
  for (const auto& [key, value] : doc.items()) {
    try {
      table().set_json(c, table().at(key), value);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(src + ": " + e.what());
    }
  }
  return c;
}

std::string to_json(const TrainConfig& c, int indent) {
  return table().to_json<ordered_json>(c).dump(indent, ' ', false, ordered_json::error_handler_t::replace);
}

std::string to_json(const TrainConfig& c, const std::vector<std::string_view>& names, int indent) {
  for (const std::string_view k : names) (void)table().at(k);
  ordered_json j = ordered_json::object();
  for (const Key& k : table().keys())
    if (std::find(names.begin(), names.end(), k.spec.name) != names.end())
      j[k.spec.name] = keys::to_json<ordered_json>(k.spec, k.get(c));
  return j.dump(indent, ' ', false, ordered_json::error_handler_t::replace);
}

std::shared_ptr<const lowp::Assignment> recipe_assignment(const TrainConfig& c) {
  if (c.recipe_file.empty()) return nullptr;
  lowp::Assignment a;
  try {
    a = lowp::read_assignment(c.recipe_file);  // its messages name the file
  } catch (const std::exception& e) {  // unreadable (std::runtime_error) or malformed: before anything starts
    throw std::invalid_argument("recipe-file: " + std::string(e.what()));
  }
  try {
    nn::check_recipes(a, c.model, c.steps);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("recipe-file: " + c.recipe_file + ": " + e.what());
  }
  return std::make_shared<const lowp::Assignment>(std::move(a));
}

StateFormats state_formats(const TrainConfig& c) {
  StateFormats f;
  f.master = c.master == "remainder" ? MasterFormat::remainder : MasterFormat::fp32;
  const auto [m, v] = moment_pair(c.moments);
  f.m = m;
  f.v = v;
  f.block = c.moment_block;
  return f;
}

}  // namespace mixprec::train
