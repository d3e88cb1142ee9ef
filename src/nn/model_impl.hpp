// Private: the model classes' factories and shared helpers.
#pragma once

#include <memory>
#include <span>

#include "mixprec/nn/model.hpp"

namespace mixprec::nn::detail {

// linears: the quantized Linear layers, before any add() (null: plain fp32 layers); the model
// adds its Linears (quantized_linear_names) and finishes them.
std::unique_ptr<Model> make_gpt(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats,
                                std::unique_ptr<Fp8Linears> linears);
std::unique_ptr<Model> make_mlp(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats,
                                std::unique_ptr<Fp8Linears> linears);

}  // namespace mixprec::nn::detail
