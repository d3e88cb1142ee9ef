// Gemm: oneDNN matmul with a per-signature primitive cache and widening scratch
// (docs/gemm.md). gemm_reference lives in gemm_reference.cpp.
#include "mixprec/nn/gemm.hpp"

#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mixprec/core/isa.hpp"
#include "nn/gemm_common.hpp"

namespace mixprec::nn {
namespace {

using dnnl::memory;
using dt = memory::data_type;

// oneDNN 3 (PyPI, scripts/deps.sh) or Debian's 2.6: the matmul API differs in how a primitive
// descriptor is made and how alpha is applied (2.6: an output scale; 3: a runtime scale of
// the weights, which also multiplies the fp32 accumulator once); 2.6 has no f16 matmul but
// its reference one.
dnnl::matmul::primitive_desc matmul_pd(const dnnl::engine& eng, const memory::desc& a, const memory::desc& b,
                                       const memory::desc& c, const dnnl::primitive_attr& attr = {}) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::matmul::primitive_desc(eng, a, b, c, attr);
#else
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, eng);
#endif
}

// Runs oneDNN on exactly n OpenMP threads (n > 0) for the lifetime of the guard and
// restores the calling thread's setting. oneDNN (OpenMP runtime) sizes its parallel
// regions from omp_get_max_threads() both when it creates a primitive and when it
// executes one, so the guard covers both.
class OmpThreads {
 public:
  explicit OmpThreads(unsigned n) : saved_(n > 0 ? omp_get_max_threads() : 0) {
    if (n > 0) omp_set_num_threads(static_cast<int>(n));
  }
  ~OmpThreads() {
    if (saved_ > 0) omp_set_num_threads(saved_);
  }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int saved_;
};

// ---- the call signature a primitive is made for ---------------------------------
struct Key {
  std::size_t m, n, k, lda, ldb, ldc;
  DType da, db;
  Trans ta, tb;
  std::uint32_t alpha_bits, beta_bits;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  std::size_t operator()(const Key& k) const noexcept {
    std::uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&h](std::uint64_t v) {
      h ^= v;
      h *= 0x100000001b3ull;
      h ^= h >> 29;
    };
    mix(k.m);
    mix(k.n);
    mix(k.k);
    mix(k.lda);
    mix(k.ldb);
    mix(k.ldc);
    mix(static_cast<std::uint64_t>(k.da) | static_cast<std::uint64_t>(k.db) << 8 |
        static_cast<std::uint64_t>(k.ta) << 16 | static_cast<std::uint64_t>(k.tb) << 24);
    mix(static_cast<std::uint64_t>(k.alpha_bits) << 32 | k.beta_bits);
    return static_cast<std::size_t>(h);
  }
};

struct Plan {
  dnnl::matmul prim;
  memory a_mem, b_mem, c_mem, scratch_mem;
  float alpha = 1.0f;  // oneDNN 3: the weights' runtime scale (alpha_mem points here)
  memory alpha_mem;
  bool widen_a = false, widen_b = false;  // input goes through the f32 scratch
  std::size_t scratch_bytes = 0;          // oneDNN scratchpad (user mode)
  std::string impl;                       // oneDNN's implementation name
};

// 64-byte aligned raw storage that only ever grows (at plan creation).
struct AlignedBuffer {
  struct Free {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte[], Free> data;
  std::size_t bytes = 0;
  void reserve(std::size_t n) {
    if (n <= bytes) return;
    data.reset(static_cast<std::byte*>(::operator new[](n, std::align_val_t{64})));
    bytes = n;
  }
  float* floats() const noexcept { return reinterpret_cast<float*>(data.get()); }
};

dt to_dnnl(DType t) {
  switch (t) {
    case DType::f32: return dt::f32;
    case DType::f16: return dt::f16;
    case DType::bf16: return dt::bf16;
  }
  return dt::undef;
}

memory::dim dim(std::size_t v) { return static_cast<memory::dim>(v); }

// op(A) as an M x K (or op(B) as K x N) descriptor over the stored row-major matrix.
memory::desc op_desc(std::size_t rows, std::size_t cols, std::size_t ld, Trans t, dt type) {
  if (t == Trans::no) return memory::desc({dim(rows), dim(cols)}, type, {dim(ld), 1});
  return memory::desc({dim(rows), dim(cols)}, type, {1, dim(ld)});
}

// Widens a stored matrix (rows x cols, leading dimension ld) into dense fp32; exact.
void widen(const MatrixView& v, float* dst) {
  const std::size_t ld = v.ld == 0 ? v.cols : v.ld;
  const bool dense = ld == v.cols;
  const std::size_t rows = dense ? 1 : v.rows;
  const std::size_t len = dense ? v.rows * v.cols : v.cols;
  for (std::size_t r = 0; r < rows; ++r) {
    std::span<float> out(dst + r * v.cols, len);
    if (v.dtype == DType::f16) {
      convert(std::span<const f16>(static_cast<const f16*>(v.data) + r * ld, len), out);
    } else {
      convert(std::span<const bf16>(static_cast<const bf16*>(v.data) + r * ld, len), out);
    }
  }
}

const char* isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
#if DNNL_VERSION_MAJOR < 3
    case dnnl::cpu_isa::avx512_mic: return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops: return "avx512_mic_4ops";
#endif
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
#if DNNL_VERSION_MAJOR >= 3
    case dnnl::cpu_isa::avx512_core_fp16: return "avx512_core_fp16";
#endif
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
#if DNNL_VERSION_MAJOR >= 3
    case dnnl::cpu_isa::avx512_core_amx_fp16: return "avx512_core_amx_fp16";
#endif
    default: return "other";
  }
}

// The implementation oneDNN picks for a dense 64x64x64 matmul of `type` into f32; "" where it
// has none, or (f16) only its reference one, which would be slower than widening.
std::string impl_of(const dnnl::engine& eng, dt type) {
  const memory::dim n = 64;
  try {
    const memory::desc a({n, n}, type, {n, 1}), b({n, n}, type, {n, 1}), c({n, n}, dt::f32, {n, 1});
    std::string impl = matmul_pd(eng, a, b, c).impl_info_str();
    if (type == dt::f16 && impl.rfind("ref", 0) == 0) return {};
    return impl;
  } catch (const dnnl::error&) {
    return {};
  }
}

}  // namespace

// ---- backend info ------------------------------------------------------------------
const GemmBackendInfo& gemm_backend_info() {
  static const GemmBackendInfo info = [] {
    GemmBackendInfo i;
    const dnnl_version_t* v = dnnl_version();
    i.onednn_version = std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
    i.cpu_isa = isa_name(dnnl::get_effective_cpu_isa());
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
    i.threading = "OpenMP";
#elif DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_TBB
    i.threading = "TBB";
#elif DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_THREADPOOL
    i.threading = "threadpool";
#else
    i.threading = "sequential";
#endif
    const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    i.f32_impl = impl_of(eng, dt::f32);
    i.bf16_impl = impl_of(eng, dt::bf16);
    i.bf16_native = !i.bf16_impl.empty();
    i.avx512_bf16 = cpu_has_avx512_bf16();
#if DNNL_VERSION_MAJOR >= 3
    i.f16_impl = impl_of(eng, dt::f16);
#endif
    i.f16_native = !i.f16_impl.empty();
    i.avx512_fp16 = cpu_has_avx512_fp16();
    i.amx_fp16 = cpu_has_amx_fp16();
    return i;
  }();
  return info;
}

// ---- Gemm ----------------------------------------------------------------------------
struct Gemm::Impl {
  GemmOptions options;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<Key, Plan, KeyHash> plans;
  AlignedBuffer widen_a, widen_b, scratchpad;
  bool bf16_native = false, f16_native = false;
  std::uint64_t flops = 0;  // Gemm::flops

  explicit Impl(GemmOptions o)
      : options(o),
        bf16_native(o.native_bf16 && gemm_backend_info().bf16_native),
        f16_native(o.native_f16 && gemm_backend_info().f16_native) {}

  bool native(DType a, DType b) const noexcept {
    return a == b && ((bf16_native && a == DType::bf16) || (f16_native && a == DType::f16));
  }

  Plan& plan_for(const Key& key) {
    if (auto it = plans.find(key); it != plans.end()) return it->second;
    const OmpThreads threads(options.threads);
    Plan p;
    const bool try_native = native(key.da, key.db);
    p.widen_a = key.da != DType::f32 && !try_native;
    p.widen_b = key.db != DType::f32 && !try_native;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (key.alpha_bits != std::bit_cast<std::uint32_t>(1.0f)) {
      p.alpha = std::bit_cast<float>(key.alpha_bits);
#if DNNL_VERSION_MAJOR >= 3
      attr.set_scales_mask(DNNL_ARG_WEIGHTS, 0);
#else
      attr.set_output_scales(0, {p.alpha});
#endif
    }
    if (key.beta_bits != 0 && key.beta_bits != std::bit_cast<std::uint32_t>(-0.0f)) {
      dnnl::post_ops po;
      po.append_sum(std::bit_cast<float>(key.beta_bits));
      attr.set_post_ops(po);
    }
    // Widened inputs are dense in scratch (leading dimension = stored columns).
    auto make = [&](bool wa, bool wb) {
      const std::size_t a_cols = key.ta == Trans::no ? key.k : key.m;
      const std::size_t b_cols = key.tb == Trans::no ? key.n : key.k;
      const memory::desc a = op_desc(key.m, key.k, wa ? a_cols : key.lda, key.ta, wa ? dt::f32 : to_dnnl(key.da));
      const memory::desc b = op_desc(key.k, key.n, wb ? b_cols : key.ldb, key.tb, wb ? dt::f32 : to_dnnl(key.db));
      const memory::desc c({dim(key.m), dim(key.n)}, dt::f32, {dim(key.ldc), 1});
      return std::tuple{a, b, c, matmul_pd(engine, a, b, c, attr)};
    };
    auto built = [&]() {
      try {
        auto native_or_f32 = make(p.widen_a, p.widen_b);
        // oneDNN 2.6 runs bf16 layouts its brgemm kernels do not take (e.g. the strided
        // per-head views of attention, leading dimension 3C) on a slower implementation
        // (gemm:jit or ref): measured 14x slower than widening and running the f32 kernel
        // (docs/gemm.md). So a bf16 (f16) signature stays native only where oneDNN picks the
        // implementation it picks for a dense 64x64x64 bf16 (f16) matmul.
        const GemmBackendInfo& info = gemm_backend_info();
        const std::string& dense = key.da == DType::f16 ? info.f16_impl : info.bf16_impl;
        if (!try_native || std::get<3>(native_or_f32).impl_info_str() == dense) {
          return native_or_f32;
        }
      } catch (const dnnl::error&) {
        if (!try_native) throw;
      }
      // No fast bf16 matmul for this layout: widen both inputs instead.
      p.widen_a = p.widen_b = true;
      return make(true, true);
    }();
    auto& [a_md, b_md, c_md, pd] = built;
    p.prim = dnnl::matmul(pd);
    p.impl = pd.impl_info_str();
    p.a_mem = memory(a_md, engine, nullptr);
    p.b_mem = memory(b_md, engine, nullptr);
    p.c_mem = memory(c_md, engine, nullptr);
#if DNNL_VERSION_MAJOR >= 3
    if (p.alpha != 1.0f) p.alpha_mem = memory(memory::desc({1}, dt::f32, {1}), engine, nullptr);
#endif
    p.scratch_bytes = pd.scratchpad_desc().get_size();
    if (p.scratch_bytes > 0) p.scratch_mem = memory(pd.scratchpad_desc(), engine, nullptr);
    // Scratch grows here only, so calls with a known signature never allocate.
    if (p.widen_a) widen_a.reserve(key.m * key.k * sizeof(float));
    if (p.widen_b) widen_b.reserve(key.k * key.n * sizeof(float));
    scratchpad.reserve(p.scratch_bytes);
    Plan& stored = plans.emplace(key, std::move(p)).first->second;
    if (stored.alpha_mem) stored.alpha_mem.set_data_handle(&stored.alpha);  // the stored plan's alpha
    return stored;
  }
};

Gemm::Gemm(GemmOptions options) : impl_(std::make_unique<Impl>(options)) {}
Gemm::~Gemm() = default;
Gemm::Gemm(Gemm&&) noexcept = default;
Gemm& Gemm::operator=(Gemm&&) noexcept = default;

const GemmOptions& Gemm::options() const noexcept { return impl_->options; }
std::size_t Gemm::cached_primitives() const noexcept { return impl_->plans.size(); }
std::uint64_t Gemm::flops() const noexcept { return impl_->flops; }
std::size_t Gemm::scratch_bytes() const noexcept {
  return impl_->widen_a.bytes + impl_->widen_b.bytes + impl_->scratchpad.bytes;
}
GemmPath Gemm::path(DType a, DType b) const noexcept {
  if (!impl_->native(a, b)) return GemmPath::onednn_f32;
  return a == DType::f16 ? GemmPath::onednn_f16 : GemmPath::onednn_bf16;
}

namespace {
Key key_of(const detail::GemmShape& s, const MatrixView& a, const MatrixView& b, const GemmArgs& args) {
  return Key{s.m,     s.n,     s.k,  s.lda, s.ldb, s.ldc, a.dtype, b.dtype, args.trans_a, args.trans_b,
             std::bit_cast<std::uint32_t>(args.alpha), std::bit_cast<std::uint32_t>(args.beta)};
}
}  // namespace

std::string Gemm::implementation(const MatrixView& a, const MatrixView& b, const OutputView& c,
                                 const GemmArgs& args) {
  const detail::GemmShape s = detail::check_gemm(a, b, c, nullptr, args);
  if (s.m == 0 || s.n == 0 || s.k == 0) return {};
  const Plan& p = impl_->plan_for(key_of(s, a, b, args));
  return (p.widen_a || p.widen_b ? "widened f32: " : "") + p.impl;
}

void Gemm::prepare(const MatrixView& a, const MatrixView& b, const OutputView& c, const GemmArgs& args) {
  const detail::GemmShape s = detail::check_gemm(a, b, c, nullptr, args);
  if (s.m == 0 || s.n == 0 || s.k == 0) return;
  impl_->plan_for(key_of(s, a, b, args));
}

void Gemm::run(const MatrixView& a, const MatrixView& b, const OutputView& c, const GemmArgs& args) {
  const detail::GemmShape s = detail::check_gemm(a, b, c, nullptr, args);
  if (s.m == 0 || s.n == 0) return;
  if (s.k == 0) {
    detail::scale_output(c, s, args.beta);
    return;
  }
  Plan& p = impl_->plan_for(key_of(s, a, b, args));
  const OmpThreads threads(impl_->options.threads);
  if (p.widen_a) widen(a, impl_->widen_a.floats());
  if (p.widen_b) widen(b, impl_->widen_b.floats());
  // Handles are set on every call (the scratch may have moved when a later plan grew it).
  p.a_mem.set_data_handle(p.widen_a ? impl_->widen_a.floats() : const_cast<void*>(a.data));
  p.b_mem.set_data_handle(p.widen_b ? impl_->widen_b.floats() : const_cast<void*>(b.data));
  p.c_mem.set_data_handle(c.data);
  // The C API takes a plain array; the C++ execute() builds an unordered_map per call.
  dnnl_exec_arg_t exec_args[5] = {{DNNL_ARG_SRC, p.a_mem.get()},
                                  {DNNL_ARG_WEIGHTS, p.b_mem.get()},
                                  {DNNL_ARG_DST, p.c_mem.get()},
                                  {DNNL_ARG_SCRATCHPAD, nullptr},
                                  {0, nullptr}};
  int nargs = 3;
  if (p.scratch_bytes > 0) {
    p.scratch_mem.set_data_handle(impl_->scratchpad.data.get());
    exec_args[nargs++] = {DNNL_ARG_SCRATCHPAD, p.scratch_mem.get()};
  }
#if DNNL_VERSION_MAJOR >= 3
  if (p.alpha_mem) exec_args[nargs++] = {DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, p.alpha_mem.get()};
#endif
  dnnl::error::wrap_c_api(dnnl_primitive_execute(p.prim.get(), impl_->stream.get(), nargs, exec_args),
                          "mixprec::nn::Gemm: oneDNN matmul failed");
  impl_->stream.wait();
  impl_->flops += 2 * static_cast<std::uint64_t>(s.m) * s.n * s.k;
}

ConversionStats Gemm::run(const MatrixView& a, const MatrixView& b, const OutputView& c, const LowOutputView& low,
                          const GemmArgs& args) {
  detail::check_gemm(a, b, c, &low, args);
  run(a, b, c, args);
  return detail::round_output(c, low);
}

}  // namespace mixprec::nn
