// Private: fp8 Linear layers for the fp8 precision presets (docs/fp8.md, "fp8 in the
// engine"). A Linear quantizes its input X and weight W to E4M3 and its output gradient
// dY to E5M2 (HYBRID) or E4M3, then runs the fp32 GEMMs of layers.hpp on the
// dequantized values ("fake quantization": the values an fp8 GEMM with fp32
// accumulation multiplies):
//   Y = Xq Wq^T + b,  dX += dYq Wq,  dW += dYq^T Xq,  db += column sums of dY (unquantized,
//   as TE's fused bias-gradient).
// The backward uses the Xq saved by the forward, as Transformer Engine does. mxfp8
// quantizes each operand along the GEMM's reduction dimension, like TE: rowwise copies
// for the forward GEMM, columnwise (transposed) copies for dgrad (Wq) and wgrad (Xq, dYq).
//
// Everything is allocated by finish(); forward/backward allocate nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/fp8/recipes.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/nn/precision.hpp"

namespace mixprec::nn::detail {

// ---- fake quantization (quantize, then dequantize) -------------------------------------

// out[i] = decode(encode_sat<dtype>(x[i] * scale)) * scale_inv: fp8::quantize followed by
// fp8::dequantize, bit for bit (RNE, saturating, subnormals kept). out may alias x.
// codes: scratch of at least x.size() bytes. Returns what the cast destroyed (overflow =
// saturated, underflow = flushed).
ConversionStats fake_quantize(std::span<const float> x, std::span<float> out, fp8::Dtype dtype, float scale,
                              float scale_inv, std::span<std::uint8_t> codes);

struct MxFakeQuantized {
  ConversionStats stats;  // overflow = saturated, underflow = flushed
  float min_factor = 0;   // smallest multiplier of any block (of the largest block scale); 0 when empty
};
// MX: x holds rows of row_len values; each row is cut into blocks of 32 from its start (the
// last may be shorter) with one E8M0 scale each: every row as fp8::mx_quantize then
// fp8::mx_dequantize, bit for bit. out may alias x. codes: x.size() bytes of scratch.
MxFakeQuantized fake_quantize_mx(std::span<const float> x, std::span<float> out, std::size_t row_len,
                                 fp8::Dtype dtype, fp8::MxRounding rounding, std::span<std::uint8_t> codes);

// dst[c * rows + r] = src[r * cols + c].
void transpose(std::span<const float> src, std::span<float> dst, std::size_t rows, std::size_t cols);

// ---- the Linear layers of one model ----------------------------------------------------

class Fp8Linears {
 public:
  Fp8Linears(Fp8Recipe recipe, const Fp8Config& config);

  // Registers a Linear X[rows, in] -> Y[rows, out] named `layer` ("h0.attn.qkv"); its fp8
  // tensors are "<layer>.input", "<layer>.weight" (forward) and "<layer>.grad_output"
  // (backward), in that order. Returns its id. Before finish().
  std::size_t add(const std::string& layer, std::size_t rows, std::size_t in, std::size_t out);
  void finish();  // allocates every buffer

  // y[rows, out] = Xq Wq^T + b for the first `rows` rows of x. What the quantization
  // did is held until backward() (an evaluation forward records nothing).
  void forward(Gemm& g, std::size_t id, std::span<float> y, std::span<const float> x, std::span<const float> w,
               std::span<const float> b, std::size_t rows);
  // The backward of the last forward of this layer, which must have used all rows.
  // dx may be empty (not needed); db must be empty exactly when the layer has no bias.
  void backward(Gemm& g, std::size_t id, std::span<float> dx, std::span<float> dw, std::span<float> db,
                std::span<const float> dy);

  void step_done();           // fp8-delayed: DelayedScaling::update()
  void reset_stats() noexcept;  // the per-step counts; scales and histories stay
  std::span<const Fp8TensorStats> stats() const noexcept { return stats_; }
  fp8::DelayedScaling* delayed() noexcept { return recipe_ == Fp8Recipe::delayed ? &delayed_ : nullptr; }
  Fp8Recipe recipe() const noexcept { return recipe_; }
  std::size_t scratch_bytes() const noexcept;

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
    std::size_t xq = 0, wq = 0, xq_col = 0, wq_col = 0;  // offsets into saved_ (the columnwise copies: mxfp8)
    std::size_t forward_rows = 0;    // rows of the last forward
    Pending input, weight;
  };

  // Quantizes x (rows x cols, reduction along cols) for tensor t into out (rowwise).
  Pending quantize(std::size_t t, std::span<const float> x, std::span<float> out, std::size_t cols);
  // mxfp8's columnwise copy: blocks along the rows (the other GEMM's reduction dimension).
  void quantize_columnwise(std::size_t t, std::span<const float> x, std::span<float> out, std::size_t rows,
                           std::size_t cols);
  void commit(std::size_t t, const Pending& p);
  float scale_of(std::size_t t) const;
  float scale_inv_of(std::size_t t) const;

  Fp8Recipe recipe_;
  Fp8Config config_;
  fp8::DelayedScaling delayed_;
  std::vector<Linear> linears_;
  std::vector<Fp8TensorStats> stats_;
  std::vector<float> saved_;  // per Linear: Xq [rows, in], Wq [out, in]; mxfp8 also their columnwise copies
  std::size_t saved_floats_ = 0;
  std::vector<float> dyq_, dyq_col_, transposed_;
  std::vector<std::uint8_t> codes_;
  std::size_t max_act_ = 0, max_weight_ = 0;
  bool finished_ = false;
};

}  // namespace mixprec::nn::detail
