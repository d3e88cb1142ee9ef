// Matrix multiply for the training engine: C = alpha * op(A) * op(B) + beta * C
// over row-major matrices, A and B in f32, f16 or bf16, C accumulated in fp32,
// and optionally rounded (nearest even) to f16/bf16 into a separate output.
//
// The fast path is oneDNN's matmul (never hand-written kernels); gemm_reference
// is the plain scalar definition (double accumulation, fixed loop order) it is
// tested against. See docs/gemm.md for what runs where, what is allocated when,
// threading, and the test tolerances.
//
// Element products of f16/bf16 inputs are exact in fp32, so widening a
// low-precision input to fp32 and multiplying in fp32 computes what a tensor
// core computes (exact products, fp32 accumulation). That is what happens for
// f16 where the linked oneDNN has no f16 matmul (2.6), and for bf16 where it has
// no bf16 matmul on this CPU; the native paths compute the same products and
// accumulate them in fp32 in their own order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mixprec/formats/dtype.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/types.hpp"

namespace mixprec::nn {

// A read-only row-major matrix as stored: element (r, c) is at data[r * ld + c],
// ld >= cols (ld == 0 means dense: ld = cols).
struct MatrixView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::size_t rows = 0, cols = 0, ld = 0;
};

// The fp32 output C[M, N] (read too when beta != 0).
struct OutputView {
  float* data = nullptr;
  std::size_t rows = 0, cols = 0, ld = 0;
};

// The optional rounded copy of C: f16 or bf16, M x N, its own leading dimension.
struct LowOutputView {
  void* data = nullptr;
  DType dtype = DType::f16;
  std::size_t rows = 0, cols = 0, ld = 0;
};

inline MatrixView view(const float* p, std::size_t rows, std::size_t cols, std::size_t ld = 0) {
  return {p, DType::f32, rows, cols, ld};
}
inline MatrixView view(const f16* p, std::size_t rows, std::size_t cols, std::size_t ld = 0) {
  return {p, DType::f16, rows, cols, ld};
}
inline MatrixView view(const bf16* p, std::size_t rows, std::size_t cols, std::size_t ld = 0) {
  return {p, DType::bf16, rows, cols, ld};
}
inline OutputView output(float* p, std::size_t rows, std::size_t cols, std::size_t ld = 0) {
  return {p, rows, cols, ld};
}
inline LowOutputView low_output(f16* p, std::size_t rows, std::size_t cols, std::size_t ld = 0) {
  return {p, DType::f16, rows, cols, ld};
}
inline LowOutputView low_output(bf16* p, std::size_t rows, std::size_t cols, std::size_t ld = 0) {
  return {p, DType::bf16, rows, cols, ld};
}

enum class Trans : std::uint8_t { no, yes };

// op(A) = A (Trans::no: A stored M x K) or A^T (Trans::yes: A stored K x M); likewise
// op(B) is K x N. Layers: Y = X W^T + b is (X, no, W, yes); dX = dY W is (dY, no, W, no);
// dW = dY^T X is (dY, yes, X, no), with beta = 1 to accumulate over micro-batches.
struct GemmArgs {
  Trans trans_a = Trans::no;
  Trans trans_b = Trans::no;
  float alpha = 1.0f;
  float beta = 0.0f;  // 0: C is written, never read (NaN in C does not propagate)
};

// How the fast path multiplies one pair of input types.
enum class GemmPath : std::uint8_t {
  onednn_f32,   // both inputs f32 (or widened to f32 first): oneDNN f32 matmul
  onednn_bf16,  // bf16 x bf16 -> f32 in oneDNN (where the CPU supports it)
  onednn_f16,   // f16 x f16 -> f32 in oneDNN (oneDNN 3, where the CPU supports it)
};

struct GemmOptions {
  // oneDNN threads for this object's calls: 0 leaves OpenMP's default (OMP_NUM_THREADS,
  // else every core); n > 0 runs each call on exactly n OpenMP threads and restores
  // the calling thread's setting afterwards.
  unsigned threads = 0;
  // Use oneDNN's bf16 matmul when the CPU has one; false always widens bf16 to f32
  // (tests use it to compare both paths on machines that have both).
  bool native_bf16 = true;
  // Use oneDNN's f16 matmul (fp32 accumulation) when the linked oneDNN has a fast one on this
  // CPU; false always widens f16 to f32, as oneDNN 2.6 must.
  bool native_f16 = true;
};

// Owns the oneDNN engine and stream, one cached primitive per distinct call
// signature (shape, input types, transposes, leading dimensions, alpha, beta),
// and the scratch buffers that inputs are widened into. The first call with a
// new signature creates its primitive and may grow scratch (allocations happen
// only then); later calls with that signature allocate nothing in mixprec (see
// docs/gemm.md for what oneDNN 2.6 itself does per call).
//
// Not thread-safe: one call at a time per object (use one object per thread).
class Gemm {
 public:
  explicit Gemm(GemmOptions options = {});
  ~Gemm();
  Gemm(Gemm&&) noexcept;
  Gemm& operator=(Gemm&&) noexcept;
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // C = alpha * op(A) * op(B) + beta * C. Throws std::invalid_argument (before
  // writing anything) when shapes disagree, a pointer is null with a non-empty
  // matrix, or ld < cols.
  void run(const MatrixView& a, const MatrixView& b, const OutputView& c, const GemmArgs& args = {});

  // The same, then rounds C to nearest even into `low` (f16 or bf16, IEEE overflow
  // to inf) with the library's bulk conversion; returns what that rounding lost.
  ConversionStats run(const MatrixView& a, const MatrixView& b, const OutputView& c, const LowOutputView& low,
                      const GemmArgs& args = {});

  // Creates the primitive and scratch for a call signature without running it,
  // so that a training loop can do all its allocation up front.
  void prepare(const MatrixView& a, const MatrixView& b, const OutputView& c, const GemmArgs& args = {});

  // oneDNN's implementation for this call signature (creating its primitive as prepare
  // does), prefixed "widened f32: " when the inputs are widened; "" for empty shapes.
  // A bf16 or f16 layout that oneDNN would only run on a slower matmul than the one it
  // picks for a dense product of that type is widened.
  std::string implementation(const MatrixView& a, const MatrixView& b, const OutputView& c,
                             const GemmArgs& args = {});

  // The path a pair of input types takes on this CPU with these options.
  GemmPath path(DType a, DType b) const noexcept;
  std::size_t cached_primitives() const noexcept;
  std::size_t scratch_bytes() const noexcept;  // widening buffers + oneDNN scratchpad
  // 2 M N K summed over the products this object has run (run(), not prepare(); K = 0 adds
  // nothing): what a step's GEMMs cost, for `mixprec bench train`'s bound.
  std::uint64_t flops() const noexcept;
  const GemmOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What oneDNN offers on this CPU, probed once per process.
struct GemmBackendInfo {
  std::string onednn_version;   // e.g. "2.6.3"
  std::string cpu_isa;          // oneDNN's effective ISA, e.g. "avx2", "avx512_core_bf16"
  std::string threading;        // "OpenMP", "TBB", "threadpool", "sequential"
  std::string f32_impl;         // oneDNN implementation chosen for a 64x64x64 f32 matmul
  bool bf16_native = false;     // oneDNN can build a bf16 x bf16 -> f32 matmul here
  std::string bf16_impl;        // its implementation, or "" when not native
  bool avx512_bf16 = false;     // the CPU has AVX512-BF16 instructions (native bf16 dot products)
  bool f16_native = false;      // oneDNN can build a fast f16 x f16 -> f32 matmul here (not its reference one)
  std::string f16_impl;         // its implementation, or "" when not native
  bool avx512_fp16 = false;     // the CPU has AVX512-FP16 (fp16 FMAs, accumulating in fp16)
  bool amx_fp16 = false;        // the CPU has AMX-FP16 (fp16 tiles accumulating in fp32)
};
const GemmBackendInfo& gemm_backend_info();

// The definition: for each (i, j), sum over k = 0..K-1 in order of
// double(op(A)[i,k]) * double(op(B)[k,j]) in double, then alpha * sum + beta * C
// (beta == 0: C not read) in double, rounded once to fp32. Same arguments and
// errors as Gemm::run.
void gemm_reference(const MatrixView& a, const MatrixView& b, const OutputView& c, const GemmArgs& args = {});
ConversionStats gemm_reference(const MatrixView& a, const MatrixView& b, const OutputView& c,
                               const LowOutputView& low, const GemmArgs& args = {});

}  // namespace mixprec::nn
