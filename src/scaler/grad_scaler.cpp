// mixprec::GradScaler: ScalerProtocol over ParamStore views and mixprec optimizers.
#include "mixprec/scaler/grad_scaler.hpp"

#include "mixprec/scaler/check_gradients.hpp"

namespace mixprec {

GradScaler::GradScaler(const LossScaleConfig& config, bool enabled, std::string preset)
    : ScalerDoor(ScalerProtocol(config, enabled, Dialect::mixprec, std::move(preset))) {}

GradScaler::GradScaler(std::unique_ptr<LossScale> scale, bool enabled)
    : ScalerDoor(ScalerProtocol(std::move(scale), enabled)) {}

void GradScaler::unscale(Optimizer& opt, ThreadPool* pool) {
  if (!protocol_.checks_on_unscale()) return;
  protocol_.begin_unscale(id_of(opt));
  protocol_.record(id_of(opt), check_gradients(opt.store().grad_tensors(), get_scale(), true, pool));
}

StepOutcome step_outcome(const StepDecision& decision) {
  StepOutcome out;
  out.scale = decision.scale;
  out.found_inf = decision.found_inf;
  out.first_overflow = decision.first_overflow;
  out.grad_norm = decision.grad_norm;
  out.clip_coef = decision.clip_coef;
  out.reason = decision.reason;
  out.guard = decision.guard;
  return out;
}

StepOutcome GradScaler::step(Optimizer& opt, const StepOptions& options) {
  mixprec::DecideOptions d;
  d.max_grad_norm = options.max_grad_norm;
  ScalerProtocol::validate_options(d);  // before anything is read or written
  const OptimizerId id = id_of(opt);
  // The mixprec dialect never passes through: a disabled scaler still checks (at scale 1).
  if (protocol_.begin_step(id) == StepPlan::check) {
    // Fused: a read-only check; the optimizer multiplies by the carried 1/S as it reads.
    protocol_.record(id, check_gradients(opt.store().grad_tensors(), get_scale(), false, options.pool));
  }
  d.found_inf_elsewhere = options.found_inf_elsewhere;
  d.global_grad_norm = options.global_grad_norm;
  if (options.loss) protocol_.observe_loss(*options.loss);
  if (options.skip_if) d.user_skip = options.skip_if(protocol_.guard_view(id, d));
  const StepDecision decision = protocol_.decide(id, d);

  StepOutcome out = step_outcome(decision);
  if (out.first_overflow >= 0) out.first_overflow_name = opt.store().spec(static_cast<std::size_t>(out.first_overflow)).name;
  if (decision.apply) {
    StepControls c;
    c.inv_scale = decision.carried_inv_scale;
    c.clip_coef = decision.clip_coef;
    c.lr = options.lr;
    out.applied = opt.step(c, options.pool);
  }
  protocol_.step_done(id);
  return out;
}

}  // namespace mixprec
