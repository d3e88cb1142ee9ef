// A small GPT written with torch::nn (pre-norm blocks, tied embeddings, GELU tanh),
// trained on mixprec's embedded corpus with fp16 autocast on the CPU and
// mixprec::torch::GradScaler (docs/libtorch.md).
//
//   libtorch_gpt [--steps N] [--log-every K] [--preset NAME] [--telemetry DIR]
//
// --telemetry DIR: a run folder for `mixprec report DIR` (activation-gradient counts of
// every block's output through tensor hooks, per-parameter gradient and weight |max|).
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "mixprec/nn/data.hpp"
#include "mixprec/torch/autocast.hpp"
#include "mixprec/torch/grad_scaler.hpp"
#include "mixprec/torch/telemetry.hpp"

namespace {

using at::Tensor;

struct BlockImpl : ::torch::nn::Module {
  BlockImpl(int64_t dim, int64_t heads)
      : heads_(heads),
        ln1(register_module("ln1", ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({dim})))),
        qkv(register_module("qkv", ::torch::nn::Linear(dim, 3 * dim))),
        proj(register_module("proj", ::torch::nn::Linear(dim, dim))),
        ln2(register_module("ln2", ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({dim})))),
        fc(register_module("fc", ::torch::nn::Linear(dim, 4 * dim))),
        fc_out(register_module("fc_out", ::torch::nn::Linear(4 * dim, dim))) {}

  Tensor attention(const Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), d = c / heads_;
    auto parts = qkv(x).view({b, t, 3, heads_, d}).permute({2, 0, 3, 1, 4});  // 3, B, H, T, D
    const Tensor q = parts[0], k = parts[1], v = parts[2];
    Tensor att = ::torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
    const Tensor causal = ::torch::ones({t, t}, ::torch::kBool).triu(1);
    att = ::torch::softmax(att.masked_fill(causal, -INFINITY), -1);
    const Tensor y = ::torch::matmul(att, v).transpose(1, 2).reshape({b, t, c});
    return proj(y);
  }
  Tensor forward(Tensor x) {
    x = x + attention(ln1(x));                                         // pre-norm
    return x + fc_out(::torch::gelu(fc(ln2(x)), "tanh"));
  }
  int64_t heads_;
  ::torch::nn::LayerNorm ln1;
  ::torch::nn::Linear qkv, proj;
  ::torch::nn::LayerNorm ln2;
  ::torch::nn::Linear fc, fc_out;
};
TORCH_MODULE(Block);

struct GptImpl : ::torch::nn::Module {
  GptImpl(int64_t vocab, int64_t context, int64_t dim, int64_t heads, int layers)
      : tok(register_module("tok", ::torch::nn::Embedding(vocab, dim))),
        pos(register_parameter("pos", ::torch::randn({context, dim}) * 0.02)),
        blocks(register_module("blocks", ::torch::nn::ModuleList())),
        ln_f(register_module("ln_f", ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({dim})))) {
    ::torch::NoGradGuard ng;
    tok->weight.normal_(0.0, 0.02);
    for (int i = 0; i < layers; ++i) blocks->push_back(Block(dim, heads));
  }
  Tensor forward(const Tensor& ids, mixprec::torch::Telemetry* tel = nullptr) {
    Tensor x = tok(ids) + pos.slice(0, 0, ids.size(1));
    int i = 0;
    for (auto& m : *blocks) {
      x = m->as<Block>()->forward(x);
      if (tel) tel->watch("blocks." + std::to_string(i++), x);
    }
    Tensor logits = ::torch::matmul(ln_f(x), tok->weight.t());  // tied embeddings
    if (tel) tel->watch("logits", logits);
    return logits;
  }
  ::torch::nn::Embedding tok;
  Tensor pos;
  ::torch::nn::ModuleList blocks;
  ::torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(Gpt);

int arg_int(int argc, char** argv, const std::string& flag, int def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == flag) return std::atoi(argv[i + 1]);
  }
  return def;
}

std::string arg_str(int argc, char** argv, const std::string& flag, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == flag) return argv[i + 1];
  }
  return def;
}

}  // namespace

int main(int argc, char** argv) try {
  const int steps = arg_int(argc, argv, "--steps", 200);
  const int log_every = std::max(1, arg_int(argc, argv, "--log-every", 10));
  const std::string preset = arg_str(argc, argv, "--preset", "mixprec");
  const std::string telemetry_dir = arg_str(argc, argv, "--telemetry", "");
  constexpr int64_t kBatch = 16, kContext = 32, kDim = 64, kHeads = 4;
  constexpr int kLayers = 2;

  // The library's embedded corpus (a seeded English-like grammar), word tokens.
  mixprec::nn::CorpusOptions co;
  co.tokens = 200'000;
  const std::string text = mixprec::nn::generate_corpus(co);
  const mixprec::nn::Vocabulary vocab = mixprec::nn::Vocabulary::build(text, {mixprec::nn::VocabKind::words, 512});
  const std::vector<mixprec::nn::TokenId> ids32 = vocab.encode(text);
  std::vector<int64_t> ids(ids32.begin(), ids32.end());
  const Tensor data = ::torch::tensor(ids, ::torch::kLong);
  const auto vocab_size = static_cast<int64_t>(vocab.size());

  ::torch::manual_seed(1);
  Gpt model(vocab_size, kContext, kDim, kHeads, kLayers);
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  ::torch::optim::AdamW opt(model->parameters(), ::torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset(preset));
  scaler.set_names(*model);
  std::printf("libtorch GPT: %lld parameters, vocabulary %lld, %zu corpus tokens; fp16 autocast (CPU), "
              "loss scale preset %s\n",
              static_cast<long long>(n_params), static_cast<long long>(vocab_size), ids.size(), preset.c_str());

  std::unique_ptr<mixprec::torch::Telemetry> tel;
  if (!telemetry_dir.empty())
    tel = std::make_unique<mixprec::torch::Telemetry>(telemetry_dir,
                                                      mixprec::torch::TelemetryOptions{.precision = "fp16", .loss_scale = preset});
  const auto named = model->named_parameters();

  ::torch::manual_seed(2);
  int skipped = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 1; step <= steps; ++step) {
    const Tensor starts = ::torch::randint(0, data.size(0) - kContext - 1, {kBatch}, ::torch::kLong);
    const Tensor offs = ::torch::arange(kContext, ::torch::kLong);
    const Tensor idx = starts.unsqueeze(1) + offs.unsqueeze(0);
    const Tensor x = data.index({idx}), y = data.index({idx + 1});
    Tensor logits;
    {
      mixprec::torch::Autocast ac(at::kCPU, at::kHalf);
      logits = model->forward(x, tel.get());
    }
    const Tensor loss = ::torch::nn::functional::cross_entropy(logits.to(::torch::kFloat).view({-1, vocab_size}),
                                                               y.view({-1}));
    scaler.scale(loss).backward();
    const mixprec::torch::StepOutcome out = scaler.step(opt, {.max_grad_norm = 1.0f});
    if (tel) tel->record(named, out, scaler, loss.item<double>(), 3e-3, static_cast<std::uint64_t>(kBatch * kContext));
    scaler.update();
    opt.zero_grad();
    if (!out.applied) {
      ++skipped;
      std::printf("step %4d  skipped: inf/NaN first in %s (scale %.0f)\n", step, out.first_overflow_name.c_str(),
                  static_cast<double>(out.scale));
    }
    if (step % log_every == 0 || step == steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("step %4d  loss %.4f  grad norm %.3f  scale %.0f  skipped %d  (%.0f ms/step)\n", step,
                  loss.item<double>(), out.grad_norm, static_cast<double>(scaler.get_scale()), skipped,
                  1000.0 * secs / step);
      std::fflush(stdout);
    }
  }
  if (tel) {
    const auto alerts = tel->finish();
    std::printf("telemetry: %s/log.jsonl (%llu steps, %zu alerts); mixprec report %s\n", tel->dir().c_str(),
                static_cast<unsigned long long>(tel->steps()), alerts.size(), tel->dir().c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "libtorch_gpt: %s\n", e.what());
  return 1;
}
