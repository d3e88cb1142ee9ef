// State formats (optim/state_format.hpp): every codec against a plain scalar transcription of
// the rule that defines it (torchao, Transformer Engine), the fused step against the same step
// composed from those transcriptions, on every back end, and the remainder master against the
// fp32 master over 1,000 steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "mixprec/formats/types.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/state_format.hpp"
#include "../support.hpp"

namespace mixprec {
namespace {

using test::hexf;
using test::SplitMix64;

// ---- the scalar transcriptions --------------------------------------------------------------

std::uint8_t e4m3_code(float x, Overflow o) {
  return static_cast<std::uint8_t>(detail::encode_full<detail::kE4M3Spec>(x, EncodeMode{o, Subnormals::keep}, false, 0).code);
}
float e4m3_value(std::uint8_t c) { return static_cast<float>(f8e4m3::from_bits(c)); }

// torchao's code choice written as a linear scan: the last value <= y (0 when none), then up one
// when y is at least halfway to the next value.
std::uint8_t map_code(std::span<const float> map, float y) {
  std::size_t c = 0;
  for (std::size_t i = 0; i < map.size(); ++i)
    if (y >= map[i]) c = i;
  const std::size_t up = std::min(c + 1, map.size() - 1);
  if (y - map[c] >= (map[up] - map[c]) * 0.5f) c = up;
  return static_cast<std::uint8_t>(c);
}

struct Quantized {
  std::vector<std::uint8_t> codes;  // one per element (4bit unpacked; 16-bit formats: two bytes each)
  std::vector<float> scales;
  std::vector<float> values;        // what dequantizing gives
};

float fabsmax(const float* x, std::size_t n) {
  float a = 0.0f;
  for (std::size_t i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
  return a;
}

// The reference quantization of one moment (finite inputs).
Quantized reference_quantize(const std::vector<float>& x, const MomentLayout& l) {
  const std::size_t n = x.size();
  Quantized q{{}, {}, std::vector<float>(n, 0.0f)};
  switch (l.format) {
    case MomentFormat::fp32: std::copy(x.begin(), x.end(), q.values.begin()); return q;
    case MomentFormat::bf16:
      for (std::size_t i = 0; i < n; ++i) q.values[i] = static_cast<float>(bf16(x[i]));
      return q;
    case MomentFormat::fp16: {  // TE: scale = absmax / 32752, stored (x * (1 / scale)).half()
      const float scale = fabsmax(x.data(), n) / 32752.0f;
      const float rscale = scale > 0 ? 1.0f / scale : 0.0f;
      q.scales = {scale};
      for (std::size_t i = 0; i < n; ++i) q.values[i] = static_cast<float>(f16(x[i] * rscale)) * scale;
      return q;
    }
    default: break;
  }
  if (l.format == MomentFormat::fp8 && l.per_tensor) {  // TE: quantizer scale 1 / scale, satfinite
    const float scale = fabsmax(x.data(), n) / 448.0f;
    const float qs = scale > 0 ? 1.0f / scale : 0.0f, ds = scale > 0 ? 1.0f / qs : 0.0f;
    q.scales = {scale};
    for (std::size_t i = 0; i < n; ++i) {
      q.codes.push_back(e4m3_code(x[i] * qs, Overflow::saturate));
      q.values[i] = e4m3_value(q.codes.back()) * ds;
    }
    return q;
  }
  for (std::size_t b = 0; b < n; b += l.block) {  // torchao: scale = max(absmax, 1e-12) (/ 448 for fp8)
    float scale = std::max(fabsmax(x.data() + b, l.block), 1e-12f);
    if (l.format == MomentFormat::fp8) scale = scale / 448.0f;
    q.scales.push_back(scale);
    for (std::size_t i = b; i < b + l.block; ++i) {
      const float y = x[i] / scale;
      if (l.format == MomentFormat::fp8) {
        q.codes.push_back(e4m3_code(y, Overflow::ieee));
        q.values[i] = e4m3_value(q.codes.back()) * scale;
      } else {
        const auto map = moment_code_map(l.format, l.is_signed);
        q.codes.push_back(map_code(map, y));
        q.values[i] = map[q.codes.back()] * scale;
      }
    }
  }
  return q;
}

// Storage for one moment.
struct Moment {
  MomentLayout layout;
  std::vector<std::byte> codes;
  std::vector<float> scales;
  explicit Moment(MomentLayout l) : layout(l), codes(l.code_bytes()), scales(std::max<std::size_t>(1, l.scale_count()), 0.0f) {}
  MomentView view() { return {layout, codes.data(), scales.data()}; }
  std::vector<float> values() {
    std::vector<float> v(layout.numel);
    dequantize_moment(view(), v.data());
    return v;
  }
};

std::vector<float> random_values(std::size_t n, std::uint64_t seed, bool positive, int spread) {
  SplitMix64 r{seed};
  std::vector<float> x(n);
  for (auto& v : x) {
    const double u = r.uniform() * 2 - 1;
    const int e = static_cast<int>(r.next() % static_cast<std::uint64_t>(spread)) - spread;
    v = static_cast<float>(std::ldexp(positive ? std::fabs(u) : u, e));
  }
  return x;
}

const MomentFormat kAll[] = {MomentFormat::fp32, MomentFormat::bf16, MomentFormat::fp16,
                             MomentFormat::fp8,  MomentFormat::q8,   MomentFormat::q4};

std::string layout_name(const MomentLayout& l) {
  return std::string(moment_format_name(l.format)) + (l.is_signed ? " signed" : " unsigned") + " block " +
         std::to_string(l.block) + (l.per_tensor ? " per tensor" : "");
}

// ---- names, layouts, bytes ------------------------------------------------------------------

TEST(StateFormats, NamesRoundTripAndUnknownNamesAreRefused) {
  for (MomentFormat f : kAll) EXPECT_EQ(parse_moment_format(moment_format_name(f)), f);
  for (MasterFormat f : {MasterFormat::fp32, MasterFormat::remainder, MasterFormat::none})
    EXPECT_EQ(parse_master_format(master_format_name(f)), f);
  for (AdamRule r : {AdamRule::torch, AdamRule::torchao, AdamRule::te}) EXPECT_EQ(parse_adam_rule(adam_rule_name(r)), r);
  EXPECT_FALSE(parse_moment_format("int8"));
  EXPECT_FALSE(parse_master_format("fp16"));
  EXPECT_EQ(moment_format_names(), "fp32, bf16, fp16, fp8, 8bit, 4bit");
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { validate(StateFormats{.block = 100}); }),
            "state formats: block: expected 0 (the format's default) or a power of two in [32, 1024], found 100");
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { validate(StateFormats{.fp8_per_tensor = true}); }),
            "state formats: fp8_per_tensor: expected an fp8 moment, found m fp32 and v fp32");
}

TEST(StateFormats, SmallAndUnevenTensorsKeepFp32MomentsAsTorchaoDoes) {
  const StateFormats f{.m = MomentFormat::q8, .v = MomentFormat::q4};
  EXPECT_EQ(moment_layout(MomentFormat::q8, true, 4096, f).format, MomentFormat::q8);
  EXPECT_EQ(moment_layout(MomentFormat::q8, true, 4095, f).format, MomentFormat::fp32);
  EXPECT_EQ(moment_layout(MomentFormat::q8, true, 4096 + 128, f).format, MomentFormat::fp32);  // not a multiple of 256
  EXPECT_EQ(moment_layout(MomentFormat::q4, false, 4096 + 128, f).format, MomentFormat::q4);   // 128 | numel
  EXPECT_EQ(moment_layout(MomentFormat::q4, false, 4096, f).scale_count(), 32u);
  EXPECT_EQ(moment_layout(MomentFormat::q4, false, 4096, f).code_bytes(), 2048u);
  EXPECT_EQ(moment_layout(MomentFormat::fp16, true, 10, f).scale_count(), 1u);  // TE scales any size
}

TEST(StateFormats, BytesPerParameterOfTheNamedCombinations) {
  // fp32: 12 bytes; remainder + bf16 moments: 6; remainder + fp8 moments (a scale per 256): 4 + 2/64.
  EXPECT_DOUBLE_EQ(state_bytes_per_param({}).total(), 12.0);
  EXPECT_DOUBLE_EQ(state_bytes_per_param({.master = MasterFormat::remainder, .m = MomentFormat::bf16, .v = MomentFormat::bf16}).total(), 6.0);
  EXPECT_DOUBLE_EQ(state_bytes_per_param({.master = MasterFormat::remainder, .m = MomentFormat::fp8, .v = MomentFormat::fp8}).total(),
                   2.0 + 2 * (1.0 + 4.0 / 256));
  EXPECT_DOUBLE_EQ(state_bytes_per_param({.master = MasterFormat::none, .m = MomentFormat::q4, .v = MomentFormat::q4}).total(),
                   2 * (0.5 + 4.0 / 128));
}

// ---- codecs ----------------------------------------------------------------------------------

TEST(StateFormats, CodeMapsAreSortedAndSpanTheUnitInterval) {
  for (MomentFormat f : {MomentFormat::q8, MomentFormat::q4})
    for (bool s : {true, false}) {
      const auto map = moment_code_map(f, s);
      ASSERT_EQ(map.size(), f == MomentFormat::q8 ? 256u : 16u);
      EXPECT_TRUE(std::is_sorted(map.begin(), map.end()));
      EXPECT_EQ(map.back(), 1.0f);
      EXPECT_EQ(std::adjacent_find(map.begin(), map.end()), map.end());
    }
  // torchao's 4-bit unsigned map has no zero; the others hold zero exactly.
  EXPECT_EQ(moment_code_map(MomentFormat::q4, false).front(), 1.0f / 16);
  EXPECT_NE(std::find(moment_code_map(MomentFormat::q8, false).begin(), moment_code_map(MomentFormat::q8, false).end(), 0.0f),
            moment_code_map(MomentFormat::q8, false).end());
}

// Every code value, the midpoints between neighbours and the values just beside them, through
// the block codec (block 32, scale 1: a block holds one value of 1).
TEST(StateFormats, EveryCodeAndEveryMidpointRoundsAsTorchaoRounds) {
  for (MomentFormat f : {MomentFormat::q8, MomentFormat::q4})
    for (bool s : {true, false}) {
      const auto map = moment_code_map(f, s);
      std::vector<float> probes;
      for (std::size_t i = 0; i < map.size(); ++i) {
        probes.push_back(map[i]);
        if (i + 1 < map.size()) {
          const float mid = map[i] + (map[i + 1] - map[i]) * 0.5f;
          probes.insert(probes.end(), {mid, std::nextafter(mid, -2.0f), std::nextafter(mid, 2.0f)});
        }
      }
      probes.insert(probes.end(), {-1.0f, 0.0f, -0.0f, 1.0f});
      std::vector<float> x;
      for (float p : probes) {  // blocks of 32: the probe, then 1 (so the scale is 1), then zeros
        x.push_back(p);
        x.push_back(1.0f);
        x.resize(x.size() + 30, 0.0f);
      }
      while (x.size() < 4096 || x.size() % 32 != 0) x.push_back(0.0f);
      const MomentLayout l = moment_layout(f, s, x.size(), StateFormats{.block = 32});
      ASSERT_EQ(l.format, f);
      Moment m(l);
      quantize_moment(x.data(), m.view());
      const Quantized want = reference_quantize(x, l);
      const std::vector<float> got = m.values();
      for (std::size_t i = 0; i < x.size(); ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want.values[i]))
            << layout_name(l) << " input " << hexf(x[i]) << ": got " << hexf(got[i]) << ", want " << hexf(want.values[i]);
    }
}

TEST(StateFormats, EveryFormatQuantizesAsItsTranscriptionOnRandomTensors) {
  for (MomentFormat f : kAll)
    for (bool s : {true, false})
      for (bool per_tensor : {false, true}) {
        if (per_tensor && f != MomentFormat::fp8) continue;
        const std::size_t n = 8192;
        const std::vector<float> x = random_values(n, 11 + static_cast<int>(f), !s, 30);
        const MomentLayout l = moment_layout(f, s, n, StateFormats{.fp8_per_tensor = per_tensor});
        Moment m(l);
        quantize_moment(x.data(), m.view());
        const Quantized want = reference_quantize(x, l);
        const std::vector<float> got = m.values();
        std::size_t bad = 0;
        for (std::size_t i = 0; i < n; ++i)
          if (std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(want.values[i]) && bad++ < 5)
            ADD_FAILURE() << layout_name(l) << " [" << i << "] " << hexf(x[i]) << ": got " << hexf(got[i])
                          << ", want " << hexf(want.values[i]);
        for (std::size_t k = 0; k < want.scales.size(); ++k)
          ASSERT_EQ(std::bit_cast<std::uint32_t>(m.scales[k]), std::bit_cast<std::uint32_t>(want.scales[k]))
              << layout_name(l) << " scale " << k;
      }
}

TEST(StateFormats, AllZeroStatesStayZero) {
  for (MomentFormat f : kAll) {
    const std::vector<float> x(4096, 0.0f);
    const MomentLayout l = moment_layout(f, true, x.size(), StateFormats{});
    Moment m(l);
    quantize_moment(x.data(), m.view());
    for (float v : m.values()) ASSERT_EQ(v, 0.0f) << moment_format_name(f);
  }
}

// ---- remainder master --------------------------------------------------------------------------

// Every fp32 pattern splits into a bf16 weight within half an ulp (ties away from zero) and a
// remainder that rebuilds it exactly.
TEST(StateFormats, RemainderSplitRebuildsEveryFp32PatternExactly) {
  test::Failures fails;
  constexpr std::uint64_t kStride = MIXPREC_EXHAUSTIVE ? 1 : 251;  // sanitizer builds: every 251st chunk
  constexpr std::size_t kChunk = std::size_t{1} << 16;
  test::sweep_patterns(0, std::uint64_t{1} << 32, kChunk, kStride, [&](std::uint32_t first, std::size_t n, unsigned) {
    thread_local std::vector<float> x(kChunk), back(kChunk);  // reused: fresh pages cost more than the test
    thread_local std::vector<std::uint16_t> w(kChunk);
    thread_local std::vector<std::int16_t> r(kChunk);
    for (std::size_t i = 0; i < n; ++i) x[i] = std::bit_cast<float>(static_cast<std::uint32_t>(first + i));
    split_master(x.data(), w.data(), r.data(), n);
    join_master(w.data(), r.data(), back.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t b = first + static_cast<std::uint32_t>(i);
      const std::uint16_t round_half_up = static_cast<std::uint16_t>((b + 0x8000u) >> 16);
      if (std::bit_cast<std::uint32_t>(back[i]) != b || w[i] != round_half_up)
        fails.add(test::hex(b, 8) + " -> weight " + test::hex(w[i], 4) + " remainder " + test::hex(static_cast<std::uint16_t>(r[i]), 4));
    }
  });
  EXPECT_EQ(fails.count(), 0u) << fails.report();
}

// ---- the fused step ----------------------------------------------------------------------------

// One tensor's storage for every format.
struct Tensor {
  std::size_t n;
  DType wdtype;
  MasterFormat master;
  std::vector<float> master_f32, weight_f32;
  std::vector<std::uint16_t> weight16;
  std::vector<std::int16_t> remainder;
  std::vector<std::uint16_t> grad16;  // bf16 gradients
  Moment m, v;

  Tensor(std::size_t size, DType w, MasterFormat mf, const StateFormats& f)
      : n(size), wdtype(w), master(mf), m(moment_layout(f.m, true, size, f)), v(moment_layout(f.v, false, size, f)) {
    weight16.resize(n);
    grad16.resize(n);
    if (w == DType::f32) weight_f32.resize(n);
    if (mf == MasterFormat::fp32 && w != DType::f32) master_f32.resize(n);
    if (mf == MasterFormat::remainder) remainder.resize(n);
  }
  void set_weights(const std::vector<float>& x) {
    if (master == MasterFormat::remainder) {
      split_master(x.data(), weight16.data(), remainder.data(), n);
    } else if (wdtype == DType::f32) {
      weight_f32 = x;
    } else {
      if (master == MasterFormat::fp32) master_f32 = x;
      for (std::size_t i = 0; i < n; ++i)
        weight16[i] = wdtype == DType::bf16 ? bf16(x[i]).bits() : f16(x[i]).bits();
    }
  }
  std::vector<float> weights_of_record() const {
    std::vector<float> p(n);
    if (master == MasterFormat::remainder) join_master(weight16.data(), remainder.data(), p.data(), n);
    else if (wdtype == DType::f32) p = weight_f32;
    else if (master == MasterFormat::fp32) p = master_f32;
    else
      for (std::size_t i = 0; i < n; ++i)
        p[i] = wdtype == DType::bf16 ? static_cast<float>(bf16::from_bits(weight16[i])) : static_cast<float>(f16::from_bits(weight16[i]));
    return p;
  }
  AdamTensor view() {
    AdamTensor t;
    t.n = n;
    t.grad_dtype = DType::bf16;
    t.grad = grad16.data();
    t.weight_dtype = wdtype;
    t.weight = wdtype == DType::f32 ? static_cast<void*>(weight_f32.data()) : static_cast<void*>(weight16.data());
    t.master = master;
    t.master_f32 = master_f32.empty() ? nullptr : master_f32.data();
    t.remainder = remainder.empty() ? nullptr : remainder.data();
    t.m = m.view();
    t.v = v.view();
    return t;
  }
};

// The three update rules written out (double-checked against docs/optimizers.md).
void reference_update(AdamRule rule, const AdamStepArgs& a, std::vector<float>& p, std::vector<float>& m,
                      std::vector<float>& v, const std::vector<float>& g) {
  const AdamHyper& h = a.hyper;
  const double t = static_cast<double>(a.step);
  for (std::size_t i = 0; i < p.size(); ++i) {
    float gi = (g[i] * a.inv_scale) * a.clip_coef, pi = p[i], mi = m[i], vi = v[i];
    if (rule == AdamRule::torch) {
      const float w = static_cast<float>(1.0 - h.beta1);
      pi = pi * static_cast<float>(1.0 - h.lr * h.weight_decay);
      mi = mi + w * (gi - mi);
      vi = vi * static_cast<float>(h.beta2);
      vi = vi + (static_cast<float>(1.0 - h.beta2) * gi) * gi;
      const float denom = std::sqrt(vi) / static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, t))) + static_cast<float>(h.eps);
      pi = pi + static_cast<float>(-(h.lr / (1.0 - std::pow(h.beta1, t)))) * (mi / denom);
    } else if (rule == AdamRule::torchao) {
      const float lr = static_cast<float>(h.lr);
      pi = pi - (lr * static_cast<float>(h.weight_decay)) * pi;
      const float w1 = static_cast<float>(1.0 - h.beta1), w2 = static_cast<float>(1.0 - h.beta2);
      mi = std::fma(w1, gi - mi, mi);  // torch.lerp on a CPU: one fused multiply-add
      vi = std::fma(w2, gi * gi - vi, vi);
      const float bc1 = 1.0f - std::pow(static_cast<float>(h.beta1), static_cast<float>(t));
      const float bc2 = 1.0f - std::pow(static_cast<float>(h.beta2), static_cast<float>(t));
      const float denom = std::sqrt(vi) / std::sqrt(bc2) + static_cast<float>(h.eps);
      pi = pi - (lr * (mi / bc1)) / denom;
    } else {
      const float b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2);
      mi = b1 * mi + (1.0f - b1) * gi;
      vi = b2 * vi + ((1.0f - b2) * gi) * gi;
      const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
      const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
      const float denom = std::sqrt(vi / bc2) + static_cast<float>(h.eps);
      const float update = (mi / bc1) / denom + static_cast<float>(h.weight_decay) * pi;
      pi = pi - static_cast<float>(h.lr) * update;
    }
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

std::vector<float> bf16_grads(Tensor& t, std::uint64_t seed) {
  const std::vector<float> g = random_values(t.n, seed, false, 12);
  std::vector<float> decoded(t.n);
  for (std::size_t i = 0; i < t.n; ++i) {
    t.grad16[i] = bf16(g[i] * 1024.0f).bits();
    decoded[i] = static_cast<float>(bf16::from_bits(t.grad16[i]));
  }
  return decoded;
}

// The fused step equals: dequantize (reference), update (transcription), quantize (reference),
// on every back end, for every master and moment format and every rule, over a few steps.
TEST(StateFormatsStep, FusedStepEqualsTheComposedTranscriptionOnEveryBackEnd) {
  const std::size_t n = 2 * 4096 + 1024;  // 9216: a multiple of 256 and 128, chunks of 1024
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) {
      std::printf("  [skip] %s: not available on this CPU\n", std::string(isa_name(isa)).c_str());
      continue;
    }
    for (AdamRule rule : {AdamRule::torch, AdamRule::torchao, AdamRule::te})
      for (MasterFormat mf : {MasterFormat::fp32, MasterFormat::remainder, MasterFormat::none})
        for (MomentFormat f : kAll)
          for (bool per_tensor : {false, true}) {
            if (per_tensor && f != MomentFormat::fp8) continue;
            const StateFormats formats{.master = mf, .m = f, .v = f, .fp8_per_tensor = per_tensor, .rule = rule};
            Tensor t(n, DType::bf16, mf, formats);
            std::vector<float> p = random_values(n, 5, false, 6), m(n, 0.0f), v(n, 0.0f);
            t.set_weights(p);
            p = t.weights_of_record();
            const std::string what = std::string(isa_name(isa)) + " " + std::string(adam_rule_name(rule)) + " master " +
                                     std::string(master_format_name(mf)) + " moments " + layout_name(t.m.layout);
            for (int step = 1; step <= 3; ++step) {
              AdamStepArgs a;
              a.hyper = AdamHyper{.lr = 1e-2, .weight_decay = 0.1};
              a.step = step;
              a.inv_scale = 1.0f / 1024;
              a.clip_coef = 0.75f;
              a.rule = rule;
              const std::vector<float> g = bf16_grads(t, 100 + step);
              validate(t.view(), a);
              adam_tensor_step(t.view(), a, isa);
              reference_update(rule, a, p, m, v, g);
              m = reference_quantize(m, t.m.layout).values;
              v = reference_quantize(v, t.v.layout).values;
              if (mf == MasterFormat::none)
                for (float& x : p) x = static_cast<float>(bf16(x));
              const std::vector<float> got_p = t.weights_of_record(), got_m = t.m.values(), got_v = t.v.values();
              for (std::size_t i = 0; i < n; ++i) {
                ASSERT_EQ(std::bit_cast<std::uint32_t>(got_p[i]), std::bit_cast<std::uint32_t>(p[i]))
                    << what << " step " << step << " p[" << i << "]: got " << hexf(got_p[i]) << ", want " << hexf(p[i]);
                ASSERT_EQ(std::bit_cast<std::uint32_t>(got_m[i]), std::bit_cast<std::uint32_t>(m[i]))
                    << what << " step " << step << " m[" << i << "]: got " << hexf(got_m[i]) << ", want " << hexf(m[i]);
                ASSERT_EQ(std::bit_cast<std::uint32_t>(got_v[i]), std::bit_cast<std::uint32_t>(v[i]))
                    << what << " step " << step << " v[" << i << "]: got " << hexf(got_v[i]) << ", want " << hexf(v[i]);
              }
              // The model reads the bf16 weight: nearest-even of the fp32 master, or (remainder)
              // the master's top half rounded half away from zero.
              if (mf == MasterFormat::fp32) {
                for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(t.weight16[i], bf16(p[i]).bits()) << what;
              }
            }
          }
  }
}

// A pool splits a tensor into pieces of 64 Ki elements over its workers: the same weights, codes,
// scales and stats as one thread, for every master, every moment format and every rule (TE's
// per-tensor scales combine the pieces' absmax), on a tensor of three pieces and a short one.
TEST(StateFormatsStep, APoolGivesTheBitsOfOneThread) {
  const std::size_t n = 3 * 65536 + 4096;
  ThreadPool pool(3);
  struct Case {
    MasterFormat master;
    StateFormats formats;
  };
  const Case cases[] = {
      {MasterFormat::remainder, {.master = MasterFormat::remainder, .m = MomentFormat::fp8, .v = MomentFormat::q8}},
      {MasterFormat::fp32, {.m = MomentFormat::q4, .v = MomentFormat::q4}},
      {MasterFormat::remainder, {.master = MasterFormat::remainder, .m = MomentFormat::fp16, .v = MomentFormat::fp16}},
      {MasterFormat::fp32, {.m = MomentFormat::fp8, .v = MomentFormat::fp8, .fp8_per_tensor = true}},
      {MasterFormat::none, {.master = MasterFormat::none, .m = MomentFormat::bf16, .v = MomentFormat::bf16}},
  };
  for (const Case& c : cases)
    for (AdamRule rule : {AdamRule::torch, AdamRule::torchao, AdamRule::te}) {
      Tensor one(n, DType::bf16, c.master, c.formats), many(n, DType::bf16, c.master, c.formats);
      const std::vector<float> init = random_values(n, 31, false, 3);
      one.set_weights(init);
      many.set_weights(init);
      AdamStepArgs a;
      a.hyper = AdamHyper{.lr = 1e-3, .weight_decay = 0.01};
      a.rule = rule;
      a.stochastic = c.master == MasterFormat::none;
      a.inv_scale = 1.0f / 1024;
      const std::string what = std::string(master_format_name(c.master)) + "/" +
                               std::string(moment_format_name(c.formats.m)) + "/" +
                               std::string(moment_format_name(c.formats.v)) + " " + std::string(adam_rule_name(rule));
      for (int step = 1; step <= 3; ++step) {
        (void)bf16_grads(one, 40 + static_cast<std::uint64_t>(step));
        many.grad16 = one.grad16;
        a.step = step;
        AdamStepStats s1, s2;
        adam_tensor_step(one.view(), a, active_isa(), step == 3 ? &s1 : nullptr);
        adam_tensor_step(many.view(), a, active_isa(), step == 3 ? &s2 : nullptr, &pool);
        ASSERT_EQ(one.weight16, many.weight16) << what << " step " << step;
        ASSERT_EQ(one.remainder, many.remainder) << what << " step " << step;
        ASSERT_EQ(one.master_f32, many.master_f32) << what << " step " << step;
        ASSERT_EQ(one.m.codes, many.m.codes) << what << " step " << step;
        ASSERT_EQ(one.m.scales, many.m.scales) << what << " step " << step;
        ASSERT_EQ(one.v.codes, many.v.codes) << what << " step " << step;
        ASSERT_EQ(one.v.scales, many.v.scales) << what << " step " << step;
        EXPECT_EQ(s1.m_err_sq, s2.m_err_sq) << what;
        EXPECT_EQ(s1.v_sq, s2.v_sq) << what;
        EXPECT_EQ(s1.meant, s2.meant) << what;
        EXPECT_EQ(s1.lost, s2.lost) << what;
      }
    }
}

// The remainder format keeps the fp32 master AdamW's weights bit for bit over 1,000 steps.
TEST(StateFormatsStep, RemainderEqualsTheFp32MasterBitForBitOver1000Steps) {
  const std::size_t n = 4096;
  const StateFormats fp32{}, rem{.master = MasterFormat::remainder};
  Tensor a(n, DType::bf16, MasterFormat::fp32, fp32), b(n, DType::bf16, MasterFormat::remainder, rem);
  const std::vector<float> init = random_values(n, 9, false, 4);
  a.set_weights(init);
  b.set_weights(init);
  std::size_t weight_differences = 0;
  for (int step = 1; step <= 1000; ++step) {
    const std::vector<float> g = random_values(n, 1000 + step, false, 16);
    for (std::size_t i = 0; i < n; ++i) a.grad16[i] = b.grad16[i] = bf16(g[i]).bits();
    AdamStepArgs s;
    s.hyper = AdamHyper{.lr = 3e-4, .weight_decay = 0.01};
    s.step = step;
    adam_tensor_step(a.view(), s);
    adam_tensor_step(b.view(), s);
    const std::vector<float> pa = a.weights_of_record(), pb = b.weights_of_record();
    ASSERT_EQ(std::memcmp(pa.data(), pb.data(), n * 4), 0) << "step " << step;
    for (std::size_t i = 0; i < n; ++i) weight_differences += a.weight16[i] != b.weight16[i];
  }
  // The bf16 weights differ only on exact ties (the remainder rounds them away from zero).
  const std::vector<float> pa = a.weights_of_record();
  for (std::size_t i = 0; i < n; ++i)
    if (a.weight16[i] != b.weight16[i]) {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(pa[i]) & 0xFFFFu, 0x8000u) << "element " << i;
    }
  std::printf("  bf16 weights that differ on ties over 1,000 steps: %zu of %zu\n", weight_differences, n * 1000);
}

// Stats: the same writes as without them; the error and lost counts equal what the test
// computes from the transcriptions.
TEST(StateFormatsStep, StatsMeasureTheQuantizationErrorAndTheLostUpdates) {
  const std::size_t n = 8192;
  for (MasterFormat mf : {MasterFormat::fp32, MasterFormat::none})
    for (MomentFormat f : {MomentFormat::fp32, MomentFormat::fp8, MomentFormat::q8, MomentFormat::fp16}) {
      const StateFormats formats{.master = mf, .m = f, .v = f};
      Tensor with(n, DType::bf16, mf, formats), without(n, DType::bf16, mf, formats);
      std::vector<float> p = random_values(n, 21, false, 3), m(n, 0.0f), v(n, 0.0f);
      with.set_weights(p);
      without.set_weights(p);
      p = with.weights_of_record();
      AdamStepArgs a;
      a.hyper = AdamHyper{.lr = 1e-5, .weight_decay = 0.0};  // small steps: a bf16-only weight loses most
      const std::vector<float> g = bf16_grads(with, 3);
      without.grad16 = with.grad16;
      AdamStepStats st;
      adam_tensor_step(with.view(), a, active_isa(), &st);
      adam_tensor_step(without.view(), a);
      ASSERT_EQ(with.weight16, without.weight16);
      ASSERT_EQ(with.m.codes, without.m.codes);
      ASSERT_EQ(with.m.scales, without.m.scales);
      reference_update(AdamRule::torch, a, p, m, v, g);
      const std::vector<float> mq = reference_quantize(m, with.m.layout).values;
      double err = 0, sq = 0;
      std::uint64_t meant = 0, lost = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double e = static_cast<double>(mq[i]) - static_cast<double>(m[i]);
        err += e * e;
        sq += static_cast<double>(m[i]) * static_cast<double>(m[i]);
      }
      const std::vector<float> after = with.weights_of_record();
      Tensor start(n, DType::bf16, mf, formats);
      start.set_weights(random_values(n, 21, false, 3));
      const std::vector<float> initial = start.weights_of_record();
      for (std::size_t i = 0; i < n; ++i) {
        if (m[i] == 0.0f) continue;
        ++meant;
        lost += std::bit_cast<std::uint32_t>(after[i]) == std::bit_cast<std::uint32_t>(initial[i]);
      }
      const std::string what = std::string(master_format_name(mf)) + " / " + std::string(moment_format_name(f));
      EXPECT_NEAR(st.m_err_sq, err, 1e-9 * (err + 1e-30)) << what;
      EXPECT_NEAR(st.m_sq, sq, 1e-9 * sq) << what;
      EXPECT_EQ(st.meant, meant) << what;
      EXPECT_EQ(st.lost, lost) << what;
      if (f == MomentFormat::fp32) {
        EXPECT_EQ(st.m_err_sq, 0.0) << what;
      }
      if (mf == MasterFormat::fp32) {
        EXPECT_EQ(st.lost, 0u) << what;
      } else {
        EXPECT_GT(st.lost_fraction(), 0.5) << what;
      }
    }
}

TEST(StateFormatsStep, StochasticRoundingIsUnbiasedAndRepeatsBySeed) {
  const std::size_t n = 1 << 16;
  const StateFormats f{.master = MasterFormat::none};
  auto run = [&](std::uint64_t seed) {
    Tensor t(n, DType::bf16, MasterFormat::none, f);
    t.set_weights(std::vector<float>(n, 1.0f));
    std::fill(t.grad16.begin(), t.grad16.end(), std::uint16_t{0});
    AdamStepArgs a;
    a.hyper = AdamHyper{.lr = 1e-3, .weight_decay = 1.0};  // p * (1 - 1e-3): between two bf16 values
    a.stochastic = true;
    a.seed = seed;
    adam_tensor_step(t.view(), a);
    return t.weight16;
  };
  const auto w1 = run(7), w2 = run(7), w3 = run(8);
  EXPECT_EQ(w1, w2);
  EXPECT_NE(w1, w3);
  const float exact = static_cast<float>(1.0 - 1e-3);  // AdamW's decay of a weight of 1; m = v = 0
  const auto lo_bits = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(exact) >> 16);  // toward zero
  const float lo = static_cast<float>(bf16::from_bits(lo_bits));
  const float hi16 = static_cast<float>(bf16::from_bits(static_cast<std::uint16_t>(lo_bits + 1)));
  ASSERT_TRUE(lo < exact && exact < hi16);
  const double p_up = (static_cast<double>(exact) - static_cast<double>(lo)) / (static_cast<double>(hi16) - static_cast<double>(lo));
  std::size_t up = 0;
  for (std::uint16_t w : w1) {
    const float x = static_cast<float>(bf16::from_bits(w));
    ASSERT_TRUE(x == lo || x == hi16) << hexf(x);
    up += x == hi16;
  }
  const double sigma = std::sqrt(p_up * (1 - p_up) / n);
  EXPECT_NEAR(static_cast<double>(up) / n, p_up, 4 * sigma);
}

TEST(StateFormatsStep, BadTensorsAreRefusedBeforeAnythingIsWritten) {
  Tensor t(4096, DType::f16, MasterFormat::fp32, StateFormats{});
  AdamTensor v = t.view();
  v.master = MasterFormat::remainder;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { validate(v, AdamStepArgs{}); }),
            "adam_tensor_step: weight dtype: expected bf16 with remainder master weights, found f16");
  AdamStepArgs a;
  a.clip_coef = NAN;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { validate(t.view(), a); }),
            "adam_tensor_step: clip_coef: expected finite and >= 0 (skip the step when the gradients overflowed), found nan");
  a = AdamStepArgs{};
  a.stochastic = true;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { validate(t.view(), a); }),
            "adam_tensor_step: stochastic rounding: expected master none with f16 or bf16 weights, found fp32 master, f16 weights");
}

}  // namespace
}  // namespace mixprec

// ---- the ParamStore and the Optimizer over state formats -----------------------------------------

namespace mixprec {
namespace {

std::vector<ParamSpec> store_specs() { return {{"w", {64, 128}}, {"b", {100}}, {"e", {32, 256}}}; }

void fill(ParamStore& s, std::uint64_t seed) {
  std::vector<float> w(s.flat_size(), 0.0f);
  SplitMix64 r{seed};
  for (std::size_t i = 0; i < s.tensor_count(); ++i)
    for (std::size_t j = 0; j < s.numel(i); ++j) w[s.offset(i) + j] = static_cast<float>(r.uniform() * 2 - 1);
  s.set_weights_of_record(w);
}

void grads(ParamStore& s, std::uint64_t seed) {
  SplitMix64 r{seed};
  for (std::size_t i = 0; i < s.tensor_count(); ++i)
    for (auto& g : s.grads<bf16>(i)) g = bf16(static_cast<float>((r.uniform() * 2 - 1) * 1e-2));
}

std::vector<float> record(const ParamStore& s) {
  std::vector<float> w(s.flat_size());
  s.weights_of_record(w);
  return w;
}

std::vector<std::byte> bytes_of(const ParamStore& s) {
  const auto* p = static_cast<const std::byte*>(s.model_data());
  std::vector<std::byte> out(p, p + s.flat_size() * 2);
  for (unsigned k = 0; k < 2; ++k)
    for (std::size_t i = 0; i < s.tensor_count(); ++i) {
      const MomentView v = const_cast<ParamStore&>(s).moment(k, i);
      const auto* c = static_cast<const std::byte*>(v.codes);
      out.insert(out.end(), c, c + v.layout.code_bytes());
      const auto* sc = reinterpret_cast<const std::byte*>(v.scales);
      if (sc != nullptr) out.insert(out.end(), sc, sc + 4 * v.layout.scale_count());
    }
  if (s.remainder_data() != nullptr) {
    const auto* r = reinterpret_cast<const std::byte*>(s.remainder_data());
    out.insert(out.end(), r, r + s.flat_size() * 2);
  }
  return out;
}

TEST(StateFormatsStore, RemainderStoreKeepsTheFp32MastersBitForBit) {
  ParamStore a(store_specs(), StoreOptions{DType::bf16, DType::bf16, true, 2});
  ParamStore b(store_specs(), StoreOptions{DType::bf16, DType::bf16, true, 2, {.master = MasterFormat::remainder}});
  EXPECT_EQ(b.master_bytes(), b.flat_size() * 2);
  fill(a, 1);
  fill(b, 1);
  AdamW oa(a, AdamConfig{.lr = 1e-3, .weight_decay = 0.1}), ob(b, AdamConfig{.lr = 1e-3, .weight_decay = 0.1});
  for (int step = 0; step < 50; ++step) {
    grads(a, 10 + step);
    grads(b, 10 + step);
    oa.step({.inv_scale = 1.0f});
    ob.step({.inv_scale = 1.0f});
  }
  EXPECT_EQ(record(a), record(b));
  EXPECT_EQ(ob.step_count(), 50);
}

TEST(StateFormatsStore, CompactMomentsStepTheSameOnAnyThreadCountAndASkipWritesNothing) {
  const StoreOptions o{DType::bf16, DType::bf16, true, 2,
                       {.master = MasterFormat::remainder, .m = MomentFormat::fp8, .v = MomentFormat::q8}};
  ParamStore a(store_specs(), o), b(store_specs(), o);
  EXPECT_TRUE(a.compact_moments());
  EXPECT_EQ(a.moment(0, 1).layout.format, MomentFormat::fp32);  // 100 elements: torchao's fallback
  EXPECT_EQ(a.moment(0, 0).layout.format, MomentFormat::fp8);
  // m: 8192 + 8192 codes, 32 + 32 scales, plus the 100-element fallback in fp32 (aligned to 64).
  EXPECT_EQ(a.state_slot_bytes(0), 8192 + 448 + 8192 + 64 * 4);
  fill(a, 2);
  fill(b, 2);
  ThreadPool pool(2);
  AdamW oa(a, AdamConfig{.lr = 1e-3}), ob(b, AdamConfig{.lr = 1e-3});
  for (int step = 0; step < 5; ++step) {
    grads(a, 30 + step);
    grads(b, 30 + step);
    oa.step({.inv_scale = 1.0f});
    ob.step({.inv_scale = 1.0f}, &pool);
  }
  EXPECT_EQ(bytes_of(a), bytes_of(b));
  const std::vector<std::byte> before = bytes_of(a);
  grads(a, 99);
  EXPECT_FALSE(oa.step({.skip = true}));
  EXPECT_EQ(bytes_of(a), before);
  EXPECT_EQ(oa.step_count(), 5);
}

TEST(StateFormatsStore, MisusesAreRefusedWithTheirReason) {
  EXPECT_EQ(test::error_of<std::invalid_argument>([] {
              ParamStore s(store_specs(), StoreOptions{DType::f16, DType::f16, true, 2, {.master = MasterFormat::remainder}});
            }),
            "ParamStore: master remainder: expected master weights and bf16 model weights, found f16 weights");
  ParamStore s(store_specs(), StoreOptions{DType::bf16, DType::bf16, true, 2, {.m = MomentFormat::q4, .v = MomentFormat::q4}});
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { (void)s.state_data(0); }),
            "ParamStore: state slot 0 holds 4bit moments, not an fp32 array (use moment())");
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { SGD sgd(s, SgdConfig{}); }),
            "optimizer sgd: expected fp32 masters and moments (the state formats are Adam's), found master fp32, moments 4bit/4bit");
  AdamW opt(s, AdamConfig{});
  std::vector<float> scratch(opt.unfused_scratch_size());
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { opt.step_unfused({.inv_scale = 1.0f}, scratch); }),
            "optimizer step_unfused: expected fp32 masters and moments, found master fp32 (the state formats step through step())");
}

}  // namespace
}  // namespace mixprec
