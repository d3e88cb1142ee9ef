// mixprec::torch::GradScaler: the loss-scaling protocol of mixprec::GradScaler
// (scaler/grad_scaler.hpp) over libtorch optimizers and tensors (docs/libtorch.md).
//
//   mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset("torch"));
//   scaler.set_names(model->named_parameters());       // names for StepOutcome
//   for each step:
//     scaler.scale(loss).backward();
//     [scaler.unscale(opt);]                            // optional: unscale in place first
//     auto out = scaler.step(opt, {.max_grad_norm = 1.0f});  // check, unscale, clip, opt.step()
//     scaler.update();
//     opt.zero_grad();
//
// The scale policy is a core mixprec::LossScale (every preset of loss_scale_preset()).
// Per optimizer: READY -> UNSCALED (unscale) -> STEPPED (step); update() puts every
// optimizer back to READY. Misuse throws std::logic_error naming it (unscale twice,
// unscale after step, step twice, update with nothing recorded, unscale/step/update
// before the end of an accumulation window). Bad gradients throw std::invalid_argument
// naming the parameter: sparse, non-contiguous, fp64 (or any dtype but fp32/fp16/bf16),
// gradients on more than one device or on a device other than CPU and CUDA; an
// optimizer without parameters too. Undefined gradients (a parameter that took no part
// in the loss) are skipped, as PyTorch does.
//
// CPU gradients: one pass of mixprec::unscale_and_check directly on the tensors'
// storage (no copy): check for inf/NaN, multiply by inv_scale = float(1/double(scale))
// in fp32 (fp16/bf16 rounded back to nearest even), and the sum of squares of the
// unscaled values for the norm. CUDA gradients: ATen's
// _amp_foreach_non_finite_check_and_unscale_ and the norm on the device, then ONE
// device-to-host copy (found_inf and the norm together) per step; untested here.
//
// Inside the namespace mixprec::torch the name `torch` means this namespace: write
// ::torch::... there.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/scaler/loss_scale.hpp"

namespace mixprec::torch {

using mixprec::OptimizerStage;

// How step() computes the norm and the coefficient it clips with.
enum class ClipNorm : std::uint8_t {
  // The norm from the unscale pass itself (no second read): the exact sum of squares
  // rounded once; coefficient max_norm / (norm + 1e-6) in double, capped at 1, as fp32.
  exact,
  // torch::nn::utils::clip_grad_norm_'s own ATen arithmetic, bit for bit: each
  // gradient's norm(2) in fp32, the norm of their stack, max_norm / (norm + 1e-6) and
  // clamp(max = 1) as fp32 tensors, then mul_. One more read of the gradients.
  torch,
};

struct StepOptions {
  std::optional<float> max_grad_norm;  // clip the unscaled gradients to this global L2 norm
  ClipNorm clip_norm = ClipNorm::exact;
};

// What step() did.
struct StepOutcome {
  bool applied = false;              // optimizer.step() ran
  bool found_inf = false;            // some gradient held inf or NaN: the step was skipped
  float scale = 1.0f;                // the loss scale these gradients carried
  std::int64_t first_overflow = -1;  // index (over the optimizer's parameters, groups in order) or -1
  std::string first_overflow_name;   // its name (set_names), else "param[<index>]"; "" when none
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // global L2 norm of the unscaled gradients
  float clip_coef = 1.0f;            // applied clip coefficient (1: none)
};

class GradScaler {
 public:
  explicit GradScaler(const LossScaleConfig& config = {}, bool enabled = true);
  explicit GradScaler(std::unique_ptr<LossScale> scale, bool enabled = true);

  bool enabled() const noexcept { return enabled_; }
  float get_scale() const noexcept;  // 1 when disabled
  const LossScale& loss_scale() const noexcept { return *scale_; }

  // loss * scale, as torch.amp.GradScaler.scale: multiplied by a 0-dim fp32 tensor on
  // the loss's device (an fp16 loss stays fp16). Disabled: the loss itself.
  at::Tensor scale(const at::Tensor& loss) const;

  // Names for StepOutcome::first_overflow_name: parameters are matched by identity.
  void set_names(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters);
  void set_names(const ::torch::nn::Module& module);

  void unscale(::torch::optim::Optimizer& opt);
  StepOutcome step(::torch::optim::Optimizer& opt, const StepOptions& options = {});
  void update();  // may throw ScaleCollapseError (preset "mixprec")

  void set_accumulation_steps(int k);
  int accumulation_steps() const noexcept { return window_.steps(); }
  void backward_done();
  int backward_passes() const noexcept { return window_.passes(); }

  OptimizerStage stage(const ::torch::optim::Optimizer& opt) const noexcept;

  // The same JSON as mixprec::GradScaler::state_json ("mixprec.grad_scaler").
  std::string state_json() const;
  void load_state_json(std::string_view json);

 private:
  struct Record {
    OptimizerStage stage = OptimizerStage::ready;
    bool found_inf = false;
    std::int64_t first_overflow = -1;
    double grad_norm = std::numeric_limits<double>::quiet_NaN();
  };
  void check_unscale(::torch::optim::Optimizer& opt, Record& r, bool write_scaled);
  std::string name_of(const ::torch::optim::Optimizer& opt, std::int64_t index) const;

  std::unique_ptr<LossScale> scale_;
  bool enabled_;
  AccumulationWindow window_;
  std::map<const ::torch::optim::Optimizer*, Record> records_;
  std::unordered_map<const void*, std::string> names_;  // TensorImpl* -> name
};

}  // namespace mixprec::torch
