// Shared by Gemm and gemm_reference: argument checks, the K = 0 case and the
// rounding of C into the low-precision output.
#pragma once

#include <cstddef>

#include "mixprec/nn/gemm.hpp"

namespace mixprec::nn::detail {

struct GemmShape {
  std::size_t m, n, k;
  std::size_t lda, ldb, ldc;  // resolved (0 replaced by the dense value)
};

// Throws std::invalid_argument when the views do not describe
// C[M,N] = op(A)[M,K] op(B)[K,N] (+ low[M,N]); nothing is written before.
GemmShape check_gemm(const MatrixView& a, const MatrixView& b, const OutputView& c, const LowOutputView* low,
                     const GemmArgs& args);

// K = 0: C = beta * C (beta == 0: C = 0, C not read).
void scale_output(const OutputView& c, const GemmShape& s, float beta);

// low = round-to-nearest-even(C), row by row when either is strided.
ConversionStats round_output(const OutputView& c, const LowOutputView& low);

}  // namespace mixprec::nn::detail
