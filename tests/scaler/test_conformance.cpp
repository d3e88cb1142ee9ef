// The conformance cases (scaler/conformance/cases.json) against mixprec::GradScaler over
// ParamStore views and mixprec::SGD.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <memory>
#include <string>
#include <vector>

#include "conformance/conformance.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/param_store.hpp"
#include "mixprec/scaler/grad_scaler.hpp"

namespace mixprec::conformance {
namespace {

class CoreDoor final : public ScalerDoorCalls<GradScaler> {
 public:
  explicit CoreDoor(const CaseSetup& s) : ScalerDoorCalls(s.config, s.enabled) {
    for (const auto& dtypes : s.optimizers) {
      for (DType d : dtypes) {
        if (d != dtypes.front()) throw std::invalid_argument("a ParamStore holds one gradient dtype");
      }
      std::vector<ParamSpec> specs;
      for (std::size_t j = 0; j < dtypes.size(); ++j) specs.push_back({std::string("p").append(std::to_string(j)), {4}});
      auto store = std::make_unique<ParamStore>(specs, StoreOptions{dtypes.front(), dtypes.front(), true, 0});
      for (std::size_t j = 0; j < dtypes.size(); ++j)
        for (std::size_t k = 0; k < 4; ++k) store->master(j)[k] = 0.25f * static_cast<float>(k + 1) + 0.125f * static_cast<float>(j);
      store->refresh_model();
      SgdConfig sgd;
      sgd.lr = 1.0 / 16;
      opts_.push_back(std::make_unique<SGD>(*store, sgd));
      stores_.push_back(std::move(store));
    }
  }

  void set_grads(std::size_t opt, const Values& values) override {
    ParamStore& s = *stores_.at(opt);
    for (std::size_t j = 0; j < values.size(); ++j) {
      if (!values[j]) throw std::invalid_argument("a ParamStore always holds every gradient");
      for (std::size_t k = 0; k < 4; ++k) {
        const auto v = static_cast<float>((*values[j])[k]);
        switch (s.grad_dtype()) {
          case DType::f32: s.grads<float>(j)[k] = v; break;
          case DType::f16: s.grads<f16>(j)[k] = f16(v); break;
          case DType::bf16: s.grads<bf16>(j)[k] = bf16(v); break;
        }
      }
    }
  }

  std::vector<std::vector<double>> grads(std::size_t opt) override {
    ParamStore& s = *stores_.at(opt);
    std::vector<std::vector<double>> out(s.tensor_count());
    for (std::size_t j = 0; j < s.tensor_count(); ++j) {
      for (std::size_t k = 0; k < 4; ++k) {
        switch (s.grad_dtype()) {
          case DType::f32: out[j].push_back(s.grads<float>(j)[k]); break;
          case DType::f16: out[j].push_back(static_cast<float>(s.grads<f16>(j)[k])); break;
          case DType::bf16: out[j].push_back(static_cast<float>(s.grads<bf16>(j)[k])); break;
        }
      }
    }
    return out;
  }

  std::vector<std::uint64_t> weight_bits(std::size_t opt) override {
    std::vector<std::uint64_t> bits;
    ParamStore& s = *stores_.at(opt);
    for (std::size_t j = 0; j < s.tensor_count(); ++j)
      for (float w : s.master(j)) bits.push_back(std::bit_cast<std::uint32_t>(w));
    return bits;
  }

  void unscale(std::size_t opt) override { scaler_->unscale(*opts_.at(opt)); }
  Outcome step(std::size_t opt) override {
    const StepOutcome o = scaler_->step(*opts_.at(opt));
    return {o.applied, o.found_inf, o.first_overflow};
  }
  void throw_next_step(std::size_t) override { throw std::logic_error("mixprec's optimizers do not throw"); }

 private:
  std::vector<std::unique_ptr<ParamStore>> stores_;
  std::vector<std::unique_ptr<Optimizer>> opts_;
};

class Conformance : public ::testing::TestWithParam<std::string> {};

TEST_P(Conformance, Core) {
  run_case("core", GetParam(), [](const CaseSetup& s) { return std::make_unique<CoreDoor>(s); });
}

INSTANTIATE_TEST_SUITE_P(Cases, Conformance, ::testing::ValuesIn(case_names("core")),
                         [](const auto& param_info) { return param_info.param; });

TEST(Conformance, TheListHasAtLeastFortyCasesAndThisDoorRunsMostOfThem) {
  EXPECT_GE(load_cases()["cases"].size(), 40u);
  EXPECT_GE(case_names("core").size(), 40u);
}

}  // namespace
}  // namespace mixprec::conformance

namespace mixprec::conformance {
namespace {

// The state files every door reads (tests/python/test_conformance.py loads the same ones):
// grad_scaler_state_v2.json is what this door writes now, grad_scaler_state_v1.json what it
// wrote before the torch keys joined the format.
std::string fixture(const std::string& name) {
  std::ifstream f(std::string(MIXPREC_SCALER_FIXTURES) + "/" + name);
  std::ostringstream text;
  text << f.rdbuf();
  return text.str();
}

GradScaler fixture_scaler() {
  LossScaleConfig c = loss_scale_preset("torch");
  c.init_scale = 2048;
  c.growth_interval = 7;
  GradScaler scaler(c);
  ParamStore store({{"w", {4}}}, StoreOptions{DType::f32, DType::f32, true, 0});
  SGD opt(store, {});
  for (int step = 0; step < 3; ++step) {
    (void)scaler.step(opt);
    scaler.update();
  }
  return scaler;
}

TEST(ConformanceState, TheV2FixtureIsWhatTheCoreWrites) {
  const json want = json::parse(fixture("grad_scaler_state_v2.json"));
  EXPECT_EQ(json::parse(fixture_scaler().state_json()), want);
  EXPECT_EQ(want["_growth_tracker"], 3);
  EXPECT_EQ(want["scale"], 2048.0);
}

TEST(ConformanceState, V1AndV2FixturesLoad) {
  for (const char* name : {"grad_scaler_state_v1.json", "grad_scaler_state_v2.json"}) {
    GradScaler scaler;
    scaler.load_state_json(fixture(name));
    EXPECT_EQ(scaler.get_scale(), 2048.0f) << name;
    EXPECT_EQ(scaler.loss_scale().counters().growth_tracker, 3) << name;
    EXPECT_EQ(scaler.loss_scale().config().growth_interval, 7) << name;
  }
}

}  // namespace
}  // namespace mixprec::conformance
