// `mixprec advise RUN_DIR`: the precision advisor over the tensors a run folder holds
// (RUN_DIR/samples/, written by mixprec.torch.Telemetry(advisor_every=N) or mixprec.torch.advise;
// docs/run_folder.md): every candidate measured per layer and role, the cheapest within the
// budget chosen, written as OUT/recipe.json (the recipe file mixprec.torch.low_precision reads)
// and OUT/advice.json (the evidence `mixprec report` shows), with --directions also
// OUT/recipe-directions.json (a recipe per GEMM direction and the late forward switch); the
// table printed. The measurement, cost model and choice are the core's (advise/advise.hpp);
// this file parses flags.
//
// Exit codes: 0 written; 1 the run folder's samples cannot be read or the files cannot be
// written (nothing is left half-written); 2 a bad command line or configuration.
#include "cmd_advise.hpp"
#include "cli_app.hpp"

#include <fmt/core.h>

#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <variant>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/keys.hpp"
#include "mixprec/advise/advise.hpp"

namespace mixprec::cli {
namespace {

namespace fs = std::filesystem;
namespace adv = monitor::advisor;

struct AdviseInputs {
  std::string dir;
  std::string config;      // a JSON file of advisor keys
  std::string candidates;  // comma separated; replaces the config's
  std::string budget;      // a number; replaces the config's error bounds
  bool budget_given = false;  // --budget, even empty (refused, not ignored)
  std::string out;         // folder of recipe.json and advice.json (default RUN_DIR/advice)
  bool directions = false;    // also write recipe-directions.json
  std::string late_switch;    // replaces late_forward_switch.when
  bool late_switch_given = false;
  std::string late_switch_from;  // replaces late_forward_switch.from_fraction
  bool late_switch_from_given = false;
};

constexpr const char* kDirectionsFile = "recipe-directions.json";

// The configuration: the file's keys, then the flags over them, parsed by the core's one parser.
adv::AdviseConfig configuration(const AdviseInputs& in) {
  std::string text = "{}";
  std::string source = "--config";
  if (!in.config.empty()) {
    source = in.config;
    text = io::read_json_text(in.config);  // a regular file: a FIFO or /dev/zero is refused, not waited on
  }
  adv::AdviseConfig c = adv::parse_config(text, source);
  if (!in.candidates.empty()) {
    std::string list = "[";
    std::stringstream ss(in.candidates);
    std::string name;
    while (std::getline(ss, name, ',')) list += (list.size() > 1 ? ",\"" : "\"") + name + "\"";
    c.candidates = adv::parse_config("{\"candidates\": " + list + "]}", "--candidates").candidates;
  }
  if (in.budget_given) {  // the core's number grammar, then the config's range for a budget
    static const keys::Spec spec{.name = "--budget", .kind = keys::Kind::number, .lo = 0, .hi = 1e300};
    c.budget.max_rel_rms_error.fill(std::get<double>(keys::parse_text(spec, in.budget)));
  }
  if (in.late_switch_given) {
    const auto when = adv::parse_late_switch_when(in.late_switch);
    if (!when) throw std::invalid_argument("--late-switch: expected " + adv::late_switch_when_names() + ", found '" + in.late_switch + "'");
    c.late_forward_switch.when = *when;
  }
  if (in.late_switch_from_given) {  // the core's number grammar; the phase covers the last (1 - f) of the run
    static const keys::Spec spec{.name = "--late-switch-from", .kind = keys::Kind::number, .lo = 0, .hi = 1, .hi_open = true};
    c.late_forward_switch.from_fraction = std::get<double>(keys::parse_text(spec, in.late_switch_from));
  }
  return c;
}

// The folder `out` names, as a path whose last part is its own name: "o/" and "." become
// absolute and lose the trailing separator, so that the folder can be swapped whole.
fs::path folder_path(const fs::path& out) {
  fs::path p = fs::absolute(out).lexically_normal();
  if (p.filename().empty() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  return p;
}

int run_advise(const AdviseInputs& in) {
  adv::AdviseConfig config;
  try {
    config = configuration(in);
  } catch (const std::exception& e) {
    fmt::print(stderr, "mixprec advise: error: {}\n", e.what());
    return 2;
  }
  try {
    const fs::path out = in.out.empty() ? fs::path(in.dir) / "advice" : fs::path(in.out);
    const std::vector<adv::OwnedSample> owned = adv::read_samples(in.dir);
    std::vector<adv::SampleView> views;
    views.reserve(owned.size());
    for (const adv::OwnedSample& s : owned) views.push_back(s.view());
    const adv::Advice a = adv::advise(views, config);
    // recipe.json and advice.json belong together: both are written into a staging folder that
    // replaces `out` in one rename, so a kill at any moment leaves the old pair or the new one.
    std::error_code ec;
    const fs::path target = folder_path(out);
    if (fs::is_symlink(target, ec))
      throw std::runtime_error("--out: '" + out.string() + "' is a symbolic link; expected a folder (it is replaced whole)");
    if (fs::exists(target, ec)) {
      if (!fs::is_directory(target, ec)) throw std::runtime_error("--out: '" + out.string() + "' is not a folder");
      for (const fs::directory_entry& e : fs::directory_iterator(out)) {
        const std::string name = e.path().filename().string();
        if (name != "recipe.json" && name != "advice.json" && name != kDirectionsFile && !io::atomic_temporary_pid(name))
          throw std::runtime_error("--out: '" + out.string() + "' holds '" + name +
                                   "'; expected a new folder or one that mixprec advise wrote (recipe.json, "
                                   "advice.json and " + kDirectionsFile + ", replaced together)");
      }
    }
    fs::create_directories(target.parent_path());
    const fs::path staged = io::make_staging_folder(target);
    try {
      io::write_file_atomic(staged / "advice.json", adv::advice_json(a));
      io::write_file_atomic(staged / "recipe.json", adv::recipe_file_json(a));
      if (in.directions) io::write_file_atomic(staged / kDirectionsFile, adv::directional_recipe_file_json(a));
      io::replace_folder(staged, target);
    } catch (...) {
      fs::remove_all(staged, ec);
      throw;
    }
    fmt::print("{}", adv::advice_table(a));
    for (const adv::LayerAdvice& l : a.layers) {
      fmt::print("{}: {}\n", l.layer, l.reason);
      if (l.directions.proposed() && (l.directions.forward != l.chosen || l.directions.backward != l.chosen))
        fmt::print("{}: directions: {}\n", l.layer, l.directions.reason);
      if (l.late_switch) fmt::print("{}: late forward switch: {}\n", l.layer, l.late_switch->reason);
    }
    fmt::print("recipe file: {}\nevidence: {}\n", (out / "recipe.json").string(), (out / "advice.json").string());
    if (in.directions) fmt::print("recipe file per GEMM direction: {}\n", (out / kDirectionsFile).string());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mixprec advise: error: {}\n", e.what());
    return 1;
  }
}

}  // namespace

void add_advise_command(CLI::App& app, std::function<int()>& action) {
  auto* cmd = app.add_subcommand(
      "advise", "Per linear layer, the cheapest precision within an error budget, from the tensors a run sampled");
  auto in = std::make_shared<AdviseInputs>();
  cmd->add_option("run_dir", in->dir, "A run folder holding samples/ (docs/run_folder.md)")
      ->required()
      ->type_name("RUN_DIR");
  cmd->add_option("--config", in->config, "Advisor configuration: candidates, budget, cost model (docs/advisor.md)")
      ->type_name("FILE.json");
  cmd->add_option("--candidates", in->candidates, "Candidates to consider, comma separated (" + adv::candidate_names() + ")")
      ->type_name("A,B,...");
  cmd->add_option("--budget", in->budget, "Relative RMS error bound for every role (default x 0.1, w 0.125, dy 0.1)")
      ->type_name("X");
  cmd->add_option("--out", in->out, "Folder for recipe.json and advice.json (default RUN_DIR/advice)")->type_name("DIR");
  cmd->add_flag("--directions", in->directions,
                std::string("Also write ") + kDirectionsFile +
                    ": per layer a forward and a backward recipe, and the late forward switch as a schedule phase");
  cmd->add_option("--late-switch", in->late_switch,
                  "Which layers get the late forward switch: " + adv::late_switch_when_names() + " (default fp4)")
      ->type_name("WHEN");
  cmd->add_option("--late-switch-from", in->late_switch_from,
                  "Fraction of the run from which the switched forwards run bf16, in [0, 1) (default 0.8)")
      ->type_name("F");
  cmd->callback([cmd, in, &action] {
    in->budget_given = cmd->count("--budget") > 0;
    in->late_switch_given = cmd->count("--late-switch") > 0;
    in->late_switch_from_given = cmd->count("--late-switch-from") > 0;
    action = [in] { return run_advise(*in); };
  });
}

}  // namespace mixprec::cli
