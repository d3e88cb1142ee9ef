// The libtorch adapter's device paths: ATen's gradient check and Telemetry's ATen counting, the
// code CUDA tensors take, run on CPU tensors against the core's (bitwise: gradients, counts,
// log lines); and on CUDA (TorchCuda.*: skipped without a GPU, run by scripts/device-check.sh;
// MIXPREC_TEST_DEVICE=cpu runs them on the CPU with the ATen paths forced).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "mixprec/formats/count.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/torch/autocast.hpp"
#include "mixprec/torch/grad_scaler.hpp"
#include "mixprec/torch/telemetry.hpp"
#include "mixprec/run/run_log.hpp"

namespace {

using at::Tensor;
namespace fs = std::filesystem;

struct NetImpl : ::torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", ::torch::nn::Linear(16, 48))), fc2(register_module("fc2", ::torch::nn::Linear(48, 8))) {}
  ::torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("mixprec_torch_device_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

std::string text_of(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Gradients of every class: random magnitudes over 2^-30 .. 2^30, one poisoned on request.
std::vector<Tensor> gradients(at::ScalarType dtype, int poison) {
  ::torch::manual_seed(7);
  std::vector<Tensor> g;
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{33, 17}, {5}, {4, 3, 2, 2}}) {
    const Tensor mag = at::exp2(at::randint(-30, 30, shape).to(at::kFloat));
    g.push_back((at::randn(shape) * mag).to(dtype));
  }
  if (poison == 1) g[1][2] = std::numeric_limits<float>::infinity();
  if (poison == 2) g[1][2] = std::numeric_limits<float>::quiet_NaN();
  return g;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  const Tensor x = a.contiguous(), y = b.contiguous();
  return x.numel() == y.numel() && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

mixprec::torch::StepOutcome step_with(mixprec::torch::GradientPath path, const std::vector<Tensor>& grads, float scale,
                                      const at::Device& device, std::vector<Tensor>& out) {
  std::vector<Tensor> params;
  for (const Tensor& g : grads) {
    Tensor p = at::zeros_like(g).to(device).set_requires_grad(true);
    p.mutable_grad() = g.clone().to(device);
    params.push_back(p);
  }
  ::torch::optim::SGD opt(params, ::torch::optim::SGDOptions(0.0));
  auto config = mixprec::loss_scale_preset("torch");
  config.init_scale = scale;
  mixprec::torch::GradScaler scaler(config);
  scaler.set_gradient_path(path);
  const auto outcome = scaler.step(opt);
  out.clear();
  for (const Tensor& p : params) out.push_back(p.grad().to(at::kCPU));
  return outcome;
}

TEST(TorchDevicePaths, AtenGradientCheckEqualsTheCoresBitwise) {
  int norms_differ = 0;  // ATen's norm (fp32 per tensor) rounds apart from the exact one somewhere
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const float scale : {65536.0f, 1.0f, 0.25f, 0x1p-140f}) {
      for (int poison = 0; poison < 3; ++poison) {
        const std::vector<Tensor> g = gradients(dtype, poison);
        std::vector<Tensor> core, aten;
        const auto a = step_with(mixprec::torch::GradientPath::automatic, g, scale, at::kCPU, core);
        const auto b = step_with(mixprec::torch::GradientPath::aten, g, scale, at::kCPU, aten);
        const std::string where = std::string(c10::toString(dtype)) + " scale " + std::to_string(scale) +
                                  " poison " + std::to_string(poison);
        EXPECT_EQ(a.applied, b.applied) << where;
        EXPECT_EQ(a.found_inf, b.found_inf) << where;
        EXPECT_EQ(a.first_overflow, b.first_overflow) << where;
        for (std::size_t k = 0; k < core.size(); ++k) EXPECT_TRUE(bitwise_equal(core[k], aten[k])) << where << " #" << k;
        if (!a.found_inf) {
          EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * a.grad_norm) << where;
          norms_differ += a.grad_norm != b.grad_norm;
        }
      }
    }
  }
  EXPECT_GT(norms_differ, 0) << "every norm bit-equal: was the ATen path taken at all?";
}

// A run recorded by Telemetry: returns log.jsonl's text.
std::string telemetry_run(const std::string& name, mixprec::torch::Counting counting, at::ScalarType dtype,
                          const at::Device& device, std::uint64_t* host_reads = nullptr) {
  const fs::path dir = fresh_dir(name);
  ::torch::manual_seed(0);
  Net net;
  net->to(device);
  ::torch::optim::SGD opt(net->parameters(), ::torch::optim::SGDOptions(0.1));
  mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset("torch"), dtype == at::kHalf);
  mixprec::torch::Telemetry tel(dir.string(), {.precision = dtype == at::kHalf ? "fp16" : "bf16",
                                               .loss_scale = dtype == at::kHalf ? "torch" : "none",
                                               .histogram_every = 2},
                                counting);
  ::torch::manual_seed(1);
  for (int step = 1; step <= 4; ++step) {
    Tensor loss;
    for (int micro = 0; micro < 2; ++micro) {
      const Tensor x = (::torch::randn({8, 16}) * 3).to(device);
      mixprec::torch::Autocast ac(device.type(), dtype);
      Tensor h = ::torch::gelu(net->fc1(x));
      if (step == 3 && micro == 1) h = h * std::numeric_limits<float>::infinity();
      tel.watch("fc1.out", h);
      Tensor y = net->fc2(h);
      tel.watch("fc2.out", y);
      loss = y.to(::torch::kFloat).pow(2).mean() * 1e-3;
      scaler.scale(loss).backward();
    }
    const auto out = scaler.step(opt, {.max_grad_norm = 1e-2f});
    (void)tel.record(net->named_parameters(), out, scaler, {.loss = loss.item<double>(), .seconds = 0.5});
    scaler.update();
    opt.zero_grad();
  }
  (void)tel.finish();
  if (host_reads != nullptr) *host_reads = tel.host_reads();
  return text_of(dir / "log.jsonl");
}

TEST(TorchDevicePaths, AtenCountingLogsWhatTheCoreLogs) {
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    std::uint64_t core_reads = 1, aten_reads = 0;
    const std::string core = telemetry_run("core", mixprec::torch::Counting::automatic, dtype, at::kCPU, &core_reads);
    const std::string aten = telemetry_run("aten", mixprec::torch::Counting::aten, dtype, at::kCPU, &aten_reads);
    EXPECT_EQ(core_reads, 0u) << "the core read every tensor in place";
    EXPECT_EQ(aten_reads, 4u) << "one host read per step (4 steps), whatever was counted";
    EXPECT_NE(core.find("\"histograms\":"), std::string::npos);
    EXPECT_NE(core.find("\"overflow_activation\":\"fc2.out\""), std::string::npos) << core;  // backward order
    EXPECT_EQ(core, aten) << c10::toString(dtype);
  }
}

// Every 16-bit code, and fp32 words around every class bound, as gradients of a watched tensor
// counted by ATen: the core's counts and histogram of the same values.
TEST(TorchDevicePaths, AtenCountsEveryCodeAsTheCore) {
  std::vector<std::int32_t> words;
  for (const std::int64_t b : {0LL, 0x33000000LL, 0x387fe000LL, 0x38800000LL, 0x477ff000LL, 0x47800000LL, 0x7f800000LL})
    for (std::int64_t d = -300; d <= 300; ++d)
      if (b + d >= 0 && b + d <= 0x7fffffff) words.push_back(static_cast<std::int32_t>(b + d));
  const Tensor f32 = at::tensor(words, at::kInt).view(at::kFloat);
  const Tensor codes = at::arange(-32768, 32768, at::kInt).to(at::kShort);
  for (const Tensor& grad : {codes.view(at::kHalf), codes.view(at::kBFloat16), at::cat({f32, -f32})}) {
    const fs::path dir = fresh_dir("codes");
    mixprec::torch::Telemetry tel(dir.string(), {.precision = "bf16", .loss_scale = "none", .histogram_every = 1},
                                  mixprec::torch::Counting::aten);
    const Tensor a = at::zeros({grad.numel()}, grad.scalar_type()).set_requires_grad(true);
    Tensor b = a * 1;
    tel.watch("codes", b);
    b.backward(grad);
    mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset("torch"), false);
    ::torch::optim::SGD opt(std::vector<Tensor>{a}, ::torch::optim::SGDOptions(0.0));
    const ::torch::OrderedDict<std::string, Tensor> none;
    const auto r = tel.record(none, scaler.step(opt), scaler, {.loss = 1.0});
    const std::size_t n = static_cast<std::size_t>(grad.numel());
    mixprec::CountedTensor want;
    std::vector<float> widened(n);
    if (grad.scalar_type() == at::kHalf) {
      want = mixprec::count_f16_as_stored({static_cast<const mixprec::f16*>(grad.data_ptr()), n});
    } else if (grad.scalar_type() == at::kBFloat16) {
      want = mixprec::count_bf16_to_f16({static_cast<const mixprec::bf16*>(grad.data_ptr()), n});
    } else {
      want = mixprec::count_f32_to_f16({static_cast<const float*>(grad.data_ptr()), n});
    }
    const Tensor as_f32 = grad.to(at::kFloat).contiguous();
    std::memcpy(widened.data(), as_f32.data_ptr(), n * sizeof(float));
    ASSERT_EQ(r.act_grad_tensors.size(), 1u);
    EXPECT_EQ(r.act_grad_tensors[0].stats, want.stats) << c10::toString(grad.scalar_type());
    EXPECT_EQ(r.act_grad_tensors[0].amax, want.amax) << c10::toString(grad.scalar_type());
    mixprec::nn::Log2Histogram h;
    h.add(widened, mixprec::nn::kHistogramStride);
    ASSERT_TRUE(r.histograms.has_value());
    EXPECT_EQ(r.histograms->activation_grads.counts, h.counts) << c10::toString(grad.scalar_type());
    EXPECT_EQ(r.histograms->activation_grads.zeros, h.zeros);
    EXPECT_EQ(r.histograms->activation_grads.nonfinite, h.nonfinite);
  }
}

// ---- on CUDA ---------------------------------------------------------------------------

// The device of TorchCuda.*: CUDA, or the CPU with the ATen paths forced (MIXPREC_TEST_DEVICE=cpu).
bool forced_cpu() {
  const char* d = std::getenv("MIXPREC_TEST_DEVICE");
  return d != nullptr && std::string(d) == "cpu";
}

#define MIXPREC_REQUIRE_DEVICE()                                                                      \
  if (!forced_cpu() && !::torch::cuda::is_available())                                                \
  GTEST_SKIP() << "no CUDA device (scripts/device-check.sh runs this on a GPU; MIXPREC_TEST_DEVICE=cpu " \
                  "runs it on the CPU)"

at::Device test_device() { return forced_cpu() ? at::Device(at::kCPU) : at::Device(at::kCUDA); }

TEST(TorchCuda, GradScalerOnDeviceGradientsEqualsTheCoreOnTheirCpuCopies) {
  MIXPREC_REQUIRE_DEVICE();
  const auto path = forced_cpu() ? mixprec::torch::GradientPath::aten : mixprec::torch::GradientPath::automatic;
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const float scale : {65536.0f, 1.0f, 0.25f}) {
      for (int poison = 0; poison < 3; ++poison) {
        const std::vector<Tensor> g = gradients(dtype, poison);
        std::vector<Tensor> cpu, dev;
        const auto a = step_with(mixprec::torch::GradientPath::automatic, g, scale, at::kCPU, cpu);
        const auto b = step_with(path, g, scale, test_device(), dev);
        EXPECT_EQ(a.found_inf, b.found_inf);
        EXPECT_EQ(a.first_overflow, b.first_overflow);
        for (std::size_t k = 0; k < cpu.size(); ++k) EXPECT_TRUE(bitwise_equal(cpu[k], dev[k])) << k;
      }
    }
  }
}

TEST(TorchCuda, TelemetryCountsOnTheDeviceEqualTheCoresOfTheSameTensors) {
  MIXPREC_REQUIRE_DEVICE();
  const at::Device device = test_device();
  const fs::path dir = fresh_dir("cuda");
  ::torch::manual_seed(0);
  Net net;
  net->to(device);
  mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset("torch"), false);
  mixprec::torch::Telemetry tel(dir.string(), {.precision = "bf16", .loss_scale = "none", .histogram_every = 1},
                                forced_cpu() ? mixprec::torch::Counting::aten : mixprec::torch::Counting::automatic);
  std::map<std::string, Tensor> seen;
  const Tensor x = (::torch::randn({8, 16}) * 3).to(device);
  Tensor loss;
  {
    mixprec::torch::Autocast ac(device.type(), at::kBFloat16);
    Tensor h = ::torch::gelu(net->fc1(x));
    tel.watch("fc1.out", h);
    h.register_hook([&](const Tensor& g) { seen["fc1.out"] = g.detach().to(at::kCPU).contiguous(); });
    Tensor y = net->fc2(h);
    tel.watch("fc2.out", y);
    y.register_hook([&](const Tensor& g) { seen["fc2.out"] = g.detach().to(at::kCPU).contiguous(); });
    loss = y.to(::torch::kFloat).pow(2).mean() * 1e-6;
  }
  loss.backward();
  ::torch::optim::SGD opt(net->parameters(), ::torch::optim::SGDOptions(0.0));
  const auto out = scaler.step(opt);
  const auto r = tel.record(net->named_parameters(), out, scaler, {.loss = loss.item<double>()});
  ASSERT_EQ(r.act_grad_tensors.size(), 2u);
  for (const auto& t : r.act_grad_tensors) {
    const Tensor& g = seen.at(t.name);
    ASSERT_EQ(g.scalar_type(), at::kBFloat16);
    const auto want = mixprec::count_bf16_to_f16({static_cast<const mixprec::bf16*>(g.data_ptr()),
                                                  static_cast<std::size_t>(g.numel())});
    EXPECT_EQ(t.stats, want.stats) << t.name;
    EXPECT_EQ(t.amax, want.amax) << t.name;
  }
  std::size_t i = 0;
  for (const auto& item : net->named_parameters()) {
    const Tensor w = item.value().detach().to(at::kCPU).contiguous();
    const Tensor g = item.value().grad().to(at::kCPU).contiguous();
    EXPECT_EQ(r.params[i].weight_amax, w.abs().max().item<float>()) << item.key();
    EXPECT_EQ(r.params[i].grad_amax, g.abs().max().item<float>()) << item.key();
    ++i;
  }
  ASSERT_TRUE(r.histograms.has_value());
  std::uint64_t params = 0;
  for (const auto& item : net->named_parameters()) params += static_cast<std::uint64_t>(item.value().numel());
  EXPECT_EQ(r.histograms->weights.total(), params);
}

}  // namespace
