// How a torch front door reads each gradient: decided here once for the libtorch door
// (src/torch/grad_scaler.cpp) and the Python door (python/mixprec/torch/grad_scaler.py).
// Each door describes a gradient in torch's words (GradDescriptor) and carries out the route
// it gets back; which gradients are refused and with what message, and how the two readers'
// results make one GradientCheck, are this file's (docs/libtorch.md and docs/python.md,
// "Gradients it takes, refuses and skips"). No torch here: the descriptor is plain data.
//
//   route          gradient
//   core           CPU float32/float16/bfloat16 whose elements are one dense block of memory
//                  (contiguous, channels_last, any permutation): check_gradients in place
//   sparse_values  sparse COO: its values (coalesced first when float16: torch sums the
//                  duplicates before its check, where the sum may overflow), routed in turn
//   aten           every other floating-point gradient torch.amp.GradScaler unscales
//                  (float64, strided or overlapping views, other devices): ATen's
//                  _amp_foreach_non_finite_check_and_unscale_, the kernel torch runs
//   refused        a meta tensor, a layout other than strided and sparse COO, a dtype that is
//                  not floating point; one optimizer's gradients on two devices (route_gradients)
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/dtype.hpp"
#include "mixprec/scaler/protocol.hpp"

namespace mixprec {

// torch's tensor layouts (at::Layout, torch.layout); other: one this list does not know.
enum class TensorLayout : std::uint8_t { strided, sparse_coo, sparse_csr, sparse_csc, sparse_bsr, sparse_bsc, mkldnn, jagged, other };
// libtorch's spelling, as c10 prints a layout ("Strided", "Sparse", "SparseCsr", ...): the messages'.
std::string_view layout_name(TensorLayout layout) noexcept;
// torch's Python name ("torch.strided", "torch.sparse_coo", "torch._mkldnn", ...; the prefix
// "torch." may be left out); other for any other.
TensorLayout layout_from_torch_name(std::string_view name) noexcept;

// One gradient as torch describes it. The views must outlive the call that reads them.
struct GradDescriptor {
  std::string_view dtype;       // torch's name: "float32", "float16", "bfloat16", "float64", "int64", ...
  bool floating_point = false;  // torch's is_floating_point (float8 types included, complex not)
  TensorLayout layout = TensorLayout::strided;
  std::string_view device;      // torch's str(device): "cpu", "cuda:0", "meta", ...
  std::span<const std::int64_t> sizes;    // strided layout: sizes and strides in elements
  std::span<const std::int64_t> strides;  // (empty for the others)
};

// Whether `numel` elements of the given sizes and strides are one dense block from the first
// element's address (no gaps, no element twice: a contiguous tensor or any permutation of one,
// channels_last included). Dimensions of size 1 do not count; no elements is a block.
bool dense_block(std::span<const std::int64_t> sizes, std::span<const std::int64_t> strides) noexcept;

enum class GradRoute : std::uint8_t { core, sparse_values, aten, refused };
std::string_view route_name(GradRoute route) noexcept;  // "core", "sparse_values", "aten", "refused"

struct GradRouting {
  GradRoute route = GradRoute::refused;
  DType dtype = DType::f32;  // core: what check_gradients reads
  bool coalesce = false;     // sparse_values: coalesce the gradient first (float16)
  bool wrong_type = false;   // refused for its dtype (Python raises TypeError; otherwise ValueError)
  std::string reason;        // refused: what follows "the gradient of NAME " in the message
};

// One gradient's route. aten_only: ATen for every gradient the core would read (the path of
// device gradients, which the tests run on CPU ones against the core's).
GradRouting route_gradient(const GradDescriptor& grad, bool aten_only = false);

// What route_gradients throws: std::invalid_argument naming the parameter; wrong_type() when
// the dtype was refused (Python: TypeError).
class GradientRefused : public std::invalid_argument {
 public:
  GradientRefused(const std::string& what, bool wrong_type) : std::invalid_argument(what), wrong_type_(wrong_type) {}
  bool wrong_type() const noexcept { return wrong_type_; }

 private:
  bool wrong_type_;
};

// Every gradient of one optimizer that has one, in parameter order (index: the door's index
// over the optimizer's parameters, groups in order), validated before the door touches any:
// the first refused gradient, or the first on another device than the first gradient's, throws
// GradientRefused with its name from name_of(index). Otherwise each one's route.
std::vector<GradRouting> route_gradients(std::span<const GradDescriptor> grads, std::span<const std::int64_t> index,
                                         bool aten_only, const std::function<std::string(std::int64_t)>& name_of);

// The name of a parameter the door has no name for: "param[<index>]".
std::string default_parameter_name(std::int64_t index);

// One optimizer's GradientCheck from its two readers: the core (check_gradients over the
// gradients routed core, including sparse values) and ATen (those routed aten).
// read(core, write) reads one share and names its first overflow within the share;
// core_index and aten_index give the door's index of each share's tensors. The rule:
//   - one share (or none: the core's, empty): read once, writing;
//   - both, scale >= 1: each read and written at once (an unscaled value cannot overflow);
//   - both, scale < 1 (1/S > 1: an unscaled value may overflow its dtype): both read first,
//     nothing written, and written only when neither found inf: an overflow step writes nothing.
// first_overflow: the smaller door index of the two (the first parameter, groups in order);
// with both shares the gradients are unscaled in place (carried_inv_scale 1).
GradientCheck check_in_two_reads(float scale, std::span<const std::int64_t> core_index,
                                 std::span<const std::int64_t> aten_index,
                                 const std::function<GradientCheck(bool core, bool write)>& read);

}  // namespace mixprec
