// The torch doors' gradient routing (scaler/grad_route.hpp): every route, every refusal with
// its whole message, the dense-block rule, and the rule that makes one check of two reads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mixprec/scaler/grad_route.hpp"

namespace mixprec {
namespace {

using Dims = std::vector<std::int64_t>;

// A strided gradient described as torch describes it; the sizes and strides live in the test.
struct Strided {
  Dims sizes, strides;
  GradDescriptor d;
  Strided(std::string_view dtype, std::string_view device, Dims s, Dims st, bool floating = true)
      : sizes(std::move(s)), strides(std::move(st)) {
    d.dtype = dtype;
    d.floating_point = floating;
    d.layout = TensorLayout::strided;
    d.device = device;
    d.sizes = sizes;
    d.strides = strides;
  }
};

GradDescriptor other_layout(TensorLayout layout, std::string_view dtype = "float32", std::string_view device = "cpu") {
  GradDescriptor d;
  d.dtype = dtype;
  d.floating_point = dtype.starts_with("float") || dtype.starts_with("bfloat");
  d.layout = layout;
  d.device = device;
  return d;
}

TEST(DenseBlock, ContiguousAndEveryPermutationOfItAreOneBlock) {
  EXPECT_TRUE(dense_block(Dims{4, 3}, Dims{3, 1}));
  EXPECT_TRUE(dense_block(Dims{3, 4}, Dims{1, 3}));                    // a transpose
  EXPECT_TRUE(dense_block(Dims{2, 3, 4, 5}, Dims{60, 1, 15, 3}));      // channels_last
  EXPECT_TRUE(dense_block(Dims{5, 3, 4}, Dims{1, 20, 5}));             // permute(2, 0, 1) of (3, 4, 5)
  EXPECT_TRUE(dense_block(Dims{7}, Dims{1}));
  EXPECT_TRUE(dense_block(Dims{}, Dims{}));                            // a 0-dim tensor: one element
  EXPECT_TRUE(dense_block(Dims{4, 1, 3}, Dims{3, 99, 1})) << "a size-1 dimension's stride does not count";
  EXPECT_TRUE(dense_block(Dims{1, 1}, Dims{7, 0}));
  EXPECT_TRUE(dense_block(Dims{0, 3}, Dims{1, 5})) << "no elements";
}

TEST(DenseBlock, GapsOverlapsAndBadSpansAreNot) {
  EXPECT_FALSE(dense_block(Dims{8, 5}, Dims{6, 1})) << "g[:, :5] of an (8, 6) tensor: gaps";
  EXPECT_FALSE(dense_block(Dims{3}, Dims{2})) << "every second element";
  EXPECT_FALSE(dense_block(Dims{3, 5}, Dims{0, 1})) << "expand: one location read three times";
  EXPECT_FALSE(dense_block(Dims{2, 2}, Dims{1, 1})) << "two dimensions over the same elements";
  EXPECT_FALSE(dense_block(Dims{2, 3}, Dims{3})) << "sizes and strides disagree";
}

TEST(GradRoute, CpuFloat32Float16Bfloat16InOneBlockGoToTheCore) {
  const std::pair<const char*, DType> dtypes[] = {{"float32", DType::f32}, {"float16", DType::f16}, {"bfloat16", DType::bf16}};
  for (const auto& [name, dtype] : dtypes) {
    SCOPED_TRACE(name);
    const Strided g(name, "cpu", {2, 3, 4, 5}, {60, 1, 15, 3});
    const GradRouting r = route_gradient(g.d);
    EXPECT_EQ(r.route, GradRoute::core);
    EXPECT_EQ(r.dtype, dtype);
    EXPECT_FALSE(r.coalesce);
    EXPECT_EQ(r.reason, "");
    EXPECT_EQ(route_gradient(g.d, true).route, GradRoute::aten) << "aten_only";
  }
}

TEST(GradRoute, EverythingElseTorchUnscalesGoesToAten) {
  EXPECT_EQ(route_gradient(Strided("float64", "cpu", {7}, {1}).d).route, GradRoute::aten);
  EXPECT_EQ(route_gradient(Strided("float8_e4m3fn", "cpu", {7}, {1}).d).route, GradRoute::aten);
  EXPECT_EQ(route_gradient(Strided("float32", "cuda:0", {7}, {1}).d).route, GradRoute::aten);
  EXPECT_EQ(route_gradient(Strided("float32", "xpu:1", {7}, {1}).d).route, GradRoute::aten);
  EXPECT_EQ(route_gradient(Strided("float32", "cpu", {8, 5}, {6, 1}).d).route, GradRoute::aten) << "a strided view";
  EXPECT_EQ(route_gradient(Strided("float32", "cpu", {3, 5}, {0, 1}).d).route, GradRoute::aten)
      << "an overlapping view: ATen's own error";
}

TEST(GradRoute, SparseCooIsReadThroughItsValuesFloat16CoalescedFirst) {
  for (const char* dtype : {"float32", "float16", "bfloat16", "float64"}) {
    for (const char* device : {"cpu", "cuda:0"}) {
      const GradRouting r = route_gradient(other_layout(TensorLayout::sparse_coo, dtype, device));
      EXPECT_EQ(r.route, GradRoute::sparse_values) << dtype << " on " << device;
      EXPECT_EQ(r.coalesce, std::string(dtype) == "float16") << dtype;
    }
  }
  EXPECT_EQ(route_gradient(other_layout(TensorLayout::sparse_coo), true).route, GradRoute::sparse_values);
}

TEST(GradRoute, MetaOtherLayoutsAndIntegerDtypesAreRefusedWithTheirReason) {
  const GradRouting meta = route_gradient(Strided("float32", "meta", {3}, {1}).d);
  EXPECT_EQ(meta.route, GradRoute::refused);
  EXPECT_FALSE(meta.wrong_type);
  EXPECT_EQ(meta.reason, "is a meta tensor (no values to check); GradScaler checks gradients on the CPU, CUDA or "
                         "another device with memory");
  const std::pair<TensorLayout, const char*> refused_layouts[] = {
      {TensorLayout::sparse_csr, "SparseCsr"}, {TensorLayout::sparse_csc, "SparseCsc"},
      {TensorLayout::sparse_bsr, "SparseBsr"}, {TensorLayout::sparse_bsc, "SparseBsc"},
      {TensorLayout::mkldnn, "Mkldnn"},        {TensorLayout::jagged, "Jagged"},
      {TensorLayout::other, "an unknown layout"}};
  for (const auto& [layout, name] : refused_layouts) {
    const GradRouting r = route_gradient(other_layout(layout));
    EXPECT_EQ(r.route, GradRoute::refused) << name;
    EXPECT_FALSE(r.wrong_type);
    EXPECT_EQ(r.reason, "has layout " + std::string(name) +
                            "; GradScaler takes strided and sparse COO gradients, as torch.amp.GradScaler does");
  }
  for (const char* dtype : {"int64", "complex64", "bool"}) {
    const GradRouting r = route_gradient(Strided(dtype, "cpu", {3}, {1}, false).d);
    EXPECT_EQ(r.route, GradRoute::refused) << dtype;
    EXPECT_TRUE(r.wrong_type);
    EXPECT_EQ(r.reason, "has dtype " + std::string(dtype) + "; gradients must be floating point");
  }
  // In this order: meta before the layout, the layout before the dtype.
  EXPECT_EQ(route_gradient(other_layout(TensorLayout::sparse_csr, "float32", "meta")).reason.substr(0, 16),
            "is a meta tensor");
  EXPECT_EQ(route_gradient(other_layout(TensorLayout::sparse_csr, "int64")).reason.substr(0, 20), "has layout SparseCsr");
}

TEST(GradRoute, LayoutNamesBothSpellings) {
  const std::pair<const char*, TensorLayout> torch_names[] = {
      {"torch.strided", TensorLayout::strided},       {"torch.sparse_coo", TensorLayout::sparse_coo},
      {"torch.sparse_csr", TensorLayout::sparse_csr}, {"torch.sparse_csc", TensorLayout::sparse_csc},
      {"torch.sparse_bsr", TensorLayout::sparse_bsr}, {"torch.sparse_bsc", TensorLayout::sparse_bsc},
      {"torch._mkldnn", TensorLayout::mkldnn},        {"torch.jagged", TensorLayout::jagged}};
  for (const auto& [name, layout] : torch_names) {
    EXPECT_EQ(layout_from_torch_name(name), layout) << name;
    EXPECT_EQ(layout_from_torch_name(std::string_view(name).substr(6)), layout) << name;
  }
  EXPECT_EQ(layout_from_torch_name("torch.sparse_xyz"), TensorLayout::other);
  EXPECT_EQ(layout_from_torch_name(""), TensorLayout::other);
  EXPECT_EQ(layout_name(TensorLayout::strided), "Strided");
  EXPECT_EQ(layout_name(TensorLayout::sparse_coo), "Sparse");
  EXPECT_EQ(route_name(GradRoute::core), "core");
  EXPECT_EQ(route_name(GradRoute::sparse_values), "sparse_values");
  EXPECT_EQ(route_name(GradRoute::aten), "aten");
  EXPECT_EQ(route_name(GradRoute::refused), "refused");
  EXPECT_EQ(default_parameter_name(7), "param[7]");
}

// route_gradients over an optimizer's gradients: the names come from the door.
std::string named(std::int64_t i) { return "p" + std::to_string(i); }

using Refusal = std::pair<std::string, bool>;  // (message, wrong_type)

template <class F>
Refusal refusal(F&& f) {
  try {
    f();
  } catch (const GradientRefused& e) {
    return {e.what(), e.wrong_type()};
  }
  return {"(nothing thrown)", false};
}

TEST(GradRoutes, EveryGradientValidatedTheFirstRefusalNamedWithItsParameter) {
  const Strided a("float32", "cpu", {4, 3}, {3, 1}), b("float64", "cpu", {3}, {1}), m("float32", "meta", {3}, {1});
  const Strided i("int64", "cpu", {3}, {1}, false), c("float32", "cuda:0", {3}, {1});
  const std::vector<std::int64_t> index = {0, 2, 5};
  {
    const std::vector<GradDescriptor> g = {a.d, other_layout(TensorLayout::sparse_coo, "float16"), b.d};
    const std::vector<GradRouting> r = route_gradients(g, index, false, named);
    ASSERT_EQ(r.size(), 3u);
    EXPECT_EQ(r[0].route, GradRoute::core);
    EXPECT_EQ(r[1].route, GradRoute::sparse_values);
    EXPECT_TRUE(r[1].coalesce);
    EXPECT_EQ(r[2].route, GradRoute::aten);
  }
  EXPECT_EQ(refusal([&] { route_gradients(std::vector<GradDescriptor>{a.d, b.d, m.d}, index, false, named); }),
            Refusal("the gradient of p5 is a meta tensor (no values to check); GradScaler checks "
                                         "gradients on the CPU, CUDA or another device with memory",
                                         false));
  EXPECT_EQ(refusal([&] {
              route_gradients(std::vector<GradDescriptor>{a.d, other_layout(TensorLayout::sparse_csr), b.d}, index,
                              false, named);
            }),
            Refusal("the gradient of p2 has layout SparseCsr; GradScaler takes strided and "
                                         "sparse COO gradients, as torch.amp.GradScaler does",
                                         false));
  EXPECT_EQ(refusal([&] { route_gradients(std::vector<GradDescriptor>{i.d, m.d, b.d}, index, false, named); }),
            Refusal("the gradient of p0 has dtype int64; gradients must be floating point", true));
  EXPECT_EQ(refusal([&] { route_gradients(std::vector<GradDescriptor>{a.d, b.d, c.d}, index, false, named); }),
            Refusal("gradients on more than one device: p0 on cpu, p5 on cuda:0; use one "
                                         "GradScaler step per device's optimizer",
                                         false));
  // A refusal before the second device is seen is the one reported (parameter order).
  EXPECT_EQ(refusal([&] { route_gradients(std::vector<GradDescriptor>{c.d, m.d, a.d}, index, false, named); }).first,
            "the gradient of p2 is a meta tensor (no values to check); GradScaler checks gradients on the CPU, CUDA "
            "or another device with memory");
  EXPECT_TRUE(route_gradients({}, {}, false, named).empty());
  EXPECT_THROW(route_gradients(std::vector<GradDescriptor>{a.d}, index, false, named), std::invalid_argument);
  static_assert(std::is_base_of_v<std::invalid_argument, GradientRefused>);
}

// check_in_two_reads with scripted shares: the calls made and the check made of them.
struct Script {
  GradientCheck core, aten;
  std::vector<std::pair<bool, bool>> calls;  // (core, write)
  GradientCheck operator()(bool on_core, bool write) {
    calls.emplace_back(on_core, write);
    return on_core ? core : aten;
  }
};

GradientCheck finite(double sum_squares, float carried = 1.0f) {
  GradientCheck c;
  c.checked = true;
  c.sum_squares = sum_squares;
  c.carried_inv_scale = carried;
  return c;
}

GradientCheck overflow(std::int64_t first) {
  GradientCheck c;
  c.checked = true;
  c.found_inf = true;
  c.first_overflow = first;
  c.sum_squares = std::numeric_limits<double>::infinity();
  return c;
}

using Calls = std::vector<std::pair<bool, bool>>;

GradientCheck run(Script& s, float scale, const std::vector<std::int64_t>& core_index,
                  const std::vector<std::int64_t>& aten_index) {
  return check_in_two_reads(scale, core_index, aten_index, [&](bool c, bool w) { return s(c, w); });
}

TEST(CheckInTwoReads, OneShareIsReadOnceWritingItsFirstOverflowReindexed) {
  Script s{overflow(1), {}, {}};
  GradientCheck c = run(s, 0.25f, {3, 7}, {});
  EXPECT_EQ(s.calls, (Calls{{true, true}}));
  EXPECT_TRUE(c.found_inf);
  EXPECT_EQ(c.first_overflow, 7);
  Script t{{}, finite(4.0, 0.5f), {}};
  c = run(t, 2.0f, {}, {1, 4});
  EXPECT_EQ(t.calls, (Calls{{false, true}}));
  EXPECT_EQ(c.sum_squares, 4.0);
  EXPECT_EQ(c.carried_inv_scale, 0.5f) << "one share's check is returned as it is";
  Script none{{}, {}, {}};
  c = run(none, 1.0f, {}, {});
  EXPECT_EQ(none.calls, (Calls{{true, true}})) << "no gradient: the core's empty check";
  EXPECT_FALSE(c.checked);
}

TEST(CheckInTwoReads, BothSharesAtScaleOneOrMoreAreWrittenAtOnce) {
  for (const float scale : {1.0f, 65536.0f}) {
    Script s{finite(2.0), finite(3.0), {}};
    const GradientCheck c = run(s, scale, {0, 2}, {1});
    EXPECT_EQ(s.calls, (Calls{{true, true}, {false, true}})) << scale;
    EXPECT_TRUE(c.checked);
    EXPECT_FALSE(c.found_inf);
    EXPECT_EQ(c.first_overflow, -1);
    EXPECT_EQ(c.sum_squares, 5.0);
    EXPECT_EQ(c.carried_inv_scale, 1.0f);
  }
}

TEST(CheckInTwoReads, BothSharesBelowScaleOneAreReadFirstAndWrittenOnlyWhenFinite) {
  Script s{finite(2.0), finite(3.0), {}};
  GradientCheck c = run(s, 0.5f, {0, 2}, {1});
  EXPECT_EQ(s.calls, (Calls{{true, false}, {false, false}, {true, true}, {false, true}}));
  EXPECT_EQ(c.sum_squares, 5.0);
  EXPECT_EQ(c.carried_inv_scale, 1.0f);
  Script t{finite(2.0), overflow(0), {}};
  c = run(t, 0.5f, {0, 2}, {1});
  EXPECT_EQ(t.calls, (Calls{{true, false}, {false, false}})) << "an overflow step writes nothing";
  EXPECT_TRUE(c.found_inf);
  EXPECT_EQ(c.first_overflow, 1);
  EXPECT_TRUE(std::isinf(c.sum_squares));
}

TEST(CheckInTwoReads, TheFirstOverflowIsTheSmallerDoorIndexOfTheTwo) {
  Script s{overflow(1), overflow(0), {}};  // core's second tensor (door index 4), aten's first (door index 3)
  EXPECT_EQ(run(s, 8.0f, {0, 4}, {3, 5}).first_overflow, 3);
  Script t{overflow(0), overflow(1), {}};
  EXPECT_EQ(run(t, 8.0f, {0, 4}, {3, 5}).first_overflow, 0);
  Script u{finite(1.0), overflow(1), {}};
  EXPECT_EQ(run(u, 8.0f, {0, 4}, {3, 5}).first_overflow, 5);
  Script bad{overflow(2), {}, {}};
  EXPECT_THROW(run(bad, 8.0f, {0, 4}, {}), std::logic_error) << "a share naming a tensor it does not have";
}

}  // namespace
}  // namespace mixprec
