// mixprec::torch::Telemetry: hooks on activations, per-parameter amax, a run folder that
// `mixprec report` reads (the library's load_run + write_report, as the CLI runs them).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "mixprec/core/io.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/report/report.hpp"
#include "mixprec/torch/autocast.hpp"
#include "mixprec/torch/grad_scaler.hpp"
#include "mixprec/torch/telemetry.hpp"
#include "mixprec/run/config.hpp"
#include "mixprec/run/run_folder.hpp"
#include "mixprec/run/run_log.hpp"

namespace {

using at::Tensor;

struct NetImpl : ::torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", ::torch::nn::Linear(8, 32))), fc2(register_module("fc2", ::torch::nn::Linear(32, 2))) {}
  ::torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

TEST(TorchTelemetry, RunFolderWithHooksAndParameterAmaxReadByTheReport) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec_torch_telemetry_test";
  std::filesystem::remove_all(dir);
  ::torch::manual_seed(0);
  Net net;
  ::torch::optim::SGD opt(net->parameters(), ::torch::optim::SGDOptions(0.01));
  mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset("torch"));
  scaler.set_names(*net);
  mixprec::torch::Telemetry tel(dir.string(), {.precision = "fp16", .loss_scale = "torch"});
  for (int step = 1; step <= 5; ++step) {
    const Tensor x = ::torch::randn({16, 8});
    Tensor loss;
    {
      mixprec::torch::Autocast ac(at::kCPU, at::kHalf);
      Tensor h = ::torch::gelu(net->fc1(x));
      tel.watch("fc1.out", h);
      Tensor y = net->fc2(h);
      tel.watch("fc2.out", y);
      loss = y.to(::torch::kFloat).pow(2).mean();
    }
    scaler.scale(loss).backward();
    if (step == 3) net->fc2->weight.mutable_grad()[0][0] = INFINITY;
    const auto out = scaler.step(opt, {.max_grad_norm = 0.1f});
    const auto rec = tel.record(net->named_parameters(), out, scaler, {.loss = loss.item<double>(), .lr = 0.01, .tokens = 16,
                                                                       .val_loss = step == 4 ? std::optional<double>(1.25) : std::nullopt});
    EXPECT_EQ(rec.next_scale, step >= 3 ? 32768.0f : 65536.0f);
    scaler.update();
    EXPECT_EQ(rec.next_scale, scaler.get_scale());
    opt.zero_grad();
  }
  const auto log = mixprec::train::read_run_log((dir / "log.jsonl").string());
  ASSERT_EQ(log.size(), 5u);
  EXPECT_TRUE(log[2].skipped);
  EXPECT_TRUE(log[2].found_inf);
  EXPECT_EQ(log[2].overflow_param, "fc2.weight");
  EXPECT_FALSE(log[0].skipped);
  EXPECT_FALSE(log[0].val_loss.has_value());
  ASSERT_TRUE(log[3].val_loss.has_value());  // the validation loss given at step 4, the report's dot
  EXPECT_EQ(*log[3].val_loss, 1.25);
  EXPECT_EQ(log[0].act_grads.elements, 16u * 32 + 16u * 2);
  ASSERT_EQ(log[0].act_grad_tensors.size(), 2u);
  EXPECT_EQ(log[0].act_grad_tensors[0].name, "fc2.out");  // backward order
  EXPECT_EQ(log[0].act_grad_tensors[1].name, "fc1.out");
  EXPECT_GT(log[0].act_grad_amax, 0.0f);
  // Both watched activations are fp16 (autocast Linear outputs): headroom against 65504.
  EXPECT_NEAR(log[0].headroom_log2, std::log2(65504.0 / static_cast<double>(log[0].act_grad_amax)), 1e-9);
  ASSERT_EQ(log[0].params.size(), 4u);
  EXPECT_EQ(log[0].params[0].name, "fc1.weight");
  EXPECT_GT(log[0].params[0].grad_amax, 0.0f);
  EXPECT_TRUE(std::isinf(log[2].params[2].grad_amax));
  EXPECT_GT(log[0].params[0].weight_amax, 0.0f);

  tel.finish();
  // The run folder of mixprec train: config.json with its schema version, its writer, the
  // run's precision and loss scale (the scaler's whole config), summary.json with its totals
  // and alerts.
  const std::string config = mixprec::io::read_file(dir / "config.json");
  EXPECT_EQ(config.rfind("{\n  \"run_folder_schema\": 2,\n  \"writer\": \"libtorch\",\n  \"precision\": \"fp16\",\n"
                         "  \"loss-scale\": \"torch\",\n  \"loss-scale-config\": {",
                         0),
            0u)
      << config;
  const mixprec::train::RunConfig rc = mixprec::train::parse_run_config(config, "config.json");
  EXPECT_EQ(rc.writer, mixprec::train::RunWriter::libtorch);
  EXPECT_EQ(rc.config.precision, mixprec::nn::Precision::fp16);
  ASSERT_TRUE(rc.loss_scale_stored && rc.loss_scale.has_value());
  EXPECT_EQ(rc.loss_scale->growth_interval, 2000);
  const std::string summary = mixprec::io::read_file(dir / "summary.json");
  EXPECT_NE(summary.find("\"steps\": 5,\n  \"applied\": 4,\n  \"skipped\": 1,"), std::string::npos) << summary;
  EXPECT_NE(summary.find("\"alerts\": []"), std::string::npos) << summary;
  EXPECT_NE(summary.find("\"final_scale\": 32768"), std::string::npos) << summary;

  const auto run = mixprec::monitor::load_run(dir.string());
  const std::string html = (dir / "report.html").string();
  mixprec::monitor::write_report(html, {run});
  std::ifstream in(html);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("no activation-gradient value underflowed in 5 steps (2 tensors"), std::string::npos)
      << "the per-tensor activation-gradient note";
  std::filesystem::remove_all(dir);
}

// The counts of a watched gradient are those of mixprec's counted conversion to fp16 on
// the same values: for fp32 and bf16 activations, what fp16 would flush at this scale.
TEST(TorchTelemetry, CountsEqualConvertCountedOnTheSameGradients) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)));
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec_torch_telemetry_counts";
    std::filesystem::remove_all(dir);
    ::torch::manual_seed(3);
    Net net;
    net->to(dtype);
    ::torch::optim::SGD opt(net->parameters(), ::torch::optim::SGDOptions(0.01));
    mixprec::torch::GradScaler scaler(mixprec::LossScaleConfig{}, false);
    mixprec::torch::Telemetry tel(dir.string(), {.precision = "fp32", .loss_scale = "none"});
    std::vector<Tensor> seen;  // the gradients the hooks saw, in backward order
    // Inputs spread over 2^-40 .. 2^8 so that the gradients reach fp16's subnormal and
    // underflow range and, for fp32/bf16, past its largest finite value.
    const Tensor x = (::torch::randn({64, 8}) * ::torch::exp2(::torch::randint(-40, 8, {64, 1}).to(::torch::kFloat)))
                         .to(dtype);
    Tensor h = net->fc1(x);
    tel.watch("fc1.out", h);
    h.register_hook([&](const Tensor& g) { seen.push_back(g.detach().clone()); });
    Tensor y = net->fc2(h);
    tel.watch("fc2.out", y);
    y.register_hook([&](const Tensor& g) { seen.push_back(g.detach().clone()); });
    (y.to(::torch::kFloat) * ::torch::exp2(::torch::randint(-30, 20, {64, 1}).to(::torch::kFloat))).sum().backward();
    const auto out = scaler.step(opt);
    const auto rec = tel.record(net->named_parameters(), out, scaler, {.loss = 0.0, .lr = 0.01});
    ASSERT_EQ(seen.size(), 2u);
    ASSERT_EQ(rec.act_grad_tensors.size(), 2u);
    mixprec::ConversionStats total;
    for (std::size_t i = 0; i < 2; ++i) {
      const Tensor g = seen[i].to(::torch::kFloat).contiguous();
      std::vector<float> v(g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
      std::vector<mixprec::f16> codes(v.size());
      const mixprec::ConversionStats want = mixprec::convert_counted(std::span<const float>(v), std::span(codes));
      const mixprec::ConversionStats& got = rec.act_grad_tensors[i].stats;
      EXPECT_EQ(got.elements, want.elements);
      EXPECT_EQ(got.nonzero, want.nonzero);
      EXPECT_EQ(got.nonfinite_input, want.nonfinite_input);
      EXPECT_EQ(got.underflow, want.underflow);
      EXPECT_EQ(got.subnormal, want.subnormal);
      EXPECT_EQ(got.overflow, want.overflow);
      total += want;
    }
    EXPECT_EQ(rec.act_grads.underflow, total.underflow);
    EXPECT_GT(total.subnormal, 0u);  // the inputs reach fp16's subnormal range
    if (dtype == at::kHalf) EXPECT_EQ(total.underflow, 0u);  // rounded already: nothing more flushes
    else EXPECT_GT(total.underflow, 0u);                      // what fp16 would flush
    std::filesystem::remove_all(dir);
  }
}

// Two outputs of one autograd node (chunk), one of them unused: its hook sees an undefined
// gradient and counts nothing; the other is counted as its own hook sees it.
TEST(TorchTelemetry, AnOutputThatReceivedNoGradientIsNotCounted) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec_torch_telemetry_unused";
  std::filesystem::remove_all(dir);
  ::torch::manual_seed(5);
  Net net;
  ::torch::optim::SGD opt(net->parameters(), ::torch::optim::SGDOptions(0.01));
  mixprec::torch::GradScaler scaler(mixprec::LossScaleConfig{}, false);
  mixprec::torch::Telemetry tel(dir.string(), {.precision = "fp32", .loss_scale = "none"});
  const auto halves = net->fc1(::torch::randn({4, 8})).chunk(2, 1);
  tel.watch("used", halves[0]);
  tel.watch("unused", halves[1]);
  std::vector<bool> defined;
  halves[1].register_hook([&](const Tensor& g) { defined.push_back(g.defined()); });
  ASSERT_NO_THROW(halves[0].pow(2).sum().backward());
  EXPECT_EQ(defined, std::vector<bool>{false});  // the hook runs, with no gradient
  const auto rec = tel.record(net->named_parameters(), scaler.step(opt), scaler, {.loss = 0.0, .lr = 0.01});
  ASSERT_EQ(rec.act_grad_tensors.size(), 1u);
  EXPECT_EQ(rec.act_grad_tensors[0].name, "used");
  EXPECT_EQ(rec.act_grad_tensors[0].stats.elements, 4u * 16u);
  std::filesystem::remove_all(dir);
}

// The logged next scale is the protocol's: what update() then sets, also when another
// optimizer of the step overflowed (the outcome recorded is a finite one's: a copy of the
// scale updated with its found_inf alone would log a growth update() does not make), and
// under preset layerwise (a scaler that loaded a layerwise state).
TEST(TorchTelemetry, NextScaleIsWhatUpdateSetsWithTwoOptimizersAndPresetLayerwise) {
  for (const bool layerwise : {false, true}) {
    SCOPED_TRACE(layerwise ? "layerwise" : "torch");
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec_torch_telemetry_test4";
    std::filesystem::remove_all(dir);
    ::torch::manual_seed(0);
    Net net;
    ::torch::optim::SGD opt1(net->fc1->parameters(), ::torch::optim::SGDOptions(0.01));
    ::torch::optim::SGD opt2(net->fc2->parameters(), ::torch::optim::SGDOptions(0.01));
    mixprec::LossScaleConfig config = mixprec::loss_scale_preset(layerwise ? "layerwise" : "torch");
    config.growth_interval = 1;  // every finite step grows: a growth logged where update() backs off shows
    mixprec::torch::GradScaler scaler(config);
    if (layerwise) {
      const mixprec::ScalerProtocol preset(config, true, mixprec::Dialect::mixprec, "layerwise");
      scaler.load_state_json(preset.state_json());
      ASSERT_NE(scaler.layerwise(), nullptr);
    }
    mixprec::torch::Telemetry tel(dir.string(), {.precision = "fp32", .loss_scale = layerwise ? "layerwise" : "torch",
                                                 .loss_scale_config = config});
    std::vector<float> logged, set;
    for (int step = 1; step <= 4; ++step) {
      const Tensor loss = net->fc2(::torch::gelu(net->fc1(::torch::randn({4, 8})))).pow(2).mean();
      scaler.scale(loss).backward();
      if (step == 2 || step == 3) net->fc1->weight.mutable_grad()[0][0] = INFINITY;  // opt1's, not opt2's
      const auto out1 = scaler.step(opt1);
      const auto out2 = scaler.step(opt2);
      EXPECT_EQ(out1.applied, step != 2 && step != 3);
      EXPECT_TRUE(out2.applied);
      logged.push_back(tel.record(net->named_parameters(), out2, scaler, {.loss = loss.item<double>()}).next_scale);
      scaler.update();
      set.push_back(scaler.get_scale());
      opt1.zero_grad();
      opt2.zero_grad();
    }
    EXPECT_EQ(logged, set);
    EXPECT_LT(set[1], set[0]) << "the overflow of opt1 backed the scale off";
    std::filesystem::remove_all(dir);
  }
}

TEST(TorchTelemetry, RefusesBadOptionsAndAFolderInUse) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec_torch_telemetry_test3";
  std::filesystem::remove_all(dir);
  auto error = [&](const mixprec::torch::TelemetryOptions& o) {
    try {
      mixprec::torch::Telemetry tel(dir.string(), o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  EXPECT_EQ(error({.precision = "fp8-current"}), "telemetry: precision: expected fp32, fp16 or bf16, found 'fp8-current'");
  EXPECT_NE(error({.loss_scale = "pytorch"}).find("loss-scale: expected none, dynamic, static:S"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir));  // nothing written
  {
    mixprec::torch::Telemetry tel(dir.string());
    try {  // a second writer of the folder, even in this process, is refused
      mixprec::torch::Telemetry again(dir.string());
      ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("is in use by this process"), std::string::npos) << e.what();
    }
  }
  EXPECT_NE(error({}).find("exists and is not empty"), std::string::npos);  // a finished run is never overwritten
  std::filesystem::remove_all(dir);
}

TEST(TorchTelemetry, WatchRefusesATensorWithoutGrad) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "mixprec_torch_telemetry_test2";
  std::filesystem::remove_all(dir);
  mixprec::torch::Telemetry tel(dir.string());
  try {
    tel.watch("x", ::torch::ones({2}));
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("watch('x'): the tensor does not require grad"), std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
