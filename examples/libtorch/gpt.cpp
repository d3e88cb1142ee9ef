// A small GPT written with torch::nn (pre-norm blocks, tied embeddings, GELU tanh),
// trained on mixprec's embedded corpus with fp16 autocast on the CPU and
// mixprec::torch::GradScaler (docs/libtorch.md).
//
//   libtorch_gpt [--steps N] [--log-every K] [--preset NAME] [--telemetry DIR] [--eval-every K]
//                [--inject-overflow-at S[,S...]]
//
// --eval-every K: the validation loss (the corpus's held-out last tenth) every K steps and
// at the last. --inject-overflow-at: writes inf into blocks.1.fc.weight's gradient after
// backward at those steps, as an fp16 overflow would; the scaler skips them and names it.
// At the end it prints the scaler's share of the step (scale, unscale, update).
//
// --telemetry DIR: a run folder for `mixprec report DIR` (activation-gradient counts of
// every block's output through tensor hooks, per-parameter gradient and weight |max|).
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <algorithm>
#include <string>
#include <vector>

#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"
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

constexpr const char* kUsage =
    "usage: libtorch_gpt [--steps N] [--log-every K] [--preset NAME] [--telemetry DIR] [--eval-every K]\n"
    "                    [--inject-overflow-at S[,S...]]";

struct Options {
  std::uint64_t steps = 200;
  std::uint64_t log_every = 10;
  std::string preset = "mixprec";
  std::string telemetry_dir;         // empty: no run folder
  std::uint64_t eval_every = 0;      // 0: no validation loss
  std::vector<std::uint64_t> inject;  // steps whose gradient gets an inf written into it
};

// Every flag is checked before anything runs: an unknown flag, a missing or malformed
// value, a step outside the run, or an unknown preset is an error naming what is allowed.
Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") throw std::invalid_argument("");
    const bool known = flag == "--steps" || flag == "--log-every" || flag == "--preset" || flag == "--telemetry" ||
                       flag == "--eval-every" || flag == "--inject-overflow-at";
    if (!known) throw std::invalid_argument("unknown option '" + flag + "'");
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    // A count in the number grammar of every mixprec key (digits, 2e3, 20.0).
    const auto count = [&](std::string_view text) {
      const mixprec::keys::Spec spec{.name = flag, .kind = mixprec::keys::Kind::integer, .int_min = 0};
      return std::get<mixprec::keys::Integer>(mixprec::keys::parse_text(spec, text)).magnitude;
    };
    if (flag == "--steps") o.steps = count(value);
    else if (flag == "--log-every") o.log_every = count(value);
    else if (flag == "--eval-every") o.eval_every = count(value);
    else if (flag == "--preset") o.preset = value;
    else if (flag == "--telemetry") {
      if (value.empty()) throw std::invalid_argument("--telemetry: expected a folder, found ''");
      o.telemetry_dir = value;
    }
    else {
      std::size_t pos = 0;
      while (pos <= value.size()) {
        const std::size_t comma = std::min(value.find(',', pos), value.size());
        o.inject.push_back(count(std::string_view(value).substr(pos, comma - pos)));
        pos = comma + 1;
      }
    }
  }
  if (o.steps == 0 || o.steps > 1'000'000) throw std::invalid_argument("--steps: expected 1 to 1000000, found " + std::to_string(o.steps));
  if (o.log_every == 0) throw std::invalid_argument("--log-every: expected at least 1, found 0");
  for (std::uint64_t s : o.inject) {
    if (s == 0 || s > o.steps) {
      throw std::invalid_argument("--inject-overflow-at: step " + std::to_string(s) + " is outside the run (1 to " +
                                  std::to_string(o.steps) + ")");
    }
  }
  (void)mixprec::loss_scale_preset(o.preset);  // an unknown name throws, listing the presets
  return o;
}


// The mean loss over the validation batches (no gradients, the same autocast).
double validation_loss(Gpt& model, const std::vector<std::pair<Tensor, Tensor>>& batches, int64_t vocab_size) {
  ::torch::NoGradGuard ng;
  double sum = 0;
  for (const auto& [x, y] : batches) {
    mixprec::torch::Autocast ac(at::kCPU, at::kHalf);
    const Tensor logits = model->forward(x);
    sum += ::torch::nn::functional::cross_entropy(logits.to(::torch::kFloat).view({-1, vocab_size}), y.view({-1}))
               .item<double>();
  }
  return sum / static_cast<double>(batches.size());
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  Options opt_in;
  try {
    opt_in = parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    if (*e.what()) std::fprintf(stderr, "libtorch_gpt: %s\n", e.what());
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  const Options& o = opt_in;
  try {
  constexpr int64_t kBatch = 16, kContext = 32, kDim = 64, kHeads = 4;
  constexpr int kLayers = 2;

  // The library's embedded corpus (a seeded English-like grammar), word tokens; the last
  // tenth is held out for the validation loss.
  mixprec::nn::CorpusOptions co;
  co.tokens = 200'000;
  const std::string text = mixprec::nn::generate_corpus(co);
  const mixprec::nn::Vocabulary vocab = mixprec::nn::Vocabulary::build(text, {mixprec::nn::VocabKind::words, 512});
  const std::vector<mixprec::nn::TokenId> ids32 = vocab.encode(text);
  std::vector<int64_t> ids(ids32.begin(), ids32.end());
  const Tensor data = ::torch::tensor(ids, ::torch::kLong);
  const auto vocab_size = static_cast<int64_t>(vocab.size());
  const int64_t train_end = data.size(0) * 9 / 10;

  auto batch_at = [&](const Tensor& starts) {
    const Tensor idx = starts.unsqueeze(1) + ::torch::arange(kContext, ::torch::kLong).unsqueeze(0);
    return std::pair<Tensor, Tensor>{data.index({idx}), data.index({idx + 1})};
  };
  std::vector<std::pair<Tensor, Tensor>> val_batches;  // 4 fixed batches of the held-out tail
  for (int64_t b = 0; b < 4; ++b) {
    val_batches.push_back(batch_at(train_end + (b * kBatch + ::torch::arange(kBatch, ::torch::kLong)) * kContext));
  }

  ::torch::manual_seed(1);
  Gpt model(vocab_size, kContext, kDim, kHeads, kLayers);
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  constexpr double kLr = 3e-3;
  ::torch::optim::AdamW opt(model->parameters(), ::torch::optim::AdamWOptions(kLr).weight_decay(0.01));
  mixprec::torch::GradScaler scaler(mixprec::loss_scale_preset(o.preset));
  scaler.set_names(*model);
  std::printf("libtorch GPT: %lld parameters, vocabulary %lld, %zu corpus tokens; fp16 autocast (CPU), "
              "loss scale preset %s\n",
              static_cast<long long>(n_params), static_cast<long long>(vocab_size), ids.size(), o.preset.c_str());

  std::unique_ptr<mixprec::torch::Telemetry> tel;
  if (!o.telemetry_dir.empty()) {
    try {  // a folder that is not new or empty is a usage error (exit 2), as mixprec train's --out
      tel = std::make_unique<mixprec::torch::Telemetry>(
          o.telemetry_dir, mixprec::torch::TelemetryOptions{.precision = "fp16",
                                                            .loss_scale = o.preset,
                                                            .loss_scale_config = scaler.loss_scale().config()});
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "libtorch_gpt: --telemetry: %s\n", e.what());
      return 2;
    }
  }
  const auto named = model->named_parameters();

  ::torch::manual_seed(2);
  int skipped = 0;
  double step_seconds = 0, scaler_seconds = 0;  // the scaler's share of the training step
  double record_seconds = 0;                     // the telemetry's record() (its hooks run in backward)
  const auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t step = 1; step <= o.steps; ++step) {
    const auto ts = std::chrono::steady_clock::now();
    const auto [x, y] = batch_at(::torch::randint(0, train_end - kContext - 1, {kBatch}, ::torch::kLong));
    Tensor logits;
    {
      mixprec::torch::Autocast ac(at::kCPU, at::kHalf);
      logits = model->forward(x, tel.get());
    }
    const Tensor loss = ::torch::nn::functional::cross_entropy(logits.to(::torch::kFloat).view({-1, vocab_size}),
                                                               y.view({-1}));
    auto tc = std::chrono::steady_clock::now();
    Tensor scaled = scaler.scale(loss);
    scaler_seconds += seconds_since(tc);
    scaled.backward();
    if (std::find(o.inject.begin(), o.inject.end(), step) != o.inject.end()) {
      ::torch::NoGradGuard ng;  // what an fp16 overflow in backward leaves behind
      named["blocks.1.fc.weight"].mutable_grad()[0][0] = INFINITY;
    }
    tc = std::chrono::steady_clock::now();
    scaler.unscale(opt);  // check + unscale + norm: one pass over the gradients
    scaler_seconds += seconds_since(tc);
    const mixprec::torch::StepOutcome out = scaler.step(opt, {.max_grad_norm = 1.0f});  // clip, opt.step()
    std::optional<double> val;
    if (o.eval_every && (step % o.eval_every == 0 || step == o.steps)) val = validation_loss(model, val_batches, vocab_size);
    const double secs = seconds_since(ts);
    if (tel) {
      const auto tr = std::chrono::steady_clock::now();
      tel->record(named, out, scaler,
                  {.loss = loss.item<double>(), .lr = kLr, .tokens = static_cast<std::uint64_t>(kBatch * kContext),
                   .seconds = secs, .val_loss = val});
      record_seconds += seconds_since(tr);
    }
    tc = std::chrono::steady_clock::now();
    scaler.update();
    scaler_seconds += seconds_since(tc);
    opt.zero_grad();
    step_seconds += seconds_since(ts);
    if (!out.applied) {
      ++skipped;
      std::printf("step %4llu  skipped: inf/NaN first in %s (scale %.0f)\n", static_cast<unsigned long long>(step),
                  out.first_overflow_name.c_str(), static_cast<double>(out.scale));
    }
    if (step % o.log_every == 0 || step == o.steps) {
      std::printf("step %4llu  loss %.4f  grad norm %.3f  scale %.0f  skipped %d  (%.0f ms/step)",
                  static_cast<unsigned long long>(step), loss.item<double>(), out.grad_norm,
                  static_cast<double>(scaler.get_scale()), skipped, 1000.0 * seconds_since(t0) / double(step));
      if (val) std::printf("  val loss %.4f", *val);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  std::printf("scaler (scale, check + unscale + norm, update): %.3f ms of %.1f ms per step (%.2f%%)\n",
              1000.0 * scaler_seconds / double(o.steps), 1000.0 * step_seconds / double(o.steps),
              100.0 * scaler_seconds / step_seconds);
  if (tel) {
    std::printf("telemetry (hooks on %d tensors, record): %.3f ms of %.1f ms per step (%.2f%%; record %.3f ms)\n",
                kLayers + 1, 1000.0 * tel->seconds() / double(o.steps), 1000.0 * step_seconds / double(o.steps),
                100.0 * tel->seconds() / step_seconds, 1000.0 * record_seconds / double(o.steps));
    const auto alerts = tel->finish();
    std::printf("telemetry: %s/log.jsonl (%llu steps, %zu alerts); mixprec report %s\n", tel->dir().c_str(),
                static_cast<unsigned long long>(tel->steps()), alerts.size(), tel->dir().c_str());
  }
  return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_gpt: %s\n", e.what());
    return 1;
  }
}
