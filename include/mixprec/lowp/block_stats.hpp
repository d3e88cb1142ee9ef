// Per-block statistics of one low-precision quantization (lowp::quantize): how the scale
// blocks' multipliers spread, which blocks flushed or saturated values, which blocks sit far
// below the tensor's amax, and the dynamic range of the tensor and of its blocks. They read
// the quantized result and the input it came from, at the steps a caller samples; a what-if
// (the same tensor under another recipe) is a second quantize and a second call.
//
// Blocks: the scale blocks of q, one per scale (q.scale_rows * q.scale_cols): a run of
// `block` elements along a row of the quantized grid (mxfp8, mxfp4: 32; fp8-block: 128;
// nvfp4: 16; the last of a row may be shorter), a 2-D tile (tile_2d: fp8-block 128x128,
// nvfp4 16x16; edge tiles may be smaller) or, for the per-tensor recipes (fp8-delayed,
// fp8-current), the whole tensor as one block (also when it is empty). A columnwise q's
// blocks run down the input's columns, as its grid is the transpose.
//
// The values: every statistic of values reads what the element cast saw unscaled: the
// input, or with rht the input after reference::rht16 along each row of the grid (the
// transform mixes the 16 values of a block, so the counts are those of the transformed
// values, as q.counts').
#pragma once

#include <cstdint>
#include <span>

#include "mixprec/lowp/quantize.hpp"

namespace mixprec::lowp {

// Nearest-rank quantiles of n sorted values v[0] <= ... <= v[n-1]: the P-th percentile is
// v[k - 1] with k = ceil(P * n / 100) (integer arithmetic; k >= 1 as P >= 1).
struct BlockQuantiles {
  double p01 = 0.0, p05 = 0.0, p25 = 0.0, p50 = 0.0, p75 = 0.0, p95 = 0.0, p99 = 0.0;
  friend bool operator==(const BlockQuantiles&, const BlockQuantiles&) = default;
};

struct BlockStats {
  std::uint64_t blocks = 0;  // q.scale_rows * q.scale_cols

  // The multiplier m_b of block b: what lowp::dequantize multiplies its decoded codes by
  // (f32: scale_inv; E8M0: the code's power of two; nvfp4: the E4M3 scale decoded times
  // tensor_amax / (6 * 448), torchao: tensor_scale times the E4M3 scale). The statistics
  // below are of log2(m_b) in double over the blocks whose m_b is finite and > 0
  // (multiplier_blocks of them); the others (0, negative, inf, NaN) are left out and counted
  // in multiplier_left_out (nvfp4: an E4M3 scale that rounded to 0; every block when the
  // input holds a NaN, as the tensor scale is then NaN). std is the population standard
  // deviation. All are 0 when no block counts (multiplier_blocks == 0).
  std::uint64_t multiplier_blocks = 0;
  std::uint64_t multiplier_left_out = 0;
  double log2_multiplier_min = 0.0, log2_multiplier_max = 0.0;
  double log2_multiplier_mean = 0.0, log2_multiplier_std = 0.0;
  BlockQuantiles log2_multiplier_quantiles;

  // Per block, with q.counts' definitions: flushed = finite nonzero values whose code
  // decodes to +-0; saturated = finite values whose fp32 product with the factor the
  // quantizer multiplied them by lay beyond the element format's largest finite. flushed
  // and saturated are the sums over the blocks: q.counts.flushed and q.counts.saturated.
  // The fractions are of the block's own elements (a short block's fewer), their maximum
  // over the blocks (0 when no block flushed, or saturated).
  std::uint64_t flushed = 0, saturated = 0;
  std::uint64_t blocks_with_flush = 0, blocks_with_saturation = 0;
  double max_flushed_fraction = 0.0, max_saturated_fraction = 0.0;

  // amax of a block: max |x| over its values, NaN ignored (inf counts: TE's block amax);
  // tensor_amax: the same over all values (with rht: of the transformed values, so it may
  // differ from q.counts.amax, which is the input's and keeps a NaN). zero_blocks: blocks
  // whose amax is 0 (every value +-0 or NaN, or no value). far_blocks: blocks whose amax is
  // > 0 and below the tensor's by more than 2^far_log2, i.e. tensor_amax > amax * 2^far_log2
  // in double (an inf value makes tensor_amax inf and every block with a finite amax far).
  float tensor_amax = 0.0f;
  double far_log2 = 8.0;
  std::uint64_t far_blocks = 0, zero_blocks = 0;

  // log2(max |x| / min |x|) (the quotient in double) over the finite nonzero values: of the
  // whole tensor (dynamic_range) and the largest over the blocks (max_block_dynamic_range);
  // 0 where there is no finite nonzero value (TE debug's dynamic_range and
  // max_blockwise_dynamic_range, with the quantization's own blocks).
  double dynamic_range = 0.0, max_block_dynamic_range = 0.0;

  friend bool operator==(const BlockStats&, const BlockStats&) = default;
};

// The statistics of q, given src: the [q.rows, q.cols] row-major input that was quantized
// into q (with another input the numbers describe neither). A pure function of (q, src,
// far_log2): one scalar pass over the values (fp8-block reads each block twice, its factor
// coming from the block's amax as in the quantizer), allocating one vector of per-block
// values. Throws std::invalid_argument for a src of the wrong size ("block_stats: src:
// expected N elements, found M"), a far_log2 that is not finite and >= 0, or a q (built by
// hand) whose buffers do not fit its shape or whose rht is not on nvfp4's 1x16 blocks.
BlockStats block_stats(const Quantized& q, std::span<const float> src, double far_log2 = 8.0);

// Pearson kurtosis m4 / m2^2 (central moments, population) in double over the finite values
// of x: 3 for a Gaussian, 1.8 for a uniform. NaN and inf are skipped; 0 when no value is
// finite or m2 == 0 (a constant).
double kurtosis(std::span<const float> x);

}  // namespace mixprec::lowp
