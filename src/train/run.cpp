// The run loop and the resume configuration (include/mixprec/train/run.hpp).
#include "mixprec/train/run.hpp"

#include <stdexcept>

#include "mixprec/checkpoint/safetensors.hpp"
#include "mixprec/core/io.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/train/run_log.hpp"

namespace mixprec::train {
namespace fs = std::filesystem;

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
    std::string text;
    try {
      text = io::read_file(cfg_path);
    } catch (const std::runtime_error& e) {
      throw std::invalid_argument(std::string("resume: ") + e.what());
    }
    r.config = apply_json(TrainConfig{}, text, "run config " + text::squote(cfg_path.string()));
    return r;
  }
  // config.json was lost (deleted under a live run, ...): every checkpoint holds the
  // run's configuration; the resume writes config.json again.
  r.from_checkpoint = r.checkpoint;
  r.config = apply_json(TrainConfig{}, ckpt::SafetensorsFile::open(r.checkpoint).require_metadata("mixprec.config"),
                        "the configuration in checkpoint " + text::squote(r.checkpoint.string()));
  return r;
}

}  // namespace mixprec::train
