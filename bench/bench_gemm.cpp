// Stand-alone runner for the GEMM benchmarks; takes Google Benchmark flags.
#include "gemm_bench.hpp"

int main(int argc, char** argv) { return mixprec::bench::run_gemm(argc, argv); }
