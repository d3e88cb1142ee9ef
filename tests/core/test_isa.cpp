// The one lookup rule of the kernel tables (src/core/select_kernels.hpp): the table of an
// available back end, nullptr for any other; under avx512 a family without AVX-512
// kernels answers with its AVX2 table (back ends nest), and says so in its isa field.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "mixprec/core/isa.hpp"
#include "mixprec/formats/kernel_table.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "optim/kernels.hpp"

namespace mixprec {
namespace {

TEST(Isa, NamesRoundTrip) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) EXPECT_EQ(parse_isa(isa_name(isa)), isa);
  EXPECT_FALSE(parse_isa("avx512f").has_value());
  EXPECT_FALSE(parse_isa("AVX2").has_value());
}

TEST(Isa, AvxLevelsNest) {
  // AVX-512 is only claimed with AVX2 (its kernels fall back to AVX2's), AVX2 with scalar.
  if (isa_available(Isa::avx512)) {
    EXPECT_TRUE(isa_available(Isa::avx2));
  }
  EXPECT_EQ(best_isa(), isa_available(Isa::avx512) ? Isa::avx512
                        : isa_available(Isa::avx2) ? Isa::avx2
                                                   : Isa::scalar);
}

TEST(Isa, ActiveAndBestAreAvailable) {
  EXPECT_TRUE(isa_available(Isa::scalar));
  EXPECT_TRUE(isa_available(best_isa()));
  EXPECT_TRUE(isa_available(active_isa()));
}

TEST(Isa, EveryTableFollowsTheSameRule) {
  std::vector<float> g(8, 1.0f);
  const GradTensor t{g.data(), g.size(), DType::f32};
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const bool available = isa_available(isa);
    const KernelTable* formats = kernel_table(isa);
    EXPECT_EQ(formats != nullptr, available);
    if (formats != nullptr) {
      EXPECT_EQ(formats->isa, isa);  // AVX-512: its own 16-bit encodes, AVX2's other kernels
      if (isa == Isa::avx512) {
        EXPECT_NE(formats->bf16.encode_round, kernel_table(Isa::avx2)->bf16.encode_round);
        EXPECT_EQ(formats->f8e4m3.encode, kernel_table(Isa::avx2)->f8e4m3.encode);
      }
    }
    const optim_detail::UpdateKernels* update = optim_detail::update_kernels(isa);
    EXPECT_EQ(update != nullptr, available);
    if (update != nullptr) {
      EXPECT_EQ(update, isa == Isa::scalar ? &optim_detail::scalar_update_kernels()
                        : isa == Isa::avx2 ? optim_detail::avx2_update_kernels()
                                           : optim_detail::avx512_update_kernels());
    }
    if (available) {
      EXPECT_NO_THROW(unscale_and_check(isa, {&t, 1}, 1.0f));
    } else {
      EXPECT_THROW(unscale_and_check(isa, {&t, 1}, 1.0f), std::invalid_argument);
    }
  }
}

}  // namespace
}  // namespace mixprec
