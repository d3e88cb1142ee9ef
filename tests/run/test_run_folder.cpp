// The run folder (include/mixprec/run/run_folder.hpp): checkpoint naming, listing and
// pruning; the lock; creating, resuming, the log's truncation, stale temporaries; the
// reading side.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/checkpoint/safetensors.hpp"
#include "mixprec/core/io.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"
#include "support.hpp"
#include "temp_dir.hpp"

namespace mixprec::train {
namespace {

using test::error_of;
namespace fs = std::filesystem;

// Each test's own folder.
struct TempDir : test::TempDir {
  TempDir() : test::TempDir("run_folder") {}
};

constexpr ckpt::WriteOptions kFast{.fsync = false, .fail_after_bytes = std::nullopt, .header_checksum = false};

std::string read(const fs::path& p) { return io::read_file(p); }

StepRecord record(std::uint64_t step) {
  StepRecord r;
  r.step = step;
  r.loss = 1.0 / static_cast<double>(step);
  return r;
}

TEST(CheckpointFolder, PathsAndListing) {
  EXPECT_EQ(checkpoint_path("run", 100), fs::path("run") / "ckpt-00000100.safetensors");
  EXPECT_EQ(checkpoint_path("run", 0).filename(), "ckpt-00000000.safetensors");
  EXPECT_EQ(checkpoint_path("run", 123456789).filename(), "ckpt-123456789.safetensors");
  EXPECT_EQ(checkpoint_path("run", UINT64_MAX).filename(), "ckpt-18446744073709551615.safetensors");

  TempDir dir;
  EXPECT_TRUE(list_checkpoints(dir.path() / "none").empty());  // a run that has not saved yet
  for (const std::uint64_t s : {100u, 5u, 123456789u, 7u, 0u}) ckpt::write_file(checkpoint_path(dir.path(), s), {}, {}, kFast);
  const std::vector<std::string> others = {".ckpt-00000001.safetensors.tmp-12-0", "ckpt-1.safetensors",
                                           "ckpt-000000001.safetensors",          "ckpt-00000002.safetensors.bak",
                                           "ckpt-0000000x.safetensors",           "ckpt-99999999999999999999.safetensors",
                                           "notes.txt",                           "CKPT-00000004.safetensors"};
  for (const auto& n : others) std::ofstream(dir.path() / n) << "x";
  const auto list = list_checkpoints(dir.path());
  std::vector<std::uint64_t> steps;
  for (const auto& [s, p] : list) {
    steps.push_back(s);
    EXPECT_EQ(p, checkpoint_path(dir.path(), s));
  }
  EXPECT_EQ(steps, (std::vector<std::uint64_t>{0, 5, 7, 100, 123456789}));
  EXPECT_THROW(list_checkpoints(dir.path() / "notes.txt"), std::runtime_error);
  // A folder with a checkpoint's name is refused by name (skipped, it would only fail
  // when the run comes to write that checkpoint).
  fs::create_directory(dir.path() / "ckpt-00000003.safetensors");
  EXPECT_NE(error_of<std::runtime_error>([&] { list_checkpoints(dir.path()); })
                .find("ckpt-00000003.safetensors' is not a regular file (a folder?); remove it"),
            std::string::npos);
}

TEST(CheckpointFolder, PruneKeepsTheNewestAndTouchesNothingElse) {
  TempDir dir;
  for (const std::uint64_t s : {10u, 30u, 20u, 40u}) ckpt::write_file(checkpoint_path(dir.path(), s), {}, {}, kFast);
  const std::set<std::string> others = {".ckpt-00000001.safetensors.tmp-1-0", "ckpt-1.safetensors", "notes.txt"};
  for (const auto& n : others) std::ofstream(dir.path() / n) << "x";
  EXPECT_NE(error_of<std::invalid_argument>([&] { prune_checkpoints(dir.path(), 0); }).find("expected keep >= 1, found 0"),
            std::string::npos);
  prune_checkpoints(dir.path(), 5);
  EXPECT_EQ(list_checkpoints(dir.path()).size(), 4u);
  prune_checkpoints(dir.path(), 2);
  std::set<std::string> expected = others;
  expected.insert({"ckpt-00000030.safetensors", "ckpt-00000040.safetensors"});
  EXPECT_EQ(dir.names(), expected);
  prune_checkpoints(dir.path(), 1);
  expected.erase("ckpt-00000030.safetensors");
  EXPECT_EQ(dir.names(), expected);
  prune_checkpoints(dir.path() / "none", 1);  // nothing to do
}


TEST(RunFolder, CreateTakesTheLockAndRefusesAFolderWithFiles) {
  TempDir dir;
  const fs::path run = dir.path() / "a" / "b";
  {
    RunFolder f(run, RunFolder::Mode::create);  // parents made
    EXPECT_EQ(f.dir(), run);
    EXPECT_TRUE(fs::exists(run / ".lock"));
    EXPECT_FALSE(run_folder_has_files(run));  // only the lock file
    // A second writer of the same folder is refused while the first holds it (a child
    // process: fcntl locks belong to the process).
    const pid_t child = ::fork();
    if (child == 0) {
      try {
        RunFolder again(run, RunFolder::Mode::resume);
        ::_exit(1);
      } catch (const std::runtime_error& e) {
        ::_exit(std::string(e.what()).find("is in use by process " + std::to_string(::getppid())) !=
                        std::string::npos ? 0 : 2);
      }
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    // In this process too (fcntl locks alone would let it through, and closing its
    // descriptor would drop the first writer's lock).
    EXPECT_NE(error_of<std::runtime_error>([&] { RunFolder again(run, RunFolder::Mode::resume); })
                  .find("is in use by this process"),
              std::string::npos);
    f.write_config("{\"steps\": 3}\n");  // version 1: "steps" makes it the engine's
  }
  { RunFolder after(run, RunFolder::Mode::resume); }  // free again once the writer is gone
  EXPECT_TRUE(run_folder_has_files(run));
  EXPECT_NE(error_of<std::invalid_argument>([&] { RunFolder f(run, RunFolder::Mode::create); })
                .find("out: '" + run.string() + "' exists and is not empty; choose a new folder, or continue that run "
                      "with --resume"),
            std::string::npos);
  EXPECT_EQ(read(run / "config.json"), "{\"steps\": 3}\n");  // untouched
  std::ofstream(dir.path() / "file") << "x";
  EXPECT_NE(error_of<std::invalid_argument>([&] { run_folder_has_files(dir.path() / "file"); })
                .find("exists and is not a folder"),
            std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([&] { RunFolder f(dir.path() / "none", RunFolder::Mode::resume); })
                .find("is not a folder"),
            std::string::npos);
}

TEST(RunFolder, LogAppendsAndTruncatesToTheCheckpointStep) {
  TempDir dir;
  RunFolder f(dir.path() / "run", RunFolder::Mode::create);
  for (std::uint64_t s = 1; s <= 5; ++s) f.append_log(step_record_json(record(s)));
  f.truncate_log(3);
  f.append_log(step_record_json(record(4)));
  const std::vector<StepRecord> log = read_run_log((f.dir() / "log.jsonl").string());
  ASSERT_EQ(log.size(), 4u);
  for (std::size_t i = 0; i < log.size(); ++i) EXPECT_EQ(log[i].step, i + 1);
  // A line cut short after the checkpoint's step is dropped; one before it is an error.
  std::ofstream(f.dir() / "log.jsonl", std::ios::app) << "{\"step\": 5, \"lo";
  f.truncate_log(4);
  EXPECT_EQ(read_run_log((f.dir() / "log.jsonl").string()).size(), 4u);
  EXPECT_NE(error_of<std::runtime_error>([&] { f.truncate_log(6); })
                .find("ends at step 4 but the newest checkpoint is at step 6; the run folder is inconsistent"),
            std::string::npos);
}

TEST(RunFolder, RemovesOnlyItsOwnStaleTemporaries) {
  TempDir dir;
  RunFolder f(dir.path() / "run", RunFolder::Mode::create);
  // PID 2^22 + 1 is above Linux's pid_max limit: no such process.
  const std::vector<std::string> stale = {".config.json.tmp-4194305", ".log.jsonl.tmp-4194305-3",
                                          ".ckpt-00000010.safetensors.tmp-4194305-0", ".summary.json.tmp-4194305-1"};
  const std::vector<std::string> kept = {".notes.txt.tmp-4194305",                       // not a run file
                                         ".config.json.tmp-1",                           // init is alive
                                         ".config.json.tmp-x", "config.json.tmp-4194305"};  // not a temporary
  for (const auto& n : stale) std::ofstream(f.dir() / n) << "x";
  for (const auto& n : kept) std::ofstream(f.dir() / n) << "x";
  const std::vector<fs::path> removed = f.remove_stale_temporaries();
  EXPECT_EQ(removed.size(), stale.size());
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(f.dir())) left.insert(e.path().filename().string());
  std::set<std::string> expected(kept.begin(), kept.end());
  expected.insert(".lock");
  EXPECT_EQ(left, expected);
}

TEST(RunFolder, ReadingSide) {
  TempDir dir;
  EXPECT_NE(error_of<std::runtime_error>([&] { check_run_folder(dir.path() / "none"); }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(error_of<std::runtime_error>([&] { check_run_folder(dir.path()); })
                .find("has no log.jsonl: not a run folder"),
            std::string::npos);
  RunFolder f(dir.path() / "run", RunFolder::Mode::create);
  f.append_log(step_record_json(record(1)));
  f.write_summary("{\"steps\": 1}\n");
  EXPECT_NO_THROW(check_run_folder(f.dir()));
  EXPECT_EQ(read_run_file(f.dir(), run_files::summary), std::optional<std::string>("{\"steps\": 1}\n"));
  EXPECT_EQ(read_run_file(f.dir(), run_files::config), std::nullopt);
}

}  // namespace
}  // namespace mixprec::train
