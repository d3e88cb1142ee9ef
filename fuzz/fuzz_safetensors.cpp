// libFuzzer target: the safetensors checkpoint reader (ckpt::SafetensorsFile::parse) on
// arbitrary bytes. A rejected file is a std::exception (std::runtime_error with the
// reason); anything else (a crash, an ASan or UBSan report, a leak, a timeout, an
// out-of-memory) is a bug. An accepted file must hand out every tensor's bytes within
// the buffer and agree with itself. The same input also drives header_mutation: a
// metadata value of a file with a header checksum, then one changed header byte, which
// must be refused. See docs/fuzzing.md.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/checkpoint/safetensors.hpp"

namespace {

namespace ckpt = mixprec::ckpt;

// Metadata mutations under the header checksum (WriteOptions::header_checksum): the
// input, less its first two bytes, becomes a metadata value of a checksummed file (as
// a trainer checkpoint's "mixprec.scaler"), which must read back exactly; then one
// byte of the length or the header (the position from the first two bytes) is changed,
// and the reader must refuse the file (or, when the change renamed the key itself, see
// no header checksum).
void header_mutation(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return;
  const std::string value(reinterpret_cast<const char*>(data) + 2, size - 2);
  const std::map<std::string, std::string> meta = {{"mixprec.scaler", value}, {"mixprec.step", "12"}};
  const std::vector<float> w = {1.0f, -2.5f, 3.0f};
  const std::vector<ckpt::TensorRef> tensors = {{"w", ckpt::DType::f32, {3}, std::as_bytes(std::span(w))}};
  ckpt::WriteOptions options;
  options.header_checksum = true;
  std::vector<std::byte> bytes;
  try {
    bytes = ckpt::serialize(tensors, meta, options);
  } catch (const std::invalid_argument&) {
    return;  // a value that is not UTF-8: the writer refuses it
  }
  const auto file = ckpt::SafetensorsFile::parse(bytes, "fuzz");  // an exception escapes: a bug
  if (!file.header_checked() || file.metadata_value("mixprec.scaler") != value) std::abort();
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::to_integer<std::uint64_t>(bytes[static_cast<std::size_t>(i)]) << (8 * i);
  const std::size_t at = (static_cast<std::size_t>(data[0]) | static_cast<std::size_t>(data[1]) << 8) % (8 + n);
  bytes[at] ^= static_cast<std::byte>(data[0] | 1);
  try {
    // Accepted only when the change hit the key's own name: then the file no longer
    // has a header checksum, which a reader that needs one (the trainer) refuses.
    if (ckpt::SafetensorsFile::parse(bytes, "fuzz").header_checked()) std::abort();  // a changed header passed
  } catch (const std::runtime_error&) {
    // refused, as it must be
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  header_mutation(data, size);
  // Small limits so that the header-length checks are exercised near their edges too.
  ckpt::ReadLimits limits;
  limits.max_header_bytes = 1u << 16;
  limits.max_file_bytes = 1u << 20;
  try {
    const auto file =
        ckpt::SafetensorsFile::parse(std::span(reinterpret_cast<const std::byte*>(data), size), "fuzz", limits);
    const std::span<const std::byte> whole = file.file_bytes();
    for (const ckpt::TensorInfo& t : file.tensors()) {
      const std::span<const std::byte> b = file.bytes(t.name);
      // Properties of an accepted file: the bytes lie inside the file, have the size the
      // offsets say, and expect() with the tensor's own dtype and shape agrees.
      if (b.size() != t.end - t.begin) std::abort();
      if (!b.empty() && (b.data() < whole.data() || b.data() + b.size() > whole.data() + whole.size())) std::abort();
      if (file.find(t.name) == nullptr) std::abort();
      if (file.expect(t.name, t.dtype, t.shape).data() != b.data()) std::abort();
    }
    for (const auto& [key, value] : file.metadata()) {
      if (file.metadata_value(key) != value) std::abort();
    }
  } catch (const std::exception&) {
    // rejected: the reason is in the message
  }
  return 0;
}
