// The conformance cases (scaler/conformance/cases.json) against mixprec::GradScaler over
// ParamStore views and mixprec::SGD.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "conformance/conformance.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/param_store.hpp"
#include "mixprec/scaler/grad_scaler.hpp"

namespace mixprec::conformance {
namespace {

class CoreDoor final : public Door {
 public:
  explicit CoreDoor(const CaseSetup& s) : scaler_(std::make_unique<GradScaler>(s.config, s.enabled)) {
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
  void update() override { scaler_->update(); }
  double scale() override { return scaler_->get_scale(); }
  double next_scale() override { return scaler_->next_scale(); }
  void backward_done() override { scaler_->backward_done(); }
  void set_accumulation_steps(int k) override { scaler_->set_accumulation_steps(k); }
  std::string state_json() override { return scaler_->state_json(); }
  void load_state_json(const std::string& text) override { scaler_->load_state_json(text); }
  void reconfigure(const std::string& key, const std::string& value) override { scaler_->reconfigure(key, value); }
  void fresh_scaler(const LossScaleConfig& config, bool enabled) override {
    scaler_ = std::make_unique<GradScaler>(config, enabled);
  }
  void throw_next_step(std::size_t) override { throw std::logic_error("mixprec's optimizers do not throw"); }

 private:
  std::unique_ptr<GradScaler> scaler_;
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
