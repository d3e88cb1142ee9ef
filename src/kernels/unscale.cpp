// unscale_and_check: argument checks, back-end choice, the split of the tensor
// list across threads and the in-order merge of their results.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "core/select_kernels.hpp"
#include "mixprec/core/text.hpp"
#include "kernels/unscale_kernels.hpp"
#include "mixprec/kernels/unscale.hpp"

namespace mixprec {
namespace {

using detail::SegmentKernel;
using detail::SegmentOut;
using detail::UnscaleKernels;

const UnscaleKernels* unscale_kernels(Isa isa) noexcept {
  return detail::select_kernels(isa, &detail::scalar_unscale_kernels, &detail::avx2_unscale_kernels,
                                &detail::avx512_unscale_kernels);
}

void validate(std::span<const GradTensor> grads, float inv_scale, const UnscaleOptions& o,
              std::span<float> amax_out) {
  if (!std::isfinite(inv_scale) || !(inv_scale > 0.0f)) {
    throw std::invalid_argument("unscale_and_check: inv_scale must be finite and > 0, got " +
                                text::num_f32(inv_scale));
  }
  if (o.amax && amax_out.size() != grads.size()) {
    throw std::invalid_argument("unscale_and_check: options.amax needs amax_out with one float per tensor (" +
                                std::to_string(grads.size()) + "), got " + std::to_string(amax_out.size()));
  }
  if (!o.amax && !amax_out.empty()) {
    throw std::invalid_argument("unscale_and_check: amax_out given (" + std::to_string(amax_out.size()) +
                                " floats) but options.amax is false");
  }
  for (std::size_t t = 0; t < grads.size(); ++t) {
    const GradTensor& g = grads[t];
    const auto code = static_cast<unsigned>(g.dtype);
    if (code > static_cast<unsigned>(DType::bf16)) {
      throw std::invalid_argument("unscale_and_check: grads[" + std::to_string(t) +
                                  "].dtype must be f32, f16 or bf16, got code " + std::to_string(code));
    }
    if (g.size == 0) continue;
    if (g.data == nullptr) {
      throw std::invalid_argument("unscale_and_check: grads[" + std::to_string(t) + "].data is null with size " +
                                  std::to_string(g.size));
    }
    const std::size_t align = dtype_size(g.dtype);
    if (reinterpret_cast<std::uintptr_t>(g.data) % align != 0) {
      throw std::invalid_argument("unscale_and_check: grads[" + std::to_string(t) + "].data must be aligned to " +
                                  std::to_string(align) + " bytes for " + std::string(dtype_name(g.dtype)));
    }
  }
}

// Where a thread's range starts: tensor index and element inside it (a chunk
// boundary of that tensor). {grads.size(), 0} is the end of the list.
struct Pos {
  std::size_t tensor;
  std::size_t elem;
};

Pos locate(std::span<const GradTensor> grads, std::size_t global) {
  std::size_t off = 0;
  for (std::size_t t = 0; t < grads.size(); ++t) {
    if (global < off + grads[t].size) {
      const std::size_t local = (global - off) / kUnscaleChunk * kUnscaleChunk;
      return {t, local};
    }
    off += grads[t].size;
  }
  return {grads.size(), 0};
}

constexpr std::uint32_t kInfBits = 0x7f800000u;
constexpr std::uint32_t kQuietNanBits = 0x7fc00000u;

float amax_value(std::uint32_t bits) { return std::bit_cast<float>(bits > kInfBits ? kQuietNanBits : bits); }

// One thread's results. The amax of the first tensor it touches is reported
// here (a neighbour may share that tensor); the others are written directly.
struct Partial {
  ExactSum sum;
  std::int64_t first_bad = -1;
  std::size_t first_tensor = 0;
  std::uint32_t first_amax = 0;
  bool touched = false;
};

void run_range(std::span<const GradTensor> grads, Pos begin, Pos end, float inv, const SegmentKernel* k,
               bool want_sum, bool want_amax, std::span<float> amax_out, Partial& p) {
  for (std::size_t t = begin.tensor; t <= end.tensor && t < grads.size(); ++t) {
    const GradTensor& g = grads[t];
    const std::size_t lo = t == begin.tensor ? begin.elem : 0;
    const std::size_t hi = t == end.tensor ? end.elem : g.size;
    if (lo >= hi) continue;
    SegmentOut out;
    std::byte* base = static_cast<std::byte*>(g.data) + lo * dtype_size(g.dtype);
    k[static_cast<int>(g.dtype)](base, hi - lo, inv, out, want_sum ? &p.sum : nullptr);
    if (out.max_in >= kInfBits && p.first_bad < 0) p.first_bad = static_cast<std::int64_t>(t);
    if (want_amax) {
      if (!p.touched) {
        p.first_tensor = t;
        p.first_amax = out.max_out;
      } else {
        amax_out[t] = amax_value(out.max_out);
      }
    }
    p.touched = true;
  }
}

UnscaleResult unscale_with(const UnscaleKernels& kernels, std::span<const GradTensor> grads, float inv_scale,
                           const UnscaleOptions& o, std::span<float> amax_out, ThreadPool* pool) {
  const bool write = o.write && inv_scale != 1.0f;  // PyTorch skips the multiply by 1
  const SegmentKernel k[3] = {kernels.segment[0][write][o.sum_squares][o.amax],
                             kernels.segment[1][write][o.sum_squares][o.amax],
                             kernels.segment[2][write][o.sum_squares][o.amax]};
  std::size_t total = 0;
  for (const GradTensor& g : grads) total += g.size;
  for (float& a : amax_out) a = 0.0f;  // empty tensors (and tensors a thread only reports) start at 0

  // At most this many threads report partials; more would need storage.
  constexpr unsigned kMaxThreads = 64;
  Partial partials_small[1];
  unsigned parts = 1;
  if (total > 0 && total >= o.min_parallel_elements && total > kUnscaleChunk) {
    if (pool == nullptr) pool = &ThreadPool::global();
    parts = std::min(pool->size(), kMaxThreads);
  }

  UnscaleResult r;
  auto finish = [&](Partial* ps, unsigned n) {
    ExactSum sum;
    for (unsigned w = 0; w < n; ++w) {
      Partial& p = ps[w];
      if (o.sum_squares) sum.merge(p.sum);
      if (p.first_bad >= 0 && (r.first_nonfinite < 0 || p.first_bad < r.first_nonfinite)) {
        r.first_nonfinite = p.first_bad;
      }
      if (o.amax && p.touched) {
        const std::uint32_t cur = std::bit_cast<std::uint32_t>(amax_out[p.first_tensor]);
        amax_out[p.first_tensor] = amax_value(std::max(cur, p.first_amax));
      }
    }
    r.found_inf = r.first_nonfinite >= 0;
    r.sum_squares = o.sum_squares ? sum.value() : std::numeric_limits<double>::quiet_NaN();
  };

  if (parts == 1) {
    run_range(grads, {0, 0}, {grads.size(), 0}, inv_scale, k, o.sum_squares, o.amax, amax_out, partials_small[0]);
    finish(partials_small, 1);
    return r;
  }
  Partial partials[kMaxThreads];
  pool->run([&](unsigned w) {
    if (w >= parts) return;
    const Pos b = locate(grads, total / parts * w + std::min<std::size_t>(w, total % parts));
    const Pos e = w + 1 == parts ? Pos{grads.size(), 0}
                                 : locate(grads, total / parts * (w + 1) + std::min<std::size_t>(w + 1, total % parts));
    run_range(grads, b, e, inv_scale, k, o.sum_squares, o.amax, amax_out, partials[w]);
  });
  finish(partials, parts);
  return r;
}

}  // namespace

void sum_squares_exact(std::span<const GradTensor> grads, float inv_scale, ExactSum& sum, bool& found_inf) {
  validate(grads, inv_scale, UnscaleOptions{}, {});
  const UnscaleKernels* kernels = unscale_kernels(active_isa());
  for (const GradTensor& g : grads) {
    if (g.size == 0) continue;
    SegmentOut out;
    kernels->segment[static_cast<int>(g.dtype)][0][1][0](g.data, g.size, inv_scale, out, &sum);
    if (out.max_in >= kInfBits) found_inf = true;
  }
}

UnscaleResult unscale_and_check(std::span<const GradTensor> grads, float inv_scale, const UnscaleOptions& options,
                                std::span<float> amax_out, ThreadPool* pool) {
  validate(grads, inv_scale, options, amax_out);
  static const UnscaleKernels* const active = unscale_kernels(active_isa());
  return unscale_with(*active, grads, inv_scale, options, amax_out, pool);
}

UnscaleResult unscale_and_check(Isa isa, std::span<const GradTensor> grads, float inv_scale,
                                const UnscaleOptions& options, std::span<float> amax_out, ThreadPool* pool) {
  const UnscaleKernels* k = unscale_kernels(isa);
  if (k == nullptr) {
    throw std::invalid_argument("unscale_and_check: back end '" + std::string(isa_name(isa)) +
                                "' is not available on this CPU or build");
  }
  validate(grads, inv_scale, options, amax_out);
  return unscale_with(*k, grads, inv_scale, options, amax_out, pool);
}

}  // namespace mixprec
