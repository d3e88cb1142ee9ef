#!/usr/bin/env bash
# Exact resume after SIGKILL, and clean stops on SIGTERM / SIGINT (docs/reliability.md).
#
#   kill_resume.sh MIXPREC_BIN CKPT_TOOL WORK_DIR [SEED]
#
# For each case (precision x model size x checkpoint interval; overflows injected at
# steps 3 and 7, so there are skipped steps and scale backoffs on both sides of
# checkpoints; accumulation over 2 or 4 micro-batches):
#   1. a reference run, never interrupted;
#   2. KILL_RUNS runs of the same configuration in other run folders, each SIGKILLed at
#      a random moment and resumed with `mixprec train --resume DIR`; a resume is
#      itself SIGKILLed again at random (1 to 3 kills per run in all), until a resume
#      runs to the end. A kill comes either a random delay after the process started
#      (any moment: start-up, a step, a checkpoint write, the resume's own writes) or a
#      random delay after the log reached a random step (inside the training loop);
#   3. the final checkpoint must hold the same state as the reference's (ckpt_tool
#      compare: every tensor byte for byte; scaler, optimizer, sampler, schedule, data
#      and step metadata; the totals except wall-clock seconds; the config except the
#      run folder) and log.jsonl the same lines once "seconds" and "scaler_seconds" are
#      removed.
# Where each kill landed is read from what it left behind (a new .NAME.tmp-* file: inside
# an atomic write) and printed, with totals at the end; so are temporaries still in a
# run folder after its last resume (a resume removes those of dead processes).
#
# Then SIGTERM and SIGINT mid-run: exit 143 / 130, "stopped after step N", a checkpoint
# of step N, no temporary, and a resume that ends identical to the reference.
#
# Environment: KILL_RUNS = kill-and-resume runs per case (default 6).
set -uo pipefail
bin=$1
tool=$2
work=$3
seed=${4:-20240611}
kill_runs=${KILL_RUNS:-6}
RANDOM=$seed

rm -rf "$work"
mkdir -p "$work"
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# One thread: deterministic and cheap. The tiny model spends most of its time in
# checkpoint writes (fsync), the small one mid-step (4 micro-batches of ~5 ms).
common=(--corpus-tokens 20000 --vocab word:256 --threads 1 --eval-windows 8 --eval-every 4 --histogram-every 5
        --layers 1 --heads 2 --steps 16 --inject-overflow-at 3,7)
tiny=(--accum 2 --batch 4 --context 16 --channels 16)
small=(--accum 4 --batch 8 --context 32 --channels 32)
steps=16

ms_text() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }
log_lines() { if [ -f "$1/log.jsonl" ]; then wc -l < "$1/log.jsonl"; else echo 0; fi; }
newest_ckpt() {
  local f
  f=$(ls "$1" 2>/dev/null | grep -E '^ckpt-[0-9]{8,}\.safetensors$' | sort | tail -n 1)
  if [ -z "$f" ]; then echo 0; else f=${f#ckpt-}; echo $((10#${f%.safetensors})); fi
}
list_tmp() { ls -A "$1" 2>/dev/null | grep -E '^\..*\.tmp-[0-9]'; }
count_tmp() { list_tmp "$1" | wc -l; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# `mixprec train ARGS` in the background: $pid; output to the file $1.
start() {
  local out=$1
  shift
  "$bin" train "$@" > "$out" 2>&1 &
  pid=$!
}

# Kill landing places (counted over all cases).
removed=0 in_write=0 in_ckpt_phase=0 in_step=0 before_ckpt=0 before_config=0 startup=0 after_last=0 ended=0 kills_total=0

# Where the SIGKILL that just happened in DIR landed (EVERY = checkpoint interval): $where.
classify() {
  local dir=$1 every=$2 tmp_now ck lines new_tmp
  tmp_now=$(count_tmp "$dir")
  new_tmp=$(comm -13 <(echo "$tmp_names_before") <(list_tmp "$dir" | sort) | tr '\n' ' ')
  ck=$(newest_ckpt "$dir")
  lines=$(log_lines "$dir")
  if [ "$lines:$ck:$tmp_now" = "$state_before" ] && [ -z "$new_tmp" ]; then
    startup=$((startup + 1)); where="start-up or first step of the process (it had written nothing yet)"
  elif [ -n "$new_tmp" ]; then
    in_write=$((in_write + 1))
    where="inside an atomic write: ${new_tmp}left (log at step $lines, checkpoint $ck)"
  elif [ ! -f "$dir/config.json" ]; then
    before_config=$((before_config + 1)); where="before config.json was written"
  elif [ "$ck" -eq 0 ]; then
    before_ckpt=$((before_ckpt + 1)); where="before the first checkpoint (log at step $lines)"
  elif [ "$ck" -eq "$steps" ]; then
    after_last=$((after_last + 1)); where="after the last checkpoint (summary.json, exit)"
  elif [ "$lines" -gt "$ck" ] && [ $((lines % every)) -eq 0 ]; then
    in_ckpt_phase=$((in_ckpt_phase + 1)); where="checkpoint $lines being serialized (no temporary yet; checkpoint $ck)"
  else
    in_step=$((in_step + 1)); where="in training step $((lines + 1)) or the start-up before it (log at step $lines, checkpoint $ck)"
  fi
}

check_same() {  # REF DIR [--ignore-config KEY]...
  local ref=$1 dir=$2
  shift 2
  local last f
  last=$(newest_ckpt "$ref")
  if [ "$(newest_ckpt "$dir")" -ne "$last" ]; then
    fail "$dir: newest checkpoint is step $(newest_ckpt "$dir"), expected $last"
    return
  fi
  f=$(printf 'ckpt-%08d.safetensors' "$last")
  "$tool" compare "$ref/$f" "$dir/$f" "$@" || fail "$dir/$f differs from $ref/$f"
  "$tool" logs "$ref/log.jsonl" "$dir/log.jsonl" || fail "$dir/log.jsonl differs from $ref/log.jsonl"
  [ -f "$dir/summary.json" ] || fail "$dir has no summary.json"
}

# kill_run NAME EVERY REF_MS STEP_MS INDEX CONFIG...
kill_run() {
  local name=$1 every=$2 ref_ms=$3 step_ms=$4 dir=$work/$1-kill$5
  shift 5
  local cfg=("$@" --checkpoint-every "$every")
  local kills=$((1 + RANDOM % 3)) k=0 rc mode d at cur
  echo "-- $dir: up to $kills kill(s)"
  tmp_names_before=
  state_before=none
  start "$dir.out0" "${cfg[@]}" --out "$dir"
  while :; do
    if [ $((RANDOM % 2)) -eq 0 ]; then
      d=$((RANDOM % (ref_ms + 1)))
      sleep "$(ms_text "$d")"
      mode="$d ms after the start"
    else
      cur=$(log_lines "$dir")
      at=$((cur + 1 + RANDOM % (steps - cur > 0 ? steps - cur : 1)))
      while kill -0 "$pid" 2>/dev/null && [ "$(log_lines "$dir")" -lt "$at" ]; do sleep 0.002; done
      d=$((RANDOM % (2 * step_ms + 1)))
      sleep "$(ms_text "$d")"
      mode="$d ms after step $at was logged"
    fi
    if kill -KILL "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null
      k=$((k + 1))
      kills_total=$((kills_total + 1))
      classify "$dir" "$every"
      echo "   kill $k, $mode: $where"
    else
      wait "$pid"
      rc=$?
      ended=$((ended + 1))
      echo "   the process had ended (exit $rc) before kill $((k + 1)) ($mode)"
      [ "$rc" -eq 0 ] || { fail "$dir: exit $rc"; cat "$dir.out$k"; return; }
      break
    fi
    tmp_names_before=$(list_tmp "$dir" | sort)
    state_before="$(log_lines "$dir"):$(newest_ckpt "$dir"):$(count_tmp "$dir")"
    local args=(--resume "$dir")
    if [ ! -f "$dir/config.json" ]; then  # not yet a run folder: start it again
      rm -rf "$dir"
      tmp_names_before=
      state_before=none
      args=("${cfg[@]}" --out "$dir")
    fi
    if [ "$k" -lt "$kills" ]; then
      start "$dir.out$k" "${args[@]}"
      continue
    fi
    "$bin" train "${args[@]}" > "$dir.final" 2>&1 || { fail "$dir: the last resume failed"; cat "$dir.final"; return; }
    break
  done
  # The last resume removed what earlier kills left (their writers are gone).
  [ "$(count_tmp "$dir")" -eq 0 ] || fail "$dir: temporaries left: $(list_tmp "$dir" | tr '\n' ' ')"
  removed=$((removed + $(cat "$dir".out* "$dir.final" 2>/dev/null | grep -c 'left by an interrupted write')))
  check_same "$work/$name-ref" "$dir"
}

# run_case NAME EVERY CONFIG...: the reference, then KILL_RUNS kill-and-resume runs.
run_case() {
  local name=$1 every=$2
  shift 2
  local t0 ref_ms step_ms i
  echo "== $name: $* --checkpoint-every $every"
  t0=$(now_ms)
  if ! "$bin" train "$@" --checkpoint-every "$every" --out "$work/$name-ref" > "$work/$name-ref.out" 2>&1; then
    fail "$name: the reference run failed"
    cat "$work/$name-ref.out"
    return
  fi
  ref_ms=$(($(now_ms) - t0))
  step_ms=$((ref_ms / steps > 1 ? ref_ms / steps : 1))
  echo "   reference: $ref_ms ms, $(grep -o '[0-9]* applied, [0-9]* skipped' "$work/$name-ref.out")"
  grep -q "(14 applied, 2 skipped: 2 nonfinite_grad)" "$work/$name-ref.out" || fail "$name: expected the 2 injected skips"
  for ((i = 1; i <= kill_runs; i++)); do kill_run "$name" "$every" "$ref_ms" "$step_ms" "$i" "$@"; done
}

# stop_case NAME SIGNAL CODE REF EVERY CONFIG...: SIGNAL mid-run. With EVERY = 0 (a
# checkpoint only at the end, or on the stop) it comes after a random logged step; with
# EVERY = 1 (the tiny model: mostly writing checkpoints) 0-4 ms after a random logged
# step, so it often arrives inside a checkpoint write.
stop_case() {
  local name=$1 sig=$2 code=$3 ref=$4 every=$5 dir=$work/$1
  shift 5
  local at=$((2 + RANDOM % (steps - 4))) rc n d f attempt
  # On a loaded machine this polling loop can fall several steps behind a tiny model, and
  # the run may finish before the signal lands (exit 0 with every step done): that says
  # nothing about the stop, so the case is run again from scratch, signalling earlier.
  for attempt in 1 2 3; do
    rm -rf "$dir"
    start "$dir.out" "$@" --checkpoint-every "$every" --out "$dir"
    if [ "$every" -eq 0 ]; then
      echo "== $name: SIG$sig after step $at is logged (no checkpoint before the stop)"
      while kill -0 "$pid" 2>/dev/null && [ "$(log_lines "$dir")" -lt "$at" ]; do sleep 0.002; done
    else
      d=$((RANDOM % 5))
      echo "== $name: SIG$sig $d ms after step $at is logged (a checkpoint every step)"
      while kill -0 "$pid" 2>/dev/null && [ "$(log_lines "$dir")" -lt "$at" ]; do sleep 0.002; done
      sleep "$(ms_text "$d")"
    fi
    kill -"$sig" "$pid" 2>/dev/null
    wait "$pid"
    rc=$?
    [ "$rc" -eq 0 ] && [ "$(log_lines "$dir")" -eq "$steps" ] || break
    echo "   the run finished (all $steps steps) before SIG$sig arrived; attempt $((attempt + 1)) signals at step 2"
    at=2
  done
  [ "$rc" -eq "$code" ] || { fail "$name: exit $rc, expected $code"; cat "$dir.out"; return; }
  n=$(log_lines "$dir")
  grep -q "SIG$sig: stopped after step $n of $steps" "$dir.out" ||
    { fail "$name: no 'SIG$sig: stopped after step $n of $steps'"; cat "$dir.out"; }
  grep -q "continue with: mixprec train --resume $dir" "$dir.out" || fail "$name: no 'continue with' line"
  [ "$(newest_ckpt "$dir")" -eq "$n" ] || fail "$name: newest checkpoint $(newest_ckpt "$dir"), expected step $n"
  [ "$(count_tmp "$dir")" -eq 0 ] || fail "$name: temporaries left: $(list_tmp "$dir" | tr '\n' ' ')"
  [ ! -e "$dir/summary.json" ] || fail "$name: summary.json written by a stopped run"
  f=$(printf 'ckpt-%08d.safetensors' "$n")
  if [ -f "$ref/$f" ]; then  # the reference keeps its newest 3
    "$tool" compare "$ref/$f" "$dir/$f" --ignore-config checkpoint-every || fail "$name: $f differs from the reference's"
  fi
  echo "   exit $rc after step $n; checkpoint $(newest_ckpt "$dir"); no temporary"
  "$bin" train --resume "$dir" > "$dir.resume" 2>&1 || { fail "$name: resume failed"; cat "$dir.resume"; return; }
  check_same "$ref" "$dir" --ignore-config checkpoint-every
}

run_case fp16-tiny 1 "${common[@]}" "${tiny[@]}" --precision fp16
run_case fp16-small 3 "${common[@]}" "${small[@]}" --precision fp16
run_case pure-tiny 1 "${common[@]}" "${tiny[@]}" --precision fp16-pure
run_case bf16-small 2 "${common[@]}" "${small[@]}" --precision bf16
stop_case fp16-sigterm TERM 143 "$work/fp16-small-ref" 0 "${common[@]}" "${small[@]}" --precision fp16
stop_case bf16-sigint INT 130 "$work/bf16-small-ref" 0 "${common[@]}" "${small[@]}" --precision bf16
stop_case tiny-sigterm TERM 143 "$work/fp16-tiny-ref" 1 "${common[@]}" "${tiny[@]}" --precision fp16
stop_case pure-sigint INT 130 "$work/pure-tiny-ref" 1 "${common[@]}" "${tiny[@]}" --precision fp16-pure
# fp8-delayed: the amax histories (length 4: they wrap between checkpoints) and scales resume
# exactly. Last, so that the seeded kill moments of the cases above stay what they were.
run_case fp8d-tiny 1 "${common[@]}" "${tiny[@]}" --precision fp8-delayed --loss-scale dynamic --fp8-amax-history 4

echo "== kills: $kills_total; inside an atomic write (a temporary left): $in_write; checkpoint being serialized:" \
     "$in_ckpt_phase; in a training step: $in_step; start-up (nothing written yet): $startup; before the first" \
     "checkpoint: $before_ckpt; before config.json: $before_config; after the last checkpoint: $after_last;" \
     "processes that ended before their kill: $ended; stale temporaries removed by resumes: $removed"
if [ "$failures" -ne 0 ]; then
  echo "kill_resume: $failures failure(s)"
  exit 1
fi
echo "kill_resume: all resumed runs match their references"
