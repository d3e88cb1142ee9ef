// The installed mixprec::torch in a libtorch program: a linear fit with fp32 gradients,
// preset torch, an inf written into the weight's gradient at step 3. Exit 0 when the
// scaler skipped exactly that step and named the parameter.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "mixprec/torch/grad_scaler.hpp"

int main() {
  ::torch::manual_seed(0);
  ::torch::nn::Linear fit(4, 1);
  ::torch::optim::SGD opt(fit->parameters(), ::torch::optim::SGDOptions(0.1));
  mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset("torch"));
  scaler.set_names(*fit);
  const at::Tensor x = ::torch::randn({32, 4}), y = x.sum(1, true);
  int skipped = 0, bad = 0;
  for (int step = 1; step <= 6; ++step) {
    const at::Tensor loss = (fit->forward(x) - y).pow(2).mean();
    scaler.scale(loss).backward();
    if (step == 3) {
      ::torch::NoGradGuard ng;
      fit->weight.mutable_grad()[0][0] = INFINITY;
    }
    const mixprec::torch::StepOutcome out = scaler.step(opt);
    scaler.update();
    opt.zero_grad();
    std::printf("step %d  loss %.4f  scale %.0f  %s%s\n", step, loss.item<double>(), static_cast<double>(out.scale),
                out.applied ? "applied" : "skipped: inf/NaN first in ", out.applied ? "" : out.first_overflow_name.c_str());
    if (!out.applied) {
      ++skipped;
      if (step != 3 || out.first_overflow_name != "weight") ++bad;
    }
  }
  std::printf("torch_consumer: %d skipped, scale %.0f\n", skipped, static_cast<double>(scaler.get_scale()));
  return skipped == 1 && bad == 0 && scaler.get_scale() == 32768.0f ? 0 : 1;
}
