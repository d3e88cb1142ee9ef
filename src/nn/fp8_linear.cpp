// fp8 Linear layers of the fp8 presets (src/nn/fp8_linear.hpp, docs/fp8.md).
#include "fp8_linear.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "mixprec/lowp/quantize.hpp"
#include "mixprec/nn/layers.hpp"

namespace mixprec::nn::detail {
namespace {

// The step's amax so far folded with another: NaN sticks, else the max.
float fold_amax(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return std::max(a, b);
}

// The smallest multiplier of any block of an mxfp8 quantization (the factor of its largest
// E8M0 scale), over the blocks whose factor is finite and > 0; 0 when there is none.
float smallest_mx_factor(const lowp::Quantized& q) {
  const lowp::ScaleRounding r = q.config.scale_rounding;
  float m = 0;
  for (const std::uint8_t code : q.scale_codes) {
    const float f = lowp::mx_quantize_factor(e8m0::from_bits(code), r);
    if (std::isfinite(f) && f > 0) m = m == 0 ? f : std::min(m, f);
  }
  return m;
}

void check_size(const char* what, std::size_t found, std::size_t expected) {
  if (found != expected) {
    throw std::invalid_argument(std::string("fp8 linear: ").append(what).append(": expected ")
                                    .append(std::to_string(expected)).append(" elements, found ")
                                    .append(std::to_string(found)));
  }
}

}  // namespace

// ---- Fp8Linears ------------------------------------------------------------------------

Fp8Linears::Fp8Linears(QuantizedGemms gemms, const Fp8Config& config)
    : gemms_(gemms),
      config_(config),
      delayed_(lowp::DelayedScalingConfig{config.margin, config.amax_history_len, config.amax_compute_algo,
                                         config.format}) {
  if (gemms.recipe == lowp::Recipe::fp8_current) {
    lowp::validate(lowp::CurrentScalingConfig{config.format, config.power_of_2_scales, config.amax_epsilon});
  }
  if (block_scaled()) {
    lowp::RecipeChoice c = lowp::RecipeChoice::of(gemms.recipe);
    if (lowp::recipe_info(gemms.recipe).element != lowp::Element::e2m1) c.fp8_format = config.format;
    if (gemms.recipe == lowp::Recipe::mxfp8) c.scale_rounding = config.mx_rounding;
    lowp_recipe_ = *lowp::resolve(c);
  }
}

bool Fp8Linears::block_scaled() const noexcept {
  return lowp::recipe_info(gemms_.recipe).block > 0;
}

std::size_t Fp8Linears::add(const std::string& layer, std::size_t rows, std::size_t in, std::size_t out) {
  if (finished_) throw std::logic_error("Fp8Linears::add after finish");
  Linear l;
  l.rows = rows;
  l.in = in;
  l.out = out;
  l.tensor = stats_.size();
  const std::pair<const char*, lowp::Role> tensors[] = {
      {".input", lowp::Role::forward}, {".weight", lowp::Role::forward}, {".grad_output", lowp::Role::backward}};
  for (const auto& [suffix, role] : tensors) {
    Fp8TensorStats s;
    s.name = std::string(layer).append(suffix);
    s.role = role;
    s.dtype = lowp::dtype_for(config_.format, role);
    if (block_scaled()) {
      const bool gradient = role == lowp::Role::backward, weight = suffix == std::string_view(".weight");
      s.recipe = std::string(lowp::recipe_name(lowp_recipe_.recipe));
      s.element = lowp_recipe_.config(gradient, weight, lowp::Layout::rowwise).element;
    }
    stats_.push_back(s);
    delayed_.add_tensor(s.name, role);
  }
  max_weight_ = std::max(max_weight_, out * in);
  max_codes_ = std::max({max_codes_, rows * in, rows * out, out * in});
  // Own work memory holds what one backward carves (forward's rows*in is within it).
  max_work_ = std::max(max_work_, rows * out + rows * in);
  if (block_scaled()) {
    // X's columnwise grid is [in, rows]: codes and one scale per block along rows.
    const lowp::RecipeInfo& info = lowp::recipe_info(lowp_recipe_.recipe);
    const bool fp4 = info.element == lowp::Element::e2m1;
    const std::size_t scale_bytes = info.scale_format == lowp::ScaleFormat::f32 ? sizeof(float) : 1;
    l.saved_bytes = in * (fp4 ? (rows + 1) / 2 : rows) + in * ((rows + info.block - 1) / info.block) * scale_bytes;
    max_work_ = std::max(max_work_, rows * out * 2 + rows * in);
  } else {
    l.saved_bytes = rows * in + sizeof(float);  // X's codes and its scale_inv
  }
  linears_.push_back(l);
  return linears_.size() - 1;
}

void Fp8Linears::finish(bool own_work) {
  wq_.assign(max_weight_, 0.0f);
  if (own_work) work_.assign(max_work_, 0.0f);
  saved_q_.resize(linears_.size());
  work_q_.codes.reserve(max_codes_);  // the largest operand's codes (fp4 needs half)
  finished_ = true;
}

lowp::QuantizeConfig Fp8Linears::per_tensor_config(std::size_t t) const {
  lowp::QuantizeConfig c;
  c.element = stats_[t].dtype;
  if (gemms_.recipe == lowp::Recipe::fp8_current) {
    c.recipe = lowp::Recipe::fp8_current;
    c.power_of_2_scales = config_.power_of_2_scales;
    c.amax_epsilon = config_.amax_epsilon;
  } else {
    c.recipe = lowp::Recipe::fp8_delayed;
    c.scale = gemms_.delayed_scaling() ? delayed_.scale(t) : 1.0f;
  }
  return c;
}

namespace {

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

std::span<const std::uint32_t> Fp8Linears::random_words(std::size_t n) {
  // A fixed stream (splitmix64 from a draw counter), so runs repeat exactly.
  if (random_.size() < n) random_.resize(n);
  lowp::random_words(0x5EEDull * 0x100000001B3ull + draws_++, std::span<std::uint32_t>(random_.data(), n));
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
  p.stats.nonzero = q.counts.nonzero;  // counted by the quantizing pass
  p.stats.overflow = q.counts.saturated;
  p.stats.underflow = q.counts.flushed;
  p.stats.nonfinite_input = q.counts.nonfinite;
  p.amax = q.counts.amax;
  // per tensor: the scale used; nvfp4: S_enc; mxfp8: the smallest block factor (the largest
  // block scale); fp8-block and mxfp4: 1 (their scales are per block).
  p.scale = q.config.recipe == lowp::Recipe::mxfp8 ? smallest_mx_factor(q) : q.tensor_scale;
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
  if (gemms_.delayed_scaling()) delayed_.record_amax(t, p.amax);
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
  if (block_scaled()) {
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
  // Per tensor: one scale, so X's rowwise quantization holds the values of every layout;
  // it is what the backward keeps.
  l.input = lowp_fake(x, xq, rows, l.in, per_tensor_config(l.tensor), false, &saved_q_[id]);
  l.weight = lowp_fake(w, wq, l.out, l.in, per_tensor_config(l.tensor + 1), false);
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
  if (block_scaled()) {
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
  commit(l.tensor + 2, lowp_fake(dy, dyq, N, OC, per_tensor_config(l.tensor + 2), false));
  // W is what the forward multiplied, so its quantization with the forward's scale gives
  // the forward's Wq again (fp8-current: no second amax pass).
  lowp::QuantizeConfig wc;
  wc.recipe = lowp::Recipe::fp8_delayed;
  wc.element = stats_[l.tensor + 1].dtype;
  wc.scale = l.weight.scale;
  (void)lowp_fake(w, wq, OC, C, wc, false);
  const std::span<float> xq = carve.take(N * C);
  lowp::dequantize(saved_q_[id], xq);
  linear_backward(g, dx, dw, {}, dyq, xq, wq, N, C, OC);
  // The bias gradient from the unquantized dY (TE fuses it into dY's quantization).
  for (std::size_t n = 0; n < N && !db.empty(); ++n) {
    const float* row = dy.data() + n * OC;
    for (std::size_t o = 0; o < OC; ++o) db[o] += row[o];
  }
}

void Fp8Linears::step_done() {
  if (gemms_.delayed_scaling()) delayed_.update();
}

void Fp8Linears::reset_stats() noexcept {
  for (Fp8TensorStats& s : stats_) {
    s.elements = s.nonzero = s.saturated = s.flushed = 0;
    s.amax = 0;
  }
}

std::size_t Fp8Linears::saved_bytes() const noexcept {
  std::size_t b = 0;
  for (const Linear& l : linears_) b += l.saved_bytes;
  return b;
}

std::size_t Fp8Linears::scratch_bytes() const noexcept {
  return (wq_.size() + work_.size()) * sizeof(float) + work_q_.codes.capacity() +
         work_q_.scale_inv.capacity() * sizeof(float) + work_q_.scale_codes.capacity();
}

}  // namespace mixprec::nn::detail
