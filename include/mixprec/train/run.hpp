// A training run's lifecycle around the Trainer, for every front door of the engine
// (`mixprec train` and `mixprec compare` today): planning the run from a config file and
// keys given on top of it, resuming a run folder, the communicator of --distributed, the
// loop that logs every step to the run folder and checkpoints it, and the summary. The
// front door adds its own flags, progress, signals and printing.
//
//   RunRequest req{.config_text = text, .config_given = true, .config_source = "config file 'c.json'",
//                  .keys = {{"steps", "100"}, {"out", "runs/a"}}};
//   RunPlan plan = plan_run(req, [](const std::string& note) { print(note); });
//   auto comm = make_communicator(plan.config, mpi_connect);  // one process unless --distributed
//   check_ranks(plan.config, *comm);
//   Trainer t(plan.config, *comm);
//   plan.config.data = stored_data_path(plan.config.data);  // after the Trainer: its messages name it as given
//   RunFolder folder(plan.dir, plan.resume ? RunFolder::Mode::resume : RunFolder::Mode::create);
//   start_run(t, &folder, plan, on_removed);                 // resume: the checkpoint, the log cut back
//   monitor::AlertMonitor alerts = run_alerts(plan, &folder); // resume: the logged steps replayed
//   run_steps(t, &folder, plan.resume ? t.steps_done() : 0, stop, [&](const StepRecord& r) { alerts.observe(r); });
//   folder.write_summary(run_summary_json(t.summary(), plan.config, alerts.all()));
//
// Errors: std::invalid_argument for what the request asks (the command line's exit 2:
// nothing is written then), anything else for a run that cannot proceed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixprec/distributed/communicator.hpp"
#include "mixprec/run/alerts.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::train {

// ---- planning ---------------------------------------------------------------------------

// What a front door asks for: an optional JSON config and the keys given on top of it
// (`mixprec train`'s flags), in config_keys() order, each (key without dashes, value
// text; "true" for a flag key). Continuing a run is the key "resume" with its folder.
struct RunRequest {
  std::string config_text;            // the config file's JSON (when config_given)
  bool config_given = false;
  std::string config_source;          // names it in messages: "config file 'c.json'"
  std::vector<std::pair<std::string, std::string>> keys;

  const std::string* key(std::string_view name) const;  // the value given, or null
  bool config_has(std::string_view name) const;         // the config file sets it
};

// The keys of `r` applied to `c` in their order, but those in `skip`.
TrainConfig apply_keys(TrainConfig c, const RunRequest& r, const std::vector<std::string>& skip = {});
// The default warmup is at most `steps` (so `--steps 3` just works); a warmup that was
// asked for (a key or the config file) is validated as given.
void fit_default_warmup(TrainConfig& c, const RunRequest& r);

// What the Trainer runs and where.
struct RunPlan {
  TrainConfig config;
  std::filesystem::path dir;               // run folder ("" = none)
  bool resume = false;
  std::filesystem::path checkpoint;        // resume: the newest checkpoint ("" = none: from step 0)
  std::uint64_t checkpoint_step = 0;
};

// A new run: the config file, then the keys; the defaults that follow from them (the
// warmup, no loss scaling for fp8 presets unless asked for); everything validated, and
// the run folder (`out`) new or empty. A resume (key "resume"): the run's own
// configuration (config.json, or its newest checkpoint's when that was lost: `note` is
// told so), which the config file and the keys may only repeat (--steps may extend it,
// the data file may be given by another path); `out` only as the run's own folder.
// std::invalid_argument naming the key for anything the request cannot have.
RunPlan plan_run(const RunRequest& r, const std::function<void(const std::string&)>& note = {});

// The data file as the run folder stores it: its absolute path, so that a resume from
// any working directory finds it (the checkpoint's data fingerprint, a hash of the
// file's tokens, identifies its content). std::invalid_argument when the name is not
// UTF-8 (the run's JSON files could not hold it).
std::string stored_data_path(const std::string& data);

// config.json of a run: its configuration with the resume folder cleared (a resume rewrites it
// with the steps it was given).
std::string run_config_json(TrainConfig c);

// ---- the communicator ---------------------------------------------------------------------

// How a front door reaches MPI: null when its build has none; else called with the
// collective deadline (config dist-timeout), it returns the MPI communicator, or null
// when the process was not launched by mpirun.
using MpiConnect = std::function<std::unique_ptr<dist::Communicator>(double timeout_seconds)>;

// The communicator of a run: MPI under mpirun with distributed, else one process.
// std::invalid_argument: launched by mpirun with several ranks but not distributed, or
// distributed in a build without MPI (`mpi` null).
std::unique_ptr<dist::Communicator> make_communicator(const TrainConfig& c, const MpiConnect& mpi);
// The configuration against the ranks it runs on (inject-overflow-rank within them).
void check_ranks(const TrainConfig& c, const dist::Communicator& comm);
// Whether the ranks stop: `here` on one process; distributed, whether any rank asked
// (a signal may reach only some of them; a collective every rank calls).
bool ranks_stop(dist::Communicator& comm, bool here);

// ---- starting, training, finishing ---------------------------------------------------------

struct RunSteps {
  bool stopped = false;                   // stop() said so before the run was done
  std::uint64_t checkpoint_step = 0;      // newest checkpoint written or loaded (0: none)
  std::filesystem::path checkpoint;       // its file ("" without a folder)
};

// Trains until t.done() or stop() returns true (asked before each step). Each step is
// appended to the folder's log.jsonl, then handed to on_step. With a folder, a
// checkpoint is written every config.checkpoint-every steps and at the end (also when
// stopped), keeping the newest keep-checkpoints. `folder` is null on ranks other than 0
// and for runs without --out; under ZeRO (config.zero == 1, with --out) every rank
// takes part in each checkpoint (the other ranks' slices are gathered), rank 0 writes
// it. `checkpointed`: the step of the checkpoint the run resumed from (0: none).
RunSteps run_steps(Trainer& t, RunFolder* folder, std::uint64_t checkpointed, const std::function<bool()>& stop,
                   const std::function<void(const StepRecord&)>& on_step);

// The configuration a resume of `dir` continues with: its config.json or, when that was
// lost, the configuration stored in its newest checkpoint (`from_checkpoint` names the
// file). std::invalid_argument when `dir` has neither (not a run folder).
struct ResumeConfig {
  TrainConfig config;
  std::filesystem::path from_checkpoint;  // "" when config.json was read
  std::uint64_t checkpoint_step = 0;      // the newest checkpoint (0 and "" when none)
  std::filesystem::path checkpoint;
};
ResumeConfig read_resume_config(const std::filesystem::path& dir);

// Brings `t` and the run folder to where the plan starts. A resume: the temporaries an
// interrupted write left are removed (each named to `removed`), the newest checkpoint
// loaded, log.jsonl cut back to its step and config.json written again (with the steps
// now asked for). A new run: config.json written. `folder` is null on ranks other than
// 0 (a resume loads the checkpoint there too) and for runs without a folder.
void start_run(Trainer& t, RunFolder* folder, const RunPlan& p,
               const std::function<void(const std::filesystem::path&)>& removed);

// The run's alert monitor (docs/alerts.md); a resume replays the steps the folder logged
// so far into it first, silently (`folder` null: none, as on ranks other than 0).
monitor::AlertMonitor run_alerts(const RunPlan& p, const RunFolder* folder);

// What the communicator moved per step during this process's `steps` steps (since its
// last reset_stats), rank 0's view, and all ranks' bytes together: summary.json's
// "distributed" object (docs/distributed.md), as JSON text. A collective: every rank calls it.
std::string communication_json(dist::Communicator& comm, const TrainConfig& c, std::uint64_t steps);

// summary.json of a finished run: the summary and its alerts, and the "distributed"
// object (communication_json) when `distributed_json` is not empty. Indented by 2.
std::string run_summary_json(const TrainSummary& s, const TrainConfig& c, std::span<const monitor::Alert> alerts,
                             const std::string& distributed_json = {});

}  // namespace mixprec::train
