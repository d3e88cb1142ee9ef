// mixprec::torch::Autocast: an RAII guard over ATen's autocast state, the C++
// counterpart of Python's `with torch.autocast(device_type, dtype):` (docs/libtorch.md).
//
//   {
//     mixprec::torch::Autocast ac(at::kCPU, at::kHalf);   // or at::kCUDA, at::kBFloat16
//     auto y = model->forward(x);                         // matmuls, linear, conv in fp16
//   }                                                     // previous state back
//
// On construction: records the device's autocast state (enabled, dtype, cache enabled),
// enables autocast for the device (or disables it with enabled = false), sets the dtype
// and increments ATen's nesting counter. On destruction (also during stack unwinding):
// restores the recorded state and, when the nesting counter drops to 0 (the outermost
// guard), clears ATen's cast cache. Guards nest like Python's context managers.
//
// Throws std::invalid_argument for a device other than CPU and CUDA, a dtype other than
// fp16 and bf16, or CUDA when this libtorch has no CUDA support.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace mixprec::torch {

class Autocast {
 public:
  Autocast(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true, bool cache_enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

  c10::DeviceType device() const noexcept { return device_; }

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

}  // namespace mixprec::torch
