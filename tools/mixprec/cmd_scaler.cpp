// `mixprec scaler replay`: runs a loss-scale policy over a given overflow sequence and prints,
// for each step, found_inf, whether the step is skipped, the scale after update and the counters.
// `mixprec scaler simulate RUN_DIR`: estimates what another policy would have done on a
// recorded run (docs/alerts.md).
#include "cmd_scaler.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/core/text.hpp"
#include "mixprec/advise/simulate.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/scaler/protocol.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"

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

using text::json_quote;

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
  fmt::print("{{\"preset\":{},\"initial_state\":{},\"steps\":[", json_quote(r.preset), initial.to_json());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& w = rows[i];
    const LossScaleCounters& k = w.counters;
    fmt::print(
        "{}{{\"step\":{},\"found_inf\":{},\"skipped\":{},\"scale\":{},\"growth_tracker\":{},\"hysteresis_left\":{},"
        "\"floor_overflows\":{},\"iteration\":{},\"last_overflow_iter\":{},\"growths\":{},\"backoffs\":{}}}",
        i == 0 ? "\n" : ",\n", i + 1, w.found_inf, w.found_inf, scale_json(w.scale), k.growth_tracker,
        k.hysteresis_left, k.floor_overflows, k.iteration, k.last_overflow_iter, k.growths, k.backoffs);
  }
  fmt::print("],\n\"final_state\":{},\n\"error\":{}}}\n", final_state, error.empty() ? "null" : json_quote(error));
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

// ---- mixprec scaler simulate ----------------------------------------------------------------

struct SimulateInputs {
  std::string dir;
  std::string preset = "mixprec";
  LossScaleConfig config;  // built at parse time, but for --preset run (from the run folder)
  std::vector<std::pair<std::string, std::string>> overrides;  // --set, for --preset run
  bool json = false;
  bool steps = false;
};

// --set key=value pairs; CLI errors: exit 2.
std::vector<std::pair<std::string, std::string>> set_pairs(const std::vector<std::string>& sets) {
  std::vector<std::pair<std::string, std::string>> overrides;
  for (const std::string& kv : sets) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw CLI::ValidationError("--set", "expected key=value, found '" + kv + "'");
    overrides.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return overrides;
}

// The policy of --preset with the --set values, built and validated by the one function every
// door uses (make_loss_scale_config: overrides in the key table's order). CLI errors: exit 2.
LossScaleConfig policy_from(const std::string& preset, const std::vector<std::string>& sets) {
  try {
    (void)loss_scale_preset(preset);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError("--preset", e.what());
  }
  const auto overrides = set_pairs(sets);
  try {
    return make_loss_scale_config(preset, overrides);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError("--set", e.what());
  }
}

std::string step_text(std::uint64_t step) { return step == 0 ? std::string("none") : fmt::format("step {}", step); }

// "2^16" for powers of two, the number otherwise.
std::string pow2_text(double s) {
  if (std::isinf(s)) return s > 0 ? "never" : "-inf";
  if (s == 0) return "any";
  int e = 0;
  if (std::frexp(s, &e) == 0.5) return fmt::format("2^{}", e - 1);
  return fmt::format("{:.4g}", s);
}

// "key=value key=value ..." of a config, on one line.
std::string config_line(const LossScaleConfig& c) {
  std::string cfg;
  for (const char ch : describe(c)) cfg += ch == '\n' ? ' ' : ch;
  for (std::size_t pos; (pos = cfg.find(" = ")) != std::string::npos;) cfg.replace(pos, 3, "=");
  while (!cfg.empty() && cfg.back() == ' ') cfg.pop_back();
  return cfg;
}

void print_simulation(const SimulateInputs& in, const train::RunConfig& rc, const monitor::Simulation& sim) {
  const train::TrainConfig& run = rc.config;
  fmt::print("mixprec scaler simulate: run {} ({}, loss scale {}, {} steps logged)\n", in.dir,
             nn::precision_name(run.precision), run.loss_scale, sim.recorded.steps);
  if (rc.loss_scale)
    fmt::print("recorded policy (rule {}{}), written by {}: {}\n", rule_name(rc.loss_scale->rule),
               rc.loss_scale_stored ? "" : ", the preset's: the run stored no loss-scale-config",
               train::run_writer_text(rc), config_line(*rc.loss_scale));
  fmt::print("policy: preset {} (rule {}): {}\n", in.preset, rule_name(in.config.rule), config_line(in.config));
  fmt::print("model: a step overflows when scale x its unscaled activation-gradient amax >= {} ({} overflow "
             "threshold), or at any scale (a non-finite forward pass, an injected inf); at the recorded scales it reproduces "
             "the recorded skips on {} of {} steps\n",
             sim.limit, nn::precision_name(sim.precision), sim.agree, sim.recorded.steps);
  fmt::print("an estimate: the gradients are the recorded ones, though the weights would differ once the policy "
             "skips another step; underflow is not modelled (docs/alerts.md)\n\n");
  const monitor::SimulationSide& a = sim.recorded;
  const monitor::SimulationSide& b = sim.simulated;
  const std::string ha = "recorded (" + run.loss_scale + ")";
  const std::string hb = "simulated (" + in.preset + ")";
  fmt::print("{:<13} {:>22} {:>22}\n", "", ha, hb);
  fmt::print("{:<13} {:>22} {:>22}\n", "steps", a.steps, b.steps);
  fmt::print("{:<13} {:>22} {:>22}\n", "skipped", a.skipped, b.skipped);
  fmt::print("{:<13} {:>22} {:>22}\n", "first skip", step_text(a.first_skip), step_text(b.first_skip));
  fmt::print("{:<13} {:>22} {:>22}\n", "growths", a.growths, b.growths);
  fmt::print("{:<13} {:>22} {:>22}\n", "backoffs", a.backoffs, b.backoffs);
  fmt::print("{:<13} {:>22} {:>22}\n", "final scale", a.final_scale, b.final_scale);
  fmt::print("{:<13} {:>22} {:>22}\n", "min scale", a.min_scale, b.min_scale);
  fmt::print("{:<13} {:>22} {:>22}\n", "max scale", a.max_scale, b.max_scale);
  if (!sim.collapse.empty())
    fmt::print("\nthe simulated policy stops the run at step {}: {}\n", sim.collapse_step, sim.collapse);

  // One character per step: '.' applied, 'x' skipped; 50 steps a line.
  fmt::print("\nskipped steps (x), 50 a line:\n");
  constexpr std::size_t kLine = 50;
  for (std::size_t i = 0; i < sim.steps.size(); i += kLine) {
    const std::size_t end = std::min(sim.steps.size(), i + kLine);
    std::string rec, simu;
    for (std::size_t k = i; k < end; ++k) {
      rec += sim.steps[k].recorded_skipped ? 'x' : '.';
      simu += sim.steps[k].skipped ? 'x' : '.';
    }
    fmt::print("steps {:>5}-{:<5}  recorded  {}\n{:>19}simulated {}\n", sim.steps[i].step, sim.steps[end - 1].step,
               rec, "", simu);
  }
  if (in.steps) {
    fmt::print("\n{:>6} {:>20} {:>13} {:>14} {:>8} {:>14} {:>8} {:>14}\n", "step", "model", "overflows at",
               "recorded scale", "skipped", "scale", "skipped", "scale after");
    for (const monitor::SimulatedStep& t : sim.steps)
      fmt::print("{:>6} {:>20} {:>13} {:>14} {:>8} {:>14} {:>8} {:>14}\n", t.step,
                 monitor::overflow_model_name(t.model), pow2_text(t.overflow_scale), t.recorded_scale,
                 t.recorded_skipped ? "yes" : "no", t.scale, t.skipped ? "yes" : "no", t.next_scale);
  }
}

int run_simulate(const SimulateInputs& in) {
  namespace fs = std::filesystem;
  const auto fail = [](const std::string& msg) {
    fmt::print(stderr, "mixprec scaler simulate: error: {}\n", msg);
    return 1;
  };
  std::error_code ec;
  const fs::path dir = in.dir;
  if (!fs::is_directory(dir, ec))
    return fail("'" + in.dir + "' is not a folder; expected a run folder written by mixprec train --out");
  try {
    train::check_run_folder(dir);
    const std::optional<train::RunConfig> rc = train::read_run_config(dir);
    if (!rc) return fail("'" + in.dir + "' has no config.json; expected a run folder written by mixprec train --out");
    SimulateInputs use = in;
    if (in.preset == "run") {  // the run's own policy, overrides included, then --set
      if (!rc->loss_scale)
        return fail("--preset run: the run trained without loss scaling (loss-scale none); give a preset");
      use.config = make_loss_scale_config(*rc->loss_scale, "run", in.overrides);
    }
    const std::vector<train::StepRecord> log = train::read_run_log((dir / train::run_files::log).string());
    const monitor::Simulation sim = monitor::simulate(log, rc->config.precision, use.config);
    if (in.json) {
      const std::string body = monitor::simulation_json(sim);
      fmt::print("{{\"run\":{},\"preset\":{},{}\n", json_quote(in.dir), json_quote(in.preset), body.substr(1));
    } else {
      print_simulation(use, *rc, sim);
    }
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (msg.starts_with("simulate: ")) msg.erase(0, 10);
    return fail(msg);
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
    r.config = policy_from(*preset, *sets);
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

  // mixprec scaler simulate RUN_DIR
  auto* sim = scaler->add_subcommand(
      "simulate", "Estimate from a run's recorded gradient amax what another policy would have skipped");
  auto si = std::make_shared<SimulateInputs>();
  auto sim_preset = std::make_shared<std::string>("mixprec");
  auto sim_sets = std::make_shared<std::vector<std::string>>();
  sim->add_option("run_dir", si->dir, "Run folder written by mixprec train --out (log.jsonl, config.json)")
      ->required()
      ->type_name("RUN_DIR");
  sim->add_option("--preset", *sim_preset,
                  "Policy preset to simulate: " + names + ", or run (the run's own policy, its overrides included)")
      ->capture_default_str();
  sim->add_option("--set", *sim_sets, "Override one setting, key=value (repeatable), as in scaler replay")->take_all();
  sim->add_flag("--steps", si->steps, "Also print every step (model, recorded and simulated scale and skip)");
  sim->add_flag("--json", si->json, "Print the simulation as JSON instead of tables");
  sim->callback([si, sim_preset, sim_sets, &action] {
    SimulateInputs in = *si;
    in.preset = *sim_preset;
    if (in.preset == "run")
      in.overrides = set_pairs(*sim_sets);  // applied to the run's policy once it is read
    else
      in.config = policy_from(*sim_preset, *sim_sets);
    action = [in] { return run_simulate(in); };
  });
}

}  // namespace mixprec::cli
