// mixprec::torch::Telemetry: what loss scaling and low precision did to a libtorch run,
// as a run folder that `mixprec report` reads (docs/libtorch.md, "Telemetry").
//
//   mixprec::torch::Telemetry tel("runs/libtorch");       // creates the folder, starts log.jsonl
//   for each step:
//     h = block0->forward(x);  tel.watch("block0.mlp", h); // gradient hook on an activation
//     ...  scaler.scale(loss).backward();
//     auto out = scaler.step(opt, o);                      // before update() and zero_grad()
//     tel.record(model->named_parameters(), out, scaler, loss.item<double>(), lr);
//     scaler.update();  opt.zero_grad();
//
// watch() attaches a tensor hook to an activation (it must require grad); when backward
// reaches it, the hook counts its gradient (scaled domain, in the activation's dtype):
// elements, non-zero, subnormal (for fp16/bf16 gradients), inf/NaN, and |max|. The
// rounding has already happened there, so values that underflowed to 0 are not told
// apart from exact zeros (underflow is written as 0).
// record() writes one log line through mixprec::train::step_record_json: the outcome
// (scale, found_inf, skipped, norm, clip coefficient, first overflowing parameter), the
// scale after the update (read from a copy of the loss scale), per named parameter the
// unscaled gradient |max| (before clipping) and the weight |max|, the activation-gradient
// counts of this step (every micro-batch of an accumulation window), the first watched
// activation whose gradient held inf/NaN, and headroom_log2: the fewest binades between a
// watched gradient's |max| and its dtype's largest finite (65504 for fp16), 0 when none
// was finite. Then it resets the counts.
#pragma once

#include <cstdint>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include "mixprec/torch/grad_scaler.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::torch {

class Telemetry {
 public:
  // Creates `dir` (parents too) and truncates dir/log.jsonl. Throws std::runtime_error
  // naming the path when it cannot.
  explicit Telemetry(std::string dir);

  // Counts `activation`'s gradient at backward under `name`. Throws std::invalid_argument
  // when the tensor does not require grad.
  void watch(const std::string& name, const at::Tensor& activation);

  // One log line for this optimizer step (call after step(), before update()); returns it.
  train::StepRecord record(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                           const StepOutcome& outcome, const GradScaler& scaler, double loss, double lr,
                           std::uint64_t tokens = 0, double seconds = 0);

  const std::string& dir() const noexcept { return dir_; }
  std::uint64_t steps() const noexcept { return step_; }

 private:
  void count(const std::string& name, const at::Tensor& grad);

  std::string dir_;
  std::ofstream log_;
  std::uint64_t step_ = 0;
  std::mutex mu_;  // hooks may run on autograd's worker threads
  std::vector<nn::TensorGradStats> act_;
  ConversionStats act_total_;
  float act_amax_ = 0;
  std::string first_nonfinite_;
  double headroom_ = std::numeric_limits<double>::infinity();  // min over this step's watched tensors
};

}  // namespace mixprec::torch
