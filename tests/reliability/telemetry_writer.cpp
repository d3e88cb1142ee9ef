// A run-folder writer for the reliability scripts (enospc.sh): train::TelemetryRecorder, the
// code behind both Telemetry front doors, recording synthetic steps. It prints one line per
// call, flushed at once, so that a script (or a SIGKILL) knows exactly which calls returned:
//
//   ok STEP JSON          record() returned this log line
//   fail STEP MESSAGE     record() threw (nothing written: the same step is tried again)
//   finished              finish() returned (summary.json written)
//   finish-fail MESSAGE   finish() threw
//
//   telemetry_writer DIR STEPS [--finish-every K] [--wait-on-failure]
//
// --wait-on-failure: after a failed call, read one line from stdin (the script frees space
// and writes a line), then try the same call again; without it, go on with the next step.
// Exit 0 when the folder was created (whatever failed later), 1 when it could not be.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "mixprec/run/run_log.hpp"
#include "mixprec/train/telemetry_recorder.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: telemetry_writer DIR STEPS [--finish-every K] [--wait-on-failure]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const unsigned long steps = std::strtoul(argv[2], nullptr, 10);
  unsigned long finish_every = 0;
  bool wait = false;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--finish-every" && i + 1 < argc) finish_every = std::strtoul(argv[++i], nullptr, 10);
    else if (a == "--wait-on-failure") wait = true;
  }
  auto waited = [&] {
    if (!wait) return false;
    std::string line;
    return static_cast<bool>(std::getline(std::cin, line));
  };
  std::vector<float> weight(256), grad(256);
  for (std::size_t i = 0; i < weight.size(); ++i) {
    weight[i] = 0.01f * static_cast<float>(i % 17);
    grad[i] = 1e-3f * static_cast<float>(i % 13);
  }
  try {
    mixprec::train::TelemetryRecorder rec(dir, {.precision = "fp16", .loss_scale = "torch", .histogram_every = 7});
    for (unsigned long step = 1; step <= steps;) {
      mixprec::train::TelemetryStep s;
      s.loss = 3.0 / static_cast<double>(step);
      s.lr = 1e-3;
      s.tokens = 64;
      s.seconds = 0.01;
      s.scale = 1024;
      s.next_scale = 1024;
      s.grad_norm = 0.5;
      std::vector<float> act(64, 1e-6f * static_cast<float>(step));
      rec.count_activation_grad("h0", {act.data(), act.size(), mixprec::DType::f32});
      const mixprec::train::NamedParam p{"w", {grad.data(), grad.size(), mixprec::DType::f32},
                                         {weight.data(), weight.size(), mixprec::DType::f32}};
      try {
        const mixprec::train::StepRecord r = rec.record(s, {&p, 1});
        std::printf("ok %lu %s\n", step, mixprec::train::step_record_json(r).c_str());
        std::fflush(stdout);
        ++step;
      } catch (const std::exception& e) {
        std::printf("fail %lu %s\n", step, e.what());
        std::fflush(stdout);
        if (!waited()) ++step;
        continue;
      }
      if (finish_every > 0 && (step - 1) % finish_every == 0) {
        for (;;) {
          try {
            (void)rec.finish();
            std::printf("finished\n");
            std::fflush(stdout);
            break;
          } catch (const std::exception& e) {
            std::printf("finish-fail %s\n", e.what());
            std::fflush(stdout);
            if (!waited()) break;
          }
        }
      }
    }
    for (;;) {
      try {
        (void)rec.finish();
        std::printf("finished\n");
        break;
      } catch (const std::exception& e) {
        std::printf("finish-fail %s\n", e.what());
        std::fflush(stdout);
        if (!waited()) break;
      }
    }
  } catch (const std::exception& e) {
    std::printf("create-fail %s\n", e.what());
    return 1;
  }
  return 0;
}
