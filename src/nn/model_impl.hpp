// Private: the model classes' factories and shared helpers.
#pragma once

#include <memory>
#include <span>

#include "mixprec/nn/model.hpp"

namespace mixprec::nn::detail {

// recipe: the fp8 recipe of the Linear layers (none: plain fp32 layers).
std::unique_ptr<Model> make_gpt(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, Fp8Recipe recipe,
                                const Fp8Config& fp8);
std::unique_ptr<Model> make_mlp(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, Fp8Recipe recipe,
                                const Fp8Config& fp8);

// Writes fp32 initial values (flat, store layout) as the store's weights of record:
// the master weights (and their rounded model copy), or the model weights themselves.
void write_initial_weights(ParamStore& store, std::span<const float> flat);

}  // namespace mixprec::nn::detail
