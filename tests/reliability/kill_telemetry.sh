#!/usr/bin/env bash
# SIGKILL at random moments of a Telemetry's record() and finish() (docs/reliability.md,
# "Killed while recording"): a child (CHILD DIR) records steps and prints "ok JSON" after each
# record() that returned and "finished" after each finish(); it is killed TRIALS times, each
# at a random delay after a random number of returned calls. Each time the folder must be
# read by `mixprec report` and its log must begin with exactly the lines that returned, byte
# for byte (one more whole line may follow: a record() killed after its write), steps 1..N.
#
#   kill_telemetry.sh MIXPREC_BIN WORK_DIR TRIALS SEED CHILD...
set -uo pipefail
bin=$1
work=$2
trials=$3
RANDOM=$4
shift 4
rm -rf "$work"
mkdir -p "$work"
cd "$work" || exit 1
fail() {
  echo "FAIL: $*"
  exit 1
}
for t in $(seq "$trials"); do
  run=run$t
  want=$((1 + RANDOM % 12))          # returned calls to wait for
  delay=$((RANDOM % 40))             # then this many ms more: inside a record() or a finish()
  "$@" "$run" > out$t.txt 2> err$t.txt &
  child=$!
  for _ in $(seq 1200); do
    [ "$(grep -c '^ok ' out$t.txt)" -ge "$want" ] && break
    kill -0 "$child" 2> /dev/null || fail "trial $t: the child ended: $(tail -n 3 err$t.txt)"
    sleep 0.05
  done
  sleep "$(printf '0.%03d' "$delay")"
  kill -9 "$child"
  wait "$child" 2> /dev/null
  returned=$(grep -c '^ok ' out$t.txt)
  [ "$returned" -ge 1 ] || fail "trial $t: no record() returned"
  "$bin" report "$run" --out "report$t.html" > /dev/null 2> report$t.err ||
    fail "trial $t: mixprec report cannot read the folder killed after $returned records: $(cat report$t.err)"
  grep '^ok ' out$t.txt | cut -c4- > expected$t.jsonl
  head -n "$returned" "$run/log.jsonl" | cmp -s - expected$t.jsonl ||
    fail "trial $t: the log does not begin with the $returned lines that returned"
  lines=$(wc -l < "$run/log.jsonl")
  [ "$lines" -le $((returned + 1)) ] || fail "trial $t: $lines lines for $returned returned records"
  tail -c 1 "$run/log.jsonl" | od -An -c | grep -q '\\n' || [ ! -s "$run/log.jsonl" ] ||
    echo "trial $t: the last line was cut short by the kill (a reader drops it)"
  echo "trial $t: killed $delay ms after $want returned calls: $returned records returned, $lines in the log," \
       "$(grep -c '^finished' out$t.txt) summaries; mixprec report reads it"
done
echo "PASS"
