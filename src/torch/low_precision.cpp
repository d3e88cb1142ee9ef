// mixprec::torch::LowPrecisionLinear and LowPrecision (include/mixprec/torch/low_precision.hpp):
// the per-GEMM quantization of TE's recipes through the core's lowp::quantize, as a libtorch
// autograd function. The same GEMMs as python/mixprec/torch/low_precision.py.
#include "mixprec/torch/low_precision.hpp"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>

#include "mixprec/lowp/scaling.hpp"

namespace mixprec::torch {

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

at::Tensor as_fp32_2d(const at::Tensor& t, std::int64_t cols) {
  return t.detach().reshape({-1, cols}).to(at::kFloat).contiguous();
}

int index_of(OperandRole r) { return static_cast<int>(r); }

bool per_tensor(const lowp::QuantizeConfig& c) {
  return c.recipe == lowp::Recipe::fp8_delayed || c.recipe == lowp::Recipe::fp8_current;
}

// The config of each operand the plan quantizes (nullopt: high precision).
std::array<std::optional<lowp::QuantizeConfig>, lowp::kOperands> configs_of(const lowp::LinearPlan& plan) {
  std::array<std::optional<lowp::QuantizeConfig>, lowp::kOperands> out;
  for (std::size_t i = 0; i < lowp::kOperands; ++i) {
    const auto o = static_cast<lowp::Operand>(i);
    if (plan.at(o)) out[i] = plan.config(o);
  }
  return out;
}

// One operand quantized with its config and dequantized. A per-tensor recipe quantizes
// rowwise (both layouts hold the same values); fp8-delayed takes its tensor's scale; `rht`
// replaces the config's (the door drops it where the batch is not a multiple of 16).
at::Tensor quantize_operand(const at::Tensor& t, lowp::QuantizeConfig c, float scale, bool rht,
                            std::span<const std::uint32_t> random = {}, lowp::Quantized* out = nullptr) {
  if (per_tensor(c)) c.layout = lowp::Layout::rowwise;
  if (c.recipe == lowp::Recipe::fp8_delayed) c.scale = scale;
  c.rht = rht;
  return fake_quantize(t, c, random, out);
}

// Two configs that quantize a tensor to the same values: a per-tensor recipe with the same
// options (its layouts differ only in the grid's order), so wgrad reuses fprop's (dgrad's) values.
bool same_values(const std::optional<lowp::QuantizeConfig>& a, const std::optional<lowp::QuantizeConfig>& b) {
  if (!a || !b || !per_tensor(*a)) return false;
  lowp::QuantizeConfig bb = *b;
  bb.layout = a->layout;
  return bb == *a;
}

constexpr std::size_t at_(lowp::Operand o) { return static_cast<std::size_t>(o); }

// The plan's GEMMs (the header). Each tensor's statistics (and fp8-delayed's history) come from
// its first quantized operand: x from fprop.x else wgrad.x, w from fprop.w else dgrad.w, dy
// from dgrad.dy else wgrad.dy.
class LowPrecisionFn : public ::torch::autograd::Function<LowPrecisionFn> {
 public:
  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, LowPrecisionLinearImpl* self) {
    const std::size_t index = self->active_index();
    const lowp::LinearPlan& plan = self->plan_number(index);
    const auto cfg = configs_of(plan);
    const auto& cx = cfg[at_(lowp::Operand::fprop_x)];
    const auto& cw = cfg[at_(lowp::Operand::fprop_w)];
    const auto& cxc = cfg[at_(lowp::Operand::wgrad_x)];
    const std::int64_t k = x.size(-1);
    const at::Tensor x2 = as_fp32_2d(x, k);
    const at::Tensor w = weight.detach().to(at::kFloat).contiguous();
    const bool sample = self->sampling();
    const float sx = self->role_scale(OperandRole::x), sw = self->role_scale(OperandRole::w);
    at::Tensor xq = x2, wq = w;
    if (cx) {
      lowp::Quantized qx;
      xq = quantize_operand(x2, *cx, sx, false, {}, &qx);
      self->record(OperandRole::x, qx, sx, *cx, sample ? x2 : at::Tensor(), xq);
    }
    if (cw) {
      lowp::Quantized qw;
      wq = quantize_operand(w, *cw, sw, false, {}, &qw);
      self->record(OperandRole::w, qw, sw, *cw, sample ? w : at::Tensor(), wq);
    }
    at::Tensor y = at::matmul(xq, wq.t());
    if (bias.defined()) y = y + bias.detach().to(at::kFloat);
    // wgrad's x, kept for the backward: from the original x or from the values fprop
    // multiplied; RHT along the batch where it is a multiple of 16 (on dy too, or on neither).
    const bool dequantized = plan.x_source == lowp::Source::dequantized;
    const at::Tensor& src = dequantized ? xq : x2;
    const bool rht = cxc && cxc->rht && x2.size(0) % 16 == 0;
    at::Tensor xc = src;
    if (cxc) {
      if (!dequantized && same_values(cx, cxc)) {
        xc = xq;
      } else {
        lowp::Quantized qxc;
        xc = quantize_operand(src, *cxc, sx, rht, {}, &qxc);
        if (!cx) self->record(OperandRole::x, qxc, sx, *cxc, sample ? src : at::Tensor(), xc);
      }
    }
    ctx->save_for_backward({xc});
    ctx->saved_data["self"] = reinterpret_cast<std::int64_t>(self);
    ctx->saved_data["plan"] = static_cast<std::int64_t>(index);  // the backward runs the forward's plan
    ctx->saved_data["sw"] = static_cast<double>(sw);
    ctx->saved_data["rht"] = rht;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<std::int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<std::int64_t>(weight.scalar_type());
    ctx->saved_data["has_bias"] = bias.defined();
    std::vector<std::int64_t> out_sizes = x.sizes().vec();
    out_sizes.back() = y.size(1);
    return y.to(x.scalar_type()).reshape(out_sizes);
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    auto* self = reinterpret_cast<LowPrecisionLinearImpl*>(ctx->saved_data["self"].toInt());
    const lowp::LinearPlan& plan = self->plan_number(static_cast<std::size_t>(ctx->saved_data["plan"].toInt()));
    const auto cfg = configs_of(plan);
    const auto& cw = cfg[at_(lowp::Operand::fprop_w)];
    const auto& cdy = cfg[at_(lowp::Operand::dgrad_dy)];
    const auto& cwd = cfg[at_(lowp::Operand::dgrad_w)];
    const auto& cdc = cfg[at_(lowp::Operand::wgrad_dy)];
    const at::Tensor xc = ctx->get_saved_variables()[0];
    const float sw = static_cast<float>(ctx->saved_data["sw"].toDouble());
    const bool rht = ctx->saved_data["rht"].toBool();
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    const at::Tensor dy2 = as_fp32_2d(grads[0], grads[0].size(-1));
    const at::Tensor w = self->weight.detach().to(at::kFloat).contiguous();
    const float sdy = self->role_scale(OperandRole::dy);
    const bool sample = self->sampling();
    const auto n = static_cast<std::size_t>(dy2.numel());
    // Stochastic rounding's words: dgrad's dy first, then wgrad's, each only where its config has it.
    at::Tensor dyq = dy2;
    if (cdy) {
      const std::vector<std::uint32_t> random = cdy->stochastic_rounding ? self->random_words(n) : std::vector<std::uint32_t>();
      lowp::Quantized qdy;
      dyq = quantize_operand(dy2, *cdy, sdy, false, random, &qdy);
      self->record(OperandRole::dy, qdy, sdy, *cdy, sample ? dy2 : at::Tensor(), dyq);
    }
    // dgrad: w along its output dimension (W does not change between a forward and its
    // backward), from the original or from the values fprop multiplied (quantized again here).
    const at::Tensor wsrc = plan.w_source == lowp::Source::dequantized ? quantize_operand(w, *cw, sw, false) : w;
    at::Tensor wc = wsrc;
    if (cwd) {
      lowp::Quantized qwc;
      wc = quantize_operand(wsrc, *cwd, sw, false, {}, &qwc);
      if (!cw) self->record(OperandRole::w, qwc, sw, *cwd, sample ? wsrc : at::Tensor(), wc);
    }
    at::Tensor dx = at::matmul(dyq, wc).to(x_dtype).reshape(ctx->saved_data["x_sizes"].toIntVector());
    // wgrad: both operands along the batch, RHT on both or on neither.
    at::Tensor dyc = dy2;
    if (cdc) {
      if (same_values(cdy, cdc)) {
        dyc = dyq;
      } else {
        const std::vector<std::uint32_t> random = cdc->stochastic_rounding ? self->random_words(n) : std::vector<std::uint32_t>();
        lowp::Quantized qdc;
        dyc = quantize_operand(dy2, *cdc, sdy, rht, random, &qdc);
        if (!cdy) self->record(OperandRole::dy, qdc, sdy, *cdc, sample ? dy2 : at::Tensor(), dyc);
      }
    }
    at::Tensor dw = at::matmul(dyc.t(), xc).to(w_dtype);
    at::Tensor db = ctx->saved_data["has_bias"].toBool() ? dy2.sum(0).to(w_dtype) : at::Tensor();
    self->end_sample();
    return {dx, dw, db, at::Tensor()};
  }
};

}  // namespace

at::Tensor fake_quantize(const at::Tensor& t, const lowp::QuantizeConfig& config, std::span<const std::uint32_t> random,
                         lowp::Quantized* out) {
  if (t.dim() != 2) fail("fake_quantize: expected a 2-D tensor, found " + std::to_string(t.dim()) + " dimensions");
  if (t.device().type() != c10::DeviceType::CPU) fail("fake_quantize: expected a CPU tensor");
  const at::Tensor a = t.detach().to(at::kFloat).contiguous();
  const auto rows = static_cast<std::size_t>(a.size(0)), cols = static_cast<std::size_t>(a.size(1));
  lowp::Quantized q = lowp::quantize({a.data_ptr<float>(), rows * cols}, rows, cols, config, random);
  at::Tensor result = at::empty({a.size(0), a.size(1)}, at::kFloat);
  lowp::dequantize(q, {result.data_ptr<float>(), rows * cols});
  if (out != nullptr) *out = std::move(q);
  return result;
}

// ---- PlanSchedule ----------------------------------------------------------------------

std::vector<std::uint64_t> PlanSchedule::starts() const {
  try {
    return assignment->phase_starts(total_steps);
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    const std::string core_hint = "give the door the number of steps";
    if (const auto at = m.find(core_hint); at != std::string::npos)
      m.replace(at, core_hint.size(), "give LowPrecision the run's steps (from_file(path, total_steps) or set_total_steps)");
    fail(m);
  }
}

lowp::LinearPlan PlanSchedule::plan_at(std::uint64_t step) const {
  starts();  // the door's message for a fraction phase without the run's length
  return lowp::plan(assignment->choice_at(name, step, total_steps), assignment->options);
}

std::optional<lowp::LinearPlan> PlanSchedule::evaluation_plan() const {
  if (!assignment->evaluation) return std::nullopt;
  // Evaluation runs its recipe on the Linears the entry quantizes; the others stay high.
  if (!lowp::plan(assignment->entry(name), assignment->options).any_quantized()) return lowp::LinearPlan{};
  return lowp::plan(*assignment->evaluation, assignment->options);
}

std::vector<lowp::LinearPlan> PlanSchedule::reachable() const {
  std::vector<lowp::LinearPlan> out{plan_at(0)};
  for (const std::uint64_t s : starts()) out.push_back(plan_at(s));
  if (auto ev = evaluation_plan()) out.push_back(std::move(*ev));
  return out;
}

std::string PlanSchedule::label_at(std::uint64_t step) const {
  const std::vector<std::uint64_t> s = starts();
  std::optional<std::size_t> best;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] > step) continue;
    const lowp::Phase& ph = assignment->schedule[i];
    bool hit = ph.modules.empty();
    for (const auto& pat : ph.modules) hit = hit || lowp::module_matches(pat, name);
    if (hit && (!best || s[i] >= s[*best])) best = i;  // a later phase of the same step wins, as it is written last
  }
  return best ? assignment->schedule[*best].label : std::string();
}

// ---- LowPrecisionLinear ----------------------------------------------------------------

namespace {

lowp::LinearPlan uniform_plan(const lowp::LinearRecipe& recipe) {
  lowp::LinearPlan p;
  p.operands.fill(recipe);
  return p;
}

// The rules lowp::plan checks, for a plan given whole.
void check_plan(const lowp::LinearPlan& p, const std::string& who) {
  using lowp::Operand;
  for (const auto& r : p.operands)
    if (r) lowp::resolve(lowp::RecipeChoice::of(r->recipe));  // the recipe must be one of the table's
  const std::optional<lowp::LinearRecipe>* delayed = nullptr;
  for (const auto& r : p.operands)
    if (r && r->recipe == lowp::Recipe::fp8_delayed) delayed = &r;
  if (delayed) {
    for (std::size_t i = 0; i < lowp::kOperands; ++i)
      if (p.operands[i] && *p.operands[i] != **delayed)
        fail(who + ": " + std::string(lowp::operand_name(static_cast<Operand>(i))) +
             ": fp8-delayed keeps one amax history per tensor, so it combines only with high precision; found " +
             std::string(lowp::recipe_name(p.operands[i]->recipe)) + " beside it");
  }
  const bool qx = p.at(Operand::wgrad_x).has_value(), qdy = p.at(Operand::wgrad_dy).has_value();
  const bool rx = qx && p.config(Operand::wgrad_x).rht, rdy = qdy && p.config(Operand::wgrad_dy).rht;
  if (rx != rdy)
    fail(who + ": wgrad: the Hadamard transform cancels only when both operands have it; found it on " +
         (rx ? "x" : "dy") + " alone");
  if (p.x_source == lowp::Source::dequantized && !p.at(Operand::fprop_x))
    fail(who + ": x_source: \"dequantized\" takes the values fprop multiplied, but fprop.x is high precision");
  if (p.w_source == lowp::Source::dequantized && !p.at(Operand::fprop_w))
    fail(who + ": w_source: \"dequantized\" takes the values fprop multiplied, but fprop.w is high precision");
}

}  // namespace

LowPrecisionLinearImpl::LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features,
                                               const lowp::LinearRecipe& recipe, bool with_bias, std::uint64_t seed)
    : LowPrecisionLinearImpl(in_features, out_features, uniform_plan(recipe), with_bias, seed) {}

LowPrecisionLinearImpl::LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, const lowp::LinearRecipe& recipe,
                                               std::uint64_t seed)
    : LowPrecisionLinearImpl(linear, uniform_plan(recipe), seed) {}

LowPrecisionLinearImpl::LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features,
                                               const lowp::LinearPlan& plan, bool with_bias, std::uint64_t seed)
    : seed_(seed) {
  take_plans({plan}, std::nullopt);
  ::torch::nn::Linear lin(::torch::nn::LinearOptions(in_features, out_features).bias(with_bias));
  weight = register_parameter("weight", lin->weight);
  if (with_bias) bias = register_parameter("bias", lin->bias);
  init_buffers();
}

LowPrecisionLinearImpl::LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, const lowp::LinearPlan& plan,
                                               std::uint64_t seed)
    : seed_(seed) {
  take_plans({plan}, std::nullopt);
  weight = register_parameter("weight", linear->weight);
  if (linear->bias.defined()) bias = register_parameter("bias", linear->bias);
  init_buffers();
}

namespace {

// The schedule's plans, each once (step 0's first), and the index of the evaluation plan.
std::pair<std::vector<lowp::LinearPlan>, std::optional<std::size_t>> plans_of(const PlanSchedule& s) {
  if (!s.assignment) fail("LowPrecisionLinear: schedule.assignment: expected a recipe file, found none");
  std::vector<lowp::LinearPlan> plans;
  auto index = [&](const lowp::LinearPlan& p) {
    for (std::size_t i = 0; i < plans.size(); ++i)
      if (plans[i] == p) return i;
    plans.push_back(p);
    return plans.size() - 1;
  };
  index(s.plan_at(0));
  for (const std::uint64_t start : s.starts()) index(s.plan_at(start));
  std::optional<std::size_t> eval;
  if (const auto ev = s.evaluation_plan()) eval = index(*ev);
  return {std::move(plans), eval};
}

}  // namespace

LowPrecisionLinearImpl::LowPrecisionLinearImpl(std::int64_t in_features, std::int64_t out_features,
                                               PlanSchedule schedule, bool with_bias, std::uint64_t seed)
    : schedule_(std::move(schedule)), seed_(seed) {
  auto [plans, eval] = plans_of(*schedule_);
  take_plans(std::move(plans), eval);
  ::torch::nn::Linear lin(::torch::nn::LinearOptions(in_features, out_features).bias(with_bias));
  weight = register_parameter("weight", lin->weight);
  if (with_bias) bias = register_parameter("bias", lin->bias);
  init_buffers();
}

LowPrecisionLinearImpl::LowPrecisionLinearImpl(const ::torch::nn::Linear& linear, PlanSchedule schedule,
                                               std::uint64_t seed)
    : schedule_(std::move(schedule)), seed_(seed) {
  auto [plans, eval] = plans_of(*schedule_);
  take_plans(std::move(plans), eval);
  weight = register_parameter("weight", linear->weight);
  if (linear->bias.defined()) bias = register_parameter("bias", linear->bias);
  init_buffers();
}

std::string LowPrecisionLinearImpl::who() const {
  return schedule_ && !schedule_->name.empty() ? schedule_->name : std::string("LowPrecisionLinear");
}

void LowPrecisionLinearImpl::take_plans(std::vector<lowp::LinearPlan> plans, std::optional<std::size_t> eval) {
  std::optional<lowp::LinearRecipe> primary;
  for (const auto& p : plans) {
    check_plan(p, who());
    if (!primary) primary = p.primary();
    for (std::size_t i = 0; i < lowp::kOperands; ++i) {
      const auto& r = p.operands[i];
      if (!r) continue;
      if (r->recipe == lowp::Recipe::fp8_delayed) {
        // One amax history per tensor, whichever plan runs.
        if (delayed_ && *delayed_ != *r)
          fail(who() + ": fp8-delayed: expected the same options in every plan of the run (its amax history is "
               "one per tensor), found different ones; give every phase the same fp8-delayed options");
        delayed_ = r;
      }
      stochastic_ = stochastic_ || p.config(static_cast<lowp::Operand>(i)).stochastic_rounding;
    }
  }
  if (!primary)
    fail(who() + ": expected a plan that quantizes some operand, found every operand in high precision in every plan "
         "of the run (use a torch::nn::Linear)");
  primary_ = *primary;
  plans_ = std::move(plans);
  eval_ = eval;
}

void LowPrecisionLinearImpl::init_buffers() {
  if (delayed_) {
    amax_history = register_buffer("amax_history", at::zeros({3, static_cast<std::int64_t>(delayed_->amax_history_len)}, at::kFloat));
    scale = register_buffer("scale", at::ones({3}, at::kFloat));
  }
  // How many random streams stochastic rounding has drawn: saved with the module, so that a
  // resumed run draws the words the uninterrupted run would have drawn.
  if (stochastic_) sr_draws = register_buffer("sr_draws", at::zeros({}, at::kLong));
}

bool LowPrecisionLinearImpl::set_step(std::uint64_t step) {
  if (!schedule_) return false;
  const lowp::LinearPlan p = schedule_->plan_at(step);
  for (std::size_t i = 0; i < plans_.size(); ++i) {
    if (plans_[i] != p) continue;
    const bool changed = i != current_;
    current_ = i;
    return changed;
  }
  // Every step's plan is one of a phase's first steps' (the same phases have begun).
  throw std::logic_error(who() + ": the plan of step " + std::to_string(step) + " is not among the run's plans");
}

at::Tensor LowPrecisionLinearImpl::forward(const at::Tensor& x) {
  at::autocast::set_autocast_enabled(at::kCPU, false);  // restored below: the GEMMs are ours
  struct Restore {
    bool cpu;
    ~Restore() { at::autocast::set_autocast_enabled(at::kCPU, cpu); }
  } restore{at::autocast::is_autocast_enabled(at::kCPU)};
  return LowPrecisionFn::apply(x, weight, bias, this);
}

float LowPrecisionLinearImpl::role_scale(OperandRole r) const {
  if (!delayed_) return 1.0f;
  return scale.data_ptr<float>()[index_of(r)];
}

void LowPrecisionLinearImpl::record(OperandRole r, const lowp::Quantized& q, float scale_used,
                                    const lowp::QuantizeConfig& config, const at::Tensor& exact,
                                    const at::Tensor& approx) {
  const bool delayed = config.recipe == lowp::Recipe::fp8_delayed;
  RoleStats& s = stats_[index_of(r)];
  s.recipe = config.recipe;
  s.element = config.element;
  s.amax = q.counts.amax;
  s.scale = delayed ? scale_used : q.tensor_scale;
  s.elements = q.counts.elements;
  s.saturated = q.counts.saturated;
  s.flushed = q.counts.flushed;
  s.nonfinite = q.counts.nonfinite;
  s.rel_rms_error.reset();
  if (exact.defined()) {
    const double den = exact.to(at::kDouble).norm().item<double>();
    const double num = (approx - exact).to(at::kDouble).norm().item<double>();
    s.rel_rms_error = den > 0 ? num / den : 0.0;
  }
  if (delayed && is_training()) {
    // TE's delayed scaling: this step's amax enters the history, the next scale comes from it.
    const int i = index_of(r);
    float* h = amax_history[i].data_ptr<float>();
    const std::span<float> hist(h, delayed_->amax_history_len);
    hist[0] = lowp::fold_amax(hist[0], q.counts.amax);
    const float chosen = lowp::roll_history(hist, delayed_->amax_compute_algo);
    const float fp8_max = lowp::max_finite(config.element);
    float* sc = scale.data_ptr<float>();
    sc[i] = lowp::delayed_scale(chosen, sc[i], fp8_max, delayed_->margin);
  }
}

std::vector<std::uint32_t> LowPrecisionLinearImpl::random_words(std::size_t n) {
  std::uint64_t draws = draws_;
  if (sr_draws.defined()) {
    const std::int64_t d = sr_draws.item<std::int64_t>();
    if (d < 0)
      fail(who() + ": sr_draws: expected an integer >= 0, found " + std::to_string(d) + " (a state edited by hand?)");
    draws = static_cast<std::uint64_t>(d);
    sr_draws.fill_(static_cast<std::int64_t>(draws + 1));
  } else {
    ++draws_;
  }
  // A fixed stream per module and draw: the core's splitmix64 words (lowp::random_words).
  std::vector<std::uint32_t> r(n);
  lowp::random_words(seed_ * 0x100000001B3ull + draws, r);
  return r;
}

// ---- LowPrecision ----------------------------------------------------------------------

LowPrecision LowPrecision::uniform(const lowp::LinearRecipe& recipe) { return uniform(uniform_plan(recipe)); }

LowPrecision LowPrecision::uniform(const lowp::LinearPlan& plan) {
  LowPrecision p;
  p.uniform_ = plan;
  return p;
}

LowPrecision LowPrecision::uniform(std::string_view name) {
  if (const auto z = lowp::parse_zoo(name)) return uniform(lowp::plan(lowp::zoo_choice(*z)));
  const auto r = lowp::parse_recipe(name);
  if (!r) fail("recipe: expected one of " + lowp::recipe_names() + " or a zoo name (" + lowp::zoo_names() + "), found '" + std::string(name) + "'");
  return uniform(*lowp::resolve(lowp::RecipeChoice::of(r)));
}

LowPrecision LowPrecision::from_assignment(lowp::Assignment assignment, std::uint64_t total_steps) {
  LowPrecision p;
  p.assignment_ = std::make_shared<const lowp::Assignment>(std::move(assignment));
  p.total_steps_ = total_steps;
  return p;
}

LowPrecision LowPrecision::from_file(const std::string& path, std::uint64_t total_steps) {
  try {
    return from_assignment(lowp::read_assignment(path), total_steps);
  } catch (const std::runtime_error& e) {  // the file itself: missing, a FIFO, too large
    fail(std::string("recipe file: ") + e.what());
  }
}

LowPrecision& LowPrecision::set_total_steps(std::uint64_t total_steps) noexcept {
  total_steps_ = total_steps;
  return *this;
}

PlanSchedule LowPrecision::schedule_of(std::string_view name) const {
  return PlanSchedule{assignment_, std::string(name), total_steps_};
}

std::optional<lowp::LinearPlan> LowPrecision::plan_for(std::string_view name, std::size_t index,
                                                       std::size_t count) const {
  if (uniform_) {
    if (index == 0 || index + 1 >= count) return std::nullopt;
    return uniform_;
  }
  if (!assignment_) return std::nullopt;
  const PlanSchedule s = schedule_of(name);
  bool quantized = false;
  for (const auto& p : s.reachable()) quantized = quantized || p.any_quantized();
  if (!quantized) return std::nullopt;
  return s.plan_at(0);
}

std::optional<lowp::LinearRecipe> LowPrecision::recipe_for(std::string_view name, std::size_t index,
                                                           std::size_t count) const {
  const auto p = plan_for(name, index, count);
  return p ? p->primary() : std::nullopt;
}

::torch::nn::AnyModule LowPrecision::linear(std::string_view name, std::size_t index, std::size_t count,
                                            std::int64_t in_features, std::int64_t out_features, bool bias,
                                            std::uint64_t seed) const {
  if (const auto p = plan_for(name, index, count)) {
    if (uniform_) return ::torch::nn::AnyModule(LowPrecisionLinear(in_features, out_features, *p, bias, seed));
    return ::torch::nn::AnyModule(LowPrecisionLinear(in_features, out_features, schedule_of(name), bias, seed));
  }
  return ::torch::nn::AnyModule(::torch::nn::Linear(::torch::nn::LinearOptions(in_features, out_features).bias(bias)));
}

void LowPrecision::check_names(const std::vector<std::string>& linear_names) const {
  if (!assignment_) return;
  for (const auto& [n, c] : assignment_->modules) {
    bool found = false;
    for (const auto& l : linear_names) found = found || l == n;
    if (!found) fail("recipe file: module '" + n + "': expected a Linear of the model, found no such Linear");
  }
  for (std::size_t i = 0; i < assignment_->schedule.size(); ++i) {
    for (const auto& pat : assignment_->schedule[i].modules) {
      bool found = false;
      for (const auto& l : linear_names) found = found || lowp::module_matches(pat, l);
      if (!found)
        fail("recipe file: schedule[" + std::to_string(i) + "].modules: '" + pat +
             "': expected a pattern matching a Linear of the model, found none that it matches");
    }
  }
}

// ---- low_precision_step ----------------------------------------------------------------

std::vector<std::pair<std::string, std::string>> low_precision_step(::torch::nn::Module& model, std::uint64_t step) {
  std::vector<std::pair<std::string, std::string>> switched;
  std::vector<const LowPrecisionLinearImpl*> seen;  // a module registered under two names is one Linear
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    auto* m = dynamic_cast<LowPrecisionLinearImpl*>(item.value().get());
    if (m == nullptr || m->schedule() == nullptr) continue;
    if (std::find(seen.begin(), seen.end(), m) != seen.end()) continue;
    seen.push_back(m);
    if (m->set_step(step)) switched.emplace_back(item.key(), m->schedule()->label_at(step));
  }
  return switched;
}

}  // namespace mixprec::torch
