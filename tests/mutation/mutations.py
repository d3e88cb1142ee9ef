"""The mutations of the mutation check: small, realistic bugs, one at a time.

Each entry: id; file (from the repository root); old, the original text, which
must occur exactly once in the file; new, what replaces it; why, the bug it
models; tests, what must catch it: 'BINARY' or 'BINARY:GTEST_FILTER' (a gtest
program of the build's tests/ folder) or 'ctest:REGEX' (with 'targets' naming
what those ctest tests need built). When the code moves, update 'old': the
driver refuses a list whose original text is missing or ambiguous.
"""

OPTIM = "src/optim/update_impl.hpp"

MUTATIONS = [
    # ---- optimizers ---------------------------------------------------------------------
    dict(id="adam-v-decays-with-beta1", file="src/optim/optimizer.cpp",
         old="a.beta2 = static_cast<float>(s.beta2);",
         new="a.beta2 = static_cast<float>(s.beta1);",
         why="Adam's second moment decays with beta1 instead of beta2",
         tests=["test_optim"]),
    dict(id="adam-v-decays-with-beta1-in-kernel", file=OPTIM,
         old="const float b2 = s.beta2, omb2",
         new="const float b2 = s.one_minus_weight, omb2",
         why="the update loop decays v with beta1 (1 - weight) instead of beta2",
         tests=["test_optim"]),
    dict(id="adamw-decay-after-update", file=OPTIM,
         old=("    if constexpr (Decoupled) pi = pi * decay;\n"
              "    float mi = m[i];\n"
              "    if constexpr (LerpLow) mi = mi + w * (gi - mi);\n"
              "    else mi = gi - (gi - mi) * omw;\n"
              "    float vi = v[i] * b2;\n"
              "    vi = vi + (omb2 * gi) * gi;\n"
              "    const float denom = std::sqrt(vi) / bc2 + eps;\n"
              "    pi = pi + nss * (mi / denom);\n"),
         new=("    float mi = m[i];\n"
              "    if constexpr (LerpLow) mi = mi + w * (gi - mi);\n"
              "    else mi = gi - (gi - mi) * omw;\n"
              "    float vi = v[i] * b2;\n"
              "    vi = vi + (omb2 * gi) * gi;\n"
              "    const float denom = std::sqrt(vi) / bc2 + eps;\n"
              "    pi = pi + nss * (mi / denom);\n"
              "    if constexpr (Decoupled) pi = pi * decay;\n"),
         why="AdamW's decoupled weight decay applied after the update instead of before",
         tests=["test_optim"]),
    dict(id="adamw-decay-without-lr", file="src/optim/optimizer.cpp",
         old="a.decay_mul = static_cast<float>(1.0 - lr * s.weight_decay);",
         new="a.decay_mul = static_cast<float>(1.0 - s.weight_decay);",
         why="AdamW decays by 1 - wd instead of 1 - lr * wd",
         tests=["test_optim"]),
    dict(id="adam-bias-correction2-no-sqrt", file="src/optim/optimizer.cpp",
         old="a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));",
         new="a.bc2_sqrt = static_cast<float>(bc2);",
         why="Adam divides sqrt(v) by 1 - beta2^t instead of its square root",
         tests=["test_optim"]),
    dict(id="skipped-step-advances-counter", file="src/optim/optimizer.cpp",
         old=("  if (c.skip) return false;\n"
              "  const Pass p = make_pass(*store_, state_, pure_, isa_, c);\n"
              "  split(pool"),
         new=("  if (c.skip) { ++state_.step; return false; }\n"
              "  const Pass p = make_pass(*store_, state_, pure_, isa_, c);\n"
              "  split(pool"),
         why="a skipped step advances Adam's step counter (bias correction drifts)",
         tests=["test_optim"]),
    dict(id="sgd-dampening-inverted", file="src/optim/optimizer.cpp",
         old="g.one_minus_dampening = static_cast<float>(1.0 - s.dampening);",
         new="g.one_minus_dampening = static_cast<float>(s.dampening);",
         why="SGD momentum weighs the gradient by dampening instead of 1 - dampening",
         tests=["test_optim"]),
    dict(id="sgd-nesterov-wrong-term", file=OPTIM,
         old="if constexpr (Nesterov) d = d + mu * b;",
         new="if constexpr (Nesterov) d = b + mu * b;",
         why="Nesterov momentum looks ahead from the buffer instead of the gradient",
         tests=["test_optim"]),
    dict(id="clip-coefficient-not-capped", file="src/optim/clip.cpp",
         old="return static_cast<float>(std::min(coef, 1.0));",
         new="return static_cast<float>(coef);",
         why="clipping scales small gradients up (coefficient not capped at 1)",
         tests=["test_optim"]),
    dict(id="warmup-off-by-one", file="src/optim/schedule.cpp",
         old="return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);",
         new="return base_lr * static_cast<double>(step) / static_cast<double>(warmup_steps);",
         why="warmup starts at lr 0 (the first step does nothing)",
         tests=["test_optim"]),
    # ---- loss scaling -------------------------------------------------------------------
    dict(id="torch-backoff-keeps-growth-tracker", file="src/scaler/loss_scale.cpp",
         old=("        scale_ = n;\n"
              "        k.growth_tracker = 0;\n"
              "        k.backoffs += 1;\n"),
         new=("        scale_ = n;\n"
              "        k.backoffs += 1;\n"),
         why="torch's rule does not reset the growth tracker on an overflow",
         tests=["test_scaler_loss_scale", "test_scaler_grad_scaler"]),
    dict(id="torch-growth-one-step-late", file="src/scaler/loss_scale.cpp",
         old="if (t == c.growth_interval) {",
         new="if (t > c.growth_interval) {",
         why="torch's rule grows one clean step after the growth interval",
         tests=["test_scaler_loss_scale", "test_scaler_grad_scaler"]),
    dict(id="deepspeed-hysteresis-off-by-one", file="src/scaler/loss_scale.cpp",
         old="if (c.hysteresis == 1 || k.hysteresis_left == 1) {",
         new="if (c.hysteresis == 1 || k.hysteresis_left == 2) {",
         why="DeepSpeed's hysteresis backs off one overflow early",
         tests=["test_scaler_loss_scale", "test_scaler_grad_scaler"]),
    dict(id="grad-scaler-last-optimizer-wins", file="src/scaler/grad_scaler.cpp",
         old="found_inf = found_inf || r.found_inf;",
         new="found_inf = r.found_inf;",
         why="with several optimizers, update() sees only the last one's overflow",
         tests=["test_scaler_grad_scaler"]),
    # ---- kernels ------------------------------------------------------------------------
    dict(id="unscale-scalar-ignores-nan", file="src/kernels/unscale_kernels.hpp",
         old="out.max_in = ax > out.max_in ? ax : out.max_in;",
         new="out.max_in = ax > out.max_in && ax <= 0x7f800000u ? ax : out.max_in;",
         why="the reference check misses NaN (only inf is found)",
         tests=["test_kernels_unscale"]),
    dict(id="unscale-avx2-drops-tail", file="src/kernels/cpu/unscale_avx2.cpp",
         old="if (main_end != end) unscale_range<D, kWrite, kSum, kAmax>(data, main_end, end, c, inv, out, lanes);",
         new="if (false) unscale_range<D, kWrite, kSum, kAmax>(data, main_end, end, c, inv, out, lanes);",
         why="the AVX2 unscale skips the elements after the last full vector",
         tests=["test_kernels_unscale"]),
    dict(id="f32-to-16bit-ties-away", file="include/mixprec/formats/scalar.hpp",
         old=": ((1u << (shift - 1)) - 1u + ((sig >> shift) & 1u));",
         new=": ((1u << (shift - 1)));",
         why="fp32 to f16/bf16/fp8 rounds ties away from zero instead of to even",
         tests=["test_formats_scalar"]),
    dict(id="fp8-delayed-margin-sign", file="src/fp8/recipes.cpp",
         old="const float scaled_max = std::ldexp(fp8_max, -margin);",
         new="const float scaled_max = std::ldexp(fp8_max, margin);",
         why="delayed scaling applies the margin the wrong way (scales up instead of down)",
         tests=["test_fp8_recipes"]),
    # ---- checkpoints, alerts ------------------------------------------------------------
    dict(id="checkpoint-checksum-not-compared", file="src/checkpoint/safetensors.cpp",
         old="if (got != *t.checksum)",
         new="if (false && got != *t.checksum)",
         why="a damaged tensor's checksum mismatch is not detected",
         tests=["test_checkpoint", "ctest:^reliability\\.bad_input\\.ckpt_bitflip$"],
         targets=["mixprec_cli", "ckpt_tool"]),
    dict(id="alert-overflow-rate-at-limit", file="src/monitor/alerts.cpp",
         old="if (static_cast<double>(overflow_skips_) > limit) {",
         new="if (static_cast<double>(overflow_skips_) >= limit) {",
         why="persistent-overflow fires at the allowed skip rate instead of above it",
         tests=["test_monitor_alerts"]),
    # ---- layers and models ----------------------------------------------------------------
    dict(id="gpt-ln1-weight-grad-into-ln2", file="src/nn/gpt.cpp",
         old="layernorm_backward(dres, e.dw(p.ln1w), e.dw(p.ln1b),",
         new="layernorm_backward(dres, e.dw(p.ln2w), e.dw(p.ln1b),",
         why="the GPT's first layer norm's weight gradient is written into the second's",
         tests=["test_nn_model", "test_nn_layers"]),
    dict(id="gpt-ln2-bias-grad-into-ln1", file="src/nn/gpt.cpp",
         old="layernorm_backward(dres2, e.dw(p.ln2w), e.dw(p.ln2b),",
         new="layernorm_backward(dres2, e.dw(p.ln2w), e.dw(p.ln1b),",
         why="the second layer norm's bias gradient lands in the first's",
         tests=["test_nn_model", "test_nn_layers"]),
    dict(id="layernorm-bias-grad-misrouted", file="src/nn/layers.cpp",
         old="      dbias[i] += dy[i];\n",
         new="      dweight[i] += dy[i];\n",
         why="layer norm adds the bias gradient to the weight gradient",
         tests=["test_nn_layers", "test_nn_model"]),
    dict(id="attention-dk-wrong-sign", file="src/nn/layers.cpp",
         old="dk[i] += q[i] * g;",
         new="dk[i] -= q[i] * g;",
         why="attention backward subtracts the key gradient",
         tests=["test_nn_layers", "test_nn_model"]),
    dict(id="attention-dk-wrong-position", file="src/nn/layers.cpp",
         old="float* dk = dqkv.data() + (b * T + t2) * C3 + h * hs + C;",
         new="float* dk = dqkv.data() + (b * T + t) * C3 + h * hs + C;",
         why="attention backward writes the key gradient at the query's position",
         tests=["test_nn_layers", "test_nn_model"]),
    dict(id="softmax-backward-wrong-index", file="src/nn/layers.cpp",
         old="for (std::size_t t2 = 0; t2 <= t; ++t2) dot += a[t2] * da[t2];",
         new="for (std::size_t t2 = 0; t2 <= t; ++t2) dot += a[t2] * da[t];",
         why="the attention softmax backward's dot product reads the wrong element",
         tests=["test_nn_layers", "test_nn_model"]),
    dict(id="gelu-backward-constant", file="src/nn/layers.cpp",
         old="(1.0f + 3.0f * 0.044715f * x * x)",
         new="(1.0f + 3.0f * 0.04f * x * x)",
         why="GELU's derivative uses a wrong cubic coefficient",
         tests=["test_nn_layers", "test_nn_model"]),
    dict(id="mlp-bias-grad-not-written", file="src/nn/mlp.cpp",
         old="linear_backward(e.gemm(), din, e.dw(w_[i]), e.dw(b_[i]), dpre,",
         new="linear_backward(e.gemm(), din, e.dw(w_[i]), i == 1 ? std::span<float>() : e.dw(b_[i]), dpre,",
         why="the MLP's second layer's bias gradient is never written",
         tests=["test_nn_model"]),
    # ---- reliability (docs/bad_inputs.md) ---------------------------------------------------
    dict(id="checkpoint-header-checksum-ignored", file="src/checkpoint/safetensors.cpp",
         old="if (got != *sum)",
         new="if (false && got != *sum)",
         why="a tampered checkpoint header (loss scale, counters) is loaded without notice",
         tests=["test_checkpoint", "ctest:^reliability\\.bad_input\\.ckpt_header_tamper$"],
         targets=["mixprec_cli", "ckpt_tool"]),
    dict(id="json-depth-limit-off", file="include/mixprec/core/json_depth.hpp",
         old="if (++depth > limit) return i;",
         new="if (++depth > limit * 1000000) return i;",
         why="deeply nested JSON reaches the recursive parser (a stack overflow)",
         tests=["test_train_run_log", "ctest:^reliability\\.bad_input\\.config_deep$"],
         targets=["mixprec_cli", "ckpt_tool"]),
    dict(id="run-folder-lock-not-taken", file="src/train/run_folder.cpp",
         old="if (::fcntl(fd, F_SETLK, &want) == 0) return fd;",
         new="if (true || ::fcntl(fd, F_SETLK, &want) == 0) return fd;",
         why="two mixprec train processes write one run folder at once",
         tests=["test_train_run_folder", "ctest:^reliability\\.run_lock$"],
         targets=["mixprec_cli", "test_train_run_folder"]),
]
