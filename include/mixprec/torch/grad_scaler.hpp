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
// The protocol (stages, misuse messages, windows, found_inf over tensors, optimizers and ranks,
// the skip decision, the clip coefficient, the state format) is mixprec::ScalerProtocol's
// (scaler/protocol.hpp), mixprec dialect; this adapter finds the gradients, checks them and
// runs opt.step(). Misuse throws ScalerMisuse (a std::logic_error). Undefined gradients (a
// parameter that took no part in the loss) are skipped, as PyTorch does; an optimizer none
// of whose parameters has a gradient cannot step ("No inf checks were recorded").
//
// Gradients as torch takes them (checked before anything is touched): the route of each one,
// and the refusals with their messages, are the core's (scaler/grad_route.hpp); this adapter
// describes each gradient and carries the route out:
//   - core: mixprec::check_gradients directly on the tensor's memory (its numel elements from
//     data_ptr; the check is elementwise, so the layout does not matter);
//   - aten: ATen's _amp_foreach_non_finite_check_and_unscale_, the kernel torch runs, with
//     the same result as torch (an overlapping view: ATen's own error); the norm through
//     linalg_vector_norm; one device-to-host copy per step for device tensors;
//   - sparse_values: its values (coalesced first when fp16, as torch does), routed in turn;
//   - refused: meta tensors, other sparse layouts, gradients on more than one device.
// A scale below 1 whose unscaled values overflow their dtype, or a scale that cannot be
// inverted, is an overflow step: found_inf, nothing written (check_gradients).
//
// Inside the namespace mixprec::torch the name `torch` means this namespace: write
// ::torch::... there.
#pragma once

#include <cstdint>
#include <functional>
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
#include "mixprec/scaler/protocol.hpp"

namespace mixprec::torch {

using mixprec::OptimizerStage;
using mixprec::ScalerDoor;

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

// Where check() reads the gradients: automatic (the core on CPU fp32/fp16/bf16 memory, ATen's
// kernel for the rest) or aten (ATen's kernel for every gradient: the path of CUDA gradients,
// which the tests run on CPU ones against the core's).
enum class GradientPath : std::uint8_t { automatic, aten };

struct StepOptions {
  std::optional<float> max_grad_norm;  // clip the unscaled gradients to this global L2 norm
  ClipNorm clip_norm = ClipNorm::exact;
  // Step guards (set_guard(); docs/spike_guards.md): this step's loss (unscaled, the mean over
  // its window) for the loss guards, and a predicate asked after the check (true: skip).
  std::optional<double> loss{};
  std::function<bool(const GuardView&)> skip_if{};
};

// What step() did: the core's one StepOutcome (scaler/grad_scaler.hpp). first_overflow is the
// index over the optimizer's parameters (groups in order), first_overflow_name its name
// (set_names), else "param[<index>]"; "" when none.
using mixprec::StepOutcome;

class GradScaler : public ScalerDoor {
 public:
  explicit GradScaler(const LossScaleConfig& config = {}, bool enabled = true);
  explicit GradScaler(std::unique_ptr<LossScale> scale, bool enabled = true);

  // loss * scale, as torch.amp.GradScaler.scale: multiplied by a 0-dim fp32 tensor on
  // the loss's device (an fp16 loss stays fp16). Disabled: the loss itself.
  at::Tensor scale(const at::Tensor& loss) const;

  // Names for StepOutcome::first_overflow_name: parameters are matched by identity.
  void set_names(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters);
  void set_names(const ::torch::nn::Module& module);

  void unscale(::torch::optim::Optimizer& opt);
  StepOutcome step(::torch::optim::Optimizer& opt, const StepOptions& options = {});

  void set_gradient_path(GradientPath path) noexcept { path_ = path; }

 private:
  GradientCheck check(::torch::optim::Optimizer& opt);
  std::string name_of(const ::torch::optim::Optimizer& opt, std::int64_t index) const;

  std::unordered_map<const void*, std::string> names_;  // TensorImpl* -> name
  GradientPath path_ = GradientPath::automatic;
};

}  // namespace mixprec::torch
