// fp8 Linear layers of the fp8 presets (src/nn/fp8_linear.hpp, docs/fp8.md).
#include "fp8_linear.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "mixprec/fp8/quantize.hpp"
#include "mixprec/nn/layers.hpp"

namespace mixprec::nn::detail {
namespace {

template <fp8::Fp8Type T>
std::span<T> as_codes(std::span<std::uint8_t> codes, std::size_t n) {
  return {reinterpret_cast<T*>(codes.data()), n};
}

template <fp8::Fp8Type T>
ConversionStats fake_quantize_as(std::span<const float> x, std::span<float> out, float scale, float scale_inv,
                                 std::span<std::uint8_t> codes) {
  const std::span<T> c = as_codes<T>(codes, x.size());
  const ConversionStats s = convert_counted<T>(x, c, {Overflow::saturate, Subnormals::keep, scale});
  convert<T>(std::span<const T>(c), out, {Overflow::ieee, Subnormals::keep, scale_inv});
  return s;
}

// One MX block of len <= 32 values. Finite blocks take the bulk (SIMD) conversion with the
// block's factor, which is what fp8::mx_quantize computes element by element; blocks
// holding inf or NaN take the scalar reference itself (their scale rules differ per
// rounding) and count saturation as 0 (the reference does not report it).
template <fp8::Fp8Type T>
void mx_block(const float* x, float* out, std::size_t len, fp8::MxRounding rounding, std::uint8_t* code_bytes,
              MxFakeQuantized& r) {
  const std::span<const float> blk(x, len);
  const std::span<float> dst(out, len);
  const std::span<T> codes(reinterpret_cast<T*>(code_bytes), len);
  const float a = amax_of(blk);  // NaN skipped: TE's block amax
  if (std::isfinite(a)) {
    const e8m0 scale = fp8::mx_scale(a, fp8::dtype_of<T>(), rounding);
    const float factor = fp8::mx_quantize_factor(scale, rounding);
    if (std::isfinite(factor) && factor > 0) {
      const ConversionStats s = convert_counted<T>(blk, codes, {Overflow::saturate, Subnormals::keep, factor});
      if (s.nonfinite_input == 0) {
        convert<T>(std::span<const T>(codes), dst, {Overflow::ieee, Subnormals::keep, static_cast<float>(scale)});
        r.stats += s;
        r.min_factor = r.min_factor == 0 ? factor : std::min(r.min_factor, factor);  // factors are > 0
        return;
      }
    }
  }
  e8m0 scale;
  fp8::mx_quantize<T>(blk, codes, std::span<e8m0>(&scale, 1), rounding);
  ConversionStats s;
  s.elements = len;
  for (std::size_t i = 0; i < len; ++i) {
    if (blk[i] == 0.0f) continue;
    ++s.nonzero;
    if (!std::isfinite(blk[i])) ++s.nonfinite_input;
    else if (mixprec::decode(codes[i]) == 0.0f) ++s.underflow;
  }
  fp8::mx_dequantize<T>(std::span<const T>(codes), std::span<const e8m0>(&scale, 1), dst);
  r.stats += s;
}

template <fp8::Fp8Type T>
MxFakeQuantized fake_quantize_mx_as(std::span<const float> x, std::span<float> out, std::size_t row_len,
                                    fp8::MxRounding rounding, std::span<std::uint8_t> codes) {
  MxFakeQuantized r;
  for (std::size_t row = 0; row < x.size(); row += row_len) {
    for (std::size_t b = 0; b < row_len; b += fp8::kMxBlock) {
      const std::size_t len = std::min(fp8::kMxBlock, row_len - b);
      mx_block<T>(x.data() + row + b, out.data() + row + b, len, rounding, codes.data() + row + b, r);
    }
  }
  return r;
}

// The step's amax so far folded with another: NaN sticks, else the max.
float fold_amax(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return std::max(a, b);
}

void check_size(const char* what, std::size_t found, std::size_t expected) {
  if (found != expected) {
    throw std::invalid_argument(std::string("fp8 linear: ").append(what).append(": expected ")
                                    .append(std::to_string(expected)).append(" elements, found ")
                                    .append(std::to_string(found)));
  }
}

}  // namespace

ConversionStats fake_quantize(std::span<const float> x, std::span<float> out, fp8::Dtype dtype, float scale,
                              float scale_inv, std::span<std::uint8_t> codes) {
  check_size("fake_quantize out", out.size(), x.size());
  if (codes.size() < x.size()) check_size("fake_quantize codes", codes.size(), x.size());
  return dtype == fp8::Dtype::e4m3 ? fake_quantize_as<f8e4m3>(x, out, scale, scale_inv, codes)
                                   : fake_quantize_as<f8e5m2>(x, out, scale, scale_inv, codes);
}

MxFakeQuantized fake_quantize_mx(std::span<const float> x, std::span<float> out, std::size_t row_len,
                                 fp8::Dtype dtype, fp8::MxRounding rounding, std::span<std::uint8_t> codes) {
  check_size("fake_quantize_mx out", out.size(), x.size());
  if (codes.size() < x.size()) check_size("fake_quantize_mx codes", codes.size(), x.size());
  if (row_len == 0 || x.size() % row_len != 0) {
    throw std::invalid_argument("fake_quantize_mx: expected a row length dividing " + std::to_string(x.size()) +
                                ", found " + std::to_string(row_len));
  }
  return dtype == fp8::Dtype::e4m3 ? fake_quantize_mx_as<f8e4m3>(x, out, row_len, rounding, codes)
                                   : fake_quantize_mx_as<f8e5m2>(x, out, row_len, rounding, codes);
}

void transpose(std::span<const float> src, std::span<float> dst, std::size_t rows, std::size_t cols) {
  constexpr std::size_t kTile = 32;
  for (std::size_t r0 = 0; r0 < rows; r0 += kTile) {
    for (std::size_t c0 = 0; c0 < cols; c0 += kTile) {
      const std::size_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (std::size_t r = r0; r < r1; ++r) {
        for (std::size_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * cols + c];
      }
    }
  }
}

// ---- Fp8Linears ------------------------------------------------------------------------

Fp8Linears::Fp8Linears(Fp8Recipe recipe, const Fp8Config& config)
    : recipe_(recipe),
      config_(config),
      delayed_(fp8::DelayedScalingConfig{config.margin, config.amax_history_len, config.amax_compute_algo,
                                         config.format}) {
  if (recipe == Fp8Recipe::none) throw std::logic_error("Fp8Linears: the precision has no fp8 recipe");
  if (recipe == Fp8Recipe::current) {
    fp8::validate(fp8::CurrentScalingConfig{config.format, config.power_of_2_scales, config.amax_epsilon});
  }
}

std::size_t Fp8Linears::add(const std::string& layer, std::size_t rows, std::size_t in, std::size_t out) {
  if (finished_) throw std::logic_error("Fp8Linears::add after finish");
  Linear l;
  l.rows = rows;
  l.in = in;
  l.out = out;
  l.tensor = stats_.size();
  const bool mx = recipe_ == Fp8Recipe::mx;
  l.xq = saved_floats_;
  l.wq = l.xq + rows * in;
  l.xq_col = l.wq + out * in;
  l.wq_col = l.xq_col + (mx ? rows * in : 0);
  saved_floats_ = l.wq_col + (mx ? out * in : 0);
  const std::pair<const char*, fp8::Role> tensors[] = {
      {".input", fp8::Role::forward}, {".weight", fp8::Role::forward}, {".grad_output", fp8::Role::backward}};
  for (const auto& [suffix, role] : tensors) {
    Fp8TensorStats s;
    s.name = std::string(layer).append(suffix);
    s.role = role;
    s.dtype = fp8::dtype_for(config_.format, role);
    stats_.push_back(s);
    delayed_.add_tensor(s.name, role);
  }
  max_act_ = std::max({max_act_, rows * in, rows * out});
  max_weight_ = std::max(max_weight_, out * in);
  linears_.push_back(l);
  return linears_.size() - 1;
}

void Fp8Linears::finish() {
  std::size_t dy = 0;
  for (const Linear& l : linears_) dy = std::max(dy, l.rows * l.out);
  saved_.assign(saved_floats_, 0.0f);
  dyq_.assign(dy, 0.0f);
  if (recipe_ == Fp8Recipe::mx) {
    dyq_col_.assign(dy, 0.0f);
    transposed_.assign(std::max(max_act_, max_weight_), 0.0f);
  }
  codes_.assign(std::max(max_act_, max_weight_), 0);
  finished_ = true;
}

float Fp8Linears::scale_of(std::size_t t) const {
  return recipe_ == Fp8Recipe::delayed ? delayed_.scale(t) : 1.0f;
}

float Fp8Linears::scale_inv_of(std::size_t t) const {
  return recipe_ == Fp8Recipe::delayed ? delayed_.scale_inv(t) : 1.0f;
}

Fp8Linears::Pending Fp8Linears::quantize(std::size_t t, std::span<const float> x, std::span<float> out,
                                         std::size_t cols) {
  const fp8::Dtype d = stats_[t].dtype;
  Pending p;
  // The vectorised amax skips NaN; with a non-finite input (counted by the conversion)
  // fp8::amax's rules (NaN, then inf, win) are applied by the scalar reference.
  p.amax = amax_of(x);
  switch (recipe_) {
    case Fp8Recipe::mx: {
      const MxFakeQuantized r = fake_quantize_mx(x, out, cols, d, config_.mx_rounding, codes_);
      p.stats = r.stats;
      p.scale = r.min_factor;
      if (p.stats.nonfinite_input > 0) p.amax = fp8::amax(x);
      return p;
    }
    case Fp8Recipe::current: {
      // fp8::quantize_current: scale from this tensor's amax, scale_inv = 1 / scale.
      const float fmax = fp8::max_finite(d);
      p.scale = fp8::current_scale(p.amax, fmax, config_.power_of_2_scales, config_.amax_epsilon);
      p.stats = fake_quantize(x, out, d, p.scale, 1.0f / p.scale, codes_);
      if (p.stats.nonfinite_input > 0) {
        p.amax = fp8::amax(x);
        p.scale = fp8::current_scale(p.amax, fmax, config_.power_of_2_scales, config_.amax_epsilon);
        p.stats = fake_quantize(x, out, d, p.scale, 1.0f / p.scale, codes_);
      }
      return p;
    }
    case Fp8Recipe::delayed:
    case Fp8Recipe::noscale:
    case Fp8Recipe::none: break;
  }
  p.scale = scale_of(t);
  p.stats = fake_quantize(x, out, d, p.scale, scale_inv_of(t), codes_);
  if (p.stats.nonfinite_input > 0) p.amax = fp8::amax(x);
  return p;
}

void Fp8Linears::quantize_columnwise(std::size_t t, std::span<const float> x, std::span<float> out,
                                     std::size_t rows, std::size_t cols) {
  const std::span<float> tr(transposed_.data(), rows * cols);
  transpose(x, tr, rows, cols);
  (void)fake_quantize_mx(tr, tr, rows, stats_[t].dtype, config_.mx_rounding, codes_);
  transpose(tr, out, cols, rows);
}

void Fp8Linears::commit(std::size_t t, const Pending& p) {
  Fp8TensorStats& s = stats_[t];
  s.elements += p.stats.elements;
  s.nonzero += p.stats.nonzero;
  s.saturated += p.stats.overflow;
  s.flushed += p.stats.underflow;
  s.amax = fold_amax(s.amax, p.amax);
  s.scale = p.scale;
  if (recipe_ == Fp8Recipe::delayed) delayed_.record_amax(t, p.amax);
}

void Fp8Linears::forward(Gemm& g, std::size_t id, std::span<float> y, std::span<const float> x,
                         std::span<const float> w, std::span<const float> b, std::size_t rows) {
  Linear& l = linears_.at(id);
  if (rows == 0 || rows > l.rows) check_size("forward rows", rows, l.rows);
  check_size("forward x", x.size(), rows * l.in);
  check_size("forward w", w.size(), l.out * l.in);
  const std::span<float> xq(saved_.data() + l.xq, rows * l.in), wq(saved_.data() + l.wq, l.out * l.in);
  l.input = quantize(l.tensor, x, xq, l.in);
  l.weight = quantize(l.tensor + 1, w, wq, l.in);
  if (recipe_ == Fp8Recipe::mx) {
    quantize_columnwise(l.tensor, x, std::span<float>(saved_.data() + l.xq_col, rows * l.in), rows, l.in);
    quantize_columnwise(l.tensor + 1, w, std::span<float>(saved_.data() + l.wq_col, l.out * l.in), l.out, l.in);
  }
  linear_forward(g, y, xq, wq, b, rows, l.in, l.out);
  l.forward_rows = rows;
}

void Fp8Linears::backward(Gemm& g, std::size_t id, std::span<float> dx, std::span<float> dw, std::span<float> db,
                          std::span<const float> dy) {
  Linear& l = linears_.at(id);
  if (l.forward_rows != l.rows) {
    throw std::logic_error("fp8 linear backward: expected a full-batch forward of " + stats_[l.tensor].name +
                           " before backward");
  }
  const std::size_t N = l.rows, C = l.in, OC = l.out;
  check_size("backward dy", dy.size(), N * OC);
  check_size("backward dw", dw.size(), OC * C);
  if (!dx.empty()) check_size("backward dx", dx.size(), N * C);
  if (!db.empty()) check_size("backward db", db.size(), OC);
  commit(l.tensor, l.input);
  commit(l.tensor + 1, l.weight);
  const std::span<float> dyq(dyq_.data(), N * OC);
  commit(l.tensor + 2, quantize(l.tensor + 2, dy, dyq, OC));
  const std::span<const float> xq(saved_.data() + l.xq, N * C), wq(saved_.data() + l.wq, OC * C);
  if (recipe_ != Fp8Recipe::mx) {
    linear_backward(g, dx, dw, {}, dyq, xq, wq, N, C, OC);
  } else {
    // dgrad reduces over OC: dYq rowwise (blocks along OC) times the columnwise Wq; wgrad
    // reduces over N: the columnwise dYq and Xq (blocks along N).
    const std::span<float> dyq_col(dyq_col_.data(), N * OC);
    quantize_columnwise(l.tensor + 2, dy, dyq_col, N, OC);
    const float* xq_col = saved_.data() + l.xq_col;
    const float* wq_col = saved_.data() + l.wq_col;
    if (!dx.empty()) {
      g.run(view(dyq.data(), N, OC), view(wq_col, OC, C), output(dx.data(), N, C),
            {.trans_a = Trans::no, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
    }
    g.run(view(dyq_col.data(), N, OC), view(xq_col, N, C), output(dw.data(), OC, C),
          {.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
  }
  // The bias gradient from the unquantized dY (TE fuses it into dY's quantization).
  for (std::size_t n = 0; n < N && !db.empty(); ++n) {
    const float* row = dy.data() + n * OC;
    for (std::size_t o = 0; o < OC; ++o) db[o] += row[o];
  }
}

void Fp8Linears::step_done() {
  if (recipe_ == Fp8Recipe::delayed) delayed_.update();
}

void Fp8Linears::reset_stats() noexcept {
  for (Fp8TensorStats& s : stats_) {
    s.elements = s.nonzero = s.saturated = s.flushed = 0;
    s.amax = 0;
  }
}

std::size_t Fp8Linears::scratch_bytes() const noexcept {
  return (saved_.size() + dyq_.size() + dyq_col_.size() + transposed_.size()) * sizeof(float) + codes_.size();
}

}  // namespace mixprec::nn::detail
