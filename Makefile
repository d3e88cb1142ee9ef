# mixprec: two commands on a fresh Debian 12 machine, as root.
#   make run    install what is missing, build (Release), train the default model (mixprec train)
#   make test   install what is missing, build Release and Debug+ASan+UBSan, run every test
#   make bench  install what is missing, build (Release), run the benchmarks
.PHONY: all deps test-deps torch-deps python-deps release debug-asan run test test-release test-asan test-python example bench bench-peers fuzz clean

JOBS     ?= $(shell nproc)
RELEASE  := build/release
ASAN     := build/debug-asan
INSTALL  := build/install
CMAKE_GEN := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
MIXPREC  := $(RELEASE)/tools/mixprec/mixprec
# libtorch for mixprec::torch (docs/libtorch.md): the torch wheel in a venv that
# `scripts/deps.sh torch` makes; the Release build of `make test` builds and tests it.
TORCH_VENV := build/torch-venv
# The Python package (docs/python.md): built with `pip install .` into this venv, which
# `scripts/deps.sh python` makes with the build and test requirements.
PY_VENV    := build/py-venv

all: release

deps:
	@bash scripts/deps.sh

# What only the tests need (headless chromium and python3-pil for the report's browser test).
test-deps:
	@bash scripts/deps.sh test

# libtorch (the PyPI torch wheel, C++ part) in $(TORCH_VENV), only if missing.
torch-deps:
	@MIXPREC_TORCH_VENV=$(TORCH_VENV) bash scripts/deps.sh torch

# python3-venv/-dev, and $(PY_VENV) with scikit-build-core, nanobind, numpy, pytest, ml_dtypes, only if missing.
python-deps:
	@MIXPREC_PY_VENV=$(PY_VENV) bash scripts/deps.sh python

$(RELEASE)/CMakeCache.txt: | deps
	cmake -S . -B $(RELEASE) $(CMAKE_GEN) -DCMAKE_BUILD_TYPE=Release

$(ASAN)/CMakeCache.txt: | deps
	cmake -S . -B $(ASAN) $(CMAKE_GEN) -DCMAKE_BUILD_TYPE=Debug -DMIXPREC_SANITIZE=ON -DMIXPREC_BUILD_BENCH=OFF \
		-DMIXPREC_TORCH=OFF

release: deps $(RELEASE)/CMakeCache.txt
	cmake --build $(RELEASE) -j $(JOBS)

debug-asan: deps $(ASAN)/CMakeCache.txt
	cmake --build $(ASAN) -j $(JOBS)

# The main job: train the default gpt in mixed fp16 with dynamic loss scaling on the
# embedded corpus (35 s to three minutes on two cores, by CPU); the run folder is replaced.
run: release
	rm -rf runs/latest
	$(MIXPREC) train --out runs/latest

test: test-release test-asan example test-fuzz-smoke test-python
	@echo "make test: all test suites passed (Release, Debug+ASan+UBSan, installed-package consumer, fuzz smoke, Python package)"

# The Release tests include mixprec::torch: the venv, then MIXPREC_TORCH=ON (required).
test-release: release test-deps torch-deps
	cmake -S . -B $(RELEASE) -DMIXPREC_TORCH=ON -DMIXPREC_TORCH_ROOT=$(CURDIR)/$(TORCH_VENV) > /dev/null
	cmake --build $(RELEASE) -j $(JOBS)
	cd $(RELEASE) && ctest --output-on-failure -j 2

test-asan: debug-asan test-deps
	cd $(ASAN) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		ctest --output-on-failure -j 2

# The Python package: `pip install .` into $(PY_VENV) (no build isolation, so that its CMake
# build folder build/py-<wheel tag> is reused and a second run only relinks), then its
# pytest suite run from an empty folder outside the repository, so that `import mixprec`
# is the installed package and not python/mixprec.
test-python: release deps python-deps
	@echo "test-python: pip install . into $(PY_VENV) (the first time builds the core: a few minutes)"
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		--no-build-isolation .
	@d=$$(mktemp -d) && cd $$d && PYTHONDONTWRITEBYTECODE=1 MIXPREC_CLI=$(CURDIR)/$(MIXPREC) \
		$(CURDIR)/$(PY_VENV)/bin/python -m pytest -q \
		-p no:cacheprovider $(CURDIR)/tests/python; rc=$$?; rm -rf $$d; exit $$rc

# The Hypothesis property suite at length (tests/python/hypothesis_profiles.py, profile fuzz:
# random seeds, 2000 examples a property; make test runs it derandomized with 40). A case it
# finds is kept as an @example of its property (docs/fuzzing.md).
.PHONY: fuzz-python
fuzz-python: release deps python-deps
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		--no-build-isolation .
	@d=$$(mktemp -d) && cd $$d && PYTHONDONTWRITEBYTECODE=1 MIXPREC_HYPOTHESIS=fuzz MIXPREC_CLI=$(CURDIR)/$(MIXPREC) \
		$(CURDIR)/$(PY_VENV)/bin/python -m pytest -q -p no:cacheprovider $(CURDIR)/tests/python/test_hypothesis_*.py; \
		rc=$$?; rm -rf $$d; exit $$rc

# A consumer project built against the installed package (find_package(mixprec CONFIG)),
# and the same project with mixprec added from source (add_subdirectory).
example: release
	rm -rf $(INSTALL) build/example build/example-subdir build/example-torch
	cmake --install $(RELEASE) --prefix $(CURDIR)/$(INSTALL) > /dev/null
	cmake -S examples/consumer -B build/example $(CMAKE_GEN) -DCMAKE_BUILD_TYPE=Release \
		-DCMAKE_PREFIX_PATH=$(CURDIR)/$(INSTALL) > /dev/null
	cmake --build build/example -j $(JOBS)
	./build/example/consumer
	cmake -S examples/consumer -B build/example-subdir $(CMAKE_GEN) -DCMAKE_BUILD_TYPE=Release \
		-DMIXPREC_SOURCE_DIR=$(CURDIR) > /dev/null
	cmake --build build/example-subdir -j $(JOBS)
	./build/example-subdir/consumer
	@# The libtorch adapter as an installed component, when this build has it (make test's does).
	if [ -f $(INSTALL)/lib/cmake/mixprec/mixprecTorchTargets.cmake ]; then \
	  rm -rf build/example-torch && \
	  cmake -S examples/torch_consumer -B build/example-torch $(CMAKE_GEN) -DCMAKE_BUILD_TYPE=Release \
	    -DCMAKE_PREFIX_PATH=$(CURDIR)/$(INSTALL) > /dev/null && \
	  cmake --build build/example-torch -j $(JOBS) && ./build/example-torch/torch_consumer; \
	else echo "examples/torch_consumer: skipped (this build has no mixprec::torch)"; fi

# ---- fuzzing (docs/fuzzing.md): libFuzzer targets built with clang, ASan and UBSan -----
# make fuzz: each target for FUZZ_SECONDS (default 60), one after another, printing the
# executions and any crash file. make test runs test-fuzz-smoke: each target over its
# seed corpus and a few thousand mutations (seconds).
.PHONY: fuzz-deps fuzz-build test-fuzz-smoke
FUZZ         := build/fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := safetensors npy config cli run_folder

fuzz-deps:
	@bash scripts/deps.sh fuzz

$(FUZZ)/CMakeCache.txt: | deps fuzz-deps
	cmake -S . -B $(FUZZ) $(CMAKE_GEN) -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Debug -DMIXPREC_FUZZ=ON \
		-DMIXPREC_BUILD_TESTS=OFF -DMIXPREC_BUILD_BENCH=OFF -DMIXPREC_TORCH=OFF

fuzz-build: deps fuzz-deps $(FUZZ)/CMakeCache.txt
	cmake --build $(FUZZ) -j $(JOBS) --target $(addprefix fuzz_,$(FUZZ_TARGETS))

fuzz: fuzz-build
	bash fuzz/run.sh $(FUZZ) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

test-fuzz-smoke: fuzz-build
	bash fuzz/run.sh --smoke $(FUZZ) 4 $(FUZZ_TARGETS)

bench: release
	$(MIXPREC) bench formats
	$(MIXPREC) bench scaler
	$(MIXPREC) bench fp8
	$(MIXPREC) bench train

# PyTorch eager on this machine, side by side with mixprec train (bench/peers/pytorch_gpt.py,
# docs/performance.md): the default and the 3.45M gpt, fp32/bf16/fp16, 1 thread and all cores.
# Uses build/py-venv (scripts/deps.sh python installs torch there); about 10 minutes.
bench-peers: release python-deps
	$(PY_VENV)/bin/python bench/peers/pytorch_gpt.py --mixprec $(MIXPREC)

clean:
	rm -rf build

# ---- ThreadSanitizer (docs/reliability.md): the tests of the ThreadPool-threaded kernels --
# (unscale/check, grad stats, fused optimizer steps, the GradScaler, inspect, the pool
# itself; bulk conversions too). OpenMP (libgomp) and oneDNN are not TSan-instrumented,
# so this build runs the ThreadPool on its own std::threads (MIXPREC_TSAN implies
# MIXPREC_POOL_STD_THREADS: the same splits, seen by TSan), and the tests that run
# OpenMP regions (nn/*, train/*) are left out. MIXPREC_THREADS=4: the global
# pool gets more threads than the two cores. Not part of `make test`.
.PHONY: tsan test-tsan
TSAN       := build/tsan
TSAN_TESTS := test_core_parallel test_kernels_unscale test_optim test_scaler_grad_scaler test_formats_bulk \
              test_inspect_npy

$(TSAN)/CMakeCache.txt: | deps
	cmake -S . -B $(TSAN) $(CMAKE_GEN) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMIXPREC_TSAN=ON \
		-DMIXPREC_BUILD_BENCH=OFF -DMIXPREC_BUILD_TOOLS=OFF -DMIXPREC_TORCH=OFF

tsan: deps $(TSAN)/CMakeCache.txt
	cmake --build $(TSAN) -j $(JOBS) --target $(TSAN_TESTS)

test-tsan: tsan
	@set -e; for t in $(TSAN_TESTS); do \
		echo "== $$t (ThreadSanitizer)"; \
		MIXPREC_THREADS=4 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" $(TSAN)/tests/$$t --gtest_brief=1; \
	done
	@echo "make test-tsan: all ThreadSanitizer tests passed ($(TSAN_TESTS))"
