// mixprec::torch::LowPrecisionLinear and LowPrecision: Transformer Engine's low-precision
// recipes for libtorch models (docs/low_precision.md), the same plans and the same GEMMs as
// Python's mixprec.torch.low_precision. A Linear runs a lowp::LinearPlan (a recipe or high
// precision per GEMM operand):
//
//   fprop  y  = Q[fprop.x](x) Q[fprop.w](w)^T + b
//   dgrad  dx = Q[dgrad.dy](dy) Q[dgrad.w](w')     w' = w, or D(Q[fprop.w](w)) (w_source dequantized)
//   wgrad  dw = Q[wgrad.dy](dy)^T Q[wgrad.x](x')   x' = x, or D(Q[fprop.x](x)) (x_source dequantized)
//
// Q quantizes through the core (lowp::quantize, LinearPlan::config) and dequantizes to fp32 (a
// high-precision operand is the fp32 value itself); the GEMMs accumulate in fp32. libtorch
// modules call their members directly, so a module tree cannot be rewired from outside as
// Python's swap does: a model builds its Linears through LowPrecision::linear, which returns a
// LowPrecisionLinear or a plain torch::nn::Linear as the plan says; low_precision_step puts the
// Linears a recipe file's schedule drives on the plan of a step.
//
//   auto lp = mixprec::torch::LowPrecision::uniform("nvfp4");   // or ::from_file(path, total_steps)
//   fc = lp.linear("h.0.mlp.fc", 2, 10, 256, 1024);              // a torch::nn::AnyModule
//   register_module("fc", fc.ptr());
//   ... each step: low_precision_step(model, step);              // a recipe file's schedule
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/quantize.hpp"

namespace mixprec::torch {

// Quantizes a 2-D tensor (fp32, fp16 or bf16; computed in fp32) with `config` and returns the
// dequantized fp32 tensor of the same shape; `out` gets the core's result when given.
at::Tensor fake_quantize(const at::Tensor& t, const lowp::QuantizeConfig& config,
                         std::span<const std::uint32_t> random = {}, lowp::Quantized* out = nullptr);

// What the last quantization of one tensor did (x, w, dy): its first quantized operand's (x:
// fprop.x else wgrad.x; w: fprop.w else dgrad.w; dy: dgrad.dy else wgrad.dy).
struct RoleStats {
  float amax = 0.0f;
  float scale = 1.0f;  // fp8 per tensor: the scale; nvfp4: S_enc; MX and fp8-block: 1
  std::uint64_t elements = 0, saturated = 0, flushed = 0, nonfinite = 0;
  std::optional<double> rel_rms_error;  // when sample_error() asked for it
  lowp::Recipe recipe = lowp::Recipe::fp8_current;  // of the operand recorded (per-direction plans differ)
  lowp::Element element = lowp::Element::e4m3;
};

enum class OperandRole : std::uint8_t { x, w, dy };

// What a Linear built from a recipe file needs to follow the file's schedule (and its
// evaluation plan): the checked file, the Linear's name in it and the run's length.
struct PlanSchedule {
  std::shared_ptr<const lowp::Assignment> assignment;
  std::string name;
  std::uint64_t total_steps = 0;  // the run's optimizer steps; 0: unknown (a from_fraction phase then throws)

  // The first step of each phase (lowp::Assignment::phase_starts; the error names the door's
  // ways to give the run's length).
  std::vector<std::uint64_t> starts() const;
  // The plan of optimizer step `step` (0-based): lowp::plan(choice_at(name, step), options).
  lowp::LinearPlan plan_at(std::uint64_t step) const;
  // The evaluation forwards' plan: nullopt when the file has none; every operand in high
  // precision for a Linear whose entry is high precision (as the Python door decides).
  std::optional<lowp::LinearPlan> evaluation_plan() const;
  // Every plan the run can put the Linear on: step 0's, each phase's first step's, evaluation's.
  std::vector<lowp::LinearPlan> reachable() const;
  // The label of the latest phase begun at `step` that reaches the Linear ("" before any).
  std::string label_at(std::uint64_t step) const;
};

class LowPrecisionLinearImpl : public ::torch::nn::Module {
 public:
  // The uniform plan: `recipe` on all six operands, backward copies from the originals.
  LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features, const lowp::LinearRecipe& recipe,
                         bool bias = true, std::uint64_t seed = 0);
  // Shares the parameters of an existing Linear.
  LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, const lowp::LinearRecipe& recipe, std::uint64_t seed = 0);
  // A per-operand plan (lowp::plan of a choice, lowp::zoo_choice); std::invalid_argument when it
  // quantizes no operand or breaks a rule of lowp::plan.
  LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features, const lowp::LinearPlan& plan,
                         bool bias = true, std::uint64_t seed = 0);
  LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, const lowp::LinearPlan& plan, std::uint64_t seed = 0);
  // Driven by a recipe file: step 0's plan until low_precision_step moves it, the file's
  // evaluation plan in eval mode. std::invalid_argument when no plan of the run quantizes an
  // operand, or fp8-delayed has different options in two of them.
  LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features, PlanSchedule schedule, bool bias = true,
                         std::uint64_t seed = 0);
  LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, PlanSchedule schedule, std::uint64_t seed = 0);

  at::Tensor forward(const at::Tensor& x);

  // The recipe the Linear is reported by: the first quantized operand's (LinearPlan::primary)
  // over every plan it can run (step 0, each phase, evaluation).
  const lowp::LinearRecipe& recipe() const noexcept { return primary_; }
  // The training plan now (moved by set_step / low_precision_step).
  const lowp::LinearPlan& plan() const noexcept { return plans_[current_]; }
  // The plan the next forward runs: the evaluation plan in eval mode where the file has one.
  const lowp::LinearPlan& active_plan() const noexcept { return plans_[active_index()]; }
  // nullptr unless built from a recipe file.
  const PlanSchedule* schedule() const noexcept { return schedule_ ? &*schedule_ : nullptr; }
  // Puts a schedule-driven Linear on the plan of `step`; true when the plan changed (false
  // for a Linear not built from a recipe file).
  bool set_step(std::uint64_t step);

  const RoleStats& stats(OperandRole r) const noexcept { return stats_[static_cast<int>(r)]; }
  // Measure the relative RMS quantization error of x, w (next forward) and dy (its backward).
  void sample_error() noexcept { sample_ = true; }

  at::Tensor weight, bias;
  at::Tensor amax_history, scale;  // fp8-delayed in some plan: buffers [3, history] and [3] (x, w, dy)
  at::Tensor sr_draws;  // stochastic rounding in some plan: the random streams drawn so far (int64 scalar)

  // Used by the autograd function.
  std::size_t active_index() const noexcept { return !is_training() && eval_ ? *eval_ : current_; }
  const lowp::LinearPlan& plan_number(std::size_t i) const { return plans_.at(i); }
  float role_scale(OperandRole r) const;
  void record(OperandRole r, const lowp::Quantized& q, float scale_used, const lowp::QuantizeConfig& config,
              const at::Tensor& exact, const at::Tensor& approx);
  std::vector<std::uint32_t> random_words(std::size_t n);
  bool sampling() const noexcept { return sample_; }
  void end_sample() noexcept { sample_ = false; }

 private:
  // Checks the plans (before any parameter is registered) and keeps them; eval: the index of
  // the evaluation plan.
  void take_plans(std::vector<lowp::LinearPlan> plans, std::optional<std::size_t> eval);
  void init_buffers();
  std::string who() const;
  std::vector<lowp::LinearPlan> plans_;  // every plan the Linear can run, each once; fixed after construction
  std::size_t current_ = 0;
  std::optional<std::size_t> eval_;
  std::optional<PlanSchedule> schedule_;
  lowp::LinearRecipe primary_;
  std::optional<lowp::LinearRecipe> delayed_;  // the fp8-delayed recipe of its operands (one per Linear)
  bool stochastic_ = false;
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

// Which plan each Linear of a model runs.
class LowPrecision {
 public:
  // One recipe (or plan) for every Linear but the first and the last (as the field keeps them high).
  static LowPrecision uniform(const lowp::LinearRecipe& recipe);
  static LowPrecision uniform(const lowp::LinearPlan& plan);
  // A recipe name (TE's defaults) or a TE zoo name (lowp::zoo_choice: a format per GEMM direction).
  static LowPrecision uniform(std::string_view name);
  // A mixed assignment (module name -> entry; others get its default), its schedule and its
  // evaluation plan. total_steps: the run's optimizer steps (0: unknown), needed by a phase
  // given as a fraction of the run; also set_total_steps.
  static LowPrecision from_assignment(lowp::Assignment assignment, std::uint64_t total_steps = 0);
  static LowPrecision from_file(const std::string& path, std::uint64_t total_steps = 0);  // checked whole
  LowPrecision& set_total_steps(std::uint64_t total_steps) noexcept;

  // The plan of the Linear `name`, the index-th of `count` Linears in model order, at step 0;
  // nullopt when no plan of the run quantizes it (a plain torch::nn::Linear). A from_fraction
  // phase without the run's length throws std::invalid_argument.
  std::optional<lowp::LinearPlan> plan_for(std::string_view name, std::size_t index, std::size_t count) const;
  // plan_for's primary recipe (LinearPlan::primary); nullopt: high precision at step 0.
  std::optional<lowp::LinearRecipe> recipe_for(std::string_view name, std::size_t index, std::size_t count) const;
  // A LowPrecisionLinear (following the file's schedule and evaluation plan) or a
  // torch::nn::Linear, as plan_for says.
  ::torch::nn::AnyModule linear(std::string_view name, std::size_t index, std::size_t count, std::int64_t in_features,
                                std::int64_t out_features, bool bias = true, std::uint64_t seed = 0) const;
  // Every module the assignment names must be among `linear_names`, and every pattern of its
  // schedule must match one of them (std::invalid_argument).
  void check_names(const std::vector<std::string>& linear_names) const;

 private:
  PlanSchedule schedule_of(std::string_view name) const;
  std::optional<lowp::LinearPlan> uniform_;
  std::shared_ptr<const lowp::Assignment> assignment_;
  std::uint64_t total_steps_ = 0;
};

// Puts every LowPrecisionLinear of `model` that a recipe file drives on the plan of optimizer
// step `step` (0-based, as the recipe file counts; call it before the step's first forward, and
// again after resuming). Returns (module name in `model`, phase label) for each Linear whose
// plan changed: the label of the latest phase begun at `step` that reaches it, "" when back
// before any. Evaluation forwards (model.eval()) run the file's evaluation plan where it has one.
std::vector<std::pair<std::string, std::string>> low_precision_step(::torch::nn::Module& model, std::uint64_t step);

}  // namespace mixprec::torch
