// mixprec::torch::LowPrecisionLinear and LowPrecision: Transformer Engine's low-precision
// recipes for libtorch models (docs/low_precision.md), the same recipes and the same GEMMs as
// Python's mixprec.torch.low_precision:
//
//   fprop  y  = Q(x, rowwise) Q(w, rowwise)^T + b
//   dgrad  dx = Q(dy, rowwise) Q(w, columnwise)          dy E5M2 under the HYBRID format
//   wgrad  dw = Q(dy, columnwise)^T Q(x, columnwise)     NVFP4: RHT on both, stochastic dy
//
// Q quantizes through the core (lowp::quantize) and dequantizes to fp32; the GEMMs accumulate
// in fp32. libtorch modules call their members directly, so a module tree cannot be rewired
// from outside as Python's swap does: a model builds its Linears through LowPrecision::linear,
// which returns a LowPrecisionLinear or a plain torch::nn::Linear as the recipe says.
//
//   auto plan = mixprec::torch::LowPrecision::uniform("nvfp4");      // or ::from_file(path)
//   fc = register_module("fc", plan.linear("h.0.mlp.fc", 2, 10, 256, 1024));
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/quantize.hpp"

namespace mixprec::torch {

// Quantizes a 2-D tensor (fp32, fp16 or bf16; computed in fp32) with `config` and returns the
// dequantized fp32 tensor of the same shape; `out` gets the core's result when given.
at::Tensor fake_quantize(const at::Tensor& t, const lowp::QuantizeConfig& config,
                         std::span<const std::uint32_t> random = {}, lowp::Quantized* out = nullptr);

// What the last quantization of one operand role did (x, w, dy).
struct RoleStats {
  float amax = 0.0f;
  float scale = 1.0f;  // fp8 per tensor: the scale; nvfp4: S_enc; MX and fp8-block: 1
  std::uint64_t elements = 0, saturated = 0, flushed = 0, nonfinite = 0;
  std::optional<double> rel_rms_error;  // when sample_error() asked for it
};

enum class OperandRole : std::uint8_t { x, w, dy };

class LowPrecisionLinearImpl : public ::torch::nn::Module {
 public:
  LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features, const lowp::LinearRecipe& recipe,
                         bool bias = true, std::uint64_t seed = 0);
  // Shares the parameters of an existing Linear.
  LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, const lowp::LinearRecipe& recipe, std::uint64_t seed = 0);

  at::Tensor forward(const at::Tensor& x);

  const lowp::LinearRecipe& recipe() const noexcept { return recipe_; }
  const RoleStats& stats(OperandRole r) const noexcept { return stats_[static_cast<int>(r)]; }
  // Measure the relative RMS quantization error of x, w (next forward) and dy (its backward).
  void sample_error() noexcept { sample_ = true; }

  at::Tensor weight, bias;
  at::Tensor amax_history, scale;  // fp8-delayed: buffers [3, history] and [3] (x, w, dy)

  // Used by the autograd function.
  float role_scale(OperandRole r) const;
  void record(OperandRole r, const lowp::Quantized& q, float scale_used, const at::Tensor& exact, const at::Tensor& approx);
  std::vector<std::uint32_t> random_words(std::size_t n);
  bool sampling() const noexcept { return sample_; }
  void end_sample() noexcept { sample_ = false; }

 private:
  void init_buffers();
  lowp::LinearRecipe recipe_;
  std::uint64_t seed_ = 0, draws_ = 0;
  bool sample_ = false;
  RoleStats stats_[3];
};
// The module holder (TORCH_MODULE's, spelt out: the macro names `torch::nn` unqualified).
class LowPrecisionLinear : public ::torch::nn::ModuleHolder<LowPrecisionLinearImpl> {
 public:
  using ::torch::nn::ModuleHolder<LowPrecisionLinearImpl>::ModuleHolder;
  using Impl = LowPrecisionLinearImpl;
};

// Which recipe each Linear of a model runs.
class LowPrecision {
 public:
  // One recipe for every Linear but the first and the last (as the field keeps them high).
  static LowPrecision uniform(const lowp::LinearRecipe& recipe);
  static LowPrecision uniform(std::string_view recipe_name);
  // A mixed assignment (module name -> recipe or "bf16"; others get its default).
  static LowPrecision from_assignment(lowp::Assignment assignment);
  static LowPrecision from_file(const std::string& path);  // the recipe file, checked whole

  // The recipe of the Linear `name`, the index-th of `count` Linears in model order;
  // nullopt: high precision.
  std::optional<lowp::LinearRecipe> recipe_for(std::string_view name, std::size_t index, std::size_t count) const;
  // A LowPrecisionLinear or a torch::nn::Linear, as recipe_for says.
  ::torch::nn::AnyModule linear(std::string_view name, std::size_t index, std::size_t count, std::int64_t in_features,
                                std::int64_t out_features, bool bias = true, std::uint64_t seed = 0) const;
  // Every module the assignment names must be among `linear_names` (std::invalid_argument).
  void check_names(const std::vector<std::string>& linear_names) const;

 private:
  std::optional<lowp::LinearRecipe> uniform_;
  lowp::Assignment assignment_;
};

}  // namespace mixprec::torch
