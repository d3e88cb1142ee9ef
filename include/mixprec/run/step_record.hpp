// The run layer: what every writer of a run folder shares, below the engine's Trainer,
// the telemetry recorder of other training loops (train::TelemetryRecorder) and the
// monitor (alerts, report, scaler simulation), which all read or write these types:
//   - StepRecord, what one optimizer step did (one line of log.jsonl), and TrainSummary;
//   - RunTotals, the one accumulator of a run's summary figures, step by step;
//   - histogram_step, the one rule for the steps that take log2 histograms;
//   - measure_amax, the one measurement of StepRecord::ParamStats (|max| per tensor).
// It sits in the run layer, below train/, report/ and advise/, which all read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mixprec/core/parallel.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/dtype.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/scaler/step_guard.hpp"

namespace mixprec::train {

// What one optimizer step did (one JSONL line of the run log).
struct StepRecord {
  std::uint64_t step = 0;        // 1-based
  double lr = 0;                 // learning rate of this step
  double loss = 0;               // mean training loss over the step's tokens (unscaled)
  bool loss_finite = true;       // false: the forward pass produced inf/NaN (loss scaling cannot repair this)
  std::string forward_nonfinite; // first activation that went non-finite, when !loss_finite
  float scale = 1;               // loss scale the gradients carried
  float next_scale = 1;          // loss scale after the update
  bool found_inf = false;        // inf/NaN among the gradients
  bool skipped = false;          // no optimizer update this step
  SkipReason skip_reason = SkipReason::none;  // why (docs/spike_guards.md); none when applied
  // The guards' z-scores (NaN while the window fills or with no spike guard on).
  double loss_z = std::numeric_limits<double>::quiet_NaN();
  double grad_z = std::numeric_limits<double>::quiet_NaN();
  bool injected = false;         // a testing injection (--inject-overflow-at, --inject-bad-batch-at) hit this step
  double grad_norm = 0;          // global norm of the unscaled gradients (NaN when skipped)
  float clip_coef = 1;
  std::string overflow_param;    // first parameter gradient holding inf/NaN
  std::string overflow_activation;  // first activation gradient whose fp16/bf16 store overflowed
  ConversionStats act_grads;     // what rounding did to activation gradients this step
  double lost_update_fraction = 0;  // of parameters the optimizer meant to change, those whose stored weights did not
  std::uint64_t tokens = 0;      // tokens processed this step
  double seconds = 0;            // wall time of the whole step
  double scaler_seconds = 0;     // of which check + unscale + clip + optimizer step + scale update
  std::optional<double> val_loss;  // when this step evaluated
  std::optional<double> val_loss_ema;  // ... and with --ema, the EMA weights' validation loss
  // --recipe-file: the labels of the schedule's phases that begin at this step (", " between
  // several); empty on every other step (the log writes it only when set).
  std::string recipe_phase;

  // Telemetry (docs/telemetry.md).
  float act_grad_amax = 0;       // largest |activation gradient| before rounding, scaled domain (inf if non-finite)
  double headroom_log2 = 0;      // log2(activation format max / act_grad_amax): binades left before overflow
  std::vector<nn::TensorGradStats> act_grad_tensors;  // per activation-gradient tensor
  struct ParamStats {
    std::string name;
    float grad_amax = 0;    // unscaled |gradient| max (inf/NaN -> inf)
    float weight_amax = 0;  // |weight| max of the weights of record after the step
  };
  std::vector<ParamStats> params;
  // At histogram steps (histogram_step): log2-magnitude histograms.
  struct Histograms {
    nn::Log2Histogram activations, activation_grads;  // before rounding; activation grads in the scaled domain
    nn::Log2Histogram weight_grads;                   // unscaled
    nn::Log2Histogram weights;                        // weights of record
  };
  std::optional<Histograms> histograms;
  // fp8 presets: per fp8 tensor of the Linear layers, this step's quantization (docs/telemetry.md).
  std::vector<nn::Fp8TensorStats> fp8;
  // Preset layerwise: per scaled layer, the factor it applied this step, the factor its
  // weight gradient carried above the base scale (chain), its backoffs before the step and
  // what happened to it (docs/loss_scaling.md, "Per-layer loss scaling").
  struct LayerScale {
    std::string name;
    double factor = 1;
    double chain = 1;
    std::int64_t backoff = 0;
    std::string outcome;  // "applied", "origin", "victim"
  };
  std::vector<LayerScale> layers;
  // Optimizer state formats (--master, --moments), at histogram steps the optimizer applied:
  // per tensor, measured inside its fused step (optim/state_format.hpp's AdamStepStats), the
  // moments' relative quantization error after the step (NaN: not finite) and the lost updates.
  struct StateStats {
    std::string name;
    double m_error = 0, v_error = 0;
    std::uint64_t meant = 0, lost = 0;
  };
  std::vector<StateStats> optimizer_state;
};

// Why r was skipped, as every reader counts it: its skip_reason, or for a skipped record
// that gives none (a writer before the step guards, a test's record) nonfinite_grad, the one
// reason there was; none for an applied step.
inline SkipReason skip_reason_of(const StepRecord& r) noexcept {
  if (!r.skipped) return SkipReason::none;
  return r.skip_reason == SkipReason::none ? SkipReason::nonfinite_grad : r.skip_reason;
}

// One tensor's optimizer-state measurements over a run's sampled steps (StepRecord::StateStats).
struct StateTotals {
  std::string name;
  std::uint64_t m_steps = 0, v_steps = 0;  // steps with a finite error
  double m_error_sum = 0, m_error_max = 0, v_error_sum = 0, v_error_max = 0;
  std::uint64_t meant = 0, lost = 0;
};

// summary.json's "optimizer_state" of a run with state formats: the formats, the bytes the store
// allocated per parameter, and per tensor its elements, its formats as stored (blocked formats
// fall back to fp32 for small tensors) and its totals.
struct OptimizerStateSummary {
  std::string optimizer;
  std::string master, m, v, rule;
  std::size_t block = 0;
  bool fp8_per_tensor = false;
  std::uint64_t elements = 0;
  double params_bytes = 0, master_bytes = 0, m_bytes = 0, v_bytes = 0;  // per parameter
  std::uint64_t sampled_steps = 0;
  struct Tensor {
    std::uint64_t elements = 0;
    std::string master, m, v;
    StateTotals totals;
  };
  std::vector<Tensor> params;
};

// A run's figures (summary.json, train::summary_json; the report's summary table).
struct TrainSummary {
  std::uint64_t steps = 0, applied = 0, skipped = 0;
  std::uint64_t skipped_by[kSkipReasons] = {};  // skipped steps by SkipReason (index none: 0)
  double final_loss = 0;             // last step's training loss
  std::optional<double> val_loss;    // last evaluation
  std::optional<double> val_loss_ema;  // last evaluation of the EMA weights (--ema)
  float final_scale = 1;
  double underflow_fraction = 0;     // activation-gradient elements flushed to zero / all nonzero ones, whole run
  double subnormal_fraction = 0;     // ... left subnormal
  double lost_update_fraction = 0;   // mean over applied steps
  // fp8 presets, whole run: of the nonzero values quantized to fp8, the fraction clipped by
  // the saturating cast / flushed to zero; forward tensors (inputs, weights) and backward
  // tensors (output gradients) apart. 0 for other presets.
  double fp8_forward_saturated_fraction = 0, fp8_forward_flushed_fraction = 0;
  double fp8_backward_saturated_fraction = 0, fp8_backward_flushed_fraction = 0;
  double seconds = 0;                // training time (steps), excluding evaluation
  double mean_step_ms = 0;           // median would hide the tail: both are in the log
  double median_step_ms = 0;
  std::uint64_t tokens = 0;
  nn::ModelMemory memory;
  std::size_t param_count = 0;
  int ranks = 1;                     // data-parallel ranks of this process's run
  std::optional<OptimizerStateSummary> optimizer_state;  // runs with state formats
};

// The counters behind a TrainSummary, added step by step: by the Trainer (and saved in
// its checkpoints, so a resumed run reports the whole run), by the telemetry recorder,
// and by the report over a log it read (an interrupted run without summary.json has its
// figures too).
struct RunTotals {
  std::uint64_t steps = 0, applied = 0, skipped = 0, tokens = 0;
  std::uint64_t skipped_by[kSkipReasons] = {};  // by SkipReason
  ConversionStats act_grads;
  // fp8 tensors, per role (0 forward, 1 backward): nonzero, saturated, flushed values.
  std::uint64_t fp8_nonzero[2] = {0, 0}, fp8_saturated[2] = {0, 0}, fp8_flushed[2] = {0, 0};
  double lost_update_sum = 0;            // over applied steps with a finite fraction (a log may hold null)
  std::uint64_t lost_update_steps = 0;   // those steps (the Trainer's fractions are always finite: its applied)
  double seconds = 0;                    // of the steps with a finite time
  double final_loss = 0;                 // the last step's loss as recorded
  bool final_loss_finite = false;        // ... and its loss_finite
  std::optional<double> val_loss;        // last evaluation
  std::optional<double> val_loss_ema;    // last evaluation of the EMA weights
  float final_scale = 1;                 // the last step's next_scale
  std::vector<double> step_ms;           // this process's step times (the median; not in checkpoints)
  std::uint64_t state_steps = 0;         // steps that measured the optimizer state
  std::vector<StateTotals> optimizer_state;  // per tensor, in the order the steps gave them

  void add(const StepRecord& r);
  // Every figure counted here; memory, param_count and ranks stay as default (the
  // writer's own), final_loss is the last recorded loss (0 before the first step).
  TrainSummary summary() const;
  // The last step's loss as the report and the telemetry summary show it: NaN when it
  // was not finite or there was no step.
  double shown_final_loss() const noexcept;
};

// What a quantized tensor's sampled statistics (nn::Fp8TensorStats::blocks, kurtosis and
// what_if) must hold, checked wherever they come in (the run log's reader, the telemetry
// recorder): the first field that does not, named within the tensor's entry
// ("blocks.far_blocks", "what_if[1].flushed"), with its rule and the value found; nullopt
// when all hold (or none is there).
struct FieldProblem {
  std::string field, rule;
  double found = 0;
};
std::optional<FieldProblem> sampled_stats_problem(const nn::Fp8TensorStats& t);

// Whether step (1-based) takes log2 histograms: step 1, every `every`-th, and the last
// (`last_step`; 0 when the writer does not know it); never when every is 0.
bool histogram_step(std::uint64_t step, std::size_t every, std::uint64_t last_step = 0) noexcept;

// What StepRecord::ParamStats holds, for many tensors at once: out[i] = max |views[i] x
// scale| (grad_amax: scale = 1 / loss scale; weight_amax: 1), 0 for an empty view (size
// 0 or no data), +inf for one holding inf/NaN or whose product overflowed. One read-only
// pass of the core's multi-tensor kernel (unscale_and_check, nothing written) on `pool`'s
// threads (nullptr: the calling thread). `scale` must pass can_unscale; out.size() ==
// views.size().
void measure_amax(std::span<const GradTensor> views, float scale, std::span<float> out, ThreadPool* pool = nullptr);

}  // namespace mixprec::train
