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

// Bytes per parameter: a whole number, or two decimals where scales make it fractional.
std::string per_param(std::uint64_t bytes, std::uint64_t params) {
  if (params == 0) return "-";
  if (bytes % params == 0) return std::to_string(bytes / params);
  return fmt::format("{:.2f}", static_cast<double>(bytes) / static_cast<double>(params));
}

std::string moments_text(const StateFormats& f) {
  if (f.m == f.v) return std::string(moment_format_name(f.m));
  return "m " + std::string(moment_format_name(f.m)) + ", v " + std::string(moment_format_name(f.v));
}

int print_plan(std::uint64_t params, OptimizerKind opt, nn::Precision prec, const StateFormats& state) {
  const nn::PrecisionPolicy pol = nn::policy_of(prec);
  const MemoryPlan m = memory_plan(params, opt, pol, state);
  const bool fp32_weights = !pol.master && pol.weights == DType::f32;
  const std::string weights(format_row(format_of(pol.weights)).label);  // fp16, bf16
  const std::string grads(format_row(format_of(pol.weight_grads)).label);
  fmt::print("mixprec memory: {} parameters, optimizer {}, precision {}, master {}, moments {}\n\n", grouped(params),
             optimizer_name(opt), nn::precision_name(prec), pol.master ? master_format_name(state.master) : "none",
             moments_text(state));
  fmt::print("{:<34} {:>7} {:>22} {:>12}\n", "buffer", "bytes/P", "bytes", "GiB");
  auto row = [&](const std::string& name, std::uint64_t bytes) {
    fmt::print("{:<34} {:>7} {:>22} {:>12.2f}\n", name, per_param(bytes, params), grouped(bytes),
               static_cast<double>(bytes) / 1073741824.0);
  };
  std::string moments = "optimizer state (none)";
  if (opt == OptimizerKind::sgd_momentum) moments = "optimizer state (momentum, fp32)";
  if (opt == OptimizerKind::adam || opt == OptimizerKind::adamw) moments = "optimizer state (m, v, " + moments_text(state) + ")";
  const std::string master_name = state.master == MasterFormat::remainder ? "master (remainder, 16 bits)"
                                  : state.master == MasterFormat::none    ? "master weights (none)"
                                                                          : "master weights (fp32)";
  row(fp32_weights ? "weights (fp32)" : pol.master ? master_name : "master weights (none)", m.master_weights);
  row(moments, m.moments);
  row("gradients (" + grads + ")", m.gradients);
  row(fp32_weights ? "model copy (none)"
      : pol.master && state.master == MasterFormat::none ? "weights (" + weights + ", the only copy)"
      : pol.master ? "model copy (" + weights + ")"
                   : "weights (" + weights + ", the only copy)",
      m.model_copy);
  row("total", m.total);
  if (params != 0) {
    std::string sum;
    for (std::uint64_t b : {m.master_weights, m.moments, m.gradients, m.model_copy})
      if (b != 0) sum += (sum.empty() ? "" : " + ") + per_param(b, params) + "P";
    fmt::print("\ntotal = {} = {}P bytes\n", sum, per_param(m.total, params));
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
  auto master = std::make_shared<std::string>("fp32");
  auto moments = std::make_shared<std::string>("fp32");
  auto block = std::make_shared<std::string>("0");
  cmd->add_option("--params", *params, "Parameter count, e.g. 7e9")->required();
  cmd->add_option("--optimizer", *optimizer, "adam (default), adamw, sgd or sgd-momentum");
  cmd->add_option("--precision", *precision,
                  "A precision preset (default fp16): " + keys::join(nn::precision_names()));
  cmd->add_option("--master", *master,
                  "Master weights of a mixed preset: " + master_format_names() + " (remainder: bf16 weights + 16 bits)");
  cmd->add_option("--moments", *moments, "Adam's moments: " + moment_format_names() + " (or M,V: one for each)");
  cmd->add_option("--moment-block", *block, "Elements per scale of fp8/8bit/4bit moments: 0 (default: 256, 256, 128) "
                                           "or a power of two in [32, 1024]");
  cmd->callback([params, optimizer, precision, master, moments, block, &action] {
    const std::uint64_t p = parse_params(*params);
    const auto opt = parse_optimizer(*optimizer);
    if (!opt)
      throw CLI::ValidationError("--optimizer", "unknown optimizer '" + *optimizer + "'; expected adam, adamw, sgd or sgd-momentum");
    const auto prec = nn::parse_precision(*precision);
    if (!prec)
      throw CLI::ValidationError("--precision",
                                 "unknown precision '" + *precision + "'; expected " + keys::join(nn::precision_names()));
    StateFormats state;
    const auto mf = parse_master_format(*master);
    if (!mf) throw CLI::ValidationError("--master", "unknown master format '" + *master + "'; expected " + master_format_names());
    state.master = *mf;
    const std::size_t comma = moments->find(',');
    const std::string m_name = moments->substr(0, comma), v_name = comma == std::string::npos ? m_name : moments->substr(comma + 1);
    for (const std::string* name : {&m_name, &v_name})
      if (!parse_moment_format(*name))
        throw CLI::ValidationError("--moments", "unknown moment format '" + *name + "'; expected " + moment_format_names() +
                                                    " (or M,V)");
    state.m = *parse_moment_format(m_name);
    state.v = *parse_moment_format(v_name);
    static const keys::Spec block_spec{.name = "--moment-block", .kind = keys::Kind::integer, .int_min = 0,
                                       .int_max = 1024, .expected = "0 or a power of two in [32, 1024]"};
    state.block = std::get<keys::Integer>(flag_value(block_spec, *block)).magnitude;
    try {
      validate(state);
    } catch (const std::invalid_argument& e) {
      throw CLI::ValidationError("--moment-block", e.what());
    }
    try {
      (void)memory_plan(p, *opt, nn::policy_of(*prec), state);  // the combination's own checks, before printing
    } catch (const std::invalid_argument& e) {
      throw CLI::ValidationError("--master/--moments", e.what());
    }
    action = [p, o = *opt, r = *prec, state] { return print_plan(p, o, r, state); };
  });
}

}  // namespace mixprec::cli
