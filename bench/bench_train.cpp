// Stand-alone runner for the training-step benchmarks; takes Google Benchmark flags.
#include "train_bench.hpp"

int main(int argc, char** argv) { return mixprec::bench::run_train(argc, argv); }
