// `mixprec train`: one training run (flags and/or a JSON config), with a run folder
// (config.json, log.jsonl, checkpoints, summary.json), resume, progress and a summary.
// `mixprec compare`: the same run under each precision / loss-scale arrangement, and a
// table of what each one did.
// This file is the command line: flags, progress, signals and printing. The run's
// lifecycle is the library's: the key table (run/config.hpp), the run folder
// (run/run_folder.hpp), and the plan, resume, communicator, loop and summary
// (train/run.hpp).
//
// Exit codes: 0 done, 1 runtime failure (data, files, training; a run folder in use by
// another process; a run that diverged, once all its files are written), 2 bad command
// line or configuration (nothing is written then), 128 + signal when interrupted.
#include "cmd_train.hpp"
#include "cmd_report.hpp"
#include "cli_app.hpp"

#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/core/json_read.hpp"
#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/distributed/communicator.hpp"
#ifdef MIXPREC_WITH_MPI
#include "mixprec/distributed/mpi.hpp"
#endif
#include "mixprec/run/alerts.hpp"
#include "mixprec/nn/data.hpp"
#include "mixprec/nn/precision.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/train/run.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::cli {
namespace {

namespace fs = std::filesystem;
using train::StepRecord;
using train::TrainConfig;
using train::Trainer;
using train::TrainSummary;
using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// Bad command line or configuration: exit 2. Everything else is a runtime failure (1).
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

using text::grouped;
using text::percent;
using text::squote;

// ---- flags: one per config key ---------------------------------------------------------

using train::ConfigKey;
using train::KeyKind;

struct Flag {
  const ConfigKey* spec;
  std::shared_ptr<std::string> value;
  CLI::Option* option;
};

// Adds --KEY for every config key (train), or every key compare does not set itself.
std::vector<Flag> add_key_flags(CLI::App* cmd, bool for_compare) {
  std::vector<Flag> flags;
  for (const ConfigKey& k : train::config_keys()) {
    if (for_compare && k.compare_sets) continue;
    const std::string key(k.name);
    auto value = std::make_shared<std::string>();
    const std::string def = train::config_key_text(TrainConfig{}, key);
    std::string help(k.help);
    if (!def.empty() && key != "resume" && key != "out" && key != "data" && k.kind != KeyKind::flag)
      help += " (default " + def + ")";
    CLI::Option* o = k.kind == KeyKind::flag ? cmd->add_flag("--" + key)->description(help)
                                             : cmd->add_option("--" + key, *value, help)->type_name(std::string(k.type));
    if (k.kind == KeyKind::boolean) o->expected(0, 1);  // --fp8-power2-scales alone means true
    flags.push_back({&k, value, o});
  }
  return flags;
}

const Flag* find_flag(const std::vector<Flag>& flags, std::string_view key) {
  for (const Flag& f : flags)
    if (f.spec->name == key) return &f;
  return nullptr;
}

// The flags actually given, as the library's run request takes them (in key-table
// order); a config file's text comes with them.
train::RunRequest run_request(const std::vector<Flag>& flags, const std::string& config_text, bool config_given,
                              const std::string& config_source) {
  train::RunRequest r;
  r.config_text = config_text;
  r.config_given = config_given;
  r.config_source = config_source;
  for (const Flag& f : flags)
    if (f.option->count() > 0)
      // --distributed, and a boolean given alone (--fp8-power2-scales): true
      r.keys.emplace_back(f.spec->name, f.spec->kind == KeyKind::flag || (f.spec->kind == KeyKind::boolean && f.value->empty())
                                            ? std::string("true")
                                            : *f.value);
  return r;
}

// ---- files ------------------------------------------------------------------------------

// A JSON file the command line names (a regular file: a FIFO or a device is refused, not
// waited on): one it cannot read is a usage error.
std::string read_text(const fs::path& p, const std::string& what) {
  try {
    return io::read_json_text(p);
  } catch (const std::runtime_error& e) {
    throw UsageError(what + ": " + e.what());
  }
}

void check_parent_exists(const std::string& path, const std::string& key) {
  const fs::path parent = fs::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty() && !fs::is_directory(parent, ec))
    throw UsageError(key + ": folder " + squote(parent.string()) + " does not exist");
}

// --json FILE: the file, checked before anything runs ("" when not given).
std::string json_output(const CLI::Option* option, const std::string& file) {
  if (option->count() == 0) return {};
  if (file.empty()) throw UsageError("json: expected a file name, found ''");
  check_parent_exists(file, "json");
  if (const std::string problem = io::output_file_problem(file); !problem.empty()) throw UsageError("json: " + problem);
  return file;
}

// --json must not land on what the run reads or writes: its run folder's files, the data
// file, the config file (train::check_output_not_input; a usage error, nothing written).
void check_json_not_input(const std::string& json, const std::vector<fs::path>& run_dirs, const std::string& data,
                          const std::string& config_file) {
  if (json.empty()) return;
  std::vector<fs::path> files;
  if (!data.empty()) files.emplace_back(data);
  if (!config_file.empty()) files.emplace_back(config_file);
  try {
    train::check_output_not_input(json, "json", run_dirs, files);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

// ---- signals ------------------------------------------------------------------------------

volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_stop_signal(int sig) { g_signal = sig; }

// SIGINT / SIGTERM set a flag; the loop stops after the current step. A second signal
// takes the default action (SA_RESETHAND).
class StopSignals {
 public:
  StopSignals() {
    g_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

// ---- progress -------------------------------------------------------------------------------

std::string duration_text(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<std::uint64_t>(std::llround(s));
  if (t < 60) return fmt::format("{}s", t);
  if (t < 3600) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}h{:02}m", t / 3600, t % 3600 / 60);
}

std::string loss_text(double v) { return std::isfinite(v) ? fmt::format("{:.4g}", v) : fmt::format("{}", v); }

// On a terminal: one line redrawn with '\r' at most ten times a second. Otherwise (a
// file, a pipe): plain lines every max(1, steps/20) steps, on every skipped step and
// on every evaluation; `lines` = false prints none (compare prints one per run).
class Progress {
 public:
  Progress(std::string label, std::uint64_t total, std::uint64_t skipped_before, bool lines)
      : label_(std::move(label)),
        total_(total),
        every_(std::max<std::uint64_t>(1, total / 20)),
        skipped_(skipped_before),
        tty_(::isatty(STDERR_FILENO) == 1),
        lines_(lines),
        start_(Clock::now()) {}

  void step(const StepRecord& r) {
    ++steps_;
    tokens_ += r.tokens;
    seconds_ += r.seconds;
    if (r.skipped) ++skipped_;
    last_ = r;
    if (r.val_loss) val_ = r.val_loss;
    if (tty_) {
      // Skipped steps and evaluations stay on screen, above the redrawn line.
      const bool note = r.skipped || r.val_loss;
      if (note) std::fputs(("\r" + plain_line(r) + "\x1b[K\n").c_str(), stderr);
      const auto now = Clock::now();
      if (!note && drawn_ && now - last_draw_ < std::chrono::milliseconds(100) && r.step != total_) return;
      last_draw_ = now;
      drawn_ = true;
      std::fputs(("\r" + bar_line() + "\x1b[K").c_str(), stderr);
      std::fflush(stderr);
    } else if (lines_ && (r.step % every_ == 0 || r.skipped || r.val_loss || r.step == total_)) {
      std::fputs((plain_line(r) + "\n").c_str(), stderr);
      std::fflush(stderr);
    }
  }

  // Ends the redrawn line on a terminal (its last state stays visible).
  void finish() {
    if (tty_ && drawn_) {
      std::fputs(("\r" + bar_line() + "\x1b[K\n").c_str(), stderr);
      std::fflush(stderr);
    }
    drawn_ = false;
  }

  std::uint64_t steps() const noexcept { return steps_; }
  // Ranks other than 0 print nothing.
  void silence() noexcept {
    tty_ = false;
    lines_ = false;
  }

 private:
  std::string prefix() const { return label_.empty() ? "" : label_ + ": "; }
  double tokens_per_second() const { return seconds_ > 0 ? static_cast<double>(tokens_) / seconds_ : 0; }
  double eta() const {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    return steps_ == 0 ? 0 : elapsed / static_cast<double>(steps_) * static_cast<double>(total_ - last_.step);
  }

  std::string plain_line(const StepRecord& r) const {
    std::string s = fmt::format("{}step {}/{} loss {}", prefix(), r.step, total_, loss_text(r.loss));
    if (r.val_loss) s += " val " + loss_text(*r.val_loss);
    s += fmt::format(" scale {} skipped {} tok/s {:.0f} eta {}", r.next_scale, skipped_, tokens_per_second(),
                     duration_text(eta()));
    if (r.skipped) {
      s += " (skipped: ";
      if (r.injected) s += "injected, ";
      switch (r.skip_reason) {
        case SkipReason::loss_spike: s += fmt::format("loss spike, z {:.2f}", r.loss_z); break;
        case SkipReason::grad_spike: s += fmt::format("gradient-norm spike, z {:.2f}", r.grad_z); break;
        case SkipReason::nonfinite_loss: s += "non-finite loss"; break;
        case SkipReason::user: s += "the guard's predicate"; break;
        default:
          s += "overflow";
          if (!r.overflow_param.empty()) s += " in " + r.overflow_param;
          break;
      }
      if (!r.loss_finite) s += ", forward pass non-finite at " + r.forward_nonfinite;
      s += ")";
    }
    return s;
  }

  std::string bar_line() const {
    constexpr int kWidth = 24;
    const double f = total_ == 0 ? 1.0 : static_cast<double>(last_.step) / static_cast<double>(total_);
    const int fill = static_cast<int>(f * kWidth);
    std::string bar(static_cast<std::size_t>(fill), '#');
    bar.resize(kWidth, '.');
    std::string s = fmt::format("{}step {}/{} [{}] loss {}", prefix(), last_.step, total_, bar, loss_text(last_.loss));
    if (val_) s += " val " + loss_text(*val_);
    s += fmt::format(" | {:.0f} tok/s | scale {} | skipped {} | eta {}", tokens_per_second(), last_.next_scale,
                     skipped_, duration_text(eta()));
    return s;
  }

  std::string label_;
  std::uint64_t total_, every_, skipped_;
  bool tty_, lines_;
  Clock::time_point start_, last_draw_{};
  bool drawn_ = false;
  std::uint64_t steps_ = 0, tokens_ = 0;
  double seconds_ = 0;
  StepRecord last_;
  std::optional<double> val_;
};

// ---- one run ----------------------------------------------------------------------------------

struct RunResult {
  bool interrupted = false;
  int signal = 0;
  std::uint64_t checkpoint_step = 0;  // newest checkpoint written (0: none)
  fs::path checkpoint;
};

// A newly raised alert, on its own lines of stderr (over the redrawn progress line on a
// terminal); `label` names the compare arrangement.
void print_alert(const monitor::Alert& a, const std::string& label) {
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  std::string text = tty ? std::string("\r") : std::string();
  if (!label.empty()) text.append(label).append(": ");
  text.append(monitor::alert_text(a));
  text.push_back('\n');
  if (tty)  // clear what is left of the progress line after the first line
    text.insert(text.find('\n'), "\x1b[K");
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
}

// Trains until done or a stop signal (train::run_steps: the log, the checkpoints), with
// progress; every step goes through `alerts` (when set), new alerts are printed at once.
RunResult run_loop(Trainer& t, train::RunFolder* folder, Progress& progress, std::uint64_t checkpointed,
                   monitor::AlertMonitor* alerts = nullptr, const std::string& label = "") {
  // Distributed: the ranks agree on stopping (a signal may reach only some of them).
  auto stop_requested = [&t] { return train::ranks_stop(t.communicator(), g_signal != 0); };
  const train::RunSteps steps = train::run_steps(t, folder, checkpointed, stop_requested, [&](const StepRecord& r) {
    progress.step(r);
    if (alerts != nullptr)
      for (const monitor::Alert& a : alerts->observe(r)) print_alert(a, label);
  });
  progress.finish();
  RunResult res;
  res.checkpoint_step = steps.checkpoint_step;
  res.checkpoint = steps.checkpoint;
  // A signal that arrives during the last step stops the run too (it is reported, and
  // the run ends as stopped runs do: a checkpoint, no summary; a resume finishes it).
  res.interrupted = steps.stopped || g_signal != 0;
  res.signal = res.interrupted && g_signal == 0 ? SIGTERM : g_signal;  // stopped because another rank was signalled
  return res;
}

std::string mib(std::size_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / 1048576.0); }

// The shared setup of a comparison, one line.
std::string config_line(const TrainConfig& c) {
  std::string model = c.model.kind == nn::ModelKind::gpt
                          ? fmt::format("gpt ({} layers, {} heads, {} channels)", c.model.layers, c.model.heads,
                                        c.model.channels)
                          : fmt::format("mlp (depth {}, hidden {}, {} channels)", c.model.depth, c.model.hidden,
                                        c.model.channels);
  return fmt::format("{}, context {}, batch {} x accum {}, {} steps, {} lr {}, seed {}, data {}", model,
                     c.model.context, c.model.batch, c.accum, c.steps, c.optimizer, c.lr, c.seed,
                     c.data.empty() ? fmt::format("embedded corpus ({} tokens, {})", c.corpus_tokens, c.vocab)
                                    : fmt::format("{} ({})", c.data, c.vocab));
}

std::string precision_text(nn::Precision p) {
  const nn::PrecisionPolicy pol = nn::policy_of(p);
  return fmt::format("{} (activations {}, weights {}, weight gradients {}{}{})", nn::precision_name(p),
                     dtype_name(pol.activations), dtype_name(pol.weights), dtype_name(pol.weight_grads),
                     pol.master ? ", fp32 master weights" : "",
                     nn::is_fp8(p) ? "; fp8 GEMM operands in the block Linears" : "");
}

void print_alerts_summary(const std::vector<monitor::Alert>& alerts) {
  if (alerts.empty()) {
    fmt::print("alerts: none\n");
    return;
  }
  fmt::print("alerts: {}\n", alerts.size());
  for (const monitor::Alert& a : alerts)
    fmt::print("  {} from step {} (held on {} steps, last {}): {}\n    try: {}\n", a.id, a.step, a.steps, a.last_step,
               a.message, a.advice);
}

void print_summary(Trainer& t, const TrainSummary& s, const TrainConfig& c, const fs::path& dir,
                   const std::string& json_path, const std::vector<monitor::Alert>& alerts) {
  const nn::Dataset& d = t.data();
  std::string reasons;  // the skips by reason (docs/spike_guards.md)
  for (std::size_t i = 1; i < kSkipReasons; ++i)
    if (s.skipped_by[i] > 0)
      reasons += fmt::format("{}{} {}", reasons.empty() ? ": " : ", ", s.skipped_by[i],
                             skip_reason_name(static_cast<SkipReason>(i)));
  fmt::print("mixprec train: {} steps ({} applied, {} skipped{})\n", s.steps, s.applied, s.skipped, reasons);
  if (s.val_loss_ema) fmt::print("ema: validation loss of the EMA weights (decay {}) {}\n", c.ema, loss_text(*s.val_loss_ema));
  fmt::print("model: {}\n", t.model().describe());
  fmt::print("data: {}; {} training and {} validation tokens, vocab {}\n", d.source(), grouped(d.train().size()),
             grouped(d.validation().size()), d.vocab().size());
  fmt::print("precision: {}\n", precision_text(c.precision));
  fmt::print("loss scale: {}, final scale {}\n", c.loss_scale, s.final_scale);
  fmt::print("loss: train {} (last step), validation {}\n", loss_text(s.final_loss),
             s.val_loss ? loss_text(*s.val_loss) : std::string("-"));
  fmt::print("activation gradients: {} of nonzero values flushed to zero, {} subnormal\n",
             percent(s.underflow_fraction), percent(s.subnormal_fraction));
  if (nn::is_fp8(c.precision))
    fmt::print("fp8 Linear operands: forward {} saturated, {} flushed; output gradients {} saturated, {} flushed "
               "(of nonzero values)\n",
               percent(s.fp8_forward_saturated_fraction), percent(s.fp8_forward_flushed_fraction),
               percent(s.fp8_backward_saturated_fraction), percent(s.fp8_backward_flushed_fraction));
  fmt::print("lost updates: {} of the parameters meant to move (mean over applied steps)\n",
             percent(s.lost_update_fraction));
  fmt::print("time: {:.1f} s training, {:.1f} ms/step mean, {:.1f} ms median, {:.0f} tokens/s\n", s.seconds,
             s.mean_step_ms, s.median_step_ms, s.seconds > 0 ? static_cast<double>(s.tokens) / s.seconds : 0.0);
  // fp8 presets: the activations in the arena (bf16, fp32 statistics) and the Linear
  // inputs saved as fp8 codes + scales, apart.
  const std::string acts = s.memory.fp8_activation_bytes == 0
                               ? mib(s.memory.activation_bytes)
                               : fmt::format("{} ({} bf16/fp32 + {} fp8 codes and scales)",
                                             mib(s.memory.activation_bytes),
                                             mib(s.memory.activation_bytes - s.memory.fp8_activation_bytes),
                                             mib(s.memory.fp8_activation_bytes));
  fmt::print("memory: parameters + optimizer state {}, activations {}, activation gradients {}, scratch {}\n",
             mib(s.memory.parameter_bytes), acts, mib(s.memory.gradient_bytes), mib(s.memory.scratch_bytes));
  if (!dir.empty()) {
    fmt::print("run folder: {}\n", dir.string());
    fmt::print("summary: {}\n", (dir / train::run_files::summary).string());
  }
  if (!json_path.empty()) fmt::print("json summary: {}\n", json_path);
  print_alerts_summary(alerts);
}

int fail_usage(std::string_view cmd, const std::string& msg) {
  fmt::print(stderr, "mixprec {}: error: {}\n", cmd, msg);
  return 2;
}

int fail_runtime(std::string_view cmd, const std::string& msg) {
  fmt::print(stderr, "mixprec {}: error: {}\n", cmd, msg);
  return 1;
}

// Builds the Trainer: invalid_argument (configuration) is a usage error, the rest
// (data files, ...) runtime failures.
std::unique_ptr<Trainer> make_trainer(const TrainConfig& c, dist::Communicator* comm = nullptr) {
  try {
    if (comm != nullptr) return std::make_unique<Trainer>(c, *comm);
    return std::make_unique<Trainer>(c);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

// ---- mixprec train ----------------------------------------------------------------------------

struct TrainInputs {
  std::vector<Flag> flags;
  std::shared_ptr<std::string> config_file, json_file;
  CLI::Option* config_opt = nullptr;
  CLI::Option* json_opt = nullptr;
};

// What the Trainer runs and where (train::plan_run), and the --json file.
struct TrainPlan : train::RunPlan {
  std::string json_path;
};

TrainPlan plan_train(const TrainInputs& in) {
  TrainPlan p;
  std::string config_text;
  if (in.config_opt->count() > 0) config_text = read_text(*in.config_file, "config");
  const std::string config_source = "config file " + squote(*in.config_file);
  p.json_path = json_output(in.json_opt, *in.json_file);
  const train::RunRequest request = run_request(in.flags, config_text, in.config_opt->count() > 0, config_source);
  static_cast<train::RunPlan&>(p) = train::plan_run(request, [](const std::string& note) {
    fmt::print(stderr, "mixprec train: {}\n", note);
  });
  check_json_not_input(p.json_path, p.dir.empty() ? std::vector<fs::path>{} : std::vector<fs::path>{p.dir},
                       p.config.data, in.config_opt->count() > 0 ? *in.config_file : std::string());
  return p;
}

// MPI, when this build has it (train::make_communicator decides whether to use it).
train::MpiConnect mpi_connect() {
#ifdef MIXPREC_WITH_MPI
  return [](double timeout) -> std::unique_ptr<dist::Communicator> {
    if (!dist::MpiCommunicator::launched_by_mpi()) return nullptr;
    return std::make_unique<dist::MpiCommunicator>(timeout);
  };
#else
  return nullptr;
#endif
}

// summary.json's "distributed" object (train::communication_json), one line per collective.
void print_comm(const ojson& d) {
  fmt::print("distributed: {} ranks, grad-reduce {}: {:.0f} bytes/step sent by rank 0 ({:.0f} by all ranks), "
             "{:.3f} ms/step in collectives\n",
             d["ranks"].get<int>(), d["grad_reduce"].get<std::string>(), d["bytes_per_step"].get<double>(),
             d["all_ranks_bytes_per_step"].get<double>(), d["seconds_per_step"].get<double>() * 1e3);
  for (const auto& [name, k] : d["collectives"].items())
    fmt::print("  {:<18} {:>6.2f} calls {:>12.0f} bytes {:>9.3f} ms per step\n", name, k["calls_per_step"].get<double>(),
               k["bytes_per_step"].get<double>(), k["seconds_per_step"].get<double>() * 1e3);
}

int run_train(const TrainInputs& in) {
  constexpr std::string_view cmd = "train";
  TrainPlan p;
  std::unique_ptr<dist::Communicator> comm;  // outlives the Trainer
  std::unique_ptr<Trainer> t;
  std::unique_ptr<train::RunFolder> folder;  // rank 0 with --out; holds the folder's lock until the run ends
  try {
    p = plan_train(in);
    comm = train::make_communicator(p.config, mpi_connect());
    train::check_ranks(p.config, *comm);
    if (p.config.distributed && comm->size() == 1)
      fmt::print(stderr, "mixprec train: --distributed on 1 rank (not launched by mpirun -np N)\n");
    t = make_trainer(p.config, comm.get());
    // The run folder stores the data file by its absolute path (messages about the
    // file, from make_trainer, name it as it was given).
    p.config.data = train::stored_data_path(p.config.data);
    if (comm->rank() == 0 && !p.dir.empty())
      folder = std::make_unique<train::RunFolder>(p.dir, p.resume ? train::RunFolder::Mode::resume
                                                                  : train::RunFolder::Mode::create);
  } catch (const dist::TimeoutError& e) {
    fmt::print(stderr, "mixprec {}: error: rank {}: {}; aborting the job\n", cmd, comm->rank(), e.what());
    comm->abort(1);
    return 1;  // not reached
  } catch (const std::invalid_argument& e) {
    return fail_usage(cmd, e.what());
  } catch (const std::exception& e) {
    return fail_runtime(cmd, e.what());
  }
  const bool root = comm->rank() == 0;
  if (!root) {  // ranks other than 0 write nothing: no run folder, log, summary or json
    p.dir.clear();
    p.json_path.clear();
  }

  try {
    train::start_run(*t, folder.get(), p, [](const fs::path& stale) {
      fmt::print(stderr, "mixprec train: removed {}, left by an interrupted write\n", stale.string());
    });
    if (p.resume && root)
      fmt::print(stderr, "mixprec train: resuming {} at step {} of {}\n", p.dir.string(), t->steps_done(),
                 p.config.steps);
    // Alerts (docs/alerts.md): a resumed run replays its logged steps first, silently.
    monitor::AlertMonitor alerts = train::run_alerts(p, folder.get());

    const StopSignals signals;
    Progress progress("", p.config.steps, t->summary().skipped, true);
    if (!root) progress.silence();
    comm->reset_stats();  // per step: the training loop's collectives only
    const std::uint64_t steps_before = t->steps_done();
    const RunResult res = run_loop(*t, folder.get(), progress, p.resume ? t->steps_done() : 0,
                                   root ? &alerts : nullptr);
    const std::string dist_doc = train::communication_json(*comm, p.config, t->steps_done() - steps_before);
    if (!root) return res.interrupted ? 128 + res.signal : 0;
    if (res.interrupted) {
      const char* name = res.signal == SIGTERM ? "SIGTERM" : "SIGINT";
      fmt::print(stderr, "mixprec train: {}: stopped after step {} of {}\n", name, t->steps_done(), p.config.steps);
      if (!p.dir.empty())
        fmt::print(stderr, "checkpoint: {}\ncontinue with: mixprec train --resume {}\n", res.checkpoint.string(),
                   p.dir.string());
      return 128 + res.signal;
    }
    const TrainSummary s = t->summary();
    const std::string summary =
        train::run_summary_json(s, p.config, alerts.all(), p.config.distributed ? dist_doc : std::string());
    if (folder != nullptr) folder->write_summary(summary);
    if (!p.json_path.empty()) io::write_file_atomic(p.json_path, summary);
    print_summary(*t, s, p.config, p.dir, p.json_path, alerts.all());
    if (p.config.distributed) print_comm(ojson::parse(dist_doc));
    errno = 0;
    if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0)
      return fail_runtime(cmd, std::string("cannot write the summary to stdout: ") +
                                   (errno != 0 ? std::strerror(errno) : "write error") +
                                   (p.dir.empty() ? std::string() : "; it is in " + (p.dir / "summary.json").string()));
    // A run whose loss became NaN or inf trained to the end but learnt nothing more:
    // its files are all written (and load), the exit code says it failed.
    if (!std::isfinite(s.final_loss) && !(s.val_loss && std::isfinite(*s.val_loss)))
      return fail_runtime(cmd, fmt::format("the run diverged: the training loss of the last step ({}) is {} and the "
                                           "validation loss is {}; lower --lr, or clip gradients with --clip",
                                           s.steps, loss_text(s.final_loss),
                                           s.val_loss ? loss_text(*s.val_loss) : std::string("not measured")));
    return 0;
  } catch (const dist::TimeoutError& e) {
    fmt::print(stderr, "mixprec {}: error: rank {}: {}; aborting the job\n", cmd, comm->rank(), e.what());
    comm->abort(1);
    return 1;  // not reached
  } catch (const std::exception& e) {
    if (comm->size() > 1) {  // the other ranks would wait for this one until their deadline
      fmt::print(stderr, "mixprec {}: error: rank {}: {}; aborting the job\n", cmd, comm->rank(), e.what());
      comm->abort(1);
    }
    return fail_runtime(cmd, e.what());
  }
}

// ---- mixprec compare ----------------------------------------------------------------------------

struct Arrangement {
  std::string name;
  nn::Precision precision;
  std::string loss_scale;  // "static:" gets the --static-scale value
};

const std::vector<Arrangement>& arrangements() {
  static const std::vector<Arrangement> rows = [] {
    std::vector<Arrangement> r = {
        {"fp32", nn::Precision::fp32, "none"},
        {"fp16-noscale", nn::Precision::fp16, "none"},
        {"fp16-static", nn::Precision::fp16, "static:"},
        {"fp16-dynamic", nn::Precision::fp16, "dynamic"},
        {"bf16", nn::Precision::bf16, "none"},
        {"fp16-pure", nn::Precision::fp16_pure, "dynamic"},
    };
    // --fp8: every preset with quantized GEMMs, in the precision table's order (bf16 with
    // low-precision Linear layers, docs/fp8.md); per-tensor or block scaling, no loss scaling.
    for (const nn::Precision p : nn::all_precisions())
      if (nn::is_fp8(p)) r.push_back({std::string(nn::precision_name(p)), p, "none"});
    return r;
  }();
  return rows;
}

struct CompareInputs {
  std::vector<Flag> flags;
  std::shared_ptr<std::string> config_file, json_file, out, static_scale, only;
  std::shared_ptr<bool> quick, fp8;
  CLI::Option* config_opt = nullptr;
  CLI::Option* json_opt = nullptr;
  CLI::Option* only_opt = nullptr;
};

struct CompareRow {
  std::string name;
  TrainConfig config;
  std::optional<TrainSummary> summary;
  std::string error;
  std::vector<monitor::Alert> alerts;  // raised during the run (docs/alerts.md)
};

struct ComparePlan {
  TrainConfig base;
  std::vector<CompareRow> rows;
  fs::path out;
  std::string json_path;
};

ComparePlan plan_compare(const CompareInputs& in) {
  ComparePlan p;
  TrainConfig c;
  std::string config_text;
  if (in.config_opt->count() > 0) {
    config_text = read_text(*in.config_file, "config");
    c = train::apply_json(c, config_text, "config file " + squote(*in.config_file));
  }
  const train::RunRequest request = run_request(in.flags, config_text, in.config_opt->count() > 0, "");
  c = train::apply_keys(c, request);
  c.out.clear();
  c.resume.clear();
  c.checkpoint_every = 0;
  c.keep_checkpoints = 1;
  if (*in.quick) {
    c.steps = std::min<std::size_t>(c.steps, std::max<std::size_t>(20, c.steps / 3));
    c.warmup = std::min(c.warmup, c.steps);
  }
  train::fit_default_warmup(c, request);
  // fp8 options go to the fp8 rows only (each row keeps those its recipe uses).
  for (const std::string& key : train::fp8_keys()) {
    const Flag* f = find_flag(in.flags, key);
    if (!*in.fp8 && f != nullptr && f->option->count() > 0)
      throw UsageError(key + ": applies to the fp8 rows only; add --fp8");
  }
  train::validate(train::with_fp8_options_for(c, c.precision));
  p.base = c;

  try {  // the static rows' loss-scale is static:<this text>
    (void)keys::parse_text(keys::Spec{.name = "static-scale", .kind = keys::Kind::number, .lo = 0, .lo_open = true},
                           *in.static_scale);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }

  std::vector<std::string> wanted;
  if (in.only_opt->count() > 0) {
    std::string names;
    for (const Arrangement& a : arrangements()) names += (names.empty() ? "" : ", ") + a.name;
    const std::string& text = *in.only;
    for (std::size_t start = 0; start <= text.size();) {
      const std::size_t comma = std::min(text.find(',', start), text.size());
      const std::string name = text.substr(start, comma - start);
      start = comma + 1;
      const auto known = std::find_if(arrangements().begin(), arrangements().end(),
                                      [&](const Arrangement& a) { return a.name == name; });
      if (known == arrangements().end())
        throw UsageError("only: expected names from " + names + ", found " + squote(name));
      if (nn::is_fp8(known->precision) && !*in.fp8)
        throw UsageError("only: " + squote(name) + " is an fp8 row; add --fp8");
      if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) wanted.push_back(name);
    }
  }

  p.out = *in.out;
  if (p.out.empty()) throw UsageError("out: expected a folder, found ''");
  for (const Arrangement& a : arrangements()) {
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), a.name) == wanted.end()) continue;
    if (nn::is_fp8(a.precision) && !*in.fp8) continue;
    CompareRow row;
    row.name = a.name;
    row.config = train::with_fp8_options_for(c, a.precision);
    row.config.precision = a.precision;
    row.config.loss_scale = a.loss_scale == "static:" ? "static:" + *in.static_scale : a.loss_scale;
    row.config.out = (p.out / a.name).string();
    try {
      train::validate(row.config);
    } catch (const std::invalid_argument& e) {
      throw UsageError(a.name + ": " + e.what());
    }
    if (train::run_folder_has_files(row.config.out, "out"))
      throw UsageError("out: " + squote(row.config.out) + " exists and is not empty; choose another --out or remove "
                       "it");
    p.rows.push_back(std::move(row));
  }
  p.json_path = json_output(in.json_opt, *in.json_file);
  std::vector<fs::path> dirs;
  for (const CompareRow& row : p.rows) dirs.emplace_back(row.config.out);
  check_json_not_input(p.json_path, dirs, c.data, in.config_opt->count() > 0 ? *in.config_file : std::string());
  return p;
}

ojson number_or_null(double v) { return std::isfinite(v) ? ojson(v) : ojson(nullptr); }

std::optional<double> fp32_val(const std::vector<CompareRow>& rows) {
  for (const CompareRow& r : rows)
    if (r.name == "fp32" && r.summary && r.summary->val_loss && std::isfinite(*r.summary->val_loss))
      return r.summary->val_loss;
  return std::nullopt;
}

std::optional<double> gap_to_fp32(const CompareRow& r, std::optional<double> base) {
  if (!base || !r.summary || !r.summary->val_loss || !std::isfinite(*r.summary->val_loss)) return std::nullopt;
  return (*r.summary->val_loss - *base) / *base;
}

std::string compare_json(const ComparePlan& p) {
  const std::optional<double> base = fp32_val(p.rows);
  ojson runs = ojson::array();
  for (const CompareRow& r : p.rows) {
    ojson o = ojson::object();
    o["name"] = r.name;
    const TrainSummary* s = r.summary ? &*r.summary : nullptr;
    o["val_loss"] = s && s->val_loss ? number_or_null(*s->val_loss) : ojson(nullptr);
    o["skipped_steps"] = s ? ojson(s->skipped) : ojson(nullptr);
    o["final_scale"] = s ? number_or_null(static_cast<double>(s->final_scale)) : ojson(nullptr);
    o["underflow_fraction"] = s ? number_or_null(s->underflow_fraction) : ojson(nullptr);
    o["subnormal_fraction"] = s ? number_or_null(s->subnormal_fraction) : ojson(nullptr);
    o["lost_update_fraction"] = s ? number_or_null(s->lost_update_fraction) : ojson(nullptr);
    o["step_ms"] = s ? number_or_null(s->mean_step_ms) : ojson(nullptr);
    if (nn::is_fp8(r.config.precision)) {  // of the nonzero values quantized to fp8, whole run
      o["fp8_forward_saturated_fraction"] = s ? number_or_null(s->fp8_forward_saturated_fraction) : ojson(nullptr);
      o["fp8_forward_flushed_fraction"] = s ? number_or_null(s->fp8_forward_flushed_fraction) : ojson(nullptr);
      o["fp8_backward_saturated_fraction"] = s ? number_or_null(s->fp8_backward_saturated_fraction) : ojson(nullptr);
      o["fp8_backward_flushed_fraction"] = s ? number_or_null(s->fp8_backward_flushed_fraction) : ojson(nullptr);
    }
    const auto gap = gap_to_fp32(r, base);
    o["gap_to_fp32"] = gap ? number_or_null(*gap) : ojson(nullptr);
    if (!r.error.empty()) o["error"] = r.error;
    o["alerts"] = ojson::parse(monitor::alerts_json(r.alerts));
    runs.push_back(std::move(o));
  }
  ojson doc = ojson::object();
  doc["runs"] = std::move(runs);
  doc["config"] = ojson::parse(train::to_json(p.base));
  return doc.dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
}

void print_compare_table(const ComparePlan& p) {
  const std::optional<double> base = fp32_val(p.rows);
  const bool fp8 = std::any_of(p.rows.begin(), p.rows.end(), [](const CompareRow& r) {
    return nn::is_fp8(r.config.precision);
  });
  fmt::print("{:<13} {:>9} {:>8} {:>7} {:>11} {:>10} {:>10} {:>9} {:>8}", "run", "val loss", "vs fp32", "skipped",
             "final scale", "underflow", "subnormal", "lost upd", "step ms");
  // fp8 rows: of the nonzero values quantized to fp8, saturated and flushed, forward / backward tensors.
  if (fp8) fmt::print(" {:>17} {:>17}", "fp8 sat fwd/bwd", "fp8 flush fwd/bwd");
  fmt::print("\n");
  for (const CompareRow& r : p.rows) {
    if (!r.summary) {
      fmt::print("{:<13} failed: {}\n", r.name, r.error);
      continue;
    }
    const TrainSummary& s = *r.summary;
    const auto gap = gap_to_fp32(r, base);
    fmt::print("{:<13} {:>9} {:>8} {:>7} {:>11} {:>10} {:>10} {:>9} {:>8.1f}", r.name,
               s.val_loss ? loss_text(*s.val_loss) : std::string("-"),
               gap ? fmt::format("{:+.2f}%", *gap * 100) : std::string("-"), s.skipped, s.final_scale,
               percent(s.underflow_fraction), percent(s.subnormal_fraction), percent(s.lost_update_fraction),
               s.mean_step_ms);
    if (fp8 && nn::is_fp8(r.config.precision)) {
      fmt::print(" {:>17} {:>17}",
                 percent(s.fp8_forward_saturated_fraction) + "/" + percent(s.fp8_backward_saturated_fraction),
                 percent(s.fp8_forward_flushed_fraction) + "/" + percent(s.fp8_backward_flushed_fraction));
    }
    fmt::print("\n");
  }
}

int run_compare(const CompareInputs& in) {
  constexpr std::string_view cmd = "compare";
  ComparePlan p;
  try {
    p = plan_compare(in);
  } catch (const std::invalid_argument& e) {
    return fail_usage(cmd, e.what());
  } catch (const std::exception& e) {
    return fail_runtime(cmd, e.what());
  }
  try {
    fmt::print(stderr, "mixprec compare: {} runs of {} steps each, into {}\n", p.rows.size(), p.base.steps,
               p.out.string());
    const StopSignals signals;
    int stopped = 0;
    for (std::size_t i = 0; i < p.rows.size(); ++i) {
      CompareRow& row = p.rows[i];
      // Not-yet-working setups (a data file, the configuration) stop the comparison;
      // what happens during training (a collapsed scale, ...) is a result of the row.
      std::unique_ptr<Trainer> t;
      try {
        t = make_trainer(row.config);
      } catch (const UsageError& e) {
        return fail_usage(cmd, row.name + ": " + e.what());
      }
      train::RunFolder folder(row.config.out, train::RunFolder::Mode::create);
      folder.write_config(train::run_config_json(row.config));
      Progress progress(row.name, row.config.steps, 0, false);
      const auto t0 = Clock::now();
      monitor::AlertMonitor alerts({}, monitor::RunContext::of(row.config));
      try {
        const RunResult res = run_loop(*t, &folder, progress, 0, &alerts, row.name);
        row.alerts = alerts.all();
        if (res.interrupted) {
          stopped = res.signal;
          row.error = fmt::format("interrupted after step {}", t->steps_done());
        } else {
          row.summary = t->summary();
          folder.write_summary(train::run_summary_json(*row.summary, row.config, row.alerts));
        }
      } catch (const std::exception& e) {
        progress.finish();
        row.error = e.what();
        row.alerts = alerts.all();
      }
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      if (row.summary) {
        const TrainSummary& s = *row.summary;
        fmt::print(stderr, "[{}/{}] {}: {} steps in {:.1f} s, val {}, skipped {}, final scale {}\n", i + 1,
                   p.rows.size(), row.name, s.steps, secs, s.val_loss ? loss_text(*s.val_loss) : std::string("-"),
                   s.skipped, s.final_scale);
      } else {
        fmt::print(stderr, "[{}/{}] {}: failed after {:.1f} s: {}\n", i + 1, p.rows.size(), row.name, secs, row.error);
      }
      if (stopped != 0) break;
    }
    const std::string doc = compare_json(p);
    io::write_file_atomic(p.out / "compare.json", doc);
    if (!p.json_path.empty()) io::write_file_atomic(p.json_path, doc);
    std::vector<std::string> report_dirs;  // the report of every run that has a log (docs/report.md)
    for (const CompareRow& r : p.rows) report_dirs.push_back(r.config.out);
    const std::string report = write_compare_report(report_dirs, p.out.string());
    fmt::print("mixprec compare: {}\n\n", config_line(p.base));
    print_compare_table(p);
    fmt::print("\nalerts:");
    bool any_alert = false;
    for (const CompareRow& r : p.rows)
      for (const monitor::Alert& a : r.alerts) {
        fmt::print("\n  {}: {} from step {} (held on {} steps)", r.name, a.id, a.step, a.steps);
        any_alert = true;
      }
    fmt::print("{}\n", any_alert ? "" : " none");
    fmt::print("\nruns: {}\ncompare.json: {}\nreport: {}\n", p.out.string(), (p.out / "compare.json").string(), report);
    if (stopped != 0) {
      fmt::print(stderr, "mixprec compare: {}: stopped\n", stopped == SIGTERM ? "SIGTERM" : "SIGINT");
      return 128 + stopped;
    }
    return 0;
  } catch (const std::exception& e) {
    return fail_runtime(cmd, e.what());
  }
}

}  // namespace

void add_train_commands(CLI::App& app, std::function<int()>& action) {
  // mixprec train
  auto* train_cmd = app.add_subcommand("train", "Train a model: flags or a JSON config, run folder, resume, summary");
  auto ti = std::make_shared<TrainInputs>();
  ti->flags = add_key_flags(train_cmd, false);
  ti->config_file = std::make_shared<std::string>();
  ti->json_file = std::make_shared<std::string>();
  ti->config_opt = train_cmd->add_option("--config", *ti->config_file,
                                         "JSON config (keys = flag names without dashes), applied first; flags given "
                                         "override it")
                       ->type_name("FILE");
  ti->json_opt =
      train_cmd->add_option("--json", *ti->json_file, "Also write the summary as JSON to FILE")->type_name("FILE");
  train_cmd->callback([ti, &action] { action = [ti] { return run_train(*ti); }; });

  // mixprec compare
  auto* cmp = app.add_subcommand(
      "compare", "Train the same model under fp32, fp16 (no / static / dynamic scaling), bf16 and fp16-pure");
  auto ci = std::make_shared<CompareInputs>();
  ci->flags = add_key_flags(cmp, true);
  ci->config_file = std::make_shared<std::string>();
  ci->json_file = std::make_shared<std::string>();
  ci->out = std::make_shared<std::string>("compare-runs");
  ci->static_scale = std::make_shared<std::string>("1024");
  ci->only = std::make_shared<std::string>();
  ci->quick = std::make_shared<bool>(false);
  ci->fp8 = std::make_shared<bool>(false);
  ci->config_opt = cmp->add_option("--config", *ci->config_file,
                                   "JSON config applied first (precision, loss-scale and out are set per run)")
                       ->type_name("FILE");
  ci->json_opt = cmp->add_option("--json", *ci->json_file, "Also write compare.json to FILE")->type_name("FILE");
  cmp->add_option("--out", *ci->out, "Folder of the runs (one sub-folder each) and compare.json (default compare-runs)")
      ->type_name("DIR");
  cmp->add_option("--static-scale", *ci->static_scale, "Loss scale S of the fp16-static run (default 1024)")
      ->type_name("S");
  std::string names, fp8_names;
  for (const Arrangement& a : arrangements()) {
    names += (names.empty() ? "" : ",") + a.name;
    if (nn::is_fp8(a.precision)) fp8_names += (fp8_names.empty() ? "" : ", ") + a.name;
  }
  ci->only_opt = cmp->add_option("--only", *ci->only, "Run only these, comma-separated: " + names)->type_name("LIST");
  cmp->add_flag("--quick", *ci->quick, "Fewer steps: steps/3, at least 20");
  cmp->add_flag("--fp8", *ci->fp8, "Add the fp8 and fp4 rows: " + fp8_names);
  cmp->callback([ci, &action] { action = [ci] { return run_compare(*ci); }; });
}

}  // namespace mixprec::cli
