#include "mixprec/optim/state_format.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>

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
constexpr float kTeFp16Range = 65504.0f / 2;  // TE: max_range of an fp16 state
constexpr float kE4M3Max = 448.0f;
constexpr float kTorchaoMinAbsmax = 1e-12f;   // torchao: absmax.clip(1e-12)

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
// <= y (0 when y is below every value or NaN; torchao finds it by a branchless binary search),
// then one up when y - value >= (next value - value) * 0.5. Here the search starts from a table
// indexed by y's top 16 bits (the largest code at or below the lowest value those bits can hold)
// and walks up the few codes inside that range: the same code, without eight dependent loads.
template <std::size_t N>
struct CodeSearch {
  const float* map;
  std::array<std::uint8_t, 65536> start;

  explicit CodeSearch(std::span<const float> values) : map(values.data()) {
    for (std::uint32_t k = 0; k < 65536; ++k) {
      const std::uint32_t lo_bits = (k & 0x8000u) != 0 ? (k << 16) | 0xFFFFu : k << 16;  // the lowest value
      const float lowest = std::bit_cast<float>(lo_bits);
      std::size_t c = 0;
      for (std::size_t i = 0; i < N; ++i)
        if (lowest >= map[i]) c = i;  // false for NaN: 0
      start[k] = static_cast<std::uint8_t>(c);
    }
  }

  std::uint8_t nearest(float y) const noexcept {
    std::size_t c = start[std::bit_cast<std::uint32_t>(y) >> 16];
    while (c + 1 < N && map[c + 1] <= y) ++c;
    const std::size_t room = c + 1 < N ? 1 : 0;
    const float down_value = map[c], up_value = map[c + room];
    c += room & static_cast<std::size_t>(y - down_value >= (up_value - down_value) * 0.5f);  // no branch: ~50% taken
    return static_cast<std::uint8_t>(c);
  }
};

template <std::size_t N>
const CodeSearch<N>& code_search(MomentFormat f, bool is_signed) {
  static const CodeSearch<N> signed_search(moment_code_map(f, true));
  static const CodeSearch<N> unsigned_search(moment_code_map(f, false));
  return is_signed ? signed_search : unsigned_search;
}

// |x| max over n values as magnitude bits compared as integers (the back end's amax kernel): a
// NaN wins, as torch's amax propagates it.
std::uint32_t absmax_bits(const KernelTable* t, const float* x, std::size_t n) noexcept { return t->amax.amax_bits(x, n); }
float absmax(const KernelTable* t, const float* x, std::size_t n) noexcept {
  return std::bit_cast<float>(absmax_bits(t, x, n));
}

// Everything a codec needs from the back end.
struct Codec {
  const KernelTable* table;

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
          table->f8e4m3.decode(static_cast<const std::byte*>(mv.codes) + b, x, n,
                               ConvertOptions{Overflow::ieee, Subnormals::keep, te_fp8_dequant_scale(mv.scales[0])});
        } else {
          table->f8e4m3.decode_block_scaled(static_cast<const std::byte*>(mv.codes) + b, x, n, l.block,
                                            mv.scales + b / l.block, ConvertOptions{});
        }
        return;
      case MomentFormat::q8:
      case MomentFormat::q4: {
        // b and n are multiples of the (even) block: whole blocks, whole bytes.
        const float* map = moment_code_map(l.format, l.is_signed).data();
        const auto* c = static_cast<const std::uint8_t*>(mv.codes);
        const std::size_t block = l.block;
        for (std::size_t k = 0; k < n; k += block) {
          const float scale = mv.scales[(b + k) / block];
          float* xb = x + k;
          if (l.format == MomentFormat::q8) {
            const std::uint8_t* cb = c + b + k;
            for (std::size_t i = 0; i < block; ++i) xb[i] = map[cb[i]] * scale;
          } else {
            const std::uint8_t* cb = c + (b + k) / 2;
            for (std::size_t i = 0; i < block; i += 2) {
              xb[i] = map[cb[i / 2] >> 4] * scale;
              xb[i + 1] = map[cb[i / 2] & 0xF] * scale;
            }
          }
        }
        return;
      }
    }
  }

  // Encode blocked or unscaled elements [b, b + n) (b and n multiples of the block) from x,
  // writing their scales. x is overwritten with the scaled values where a rule divides first.
  void encode_blocks(const MomentView& mv, std::size_t b, std::size_t n, float* x) const noexcept {
    const MomentLayout& l = mv.layout;
    switch (l.format) {
      case MomentFormat::fp32:
        std::memcpy(static_cast<float*>(mv.codes) + b, x, n * 4);
        return;
      case MomentFormat::bf16:
        table->bf16.encode(x, static_cast<std::byte*>(mv.codes) + 2 * b, n, ConvertOptions{});
        return;
      default: break;
    }
    for (std::size_t k = 0; k < n; k += l.block) {
      float* xb = x + k;
      const std::size_t e0 = b + k;
      const float amax = absmax(table, xb, l.block);
      const float clipped = amax < kTorchaoMinAbsmax ? kTorchaoMinAbsmax : amax;  // NaN stays NaN
      const float scale = l.format == MomentFormat::fp8 ? clipped / kE4M3Max : clipped;
      mv.scales[e0 / l.block] = scale;
      for (std::size_t i = 0; i < l.block; ++i) xb[i] = xb[i] / scale;
      if (l.format == MomentFormat::fp8) {
        table->f8e4m3.encode(xb, static_cast<std::byte*>(mv.codes) + e0, l.block, ConvertOptions{});
      } else if (l.format == MomentFormat::q8) {
        const CodeSearch<256>& search = code_search<256>(l.format, l.is_signed);
        auto* c = static_cast<std::uint8_t*>(mv.codes) + e0;
        for (std::size_t i = 0; i < l.block; ++i) c[i] = search.nearest(xb[i]);
      } else {
        const CodeSearch<16>& search = code_search<16>(l.format, l.is_signed);
        auto* c = static_cast<std::uint8_t*>(mv.codes) + e0 / 2;  // blocks are even: pairs stay in a block
        for (std::size_t i = 0; i < l.block; i += 2)
          c[i / 2] = static_cast<std::uint8_t>((search.nearest(xb[i]) << 4) | search.nearest(xb[i + 1]));
      }
    }
  }

  // Encode per-tensor elements [b, b + n) with the tensor's new scale (TE's rules).
  void encode_per_tensor(const MomentView& mv, std::size_t b, std::size_t n, const float* x, float scale) const noexcept {
    if (mv.layout.format == MomentFormat::fp16) {
      const float rscale = scale > 0.0f ? 1.0f / scale : 0.0f;
      table->f16.encode(x, static_cast<std::byte*>(mv.codes) + 2 * b, n,
                        ConvertOptions{Overflow::ieee, Subnormals::keep, rscale});
    } else {
      table->f8e4m3.encode(x, static_cast<std::byte*>(mv.codes) + b, n,
                           ConvertOptions{Overflow::saturate, Subnormals::keep, te_fp8_quant_scale(scale)});
    }
  }

  // TE's FP8 state: the quantizer's scale is 1 / scale, the tensor's scale_inv its reciprocal.
  // A zero scale (an all-zero state) stores zeros: decided here, TE would divide by zero.
  static float te_fp8_quant_scale(float scale) noexcept { return scale > 0.0f ? 1.0f / scale : 0.0f; }
  static float te_fp8_dequant_scale(float scale) noexcept { return scale > 0.0f ? 1.0f / (1.0f / scale) : 0.0f; }
};

float per_tensor_scale(MomentFormat f, float amax) noexcept {
  return amax / (f == MomentFormat::fp16 ? kTeFp16Range : kE4M3Max);
}

}  // namespace

void quantize_moment(const float* x, const MomentView& out) {
  const Codec codec{kernel_table(active_isa())};
  const MomentLayout& l = out.layout;
  alignas(64) float buf[kChunk];
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
    std::memcpy(buf, x + b, n * 4);
    codec.encode_blocks(out, b, n, buf);
  }
}

void dequantize_moment(const MomentView& in, float* x) {
  const Codec codec{kernel_table(active_isa())};
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
    s.bc1 = 1.0f - std::pow(static_cast<float>(h.beta1), static_cast<float>(t));
    s.bc2 = 1.0f - std::pow(static_cast<float>(h.beta2), static_cast<float>(t));
    s.sqrt_bc2 = std::sqrt(s.bc2);
  } else {
    // TE: float hyperparameters; bias corrections 1 - std::pow(float beta, int step) in double.
    s.decay = s.weight_decay;
    s.beta1 = static_cast<float>(h.beta1);
    s.one_minus_beta1 = 1.0f - s.beta1;
    s.beta2 = static_cast<float>(h.beta2);
    s.one_minus_beta2 = 1.0f - s.beta2;
    s.bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(s.beta1), t));
    s.bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(s.beta2), t));
  }
  return s;
}

optim_detail::AdamScalars torch_scalars(const AdamStepArgs& a) {
  const AdamHyper& h = a.hyper;
  const auto t = static_cast<double>(a.step);
  optim_detail::AdamScalars s{};
  s.weight = static_cast<float>(1.0 - h.beta1);
  s.one_minus_weight = 1.0f - s.weight;
  s.lerp_low = std::fabs(s.weight) < 0.5f;
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.decay_mul = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.neg_step_size = static_cast<float>(-(h.lr / (1.0 - std::pow(h.beta1, t))));
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, t)));
  s.l2 = !h.decoupled && h.weight_decay != 0;
  s.decoupled = h.decoupled && h.weight_decay != 0;
  return s;
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
  // format is fp32 (and `in_place`), else in the caller's L1 buffers.
  struct Chunk {
    float* p;
    float* m;
    float* v;
  };

  // Loads chunk [b, b + n), updates it. in_place = false (the absmax pass of per-tensor scales)
  // leaves every stored byte as it was.
  Chunk load_and_update(std::size_t b, std::size_t n, float* g, float* pbuf, float* mbuf, float* vbuf,
                        bool in_place) const noexcept {
    float pre = 1.0f;
    const float* gp = g;
    if (grad_fmt == nullptr) {
      gp = static_cast<const float*>(t.grad) + b;
      pre = a.inv_scale;
    } else {
      grad_fmt->decode(static_cast<const std::byte*>(t.grad) + 2 * b, g, n,
                       ConvertOptions{Overflow::ieee, Subnormals::keep, a.inv_scale});
    }
    Chunk c{pbuf, mbuf, vbuf};
    float* const fp32_weights = t.master == MasterFormat::fp32 && t.master_f32 != nullptr ? t.master_f32 + b
                                : weight_fmt == nullptr && t.master != MasterFormat::remainder
                                    ? static_cast<float*>(t.weight) + b
                                    : nullptr;
    if (fp32_weights != nullptr) {
      if (in_place) c.p = fp32_weights;
      else std::memcpy(pbuf, fp32_weights, n * 4);
    } else if (t.master == MasterFormat::remainder) {
      join_master(static_cast<const std::uint16_t*>(t.weight) + b, t.remainder + b, pbuf, n);
    } else {
      weight_fmt->decode(static_cast<const std::byte*>(t.weight) + 2 * b, pbuf, n, ConvertOptions{});
    }
    if (in_place && t.m.layout.format == MomentFormat::fp32) c.m = static_cast<float*>(t.m.codes) + b;
    else codec.decode(t.m, b, n, mbuf);
    if (in_place && t.v.layout.format == MomentFormat::fp32) c.v = static_cast<float*>(t.v.codes) + b;
    else codec.decode(t.v, b, n, vbuf);
    switch (a.rule) {
      case AdamRule::torch: k->adam(c.p, c.m, c.v, gp, n, pre, a.clip_coef, torch_s); break;
      case AdamRule::torchao: k->adam_torchao(c.p, c.m, c.v, gp, n, pre, a.clip_coef, rule_s); break;
      case AdamRule::te: k->adam_te(c.p, c.m, c.v, gp, n, pre, a.clip_coef, rule_s); break;
    }
    return c;
  }

  // Writes what the update left in buffers: the moments' codes (fp32 moments were updated in
  // place) and the weights (fp32 weights or masters were; their 16-bit copy is written here).
  void store_moment(const MomentView& mv, std::size_t b, std::size_t n, float* x, bool per_tensor, float scale) const noexcept {
    if (mv.layout.format == MomentFormat::fp32) return;
    if (per_tensor) codec.encode_per_tensor(mv, b, n, x, scale);
    else codec.encode_blocks(mv, b, n, x);
  }

  void store_weights(std::size_t b, std::size_t n, const float* p) const noexcept {
    if (t.master == MasterFormat::remainder) {
      split_master(p, static_cast<std::uint16_t*>(t.weight) + b, t.remainder + b, n);
    } else if (weight_fmt == nullptr) {
      // fp32 weights: updated in place.
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

void adam_tensor_step(const AdamTensor& t, const AdamStepArgs& a, Isa isa, AdamStepStats* stats) {
  const KernelTable* table = kernel_table(isa);
  const Step s{t,
               a,
               Codec{table},
               optim_detail::update_kernels(isa),
               sixteen_bit(table, t.grad_dtype),
               sixteen_bit(table, t.weight_dtype),
               torch_scalars(a),
               a.rule == AdamRule::torch ? optim_detail::RuleScalars{} : rule_scalars(a),
               optim_detail::sr_key(a.seed, static_cast<std::uint64_t>(a.step))};
  alignas(64) float g[kChunk], p[kChunk], m[kChunk], v[kChunk];
  const bool m_tensor = t.m.layout.per_tensor, v_tensor = t.v.layout.per_tensor;
  float m_scale = 0.0f, v_scale = 0.0f;
  if (m_tensor || v_tensor) {
    // TE's per-tensor scale needs the new state's absmax before any code is written.
    std::uint32_t m_amax = 0, v_amax = 0;
    for (std::size_t b = 0; b < t.n; b += kChunk) {
      const std::size_t n = std::min(kChunk, t.n - b);
      const Step::Chunk c = s.load_and_update(b, n, g, p, m, v, false);
      m_amax = std::max(m_amax, absmax_bits(table, c.m, n));
      v_amax = std::max(v_amax, absmax_bits(table, c.v, n));
    }
    m_scale = per_tensor_scale(t.m.layout.format, std::bit_cast<float>(m_amax));
    v_scale = per_tensor_scale(t.v.layout.format, std::bit_cast<float>(v_amax));
  }
  if (stats == nullptr) {
    for (std::size_t b = 0; b < t.n; b += kChunk) {
      const std::size_t n = std::min(kChunk, t.n - b);
      const Step::Chunk c = s.load_and_update(b, n, g, p, m, v, true);
      s.store_moment(t.m, b, n, c.m, m_tensor, m_scale);
      s.store_moment(t.v, b, n, c.v, v_tensor, v_scale);
      s.store_weights(b, n, c.p);
    }
  } else {
    // The same writes, with the record before and after and the exact moments kept aside.
    alignas(64) std::uint32_t before[kChunk], after[kChunk];
    alignas(64) float m_exact[kChunk], v_exact[kChunk], scratch[kChunk];
    const bool decays = a.hyper.decoupled && a.hyper.weight_decay != 0;
    for (std::size_t b = 0; b < t.n; b += kChunk) {
      const std::size_t n = std::min(kChunk, t.n - b);
      record_bits(t, b, n, before);
      const Step::Chunk c = s.load_and_update(b, n, g, p, m, v, true);
      std::memcpy(m_exact, c.m, n * 4);
      std::memcpy(v_exact, c.v, n * 4);
      s.store_moment(t.m, b, n, c.m, m_tensor, m_scale);
      s.store_moment(t.v, b, n, c.v, v_tensor, v_scale);
      s.store_weights(b, n, c.p);
      add_error(s.codec, t.m, m_scale, b, n, m_exact, scratch, stats->m_err_sq, stats->m_sq);
      add_error(s.codec, t.v, v_scale, b, n, v_exact, scratch, stats->v_err_sq, stats->v_sq);
      record_bits(t, b, n, after);
      for (std::size_t i = 0; i < n; ++i) {
        const bool meant = m_exact[i] != 0.0f || (decays && record_nonzero(t, before[i]));
        stats->meant += meant;
        stats->lost += meant && before[i] == after[i];
      }
    }
  }
  if (t.n > 0) {
    if (m_tensor) t.m.scales[0] = m_scale;
    if (v_tensor) t.v.scales[0] = v_scale;
  }
}

}  // namespace mixprec
