// The deep MLP next-token classifier (Bengio-style): the embeddings of a window's T
// tokens, concatenated, pass through `depth` Linear+GELU layers and a Linear to V
// logits that predict the window's last target. Same precision policy as gpt.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine.hpp"
#include "fp8_linear.hpp"
#include "layer_kernels.hpp"
#include "mixprec/nn/layers.hpp"
#include "model_impl.hpp"

namespace mixprec::nn::detail {
namespace {

std::vector<ParamSpec> mlp_specs(const ModelConfig& c) {
  std::vector<ParamSpec> s{{"wte", {c.vocab, c.channels}}};
  std::size_t in = c.context * c.channels;
  for (std::size_t i = 0; i < c.depth; ++i) {
    const std::string f = std::string("fc").append(std::to_string(i)).append(".");
    s.push_back({f + "weight", {c.hidden, in}});
    s.push_back({f + "bias", {c.hidden}});
    in = c.hidden;
  }
  s.push_back({"head.weight", {c.vocab, c.hidden}});
  s.push_back({"head.bias", {c.vocab}});
  return s;
}

// The Engine's fp32 scratch slots. Forward computes a low-precision activation in its
// slot before committing it (an fp32 one is computed in its own buffer and leaves the
// slot alone); backward computes every gradient in a slot. The values listed for a
// slot share it: each is dead before the next overwrites it. Backward reuses
// forward's slots, as it decodes the saved activations again (Engine::load).
enum ForwardSlot : std::size_t {
  kInputSlot,   // the embedding, then odd layers' GELU output (fc<i>.gelu)
  kLinearSlot,  // each hidden Linear's output (fc<i>)
  kGeluSlot,    // even layers' GELU output: alternating with kInputSlot, so that a layer's
                // output never lands in its input's slot
  kLogitsSlot,  // logits
};
constexpr std::size_t kSlotCount = kLogitsSlot + 1;
enum BackwardSlot : std::size_t {
  kPreGradSlot,   // logits.grad, then each layer's fc<i>.grad (before the GELU)
  kDownGradSlot,  // the gradient flowing down: fc<last>.gelu.grad, then each layer's input
                  // gradient, written once the GELU backward has read the previous one
  kSavedSlot,     // the saved activation the op at hand reads (Engine::load)
};

class Mlp final : public Model {
 public:
  Mlp(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats,
      std::unique_ptr<Fp8Linears> linears)
      : Model(c, p) {
    store_ = std::make_unique<ParamStore>(mlp_specs(c), StoreOptions{p.weights, p.weight_grads, p.master, state_slots, formats});
    const std::size_t B = c.batch, TC = c.context * c.channels, H = c.hidden, V = c.vocab;
    engine_ = std::make_unique<Engine>(p, *store_, B * std::max({TC, H, V}), kSlotCount);
    Arena& a = engine_->acts();
    const DType act = p.activations;
    wte_ = store_->index_of("wte");
    x0_ = a.add("embedding", act, B * TC);
    for (std::size_t i = 0; i < c.depth; ++i) {
      const std::string f = std::string("fc").append(std::to_string(i));
      w_.push_back(store_->index_of(f + ".weight"));
      b_.push_back(store_->index_of(f + ".bias"));
      pre_.push_back(a.add(f, act, B * H));
      post_.push_back(a.add(f + ".gelu", act, B * H));
    }
    logits_label_ = grad_label("logits.grad");
    labels_.resize(c.depth);
    for (std::size_t i = c.depth; i-- > 0;) {
      const std::string f = std::string("fc").append(std::to_string(i));
      labels_[i].second = grad_label(f + ".gelu.grad");
      labels_[i].first = grad_label(f + ".grad");
    }
    embedding_label_ = grad_label("embedding.grad");
    headw_ = store_->index_of("head.weight");
    headb_ = store_->index_of("head.bias");
    logits_ = a.add("logits", act, B * V);
    probs_ = a.add("probs", DType::f32, B * V);
    losses_ = a.add("losses", DType::f32, B);
    saved_end_ = a.count();
    dlogits_ = a.add("logits.grad", act, B * V);
    dhid_ = a.add("hidden.grad", act, B * std::max(H, TC));
    a.finish();
    // Quantized presets and recipe files: the hidden Linears; the embedding and the head stay bf16.
    if (linears) {
      fp8_ = std::move(linears);
      for (std::size_t i = 0; i < c.depth; ++i) {
        fp8_->add(std::string("fc").append(std::to_string(i)), B, i == 0 ? TC : H, H);
      }
      fp8_->finish();
    }
    // Per-layer loss scaling: slots 0..depth-1 the hidden Linears, slot depth the head.
    for (std::size_t i = 0; i < c.depth; ++i)
      scaled_layer(std::string("fc").append(std::to_string(i)), static_cast<std::int64_t>(H), {w_[i], b_[i]});
    scaled_layer("head", static_cast<std::int64_t>(V), {headw_, headb_});
    tokens_.assign(B * c.context, 0);
    targets_.assign(B, 0);
    dlosses_.assign(B, 0.0f);

    std::vector<float> flat(store_->flat_size(), 0.0f);
    auto w = [&](std::size_t i) { return std::span<float>(flat.data() + store_->offset(i), store_->numel(i)); };
    init_normal(w(wte_), 1.0f, c.seed, wte_);
    std::size_t in = TC;
    for (std::size_t i = 0; i < c.depth; ++i) {
      init_normal(w(w_[i]), std::sqrt(2.0f / static_cast<float>(in)), c.seed, w_[i]);  // He init for GELU
      in = H;
    }
    init_normal(w(headw_), 1.0f / std::sqrt(static_cast<float>(H)), c.seed, headw_);
    store_->set_weights_of_record(flat);
    engine_->weights_updated();
  }

  std::size_t losses_per_batch() const noexcept override { return config_.batch; }

  ForwardResult forward(std::span<const TokenId> inputs, std::span<const TokenId> targets, std::size_t rows) override {
    const std::size_t T = config_.context, C = config_.channels, H = config_.hidden, V = config_.vocab;
    check_batch("mlp forward", inputs, targets, rows, config_.batch, T, V);
    std::copy_n(inputs.begin(), rows * T, tokens_.begin());
    for (std::size_t b = 0; b < rows; ++b) targets_[b] = targets[b * T + T - 1];
    rows_ = rows;
    Engine& e = *engine_;
    Arena& a = e.acts();
    const std::span<const float> wte = e.w(wte_);

    std::span<float> x = e.target(x0_, kInputSlot, rows * T * C);
    for (std::size_t i = 0; i < rows * T; ++i) std::memcpy(&x[i * C], &wte[tokens_[i] * C], C * sizeof(float));
    e.commit(x0_, x);
    std::span<const float> in = x;
    std::size_t in_act = x0_;  // the activation `in` holds (GEMM operand: engine.hpp)
    std::size_t fan_in = T * C;
    for (std::size_t i = 0; i < config_.depth; ++i) {
      std::span<float> h = e.target(pre_[i], kLinearSlot, rows * H);
      if (fp8_) fp8_->forward(e.gemm(), i, h, in, e.w(w_[i]), e.w(b_[i]), rows);
      else linear_forward(e.gemm(), h, e.operand(in_act, in, rows, fan_in), e.weight_operand(w_[i], H, fan_in),
                          e.w(b_[i]), rows, fan_in, H);
      e.commit(pre_[i], h);
      std::span<float> g = e.target(post_[i], i % 2 == 0 ? kGeluSlot : kInputSlot, rows * H);
      gelu_forward(g, h);
      e.commit(post_[i], g);
      in = g;
      in_act = post_[i];
      fan_in = H;
    }
    std::span<float> logits = e.target(logits_, kLogitsSlot, rows * V);
    linear_forward(e.gemm(), logits, e.operand(in_act, in, rows, H), e.weight_operand(headw_, V, H), e.w(headb_), rows,
                   H, V);
    e.commit(logits_, logits);
    const std::span<float> losses = a.f32(losses_, rows);
    softmax_crossentropy_forward(losses, a.f32(probs_, rows * V), logits, {targets_.data(), rows}, rows, 1, V);
    ForwardResult r;
    r.count = rows;
    for (float l : losses) r.loss_sum += static_cast<double>(l);
    r.finite = std::isfinite(r.loss_sum);
    if (!r.finite) r.first_nonfinite = first_nonfinite_activation(rows);
    return r;
  }

  void backward(float dloss) override {
    const std::size_t B = config_.batch, T = config_.context, C = config_.channels, H = config_.hidden;
    const std::size_t V = config_.vocab;
    if (rows_ != B) throw std::logic_error("mlp backward: expected a full-batch forward before backward");
    Engine& e = *engine_;
    Arena& a = e.acts();
    e.begin_backward();
    std::fill(dlosses_.begin(), dlosses_.end(), dloss);
    std::span<float> dlogits = e.scratch(kPreGradSlot, B * V);  // overwritten in full
    crossentropy_softmax_backward_store(dlogits, dlosses_, a.f32(probs_, B * V), targets_, B, 1, V);
    e.commit_grad(dlogits_, dlogits, stats_, logits_label_);
    const std::size_t last = config_.depth - 1;
    // Per-layer scaling: the gradient carries the product of the factors of the Linears it
    // passed (one chain from the head down to the embedding).
    double chain = scale_layer(config_.depth, dlogits, e.w(headw_), 1.0);
    std::span<float> dout = e.zeroed(kDownGradSlot, B * H);
    linear_backward(e.gemm(), dout, e.dw(headw_), e.dw(headb_), dlogits, e.operand(dlogits_, dlogits, B, V),
                    e.saved_operand(post_[last], kSavedSlot, B, H), e.weight_operand(headw_, V, H), B, H, V);
    e.commit_grad(dhid_, dout, stats_, labels_[last].second);
    for (std::size_t i = config_.depth; i-- > 0;) {
      std::span<float> dpre = e.scratch(kPreGradSlot, B * H);  // overwritten in full
      gelu_backward_store(dpre, e.load(pre_[i], kSavedSlot, B * H), dout);
      e.commit_grad(dhid_, dpre, stats_, labels_[i].first);
      chain *= scale_layer(i, dpre, e.w(w_[i]), chain);
      const std::size_t fan_in = i == 0 ? T * C : H;
      const std::size_t in_act = i == 0 ? x0_ : post_[i - 1];
      std::span<float> din = e.zeroed(kDownGradSlot, B * fan_in);
      if (fp8_) fp8_->backward(e.gemm(), i, din, e.dw(w_[i]), e.dw(b_[i]), dpre, e.w(w_[i]));
      else linear_backward(e.gemm(), din, e.dw(w_[i]), e.dw(b_[i]), dpre,
                           e.operand(dhid_, dpre, B, H), e.saved_operand(in_act, kSavedSlot, B, fan_in),
                           e.weight_operand(w_[i], H, fan_in), B, fan_in, H);
      e.commit_grad(dhid_, din, stats_, i == 0 ? embedding_label_ : labels_[i - 1].second);
      dout = din;
    }
    mark_grad_factor(wte_, chain);
    std::span<float> dwte = e.dw(wte_);
    for (std::size_t i = 0; i < B * T; ++i) {
      float* row = &dwte[tokens_[i] * C];
      for (std::size_t k = 0; k < C; ++k) row[k] += dout[i * C + k];
    }
    e.finish_backward();
  }

  void weights_updated() override { engine_->weights_updated(); }
  void histograms_changed() noexcept override { engine_->set_histograms(histogram_sink()); }
  Fp8Linears* fp8_linears() const noexcept override { return fp8_.get(); }

  ModelMemory memory() const override {
    ModelMemory m;
    m.parameter_bytes = store_->bytes();
    m.master_bytes = store_->master_bytes();
    for (unsigned k = 0; k < store_->state_slots(); ++k) m.optimizer_state_bytes += store_->state_slot_bytes(k);
    const Arena& a = engine_->acts();
    for (std::size_t i = 0; i < a.count(); ++i) {
      const std::size_t b = a.act(i).numel * dtype_size(a.act(i).dtype);
      (i < saved_end_ ? m.activation_bytes : m.gradient_bytes) += b;
    }
    m.scratch_bytes = engine_->scratch_bytes() + (fp8_ ? fp8_->scratch_bytes() : 0);
    if (fp8_) {  // saved for backward, as fp8 codes + scales
      m.fp8_activation_bytes = fp8_->saved_bytes();
      m.activation_bytes += m.fp8_activation_bytes;
    }
    return m;
  }

  std::string describe() const override {
    return "mlp: " + std::to_string(config_.depth) + " hidden layers of " + std::to_string(config_.hidden) +
           ", context " + std::to_string(config_.context) + " x " + std::to_string(config_.channels) +
           " channels, vocab " + std::to_string(config_.vocab) + " (" + group_thousands(store_->param_count()) +
           " parameters)";
  }

 private:
  std::string first_nonfinite_activation(std::size_t rows) const {
    const std::size_t H = config_.hidden;
    std::vector<std::pair<std::size_t, std::size_t>> order{{x0_, rows * config_.context * config_.channels}};
    for (std::size_t i = 0; i < config_.depth; ++i) order.insert(order.end(), {{pre_[i], rows * H}, {post_[i], rows * H}});
    order.push_back({logits_, rows * config_.vocab});
    for (auto [act, n] : order) {
      if (engine_->first_nonfinite(act, n) != std::numeric_limits<std::size_t>::max()) return engine_->acts().act(act).name;
    }
    return "losses";
  }

  Engine& engine() noexcept override { return *engine_; }
  const Engine& engine() const noexcept override { return *engine_; }
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Fp8Linears> fp8_;  // the hidden Linears fc<i> (id i), fp8 presets only
  std::size_t wte_ = 0, headw_ = 0, headb_ = 0;
  std::vector<std::size_t> w_, b_, pre_, post_;
  std::vector<std::pair<std::size_t, std::size_t>> labels_;  // (pre-activation grad, GELU output grad) per layer
  std::size_t logits_label_ = 0, embedding_label_ = 0;
  std::size_t x0_ = 0, logits_ = 0, probs_ = 0, losses_ = 0, dlogits_ = 0, dhid_ = 0, saved_end_ = 0;
  std::size_t rows_ = 0;
  std::vector<TokenId> tokens_, targets_;
  std::vector<float> dlosses_;
};

}  // namespace

std::unique_ptr<Model> make_mlp(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats,
                                std::unique_ptr<Fp8Linears> linears) {
  return std::make_unique<Mlp>(c, p, state_slots, formats, std::move(linears));
}

}  // namespace mixprec::nn::detail
