// fp32 layers, llm.c style (include/mixprec/nn/layers.hpp, docs/layers.md).
#include "mixprec/nn/layers.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "mixprec/core/text.hpp"
#include "nn/layer_kernels.hpp"

namespace mixprec::nn {
namespace {

using detail::active_layer_kernels;
using detail::LayerKernels;

// Elementwise ops split into chunks of this many elements for OpenMP (each chunk one
// kernel call; results do not depend on the split, see layer_kernels.hpp).
constexpr std::size_t kChunk = 4096;

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

void check_dim(const char* fn, const char* name, std::size_t v) {
  if (v == 0) fail(fn, std::string(name) + ": expected > 0, found 0");
}

// `found` elements in buffer `name`, `expected` needed (shape text for the message).
void check_size(const char* fn, const char* name, std::size_t found, std::size_t expected, const char* shape) {
  if (found != expected) {
    fail(fn, std::string(name) + ": expected " + std::to_string(expected) + " elements (" + shape + "), found " +
                 std::to_string(found));
  }
}

// A dense matrix operand of `rows` x `cols` (shape text for the message).
void check_matrix(const char* fn, const char* name, const MatrixView& m, std::size_t rows, std::size_t cols,
                  const char* shape) {
  const std::size_t ld = m.ld == 0 ? m.cols : m.ld;
  if (m.rows != rows || m.cols != cols || ld != cols || m.data == nullptr) {
    fail(fn, std::string(name) + ": expected a dense " + std::to_string(rows) + " x " + std::to_string(cols) + " (" +
                 shape + ") matrix, found " + std::to_string(m.rows) + " x " + std::to_string(m.cols) + ", ld " +
                 std::to_string(ld));
  }
}

void check_tokens(const char* fn, const char* name, std::span<const TokenId> ids, std::size_t V) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= V) {
      fail(fn, std::string(name) + "[" + std::to_string(i) + "]: expected an id < V = " + std::to_string(V) +
                   ", found " + std::to_string(ids[i]));
    }
  }
}

// wpe / dwpe: [maxT, C] with maxT >= T.
void check_wpe(const char* fn, const char* name, std::size_t found, std::size_t T, std::size_t C) {
  if (found % C != 0 || found < T * C) {
    fail(fn, std::string(name) + ": expected a multiple of C = " + std::to_string(C) + " elements, at least T*C = " +
                 std::to_string(T * C) + " ([maxT,C], maxT >= T), found " + std::to_string(found));
  }
}

// Whether a loop touching `elements` values is worth an OpenMP parallel region. Waking
// the team costs microseconds on a quiet machine and far more on a busy one, so small
// problems (tests, evaluation tails, tiny models) stay on the calling thread.
inline bool parallel_worth_it(std::size_t elements) { return elements >= (std::size_t{1} << 16); }

// Calls f(i) for i in [0, n), split over the OpenMP team when `elements` (the values the
// loop touches) is worth a parallel region, else in a plain loop: a region whose if-clause
// is false still makes (and allocates) a one-thread team, which the engine's block-sized
// calls (Engine::run_stages) would pay for every block.
template <class F>
void for_range(std::size_t n, std::size_t elements, F&& f) {
  if (!parallel_worth_it(elements)) {
    for (std::size_t i = 0; i < n; ++i) f(i);
    return;
  }
  #pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < n; ++i) f(i);
}

// Runs f(begin, count) over [0, n) in chunks of kChunk, in parallel when worth it.
template <class F>
void chunked(std::size_t n, F&& f) {
  const std::size_t chunks = (n + kChunk - 1) / kChunk;
  for_range(chunks, n, [&](std::size_t c) {
    const std::size_t b = c * kChunk;
    f(b, std::min(kChunk, n - b));
  });
}

}  // namespace

// ---- linear --------------------------------------------------------------------

void linear_forward(Gemm& gemm, std::span<float> out, std::span<const float> inp, std::span<const float> weight,
                    std::span<const float> bias, std::size_t N, std::size_t C, std::size_t OC) {
  constexpr const char* fn = "linear_forward";
  check_dim(fn, "N", N);
  check_dim(fn, "C", C);
  check_dim(fn, "OC", OC);
  check_size(fn, "out", out.size(), N * OC, "N*OC");
  check_size(fn, "inp", inp.size(), N * C, "N*C");
  check_size(fn, "weight", weight.size(), OC * C, "OC*C");
  linear_forward(gemm, out, view(inp.data(), N, C), view(weight.data(), OC, C), bias, N, C, OC);
}

void linear_forward(Gemm& gemm, std::span<float> out, const MatrixView& inp, const MatrixView& weight,
                    std::span<const float> bias, std::size_t N, std::size_t C, std::size_t OC) {
  constexpr const char* fn = "linear_forward";
  check_dim(fn, "N", N);
  check_dim(fn, "C", C);
  check_dim(fn, "OC", OC);
  check_size(fn, "out", out.size(), N * OC, "N*OC");
  check_matrix(fn, "inp", inp, N, C, "N x C");
  check_matrix(fn, "weight", weight, OC, C, "OC x C");
  if (!bias.empty()) check_size(fn, "bias", bias.size(), OC, "OC, or empty for no bias");

  gemm.run(inp, weight, output(out.data(), N, OC), {.trans_a = Trans::no, .trans_b = Trans::yes});
  if (!bias.empty()) detail::add_bias_rows(out, bias, N, OC);
}

void detail::add_bias_rows(std::span<float> out, std::span<const float> bias, std::size_t N, std::size_t OC) {
  check_size("add_bias_rows", "out", out.size(), N * OC, "N*OC");
  check_size("add_bias_rows", "bias", bias.size(), OC, "OC");
  for_range(N, N * OC, [&](std::size_t n) {
    float* row = out.data() + n * OC;
    for (std::size_t o = 0; o < OC; ++o) row[o] += bias[o];
  });
}

void linear_backward(Gemm& gemm, std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                     std::span<const float> dout, std::span<const float> inp, std::span<const float> weight,
                     std::size_t N, std::size_t C, std::size_t OC) {
  constexpr const char* fn = "linear_backward";
  check_dim(fn, "N", N);
  check_dim(fn, "C", C);
  check_dim(fn, "OC", OC);
  check_size(fn, "dout", dout.size(), N * OC, "N*OC");
  check_size(fn, "inp", inp.size(), N * C, "N*C");
  check_size(fn, "weight", weight.size(), OC * C, "OC*C");
  linear_backward(gemm, dinp, dweight, dbias, dout, view(dout.data(), N, OC), view(inp.data(), N, C),
                  view(weight.data(), OC, C), N, C, OC);
}

void linear_backward(Gemm& gemm, std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                     std::span<const float> dout, const MatrixView& dout_op, const MatrixView& inp,
                     const MatrixView& weight, std::size_t N, std::size_t C, std::size_t OC) {
  constexpr const char* fn = "linear_backward";
  check_dim(fn, "N", N);
  check_dim(fn, "C", C);
  check_dim(fn, "OC", OC);
  if (!dinp.empty()) check_size(fn, "dinp", dinp.size(), N * C, "N*C, or empty to skip");
  check_size(fn, "dweight", dweight.size(), OC * C, "OC*C");
  if (!dbias.empty()) check_size(fn, "dbias", dbias.size(), OC, "OC, or empty for no bias");
  check_size(fn, "dout", dout.size(), N * OC, "N*OC");
  check_matrix(fn, "dout_op", dout_op, N, OC, "N x OC");
  check_matrix(fn, "inp", inp, N, C, "N x C");
  check_matrix(fn, "weight", weight, OC, C, "OC x C");

  const GemmArgs accumulate_nn{.trans_a = Trans::no, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f};
  const GemmArgs accumulate_tn{.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f};
  // dinp[N,C] += dout[N,OC] * weight[OC,C]
  if (!dinp.empty()) gemm.run(dout_op, weight, output(dinp.data(), N, C), accumulate_nn);
  // dweight[OC,C] += dout^T[OC,N] * inp[N,C]
  gemm.run(dout_op, inp, output(dweight.data(), OC, C), accumulate_tn);
  if (!dbias.empty()) {
    // Column blocks over the threads; each column still sums its rows in order, so the
    // result does not depend on the split.
    constexpr std::size_t kBlock = 64;
    const std::size_t blocks = (OC + kBlock - 1) / kBlock;
    #pragma omp parallel for schedule(static) if (parallel_worth_it(N * OC))
    for (std::size_t blk = 0; blk < blocks; ++blk) {
      const std::size_t o0 = blk * kBlock, o1 = std::min(OC, o0 + kBlock);
      for (std::size_t n = 0; n < N; ++n) {
        const float* row = dout.data() + n * OC;
        for (std::size_t o = o0; o < o1; ++o) dbias[o] += row[o];
      }
    }
  }
}

// ---- embedding -------------------------------------------------------------------

void embedding_forward(std::span<float> out, std::span<const TokenId> tokens, std::span<const float> wte,
                       std::span<const float> wpe, std::size_t B, std::size_t T, std::size_t C, std::size_t V) {
  constexpr const char* fn = "embedding_forward";
  check_dim(fn, "B", B);
  check_dim(fn, "T", T);
  check_dim(fn, "C", C);
  check_dim(fn, "V", V);
  check_size(fn, "out", out.size(), B * T * C, "B*T*C");
  check_size(fn, "tokens", tokens.size(), B * T, "B*T");
  check_size(fn, "wte", wte.size(), V * C, "V*C");
  check_wpe(fn, "wpe", wpe.size(), T, C);
  check_tokens(fn, "tokens", tokens, V);

  const LayerKernels& k = active_layer_kernels();
  #pragma omp parallel for schedule(static) if (parallel_worth_it(B * T * C))
  for (std::size_t b = 0; b < B; ++b) {
    for (std::size_t t = 0; t < T; ++t) {
      const float* e = wte.data() + static_cast<std::size_t>(tokens[b * T + t]) * C;
      k.add(out.data() + (b * T + t) * C, e, wpe.data() + t * C, C);
    }
  }
}

void embedding_backward(std::span<float> dwte, std::span<float> dwpe, std::span<const float> dout,
                        std::span<const TokenId> tokens, std::size_t B, std::size_t T, std::size_t C, std::size_t V) {
  constexpr const char* fn = "embedding_backward";
  check_dim(fn, "B", B);
  check_dim(fn, "T", T);
  check_dim(fn, "C", C);
  check_dim(fn, "V", V);
  check_size(fn, "dwte", dwte.size(), V * C, "V*C");
  check_wpe(fn, "dwpe", dwpe.size(), T, C);
  check_size(fn, "dout", dout.size(), B * T * C, "B*T*C");
  check_size(fn, "tokens", tokens.size(), B * T, "B*T");
  check_tokens(fn, "tokens", tokens, V);

  const LayerKernels& k = active_layer_kernels();
  for (std::size_t b = 0; b < B; ++b) {
    for (std::size_t t = 0; t < T; ++t) {
      float* e = dwte.data() + static_cast<std::size_t>(tokens[b * T + t]) * C;
      k.add_to_both(e, dwpe.data() + t * C, dout.data() + (b * T + t) * C, C);
    }
  }
}

// ---- layer norm ------------------------------------------------------------------

void layernorm_forward(std::span<float> out, std::span<float> mean, std::span<float> rstd, std::span<const float> inp,
                       std::span<const float> weight, std::span<const float> bias, std::size_t N, std::size_t C,
                       float eps) {
  constexpr const char* fn = "layernorm_forward";
  check_dim(fn, "N", N);
  check_dim(fn, "C", C);
  check_size(fn, "out", out.size(), N * C, "N*C");
  check_size(fn, "mean", mean.size(), N, "N");
  check_size(fn, "rstd", rstd.size(), N, "N");
  check_size(fn, "inp", inp.size(), N * C, "N*C");
  check_size(fn, "weight", weight.size(), C, "C");
  check_size(fn, "bias", bias.size(), C, "C");
  if (!(eps > 0.0f)) fail(fn, "eps: expected > 0, found " + text::num_f32(eps));

  const LayerKernels& k = active_layer_kernels();
  for_range(N, N * C, [&](std::size_t n) {
    k.layernorm_forward_row(out.data() + n * C, &mean[n], &rstd[n], inp.data() + n * C, weight.data(), bias.data(), C,
                            eps);
  });
}

namespace {
void layernorm_backward_impl(std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                             std::span<const float> dout, std::span<const float> inp, std::span<const float> weight,
                             std::span<const float> mean, std::span<const float> rstd, std::size_t N, std::size_t C,
                             bool accumulate) {
  constexpr const char* fn = "layernorm_backward";
  check_dim(fn, "N", N);
  check_dim(fn, "C", C);
  check_size(fn, "dinp", dinp.size(), N * C, "N*C");
  check_size(fn, "dweight", dweight.size(), C, "C");
  check_size(fn, "dbias", dbias.size(), C, "C");
  check_size(fn, "dout", dout.size(), N * C, "N*C");
  check_size(fn, "inp", inp.size(), N * C, "N*C");
  check_size(fn, "weight", weight.size(), C, "C");
  check_size(fn, "mean", mean.size(), N, "N");
  check_size(fn, "rstd", rstd.size(), N, "N");

  // Parameters first, so that a dinp aliasing dout is written only after dout has been
  // read for them.
  detail::layernorm_backward_params(dweight, dbias, dout, inp, mean, rstd, N, C);
  detail::layernorm_backward_dx(dinp, dout, inp, weight, mean, rstd, N, C, accumulate);
}
}  // namespace

// dweight/dbias by column blocks (each column sums its rows in order), dinp by rows: both
// split over the threads without changing a result.
void detail::layernorm_backward_params(std::span<float> dweight, std::span<float> dbias, std::span<const float> dout,
                                       std::span<const float> inp, std::span<const float> mean,
                                       std::span<const float> rstd, std::size_t N, std::size_t C) {
  constexpr const char* fn = "layernorm_backward_params";
  check_size(fn, "dweight", dweight.size(), C, "C");
  check_size(fn, "dbias", dbias.size(), C, "C");
  check_size(fn, "dout", dout.size(), N * C, "N*C");
  check_size(fn, "inp", inp.size(), N * C, "N*C");
  check_size(fn, "mean", mean.size(), N, "N");
  check_size(fn, "rstd", rstd.size(), N, "N");
  const LayerKernels& k = active_layer_kernels();
  constexpr std::size_t kBlock = 64;
  const std::size_t blocks = (C + kBlock - 1) / kBlock;
  #pragma omp parallel for schedule(static) if (parallel_worth_it(N * C))
  for (std::size_t blk = 0; blk < blocks; ++blk) {
    const std::size_t c0 = blk * kBlock;
    k.layernorm_backward_params(dweight.data() + c0, dbias.data() + c0, dout.data() + c0, inp.data() + c0,
                                mean.data(), rstd.data(), N, C, std::min(kBlock, C - c0));
  }
}

void detail::layernorm_backward_dx(std::span<float> dinp, std::span<const float> dout, std::span<const float> inp,
                                   std::span<const float> weight, std::span<const float> mean,
                                   std::span<const float> rstd, std::size_t N, std::size_t C, bool accumulate) {
  constexpr const char* fn = "layernorm_backward_dx";
  check_size(fn, "dinp", dinp.size(), N * C, "N*C");
  check_size(fn, "dout", dout.size(), N * C, "N*C");
  check_size(fn, "inp", inp.size(), N * C, "N*C");
  check_size(fn, "weight", weight.size(), C, "C");
  check_size(fn, "mean", mean.size(), N, "N");
  check_size(fn, "rstd", rstd.size(), N, "N");
  const LayerKernels& k = active_layer_kernels();
  for_range(N, N * C, [&](std::size_t n) {
    k.layernorm_backward_dx_row(dinp.data() + n * C, dout.data() + n * C, inp.data() + n * C, weight.data(), mean[n],
                                rstd[n], C, accumulate);
  });
}

void layernorm_backward(std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                        std::span<const float> dout, std::span<const float> inp, std::span<const float> weight,
                        std::span<const float> mean, std::span<const float> rstd, std::size_t N, std::size_t C) {
  layernorm_backward_impl(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, true);
}

void detail::layernorm_backward_store(std::span<float> dinp, std::span<float> dweight, std::span<float> dbias,
                                      std::span<const float> dout, std::span<const float> inp,
                                      std::span<const float> weight, std::span<const float> mean,
                                      std::span<const float> rstd, std::size_t N, std::size_t C) {
  layernorm_backward_impl(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, false);
}

// ---- GELU ---------------------------------------------------------------------------

void gelu_forward(std::span<float> out, std::span<const float> inp) {
  check_size("gelu_forward", "out", out.size(), inp.size(), "inp.size()");
  const LayerKernels& k = active_layer_kernels();
  chunked(inp.size(), [&](std::size_t b, std::size_t n) { k.gelu_forward(out.data() + b, inp.data() + b, n); });
}

namespace {
void gelu_backward_impl(std::span<float> dinp, std::span<const float> inp, std::span<const float> dout,
                        bool accumulate) {
  check_size("gelu_backward", "dinp", dinp.size(), inp.size(), "inp.size()");
  check_size("gelu_backward", "dout", dout.size(), inp.size(), "inp.size()");
  const LayerKernels& k = active_layer_kernels();
  chunked(inp.size(), [&](std::size_t b, std::size_t n) {
    k.gelu_backward(dinp.data() + b, inp.data() + b, dout.data() + b, n, accumulate);
  });
}
}  // namespace

void gelu_backward(std::span<float> dinp, std::span<const float> inp, std::span<const float> dout) {
  gelu_backward_impl(dinp, inp, dout, true);
}

void detail::gelu_backward_store(std::span<float> dinp, std::span<const float> inp, std::span<const float> dout) {
  gelu_backward_impl(dinp, inp, dout, false);
}

// ---- residual ------------------------------------------------------------------------

void residual_forward(std::span<float> out, std::span<const float> a, std::span<const float> b) {
  check_size("residual_forward", "b", b.size(), a.size(), "a.size()");
  check_size("residual_forward", "out", out.size(), a.size(), "a.size()");
  const LayerKernels& k = active_layer_kernels();
  chunked(a.size(), [&](std::size_t i, std::size_t n) { k.add(out.data() + i, a.data() + i, b.data() + i, n); });
}

void residual_backward(std::span<float> da, std::span<float> db, std::span<const float> dout) {
  check_size("residual_backward", "da", da.size(), dout.size(), "dout.size()");
  check_size("residual_backward", "db", db.size(), dout.size(), "dout.size()");
  const LayerKernels& k = active_layer_kernels();
  chunked(dout.size(), [&](std::size_t i, std::size_t n) { k.add_to_both(da.data() + i, db.data() + i, dout.data() + i, n); });
}

// ---- attention -------------------------------------------------------------------------

namespace {
void check_attention(const char* fn, std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  check_dim(fn, "B", B);
  check_dim(fn, "T", T);
  check_dim(fn, "C", C);
  check_dim(fn, "NH", NH);
  if (C % NH != 0) {
    fail(fn, "NH: expected a divisor of C = " + std::to_string(C) + ", found " + std::to_string(NH));
  }
}
}  // namespace

// The scalar reference (declared in layers.hpp's namespace reference).
namespace reference {

void attention_forward(std::span<float> out, std::span<float> preatt, std::span<float> att, std::span<const float> qkv,
                       std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  constexpr const char* fn = "attention_forward";
  check_attention(fn, B, T, C, NH);
  check_size(fn, "out", out.size(), B * T * C, "B*T*C");
  check_size(fn, "preatt", preatt.size(), B * NH * T * T, "B*NH*T*T");
  check_size(fn, "att", att.size(), B * NH * T * T, "B*NH*T*T");
  check_size(fn, "qkv", qkv.size(), B * T * 3 * C, "B*T*3C");

  const std::size_t C3 = 3 * C;
  const std::size_t hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  #pragma omp parallel for schedule(static) if (parallel_worth_it(B * NH * T * T * (C / NH)))
  for (std::size_t b = 0; b < B; ++b) {
    for (std::size_t t = 0; t < T; ++t) {
      for (std::size_t h = 0; h < NH; ++h) {
        const float* q = qkv.data() + (b * T + t) * C3 + h * hs;
        float* pre = preatt.data() + ((b * NH + h) * T + t) * T;
        float* a = att.data() + ((b * NH + h) * T + t) * T;
        // q.k / sqrt(hs) and the row maximum
        float maxval = 0.0f;
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const float* k = qkv.data() + (b * T + t2) * C3 + h * hs + C;
          float dot = 0.0f;
          #pragma omp simd reduction(+ : dot)
          for (std::size_t i = 0; i < hs; ++i) dot += q[i] * k[i];
          dot *= scale;
          if (t2 == 0 || dot > maxval) maxval = dot;
          pre[t2] = dot;
        }
        float expsum = 0.0f;
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const float e = std::exp(pre[t2] - maxval);
          expsum += e;
          a[t2] = e;
        }
        const float inv = 1.0f / expsum;  // expsum >= 1 (the maximum contributes exp(0))
        for (std::size_t t2 = 0; t2 <= t; ++t2) a[t2] *= inv;
        for (std::size_t t2 = t + 1; t2 < T; ++t2) {
          a[t2] = 0.0f;
          pre[t2] = 0.0f;
        }
        // out = att . v
        float* o = out.data() + (b * T + t) * C + h * hs;
        for (std::size_t i = 0; i < hs; ++i) o[i] = 0.0f;
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const float* v = qkv.data() + (b * T + t2) * C3 + h * hs + 2 * C;
          const float w = a[t2];
          #pragma omp simd
          for (std::size_t i = 0; i < hs; ++i) o[i] += w * v[i];
        }
      }
    }
  }
}

void attention_backward(std::span<float> dqkv, std::span<float> dpreatt, std::span<float> datt,
                        std::span<const float> dout, std::span<const float> qkv, std::span<const float> att,
                        std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  constexpr const char* fn = "attention_backward";
  check_attention(fn, B, T, C, NH);
  check_size(fn, "dqkv", dqkv.size(), B * T * 3 * C, "B*T*3C");
  check_size(fn, "dpreatt", dpreatt.size(), B * NH * T * T, "B*NH*T*T");
  check_size(fn, "datt", datt.size(), B * NH * T * T, "B*NH*T*T");
  check_size(fn, "dout", dout.size(), B * T * C, "B*T*C");
  check_size(fn, "qkv", qkv.size(), B * T * 3 * C, "B*T*3C");
  check_size(fn, "att", att.size(), B * NH * T * T, "B*NH*T*T");

  const std::size_t C3 = 3 * C;
  const std::size_t hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  #pragma omp parallel for schedule(static) if (parallel_worth_it(B * NH * T * T * (C / NH)))
  for (std::size_t b = 0; b < B; ++b) {
    for (std::size_t t = 0; t < T; ++t) {
      for (std::size_t h = 0; h < NH; ++h) {
        const float* q = qkv.data() + (b * T + t) * C3 + h * hs;
        float* dq = dqkv.data() + (b * T + t) * C3 + h * hs;
        const float* a = att.data() + ((b * NH + h) * T + t) * T;
        float* da = datt.data() + ((b * NH + h) * T + t) * T;
        float* dpre = dpreatt.data() + ((b * NH + h) * T + t) * T;
        const float* dy = dout.data() + (b * T + t) * C + h * hs;

        // through out = att . v: datt[t2] = v[t2] . dout; dv[t2] += att[t2] * dout
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const float* v = qkv.data() + (b * T + t2) * C3 + h * hs + 2 * C;
          float* dv = dqkv.data() + (b * T + t2) * C3 + h * hs + 2 * C;
          const float w = a[t2];
          float s = 0.0f;
          #pragma omp simd reduction(+ : s)
          for (std::size_t i = 0; i < hs; ++i) {
            s += v[i] * dy[i];
            dv[i] += w * dy[i];
          }
          da[t2] = s;
        }
        // through the softmax: dpre[t3] = att[t3] * (datt[t3] - sum_t2 att[t2] datt[t2])
        float dot = 0.0f;
        for (std::size_t t2 = 0; t2 <= t; ++t2) dot += a[t2] * da[t2];
        for (std::size_t t3 = 0; t3 <= t; ++t3) dpre[t3] = a[t3] * (da[t3] - dot);
        for (std::size_t t2 = t + 1; t2 < T; ++t2) {
          da[t2] = 0.0f;
          dpre[t2] = 0.0f;
        }
        // through preatt = q.k * scale
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const float* k = qkv.data() + (b * T + t2) * C3 + h * hs + C;
          float* dk = dqkv.data() + (b * T + t2) * C3 + h * hs + C;
          const float g = dpre[t2] * scale;
          #pragma omp simd
          for (std::size_t i = 0; i < hs; ++i) {
            dq[i] += k[i] * g;
            dk[i] += q[i] * g;
          }
        }
      }
    }
  }
}

}  // namespace reference

// The dispatched softmax row (vectorized where the CPU allows; docs/layers.md gives its
// bound against the scalar reference), then the masked part of `pre` zeroed.
void softmax_causal_row(float* pre, float* att, std::size_t visible, std::size_t T) noexcept {
  (void)active_layer_kernels().softmax_row(att, pre, T, visible);
  for (std::size_t t2 = visible; t2 < T; ++t2) pre[t2] = 0.0f;
}

namespace {

// Element offset of (row, col) in a stored matrix, as an untyped pointer.
const void* at(const MatrixView& m, std::size_t row, std::size_t col) {
  return static_cast<const std::byte*>(m.data) + (row * (m.ld == 0 ? m.cols : m.ld) + col) * dtype_size(m.dtype);
}

// One head's T x hs block of a stored [B*T, ld] matrix, starting at column `col`.
MatrixView head_block(const MatrixView& m, std::size_t b, std::size_t T, std::size_t col, std::size_t hs) {
  return MatrixView{at(m, b * T, col), m.dtype, T, hs, m.ld == 0 ? m.cols : m.ld};
}

void check_gemms(const char* fn, std::span<Gemm> gemms) {
  if (gemms.empty()) fail(fn, "gemms: expected at least one Gemm, found 0");
  if (gemms.size() == 1) return;
  for (const Gemm& g : gemms) {
    if (g.options().threads != 1) {
      fail(fn, "gemms: expected 1-thread Gemms when there are " + std::to_string(gemms.size()) + ", found one with " +
                   std::to_string(g.options().threads) + " threads");
    }
  }
}

// f(gemm, i) for i in [0, count): on gemms[0] in order, or in parallel with each OpenMP
// thread on its own Gemm.
template <class F>
void for_each_head(std::span<Gemm> gemms, std::size_t count, F&& f) {
  if (gemms.size() == 1) {
    for (std::size_t i = 0; i < count; ++i) f(gemms[0], i);
    return;
  }
  #pragma omp parallel for schedule(static) num_threads(static_cast<int>(gemms.size()))
  for (std::size_t i = 0; i < count; ++i) f(gemms[static_cast<std::size_t>(omp_get_thread_num())], i);
}

}  // namespace

void attention_prepare(std::span<Gemm> gemms, DType qkv_type, DType dout_type, std::size_t T, std::size_t C,
                       std::size_t NH) {
  check_gemms("attention_prepare", gemms);
  for (Gemm& g : gemms) attention_prepare(g, qkv_type, dout_type, T, C, NH);
}

void attention_prepare(Gemm& gemm, DType qkv_type, DType dout_type, std::size_t T, std::size_t C, std::size_t NH) {
  check_attention("attention_prepare", 1, T, C, NH);
  const std::size_t hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float x = 0;  // only shapes matter to prepare(); pointers must be non-null
  const MatrixView qkv_head{&x, qkv_type, T, hs, 3 * C}, dout_head{&x, dout_type, T, hs, C};
  const MatrixView tt = view(&x, T, T);
  // forward: the scores, att . v
  gemm.prepare(qkv_head, qkv_head, output(&x, T, T), {.trans_a = Trans::no, .trans_b = Trans::yes, .alpha = scale});
  gemm.prepare(tt, qkv_head, output(&x, T, hs, C));
  // backward: dout . v^T, att^T . dout, dpre . k, dpre^T . q
  gemm.prepare(dout_head, qkv_head, output(&x, T, T), {.trans_a = Trans::no, .trans_b = Trans::yes});
  gemm.prepare(tt, dout_head, output(&x, T, hs, 3 * C), {.trans_a = Trans::yes, .beta = 1.0f});
  gemm.prepare(tt, qkv_head, output(&x, T, hs, 3 * C), {.alpha = scale, .beta = 1.0f});
  gemm.prepare(tt, qkv_head, output(&x, T, hs, 3 * C), {.trans_a = Trans::yes, .alpha = scale, .beta = 1.0f});
}

void attention_forward(Gemm& gemm, std::span<float> out, std::span<float> preatt, std::span<float> att,
                       std::span<const float> qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  check_attention("attention_forward", B, T, C, NH);
  check_size("attention_forward", "qkv", qkv.size(), B * T * 3 * C, "B*T*3C");
  attention_forward(gemm, out, preatt, att, view(qkv.data(), B * T, 3 * C), B, T, C, NH);
}

void attention_forward(Gemm& gemm, std::span<float> out, std::span<float> preatt, std::span<float> att,
                       const MatrixView& qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  attention_forward(std::span<Gemm>(&gemm, 1), out, preatt, att, qkv, B, T, C, NH);
}

void attention_forward(std::span<Gemm> gemms, std::span<float> out, std::span<float> preatt, std::span<float> att,
                       const MatrixView& qkv, std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  constexpr const char* fn = "attention_forward";
  check_gemms(fn, gemms);
  check_attention(fn, B, T, C, NH);
  check_size(fn, "out", out.size(), B * T * C, "B*T*C");
  check_size(fn, "preatt", preatt.size(), B * NH * T * T, "B*NH*T*T");
  check_size(fn, "att", att.size(), B * NH * T * T, "B*NH*T*T");
  check_matrix(fn, "qkv", qkv, B * T, 3 * C, "B*T x 3C");

  const std::size_t hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const GemmArgs scores{.trans_a = Trans::no, .trans_b = Trans::yes, .alpha = scale, .beta = 0.0f};
  // preatt[t, t2] = q_t . k_t2 * scale over the full T x T block of every (b, h) (the
  // masked half is overwritten by the softmax), then att = causal softmax per row (all
  // B*NH*T rows in one parallel loop), then out[t, h*hs..] = sum_t2 att[t, t2] v_t2
  // (masked att entries are exactly 0).
  for_each_head(gemms, B * NH, [&](Gemm& gemm, std::size_t bh) {
    const std::size_t b = bh / NH, h = bh % NH;
    gemm.run(head_block(qkv, b, T, h * hs, hs), head_block(qkv, b, T, C + h * hs, hs),
             output(preatt.data() + bh * T * T, T, T), scores);
  });
  const std::size_t rows = B * NH * T;
  #pragma omp parallel for schedule(static) if (parallel_worth_it(rows * T))
  for (std::size_t r = 0; r < rows; ++r) softmax_causal_row(preatt.data() + r * T, att.data() + r * T, r % T + 1, T);
  for_each_head(gemms, B * NH, [&](Gemm& gemm, std::size_t bh) {
    const std::size_t b = bh / NH, h = bh % NH;
    gemm.run(view(att.data() + bh * T * T, T, T), head_block(qkv, b, T, 2 * C + h * hs, hs),
             output(out.data() + b * T * C + h * hs, T, hs, C));
  });
}

void attention_backward(Gemm& gemm, std::span<float> dqkv, std::span<float> dpreatt, std::span<float> datt,
                        std::span<const float> dout, std::span<const float> qkv, std::span<const float> att,
                        std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  check_attention("attention_backward", B, T, C, NH);
  check_size("attention_backward", "dout", dout.size(), B * T * C, "B*T*C");
  check_size("attention_backward", "qkv", qkv.size(), B * T * 3 * C, "B*T*3C");
  attention_backward(gemm, dqkv, dpreatt, datt, view(dout.data(), B * T, C), view(qkv.data(), B * T, 3 * C), att, B,
                     T, C, NH);
}

void attention_backward(Gemm& gemm, std::span<float> dqkv, std::span<float> dpreatt, std::span<float> datt,
                        const MatrixView& dout, const MatrixView& qkv, std::span<const float> att, std::size_t B,
                        std::size_t T, std::size_t C, std::size_t NH) {
  attention_backward(std::span<Gemm>(&gemm, 1), dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH);
}

void attention_backward(std::span<Gemm> gemms, std::span<float> dqkv, std::span<float> dpreatt,
                        std::span<float> datt, const MatrixView& dout, const MatrixView& qkv,
                        std::span<const float> att, std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  constexpr const char* fn = "attention_backward";
  check_gemms(fn, gemms);
  check_attention(fn, B, T, C, NH);
  check_size(fn, "dqkv", dqkv.size(), B * T * 3 * C, "B*T*3C");
  check_size(fn, "dpreatt", dpreatt.size(), B * NH * T * T, "B*NH*T*T");
  check_size(fn, "datt", datt.size(), B * NH * T * T, "B*NH*T*T");
  check_matrix(fn, "dout", dout, B * T, C, "B*T x C");
  check_matrix(fn, "qkv", qkv, B * T, 3 * C, "B*T x 3C");
  check_size(fn, "att", att.size(), B * NH * T * T, "B*NH*T*T");

  const std::size_t C3 = 3 * C;
  const std::size_t hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const GemmArgs nt{.trans_a = Trans::no, .trans_b = Trans::yes, .alpha = 1.0f, .beta = 0.0f};
  const GemmArgs tn_acc{.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f};
  const GemmArgs nn_scaled_acc{.trans_a = Trans::no, .trans_b = Trans::no, .alpha = scale, .beta = 1.0f};
  const GemmArgs tn_scaled_acc{.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = scale, .beta = 1.0f};
  // through out = att . v: datt = dout . v^T (full blocks; masked entries zeroed below),
  // dv += att^T . dout
  for_each_head(gemms, B * NH, [&](Gemm& gemm, std::size_t bh) {
    const std::size_t b = bh / NH, h = bh % NH;
    const MatrixView dy = head_block(dout, b, T, h * hs, hs);
    gemm.run(dy, head_block(qkv, b, T, 2 * C + h * hs, hs), output(datt.data() + bh * T * T, T, T), nt);
    gemm.run(view(att.data() + bh * T * T, T, T), dy, output(dqkv.data() + b * T * C3 + 2 * C + h * hs, T, hs, C3),
             tn_acc);
  });
  // through the softmax, every row in one parallel loop:
  // dpre[t3] = att[t3] * (datt[t3] - sum_t2 att[t2] datt[t2])
  const std::size_t rows = B * NH * T;
  #pragma omp parallel for schedule(static) if (parallel_worth_it(rows * T))
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t t = r % T;
    const float* ar = att.data() + r * T;
    float* dar = datt.data() + r * T;
    float* dpr = dpreatt.data() + r * T;
    float dot = 0.0f;
    for (std::size_t t2 = 0; t2 <= t; ++t2) dot += ar[t2] * dar[t2];
    for (std::size_t t3 = 0; t3 <= t; ++t3) dpr[t3] = ar[t3] * (dar[t3] - dot);
    for (std::size_t t2 = t + 1; t2 < T; ++t2) {
      dar[t2] = 0.0f;
      dpr[t2] = 0.0f;
    }
  }
  // through preatt = q.k * scale: dq += scale dpre . k, dk += scale dpre^T . q
  for_each_head(gemms, B * NH, [&](Gemm& gemm, std::size_t bh) {
    const std::size_t b = bh / NH, h = bh % NH;
    const MatrixView dpre = view(dpreatt.data() + bh * T * T, T, T);
    float* dq = dqkv.data() + b * T * C3 + h * hs;
    gemm.run(dpre, head_block(qkv, b, T, C + h * hs, hs), output(dq, T, hs, C3), nn_scaled_acc);
    gemm.run(dpre, head_block(qkv, b, T, h * hs, hs), output(dq + C, T, hs, C3), tn_scaled_acc);
  });
}

// ---- softmax + cross-entropy -------------------------------------------------------------

namespace {
void check_crossentropy(const char* fn, std::size_t B, std::size_t T, std::size_t V) {
  check_dim(fn, "B", B);
  check_dim(fn, "T", T);
  check_dim(fn, "V", V);
}
}  // namespace

void softmax_crossentropy_forward(std::span<float> losses, std::span<float> probs, std::span<const float> logits,
                                  std::span<const TokenId> targets, std::size_t B, std::size_t T, std::size_t V) {
  constexpr const char* fn = "softmax_crossentropy_forward";
  check_crossentropy(fn, B, T, V);
  check_size(fn, "losses", losses.size(), B * T, "B*T");
  check_size(fn, "probs", probs.size(), B * T * V, "B*T*V");
  check_size(fn, "logits", logits.size(), B * T * V, "B*T*V");
  check_size(fn, "targets", targets.size(), B * T, "B*T");
  check_tokens(fn, "targets", targets, V);

  const LayerKernels& k = active_layer_kernels();
  for_range(B * T, B * T * V, [&](std::size_t n) {
    const float* l = logits.data() + n * V;
    const detail::SoftmaxStats st = k.softmax_row(probs.data() + n * V, l, V, V);
    losses[n] = std::log(st.sum) - (l[targets[n]] - st.max);  // st.sum >= 1
  });
}

namespace {
void crossentropy_backward_impl(std::span<float> dlogits, std::span<const float> dlosses,
                                std::span<const float> probs, std::span<const TokenId> targets, std::size_t B,
                                std::size_t T, std::size_t V, bool accumulate) {
  constexpr const char* fn = "crossentropy_softmax_backward";
  check_crossentropy(fn, B, T, V);
  check_size(fn, "dlogits", dlogits.size(), B * T * V, "B*T*V");
  check_size(fn, "dlosses", dlosses.size(), B * T, "B*T");
  check_size(fn, "probs", probs.size(), B * T * V, "B*T*V");
  check_size(fn, "targets", targets.size(), B * T, "B*T");
  check_tokens(fn, "targets", targets, V);

  const LayerKernels& k = active_layer_kernels();
  for_range(B * T, B * T * V, [&](std::size_t n) {
    k.crossentropy_backward_row(dlogits.data() + n * V, probs.data() + n * V, V, targets[n], dlosses[n], accumulate);
  });
}
}  // namespace

void crossentropy_softmax_backward(std::span<float> dlogits, std::span<const float> dlosses,
                                   std::span<const float> probs, std::span<const TokenId> targets, std::size_t B,
                                   std::size_t T, std::size_t V) {
  crossentropy_backward_impl(dlogits, dlosses, probs, targets, B, T, V, true);
}

void detail::crossentropy_softmax_backward_store(std::span<float> dlogits, std::span<const float> dlosses,
                                                 std::span<const float> probs, std::span<const TokenId> targets,
                                                 std::size_t B, std::size_t T, std::size_t V) {
  crossentropy_backward_impl(dlogits, dlosses, probs, targets, B, T, V, false);
}

float mean_loss(std::span<const float> losses) noexcept {
  if (losses.empty()) return 0.0f;
  double sum = 0.0;
  for (const float l : losses) sum += static_cast<double>(l);
  return static_cast<float>(sum / static_cast<double>(losses.size()));
}

}  // namespace mixprec::nn
