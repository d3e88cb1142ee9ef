// `mixprec memory --params 7e9`: master weights, moments, gradients and model copy
// in bytes and GiB (mixprec::memory_plan), e.g. 4P + 8P + 4P + 2P for Adam with fp16.
#include "cmd_memory.hpp"
#include "cli_app.hpp"

#include <fmt/core.h>

#include <optional>
#include <cmath>
#include <memory>
#include <string>
#include <variant>

#include "mixprec/core/keys.hpp"
#include "mixprec/core/text.hpp"
#include "mixprec/nn/precision.hpp"
#include "mixprec/nn/memory.hpp"

namespace mixprec::cli {
namespace {

using text::grouped;

// A parameter count: an integer in the core's number grammar (keys::parse_integer), written in
// digits or as a whole number in scientific notation (7e9), up to 2^53.
std::uint64_t parse_params(const std::string& text) {
  static const keys::Spec spec{.name = "--params",
                               .kind = keys::Kind::integer,
                               .int_min = 0,
                               .int_max = std::uint64_t{1} << 53,
                               .expected = "a whole number in [0, 2^53] such as 7e9 or 125000000"};
  return std::get<keys::Integer>(flag_value(spec, text)).magnitude;
}

int print_plan(std::uint64_t params, OptimizerKind opt, nn::Precision prec) {
  const MemoryPlan m = memory_plan(params, opt, prec);
  const nn::PrecisionPolicy pol = nn::policy_of(prec);
  const bool fp32_weights = !pol.master && pol.weights == DType::f32;
  const std::string weights(format_row(format_of(pol.weights)).label);  // fp16, bf16
  const std::string grads(format_row(format_of(pol.weight_grads)).label);
  fmt::print("mixprec memory: {} parameters, optimizer {}, precision {}\n\n", grouped(params), optimizer_name(opt),
             nn::precision_name(prec));
  fmt::print("{:<34} {:>7} {:>22} {:>12}\n", "buffer", "bytes/P", "bytes", "GiB");
  auto row = [&](const std::string& name, std::uint64_t bytes) {
    const std::uint64_t per = params == 0 ? 0 : bytes / params;
    fmt::print("{:<34} {:>7} {:>22} {:>12.2f}\n", name, params == 0 ? "-" : std::to_string(per), grouped(bytes),
               static_cast<double>(bytes) / 1073741824.0);
  };
  std::string moments = "optimizer state (none)";
  if (opt == OptimizerKind::sgd_momentum) moments = "optimizer state (momentum, fp32)";
  if (opt == OptimizerKind::adam || opt == OptimizerKind::adamw) moments = "optimizer state (m, v, fp32)";
  row(fp32_weights ? "weights (fp32)" : pol.master ? "master weights (fp32)" : "master weights (none)", m.master_weights);
  row(moments, m.moments);
  row("gradients (" + grads + ")", m.gradients);
  row(fp32_weights ? "model copy (none)"
      : pol.master ? "model copy (" + weights + ")"
                   : "weights (" + weights + ", the only copy)",
      m.model_copy);
  row("total", m.total);
  if (params != 0) {
    std::string sum;
    for (std::uint64_t b : {m.master_weights, m.moments, m.gradients, m.model_copy})
      if (b != 0) sum += (sum.empty() ? "" : " + ") + std::to_string(b / params) + "P";
    fmt::print("\ntotal = {} = {}P bytes\n", sum, m.total / params);
  }
  fmt::print("Activations and temporary buffers are not counted.\n");
  return 0;
}

}  // namespace

void add_memory_command(CLI::App& app, std::function<int()>& action) {
  auto* cmd = app.add_subcommand("memory", "Bytes of master weights, optimizer state, gradients and model copy");
  auto params = std::make_shared<std::string>();
  auto optimizer = std::make_shared<std::string>("adam");
  auto precision = std::make_shared<std::string>("fp16");
  cmd->add_option("--params", *params, "Parameter count, e.g. 7e9")->required();
  cmd->add_option("--optimizer", *optimizer, "adam (default), adamw, sgd or sgd-momentum");
  cmd->add_option("--precision", *precision,
                  "A precision preset (default fp16): " + keys::join(nn::precision_names()));
  cmd->callback([params, optimizer, precision, &action] {
    const std::uint64_t p = parse_params(*params);
    const auto opt = parse_optimizer(*optimizer);
    if (!opt)
      throw CLI::ValidationError("--optimizer", "unknown optimizer '" + *optimizer + "'; expected adam, adamw, sgd or sgd-momentum");
    const auto prec = nn::parse_precision(*precision);
    if (!prec)
      throw CLI::ValidationError("--precision",
                                 "unknown precision '" + *precision + "'; expected " + keys::join(nn::precision_names()));
    action = [p, o = *opt, r = *prec] { return print_plan(p, o, r); };
  });
}

}  // namespace mixprec::cli
