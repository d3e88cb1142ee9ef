#!/usr/bin/env bash
# `mpirun -np N mixprec train --distributed` end to end (docs/distributed.md):
#
#   cli_dist.sh MIXPREC_BIN CKPT_TOOL WORK_DIR
#
#   1. 2 ranks, an overflow injected on rank 1 only at step 3: the log (rank 0's) shows
#      step 3 skipped with the scale halved; summary.json reports 2 ranks and the bytes
#      and seconds per step of each collective; rank 1 wrote nothing (one log line per step).
#   2. mpirun without --distributed, and a rank filter outside the job: exit 2, a message.
#   3. A rank stalled (SIGSTOP) mid-run: the other rank's collective times out
#      (--dist-timeout 3) with an error naming the collective and the step, and the job
#      ends (no hang) with a non-zero status.
#   4. A rank killed (SIGKILL) mid-run: the job fails within seconds, saying which rank
#      died; the run resumes from its newest checkpoint on 3 ranks, is killed again, and
#      finishes on 1 process (no mpirun): every step logged once, the final checkpoint
#      at the last step.
#   5. --zero 1 on 3 ranks: the final checkpoint (gathered by rank 0) holds the same
#      state as the unsharded 3-rank run's (ckpt_tool compare), and the summary reports
#      the reduce-scatter and the all-gather.
#   6. Optimizer state formats (--master remainder --moments fp8,8bit) on 2 ranks, an
#      overflow on rank 1 at step 3: a run stopped at step 4 and resumed on 2 ranks ends
#      with the straight run's checkpoint, byte for byte (codes, scales, masters).
#   7. The same formats under --zero 1 (whole tensors a rank): the straight run and a run
#      stopped at step 4 and resumed under ZeRO end with case 6's unsharded checkpoint,
#      byte for byte; rank 0 holds about half the master and moment bytes.
set -uo pipefail
bin=$1
tool=$2
work=$3
here=$(cd "$(dirname "$0")" && pwd)
mpi() { bash "$here/mpirun.sh" "$@"; }
rm -rf "$work"
mkdir -p "$work"
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
small=(--corpus-tokens 20000 --vocab word:256 --threads 1 --eval-windows 4 --layers 1 --heads 2 --channels 16
       --context 16 --batch 4 --accum 1 --histogram-every 0)
log_lines() { if [ -f "$1/log.jsonl" ]; then wc -l < "$1/log.jsonl"; else echo 0; fi; }
# The pid of rank R of the job whose command line holds $1 (the run folder).
rank_pid() {
  local p
  for p in $(pgrep -f -- "$1"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then echo "$p"; return; fi
  done
}
wait_lines() {  # wait_lines DIR N SECONDS: until the log has N lines
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    [ "$(log_lines "$1")" -ge "$2" ] && return 0
    sleep 0.1
  done
  return 1
}

echo "== 1. overflow on rank 1 only"
run="$work/overflow"
mpi 2 "$bin" train --distributed "${small[@]}" --steps 6 --inject-overflow-at 3 --inject-overflow-rank 1 \
  --out "$run" > "$work/overflow.out" 2>&1 || fail "2-rank run exited $?: $(tail -5 "$work/overflow.out")"
[ "$(log_lines "$run")" -eq 6 ] || fail "log.jsonl has $(log_lines "$run") lines, expected 6 (rank 0 writes it alone)"
line3=$(sed -n 3p "$run/log.jsonl")
echo "$line3" | grep -q '"skipped":true' || fail "step 3 not skipped: $line3"
echo "$line3" | grep -q '"scale":65536,"next_scale":32768' || fail "step 3 did not halve the scale: $line3"
echo "$line3" | grep -q '"injected":false' || fail "rank 0 logged an injection that happened on rank 1: $line3"
sed -n 4p "$run/log.jsonl" | grep -q '"skipped":false' || fail "step 4 skipped"
python3 - "$run/summary.json" <<'PY' || fail "summary.json: no distributed section as expected"
import json, sys
d = json.load(open(sys.argv[1]))["distributed"]
assert d["ranks"] == 2 and d["grad_reduce"] == "fp32", d
assert d["bytes_per_step"] > 0 and d["all_ranks_bytes_per_step"] >= d["bytes_per_step"], d
k = d["collectives"]["allreduce_sum_f32"]
assert k["calls_per_step"] == 1 and k["bytes_per_step"] > 0 and k["seconds_per_step"] > 0, k
assert d["collectives"]["allreduce_max"]["calls_per_step"] >= 1, d
print("summary:", json.dumps(d))
PY
grep -q "distributed: 2 ranks, grad-reduce fp32" "$work/overflow.out" || fail "no distributed line in the printed summary"
[ "$(grep -c '^mixprec train: 6 steps' "$work/overflow.out")" -eq 1 ] || fail "the summary was not printed exactly once"

echo "== 2. bad launches"
mpi 2 "$bin" train "${small[@]}" --steps 2 > "$work/nodist.out" 2>&1
code=$?
[ "$code" -ne 0 ] || fail "mpirun -np 2 without --distributed succeeded"
grep -q "distributed: launched by mpirun with 2 ranks; give --distributed" "$work/nodist.out" ||
  fail "no message for mpirun without --distributed: $(head -3 "$work/nodist.out")"
mpi 2 "$bin" train --distributed "${small[@]}" --steps 2 --inject-overflow-at 1 --inject-overflow-rank 2 \
  > "$work/badrank.out" 2>&1
[ $? -ne 0 ] || fail "inject-overflow-rank 2 of 2 ranks accepted"
grep -q "inject-overflow-rank: expected -1 (every rank) or a rank in \[0, 2), found 2" "$work/badrank.out" ||
  fail "no message for inject-overflow-rank 2: $(head -3 "$work/badrank.out")"

echo "== 3. a stalled rank: the collective deadline"
run="$work/stall"
start=$(date +%s)
mpi 2 "$bin" train --distributed "${small[@]}" --steps 100000 --warmup 1 --eval-every 0 --dist-timeout 3 \
  --out "$run" > "$work/stall.out" 2>&1 &
job=$!
if wait_lines "$run" 5 60; then
  pid=$(rank_pid "--out $run" 1)
  if [ -n "$pid" ]; then kill -STOP "$pid"; else fail "no pid for rank 1"; fi
else
  fail "the run did not reach step 5"
fi
( sleep 60; kill -KILL "$job" ) > /dev/null 2>&1 &
guard=$!
wait "$job"
code=$?
kill "$guard" 2>/dev/null
elapsed=$(($(date +%s) - start))
[ "$code" -ne 0 ] || fail "the job with a stalled rank exited 0"
[ "$elapsed" -lt 55 ] || fail "the job with a stalled rank took ${elapsed} s (deadline 3 s): a hang"
grep -qE "error: rank 0: [a-z_0-9]+ of [0-9]+ elements at step [0-9]+ did not complete within 3\.0+ s on rank 0 of 2: a peer rank died, stalled or is not in the same collective; aborting the job" "$work/stall.out" ||
  fail "no timeout error naming the collective and the step: $(grep -i error "$work/stall.out" | head -3)"
echo "stalled rank: exit $code after ${elapsed} s: $(grep -o 'error: rank 0: .*' "$work/stall.out" | head -1)"

echo "== 4. a killed rank, then resume on 3 ranks and on 1"
run="$work/kill"
steps=300
common=("${small[@]}" --steps $steps --warmup 2 --eval-every 0 --checkpoint-every 10 --keep-checkpoints 2)
start=$(date +%s)
mpi 2 "$bin" train --distributed "${common[@]}" --out "$run" > "$work/kill1.out" 2>&1 &
job=$!
if wait_lines "$run" 9 60; then
  pid=$(rank_pid "--out $run" 1)
  if [ -n "$pid" ]; then kill -KILL "$pid"; else fail "no pid for rank 1"; fi
else
  fail "the run did not reach step 9"
fi
wait "$job"
code=$?
elapsed=$(($(date +%s) - start))
[ "$code" -ne 0 ] || fail "the job with a killed rank exited 0"
grep -qE "rank 1 .*exited on signal 9|rank 1 .*(Killed)" "$work/kill1.out" ||
  fail "no message naming the killed rank: $(tail -5 "$work/kill1.out")"
echo "killed rank 1: exit $code after ${elapsed} s"
ck=$(ls "$run" | grep -E '^ckpt-' | sort | tail -n 1)
[ -n "$ck" ] || fail "no checkpoint before the kill"
at=$((10#$(echo "$ck" | sed 's/ckpt-\([0-9]*\).*/\1/')))
mpi 3 "$bin" train --distributed --resume "$run" > "$work/kill2.out" 2>&1 &
job=$!
if wait_lines "$run" $((at + 15)) 60; then
  pid=$(rank_pid "--resume $run" 2)
  if [ -n "$pid" ]; then kill -KILL "$pid"; else fail "no pid for rank 2"; fi
else
  fail "the 3-rank resume did not reach step $((at + 15))"
fi
wait "$job"
grep -q "resuming $run at step $at of $steps" "$work/kill2.out" || fail "3 ranks did not resume at step $at: $(head -3 "$work/kill2.out")"
grep -q "distributed: 3 ranks" "$work/kill2.out" && fail "the 3-rank resume was not interrupted"
ck=$(ls "$run" | grep -E '^ckpt-' | sort | tail -n 1)
at2=$((10#$(echo "$ck" | sed 's/ckpt-\([0-9]*\).*/\1/')))
[ "$at2" -gt "$at" ] || fail "the 3-rank resume wrote no checkpoint after step $at"
OMP_NUM_THREADS=1 "$bin" train --resume "$run" > "$work/kill3.out" 2>&1 || fail "1-process resume failed: $(tail -3 "$work/kill3.out")"
grep -q "resuming $run at step $at2 of $steps" "$work/kill3.out" || fail "1 process did not resume at step $at2"
[ "$(log_lines "$run")" -eq $steps ] || fail "log.jsonl has $(log_lines "$run") lines after the resumes, expected $steps"
python3 - "$run/log.jsonl" $steps <<'PY' || fail "log.jsonl steps are not 1..$steps once each"
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1])]
assert steps == list(range(1, int(sys.argv[2]) + 1)), steps
PY
[ -f "$run/ckpt-$(printf '%08d' $steps).safetensors" ] || fail "no final checkpoint of step $steps"
echo "resumed: 2 ranks -> killed at step >= 9, checkpoint $at -> 3 ranks -> killed, checkpoint $at2 -> 1 process -> step $steps"

echo "== 5. ZeRO-1 on 3 ranks == unsharded"
zargs=("${small[@]}" --steps 8 --inject-overflow-at 3 --inject-overflow-rank 2 --clip 0.05)
mpi 3 "$bin" train --distributed "${zargs[@]}" --out "$work/plain3" > "$work/plain3.out" 2>&1 ||
  fail "unsharded 3-rank run: $(tail -3 "$work/plain3.out")"
mpi 3 "$bin" train --distributed --zero 1 "${zargs[@]}" --out "$work/zero3" > "$work/zero3.out" 2>&1 ||
  fail "ZeRO 3-rank run: $(tail -3 "$work/zero3.out")"
"$tool" compare "$work/plain3/ckpt-00000008.safetensors" "$work/zero3/ckpt-00000008.safetensors" --ignore-config zero ||
  fail "the ZeRO checkpoint differs from the unsharded one"
"$tool" logs "$work/plain3/log.jsonl" "$work/zero3/log.jsonl" > "$work/zero-logs.out" 2>&1 ||
  echo "   (logs differ only in what ZeRO does not measure: $(grep -c . "$work/zero-logs.out") lines of differences)"
python3 - "$work/zero3/summary.json" <<'PY' || fail "ZeRO summary.json: no reduce-scatter / all-gather"
import json, sys
d = json.load(open(sys.argv[1]))["distributed"]
k = d["collectives"]
assert d["ranks"] == 3 and k["reduce_scatter"]["calls_per_step"] == 1, d
# per step: the norm's partial sums, the model copy (applied steps), and the checkpoint's gathers
assert 1 < k["all_gather"]["calls_per_step"] <= 3, d
print("zero summary:", json.dumps(d))
PY
grep "memory:" "$work/plain3.out" "$work/zero3.out"

echo "== 6. state formats on 2 ranks, resumed == straight"
# 64 channels: weights of 4096 elements and more, so the blocked moments really quantize.
fargs=(--corpus-tokens 20000 --vocab word:256 --threads 1 --eval-windows 4 --layers 1 --heads 2 --channels 64
       --context 16 --batch 4 --accum 1 --histogram-every 0 --warmup 2 --precision bf16 --master remainder
       --moments fp8,8bit --inject-overflow-at 3 --inject-overflow-rank 1)
mpi 2 "$bin" train --distributed "${fargs[@]}" --steps 8 --out "$work/formats" > "$work/formats.out" 2>&1 ||
  fail "formats run: $(tail -3 "$work/formats.out")"
mpi 2 "$bin" train --distributed "${fargs[@]}" --steps 4 --out "$work/formats-resumed" > "$work/formats-r1.out" 2>&1 ||
  fail "formats run to step 4: $(tail -3 "$work/formats-r1.out")"
mpi 2 "$bin" train --distributed --resume "$work/formats-resumed" --steps 8 > "$work/formats-r2.out" 2>&1 ||
  fail "formats resume: $(tail -3 "$work/formats-r2.out")"
"$tool" compare "$work/formats/ckpt-00000008.safetensors" "$work/formats-resumed/ckpt-00000008.safetensors" \
  --ignore-config out --ignore-config resume || fail "the resumed formats run differs from the straight one"
python3 - "$work/formats/log.jsonl" <<'PY' || fail "formats: step 3 was not skipped"
import json, sys
assert [json.loads(l)["skipped"] for l in open(sys.argv[1])][2] is True
PY

echo "== 7. state formats under ZeRO-1 on 2 ranks == unsharded"
mpi 2 "$bin" train --distributed --zero 1 "${fargs[@]}" --steps 8 --out "$work/zformats" > "$work/zformats.out" 2>&1 ||
  fail "ZeRO formats run: $(tail -3 "$work/zformats.out")"
"$tool" compare "$work/formats/ckpt-00000008.safetensors" "$work/zformats/ckpt-00000008.safetensors" \
  --ignore-config zero || fail "the ZeRO formats checkpoint differs from the unsharded one"
mpi 2 "$bin" train --distributed --zero 1 "${fargs[@]}" --steps 4 --out "$work/zformats-resumed" \
  > "$work/zformats-r1.out" 2>&1 || fail "ZeRO formats run to step 4: $(tail -3 "$work/zformats-r1.out")"
mpi 2 "$bin" train --distributed --zero 1 --resume "$work/zformats-resumed" --steps 8 > "$work/zformats-r2.out" 2>&1 ||
  fail "ZeRO formats resume: $(tail -3 "$work/zformats-r2.out")"
"$tool" compare "$work/formats/ckpt-00000008.safetensors" "$work/zformats-resumed/ckpt-00000008.safetensors" \
  --ignore-config zero --ignore-config out --ignore-config resume || fail "the resumed ZeRO formats run differs"
python3 - "$work/formats/summary.json" "$work/zformats/summary.json" <<'PY' || fail "ZeRO formats: rank 0 holds the whole state"
import json, sys
plain, zero = (json.load(open(p))["memory"] for p in sys.argv[1:])
for k in ("master_bytes", "optimizer_state_bytes"):
    assert 0 < zero[k] < 0.75 * plain[k], (k, plain[k], zero[k])
print("ZeRO formats, rank 0:", {k: (plain[k], zero[k]) for k in ("master_bytes", "optimizer_state_bytes")})
PY

if [ "$failures" -ne 0 ]; then
  echo "cli_dist: $failures failure(s)"
  exit 1
fi
echo "cli_dist: all checks passed"
