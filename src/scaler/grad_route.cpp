// How a torch front door reads each gradient (scaler/grad_route.hpp).
#include "mixprec/scaler/grad_route.hpp"

#include <algorithm>
#include <array>
#include <optional>
#include <utility>

#include "mixprec/kernels/unscale.hpp"

namespace mixprec {
namespace {

struct LayoutRow {
  TensorLayout layout;
  std::string_view c10_name;    // c10's operator<<
  std::string_view torch_name;  // torch's Python name without "torch."
};
constexpr std::array<LayoutRow, 8> kLayouts{{
    {TensorLayout::strided, "Strided", "strided"},
    {TensorLayout::sparse_coo, "Sparse", "sparse_coo"},
    {TensorLayout::sparse_csr, "SparseCsr", "sparse_csr"},
    {TensorLayout::sparse_csc, "SparseCsc", "sparse_csc"},
    {TensorLayout::sparse_bsr, "SparseBsr", "sparse_bsr"},
    {TensorLayout::sparse_bsc, "SparseBsc", "sparse_bsc"},
    {TensorLayout::mkldnn, "Mkldnn", "_mkldnn"},
    {TensorLayout::jagged, "Jagged", "jagged"},
}};

// The dtypes check_gradients reads, by torch's names.
std::optional<DType> core_dtype(std::string_view torch_dtype) noexcept {
  if (torch_dtype == "float32") return DType::f32;
  if (torch_dtype == "float16") return DType::f16;
  if (torch_dtype == "bfloat16") return DType::bf16;
  return std::nullopt;
}

bool on_cpu(std::string_view device) noexcept { return device == "cpu" || device.starts_with("cpu:"); }

GradRouting refused(std::string reason, bool wrong_type = false) {
  GradRouting r;
  r.route = GradRoute::refused;
  r.wrong_type = wrong_type;
  r.reason = std::move(reason);
  return r;
}

}  // namespace

std::string_view layout_name(TensorLayout layout) noexcept {
  for (const LayoutRow& row : kLayouts)
    if (row.layout == layout) return row.c10_name;
  return "an unknown layout";
}

TensorLayout layout_from_torch_name(std::string_view name) noexcept {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (const LayoutRow& row : kLayouts)
    if (row.torch_name == name) return row.layout;
  return TensorLayout::other;
}

std::string_view route_name(GradRoute route) noexcept {
  switch (route) {
    case GradRoute::core: return "core";
    case GradRoute::sparse_values: return "sparse_values";
    case GradRoute::aten: return "aten";
    case GradRoute::refused: break;
  }
  return "refused";
}

bool dense_block(std::span<const std::int64_t> sizes, std::span<const std::int64_t> strides) noexcept {
  if (sizes.size() != strides.size()) return false;
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of the dimensions that count
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return true;
    if (sizes[d] != 1) dims.emplace_back(strides[d], sizes[d]);
  }
  // Innermost first: each dimension must step over exactly the block the ones inside it make.
  std::stable_sort(dims.begin(), dims.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

GradRouting route_gradient(const GradDescriptor& grad, bool aten_only) {
  if (grad.device == "meta")
    return refused("is a meta tensor (no values to check); GradScaler checks gradients on the CPU, CUDA or "
                   "another device with memory");
  if (grad.layout != TensorLayout::strided && grad.layout != TensorLayout::sparse_coo)
    return refused("has layout " + std::string(layout_name(grad.layout)) +
                   "; GradScaler takes strided and sparse COO gradients, as torch.amp.GradScaler does");
  if (!grad.floating_point)
    return refused("has dtype " + std::string(grad.dtype) + "; gradients must be floating point", true);
  GradRouting r;
  if (grad.layout == TensorLayout::sparse_coo) {
    r.route = GradRoute::sparse_values;
    r.coalesce = grad.dtype == "float16";  // torch's unscale_ sums float16 duplicates first
    return r;
  }
  const std::optional<DType> dtype = core_dtype(grad.dtype);
  if (!aten_only && dtype && on_cpu(grad.device) && dense_block(grad.sizes, grad.strides)) {
    r.route = GradRoute::core;
    r.dtype = *dtype;
  } else {
    r.route = GradRoute::aten;
  }
  return r;
}

std::vector<GradRouting> route_gradients(std::span<const GradDescriptor> grads, std::span<const std::int64_t> index,
                                         bool aten_only, const std::function<std::string(std::int64_t)>& name_of) {
  if (index.size() != grads.size())
    throw std::invalid_argument("route_gradients: expected one index per gradient, found " +
                                std::to_string(index.size()) + " for " + std::to_string(grads.size()));
  std::vector<GradRouting> routes;
  routes.reserve(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) {
    GradRouting r = route_gradient(grads[k], aten_only);
    if (r.route == GradRoute::refused)
      throw GradientRefused("the gradient of " + name_of(index[k]) + " " + r.reason, r.wrong_type);
    if (grads[k].device != grads.front().device) {
      throw GradientRefused("gradients on more than one device: " + name_of(index.front()) + " on " +
                                std::string(grads.front().device) + ", " + name_of(index[k]) + " on " +
                                std::string(grads[k].device) + "; use one GradScaler step per device's optimizer",
                            false);
    }
    routes.push_back(std::move(r));
  }
  return routes;
}

std::string default_parameter_name(std::int64_t index) { return "param[" + std::to_string(index) + "]"; }

namespace {

// A share's check with its first overflow as the door's index.
GradientCheck reindexed(GradientCheck c, std::span<const std::int64_t> index) {
  if (c.first_overflow >= 0) {
    const auto k = static_cast<std::size_t>(c.first_overflow);
    if (k >= index.size())
      throw std::logic_error("check_in_two_reads: a share named tensor " + std::to_string(k) + " of " +
                             std::to_string(index.size()));
    c.first_overflow = index[k];
  }
  return c;
}

}  // namespace

GradientCheck check_in_two_reads(float scale, std::span<const std::int64_t> core_index,
                                 std::span<const std::int64_t> aten_index,
                                 const std::function<GradientCheck(bool core, bool write)>& read) {
  if (aten_index.empty()) return reindexed(read(true, true), core_index);
  if (core_index.empty()) return reindexed(read(false, true), aten_index);
  const bool read_first = inv_scale_of(scale) > 1.0f;
  const GradientCheck a = reindexed(read(true, !read_first), core_index);
  const GradientCheck b = reindexed(read(false, !read_first), aten_index);
  GradientCheck m;
  m.checked = a.checked || b.checked;
  m.found_inf = a.found_inf || b.found_inf;
  if (a.first_overflow < 0) m.first_overflow = b.first_overflow;
  else if (b.first_overflow < 0) m.first_overflow = a.first_overflow;
  else m.first_overflow = std::min(a.first_overflow, b.first_overflow);
  m.sum_squares = (a.checked ? a.sum_squares : 0.0) + (b.checked ? b.sum_squares : 0.0);
  m.carried_inv_scale = 1.0f;
  if (read_first && !m.found_inf) {
    (void)read(true, true);
    (void)read(false, true);
  }
  return m;
}

}  // namespace mixprec
