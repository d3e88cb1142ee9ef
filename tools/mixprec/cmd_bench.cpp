// `mixprec bench formats|scaler|optim|gemm|fp8|train`: the benchmarks of bench/, with their ratio tables.
#include "cmd_bench.hpp"

#include <string>
#include <vector>

#include "formats_bench.hpp"
#include "fp8_bench.hpp"
#include "gemm_bench.hpp"
#include "train_bench.hpp"
#include "optim_bench.hpp"
#include "scaler_bench.hpp"

namespace mixprec::cli {
namespace {

using Runner = int (*)(int, char**);

// One `bench NAME` subcommand running the given suites in order; the remaining
// arguments are Google Benchmark flags, which the suites validate (a suite
// returns 1 on an unrecognised flag: a bad command line, exit code 2).
void add_suite(CLI::App& bench, std::function<int()>& action, const std::string& name, const std::string& help,
               std::vector<Runner> runners) {
  auto* cmd = bench.add_subcommand(name, help);
  cmd->allow_extras();
  cmd->callback([cmd, &action, name, runners] {
    std::vector<std::string> args = {"mixprec bench " + name};
    for (const std::string& a : cmd->remaining()) args.push_back(a);
    action = [args, runners] {
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      for (Runner run : runners) {
        if (run(static_cast<int>(argv.size()), argv.data()) != 0) return 2;
      }
      return 0;
    };
  });
}

}  // namespace

void add_bench_command(CLI::App& app, std::function<int()>& action) {
  auto* bench = app.add_subcommand("bench", "Measure kernel speed against memory copy and the scalar reference");
  bench->require_subcommand(1);
  add_suite(*bench, action, "formats", "Bulk conversions: GB/s, ratio to memcpy and to scalar",
            {&mixprec::bench::run_formats});
  // The scaler suite ends with the optimizer step that consumes the unscaled gradients.
  add_suite(*bench, action, "scaler",
            "Loss scaling: unscale_and_check vs an in-place multiply of the same bytes, then the fused Adam step",
            {&mixprec::bench::run_scaler, &mixprec::bench::run_optim});
  add_suite(*bench, action, "optim",
            "Fused Adam step vs a copy of the same bytes and vs the unfused passes; the step over each state "
            "format (--state-formats-only, --no-state-formats)",
            {&mixprec::bench::run_optim});
  add_suite(*bench, action, "gemm", "oneDNN matmul GFLOP/s: f32, bf16, f16 (widened), 1 and 2 threads, ratios to f32",
            {&mixprec::bench::run_gemm});
  add_suite(*bench, action, "fp8",
            "FP8 quantize (fused amax) / dequantize, per tensor and MX blocks, vs a copy of the same bytes",
            {&mixprec::bench::run_fp8});
  add_suite(*bench, action, "train",
            "Training step of the default gpt per precision preset, ratios to fp32, scaler share of the step",
            {&mixprec::bench::run_train});
}

}  // namespace mixprec::cli
