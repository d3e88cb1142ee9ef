#include "mixprec/train/telemetry_recorder.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "mixprec/core/text.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/run/run_log.hpp"

namespace mixprec::train {
namespace {

// Adds the time since construction to `total` when it goes out of scope (the caller holds the lock).
struct Spent {
  double& total;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  explicit Spent(double& t) : total(t) {}
  ~Spent() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
  Spent(const Spent&) = delete;
  Spent& operator=(const Spent&) = delete;
};

const std::vector<std::string_view> kConfigKeys = {"precision", "loss-scale"};

TrainConfig run_config(const TelemetryOptions& o) {
  TrainConfig c;
  const auto p = nn::parse_precision(o.precision);
  if (!p || (*p != nn::Precision::fp32 && *p != nn::Precision::fp16 && *p != nn::Precision::bf16))
    throw std::invalid_argument("telemetry: precision: expected fp32, fp16 or bf16, found '" + o.precision + "'");
  c.precision = *p;
  c.loss_scale = o.loss_scale;
  (void)loss_scale_config(c.loss_scale);  // "loss-scale: expected ..." for anything else
  if (o.loss_scale_config) {
    if (c.loss_scale == "none")
      throw std::invalid_argument("telemetry: loss_scale_config: given for a run without loss scaling (loss_scale "
                                  "'none')");
    try {
      validate(*o.loss_scale_config);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("telemetry: loss_scale_config: ") + e.what());
    }
  }
  c.histogram_every = o.histogram_every;
  return c;
}

// The alerts' view of the run: the writer's words, the scaler's own config, and the learning
// rate the steps record (the TrainConfig default lr is no run's).
monitor::RunContext alert_context(const TrainConfig& c, const TelemetryOptions& o) {
  monitor::RunContext ctx = monitor::RunContext::of(c);
  ctx.lr = 0;
  ctx.writer = o.writer;
  ctx.loss_scale_config = o.loss_scale_config;
  return ctx;
}

[[noreturn]] void bad_step(std::string_view field, std::string_view rule, double found) {
  throw std::invalid_argument("telemetry: record(): " + std::string(field) + ": expected " + std::string(rule) +
                              ", found " + text::num(found));
}

// The step's values against the schema and the run's meaning (TelemetryStep's rules).
void check_step(const TelemetryStep& s) {
  if (!(std::isfinite(s.lr) && s.lr >= 0)) bad_step("lr", "a finite number >= 0", s.lr);
  if (!(std::isfinite(s.seconds) && s.seconds >= 0)) bad_step("seconds", "a finite number >= 0", s.seconds);
  if (!(s.clip_coef > 0 && s.clip_coef <= 1)) bad_step("clip_coef", "a number in (0, 1]", s.clip_coef);
  if (std::isnan(s.scale) || s.scale < 0) bad_step("scale", "a number >= 0", s.scale);
  if (std::isnan(s.next_scale) || s.next_scale < 0) bad_step("next_scale", "a number >= 0", s.next_scale);
  if (s.grad_norm < 0) bad_step("grad_norm", "a number >= 0 (inf or NaN for an overflow)", s.grad_norm);
  if (!s.skip_reason.empty()) {
    const std::optional<SkipReason> r = parse_skip_reason(s.skip_reason);
    if (!r || (*r == SkipReason::none) != s.applied) {
      std::string names;
      for (std::string_view n : skip_reason_names()) names += (names.empty() ? "" : ", ") + std::string(n);
      throw std::invalid_argument("telemetry: record(): skip_reason: expected " +
                                  std::string(s.applied ? "none or \"\" (the step was applied)"
                                                        : "a reason the step was skipped (" + names + ")") +
                                  ", found '" + s.skip_reason + "'");
    }
  }
  for (const nn::Fp8TensorStats& t : s.quantized) {
    const std::string where = "quantized '" + t.name + "'";
    if (t.name.empty()) throw std::invalid_argument("telemetry: record(): quantized: a tensor without a name");
    if (!lowp::parse_recipe(t.recipe))
      throw std::invalid_argument("telemetry: record(): " + where + ": recipe: expected one of " + lowp::recipe_names() +
                                  ", found '" + t.recipe + "'");
    if (std::isnan(t.scale) || t.scale < 0) bad_step(where + ": scale", "a number >= 0", t.scale);
    if (!t.counts_consistent())
      bad_step(where + ": elements", nn::Fp8TensorStats::kElementsRule, static_cast<double>(t.elements));
    if (t.rel_rms_error && !(*t.rel_rms_error >= 0))
      bad_step(where + ": rel_rms_error", "a number >= 0", *t.rel_rms_error);
    for (std::size_t i = 0; i < t.what_if.size(); ++i)
      if (!lowp::parse_recipe(t.what_if[i].recipe))
        throw std::invalid_argument("telemetry: record(): " + where + ": what_if[" + std::to_string(i) +
                                    "].recipe: expected one of " + lowp::recipe_names() + ", found '" +
                                    t.what_if[i].recipe + "'");
    if (const std::optional<FieldProblem> p = sampled_stats_problem(t))
      bad_step(where + ": " + p->field, p->rule, p->found);
  }
}

double format_max(DType t) { return static_cast<double>(format_row(format_of(t)).max_finite); }

// What count.hpp reports for a view (an empty view: nothing, 0 elements).
CountedTensor count_view(const GradTensor& t) {
  if (t.size == 0 || t.data == nullptr) return {};
  switch (t.dtype) {
    case DType::f16: return count_f16_as_stored({static_cast<const f16*>(t.data), t.size});
    case DType::bf16: return count_bf16_to_f16({static_cast<const bf16*>(t.data), t.size});
    case DType::f32: break;
  }
  return count_f32_to_f16({static_cast<const float*>(t.data), t.size});
}

// count.hpp's |max| pass over a view (0 for an empty one): inf iff it holds inf or NaN.
float amax_view(const GradTensor& t) {
  if (t.size == 0 || t.data == nullptr) return 0.0f;
  switch (t.dtype) {
    case DType::f16: return amax_f16({static_cast<const f16*>(t.data), t.size});
    case DType::bf16: return amax_bf16({static_cast<const bf16*>(t.data), t.size});
    case DType::f32: break;
  }
  return amax_f32({static_cast<const float*>(t.data), t.size});
}

void merge(nn::Log2Histogram& into, const nn::Log2Histogram& h) {
  for (std::size_t i = 0; i < into.counts.size() && i < h.counts.size(); ++i) into.counts[i] += h.counts[i];
  into.zeros += h.zeros;
  into.nonfinite += h.nonfinite;
}

}  // namespace

TelemetryRecorder::TelemetryRecorder(std::string dir, const TelemetryOptions& options)
    : dir_(std::move(dir)),
      config_(run_config(options)),
      histogram_every_(options.histogram_every),
      folder_(dir_, RunFolder::Mode::create, options.writer),
      alerts_({}, alert_context(config_, options)) {
  folder_.write_config(run_config_text(config_, options.writer, kConfigKeys, options.loss_scale_config));
  folder_.create_log();  // readable before the first record(): a run of no steps yet
}

bool TelemetryRecorder::histogram_step() const noexcept {
  return train::histogram_step(step_ + 1, histogram_every_);  // the last step is not known here
}

double TelemetryRecorder::seconds() {
  std::lock_guard lock(mu_);
  return seconds_;
}

void TelemetryRecorder::add_seconds(double s) {
  std::lock_guard lock(mu_);
  seconds_ += s;
}

// The view as fp32: itself, or widened (exactly) into `scratch`. Caller holds the lock.
std::span<const float> TelemetryRecorder::as_f32(const GradTensor& t, std::vector<float>& scratch) {
  if (t.size == 0 || t.data == nullptr) return {};
  if (t.dtype == DType::f32) return {static_cast<const float*>(t.data), t.size};
  if (scratch.size() < t.size) scratch.resize(t.size);
  const std::span<float> out(scratch.data(), t.size);
  if (t.dtype == DType::f16)
    f16_to_f32(std::span<const f16>(static_cast<const f16*>(t.data), t.size), out);
  else
    bf16_to_f32(std::span<const bf16>(static_cast<const bf16*>(t.data), t.size), out);
  return out;
}

void TelemetryRecorder::count_activation_grad(std::string_view name, const GradTensor& grad) {
  std::lock_guard lock(mu_);
  const Spent spent(seconds_);
  add_counted(name, count_view(grad), grad.dtype);
  // Histogram steps only: the histogram reads fp32 (every kHistogramStride-th value).
  if (histogram_step()) hist_.activation_grads.add(as_f32(grad, f32_scratch_), nn::kHistogramStride);
}

void TelemetryRecorder::add_activation_grad(std::string_view name, const CountedTensor& counted, DType dtype) {
  std::lock_guard lock(mu_);
  const Spent spent(seconds_);
  add_counted(name, counted, dtype);
}

void TelemetryRecorder::add_counted(std::string_view name, const CountedTensor& counted, DType dtype) {
  const ConversionStats& s = counted.stats;
  const float amax = counted.amax;  // inf when the tensor holds inf/NaN
  // Binades between this gradient's largest value and its format's largest finite.
  const double headroom = amax > 0 && std::isfinite(amax) ? std::log2(format_max(dtype) / static_cast<double>(amax))
                                                          : std::numeric_limits<double>::infinity();
  headroom_ = std::min(headroom_, headroom);
  act_total_ += s;
  act_amax_ = std::max(act_amax_, amax);
  if (s.nonfinite_input && first_nonfinite_grad_.empty()) first_nonfinite_grad_ = name;
  for (auto& t : act_) {
    if (t.name == name) {
      t.stats += s;
      t.amax = std::max(t.amax, amax);
      return;
    }
  }
  act_.push_back({std::string(name), s, amax});
}

void TelemetryRecorder::forward_nonfinite(std::string_view name) {
  std::lock_guard lock(mu_);
  if (first_nonfinite_forward_.empty()) first_nonfinite_forward_ = name;
}

void TelemetryRecorder::add_histograms(const StepRecord::Histograms& h) {
  std::lock_guard lock(mu_);
  const Spent spent(seconds_);
  merge(hist_.activations, h.activations);
  merge(hist_.activation_grads, h.activation_grads);
  merge(hist_.weight_grads, h.weight_grads);
  merge(hist_.weights, h.weights);
}

bool TelemetryRecorder::check_activation(std::string_view name, const GradTensor& output) {
  std::lock_guard lock(mu_);
  const Spent spent(seconds_);
  if (output.size == 0 || output.data == nullptr) return false;
  // The |max| pass alone: one read of the codes, no counts (3-4x the counting pass's rate in cache).
  const bool nonfinite = std::isinf(amax_view(output));
  if (nonfinite && first_nonfinite_forward_.empty()) first_nonfinite_forward_ = name;
  if (histogram_step()) hist_.activations.add(as_f32(output, f32_scratch_), nn::kHistogramStride);
  return nonfinite;
}

StepRecord TelemetryRecorder::record(const TelemetryStep& step, std::span<const NamedParam> params) {
  const auto t0 = std::chrono::steady_clock::now();
  check_step(step);
  if (step.step != 0 && step.step <= step_)
    throw std::invalid_argument("telemetry: record(): step: expected a number above the previous step " +
                                std::to_string(step_) + ", found " + std::to_string(step.step));
  const bool histograms = histogram_step();  // as the hooks were told: the coming step's plan
  StepRecord r;
  r.step = step.step != 0 ? step.step : step_ + 1;
  r.lr = step.lr;
  r.loss = step.loss;
  r.loss_finite = std::isfinite(step.loss);
  r.val_loss = step.val_loss;
  r.scale = step.scale;
  r.next_scale = step.next_scale;
  r.found_inf = step.found_inf;
  r.skipped = !step.applied;
  if (!step.skip_reason.empty()) r.skip_reason = *parse_skip_reason(step.skip_reason);
  else r.skip_reason = step.applied ? SkipReason::none : step.found_inf ? SkipReason::nonfinite_grad : SkipReason::user;
  r.loss_z = step.loss_z;
  r.grad_z = step.grad_z;
  r.grad_norm = step.found_inf ? std::numeric_limits<double>::quiet_NaN() : step.grad_norm;
  r.clip_coef = step.clip_coef;
  r.overflow_param = step.overflow_param;
  r.layers = step.layers;
  r.fp8 = step.quantized;
  r.recipe_phase = step.recipe_phase;
  r.tokens = step.tokens;
  r.seconds = step.seconds;

  // One read-only pass of the multi-tensor kernel over every gradient and weight whose
  // |max| was not measured elsewhere.
  const std::size_t n = params.size();
  std::vector<GradTensor> measured;
  std::vector<float*> into;
  std::vector<float> grad_amax(n, 0.0f), weight_amax(n, 0.0f);
  auto present = [](const GradTensor& t) { return t.size > 0 && t.data != nullptr; };
  for (std::size_t i = 0; i < n; ++i) {
    const NamedParam& p = params[i];
    if (p.unclipped_grad_amax) grad_amax[i] = *p.unclipped_grad_amax;
    else if (p.grad_amax) grad_amax[i] = *p.grad_amax;
    else if (present(p.grad)) measured.push_back(p.grad), into.push_back(&grad_amax[i]);
    if (p.weight_amax) weight_amax[i] = *p.weight_amax;
    else if (present(p.weight)) measured.push_back(p.weight), into.push_back(&weight_amax[i]);
  }
  if (!measured.empty()) {
    std::vector<float> amax(measured.size());
    measure_amax(measured, 1.0f, amax);
    for (std::size_t k = 0; k < amax.size(); ++k) *into[k] = amax[k];
  }
  r.params.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const NamedParam& p = params[i];
    StepRecord::ParamStats ps;
    ps.name = p.name;
    if (p.unclipped_grad_amax) {
      ps.grad_amax = grad_amax[i];
    } else if (p.grad_amax || present(p.grad)) {
      // step() left the gradients unscaled and clipped: undo the coefficient.
      float a = grad_amax[i];
      if (std::isfinite(a) && step.applied && step.clip_coef < 1.0f) a /= step.clip_coef;
      ps.grad_amax = a;
    }
    if (p.weight_amax || present(p.weight)) ps.weight_amax = weight_amax[i];
    r.params.push_back(std::move(ps));
  }
  {
    // The step's counts are read here and cleared only once the line is in the log: a write
    // that fails leaves them for the next record() of the same step.
    std::lock_guard lock(mu_);
    if (histograms) {
      StepRecord::Histograms h = hist_;
      for (const NamedParam& p : params) {
        h.weight_grads.add(as_f32(p.grad, f32_scratch_));
        h.weights.add(as_f32(p.weight, f32_scratch_));
      }
      r.histograms = std::move(h);
    }
    r.act_grads = act_total_;
    r.act_grad_amax = act_amax_;
    r.headroom_log2 = std::isfinite(headroom_) ? headroom_ : 0.0;  // the tightest counted tensor; 0 when none
    r.act_grad_tensors = act_;
    r.overflow_activation = first_nonfinite_grad_;
    r.forward_nonfinite = first_nonfinite_forward_;
    folder_.append_log(step_record_json(r));
    step_ = r.step;
    hist_ = {};
    act_.clear();
    act_total_ = {};
    act_amax_ = 0;
    headroom_ = std::numeric_limits<double>::infinity();
    first_nonfinite_grad_.clear();
    first_nonfinite_forward_.clear();
  }
  (void)alerts_.observe(r);
  totals_.add(r);
  if (param_count_ == 0)
    for (const NamedParam& p : params) param_count_ += p.weight.size;
  add_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return r;
}

std::vector<monitor::Alert> TelemetryRecorder::finish() {
  TrainSummary s = totals_.summary();
  s.final_loss = totals_.shown_final_loss();
  s.param_count = param_count_;
  // The summary with the run's alerts, as mixprec train writes it.
  const std::vector<monitor::Alert> alerts = alerts_.all();
  folder_.write_summary(monitor::summary_with_alerts(summary_json(s, to_json(config_, kConfigKeys)), alerts));
  return alerts;
}

}  // namespace mixprec::train
