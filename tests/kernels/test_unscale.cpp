// unscale_and_check: scalar reference vs AVX2 and AVX-512 bit for bit, PyTorch GradScaler
// semantics (check before the multiply, skip at inv_scale == 1), check-only
// mode, thread-count independence, hand-derived cases and argument errors.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/formats/types.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "kernels/unscale_kernels.hpp"  // both AVX-512 bf16 stores (private)

namespace mixprec {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr std::size_t C = kUnscaleChunk;

std::uint16_t code_of(DType d, float v) {
  return d == DType::f16 ? f16(v).bits() : bf16(v).bits();
}
float value_of(DType d, std::uint16_t c) {
  return d == DType::f16 ? static_cast<float>(f16::from_bits(c)) : static_cast<float>(bf16::from_bits(c));
}

// A list of tensors with owned storage (4-byte aligned words).
struct Tensors {
  std::vector<DType> dtypes;
  std::vector<std::vector<std::uint32_t>> words;
  std::vector<std::size_t> sizes;

  void add(DType d, std::size_t n) {
    dtypes.push_back(d);
    sizes.push_back(n);
    words.emplace_back((n * dtype_size(d) + 3) / 4 + 1, 0u);
  }
  void set(std::size_t t, std::size_t i, float v) {
    if (dtypes[t] == DType::f32) {
      std::memcpy(reinterpret_cast<std::byte*>(words[t].data()) + 4 * i, &v, 4);
    } else {
      const std::uint16_t c = code_of(dtypes[t], v);
      std::memcpy(reinterpret_cast<std::byte*>(words[t].data()) + 2 * i, &c, 2);
    }
  }
  float get(std::size_t t, std::size_t i) const {
    if (dtypes[t] == DType::f32) {
      float v;
      std::memcpy(&v, reinterpret_cast<const std::byte*>(words[t].data()) + 4 * i, 4);
      return v;
    }
    std::uint16_t c;
    std::memcpy(&c, reinterpret_cast<const std::byte*>(words[t].data()) + 2 * i, 2);
    return value_of(dtypes[t], c);
  }
  std::vector<GradTensor> grads() {
    std::vector<GradTensor> g;
    for (std::size_t t = 0; t < sizes.size(); ++t) g.push_back({sizes[t] ? words[t].data() : nullptr, sizes[t], dtypes[t]});
    return g;
  }
  void fill_random(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> kind(0, 99);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        const int k = kind(rng);
        float v = normal(rng) * 4096.0f;  // a scaled gradient
        if (k < 5) v = 0.0f;
        else if (k < 8) v = -0.0f;
        else if (k < 12) v = normal(rng) * 1e-7f;    // subnormal after unscaling in f16
        else if (k < 14) v = normal(rng) * 60000.0f; // near f16 max
        set(t, i, v);
      }
    }
  }
};

struct Outcome {
  UnscaleResult r;
  std::vector<float> amax;
  std::vector<std::vector<std::uint32_t>> words;
};

Outcome run(Isa isa, Tensors t, float inv, UnscaleOptions o, ThreadPool* pool = nullptr) {
  Outcome out;
  if (o.amax) out.amax.assign(t.sizes.size(), -1.0f);
  const auto g = t.grads();
  out.r = unscale_and_check(isa, g, inv, o, out.amax, pool);
  out.words = t.words;
  return out;
}

std::uint64_t bits(double d) { return std::bit_cast<std::uint64_t>(d); }

void expect_same(const Outcome& a, const Outcome& b, const std::string& what) {
  EXPECT_EQ(a.r.found_inf, b.r.found_inf) << what;
  EXPECT_EQ(a.r.first_nonfinite, b.r.first_nonfinite) << what;
  EXPECT_EQ(bits(a.r.sum_squares), bits(b.r.sum_squares)) << what << ": " << a.r.sum_squares << " vs " << b.r.sum_squares;
  ASSERT_EQ(a.amax.size(), b.amax.size()) << what;
  for (std::size_t i = 0; i < a.amax.size(); ++i) {
    EXPECT_EQ(std::bit_cast<std::uint32_t>(a.amax[i]), std::bit_cast<std::uint32_t>(b.amax[i])) << what << " amax " << i;
  }
  ASSERT_EQ(a.words.size(), b.words.size());
  for (std::size_t t = 0; t < a.words.size(); ++t) {
    EXPECT_TRUE(a.words[t] == b.words[t]) << what << ": data of tensor " << t << " differs";
  }
}

bool have_avx2() { return isa_available(Isa::avx2); }

std::vector<UnscaleOptions> all_options(std::size_t min_parallel) {
  std::vector<UnscaleOptions> v;
  for (int m = 0; m < 8; ++m) v.push_back({(m & 1) != 0, (m & 2) != 0, (m & 4) != 0, min_parallel});
  return v;
}

std::string describe(const UnscaleOptions& o) {
  return std::string("write=") + (o.write ? "1" : "0") + " sum=" + (o.sum_squares ? "1" : "0") +
         " amax=" + (o.amax ? "1" : "0") + " min_parallel=" + std::to_string(o.min_parallel_elements);
}

Tensors awkward_list() {
  Tensors t;
  const std::size_t sizes[] = {0, 1, 7, 15, 16, 17, 4099, C - 1, C + 17, 3 * C + 5, 33};
  const DType dts[] = {DType::f32, DType::f16, DType::bf16};
  int k = 0;
  for (std::size_t n : sizes) {
    for (int r = 0; r < 2; ++r) t.add(dts[(k++) % 3], n);
  }
  t.fill_random(7);
  return t;
}

// ---- reference vs AVX2 ----------------------------------------------------------

// A SIMD back end against the scalar reference on awkward mixed lists, every option.
void expect_equals_scalar_on_awkward_lists(Isa isa) {
  ThreadPool pool2(2);
  const Tensors t = awkward_list();
  for (float inv : {inv_scale_of(65536.0f), inv_scale_of(3000.0f), 1.0f, 3.0f}) {
    for (std::size_t mp : {kUnscaleParallelElements, std::size_t{0}}) {
      for (const UnscaleOptions& o : all_options(mp)) {
        const std::string what = describe(o) + " inv=" + std::to_string(inv);
        expect_same(run(Isa::scalar, t, inv, o, &pool2), run(isa, t, inv, o, &pool2), what);
      }
    }
  }
}

TEST(Unscale, Avx2EqualsScalarOnAwkwardMixedLists) {
  if (!have_avx2()) GTEST_SKIP() << "no AVX2 back end here";
  expect_equals_scalar_on_awkward_lists(Isa::avx2);
}

TEST(Unscale, Avx512EqualsScalarOnAwkwardMixedLists) {
  if (!isa_available(Isa::avx512)) GTEST_SKIP() << "no AVX-512 (F, BW, DQ, VL) on this CPU: its back end is not tested here";
  expect_equals_scalar_on_awkward_lists(Isa::avx512);
}

// Every f16 and every bf16 code (NaNs, infinities, subnormals, both zeros), and a
// stride through all f32 patterns, unscaled by each SIMD back end: the values written
// are the reference's bit for bit; the first difference is printed in hex.
TEST(Unscale, EverySixteenBitCodeAndF32PatternsEqualTheReference) {
  int ran = 0;
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) {
      std::printf("[  SKIP    ] %s: not available on this CPU\n", std::string(isa_name(isa)).c_str());
      continue;
    }
    for (DType d : {DType::f16, DType::bf16, DType::f32}) {
      Tensors t;
      const std::size_t n = d == DType::f32 ? (std::size_t{1} << 20) + 5 : std::size_t{1} << 16;
      t.add(d, n);
      for (std::size_t i = 0; i < n; ++i) {
        if (d == DType::f32) {
          const auto w = static_cast<std::uint32_t>(i * 4099u + (i >> 7));  // 4099 odd: spreads over 2^32
          std::memcpy(reinterpret_cast<std::byte*>(t.words[0].data()) + 4 * i, &w, 4);
        } else {
          const auto c = static_cast<std::uint16_t>(i);
          std::memcpy(reinterpret_cast<std::byte*>(t.words[0].data()) + 2 * i, &c, 2);
        }
      }
      for (float inv : {0.5f, 3.0f, inv_scale_of(65536.0f), 1.0f / 3.0f}) {
        // amax with and without the write (the 16-bit back ends derive it from the largest input).
        const Outcome check_ref = run(Isa::scalar, t, inv, {false, false, true, 0});
        expect_same(check_ref, run(isa, t, inv, {false, false, true, 0}),
                    std::string(isa_name(isa)) + " " + std::string(dtype_name(d)) + " check-only amax");
        const Outcome ref = run(Isa::scalar, t, inv, {true, true, true, 0});
        const Outcome got = run(isa, t, inv, {true, true, true, 0});
        const std::size_t width = dtype_size(d);
        for (std::size_t i = 0; i < n; ++i) {
          std::uint32_t a = 0, b = 0, x = 0;
          std::memcpy(&a, reinterpret_cast<const std::byte*>(ref.words[0].data()) + width * i, width);
          std::memcpy(&b, reinterpret_cast<const std::byte*>(got.words[0].data()) + width * i, width);
          std::memcpy(&x, reinterpret_cast<const std::byte*>(t.words[0].data()) + width * i, width);
          ASSERT_EQ(a, b) << isa_name(isa) << " " << dtype_name(d) << " inv " << inv << ": input 0x" << std::hex << x
                          << " gives 0x" << b << ", the reference 0x" << a;
        }
        expect_same(ref, got, std::string(isa_name(isa)) + " " + std::string(dtype_name(d)));
        ++ran;
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no SIMD back end on this CPU";
}

// The 16-bit SIMD back ends take amax from the largest input code (fl(max|x| * inv)).
// With NaNs of both kinds (a signalling NaN with a large payload, which the multiply
// quiets, next to a quiet one whose raw code is larger) and with inf alone, with and
// without the write, every back end must report what the reference does.
TEST(Unscale, AmaxWithSignallingAndQuietNaNsEqualsTheReference) {
  int ran = 0;
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) {
      std::printf("[  SKIP    ] %s: not available on this CPU\n", std::string(isa_name(isa)).c_str());
      continue;
    }
    for (DType d : {DType::f16, DType::bf16}) {
      // {signalling NaN with the largest payload, quiet NaN with the smallest}, +-inf alone.
      const std::uint16_t snan = d == DType::f16 ? 0x7dffu : 0x7fbfu;
      const std::uint16_t qnan = d == DType::f16 ? 0xfe00u : 0xffc0u;
      const std::uint16_t inf = d == DType::f16 ? 0xfc00u : 0xff80u;
      const std::vector<std::vector<std::uint16_t>> specials = {{snan, qnan}, {qnan, snan}, {inf}};
      for (const auto& sp : specials) {
        for (std::size_t n : {std::size_t{48}, std::size_t{100}, C + 40}) {
          for (std::size_t at : {std::size_t{0}, std::size_t{17}, n - 20}) {
            Tensors t;
            t.add(d, n);
            t.fill_random(static_cast<std::uint32_t>(n + at));
            for (std::size_t k = 0; k < sp.size(); ++k) {
              std::memcpy(reinterpret_cast<std::byte*>(t.words[0].data()) + 2 * (at + k), &sp[k], 2);
            }
            for (bool write : {false, true}) {
              const UnscaleOptions o{write, false, true, 0};
              const std::string what = std::string(isa_name(isa)) + " " + std::string(dtype_name(d)) +
                                       " n=" + std::to_string(n) + " at=" + std::to_string(at) +
                                       " write=" + (write ? "1" : "0");
              const Outcome ref = run(Isa::scalar, t, 0.5f, o);
              expect_same(ref, run(isa, t, 0.5f, o), what);
              ++ran;
            }
          }
        }
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no SIMD back end on this CPU";
}

// The AVX-512 back end has two bf16 stores: vcvtneps2bf16 where the CPU has AVX512-BF16
// (it flushes subnormal results, so such vectors take the integer trick) and the integer
// trick alone. unscale_and_check reaches only the one this CPU picks; here both run,
// segment by segment, on every bf16 code and on random codes, with factors that make
// subnormal, overflowing and ordinary products, against the scalar reference.
TEST(Unscale, BothAvx512Bf16StoresEqualTheReferenceOnEveryCode) {
  using detail::SegmentOut;
  if (!isa_available(Isa::avx512)) GTEST_SKIP() << "no AVX-512 (F, BW, DQ, VL) on this CPU: its back end is not tested here";
  std::vector<const detail::UnscaleKernels*> variants{detail::avx512_unscale_kernels(false)};
  if (cpu_has_avx512_bf16()) variants.push_back(detail::avx512_unscale_kernels(true));
  else std::printf("[  SKIP    ] the AVX512-BF16 store: this CPU has no AVX512-BF16\n");
  const detail::UnscaleKernels& ref = detail::scalar_unscale_kernels();
  const int bf = static_cast<int>(DType::bf16);
  std::vector<std::uint16_t> input(std::size_t{1} << 16);
  for (std::size_t i = 0; i < input.size(); ++i) input[i] = static_cast<std::uint16_t>(i);
  std::mt19937 rng(3);
  std::vector<std::uint16_t> random(2 * C + 37);
  for (auto& c : random) c = static_cast<std::uint16_t>(rng());
  for (const auto* v : variants) {
    for (const auto* data : {&input, &random}) {
      for (float inv : {0.5f, 1.0f / 3.0f, 0x1p-120f, 0x1p+100f}) {
        for (int m = 0; m < 8; ++m) {
          const int w = m & 1, sq = (m >> 1) & 1, am = (m >> 2) & 1;
          std::vector<std::uint16_t> a = *data, b = *data;
          SegmentOut oa, ob;
          ExactSum sa, sb;
          ref.segment[bf][w][sq][am](a.data(), a.size(), inv, oa, sq ? &sa : nullptr);
          v->segment[bf][w][sq][am](b.data(), b.size(), inv, ob, sq ? &sb : nullptr);
          const std::string what = std::string(v == variants[0] ? "integer" : "vcvtneps2bf16") + " store, inv " +
                                   std::to_string(inv) + ", write/sum/amax " + std::to_string(m);
          for (std::size_t i = 0; i < a.size(); ++i) {
            ASSERT_EQ(a[i], b[i]) << what << ": input 0x" << std::hex << (*data)[i] << " gives 0x" << b[i]
                                  << ", the reference 0x" << a[i];
          }
          EXPECT_EQ(oa.max_in, ob.max_in) << what;
          // Above inf, max_out only means NaN (SegmentOut).
          if (am) {
            EXPECT_EQ(std::min(oa.max_out, 0x7f800001u), std::min(ob.max_out, 0x7f800001u)) << what;
          }
          if (sq) {
            EXPECT_EQ(bits(sa.value()), bits(sb.value())) << what;
          }
        }
      }
    }
  }
}

TEST(Unscale, NonFiniteAnywhereInAnyDtype) {
  const Isa isas[] = {Isa::scalar, Isa::avx2, Isa::avx512};
  for (DType d : {DType::f32, DType::f16, DType::bf16}) {
    for (float bad : {kInf, -kInf, kNaN}) {
      for (int where = 0; where < 3; ++where) {
        Tensors t;
        t.add(DType::f32, 100);
        t.add(DType::bf16, 33);
        t.add(d, 2 * C + 19);
        t.add(DType::f16, 40);
        t.fill_random(11);
        const std::size_t n = t.sizes[2];
        const std::size_t pos = where == 0 ? 0 : where == 1 ? n / 2 + 3 : n - 1;
        t.set(2, pos, bad);
        t.set(3, 5, kInf);  // a later tensor too: first_nonfinite is the earlier one
        const std::string what = std::string(dtype_name(d)) + " pos " + std::to_string(pos) + " " + std::to_string(bad);
        Outcome ref;
        for (Isa isa : isas) {
          if (!isa_available(isa)) continue;
          const Outcome o = run(isa, t, inv_scale_of(1024.0f), {true, true, true, 0});
          EXPECT_TRUE(o.r.found_inf) << what;
          EXPECT_EQ(o.r.first_nonfinite, 2) << what;
          EXPECT_FALSE(std::isfinite(o.r.sum_squares)) << what;
          if (std::isnan(bad)) {
            EXPECT_TRUE(std::isnan(o.r.sum_squares)) << what;
            EXPECT_EQ(std::bit_cast<std::uint32_t>(o.amax[2]), 0x7fc00000u) << what;
          } else {
            EXPECT_EQ(o.r.sum_squares, std::numeric_limits<double>::infinity()) << what;
            EXPECT_EQ(o.amax[2], kInf) << what;
          }
          EXPECT_TRUE(std::isfinite(o.amax[0]) && std::isfinite(o.amax[1])) << what;
          // Multiplied anyway (as PyTorch does); the bad element stays bad.
          Tensors after = t;
          after.words = o.words;
          EXPECT_FALSE(std::isfinite(after.get(2, pos))) << what;
          EXPECT_EQ(after.get(0, 3), t.get(0, 3) * inv_scale_of(1024.0f)) << what;
          if (isa == Isa::scalar) ref = o;
          else expect_same(ref, o, what);
        }
      }
    }
  }
}

TEST(Unscale, FiniteProductOverflowIsNotFoundInf) {
  // inv_scale > 1 (a loss scale below 1): the check reads g, which is finite.
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) continue;
    Tensors t;
    t.add(DType::f32, 20);
    t.add(DType::f16, 20);
    t.set(0, 17, 3e38f);
    t.set(1, 18, 60000.0f);
    const Outcome o = run(isa, t, 4.0f, {true, true, true});
    EXPECT_FALSE(o.r.found_inf);
    EXPECT_EQ(o.r.first_nonfinite, -1);
    EXPECT_EQ(o.r.sum_squares, std::numeric_limits<double>::infinity());
    EXPECT_EQ(o.amax[0], kInf);
    EXPECT_EQ(o.amax[1], 240000.0f);  // of the f32 product; the f16 written is inf
    Tensors after = t;
    after.words = o.words;
    EXPECT_EQ(after.get(0, 17), kInf);
    EXPECT_EQ(after.get(1, 18), kInf);
  }
}

// ---- PyTorch semantics and modes -------------------------------------------------

TEST(Unscale, InvScaleOneWritesNothing) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) continue;
    Tensors t = awkward_list();
    t.words[3][0] = 0x7f800001u;  // a signalling NaN (f32) would be quieted by a multiply
    const Outcome o = run(isa, t, 1.0f, {true, true, true, 0});
    EXPECT_TRUE(o.words == t.words);
    EXPECT_TRUE(o.r.found_inf);
    EXPECT_EQ(o.r.first_nonfinite, 3);
  }
}

TEST(Unscale, CheckOnlyWritesNothingAndReportsTheSame) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) continue;
    ThreadPool pool(2);
    const Tensors t = awkward_list();
    const Outcome check = run(isa, t, inv_scale_of(512.0f), {false, true, true, 0}, &pool);
    const Outcome write = run(isa, t, inv_scale_of(512.0f), {true, true, true, 0}, &pool);
    EXPECT_TRUE(check.words == t.words);
    EXPECT_FALSE(write.words == t.words);
    EXPECT_EQ(bits(check.r.sum_squares), bits(write.r.sum_squares));
    EXPECT_EQ(check.r.found_inf, write.r.found_inf);
    for (std::size_t i = 0; i < check.amax.size(); ++i) EXPECT_EQ(check.amax[i], write.amax[i]) << i;
  }
}

TEST(Unscale, WrittenValuesAreTheLibraryRounding) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) continue;
    const Tensors t = awkward_list();
    const float inv = inv_scale_of(3000.0f);
    const Outcome o = run(isa, t, inv, {});
    Tensors after = t;
    after.words = o.words;
    std::size_t checked = 0;
    for (std::size_t k = 0; k < t.sizes.size(); ++k) {
      for (std::size_t i = 0; i < t.sizes[k]; ++i) {
        const float y = t.get(k, i) * inv;
        const float expect = t.dtypes[k] == DType::f32 ? y : value_of(t.dtypes[k], code_of(t.dtypes[k], y));
        ASSERT_EQ(std::bit_cast<std::uint32_t>(after.get(k, i)), std::bit_cast<std::uint32_t>(expect))
            << isa_name(isa) << " tensor " << k << " element " << i;
        ++checked;
      }
    }
    EXPECT_GT(checked, 4 * C);
    EXPECT_TRUE(std::isnan(o.r.sum_squares));  // not requested
  }
}

TEST(Unscale, ResultsDoNotDependOnThreadCount) {
  Tensors t;
  t.add(DType::f32, 5 * C + 3);
  t.add(DType::f16, 17);
  t.add(DType::bf16, 7 * C + 1);
  t.add(DType::f32, 0);
  t.add(DType::f16, 4 * C);
  t.add(DType::f32, 2 * C - 1);
  t.fill_random(3);
  t.set(4, 3 * C + 2, kInf);
  ThreadPool p1(1), p2(2), p3(3), p5(5);
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) continue;
    for (const UnscaleOptions& o : all_options(0)) {
      const Outcome base = run(isa, t, inv_scale_of(65536.0f), o, &p1);
      for (ThreadPool* p : {&p2, &p3, &p5}) {
        expect_same(base, run(isa, t, inv_scale_of(65536.0f), o, p),
                    std::string(isa_name(isa)) + " " + describe(o) + " threads " + std::to_string(p->size()));
      }
    }
    // Default dispatch and pool agree with the named back end.
    if (isa == active_isa()) {
      Tensors a = t;
      std::vector<float> am(a.sizes.size());
      const auto g = a.grads();
      const UnscaleResult r = unscale_and_check(g, inv_scale_of(65536.0f), {true, true, true}, am);
      const Outcome base = run(isa, t, inv_scale_of(65536.0f), {true, true, true}, &p1);
      EXPECT_EQ(bits(r.sum_squares), bits(base.r.sum_squares));
      EXPECT_TRUE(a.words == base.words);
    }
  }
}

// ---- hand-derived ---------------------------------------------------------------

TEST(Unscale, SmallKnownCases) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) continue;
    Tensors t;
    t.add(DType::f32, 4);
    t.add(DType::f16, 2);
    t.add(DType::bf16, 1);
    for (int i = 0; i < 4; ++i) t.set(0, static_cast<std::size_t>(i), static_cast<float>(i + 1) * 65536.0f);  // 1..4 * 2^16
    t.set(1, 0, -65504.0f);   // f16 max: * 2^-16 = -2047 * 2^-11, exact in f16
    t.set(1, 1, 0x1p-24f);    // smallest f16 subnormal: * 2^-16 underflows to 0 in f16
    t.set(2, 0, 0x1p100f);
    const Outcome o = run(isa, t, inv_scale_of(65536.0f), {true, true, true});
    Tensors after = t;
    after.words = o.words;
    for (int i = 0; i < 4; ++i) EXPECT_EQ(after.get(0, static_cast<std::size_t>(i)), static_cast<float>(i + 1));
    EXPECT_EQ(after.get(1, 0), -65504.0f / 65536.0f);
    EXPECT_EQ(after.get(1, 1), 0.0f);
    EXPECT_EQ(after.get(2, 0), 0x1p84f);
    EXPECT_FALSE(o.r.found_inf);
    EXPECT_EQ(o.r.first_nonfinite, -1);
    EXPECT_EQ(o.amax[0], 4.0f);
    EXPECT_EQ(o.amax[1], 65504.0f / 65536.0f);
    EXPECT_EQ(o.amax[2], 0x1p84f);
    // 1 + 4 + 9 + 16 + (2047 * 2^-11)^2 + (2^-40)^2 + 2^168, rounded once.
    const long double exact = 30.0L + std::pow(2047.0L / 2048.0L, 2) + std::ldexp(1.0L, -80) + std::ldexp(1.0L, 168);
    EXPECT_EQ(o.r.sum_squares, static_cast<double>(exact));
  }
  EXPECT_EQ(inv_scale_of(65536.0f), 0x1p-16f);
  EXPECT_EQ(inv_scale_of(3.0f), static_cast<float>(1.0 / 3.0));
}

TEST(Unscale, SumOfSquaresFollowsTheDocumentedLanes) {
  // Ones, and one big value at index 4 of its tensor: in lane 4 the ones that
  // come after big^2 are lost (below half an ulp); the other 15 lanes keep
  // theirs and the lanes are added exactly. 325 = 20 * 16 + 5 elements: lanes
  // 0..4 hold 21 elements, lanes 5..15 hold 20, so the total is big^2 + 4 * 21
  // + 11 * 20. A second tensor in the list and a second chunk restart the lanes.
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) continue;
    for (DType d : {DType::f32, DType::bf16}) {
      const float big = d == DType::f32 ? 0x1p30f : 0x1p60f;
      const double big2 = static_cast<double>(big) * static_cast<double>(big);
      Tensors t;
      t.add(DType::f16, 3);  // 3 ones before: their own lanes
      t.add(d, 325);
      t.add(d, C + 32);      // second chunk: 32 ones, lanes restarted
      for (std::size_t k = 0; k < 3; ++k) {
        for (std::size_t i = 0; i < t.sizes[k]; ++i) t.set(k, i, 1.0f);
      }
      t.set(1, 4, big);
      t.set(2, 4, big);
      const Outcome o = run(isa, t, 1.0f, {true, true, false});
      // Exact in long double (64-bit mantissa) for f32; for bf16 the ones vanish anyway.
      const long double exact = 3.0L + 2.0L * static_cast<long double>(big2) + (4 * 21 + 11 * 20) +
                                15.0L * (C / 16) + 32;
      EXPECT_EQ(o.r.sum_squares, static_cast<double>(exact)) << isa_name(isa) << " " << dtype_name(d);
    }
  }
}

// Each double lane adds its squares in index order: element i, then i + 16, i + 32, ..
// The SIMD back ends hold lanes in vectors (the AVX-512 bf16 loop even keeps the even
// and the odd lanes apart), so a slip in that order changes only roundings. Here one
// lane at a time holds values (the other elements are 0) in one chunk, so the sum is
// that lane's double sum itself, not rounded again with the others. The products have
// full 24-bit significands (inv = 1/3, 5/7) and magnitudes within a few binades, so the
// sum keeps rounding as it crosses binades, where the order of two terms shows. The
// test first checks that it can fail: for most lanes the reference over the same codes
// with elements i and i + 16 swapped in every block of 32 gives another sum (not for all:
// a swap that crosses no binade boundary rounds the same). Every SIMD back end must give
// the reference's bits for every lane.
TEST(Unscale, SixteenBitLaneSumsKeepTheIndexOrder) {
  int ran = 0;
  const std::size_t n = C - 5;  // one chunk, with a tail
  for (DType d : {DType::f16, DType::bf16}) {
    for (float inv : {1.0f / 3.0f, 5.0f / 7.0f}) {
      int order_shows = 0;
      for (std::size_t lane = 0; lane < 16; ++lane) {
        std::mt19937 rng(static_cast<std::uint32_t>(lane * 2 + (d == DType::f16)));
        std::uniform_int_distribution<int> expo(-3, 3);
        std::uniform_real_distribution<float> mant(1.0f, 2.0f);
        Tensors t, swapped;
        t.add(d, n);
        swapped.add(d, n);
        for (std::size_t i = lane; i < n; i += 16) {
          t.set(0, i, std::ldexp(mant(rng), expo(rng)) * ((rng() & 1) ? -1.0f : 1.0f));
        }
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t j = i % 32 < 16 ? i + 16 : i - 16;  // the partner in its block of 32
          swapped.set(0, i, i < n - n % 32 ? t.get(0, j) : t.get(0, i));
        }
        const std::string what = std::string(dtype_name(d)) + " lane " + std::to_string(lane) + " inv " +
                                 std::to_string(inv);
        const UnscaleOptions check_only{false, true, true, 0};
        const Outcome ref = run(Isa::scalar, t, inv, check_only);
        order_shows += bits(ref.r.sum_squares) != bits(run(Isa::scalar, swapped, inv, check_only).r.sum_squares);
        for (Isa isa : {Isa::avx2, Isa::avx512}) {
          if (!isa_available(isa)) continue;
          for (bool write : {false, true}) {
            const UnscaleOptions o{write, true, true, 0};
            expect_same(write ? run(Isa::scalar, t, inv, o) : ref, run(isa, t, inv, o),
                        std::string(isa_name(isa)) + " " + what + (write ? " write" : " check"));
            ++ran;
          }
        }
      }
      EXPECT_GE(order_shows, 8) << dtype_name(d) << " inv " << inv
                                << ": in too few lanes do these codes tell the order of the squares apart";
    }
  }
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (!isa_available(isa)) std::printf("[  SKIP    ] %s: not available on this CPU\n", std::string(isa_name(isa)).c_str());
  }
  if (ran == 0) GTEST_SKIP() << "no SIMD back end on this CPU";
}

TEST(Unscale, EmptyListAndEmptyTensors) {
  const UnscaleResult r = unscale_and_check(std::span<const GradTensor>{}, 0.5f, {true, true, false});
  EXPECT_FALSE(r.found_inf);
  EXPECT_EQ(r.first_nonfinite, -1);
  EXPECT_EQ(r.sum_squares, 0.0);
  std::vector<GradTensor> g = {{nullptr, 0, DType::f16}, {nullptr, 0, DType::f32}};
  std::vector<float> am(2, 7.0f);
  const UnscaleResult s = unscale_and_check(g, 0.5f, {true, true, true}, am);
  EXPECT_EQ(s.sum_squares, 0.0);
  EXPECT_EQ(am[0], 0.0f);
  EXPECT_EQ(am[1], 0.0f);
}

// ---- argument validation --------------------------------------------------------

template <class F>
void expect_invalid(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one mentioning '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Unscale, RejectsBadArguments) {
  std::vector<float> x(8, 1.0f);
  std::vector<GradTensor> g = {{x.data(), 8, DType::f32}};
  for (float inv : {0.0f, -1.0f, kInf, kNaN}) {
    expect_invalid([&] { unscale_and_check(g, inv); }, "inv_scale must be finite and > 0");
  }
  expect_invalid([&] { unscale_and_check(g, 0.5f, {true, false, true}); }, "one float per tensor (1), got 0");
  std::vector<float> am(3);
  expect_invalid([&] { unscale_and_check(g, 0.5f, {true, false, true}, am); }, "one float per tensor (1), got 3");
  expect_invalid([&] { unscale_and_check(g, 0.5f, {}, am); }, "options.amax is false");
  std::vector<GradTensor> null_data = {{x.data(), 8, DType::f32}, {nullptr, 4, DType::f16}};
  expect_invalid([&] { unscale_and_check(null_data, 0.5f); }, "grads[1].data is null with size 4");
  std::vector<GradTensor> misaligned = {{reinterpret_cast<std::byte*>(x.data()) + 2, 3, DType::f32}};
  expect_invalid([&] { unscale_and_check(misaligned, 0.5f); }, "grads[0].data must be aligned to 4 bytes for f32");
  std::vector<GradTensor> odd = {{reinterpret_cast<std::byte*>(x.data()) + 1, 3, DType::bf16}};
  expect_invalid([&] { unscale_and_check(odd, 0.5f); }, "aligned to 2 bytes for bf16");
  std::vector<GradTensor> bad_dtype = {{x.data(), 8, static_cast<DType>(7)}};
  expect_invalid([&] { unscale_and_check(bad_dtype, 0.5f); }, "dtype must be f32, f16 or bf16, got code 7");
  // Nothing was touched by the rejected calls.
  for (float v : x) EXPECT_EQ(v, 1.0f);
  if (!isa_available(Isa::avx2)) {
    expect_invalid([&] { unscale_and_check(Isa::avx2, g, 0.5f); }, "'avx2' is not available");
  }
  if (!isa_available(Isa::avx512)) {
    expect_invalid([&] { unscale_and_check(Isa::avx512, g, 0.5f); }, "'avx512' is not available");
  }
}

}  // namespace
}  // namespace mixprec
