// Optimizer state in fewer bytes: the formats of the master weights and of Adam's moments,
// and the fused AdamW step of one tensor over them (docs/optimizers.md, "State formats").
//
// Each format follows the system that defines it:
//   master   fp32        4 bytes a parameter
//            remainder   bf16 weights + the low 16 bits of the fp32 master, which rebuild it exactly
//                        (Transformer Engine's store_param_remainders: the bf16 weight is the fp32
//                        value's top half rounded half away from zero, the remainder a signed int16)
//            none        the 16-bit weights are the only copy (nearest-even or stochastic rounding)
//   moments  fp32        4 bytes
//            bf16        a plain round-to-nearest-even cast (TE)
//            fp16        one fp32 scale per tensor, absmax / 32752, stored x * (1 / scale) (TE)
//            fp8         E4M3; per block of 256 (default): scale = max(absmax, 1e-12) / 448, stored
//                        x / scale (torchao AdamWFp8); per tensor (block 0): TE's absmax / 448
//            8bit        dynamic-tree code map, per block of 256: scale = max(absmax, 1e-12), the code
//                        of x / scale nearest in torchao's rule (torchao AdamW8bit)
//            4bit        the 4-bit map, per block of 128, two codes a byte (torchao AdamW4bit)
// Blocked formats keep fp32 moments for a tensor of fewer than 4096 elements or one whose size is
// not a multiple of the block, as torchao does.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/dtype.hpp"

namespace mixprec {

class ThreadPool;  // core/parallel.hpp

enum class MasterFormat : std::uint8_t { fp32, remainder, none };
enum class MomentFormat : std::uint8_t { fp32, bf16, fp16, fp8, q8, q4 };
// Whose arithmetic the fp32 update follows (docs/optimizers.md writes each out).
enum class AdamRule : std::uint8_t { torch, torchao, te };

std::string_view master_format_name(MasterFormat f) noexcept;  // "fp32", "remainder", "none"
std::string_view moment_format_name(MomentFormat f) noexcept;  // "fp32", "bf16", "fp16", "fp8", "8bit", "4bit"
std::string_view adam_rule_name(AdamRule r) noexcept;          // "torch", "torchao", "te"
std::optional<MasterFormat> parse_master_format(std::string_view s) noexcept;
std::optional<MomentFormat> parse_moment_format(std::string_view s) noexcept;
std::optional<AdamRule> parse_adam_rule(std::string_view s) noexcept;
// "fp32, remainder, none" and "fp32, bf16, fp16, fp8, 8bit, 4bit": for error messages.
std::string master_format_names();
std::string moment_format_names();

// The formats of one optimizer's state, chosen once (config, CLI, Python) and echoed in reports.
struct StateFormats {
  MasterFormat master = MasterFormat::fp32;
  MomentFormat m = MomentFormat::fp32;
  MomentFormat v = MomentFormat::fp32;
  std::size_t block = 0;  // elements per scale of fp8/8bit/4bit: 0 (the format's default: 256, 256, 128)
                          // or a power of two in [32, 1024]
  bool fp8_per_tensor = false;  // fp8 with one scale per tensor (TE) instead of blocks
  AdamRule rule = AdamRule::torch;
  friend bool operator==(const StateFormats&, const StateFormats&) = default;
};
// Throws std::invalid_argument naming the field: a block that is not 0 or a power of two in
// [32, 1024], fp8_per_tensor without an fp8 moment.
void validate(const StateFormats& f);

// How one moment of one tensor is stored: `format` after torchao's fallback rule (fp32 for small
// or uneven tensors), its code bytes and its fp32 scales.
struct MomentLayout {
  MomentFormat format = MomentFormat::fp32;
  bool is_signed = true;      // m: signed code map; v: unsigned
  std::size_t numel = 0;
  std::size_t block = 0;      // elements per scale (numel for one scale per tensor; 0 without scales)
  bool per_tensor = false;    // TE's per-tensor rule (fp16, and fp8 with fp8_per_tensor)
  std::size_t code_bytes() const noexcept;
  std::size_t scale_count() const noexcept;
};
MomentLayout moment_layout(MomentFormat f, bool is_signed, std::size_t numel, const StateFormats& formats) noexcept;

// Bytes per parameter of each part for large tensors (no fallback, no padding, scales included).
struct StateBytes {
  double master = 0, m = 0, v = 0;
  double total() const noexcept { return master + m + v; }
};
StateBytes state_bytes_per_param(const StateFormats& f) noexcept;
// Bytes of one moment of `numel` parameters held as one flat range (codes and scales, no
// torchao fallback): what memory plans count.
std::uint64_t moment_bytes(MomentFormat m, std::uint64_t numel, const StateFormats& f) noexcept;
// Bytes per parameter of a master format: 4, 2 or 0.
unsigned master_bytes_per_param(MasterFormat m) noexcept;

// torchao's code maps (quant_utils.create_dynamic_map and subclass_4bit's unsigned map), sorted.
std::span<const float> moment_code_map(MomentFormat f, bool is_signed) noexcept;  // q8: 256 values, q4: 16

// One moment's storage, as pointers into memory the caller owns.
struct MomentView {
  MomentLayout layout;
  void* codes = nullptr;    // code_bytes() bytes
  float* scales = nullptr;  // scale_count() floats
};

// Quantize n = layout.numel values (scales computed from them) and back: the state formats'
// scalar definitions, for tests, the Python door's state_dict and checkpoints.
void quantize_moment(const float* x, const MomentView& out);
void dequantize_moment(const MomentView& in, float* x);

// The remainder format's split of fp32 masters into bf16 weight bits and int16 remainders, and back
// (exact for every fp32 bit pattern).
void split_master(const float* master, std::uint16_t* bf16_bits, std::int16_t* remainder, std::size_t n) noexcept;
void join_master(const std::uint16_t* bf16_bits, const std::int16_t* remainder, float* master, std::size_t n) noexcept;

// One tensor's parameters, gradient and state for the fused step.
struct AdamTensor {
  std::size_t n = 0;
  DType grad_dtype = DType::f32;
  const void* grad = nullptr;
  DType weight_dtype = DType::f32;  // the weights the model reads
  void* weight = nullptr;
  MasterFormat master = MasterFormat::fp32;
  float* master_f32 = nullptr;            // MasterFormat::fp32 (nullptr when weight is f32: it is the master)
  std::int16_t* remainder = nullptr;      // MasterFormat::remainder (weight must be bf16)
  MomentView m, v;
  std::uint64_t first_index = 0;          // stochastic rounding: the flat index of element 0
};

struct AdamHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  bool decoupled = true;  // AdamW; false: Adam with L2 added to the gradient
};

struct AdamStepArgs {
  AdamHyper hyper;
  std::int64_t step = 1;  // t, the applied steps including this one
  float inv_scale = 1.0f;
  float clip_coef = 1.0f;
  AdamRule rule = AdamRule::torch;
  bool stochastic = false;  // MasterFormat::none with 16-bit weights: stochastic rounding
  std::uint64_t seed = 0;
};

// Checks what the kernel assumes (std::invalid_argument naming the field): sizes, pointers,
// formats against dtypes, finite controls. Call before adam_tensor_step.
void validate(const AdamTensor& t, const AdamStepArgs& a);

// The fused AdamW step of one tensor: read the scaled gradient, unscale, clip, update from the
// dequantized state, re-quantize the state, write the master (or its remainder) and the weights.
// Blocked moments: one pass. Per-tensor scaled moments: a first pass finds the new absmax (nothing
// written), the second writes. Never allocates. `isa` picks the back end of the conversions and
// of the update loop; every back end gives the same bits.
// What a step did to one tensor, for telemetry (adam_tensor_step fills it when given one):
// the moments' quantization error (sums over elements of (stored - exact)^2 and exact^2, the
// exact value being the fp32 moment the update computed), and the lost updates: of the
// elements the step meant to move (new m != 0, or decoupled weight decay on a nonzero weight),
// those whose weights of record (the fp32 master, rebuilt or not, or the only 16-bit copy)
// did not change.
struct AdamStepStats {
  double m_err_sq = 0, m_sq = 0, v_err_sq = 0, v_sq = 0;
  std::uint64_t meant = 0, lost = 0;
  double m_relative_error() const noexcept;  // sqrt(m_err_sq / m_sq), 0 when m_sq is 0
  double v_relative_error() const noexcept;
  double lost_fraction() const noexcept;     // lost / meant, 0 when nothing was meant to move
};

// pool: the tensor's pieces (64 Ki elements) split over its workers; the same bits with any
// number of threads, or none (nullptr: the caller's thread).
void adam_tensor_step(const AdamTensor& t, const AdamStepArgs& a, Isa isa = active_isa(),
                      AdamStepStats* stats = nullptr, ThreadPool* pool = nullptr);

}  // namespace mixprec
