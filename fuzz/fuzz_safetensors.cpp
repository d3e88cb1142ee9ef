// libFuzzer target: the safetensors checkpoint reader (ckpt::SafetensorsFile::parse) on
// arbitrary bytes. A rejected file is a std::exception (std::runtime_error with the
// reason); anything else (a crash, an ASan or UBSan report, a leak, a timeout, an
// out-of-memory) is a bug. An accepted file must hand out every tensor's bytes within
// the buffer and agree with itself. See docs/fuzzing.md.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <span>

#include "mixprec/checkpoint/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace ckpt = mixprec::ckpt;
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
