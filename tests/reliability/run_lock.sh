#!/usr/bin/env bash
# One `mixprec train` at a time in a run folder (docs/reliability.md, "One process per
# run folder"):
#   1. a live run holds its folder: three `--resume` of it, started together while it
#      trains, each exit 1 naming the holder's PID and change nothing; SIGKILLed, the
#      holder leaves no stale lock: a `--resume` then finishes the run;
#   2. four `--out` of one new folder started together (20 steps, a checkpoint each):
#      exactly one trains, the others exit non-zero (1 naming the winner's PID while it
#      runs, or 2 "exists and is not empty" once it has finished); the folder holds one
#      run's log, steps 1..20 once each, and resumes to step 22.
#
#   run_lock.sh MIXPREC_BIN WORK_DIR
set -uo pipefail
bin=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
cd "$work" || exit 1

fail() {
  echo "FAIL: $*"
  exit 1
}
tiny=(--accum 1 --batch 2 --context 16 --channels 16 --layers 1 --heads 2 --corpus-tokens 20000 --vocab word:256
      --threads 1 --eval-windows 8 --warmup 0)
snapshot() { (cd "$1" && find . -type f ! -name 'ckpt-*' ! -name 'log.jsonl' ! -name '.*.tmp-*' -print0 | sort -z |
                xargs -0 sha256sum); }

# ---- 1. a live holder, three resumes at once, then SIGKILL
"$bin" train "${tiny[@]}" --steps 1000000 --checkpoint-every 1 --keep-checkpoints 1 --out held > held.txt 2>&1 &
holder=$!
for _ in $(seq 600); do
  [ -s held/log.jsonl ] && break
  sleep 0.1
done
[ -s held/log.jsonl ] || { kill -9 "$holder"; fail "the holder did not start: $(cat held.txt)"; }
before=$(snapshot held)
pids=()
for k in 1 2 3; do
  timeout 60 "$bin" train --resume held > "resume$k.txt" 2>&1 &
  pids+=($!)
done
for k in 1 2 3; do
  wait "${pids[$((k - 1))]}"
  rc=$?
  echo "resume $k: exit $rc: $(tail -n 1 "resume$k.txt")"
  [ "$rc" -eq 1 ] || { kill -9 "$holder"; fail "resume $k of a live run: exit $rc, expected 1"; }
  grep -qF "run folder 'held' is in use by process $holder (it holds the lock on 'held/.lock')" "resume$k.txt" ||
    { kill -9 "$holder"; fail "resume $k does not name the holder (PID $holder)"; }
done
[ "$(snapshot held)" = "$before" ] || { kill -9 "$holder"; fail "a refused resume changed the run folder"; }
kill -9 "$holder"
wait "$holder" 2> /dev/null
ckpt=$(ls held | grep -E '^ckpt-[0-9]{8}\.safetensors$' | tail -n 1)
[ -n "$ckpt" ] || fail "the holder left no checkpoint"
step=$((10#$(echo "$ckpt" | tr -dc 0-9)))
echo "holder SIGKILLed at checkpoint step $step; resuming to step $((step + 2))"
timeout 120 "$bin" train --resume held --steps $((step + 2)) > after.txt 2>&1
rc=$?
tail -n 3 after.txt
[ "$rc" -eq 0 ] || fail "--resume after the holder was SIGKILLed: exit $rc (a stale lock?)"
grep -qF "mixprec train: $((step + 2)) steps" after.txt || fail "the resumed run did not finish"

# ---- 2. four new runs racing for one folder
for k in 1 2 3 4; do
  bash -c 'while [ ! -e go ]; do sleep 0.01; done; exec "$@"' racer "$bin" train "${tiny[@]}" --steps 20 \
    --checkpoint-every 1 --out race > "race$k.txt" 2>&1 &
  pids[$k]=$!
done
touch go
winners=0
winner_pid=
for k in 1 2 3 4; do
  wait "${pids[$k]}"
  codes[$k]=$?
  echo "racer $k (PID ${pids[$k]}): exit ${codes[$k]}: $(grep -E 'error|mixprec train: [0-9]+ steps' "race$k.txt" | tail -n 1)"
  if [ "${codes[$k]}" -eq 0 ]; then
    winners=$((winners + 1))
    winner_pid=${pids[$k]}
  fi
done
[ "$winners" -eq 1 ] || fail "$winners of 4 racers trained, expected exactly 1"
for k in 1 2 3 4; do
  case ${codes[$k]} in
    0) ;;
    1) grep -qF "run folder 'race' is in use by process $winner_pid" "race$k.txt" ||
         fail "racer $k: exit 1 without naming the winner (PID $winner_pid): $(cat "race$k.txt")" ;;
    2) grep -qF "out: 'race' exists and is not empty" "race$k.txt" || fail "racer $k: exit 2: $(cat "race$k.txt")" ;;
    *) fail "racer $k: exit ${codes[$k]}" ;;
  esac
done
steps=$(grep -o '"step":[0-9]*' race/log.jsonl | tr -dc '0-9\n' | tr '\n' ' ')
[ "$steps" = "$(seq -s ' ' 1 20) " ] || fail "race/log.jsonl holds steps '$steps', expected one run's 1..20"
[ -f race/summary.json ] || fail "race/summary.json is missing"
timeout 120 "$bin" train --resume race --steps 22 > resumed.txt 2>&1 || fail "--resume race: $(cat resumed.txt)"
steps=$(grep -o '"step":[0-9]*' race/log.jsonl | tr -dc '0-9\n' | tr '\n' ' ')
[ "$steps" = "$(seq -s ' ' 1 22) " ] || fail "after the resume race/log.jsonl holds steps '$steps'"
echo "PASS: run_lock"
