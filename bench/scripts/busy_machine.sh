#!/usr/bin/env bash
# mixprec train beside one busy process: the step must not collapse when another process
# holds a core (OpenMP waiters that spin starve each other; tools/mixprec/main.cpp makes
# them sleep). Paired rounds, alternating quiet and busy; prints each round's seconds and
# the median ratio busy/quiet. The busy process is started and ended here.
#   bash bench/scripts/busy_machine.sh [MIXPREC] [ROUNDS] [-- extra train flags]
# Default: build/release/tools/mixprec/mixprec, 3 rounds, `train --steps 8` (the default model).
set -euo pipefail
bin=${1:-build/release/tools/mixprec/mixprec}
rounds=${2:-3}
shift $(( $# > 2 ? 2 : $# )) || true
[ "${1:-}" = "--" ] && shift
extra=("$@")
[ -x "$bin" ] || { echo "busy_machine: no mixprec at '$bin' (make release)" >&2; exit 2; }
tmp=$(mktemp -d)
busy_pid=
cleanup() { [ -n "$busy_pid" ] && kill "$busy_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

timed_train() {  # seconds of one `mixprec train --steps 8`
  local t0 t1
  t0=$(date +%s.%N)
  "$bin" train --steps 8 --out "$tmp/run" "${extra[@]}" > "$tmp/train.log" 2>&1 || { cat "$tmp/train.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  rm -rf "$tmp/run"
  awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }'
}

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores; OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset}"
ratios=()
for r in $(seq 1 "$rounds"); do
  quiet=$(timed_train)
  # One busy process: a single-threaded loop that never sleeps.
  ( while :; do :; done ) &
  busy_pid=$!
  busy=$(timed_train)
  kill "$busy_pid"; wait "$busy_pid" 2>/dev/null || true; busy_pid=
  ratio=$(awk -v a="$quiet" -v b="$busy" 'BEGIN { print b / a }')
  ratios+=("$ratio")
  printf 'round %d: quiet %.1f s, beside a busy process %.1f s, ratio %.2f\n' "$r" "$quiet" "$busy" "$ratio"
done
median=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}')
printf 'median ratio busy/quiet over %d rounds: %.2f (target <= 2.5)\n' "$rounds" "$median"
