// AVX2 + F16C back end. Compiled with -mavx2 -mf16c -mfma and only called
// after the dispatcher has checked the CPU. Eight lanes at a time; tails go
// through the scalar loops, so every element matches the reference.
//
// f32 -> f16 (round to nearest even) uses vcvtps2ph, the hardware oracle.
// Every other encode runs the reference algorithm of scalar.hpp in integer
// lanes (variable shifts), so there is one algorithm to trust.
#include "formats/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

namespace mixprec::detail {
namespace {

inline __m256i set1(std::uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
inline __m128i set1_16(std::uint16_t v) { return _mm_set1_epi16(static_cast<short>(v)); }

// Per-lane 32-bit counters, spilled to 64 bits before they can wrap.
struct LaneCounters {
  __m256i zero_in = _mm256_setzero_si256();
  __m256i nonfinite = _mm256_setzero_si256();
  __m256i underflow = _mm256_setzero_si256();
  __m256i subnormal = _mm256_setzero_si256();
  __m256i overflow = _mm256_setzero_si256();
  std::size_t vectors = 0;

  static std::uint64_t hsum(__m256i v) {
    alignas(32) std::uint32_t l[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(l), v);
    std::uint64_t s = 0;
    for (std::uint32_t x : l) s += x;
    return s;
  }
  void spill(ConversionStats& st) {
    const std::uint64_t elems = vectors * 8;
    const std::uint64_t zeros = hsum(zero_in);
    st.elements += elems;
    st.nonzero += elems - zeros;
    st.nonfinite_input += hsum(nonfinite);
    st.underflow += hsum(underflow);
    st.subnormal += hsum(subnormal);
    st.overflow += hsum(overflow);
    *this = LaneCounters{};
  }
  // x: unscaled input; code: 32-bit lanes of the written codes; ovf: past-max mask.
  template <const MiniFloatSpec& S>
  void add(__m256 x, __m256i code, __m256i ovf, ConversionStats& st) {
    constexpr std::uint32_t kMag = (1u << (S.bits - 1)) - 1;
    const __m256i zero = _mm256_setzero_si256();
    const __m256i ax = _mm256_and_si256(_mm256_castps_si256(x), set1(0x7fffffffu));
    const __m256i zin = _mm256_cmpeq_epi32(ax, zero);
    const __m256i nonfin = _mm256_cmpgt_epi32(ax, set1(0x7f7fffffu));
    const __m256i fin_nz = _mm256_andnot_si256(_mm256_or_si256(zin, nonfin), set1(0xffffffffu));
    const __m256i mag = _mm256_and_si256(code, set1(kMag));
    const __m256i zout = _mm256_cmpeq_epi32(mag, zero);
    const __m256i sub = _mm256_andnot_si256(zout, _mm256_cmpgt_epi32(set1(1u << S.man_bits), mag));
    zero_in = _mm256_sub_epi32(zero_in, zin);
    nonfinite = _mm256_sub_epi32(nonfinite, nonfin);
    underflow = _mm256_sub_epi32(underflow, _mm256_and_si256(fin_nz, zout));
    subnormal = _mm256_sub_epi32(subnormal, _mm256_and_si256(fin_nz, sub));
    overflow = _mm256_sub_epi32(overflow, _mm256_andnot_si256(nonfin, ovf));
    if (++vectors == (1u << 24)) spill(st);
  }
};

// ---- stores of 8 codes held in 32-bit lanes --------------------------------
inline void store8(std::uint16_t* d, __m256i code) {
  const __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), p);
}
inline void store8(std::uint8_t* d, __m256i code) {
  const __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(d), _mm_packus_epi16(p, p));
}

// ---- generic encode: the reference algorithm, eight lanes -------------------
template <const MiniFloatSpec& S, bool kStochastic>
inline __m256i encode8_generic(__m256 y, __m256i rnd, __m256i ovf_code, bool flush, __m256i& ovf_out) {
  constexpr int M = S.man_bits;
  constexpr int kMinE = min_normal_f32_exponent(S);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i u = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(u, set1(0x7fffffffu));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), S.bits - 1);
  const __m256i mant = _mm256_and_si256(a, set1(0x7fffffu));
  __m256i e32 = _mm256_srli_epi32(a, 23);
  __m256i sig = _mm256_or_si256(mant, _mm256_and_si256(_mm256_cmpgt_epi32(e32, zero), set1(0x800000u)));
  e32 = _mm256_max_epi32(e32, set1(1));
  const __m256i diff = _mm256_sub_epi32(e32, set1(static_cast<std::uint32_t>(kMinE)));
  const __m256i target_normal = _mm256_cmpgt_epi32(diff, set1(0xffffffffu));  // diff >= 0
  const __m256i base = _mm256_and_si256(target_normal, _mm256_slli_epi32(diff, M));
  __m256i shift = _mm256_add_epi32(set1(23 - M), _mm256_max_epi32(_mm256_sub_epi32(zero, diff), zero));
  const __m256i pre = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(shift, set1(31)), zero), set1(31));
  sig = _mm256_srlv_epi32(sig, pre);
  shift = _mm256_min_epi32(shift, set1(31));
  __m256i add;
  if constexpr (kStochastic) {
    add = _mm256_srlv_epi32(rnd, _mm256_sub_epi32(set1(32), shift));
  } else {
    const __m256i half_m1 = _mm256_sub_epi32(_mm256_sllv_epi32(set1(1), _mm256_sub_epi32(shift, set1(1))), set1(1));
    add = _mm256_add_epi32(half_m1, _mm256_and_si256(_mm256_srlv_epi32(sig, shift), set1(1)));
  }
  __m256i code = _mm256_add_epi32(base, _mm256_srlv_epi32(_mm256_add_epi32(sig, add), shift));
  const __m256i ovf = _mm256_cmpgt_epi32(code, set1(S.max_code));
  code = _mm256_blendv_epi8(code, ovf_code, ovf);
  if (flush) code = _mm256_andnot_si256(_mm256_cmpgt_epi32(set1(1u << M), code), code);
  const __m256i nan = _mm256_cmpgt_epi32(a, set1(0x7f800000u));
  __m256i nan_code;
  if constexpr (S.has_inf) {
    nan_code = _mm256_or_si256(set1(S.overflow_code | (1u << (M - 1))), _mm256_srli_epi32(mant, 23 - M));
  } else {
    nan_code = set1(S.nan_code);
  }
  code = _mm256_blendv_epi8(code, nan_code, nan);
  ovf_out = _mm256_andnot_si256(nan, ovf);
  return _mm256_or_si256(code, sign);
}

// ---- bf16 round to nearest even: the integer rounding trick ----------------
inline __m256i encode8_bf16(__m256 y, bool saturate, bool flush, __m256i& ovf_out) {
  constexpr std::uint32_t kThreshold = overflow_threshold_bits(kBF16Spec);
  const __m256i u = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(u, set1(0x7fffffffu));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), set1(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(set1(0x7fffu), lsb)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(a, set1(0x7f800000u));
  const __m256i ovf = _mm256_andnot_si256(nan, _mm256_cmpgt_epi32(a, set1(kThreshold - 1)));
  if (saturate) {
    const __m256i sign16 = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), 15);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(sign16, set1(kBF16Spec.max_code)), ovf);
  }
  if (flush) {
    const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(r, set1(0x7f80u)), _mm256_setzero_si256());
    r = _mm256_andnot_si256(_mm256_and_si256(sub, set1(0x7fffu)), r);
  }
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), set1(0x40u)), nan);
  ovf_out = ovf;
  return r;
}

// ---- f16 round to nearest even: F16C --------------------------------------
inline __m128i encode8_f16(__m256 y, bool saturate, bool flush, __m256i& ovf_out) {
  constexpr std::uint32_t kThreshold = overflow_threshold_bits(kF16Spec);
  const __m256 sign_mask = _mm256_castsi256_ps(set1(0x80000000u));
  const __m256 ay = _mm256_andnot_ps(sign_mask, y);
  const __m256i ai = _mm256_castps_si256(ay);
  ovf_out = _mm256_andnot_si256(_mm256_cmpgt_epi32(ai, set1(0x7f800000u)),
                                _mm256_cmpgt_epi32(ai, set1(kThreshold - 1)));
  if (saturate) {
    // min(max, |y|) returns |y| when it is NaN (MINPS returns its second operand).
    const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(65504.0f), ay);
    y = _mm256_or_ps(clamped, _mm256_and_ps(sign_mask, y));
  }
  __m128i h = _mm256_cvtps_ph(y, 0);
  if (flush) {
    const __m128i sub = _mm_cmpeq_epi16(_mm_and_si128(h, set1_16(0x7c00)), _mm_setzero_si128());
    h = _mm_andnot_si128(_mm_and_si128(sub, set1_16(0x7fff)), h);
  }
  return h;
}

// ---- kernels ----------------------------------------------------------------
// Layout equality (address comparison of the specs is not a constant expression
// under the sanitizers).
constexpr bool same_format(const MiniFloatSpec& a, const MiniFloatSpec& b) {
  return a.bits == b.bits && a.man_bits == b.man_bits && a.bias == b.bias && a.has_inf == b.has_inf;
}
template <const MiniFloatSpec& S>
using StorageOf = std::conditional_t<S.bits == 16, std::uint16_t, std::uint8_t>;

template <const MiniFloatSpec& S, bool kCount>
ConversionStats encode_kernel(const float* src, void* dst_v, std::size_t n, const ConvertOptions& o) {
  using Storage = StorageOf<S>;
  auto* dst = static_cast<Storage*>(dst_v);
  const bool saturate = o.overflow == Overflow::saturate;
  const bool flush = o.subnormals == Subnormals::flush;
  const __m256 scale = _mm256_set1_ps(o.scale);
  const __m256i ovf_code = set1(saturate ? S.max_code : S.overflow_code);
  ConversionStats st;
  LaneCounters counters;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256 y = _mm256_mul_ps(x, scale);
    __m256i ovf = _mm256_setzero_si256();
    __m256i code = _mm256_setzero_si256();
    if constexpr (same_format(S, kF16Spec)) {
      const __m128i h = encode8_f16(y, saturate, flush, ovf);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
      if constexpr (kCount) code = _mm256_cvtepu16_epi32(h);
    } else {
      if constexpr (same_format(S, kBF16Spec)) {
        code = encode8_bf16(y, saturate, flush, ovf);
      } else {
        code = encode8_generic<S, false>(y, _mm256_setzero_si256(), ovf_code, flush, ovf);
      }
      store8(dst + i, code);
    }
    if constexpr (kCount) counters.add<S>(x, code, ovf, st);
  }
  if constexpr (kCount) {
    counters.spill(st);
    encode_counted_range<S>(src + i, dst + i, n - i, o, st);
  } else {
    encode_range<S>(src + i, dst + i, n - i, o);
  }
  return st;
}

template <const MiniFloatSpec& S>
void encode_stochastic_kernel(const float* src, void* dst_v, const std::uint32_t* random, std::size_t n,
                              const ConvertOptions& o) {
  using Storage = StorageOf<S>;
  auto* dst = static_cast<Storage*>(dst_v);
  const bool flush = o.subnormals == Subnormals::flush;
  const __m256 scale = _mm256_set1_ps(o.scale);
  const __m256i ovf_code = set1(o.overflow == Overflow::saturate ? S.max_code : S.overflow_code);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(src + i), scale);
    const __m256i rnd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(random + i));
    __m256i ovf;
    store8(dst + i, encode8_generic<S, true>(y, rnd, ovf_code, flush, ovf));
  }
  encode_stochastic_range<S>(src + i, dst + i, random + i, n - i, o);
}

// Decode helpers: flush subnormal f16 patterns to a signed zero.
inline __m128i flush_f16(__m128i h) {
  const __m128i sub = _mm_cmpeq_epi16(_mm_and_si128(h, set1_16(0x7c00)), _mm_setzero_si128());
  return _mm_andnot_si128(_mm_and_si128(sub, set1_16(0x7fff)), h);
}

template <const MiniFloatSpec& S>
void decode_kernel(const void* src_v, float* dst, std::size_t n, const ConvertOptions& o) {
  using Storage = StorageOf<S>;
  const auto* src = static_cast<const Storage*>(src_v);
  const bool flush = o.subnormals == Subnormals::flush;
  const __m256 scale = _mm256_set1_ps(o.scale);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 f;
    if constexpr (same_format(S, kF16Spec)) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      if (flush) h = flush_f16(h);
      f = _mm256_cvtph_ps(h);
    } else if constexpr (same_format(S, kBF16Spec)) {
      __m256i u = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16);
      const __m256i a = _mm256_and_si256(u, set1(0x7fffffffu));
      u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpgt_epi32(a, set1(0x7f800000u)), set1(0x400000u)));
      if (flush) {
        const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(u, set1(0x7f800000u)), _mm256_setzero_si256());
        u = _mm256_andnot_si256(_mm256_and_si256(sub, set1(0x7fffffffu)), u);
      }
      f = _mm256_castsi256_ps(u);
    } else if constexpr (same_format(S, kE5M2Spec)) {
      // E5M2 is the top byte of an f16.
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
      __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
      if (flush) h = flush_f16(h);
      f = _mm256_cvtph_ps(h);
    } else {
      // E4M3: place exponent and mantissa into an f16 (bias 15 vs 7: times 2^8), NaN fixed up.
      const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, set1_16(0x80)), 8);
      __m128i mag = _mm_and_si128(w, set1_16(0x7f));
      const __m128i nan16 = _mm_cmpeq_epi16(mag, set1_16(0x7f));
      if (flush) mag = _mm_andnot_si128(_mm_cmpeq_epi16(_mm_and_si128(mag, set1_16(0x78)), _mm_setzero_si128()), mag);
      f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(mag, 7))), _mm256_set1_ps(256.0f));
      const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16));
      const __m256 qnan = _mm256_or_ps(_mm256_and_ps(f, _mm256_castsi256_ps(set1(0x80000000u))),
                                       _mm256_castsi256_ps(set1(0x7fc00000u)));
      f = _mm256_blendv_ps(f, qnan, nan);
    }
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(f, scale));
  }
  decode_range<S>(src + i, dst + i, n - i, o);
}

template <const MiniFloatSpec& S>
FormatKernels make_avx2() {
  return FormatKernels{
      [](const float* s, void* d, std::size_t n, const ConvertOptions& o) {
        (void)encode_kernel<S, false>(s, d, n, o);
      },
      &encode_stochastic_kernel<S>,
      &encode_kernel<S, true>,
      &decode_kernel<S>,
  };
}

}  // namespace

const KernelTable* avx2_kernels() noexcept {
  static const KernelTable table{
      Isa::avx2, make_avx2<kF16Spec>(), make_avx2<kBF16Spec>(), make_avx2<kE4M3Spec>(),
      make_avx2<kE5M2Spec>(),
  };
  return &table;
}

}  // namespace mixprec::detail

#else  // not x86-64: no AVX2 back end

namespace mixprec::detail {
const KernelTable* avx2_kernels() noexcept { return nullptr; }
}  // namespace mixprec::detail

#endif
