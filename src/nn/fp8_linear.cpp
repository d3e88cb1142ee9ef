// The quantized Linear layers of the quantized presets and of recipe files
// (src/nn/fp8_linear.hpp, docs/fp8.md, docs/low_precision.md).
#include "fp8_linear.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "mixprec/lowp/block_stats.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/nn/layers.hpp"

namespace mixprec::nn::detail {
namespace {

using lowp::Operand;

constexpr std::size_t at(Operand o) noexcept { return static_cast<std::size_t>(o); }

// The step's amax so far folded with another: NaN sticks, else the max.
float fold_amax(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return std::max(a, b);
}

// The smallest multiplier of any block of an mxfp8 quantization (the factor of its largest
// E8M0 scale), over the blocks whose factor is finite and > 0; 0 when there is none.
float smallest_mx_factor(const lowp::Quantized& q) {
  const lowp::ScaleRounding r = q.config.scale_rounding;
  float m = 0;
  for (const std::uint8_t code : q.scale_codes) {
    const float f = lowp::mx_quantize_factor(e8m0::from_bits(code), r);
    if (std::isfinite(f) && f > 0) m = m == 0 ? f : std::min(m, f);
  }
  return m;
}

void check_size(const char* what, std::size_t found, std::size_t expected) {
  if (found != expected) {
    throw std::invalid_argument(std::string("fp8 linear: ").append(what).append(": expected ")
                                    .append(std::to_string(expected)).append(" elements, found ")
                                    .append(std::to_string(found)));
  }
}

bool per_tensor(lowp::Recipe r) noexcept { return r == lowp::Recipe::fp8_delayed || r == lowp::Recipe::fp8_current; }

// The bytes of a quantization of [rows, cols] with config c: codes and scales, as lowp lays
// them out (the per-tensor scale counted as one fp32 scale_inv).
std::size_t quantized_bytes(const lowp::QuantizeConfig& c, std::size_t rows, std::size_t cols) {
  const lowp::RecipeInfo& info = lowp::recipe_info(c.recipe);
  const bool col = c.layout == lowp::Layout::columnwise;
  const std::size_t code_rows = col ? cols : rows, code_cols = col ? rows : cols;
  const std::size_t codes = code_rows * (c.element == lowp::Element::e2m1 ? (code_cols + 1) / 2 : code_cols);
  std::size_t scales = 1;
  if (info.block > 0) {
    const std::size_t tr = c.tile_2d ? info.tile_rows : 1;
    scales = ((code_rows + tr - 1) / tr) * ((code_cols + info.block - 1) / info.block);
  }
  return codes + scales * (info.scale_format == lowp::ScaleFormat::f32 ? sizeof(float) : 1);
}

// The tensor (0 x, 1 w, 2 dy) an operand reads.
std::size_t tensor_of(Operand o) noexcept {
  switch (o) {
    case Operand::fprop_x:
    case Operand::wgrad_x: return 0;
    case Operand::fprop_w:
    case Operand::dgrad_w: return 1;
    case Operand::dgrad_dy:
    case Operand::wgrad_dy: return 2;
  }
  return 0;
}

std::string delayed_text(const lowp::DelayedScalingConfig& c) {
  return std::string("amax_history_len ").append(std::to_string(c.amax_history_len))
      .append(", amax_compute_algo ").append(lowp::amax_algo_name(c.amax_compute_algo))
      .append(", margin ").append(std::to_string(c.margin))
      .append(", fp8_format ").append(lowp::format_key(c.format));
}

lowp::DelayedScalingConfig delayed_config_of(const lowp::LinearRecipe& r) {
  return {r.margin, r.amax_history_len, r.amax_compute_algo, r.fp8_format};
}

}  // namespace

std::vector<std::pair<std::uint64_t, lowp::LinearPlan>> recipe_timeline(const lowp::Assignment& a,
                                                                        std::string_view name,
                                                                        std::uint64_t total_steps) {
  std::vector<std::uint64_t> points = a.phase_starts(total_steps);
  points.push_back(0);
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  std::vector<std::pair<std::uint64_t, lowp::LinearPlan>> out;
  for (const std::uint64_t s : points) {
    lowp::LinearPlan p;
    try {
      p = lowp::plan(a.choice_at(name, s, total_steps), a.options);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("recipe file: " + std::string(name) + " from step " + std::to_string(s) + ": " +
                                  e.what());
    }
    if (out.empty() || !(out.back().second == p)) out.emplace_back(s, std::move(p));
  }
  return out;
}

// ---- Fp8Linears ------------------------------------------------------------------------

Fp8Linears::Fp8Linears(QuantizedGemms gemms, const Fp8Config& config) : gemms_(gemms), config_(config) {
  if (gemms.recipe == lowp::Recipe::fp8_current) {
    lowp::validate(lowp::CurrentScalingConfig{config.format, config.power_of_2_scales, config.amax_epsilon});
  }
  // The preset's recipe with the options of `config`, on every operand.
  lowp::LinearRecipe r;
  if (!per_tensor(gemms.recipe)) {
    lowp::RecipeChoice c = lowp::RecipeChoice::of(gemms.recipe);
    if (lowp::recipe_info(gemms.recipe).element != lowp::Element::e2m1) c.fp8_format = config.format;
    if (gemms.recipe == lowp::Recipe::mxfp8) c.scale_rounding = config.mx_rounding;
    r = *lowp::resolve(c);
  } else {
    r.recipe = gemms.recipe;
    r.fp8_format = config.format;
    r.amax_history_len = config.amax_history_len;
    r.amax_compute_algo = config.amax_compute_algo;
    r.margin = config.margin;
    if (gemms.recipe == lowp::Recipe::fp8_current) r.power_of_2_scales = config.power_of_2_scales;
  }
  lowp::LinearPlan p;
  p.operands.fill(r);
  (void)add_plan(p);
  delayed_config_ = lowp::DelayedScalingConfig{config.margin, config.amax_history_len, config.amax_compute_algo,
                                              config.format};
  delayed_on_ = gemms.delayed_scaling();
  unit_scale_ = gemms.unit_scale;
}

Fp8Linears::Fp8Linears(std::shared_ptr<const lowp::Assignment> recipes, std::uint64_t total_steps)
    : recipes_(std::move(recipes)), total_steps_(total_steps) {
  if (!recipes_) throw std::invalid_argument("Fp8Linears: expected a recipe file, found none");
  if (recipes_->evaluation) {
    const lowp::LinearPlan e = lowp::plan(*recipes_->evaluation, recipes_->options);
    for (const auto& r : e.operands)
      if (r && r->recipe == lowp::Recipe::fp8_delayed)
        throw std::invalid_argument("recipe file: evaluation: expected a recipe other than fp8-delayed (its scales "
                                    "come from the amax histories of training steps), found fp8-delayed");
    evaluation_plan_ = add_plan(e);
  }
}

std::size_t Fp8Linears::add_plan(const lowp::LinearPlan& p) {
  for (std::size_t i = 0; i < plans_.size(); ++i)
    if (plans_[i].plan == p) return i;
  RunPlan rp;
  rp.plan = p;
  for (std::size_t o = 0; o < lowp::kOperands; ++o) {
    if (!p.operands[o]) continue;
    lowp::QuantizeConfig c = p.config(static_cast<Operand>(o));
    if (per_tensor(c.recipe)) c.layout = lowp::Layout::rowwise;
    if (c.recipe == lowp::Recipe::fp8_current) c.amax_epsilon = config_.amax_epsilon;
    if (c.recipe == lowp::Recipe::fp8_delayed) rp.delayed = true;
    rp.config[o] = c;
  }
  auto same = [&](Operand a, Operand b) {
    const auto& ca = rp.config[at(a)];
    const auto& cb = rp.config[at(b)];
    return ca && cb && per_tensor(ca->recipe) && *ca == *cb;
  };
  rp.share_x = same(Operand::fprop_x, Operand::wgrad_x) && p.x_source == lowp::Source::original;
  rp.share_w = same(Operand::fprop_w, Operand::dgrad_w) && p.w_source == lowp::Source::original;
  rp.share_dy = same(Operand::dgrad_dy, Operand::wgrad_dy);
  rp.saved = p.at(Operand::wgrad_x)                   ? Saved::quantized
             : p.x_source == lowp::Source::dequantized ? Saved::fprop
                                                       : Saved::fp32;
  if (rp.delayed && recipes_) {
    // One DelayedScaling holds every tensor's amax history, under one config.
    for (const auto& r : p.operands) {
      if (!r || r->recipe != lowp::Recipe::fp8_delayed) continue;
      const lowp::DelayedScalingConfig d = delayed_config_of(*r);
      if (delayed_config_ && !(*delayed_config_ == d))
        throw std::invalid_argument("recipe file: fp8-delayed: expected one set of delayed-scaling options for the "
                                    "whole model (the engine keeps one amax-history config), found " +
                                    delayed_text(*delayed_config_) + " and " + delayed_text(d));
      delayed_config_ = d;
      delayed_on_ = true;
    }
  }
  plans_.push_back(std::move(rp));
  return plans_.size() - 1;
}

std::size_t Fp8Linears::add(const std::string& layer, std::size_t rows, std::size_t in, std::size_t out) {
  if (finished_) throw std::logic_error("Fp8Linears::add after finish");
  Linear l;
  l.rows = rows;
  l.in = in;
  l.out = out;
  l.tensor = stats_.size();
  if (recipes_) {
    for (const auto& [step, plan] : recipe_timeline(*recipes_, layer, total_steps_))
      l.timeline.emplace_back(step, add_plan(plan));
  } else {
    l.timeline.emplace_back(0, 0);
  }
  l.current = l.timeline.front().second;
  for (const auto& [step, i] : l.timeline) l.evaluated = l.evaluated || plans_[i].plan.any_quantized();
  const std::pair<const char*, lowp::Role> tensors[] = {
      {".input", lowp::Role::forward}, {".weight", lowp::Role::forward}, {".grad_output", lowp::Role::backward}};
  for (const auto& [suffix, role] : tensors) {
    Fp8TensorStats s;
    s.name = std::string(layer).append(suffix);
    s.role = role;
    s.dtype = lowp::dtype_for(config_.format, role);
    if (gemms_ && !per_tensor(gemms_->recipe)) {
      // The block-scaled presets name their recipe and each role's element.
      const lowp::LinearRecipe& r = *plans_.front().plan.at(Operand::fprop_x);
      const bool gradient = role == lowp::Role::backward, weight = suffix == std::string_view(".weight");
      s.recipe = std::string(lowp::recipe_name(r.recipe));
      s.element = r.config(gradient, weight, lowp::Layout::rowwise).element;
    }
    stats_.push_back(s);
  }
  max_weight_ = std::max(max_weight_, out * in);
  max_codes_ = std::max({max_codes_, rows * in, rows * out, out * in});
  max_random_ = std::max({max_random_, rows * out});
  // Per reachable plan: the work memory one call carves (own work memory holds the most a
  // backward carves; the forward's within it) and what the forward keeps.
  std::vector<std::size_t> reach;
  for (const auto& [step, plan] : l.timeline) reach.push_back(plan);
  if (evaluation_plan_) reach.push_back(*evaluation_plan_);
  for (const std::size_t i : reach) {
    const RunPlan& p = plans_[i];
    const bool training = std::find_if(l.timeline.begin(), l.timeline.end(),
                                       [&](const auto& t) { return t.second == i; }) != l.timeline.end();
    const std::size_t forward = p.config[at(Operand::fprop_x)] ? rows * in : 0;
    std::size_t backward = 0, saved = 0;
    if (training) {
      backward = (p.config[at(Operand::dgrad_dy)] ? rows * out : 0) +
                 (p.config[at(Operand::wgrad_dy)] && !p.share_dy ? rows * out : 0) +
                 (p.saved != Saved::fp32 ? rows * in : 0);
      switch (p.saved) {
        case Saved::quantized: saved = quantized_bytes(*p.config[at(Operand::wgrad_x)], rows, in); break;
        case Saved::fprop: saved = quantized_bytes(*p.config[at(Operand::fprop_x)], rows, in); break;
        case Saved::fp32: saved = rows * in * sizeof(float); break;
      }
    }
    max_work_ = std::max({max_work_, forward, backward});
    l.saved_bytes = std::max(l.saved_bytes, saved);
  }
  linears_.push_back(std::move(l));
  return linears_.size() - 1;
}

void Fp8Linears::finish(bool own_work) {
  delayed_ = lowp::DelayedScaling(delayed_config_.value_or(lowp::DelayedScalingConfig{}));
  for (const Fp8TensorStats& s : stats_) delayed_.add_tensor(s.name, s.role);
  wq_.assign(max_weight_, 0.0f);
  if (own_work) work_.assign(max_work_, 0.0f);
  saved_q_.resize(linears_.size());
  saved_x_.resize(linears_.size());
  for (std::size_t id = 0; id < linears_.size(); ++id) {
    const Linear& l = linears_[id];
    for (const auto& [step, i] : l.timeline)
      if (plans_[i].saved == Saved::fp32) saved_x_[id].assign(l.rows * l.in, 0.0f);
  }
  work_q_.codes.reserve(max_codes_);  // the largest operand's codes (fp4 needs half)
  finished_ = true;
  if (recipes_) {
    for (std::size_t id = 0; id < linears_.size(); ++id) describe_tensors(id);
    random_.resize(max_random_);
    warm_up();
  }
}

void Fp8Linears::describe_tensors(std::size_t id) {
  const Linear& l = linears_[id];
  const RunPlan& p = plans_[l.current];
  const Operand first[3][2] = {{Operand::fprop_x, Operand::wgrad_x},
                               {Operand::fprop_w, Operand::dgrad_w},
                               {Operand::dgrad_dy, Operand::wgrad_dy}};
  for (std::size_t k = 0; k < 3; ++k) {
    const auto& a = p.config[at(first[k][0])];
    const auto& c = a ? a : p.config[at(first[k][1])];
    Fp8TensorStats& s = stats_[l.tensor + k];
    if (c) {
      s.recipe = lowp::recipe_name(c->recipe);
      s.element = c->element;
      s.dtype = c->element == lowp::Element::e5m2 ? lowp::Element::e5m2 : lowp::Element::e4m3;
    } else {
      s.recipe.clear();  // not quantized: no counts (the run log leaves it out)
    }
  }
}

void Fp8Linears::warm_up() {
  std::size_t largest = 0;
  for (const Linear& l : linears_) largest = std::max({largest, l.rows * l.in, l.rows * l.out, l.out * l.in});
  const std::vector<float> zeros(largest, 0.0f);
  std::vector<float> sink(largest, 0.0f);
  const std::vector<std::uint32_t> words(largest, 0u);
  for (std::size_t id = 0; id < linears_.size(); ++id) {
    const Linear& l = linears_[id];
    std::vector<std::size_t> reach;
    for (const auto& [step, i] : l.timeline) reach.push_back(i);
    if (evaluation_plan_) reach.push_back(*evaluation_plan_);
    for (const std::size_t i : reach) {
      const RunPlan& p = plans_[i];
      for (std::size_t o = 0; o < lowp::kOperands; ++o) {
        if (!p.config[o]) continue;
        const Operand op = static_cast<Operand>(o);
        const std::size_t t = tensor_of(op);
        const std::size_t rows = t == 1 ? l.out : l.rows, cols = t == 2 ? l.out : l.in;
        const lowp::QuantizeConfig c = call_config(p, op, l.tensor + t, l.rows);
        const bool kept = (op == Operand::wgrad_x && p.saved == Saved::quantized) ||
                          (op == Operand::fprop_x && (p.share_x || p.saved == Saved::fprop));
        lowp::Quantized& q = kept ? saved_q_[id] : work_q_;
        const std::size_t n = rows * cols;
        lowp::quantize(std::span<const float>(zeros.data(), n), rows, cols, c,
                       c.stochastic_rounding ? std::span<const std::uint32_t>(words.data(), n)
                                             : std::span<const std::uint32_t>{},
                       q);
        lowp::dequantize(q, std::span<float>(sink.data(), n));
      }
    }
  }
}

bool Fp8Linears::set_step(std::uint64_t step) {
  bool changed = false;
  for (std::size_t id = 0; id < linears_.size(); ++id) {
    Linear& l = linears_[id];
    std::size_t want = l.timeline.front().second;
    for (const auto& [first, i] : l.timeline)
      if (first <= step) want = i;
    if (want == l.current) continue;
    l.current = want;
    describe_tensors(id);
    changed = true;
  }
  return changed;
}

lowp::QuantizeConfig Fp8Linears::call_config(const RunPlan& p, Operand o, std::size_t t, std::size_t rows) const {
  lowp::QuantizeConfig c = *p.config[at(o)];
  if (c.recipe == lowp::Recipe::fp8_delayed) c.scale = delayed_on_ && !unit_scale_ ? delayed_.scale(t) : 1.0f;
  // TE's transform runs along the batch in groups of 16: on both wgrad operands or neither.
  if (c.rht && rows % 16 != 0) c.rht = false;
  return c;
}

namespace {

// Carves the spans one call needs out of the work memory (first fit); allocates nothing.
class Carver {
 public:
  explicit Carver(Fp8Linears::Work work) : work_(work) {
    if (work.size() > kMax) throw std::logic_error("fp8 linear: more than 8 work spans");
  }
  std::span<float> take(std::size_t n) {
    for (std::size_t i = 0; i < work_.size(); ++i) {
      if (work_[i].size() - used_[i] >= n) {
        const std::span<float> s = work_[i].subspan(used_[i], n);
        used_[i] += n;
        return s;
      }
    }
    throw std::logic_error("fp8 linear: the work memory is too small for " + std::to_string(n) + " floats");
  }

 private:
  static constexpr std::size_t kMax = 8;
  Fp8Linears::Work work_;
  std::size_t used_[kMax] = {};
};

const GemmArgs kAccumulateNN{.trans_a = Trans::no, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f};
const GemmArgs kAccumulateTN{.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f};

}  // namespace

std::span<const std::uint32_t> Fp8Linears::random_words(std::size_t n) {
  // A fixed stream (splitmix64 from a draw counter), so runs repeat exactly.
  if (random_.size() < n) random_.resize(n);
  lowp::random_words(0x5EEDull * 0x100000001B3ull + draws_++, std::span<std::uint32_t>(random_.data(), n));
  return {random_.data(), n};
}

Fp8Linears::Pending Fp8Linears::lowp_fake(std::span<const float> x, std::span<float> out, std::size_t rows,
                                          std::size_t cols, const lowp::QuantizeConfig& c, lowp::Quantized* keep) {
  // Into kept buffers (X's saved copy, or this object's): a warm step allocates nothing.
  lowp::Quantized& q = keep != nullptr ? *keep : work_q_;
  lowp::quantize(x.first(rows * cols), rows, cols, c,
                 c.stochastic_rounding ? random_words(rows * cols) : std::span<const std::uint32_t>{}, q);
  if (!out.empty()) lowp::dequantize(q, out.first(rows * cols));
  Pending p;
  p.stats.elements = q.counts.elements;
  p.stats.nonzero = q.counts.nonzero;  // counted by the quantizing pass
  p.stats.overflow = q.counts.saturated;
  p.stats.underflow = q.counts.flushed;
  p.stats.nonfinite_input = q.counts.nonfinite;
  p.amax = q.counts.amax;
  // per tensor: the scale used; nvfp4: S_enc; mxfp8: the smallest block factor (the largest
  // block scale); fp8-block and mxfp4: 1 (their scales are per block).
  p.scale = q.config.recipe == lowp::Recipe::mxfp8 ? smallest_mx_factor(q) : q.tensor_scale;
  if (sampled_) {
    p.blocks = lowp::block_stats(q, x.first(rows * cols));
    p.kurtosis = lowp::kurtosis(x.first(rows * cols));
  }
  return p;
}

void Fp8Linears::commit(std::size_t t, const Pending& p, bool delayed) {
  Fp8TensorStats& s = stats_[t];
  s.elements += p.stats.elements;
  s.nonzero += p.stats.nonzero;
  s.saturated += p.stats.overflow;
  s.flushed += p.stats.underflow;
  s.amax = fold_amax(s.amax, p.amax);
  s.scale = p.scale;
  if (p.blocks) {  // the step's last sampled quantization of the tensor
    s.blocks = p.blocks;
    s.kurtosis = p.kurtosis;
  }
  if (delayed && delayed_on_ && !unit_scale_) delayed_.record_amax(t, p.amax);
}

void Fp8Linears::forward(Gemm& g, std::size_t id, std::span<float> y, std::span<const float> x,
                         std::span<const float> w, std::span<const float> b, std::size_t rows, Work work) {
  Linear& l = linears_.at(id);
  if (rows == 0 || rows > l.rows) check_size("forward rows", rows, l.rows);
  check_size("forward x", x.size(), rows * l.in);
  check_size("forward w", w.size(), l.out * l.in);
  // Only a training forward of every row has a backward: nothing is kept otherwise.
  const bool training = !evaluation_ && rows == l.rows;
  std::size_t pi = l.current;
  if (evaluation_ && evaluation_plan_ && l.evaluated) pi = *evaluation_plan_;
  const RunPlan& p = plans_[pi];
  const std::span<float> own(work_);
  Carver carve(work.empty() ? Work(&own, 1) : work);
  const std::size_t t = l.tensor;
  const std::span<const float> xs = x.first(rows * l.in);
  std::span<const float> xf = xs;  // what fprop multiplies
  Pending px;
  bool x_quantized = false;
  if (p.config[at(Operand::fprop_x)]) {
    const std::span<float> xq = carve.take(rows * l.in);
    // Per tensor, this quantization is wgrad's too; or the source of a dequantized X'.
    const bool keep = training && (p.share_x || p.saved == Saved::fprop);
    px = lowp_fake(xs, xq, rows, l.in, call_config(p, Operand::fprop_x, t, rows), keep ? &saved_q_[id] : nullptr);
    x_quantized = true;
    xf = xq;
  }
  if (training) {
    if (p.saved == Saved::quantized && !p.share_x) {
      // wgrad's copy: from X, or from the values fprop multiplied.
      const std::span<const float> src = p.plan.x_source == lowp::Source::dequantized ? xf : xs;
      const Pending ps = lowp_fake(src, {}, rows, l.in, call_config(p, Operand::wgrad_x, t, rows), &saved_q_[id]);
      if (!x_quantized) {
        px = ps;
        x_quantized = true;
      }
    } else if (p.saved == Saved::fp32) {
      std::copy(xs.begin(), xs.end(), saved_x_[id].begin());
    }
    l.input = px;
    l.input_quantized = x_quantized;
  }
  std::span<const float> wf = w;
  if (p.config[at(Operand::fprop_w)]) {
    const std::span<float> wq(wq_.data(), l.out * l.in);
    const Pending pw = lowp_fake(w, wq, l.out, l.in, call_config(p, Operand::fprop_w, t + 1, rows));
    if (training) l.weight = pw;
    wf = wq;
  }
  linear_forward(g, y, xf, wf, b, rows, l.in, l.out);
  l.forward_rows = training ? rows : 0;
  l.forward_plan = pi;
}

void Fp8Linears::backward(Gemm& g, std::size_t id, std::span<float> dx, std::span<float> dw, std::span<float> db,
                          std::span<const float> dy, std::span<const float> w, Work work) {
  Linear& l = linears_.at(id);
  if (l.forward_rows != l.rows) {
    throw std::logic_error("fp8 linear backward: expected a full-batch training forward of " +
                           stats_[l.tensor].name + " before backward");
  }
  const std::size_t N = l.rows, C = l.in, OC = l.out;
  check_size("backward dy", dy.size(), N * OC);
  check_size("backward dw", dw.size(), OC * C);
  check_size("backward w", w.size(), OC * C);
  if (!dx.empty()) check_size("backward dx", dx.size(), N * C);
  if (!db.empty()) check_size("backward db", db.size(), OC);
  const RunPlan& p = plans_[l.forward_plan];
  const std::span<float> own(work_);
  Carver carve(work.empty() ? Work(&own, 1) : work);
  const std::size_t t = l.tensor;
  if (l.input_quantized) commit(t, l.input, p.delayed);
  if (p.config[at(Operand::fprop_w)]) commit(t + 1, l.weight, p.delayed);

  // dgrad: dX += Q[dgrad.dy](dY) Q[dgrad.w](W').
  std::span<const float> dy_dgrad = dy;
  if (p.config[at(Operand::dgrad_dy)]) {
    const std::span<float> dyq = carve.take(N * OC);
    commit(t + 2, lowp_fake(dy, dyq, N, OC, call_config(p, Operand::dgrad_dy, t + 2, N)), p.delayed);
    dy_dgrad = dyq;
  }
  const bool w_counted_here = !p.config[at(Operand::fprop_w)] && p.config[at(Operand::dgrad_w)];
  if (!dx.empty() || w_counted_here) {
    const std::span<float> wq(wq_.data(), OC * C);
    std::span<const float> wd = w;
    if (p.plan.w_source == lowp::Source::dequantized) {
      // The values fprop multiplied: W is unchanged since the forward, so quantizing it again
      // with fprop's config gives them again.
      (void)lowp_fake(w, wq, OC, C, call_config(p, Operand::fprop_w, t + 1, N));
      wd = wq;
    }
    if (p.config[at(Operand::dgrad_w)]) {
      lowp::QuantizeConfig c = call_config(p, Operand::dgrad_w, t + 1, N);
      if (p.share_w) {
        // fprop's quantization again at the scale the forward used (fp8-current: no second
        // amax pass).
        lowp::QuantizeConfig same;
        same.recipe = lowp::Recipe::fp8_delayed;
        same.element = c.element;
        same.scale = l.weight.scale;
        c = same;
      }
      const Pending pw = lowp_fake(wd, wq, OC, C, c);  // in place when wd is wq: quantized before written
      if (w_counted_here) commit(t + 1, pw, p.delayed);
      wd = wq;
    }
    if (!dx.empty())
      g.run(view(dy_dgrad.data(), N, OC), view(wd.data(), OC, C), output(dx.data(), N, C), kAccumulateNN);
  }

  // wgrad: dW += Q[wgrad.dy](dY)^T Q[wgrad.x](X').
  std::span<const float> dy_wgrad = dy;
  if (p.config[at(Operand::wgrad_dy)]) {
    if (p.share_dy) {
      dy_wgrad = dy_dgrad;
    } else {
      const std::span<float> dyq_col = carve.take(N * OC);
      const Pending pw = lowp_fake(dy, dyq_col, N, OC, call_config(p, Operand::wgrad_dy, t + 2, N));
      if (!p.config[at(Operand::dgrad_dy)]) commit(t + 2, pw, p.delayed);
      dy_wgrad = dyq_col;
    }
  }
  std::span<const float> xw;
  if (p.saved == Saved::fp32) {
    xw = std::span<const float>(saved_x_[id].data(), N * C);
  } else {
    const std::span<float> xq = carve.take(N * C);
    lowp::dequantize(saved_q_[id], xq);
    xw = xq;
  }
  g.run(view(dy_wgrad.data(), N, OC), view(xw.data(), N, C), output(dw.data(), OC, C), kAccumulateTN);
  // The bias gradient from the unquantized dY (TE fuses it into dY's quantization).
  for (std::size_t n = 0; n < N && !db.empty(); ++n) {
    const float* row = dy.data() + n * OC;
    for (std::size_t o = 0; o < OC; ++o) db[o] += row[o];
  }
}

void Fp8Linears::step_done() {
  if (delayed_on_ && !unit_scale_) delayed_.update();
}

void Fp8Linears::reset_stats() noexcept {
  for (Fp8TensorStats& s : stats_) {
    s.elements = s.nonzero = s.saturated = s.flushed = 0;
    s.amax = 0;
    s.blocks.reset();
    s.kurtosis.reset();
  }
}

std::size_t Fp8Linears::saved_bytes() const noexcept {
  std::size_t b = 0;
  for (const Linear& l : linears_) b += l.saved_bytes;
  return b;
}

std::size_t Fp8Linears::scratch_bytes() const noexcept {
  return (wq_.size() + work_.size()) * sizeof(float) + work_q_.codes.capacity() +
         work_q_.scale_inv.capacity() * sizeof(float) + work_q_.scale_codes.capacity();
}

}  // namespace mixprec::nn::detail
