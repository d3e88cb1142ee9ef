// train::TelemetryRecorder: the run folder of a training loop that mixprec does not run
// (a libtorch or PyTorch model), written in the schema of `mixprec train --out`
// (docs/run_folder.md), so that `mixprec report`, the alerts and `mixprec scaler simulate`
// read it as they read one of mixprec's own runs. One implementation behind both front
// ends: mixprec::torch::Telemetry (C++, include/mixprec/torch/telemetry.hpp) and
// mixprec.torch.Telemetry (Python, docs/python.md) only turn their tensors into
// GradTensor views and call this.
//
//   train::TelemetryRecorder rec("runs/x", {.precision = "fp16", .loss_scale = "torch"});
//   during backward:   rec.count_activation_grad("h0.mlp", view_of(grad));   // any thread
//   during forward:    rec.check_activation("h0.mlp", view_of(output));      // optional
//   after the step:    rec.record(step, params);    // one log line; resets the step's counts
//   at the end:        rec.finish();                // summary.json with the run's alerts
//
// Counting an activation gradient means counting what converting it, as it is (scaled
// domain), to fp16 with the core's counted conversion (convert_counted) would report: for
// an fp16 gradient its zeros and subnormals as stored (underflow is 0: it is fp16
// already), for fp32 and bf16 what fp16 would flush or overflow at the current scale. One
// read-only pass over the tensor's own codes (formats/count.hpp: 16-bit tensors are never
// widened), |max| in the same pass. Views are read only; the recorder never keeps them
// past the call.
//
// Tensors the recorder cannot read (on a GPU) are counted where they lie by the front end,
// which hands over the results: add_activation_grad (the same counts), forward_nonfinite,
// add_histograms, and NamedParam's measured |max|; the front ends test that path on CPU
// tensors against this one (docs/telemetry.md, "Counting on any device").
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/count.hpp"
#include "mixprec/formats/dtype.hpp"
#include "mixprec/run/alerts.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/step_record.hpp"

namespace mixprec::train {

// What config.json says about the run, and how often histograms are taken.
struct TelemetryOptions {
  std::string precision = "fp16";     // fp32, fp16 or bf16 (the autocast dtype; fp32: none)
  std::string loss_scale = "mixprec"; // as mixprec train's --loss-scale: a preset, static:S or none
  std::size_t histogram_every = 50;   // log2 histograms at step 1 and every N steps; 0 = never
  // The scaler's whole config (its overrides: growth_interval, ...), stored in config.json as
  // "loss-scale-config" for the report and `mixprec scaler simulate`; nullopt: the preset
  // loss_scale names. mixprec::torch::Telemetry's GradScaler: scaler.loss_scale().config().
  std::optional<LossScaleConfig> loss_scale_config = std::nullopt;
  RunWriter writer = RunWriter::libtorch;  // config.json's "writer" (the Python binding says python)
};

// One optimizer step as the front end saw it: its own numbers and its scaler's outcome.
// record() checks every value first (std::invalid_argument naming the field and the rule;
// nothing is written then): lr, seconds and grad_norm >= 0 (grad_norm may be inf/NaN: an
// overflow), lr and seconds finite, clip_coef in (0, 1], scale and next_scale >= 0 and not
// NaN (inf is written as null), tokens any; loss and val_loss any (non-finite: null).
struct TelemetryStep {
  double loss = std::numeric_limits<double>::quiet_NaN();  // training loss (unscaled)
  double lr = 0;
  std::uint64_t tokens = 0;                 // tokens trained on (the summary's throughput)
  double seconds = 0;                       // the step's wall time (the summary's median step time)
  std::optional<double> val_loss = std::nullopt;  // a validation loss measured at this step
  float scale = 1;                          // the scale the gradients carried
  float next_scale = 1;                     // the scale after this step's update
  bool found_inf = false;                   // inf/NaN among the parameter gradients
  bool applied = true;                      // optimizer.step() ran
  double grad_norm = 0;                     // of the unscaled gradients, before clipping
  float clip_coef = 1;                      // the clipping applied to the gradients (1: none)
  std::string overflow_param = {};          // the first parameter holding inf/NaN
  // Why the step was skipped (a SkipReason's name; docs/spike_guards.md); "": none when
  // applied, else nonfinite_grad when found_inf, else user. The guards' z-scores (NaN: none).
  std::string skip_reason = {};
  double loss_z = std::numeric_limits<double>::quiet_NaN();
  double grad_z = std::numeric_limits<double>::quiet_NaN();
  std::vector<StepRecord::LayerScale> layers = {};  // preset layerwise: each watched layer's scaling
  // Tensors a low-precision recipe quantized this step (mixprec.torch.low_precision's Linear
  // modules: "<module>.input", ".weight", ".grad_output"), the log's "fp8" array: each needs a
  // name and a recipe; scale >= 0; saturated + flushed and nonzero at most elements;
  // rel_rms_error >= 0 when given.
  std::vector<nn::Fp8TensorStats> quantized = {};
  // The label of a recipe-file phase that began at this step (mixprec.torch.low_precision_step
  // switched Linears before it); "" on other steps. The log's "recipe_phase".
  std::string recipe_phase = {};
  // This step's number: 0 numbers it after the previous record (1 first); a front end that
  // records a resumed run gives its global step, above the previous record's (a run folder of
  // steps 11-20 continues the one of steps 1-10).
  std::uint64_t step = 0;
};

// A parameter as the step left it: its gradient (data == nullptr or size 0: none) as
// step() left it (unscaled; divided back by clip_coef when the step clipped) and its weight.
// A |max| measured elsewhere replaces the recorder's own pass over that tensor:
//   grad_amax            of the gradient as step() left it (a device's measurement): the
//                        recorder undoes clip_coef as it does for its own;
//   unclipped_grad_amax  from the scaler's unscale pass, before any clipping (check_gradients'
//                        amax_out): taken as it is;
//   weight_amax          of the weight.
// A view given with one of them is then read only for the histograms (histogram steps); its
// data may be null (a tensor the recorder cannot read), weight.size still counting the
// parameter's elements (the summary's param_count).
struct NamedParam {
  std::string name;
  GradTensor grad;
  GradTensor weight;
  std::optional<float> grad_amax = std::nullopt;
  std::optional<float> unclipped_grad_amax = std::nullopt;
  std::optional<float> weight_amax = std::nullopt;
};

class TelemetryRecorder {
 public:
  // Checks the options (std::invalid_argument: "telemetry: precision: expected ..."), then
  // creates the run folder `dir` (parents too), takes its lock and writes config.json.
  // std::invalid_argument when `dir` holds files already; std::runtime_error naming the
  // path when it cannot write.
  TelemetryRecorder(std::string dir, const TelemetryOptions& options);

  // Whether the coming step (steps() + 1) takes histograms: step 1 and every
  // histogram_every-th. Front ends ask before they hand over forward activations.
  bool histogram_step() const noexcept;

  // Counts one activation gradient under `name` (summed over the step's micro-batches).
  // Thread-safe (autograd may call hooks on its worker threads).
  void count_activation_grad(std::string_view name, const GradTensor& grad);
  // The same for a gradient counted elsewhere (a device): its counts and |max| as
  // count.hpp defines them, and the dtype it is stored in (for the headroom). Thread-safe.
  void add_activation_grad(std::string_view name, const CountedTensor& counted, DType dtype);
  // A forward output found to hold inf/NaN elsewhere: named in the log line when it is the
  // step's first. Thread-safe.
  void forward_nonfinite(std::string_view name);
  // Histograms taken elsewhere, added to this step's (only at histogram steps: the record
  // of another step carries none). Thread-safe.
  void add_histograms(const StepRecord::Histograms& h);
  // A forward output: the first non-finite one of the step is named in the log line
  // (forward_nonfinite); at histogram steps its values go into the activation histogram.
  // Returns true when it held inf/NaN. Thread-safe.
  bool check_activation(std::string_view name, const GradTensor& output);

  // One log line for this step; resets the step's counts. Returns the record written.
  // All or nothing: a value refused (std::invalid_argument) or a write that failed
  // (std::runtime_error: the log is left as it was) changes nothing here either; the step's
  // counts are kept, and the next record() takes the same step number. A step number given
  // (TelemetryStep::step) not above the previous record's is refused likewise.
  StepRecord record(const TelemetryStep& step, std::span<const NamedParam> params);
  // Writes summary.json (the run's totals and alerts, as mixprec train's); returns the
  // alerts raised. Records may follow; a later finish() rewrites it.
  std::vector<monitor::Alert> finish();

  const std::string& dir() const noexcept { return dir_; }
  // The number of the last step recorded (0 before the first): the count of records unless
  // record() was given step numbers.
  std::uint64_t steps() const noexcept { return step_; }
  // Wall time spent inside the recorder so far (counting, checks, record()): what the
  // telemetry costs a step, with the front end's own time added by the front end.
  double seconds();
  void add_seconds(double s);

 private:
  std::span<const float> as_f32(const GradTensor& t, std::vector<float>& scratch);
  void add_counted(std::string_view name, const CountedTensor& counted, DType dtype);  // caller holds mu_

  std::string dir_;
  TrainConfig config_;  // precision and loss-scale (the keys config.json holds)
  std::size_t histogram_every_;
  RunFolder folder_;
  monitor::AlertMonitor alerts_;
  RunTotals totals_;                // the summary's figures, as the Trainer and the report add them
  std::size_t param_count_ = 0;
  std::uint64_t step_ = 0;

  std::mutex mu_;                   // hooks may run on autograd's worker threads
  std::vector<float> f32_scratch_;  // fp16/bf16 tensors widened for a histogram, reused
  std::vector<nn::TensorGradStats> act_;
  ConversionStats act_total_;
  float act_amax_ = 0;
  std::string first_nonfinite_grad_;
  std::string first_nonfinite_forward_;
  double headroom_ = std::numeric_limits<double>::infinity();  // min over this step's tensors
  StepRecord::Histograms hist_;
  double seconds_ = 0;
};

}  // namespace mixprec::train
