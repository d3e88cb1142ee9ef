// `mixprec scaler replay`: runs a loss-scale policy over a given overflow sequence and prints,
// for each step, found_inf, whether the step is skipped, the scale after update and the counters.
#include "cmd_scaler.hpp"

#include <fmt/core.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "mixprec/scaler/loss_scale.hpp"

namespace mixprec::cli {
namespace {

struct Replay {
  std::string preset = "mixprec";
  LossScaleConfig config;
  std::vector<bool> overflows;
  bool json = false;
};

struct Row {
  bool found_inf;
  double scale;
  LossScaleCounters counters;
};

std::string scale_text(double s) { return std::isinf(s) ? std::string("inf") : fmt::format("{}", s); }
std::string scale_json(double s) { return std::isinf(s) ? std::string("\"inf\"") : fmt::format("{}", s); }

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(ch));
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

void print_table(const Replay& r, const LossScaleState& initial, const std::vector<Row>& rows) {
  const bool ds = r.config.rule == LossScaleRule::deepspeed;
  fmt::print("mixprec scaler replay: preset {} (rule {}), {} steps\n", r.preset, rule_name(r.config.rule),
             r.overflows.size());
  std::string cfg;
  for (const char ch : describe(r.config)) cfg += ch == '\n' ? ' ' : ch;
  for (std::size_t pos; (pos = cfg.find(" = ")) != std::string::npos;) cfg.replace(pos, 3, "=");
  fmt::print("config: {}\ninitial scale {}\n\n", cfg, scale_text(initial.scale));
  fmt::print("{:>6} {:>9} {:>7} {:>16} {:>8} {:>10} {:>9}", "step", "found_inf", "skipped", "scale after",
             "tracker", "hysteresis", "floor_run");
  if (ds) fmt::print(" {:>9} {:>13}", "iteration", "last_overflow");
  fmt::print("\n");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& w = rows[i];
    fmt::print("{:>6} {:>9} {:>7} {:>16} {:>8} {:>10} {:>9}", i + 1, w.found_inf ? 1 : 0, w.found_inf ? "yes" : "no",
               scale_text(w.scale), w.counters.growth_tracker, w.counters.hysteresis_left, w.counters.floor_overflows);
    if (ds) fmt::print(" {:>9} {:>13}", w.counters.iteration, w.counters.last_overflow_iter);
    fmt::print("\n");
  }
  if (!rows.empty()) {
    const LossScaleCounters& k = rows.back().counters;
    fmt::print("\n{} steps, {} overflows (skipped), {} growths, {} backoffs; final scale {}\n", k.steps, k.overflows,
               k.growths, k.backoffs, scale_text(rows.back().scale));
  }
}

void print_json(const Replay& r, const LossScaleState& initial, const std::vector<Row>& rows,
                const std::string& final_state, const std::string& error) {
  fmt::print("{{\"preset\":{},\"initial_state\":{},\"steps\":[", json_string(r.preset), initial.to_json());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& w = rows[i];
    const LossScaleCounters& k = w.counters;
    fmt::print(
        "{}{{\"step\":{},\"found_inf\":{},\"skipped\":{},\"scale\":{},\"growth_tracker\":{},\"hysteresis_left\":{},"
        "\"floor_overflows\":{},\"iteration\":{},\"last_overflow_iter\":{},\"growths\":{},\"backoffs\":{}}}",
        i == 0 ? "\n" : ",\n", i + 1, w.found_inf, w.found_inf, scale_json(w.scale), k.growth_tracker,
        k.hysteresis_left, k.floor_overflows, k.iteration, k.last_overflow_iter, k.growths, k.backoffs);
  }
  fmt::print("],\n\"final_state\":{},\n\"error\":{}}}\n", final_state, error.empty() ? "null" : json_string(error));
}

int run_replay(const Replay& r) {
  const std::unique_ptr<LossScale> ls = make_loss_scale(r.config);
  const LossScaleState initial = ls->state();
  std::vector<Row> rows;
  rows.reserve(r.overflows.size());
  std::string error;
  for (const bool f : r.overflows) {
    try {
      ls->update(f);
    } catch (const ScaleCollapseError& e) {
      error = e.what();
      break;
    }
    rows.push_back({f, ls->state().scale, ls->counters()});
  }
  if (r.json) {
    print_json(r, initial, rows, ls->to_json(), error);
  } else {
    print_table(r, initial, rows);
  }
  if (!error.empty()) {
    fmt::print(stderr, "mixprec: error: {}\n", error);
    return 1;
  }
  return 0;
}

}  // namespace

void add_scaler_command(CLI::App& app, std::function<int()>& action) {
  auto* scaler = app.add_subcommand("scaler", "Loss-scale policies (presets of PyTorch, DeepSpeed, Megatron, ...)");
  scaler->require_subcommand(1);
  auto* replay = scaler->add_subcommand("replay", "Replay a policy over an overflow sequence, step by step");
  auto preset = std::make_shared<std::string>("mixprec");
  auto sets = std::make_shared<std::vector<std::string>>();
  auto overflows = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  std::string names;
  for (const auto& n : loss_scale_preset_names()) names += (names.empty() ? "" : ", ") + n;
  replay->add_option("--preset", *preset, "Policy preset: " + names)->capture_default_str();
  replay->add_option("--set", *sets, "Override one setting, key=value (repeatable); keys: rule, init_scale, ...")
      ->take_all();
  replay->add_option("--overflows", *overflows, "One character per step: 1 = found inf/NaN, 0 = clean (e.g. 0010)")
      ->required();
  replay->add_flag("--json", *json, "Print JSON (initial state, one object per step, final state) instead of a table");
  replay->callback([=, &action] {
    Replay r;
    r.preset = *preset;
    r.json = *json;
    try {
      r.config = loss_scale_preset(*preset);
    } catch (const std::invalid_argument& e) {
      throw CLI::ValidationError("--preset", e.what());
    }
    for (const std::string& kv : *sets) {
      const auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0)
        throw CLI::ValidationError("--set", "expected key=value, found '" + kv + "'");
      try {
        set(r.config, kv.substr(0, eq), kv.substr(eq + 1));
      } catch (const std::invalid_argument& e) {
        throw CLI::ValidationError("--set", e.what());
      }
    }
    try {
      validate(r.config);
    } catch (const std::invalid_argument& e) {
      throw CLI::ValidationError("--set", std::string(e.what()) + " (preset " + *preset + " with the --set values)");
    }
    if (overflows->empty())
      throw CLI::ValidationError("--overflows", "expected at least one step (0 = clean, 1 = overflow), found none");
    for (std::size_t i = 0; i < overflows->size(); ++i) {
      const char ch = (*overflows)[i];
      if (ch != '0' && ch != '1')
        throw CLI::ValidationError("--overflows", fmt::format("expected only 0 and 1, found '{}' at position {} "
                                                              "(1-based)",
                                                              ch, i + 1));
      r.overflows.push_back(ch == '1');
    }
    action = [r] { return run_replay(r); };
  });
}

}  // namespace mixprec::cli
