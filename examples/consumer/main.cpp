// Converts a few fp32 values to bf16 and f16 with the installed library, then back.
#include <mixprec/mixprec.hpp>

#include <cmath>
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
  const bool formats_ok = b[0].bits() == 0x3f80 && h[0].bits() == 0x3c00 && st.underflow == 1 && st.overflow == 1;

  // Loss-scaled steps over fp32 master weights with fp16 gradients: fit w to 0.5.
  mixprec::ParamStore params({{"w", {4}}}, {.model = mixprec::DType::f16, .grads = mixprec::DType::f16});
  mixprec::Adam opt(params, {.lr = 0.05});
  mixprec::GradScaler scaler(mixprec::loss_scale_preset("torch"));
  int skipped = 0;
  for (int step = 0; step < 50; ++step) {
    auto w = params.master(0);
    auto g = params.grads<mixprec::f16>(0);
    for (std::size_t i = 0; i < w.size(); ++i) {  // d/dw of S * (w - 0.5)^2 / 2
      g[i] = mixprec::f16(scaler.scale(w[i] - 0.5f));
    }
    if (step == 10) g[0] = mixprec::f16(INFINITY);  // an overflow: this step is skipped
    const mixprec::StepOutcome out = scaler.step(opt);
    skipped += out.applied ? 0 : 1;
    scaler.update();
  }
  const float w0 = params.master(0)[0];
  std::printf("GradScaler: %d applied, %d skipped, scale %g, w[0] = %g\n", static_cast<int>(opt.step_count()), skipped,
              static_cast<double>(scaler.get_scale()), static_cast<double>(w0));
  return (formats_ok && skipped == 1 && opt.step_count() == 49 && w0 > 0.3f && w0 < 0.7f) ? 0 : 1;
}
