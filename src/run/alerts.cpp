// Alert rules over a run's step log (see alerts.hpp and docs/alerts.md).
#include "mixprec/run/alerts.hpp"
#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

#include "mixprec/formats/types.hpp"
#include "mixprec/nn/precision.hpp"
#include "mixprec/scaler/loss_scale.hpp"

namespace mixprec::monitor {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string fmt_g(double v, int digits = 3) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

// Shortest text that reads back as the same double.
std::string exact(double v) {
  if (!std::isfinite(v)) return fmt_g(v);
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// Alerts show one decimal unless they ask for more.
std::string percent(double f, int decimals = 1) { return text::percent(f, decimals); }

// "65536 (2^16)" for powers of two, "1000" otherwise.
std::string scale_text(double s) {
  if (!(s > 0) || !std::isfinite(s)) return fmt_g(s);
  int e = 0;
  const double m = std::frexp(s, &e);
  if (m == 0.5) {
    const std::string p = std::string("2^").append(std::to_string(e - 1));
    if (e - 1 >= -24 && e - 1 <= 24) return fmt_g(s, 10).append(" (").append(p).append(")");
    return p;
  }
  return fmt_g(s, 6);
}

// Concatenation by append (GCC 12 warns falsely, -Wrestrict, on "literal" + std::string at -O3).
template <class... A>
std::string cat(const A&... parts) {
  std::string out;
  (out.append(std::string_view(parts)), ...);
  return out;
}

std::string num(std::uint64_t v) { return std::to_string(v); }

using text::squote;

[[noreturn]] void bad(std::string_view field, std::string_view expected, const std::string& found) {
  throw std::invalid_argument(std::string("alerts: ").append(field).append(": expected ").append(expected).append(
      ", found ").append(found));
}

double ratio(std::uint64_t a, std::uint64_t b) { return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b); }

std::string lr_advice(double lr) {
  if (!(lr > 0)) return "lower the learning rate (try 10x lower)";
  return std::string("lower the learning rate (peak ").append(fmt_g(lr)).append("; try ").append(fmt_g(lr / 10)).append(
      ")");
}

}  // namespace

std::string_view alert_id(AlertKind k) noexcept {
  switch (k) {
    case AlertKind::persistent_overflow: return "persistent-overflow";
    case AlertKind::scale_collapse: return "scale-collapse";
    case AlertKind::underflow_plateau: return "underflow-plateau";
    case AlertKind::forward_overflow: return "forward-overflow";
    case AlertKind::scale_pinned: return "scale-pinned";
    case AlertKind::nonfinite_input: return "nonfinite-input";
    case AlertKind::loss_divergence: return "loss-divergence";
    case AlertKind::guarded_skip: return "guarded-skip";
    case AlertKind::kurtosis_rise: return "kurtosis-rise";
    case AlertKind::block_spread_rise: return "block-spread-rise";
  }
  return "?";
}

const std::vector<AlertKind>& alert_kinds() {
  static const std::vector<AlertKind> kinds = {AlertKind::persistent_overflow, AlertKind::scale_collapse,
                                               AlertKind::underflow_plateau,   AlertKind::forward_overflow,
                                               AlertKind::scale_pinned,        AlertKind::nonfinite_input,
                                               AlertKind::loss_divergence,     AlertKind::guarded_skip,
                                               AlertKind::kurtosis_rise,       AlertKind::block_spread_rise};
  return kinds;
}

void validate(const AlertThresholds& t) {
  auto window = [](std::string_view field, std::uint64_t v) {
    if (v < 1 || v > 1'000'000) bad(field, "an integer in [1, 1000000]", std::to_string(v));
  };
  auto fraction = [](std::string_view field, double v, bool open_low) {
    if (!(open_low ? v > 0 && v <= 1 : v >= 0 && v <= 1))
      bad(field, open_low ? "a number in (0, 1]" : "a number in [0, 1]", exact(v));
  };
  if (t.warmup_steps > 1'000'000'000) bad("warmup_steps", "an integer in [0, 1000000000]", std::to_string(t.warmup_steps));
  window("overflow_window", t.overflow_window);
  if (!(t.overflow_skip_rate >= 0 && t.overflow_skip_rate < 1))
    bad("overflow_skip_rate", "a number in [0, 1)", exact(t.overflow_skip_rate));
  window("collapse_window", t.collapse_window);
  if (!(t.collapse_binades > 0 && t.collapse_binades <= 256))
    bad("collapse_binades", "a number in (0, 256]", exact(t.collapse_binades));
  if (!(t.collapse_floor >= 0 && std::isfinite(t.collapse_floor)))
    bad("collapse_floor", "a finite number >= 0", exact(t.collapse_floor));
  window("plateau_window", t.plateau_window);
  if (t.plateau_window < 3) bad("plateau_window", "an integer >= 3 (first and last thirds)", std::to_string(t.plateau_window));
  fraction("plateau_loss_change", t.plateau_loss_change, true);
  fraction("plateau_underflow", t.plateau_underflow, false);
  window("pinned_window", t.pinned_window);
  if (!(t.pinned_headroom_binades >= 0 && t.pinned_headroom_binades <= 256))
    bad("pinned_headroom_binades", "a number in [0, 256]", exact(t.pinned_headroom_binades));
  fraction("pinned_underflow", t.pinned_underflow, false);
  for (const std::string& a : t.input_activations)
    if (a.empty()) bad("input_activations", "non-empty activation names", "''");
  window("divergence_window", t.divergence_window);
  if (t.divergence_window < 3)
    bad("divergence_window", "an integer >= 3", std::to_string(t.divergence_window));
  if (!(t.divergence_rise >= 0 && std::isfinite(t.divergence_rise)))
    bad("divergence_rise", "a finite number >= 0", exact(t.divergence_rise));
  if (!(t.divergence_nats >= 0 && std::isfinite(t.divergence_nats)))
    bad("divergence_nats", "a finite number >= 0", exact(t.divergence_nats));
  window("tensor_baseline", t.tensor_baseline);
  if (!(t.kurtosis_rise > 1 && std::isfinite(t.kurtosis_rise)))
    bad("kurtosis_rise", "a finite number > 1", exact(t.kurtosis_rise));
  if (!(t.kurtosis_min >= 0 && std::isfinite(t.kurtosis_min)))
    bad("kurtosis_min", "a finite number >= 0", exact(t.kurtosis_min));
  if (!(t.spread_rise_binades > 0 && std::isfinite(t.spread_rise_binades)))
    bad("spread_rise_binades", "a finite number > 0", exact(t.spread_rise_binades));
  fraction("far_blocks_rise", t.far_blocks_rise, true);
}

std::vector<std::pair<std::string, std::string>> describe(const AlertThresholds& t) {
  std::string inputs;
  for (const std::string& a : t.input_activations) inputs.append(inputs.empty() ? "" : ",").append(a);
  return {{"warmup_steps", std::to_string(t.warmup_steps)},
          {"overflow_window", std::to_string(t.overflow_window)},
          {"overflow_skip_rate", exact(t.overflow_skip_rate)},
          {"collapse_window", std::to_string(t.collapse_window)},
          {"collapse_binades", exact(t.collapse_binades)},
          {"collapse_floor", exact(t.collapse_floor)},
          {"plateau_window", std::to_string(t.plateau_window)},
          {"plateau_loss_change", exact(t.plateau_loss_change)},
          {"plateau_underflow", exact(t.plateau_underflow)},
          {"pinned_window", std::to_string(t.pinned_window)},
          {"pinned_headroom_binades", exact(t.pinned_headroom_binades)},
          {"pinned_underflow", exact(t.pinned_underflow)},
          {"input_activations", inputs},
          {"divergence_window", std::to_string(t.divergence_window)},
          {"divergence_rise", exact(t.divergence_rise)},
          {"divergence_nats", exact(t.divergence_nats)},
          {"tensor_baseline", std::to_string(t.tensor_baseline)},
          {"kurtosis_rise", exact(t.kurtosis_rise)},
          {"kurtosis_min", exact(t.kurtosis_min)},
          {"spread_rise_binades", exact(t.spread_rise_binades)},
          {"far_blocks_rise", exact(t.far_blocks_rise)}};
}

RunContext RunContext::of(const train::TrainConfig& c) {
  RunContext ctx;
  ctx.precision = std::string(nn::precision_name(c.precision));
  ctx.loss_scale = c.loss_scale;
  ctx.lr = c.lr;
  return ctx;
}

AlertMonitor::AlertMonitor(AlertThresholds thresholds, RunContext context)
    : t_(std::move(thresholds)), ctx_(std::move(context)) {
  validate(t_);
  const auto p = nn::parse_precision(ctx_.precision);
  if (!p) bad("precision", keys::join(nn::precision_names()), squote(ctx_.precision));
  format_max_ = static_cast<double>(format_row(format_of(nn::policy_of(*p).activations)).max_finite);
  // The spec through the one parser of TrainConfig's loss-scale key (train::loss_scale_config).
  const std::string& s = ctx_.loss_scale;
  std::optional<LossScaleConfig> spec;
  try {
    spec = train::loss_scale_config(s);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("alerts: ") + e.what());
  }
  scaled_ = spec.has_value();
  if (spec && spec->rule != LossScaleRule::static_scale) {  // a dynamic preset
    policy_ = s == "dynamic" ? "mixprec" : s;
    // The run's own config, overrides included, when known.
    const LossScaleConfig cfg = ctx_.loss_scale_config ? *ctx_.loss_scale_config : *spec;
    dynamic_ = cfg.rule != LossScaleRule::static_scale;
    if (!dynamic_) bad("loss_scale_config", "a dynamic rule (loss-scale " + squote(s) + ")", "rule static");
    max_scale_ = cfg.max_scale;
    growth_interval_ = cfg.growth_interval;
  }
  peak_lr_ = ctx_.lr;
}

std::string_view AlertMonitor::say(std::string_view engine, std::string_view torch) const noexcept {
  return ctx_.writer == train::RunWriter::engine ? engine : torch;
}

bool AlertMonitor::run_problem() {
  return find(AlertKind::persistent_overflow) != nullptr || find(AlertKind::forward_overflow) != nullptr ||
         find(AlertKind::nonfinite_input) != nullptr || find(AlertKind::loss_divergence) != nullptr ||
         find(AlertKind::guarded_skip) != nullptr;
}

Alert* AlertMonitor::find(AlertKind k, std::string_view tensor) {
  for (Alert& a : alerts_)
    if (a.kind == k && a.tensor == tensor) return &a;
  return nullptr;
}

// The rule of kind k holds at `step` (for `tensor`: the per-tensor kinds): raise it (first
// time) or count it.
void AlertMonitor::hold(AlertKind k, std::uint64_t step, std::vector<Alert>& raised, std::string message,
                        std::string advice, std::string tensor) {
  if (Alert* a = find(k, tensor)) {
    a->last_step = step;
    ++a->steps;
    return;
  }
  Alert a;
  a.kind = k;
  a.id = std::string(alert_id(k));
  a.step = a.last_step = step;
  a.steps = 1;
  a.message = std::move(message);
  a.advice = std::move(advice);
  a.tensor = std::move(tensor);
  alerts_.push_back(a);
  raised.push_back(std::move(a));
}

void AlertMonitor::hold(AlertKind k, std::uint64_t step, std::string_view tensor) {
  if (Alert* a = find(k, tensor)) {
    a->last_step = step;
    ++a->steps;
  }
}

std::vector<Alert> AlertMonitor::observe(const train::StepRecord& r) {
  if (r.step <= last_step_)
    throw std::invalid_argument(cat("alerts: step ", num(r.step), " follows step ", num(last_step_),
                                    "; expected increasing steps"));
  last_step_ = r.step;
  if (ctx_.lr <= 0 && std::isfinite(r.lr)) peak_lr_ = std::max(peak_lr_, r.lr);
  std::vector<Alert> raised;
  const std::string at = num(r.step);

  Sample s{};
  s.step = r.step;
  s.loss = r.loss;
  s.loss_finite = r.loss_finite && std::isfinite(r.loss);
  // Skipped for inf/NaN gradients (the overflow rules' skips; a guard's skip is not an overflow).
  s.skipped = skip_reason_of(r) == SkipReason::nonfinite_grad;
  s.injected = r.injected;
  s.forward = !r.loss_finite;
  s.scale = r.scale;
  s.next_scale = r.next_scale;
  s.grad_norm = r.grad_norm;
  s.underflow = r.act_grads.underflow;
  s.nonzero = r.act_grads.nonzero;
  // Headroom only where the step carries telemetry (logs written before it have none).
  const bool telemetry = r.act_grad_amax != 0 || !r.act_grad_tensors.empty();
  if (!std::isfinite(r.act_grad_amax)) {
    s.headroom = -kInf;
  } else if (telemetry) {
    s.headroom = std::isnan(r.headroom_log2) ? -kInf : r.headroom_log2;
  } else {
    s.headroom = kNaN;
  }
  const double scale = static_cast<double>(r.scale);
  const double next_scale = static_cast<double>(r.next_scale);

  // ---- forward overflow / non-finite input: the first non-finite forward pass.
  if (!r.loss_finite) {
    const bool input = std::find(t_.input_activations.begin(), t_.input_activations.end(), r.forward_nonfinite) !=
                       t_.input_activations.end();
    const std::string where = r.forward_nonfinite.empty() ? std::string("an unnamed tensor") : squote(r.forward_nonfinite);
    if (input) {
      hold(AlertKind::nonfinite_input, r.step, raised,
           cat("at step ", at, " the first tensor computed from the data, ", where,
               ", already held inf/NaN, so the loss was not finite and the step was skipped: the inputs (or the "
               "embedding table they index) were non-finite before any low-precision arithmetic ran"),
           "check the data for NaN/inf and out-of-range values, and the embedding weights (params[].weight_amax of "
           "wte/wpe in log.jsonl); loss scaling cannot repair values that are non-finite already in the forward pass");
    } else {
      std::string msg = cat("at step ", at, " the forward pass produced inf/NaN, first in ", where,
                            ", so the loss was not finite and the step was skipped");
      if (r.forward_nonfinite == "losses") msg += " (every activation was finite: the per-token losses overflowed)";
      std::string advice = cat(
          "loss scaling acts on the backward pass and cannot repair activations that overflowed in the forward pass; ",
          lr_advice(peak_lr_),
          " (weights that grow too fast drive logits and attention scores past the format's range), check the data "
          "and the operation named");
      if (format_max_ < 1e6)
        advice += cat("; activations above ", fmt_g(format_max_, 6), " overflow in ", ctx_.precision,
                      ": bf16 (", say("--precision bf16", "autocast dtype=torch.bfloat16"), ") has fp32's range");
      hold(AlertKind::forward_overflow, r.step, raised, std::move(msg), std::move(advice));
    }
  }

  // ---- loss divergence: a loss far above the median of the previous finite losses.
  if (s.loss_finite) {
    if (losses_.size() >= 3) {
      std::vector<double> prev(losses_.begin(), losses_.end());
      std::nth_element(prev.begin(), prev.begin() + static_cast<std::ptrdiff_t>(prev.size() / 2), prev.end());
      double median = prev[prev.size() / 2];
      if (prev.size() % 2 == 0) {
        const double below = *std::max_element(prev.begin(), prev.begin() + static_cast<std::ptrdiff_t>(prev.size() / 2));
        median = (median + below) / 2;
      }
      const double rise = s.loss - median;
      if (rise > t_.divergence_rise * std::fabs(median) && rise > t_.divergence_nats) {
        if (find(AlertKind::loss_divergence) != nullptr) {
          hold(AlertKind::loss_divergence, r.step);
        } else {
          std::string msg = cat("at step ", at, " the loss jumped to ", fmt_g(s.loss, 4), ", ",
                                percent(rise / std::fabs(median), 0), " (", fmt_g(rise, 3),
                                " nats) above the median of the previous ", num(losses_.size()), " steps (",
                                fmt_g(median, 4), ")");
          if (std::isfinite(r.grad_norm)) msg += cat("; the gradient norm was ", fmt_g(r.grad_norm));
          msg += r.skipped ? std::string("; the step was skipped")
                           : std::string(", with finite gradients: nothing overflowed, so loss scaling is not involved");
          hold(AlertKind::loss_divergence, r.step, raised, std::move(msg),
               cat("the optimizer's steps are too large for the loss surface: ", lr_advice(peak_lr_),
                   " or lengthen the warmup, and keep gradient clipping on (", say("--clip", "clip_grad_norm_"),
                   "); a single spike that recovers at "
                   "once can also be a bad batch: check the data"));
        }
      }
    }
    losses_.push_back(s.loss);
    if (losses_.size() > t_.divergence_window) losses_.pop_front();
  }

  // ---- guarded skip: a step guard refused the step; what the step's numbers say about why.
  if (const SkipReason reason = skip_reason_of(r); reason != SkipReason::none && reason != SkipReason::nonfinite_grad) {
    if (find(AlertKind::guarded_skip) != nullptr) {
      hold(AlertKind::guarded_skip, r.step);
    } else {
      std::string why;
      switch (skip_reason_of(r)) {
        case SkipReason::loss_spike:
          why = cat("the loss, ", fmt_g(r.loss, 4), ", was ", fmt_g(r.loss_z, 3),
                    " standard deviations above the mean of the guard's window");
          break;
        case SkipReason::grad_spike:
          why = cat("the gradient norm, ", fmt_g(r.grad_norm, 4), ", was ", fmt_g(r.grad_z, 3),
                    " standard deviations above the mean of the guard's window");
          break;
        case SkipReason::nonfinite_loss: why = "the loss was not finite while every gradient was"; break;
        default: why = "the run's own predicate (skip_if) refused it"; break;
      }
      std::string msg = cat("at step ", at, " a step guard skipped the update (", skip_reason_name(skip_reason_of(r)),
                            "): ", why);
      // Where: the first non-finite activation, the largest gradient, the most saturated
      // quantized tensor of the step.
      if (!r.forward_nonfinite.empty()) msg += cat("; the forward pass first went non-finite in ", squote(r.forward_nonfinite));
      if (!r.overflow_activation.empty())
        msg += cat("; the backward pass first overflowed in ", squote(r.overflow_activation));
      const train::StepRecord::ParamStats* top = nullptr;
      for (const auto& p : r.params)
        if (std::isfinite(p.grad_amax) && (top == nullptr || p.grad_amax > top->grad_amax)) top = &p;
      if (top != nullptr) msg += cat("; the largest gradient was ", squote(top->name), "'s (|max| ", fmt_g(top->grad_amax), ")");
      const nn::Fp8TensorStats* sat = nullptr;
      for (const auto& f : r.fp8)
        if (f.saturated > 0 && (sat == nullptr || f.saturated * std::max<std::uint64_t>(sat->nonzero, 1) >
                                                      sat->saturated * std::max<std::uint64_t>(f.nonzero, 1)))
          sat = &f;
      std::string advice =
          "one guarded skip the run recovers from is a bad batch: check the data of that step; repeated spikes "
          "mean the optimizer's steps are too large: " +
          lr_advice(peak_lr_) + " or lengthen the warmup";
      if (sat != nullptr) {
        msg += cat("; ", squote(sat->name), " saturated ", num(sat->saturated), " of ", num(sat->nonzero),
                   " nonzero values in its low-precision format");
        advice += cat("; ", squote(sat->name), " saturates: its recipe is too coarse for it (give that layer a "
                      "finer recipe, e.g. as mixprec advise proposes)");
      }
      hold(AlertKind::guarded_skip, r.step, raised, std::move(msg), std::move(advice));
    }
  }

  // ---- persistent overflow: skip rate over the last window of steps after the warm-up.
  if (r.step > t_.warmup_steps) {
    overflow_win_.push_back(s);
    overflow_skips_ += s.skipped ? 1 : 0;
    if (overflow_win_.size() > t_.overflow_window) {
      overflow_skips_ -= overflow_win_.front().skipped ? 1 : 0;
      overflow_win_.pop_front();
    }
    const double limit = t_.overflow_skip_rate * static_cast<double>(t_.overflow_window);
    if (static_cast<double>(overflow_skips_) > limit) {
      if (find(AlertKind::persistent_overflow) != nullptr) {
        hold(AlertKind::persistent_overflow, r.step);
      } else {
        std::uint64_t forward = 0, injected = 0;
        double first_norm = kNaN, last_norm = kNaN, first_loss = kNaN, last_loss = kNaN;
        for (const Sample& w : overflow_win_) {
          forward += w.skipped && w.forward ? 1 : 0;
          injected += w.skipped && w.injected ? 1 : 0;
          if (!w.skipped && std::isfinite(w.grad_norm)) {
            if (std::isnan(first_norm)) first_norm = w.grad_norm;
            last_norm = w.grad_norm;
          }
          if (w.loss_finite) {
            if (std::isnan(first_loss)) first_loss = w.loss;
            last_loss = w.loss;
          }
        }
        std::string msg = cat(num(overflow_skips_), " of the last ", num(overflow_win_.size()),
                              " steps after the warm-up (steps ", num(overflow_win_.front().step), "-", at,
                              ") were skipped for inf/NaN gradients, more than ", percent(t_.overflow_skip_rate),
                              " of a ", num(t_.overflow_window), "-step window");
        if (forward > 0) msg += cat("; ", num(forward), " of them had a non-finite forward pass");
        if (injected > 0) msg += cat("; ", num(injected), " of them were injected");
        if (!std::isnan(first_loss) && first_loss != last_loss)
          msg += cat("; the loss went from ", fmt_g(first_loss, 4), " to ", fmt_g(last_loss, 4));
        if (!std::isnan(first_norm) && first_norm != last_norm)
          msg += cat("; the gradient norm of the applied steps went from ", fmt_g(first_norm), " to ",
                     fmt_g(last_norm));
        if (!r.overflow_activation.empty())
          msg += cat("; the last overflow appeared first in ", squote(r.overflow_activation));
        else if (!r.overflow_param.empty())
          msg += cat("; the last overflow appeared first in the gradient of ", squote(r.overflow_param));
        if (dynamic_)
          msg += cat("; the loss scale is now ", scale_text(next_scale));
        else
          msg += cat("; with ", scaled_ ? "a static scale" : "no loss scaling",
                     " nothing adapts, and each of these steps is lost");
        std::string advice = cat(
            "frequent skips early in training are normal while a dynamic scale finds its range; persistent ones are "
            "a learning-rate or data problem that loss scaling cannot fix: ",
            lr_advice(peak_lr_),
            " or lengthen the warmup, keep gradient clipping on (", say("--clip", "clip_grad_norm_"),
            "), and check the data for bad batches "
            "(inf/NaN, extreme values, broken labels)");
        hold(AlertKind::persistent_overflow, r.step, raised, std::move(msg), std::move(advice));
      }
    }
  }

  // ---- scale collapse (dynamic scales only).
  if (dynamic_) {
    bool held = false;
    std::string msg;
    if (next_scale < t_.collapse_floor) {
      held = true;
      msg = cat("the loss scale fell below ", fmt_g(t_.collapse_floor), " (to ", scale_text(next_scale), " at step ",
                at, "): the gradients overflow even unscaled");
    } else if (s.skipped && !r.injected && scale <= t_.collapse_floor) {
      held = true;
      msg = cat("at step ", at, " the gradients overflowed with the loss scale already at ", scale_text(scale),
                ": they overflow without any scaling, so lowering the scale cannot help");
    }
    if (r.step > t_.warmup_steps) {
      collapse_win_.push_back(s);
      collapse_growths_ += s.next_scale > s.scale ? 1 : 0;
      if (collapse_win_.size() > t_.collapse_window) {
        const Sample& f = collapse_win_.front();
        collapse_growths_ -= f.next_scale > f.scale ? 1 : 0;
        collapse_win_.pop_front();
      }
      const double from = static_cast<double>(collapse_win_.front().scale);
      const double fall = std::log2(from) - std::log2(next_scale);
      if (!held && collapse_growths_ == 0 && next_scale > 0 && fall >= t_.collapse_binades) {
        std::uint64_t skips = 0;
        for (const Sample& w : collapse_win_) skips += w.skipped ? 1 : 0;
        held = true;
        msg = cat("the loss scale fell from ", scale_text(from), " to ", scale_text(next_scale), " (", fmt_g(fall),
                  " binades) over steps ", num(collapse_win_.front().step), "-", at, " without growing once (",
                  num(skips), " skipped steps): the gradients overflow more and more as training goes on");
      }
    }
    if (held) {
      if (find(AlertKind::scale_collapse) != nullptr) {
        hold(AlertKind::scale_collapse, r.step);
      } else {
        hold(AlertKind::scale_collapse, r.step, raised, std::move(msg),
             cat("a scale that collapses steadily is a symptom, not the fix: look beyond the scaler; ",
                 lr_advice(peak_lr_),
                 ", check the data for inf/NaN or extreme batches, and look for activations near the format's range "
                 "(act_grad_amax, headroom_log2 in log.jsonl)"));
      }
    }
  }

  // ---- underflow plateau: flat loss while many activation gradients flush to zero.
  if (s.loss_finite) {
    plateau_win_.push_back(s);
    plateau_underflow_ += s.underflow;
    plateau_nonzero_ += s.nonzero;
    if (plateau_win_.size() > t_.plateau_window) {
      plateau_underflow_ -= plateau_win_.front().underflow;
      plateau_nonzero_ -= plateau_win_.front().nonzero;
      plateau_win_.pop_front();
    }
    if (plateau_win_.size() == t_.plateau_window) {
      const std::size_t third = plateau_win_.size() / 3;
      double first = 0, last = 0;
      for (std::size_t i = 0; i < third; ++i) {
        first += plateau_win_[i].loss;
        last += plateau_win_[plateau_win_.size() - 1 - i].loss;
      }
      first /= static_cast<double>(third);
      last /= static_cast<double>(third);
      const double change = first != 0 ? std::fabs(first - last) / std::fabs(first) : std::fabs(last);
      const double under = ratio(plateau_underflow_, plateau_nonzero_);
      if (change < t_.plateau_loss_change && under >= t_.plateau_underflow) {
        if (find(AlertKind::underflow_plateau) != nullptr) {
          hold(AlertKind::underflow_plateau, r.step);
        } else if (!run_problem()) {
          std::string msg = cat("over steps ", num(plateau_win_.front().step), "-", at, " the loss stayed flat (",
                                fmt_g(first, 4), " -> ", fmt_g(last, 4), ", ", percent(change, 2), ") while ",
                                percent(under), " of the nonzero activation gradients flushed to zero in ",
                                ctx_.precision,
                                ": the updates those gradients carried are lost, and the model stops learning");
          if (std::isfinite(s.headroom))
            msg += cat("; the largest activation gradient has ", fmt_g(s.headroom), " binades of headroom");
          std::string advice = "a gradient that rounded to zero is gone, and a larger learning rate cannot bring it back; ";
          // A static scale should leave 8 binades (256x) for the gradients to grow.
          const double room = std::isfinite(s.headroom) ? std::floor(s.headroom) - 8 : kNaN;
          const std::string room_text = room >= 1 ? std::to_string(static_cast<int>(room)) : std::string();
          if (!scaled_) {
            advice += cat("enable loss scaling: ", say("--loss-scale dynamic", "a mixprec.torch.GradScaler"),
                          " (starts at 2^16 and backs off on overflow)");
            if (!room_text.empty())
              advice += cat(", or a static scale of about 2^", room_text,
                            " (8 binades below where the largest gradient would overflow)");
          } else if (!dynamic_) {
            advice += cat("raise the static scale (", ctx_.loss_scale, ")");
            if (!room_text.empty())
              advice += cat(" by about 2^", room_text, " (8 binades below where the largest gradient would overflow)");
            advice += cat(", or use ", say("--loss-scale dynamic", "a dynamic GradScaler preset"));
          } else {
            advice += cat("the dynamic scale (", scale_text(next_scale), ") grows only after ",
                          std::to_string(growth_interval_),
                          " clean steps (growth_interval): use a policy that starts higher or grows sooner");
          }
          if (ctx_.precision != "bf16" && ctx_.precision != "fp32")
            advice += cat("; bf16 (", say("--precision bf16", "autocast dtype=torch.bfloat16"),
                          ") has fp32's exponent range and rarely underflows");
          hold(AlertKind::underflow_plateau, r.step, raised, std::move(msg), std::move(advice));
        }
      }
    }
  }

  // ---- scale pinned (dynamic scales with telemetry): no change, big headroom, flushing.
  if (dynamic_) {
    const bool steady = !r.skipped && r.next_scale == r.scale && !std::isnan(s.headroom);
    if (!steady || (!pinned_run_.empty() && pinned_run_.back().scale != r.scale)) pinned_run_.clear();
    if (steady) {
      pinned_run_.push_back(s);
      if (pinned_run_.size() > t_.pinned_window) pinned_run_.pop_front();
    }
    if (pinned_run_.size() == t_.pinned_window) {
      double room = kInf;
      std::uint64_t under = 0, nonzero = 0;
      for (const Sample& w : pinned_run_) {
        room = std::min(room, w.headroom);
        under += w.underflow;
        nonzero += w.nonzero;
      }
      const double frac = ratio(under, nonzero);
      if (room >= t_.pinned_headroom_binades && frac >= t_.pinned_underflow) {
        if (find(AlertKind::scale_pinned) != nullptr) {
          hold(AlertKind::scale_pinned, r.step);
        } else if (!run_problem()) {
          const bool capped = std::isfinite(max_scale_) && scale >= max_scale_;
          std::string msg = cat("the loss scale stayed at ", scale_text(scale), " for steps ",
                                num(pinned_run_.front().step), "-", at,
                                capped ? ", its maximum (max_scale)," : "",
                                " while the largest activation gradient kept at least ", fmt_g(room),
                                " binades of headroom below the format's maximum and ", percent(frac),
                                " of the nonzero activation gradients flushed to zero: the headroom is wasted");
          std::string advice =
              capped ? cat("raise or remove the policy's max_scale (now ", scale_text(max_scale_), ")")
                     : cat("the policy (", policy_, ") grows only after ", std::to_string(growth_interval_),
                           " clean steps: shorten growth_interval or start higher");
          const int up = static_cast<int>(std::floor(std::min(room, 64.0))) - 1;
          if (up >= 1)
            advice += cat("; a scale 2^", std::to_string(up), " times larger would still not overflow");
          hold(AlertKind::scale_pinned, r.step, raised, std::move(msg), std::move(advice));
        }
      }
    }
  }
  observe_tensors(r, raised);
  return raised;
}

namespace {

// The median of a few values (the mean of the middle two for an even count).
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? kNaN : n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// "layer h0.mlp.fc, its input x (the activation)" for "h0.mlp.fc.input".
std::string tensor_words(const std::string& name) {
  const std::pair<std::string_view, std::string_view> roles[] = {
      {".input", "its input x (the activation)"},
      {".weight", "its weight w"},
      {".grad_output", "its output gradient dy"}};
  for (const auto& [suffix, words] : roles)
    if (name.ends_with(suffix)) return cat("layer ", name.substr(0, name.size() - suffix.size()), ", ", words);
  return cat("tensor ", name);
}

// What the run log holds of a tensor's blocks at this step, for a message.
std::string blocks_words(const nn::Fp8TensorStats& t) {
  if (!t.blocks) return {};
  const lowp::BlockStats& b = *t.blocks;
  return cat("; its ", num(b.blocks), " blocks' log2 multipliers spread with std ", fmt_g(b.log2_multiplier_std),
             " binades (p01 ", fmt_g(b.log2_multiplier_quantiles.p01), ", p99 ", fmt_g(b.log2_multiplier_quantiles.p99),
             "), ", percent(ratio(b.far_blocks, b.blocks)), " of them more than 2^", fmt_g(b.far_log2),
             " below the tensor's amax, the largest block dynamic range ", fmt_g(b.max_block_dynamic_range),
             " binades");
}

// The advice of the per-tensor rules: where the tensor's GEMM can go, and what the what-ifs measured.
std::string tensor_advice(const nn::Fp8TensorStats& t, std::string_view base) {
  const bool backward = t.role == lowp::Role::backward;
  std::string layer = t.name.substr(0, t.name.rfind('.'));
  std::string advice = cat(
      base, "keep this layer's ", backward ? "backward" : "forward", " in bf16 (in the recipe-file entry of ",
      squote(layer), ": ",
      backward ? "\"backward_override\": \"high_precision\"" : "\"fprop\": \"bf16\"",
      ") or move it to a finer-grained recipe (smaller scale blocks: nvfp4's 16 or mxfp8's 32 values rather than "
      "fp8-block's 128, any of them rather than one scale per tensor)");
  const double own = ratio(t.flushed, t.nonzero);
  if (!t.what_if.empty()) {
    advice += cat("; here ", t.recipe.empty() ? std::string("its recipe") : t.recipe, " flushes ", percent(own),
                  " of its nonzero values to zero, and the what-if says");
    for (std::size_t i = 0; i < t.what_if.size(); ++i) {
      const nn::Fp8WhatIf& w = t.what_if[i];
      advice += cat(i == 0 ? " " : i + 1 == t.what_if.size() ? " and " : ", ", w.recipe, " would flush ",
                    percent(ratio(w.flushed, t.nonzero)), " (", num(w.far_blocks), " of ", num(w.blocks),
                    " blocks far)");
    }
  }
  return advice;
}

}  // namespace

void AlertMonitor::observe_tensors(const train::StepRecord& r, std::vector<Alert>& raised) {
  const std::string at = num(r.step);
  const std::size_t n = t_.tensor_baseline;
  for (const nn::Fp8TensorStats& t : r.fp8) {
    if (!t.kurtosis && !t.blocks) continue;  // not a sampled step of this tensor
    auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const TensorBaseline& b) { return b.name == t.name; });
    if (it == tensors_.end()) it = tensors_.insert(tensors_.end(), TensorBaseline{t.name, {}, {}, {}});
    TensorBaseline& b = *it;
    const std::string what = cat(squote(t.name), " (", tensor_words(t.name), ")");
    const std::string baseline_words = cat("the median of its first ", num(n), " sampled steps");

    // ---- kurtosis rise: outlier values growing (FOG, arXiv 2505.20524: an early warning of FP8 divergence).
    if (t.kurtosis) {
      const double k = *t.kurtosis;
      if (b.kurtosis.size() < n) {
        b.kurtosis.push_back(k);
      } else if (const double base = median_of(b.kurtosis); k >= t_.kurtosis_rise * base && k >= t_.kurtosis_min) {
        if (find(AlertKind::kurtosis_rise, t.name) != nullptr) {
          hold(AlertKind::kurtosis_rise, r.step, t.name);
        } else {
          std::string msg = cat("at step ", at, " the kurtosis of ", what, " rose to ", fmt_g(k), ", ",
                                base > 0 ? fmt_g(k / base) + "x" : std::string("far above"), " its baseline ",
                                fmt_g(base), " (", baseline_words, "): a few of its values grow far beyond the rest "
                                "(outlier features), which a block's or a tensor's one scale cannot follow; a rising "
                                "activation kurtosis is an early warning of FP8 divergence (FOG, arXiv 2505.20524)",
                                blocks_words(t));
          hold(AlertKind::kurtosis_rise, r.step, raised, std::move(msg),
               tensor_advice(t, "watch the loss of the next steps; "), t.name);
        }
      }
    }

    // ---- block-spread rise: the blocks' scales spread out, or blocks fall far below the tensor's amax.
    if (t.blocks) {
      const lowp::BlockStats& bs = *t.blocks;
      const double spread = bs.log2_multiplier_std, far = ratio(bs.far_blocks, bs.blocks);
      if (b.spread.size() < n) {
        b.spread.push_back(spread);
        b.far.push_back(far);
      } else {
        const double base_spread = median_of(b.spread), base_far = median_of(b.far);
        const bool wide = spread >= base_spread + t_.spread_rise_binades;
        const bool distant = far >= base_far + t_.far_blocks_rise;
        if (wide || distant) {
          if (find(AlertKind::block_spread_rise, t.name) != nullptr) {
            hold(AlertKind::block_spread_rise, r.step, t.name);
          } else {
            std::string msg = cat("at step ", at, " the scale blocks of ", what, " spread out: ");
            if (wide)
              msg += cat("the std of their log2 multipliers rose to ", fmt_g(spread), " binades from ",
                         fmt_g(base_spread));
            if (wide && distant) msg += ", and ";
            if (distant)
              msg += cat(percent(far), " of the blocks (", percent(base_far), " before) now sit more than 2^",
                         fmt_g(bs.far_log2), " below the tensor's amax");
            msg += cat(" (baselines: ", baseline_words, "): a few values outgrow the rest, so their blocks' "
                       "scales move away from the others' and the quantization of the small values coarsens "
                       "(MX training instabilities come from a few such activations and layer-norm parameters, "
                       "arXiv 2506.20752)");
            if (t.kurtosis) msg += cat("; its kurtosis is ", fmt_g(*t.kurtosis));
            hold(AlertKind::block_spread_rise, r.step, raised, std::move(msg),
                 tensor_advice(t, "check the layer norm feeding it and watch the loss; "), t.name);
          }
        }
      }
    }
  }
}

std::vector<Alert> evaluate(std::span<const train::StepRecord> log, const RunContext& context,
                            const AlertThresholds& thresholds) {
  AlertMonitor m(thresholds, context);
  for (const train::StepRecord& r : log) m.observe(r);
  return m.all();
}

std::string alert_json(const Alert& a) {
  nlohmann::ordered_json j;
  j["id"] = a.id;
  j["step"] = a.step;
  j["last_step"] = a.last_step;
  j["steps"] = a.steps;
  j["message"] = a.message;
  j["advice"] = a.advice;
  if (!a.tensor.empty()) j["tensor"] = a.tensor;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string alerts_json(std::span<const Alert> alerts) {
  std::string out = "[";
  for (std::size_t i = 0; i < alerts.size(); ++i) out.append(i == 0 ? "" : ",").append(alert_json(alerts[i]));
  return out + "]";
}

std::string summary_with_alerts(std::string_view summary_json, std::span<const Alert> alerts) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(summary_json);
  doc["alerts"] = nlohmann::ordered_json::parse(alerts_json(alerts));
  return doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string alert_text(const Alert& a) {
  return std::string("ALERT step ").append(std::to_string(a.step)).append(" ").append(a.id).append(": ").append(
      a.message).append("\n  try: ").append(a.advice);
}

}  // namespace mixprec::monitor
