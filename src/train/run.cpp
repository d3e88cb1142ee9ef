// A run's lifecycle: the plan, the communicator, the loop, the resume configuration
// and the summary (include/mixprec/train/run.hpp).
#include "mixprec/train/run.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <system_error>

#include "mixprec/checkpoint/safetensors.hpp"
#include "mixprec/core/io.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/nn/precision.hpp"
#include "mixprec/run/run_log.hpp"

namespace mixprec::train {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using text::squote;

namespace {

// fp8 presets default to no loss scaling (per-tensor scaling replaces it; the scaler
// still refuses non-finite gradients) unless a loss scale was asked for.
void fit_default_loss_scale(TrainConfig& c, const RunRequest& r) {
  if (!nn::is_fp8(c.precision)) return;
  if (r.key("loss-scale") != nullptr || r.config_has("loss-scale")) return;
  c.loss_scale = "none";
}

// An fp8 key given for a precision that does not use it is an error, even at its
// default value (validate catches the other values and config files).
void check_fp8_keys(const TrainConfig& c, const RunRequest& r) {
  for (const std::string& key : fp8_keys()) {
    if (r.key(key) == nullptr || fp8_key_applies(key, c.precision)) continue;
    std::string names;
    for (const std::string& p : nn::precision_names())
      if (const auto pp = nn::parse_precision(p); pp && fp8_key_applies(key, *pp))
        names += (names.empty() ? "" : ", ") + p;
    throw std::invalid_argument(key + ": applies to --precision " + names + " only, found --precision " +
                                std::string(nn::precision_name(c.precision)));
  }
}

// A data file name that is not UTF-8 is refused: the run's JSON files could not hold it
// (it would be stored with U+FFFD and never found again).
void check_data_name(const std::string& data) {
  if (data.empty()) return;
  try {
    nn::check_text(data, "data: the file name");
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(std::string(e.what()) + "; the run folder's JSON files hold UTF-8 names only: rename "
                                "the file, or give a link to it with a UTF-8 name");
  }
}

std::string json_value_text(const ojson& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

RunPlan plan_new_run(const RunRequest& r) {
  TrainConfig c;
  if (r.config_given) c = apply_json(c, r.config_text, r.config_source);
  if (!c.resume.empty())
    throw std::invalid_argument(r.config_source + ": resume: give --resume DIR on the command line to continue a run");
  c = apply_keys(c, r);
  fit_default_warmup(c, r);
  fit_default_loss_scale(c, r);
  check_fp8_keys(c, r);
  validate(c);
  const bool out_given = r.key("out") != nullptr || r.config_has("out");
  if (out_given && c.out.empty())
    throw std::invalid_argument("out: expected a folder, found '' (omit --out to write no run folder)");
  check_data_name(c.data);
  if (c.out.empty() && c.checkpoint_every > 0)
    throw std::invalid_argument("checkpoint-every: checkpoints go to the run folder; give --out DIR");
  if (!c.out.empty() && run_folder_has_files(c.out, "out"))
    throw std::invalid_argument("out: " + squote(c.out) + " exists and is not empty; " +
                                nonempty_folder_advice(c.out, RunWriter::engine));
  RunPlan p;
  p.config = c;
  p.dir = c.out;
  return p;
}

// Resume: the run's own configuration; the keys may only repeat it (steps may extend).
RunPlan plan_resume(const RunRequest& r, const std::string& dir, const std::function<void(const std::string&)>& note) {
  if (dir.empty()) throw std::invalid_argument("resume: expected a run folder, found ''");
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw std::invalid_argument("resume: " + squote(dir) + " is not a folder");
  const ResumeConfig run = read_resume_config(dir);
  if (!run.from_checkpoint.empty() && note)
    note(dir + " has no config.json; using the configuration in " + run.from_checkpoint.string());
  const TrainConfig& base = run.config;
  TrainConfig requested = base;
  if (r.config_given) requested = apply_json(requested, r.config_text, r.config_source);
  requested = apply_keys(requested, r, {"resume"});
  // The data file may be given by any path (or moved): the checkpoint's data
  // fingerprint decides whether it is the run's data.
  if (requested.data != base.data) requested.data = stored_data_path(requested.data);
  const ojson was = ojson::parse(to_json(base));
  const ojson now = ojson::parse(to_json(requested));
  for (const auto& [key, value] : was.items()) {
    if (find_config_key(key)->resume_may_change) continue;
    if (now.at(key) != value)
      throw std::invalid_argument("--" + key + ": this run was started with " +
                                  (json_value_text(value).empty() ? "''" : json_value_text(value)) +
                                  "; a resumed run keeps its configuration");
  }
  if (const std::string* out = r.key("out"); out != nullptr) {
    if (!fs::exists(*out, ec) || !fs::equivalent(*out, dir, ec))
      throw std::invalid_argument("out: a resumed run continues in its own folder " + squote(dir) + ", found " +
                                  squote(*out));
  }
  // No checkpoint: the run stopped before its first one and starts again from step 0.
  RunPlan p;
  p.checkpoint_step = run.checkpoint_step;
  p.checkpoint = run.checkpoint;
  TrainConfig c = requested;
  c.out = dir;
  c.resume = dir;
  // Before validate: fewer steps than done is the problem, not the warmup that follows.
  if (c.steps < p.checkpoint_step)
    throw std::invalid_argument("steps: the run in " + squote(dir) + " is at step " +
                                std::to_string(p.checkpoint_step) + "; expected at least " +
                                std::to_string(p.checkpoint_step) + ", found " + std::to_string(c.steps));
  validate(c);
  p.config = c;
  p.dir = dir;
  p.resume = true;
  return p;
}

}  // namespace

const std::string* RunRequest::key(std::string_view name) const {
  for (const auto& [k, v] : keys)
    if (k == name) return &v;
  return nullptr;
}

bool RunRequest::config_has(std::string_view name) const {
  return config_given && ojson::parse(config_text).contains(name);
}

TrainConfig apply_keys(TrainConfig c, const RunRequest& r, const std::vector<std::string>& skip) {
  for (const auto& [key, value] : r.keys) {
    if (std::find(skip.begin(), skip.end(), key) != skip.end()) continue;
    set_config_key(c, key, value);
  }
  return c;
}

void fit_default_warmup(TrainConfig& c, const RunRequest& r) {
  if (r.key("warmup") != nullptr || r.config_has("warmup")) return;
  c.warmup = std::min(c.warmup, c.steps);
}

RunPlan plan_run(const RunRequest& r, const std::function<void(const std::string&)>& note) {
  const std::string* resume = r.key("resume");
  return resume == nullptr ? plan_new_run(r) : plan_resume(r, *resume, note);
}

std::string stored_data_path(const std::string& data) {
  if (data.empty()) return data;
  check_data_name(data);
  std::error_code ec;
  const fs::path abs = fs::absolute(data, ec);
  return ec ? data : abs.lexically_normal().string();
}

std::string run_config_json(TrainConfig c) {
  c.resume.clear();
  // The recipe file's content too, so that the folder says what the run ran; its path
  // absolute, so that a resume from another folder finds it.
  std::string recipes;
  if (const std::shared_ptr<const lowp::Assignment> a = recipe_assignment(c)) {
    recipes = lowp::to_json(*a);
    std::error_code ec;
    const fs::path abs = fs::absolute(c.recipe_file, ec);
    if (!ec) c.recipe_file = abs.lexically_normal().string();
  }
  return run_config_text(c, RunWriter::engine, {}, std::nullopt, recipes);
}

std::unique_ptr<dist::Communicator> make_communicator(const TrainConfig& c, const MpiConnect& mpi) {
  const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (world == nullptr) world = std::getenv("PMI_SIZE");
  const bool many = world != nullptr && std::string_view(world) != "1";
  if (!c.distributed) {
    if (many)
      throw std::invalid_argument(std::string("distributed: launched by mpirun with ").append(world) +
                                  " ranks; give --distributed (otherwise every rank would train the whole run on its "
                                  "own)");
    return std::make_unique<dist::SingleProcess>();
  }
  if (!mpi)
    throw std::invalid_argument("distributed: this mixprec was built without MPI (CMake found no MPI; install "
                                "libopenmpi-dev, e.g. scripts/deps.sh, and rebuild); run without --distributed");
  if (std::unique_ptr<dist::Communicator> comm = mpi(c.dist_timeout)) return comm;
  return std::make_unique<dist::SingleProcess>();  // not under mpirun: one rank
}

void check_ranks(const TrainConfig& c, const dist::Communicator& comm) {
  if (comm.size() > 1 && c.inject_overflow_rank >= comm.size())
    throw std::invalid_argument("inject-overflow-rank: expected -1 (every rank) or a rank in [0, " +
                                std::to_string(comm.size()) + "), found " + std::to_string(c.inject_overflow_rank));
}

bool ranks_stop(dist::Communicator& comm, bool here) {
  if (comm.size() == 1) return here;
  float stop = here ? 1.0f : 0.0f;
  comm.allreduce_max(std::span<float>(&stop, 1));
  return stop != 0.0f;
}

RunSteps run_steps(Trainer& t, RunFolder* folder, std::uint64_t checkpointed, const std::function<bool()>& stop,
                   const std::function<void(const StepRecord&)>& on_step) {
  const TrainConfig& c = t.config();
  RunSteps res;
  res.checkpoint_step = checkpointed;
  // ZeRO: a checkpoint gathers every rank's slice, so the other ranks take part in
  // each save that rank 0 makes (and write nothing).
  const bool follower = c.zero == 1 && t.communicator().rank() != 0 && !c.out.empty();
  const bool saving = folder != nullptr || follower;
  auto save = [&](std::uint64_t step) {
    if (follower) {
      t.save_checkpoint("");
    } else {
      res.checkpoint = folder->checkpoint_path(step);
      t.save_checkpoint(res.checkpoint.string());
      folder->prune_checkpoints(c.keep_checkpoints);
    }
    res.checkpoint_step = step;
  };
  while (!t.done() && !stop()) {
    const StepRecord r = t.train_step();
    if (folder != nullptr) folder->append_log(step_record_json(r));
    on_step(r);
    if (saving && c.checkpoint_every > 0 && r.step % c.checkpoint_every == 0) save(r.step);
  }
  res.stopped = !t.done();
  if (saving && res.checkpoint_step != t.steps_done()) save(t.steps_done());
  if (folder != nullptr && res.checkpoint.empty()) res.checkpoint = folder->checkpoint_path(res.checkpoint_step);
  return res;
}

ResumeConfig read_resume_config(const fs::path& dir) {
  ResumeConfig r;
  const fs::path cfg_path = dir / run_files::config;
  const auto checkpoints = list_checkpoints(dir);
  if (!checkpoints.empty()) {
    r.checkpoint_step = checkpoints.back().first;
    r.checkpoint = checkpoints.back().second;
  }
  std::error_code ec;
  if (fs::exists(cfg_path, ec) || checkpoints.empty()) {
    if (!fs::exists(cfg_path, ec))
      throw std::invalid_argument("resume: " + text::squote(dir.string()) + " has no config.json; expected a run "
                                  "folder written by mixprec train --out");
    std::optional<RunConfig> rc;
    try {
      rc = read_run_config(dir);
    } catch (const std::runtime_error& e) {  // unreadable: a FIFO, a device, no permission
      throw std::invalid_argument(std::string("resume: ") + e.what());
    }
    // The engine continues its own runs only: a front door's folder (a Telemetry run has no
    // checkpoint) would otherwise be "resumed" from step 0, its log and summary replaced.
    if (rc->writer != RunWriter::engine)
      throw std::invalid_argument("resume: " + text::squote(dir.string()) + " was written by " + run_writer_text(*rc) +
                                  ", not by mixprec train; --resume continues only runs that mixprec train started, "
                                  "and never writes another writer's folder (read it with mixprec report " +
                                  dir.string() + "; train into a new folder with --out)");
    r.config = rc->config;
    return r;
  }
  // config.json was lost (deleted under a live run, ...): every checkpoint holds the
  // run's configuration; the resume writes config.json again.
  r.from_checkpoint = r.checkpoint;
  r.config = apply_json(TrainConfig{}, ckpt::SafetensorsFile::open(r.checkpoint).require_metadata("mixprec.config"),
                        "the configuration in checkpoint " + text::squote(r.checkpoint.string()));
  return r;
}

void start_run(Trainer& t, RunFolder* folder, const RunPlan& p,
               const std::function<void(const fs::path&)>& removed) {
  if (p.resume && folder == nullptr) {
    if (!p.checkpoint.empty()) t.load_checkpoint(p.checkpoint.string());
  } else if (p.resume) {
    for (const fs::path& stale : folder->remove_stale_temporaries())
      if (removed) removed(stale);
    if (!p.checkpoint.empty()) t.load_checkpoint(p.checkpoint.string());
    folder->truncate_log(t.steps_done());
    folder->write_config(run_config_json(p.config));  // with the (possibly extended) steps
  } else if (folder != nullptr) {
    folder->write_config(run_config_json(p.config));
  }
}

monitor::AlertMonitor run_alerts(const RunPlan& p, const RunFolder* folder) {
  monitor::AlertMonitor alerts({}, monitor::RunContext::of(p.config));
  if (p.resume && folder != nullptr)
    for (const StepRecord& r : read_run_log((folder->dir() / run_files::log).string())) alerts.observe(r);
  return alerts;
}

std::string communication_json(dist::Communicator& comm, const TrainConfig& c, std::uint64_t steps) {
  std::uint64_t total_bytes = 0;
  for (const dist::CollectiveStats& st : comm.stats()) total_bytes += st.bytes_sent;
  ojson d = ojson::object();
  d["ranks"] = comm.size();
  d["grad_reduce"] = c.grad_reduce;
  d["steps_measured"] = steps;
  const double per = steps > 0 ? 1.0 / static_cast<double>(steps) : 0.0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  ojson kinds = ojson::object();
  for (std::size_t k = 0; k < dist::kCollectiveKinds; ++k) {
    const dist::CollectiveStats& st = comm.stats()[k];
    if (st.calls == 0) continue;
    bytes += st.bytes_sent;
    seconds += st.seconds;
    kinds[std::string(dist::collective_name(static_cast<dist::Collective>(k)))] =
        ojson{{"calls_per_step", static_cast<double>(st.calls) * per},
              {"bytes_per_step", static_cast<double>(st.bytes_sent) * per},
              {"seconds_per_step", st.seconds * per}};
  }
  d["bytes_per_step"] = static_cast<double>(bytes) * per;  // sent by rank 0
  // Every rank's bytes, summed over the ranks (the sum's own bytes are not counted).
  if (comm.size() > 1) comm.allreduce_sum(std::span<std::uint64_t>(&total_bytes, 1));
  d["all_ranks_bytes_per_step"] = steps > 0 ? static_cast<double>(total_bytes) / static_cast<double>(steps) : 0.0;
  d["seconds_per_step"] = seconds * per;  // rank 0 inside collectives
  d["collectives"] = kinds;
  return d.dump();
}

std::string run_summary_json(const TrainSummary& s, const TrainConfig& c, std::span<const monitor::Alert> alerts,
                             const std::string& distributed_json) {
  std::string summary = monitor::summary_with_alerts(summary_json(s, c), alerts);
  if (distributed_json.empty()) return summary;
  ojson doc = ojson::parse(summary);
  doc["distributed"] = ojson::parse(distributed_json);
  return doc.dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
}

}  // namespace mixprec::train
