#include "mixprec/optim/state_format.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mixprec/core/parallel.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/formats/kernel_table.hpp"
#include "optim/kernels.hpp"

namespace mixprec {

namespace {
#include "optim/moment_code_maps.inc"

constexpr MasterFormat kMasters[] = {MasterFormat::fp32, MasterFormat::remainder, MasterFormat::none};
constexpr MomentFormat kMoments[] = {MomentFormat::fp32, MomentFormat::bf16, MomentFormat::fp16,
                                     MomentFormat::fp8,  MomentFormat::q8,   MomentFormat::q4};
constexpr AdamRule kRules[] = {AdamRule::torch, AdamRule::torchao, AdamRule::te};

// torchao quantizes a state only when it has at least this many elements (adam.py _new_buffer).
constexpr std::size_t kMinBlockedNumel = 4096;
// Elements per pass of the fused step: a multiple of every block (the largest block allowed).
constexpr std::size_t kChunk = 1024;
// How many chunks ahead the fused step asks for its stored bytes.
constexpr std::size_t kPrefetchChunks = 1;
// Elements per piece a worker of the fused step's pool takes (64 chunks: about 1 MB of state).
constexpr std::size_t kStepPiece = 64 * kChunk;

template <class E, std::size_t N, class F>
std::string joined(const E (&all)[N], F name) {
  std::string s;
  for (E e : all) s += (s.empty() ? "" : ", ") + std::string(name(e));
  return s;
}
template <class E, std::size_t N, class F>
std::optional<E> parse_in(const E (&all)[N], F name, std::string_view s) {
  for (E e : all)
    if (name(e) == s) return e;
  return std::nullopt;
}

bool blocked(MomentFormat f) noexcept { return f == MomentFormat::fp8 || f == MomentFormat::q8 || f == MomentFormat::q4; }

std::size_t default_block(MomentFormat f) noexcept { return f == MomentFormat::q4 ? 128 : 256; }

template <std::size_t N>
constexpr std::array<float, N> floats_of(const std::uint32_t (&bits)[N]) {
  std::array<float, N> f{};
  for (std::size_t i = 0; i < N; ++i) f[i] = std::bit_cast<float>(bits[i]);
  return f;
}
constexpr auto kQ8SignedMap = floats_of(kQ8Signed);
constexpr auto kQ8UnsignedMap = floats_of(kQ8Unsigned);
constexpr auto kQ4SignedMap = floats_of(kQ4Signed);
constexpr auto kQ4UnsignedMap = floats_of(kQ4Unsigned);

}  // namespace

std::string_view master_format_name(MasterFormat f) noexcept {
  switch (f) {
    case MasterFormat::fp32: return "fp32";
    case MasterFormat::remainder: return "remainder";
    case MasterFormat::none: return "none";
  }
  return "?";
}
std::string_view moment_format_name(MomentFormat f) noexcept {
  switch (f) {
    case MomentFormat::fp32: return "fp32";
    case MomentFormat::bf16: return "bf16";
    case MomentFormat::fp16: return "fp16";
    case MomentFormat::fp8: return "fp8";
    case MomentFormat::q8: return "8bit";
    case MomentFormat::q4: return "4bit";
  }
  return "?";
}
std::string_view adam_rule_name(AdamRule r) noexcept {
  switch (r) {
    case AdamRule::torch: return "torch";
    case AdamRule::torchao: return "torchao";
    case AdamRule::te: return "te";
  }
  return "?";
}
std::optional<MasterFormat> parse_master_format(std::string_view s) noexcept { return parse_in(kMasters, master_format_name, s); }
std::optional<MomentFormat> parse_moment_format(std::string_view s) noexcept { return parse_in(kMoments, moment_format_name, s); }
std::optional<AdamRule> parse_adam_rule(std::string_view s) noexcept { return parse_in(kRules, adam_rule_name, s); }
std::string master_format_names() { return joined(kMasters, master_format_name); }
std::string moment_format_names() { return joined(kMoments, moment_format_name); }

void validate(const StateFormats& f) {
  if (f.block != 0 && (f.block < 32 || f.block > kChunk || !std::has_single_bit(f.block)))
    throw std::invalid_argument("state formats: block: expected 0 (the format's default) or a power of two in "
                                "[32, 1024], found " + std::to_string(f.block));
  if (f.fp8_per_tensor && f.m != MomentFormat::fp8 && f.v != MomentFormat::fp8)
    throw std::invalid_argument("state formats: fp8_per_tensor: expected an fp8 moment, found m " +
                                std::string(moment_format_name(f.m)) + " and v " + std::string(moment_format_name(f.v)));
}

std::size_t MomentLayout::code_bytes() const noexcept {
  switch (format) {
    case MomentFormat::fp32: return numel * 4;
    case MomentFormat::bf16:
    case MomentFormat::fp16: return numel * 2;
    case MomentFormat::fp8:
    case MomentFormat::q8: return numel;
    case MomentFormat::q4: return (numel + 1) / 2;
  }
  return 0;
}
std::size_t MomentLayout::scale_count() const noexcept {
  if (block == 0 || numel == 0) return 0;
  return (numel + block - 1) / block;
}

MomentLayout moment_layout(MomentFormat f, bool is_signed, std::size_t numel, const StateFormats& formats) noexcept {
  MomentLayout l;
  l.format = f;
  l.is_signed = is_signed;
  l.numel = numel;
  if (f == MomentFormat::fp16 || (f == MomentFormat::fp8 && formats.fp8_per_tensor)) {
    l.per_tensor = true;
    l.block = numel;
  } else if (blocked(f)) {
    const std::size_t b = formats.block != 0 ? formats.block : default_block(f);
    if (numel < kMinBlockedNumel || numel % b != 0) l.format = MomentFormat::fp32;  // torchao's fallback
    else l.block = b;
  }
  return l;
}

std::uint64_t moment_bytes(MomentFormat m, std::uint64_t numel, const StateFormats& f) noexcept {
  switch (m) {
    case MomentFormat::fp32: return 4 * numel;
    case MomentFormat::bf16: return 2 * numel;
    case MomentFormat::fp16: return 2 * numel + 4;  // one fp32 scale
    default: break;
  }
  const std::uint64_t block = f.block != 0 ? f.block : default_block(m);
  const std::uint64_t codes = m == MomentFormat::q4 ? (numel + 1) / 2 : numel;
  if (m == MomentFormat::fp8 && f.fp8_per_tensor) return codes + 4;
  return codes + 4 * ((numel + block - 1) / block);
}

unsigned master_bytes_per_param(MasterFormat m) noexcept {
  return m == MasterFormat::fp32 ? 4 : m == MasterFormat::remainder ? 2 : 0;
}

StateBytes state_bytes_per_param(const StateFormats& f) noexcept {
  constexpr std::uint64_t kLarge = std::uint64_t{1} << 30;  // per-tensor scales vanish
  StateBytes b;
  b.master = master_bytes_per_param(f.master);
  b.m = static_cast<double>(moment_bytes(f.m, kLarge, f)) / static_cast<double>(kLarge);
  b.v = static_cast<double>(moment_bytes(f.v, kLarge, f)) / static_cast<double>(kLarge);
  return b;
}

std::span<const float> moment_code_map(MomentFormat f, bool is_signed) noexcept {
  if (f == MomentFormat::q8) return is_signed ? std::span<const float>(kQ8SignedMap) : std::span<const float>(kQ8UnsignedMap);
  if (f == MomentFormat::q4) return is_signed ? std::span<const float>(kQ4SignedMap) : std::span<const float>(kQ4UnsignedMap);
  return {};
}

void split_master(const float* master, std::uint16_t* bf16_bits, std::int16_t* remainder, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t b = std::bit_cast<std::uint32_t>(master[i]);
    const auto rem = static_cast<std::int16_t>(static_cast<std::uint16_t>(b & 0xFFFFu));
    // TE: the top half rounded half away from zero (a negative remainder rounds the magnitude up).
    bf16_bits[i] = static_cast<std::uint16_t>((b >> 16) + (rem < 0 ? 1u : 0u));
    remainder[i] = rem;
  }
}

void join_master(const std::uint16_t* bf16_bits, const std::int16_t* remainder, float* master, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t hi = static_cast<std::uint32_t>(bf16_bits[i]) - (remainder[i] < 0 ? 1u : 0u);
    master[i] = std::bit_cast<float>(((hi & 0xFFFFu) << 16) | static_cast<std::uint16_t>(remainder[i]));
  }
}

// ---------------------------------------------------------------------------------------------
// Moment codecs. A block (or a per-tensor group handled in chunks) is dequantized into fp32,
// updated, and quantized back; the scale of each rule is written out in the docs.

namespace {

// torchao's quantize_8bit_with_qmap / quantize_4bit_with_qmap: the largest code whose value is
// <= y (0 when y is below every value or NaN), then one up when y - value >= (next value - value)
// * 0.5. Written out once here, to build the tables of the kernels' searches (kernels.hpp's
// CodeMap); the kernels give this code for every fp32 value.
std::size_t rule_code(std::span<const float> map, float y) noexcept {
  if (std::isnan(y)) return 0;
  const auto above = std::upper_bound(map.begin(), map.end(), y);  // the first value > y
  std::size_t c = above == map.begin() ? 0 : static_cast<std::size_t>(above - map.begin()) - 1;
  const std::size_t up = c + 1 < map.size() ? c + 1 : c;
  if (y - map[c] >= (map[up] - map[c]) * 0.5f) c = up;
  return c;
}

// The fp32 values in order, as integers: -inf .. -0 -> -0x7F800000 .. 0, +0 .. +inf -> 0 .. 0x7F800000.
float ordered_float(std::int64_t k) noexcept {
  return std::bit_cast<float>(k < 0 ? static_cast<std::uint32_t>(-k) | 0x80000000u : static_cast<std::uint32_t>(k));
}

// The code never decreases as y grows (the largest value <= y never does, and inside one gap
// y - value >= half is monotone in y), so it is the number of thresholds <= y, threshold k the
// least fp32 value whose code is >= k: each found by bisection over the ordered fp32 values.
// The buckets of the top 16 bits start at their lowest value (negative: the largest magnitude).
template <std::size_t N>
struct MapTables {
  std::array<std::uint8_t, 65536> walk_start{};
  std::array<float, N + 1> thresholds{};
  std::array<std::uint8_t, 65536 + 3> start{};
  std::array<std::uint32_t, 65536> packed{};
  optim_detail::CodeMap map{};

  explicit MapTables(std::span<const float> values) {
    for (std::uint32_t k = 0; k < 65536; ++k) {
      const std::uint32_t lo_bits = (k & 0x8000u) != 0 ? (k << 16) | 0xFFFFu : k << 16;  // the lowest value
      const float lowest = std::bit_cast<float>(lo_bits);
      std::size_t c = 0;
      for (std::size_t i = 0; i < N; ++i)
        if (lowest >= values[i]) c = i;  // false for NaN: 0
      walk_start[k] = static_cast<std::uint8_t>(c);
    }
    thresholds[0] = -std::numeric_limits<float>::infinity();
    thresholds[N] = std::numeric_limits<float>::quiet_NaN();
    for (std::size_t k = 1; k < N; ++k) {
      std::int64_t below = -0x7F800000LL, at = 0x7F800000LL;  // rule_code(-inf) = 0, rule_code(inf) = N - 1
      while (at - below > 1) {
        const std::int64_t mid = below + (at - below) / 2;
        (rule_code(values, ordered_float(mid)) >= k ? at : below) = mid;
      }
      thresholds[k] = ordered_float(at);
    }
    unsigned steps = 0;
    for (std::uint32_t k = 0; k < 65536; ++k) {
      const bool negative = (k & 0x8000u) != 0;
      const float lowest = std::bit_cast<float>(negative ? (k << 16) | 0xFFFFu : k << 16);
      const float highest = std::bit_cast<float>(negative ? k << 16 : (k << 16) | 0xFFFFu);
      const std::size_t c = rule_code(values, lowest);
      start[k] = static_cast<std::uint8_t>(c);
      // Thresholds inside the bucket, above its lowest value (NaN buckets: none reachable; y is
      // a quotient, and a quotient's NaN is quiet).
      if (!std::isnan(lowest) && !std::isnan(highest)) steps = std::max(steps, static_cast<unsigned>(rule_code(values, highest) - c));
    }
    for (std::uint32_t k = 0; k < 65536; ++k) {
      const std::uint32_t next = std::bit_cast<std::uint32_t>(thresholds[start[k] + 1u]);  // NaN past the last code
      std::uint32_t offset = 0x10000u;
      if (start[k] + 1u < N && next >> 16 == k) offset = (k & 0x8000u) != 0 ? 0xFFFFu - (next & 0xFFFFu) : next & 0xFFFFu;
      packed[k] = start[k] | offset << 8;
    }
    // The interval of 0's code: [thresholds[k0], thresholds[k0 + 1]), the first -inf for code 0,
    // the second NaN (none) past the last code.
    const std::size_t k0 = rule_code(values, 0.0f);
    const float below = -thresholds[k0], above = k0 + 1 < N ? thresholds[k0 + 1] : std::numeric_limits<float>::infinity();
    map = {values.data(), N, walk_start.data(), thresholds.data(), start.data(), steps,
           steps <= 1 ? packed.data() : nullptr, std::min(below, above)};
  }
};

}  // namespace

const optim_detail::CodeMap& optim_detail::code_map(bool eight_bit, bool is_signed) noexcept {
  if (eight_bit) {
    static const MapTables<256> signed_tables(kQ8SignedMap), unsigned_tables(kQ8UnsignedMap);
    return is_signed ? signed_tables.map : unsigned_tables.map;
  }
  static const MapTables<16> signed_tables(kQ4SignedMap), unsigned_tables(kQ4UnsignedMap);
  return is_signed ? signed_tables.map : unsigned_tables.map;
}

namespace {

// |x| max over n values as magnitude bits compared as integers (the back end's amax kernel): a
// NaN wins, as torch's amax propagates it.
std::uint32_t absmax_bits(const KernelTable* t, const float* x, std::size_t n) noexcept { return t->amax.amax_bits(x, n); }
float absmax(const KernelTable* t, const float* x, std::size_t n) noexcept {
  return std::bit_cast<float>(absmax_bits(t, x, n));
}

// Everything a codec needs from the back end.
struct Codec {
  const KernelTable* table;
  const optim_detail::UpdateKernels* k;

  // Decode elements [b, b + n) of a moment into x. For per-tensor layouts the scale is scales[0].
  void decode(const MomentView& mv, std::size_t b, std::size_t n, float* x) const noexcept {
    const MomentLayout& l = mv.layout;
    switch (l.format) {
      case MomentFormat::fp32:
        std::memcpy(x, static_cast<const float*>(mv.codes) + b, n * 4);
        return;
      case MomentFormat::bf16:
        table->bf16.decode(static_cast<const std::byte*>(mv.codes) + 2 * b, x, n, ConvertOptions{});
        return;
      case MomentFormat::fp16:
        table->f16.decode(static_cast<const std::byte*>(mv.codes) + 2 * b, x, n,
                          ConvertOptions{Overflow::ieee, Subnormals::keep, mv.scales[0]});
        return;
      case MomentFormat::fp8:
        if (l.per_tensor) {
          const float factor = te_fp8_dequant_scale(mv.scales[0]);
          k->decode_fp8_blocks(static_cast<const std::uint8_t*>(mv.codes) + b, &factor, x, n, n);
        } else {
          k->decode_fp8_blocks(static_cast<const std::uint8_t*>(mv.codes) + b, mv.scales + b / l.block, x, n, l.block);
        }
        return;
      case MomentFormat::q8:
      case MomentFormat::q4:
        // b and n are multiples of the (even) block: whole blocks, whole bytes.
        k->decode_map_blocks(static_cast<const std::uint8_t*>(mv.codes) + (l.format == MomentFormat::q8 ? b : b / 2),
                             mv.scales + b / l.block, x, n, l.block, optim_detail::code_map(l.format == MomentFormat::q8, l.is_signed));
        return;
    }
  }

  // Encode blocked or unscaled elements [b, b + n) (b and n multiples of the block) from x,
  // writing their scales. x is only read.
  void encode_blocks(const MomentView& mv, std::size_t b, std::size_t n, const float* x) const noexcept {
    const MomentLayout& l = mv.layout;
    auto* codes = static_cast<std::uint8_t*>(mv.codes);
    switch (l.format) {
      case MomentFormat::fp32:
        std::memcpy(static_cast<float*>(mv.codes) + b, x, n * 4);
        return;
      case MomentFormat::bf16:
        table->bf16.encode(x, static_cast<std::byte*>(mv.codes) + 2 * b, n, ConvertOptions{});
        return;
      case MomentFormat::fp8:
        k->encode_fp8_blocks(x, codes + b, mv.scales + b / l.block, n, l.block);
        return;
      case MomentFormat::q8:
        k->encode_map_blocks(x, codes + b, mv.scales + b / l.block, n, l.block, optim_detail::code_map(true, l.is_signed));
        return;
      case MomentFormat::q4:  // blocks are even: pairs stay in a block
        k->encode_map_blocks(x, codes + b / 2, mv.scales + b / l.block, n, l.block, optim_detail::code_map(false, l.is_signed));
        return;
      case MomentFormat::fp16: break;  // per tensor: encode_per_tensor
    }
  }

  // Encode per-tensor elements [b, b + n) with the tensor's new scale (TE's rules).
  void encode_per_tensor(const MomentView& mv, std::size_t b, std::size_t n, const float* x, float scale) const noexcept {
    if (mv.layout.format == MomentFormat::fp16) {
      const float rscale = scale > 0.0f ? 1.0f / scale : 0.0f;
      table->f16.encode(x, static_cast<std::byte*>(mv.codes) + 2 * b, n,
                        ConvertOptions{Overflow::ieee, Subnormals::keep, rscale});
    } else {
      k->encode_fp8_scaled(x, static_cast<std::uint8_t*>(mv.codes) + b, n, te_fp8_quant_scale(scale));
    }
  }

  // TE's FP8 state: the quantizer's scale is 1 / scale, the tensor's scale_inv its reciprocal.
  // A zero scale (an all-zero state) stores zeros: decided here, TE would divide by zero.
  static float te_fp8_quant_scale(float scale) noexcept { return scale > 0.0f ? 1.0f / scale : 0.0f; }
  static float te_fp8_dequant_scale(float scale) noexcept { return scale > 0.0f ? 1.0f / (1.0f / scale) : 0.0f; }
};

float per_tensor_scale(MomentFormat f, float amax) noexcept {
  return amax / (f == MomentFormat::fp16 ? optim_detail::kTeFp16Range : optim_detail::kE4M3Max);
}

}  // namespace

void quantize_moment(const float* x, const MomentView& out) {
  const Codec codec{kernel_table(active_isa()), optim_detail::update_kernels(active_isa())};
  const MomentLayout& l = out.layout;
  if (l.per_tensor) {
    const float scale = per_tensor_scale(l.format, absmax(codec.table, x, l.numel));
    for (std::size_t b = 0; b < l.numel; b += kChunk) {
      const std::size_t n = std::min(kChunk, l.numel - b);
      codec.encode_per_tensor(out, b, n, x + b, scale);
    }
    if (l.numel > 0) out.scales[0] = scale;
    return;
  }
  for (std::size_t b = 0; b < l.numel; b += kChunk) {
    const std::size_t n = std::min(kChunk, l.numel - b);
    codec.encode_blocks(out, b, n, x + b);
  }
}

void dequantize_moment(const MomentView& in, float* x) {
  const Codec codec{kernel_table(active_isa()), optim_detail::update_kernels(active_isa())};
  for (std::size_t b = 0; b < in.layout.numel; b += kChunk)
    codec.decode(in, b, std::min(kChunk, in.layout.numel - b), x + b);
}

// ---------------------------------------------------------------------------------------------
// The fused step.

namespace {

using text::num;

[[noreturn]] void bad(const std::string& what, const std::string& expected, const std::string& found) {
  throw std::invalid_argument("adam_tensor_step: " + what + ": expected " + expected + ", found " + found);
}

void check_moment(const MomentView& mv, std::size_t n, const char* name) {
  if (mv.layout.numel != n) bad(std::string(name) + " numel", std::to_string(n), std::to_string(mv.layout.numel));
  if (n > 0 && mv.codes == nullptr) bad(std::string(name) + " codes", "a buffer", "nullptr");
  if (mv.layout.scale_count() > 0 && mv.scales == nullptr) bad(std::string(name) + " scales", "a buffer", "nullptr");
  if (mv.layout.format == MomentFormat::q4 && mv.layout.block % 2 != 0)
    bad(std::string(name) + " block", "an even block for 4bit", std::to_string(mv.layout.block));
  if (!mv.layout.per_tensor && mv.layout.block != 0 && (n % mv.layout.block != 0 || kChunk % mv.layout.block != 0))
    bad(std::string(name) + " block", "a divisor of 1024 that divides the tensor", std::to_string(mv.layout.block));
}

optim_detail::RuleScalars rule_scalars(const AdamStepArgs& a) {
  const AdamHyper& h = a.hyper;
  const auto t = static_cast<double>(a.step);
  optim_detail::RuleScalars s{};
  s.lr = static_cast<float>(h.lr);
  s.eps = static_cast<float>(h.eps);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.l2 = !h.decoupled && h.weight_decay != 0;
  s.decoupled = h.decoupled && h.weight_decay != 0;
  if (a.rule == AdamRule::torchao) {
    // lr is an fp32 tensor, lr * weight_decay an fp32 product; beta ** step an fp32 pow.
    s.decay = s.lr * static_cast<float>(h.weight_decay);
    s.w1 = static_cast<float>(1.0 - h.beta1);
    s.omw1 = 1.0f - s.w1;
    s.low1 = std::fabs(s.w1) < 0.5f;
    s.w2 = static_cast<float>(1.0 - h.beta2);
    s.omw2 = 1.0f - s.w2;
    s.low2 = std::fabs(s.w2) < 0.5f;
    s.bc1 = optim_detail::divisor(1.0f - std::pow(static_cast<float>(h.beta1), static_cast<float>(t)));
    s.bc2 = optim_detail::divisor(1.0f - std::pow(static_cast<float>(h.beta2), static_cast<float>(t)));
    s.sqrt_bc2 = optim_detail::divisor(std::sqrt(s.bc2.d));
  } else {
    // TE: float hyperparameters; bias corrections 1 - std::pow(float beta, int step) in double.
    s.decay = s.weight_decay;
    s.beta1 = static_cast<float>(h.beta1);
    s.one_minus_beta1 = 1.0f - s.beta1;
    s.beta2 = static_cast<float>(h.beta2);
    s.one_minus_beta2 = 1.0f - s.beta2;
    s.bc1 = optim_detail::divisor(static_cast<float>(1.0 - std::pow(static_cast<double>(s.beta1), t)));
    s.bc2 = optim_detail::divisor(static_cast<float>(1.0 - std::pow(static_cast<double>(s.beta2), t)));
  }
  return s;
}

optim_detail::AdamScalars torch_scalars(const AdamStepArgs& a) {
  const AdamHyper& h = a.hyper;
  return optim_detail::adam_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, a.step);
}

const FormatKernels* sixteen_bit(const KernelTable* t, DType d) noexcept {
  return d == DType::f16 ? &t->f16 : d == DType::bf16 ? &t->bf16 : nullptr;
}

struct Step {
  const AdamTensor& t;
  const AdamStepArgs& a;
  Codec codec;
  const optim_detail::UpdateKernels* k;
  const FormatKernels* grad_fmt;
  const FormatKernels* weight_fmt;
  optim_detail::AdamScalars torch_s;
  optim_detail::RuleScalars rule_s;
  std::uint64_t sr_key;

  // Where chunk [b, b + n)'s fp32 values live during the update: in place where the stored
  // format is fp32 (and `in_place`), else in the caller's L1 buffers; p is nullptr where the
  // update wrote the weights itself.
  struct Chunk {
    float* p;
    float* m;
    float* v;
  };

  // The stored bytes of the next chunk, asked for a slice at a time between the passes over
  // this one (prefetch: a burst of prefetches waits for fill buffers).
  struct Ahead {
    static constexpr std::size_t kSlice = 128;
    const Step* s;
    std::size_t at, end;
    void next() noexcept {
      if (at >= end) return;
      s->prefetch(at, std::min(kSlice, end - at));
      at += kSlice;
    }
    void rest() noexcept {
      while (at < end) next();
    }
  };
  // The chunk kPrefetchChunks ahead of b, inside [.., end) (a piece's end: another worker's
  // piece is that worker's to prefetch).
  Ahead ahead_of(std::size_t b, std::size_t end) const noexcept {
    const std::size_t at = b + kPrefetchChunks * kChunk;
    return {this, at, at < end ? std::min(at + kChunk, end) : at};
  }

  // Loads chunk [b, b + n), updates it. in_place = false (the absmax pass of per-tensor scales)
  // computes the new moments alone (the weights are read only for L2) and leaves every stored
  // byte as it was.
  Chunk load_and_update(std::size_t b, std::size_t n, float* g, float* pbuf, float* mbuf, float* vbuf,
                        bool in_place, Ahead& ahead) const noexcept {
    ahead.next();
    if (in_place && a.rule == AdamRule::torch && t.master == MasterFormat::remainder && t.grad_dtype == DType::bf16) {
      // One pass over gradient, weights and remainders (the moments decoded first).
      Chunk c{nullptr, mbuf, vbuf};
      load_moments(b, n, c, ahead);
      k->adam_remainder(static_cast<std::uint16_t*>(t.weight) + b, t.remainder + b, c.m, c.v,
                        static_cast<const std::uint16_t*>(t.grad) + b, n, a.inv_scale, a.clip_coef, torch_s);
      ahead.next();
      return c;
    }
    float pre = 1.0f;
    const float* gp = g;
    if (grad_fmt == nullptr) {
      gp = static_cast<const float*>(t.grad) + b;
      pre = a.inv_scale;
    } else {
      grad_fmt->decode(static_cast<const std::byte*>(t.grad) + 2 * b, g, n,
                       ConvertOptions{Overflow::ieee, Subnormals::keep, a.inv_scale});
      ahead.next();
    }
    Chunk c{pbuf, mbuf, vbuf};
    const bool l2 = a.rule == AdamRule::torch ? torch_s.l2 : rule_s.l2;
    if (!in_place && !l2) {
      codec.decode(t.m, b, n, mbuf);
      ahead.next();
      codec.decode(t.v, b, n, vbuf);
      ahead.next();
      update_moments(pbuf, mbuf, vbuf, gp, n, pre);
      ahead.rest();
      return c;
    }
    float* const fp32_weights = t.master == MasterFormat::fp32 && t.master_f32 != nullptr ? t.master_f32 + b
                                : weight_fmt == nullptr && t.master != MasterFormat::remainder
                                    ? static_cast<float*>(t.weight) + b
                                    : nullptr;
    if (fp32_weights != nullptr) {
      if (in_place) c.p = fp32_weights;
      else std::memcpy(pbuf, fp32_weights, n * 4);
    } else if (t.master == MasterFormat::remainder) {
      k->join_master(static_cast<const std::uint16_t*>(t.weight) + b, t.remainder + b, pbuf, n);
    } else {
      weight_fmt->decode(static_cast<const std::byte*>(t.weight) + 2 * b, pbuf, n, ConvertOptions{});
    }
    ahead.next();
    if (in_place) {
      load_moments(b, n, c, ahead);
    } else {
      codec.decode(t.m, b, n, mbuf);
      ahead.next();
      codec.decode(t.v, b, n, vbuf);
      ahead.next();
    }
    if (!in_place) {
      update_moments(c.p, c.m, c.v, gp, n, pre);
      ahead.rest();
      return c;
    }
    switch (a.rule) {
      case AdamRule::torch: k->adam(c.p, c.m, c.v, gp, n, pre, a.clip_coef, torch_s); break;
      case AdamRule::torchao: k->adam_torchao(c.p, c.m, c.v, gp, n, pre, a.clip_coef, rule_s); break;
      case AdamRule::te: k->adam_te(c.p, c.m, c.v, gp, n, pre, a.clip_coef, rule_s); break;
    }
    ahead.next();
    return c;
  }

  // Asks for the stored bytes of chunk [b, b + n) ahead of their use. Most of a chunk's time goes
  // to the divider (the update's square root and divisions, the blocked codecs' x / scale); the
  // next chunk's lines arrive meanwhile, where the hardware prefetchers alone keep too few misses
  // in flight over this many streams. Changes no value.
  void prefetch(std::size_t b, std::size_t n) const noexcept {
    auto lines = [](const void* base, std::size_t offset, std::size_t bytes, bool write) {
      const auto* p = static_cast<const char*>(base) + offset;
      for (std::size_t i = 0; i < bytes; i += 64) {
        if (write) __builtin_prefetch(p + i, 1, 3);
        else __builtin_prefetch(p + i, 0, 3);
        asm volatile("" : : "r"(p + i));  // GCC deletes a loop of prefetches alone (no side effect)
      }
    };
    // fp32 streams updated in place are the update loop's own to prefetch (adam_loop); more
    // prefetches in flight than the core keeps only slow it down (measured: fp32 moments).
    const std::size_t gb = grad_fmt == nullptr ? 4 : 2;
    lines(t.grad, gb * b, gb * n, false);
    if (t.master == MasterFormat::remainder || (t.master == MasterFormat::none && weight_fmt != nullptr)) {
      lines(t.weight, 2 * b, 2 * n, true);
      if (t.master == MasterFormat::remainder) lines(t.remainder, 2 * b, 2 * n, true);
    }
    for (const MomentView* mv : {&t.m, &t.v}) {
      const MomentLayout& l = mv->layout;
      if (l.format == MomentFormat::fp32) continue;
      const std::size_t bits = l.format == MomentFormat::bf16 || l.format == MomentFormat::fp16 ? 16
                               : l.format == MomentFormat::q4                                     ? 4
                                                                                                  : 8;
      lines(mv->codes, bits * b / 8, bits * n / 8, true);
      if (!l.per_tensor && l.block != 0) lines(mv->scales, 4 * (b / l.block), 4 * (n / l.block), true);
    }
  }

  // Points c.m and c.v at the fp32 moments of chunk [b, b + n) (updated in place), or decodes a
  // compact moment into its buffer (c.m, c.v on entry).
  void load_moments(std::size_t b, std::size_t n, Chunk& c, Ahead& ahead) const noexcept {
    if (t.m.layout.format == MomentFormat::fp32) {
      c.m = static_cast<float*>(t.m.codes) + b;
    } else {
      codec.decode(t.m, b, n, c.m);
      ahead.next();
    }
    if (t.v.layout.format == MomentFormat::fp32) {
      c.v = static_cast<float*>(t.v.codes) + b;
    } else {
      codec.decode(t.v, b, n, c.v);
      ahead.next();
    }
  }

  // The new m and v alone (p is read for L2 only).
  void update_moments(const float* p, float* m, float* v, const float* g, std::size_t n, float pre) const noexcept {
    switch (a.rule) {
      case AdamRule::torch: k->adam_moments(p, m, v, g, n, pre, a.clip_coef, torch_s); break;
      case AdamRule::torchao: k->adam_moments_torchao(p, m, v, g, n, pre, a.clip_coef, rule_s); break;
      case AdamRule::te: k->adam_moments_te(p, m, v, g, n, pre, a.clip_coef, rule_s); break;
    }
  }

  // Writes what the update left in buffers: the moments' codes (fp32 moments were updated in
  // place) and the weights (fp32 weights or masters were; their 16-bit copy is written here).
  void store_moment(const MomentView& mv, std::size_t b, std::size_t n, float* x, bool per_tensor, float scale) const noexcept {
    if (mv.layout.format == MomentFormat::fp32) return;
    if (per_tensor) codec.encode_per_tensor(mv, b, n, x, scale);
    else codec.encode_blocks(mv, b, n, x);
  }

  // p = nullptr: the update wrote the weights itself (adam_remainder).
  void store_weights(std::size_t b, std::size_t n, const float* p) const noexcept {
    if (p == nullptr) return;
    if (t.master == MasterFormat::remainder) {
      k->split_master(p, static_cast<std::uint16_t*>(t.weight) + b, t.remainder + b, n);
    } else if (weight_fmt == nullptr) {
      // fp32 weights: updated in place.
    } else if (t.master == MasterFormat::none && a.stochastic && t.weight_dtype == DType::bf16) {
      k->round_bf16_stochastic(p, static_cast<std::uint16_t*>(t.weight) + b, t.first_index + b, n, sr_key);
    } else if (t.master == MasterFormat::none && a.stochastic) {
      alignas(64) std::uint32_t bits[kChunk];
      k->sr_bits(bits, t.first_index + b, n, sr_key);
      weight_fmt->encode_stochastic(p, static_cast<std::byte*>(t.weight) + 2 * b, bits, n, ConvertOptions{});
    } else {
      weight_fmt->encode(p, static_cast<std::byte*>(t.weight) + 2 * b, n, ConvertOptions{});
    }
  }
};

}  // namespace

void validate(const AdamTensor& t, const AdamStepArgs& a) {
  if (!(std::isfinite(a.hyper.lr) && a.hyper.lr >= 0)) bad("lr", "finite and >= 0", num(a.hyper.lr));
  if (!(a.hyper.beta1 >= 0 && a.hyper.beta1 < 1)) bad("beta1", "in [0, 1)", num(a.hyper.beta1));
  if (!(a.hyper.beta2 >= 0 && a.hyper.beta2 < 1)) bad("beta2", "in [0, 1)", num(a.hyper.beta2));
  if (!(std::isfinite(a.hyper.eps) && a.hyper.eps >= 0)) bad("eps", "finite and >= 0", num(a.hyper.eps));
  if (!(std::isfinite(a.hyper.weight_decay) && a.hyper.weight_decay >= 0))
    bad("weight_decay", "finite and >= 0", num(a.hyper.weight_decay));
  if (a.step < 1) bad("step", ">= 1 (applied steps including this one)", std::to_string(a.step));
  if (!(std::isfinite(a.inv_scale) && a.inv_scale > 0)) bad("inv_scale", "finite and > 0", num(a.inv_scale));
  if (!(std::isfinite(a.clip_coef) && a.clip_coef >= 0))
    bad("clip_coef", "finite and >= 0 (skip the step when the gradients overflowed)", num(a.clip_coef));
  if (t.n > 0 && (t.grad == nullptr || t.weight == nullptr)) bad("grad and weight", "buffers", "nullptr");
  if (t.master == MasterFormat::remainder && t.weight_dtype != DType::bf16)
    bad("weight dtype", "bf16 with remainder master weights", std::string(dtype_name(t.weight_dtype)));
  if (t.master == MasterFormat::remainder && t.n > 0 && t.remainder == nullptr) bad("remainder", "a buffer", "nullptr");
  if (t.master == MasterFormat::fp32 && t.weight_dtype != DType::f32 && t.n > 0 && t.master_f32 == nullptr)
    bad("master", "an fp32 buffer for 16-bit weights", "nullptr");
  if (a.stochastic && (t.master != MasterFormat::none || t.weight_dtype == DType::f32))
    bad("stochastic rounding", "master none with f16 or bf16 weights",
        std::string(master_format_name(t.master)) + " master, " + std::string(dtype_name(t.weight_dtype)) + " weights");
  check_moment(t.m, t.n, "m");
  check_moment(t.v, t.n, "v");
}

double AdamStepStats::m_relative_error() const noexcept { return m_sq > 0 ? std::sqrt(m_err_sq / m_sq) : 0.0; }
double AdamStepStats::v_relative_error() const noexcept { return v_sq > 0 ? std::sqrt(v_err_sq / v_sq) : 0.0; }
double AdamStepStats::lost_fraction() const noexcept {
  return meant > 0 ? static_cast<double>(lost) / static_cast<double>(meant) : 0.0;
}

namespace {

// The weights of record of chunk [b, b + n) as bits: the fp32 master (or fp32 weights, or the
// master rebuilt from its remainder), else the only 16-bit copy.
void record_bits(const AdamTensor& t, std::size_t b, std::size_t n, std::uint32_t* out) noexcept {
  if (t.master == MasterFormat::remainder) {
    join_master(static_cast<const std::uint16_t*>(t.weight) + b, t.remainder + b, reinterpret_cast<float*>(out), n);
    return;
  }
  const void* src = t.master == MasterFormat::fp32 && t.master_f32 != nullptr ? static_cast<const void*>(t.master_f32 + b)
                    : t.weight_dtype == DType::f32 ? static_cast<const void*>(static_cast<const float*>(t.weight) + b)
                                                   : nullptr;
  if (src != nullptr) {
    std::memcpy(out, src, n * 4);
  } else {
    const auto* w = static_cast<const std::uint16_t*>(t.weight) + b;
    for (std::size_t i = 0; i < n; ++i) out[i] = w[i];
  }
}

// Decodes the weight-of-record bits to a value: fp32 bits, or 16-bit codes (nonzero test only).
bool record_nonzero(const AdamTensor& t, std::uint32_t bits) noexcept {
  const bool wide = t.master != MasterFormat::none || t.weight_dtype == DType::f32;
  return wide ? (bits & 0x7FFFFFFFu) != 0 : (bits & 0x7FFFu) != 0;
}

void add_error(const Codec& codec, const MomentView& mv, float scale_now, std::size_t b, std::size_t n,
               const float* exact, float* scratch, double& err_sq, double& sq) noexcept {
  MomentView now = mv;
  if (mv.layout.per_tensor) now.scales = &scale_now;  // the new scale (the stored one changes after the pass)
  codec.decode(now, b, n, scratch);
  for (std::size_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(scratch[i]) - static_cast<double>(exact[i]);
    err_sq += e * e;
    sq += static_cast<double>(exact[i]) * static_cast<double>(exact[i]);
  }
}

}  // namespace

void adam_tensor_step(const AdamTensor& t, const AdamStepArgs& a, Isa isa, AdamStepStats* stats, ThreadPool* pool) {
  const KernelTable* table = kernel_table(isa);
  const Step s{t,
               a,
               Codec{table, optim_detail::update_kernels(isa)},
               optim_detail::update_kernels(isa),
               sixteen_bit(table, t.grad_dtype),
               sixteen_bit(table, t.weight_dtype),
               torch_scalars(a),
               a.rule == AdamRule::torch ? optim_detail::RuleScalars{} : rule_scalars(a),
               optim_detail::sr_key(a.seed, static_cast<std::uint64_t>(a.step))};
  // Pieces of kStepPiece elements (whole chunks, whole blocks), stepped by the pool's workers
  // when one is given: every element's arithmetic is its own, and the pieces' absmaxes and stats
  // combine in piece order, so the bits do not depend on the number of threads.
  const std::size_t pieces = (t.n + kStepPiece - 1) / kStepPiece;
  auto for_pieces = [&](auto&& fn) {
    auto range = [&](std::size_t p0, std::size_t p1) {
      for (std::size_t p = p0; p < p1; ++p) fn(p, p * kStepPiece, std::min(t.n, (p + 1) * kStepPiece));
    };
    if (pool != nullptr && pieces > 1) pool->parallel_for(pieces, 1, 2, [&](std::size_t p0, std::size_t p1, unsigned) {
      range(p0, p1);
    });
    else range(0, pieces);
  };
  const bool m_tensor = t.m.layout.per_tensor, v_tensor = t.v.layout.per_tensor;
  float m_scale = 0.0f, v_scale = 0.0f;
  if (m_tensor || v_tensor) {
    // TE's per-tensor scale needs the new state's absmax before any code is written.
    std::vector<std::uint32_t> amax(2 * pieces, 0);
    for_pieces([&](std::size_t p, std::size_t begin, std::size_t end) {
      alignas(64) float g[kChunk], w[kChunk], m[kChunk], v[kChunk];
      for (std::size_t b = begin; b < end; b += kChunk) {
        const std::size_t n = std::min(kChunk, end - b);
        Step::Ahead ahead = s.ahead_of(b, end);
        const Step::Chunk c = s.load_and_update(b, n, g, w, m, v, false, ahead);
        amax[2 * p] = std::max(amax[2 * p], absmax_bits(table, c.m, n));
        amax[2 * p + 1] = std::max(amax[2 * p + 1], absmax_bits(table, c.v, n));
      }
    });
    std::uint32_t m_amax = 0, v_amax = 0;
    for (std::size_t p = 0; p < pieces; ++p) {
      m_amax = std::max(m_amax, amax[2 * p]);
      v_amax = std::max(v_amax, amax[2 * p + 1]);
    }
    m_scale = per_tensor_scale(t.m.layout.format, std::bit_cast<float>(m_amax));
    v_scale = per_tensor_scale(t.v.layout.format, std::bit_cast<float>(v_amax));
  }
  if (stats == nullptr) {
    for_pieces([&](std::size_t, std::size_t begin, std::size_t end) {
      alignas(64) float g[kChunk], w[kChunk], m[kChunk], v[kChunk];
      for (std::size_t b = begin; b < end; b += kChunk) {
        const std::size_t n = std::min(kChunk, end - b);
        Step::Ahead ahead = s.ahead_of(b, end);
        const Step::Chunk c = s.load_and_update(b, n, g, w, m, v, true, ahead);
        s.store_moment(t.m, b, n, c.m, m_tensor, m_scale);
        ahead.next();
        s.store_moment(t.v, b, n, c.v, v_tensor, v_scale);
        ahead.rest();
        s.store_weights(b, n, c.p);
      }
    });
  } else {
    // The same writes, with the record before and after and the exact moments kept aside.
    std::vector<AdamStepStats> part(pieces);
    const bool decays = a.hyper.decoupled && a.hyper.weight_decay != 0;
    for_pieces([&](std::size_t p, std::size_t begin, std::size_t end) {
      alignas(64) float g[kChunk], w[kChunk], m[kChunk], v[kChunk];
      alignas(64) std::uint32_t before[kChunk], after[kChunk];
      alignas(64) float m_exact[kChunk], v_exact[kChunk], scratch[kChunk];
      AdamStepStats& st = part[p];
      for (std::size_t b = begin; b < end; b += kChunk) {
        const std::size_t n = std::min(kChunk, end - b);
        record_bits(t, b, n, before);
        Step::Ahead ahead = s.ahead_of(b, end);
        const Step::Chunk c = s.load_and_update(b, n, g, w, m, v, true, ahead);
        ahead.rest();
        std::memcpy(m_exact, c.m, n * 4);
        std::memcpy(v_exact, c.v, n * 4);
        s.store_moment(t.m, b, n, c.m, m_tensor, m_scale);
        s.store_moment(t.v, b, n, c.v, v_tensor, v_scale);
        s.store_weights(b, n, c.p);
        add_error(s.codec, t.m, m_scale, b, n, m_exact, scratch, st.m_err_sq, st.m_sq);
        add_error(s.codec, t.v, v_scale, b, n, v_exact, scratch, st.v_err_sq, st.v_sq);
        record_bits(t, b, n, after);
        for (std::size_t i = 0; i < n; ++i) {
          const bool meant = m_exact[i] != 0.0f || (decays && record_nonzero(t, before[i]));
          st.meant += meant;
          st.lost += meant && before[i] == after[i];
        }
      }
    });
    for (const AdamStepStats& st : part) {
      stats->m_err_sq += st.m_err_sq;
      stats->m_sq += st.m_sq;
      stats->v_err_sq += st.v_err_sq;
      stats->v_sq += st.v_sq;
      stats->meant += st.meant;
      stats->lost += st.lost;
    }
  }
  if (t.n > 0) {
    if (m_tensor) t.m.scales[0] = m_scale;
    if (v_tensor) t.v.scales[0] = v_scale;
  }
}

}  // namespace mixprec
