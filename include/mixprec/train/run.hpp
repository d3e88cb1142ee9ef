// A training run's lifecycle around the Trainer: the loop that logs every step to the
// run folder and checkpoints it, and the configuration a resume continues with. The
// command line (`mixprec train`, `mixprec compare`) adds flags, progress and signals.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "mixprec/train/config.hpp"
#include "mixprec/train/run_folder.hpp"
#include "mixprec/train/trainer.hpp"

namespace mixprec::train {

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

}  // namespace mixprec::train
