// Stand-alone runner for the scaler benchmarks; takes Google Benchmark flags.
#include "scaler_bench.hpp"

int main(int argc, char** argv) { return mixprec::bench::run_scaler(argc, argv); }
