// Alert rules over the step log of a training run: what a run's numbers say is going
// wrong, in the terms of the seeds (frequent early skips are normal, persistent ones are
// a learning-rate or data problem; a scale that collapses steadily; a loss frozen on a
// plateau while gradients flush to zero; non-finite values already in the forward pass,
// which loss scaling cannot repair; a learning rate that destabilises training with no
// overflow at all). See docs/alerts.md for the rules and the table of thresholds.
//
//   monitor::AlertMonitor m({}, monitor::RunContext::of(config));
//   for each step: for (const Alert& a : m.observe(record)) print(a);   // newly raised
//   m.all();                                                           // for the summary
//
// Each kind is raised at most once per run, at the first step its rule holds; all() keeps
// counting the steps on which it held afterwards (Alert::last_step, Alert::steps). The
// per-tensor kinds (kurtosis-rise, block-spread-rise) are raised at most once per tensor
// (Alert::tensor), each counted on its own. Once the
// run has shown a learning-rate or data problem (persistent-overflow, forward-overflow,
// nonfinite-input, loss-divergence, guarded-skip), the rules that point at the scaler's settings
// (underflow-plateau, scale-pinned) are no longer raised: the underflow then follows from
// that problem.
// observe() keeps a few numbers of the last window of each rule, never the records; its
// cost is a pass over those windows (microseconds against a training step).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/run/config.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/step_record.hpp"

namespace mixprec::monitor {

enum class AlertKind : std::uint8_t {
  persistent_overflow,  // many skipped steps after the warm-up: learning rate or data, not the scaler
  scale_collapse,       // a dynamic scale falling steadily, or overflowing at scale <= 1
  underflow_plateau,    // loss flat while a large fraction of activation gradients flush to zero
  forward_overflow,     // the forward pass produced inf/NaN (loss scaling cannot repair it)
  scale_pinned,         // a dynamic scale stuck below what the gradients allow while values still flush to zero
  nonfinite_input,      // inf/NaN already in the first tensor the data produce (the embedding)
  loss_divergence,      // the loss jumped well above its recent level: learning rate (or a bad batch)
  guarded_skip,         // a step guard refused a step (loss or gradient-norm spike, non-finite loss, skip_if)
  // Per quantized tensor, at its sampled steps (the per-block statistics of the log's fp8 entries):
  kurtosis_rise,        // its values' kurtosis rose far above its own baseline: a few values (outlier features) grow
  block_spread_rise,    // the spread of its blocks' scales (or its far blocks) rose far above its baseline
};

// "persistent-overflow", "scale-collapse", "underflow-plateau", "forward-overflow",
// "scale-pinned", "nonfinite-input", "loss-divergence", "guarded-skip", "kurtosis-rise",
// "block-spread-rise".
std::string_view alert_id(AlertKind k) noexcept;
// Every kind, in the order above.
const std::vector<AlertKind>& alert_kinds();

// Every threshold of every rule, with its default (docs/alerts.md has the table and the
// reasons). Steps are optimizer steps (applied or skipped).
struct AlertThresholds {
  // persistent overflow: more than skip_rate x window of the last `window` steps after
  // the first warmup_steps were skipped.
  std::uint64_t warmup_steps = 20;
  std::uint64_t overflow_window = 50;
  double overflow_skip_rate = 0.2;
  // scale collapse (dynamic scales): over the last collapse_window steps after the
  // warm-up the scale fell by >= 2^collapse_binades with no growth; or a step overflowed
  // with the scale already <= collapse_floor, or the scale went below collapse_floor.
  std::uint64_t collapse_window = 50;
  double collapse_binades = 8;
  double collapse_floor = 1;
  // underflow plateau: over the last plateau_window steps with a finite loss, the mean
  // loss of the last third differs from that of the first third by less than
  // plateau_loss_change (relative), and underflow / nonzero of the activation gradients
  // summed over the window is >= plateau_underflow.
  std::uint64_t plateau_window = 30;
  double plateau_loss_change = 0.01;
  double plateau_underflow = 0.25;
  // scale pinned (dynamic scales, needs telemetry): the scale unchanged and no step
  // skipped for pinned_window steps, the smallest headroom over them >=
  // pinned_headroom_binades, and underflow / nonzero over them >= pinned_underflow.
  std::uint64_t pinned_window = 100;
  double pinned_headroom_binades = 8;
  double pinned_underflow = 0.01;
  // forward overflow / non-finite input: raised at the first step whose loss is not
  // finite; nonfinite-input when the first non-finite activation is one of
  // input_activations (the tensors computed directly from the data), forward-overflow
  // otherwise.
  std::vector<std::string> input_activations{"embedding"};
  // loss divergence: a finite loss above the median of the previous divergence_window
  // finite losses (at least 3 of them) by more than divergence_rise (relative) and more
  // than divergence_nats (absolute).
  std::uint64_t divergence_window = 10;
  double divergence_rise = 0.2;
  double divergence_nats = 0.25;
  // Per quantized tensor, over its sampled steps (fp8 entries with kurtosis / blocks): the
  // baseline is the median of its first tensor_baseline samples. kurtosis rise: a kurtosis >=
  // kurtosis_rise x the baseline and >= kurtosis_min. block-spread rise: the std of the log2
  // block multipliers >= the baseline's + spread_rise_binades, or the far-blocks fraction
  // (far_blocks / blocks) >= the baseline's + far_blocks_rise.
  std::uint64_t tensor_baseline = 3;
  double kurtosis_rise = 4;
  double kurtosis_min = 10;
  double spread_rise_binades = 2;
  double far_blocks_rise = 0.05;

  friend bool operator==(const AlertThresholds&, const AlertThresholds&) = default;
};

// std::invalid_argument "alerts: <field>: expected ..., found ..." for a value no rule can use.
void validate(const AlertThresholds& t);
// Every threshold as (name, value text), in declaration order: the table of docs/alerts.md.
std::vector<std::pair<std::string, std::string>> describe(const AlertThresholds& t);

// What the rules need to know about the run besides its steps.
struct RunContext {
  std::string precision = "fp16";    // a preset of the precision table (nn::precision_names())
  std::string loss_scale = "dynamic";  // TrainConfig::loss_scale: none, dynamic, static:S or a preset
  double lr = 0;                     // peak learning rate (0: unknown; then the largest lr the steps recorded)
  // Who trains the run: the advice names mixprec train's flags, or what a PyTorch loop does.
  train::RunWriter writer = train::RunWriter::engine;
  // The scaler's whole config when known (its overrides: growth_interval, max_scale); else
  // the preset loss_scale names.
  std::optional<LossScaleConfig> loss_scale_config;

  static RunContext of(const train::TrainConfig& c);
};

struct Alert {
  AlertKind kind{};
  std::string id;                // alert_id(kind)
  std::uint64_t step = 0;        // first step the rule held (the alert was raised)
  std::uint64_t last_step = 0;   // last step it held so far
  std::uint64_t steps = 0;       // steps on which it held so far
  std::string message;           // what it means, with the numbers at `step`
  std::string advice;            // what to try
  std::string tensor;            // the per-tensor kinds: the tensor ("h0.mlp.fc.input"); empty otherwise
};

class AlertMonitor {
 public:
  // Throws std::invalid_argument for invalid thresholds, an unknown precision or a
  // loss-scale spec TrainConfig would not accept.
  explicit AlertMonitor(AlertThresholds thresholds = {}, RunContext context = {});

  // Feeds one step (steps must increase); returns the alerts raised at this step.
  std::vector<Alert> observe(const train::StepRecord& r);
  // Every alert raised so far, in the order raised.
  const std::vector<Alert>& all() const noexcept { return alerts_; }

  const AlertThresholds& thresholds() const noexcept { return t_; }
  const RunContext& context() const noexcept { return ctx_; }

 private:
  struct Sample {
    std::uint64_t step;
    double loss;
    bool loss_finite, skipped, injected, forward;
    float scale, next_scale;
    double grad_norm;
    std::uint64_t underflow, nonzero;
    double headroom;  // NaN without telemetry
  };
  // A quantized tensor's sampled statistics so far: its baseline samples, then their medians.
  struct TensorBaseline {
    std::string name;
    std::vector<double> kurtosis, spread, far;  // the first tensor_baseline samples of each
  };
  Alert* find(AlertKind k, std::string_view tensor = {});
  bool run_problem();  // a learning-rate or data alert has been raised
  void hold(AlertKind k, std::uint64_t step, std::vector<Alert>& raised, std::string message, std::string advice,
            std::string tensor = {});
  void hold(AlertKind k, std::uint64_t step, std::string_view tensor = {});
  void observe_tensors(const train::StepRecord& r, std::vector<Alert>& raised);
  // The advice's words for the run's writer: mixprec train's flag, or what a PyTorch loop does.
  std::string_view say(std::string_view engine, std::string_view torch) const noexcept;

  AlertThresholds t_;
  RunContext ctx_;
  bool dynamic_ = false;       // a dynamic loss scale
  bool scaled_ = false;        // any loss scaling (static or dynamic)
  double max_scale_ = 0;       // the dynamic policy's cap (inf: none)
  std::string policy_;         // preset name of the dynamic policy
  std::int64_t growth_interval_ = 0;
  double format_max_ = 0;      // largest finite value of the activation format
  double peak_lr_ = 0;         // ctx_.lr, or the largest lr recorded so far
  std::vector<Alert> alerts_;

  std::uint64_t last_step_ = 0;
  std::deque<Sample> overflow_win_;  // steps after the warm-up, at most overflow_window
  std::uint64_t overflow_skips_ = 0;
  std::deque<Sample> collapse_win_;  // steps after the warm-up, at most collapse_window
  std::uint64_t collapse_growths_ = 0;
  std::deque<Sample> plateau_win_;   // steps with a finite loss, at most plateau_window
  std::uint64_t plateau_underflow_ = 0, plateau_nonzero_ = 0;
  std::deque<double> losses_;        // the last divergence_window finite losses
  std::deque<Sample> pinned_run_;    // the last steps (at most pinned_window) of the current run of
                                     // steps with an unchanged scale and no skip
  std::vector<TensorBaseline> tensors_;  // per quantized tensor with sampled statistics, in log order
};

// Runs an AlertMonitor over a whole log; returns all().
std::vector<Alert> evaluate(std::span<const train::StepRecord> log, const RunContext& context,
                            const AlertThresholds& thresholds = {});

// One alert as a compact JSON object: {"id","step","last_step","steps","message","advice"}, and
// "tensor" for the per-tensor kinds.
std::string alert_json(const Alert& a);
// A JSON array of alerts (compact).
std::string alerts_json(std::span<const Alert> alerts);
// A run's summary.json (train::summary_json) with "alerts": alerts_json added, indented by 2.
std::string summary_with_alerts(std::string_view summary_json, std::span<const Alert> alerts);
// The human line printed during a run: "ALERT step N id: message" and, indented on the
// next line, "try: advice".
std::string alert_text(const Alert& a);

}  // namespace mixprec::monitor
