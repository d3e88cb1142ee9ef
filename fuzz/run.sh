#!/usr/bin/env bash
# Runs the libFuzzer targets of a MIXPREC_FUZZ build one after another (docs/fuzzing.md).
#
#   fuzz/run.sh BUILD_DIR SECONDS TARGET...        fuzz each target for SECONDS (make fuzz)
#   fuzz/run.sh --smoke BUILD_DIR SECONDS TARGET... each target over its seeds plus a few
#                                                  thousand mutations, at most SECONDS (make test)
#
# TARGET is safetensors, npy, config, cli or run_folder: BUILD_DIR/fuzz/fuzz_TARGET, seeded from
# fuzz/corpus/TARGET (never written to). Full runs keep what they find in
# BUILD_DIR/fuzz-work/corpus/TARGET, so the next run starts from there; crash inputs go
# to BUILD_DIR/fuzz-work/artifacts/TARGET/, the log to BUILD_DIR/fuzz-work/logs/TARGET.log.
# Prints one line per target (executions, seconds, corpus size, result) and exits 1 when
# any target crashed, leaked, timed out or ran out of memory.
set -uo pipefail

smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi
if [ $# -lt 3 ]; then
  echo "usage: fuzz/run.sh [--smoke] BUILD_DIR SECONDS TARGET..." >&2
  exit 2
fi
build=$1 seconds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
work=$build/fuzz-work

# Longest input per target: a few tensors' header, a small .npy, a config or log line
# with every field, a command line.
max_len() {
  case $1 in
    safetensors) echo 4096 ;;
    npy) echo 4096 ;;
    config) echo 8192 ;;
    run_folder) echo 16384 ;;
    cli) echo 512 ;;
    *) echo 4096 ;;
  esac
}

failed=0
summary=()
for t in "$@"; do
  bin=$build/fuzz/fuzz_$t
  seeds=$here/corpus/$t
  if [ ! -x "$bin" ] || [ ! -d "$seeds" ]; then
    echo "fuzz: no target '$t' ($bin, $seeds)" >&2
    exit 2
  fi
  mkdir -p "$work/artifacts/$t" "$work/logs"
  log=$work/logs/$t.log
  if [ $smoke -eq 1 ]; then
    corpus=$(mktemp -d)  # new inputs of a smoke run are dropped
    limits=(-runs=3000 -max_total_time="$seconds")
  else
    corpus=$work/corpus/$t
    mkdir -p "$corpus"
    limits=(-max_total_time="$seconds")
  fi
  dict=()
  [ -f "$here/$t.dict" ] && dict=(-dict="$here/$t.dict")
  # -close_fd_mask=1: the CLI's help text stays quiet; libFuzzer and sanitizer reports go to stderr.
  "$bin" "${limits[@]}" -max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -close_fd_mask=1 -artifact_prefix="$work/artifacts/$t/" "${dict[@]}" "$corpus" "$seeds" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  units=$(find "$corpus" -type f | wc -l)
  [ $smoke -eq 1 ] && rm -rf "$corpus"
  if [ $rc -eq 0 ]; then
    result=ok
  else
    failed=1
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
    result="FAILED (exit $rc): ${artifact:-see $log}"
    echo "fuzz: fuzz_$t failed; the end of $log:" >&2
    grep -E "ERROR|SUMMARY|==[0-9]+==|#[0-9]+ +0x|runtime error|deadly signal|Test unit" "$log" | head -25 >&2
    [ -n "$artifact" ] && echo "fuzz: replay with: $bin $artifact" >&2
  fi
  summary+=("$(printf 'fuzz_%-12s %10s executions in %4s s, %6s inputs in the corpus: %s' "$t" "${execs:-?}" \
    "${secs:-?}" "$units" "$result")")
done
printf '%s\n' "${summary[@]}"
exit $failed
