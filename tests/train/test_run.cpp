// A run's lifecycle (include/mixprec/train/run.hpp) without the command line: the plan
// from a config file and keys, resume plans, the communicator, the summary. tests/cli and
// tests/reliability check the same through `mixprec train`.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "mixprec/core/io.hpp"
#include "mixprec/train/run.hpp"
#include "support.hpp"
#include "temp_dir.hpp"

namespace mixprec::train {
namespace {

using test::error_of;
namespace fs = std::filesystem;

struct TempDir : test::TempDir {
  TempDir() : test::TempDir("run") {}
};

RunRequest keys(std::vector<std::pair<std::string, std::string>> k) {
  RunRequest r;
  r.keys = std::move(k);
  return r;
}

TEST(RunPlan, NewRunDefaultsFollowTheKeys) {
  const RunPlan p = plan_run(keys({{"steps", "3"}}));
  EXPECT_FALSE(p.resume);
  EXPECT_TRUE(p.dir.empty());
  EXPECT_EQ(p.config.steps, 3u);
  EXPECT_EQ(p.config.warmup, 3u) << "the default warmup is at most the steps";
  const RunPlan fp8 = plan_run(keys({{"precision", "fp8-delayed"}}));
  EXPECT_EQ(fp8.config.loss_scale, "none") << "fp8 presets: no loss scaling unless asked for";
  const RunPlan asked = plan_run(keys({{"precision", "fp8-delayed"}, {"loss-scale", "dynamic"}}));
  EXPECT_EQ(asked.config.loss_scale, "dynamic");
  RunRequest cfg;
  cfg.config_given = true;
  cfg.config_text = R"({"steps": 3, "warmup": 2})";
  cfg.config_source = "config file 'c.json'";
  EXPECT_EQ(plan_run(cfg).config.warmup, 2u);
}

TEST(RunPlan, NewRunRefusals) {
  EXPECT_EQ(error_of<std::invalid_argument>([] { plan_run(keys({{"steps", "4"}, {"checkpoint-every", "2"}})); }),
            "checkpoint-every: checkpoints go to the run folder; give --out DIR");
  EXPECT_EQ(error_of<std::invalid_argument>([] { plan_run(keys({{"out", ""}})); }),
            "out: expected a folder, found '' (omit --out to write no run folder)");
  EXPECT_EQ(error_of<std::invalid_argument>([] { plan_run(keys({{"fp8-margin", "1"}})); }),
            "fp8-margin: applies to --precision fp8-delayed only, found --precision fp16");
  RunRequest cfg;
  cfg.config_given = true;
  cfg.config_text = R"({"resume": "x"})";
  cfg.config_source = "config file 'c.json'";
  EXPECT_EQ(error_of<std::invalid_argument>([&] { plan_run(cfg); }),
            "config file 'c.json': resume: give --resume DIR on the command line to continue a run");
}

TEST(RunPlan, ResumeKeepsTheRunsConfiguration) {
  const TempDir dir;
  const fs::path run = dir.path() / "run";
  fs::create_directories(run);
  TrainConfig c;
  c.steps = 8;
  c.warmup = 2;
  c.out = run.string();
  io::write_file_atomic(run / run_files::config, run_config_json(c));
  int notes = 0;
  const RunPlan p = plan_run(keys({{"resume", run.string()}, {"steps", "12"}}), [&](const std::string&) { ++notes; });
  EXPECT_TRUE(p.resume);
  EXPECT_EQ(p.dir, run);
  EXPECT_EQ(p.config.steps, 12u) << "steps may extend the run";
  EXPECT_EQ(p.config.resume, run.string());
  EXPECT_EQ(p.checkpoint_step, 0u) << "no checkpoint: from step 0";
  EXPECT_EQ(notes, 0);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { plan_run(keys({{"lr", "0.5"}, {"resume", run.string()}})); }),
            "--lr: this run was started with 0.003; a resumed run keeps its configuration");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { plan_run(keys({{"resume", ""}})); }),
            "resume: expected a run folder, found ''");
  EXPECT_EQ(error_of<std::invalid_argument>(
                [&] { plan_run(keys({{"out", (dir.path() / "other").string()}, {"resume", run.string()}})); }),
            "out: a resumed run continues in its own folder '" + run.string() + "', found '" +
                (dir.path() / "other").string() + "'");
}

TEST(RunConfig, WithoutTheResumeFolder) {
  TrainConfig c;
  c.resume = "somewhere";
  c.steps = 7;
  const auto j = nlohmann::json::parse(run_config_json(c));
  EXPECT_EQ(j["resume"], "");
  EXPECT_EQ(j["steps"], 7);
}

TEST(RunCommunicator, OneProcessUnlessDistributed) {
  TrainConfig c;
  EXPECT_EQ(make_communicator(c, nullptr)->size(), 1);
  c.distributed = true;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { make_communicator(c, nullptr); }).rfind(
                "distributed: this mixprec was built without MPI", 0),
            0u);
  double timeout = 0;
  const MpiConnect not_launched = [&](double t) -> std::unique_ptr<dist::Communicator> {
    timeout = t;
    return nullptr;
  };
  EXPECT_EQ(make_communicator(c, not_launched)->size(), 1) << "not under mpirun: one rank";
  EXPECT_EQ(timeout, c.dist_timeout);
  c.distributed = false;
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  const std::string msg = error_of<std::invalid_argument>([&] { make_communicator(c, not_launched); });
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(msg, "distributed: launched by mpirun with 2 ranks; give --distributed (otherwise every rank would train "
                 "the whole run on its own)");
  dist::SingleProcess one;
  EXPECT_FALSE(ranks_stop(one, false));
  EXPECT_TRUE(ranks_stop(one, true));
}

TEST(RunSummary, DistributedObjectAfterTheAlerts) {
  TrainConfig c;
  dist::SingleProcess one;
  const std::string comm = communication_json(one, c, 0);
  const auto d = nlohmann::ordered_json::parse(comm);
  EXPECT_EQ(d["ranks"], 1);
  EXPECT_EQ(d["steps_measured"], 0);
  EXPECT_EQ(d["all_ranks_bytes_per_step"], 0.0);
  TrainSummary s;
  s.steps = 2;
  const auto plain = nlohmann::ordered_json::parse(run_summary_json(s, c, {}));
  EXPECT_FALSE(plain.contains("distributed"));
  EXPECT_TRUE(plain.contains("alerts"));
  const auto with = nlohmann::ordered_json::parse(run_summary_json(s, c, {}, comm));
  EXPECT_EQ(with["distributed"], d);
  EXPECT_EQ(with.items().begin().key(), "steps");
}

}  // namespace
}  // namespace mixprec::train
