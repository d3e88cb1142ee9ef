// The conformance cases (scaler/conformance/cases.json) against mixprec::torch::GradScaler
// over libtorch tensors and torch::optim::SGD.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "scaler/conformance/conformance.hpp"
#include "mixprec/torch/grad_scaler.hpp"

namespace mixprec::conformance {
namespace {

at::ScalarType torch_dtype(DType d) {
  switch (d) {
    case DType::f32: return at::kFloat;
    case DType::f16: return at::kHalf;
    case DType::bf16: return at::kBFloat16;
  }
  return at::kFloat;
}

// SGD that raises once when asked (an optimizer that throws mid-step, LBFGS without a closure).
class ThrowingSGD final : public ::torch::optim::SGD {
 public:
  using SGD::SGD;
  bool throw_once = false;
  at::Tensor step(LossClosure closure = nullptr) override {
    if (throw_once) {
      throw_once = false;
      throw OptimizerRaised();
    }
    return SGD::step(std::move(closure));
  }
};

class TorchDoor final : public ScalerDoorCalls<torch::GradScaler> {
 public:
  explicit TorchDoor(const CaseSetup& s) : ScalerDoorCalls(s.config, s.enabled) {
    for (const auto& dtypes : s.optimizers) {
      std::vector<at::Tensor> ps;
      for (std::size_t j = 0; j < dtypes.size(); ++j) {
        at::Tensor p = (::torch::arange(1, 5, at::kFloat) * 0.25 + 0.125 * static_cast<double>(j))
                           .to(torch_dtype(dtypes[j]))
                           .set_requires_grad(true);
        ps.push_back(p);
      }
      opts_.push_back(std::make_unique<ThrowingSGD>(ps, ::torch::optim::SGDOptions(1.0 / 16)));
      params_.push_back(ps);
    }
  }

  void set_grads(std::size_t opt, const Values& values) override {
    for (std::size_t j = 0; j < values.size(); ++j) {
      at::Tensor& p = params_.at(opt).at(j);
      if (!values[j]) {
        p.mutable_grad() = at::Tensor();
        continue;
      }
      const std::vector<double>& v = *values[j];
      p.mutable_grad() = ::torch::tensor(v, at::kDouble).to(p.scalar_type());
    }
  }

  std::vector<std::vector<double>> grads(std::size_t opt) override {
    std::vector<std::vector<double>> out;
    for (const at::Tensor& p : params_.at(opt)) {
      if (!p.grad().defined()) continue;
      const at::Tensor d = p.grad().to(at::kDouble).contiguous();
      out.emplace_back(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
    }
    return out;
  }

  std::vector<std::uint64_t> weight_bits(std::size_t opt) override {
    std::vector<std::uint64_t> bits;
    for (const at::Tensor& p : params_.at(opt)) {
      const at::Tensor d = p.detach().to(at::kDouble).contiguous();
      for (std::int64_t k = 0; k < d.numel(); ++k) bits.push_back(std::bit_cast<std::uint64_t>(d.data_ptr<double>()[k]));
    }
    return bits;
  }

  void unscale(std::size_t opt) override { scaler_->unscale(*opts_.at(opt)); }
  Outcome step(std::size_t opt) override {
    const torch::StepOutcome o = scaler_->step(*opts_.at(opt));
    return {o.applied, o.found_inf, o.first_overflow};
  }
  void throw_next_step(std::size_t opt) override { opts_.at(opt)->throw_once = true; }

 private:
  std::vector<std::vector<at::Tensor>> params_;
  std::vector<std::unique_ptr<ThrowingSGD>> opts_;
};

class TorchConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(TorchConformance, Libtorch) {
  run_case("libtorch", GetParam(), [](const CaseSetup& s) { return std::make_unique<TorchDoor>(s); });
}

INSTANTIATE_TEST_SUITE_P(Cases, TorchConformance, ::testing::ValuesIn(case_names("libtorch")),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace mixprec::conformance
