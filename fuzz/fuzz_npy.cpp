// libFuzzer target: the .npy reader (monitor::parse_npy) on arbitrary bytes, and on an
// accepted file the analysis of `mixprec inspect` (monitor::inspect) over its values,
// with scales 2^0 .. 2^4 to keep each input fast. A rejected file is a std::exception;
// anything else (a crash, an ASan or UBSan report, a leak, a timeout, an out-of-memory)
// is a bug. See docs/fuzzing.md.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <span>

#include "mixprec/inspect/inspect.hpp"
#include "mixprec/inspect/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace monitor = mixprec::monitor;
  try {
    const monitor::NpyArray a = monitor::parse_npy(std::span(reinterpret_cast<const std::byte*>(data), size), "fuzz");
    // Properties of an accepted file: as many values as the shape says, and a shape
    // that prints.
    std::size_t n = 1;
    for (std::size_t d : a.shape) n *= d;
    if (a.values.size() != n) std::abort();
    (void)monitor::shape_text(a.shape);
    monitor::InspectOptions o;
    o.max_scale_log2 = 4;
    const monitor::InspectReport r = monitor::inspect(a.values, o);
    // Every value is counted once, and at each scale every finite nonzero value has
    // exactly one outcome.
    const monitor::TensorStats& st = r.stats;
    if (st.count != n || st.zeros + st.nan + st.inf + st.finite_nonzero != n) std::abort();
    for (const monitor::FormatInspection& f : r.formats) {
      if (f.scales.size() != 5) std::abort();
      for (const monitor::ScaleOutcome& s : f.scales) {
        if (s.underflow + s.subnormal + s.overflow + s.normal != st.finite_nonzero) std::abort();
      }
    }
  } catch (const std::exception&) {
    // rejected: the reason is in the message
  }
  return 0;
}
