// Issue 30 (docs/bad_inputs.md, "Run folders"): the run folder knows its schema version and
// its writer; outputs never land on inputs; a failed append leaves the log as it was; readers
// refuse FIFOs and devices before they block; the telemetry recorder validates every value
// at the call and writes all or nothing; its alerts' advice fits the writer and the run's lr.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/run/alerts.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"
#include "mixprec/train/telemetry_recorder.hpp"
#include "support.hpp"
#include "temp_dir.hpp"

namespace mixprec::train {
namespace {

using test::error_of;
namespace fs = std::filesystem;

struct TempDir : test::TempDir {
  explicit TempDir(const std::string& which = "a") : test::TempDir("run_folder_guard_" + which) {}
};

void write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

StepRecord record(std::uint64_t step) {
  StepRecord r;
  r.step = step;
  r.lr = 1e-3;
  r.loss = 2.0;
  r.scale = 1024;
  r.next_scale = 1024;
  r.tokens = 16;
  r.seconds = 0.01;
  return r;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs f in a forked child (so that resource limits and signal dispositions stay there);
// the child's exit code is 0 when f returned true.
template <class F>
int in_child(F&& f) {
  const pid_t pid = ::fork();
  if (pid == 0) _exit(f() ? 0 : 1);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// ---- schema version and writer (findings 1, 12) ---------------------------------------

TEST(RunFolderSchema, ReadsVersionsOneAndTwoAndRefusesAnyOther) {
  const RunConfig v1_engine = parse_run_config(R"({"steps": 10, "precision": "fp16"})", "c");
  EXPECT_EQ(v1_engine.schema, 1);
  EXPECT_EQ(v1_engine.writer, RunWriter::engine);
  const RunConfig v1_door = parse_run_config(R"({"precision": "fp16", "loss-scale": "torch"})", "c");
  EXPECT_EQ(v1_door.writer, std::nullopt);  // a front door's version-1 folder: not the engine's
  EXPECT_EQ(run_writer_text(v1_door), "a Telemetry (libtorch or Python)");
  const RunConfig v2 = parse_run_config(R"({"run_folder_schema": 2, "writer": "python", "precision": "bf16"})", "c");
  EXPECT_EQ(v2.schema, 2);
  EXPECT_EQ(v2.writer, RunWriter::python);
  EXPECT_EQ(v2.config.precision, nn::Precision::bf16);

  EXPECT_EQ(error_of<std::invalid_argument>([] { parse_run_config(R"({"run_folder_schema": 9, "steps": 3})", "c"); }),
            "c: run_folder_schema: this mixprec reads run folders of schema versions 1 to 2, found 9 (written by a "
            "newer mixprec: read it with that version)");
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([] { parse_run_config(R"({"run_folder_schema": "2"})", "c"); }),
                       "found \"2\""));
  EXPECT_EQ(error_of<std::invalid_argument>([] { parse_run_config(R"({"run_folder_schema": 2})", "c"); }),
            "c: writer: missing (schema version 2 names the folder's writer)");
  EXPECT_TRUE(contains(error_of<std::invalid_argument>(
                           [] { parse_run_config(R"({"run_folder_schema": 2, "writer": "jax"})", "c"); }),
                       "writer: expected \"engine\", \"libtorch\" or \"python\", found \"jax\""));
}

TEST(RunFolderSchema, EveryReaderChecksTheVersionFirst) {
  const TempDir dir;
  write(dir.path() / "config.json", R"({"run_folder_schema": 9, "some-key-of-version-9": true})");
  write(dir.path() / "log.jsonl", step_record_json(record(1)) + "\n");
  const std::string e = error_of<std::runtime_error>([&] { check_run_folder(dir.path()); });
  EXPECT_TRUE(contains(e, "run_folder_schema: this mixprec reads run folders of schema versions 1 to 2, found 9")) << e;
}

TEST(RunFolderSchema, TheLossScaleConfigRoundTripsWithItsOverrides) {
  TrainConfig c;
  c.loss_scale = "torch";
  LossScaleConfig ls = loss_scale_preset("torch");
  ls.growth_interval = 20;
  ls.init_scale = 1024;
  const std::string text = run_config_text(c, RunWriter::python, {"precision", "loss-scale"}, ls);
  EXPECT_TRUE(contains(text, "\"run_folder_schema\": 2")) << text;
  EXPECT_TRUE(contains(text, "\"writer\": \"python\"")) << text;
  const RunConfig back = parse_run_config(text, "c");
  ASSERT_TRUE(back.loss_scale.has_value());
  EXPECT_TRUE(back.loss_scale_stored);
  EXPECT_EQ(*back.loss_scale, ls);
  // Without a stored config, the preset's; a stored one that is not valid is refused by field.
  EXPECT_EQ(*parse_run_config(R"({"loss-scale": "deepspeed"})", "c").loss_scale, loss_scale_preset("deepspeed"));
  const std::string bad = R"({"run_folder_schema": 2, "writer": "python", "loss-scale": "torch", "loss-scale-config": {"rule": "torch"}})";
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([&] { parse_run_config(bad, "c"); }), "c: loss-scale-config."));
}

TEST(RunFolderSchema, TheLockAndTheNonEmptyMessageGiveAdviceThatFitsTheWriter) {
  const TempDir dir;
  write(dir.path() / "config.json", R"({"run_folder_schema": 2, "writer": "python", "precision": "fp16"})");
  write(dir.path() / "log.jsonl", step_record_json(record(1)) + "\n");
  // The engine is not told to --resume a front door's folder; the engine's own folder it is.
  EXPECT_EQ(nonempty_folder_advice(dir.path(), RunWriter::engine), "choose a new folder");
  write(dir.path() / "config.json", R"({"run_folder_schema": 2, "writer": "engine", "steps": 3})");
  EXPECT_TRUE(contains(nonempty_folder_advice(dir.path(), RunWriter::engine), "--resume"));
  EXPECT_EQ(nonempty_folder_advice(dir.path(), RunWriter::python), "choose a new folder");
  // A second writer of a live folder (another process holds the lock).
  const TempDir live("live");
  const RunFolder held(live.path(), RunFolder::Mode::create, RunWriter::python);
  const int rc = in_child([&] {
    const std::string e = error_of<std::runtime_error>([&] { RunFolder(live.path(), RunFolder::Mode::resume, RunWriter::python); });
    return contains(e, "in use by process") && contains(e, "give this run a new folder") && !contains(e, "--resume");
  });
  EXPECT_EQ(rc, 0);
}

TEST(RunFolderSchema, AFileOrADanglingLinkAsTheFolderIsNamed) {
  const TempDir dir;
  write(dir.path() / "file", "x");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { RunFolder(dir.path() / "file", RunFolder::Mode::create); }),
            "out: '" + (dir.path() / "file").string() +
                "' exists and is not a folder (a file); expected a new folder or an empty one");
  fs::create_symlink(dir.path() / "nowhere", dir.path() / "link");
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([&] { RunFolder(dir.path() / "link", RunFolder::Mode::create); }),
                       "is a symbolic link to '" + (dir.path() / "nowhere").string() + "', which does not exist"));
  EXPECT_EQ(error_of<std::runtime_error>([&] { RunFolder(dir.path() / "file" / "run", RunFolder::Mode::create); }),
            "cannot create run folder '" + (dir.path() / "file" / "run").string() + "': Not a directory ('" +
                (dir.path() / "file").string() + "' is not a folder)");
}

// ---- outputs never land on inputs (findings 2, 3) ----------------------------------------

TEST(RunFolderOutputs, AnOutputThatResolvesToAFileOfARunFolderIsRefused) {
  const TempDir dir;
  const fs::path run = dir.path() / "run";
  fs::create_directories(run);
  for (const char* f : {"config.json", "log.jsonl", "ckpt-00000004.safetensors"}) write(run / f, "x");
  fs::create_symlink(run / "log.jsonl", dir.path() / "link.html");
  fs::create_hard_link(run / "config.json", dir.path() / "hard.html");
  const std::vector<fs::path> dirs{run};
  for (const fs::path& out : {run / "log.jsonl", run / "config.json", run / "ckpt-00000004.safetensors",
                              run / "summary.json" /* not there yet: still the run's */, run / ".lock",
                              run / ".log.jsonl.tmp-12-0", dir.path() / "link.html", dir.path() / "hard.html",
                              run / ".." / "run" / "log.jsonl"}) {
    const std::string e = error_of<std::invalid_argument>([&] { check_output_not_input(out.string(), "--out", dirs); });
    EXPECT_TRUE(contains(e, "--out: '" + out.string() + "' is ")) << out << ": " << e;
    EXPECT_TRUE(contains(e, " of the run folder '" + run.string() + "'; an output never replaces")) << out << ": " << e;
  }
  EXPECT_NO_THROW(check_output_not_input((run / "report.html").string(), "--out", dirs));
  EXPECT_NO_THROW(check_output_not_input((dir.path() / "elsewhere.json").string(), "--out", dirs));
  // Other inputs (a data file, a config file), by inode.
  write(dir.path() / "data.txt", "abc");
  fs::create_symlink(dir.path() / "data.txt", dir.path() / "d.json");
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([&] {
                         check_output_not_input((dir.path() / "d.json").string(), "json", {}, {dir.path() / "data.txt"});
                       }),
                       "is the input file"));
}

// ---- readers refuse FIFOs and devices (finding 6) -----------------------------------------

// f() must return (or throw) within 20 s; a reader that blocks on a FIFO fails here instead
// of hanging the suite.
template <class F>
std::string within_20s(F&& f) {
  auto fut = std::async(std::launch::async, [&] {
    try {
      f();
      return std::string("returned");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
  });
  if (fut.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "the reader blocked";
    std::_Exit(1);  // the blocked thread cannot be joined
  }
  return fut.get();
}

TEST(RunFolderReaders, RefuseAFifoOrADeviceBeforeBlocking) {
  for (const char* name : {"log.jsonl", "config.json", "summary.json"}) {
    const TempDir dir;
    write(dir.path() / "log.jsonl", step_record_json(record(1)) + "\n");
    fs::remove(dir.path() / name);
    ASSERT_EQ(::mkfifo((dir.path() / name).c_str(), 0644), 0);
    const std::string e = within_20s([&] {
      check_run_folder(dir.path());
      (void)read_run_log((dir.path() / "log.jsonl").string());
      (void)read_run_file(dir.path(), "summary.json");
    });
    EXPECT_TRUE(contains(e, "is a FIFO (named pipe), not a regular file")) << name << ": " << e;
  }
  const TempDir dir;
  fs::create_symlink("/dev/zero", dir.path() / "log.jsonl");
  const std::string e = within_20s([&] { (void)read_run_log((dir.path() / "log.jsonl").string()); });
  EXPECT_TRUE(contains(e, "is a character device, not a regular file")) << e;
  fs::create_directory(dir.path() / "config.json");
  EXPECT_TRUE(contains(within_20s([&] { (void)read_run_config(dir.path()); }), "is a folder, not a regular file"));
}

// A number a double cannot hold is a malformed line like any other, named by file and line
// (it escaped as nlohmann's out_of_range, without either).
TEST(RunFolderReaders, ANumberOverflowNamesTheFileAndLine) {
  const TempDir dir;
  std::string line = step_record_json(record(1));
  line.replace(line.find("\"loss\":2"), 8, "\"loss\":1e400");
  write(dir.path() / "log.jsonl", line + "\n");
  const std::string e = error_of<std::runtime_error>([&] { (void)read_run_log((dir.path() / "log.jsonl").string()); });
  EXPECT_TRUE(contains(e, "log.jsonl:1: malformed JSON")) << e;
  EXPECT_TRUE(contains(e, "1e400")) << e;
}

// ---- a failed append leaves the log as it was (finding 5) ---------------------------------

// RLIMIT_FSIZE makes the kernel refuse a write past the limit (EFBIG), part way through a
// line: the same partial write a full disk gives (the tmpfs test, tests/reliability/enospc.sh,
// gives the real ENOSPC).
TEST(RunFolderAppend, AFailedAppendIsCutBackAndLaterAppendsFollowWholeLines) {
  const TempDir dir;
  const int rc = in_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    RunFolder f(dir.path(), RunFolder::Mode::create);
    f.append_log(step_record_json(record(1)));
    const auto size = fs::file_size(dir.path() / "log.jsonl");
    rlimit lim{};
    ::getrlimit(RLIMIT_FSIZE, &lim);
    const rlimit low{static_cast<rlim_t>(size + 40), lim.rlim_max};
    ::setrlimit(RLIMIT_FSIZE, &low);
    for (int i = 0; i < 2; ++i) {
      const std::string e = error_of<std::runtime_error>([&] { f.append_log(step_record_json(record(2))); });
      if (!contains(e, "(the log is as it was before this record: " + std::to_string(size) + " bytes)")) return false;
      if (fs::file_size(dir.path() / "log.jsonl") != size) return false;
    }
    ::setrlimit(RLIMIT_FSIZE, &lim);  // space comes back
    for (std::uint64_t s = 2; s <= 9; ++s) f.append_log(step_record_json(record(s)));
    const auto log = read_run_log((dir.path() / "log.jsonl").string());
    if (log.size() != 9) return false;
    for (std::size_t i = 0; i < log.size(); ++i)
      if (log[i].step != i + 1) return false;
    return true;
  });
  EXPECT_EQ(rc, 0);
}

// ---- the telemetry recorder: values checked, all or nothing (findings 4, 5; Low) -----------

TelemetryStep good_step() {
  TelemetryStep s;
  s.loss = 2.5;
  s.lr = 1e-3;
  s.seconds = 0.01;
  s.scale = 1024;
  s.next_scale = 1024;
  s.grad_norm = 1;
  return s;
}

TEST(TelemetryRecorderGuard, EveryValueIsCheckedAtTheCallAndNothingIsWritten) {
  const TempDir dir;
  TelemetryRecorder rec((dir.path() / "run").string(), {.precision = "fp16", .loss_scale = "torch"});
  struct Case {
    const char* what;
    void (*set)(TelemetryStep&);
    const char* message;
  };
  const std::vector<Case> cases = {
      {"seconds nan", [](TelemetryStep& s) { s.seconds = std::nan(""); }, "seconds: expected a finite number >= 0, found nan"},
      {"seconds < 0", [](TelemetryStep& s) { s.seconds = -1; }, "seconds: expected a finite number >= 0, found -1"},
      {"lr < 0", [](TelemetryStep& s) { s.lr = -0.5; }, "lr: expected a finite number >= 0, found -0.5"},
      {"lr inf", [](TelemetryStep& s) { s.lr = std::numeric_limits<double>::infinity(); }, "lr: expected a finite number >= 0, found inf"},
      {"clip 0", [](TelemetryStep& s) { s.clip_coef = 0; }, "clip_coef: expected a number in (0, 1], found 0"},
      {"clip 2", [](TelemetryStep& s) { s.clip_coef = 2; }, "clip_coef: expected a number in (0, 1], found 2"},
      {"scale < 0", [](TelemetryStep& s) { s.scale = -1; }, "scale: expected a number >= 0, found -1"},
      {"next nan", [](TelemetryStep& s) { s.next_scale = std::nanf(""); }, "next_scale: expected a number >= 0, found nan"},
      {"norm < 0", [](TelemetryStep& s) { s.grad_norm = -2; }, "grad_norm: expected a number >= 0 (inf or NaN for an overflow), found -2"},
  };
  for (const Case& c : cases) {
    TelemetryStep s = good_step();
    c.set(s);
    EXPECT_EQ(error_of<std::invalid_argument>([&] { rec.record(s, {}); }),
              std::string("telemetry: record(): ") + c.message)
        << c.what;
  }
  EXPECT_EQ(rec.steps(), 0u);
  EXPECT_EQ(fs::file_size(dir.path() / "run" / "log.jsonl"), 0u);  // nothing appended
  // A loss that is not finite is a fact of the run (null in the log), not an error.
  TelemetryStep s = good_step();
  s.loss = std::numeric_limits<double>::infinity();
  EXPECT_EQ(rec.record(s, {}).step, 1u);
  const auto log = read_run_log((dir.path() / "run" / "log.jsonl").string());
  ASSERT_EQ(log.size(), 1u);
  EXPECT_FALSE(log[0].loss_finite);
}

// A resumed run's front end gives the global step: the folder continues its numbering
// (issue 43: a Trainer resumed at step 10 logged step 4); a number not above the last is refused.
TEST(TelemetryRecorderGuard, GivenStepNumbersContinueAndMustGrow) {
  const TempDir dir;
  TelemetryRecorder rec((dir.path() / "run").string(), {.precision = "fp16", .loss_scale = "torch"});
  TelemetryStep s = good_step();
  s.step = 11;
  EXPECT_EQ(rec.record(s, {}).step, 11u);
  EXPECT_EQ(rec.steps(), 11u);
  EXPECT_EQ(rec.record(good_step(), {}).step, 12u);  // 0: after the previous record
  s.step = 12;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { rec.record(s, {}); }),
            "telemetry: record(): step: expected a number above the previous step 12, found 12");
  s.step = 20;
  EXPECT_EQ(rec.record(s, {}).step, 20u);
  const auto log = read_run_log((dir.path() / "run" / "log.jsonl").string());
  ASSERT_EQ(log.size(), 3u);
  EXPECT_EQ(log[0].step, 11u);
  EXPECT_EQ(log[1].step, 12u);
  EXPECT_EQ(log[2].step, 20u);
}

TEST(TelemetryRecorderGuard, AFailedWriteKeepsTheStepNumberAndItsCounts) {
  const TempDir dir;
  const int rc = in_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    TelemetryRecorder rec((dir.path() / "run").string(), {.precision = "fp16", .loss_scale = "torch"});
    std::vector<float> g(64, 1e-9f);  // flushed to zero in fp16
    rec.count_activation_grad("h0", {g.data(), g.size(), DType::f32});
    rlimit lim{};
    ::getrlimit(RLIMIT_FSIZE, &lim);
    const rlimit low{10, lim.rlim_max};
    ::setrlimit(RLIMIT_FSIZE, &low);
    for (int i = 0; i < 2; ++i)
      if (error_of<std::runtime_error>([&] { rec.record(good_step(), {}); }).find("cannot write") == std::string::npos)
        return false;
    ::setrlimit(RLIMIT_FSIZE, &lim);
    const StepRecord r = rec.record(good_step(), {});
    for (int i = 0; i < 7; ++i) rec.record(good_step(), {});
    const auto log = read_run_log((dir.path() / "run" / "log.jsonl").string());
    return r.step == 1 && r.act_grads.underflow == 64 && log.size() == 8 && log.back().step == 8 &&
           log[0].act_grads.underflow == 64 && log[1].act_grads.elements == 0;
  });
  EXPECT_EQ(rc, 0);
}

TEST(TelemetryRecorderGuard, ConfigJsonNamesTheWriterAndTheScalersWholeConfig) {
  const TempDir dir;
  LossScaleConfig ls = loss_scale_preset("torch");
  ls.growth_interval = 20;
  {
    TelemetryRecorder rec((dir.path() / "run").string(), {.precision = "fp16",
                                                        .loss_scale = "torch",
                                                        .loss_scale_config = ls,
                                                        .writer = RunWriter::python});
  }
  const auto rc = read_run_config(dir.path() / "run");
  ASSERT_TRUE(rc.has_value());
  EXPECT_EQ(rc->writer, RunWriter::python);
  EXPECT_EQ(rc->loss_scale->growth_interval, 20);
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([&] {
                         TelemetryRecorder((dir.path() / "r2").string(),
                                           {.precision = "fp16", .loss_scale = "none", .loss_scale_config = ls});
                       }),
                       "loss_scale_config: given for a run without loss scaling"));
}

// ---- alerts fit the writer and the recorded lr (finding 15) ------------------------------

TEST(TelemetryRecorderGuard, AlertAdviceNamesTheRecordedLrAndTheWritersWords) {
  for (const RunWriter w : {RunWriter::python, RunWriter::libtorch}) {
    const TempDir dir;
    TelemetryRecorder rec((dir.path() / "run").string(),
                          {.precision = "fp16", .loss_scale = "torch", .writer = w});
    for (int i = 1; i <= 40; ++i) {
      TelemetryStep s = good_step();
      s.lr = 0.5;
      if (i > 20) {
        s.found_inf = true;
        s.applied = false;
        s.grad_norm = std::numeric_limits<double>::quiet_NaN();
      }
      rec.record(s, {});
    }
    const auto alerts = rec.finish();
    ASSERT_FALSE(alerts.empty());
    bool persistent = false;
    for (const monitor::Alert& a : alerts) {
      EXPECT_FALSE(contains(a.advice, "0.003")) << a.advice;  // TrainConfig's default lr: no run's
      EXPECT_FALSE(contains(a.advice, "--clip")) << a.advice;
      if (a.id == "persistent-overflow") {
        persistent = true;
        EXPECT_TRUE(contains(a.advice, "lower the learning rate (peak 0.5; try 0.05)")) << a.advice;
        EXPECT_TRUE(contains(a.advice, "clip_grad_norm_")) << a.advice;
      }
    }
    EXPECT_TRUE(persistent);
  }
}

}  // namespace
}  // namespace mixprec::train
