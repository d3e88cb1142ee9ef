// gemm_reference (the scalar definition the oneDNN path is tested against) and the
// argument checks, K = 0 case and output rounding shared with Gemm.
#include <span>
#include <stdexcept>
#include <string>

#include "mixprec/nn/gemm.hpp"
#include "nn/gemm_common.hpp"

namespace mixprec::nn {
namespace detail {
namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("mixprec::nn::gemm: " + what); }

std::string dims(std::size_t r, std::size_t c) { return std::to_string(r) + "x" + std::to_string(c); }

std::size_t resolve_ld(const char* name, std::size_t rows, std::size_t cols, std::size_t ld, const void* data) {
  if (ld == 0) ld = cols;
  if (ld < cols) bad(std::string(name) + ": leading dimension " + std::to_string(ld) + " < columns " + std::to_string(cols));
  if (rows > 0 && cols > 0 && data == nullptr) bad(std::string(name) + ": null data for a " + dims(rows, cols) + " matrix");
  return ld;
}

bool valid(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

}  // namespace

GemmShape check_gemm(const MatrixView& a, const MatrixView& b, const OutputView& c, const LowOutputView* low,
                     const GemmArgs& args) {
  if (!valid(a.dtype) || !valid(b.dtype)) bad("inputs must be f32, f16 or bf16");
  const bool ta = args.trans_a == Trans::yes, tb = args.trans_b == Trans::yes;
  GemmShape s{};
  s.m = ta ? a.cols : a.rows;
  s.k = ta ? a.rows : a.cols;
  const std::size_t kb = tb ? b.cols : b.rows;
  s.n = tb ? b.rows : b.cols;
  if (kb != s.k) {
    bad("inner dimensions differ: op(A) is " + dims(s.m, s.k) + ", op(B) is " + dims(kb, s.n));
  }
  if (c.rows != s.m || c.cols != s.n) bad("C is " + dims(c.rows, c.cols) + ", expected " + dims(s.m, s.n));
  s.lda = resolve_ld("A", a.rows, a.cols, a.ld, a.data);
  s.ldb = resolve_ld("B", b.rows, b.cols, b.ld, b.data);
  s.ldc = resolve_ld("C", c.rows, c.cols, c.ld, c.data);
  if (low != nullptr) {
    if (low->dtype != DType::f16 && low->dtype != DType::bf16) bad("the rounded output must be f16 or bf16");
    if (low->rows != s.m || low->cols != s.n) {
      bad("rounded output is " + dims(low->rows, low->cols) + ", expected " + dims(s.m, s.n));
    }
    resolve_ld("rounded output", low->rows, low->cols, low->ld, low->data);
  }
  return s;
}

void scale_output(const OutputView& c, const GemmShape& s, float beta) {
  for (std::size_t i = 0; i < s.m; ++i) {
    float* row = c.data + i * s.ldc;
    for (std::size_t j = 0; j < s.n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
  }
}

ConversionStats round_output(const OutputView& c, const LowOutputView& low) {
  const std::size_t ldc = c.ld == 0 ? c.cols : c.ld;
  const std::size_t ldl = low.ld == 0 ? low.cols : low.ld;
  const bool dense = ldc == c.cols && ldl == low.cols;
  const std::size_t rows = dense ? 1 : c.rows;
  const std::size_t len = dense ? c.rows * c.cols : c.cols;
  ConversionStats st;
  if (c.rows == 0 || c.cols == 0) return st;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::span<const float> src(c.data + r * ldc, len);
    if (low.dtype == DType::f16) {
      st += convert_counted(src, std::span<f16>(static_cast<f16*>(low.data) + r * ldl, len));
    } else {
      st += convert_counted(src, std::span<bf16>(static_cast<bf16*>(low.data) + r * ldl, len));
    }
  }
  return st;
}

}  // namespace detail

namespace {

double element(const MatrixView& v, std::size_t ld, std::size_t r, std::size_t c) {
  const std::size_t i = r * ld + c;
  switch (v.dtype) {
    case DType::f32: return static_cast<const float*>(v.data)[i];
    case DType::f16: return static_cast<float>(static_cast<const f16*>(v.data)[i]);
    case DType::bf16: return static_cast<float>(static_cast<const bf16*>(v.data)[i]);
  }
  return 0.0;
}

}  // namespace

void gemm_reference(const MatrixView& a, const MatrixView& b, const OutputView& c, const GemmArgs& args) {
  const detail::GemmShape s = detail::check_gemm(a, b, c, nullptr, args);
  const bool ta = args.trans_a == Trans::yes, tb = args.trans_b == Trans::yes;
  for (std::size_t i = 0; i < s.m; ++i) {
    for (std::size_t j = 0; j < s.n; ++j) {
      double sum = 0.0;
      for (std::size_t k = 0; k < s.k; ++k) {
        const double x = ta ? element(a, s.lda, k, i) : element(a, s.lda, i, k);
        const double y = tb ? element(b, s.ldb, j, k) : element(b, s.ldb, k, j);
        sum += x * y;
      }
      float& out = c.data[i * s.ldc + j];
      double r = static_cast<double>(args.alpha) * sum;
      if (args.beta != 0.0f) r += static_cast<double>(args.beta) * static_cast<double>(out);
      out = static_cast<float>(r);
    }
  }
}

ConversionStats gemm_reference(const MatrixView& a, const MatrixView& b, const OutputView& c,
                               const LowOutputView& low, const GemmArgs& args) {
  detail::check_gemm(a, b, c, &low, args);
  gemm_reference(a, b, c, args);
  return detail::round_output(c, low);
}

}  // namespace mixprec::nn
