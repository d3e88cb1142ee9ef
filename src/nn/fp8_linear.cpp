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
std::span<const T> as_codes(std::span<const std::uint8_t> codes, std::size_t n) {
  return {reinterpret_cast<const T*>(codes.data()), n};
}

template <fp8::Fp8Type T>
ConversionStats quantize_codes_as(std::span<const float> x, std::span<std::uint8_t> codes, float scale) {
  return convert_counted<T>(x, as_codes<T>(codes, x.size()), {Overflow::saturate, Subnormals::keep, scale});
}

template <fp8::Fp8Type T>
void dequantize_codes_as(std::span<const std::uint8_t> codes, std::span<float> out, float scale_inv) {
  convert<T>(as_codes<T>(codes, out.size()), out, {Overflow::ieee, Subnormals::keep, scale_inv});
}

// One MX block of len <= 32 values. Finite blocks take the bulk (SIMD) conversion with the
// block's factor, which is what fp8::mx_quantize computes element by element; blocks
// holding inf or NaN take the scalar reference itself (their scale rules differ per
// rounding) and count saturation as 0 (the reference does not report it).
// out == nullptr: codes and scale only (the caller dequantizes later, dequantize_mx_codes).
template <fp8::Fp8Type T>
void mx_block(const float* x, float* out, std::size_t len, fp8::MxRounding rounding, std::uint8_t* code_bytes,
              e8m0& scale, MxFakeQuantized& r) {
  const std::span<const float> blk(x, len);
  const std::span<float> dst(out, out == nullptr ? 0 : len);
  const std::span<T> codes(reinterpret_cast<T*>(code_bytes), len);
  const float a = amax_of(blk);  // NaN skipped: TE's block amax
  if (std::isfinite(a)) {
    scale = fp8::mx_scale(a, fp8::dtype_of<T>(), rounding);
    const float factor = fp8::mx_quantize_factor(scale, rounding);
    if (std::isfinite(factor) && factor > 0) {
      const ConversionStats s = convert_counted<T>(blk, codes, {Overflow::saturate, Subnormals::keep, factor});
      if (s.nonfinite_input == 0) {
        if (out != nullptr) {
          convert<T>(std::span<const T>(codes), dst, {Overflow::ieee, Subnormals::keep, static_cast<float>(scale)});
        }
        r.stats += s;
        r.min_factor = r.min_factor == 0 ? factor : std::min(r.min_factor, factor);  // factors are > 0
        return;
      }
    }
  }
  fp8::mx_quantize<T>(blk, codes, std::span<e8m0>(&scale, 1), rounding);
  ConversionStats s;
  s.elements = len;
  for (std::size_t i = 0; i < len; ++i) {
    if (blk[i] == 0.0f) continue;
    ++s.nonzero;
    if (!std::isfinite(blk[i])) ++s.nonfinite_input;
    else if (mixprec::decode(codes[i]) == 0.0f) ++s.underflow;
  }
  if (out != nullptr) fp8::mx_dequantize<T>(std::span<const T>(codes), std::span<const e8m0>(&scale, 1), dst);
  r.stats += s;
}

// out empty: codes and scales only; scales empty: not kept.
template <fp8::Fp8Type T>
MxFakeQuantized fake_quantize_mx_as(std::span<const float> x, std::span<float> out, std::size_t row_len,
                                    fp8::MxRounding rounding, std::span<std::uint8_t> codes, std::span<e8m0> scales) {
  MxFakeQuantized r;
  std::size_t k = 0;
  for (std::size_t row = 0; row < x.size(); row += row_len) {
    for (std::size_t b = 0; b < row_len; b += fp8::kMxBlock, ++k) {
      const std::size_t len = std::min(fp8::kMxBlock, row_len - b);
      e8m0 scale;
      mx_block<T>(x.data() + row + b, out.empty() ? nullptr : out.data() + row + b, len, rounding,
                  codes.data() + row + b, scale, r);
      if (!scales.empty()) scales[k] = scale;
    }
  }
  return r;
}

template <fp8::Fp8Type T>
void dequantize_mx_codes_as(std::span<const std::uint8_t> codes, std::span<const e8m0> scales, std::size_t row_len,
                            std::span<float> out) {
  const std::size_t nb = fp8::mx_blocks(row_len);
  for (std::size_t row = 0, k = 0; row < out.size(); row += row_len, k += nb) {
    fp8::mx_dequantize<T>(as_codes<T>(codes.subspan(row), row_len), scales.subspan(k, nb), out.subspan(row, row_len));
  }
}

void check_row_len(const char* fn, std::size_t n, std::size_t row_len) {
  if (row_len == 0 || n % row_len != 0) {
    throw std::invalid_argument(std::string(fn) + ": expected a row length dividing " + std::to_string(n) +
                                ", found " + std::to_string(row_len));
  }
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
  const ConversionStats s = quantize_codes(x, codes, dtype, scale);
  dequantize_codes(codes, out, dtype, scale_inv);
  return s;
}

ConversionStats quantize_codes(std::span<const float> x, std::span<std::uint8_t> codes, fp8::Dtype dtype,
                               float scale) {
  if (codes.size() < x.size()) check_size("quantize_codes codes", codes.size(), x.size());
  return dtype == fp8::Dtype::e4m3 ? quantize_codes_as<f8e4m3>(x, codes, scale)
                                   : quantize_codes_as<f8e5m2>(x, codes, scale);
}

void dequantize_codes(std::span<const std::uint8_t> codes, std::span<float> out, fp8::Dtype dtype, float scale_inv) {
  if (codes.size() < out.size()) check_size("dequantize_codes codes", codes.size(), out.size());
  if (dtype == fp8::Dtype::e4m3) dequantize_codes_as<f8e4m3>(codes, out, scale_inv);
  else dequantize_codes_as<f8e5m2>(codes, out, scale_inv);
}

MxFakeQuantized fake_quantize_mx(std::span<const float> x, std::span<float> out, std::size_t row_len,
                                 fp8::Dtype dtype, fp8::MxRounding rounding, std::span<std::uint8_t> codes) {
  check_size("fake_quantize_mx out", out.size(), x.size());
  if (codes.size() < x.size()) check_size("fake_quantize_mx codes", codes.size(), x.size());
  check_row_len("fake_quantize_mx", x.size(), row_len);
  return dtype == fp8::Dtype::e4m3 ? fake_quantize_mx_as<f8e4m3>(x, out, row_len, rounding, codes, {})
                                   : fake_quantize_mx_as<f8e5m2>(x, out, row_len, rounding, codes, {});
}

MxFakeQuantized quantize_mx_codes(std::span<const float> x, std::size_t row_len, fp8::Dtype dtype,
                                  fp8::MxRounding rounding, std::span<std::uint8_t> codes, std::span<e8m0> scales) {
  if (codes.size() < x.size()) check_size("quantize_mx_codes codes", codes.size(), x.size());
  check_row_len("quantize_mx_codes", x.size(), row_len);
  const std::size_t nb = x.size() / row_len * fp8::mx_blocks(row_len);
  if (scales.size() < nb) check_size("quantize_mx_codes scales", scales.size(), nb);
  return dtype == fp8::Dtype::e4m3 ? fake_quantize_mx_as<f8e4m3>(x, {}, row_len, rounding, codes, scales)
                                   : fake_quantize_mx_as<f8e5m2>(x, {}, row_len, rounding, codes, scales);
}

void dequantize_mx_codes(std::span<const std::uint8_t> codes, std::span<const e8m0> scales, std::size_t row_len,
                         fp8::Dtype dtype, std::span<float> out) {
  if (codes.size() < out.size()) check_size("dequantize_mx_codes codes", codes.size(), out.size());
  check_row_len("dequantize_mx_codes", out.size(), row_len);
  const std::size_t nb = out.size() / row_len * fp8::mx_blocks(row_len);
  if (scales.size() < nb) check_size("dequantize_mx_codes scales", scales.size(), nb);
  if (dtype == fp8::Dtype::e4m3) dequantize_mx_codes_as<f8e4m3>(codes, scales, row_len, out);
  else dequantize_mx_codes_as<f8e5m2>(codes, scales, row_len, out);
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
  if (lowp()) {
    lowp::RecipeChoice c = lowp::RecipeChoice::of(recipe == Fp8Recipe::block   ? lowp::Recipe::fp8_block
                                                  : recipe == Fp8Recipe::nvfp4 ? lowp::Recipe::nvfp4
                                                                               : lowp::Recipe::mxfp4);
    if (recipe == Fp8Recipe::block) c.fp8_format = config.format;
    lowp_recipe_ = *lowp::resolve(c);
  }
}

bool Fp8Linears::lowp() const noexcept {
  return recipe_ == Fp8Recipe::block || recipe_ == Fp8Recipe::nvfp4 || recipe_ == Fp8Recipe::mx4;
}

std::size_t Fp8Linears::add(const std::string& layer, std::size_t rows, std::size_t in, std::size_t out) {
  if (finished_) throw std::logic_error("Fp8Linears::add after finish");
  Linear l;
  l.rows = rows;
  l.in = in;
  l.out = out;
  l.tensor = stats_.size();
  const bool mx = recipe_ == Fp8Recipe::mx;
  l.x_codes = saved_code_bytes_;
  if (!lowp()) saved_code_bytes_ += rows * in;  // lowp recipes keep lowp::Quantized instead
  l.x_scales = saved_scale_count_;
  if (mx) saved_scale_count_ += in * fp8::mx_blocks(rows);
  const std::pair<const char*, fp8::Role> tensors[] = {
      {".input", fp8::Role::forward}, {".weight", fp8::Role::forward}, {".grad_output", fp8::Role::backward}};
  for (const auto& [suffix, role] : tensors) {
    Fp8TensorStats s;
    s.name = std::string(layer).append(suffix);
    s.role = role;
    s.dtype = fp8::dtype_for(config_.format, role);
    if (lowp()) {
      const bool gradient = role == fp8::Role::backward, weight = suffix == std::string_view(".weight");
      s.recipe = std::string(lowp::recipe_name(lowp_recipe_.recipe));
      s.element = lowp_recipe_.config(gradient, weight, lowp::Layout::rowwise).element;
    }
    stats_.push_back(s);
    delayed_.add_tensor(s.name, role);
  }
  max_act_ = std::max({max_act_, rows * in, rows * out});
  max_weight_ = std::max(max_weight_, out * in);
  // Own work memory holds what one backward carves (forward's rows*in is within it).
  max_work_ = std::max(max_work_, rows * out * (mx ? 2 : 1) + rows * in);
  max_tile_rows_ = std::max({max_tile_rows_, rows, out});
  if (lowp()) {
    // X's columnwise grid is [in, rows]: codes and one scale per block along rows.
    const lowp::RecipeInfo& info = lowp::recipe_info(lowp_recipe_.recipe);
    const bool fp4 = info.element == lowp::Element::e2m1;
    const std::size_t scale_bytes = info.scale_format == lowp::ScaleFormat::f32 ? sizeof(float) : 1;
    l.lowp_saved_bytes = in * (fp4 ? (rows + 1) / 2 : rows) + in * ((rows + info.block - 1) / info.block) * scale_bytes;
    max_work_ = std::max(max_work_, rows * out * 2 + rows * in);
  }
  linears_.push_back(l);
  return linears_.size() - 1;
}

void Fp8Linears::finish(bool own_work) {
  saved_codes_.assign(saved_code_bytes_, 0);
  saved_scales_.assign(saved_scale_count_, e8m0::from_bits(127));
  wq_.assign(max_weight_, 0.0f);
  if (recipe_ == Fp8Recipe::mx) tile_.assign(fp8::kMxBlock * max_tile_rows_, 0.0f);
  if (own_work) work_.assign(max_work_, 0.0f);
  codes_.assign(std::max(max_act_, max_weight_), 0);
  if (lowp()) saved_q_.resize(linears_.size());
  finished_ = true;
}

float Fp8Linears::scale_of(std::size_t t) const {
  return recipe_ == Fp8Recipe::delayed ? delayed_.scale(t) : 1.0f;
}

float Fp8Linears::scale_inv_of(std::size_t t) const {
  return recipe_ == Fp8Recipe::delayed ? delayed_.scale_inv(t) : 1.0f;
}

Fp8Linears::Pending Fp8Linears::quantize(std::size_t t, std::span<const float> x, std::span<float> out,
                                         std::size_t cols, std::span<std::uint8_t> codes, float& scale_inv) {
  const fp8::Dtype d = stats_[t].dtype;
  Pending p;
  // The vectorised amax skips NaN; with a non-finite input (counted by the conversion)
  // fp8::amax's rules (NaN, then inf, win) are applied by the scalar reference.
  p.amax = amax_of(x);
  scale_inv = 1.0f;
  switch (recipe_) {
    case Fp8Recipe::mx: {
      const MxFakeQuantized r = fake_quantize_mx(x, out, cols, d, config_.mx_rounding, codes);
      p.stats = r.stats;
      p.scale = r.min_factor;
      if (p.stats.nonfinite_input > 0) p.amax = fp8::amax(x);
      return p;
    }
    case Fp8Recipe::current: {
      // fp8::quantize_current: scale from this tensor's amax, scale_inv = 1 / scale.
      const float fmax = fp8::max_finite(d);
      p.scale = fp8::current_scale(p.amax, fmax, config_.power_of_2_scales, config_.amax_epsilon);
      p.stats = quantize_codes(x, codes, d, p.scale);
      if (p.stats.nonfinite_input > 0) {
        p.amax = fp8::amax(x);
        p.scale = fp8::current_scale(p.amax, fmax, config_.power_of_2_scales, config_.amax_epsilon);
        p.stats = quantize_codes(x, codes, d, p.scale);
      }
      scale_inv = 1.0f / p.scale;
      dequantize_codes(codes, out, d, scale_inv);
      return p;
    }
    case Fp8Recipe::delayed:
    case Fp8Recipe::noscale:
    case Fp8Recipe::block:  // the lowp recipes go through lowp_fake, never here
    case Fp8Recipe::nvfp4:
    case Fp8Recipe::mx4:
    case Fp8Recipe::none: break;
  }
  p.scale = scale_of(t);
  scale_inv = scale_inv_of(t);
  p.stats = quantize_codes(x, codes, d, p.scale);
  dequantize_codes(codes, out, d, scale_inv);
  if (p.stats.nonfinite_input > 0) p.amax = fp8::amax(x);
  return p;
}

namespace {

// Columns [c0, c0 + w) of x[rows, cols] into tile[j * rows + r] (one row per column).
void gather_columns(const float* x, float* tile, std::size_t rows, std::size_t cols, std::size_t c0, std::size_t w) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* src = x + r * cols + c0;
    for (std::size_t j = 0; j < w; ++j) tile[j * rows + r] = src[j];
  }
}

void scatter_columns(const float* tile, float* x, std::size_t rows, std::size_t cols, std::size_t c0, std::size_t w) {
  for (std::size_t r = 0; r < rows; ++r) {
    float* dst = x + r * cols + c0;
    for (std::size_t j = 0; j < w; ++j) dst[j] = tile[j * rows + r];
  }
}

// Carves the spans one call needs out of the work memory (first fit); allocates nothing.
class Carver {
 public:
  explicit Carver(Fp8Linears::Work work) : work_(work) {
    if (work.size() > kMax) throw std::logic_error("fp8 linear: more than 8 work spans");
  }
  std::span<float> take(std::size_t n) {
    for (std::size_t i = 0; i < work_.size(); ++i) {
      if (work_[i].size() - used_[i] >= n) {
        const std::span<float> s = work_[i].subspan(used_[i], n);
        used_[i] += n;
        return s;
      }
    }
    throw std::logic_error("fp8 linear: the work memory is too small for " + std::to_string(n) + " floats");
  }

 private:
  static constexpr std::size_t kMax = 8;
  Fp8Linears::Work work_;
  std::size_t used_[kMax] = {};
};

}  // namespace

// The same values as transposing x, fake_quantize_mx of its rows (row_len = rows) and
// transposing back: each column is quantized on its own, so kMxBlock columns at a time do.
void Fp8Linears::fake_quantize_columnwise(std::size_t t, std::span<const float> x, std::span<float> out,
                                          std::size_t rows, std::size_t cols) {
  for (std::size_t c0 = 0; c0 < cols; c0 += fp8::kMxBlock) {
    const std::size_t w = std::min(fp8::kMxBlock, cols - c0);
    const std::span<float> tile(tile_.data(), w * rows);
    gather_columns(x.data(), tile.data(), rows, cols, c0, w);
    (void)fake_quantize_mx(tile, tile, rows, stats_[t].dtype, config_.mx_rounding, codes_);
    scatter_columns(tile.data(), out.data(), rows, cols, c0, w);
  }
}

// Codes [cols][rows] and scales [cols][mx_blocks(rows)] of x's columnwise quantization.
void Fp8Linears::save_columnwise(std::size_t t, std::span<const float> x, std::uint8_t* codes, e8m0* scales,
                                 std::size_t rows, std::size_t cols) {
  const std::size_t nb = fp8::mx_blocks(rows);
  for (std::size_t c0 = 0; c0 < cols; c0 += fp8::kMxBlock) {
    const std::size_t w = std::min(fp8::kMxBlock, cols - c0);
    const std::span<float> tile(tile_.data(), w * rows);
    gather_columns(x.data(), tile.data(), rows, cols, c0, w);
    (void)quantize_mx_codes(tile, rows, stats_[t].dtype, config_.mx_rounding, {codes + c0 * rows, w * rows},
                            {scales + c0 * nb, w * nb});
  }
}

// out[rows, cols] = the dequantization of save_columnwise's codes.
void Fp8Linears::load_columnwise(std::size_t t, const std::uint8_t* codes, const e8m0* scales, std::span<float> out,
                                 std::size_t rows, std::size_t cols) {
  const std::size_t nb = fp8::mx_blocks(rows);
  for (std::size_t c0 = 0; c0 < cols; c0 += fp8::kMxBlock) {
    const std::size_t w = std::min(fp8::kMxBlock, cols - c0);
    const std::span<float> tile(tile_.data(), w * rows);
    dequantize_mx_codes({codes + c0 * rows, w * rows}, {scales + c0 * nb, w * nb}, rows, stats_[t].dtype, tile);
    scatter_columns(tile.data(), out.data(), rows, cols, c0, w);
  }
}

std::span<const std::uint32_t> Fp8Linears::random_words(std::size_t n) {
  // A fixed stream (splitmix64 over a draw counter), so runs repeat exactly.
  if (random_.size() < n) random_.resize(n);
  std::uint64_t state = 0x5EEDull * 0x100000001B3ull + draws_++;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    random_[i] = static_cast<std::uint32_t>((z ^ (z >> 31)) >> 32);
  }
  return {random_.data(), n};
}

Fp8Linears::Pending Fp8Linears::lowp_fake(std::span<const float> x, std::span<float> out,
                                          std::size_t rows, std::size_t cols, const lowp::QuantizeConfig& c,
                                          bool random, lowp::Quantized* keep) {
  lowp::QuantizeConfig cfg = c;
  cfg.stochastic_rounding = random;
  // Into kept buffers (X's saved copy, or this object's): a warm step allocates nothing.
  lowp::Quantized& q = keep != nullptr ? *keep : work_q_;
  lowp::quantize(x.first(rows * cols), rows, cols, cfg,
                 random ? random_words(rows * cols) : std::span<const std::uint32_t>{}, q);
  if (!out.empty()) lowp::dequantize(q, out.first(rows * cols));
  Pending p;
  p.stats.elements = q.counts.elements;
  for (std::size_t i = 0; i < rows * cols; ++i) p.stats.nonzero += x[i] != 0.0f || std::isnan(x[i]);
  p.stats.overflow = q.counts.saturated;
  p.stats.underflow = q.counts.flushed;
  p.stats.nonfinite_input = q.counts.nonfinite;
  p.amax = q.counts.amax;
  p.scale = q.tensor_scale;  // nvfp4: S_enc; fp8-block and mxfp4: 1 (their scales are per block)
  return p;
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
                         std::span<const float> w, std::span<const float> b, std::size_t rows, Work work) {
  Linear& l = linears_.at(id);
  if (rows == 0 || rows > l.rows) check_size("forward rows", rows, l.rows);
  check_size("forward x", x.size(), rows * l.in);
  check_size("forward w", w.size(), l.out * l.in);
  const std::span<float> own(work_);
  Carver carve(work.empty() ? Work(&own, 1) : work);
  const std::span<float> xq = carve.take(rows * l.in), wq(wq_.data(), l.out * l.in);
  std::uint8_t* saved = saved_codes_.data() + l.x_codes;
  if (lowp()) {
    const lowp::LinearRecipe& r = lowp_recipe_;
    l.input = lowp_fake(x, xq, rows, l.in, r.config(false, false, lowp::Layout::rowwise), false);
    lowp::QuantizeConfig xc = r.config(false, false, lowp::Layout::columnwise);
    xc.rht = r.rht && rows % 16 == 0;
    (void)lowp_fake(x, {}, rows, l.in, xc, false, &saved_q_[id]);
    l.weight = lowp_fake(w, wq, l.out, l.in, r.config(false, true, lowp::Layout::rowwise), false);
    linear_forward(g, y, xq, wq, b, rows, l.in, l.out);
    l.forward_rows = rows;
    return;
  }
  if (recipe_ == Fp8Recipe::mx) {
    // The forward GEMM's rowwise Xq is not kept; wgrad's columnwise X is, as codes.
    l.input = quantize(l.tensor, x, xq, l.in, codes_, l.x_scale_inv);
    save_columnwise(l.tensor, x, saved, saved_scales_.data() + l.x_scales, rows, l.in);
  } else {
    l.input = quantize(l.tensor, x, xq, l.in, {saved, rows * l.in}, l.x_scale_inv);
  }
  l.weight = quantize(l.tensor + 1, w, wq, l.in, codes_, l.w_scale_inv);
  l.w_scale = l.weight.scale;
  linear_forward(g, y, xq, wq, b, rows, l.in, l.out);
  l.forward_rows = rows;
}

void Fp8Linears::backward(Gemm& g, std::size_t id, std::span<float> dx, std::span<float> dw, std::span<float> db,
                          std::span<const float> dy, std::span<const float> w, Work work) {
  Linear& l = linears_.at(id);
  if (l.forward_rows != l.rows) {
    throw std::logic_error("fp8 linear backward: expected a full-batch forward of " + stats_[l.tensor].name +
                           " before backward");
  }
  const std::size_t N = l.rows, C = l.in, OC = l.out;
  check_size("backward dy", dy.size(), N * OC);
  check_size("backward dw", dw.size(), OC * C);
  check_size("backward w", w.size(), OC * C);
  if (!dx.empty()) check_size("backward dx", dx.size(), N * C);
  if (!db.empty()) check_size("backward db", db.size(), OC);
  const std::span<float> own(work_);
  Carver carve(work.empty() ? Work(&own, 1) : work);
  commit(l.tensor, l.input);
  commit(l.tensor + 1, l.weight);
  const std::span<float> dyq = carve.take(N * OC), wq(wq_.data(), OC * C);
  if (lowp()) {
    // dgrad: dYq rowwise (stochastic for nvfp4) times W columnwise; wgrad: the columnwise dYq
    // and the kept columnwise Xq (RHT on both or on neither, along N).
    const lowp::LinearRecipe& r = lowp_recipe_;
    commit(l.tensor + 2, lowp_fake(dy, dyq, N, OC, r.config(true, false, lowp::Layout::rowwise),
                                   r.stochastic_rounding));
    if (!dx.empty()) {
      (void)lowp_fake(w, wq, OC, C, r.config(false, true, lowp::Layout::columnwise), false);
      g.run(view(dyq.data(), N, OC), view(wq.data(), OC, C), output(dx.data(), N, C),
            {.trans_a = Trans::no, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
    }
    const std::span<float> dyq_col = carve.take(N * OC), xq_col = carve.take(N * C);
    lowp::QuantizeConfig dc = r.config(true, false, lowp::Layout::columnwise);
    dc.rht = saved_q_[id].config.rht;
    (void)lowp_fake(dy, dyq_col, N, OC, dc, r.stochastic_rounding);
    lowp::dequantize(saved_q_[id], xq_col);
    g.run(view(dyq_col.data(), N, OC), view(xq_col.data(), N, C), output(dw.data(), OC, C),
          {.trans_a = Trans::yes, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
    for (std::size_t n = 0; n < N && !db.empty(); ++n) {
      const float* row = dy.data() + n * OC;
      for (std::size_t o = 0; o < OC; ++o) db[o] += row[o];
    }
    return;
  }
  float unused = 1;
  commit(l.tensor + 2, quantize(l.tensor + 2, dy, dyq, OC, codes_, unused));
  const std::uint8_t* saved = saved_codes_.data() + l.x_codes;
  if (recipe_ != Fp8Recipe::mx) {
    // W is what the forward multiplied, so its quantization with the forward's scale
    // gives the forward's Wq again.
    (void)fake_quantize(w, wq, stats_[l.tensor + 1].dtype, l.w_scale, l.w_scale_inv, codes_);
    const std::span<float> xq = carve.take(N * C);
    dequantize_codes({saved, N * C}, xq, stats_[l.tensor].dtype, l.x_scale_inv);
    linear_backward(g, dx, dw, {}, dyq, xq, wq, N, C, OC);
  } else {
    // dgrad reduces over OC: dYq rowwise (blocks along OC) times the columnwise Wq; wgrad
    // reduces over N: the columnwise dYq and Xq (blocks along N).
    if (!dx.empty()) {
      fake_quantize_columnwise(l.tensor + 1, w, wq, OC, C);
      g.run(view(dyq.data(), N, OC), view(wq.data(), OC, C), output(dx.data(), N, C),
            {.trans_a = Trans::no, .trans_b = Trans::no, .alpha = 1.0f, .beta = 1.0f});
    }
    const std::span<float> dyq_col = carve.take(N * OC), xq_col = carve.take(N * C);
    fake_quantize_columnwise(l.tensor + 2, dy, dyq_col, N, OC);
    load_columnwise(l.tensor, saved, saved_scales_.data() + l.x_scales, xq_col, N, C);
    g.run(view(dyq_col.data(), N, OC), view(xq_col.data(), N, C), output(dw.data(), OC, C),
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

std::size_t Fp8Linears::saved_bytes() const noexcept {
  if (lowp()) {
    std::size_t b = 0;
    for (const Linear& l : linears_) b += l.lowp_saved_bytes;
    return b;
  }
  return saved_codes_.size() + saved_scales_.size() * sizeof(e8m0);
}

std::size_t Fp8Linears::scratch_bytes() const noexcept {
  return (wq_.size() + tile_.size() + work_.size()) * sizeof(float) + codes_.size();
}

}  // namespace mixprec::nn::detail
