// Scalar reference back end of unscale_and_check: the element step of
// kernels/unscale_kernels.hpp in index order, chunk by chunk.
#include "kernels/unscale_kernels.hpp"

namespace mixprec::detail {
namespace {

template <DType D, bool kWrite, bool kSum, bool kAmax>
void segment_scalar(void* data, std::size_t n, float inv, SegmentOut& out, ExactSum* sum) {
  double lanes[kSumLanes] = {};
  for (std::size_t c = 0; c < n; c += kUnscaleChunk) {
    const std::size_t end = n - c < kUnscaleChunk ? n : c + kUnscaleChunk;
    unscale_range<D, kWrite, kSum, kAmax>(data, c, end, c, inv, out, lanes);
    if constexpr (kSum) flush_lanes(lanes, *sum);
  }
}

template <DType D>
void fill(UnscaleKernels& k) {
  auto& t = k.segment[static_cast<int>(D)];
  t[0][0][0] = &segment_scalar<D, false, false, false>;
  t[0][0][1] = &segment_scalar<D, false, false, true>;
  t[0][1][0] = &segment_scalar<D, false, true, false>;
  t[0][1][1] = &segment_scalar<D, false, true, true>;
  t[1][0][0] = &segment_scalar<D, true, false, false>;
  t[1][0][1] = &segment_scalar<D, true, false, true>;
  t[1][1][0] = &segment_scalar<D, true, true, false>;
  t[1][1][1] = &segment_scalar<D, true, true, true>;
}

UnscaleKernels make() {
  UnscaleKernels k{};
  k.isa = Isa::scalar;
  fill<DType::f32>(k);
  fill<DType::f16>(k);
  fill<DType::bf16>(k);
  return k;
}

}  // namespace

const UnscaleKernels& scalar_unscale_kernels() noexcept {
  static const UnscaleKernels k = make();
  return k;
}

}  // namespace mixprec::detail
