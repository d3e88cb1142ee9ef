// mixprec::torch::Autocast: matmuls inside run in the chosen dtype, fp32 outside;
// nesting restores; the previous state comes back on exit, also on an exception.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <ATen/autocast_mode.h>

#include <stdexcept>

#include "mixprec/torch/autocast.hpp"

namespace {

using at::Tensor;
using mixprec::torch::Autocast;

at::ScalarType mm_dtype() {
  const Tensor a = ::torch::randn({8, 8});
  return ::torch::mm(a, a).scalar_type();
}

TEST(TorchAutocast, MatmulInsideInTheChosenDtypeOutsideInFp32) {
  for (const auto dt : {at::kHalf, at::kBFloat16}) {
    EXPECT_EQ(mm_dtype(), at::kFloat);
    {
      Autocast ac(at::kCPU, dt);
      EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
      EXPECT_EQ(mm_dtype(), dt);
      ::torch::nn::Linear lin(4, 4);
      EXPECT_EQ(lin(::torch::randn({2, 4})).scalar_type(), dt);
    }
    EXPECT_EQ(mm_dtype(), at::kFloat);
    EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  }
}

TEST(TorchAutocast, NestingRestoresEachLevel) {
  const at::ScalarType dtype0 = at::autocast::get_autocast_dtype(at::kCPU);
  {
    Autocast outer(at::kCPU, at::kBFloat16);
    {
      Autocast inner(at::kCPU, at::kHalf);
      EXPECT_EQ(mm_dtype(), at::kHalf);
      {
        Autocast off(at::kCPU, at::kHalf, false);
        EXPECT_EQ(mm_dtype(), at::kFloat);
      }
      EXPECT_EQ(mm_dtype(), at::kHalf);
    }
    EXPECT_EQ(mm_dtype(), at::kBFloat16);
    EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), at::kBFloat16);
  }
  EXPECT_EQ(mm_dtype(), at::kFloat);
  EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), dtype0);
}

TEST(TorchAutocast, PreviousStateRestoredOnException) {
  at::autocast::set_autocast_enabled(at::kCPU, true);  // a state set outside any guard
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  try {
    Autocast ac(at::kCPU, at::kHalf, true, false);
    EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), at::kBFloat16);
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  at::autocast::set_autocast_enabled(at::kCPU, false);
  EXPECT_EQ(mm_dtype(), at::kFloat);
}

TEST(TorchAutocast, RefusesOtherDevicesAndDtypes) {
  EXPECT_THROW(Autocast(at::kCPU, at::kFloat), std::invalid_argument);
  EXPECT_THROW(Autocast(at::kMeta, at::kHalf), std::invalid_argument);
  try {
    Autocast ac(at::kCPU, at::kDouble);
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "mixprec::torch::Autocast: dtype Double is not supported; use Half (fp16) or BFloat16 (bf16)");
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
}

}  // namespace
