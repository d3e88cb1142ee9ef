// Everything a training run is configured by, with its defaults (the embedded default
// task), parsed once at the edge (command-line flags and/or a JSON config file) and
// echoed in logs, checkpoints and reports. JSON keys are the long flag names without
// the dashes ("loss-scale", "checkpoint-every", ...); see docs/training.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/core/keys.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/nn/precision.hpp"
#include "mixprec/optim/state_format.hpp"
#include "mixprec/scaler/loss_scale.hpp"

namespace mixprec::train {

struct TrainConfig {
  // model (model.vocab is set from the data; model.seed from `seed`)
  nn::ModelConfig model{};
  nn::Precision precision = nn::Precision::fp16;
  // "none" | "static:S" (S finite, > 0) | "dynamic" (the mixprec preset) | a preset name
  // (mixprec, torch, deepspeed, megatron, apex, keras, tf-keras, jmp, layerwise).
  std::string loss_scale = "dynamic";
  // fp8 presets only (an error with another precision when not at the default):
  std::string fp8_format = "hybrid";           // hybrid (E4M3 forward, E5M2 gradients) | e4m3
  std::size_t fp8_amax_history = 1024;         // fp8-delayed: amax history length
  std::string fp8_amax_algo = "max";           // fp8-delayed: max | most_recent
  std::int64_t fp8_margin = 0;                 // fp8-delayed: scale = fp8_max * 2^-margin / amax; |margin| <= 64
  bool fp8_power2_scales = false;              // fp8-current: scales rounded down to powers of two
  double fp8_amax_epsilon = 0;                 // fp8-current: amax floor (finite, >= 0)
  std::string mx_rounding = "te";              // mxfp8: te | ocp
  // A recipe file (docs/low_precision.md, "Recipe files in the engine"): each block Linear's
  // recipe per GEMM operand and its schedule; with a quantized precision only, whose other
  // fp8 options then stay at their defaults ("" = the precision's own recipe).
  std::string recipe_file;

  // data: the embedded corpus when `data` is empty
  std::string data;
  std::string vocab = "word:1024";             // char | word:N
  std::size_t corpus_tokens = 2'000'000;       // size of the embedded corpus
  double val_fraction = 0.1;                   // held-out tail of the token stream

  // optimisation: AdamW over fp32 master weights (or the low-precision weights in fp16-pure)
  std::string optimizer = "adamw";             // adamw | adam | sgd
  double lr = 3e-3;                            // peak learning rate
  double min_lr = 3e-4;                        // cosine floor
  std::size_t warmup = 10;                     // linear warmup steps
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;                           // max global grad norm; 0 = no clipping
  // optimizer state formats (docs/optimizers.md, "State formats"), Adam and AdamW only:
  std::string master = "fp32";                 // fp32 | remainder (bf16 weights + 16 bits: bf16 presets)
  std::string moments = "fp32";                // fp32 | bf16 | fp16 | fp8 | 8bit | 4bit, or M,V
  std::size_t moment_block = 0;                // elements per scale of fp8/8bit/4bit; 0: 256, 256, 128
  // step guards (docs/spike_guards.md): a step is skipped when its loss or gradient norm
  // is more than Z standard deviations above the mean of the last skip_window steps (0: off)
  double skip_loss_z = 0;
  double skip_grad_z = 0;
  std::size_t skip_window = 128;
  double ema = 0;                              // decay of an EMA of the weights over applied steps; 0 = none
  std::size_t steps = 150;                     // optimizer steps (applied or skipped)
  std::size_t accum = 32;                      // micro-batches per step; loss averaged over all of their tokens
  std::uint64_t seed = 1;                      // weights, batch order, corpus

  // evaluation
  std::size_t eval_every = 50;                 // validation loss every N steps (and at the end); 0 = only at the end
  std::size_t eval_windows = 256;              // validation windows used (0 = the whole split)
  std::size_t histogram_every = 50;            // log2 histograms at step 1, every N steps and the last; 0 = never

  // outputs
  std::string out;                             // run folder: log, checkpoints, summary ("" = none)
  std::size_t checkpoint_every = 0;            // 0 = only the final checkpoint (when `out` is set)
  std::size_t keep_checkpoints = 3;
  std::string resume;                          // run folder to resume from ("" = fresh run)

  // testing: after backward at these steps (1-based), +inf is written into the first
  // gradient element, as if the backward pass had overflowed.
  std::vector<std::size_t> inject_overflow_at;
  std::string inject_overflow_tensor;          // testing: the parameter it writes into ("" = the first)
  // testing: these steps (1-based) draw a bad batch of kind inject_bad_batch: "labels"
  // (every target replaced by a random token) or "scaled" (the loss gradient times 1000);
  // one kind for every step, or a comma-separated kind per step.
  std::vector<std::size_t> inject_bad_batch_at;
  std::string inject_bad_batch = "labels";
  // testing: at these steps a fault in one stored tensor: "forward:NAME" writes NaN into
  // activation NAME as the forward pass stores it, "backward:NAME" +inf into activation
  // gradient NAME (the names the run log's forward_nonfinite / overflow_activation use).
  std::vector<std::size_t> inject_fault_at;
  std::string inject_fault;
  unsigned threads = 0;                        // 0 = all cores (MIXPREC_THREADS / OMP_NUM_THREADS respected)

  // data parallelism over the ranks of a communicator (docs/distributed.md)
  bool distributed = false;                    // each rank runs `accum` micro-batches of a global batch of accum * ranks
  unsigned zero = 0;                           // 1: ZeRO stage 1, master weights and optimizer state sharded
  std::string grad_reduce = "fp32";            // fp32 | low (f16/bf16 all-reduce of the scaled gradients)
  double dist_timeout = 120;                   // seconds a collective may take before the job is aborted
  std::int64_t inject_overflow_rank = -1;      // testing: the rank inject-overflow-at writes on; -1 = every rank

  friend bool operator==(const TrainConfig&, const TrainConfig&) = default;
};

// Every key's range (the key table), then the rules across keys. Throws
// std::invalid_argument: "<key>: expected <allowed>, found <value>".
void validate(const TrainConfig& c);

// The loss scale a `loss-scale` value names: nullopt for "none", the mixprec preset for
// "dynamic", the static preset at S for "static:S", else the named preset.
// std::invalid_argument as validate gives it for any other text.
std::optional<LossScaleConfig> loss_scale_config(const std::string& spec);

// inject_bad_batch's kinds, split at commas ("labels,scaled" -> labels, scaled).
std::vector<std::string> bad_batch_kinds(const std::string& text);
// The optimizer state formats of c (validated by validate()).
StateFormats state_formats(const TrainConfig& c);
// The fp8 recipe options of c (validated by validate()).
nn::Fp8Config fp8_config(const TrainConfig& c);
// The recipe file of c (recipe-file) read (lowp::read_assignment) and checked against c's
// model and steps (nn::check_recipes); null when c has none. std::invalid_argument
// "recipe-file: ..." naming the file and the field.
std::shared_ptr<const lowp::Assignment> recipe_assignment(const TrainConfig& c);
// The config keys of the fp8 recipe options ("fp8-format", ..., "mx-rounding", "recipe-file"):
// those of the key table that apply to some precisions only.
const std::vector<std::string>& fp8_keys();
// Whether fp8 option `key` is used by precision p (validate refuses it set otherwise).
bool fp8_key_applies(std::string_view key, nn::Precision p);
// c with every fp8 option that precision p does not use back at its default (compare's rows).
TrainConfig with_fp8_options_for(TrainConfig c, nn::Precision p);

// JSON config text (an object of flag names) applied on top of `base`; unknown keys,
// wrong types and values out of a key's range are errors naming `source` and the key.
// Numbers as JSON writes them; an integer key takes a whole number written as a float
// (12.0, 2e5). Does not validate cross-field constraints (call validate).
TrainConfig apply_json(const TrainConfig& base, std::string_view json_text, std::string_view source);
// The whole config as one JSON object (the same keys), for logs, reports, checkpoints.
std::string to_json(const TrainConfig& c, int indent = -1);
// Only `keys` (in the table's order): the config.json of a run another front end trained
// (libtorch, Python), which holds the keys that describe it. std::invalid_argument for an
// unknown key.
std::string to_json(const TrainConfig& c, const std::vector<std::string_view>& keys, int indent = -1);

// ---- the key table ------------------------------------------------------------------------
// One entry per TrainConfig key, in to_json's order: the CLI's flags (--NAME), the JSON
// config's keys, `mixprec compare`'s flags and resume's comparison are all derived from it.
// Each key's kind, range and allowed values are its keys::Spec (core/keys.hpp), the
// description every config shares (docs/configuration.md).

// How a key is written on the command line: integer (N), number (X), text, list
// (comma-separated integers), boolean (--KEY [true|false], alone: true), flag (--KEY).
enum class KeyKind : std::uint8_t { integer, number, text, list, boolean, flag };

struct ConfigKey {
  std::string_view name;  // the JSON key; the flag is --name
  KeyKind kind = KeyKind::text;
  std::string_view type;  // the value in the help: N, X, NAME, ...
  std::string_view help;
  // A resumed run may give it another value (steps may extend the run; the data file
  // may move; the distribution may change: docs/distributed.md). Every other key must
  // repeat the run's own value.
  bool resume_may_change = false;
  // `mixprec compare` sets it per row (precision, loss-scale, out) or does not use it:
  // compare has no flag for it.
  bool compare_sets = false;
  // The precisions that use the key (bit 1 << Precision), 0 for all of them: the fp8
  // recipe options, which validate refuses away from their default elsewhere.
  std::uint32_t only_for = 0;
  // Kind, range, allowed values and doc line, as the key table reads and checks the key.
  const keys::Spec* spec = nullptr;
};

constexpr std::uint32_t precision_bits(std::initializer_list<nn::Precision> ps) {
  std::uint32_t bits = 0;
  for (const nn::Precision p : ps) bits |= 1u << static_cast<unsigned>(p);
  return bits;
}

const std::vector<ConfigKey>& config_keys();
// nullptr for an unknown name.
const ConfigKey* find_config_key(std::string_view name);
// Sets `key` from its command-line text in the number grammar of every key
// (keys::parse_number, parse_integer; booleans true, false, 1, 0; lists comma-separated).
// std::invalid_argument, c unchanged, when the key is unknown, the text is no value of the
// key's kind ("found 'TEXT'") or the value is out of the key's range ("found VALUE", as a
// config file's value is named). Rules across keys are validate()'s.
void set_config_key(TrainConfig& c, std::string_view key, std::string_view text);
// The value of `key` in c as command-line text ("" for an empty text; lists joined
// with commas): for defaults in the help and for messages.
std::string config_key_text(const TrainConfig& c, std::string_view key);

}  // namespace mixprec::train
