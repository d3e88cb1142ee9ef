// mixprec::torch::Telemetry: what loss scaling and low precision did to a libtorch run,
// as a run folder (docs/run_folder.md) that `mixprec report`, the alerts and `mixprec
// scaler simulate` read as they read one of `mixprec train --out` (docs/libtorch.md).
//
//   mixprec::torch::Telemetry tel("runs/libtorch", {.precision = "fp16", .loss_scale = "torch"});
//   for each step:
//     h = block0->forward(x);  tel.watch("block0.mlp", h); // gradient hook on an activation
//     ...  scaler.scale(loss).backward();
//     auto out = scaler.step(opt, o);                      // before update() and zero_grad()
//     tel.record(model->named_parameters(), out, scaler, {.loss = loss.item<double>(), .lr = lr});
//     scaler.update();  opt.zero_grad();
//   tel.finish();                                          // summary.json, with the run's alerts
//
// The counting, the log line, the alerts and the summary are the core's
// train::TelemetryRecorder (include/mixprec/train/telemetry_recorder.hpp), the same code
// behind mixprec.torch.Telemetry in Python: this class only turns tensors into views.
// Histograms (log2 magnitudes of the watched activation gradients, the parameter
// gradients and the weights) are taken at step 1 and every options.histogram_every steps.
// The folder is written through train::RunFolder: it must be new or empty, its lock is
// held while the Telemetry lives, config.json holds the keys that describe the run
// (precision, loss-scale), log.jsonl one line per record(), summary.json is written by
// finish().
// watch() attaches a tensor hook to an activation (it must require grad); when backward
// reaches it, the hook counts its gradient (scaled domain) with mixprec's counted
// conversion to fp16 (convert_counted): elements, non-zero, inf/NaN, subnormal,
// underflow, overflow, and |max|. For an fp16 gradient these are its values as stored:
// the rounding has already happened there, so values that underflowed to 0 are not told
// apart from exact zeros (underflow is 0). For an fp32 or bf16 gradient they are what
// fp16 would flush (underflow, subnormal) or overflow at the current scale.
// record() writes one log line through mixprec::train::step_record_json: the outcome
// (scale, found_inf, skipped, norm, clip coefficient, first overflowing parameter), the
// scale update() will set (the protocol's next_scale(): every optimizer of the step and every
// rank count, as update() counts them), per named parameter the
// unscaled gradient |max| (before clipping) and the weight |max|, the activation-gradient
// counts of this step (every micro-batch of an accumulation window), the first watched
// activation whose gradient held inf/NaN, and headroom_log2: the fewest binades between a
// watched gradient's |max| and its dtype's largest finite (65504 for fp16), 0 when none
// was finite. Then it resets the counts.
// Tensors on a device other than the CPU (CUDA) are counted where they lie with ATen
// operations (the same counts, |max| and histograms; src/torch/device_counts.cpp), kept on the
// device until record() reads them all in one host copy; nothing is copied to the host per
// tensor. Counting::aten runs that path on CPU tensors too (the tests compare the two).
#pragma once

#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include "mixprec/run/alerts.hpp"
#include "mixprec/torch/grad_scaler.hpp"
#include "mixprec/train/telemetry_recorder.hpp"

namespace mixprec::torch {

// What record() logs besides the outcome and the parameters: the step's own numbers.
struct StepInfo {
  double loss = std::numeric_limits<double>::quiet_NaN();  // the training loss (unscaled)
  double lr = 0;
  std::uint64_t tokens = 0;          // tokens this step trained on (the summary's throughput)
  double seconds = 0;                // the step's wall time (the summary's median step time)
  std::optional<double> val_loss = std::nullopt;  // a validation loss measured at this step: the report's dots
};

// What config.json says about the run (precision, loss-scale) and how often histograms
// are taken: the core recorder's options.
using TelemetryOptions = train::TelemetryOptions;

// Who counts a tensor: automatic (the core reads CPU tensors in place, ATen operations count
// tensors on other devices where they lie) or aten (ATen operations for every tensor: the
// CUDA path, run on CPU tensors by the tests).
enum class Counting : std::uint8_t { automatic, aten };

class Telemetry {
 public:
  // Checks the options (std::invalid_argument), then creates the run folder `dir`
  // (parents too), takes its lock and writes config.json. std::invalid_argument when
  // `dir` holds files already; std::runtime_error naming the path when it cannot write.
  explicit Telemetry(std::string dir, const TelemetryOptions& options = {}, Counting counting = Counting::automatic);

  // Counts `activation`'s gradient at backward under `name` (nothing when it receives none:
  // an unused output of a multi-output node). One tensor hook per call: watch each step's
  // activations, which go with their graph; a leaf (a parameter) outlives the step and would
  // keep every hook, each counting it again. Throws std::invalid_argument when the tensor
  // does not require grad.
  void watch(const std::string& name, const at::Tensor& activation);

  // One log line for this optimizer step (call after step(), before update()); returns it.
  train::StepRecord record(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                           const StepOutcome& outcome, const GradScaler& scaler, const StepInfo& info);

  // Writes summary.json (the run's totals and alerts, as mixprec train's); returns the
  // alerts raised. Records may follow; a later finish() rewrites it.
  std::vector<monitor::Alert> finish();

  const std::string& dir() const noexcept { return rec_.dir(); }
  // Wall time spent inside the telemetry so far: its hooks during backward and record().
  // What it costs a step (the example prints its share; docs/libtorch.md).
  double seconds() { return rec_.seconds(); }
  std::uint64_t steps() const noexcept { return rec_.steps(); }
  // Copies of device results to the host so far: one per record() and device that had
  // something counted by ATen (0 when everything was read by the core).
  std::uint64_t host_reads() const noexcept { return host_reads_; }

  // Device results waiting for record()'s host read: an activation gradient's profile or a
  // histogram (public for the implementation's helpers; not an interface).
  struct Pending {
    enum class Kind : std::uint8_t { gradient, histogram } kind;
    std::string name;  // the watched name, or the histogram's kind
    DType dtype = DType::f32;
    std::uint64_t elements = 0;
    at::Tensor values;
  };

 private:
  void count(const std::string& name, const at::Tensor& grad);
  bool on_aten(const at::Tensor& t) const;

  train::TelemetryRecorder rec_;  // the run folder, counts, alerts and summary: the core's
  Counting counting_;
  std::mutex pending_mu_;  // backward may run hooks on a device's autograd thread
  std::vector<Pending> pending_;
  std::uint64_t host_reads_ = 0;
};

}  // namespace mixprec::torch
