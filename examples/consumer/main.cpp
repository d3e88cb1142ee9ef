// Converts a few fp32 values to bf16 and f16 with the installed library, then back.
#include <mixprec/mixprec.hpp>

#include <cstdio>
#include <string>
#include <vector>

int main() {
  const std::vector<float> x = {1.0f, 3.14159265f, 1e-8f, 70000.0f};
  std::vector<mixprec::bf16> b(x.size());
  std::vector<mixprec::f16> h(x.size());
  mixprec::convert(std::span<const float>(x), std::span<mixprec::bf16>(b));
  const mixprec::ConversionStats st = mixprec::convert_counted(std::span<const float>(x), std::span<mixprec::f16>(h));
  std::printf("mixprec %s, back end %s\n", mixprec::kVersionString,
              std::string(mixprec::isa_name(mixprec::active_isa())).c_str());
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::printf("%-12g bf16 0x%04x = %-12g f16 0x%04x = %g\n", static_cast<double>(x[i]), b[i].bits(),
                static_cast<double>(static_cast<float>(b[i])), h[i].bits(),
                static_cast<double>(static_cast<float>(h[i])));
  }
  std::printf("f16: %llu underflowed, %llu overflowed\n", static_cast<unsigned long long>(st.underflow),
              static_cast<unsigned long long>(st.overflow));
  return (b[0].bits() == 0x3f80 && h[0].bits() == 0x3c00 && st.underflow == 1 && st.overflow == 1) ? 0 : 1;
}
