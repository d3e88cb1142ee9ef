// The libtorch side of kill_telemetry.sh: mixprec::torch::Telemetry over a small model,
// training until it is killed. After each record() that returned it prints "ok JSON" (the
// line written, step_record_json), after each finish() "finished", flushed at once, so the
// script knows which calls returned before its SIGKILL.
//
//   torch_telemetry_child DIR
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "mixprec/torch/grad_scaler.hpp"
#include "mixprec/torch/telemetry.hpp"
#include "mixprec/run/run_log.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: torch_telemetry_child DIR\n");
    return 2;
  }
  ::torch::manual_seed(0);
  ::torch::set_num_threads(1);
  ::torch::nn::Sequential net(::torch::nn::Linear(32, 64), ::torch::nn::ReLU(), ::torch::nn::Linear(64, 8));
  ::torch::optim::SGD opt(net->parameters(), ::torch::optim::SGDOptions(0.01));
  mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset("torch"));
  mixprec::torch::Telemetry tel(argv[1], {.precision = "fp16",
                                          .loss_scale = "torch",
                                          .histogram_every = 3,
                                          .loss_scale_config = scaler.loss_scale().config()});
  for (int step = 1;; ++step) {
    const at::Tensor h = net->forward(::torch::randn({16, 32}));
    tel.watch("out", h);
    const at::Tensor loss = h.pow(2).mean();
    scaler.scale(loss).backward();
    const auto out = scaler.step(opt);
    const auto r = tel.record(net->named_parameters(), out, scaler, {.loss = loss.item<double>(), .lr = 0.01,
                                                                     .tokens = 16, .seconds = 0.001});
    std::printf("ok %s\n", mixprec::train::step_record_json(r).c_str());
    std::fflush(stdout);
    scaler.update();
    opt.zero_grad();
    if (step % 2 == 0) {
      (void)tel.finish();
      std::printf("finished\n");
      std::fflush(stdout);
    }
  }
}
