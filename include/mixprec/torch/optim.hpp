// mixprec::torch::AdamW: AdamW over libtorch parameters with its master weights and moments in
// the optimizer state formats (optim/state_format.hpp; docs/optimizers.md, "State formats"),
// one fused pass of the core per tensor: the libtorch counterpart of Python's
// mixprec.torch.optim.AdamW (docs/libtorch.md).
//
//   mixprec::torch::AdamWOptions o;
//   o.lr = 3e-4; o.weight_decay = 0.1;
//   o.master = mixprec::MasterFormat::remainder;          // bf16 parameters + 16-bit remainders
//   o.m = o.v = mixprec::MomentFormat::fp8;                // 4 bytes a parameter in all
//   mixprec::torch::AdamW opt(model->parameters(), o);
//   for each step:
//     loss.backward();
//     opt.step();                                         // or step(1 / scale, found_inf)
//     opt.zero_grad();
//
// An adapter: every number is the core's adam_tensor_step. The state of each parameter is held
// in torch tensors under the Python door's names, created at its first step with a gradient:
//   step                 float32, 0-dim: the applied steps
//   exp_avg, exp_avg_sq  codes: shaped as the parameter in float32 / bfloat16 / float16 (formats
//                        fp32, bf16, fp16), else flat uint8 (fp8, 8bit, 4bit); a blocked format
//                        keeps fp32 for a tensor under 4096 elements or of a size that is not a
//                        multiple of the block (the core's moment_layout)
//   exp_avg_scale, exp_avg_sq_scale   float32, flat: the moment's scales (0 elements without)
//   master               float32 shaped as the parameter: master fp32 over a 16-bit parameter
//   master_remainder     int16 shaped as the parameter: master remainder over a bf16 parameter
// A float32 parameter is its own master whatever `master` says; master none keeps no copy.
//
// step(inv_scale, skip): gradients are multiplied by inv_scale inside the pass (1 / the loss
// scale); skip = true (the scaler found inf/NaN) writes nothing, and the step count stays.
// Parameters whose grad() is undefined are left alone. Stochastic rounding (master none) draws
// element i's bits from (seed, step, i), i counting the elements of all parameters in order.
//
// state_dict() is a map of named tensors, copies of the state as stored:
//   "state.<i>.<name>"        the state tensors above of parameter i (only those that stepped)
//   "param_groups.0.<key>"    the formats: master, moments ("m,v"), rule (names as uint8 bytes),
//                             block, seed (int64; the seed's bits), fp8_per_tensor,
//                             stochastic_rounding (bool), 0-dim
// load_state_dict() refuses, before changing anything, other formats, unknown keys, and tensors
// of another dtype or size than this optimizer stores; hyperparameters (lr, betas, eps,
// weight_decay, decoupled) are the constructor's (set_lr() for a schedule).
//
// Inside the namespace mixprec::torch the name `torch` means this namespace: write
// ::torch::... there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "mixprec/optim/state_format.hpp"

namespace mixprec::torch {

struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool decoupled = true;  // AdamW; false: Adam with L2 added to the gradient
  MasterFormat master = MasterFormat::fp32;
  MomentFormat m = MomentFormat::fp32;
  MomentFormat v = MomentFormat::fp32;
  std::size_t block = 0;  // elements per scale of fp8/8bit/4bit: 0 (the format's default) or 2^k in [32, 1024]
  bool fp8_per_tensor = false;
  AdamRule rule = AdamRule::torch;
  bool stochastic_rounding = false;  // master none with 16-bit parameters only
  std::uint64_t seed = 0;

  StateFormats formats() const noexcept { return {master, m, v, block, fp8_per_tensor, rule}; }
};

// Bytes held by the state tensors (codes and scales included), and by the parameters.
struct AdamWStateBytes {
  std::uint64_t master = 0, m = 0, v = 0, params = 0;
  std::uint64_t total() const noexcept { return master + m + v; }
};

class AdamW {
 public:
  using StateDict = std::map<std::string, at::Tensor>;

  // Parameters: defined, distinct, CPU, contiguous, float32 / float16 / bfloat16 (master remainder:
  // bfloat16 or float32; stochastic rounding: 16-bit). Throws std::invalid_argument naming the
  // option or parameter, what is allowed and what was found.
  explicit AdamW(std::vector<at::Tensor> params, const AdamWOptions& options = {});

  // One step of every parameter with a gradient; everything is checked before anything is written.
  void step(float inv_scale = 1.0f, bool skip = false);
  void zero_grad();

  // The fp32 weights of record of parameter i (its master, rebuilt from the remainder, or the
  // parameter itself), as a new tensor shaped as the parameter.
  at::Tensor master_weights(std::size_t i) const;
  // Parameter i's state tensors by name (empty before its first step); they are the optimizer's own.
  const std::map<std::string, at::Tensor>& state(std::size_t i) const;
  AdamWStateBytes state_bytes() const;

  StateDict state_dict() const;
  void load_state_dict(const StateDict& state_dict);

  const std::vector<at::Tensor>& parameters() const noexcept { return params_; }
  const AdamWOptions& options() const noexcept { return options_; }
  void set_lr(double lr);  // finite and >= 0

 private:
  std::map<std::string, at::Tensor> init_state(std::size_t i) const;

  std::vector<at::Tensor> params_;
  AdamWOptions options_;
  std::vector<std::map<std::string, at::Tensor>> state_;
};

}  // namespace mixprec::torch
