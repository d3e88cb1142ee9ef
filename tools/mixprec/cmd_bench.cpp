// `mixprec bench formats|scaler|optim`: the benchmarks of bench/, with their ratio tables.
#include "cmd_bench.hpp"

#include <memory>
#include <string>
#include <vector>

#include "formats_bench.hpp"
#include "optim_bench.hpp"
#include "scaler_bench.hpp"

namespace mixprec::cli {

void add_bench_command(CLI::App& app, std::function<int()>& action) {
  auto* bench = app.add_subcommand("bench", "Measure kernel speed against memory copy and the scalar reference");
  bench->require_subcommand(1);
  auto* formats = bench->add_subcommand("formats", "Bulk conversions: GB/s, ratio to memcpy and to scalar");
  formats->allow_extras();  // --benchmark_* flags go to Google Benchmark, which validates them
  formats->callback([formats, &action] {
    std::vector<std::string> args = {"mixprec bench formats"};
    for (const std::string& a : formats->remaining()) args.push_back(a);
    action = [args] {
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      return mixprec::bench::run_formats(static_cast<int>(argv.size()), argv.data());
    };
  });
  auto* scaler = bench->add_subcommand("scaler", "Loss scaling: unscale_and_check vs an in-place multiply of the same bytes");
  scaler->allow_extras();  // --benchmark_* flags go to Google Benchmark
  scaler->callback([scaler, &action] {
    std::vector<std::string> args = {"mixprec bench scaler"};
    for (const std::string& a : scaler->remaining()) args.push_back(a);
    action = [args] {
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      const int rc = mixprec::bench::run_scaler(static_cast<int>(argv.size()), argv.data());
      if (rc != 0) return rc;
      // The optimizer step that consumes the unscaled gradients (bench/optim_bench.hpp).
      return mixprec::bench::run_optim(static_cast<int>(argv.size()), argv.data());
    };
  });
  auto* optim = bench->add_subcommand("optim", "Fused Adam step vs a copy of the same bytes and vs the unfused passes");
  optim->allow_extras();  // --benchmark_* flags go to Google Benchmark
  optim->callback([optim, &action] {
    std::vector<std::string> args = {"mixprec bench optim"};
    for (const std::string& a : optim->remaining()) args.push_back(a);
    action = [args] {
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      return mixprec::bench::run_optim(static_cast<int>(argv.size()), argv.data());
    };
  });
}

}  // namespace mixprec::cli
