// Private: the one rule by which every kernel table is looked up (the formats'
// kernel_table, unscale_and_check's and the optimizers' update kernels).
#pragma once

#include "mixprec/core/isa.hpp"

namespace mixprec::detail {

// The table of `isa` when isa_available(isa) (compiled in and supported by this CPU),
// else nullptr: never a table of a back end this CPU lacks, so a test or benchmark
// that asks for a back end measures that one or nothing. Callers that must have a table ask for
// active_isa(), which is always available. The tables are reached through their
// accessors, so only the selected one is built. Back ends nest: a family without
// AVX-512 kernels (avx512 == nullptr) answers avx512 with its AVX2 table, whose `isa`
// field says so (AVX-512 implies AVX2 in isa_available).
template <class Table>
const Table* select_kernels(Isa isa, const Table& (*scalar)() noexcept, const Table* (*avx2)() noexcept,
                            const Table* (*avx512)() noexcept = nullptr) noexcept {
  if (!isa_available(isa)) return nullptr;
  switch (isa) {
    case Isa::scalar: return &scalar();
    case Isa::avx2: return avx2();
    case Isa::avx512: return avx512 != nullptr ? avx512() : avx2();
  }
  return nullptr;
}

}  // namespace mixprec::detail
