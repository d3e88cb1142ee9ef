// ParamStore: every tensor of a model in one allocation (llm.c style).
//
// Regions, each a flat array of flat_size() elements, laid out one after the other
// in a single 64-byte aligned block:
//   master   fp32 master weights (absent in a master-less, "pure" store)
//   model    the weights the forward pass reads: f32, f16 or bf16
//   grads    the gradients the backward pass writes: f32, f16 or bf16
//   state    `state_slots` fp32 arrays of optimizer state (Adam: m, v; SGD momentum: buf)
// Tensor i occupies elements [offset(i), offset(i) + numel(i)) of every region;
// offsets are multiples of kAlignElements (32 elements: 64 bytes of a 16-bit region,
// 128 bytes of an fp32 one), and the padding between tensors is zero and stays zero
// through every optimizer step. Nothing is allocated after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "mixprec/formats/dtype.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/formats/dtype.hpp"

namespace mixprec {

// One named parameter tensor: its shape (row-major; the empty shape is a scalar;
// a zero dimension gives an empty tensor).
struct ParamSpec {
  std::string name;
  std::vector<std::size_t> shape;
};

struct StoreOptions {
  DType model = DType::f16;  // weights the forward pass reads
  DType grads = DType::f16;  // what the backward pass writes
  bool master = true;        // fp32 master weights; false: the model copy is the only weights ("pure")
  unsigned state_slots = 2;  // fp32 optimizer state arrays: 0 (SGD), 1 (SGD momentum), 2 (Adam, AdamW)
};

class ParamStore {
 public:
  static constexpr std::size_t kAlignElements = 32;
  static constexpr std::size_t kAlignBytes = 64;
  static constexpr unsigned kMaxStateSlots = 2;

  // Throws std::invalid_argument for: no tensors, an empty or duplicate name,
  // a state_slots above 2, or a size that overflows.
  ParamStore(std::vector<ParamSpec> specs, StoreOptions options);
  ParamStore(ParamStore&&) noexcept = default;
  ParamStore& operator=(ParamStore&&) noexcept = default;

  const StoreOptions& options() const noexcept { return options_; }
  bool has_master() const noexcept { return options_.master; }
  DType model_dtype() const noexcept { return options_.model; }
  DType grad_dtype() const noexcept { return options_.grads; }
  unsigned state_slots() const noexcept { return options_.state_slots; }

  std::size_t tensor_count() const noexcept { return specs_.size(); }
  const ParamSpec& spec(std::size_t i) const;
  std::size_t index_of(std::string_view name) const;  // throws std::invalid_argument naming the known names
  std::size_t numel(std::size_t i) const;
  std::size_t offset(std::size_t i) const;             // element offset in every region
  std::size_t param_count() const noexcept { return param_count_; }  // sum of numel
  std::size_t flat_size() const noexcept { return flat_size_; }      // padded length of each region
  std::size_t bytes() const noexcept { return bytes_; }              // the one allocation

  // Views of one tensor, by index or by name. Typed views check the dtype
  // (std::invalid_argument on a mismatch); master() throws in a pure store.
  std::span<float> master(std::size_t i);
  std::span<float> master(std::string_view name) { return master(index_of(name)); }
  std::span<const float> master(std::size_t i) const;
  std::span<float> state(unsigned slot, std::size_t i);
  std::span<const float> state(unsigned slot, std::size_t i) const;
  template <class T>
  std::span<T> model(std::size_t i) {
    check_view_type(sizeof(T), dtype_of<T>(), options_.model, "model");
    return {reinterpret_cast<T*>(model_ + offset(i) * dtype_size(options_.model)), numel(i)};
  }
  template <class T>
  std::span<T> model(std::string_view name) { return model<T>(index_of(name)); }
  template <class T>
  std::span<T> grads(std::size_t i) {
    check_view_type(sizeof(T), dtype_of<T>(), options_.grads, "grads");
    return {reinterpret_cast<T*>(grads_ + offset(i) * dtype_size(options_.grads)), numel(i)};
  }
  template <class T>
  std::span<T> grads(std::string_view name) { return grads<T>(index_of(name)); }

  // One GradTensor per tensor (exact sizes, store order), for unscale_and_check
  // over a model's gradients; built once, at construction.
  std::span<const GradTensor> grad_tensors() const noexcept { return grad_tensors_; }
  // The whole grads region, padding included (zeros), as one tensor.
  GradTensor flat_grads() noexcept { return {grads_, flat_size_, options_.grads}; }

  // Flat regions (flat_size() elements each); master_data() is nullptr in a pure store.
  float* master_data() noexcept { return master_; }
  const float* master_data() const noexcept { return master_; }
  void* model_data() noexcept { return model_; }
  const void* model_data() const noexcept { return model_; }
  void* grad_data() noexcept { return grads_; }
  const void* grad_data() const noexcept { return grads_; }
  float* state_data(unsigned slot);
  const float* state_data(unsigned slot) const;

  void zero_grads() noexcept;
  void zero_state() noexcept;
  // Model copy := round-to-nearest-even(master). Call after writing the master weights.
  void refresh_model();
  // The weights of record := flat (flat_size() fp32 values): the master weights and the model
  // copy rounded from them, or in a pure store the model weights rounded to their dtype.
  void set_weights_of_record(std::span<const float> flat);


 private:
  template <class T>
  static constexpr DType dtype_of() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, const float>) return DType::f32;
    else if constexpr (std::is_same_v<std::remove_const_t<T>, f16>) return DType::f16;
    else return DType::bf16;
  }
  static void check_view_type(std::size_t elem_size, DType want, DType have, const char* region);

  struct FreeAligned {
    void operator()(std::byte* p) const noexcept;
  };

  std::vector<ParamSpec> specs_;
  std::vector<std::size_t> numel_, offset_;
  StoreOptions options_;
  std::size_t param_count_ = 0, flat_size_ = 0, bytes_ = 0;
  std::unique_ptr<std::byte, FreeAligned> block_;
  float* master_ = nullptr;
  std::byte* model_ = nullptr;
  std::byte* grads_ = nullptr;
  float* state_[kMaxStateSlots] = {nullptr, nullptr};
  std::vector<GradTensor> grad_tensors_;
};

}  // namespace mixprec
