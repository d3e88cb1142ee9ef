// ParamStore: every tensor of a model in one allocation (llm.c style).
//
// Regions, each a flat array of flat_size() elements, laid out one after the other
// in a single 64-byte aligned block:
//   master   fp32 master weights (absent in a master-less, "pure" store)
//   model    the weights the forward pass reads: f32, f16 or bf16
//   grads    the gradients the backward pass writes: f32, f16 or bf16
//   state    `state_slots` fp32 arrays of optimizer state (Adam: m, v; SGD momentum: buf)
// With StoreOptions::formats (optim/state_format.hpp) the master region may hold int16
// remainders (bf16 weights + remainder = the fp32 master, exactly) and Adam's two state slots
// may hold compact moments: per tensor its codes (64-byte aligned) and its fp32 scales.
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
#include "mixprec/optim/state_format.hpp"

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
  // Master and moment formats: master remainder needs master = true and bf16 weights; moments
  // other than fp32 need 2 state slots. (formats.master none: use master = false.)
  StateFormats formats{};
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
  // fp32 or remainder in a store with master weights, none in a pure store.
  MasterFormat master_format() const noexcept {
    return options_.master ? options_.formats.master : MasterFormat::none;
  }
  // Whether Adam's moments are stored in a format other than fp32 (state(), state_data() refuse).
  bool compact_moments() const noexcept { return compact_; }

  std::size_t tensor_count() const noexcept { return specs_.size(); }
  const ParamSpec& spec(std::size_t i) const;
  std::size_t index_of(std::string_view name) const;  // throws std::invalid_argument naming the known names
  std::size_t numel(std::size_t i) const;
  std::size_t offset(std::size_t i) const;             // element offset in every region
  std::size_t param_count() const noexcept { return param_count_; }  // sum of numel
  std::size_t flat_size() const noexcept { return flat_size_; }      // padded length of each region
  std::size_t bytes() const noexcept { return bytes_; }              // the one allocation

  // Views of one tensor, by index or by name. Typed views check the dtype
  // (std::invalid_argument on a mismatch); master() throws in a pure store and under
  // remainder masters (remainder() gives those; weights_of_record() the fp32 values).
  std::span<float> master(std::size_t i);
  std::span<float> master(std::string_view name) { return master(index_of(name)); }
  std::span<const float> master(std::size_t i) const;
  std::span<float> state(unsigned slot, std::size_t i);
  std::span<const float> state(unsigned slot, std::size_t i) const;
  std::span<std::int16_t> remainder(std::size_t i);
  std::span<const std::int16_t> remainder(std::size_t i) const;
  // Slot 0 (m) or 1 (v) of tensor i in any format (fp32 too) as the fused step reads it.
  MomentView moment(unsigned slot, std::size_t i);
  // The bytes one state slot holds (codes and scales, or the fp32 array): what it costs.
  std::size_t state_slot_bytes(unsigned slot) const;
  std::size_t master_bytes() const noexcept { return master_bytes_; }
  // The fp32 weights of record into `flat` (flat_size() values): the master, rebuilt from
  // the remainder, or the model weights decoded in a pure store.
  void weights_of_record(std::span<float> flat) const;
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

  // Flat regions (flat_size() elements each); master_data() is nullptr in a pure store and
  // under remainder masters (remainder_data(): flat_size() int16 values).
  float* master_data() noexcept { return master_; }
  const float* master_data() const noexcept { return master_; }
  std::int16_t* remainder_data() noexcept { return remainder_; }
  const std::int16_t* remainder_data() const noexcept { return remainder_; }
  void* model_data() noexcept { return model_; }
  const void* model_data() const noexcept { return model_; }
  void* grad_data() noexcept { return grads_; }
  const void* grad_data() const noexcept { return grads_; }
  float* state_data(unsigned slot);
  const float* state_data(unsigned slot) const;

  void zero_grads() noexcept;
  void zero_state() noexcept;
  // Model copy := round-to-nearest-even(master). Call after writing the master weights.
  // (Remainder masters: nothing to do; the model weights are half of the master.)
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
  // Remainder masters and compact moments.
  std::int16_t* remainder_ = nullptr;
  std::size_t master_bytes_ = 0;
  bool compact_ = false;
  std::byte* compact_state_[kMaxStateSlots] = {nullptr, nullptr};
  std::size_t state_slot_bytes_[kMaxStateSlots] = {0, 0};
  std::vector<MomentLayout> layouts_[kMaxStateSlots];
  std::vector<std::size_t> code_offset_[kMaxStateSlots], scale_offset_[kMaxStateSlots];  // bytes, floats
  std::size_t codes_bytes_[kMaxStateSlots] = {0, 0};  // where each compact slot's scales start
};

}  // namespace mixprec
