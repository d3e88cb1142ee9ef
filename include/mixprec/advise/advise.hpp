// The precision advisor (docs/advisor.md): from tensors of linear layers sampled during real
// steps, measure what every candidate format does to each tensor role, model what each
// candidate costs, and choose per layer the cheapest candidate whose error stays within the
// budget; the choice is written as the recipe file mixprec.torch.low_precision reads.
//
//   std::vector<advisor::SampleView> samples = ...;        // or read_samples(run_dir)
//   advisor::Advice a = advisor::advise(samples, advisor::AdviseConfig{});
//   advisor::recipe_file_json(a);   // {"format": "mixprec.low_precision", "version": 1, ...}
//   advisor::directional_recipe_file_json(a);  // a format per GEMM direction, the late forward switch
//   advisor::advice_json(a);        // every measurement behind the choice (the report reads it)
//
// Every quantization is the core's own: lowp::quantize + lowp::dequantize for the six
// low-precision recipes, the counted fp16 / bf16 conversions (formats/bulk.hpp) for fp16 at
// the run's loss scale and bf16. This module only measures, models and chooses; the two front
// doors (mixprec.torch.advise, `mixprec advise RUN_DIR`) hand it samples and print its result.
// Errors: std::invalid_argument naming the field, what was expected and what was found.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/lowp/quantize.hpp"

namespace mixprec::monitor::advisor {

// The tensor roles of a linear layer y = x W^T: its input, its weight, the gradient of its
// output (dy) and its weight gradient (dW).
enum class Role : std::uint8_t { x, w, dy, dw };
inline constexpr std::size_t kRoles = 4;
std::string_view role_name(Role r) noexcept;  // "x", "w", "dy", "dw"
std::optional<Role> parse_role(std::string_view s) noexcept;

// The candidates, cheapest last in no particular order: one table (candidate_table()) names
// them for every door. The six low-precision ones are lowp's recipes.
enum class Candidate : std::uint8_t { bf16, fp16, fp8_delayed, fp8_current, mxfp8, fp8_block, nvfp4, mxfp4 };
inline constexpr std::size_t kCandidates = 8;

// How a candidate stores one operand and how fast its GEMMs run: the cost model's row
// (docs/advisor.md states the defaults and where they come from). Overridable per candidate.
struct CostRow {
  double tflops = 0;            // dense GEMM rate, TFLOP/s
  double element_bits = 0;      // bits per stored element
  double scale_bits = 0;        // scale bits per element of 1-D blocks (x, dy)
  double weight_scale_bits = 0; // scale bits per element of the weight (2-D tiles where the recipe has them)
  bool amax_pass = false;       // an extra read of the high-precision operand for its amax (current scaling)
  bool quantized = false;       // a quantization pass (read high precision, write the quantized copies)
  friend bool operator==(const CostRow&, const CostRow&) = default;
};

struct CandidateInfo {
  Candidate candidate;
  std::string_view name;               // "bf16", "fp16", then lowp's recipe names
  std::optional<lowp::Recipe> recipe;  // the lowp recipe (none for bf16, fp16)
  CostRow cost;                        // the default cost row
  std::string_view summary;
};
std::span<const CandidateInfo> candidate_table() noexcept;
const CandidateInfo& candidate_info(Candidate c) noexcept;
std::string_view candidate_name(Candidate c) noexcept;
std::optional<Candidate> parse_candidate(std::string_view s) noexcept;
std::string candidate_names();  // "bf16, fp16, fp8-delayed, ..."

// What quantizing one tensor (or the pooled samples of one layer and role) in one candidate
// did. Only the finite inputs are measured: an inf / NaN input (an overflowed gradient, a
// diverged weight) is counted in `nonfinite` and quantized as a zero, so that it sets no scale
// and no amax. rel_rms_error = sqrt(sum (q - x)^2 / sum x^2) over the finite inputs (inf when a
// finite input became inf, 0 for an all-zero tensor, NaN when no input is finite: nothing was
// measured); saturated: finite inputs clamped (or, fp16 / bf16, that overflowed to inf) /
// finite inputs; flushed: finite nonzero inputs that became zero / finite nonzero inputs;
// headroom_log2: log2(largest finite of the format at the scale used / amax) for candidates
// with one scale per tensor (bf16, fp16 at the loss scale, fp8-delayed, fp8-current, nvfp4's
// tensor scale), NaN for the block-only recipes (mxfp8, fp8-block, mxfp4), whose scales follow
// each block's amax. Pooled over samples: the error from the summed squares, fractions from the
// summed counts, the smallest headroom, the largest per-sample error.
struct Measurement {
  double rel_rms_error = 0;
  double worst_rel_rms_error = 0;  // the largest over the pooled samples
  double saturated = 0;
  double flushed = 0;
  double headroom_log2 = 0;
  float amax = 0;                  // over the finite inputs
  std::uint64_t elements = 0;
  std::uint64_t nonzero = 0;      // finite nonzero inputs
  std::uint64_t nonfinite = 0;    // inf / NaN inputs (left out of the measurement)
  std::uint64_t samples = 0;
  // The sums behind the pooled values.
  double err_sq = 0, ref_sq = 0;
  std::uint64_t saturated_count = 0, flushed_count = 0;
};

// How a candidate quantizes one role (the recipe's defaults, as mixprec.torch.low_precision
// and Transformer Engine apply them): the lowp configuration, or nullopt for bf16 / fp16.
// fp8-delayed / fp8-current use E5M2 for dy (TE's HYBRID format), the other fp8 recipes E4M3;
// fp8-block and nvfp4 quantize the weight in 2-D tiles; every role rowwise, round to nearest.
std::optional<lowp::QuantizeConfig> role_config(Candidate c, Role r);

// Quantizes one [rows, cols] tensor in candidate c for role r and measures it. loss_scale:
// fp16 multiplies by it before the conversion and divides after (the values are unscaled);
// delayed_scale: the fp8-delayed scale to use. Values are taken as they are (unscaled).
Measurement measure(std::span<const float> values, std::size_t rows, std::size_t cols, Candidate c, Role r,
                    float loss_scale = 1.0f, float delayed_scale = 1.0f);

// One sampled tensor: the values (unscaled: a scaled gradient divided by the loss scale) of one
// role of one layer at one step, [rows, cols] row-major. rows_total: the rows of the whole
// tensor when only some were sampled (tokens, for the cost model); 0 = rows.
struct SampleView {
  std::string_view layer;
  Role role = Role::x;
  std::uint64_t step = 0;
  float loss_scale = 1.0f;  // the run's loss scale at that step (fp16's candidate quantizes at it)
  std::size_t rows = 0, cols = 0;
  std::size_t rows_total = 0;
  std::span<const float> values;
};

// The bound a candidate must stay within for every chosen role. The defaults are calibrated
// so that Gaussian tensors pass in NVFP4 as Transformer Engine runs it and not in MXFP4 (the
// field's finding: NVFP4 trains most layers, MXFP4 worse; docs/advisor.md, "Budget"): on
// Gaussian data NVFP4's error is 0.095 for x and dy and 0.112 for a weight in 16x16 tiles,
// MXFP4's 0.116; NVFP4's E4M3 block scales round down and clamp about 3% of such values by
// less than one E2M1 step, and E2M1 flushes 6.8% (MXFP4 10.8%): the fraction bounds sit well
// above a format's normal rounding and catch a range that does not fit (flushing, a stale
// fp8 scale).
struct Budget {
  std::array<double, kRoles> max_rel_rms_error = {0.1, 0.125, 0.1, 0.1};  // x, w, dy, dW
  double max_saturated = 0.1;
  double max_flushed = 0.25;
  std::array<bool, kRoles> roles = {true, true, true, false};  // dW is measured, not required
  friend bool operator==(const Budget&, const Budget&) = default;
};

struct CostModel {
  std::array<CostRow, kCandidates> rows{};  // by Candidate; the table's defaults
  double bandwidth_gbs = 8000;               // memory bandwidth, GB/s
  double activation_bits = 16;               // the high-precision activations (bf16)
  CostModel();
  friend bool operator==(const CostModel&, const CostModel&) = default;
};

// Which layers get the late forward switch (docs/advisor.md, "Per GEMM direction and in time"):
// those whose proposed forward is an fp4 recipe (nvfp4, mxfp4: the NVFP4 pretraining paper's
// case), every quantized forward, none, or those whose forward error uses more than
// `budget_share` of a required forward role's bound.
enum class LateSwitchWhen : std::uint8_t { fp4, always, never, budget_share };
std::string_view late_switch_when_name(LateSwitchWhen w) noexcept;  // "fp4", "always", "never", "budget_share"
std::optional<LateSwitchWhen> parse_late_switch_when(std::string_view s) noexcept;
std::string late_switch_when_names();  // "fp4, always, never or budget_share"

struct LateForwardSwitch {
  double from_fraction = 0.8;  // in [0, 1): the forward runs bf16 for the last (1 - f) of the run
  LateSwitchWhen when = LateSwitchWhen::fp4;
  double budget_share = 0.5;   // when == budget_share: the share of a bound, in [0, 1]
  friend bool operator==(const LateForwardSwitch&, const LateForwardSwitch&) = default;
};

struct AdviseConfig {
  std::vector<Candidate> candidates;  // empty: every candidate of the table
  Budget budget;
  CostModel cost;
  // fp8-delayed: TE's DelayedScaling defaults (amax history over the sampled steps).
  std::size_t amax_history_len = 1024;
  int margin = 0;
  // Per layer, a forward and a backward candidate besides the single choice (false: the
  // single choice in both directions).
  bool directions = true;
  LateForwardSwitch late_forward_switch;
};
// Parses a JSON object of config keys (docs/advisor.md, "Configuration"): candidates, budget
// (a number for every role, or an object: x, w, dy, dw, max_saturated, max_flushed, roles),
// cost (bandwidth_gbs, activation_bits, candidates: {name: {tflops, element_bits, ...}}),
// amax_history_len, margin, directions (true / false), late_forward_switch ({from_fraction,
// when, budget_share}). Unknown keys and wrong types are errors; `source` names the text.
AdviseConfig parse_config(std::string_view json, std::string_view source = "config");
std::string config_json(const AdviseConfig& c);

// The three GEMMs of a linear layer's training step: fprop y = x w^T, dgrad dx = dy w,
// wgrad dW = dy^T x.
enum class Gemm : std::uint8_t { fprop, dgrad, wgrad };
inline constexpr std::size_t kGemms = 3;
std::string_view gemm_name(Gemm g) noexcept;  // "fprop", "dgrad", "wgrad"

// The modeled time of one GEMM of a layer [tokens, in] x [out, in]^T in candidate c: its
// 2 tokens in out FLOPs at the candidate's rate, plus at the bandwidth the bytes of its two
// operand uses (each use: one read of the stored operand, and half of the operand's producer
// write and amax pass, which its two uses share) and of its output (docs/advisor.md, "Cost
// model"). Seconds.
double gemm_cost(const CostModel& m, Candidate c, Gemm g, std::size_t tokens, std::size_t in, std::size_t out);
// The modeled time of one training step of a linear layer: its three GEMMs' gemm_cost,
// fprop + (dgrad + wgrad) (forward plus backward, as the directional proposal sums a pair, so
// that a candidate's pair costs exactly this). Seconds.
double layer_cost(const CostModel& m, Candidate c, std::size_t tokens, std::size_t in, std::size_t out);

// The directional proposal of one layer (docs/advisor.md, "Per GEMM direction and in time"):
// the forward candidate runs fprop, the backward candidate dgrad and wgrad. The forward must be
// within the budget on the required forward roles (x, w), the backward on every required role
// (dy, and the x and w the backward GEMMs read: the same measurements); the pair is the
// cheapest (fprop at the forward's cost + dgrad and wgrad at the backward's) that
// lowp::plan accepts. Equal to the single choice where no split is cheaper.
struct DirectionAdvice {
  std::optional<Candidate> forward, backward;  // both or neither (no proposal: the layer stays bf16)
  double cost_forward = 0;   // gemm_cost of fprop in `forward` (seconds)
  double cost_backward = 0;  // gemm_cost of dgrad + wgrad in `backward`
  double saving = 0;         // the single choice's layer_cost minus cost_forward + cost_backward (>= 0)
  std::string reason;
  // Cheapest first: forward candidates beyond the budget ("forward mxfp4: x error 0.12 > 0.1"),
  // backward ones ("backward nvfp4: dy error 0.3 > 0.1"), and cheaper pairs within the budget
  // that lowp::plan refuses ("fp8-delayed / mxfp8: dgrad.dy: fp8-delayed keeps one amax ...").
  std::vector<std::string> rejected;
  bool proposed() const noexcept { return forward.has_value() && backward.has_value(); }
  double cost() const noexcept { return cost_forward + cost_backward; }
};

// The late forward switch of one layer (the NVFP4 pretraining paper, arXiv 2509.25149,
// Appendix D): fprop in bf16 from `from_fraction` of the run on.
struct LateSwitchAdvice {
  double from_fraction = 0.8;
  // The extra modeled time: (1 - from_fraction) x (fprop in bf16 - fprop in the forward
  // candidate), seconds per step averaged over the run; Advice::cost_directional is the run's.
  double extra_cost = 0;
  std::string reason;  // the rule that proposed it, the forward roles' errors against their bounds, the cost
};

// The choice for one layer and the measurements behind it.
struct LayerAdvice {
  std::string layer;
  std::size_t tokens = 0, in = 0, out = 0;     // the GEMM shape the cost is modeled at
  std::array<bool, kRoles> sampled{};           // which roles were measured: had a sample holding a finite value
  // Per role, the samples that held no finite value (every value inf or NaN: a step whose
  // gradients overflowed, a diverged weight). Such a sample is not a measurement: it is left
  // out (of the pooled measurement and of fp8-delayed's amax history). A role with samples, all
  // of them left out, is "not measured"; a required one leaves the layer without a recommendation.
  std::array<std::uint64_t, kRoles> unmeasured{};
  // measurements[candidate][role], for the configured candidates and measured roles
  std::array<std::array<Measurement, kRoles>, kCandidates> measurements{};
  std::array<double, kCandidates> cost{};       // layer_cost per candidate (seconds)
  std::array<std::array<double, kGemms>, kCandidates> gemm_cost{};  // [candidate][gemm]: gemm_cost
  std::optional<Candidate> chosen;              // nullopt: no candidate within the budget
  std::string reason;                           // one sentence per decision
  std::vector<std::string> rejected;            // "mxfp4: dy error 0.141 > 0.1", cheapest first
  DirectionAdvice directions;                   // forward and backward (the single choice in both when equal)
  std::optional<LateSwitchAdvice> late_switch;  // the forward to bf16 late in the run, where proposed
};

struct Advice {
  AdviseConfig config;
  std::vector<Candidate> candidates;   // the ones measured, table order
  std::vector<LayerAdvice> layers;     // in the order the samples first named them
  std::uint64_t first_step = 0, last_step = 0, steps = 0;  // the sampled steps
  double cost_chosen = 0;              // sum of the layers' chosen costs (bf16 where none fits)
  double cost_bf16 = 0;                // the same, all layers bf16
  double cost_directional = 0;         // sum of the layers' directional costs (bf16 where none)
  double cost_late_switch = 0;         // sum of the late switches' extra_cost (seconds per step, over the run)
};

// Measures every sample in every configured candidate, pools them per layer and role, and
// chooses. Samples of a layer and role are taken in step order (fp8-delayed's amax history
// runs over them: the scale of a sample comes from the earlier samples' amaxes, the first
// from its own, a warmed-up history). A sample without a finite value is left out
// (LayerAdvice::unmeasured); a layer with a required role not measured gets no choice. A layer
// needs a weight sample (its shape) and an x sample (its tokens). std::invalid_argument for
// inconsistent samples (shapes that disagree).
Advice advise(std::span<const SampleView> samples, const AdviseConfig& config);

// The evidence (every measurement, cost, choice and reason) as JSON, and back (the report).
std::string advice_json(const Advice& a);
Advice parse_advice_json(std::string_view json, std::string_view source = "advice.json");

// The recipe file of the choice (docs/low_precision.md, "The recipe file"): format
// "mixprec.low_precision", version 1, default "bf16", modules {layer: recipe name | "bf16"}.
// A layer whose choice is fp16, that has none within the budget or that was not measured is
// written "bf16" (not quantized); notes says which and why.
inline constexpr std::string_view kRecipeFileFormat = "mixprec.low_precision";
inline constexpr int kRecipeFileVersion = 1;
std::string recipe_file_json(const Advice& a);
// The recipe file of the directional proposal (docs/advisor.md, "Per GEMM direction and in
// time"): modules {layer: forward name | {"recipe": forward, "dgrad": backward, "wgrad":
// backward}} ("bf16" for bf16, fp16 and a layer without a proposal), and, when a layer has a
// late switch, one schedule phase {"from_fraction": f, "modules": [layers], "fprop": "bf16",
// "label": "forward to bf16 (advisor)"}. lowp::parse_assignment reads it.
inline constexpr std::string_view kLateSwitchLabel = "forward to bf16 (advisor)";
std::string directional_recipe_file_json(const Advice& a);

// A text table: layer, shape, choice ("not measured" where a required role was not), cost
// against bf16, the chosen candidate's error per role ("n/m": not measured, "-": no samples),
// then a line per role that was not measured or had inf / NaN values left out; then, with
// directions on or a late switch proposed, a table per layer of the forward / backward
// proposal, its cost against the single choice and the late forward switch with its cost.
std::string advice_table(const Advice& a);

// ---- samples in a run folder (docs/run_folder.md, "Advisor samples") ----------------------
// RUN_DIR/samples/step-NNNNNNNN/index.json lists the tensors of one sampled step, each a
// float32 .npy file next to it (t000.npy, ...): {"format": "mixprec.advisor_samples",
// "version": 1, "step": N, "loss_scale": S, "tensors": [{"layer", "role", "file", "rows_total"}]}.
struct OwnedSample {
  std::string layer;
  Role role = Role::x;
  std::uint64_t step = 0;
  float loss_scale = 1.0f;
  std::size_t rows = 0, cols = 0, rows_total = 0;
  std::vector<float> values;
  SampleView view() const;
};
// Writes one step's samples (files first, index.json last, each replaced atomically), so a
// reader sees a step whole or not at all. All samples must have `step`.
void write_step_samples(const std::filesystem::path& run_dir, std::uint64_t step, float loss_scale,
                        std::span<const SampleView> samples);
// Reads every step folder that has an index.json, in step order. std::runtime_error naming
// the file for a malformed index or tensor.
std::vector<OwnedSample> read_samples(const std::filesystem::path& run_dir);
std::filesystem::path samples_dir(const std::filesystem::path& run_dir);

}  // namespace mixprec::monitor::advisor
