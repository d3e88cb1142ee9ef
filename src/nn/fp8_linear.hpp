// Private: fp8 Linear layers for the fp8 precision presets (docs/fp8.md, "fp8 in the
// engine"). A Linear quantizes its input X and weight W to E4M3 and its output gradient
// dY to E5M2 (HYBRID) or E4M3, then runs the fp32 GEMMs of layers.hpp on the
// dequantized values ("fake quantization": the values an fp8 GEMM with fp32
// accumulation multiplies):
//   Y = Xq Wq^T + b,  dX += dYq Wq,  dW += dYq^T Xq,  db += column sums of dY (unquantized,
//   as TE's fused bias-gradient).
// The backward uses the X saved by the forward as fp8 codes plus scale(s) (1 byte per
// element), as Transformer Engine does, and dequantizes them into fp32 work memory right
// before its GEMM; the weight is re-quantized from W (unchanged between a forward and its
// backward) with the forward's scale, so no copy of it is kept. The block-scaled presets
// (mxfp8, fp8-block, nvfp4, mxfp4) run lowp::quantize, the one quantizer of every door, and
// quantize each operand along its GEMM's reduction dimension, like TE: rowwise for the
// forward GEMM, columnwise for dgrad (Wq) and wgrad (Xq, dYq); only X's columnwise
// quantization is kept.
//
// Everything is allocated by finish(); forward/backward allocate nothing. The fp32 work
// memory for the dequantized operands is either the caller's (spans of scratch it does
// not need during the call) or, finish(true), buffers of this object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/lowp/assignment.hpp"
#include "mixprec/lowp/quantize.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/nn/precision.hpp"

namespace mixprec::nn::detail {

// ---- the Linear layers of one model ----------------------------------------------------

class Fp8Linears {
 public:
  Fp8Linears(QuantizedGemms gemms, const Fp8Config& config);

  // Registers a Linear X[rows, in] -> Y[rows, out] named `layer` ("h0.attn.qkv"); its fp8
  // tensors are "<layer>.input", "<layer>.weight" (forward) and "<layer>.grad_output"
  // (backward), in that order. Returns its id. Before finish().
  std::size_t add(const std::string& layer, std::size_t rows, std::size_t in, std::size_t out);
  // Allocates every buffer; own_work: also the fp32 work memory, for callers that pass no
  // work spans.
  void finish(bool own_work = true);

  // fp32 work memory of one call: the dequantized operands are carved out of these spans
  // (first fit), which the caller does not read or write during the call; empty: this
  // object's own (finish(true)). Too little is a std::logic_error. Needed: forward
  // rows*in floats in one span; backward N*OC (dYq) and N*C (Xq), the block-scaled
  // presets another N*OC (the columnwise dYq), each in one span.
  using Work = std::span<const std::span<float>>;

  // y[rows, out] = Xq Wq^T + b for the first `rows` rows of x; saves X's codes for the
  // backward. What the quantization did is held until backward() (an evaluation forward
  // records nothing).
  void forward(Gemm& g, std::size_t id, std::span<float> y, std::span<const float> x, std::span<const float> w,
               std::span<const float> b, std::size_t rows, Work work = {});
  // The backward of the last forward of this layer, which must have used all rows; w is
  // the weight that forward multiplied (re-quantized here with that forward's scale).
  // dx may be empty (not needed); db must be empty exactly when the layer has no bias.
  void backward(Gemm& g, std::size_t id, std::span<float> dx, std::span<float> dw, std::span<float> db,
                std::span<const float> dy, std::span<const float> w, Work work = {});

  void step_done();           // fp8-delayed: DelayedScaling::update()
  void reset_stats() noexcept;  // the per-step counts; scales and histories stay
  std::span<const Fp8TensorStats> stats() const noexcept { return stats_; }
  lowp::DelayedScaling* delayed() noexcept { return gemms_.delayed_scaling() ? &delayed_ : nullptr; }
  QuantizedGemms gemms() const noexcept { return gemms_; }
  // What is kept from a forward to its backward: X's codes and scales (per tensor: 1 byte
  // per element; block-scaled presets: lowp's codes and block scales).
  std::size_t saved_bytes() const noexcept;
  std::size_t scratch_bytes() const noexcept;  // the weight, the codes on their way, own work

 private:
  // What one quantization did, before it is committed to the step's stats.
  struct Pending {
    ConversionStats stats;
    float amax = 0;
    float scale = 1;
  };
  struct Linear {
    std::size_t rows = 0, in = 0, out = 0;
    std::size_t tensor = 0;          // index of "<layer>.input"; weight and grad_output follow
    std::size_t forward_rows = 0;    // rows of the last forward
    std::size_t saved_bytes = 0;     // the bytes of X's kept codes and scales
    Pending input, weight;
  };

  // fp8-noscale, fp8-delayed, fp8-current: tensor t's lowp::quantize config (fp8-delayed at
  // this step's scale of t; fp8-noscale at 1).
  lowp::QuantizeConfig per_tensor_config(std::size_t t) const;
  void commit(std::size_t t, const Pending& p);
  // mxfp8, fp8-block, nvfp4, mxfp4: each operand in the GEMM layout TE uses (as
  // mixprec.torch.low_precision); X's columnwise quantization is kept for the backward.
  bool block_scaled() const noexcept;
  Pending lowp_fake(std::span<const float> x, std::span<float> out, std::size_t rows, std::size_t cols,
                    const lowp::QuantizeConfig& c, bool random, lowp::Quantized* keep = nullptr);
  std::span<const std::uint32_t> random_words(std::size_t n);

  QuantizedGemms gemms_;
  Fp8Config config_;
  lowp::DelayedScaling delayed_;
  std::vector<Linear> linears_;
  std::vector<Fp8TensorStats> stats_;
  std::vector<float> wq_;                  // the weight being multiplied (forward or backward)
  std::vector<float> work_;                // own work memory (finish(true))
  lowp::LinearRecipe lowp_recipe_;         // the lowp recipes' settings
  std::vector<lowp::Quantized> saved_q_;   // per Linear: X's kept quantization (block-scaled: columnwise)
  lowp::Quantized work_q_;                 // the other operands' codes on their way
  std::vector<std::uint32_t> random_;      // nvfp4: stochastic rounding's words (splitmix64)
  std::uint64_t draws_ = 0;
  std::size_t max_weight_ = 0, max_work_ = 0, max_codes_ = 0;
  bool finished_ = false;
};

}  // namespace mixprec::nn::detail
