// Stand-alone runner for the FP8 quantize benchmarks; takes Google Benchmark flags.
#include "fp8_bench.hpp"

int main(int argc, char** argv) { return mixprec::bench::run_fp8(argc, argv); }
