// Private: the model classes' factories and shared helpers.
#pragma once

#include <memory>
#include <span>

#include "mixprec/nn/model.hpp"

namespace mixprec::nn::detail {

// recipe: the fp8 recipe of the Linear layers (none: plain fp32 layers).
std::unique_ptr<Model> make_gpt(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats, std::optional<QuantizedGemms> gemms,
                                const Fp8Config& fp8);
std::unique_ptr<Model> make_mlp(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats, std::optional<QuantizedGemms> gemms,
                                const Fp8Config& fp8);

}  // namespace mixprec::nn::detail
