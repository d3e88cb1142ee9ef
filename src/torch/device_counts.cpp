#include "device_counts.hpp"

#include <ATen/ATen.h>

#include <bit>
#include <limits>
#include <map>

#include "dtype.hpp"
#include "mixprec/formats/count.hpp"
#include "mixprec/nn/model.hpp"

namespace mixprec::torch::detail {
namespace {

constexpr std::uint32_t kF32InfBits = 0x7f800000u;

// The integer view of a counted tensor with its sign bit cleared.
at::Tensor magnitudes(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return at::bitwise_and(t.view(at::kInt), 0x7fffffff);
  return at::bitwise_and(t.view(at::kShort), 0x7fff);
}

}  // namespace

at::Tensor counted(const at::Tensor& t) {
  at::Tensor d = t.detach();
  return mixprec_dtype(d.scalar_type()) ? d : d.to(at::kFloat);
}

DType counted_dtype(const at::Tensor& c) { return *mixprec_dtype(c.scalar_type()); }

at::Tensor profile(const at::Tensor& c) {
  const auto opts = at::TensorOptions().dtype(at::kLong).device(c.device());
  if (c.numel() == 0) return at::zeros({6}, opts);
  const at::Tensor m = magnitudes(c);
  std::vector<at::Tensor> parts;
  for (std::uint32_t b : count_bounds(counted_dtype(c))) parts.push_back(at::gt(m, static_cast<std::int64_t>(b)).sum());
  parts.push_back(m.max().to(at::kLong));
  return at::stack(parts);
}

std::pair<at::Tensor, std::vector<std::size_t>> amax_bits(const std::vector<at::Tensor>& tensors) {
  std::map<int, std::vector<std::size_t>> by_dtype;
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].numel() > 0) by_dtype[static_cast<int>(tensors[i].scalar_type())].push_back(i);
  std::vector<at::Tensor> parts;
  std::vector<std::size_t> order;
  for (const auto& [dtype, idx] : by_dtype) {
    std::vector<at::Tensor> group;
    for (std::size_t i : idx) group.push_back(tensors[i]);
    const std::vector<at::Tensor> norms = at::_foreach_norm(group, std::numeric_limits<double>::infinity());
    parts.push_back(at::bitwise_and(at::stack(norms).to(at::kFloat).view(at::kInt).to(at::kLong), 0x7fffffff));
    order.insert(order.end(), idx.begin(), idx.end());
  }
  if (parts.empty()) return {at::zeros({0}, at::kLong), {}};
  return {at::cat(parts), order};
}

at::Tensor histogram(const at::Tensor& c, std::int64_t stride) {
  constexpr std::int64_t kBins = nn::Log2Histogram::kMaxExp - nn::Log2Histogram::kMinExp + 1;
  const at::Tensor x = c.reshape({-1}).slice(0, 0, std::nullopt, stride).to(at::kFloat);
  const at::Tensor bits = at::bitwise_and(x.view(at::kInt), 0x7fffffff);
  const at::Tensor zero = at::eq(bits, 0);
  const at::Tensor bad = at::ge(bits, static_cast<std::int64_t>(kF32InfBits));
  // floor(log2|x|) of finite nonzero x (subnormals too) is frexp's exponent - 1.
  const at::Tensor exponent = std::get<1>(at::frexp(x)) - 1;
  const at::Tensor index = (exponent.clamp(nn::Log2Histogram::kMinExp, nn::Log2Histogram::kMaxExp) -
                            nn::Log2Histogram::kMinExp)
                               .masked_fill(at::logical_or(zero, bad), kBins);
  const at::Tensor bins = at::bincount(index.reshape({-1}), {}, kBins + 1).slice(0, 0, kBins).to(at::kLong);
  return at::cat({bins, zero.sum().reshape({1}), bad.sum().reshape({1})});
}

float f32_from_bits(std::uint32_t bits) noexcept {
  return bits >= kF32InfBits ? std::numeric_limits<float>::infinity() : std::bit_cast<float>(bits);
}

}  // namespace mixprec::torch::detail
