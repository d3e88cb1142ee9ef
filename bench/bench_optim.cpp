// Stand-alone runner for the optimizer benchmarks; takes Google Benchmark flags.
#include "optim_bench.hpp"

int main(int argc, char** argv) { return mixprec::bench::run_optim(argc, argv); }
