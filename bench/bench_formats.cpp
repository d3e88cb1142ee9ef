// Stand-alone runner for the format benchmarks; takes Google Benchmark flags.
#include "formats_bench.hpp"

int main(int argc, char** argv) { return mixprec::bench::run_formats(argc, argv); }
