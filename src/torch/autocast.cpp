#include "mixprec/torch/autocast.hpp"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

#include <stdexcept>
#include <string>

namespace mixprec::torch {

Autocast::Autocast(c10::DeviceType device, c10::ScalarType dtype, bool enabled, bool cache_enabled) : device_(device) {
  if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) {
    throw std::invalid_argument("mixprec::torch::Autocast: device " + c10::DeviceTypeName(device, true) +
                                " is not supported; use CPU or CUDA");
  }
  if (dtype != c10::ScalarType::Half && dtype != c10::ScalarType::BFloat16) {
    throw std::invalid_argument(std::string("mixprec::torch::Autocast: dtype ") + c10::toString(dtype) +
                                " is not supported; use Half (fp16) or BFloat16 (bf16)");
  }
  if (device == c10::DeviceType::CUDA && !at::globalContext().hasCUDA()) {
    throw std::invalid_argument("mixprec::torch::Autocast: CUDA requested but this libtorch has no CUDA support "
                                "loaded (link libtorch_cuda)");
  }
  prev_enabled_ = at::autocast::is_autocast_enabled(device);
  prev_dtype_ = at::autocast::get_autocast_dtype(device);
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
  at::autocast::increment_nesting();
}

// Python's torch.autocast.__exit__ order: clear the cache when the outermost exits, then restore.
Autocast::~Autocast() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace mixprec::torch
