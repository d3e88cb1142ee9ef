#!/usr/bin/env bash
# scripts/device-check.sh: every CUDA path of mixprec on a machine with an NVIDIA GPU, in one
# run of at most 8 minutes, ending with one summary (docs/performance.md, "The device check").
#
#   scripts/device-check.sh            on a GPU machine (nvidia-smi, a CUDA torch in the venv)
#   scripts/device-check.sh --cpu      the same steps on the CPU: the CUDA tests run on CPU
#                                      tensors with the device paths forced
#                                      (MIXPREC_TEST_DEVICE=cpu), the cost on a CPU step; what
#                                      a machine without a GPU can check of this script
#
# Options: --venv DIR (default build/py-venv: a venv with the CUDA build of torch, as
# scripts/deps.sh makes it), --torch-root DIR (libtorch for the C++ adapter; default: the
# venv's torch package), --build DIR (default build/device), --jobs N (default: all cores),
# --budget SECONDS (default 480).
#
# Steps, each with its own share of the budget (a step that runs out is a failure):
#   1. build  the core, the libtorch adapter linked with libtorch's CUDA libraries
#             (MIXPREC_TORCH_CUDA=ON) and its test program; `pip install .` into the venv
#   2. python tests/python/test_cuda_paths.py (GradScaler parity with torch.amp on CUDA in
#             fp16 and bf16; Telemetry's counts of CUDA tensors against the core's of the same
#             tensors) and tests/python/test_telemetry_device_counts.py (the device path on
#             CPU tensors, the reference those depend on)
#   3. libtorch  test_torch --gtest_filter='TorchCuda.*:TorchDevicePaths.*' (the adapter's CUDA
#             path: GradScaler and Telemetry on CUDA tensors against the core on their copies)
#   4. cost   bench/python/telemetry_cost.py on a GPU step (the transformers GPT-2 config,
#             bf16 autocast), interleaved rounds
# Exit status: 0 when every step passed; 1 otherwise; 2 for bad arguments or a machine that
# cannot run it (no GPU without --cpu).
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=build/py-venv
BUILD=build/device
JOBS=$(nproc)
BUDGET=480
DEVICE=cuda
TORCH_ROOT=
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) DEVICE=cpu ;;
    --venv) VENV=${2:?--venv needs a folder}; shift ;;
    --torch-root) TORCH_ROOT=${2:?--torch-root needs a folder}; shift ;;
    --build) BUILD=${2:?--build needs a folder}; shift ;;
    --jobs) JOBS=${2:?--jobs needs a number}; shift ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    -h|--help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device-check: unknown argument '$1' (allowed: --cpu, --venv DIR, --torch-root DIR, --build DIR, --jobs N, --budget SECONDS)" >&2; exit 2 ;;
  esac
  shift
done
for n in "$JOBS" "$BUDGET"; do
  case "$n" in ''|*[!0-9]*) echo "device-check: --jobs and --budget take positive integers, found '$n'" >&2; exit 2 ;; esac
done
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "device-check: no Python at $PY (make the venv with scripts/deps.sh, or pass --venv DIR)" >&2
  exit 2
fi
if [ "$DEVICE" = cuda ]; then
  if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
    echo "device-check: no NVIDIA GPU here (nvidia-smi); --cpu runs the script's steps on the CPU" >&2
    exit 2
  fi
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; then
    echo "device-check: the venv's torch sees no CUDA device (a CPU wheel?): $("$PY" -c 'import torch; print(torch.__version__)' 2>&1)" >&2
    exit 2
  fi
fi

LOGS="$BUILD/logs"
mkdir -p "$LOGS"
START=$(date +%s)
declare -a NAMES=() RESULTS=() SECONDS_TAKEN=() DETAILS=()
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME SHARE_SECONDS COMMAND...: runs COMMAND with its output in $LOGS/NAME.log, under
# the smaller of its share and what is left of the budget.
step() {
  local name=$1 share=$(( $2 * BUDGET / 480 )); shift 2  # shares of the default 8 minutes, scaled
  local limit t0 rc
  limit=$(left)
  [ "$share" -lt "$limit" ] && limit=$share
  t0=$(date +%s)
  if [ "$limit" -le 0 ]; then
    rc=124
    echo "no time left in the budget" > "$LOGS/$name.log"
  else
    echo "== $name (up to ${limit} s)"
    timeout "$limit" bash -c "$*" > "$LOGS/$name.log" 2>&1  # timeout ends the step's whole process group
    rc=$?
  fi
  NAMES+=("$name")
  SECONDS_TAKEN+=($(( $(date +%s) - t0 )))
  case $rc in
    0) RESULTS+=(PASS) ;;
    124) RESULTS+=("FAIL (out of time)") ;;
    *) RESULTS+=("FAIL (exit $rc)") ;;
  esac
  DETAILS+=("$(grep -E '(passed|failed|skipped|PASSED|FAILED|SKIPPED)' "$LOGS/$name.log" | tail -n 2 | tr '\n' ' ')")
  return $rc
}

build() {
  local cuda=ON torch_root
  [ "$DEVICE" = cpu ] && cuda=OFF
  # libtorch: the venv's own torch package (include/ and lib/ of the wheel), unless given.
  torch_root=$TORCH_ROOT
  [ -n "$torch_root" ] || torch_root=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))') || return 1
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMIXPREC_TORCH=ON -DMIXPREC_TORCH_ROOT="$torch_root" \
    -DMIXPREC_TORCH_CUDA=$cuda &&
    cmake --build "$BUILD" -j "$JOBS" --target test_torch mixprec_cli &&
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip install -q --no-build-isolation .
}

python_tests() {
  local dir
  dir=$(mktemp -d)
  (cd "$dir" && MIXPREC_TEST_DEVICE=$DEVICE MIXPREC_CLI="$REPO/$BUILD/tools/mixprec/mixprec" "$REPO/$PY" -m pytest -q \
    -p no:cacheprovider -rs "$REPO/tests/python/test_cuda_paths.py" "$REPO/tests/python/test_telemetry_device_counts.py")
}

libtorch_tests() {
  MIXPREC_TEST_DEVICE=$DEVICE "$BUILD/tests/test_torch" --gtest_filter='TorchCuda.*:TorchDevicePaths.*' \
    --gtest_brief=0
}

cost() {
  if [ "$DEVICE" = cpu ]; then  # the script's logic only: a CPU without AVX512-BF16 runs bf16 100x slower
    "$PY" "$REPO/bench/python/telemetry_cost.py" --device cpu --dtype fp32 --rounds 2 --steps 3 --device-path
  else
    "$PY" "$REPO/bench/python/telemetry_cost.py" --device cuda --dtype bf16 --rounds 5 --steps 10 --device-path
  fi
}

export REPO VENV PY BUILD JOBS DEVICE TORCH_ROOT
export -f build python_tests libtorch_tests cost
step build 300 build && built=1 || built=0
if [ $built = 1 ]; then
  step python 90 python_tests
  step libtorch 60 libtorch_tests
  step cost 120 cost
fi

TOTAL=$(( $(date +%s) - START ))
echo
echo "device-check summary ($DEVICE; $( [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 || echo "forced CPU, no GPU used"); budget ${BUDGET} s)"
failed=0
for i in "${!NAMES[@]}"; do
  printf '  %-9s %-22s %4d s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" "${DETAILS[$i]}"
  [ "${RESULTS[$i]}" = PASS ] || failed=1
done
[ $built = 1 ] || echo "  (the tests and the cost need the build)"
if [ -f "$LOGS/cost.log" ]; then
  echo "  Telemetry's cost on this step (bench/python/telemetry_cost.py):"
  grep -E '^(model|variant|none|default|every)' "$LOGS/cost.log" | sed 's/^/    /'
fi
echo "  total ${TOTAL} s; logs in $LOGS"
exit $failed
