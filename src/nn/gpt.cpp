// The decoder-only transformer (GPT-2 architecture, llm.c's layout) under a precision
// policy. See include/mixprec/nn/model.hpp for the protocol and docs/training.md for
// which format every tensor is stored in.
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.hpp"
#include "fp8_linear.hpp"
#include "layer_kernels.hpp"
#include "mixprec/nn/layers.hpp"
#include "model_impl.hpp"

namespace mixprec::nn::detail {
namespace {

struct LayerParams {
  std::size_t ln1w, ln1b, qkvw, qkvb, projw, projb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
};

struct LayerActs {
  std::size_t ln1, ln1_mean, ln1_rstd, qkv, att, atty, res2, ln2, ln2_mean, ln2_rstd, fch, fchg, res3;
};

// The layer's Linears in the fp8 set (fp8 presets only).
struct LayerFp8 {
  std::size_t qkv, proj, fc, fcproj;
};

// The Engine's fp32 scratch slots. Forward computes a low-precision activation in its
// slot before committing it (an fp32 one is computed in its own buffer and leaves the
// slot alone); backward computes every gradient in a slot. The values listed for a
// slot share it: each is dead before the next overwrites it, except the residual
// stream, computed in place. Backward reuses forward's slots, as it decodes the saved
// activations again (Engine::load).
enum ForwardSlot : std::size_t {
  kResidualSlot,    // the residual stream: embedding, then each block's attn.residual and
                    // mlp.residual, each computed in place over the previous one
  kNarrowSlot,      // ln1, attn, ln2, lnf: each read by the op that follows it only
  kWideSlot,        // attn.qkv, mlp.fc, logits
  kGeluSlot,        // mlp.gelu
  kProjectionSlot,  // attn.proj and mlp.proj outputs, until added to the residual stream
};
enum BackwardSlot : std::size_t {
  kWideGradSlot,           // logits.grad, mlp.gelu.grad, attn.qkv.grad
  kNarrowGradSlot,         // lnf.grad, ln2.grad, attn.grad, ln1.grad
  kSavedSlot,              // the saved activation the op at hand reads (Engine::load)
  kResidualGradSlot,       // the residual stream's gradient, carried from block to block
  kFcGradSlot,             // mlp.fc.grad
  kAttnResidualGradSlot,   // attn.residual.grad within a block
};
constexpr std::size_t kSlotCount = kAttnResidualGradSlot + 1;  // forward needs the first five

// A block's Linears as per-layer loss scaling numbers them (Model::scaled_layers).
enum ScaledSlot : std::size_t { kAttnQkv, kAttnProj, kMlpFc, kMlpProj, kScaledPerBlock };
std::size_t scaled_slot(std::size_t layer, ScaledSlot s) { return layer * kScaledPerBlock + s; }

// Gradient labels per layer, built once (nothing is allocated per step).
struct LayerLabels {
  std::size_t fcproj_in, fc_out, ln2_out, res2, attproj_in, qkv_out, ln1_out, res_in;
};

// "h<l>." (built with append: GCC 12's -Wrestrict misfires on "h" + std::string).
std::string layer_prefix(std::size_t l) { return std::string("h").append(std::to_string(l)).append("."); }

std::vector<ParamSpec> gpt_specs(const ModelConfig& c) {
  const std::size_t C = c.channels;
  std::vector<ParamSpec> s{{"wte", {c.vocab, C}}, {"wpe", {c.context, C}}};
  for (std::size_t l = 0; l < c.layers; ++l) {
    const std::string h = layer_prefix(l);
    s.push_back({h + "ln1.weight", {C}});
    s.push_back({h + "ln1.bias", {C}});
    s.push_back({h + "attn.qkv.weight", {3 * C, C}});
    s.push_back({h + "attn.qkv.bias", {3 * C}});
    s.push_back({h + "attn.proj.weight", {C, C}});
    s.push_back({h + "attn.proj.bias", {C}});
    s.push_back({h + "ln2.weight", {C}});
    s.push_back({h + "ln2.bias", {C}});
    s.push_back({h + "mlp.fc.weight", {4 * C, C}});
    s.push_back({h + "mlp.fc.bias", {4 * C}});
    s.push_back({h + "mlp.proj.weight", {C, 4 * C}});
    s.push_back({h + "mlp.proj.bias", {C}});
  }
  s.push_back({"lnf.weight", {C}});
  s.push_back({"lnf.bias", {C}});
  return s;
}

class Gpt final : public Model {
 public:
  Gpt(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats,
      std::unique_ptr<Fp8Linears> linears)
      : Model(c, p) {
    store_ = std::make_unique<ParamStore>(
        gpt_specs(c), StoreOptions{p.weights, p.weight_grads, p.master, state_slots, formats});
    const std::size_t B = c.batch, T = c.context, C = c.channels, V = c.vocab, NH = c.heads, L = c.layers;
    const std::size_t N = B * T;
    slot_floats_ = N * std::max(V, 4 * C);
    engine_ = std::make_unique<Engine>(p, *store_, slot_floats_, kSlotCount);
    Arena& a = engine_->acts();
    const DType act = p.activations;
    const bool shared_inputs = linears != nullptr;  // quantized Linears (below)
    wte_ = store_->index_of("wte");
    wpe_ = store_->index_of("wpe");
    lnfw_ = store_->index_of("lnf.weight");
    lnfb_ = store_->index_of("lnf.bias");
    enc_ = a.add("embedding", act, N * C);
    for (std::size_t l = 0; l < L; ++l) {
      const std::string h = layer_prefix(l);
      auto idx = [&](const char* n) { return store_->index_of(h + n); };
      params_.push_back({idx("ln1.weight"), idx("ln1.bias"), idx("attn.qkv.weight"), idx("attn.qkv.bias"),
                         idx("attn.proj.weight"), idx("attn.proj.bias"), idx("ln2.weight"), idx("ln2.bias"),
                         idx("mlp.fc.weight"), idx("mlp.fc.bias"), idx("mlp.proj.weight"), idx("mlp.proj.bias")});
      LayerActs la{};
      // fp8 presets: the inputs of the block Linears (ln1, attn, ln2, mlp.gelu) are read
      // by the fp8 Linears only, whose backward reads the codes they saved; they pass
      // through one shared buffer (below) instead of being kept.
      if (!shared_inputs) la.ln1 = a.add(h + "ln1", act, N * C);
      la.ln1_mean = a.add(h + "ln1.mean", DType::f32, N);
      la.ln1_rstd = a.add(h + "ln1.rstd", DType::f32, N);
      la.qkv = a.add(h + "attn.qkv", act, N * 3 * C);
      la.att = a.add(h + "attn.softmax", DType::f32, B * NH * T * T);
      if (!shared_inputs) la.atty = a.add(h + "attn", act, N * C);
      la.res2 = a.add(h + "attn.residual", act, N * C);
      if (!shared_inputs) la.ln2 = a.add(h + "ln2", act, N * C);
      la.ln2_mean = a.add(h + "ln2.mean", DType::f32, N);
      la.ln2_rstd = a.add(h + "ln2.rstd", DType::f32, N);
      la.fch = a.add(h + "mlp.fc", act, N * 4 * C);
      if (!shared_inputs) la.fchg = a.add(h + "mlp.gelu", act, N * 4 * C);
      la.res3 = a.add(h + "mlp.residual", act, N * C);
      acts_.push_back(la);
    }
    // Activation-gradient tensors, registered in the order backward stores them.
    logits_label_ = grad_label("logits.grad");
    lnf_label_ = grad_label("lnf.grad");
    last_res_label_ = grad_label(layer_prefix(L - 1) + "mlp.residual.grad");
    labels_.resize(L);
    for (std::size_t l = L; l-- > 0;) {
      const std::string h = layer_prefix(l);
      LayerLabels& lb = labels_[l];
      lb.fcproj_in = grad_label(h + "mlp.gelu.grad");
      lb.fc_out = grad_label(h + "mlp.fc.grad");
      lb.ln2_out = grad_label(h + "ln2.grad");
      lb.res2 = grad_label(h + "attn.residual.grad");
      lb.attproj_in = grad_label(h + "attn.grad");
      lb.qkv_out = grad_label(h + "attn.qkv.grad");
      lb.ln1_out = grad_label(h + "ln1.grad");
      lb.res_in = grad_label(l == 0 ? std::string("embedding.grad") : layer_prefix(l - 1) + "mlp.residual.grad");
    }
    lnf_ = a.add("lnf", act, N * C);
    lnf_mean_ = a.add("lnf.mean", DType::f32, N);
    lnf_rstd_ = a.add("lnf.rstd", DType::f32, N);
    logits_ = a.add("logits", act, N * V);
    probs_ = a.add("probs", DType::f32, N * V);
    losses_ = a.add("losses", DType::f32, N);
    saved_bytes_end_ = a.count();
    if (shared_inputs) {
      // Stored in the activation format and decoded back (Engine::commit), as the kept
      // copies were: the fp8 Linears quantize the same values.
      const std::size_t in = a.add("fp8.linear_input", act, N * 4 * C);
      for (LayerActs& la : acts_) la.ln1 = la.atty = la.ln2 = la.fchg = in;
    }
    tmp_ = a.add("projection", act, N * C);
    preatt_ = a.add("attn.scores", DType::f32, B * NH * T * T);
    dpreatt_ = a.add("attn.scores.grad", DType::f32, B * NH * T * T);
    datt_ = a.add("attn.softmax.grad", DType::f32, B * NH * T * T);
    dlogits_ = a.add("logits.grad", act, N * V);
    dbig_ = a.add("wide.grad", act, N * 4 * C);
    dmid_ = a.add("narrow.grad", act, N * C);
    dres_ = a.add("residual.grad", act, N * C);
    a.finish();
    // Quantized presets and recipe files: the four Linears of every block, in the order of
    // quantized_linear_names; the tied embedding / LM head stays bf16 (TE keeps the first and
    // last layers in higher precision).
    if (linears) {
      fp8_ = std::move(linears);
      for (std::size_t l = 0; l < L; ++l) {
        const std::string h = layer_prefix(l);
        fp8_ids_.push_back({fp8_->add(h + "attn.qkv", N, C, 3 * C), fp8_->add(h + "attn.proj", N, C, C),
                            fp8_->add(h + "mlp.fc", N, C, 4 * C), fp8_->add(h + "mlp.proj", N, 4 * C, C)});
      }
      fp8_->finish(false);  // its fp32 work memory: engine slots free during each call (fp8_work)
    }
    tokens_.assign(N, 0);
    targets_.assign(N, 0);
    dlosses_.assign(N, 0.0f);
    // Per-layer loss scaling: four slots per block, in the order of enum ScaledSlot.
    for (std::size_t l = 0; l < L; ++l) {
      const std::string h = layer_prefix(l);
      const LayerParams& lp = params_[l];
      scaled_layer(h + "attn.qkv", static_cast<std::int64_t>(3 * C), {lp.qkvw, lp.qkvb});
      scaled_layer(h + "attn.proj", static_cast<std::int64_t>(C), {lp.projw, lp.projb});
      scaled_layer(h + "mlp.fc", static_cast<std::int64_t>(4 * C), {lp.fcw, lp.fcb});
      scaled_layer(h + "mlp.proj", static_cast<std::int64_t>(C), {lp.fcprojw, lp.fcprojb});
    }

    init_weights();
    engine_->weights_updated();
    prepare_gemms();
  }

  std::size_t losses_per_batch() const noexcept override { return config_.batch * config_.context; }

  ForwardResult forward(std::span<const TokenId> inputs, std::span<const TokenId> targets, std::size_t rows) override {
    const std::size_t B = config_.batch, T = config_.context, C = config_.channels, V = config_.vocab;
    const std::size_t NH = config_.heads;
    check_batch("gpt forward", inputs, targets, rows, B, T, V);
    const std::size_t N = rows * T;
    std::copy_n(inputs.begin(), N, tokens_.begin());
    std::copy_n(targets.begin(), N, targets_.begin());
    rows_ = rows;
    Engine& e = *engine_;
    Arena& a = e.acts();
    Gemm& g = e.gemm();
    const std::span<const TokenId> tok(tokens_.data(), N), tgt(targets_.data(), N);

    std::span<float> res = e.target(enc_, kResidualSlot, N * C);
    embedding_forward(res, tok, e.w(wte_), e.w(wpe_), rows, T, C, V);
    e.commit(enc_, res);
    // Each layer norm reads the residual stream where the add before it (or the embedding)
    // left it: the blocks' norms run in the stages of that add (linear_residual).
    layernorm_stage(ln1_of(0, N), res, N);
    for (std::size_t l = 0; l < config_.layers; ++l) {
      const LayerParams& p = params_[l];
      const LayerActs& s = acts_[l];
      const std::span<float> ln = e.target(s.ln1, kNarrowSlot, N * C);
      std::span<float> qkv = e.target(s.qkv, kWideSlot, N * 3 * C);
      linear(l, &LayerFp8::qkv, qkv, ln, s.ln1, p.qkvw, p.qkvb, N, C, 3 * C, s.qkv);
      std::span<float> y = e.target(s.atty, kNarrowSlot, N * C);
      // fp32 values of qkv: oneDNN 2.6 has no fast bf16 kernel for the per-head strided
      // views (Gemm widens them), and qkv's fp32 values are at hand (docs/gemm.md).
      attention_forward(e.head_gemms(), y, a.f32(preatt_, rows * NH * T * T), a.f32(s.att, rows * NH * T * T),
                        view(qkv.data(), N, 3 * C), rows, T, C, NH);
      commit_linear_input(s.atty, y);
      std::span<float> proj = e.target(tmp_, kProjectionSlot, N * C);
      std::span<float> res2 = e.target(s.res2, kResidualSlot, N * C);
      const Norm n2{e.target(s.ln2, kNarrowSlot, N * C), s.ln2, s.ln2_mean, s.ln2_rstd, p.ln2w, p.ln2b, linear_input()};
      linear_residual(l, &LayerFp8::proj, proj, y, s.atty, p.projw, p.projb, N, C, res2, s.res2, res, n2);
      res = res2;
      const std::span<float> ln2 = n2.out;
      std::span<float> h = e.target(s.fch, kWideSlot, N * 4 * C);
      std::span<float> hg = e.target(s.fchg, kGeluSlot, N * 4 * C);
      if (fp8_) {
        linear(l, &LayerFp8::fc, h, ln2, s.ln2, p.fcw, p.fcb, N, C, 4 * C, s.fch);
        gelu_forward(hg, h);
        commit_linear_input(s.fchg, hg);
      } else {
        // fc's GEMM, then per block: its bias and commit, GELU and its commit.
        linear_forward(e.gemm(), h, e.operand(s.ln2, ln2, N, C), e.weight_operand(p.fcw, 4 * C, C), {}, N, C, 4 * C);
        const std::span<const float> fcb = e.w(p.fcb);
        auto bias = [&](std::size_t r0, std::size_t r1) { add_bias_rows(rows_of(h, 4 * C, r0, r1), fcb, r1 - r0, 4 * C); };
        auto gelu = [&](std::size_t r0, std::size_t r1) { gelu_forward(rows_of(hg, 4 * C, r0, r1), rows_of(h, 4 * C, r0, r1)); };
        const Engine::Stage st[] = {Engine::stage(bias, s.fch, h, 4 * C),
                                    Engine::stage(gelu, s.fchg, hg, 4 * C, Engine::Commit::operand)};
        e.run_stages(N, st, nullptr);
      }
      std::span<float> fp = e.target(tmp_, kProjectionSlot, N * C);
      std::span<float> res3 = e.target(s.res3, kResidualSlot, N * C);
      const bool last = l + 1 == config_.layers;
      linear_residual(l, &LayerFp8::fcproj, fp, hg, s.fchg, p.fcprojw, p.fcprojb, N, 4 * C, res3, s.res3, res,
                      last ? lnf_of(N) : ln1_of(l + 1, N));
      res = res3;
    }
    const std::span<float> lf = e.target(lnf_, kNarrowSlot, N * C);
    std::span<float> logits = e.target(logits_, kWideSlot, N * V);
    linear_forward(g, logits, e.operand(lnf_, lf, N, C), e.weight_operand(wte_, V, C), {}, N, C, V);
    // Per block: the logits' commit, then the softmax and loss of those rows.
    const std::span<float> losses = a.f32(losses_, N);
    const std::span<float> probs = a.f32(probs_, N * V);
    auto none = [](std::size_t, std::size_t) {};
    auto softmax = [&](std::size_t r0, std::size_t r1) {
      softmax_crossentropy_forward(losses.subspan(r0, r1 - r0), rows_of(probs, V, r0, r1), rows_of(logits, V, r0, r1),
                                   tgt.subspan(r0, r1 - r0), r1 - r0, 1, V);
    };
    const Engine::Stage st[] = {Engine::stage(none, logits_, logits, V),
                                Engine::stage(softmax, 0, probs, V, Engine::Commit::none)};
    e.run_stages(N, st, nullptr);
    return finish_forward(losses, N);
  }

  void backward(float dloss) override {
    const std::size_t B = config_.batch, T = config_.context, C = config_.channels, V = config_.vocab;
    const std::size_t NH = config_.heads, N = B * T;
    if (rows_ != B) throw std::logic_error("gpt backward: expected a full-batch forward before backward");
    Engine& e = *engine_;
    Arena& a = e.acts();
    Gemm& g = e.gemm();
    const std::span<const TokenId> tok(tokens_.data(), N), tgt(targets_.data(), N);
    e.begin_backward();
    std::fill(dlosses_.begin(), dlosses_.end(), dloss);

    // Ops that overwrite their whole output get an unzeroed slot and the storing variant.
    std::span<float> dlogits = e.scratch(kWideGradSlot, N * V);
    {
      const std::span<const float> probs = a.f32(probs_, N * V);
      auto ce = [&](std::size_t r0, std::size_t r1) {
        crossentropy_softmax_backward_store(rows_of(dlogits, V, r0, r1), std::span<const float>(dlosses_).subspan(r0, r1 - r0),
                                            rows_of(probs, V, r0, r1), tgt.subspan(r0, r1 - r0), r1 - r0, 1, V);
      };
      // Read by GEMMs only (no bias).
      const Engine::Stage st[] = {Engine::stage(ce, dlogits_, dlogits, V, Engine::Commit::grad_operand, logits_label_)};
      e.run_stages(N, st, &stats_);
    }
    std::span<float> dlf = e.zeroed(kNarrowGradSlot, N * C);
    linear_backward(g, dlf, e.dw(wte_), {}, dlogits, e.operand(dlogits_, dlogits, N, V),
                    e.saved_operand(lnf_, kSavedSlot, N, C), e.weight_operand(wte_, V, C), N, C, V);
    e.commit_grad(dmid_, dlf, stats_, lnf_label_);
    std::span<float> dres = e.scratch(kResidualGradSlot, N * C);
    const std::size_t last = config_.layers - 1;
    layernorm_backward_stage(dres, {}, lnfw_, lnfb_, dlf, acts_[last].res3, lnf_mean_, lnf_rstd_, last_res_label_);

    for (std::size_t l = config_.layers; l-- > 0;) {
      const LayerParams& p = params_[l];
      const LayerActs& s = acts_[l];
      const LayerLabels& lb = labels_[l];
      // res3 = res2 + proj(gelu(fc(ln2(res2)))): dres flows to both. Per-layer scaling: the
      // branch's gradients carry the factors of its Linears (f_mp, then f_mp * f_fc) and
      // return to the residual stream's scale before they join it.
      const double f_mp = scale_layer(scaled_slot(l, kMlpProj), dres, e.w(p.fcprojw), 1.0);
      std::span<float> dhg = e.zeroed(kWideGradSlot, N * 4 * C);
      if (fp8_) fp8_->backward(g, fp8_ids_[l].fcproj, dhg, e.dw(p.fcprojw), e.dw(p.fcprojb), dres, e.w(p.fcprojw),
                               fp8_work({kSavedSlot, kFcGradSlot, kAttnResidualGradSlot}));
      else linear_backward(g, dhg, e.dw(p.fcprojw), e.dw(p.fcprojb), dres, e.operand(dres_, dres, N, C),
                           e.saved_operand(s.fchg, kSavedSlot, N, 4 * C), e.weight_operand(p.fcprojw, C, 4 * C), N,
                           4 * C, C);
      rescale(dres, 1.0 / f_mp);
      std::span<float> dh = e.scratch(kFcGradSlot, N * 4 * C);
      {
        // Per block: dhg's commit, then GELU backward on those rows (fch decoded there) and
        // dh's commit (dh's codes replace dhg's in dbig_: nothing reads dhg's).
        auto none = [](std::size_t, std::size_t) {};
        auto gelu = [&](std::size_t r0, std::size_t r1) {
          const std::span<const float> x = e.load_part(s.fch, kSavedSlot, r0 * 4 * C, (r1 - r0) * 4 * C);
          gelu_backward_store(rows_of(dh, 4 * C, r0, r1), x, rows_of(dhg, 4 * C, r0, r1));
        };
        const Engine::Stage st[] = {Engine::stage(none, dbig_, dhg, 4 * C, Engine::Commit::grad, lb.fcproj_in),
                                    Engine::stage(gelu, dbig_, dh, 4 * C, Engine::Commit::grad, lb.fc_out)};
        e.run_stages(N, st, &stats_);
      }
      const double f_fc = scale_layer(scaled_slot(l, kMlpFc), dh, e.w(p.fcw), f_mp);
      std::span<float> dln2 = e.zeroed(kNarrowGradSlot, N * C);
      if (fp8_) fp8_->backward(g, fp8_ids_[l].fc, dln2, e.dw(p.fcw), e.dw(p.fcb), dh, e.w(p.fcw),
                               fp8_work({kSavedSlot, kAttnResidualGradSlot, kWideGradSlot}));  // dhg: consumed
      else linear_backward(g, dln2, e.dw(p.fcw), e.dw(p.fcb), dh, e.operand(dbig_, dh, N, 4 * C),
                           e.saved_operand(s.ln2, kSavedSlot, N, C), e.weight_operand(p.fcw, 4 * C, C), N, C, 4 * C);
      e.commit_grad(dmid_, dln2, stats_, lb.ln2_out);
      rescale(dln2, 1.0 / (f_mp * f_fc));
      std::span<float> dres2 = e.scratch(kAttnResidualGradSlot, N * C);
      layernorm_backward_stage(dres2, dres, p.ln2w, p.ln2b, dln2, s.res2, s.ln2_mean, s.ln2_rstd, lb.res2);
      // res2 = res + proj(attention(qkv(ln1(res)))), scaled as the MLP branch.
      const double f_ap = scale_layer(scaled_slot(l, kAttnProj), dres2, e.w(p.projw), 1.0);
      std::span<float> dy = e.zeroed(kNarrowGradSlot, N * C);
      if (fp8_) fp8_->backward(g, fp8_ids_[l].proj, dy, e.dw(p.projw), e.dw(p.projb), dres2, e.w(p.projw),
                               fp8_work({kSavedSlot, kFcGradSlot, kWideGradSlot}));
      else linear_backward(g, dy, e.dw(p.projw), e.dw(p.projb), dres2, e.operand(dres_, dres2, N, C),
                           e.saved_operand(s.atty, kSavedSlot, N, C), e.weight_operand(p.projw, C, C), N, C, C);
      rescale(dres2, 1.0 / f_ap);
      e.commit_grad(dmid_, dy, stats_, lb.attproj_in);
      std::span<float> dqkv = e.zeroed(kWideGradSlot, N * 3 * C);
      attention_backward(e.head_gemms(), dqkv, a.f32(dpreatt_, B * NH * T * T), a.f32(datt_, B * NH * T * T),
                         view(dy.data(), N, C), view(e.load(s.qkv, kSavedSlot, N * 3 * C).data(), N, 3 * C),
                         a.f32(s.att, B * NH * T * T), B, T, C, NH);
      e.commit_grad(dbig_, dqkv, stats_, lb.qkv_out);
      const double f_qkv = scale_layer(scaled_slot(l, kAttnQkv), dqkv, e.w(p.qkvw), f_ap);
      std::span<float> dln1 = e.zeroed(kNarrowGradSlot, N * C);
      if (fp8_) fp8_->backward(g, fp8_ids_[l].qkv, dln1, e.dw(p.qkvw), e.dw(p.qkvb), dqkv, e.w(p.qkvw),
                               fp8_work({kSavedSlot, kFcGradSlot}));
      else linear_backward(g, dln1, e.dw(p.qkvw), e.dw(p.qkvb), dqkv, e.operand(dbig_, dqkv, N, 3 * C),
                           e.saved_operand(s.ln1, kSavedSlot, N, C), e.weight_operand(p.qkvw, 3 * C, C), N, C, 3 * C);
      e.commit_grad(dmid_, dln1, stats_, lb.ln1_out);
      rescale(dln1, 1.0 / (f_ap * f_qkv));
      const std::size_t res_in = l == 0 ? enc_ : acts_[l - 1].res3;
      layernorm_backward_stage(dres, dres2, p.ln1w, p.ln1b, dln1, res_in, s.ln1_mean, s.ln1_rstd, lb.res_in);
    }
    embedding_backward(e.dw(wte_), e.dw(wpe_), dres, tok, B, T, C, V);
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
      const Act& act = a.act(i);
      const std::size_t b = act.numel * dtype_size(act.dtype);
      if (i < saved_bytes_end_) m.activation_bytes += b;
      else if (i >= dlogits_) m.gradient_bytes += b;
      else m.scratch_bytes += b;
    }
    m.scratch_bytes += engine_->scratch_bytes();
    if (fp8_) {
      m.activation_bytes += fp8_->saved_bytes();  // saved for backward, as fp8 codes + scales
      m.fp8_activation_bytes = fp8_->saved_bytes();
      m.scratch_bytes += fp8_->scratch_bytes();
    }
    return m;
  }

  std::string describe() const override {
    return "gpt: " + std::to_string(config_.layers) + " layers, " + std::to_string(config_.heads) + " heads, " +
           std::to_string(config_.channels) + " channels, context " + std::to_string(config_.context) + ", vocab " +
           std::to_string(config_.vocab) + " (" + group_thousands(store_->param_count()) + " parameters)";
  }

 private:
  // Engine scratch slots as fp8 work memory (Fp8Linears::Work): slots no live value
  // occupies during the call (at most three).
  Fp8Linears::Work fp8_work(std::initializer_list<std::size_t> slots) {
    std::size_t i = 0;
    for (std::size_t s : slots) fp8_work_.at(i++) = engine_->scratch(s, slot_floats_);
    return {fp8_work_.data(), slots.size()};
  }

  // How an activation that only the next block Linear reads is committed: without
  // decoding it back when that Linear multiplies the stored bf16 (Engine::commit_operand);
  // not in the fp8 presets, whose Linears quantize the fp32 values.
  Engine::Commit linear_input() const noexcept { return fp8_ ? Engine::Commit::value : Engine::Commit::operand; }
  void commit_linear_input(std::size_t act, std::span<float> v) {
    if (fp8_) engine_->commit(act, v);
    else engine_->commit_operand(act, v);
  }

  template <class T>
  static std::span<T> rows_of(std::span<T> v, std::size_t cols, std::size_t r0, std::size_t r1) {
    return v.subspan(r0 * cols, (r1 - r0) * cols);
  }

  // A layer norm of the residual stream: its output (target), the activation it is
  // committed to and how, its statistics and parameters.
  struct Norm {
    std::span<float> out;
    std::size_t act, mean, rstd, w, b;
    Engine::Commit kind;
  };
  Norm ln1_of(std::size_t l, std::size_t N) {
    const LayerActs& s = acts_[l];
    return {engine_->target(s.ln1, kNarrowSlot, N * config_.channels), s.ln1, s.ln1_mean, s.ln1_rstd, params_[l].ln1w,
            params_[l].ln1b, linear_input()};
  }
  Norm lnf_of(std::size_t N) {  // read by the LM head's GEMM only
    return {engine_->target(lnf_, kNarrowSlot, N * config_.channels), lnf_, lnf_mean_, lnf_rstd_, lnfw_, lnfb_,
            Engine::Commit::operand};
  }

  // The stage computing n.out = layernorm(x) over rows [r0, r1); f must outlive its use.
  auto norm_rows(const Norm& n, std::span<const float> x, std::size_t N) {
    Engine& e = *engine_;
    const std::size_t C = config_.channels;
    return [n, x, C, mn = e.acts().f32(n.mean, N), rs = e.acts().f32(n.rstd, N), wt = e.w(n.w),
            bs = e.w(n.b)](std::size_t r0, std::size_t r1) {
      layernorm_forward(rows_of(n.out, C, r0, r1), mn.subspan(r0, r1 - r0), rs.subspan(r0, r1 - r0),
                        rows_of(x, C, r0, r1), wt, bs, r1 - r0, C);
    };
  }

  // n.out = layernorm(x) over N rows, committed block by block.
  void layernorm_stage(const Norm& n, std::span<const float> x, std::size_t N) {
    auto norm = norm_rows(n, x, N);
    const Engine::Stage st[] = {Engine::stage(norm, n.act, n.out, config_.channels, n.kind)};
    engine_->run_stages(N, st, nullptr);
  }

  // The residual stream's gradient through a layer norm: dx = base + layernorm'(dout) (base
  // empty: dx = layernorm'(dout)), the norm's parameter gradients accumulated, dx committed
  // to dres_ under `label`. The parameter gradients need every row of dout and x first;
  // then per block: base copied, dx added, committed.
  void layernorm_backward_stage(std::span<float> dx, std::span<const float> base, std::size_t w, std::size_t b,
                                std::span<const float> dout, std::size_t x_act, std::size_t mean, std::size_t rstd,
                                std::size_t label) {
    Engine& e = *engine_;
    const std::size_t N = config_.batch * config_.context, C = config_.channels;
    const std::span<const float> x = e.load(x_act, kSavedSlot, N * C);
    const std::span<const float> mn = e.acts().f32(mean, N), rs = e.acts().f32(rstd, N), wt = e.w(w);
    layernorm_backward_params(e.dw(w), e.dw(b), dout, x, mn, rs, N, C);
    auto grad = [&](std::size_t r0, std::size_t r1) {
      const std::span<float> d = rows_of(dx, C, r0, r1);
      if (!base.empty()) std::memcpy(d.data(), base.data() + r0 * C, d.size() * sizeof(float));
      layernorm_backward_dx(d, rows_of(dout, C, r0, r1), rows_of(x, C, r0, r1), wt, mn.subspan(r0, r1 - r0),
                            rs.subspan(r0, r1 - r0), r1 - r0, C, !base.empty());
    };
    const Engine::Stage st[] = {Engine::stage(grad, dres_, dx, C, Engine::Commit::grad, label)};
    e.run_stages(N, st, &stats_);
  }

  // A block Linear, out = x W^T + b, committed to out_act: fp8 (fp8 presets) or the GEMM
  // on the engine's operands (bf16 storage on the native path), then per block the bias
  // and the commit. x holds the values of activation x_act.
  void linear(std::size_t layer, std::size_t LayerFp8::*which, std::span<float> out, std::span<const float> x,
              std::size_t x_act, std::size_t w, std::size_t b, std::size_t N, std::size_t C, std::size_t OC,
              std::size_t out_act) {
    Engine& e = *engine_;
    if (fp8_) {
      // Work memory: the one slot the forward leaves unused (enum ForwardSlot).
      fp8_->forward(e.gemm(), fp8_ids_[layer].*which, out, x, e.w(w), e.w(b), N, fp8_work({kAttnResidualGradSlot}));
      e.commit(out_act, out);
      return;
    }
    linear_forward(e.gemm(), out, e.operand(x_act, x, N, C), e.weight_operand(w, OC, C), {}, N, C, OC);
    const std::span<const float> bias = e.w(b);
    auto add = [&](std::size_t r0, std::size_t r1) { add_bias_rows(rows_of(out, OC, r0, r1), bias, r1 - r0, OC); };
    const Engine::Stage st[] = {Engine::stage(add, out_act, out, OC)};
    e.run_stages(N, st, nullptr);
  }

  // A block Linear whose output joins the residual stream: out = x W^T + b committed to
  // tmp_ (rounded as the Linear's output), then sum = res + out committed to sum_act, then
  // the next layer norm of sum (`next`); per block on the non-fp8 path. sum may alias res.
  void linear_residual(std::size_t layer, std::size_t LayerFp8::*which, std::span<float> out, std::span<const float> x,
                       std::size_t x_act, std::size_t w, std::size_t b, std::size_t N, std::size_t C,
                       std::span<float> sum, std::size_t sum_act, std::span<const float> res, const Norm& next) {
    Engine& e = *engine_;
    const std::size_t OC = config_.channels;
    if (fp8_) {
      linear(layer, which, out, x, x_act, w, b, N, C, OC, tmp_);
      residual_forward(sum, res, out);
      e.commit(sum_act, sum);
      layernorm_stage(next, sum, N);
      return;
    }
    linear_forward(e.gemm(), out, e.operand(x_act, x, N, C), e.weight_operand(w, OC, C), {}, N, C, OC);
    const std::span<const float> bias = e.w(b);
    auto add = [&](std::size_t r0, std::size_t r1) { add_bias_rows(rows_of(out, OC, r0, r1), bias, r1 - r0, OC); };
    auto residual = [&](std::size_t r0, std::size_t r1) {
      residual_forward(rows_of(sum, OC, r0, r1), rows_of(res, OC, r0, r1), rows_of(out, OC, r0, r1));
    };
    auto norm = norm_rows(next, sum, N);
    const Engine::Stage st[] = {Engine::stage(add, tmp_, out, OC), Engine::stage(residual, sum_act, sum, OC),
                                Engine::stage(norm, next.act, next.out, OC, next.kind)};
    e.run_stages(N, st, nullptr);
  }

  void init_weights() {
    std::vector<float> flat(store_->flat_size(), 0.0f);
    const float residual_std = 0.02f / std::sqrt(2.0f * static_cast<float>(config_.layers));
    for (std::size_t i = 0; i < store_->tensor_count(); ++i) {
      const std::string& n = store_->spec(i).name;
      std::span<float> w(flat.data() + store_->offset(i), store_->numel(i));
      if (n.ends_with(".bias")) init_constant(w, 0.0f);
      else if (n.find("ln") != std::string::npos) init_constant(w, 1.0f);
      else if (n.ends_with("proj.weight")) init_normal(w, residual_std, config_.seed, i);
      else init_normal(w, 0.02f, config_.seed, i);
    }
    store_->set_weights_of_record(flat);
  }

  // Creates every GEMM primitive now, so training allocates nothing later.
  void prepare_gemms() {
    const std::size_t N = config_.batch * config_.context, C = config_.channels, V = config_.vocab;
    Gemm& g = engine_->gemm();
    float x = 0;  // only shapes matter to prepare(); pointers must be non-null
    // The operands' dtype: bf16 storage on the native path (engine.hpp), else f32; the
    // fp8 presets' block Linears multiply fp32 values of fp8 operands (fp8_linear.cpp).
    const DType d = engine_->operand_dtype();
    const DType block = fp8_ ? DType::f32 : d;
    auto fwd = [&](std::size_t n, std::size_t in, std::size_t out, DType t) {
      auto op = [&](std::size_t rows, std::size_t cols) { return MatrixView{&x, t, rows, cols, 0}; };
      g.prepare(op(n, in), op(out, in), output(&x, n, out), {.trans_a = Trans::no, .trans_b = Trans::yes});
      g.prepare(op(n, out), op(out, in), output(&x, n, in), {.trans_a = Trans::no, .trans_b = Trans::no,
                                                             .alpha = 1.0f, .beta = 1.0f});
      g.prepare(op(n, out), op(n, in), output(&x, out, in), {.trans_a = Trans::yes, .trans_b = Trans::no,
                                                             .alpha = 1.0f, .beta = 1.0f});
    };
    fwd(N, C, 3 * C, block);
    fwd(N, C, C, block);
    fwd(N, C, 4 * C, block);
    fwd(N, 4 * C, C, block);
    fwd(N, C, V, d);
    attention_prepare(engine_->head_gemms(), DType::f32, DType::f32, config_.context, C, config_.heads);
  }

  ForwardResult finish_forward(std::span<const float> losses, std::size_t n) {
    ForwardResult r;
    r.count = n;
    for (float l : losses) r.loss_sum += static_cast<double>(l);
    r.finite = std::isfinite(r.loss_sum);
    if (!r.finite) r.first_nonfinite = first_nonfinite_activation(n);
    return r;
  }

  std::string first_nonfinite_activation(std::size_t N) const {
    const std::size_t C = config_.channels;
    std::vector<std::pair<std::size_t, std::size_t>> order{{enc_, N * C}};
    for (const LayerActs& s : acts_) {
      if (fp8_) {  // the Linear inputs are not kept (their shared buffer holds the last one)
        order.insert(order.end(), {{s.qkv, 3 * N * C}, {s.res2, N * C}, {s.fch, 4 * N * C}, {s.res3, N * C}});
        continue;
      }
      order.insert(order.end(), {{s.ln1, N * C}, {s.qkv, 3 * N * C}, {s.atty, N * C}, {s.res2, N * C},
                                 {s.ln2, N * C}, {s.fch, 4 * N * C}, {s.fchg, 4 * N * C}, {s.res3, N * C}});
    }
    order.insert(order.end(), {{lnf_, N * C}, {logits_, N * config_.vocab}, {probs_, N * config_.vocab}});
    for (auto [act, n] : order) {
      if (engine_->first_nonfinite(act, n) != std::numeric_limits<std::size_t>::max()) {
        return engine_->acts().act(act).name;
      }
    }
    return "losses";
  }

  Engine& engine() noexcept override { return *engine_; }
  const Engine& engine() const noexcept override { return *engine_; }
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Fp8Linears> fp8_;
  std::vector<LayerFp8> fp8_ids_;
  std::vector<LayerParams> params_;
  std::vector<LayerActs> acts_;
  std::vector<LayerLabels> labels_;
  std::size_t wte_ = 0, wpe_ = 0, lnfw_ = 0, lnfb_ = 0;
  std::size_t enc_ = 0, lnf_ = 0, lnf_mean_ = 0, lnf_rstd_ = 0, logits_ = 0, probs_ = 0, losses_ = 0;
  std::size_t tmp_ = 0, preatt_ = 0, dpreatt_ = 0, datt_ = 0, dlogits_ = 0, dbig_ = 0, dmid_ = 0, dres_ = 0;
  std::size_t saved_bytes_end_ = 0;
  std::size_t slot_floats_ = 0;
  std::array<std::span<float>, 3> fp8_work_{};
  std::size_t logits_label_ = 0, lnf_label_ = 0, last_res_label_ = 0;
  std::size_t rows_ = 0;
  std::vector<TokenId> tokens_, targets_;
  std::vector<float> dlosses_;
};

}  // namespace

std::unique_ptr<Model> make_gpt(const ModelConfig& c, PrecisionPolicy p, unsigned state_slots, const StateFormats& formats,
                                std::unique_ptr<Fp8Linears> linears) {
  return std::make_unique<Gpt>(c, p, state_slots, formats, std::move(linears));
}

}  // namespace mixprec::nn::detail
