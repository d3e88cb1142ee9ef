// The precision policy (the seeds' "autocast"): which format each kind of tensor
// is stored in during training. Every op computes in fp32 on values read from its
// inputs' storage format and rounds its output, once, to the activation format; so
// underflow and overflow happen at the same op boundaries as on a GPU that stores
// activations in fp16/bf16. The op-by-op table is in docs/training.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/dtype.hpp"
#include "mixprec/lowp/quantize.hpp"

namespace mixprec::nn {

// The presets, one row each in the precision table (src/nn/precision.cpp): the engine's
// `--precision`, the memory planner's (nn/memory.hpp) and every list of their names read
// its rows. A new preset is an enumerator and a row (its storage formats and fp8 recipe).
enum class Precision : std::uint8_t {
  fp32,       // everything fp32 (the baseline)
  fp16,       // mixed: fp16 activations and weight copy, fp32 master weights and weight gradients
  bf16,       // mixed: bf16 activations and weight copy, fp32 master weights and weight gradients
  fp16_pure,  // fp16 everywhere the model lives: weights (no master copy), weight gradients, activations
  bf16_pure,  // bf16 everywhere the model lives, as fp16_pure
  // bf16 mixed, and the Linear layers of the blocks run their GEMMs on fp8-quantized
  // operands (docs/fp8.md, "fp8 in the engine"):
  fp8_noscale,  // every fp8 scale fixed at 1 ("fp8 without scaling")
  fp8_delayed,  // per-tensor delayed scaling (amax history)
  fp8_current,  // per-tensor current (just-in-time) scaling
  mxfp8,        // MX blocks of 32 values with E8M0 scales
  // The same arrangement with the other recipes of docs/low_precision.md (lowp::quantize):
  fp8_block,    // FP8 in 1x128 blocks, 128x128 weight tiles, fp32 scales (TE Float8BlockScaling)
  nvfp4,        // E2M1 in blocks of 16 with E4M3 scales and a tensor scale (TE NVFP4BlockScaling)
  mxfp4,        // E2M1 in blocks of 32 with E8M0 scales
};

// "fp32", "fp16", "bf16", "fp16-pure", "bf16-pure", "fp8-noscale", "fp8-delayed", "fp8-current", "mxfp8",
// "fp8-block", "nvfp4", "mxfp4"
std::string_view precision_name(Precision p) noexcept;
std::optional<Precision> parse_precision(std::string_view s) noexcept;
const std::vector<std::string>& precision_names();  // in the table's order
const std::vector<Precision>& all_precisions();     // in the table's order
// One line on what the preset stores where (help text, docs).
std::string_view precision_doc(Precision p) noexcept;

struct PrecisionPolicy {
  DType activations = DType::f32;   // stored activations and activation gradients
  DType weights = DType::f32;       // the weights the forward pass reads (ParamStore model region)
  DType weight_grads = DType::f32;  // ParamStore grads region
  bool master = false;              // fp32 master weights that the optimizer updates

  bool low_precision() const noexcept { return activations != DType::f32; }
  friend bool operator==(const PrecisionPolicy&, const PrecisionPolicy&) = default;
};

PrecisionPolicy policy_of(Precision p) noexcept;

// How a low-precision preset quantizes the Linear layers' GEMM operands: one of lowp's
// recipes (the one recipe table, lowp/quantize.hpp); fp8-noscale is lowp's fp8-delayed with
// every scale fixed at 1 ("fp8 without scaling").
struct QuantizedGemms {
  lowp::Recipe recipe = lowp::Recipe::fp8_current;
  bool unit_scale = false;
  bool delayed_scaling() const noexcept { return recipe == lowp::Recipe::fp8_delayed && !unit_scale; }
  friend bool operator==(const QuantizedGemms&, const QuantizedGemms&) = default;
};
// nullopt for the presets without quantized GEMMs.
std::optional<QuantizedGemms> quantized_gemms_of(Precision p) noexcept;
bool is_fp8(Precision p) noexcept;

// The fp8 recipe's options (TE's defaults). `format` applies to every fp8 preset but the fp4 ones; the
// delayed-scaling fields (margin, history, algorithm) to fp8-delayed; power_of_2_scales and
// amax_epsilon to fp8-current; mx_rounding to mxfp8 (mxfp4 uses TE's rounding up).
struct Fp8Config {
  lowp::Format format = lowp::Format::hybrid;
  int margin = 0;
  std::size_t amax_history_len = 1024;
  lowp::AmaxAlgo amax_compute_algo = lowp::AmaxAlgo::max;
  bool power_of_2_scales = false;
  float amax_epsilon = 0.0f;
  lowp::ScaleRounding mx_rounding = lowp::ScaleRounding::rceil;
  friend bool operator==(const Fp8Config&, const Fp8Config&) = default;
};

}  // namespace mixprec::nn
