#include "mixprec/optim/param_store.hpp"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "mixprec/formats/bulk.hpp"

namespace mixprec {
namespace {

std::size_t checked_mul(std::size_t a, std::size_t b, const std::string& what) {
  if (b != 0 && a > std::numeric_limits<std::size_t>::max() / b)
    throw std::invalid_argument("ParamStore: " + what + " overflows size_t");
  return a * b;
}
std::size_t checked_add(std::size_t a, std::size_t b, const std::string& what) {
  if (a > std::numeric_limits<std::size_t>::max() - b) throw std::invalid_argument("ParamStore: " + what + " overflows size_t");
  return a + b;
}

}  // namespace

void ParamStore::FreeAligned::operator()(std::byte* p) const noexcept { std::free(p); }

ParamStore::ParamStore(std::vector<ParamSpec> specs, StoreOptions options)
    : specs_(std::move(specs)), options_(options) {
  if (specs_.empty()) throw std::invalid_argument("ParamStore: expected at least one tensor, found none");
  if (options_.state_slots > kMaxStateSlots)
    throw std::invalid_argument("ParamStore: state_slots must be 0, 1 or 2, found " +
                                std::to_string(options_.state_slots));
  if (options_.model != DType::f32 && options_.model != DType::f16 && options_.model != DType::bf16)
    throw std::invalid_argument("ParamStore: model dtype must be f32, f16 or bf16");
  if (options_.grads != DType::f32 && options_.grads != DType::f16 && options_.grads != DType::bf16)
    throw std::invalid_argument("ParamStore: grads dtype must be f32, f16 or bf16");
  numel_.reserve(specs_.size());
  offset_.reserve(specs_.size());
  std::size_t at = 0;
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& s = specs_[i];
    if (s.name.empty()) throw std::invalid_argument("ParamStore: tensor " + std::to_string(i) + " has an empty name");
    for (std::size_t j = 0; j < i; ++j)
      if (specs_[j].name == s.name)
        throw std::invalid_argument("ParamStore: duplicate tensor name '" + s.name + "' (tensors " +
                                    std::to_string(j) + " and " + std::to_string(i) + ")");
    std::size_t n = 1;
    for (std::size_t d : s.shape) n = checked_mul(n, d, "the size of tensor '" + s.name + "'");
    numel_.push_back(n);
    offset_.push_back(at);
    param_count_ = checked_add(param_count_, n, "the parameter count");
    const std::size_t padded = checked_add(n, kAlignElements - 1, "the padded size") / kAlignElements * kAlignElements;
    at = checked_add(at, padded, "the padded size");
  }
  flat_size_ = at;
  const StateFormats& f = options_.formats;
  validate(f);
  if (f.master == MasterFormat::none)
    throw std::invalid_argument("ParamStore: formats.master none: expected fp32 or remainder (a store without "
                                "masters is master = false)");
  if (f.master == MasterFormat::remainder && (!options_.master || options_.model != DType::bf16))
    throw std::invalid_argument(std::string("ParamStore: master remainder: expected master weights and bf16 model "
                                            "weights, found ") +
                                (options_.master ? "" : "no master, ") + std::string(dtype_name(options_.model)) +
                                " weights");
  compact_ = f.m != MomentFormat::fp32 || f.v != MomentFormat::fp32;
  if (compact_ && options_.state_slots != 2)
    throw std::invalid_argument("ParamStore: moment formats " + std::string(moment_format_name(f.m)) + ", " +
                                std::string(moment_format_name(f.v)) + ": expected Adam's 2 state slots, found " +
                                std::to_string(options_.state_slots));
  const bool remainder = options_.master && f.master == MasterFormat::remainder;
  master_bytes_ = options_.master ? checked_mul(flat_size_, remainder ? 2 : 4, "the master region") : 0;
  const std::size_t master_region = (master_bytes_ + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
  const std::size_t model_bytes = checked_mul(flat_size_, dtype_size(options_.model), "the model region");
  const std::size_t grad_bytes = checked_mul(flat_size_, dtype_size(options_.grads), "the grads region");
  std::size_t state_bytes = 0;
  for (unsigned k = 0; k < options_.state_slots; ++k) {
    if (!compact_) {
      state_slot_bytes_[k] = checked_mul(flat_size_, 4, "the state region");
    } else {
      // Per tensor: codes (64-byte aligned), then all the slot's scales.
      std::size_t codes = 0, scales = 0;
      for (std::size_t i = 0; i < specs_.size(); ++i) {
        const MomentLayout l = moment_layout(k == 0 ? f.m : f.v, k == 0, numel_[i], f);
        layouts_[k].push_back(l);
        code_offset_[k].push_back(codes);
        scale_offset_[k].push_back(scales);
        codes = checked_add(codes, (l.code_bytes() + kAlignBytes - 1) / kAlignBytes * kAlignBytes, "the state region");
        scales = checked_add(scales, l.scale_count(), "the state region");
      }
      codes_bytes_[k] = codes;  // the slot's scales follow its codes
      state_slot_bytes_[k] = checked_add(codes, checked_mul(scales, 4, "the state region"), "the state region");
      state_slot_bytes_[k] = (state_slot_bytes_[k] + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
    }
    state_bytes = checked_add(state_bytes, state_slot_bytes_[k], "the state region");
  }
  // Every region's size is a multiple of 64 bytes.
  bytes_ = checked_add(checked_add(master_region, model_bytes, "the store"), checked_add(grad_bytes, state_bytes, "the store"),
                       "the store");
  void* raw = std::aligned_alloc(kAlignBytes, bytes_ == 0 ? kAlignBytes : bytes_);
  if (raw == nullptr) throw std::bad_alloc();
  block_.reset(static_cast<std::byte*>(raw));
  std::memset(raw, 0, bytes_);
  std::byte* p = block_.get();
  if (options_.master) {
    if (remainder) remainder_ = reinterpret_cast<std::int16_t*>(p);
    else master_ = reinterpret_cast<float*>(p);
    p += master_region;
  }
  model_ = p;
  p += model_bytes;
  grads_ = p;
  p += grad_bytes;
  const std::size_t es = dtype_size(options_.grads);
  grad_tensors_.reserve(specs_.size());
  for (std::size_t i = 0; i < specs_.size(); ++i) grad_tensors_.push_back({grads_ + offset_[i] * es, numel_[i], options_.grads});
  for (unsigned k = 0; k < options_.state_slots; ++k) {
    if (compact_) compact_state_[k] = p;
    else state_[k] = reinterpret_cast<float*>(p);
    p += state_slot_bytes_[k];
  }
}

const ParamSpec& ParamStore::spec(std::size_t i) const {
  if (i >= specs_.size())
    throw std::invalid_argument("ParamStore: tensor index " + std::to_string(i) + " out of range (" +
                                std::to_string(specs_.size()) + " tensors)");
  return specs_[i];
}

std::size_t ParamStore::index_of(std::string_view name) const {
  for (std::size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return i;
  std::string known;
  for (const ParamSpec& s : specs_) known += (known.empty() ? "" : ", ") + s.name;
  throw std::invalid_argument("ParamStore: no tensor named '" + std::string(name) + "'; tensors: " + known);
}

std::size_t ParamStore::numel(std::size_t i) const { return (void)spec(i), numel_[i]; }
std::size_t ParamStore::offset(std::size_t i) const { return (void)spec(i), offset_[i]; }

namespace {
void require_fp32_master(bool master, const std::int16_t* remainder) {
  if (!master) throw std::invalid_argument("ParamStore: expected a store with master weights, found a pure one");
  if (remainder != nullptr)
    throw std::invalid_argument("ParamStore: expected fp32 master weights, found remainder masters (use remainder() or "
                                "weights_of_record())");
}
}  // namespace

std::span<float> ParamStore::master(std::size_t i) {
  require_fp32_master(options_.master, remainder_);
  return {master_ + offset(i), numel(i)};
}
std::span<const float> ParamStore::master(std::size_t i) const {
  require_fp32_master(options_.master, remainder_);
  return {master_ + offset(i), numel(i)};
}

std::span<std::int16_t> ParamStore::remainder(std::size_t i) {
  if (remainder_ == nullptr) throw std::invalid_argument("ParamStore: expected remainder masters, found " +
                                                         std::string(master_format_name(master_format())));
  return {remainder_ + offset(i), numel(i)};
}
std::span<const std::int16_t> ParamStore::remainder(std::size_t i) const {
  return const_cast<ParamStore*>(this)->remainder(i);
}

MomentView ParamStore::moment(unsigned slot, std::size_t i) {
  if (slot >= options_.state_slots)
    throw std::invalid_argument("ParamStore: state slot " + std::to_string(slot) + " out of range (" +
                                std::to_string(options_.state_slots) + " slots)");
  MomentView v;
  if (!compact_) {
    v.layout.numel = numel(i);
    v.layout.is_signed = slot == 0;
    v.codes = state_[slot] + offset(i);
    return v;
  }
  (void)spec(i);
  v.layout = layouts_[slot][i];
  v.codes = compact_state_[slot] + code_offset_[slot][i];
  v.scales = reinterpret_cast<float*>(compact_state_[slot] + codes_bytes_[slot]) + scale_offset_[slot][i];
  return v;
}

std::size_t ParamStore::state_slot_bytes(unsigned slot) const {
  if (slot >= options_.state_slots)
    throw std::invalid_argument("ParamStore: state slot " + std::to_string(slot) + " out of range (" +
                                std::to_string(options_.state_slots) + " slots)");
  return state_slot_bytes_[slot];
}

void ParamStore::weights_of_record(std::span<float> flat) const {
  if (flat.size() != flat_size_)
    throw std::invalid_argument("ParamStore::weights_of_record: expected " + std::to_string(flat_size_) +
                                " values, found " + std::to_string(flat.size()));
  if (master_ != nullptr) {
    std::memcpy(flat.data(), master_, flat_size_ * 4);
  } else if (remainder_ != nullptr) {
    join_master(static_cast<const std::uint16_t*>(static_cast<const void*>(model_)), remainder_, flat.data(), flat_size_);
  } else {
    switch (options_.model) {
      case DType::f32: std::memcpy(flat.data(), model_, flat_size_ * 4); break;
      case DType::f16: convert(std::span<const f16>(reinterpret_cast<const f16*>(model_), flat_size_), flat); break;
      case DType::bf16: convert(std::span<const bf16>(reinterpret_cast<const bf16*>(model_), flat_size_), flat); break;
    }
  }
}

float* ParamStore::state_data(unsigned slot) {
  if (slot >= options_.state_slots)
    throw std::invalid_argument("ParamStore: state slot " + std::to_string(slot) + " out of range (" +
                                std::to_string(options_.state_slots) + " slots)");
  if (compact_)
    throw std::invalid_argument("ParamStore: state slot " + std::to_string(slot) + " holds " +
                                std::string(moment_format_name(slot == 0 ? options_.formats.m : options_.formats.v)) +
                                " moments, not an fp32 array (use moment())");
  return state_[slot];
}
const float* ParamStore::state_data(unsigned slot) const { return const_cast<ParamStore*>(this)->state_data(slot); }

std::span<float> ParamStore::state(unsigned slot, std::size_t i) { return {state_data(slot) + offset(i), numel(i)}; }
std::span<const float> ParamStore::state(unsigned slot, std::size_t i) const {
  return {state_data(slot) + offset(i), numel(i)};
}

void ParamStore::check_view_type(std::size_t elem_size, DType want, DType have, const char* region) {
  if (want != have || elem_size != dtype_size(have))
    throw std::invalid_argument(std::string("ParamStore: ") + region + " view of type " +
                                std::string(dtype_name(want)) + " requested, but the " + region + " region holds " +
                                std::string(dtype_name(have)));
}

void ParamStore::zero_grads() noexcept { std::memset(grads_, 0, flat_size_ * dtype_size(options_.grads)); }

void ParamStore::zero_state() noexcept {
  for (unsigned s = 0; s < options_.state_slots; ++s)
    std::memset(compact_ ? compact_state_[s] : reinterpret_cast<std::byte*>(state_[s]), 0, state_slot_bytes_[s]);
}

void ParamStore::refresh_model() {
  if (!options_.master || remainder_ != nullptr) return;
  switch (options_.model) {
    case DType::f32: std::memcpy(model_, master_, flat_size_ * 4); break;
    case DType::f16:
      convert(std::span<const float>(master_, flat_size_), std::span<f16>(reinterpret_cast<f16*>(model_), flat_size_));
      break;
    case DType::bf16:
      convert(std::span<const float>(master_, flat_size_), std::span<bf16>(reinterpret_cast<bf16*>(model_), flat_size_));
      break;
  }
}

void ParamStore::set_weights_of_record(std::span<const float> flat) {
  if (flat.size() != flat_size_)
    throw std::invalid_argument("ParamStore::set_weights_of_record: expected " + std::to_string(flat_size_) +
                                " values, found " + std::to_string(flat.size()));
  if (remainder_ != nullptr) {
    split_master(flat.data(), static_cast<std::uint16_t*>(static_cast<void*>(model_)), remainder_, flat_size_);
    return;
  }
  if (options_.master) {
    std::memcpy(master_, flat.data(), flat_size_ * 4);
    refresh_model();
    return;
  }
  switch (options_.model) {
    case DType::f32: std::memcpy(model_, flat.data(), flat_size_ * 4); break;
    case DType::f16: convert(flat, std::span<f16>(reinterpret_cast<f16*>(model_), flat_size_)); break;
    case DType::bf16: convert(flat, std::span<bf16>(reinterpret_cast<bf16*>(model_), flat_size_)); break;
  }
}

}  // namespace mixprec
