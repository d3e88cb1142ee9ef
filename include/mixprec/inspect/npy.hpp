// Reading NumPy .npy files (float32, float16 and float64 tensors) for diagnostics such as
// `mixprec inspect`. See docs/inspect.md.
//
// Accepted: format versions 1.0, 2.0 and 3.0; the header is parsed by a small strict
// parser for exactly the dict literal NumPy writes ({'descr': ..., 'fortran_order': ...,
// 'shape': (...), }), never evaluated. dtypes '<f4' '>f4' '<f2' '>f2' '<f8' '>f8'; every
// other descr (integers, bool, complex, 'O' objects, structured dtypes) is rejected with
// a message naming what was found and what is allowed.
//
// Values are decoded to fp32 in file order (row-major for C order, column-major when
// fortran_order is True; the order does not matter to statistics). float16 and float32
// decode exactly; float64 is rounded to the nearest float32 (ties to even), as
// x.astype(np.float32) or torch's .float() would, and NpyArray counts the values that
// rounding turned into 0 or inf.
//
// Errors: std::runtime_error whose message starts with the source name and says what was
// expected and what was found, with the byte offset in the file where there is one, e.g.
// "grad.npy: npy header: expected ':' after key 'shape', found '=' at byte 27".
// parse_npy never reads outside `bytes` and never allocates more than the data it holds
// needs (it is the entry point for fuzzing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::monitor {

struct NpyArray {
  int version_major = 1;                 // 1, 2 or 3
  int version_minor = 0;                 // 0
  std::vector<std::size_t> shape;        // () for a scalar: one value
  bool fortran_order = false;
  std::string dtype;                     // as in the header: "<f4", ">f2", "<f8", ...
  std::vector<float> values;             // product(shape) values, decoded to fp32
  std::uint64_t narrowed_to_zero = 0;    // float64 only: nonzero finite values that became +-0 in fp32
  std::uint64_t narrowed_to_inf = 0;     // float64 only: finite values that became +-inf in fp32
};

// The largest file read_npy accepts (4 GiB).
inline constexpr std::uint64_t kNpyMaxFileBytes = std::uint64_t{4} << 30;
// The most dimensions a shape may have (NumPy 2 allows 64).
inline constexpr std::size_t kNpyMaxDims = 64;

// Parses a whole .npy image held in memory; `source` names it in error messages.
NpyArray parse_npy(std::span<const std::byte> bytes, std::string_view source);

// Reads and parses a file of at most max_file_bytes.
NpyArray read_npy(const std::filesystem::path& path, std::uint64_t max_file_bytes = kNpyMaxFileBytes);

// A float32 .npy image (version 1.0, '<f4', C order) of `values` with `shape`, as
// numpy.save writes it (the header padded with spaces to a multiple of 64 bytes).
// std::invalid_argument when the shape's product is not values.size().
std::string npy_f32_image(std::span<const std::size_t> shape, std::span<const float> values);

// "(2, 3)", "(5,)", "()": the shape as Python prints a tuple.
std::string shape_text(std::span<const std::size_t> shape);

}  // namespace mixprec::monitor
