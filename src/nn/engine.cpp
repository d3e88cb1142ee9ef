// Model machinery shared by gpt and mlp (src/nn/engine.hpp).
#include "engine.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numbers>
#include <stdexcept>

#include "data_rng.hpp"

namespace mixprec::nn::detail {
namespace {

constexpr std::size_t kAlign = 64;

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// The element-wise conversions below split a large tensor over the OpenMP threads: the
// layers around them already run on every thread, and single-threaded conversions were
// what kept the bf16 step from scaling to two threads (Amdahl). Chunks are whole
// multiples of 64 elements; every element is converted alone, so the result does not
// depend on the split, and counts are sums (amax a max) merged after the loop.
constexpr int kMaxConvertThreads = 64;

int convert_threads(std::size_t n) {
  if (n < (std::size_t{1} << 16)) return 1;  // below ~64 Ki elements a parallel region costs more
  return std::clamp(omp_get_max_threads(), 1, kMaxConvertThreads);
}

// f(begin, end, part) over [0, n) in `threads` contiguous chunks.
template <class F>
void for_chunks(std::size_t n, int threads, F&& f) {
  if (threads <= 1) {
    f(std::size_t{0}, n, 0);
    return;
  }
  const std::size_t per = round_up((n + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads), 64);
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int part = 0; part < threads; ++part) {
    const std::size_t b = std::min(n, static_cast<std::size_t>(part) * per);
    const std::size_t e = std::min(n, b + per);
    if (b < e) f(b, e, part);
  }
}

template <class T>
T* as(std::byte* p) noexcept {
  return reinterpret_cast<T*>(p);
}
template <class T>
const T* as(const std::byte* p) noexcept {
  return reinterpret_cast<const T*>(p);
}

void decode(const std::byte* src, DType t, std::span<float> dst) {
  for_chunks(dst.size(), convert_threads(dst.size()), [&](std::size_t b, std::size_t e, int) {
    const std::span<float> d = dst.subspan(b, e - b);
    switch (t) {
      case DType::f32: std::memcpy(d.data(), src + 4 * b, d.size() * 4); return;
      case DType::f16: convert(std::span<const f16>(as<f16>(src) + b, d.size()), d); return;
      case DType::bf16: convert(std::span<const bf16>(as<bf16>(src) + b, d.size()), d); return;
    }
  });
}

// One thread's part of the conversions below and of a fused block (Engine::commit_block):
// elements [b, b + s.size()) of the tensor at dst.
void encode_part(std::span<const float> s, std::byte* dst, std::size_t b, DType t) {
  switch (t) {
    case DType::f32: std::memcpy(dst + 4 * b, s.data(), s.size() * 4); return;
    case DType::f16: convert(s, std::span<f16>(as<f16>(dst) + b, s.size())); return;
    case DType::bf16: convert(s, std::span<bf16>(as<bf16>(dst) + b, s.size())); return;
  }
}
ConversionStats encode_counted_part(std::span<const float> s, std::byte* dst, std::size_t b, DType t) {
  return t == DType::f16 ? convert_counted(s, std::span<f16>(as<f16>(dst) + b, s.size()))
                         : convert_counted(s, std::span<bf16>(as<bf16>(dst) + b, s.size()));
}
void store_and_round_part(std::span<float> s, std::byte* dst, std::size_t b, DType t) {
  switch (t) {
    case DType::f32: std::memcpy(dst + 4 * b, s.data(), s.size() * 4); return;
    case DType::f16: encode_and_round(s, std::span<f16>(as<f16>(dst) + b, s.size())); return;
    case DType::bf16: encode_and_round(s, std::span<bf16>(as<bf16>(dst) + b, s.size())); return;
  }
}
RoundedStats store_and_round_counted_part(std::span<float> s, std::byte* dst, std::size_t b, DType t) {
  return t == DType::f16 ? encode_and_round_counted(s, std::span<f16>(as<f16>(dst) + b, s.size()))
                         : encode_and_round_counted(s, std::span<bf16>(as<bf16>(dst) + b, s.size()));
}

void encode(std::span<const float> src, std::byte* dst, DType t) {
  for_chunks(src.size(), convert_threads(src.size()), [&](std::size_t b, std::size_t e, int) {
    encode_part(src.subspan(b, e - b), dst, b, t);
  });
}

ConversionStats encode_counted(std::span<const float> src, std::byte* dst, DType t) {
  if (t == DType::f32) {
    encode(src, dst, t);
    return {};
  }
  const int threads = convert_threads(src.size());
  ConversionStats parts[kMaxConvertThreads];
  for_chunks(src.size(), threads, [&](std::size_t b, std::size_t e, int part) {
    parts[part] = encode_counted_part(src.subspan(b, e - b), dst, b, t);
  });
  ConversionStats total;
  for (int i = 0; i < threads; ++i) total += parts[i];
  return total;
}

// Stores v and leaves in v the values stored (what decode would give back), in one pass.
void store_and_round(std::span<float> v, std::byte* dst, DType t) {
  for_chunks(v.size(), convert_threads(v.size()), [&](std::size_t b, std::size_t e, int) {
    store_and_round_part(v.subspan(b, e - b), dst, b, t);
  });
}

// The same, counted, with the input's amax (inf when it holds a nonfinite element).
RoundedStats store_and_round_counted(std::span<float> v, std::byte* dst, DType t) {
  if (t == DType::f32) throw std::logic_error("store_and_round_counted: fp32 is stored as it is");
  const int threads = convert_threads(v.size());
  RoundedStats parts[kMaxConvertThreads];
  for_chunks(v.size(), threads, [&](std::size_t b, std::size_t e, int part) {
    parts[part] = store_and_round_counted_part(v.subspan(b, e - b), dst, b, t);
  });
  RoundedStats total;
  for (int i = 0; i < threads; ++i) {
    total.stats += parts[i].stats;
    total.amax = std::max(total.amax, parts[i].amax);
  }
  return total;
}

}  // namespace

// ---- Arena ---------------------------------------------------------------------

std::size_t Arena::add(std::string name, DType dtype, std::size_t numel) {
  if (base_ != nullptr) throw std::logic_error("Arena::add after finish");
  acts_.push_back({std::move(name), dtype, numel, bytes_});
  bytes_ += round_up(numel * dtype_size(dtype), kAlign);
  return acts_.size() - 1;
}

void Arena::finish() {
  storage_.assign(bytes_ + kAlign, std::byte{0});
  auto addr = reinterpret_cast<std::uintptr_t>(storage_.data());
  base_ = storage_.data() + (round_up(addr, kAlign) - addr);
}

std::span<float> Arena::f32(std::size_t i, std::size_t n) {
  if (acts_[i].dtype != DType::f32 || n > acts_[i].numel) {
    throw std::logic_error("Arena::f32: buffer '" + acts_[i].name + "' is not fp32 or too short");
  }
  return {reinterpret_cast<float*>(data(i)), n};
}

// ---- Engine --------------------------------------------------------------------

Engine::Engine(PrecisionPolicy policy, ParamStore& store, std::size_t scratch_floats, std::size_t scratch_count)
    : policy_(policy), store_(&store), scratch_(scratch_count, std::vector<float>(scratch_floats, 0.0f)) {
  if (policy_.weights != DType::f32) weights_f32_.assign(store.flat_size(), 0.0f);
  if (const int n = omp_get_max_threads(); n > 1) {
    head_gemms_.reserve(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) head_gemms_.emplace_back(GemmOptions{.threads = 1});
  }
  native_ = policy_.activations == DType::bf16 && policy_.weights == DType::bf16 &&
            gemm_.path(DType::bf16, DType::bf16) == GemmPath::onednn_bf16;
  if (policy_.weight_grads != DType::f32) grad_acc_.assign(store.flat_size(), 0.0f);
}

std::span<float> Engine::scratch(std::size_t slot, std::size_t n) {
  if (n > scratch_[slot].size()) throw std::logic_error("Engine::scratch: request beyond the planned size");
  return {scratch_[slot].data(), n};
}

std::span<float> Engine::zeroed(std::size_t slot, std::size_t n) {
  std::span<float> s = scratch(slot, n);
  for_chunks(n, convert_threads(n), [&](std::size_t b, std::size_t e, int) {
    std::memset(s.data() + b, 0, (e - b) * sizeof(float));
  });
  return s;
}

void Engine::copy(std::span<float> dst, std::span<const float> src) {
  if (dst.size() != src.size()) {
    throw std::logic_error("Engine::copy: expected equal sizes, found " + std::to_string(dst.size()) + " and " +
                           std::to_string(src.size()));
  }
  for_chunks(dst.size(), convert_threads(dst.size()), [&](std::size_t b, std::size_t e, int) {
    std::memcpy(dst.data() + b, src.data() + b, (e - b) * sizeof(float));
  });
}

std::span<float> Engine::target(std::size_t a, std::size_t slot, std::size_t n) {
  if (acts_.act(a).dtype == DType::f32) return acts_.f32(a, n);
  return scratch(slot, n);
}

void Engine::commit(std::size_t a, std::span<float> v) {
  if (a == fault_act_ && !v.empty()) v[0] = std::numeric_limits<float>::quiet_NaN();
  const Act& act = acts_.act(a);
  if (hist_ != nullptr) hist_->activations.add(v, kHistogramStride);
  if (act.dtype == DType::f32) {
    if (v.data() != reinterpret_cast<float*>(acts_.data(a))) std::memcpy(acts_.data(a), v.data(), v.size() * 4);
    return;
  }
  store_and_round(v, acts_.data(a), act.dtype);
}

void Engine::commit_operand(std::size_t a, std::span<float> v) {
  if (a == fault_act_ && !v.empty()) v[0] = std::numeric_limits<float>::quiet_NaN();
  const Act& act = acts_.act(a);
  if (!(native_ && act.dtype == DType::bf16)) return commit(a, v);
  if (hist_ != nullptr) hist_->activations.add(v, kHistogramStride);
  encode(v, acts_.data(a), act.dtype);
}

void Engine::commit_grad_operand(std::size_t a, std::span<float> v, BackwardStats& stats, std::size_t label) {
  commit_grad_impl(a, v, stats, label, !(native_ && acts_.act(a).dtype == DType::bf16));
}

void Engine::commit_grad(std::size_t a, std::span<float> v, BackwardStats& stats, std::size_t label) {
  commit_grad_impl(a, v, stats, label, true);
}

void Engine::commit_grad_impl(std::size_t a, std::span<float> v, BackwardStats& stats, std::size_t label,
                              bool decode_back) {
  if (label == fault_label_ && !v.empty()) v[0] = std::numeric_limits<float>::infinity();
  const Act& act = acts_.act(a);
  if (hist_ != nullptr) hist_->activation_grads.add(v, kHistogramStride);
  float m = 0;
  ConversionStats s;
  if (act.dtype == DType::f32) {
    // An fp32 gradient is stored as it is, so v is its stored value: every reader gets v
    // (operand() views it; nothing loads a gradient back from the arena), and copying
    // it into the arena would only cost a pass.
    m = amax_of(v);
  } else if (decode_back) {
    // One pass: codes, stats, amax (inf when a nonfinite is present) and v rounded.
    const RoundedStats r = store_and_round_counted(v, acts_.data(a), act.dtype);
    s = r.stats;
    m = r.amax;
  } else {
    m = amax_of(v);
    s = encode_counted(v, acts_.data(a), act.dtype);
    if (s.nonfinite_input > 0) m = std::numeric_limits<float>::infinity();
  }
  record_grad(stats, label, s, m);
}

void Engine::record_grad(BackwardStats& stats, std::size_t label, const ConversionStats& s, float m) const {
  TensorGradStats& t = stats.tensors[label];
  ++stats.stores;
  stats.activation_grads += s;
  t.stats += s;
  if ((s.overflow > 0 || s.nonfinite_input > 0) && stats.first_overflow.empty()) stats.first_overflow = t.name;
  t.amax = std::max(t.amax, m);
  stats.amax = std::max(stats.amax, m);
}

// ---- fused passes ------------------------------------------------------------------

namespace {
std::atomic<bool> g_fused_passes{true};
// Elements of the widest stage output per block (64 KiB of fp32): a block of every stage
// stays in the core's L2 (512 KiB and up) between its producer and its commit.
constexpr std::size_t kFusedBlockFloats = 16384;
constexpr std::size_t kMaxStages = 4;
}  // namespace

void set_fused_passes(bool on) noexcept { g_fused_passes.store(on, std::memory_order_relaxed); }
bool fused_passes() noexcept { return g_fused_passes.load(std::memory_order_relaxed); }

void Engine::run_stages_unfused(std::size_t rows, std::span<const Stage> stages, BackwardStats* stats) {
  for (const Stage& st : stages) {
    st.produce(st.ctx, 0, rows);
    const std::span<float> v = st.v.first(rows * st.cols);
    switch (st.kind) {
      case Commit::value: commit(st.act, v); break;
      case Commit::operand: commit_operand(st.act, v); break;
      case Commit::grad: commit_grad(st.act, v, *stats, st.label); break;
      case Commit::grad_operand: commit_grad_operand(st.act, v, *stats, st.label); break;
      case Commit::none: break;
    }
  }
}

// Rows [r0, r1) of a stage's output, committed as the unfused commit would commit them;
// a gradient's counts and amax go to counts / amax.
void Engine::commit_block(const Stage& st, std::size_t r0, std::size_t r1, ConversionStats& counts, float& amax) {
  if (st.kind == Commit::none) return;
  const Act& act = acts_.act(st.act);
  const std::size_t b = r0 * st.cols;
  const std::span<float> v = st.v.subspan(b, (r1 - r0) * st.cols);
  std::byte* dst = acts_.data(st.act);
  const bool native = native_ && act.dtype == DType::bf16;
  if (r0 == 0 && !v.empty()) {  // a planted fault (testing): in the block that holds element 0
    const bool grad_kind = st.kind == Commit::grad || st.kind == Commit::grad_operand;
    if (!grad_kind && st.act == fault_act_) v[0] = std::numeric_limits<float>::quiet_NaN();
    if (grad_kind && st.label == fault_label_) v[0] = std::numeric_limits<float>::infinity();
  }
  switch (st.kind) {
    case Commit::value:
    case Commit::operand:
      if (act.dtype == DType::f32) {
        if (st.v.data() != reinterpret_cast<float*>(dst)) std::memcpy(dst + 4 * b, v.data(), v.size() * 4);
      } else if (st.kind == Commit::operand && native) {
        encode_part(v, dst, b, act.dtype);
      } else {
        store_and_round_part(v, dst, b, act.dtype);
      }
      return;
    case Commit::grad:
    case Commit::grad_operand: {
      float m = 0;
      if (act.dtype == DType::f32) {
        m = amax_of(v);
      } else if (st.kind == Commit::grad_operand && native) {
        m = amax_of(v);
        const ConversionStats s = encode_counted_part(v, dst, b, act.dtype);
        if (s.nonfinite_input > 0) m = std::numeric_limits<float>::infinity();
        counts += s;
      } else {
        const RoundedStats r = store_and_round_counted_part(v, dst, b, act.dtype);
        counts += r.stats;
        m = r.amax;
      }
      amax = std::max(amax, m);
      return;
    }
    case Commit::none: return;
  }
}

void Engine::run_stages(std::size_t rows, std::span<const Stage> stages, BackwardStats* stats) {
  if (stages.size() > kMaxStages) throw std::logic_error("Engine::run_stages: more stages than planned");
  for (const Stage& st : stages) {
    const bool grad = st.kind == Commit::grad || st.kind == Commit::grad_operand;
    if (grad && stats == nullptr) throw std::logic_error("Engine::run_stages: a gradient stage needs stats");
    if (st.v.size() < rows * st.cols) throw std::logic_error("Engine::run_stages: an output shorter than rows x cols");
  }
  if (hist_ != nullptr || !fused_passes()) return run_stages_unfused(rows, stages, stats);
  std::size_t widest = 1, total = 0;
  for (const Stage& st : stages) {
    widest = std::max(widest, st.cols);
    total += rows * st.cols;
  }
  const std::size_t per_block = std::max<std::size_t>(1, kFusedBlockFloats / widest);
  const std::size_t blocks = (rows + per_block - 1) / per_block;
  const int threads = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(convert_threads(total)), blocks));
  struct Part {
    ConversionStats counts[kMaxStages];
    float amax[kMaxStages] = {};
  };
  Part parts[kMaxConvertThreads];
  // Every element is rounded alone and counts merge as sums (amax as a max), so neither
  // the blocks nor the thread split change a result.
  auto block = [&](std::size_t blk, Part& p) {
    const std::size_t r0 = blk * per_block, r1 = std::min(rows, r0 + per_block);
    for (std::size_t i = 0; i < stages.size(); ++i) {
      stages[i].produce(stages[i].ctx, r0, r1);
      commit_block(stages[i], r0, r1, p.counts[i], p.amax[i]);
    }
  };
  if (threads <= 1) {
    for (std::size_t blk = 0; blk < blocks; ++blk) block(blk, parts[0]);
  } else {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (std::size_t blk = 0; blk < blocks; ++blk) block(blk, parts[omp_get_thread_num()]);
  }
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const Stage& st = stages[i];
    if (st.kind != Commit::grad && st.kind != Commit::grad_operand) continue;
    ConversionStats s;
    float m = 0;
    for (int t = 0; t < threads; ++t) {
      s += parts[t].counts[i];
      m = std::max(m, parts[t].amax[i]);
    }
    record_grad(*stats, st.label, s, m);
  }
}

}  // namespace mixprec::nn::detail

namespace mixprec::nn {

float amax_of(std::span<const float> v) noexcept {
  std::size_t i = 0;
  float m = 0;
#if defined(__SSE2__)
  // maxps(x, m) returns m when x is NaN: NaN is skipped, as documented. Baseline SSE2
  // (every x86-64 CPU); four independent accumulators hide the max latency.
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 16 <= v.size(); i += 16) {
    a0 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(&v[i]), abs_mask), a0);
    a1 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(&v[i + 4]), abs_mask), a1);
    a2 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(&v[i + 8]), abs_mask), a2);
    a3 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(&v[i + 12]), abs_mask), a3);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(a0, a1), _mm_max_ps(a2, a3)));
  for (float x : lanes) m = x > m ? x : m;
#endif
  for (; i < v.size(); ++i) m = std::fabs(v[i]) > m ? std::fabs(v[i]) : m;
  return m;
}

}  // namespace mixprec::nn

namespace mixprec::nn::detail {

std::span<const float> Engine::load(std::size_t a, std::size_t slot, std::size_t n) {
  const Act& act = acts_.act(a);
  if (act.dtype == DType::f32) return acts_.f32(a, n);
  std::span<float> s = scratch(slot, n);
  decode(acts_.data(a), act.dtype, s);
  return s;
}

std::span<const float> Engine::load_part(std::size_t a, std::size_t slot, std::size_t begin, std::size_t n) {
  const Act& act = acts_.act(a);
  if (begin + n > act.numel) throw std::logic_error("Engine::load_part: beyond '" + act.name + "'");
  if (act.dtype == DType::f32) return acts_.f32(a, begin + n).subspan(begin);
  const std::span<float> s = scratch(slot, begin + n).subspan(begin);
  const std::byte* src = acts_.data(a);
  if (act.dtype == DType::f16) convert(std::span<const f16>(as<f16>(src) + begin, n), s);
  else convert(std::span<const bf16>(as<bf16>(src) + begin, n), s);
  return s;
}

MatrixView Engine::operand(std::size_t a, std::span<const float> v, std::size_t rows, std::size_t cols) {
  if (v.size() != rows * cols) throw std::logic_error("Engine::operand: span does not match the shape");
  const Act& act = acts_.act(a);
  if (native_ && act.dtype == DType::bf16) {
    if (rows * cols > act.numel) throw std::logic_error("Engine::operand: beyond '" + act.name + "'");
    return {acts_.data(a), DType::bf16, rows, cols, 0};
  }
  return view(v.data(), rows, cols);
}

MatrixView Engine::saved_operand(std::size_t a, std::size_t slot, std::size_t rows, std::size_t cols) {
  const Act& act = acts_.act(a);
  if (native_ && act.dtype == DType::bf16) {
    if (rows * cols > act.numel) throw std::logic_error("Engine::saved_operand: beyond '" + act.name + "'");
    return {acts_.data(a), DType::bf16, rows, cols, 0};
  }
  return view(load(a, slot, rows * cols).data(), rows, cols);
}

MatrixView Engine::weight_operand(std::size_t param, std::size_t rows, std::size_t cols) const {
  if (rows * cols != store_->numel(param)) throw std::logic_error("Engine::weight_operand: shape mismatch");
  if (native_) {
    return {static_cast<const bf16*>(store_->model_data()) + store_->offset(param), DType::bf16, rows, cols, 0};
  }
  return view(w(param).data(), rows, cols);
}

std::size_t Engine::first_nonfinite(std::size_t a, std::size_t n) const {
  const Act& act = acts_.act(a);
  const std::byte* p = acts_.data(a);
  for (std::size_t i = 0; i < n; ++i) {
    float x = 0;
    switch (act.dtype) {
      case DType::f32: std::memcpy(&x, p + i * 4, 4); break;
      case DType::f16: x = mixprec::decode(reinterpret_cast<const f16*>(p)[i]); break;
      case DType::bf16: x = mixprec::decode(reinterpret_cast<const bf16*>(p)[i]); break;
    }
    if (!std::isfinite(x)) return i;
  }
  return std::numeric_limits<std::size_t>::max();
}

std::span<const float> Engine::w(std::size_t param) const {
  const std::size_t off = store_->offset(param), n = store_->numel(param);
  if (policy_.weights == DType::f32) return {static_cast<const float*>(store_->model_data()) + off, n};
  return {weights_f32_.data() + off, n};
}

void Engine::weights_updated() {
  if (policy_.weights == DType::f32) return;
  decode(static_cast<const std::byte*>(store_->model_data()), policy_.weights, weights_f32_);
}

std::span<float> Engine::dw(std::size_t param) {
  const std::size_t off = store_->offset(param), n = store_->numel(param);
  if (policy_.weight_grads == DType::f32) return {static_cast<float*>(store_->grad_data()) + off, n};
  return {grad_acc_.data() + off, n};
}

void Engine::begin_backward() {
  if (!grad_acc_.empty()) std::memset(grad_acc_.data(), 0, grad_acc_.size() * sizeof(float));
}

// Low-precision weight gradients accumulate over micro-batches the way .grad does in a
// pure-fp16 model: stored = round(stored + this micro-batch's fp32 gradient).
void Engine::finish_backward() {
  if (grad_acc_.empty()) return;
  std::byte* g = static_cast<std::byte*>(store_->grad_data());
  std::span<float> tmp = scratch(0, std::min(scratch_[0].size(), grad_acc_.size()));
  for (std::size_t begin = 0; begin < grad_acc_.size(); begin += tmp.size()) {
    const std::size_t n = std::min(tmp.size(), grad_acc_.size() - begin);
    std::span<float> t = tmp.first(n);
    std::byte* gp = g + begin * dtype_size(policy_.weight_grads);
    decode(gp, policy_.weight_grads, t);
    for (std::size_t i = 0; i < n; ++i) t[i] += grad_acc_[begin + i];
    encode(t, gp, policy_.weight_grads);
  }
}

std::size_t Engine::scratch_bytes() const noexcept {
  std::size_t b = (weights_f32_.size() + grad_acc_.size()) * sizeof(float) + gemm_.scratch_bytes();
  for (const Gemm& g : head_gemms_) b += g.scratch_bytes();
  for (const auto& s : scratch_) b += s.size() * sizeof(float);
  return b;
}

void check_batch(const char* fn, std::span<const TokenId> inputs, std::span<const TokenId> targets, std::size_t rows,
                 std::size_t batch, std::size_t T, std::size_t V) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument(std::string(fn) + ": " + what); };
  if (rows == 0 || rows > batch) {
    fail("rows: expected 1.." + std::to_string(batch) + ", found " + std::to_string(rows));
  }
  const std::size_t n = rows * T;
  if (inputs.size() < n || targets.size() < n) {
    fail("expected at least rows*T = " + std::to_string(n) + " inputs and targets, found " +
         std::to_string(inputs.size()) + " and " + std::to_string(targets.size()));
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (inputs[i] >= V || targets[i] >= V) {
      fail("token " + std::to_string(i) + ": expected ids < vocab " + std::to_string(V) + ", found " +
           std::to_string(std::max(inputs[i], targets[i])));
    }
  }
}

std::string group_thousands(std::size_t n) {
  const std::string digits = std::to_string(n);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) s.push_back(',');
    s.push_back(digits[i]);
  }
  return s;
}

// ---- initialisation --------------------------------------------------------------

// Box-Muller over splitmix64 words: deterministic on every platform (libm's log/cos
// are correctly rounded enough for initial weights; exact reproducibility across
// platforms is not promised for them).
void init_normal(std::span<float> w, float stddev, std::uint64_t seed, std::uint64_t stream) {
  SplitMix rng(mix64(seed) ^ mix64(stream + 0x1234567ull));
  constexpr double kTwoPow53 = 9007199254740992.0;
  for (std::size_t i = 0; i < w.size(); i += 2) {
    const double u1 = (static_cast<double>(rng.next() >> 11) + 1.0) / (kTwoPow53 + 1.0);
    const double u2 = static_cast<double>(rng.next() >> 11) / kTwoPow53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    w[i] = static_cast<float>(static_cast<double>(stddev) * r * std::cos(2.0 * std::numbers::pi * u2));
    if (i + 1 < w.size()) w[i + 1] = static_cast<float>(static_cast<double>(stddev) * r * std::sin(2.0 * std::numbers::pi * u2));
  }
}

void init_constant(std::span<float> w, float value) {
  for (float& x : w) x = value;
}

}  // namespace mixprec::nn::detail
