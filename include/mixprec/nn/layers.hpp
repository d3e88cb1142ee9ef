// The transformer's layers in fp32, llm.c style: each layer is a pair of free
// functions, *_forward and *_backward, over caller-owned row-major buffers.
// Nothing here allocates (the Gemm allocates only on the first call with a new
// shape, see gemm.hpp / Gemm::prepare). The training engine wraps these with its
// precision policy; see docs/layers.md for each function's contract, what it
// saves for backward and what memory it needs.
//
// Conventions (all functions):
//   - Buffers are std::span over fp32, row-major; B = batch, T = sequence,
//     C = channels, OC = output channels, V = vocabulary, NH = heads, N = rows.
//   - Shapes are validated at entry, before anything is written: every dimension
//     must be > 0 and every span must hold exactly the elements its shape needs
//     (wpe/dwpe: at least T rows, see embedding_forward). Otherwise
//     std::invalid_argument naming the function, the buffer, the expected and the
//     found element count. Token ids / targets >= V are rejected the same way.
//   - Gradients ACCUMULATE (+=) into every parameter-gradient and every
//     input-gradient buffer (llm.c semantics: zero them once per step / micro-batch
//     group). The only exception is attention_backward's scratch `datt`/`dpreatt`,
//     which are overwritten in full.
//   - Outputs of a forward may alias its input only where stated (elementwise ops).
#pragma once

#include <cstddef>
#include <span>

#include "mixprec/nn/data.hpp"
#include "mixprec/nn/gemm.hpp"

namespace mixprec::nn {

// ---- linear: out[N,OC] = inp[N,C] * weight[OC,C]^T + bias[OC] ------------------
// bias may be empty (no bias). N is usually B*T.
void linear_forward(Gemm& gemm, std::span<float> out, std::span<const float> inp, std::span<const float> weight,
                    std::span<const float> bias, std::size_t N, std::size_t C, std::size_t OC);
// dinp[N,C] += dout * weight; dweight[OC,C] += dout^T * inp; dbias[OC] += column sums
// of dout. dinp may be empty (gradient not needed, e.g. the first layer); dbias must be
// empty exactly when the layer has no bias.
void linear_backward(Gemm& gemm, std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                     std::span<const float> dout, std::span<const float> inp, std::span<const float> weight,
                     std::size_t N, std::size_t C, std::size_t OC);

// The same with the GEMM operands as stored (each a dense MatrixView of f32, f16 or
// bf16: inp N x C, weight OC x C, dout_op N x OC), so that a bf16 model multiplies its
// bf16 activations and weights on oneDNN's native bf16 path instead of widening fp32
// copies of them (Gemm::path; docs/gemm.md). linear_backward still reads the fp32
// values of dout (`dout`, the same values as dout_op) for dbias.
void linear_forward(Gemm& gemm, std::span<float> out, const MatrixView& inp, const MatrixView& weight,
                    std::span<const float> bias, std::size_t N, std::size_t C, std::size_t OC);
void linear_backward(Gemm& gemm, std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                     std::span<const float> dout, const MatrixView& dout_op, const MatrixView& inp,
                     const MatrixView& weight, std::size_t N, std::size_t C, std::size_t OC);

// ---- embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:] ---------------------
// wte is [V,C]; wpe is [maxT,C] with maxT >= T (its size must be a multiple of C).
void embedding_forward(std::span<float> out, std::span<const TokenId> tokens, std::span<const float> wte,
                       std::span<const float> wpe, std::size_t B, std::size_t T, std::size_t C, std::size_t V);
// dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:].
void embedding_backward(std::span<float> dwte, std::span<float> dwpe, std::span<const float> dout,
                        std::span<const TokenId> tokens, std::size_t B, std::size_t T, std::size_t C, std::size_t V);

// ---- layer norm over the last dimension of inp[N,C] ----------------------------
// out = (inp - mean) * rstd * weight + bias, rstd = 1/sqrt(var + eps) (biased
// variance); saves mean[N] and rstd[N] for the backward.
void layernorm_forward(std::span<float> out, std::span<float> mean, std::span<float> rstd, std::span<const float> inp,
                       std::span<const float> weight, std::span<const float> bias, std::size_t N, std::size_t C,
                       float eps = 1e-5f);
// dinp[N,C] +=, dweight[C] +=, dbias[C] +=.
void layernorm_backward(std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                        std::span<const float> dout, std::span<const float> inp, std::span<const float> weight,
                        std::span<const float> mean, std::span<const float> rstd, std::size_t N, std::size_t C);

// ---- GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))
// out and inp have the same size; out may alias inp.
void gelu_forward(std::span<float> out, std::span<const float> inp);
// dinp += gelu'(inp) * dout. dinp may alias dout.
void gelu_backward(std::span<float> dinp, std::span<const float> inp, std::span<const float> dout);

// ---- residual: out = a + b (out may alias a or b) -----------------------------------
void residual_forward(std::span<float> out, std::span<const float> a, std::span<const float> b);
// da += dout; db += dout.
void residual_backward(std::span<float> da, std::span<float> db, std::span<const float> dout);

// ---- causal multi-head self-attention ----------------------------------------------
// qkv[B,T,3C] holds q, k, v side by side per token (q in [0,C), k in [C,2C), v in
// [2C,3C)); head h uses channels [h*hs, (h+1)*hs) of each, hs = C/NH (NH must divide
// C). Writes out[B,T,C] and saves preatt[B,NH,T,T] (q.k / sqrt(hs)) and
// att[B,NH,T,T] (its causal softmax); entries t2 > t (masked) are written as exactly 0.
//
// The fast path: per (batch row, head), QK^T and att.V (and in backward dout.V^T,
// att^T.dout, dpreatt.K, dpreatt^T.Q) are strided GEMMs through `gemm` (oneDNN), with
// the causal softmax as a plain loop over each row's visible entries. The GEMMs read
// q, k, v straight out of qkv with leading dimension 3C. Compared with the scalar
// reference (namespace reference below) only the summation order of the dot products
// differs (tests/nn/test_layers.cpp states the tolerance).
void attention_forward(Gemm& gemm, std::span<float> out, std::span<float> preatt, std::span<float> att,
                       std::span<const float> qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH);
// qkv as stored ([B*T, 3C], dense; f32, f16 or bf16; bf16 is multiplied natively only
// where oneDNN has a fast kernel for the strided per-head views, see Gemm).
void attention_forward(Gemm& gemm, std::span<float> out, std::span<float> preatt, std::span<float> att,
                       const MatrixView& qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH);
// With one 1-thread Gemm per OpenMP thread (gemms.size() > 1): the per-head GEMMs run in
// parallel over (batch row, head), one parallel region per phase instead of a threaded
// call per small GEMM. gemms.size() == 1: that Gemm, sequentially over the heads. More
// than one Gemm with threads != 1 is refused (std::invalid_argument).
void attention_forward(std::span<Gemm> gemms, std::span<float> out, std::span<float> preatt, std::span<float> att,
                       const MatrixView& qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH);
// dqkv[B,T,3C] +=. datt and dpreatt [B,NH,T,T] are scratch, overwritten in full
// (masked entries 0): afterwards they hold dL/datt and dL/dpreatt.
void attention_backward(Gemm& gemm, std::span<float> dqkv, std::span<float> dpreatt, std::span<float> datt,
                        std::span<const float> dout, std::span<const float> qkv, std::span<const float> att,
                        std::size_t B, std::size_t T, std::size_t C, std::size_t NH);
// dout ([B*T, C]) and qkv ([B*T, 3C]) as stored, dense.
void attention_backward(Gemm& gemm, std::span<float> dqkv, std::span<float> dpreatt, std::span<float> datt,
                        const MatrixView& dout, const MatrixView& qkv, std::span<const float> att, std::size_t B,
                        std::size_t T, std::size_t C, std::size_t NH);
void attention_backward(std::span<Gemm> gemms, std::span<float> dqkv, std::span<float> dpreatt,
                        std::span<float> datt, const MatrixView& dout, const MatrixView& qkv,
                        std::span<const float> att, std::size_t B, std::size_t T, std::size_t C, std::size_t NH);

// Creates the fast path's GEMM primitives (Gemm::prepare) for qkv stored as `qkv_type`
// and dout as `dout_type`, so that training allocates nothing later.
void attention_prepare(Gemm& gemm, DType qkv_type, DType dout_type, std::size_t T, std::size_t C, std::size_t NH);
void attention_prepare(std::span<Gemm> gemms, DType qkv_type, DType dout_type, std::size_t T, std::size_t C,
                       std::size_t NH);

// The causal softmax of one attention row: att[t2] = softmax(pre[0..visible))[t2] for
// t2 < visible (max subtracted, fp32), and pre[t2] = att[t2] = 0 for visible <= t2 < T.
void softmax_causal_row(float* pre, float* att, std::size_t visible, std::size_t T) noexcept;

namespace reference {
// The plain scalar attention (llm.c's CPU reference loops, fixed order, no GEMM): the
// definition the fast path above is tested against. Same contracts and errors.
void attention_forward(std::span<float> out, std::span<float> preatt, std::span<float> att, std::span<const float> qkv,
                       std::size_t B, std::size_t T, std::size_t C, std::size_t NH);
void attention_backward(std::span<float> dqkv, std::span<float> dpreatt, std::span<float> datt,
                        std::span<const float> dout, std::span<const float> qkv, std::span<const float> att,
                        std::size_t B, std::size_t T, std::size_t C, std::size_t NH);
}  // namespace reference

// ---- softmax + cross-entropy over logits[B,T,V] -------------------------------------
// probs = softmax(logits) per row (max subtracted, fp32); losses[b,t] =
// -log probs[b,t,targets[b,t]], computed as log(sum exp(l - max)) - (l_target - max)
// so that it stays finite when the target's probability underflows.
void softmax_crossentropy_forward(std::span<float> losses, std::span<float> probs, std::span<const float> logits,
                                  std::span<const TokenId> targets, std::size_t B, std::size_t T, std::size_t V);
// dlogits[b,t,:] += (probs[b,t,:] - onehot(targets[b,t])) * dlosses[b,t].
void crossentropy_softmax_backward(std::span<float> dlogits, std::span<const float> dlosses,
                                   std::span<const float> probs, std::span<const TokenId> targets, std::size_t B,
                                   std::size_t T, std::size_t V);

// The mean of the per-token losses (summed in double, rounded once); 0 for an empty span.
// The matching dlosses for the mean is 1/(B*T) per token.
float mean_loss(std::span<const float> losses) noexcept;

}  // namespace mixprec::nn
