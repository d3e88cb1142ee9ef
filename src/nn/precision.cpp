// Precision presets (include/mixprec/nn/precision.hpp, docs/training.md).
#include "mixprec/nn/precision.hpp"

namespace mixprec::nn {

namespace {

struct PrecisionRow {
  Precision precision;
  std::string_view name;
  PrecisionPolicy policy;  // activations, weights, weight gradients, master
  std::optional<QuantizedGemms> gemms;
  std::string_view doc;
};

// Every precision preset, one row each, in the order precision_names() lists them: the
// engine, the memory planner (memory_plan reads the policy) and every list of names read
// these rows. Mixed presets are PyTorch AMP's arrangement: fp32 parameters (our master
// weights) and fp32 .grad, low-precision weight copies and activations; the pure presets
// keep nothing in fp32; the fp8 presets are the bf16 arrangement with only the Linear GEMM
// operands in fp8 (fp8_linear.hpp).
const PrecisionRow kPrecisions[] = {
    {Precision::fp32, "fp32", {DType::f32, DType::f32, DType::f32, false}, std::nullopt, "everything fp32"},
    {Precision::fp16, "fp16", {DType::f16, DType::f16, DType::f32, true}, std::nullopt,
     "mixed: fp16 activations and weight copy, fp32 master weights and weight gradients"},
    {Precision::bf16, "bf16", {DType::bf16, DType::bf16, DType::f32, true}, std::nullopt,
     "mixed: bf16 activations and weight copy, fp32 master weights and weight gradients"},
    {Precision::fp16_pure, "fp16-pure", {DType::f16, DType::f16, DType::f16, false}, std::nullopt,
     "fp16 weights (no master copy), weight gradients and activations"},
    {Precision::bf16_pure, "bf16-pure", {DType::bf16, DType::bf16, DType::bf16, false}, std::nullopt,
     "bf16 weights (no master copy), weight gradients and activations"},
    {Precision::fp8_noscale, "fp8-noscale", {DType::bf16, DType::bf16, DType::f32, true}, QuantizedGemms{lowp::Recipe::fp8_delayed, true},
     "bf16 mixed, block Linears in fp8 with every scale 1"},
    {Precision::fp8_delayed, "fp8-delayed", {DType::bf16, DType::bf16, DType::f32, true}, QuantizedGemms{lowp::Recipe::fp8_delayed},
     "bf16 mixed, block Linears in fp8 with per-tensor delayed scaling"},
    {Precision::fp8_current, "fp8-current", {DType::bf16, DType::bf16, DType::f32, true}, QuantizedGemms{lowp::Recipe::fp8_current},
     "bf16 mixed, block Linears in fp8 with per-tensor current scaling"},
    {Precision::mxfp8, "mxfp8", {DType::bf16, DType::bf16, DType::f32, true}, QuantizedGemms{lowp::Recipe::mxfp8},
     "bf16 mixed, block Linears in fp8 MX blocks of 32 with E8M0 scales"},
    {Precision::fp8_block, "fp8-block", {DType::bf16, DType::bf16, DType::f32, true}, QuantizedGemms{lowp::Recipe::fp8_block},
     "bf16 mixed, block Linears in fp8 blocks of 1x128 (weights 128x128) with fp32 scales"},
    {Precision::nvfp4, "nvfp4", {DType::bf16, DType::bf16, DType::f32, true}, QuantizedGemms{lowp::Recipe::nvfp4},
     "bf16 mixed, block Linears in fp4 (E2M1) blocks of 16 with E4M3 scales and a tensor scale"},
    {Precision::mxfp4, "mxfp4", {DType::bf16, DType::bf16, DType::f32, true}, QuantizedGemms{lowp::Recipe::mxfp4},
     "bf16 mixed, block Linears in fp4 (E2M1) MX blocks of 32 with E8M0 scales"},
};

const PrecisionRow* row_of(Precision p) noexcept {
  for (const PrecisionRow& r : kPrecisions)
    if (r.precision == p) return &r;
  return nullptr;
}

}  // namespace

std::string_view precision_name(Precision p) noexcept {
  const PrecisionRow* r = row_of(p);
  return r ? r->name : "?";
}

const std::vector<std::string>& precision_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const PrecisionRow& r : kPrecisions) n.emplace_back(r.name);
    return n;
  }();
  return names;
}

const std::vector<Precision>& all_precisions() {
  static const std::vector<Precision> all = [] {
    std::vector<Precision> p;
    for (const PrecisionRow& r : kPrecisions) p.push_back(r.precision);
    return p;
  }();
  return all;
}

std::string_view precision_doc(Precision p) noexcept {
  const PrecisionRow* r = row_of(p);
  return r ? r->doc : "?";
}

std::optional<Precision> parse_precision(std::string_view s) noexcept {
  for (const PrecisionRow& r : kPrecisions)
    if (r.name == s) return r.precision;
  return std::nullopt;
}

PrecisionPolicy policy_of(Precision p) noexcept {
  const PrecisionRow* r = row_of(p);
  return r ? r->policy : PrecisionPolicy{};
}

std::optional<QuantizedGemms> quantized_gemms_of(Precision p) noexcept {
  const PrecisionRow* r = row_of(p);
  return r ? r->gemms : std::nullopt;
}

bool is_fp8(Precision p) noexcept { return quantized_gemms_of(p).has_value(); }

}  // namespace mixprec::nn
