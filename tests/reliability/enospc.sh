#!/usr/bin/env bash
# A full disk, for real: run folders written on a small tmpfs until the kernel says ENOSPC at
# each kind of write (docs/reliability.md, "A full disk"):
#   1. no space for config.json: the writer is refused at creation, naming ENOSPC, and leaves
#      no temporary and no config.json;
#   2. appends and summaries that fail part way (a Telemetry recorder, telemetry_writer): each
#      failed call raises, the log keeps whole lines only, `mixprec report` reads the folder at
#      every failure with exactly the records that returned, byte for byte; space comes back
#      (a filler file is removed) and later records follow with consecutive steps;
#   3. mixprec train on a full disk: exit 1 naming ENOSPC, the log readable; with space back,
#      --resume finishes the run.
# The tmpfs is mounted directly when this runs as root and may mount; otherwise in a user and
# mount namespace (unshare -rm); where neither is permitted (a container without mount
# rights and user namespaces) the test is skipped (exit 77) and says why.
#
#   enospc.sh MIXPREC_BIN TELEMETRY_WRITER_BIN WORK_DIR
set -uo pipefail
bin=$1
writer=$2
work=$3

if [ "${MIXPREC_ENOSPC_NS:-}" != 1 ]; then
  rm -rf "$work"
  mkdir -p "$work/probe"
  if mount -t tmpfs -o size=64k tmpfs "$work/probe" 2>/dev/null; then
    umount "$work/probe"
  elif unshare --user --map-root-user --mount true 2>/dev/null; then
    echo "enospc: mount is not permitted here; running in a user and mount namespace (unshare -rm)"
    MIXPREC_ENOSPC_NS=1 exec unshare --user --map-root-user --mount bash "$0" "$@"
  else
    echo "enospc: SKIPPED: this machine permits neither 'mount -t tmpfs' nor user namespaces (unshare -rm),"
    echo "so no small file system can be made full; the RLIMIT_FSIZE tests (test_run_folder_guard,"
    echo "test_reliability_run_folder.py) still cut appends short for real"
    exit 77
  fi
fi
cd "$work" || exit 1
fail() {
  echo "FAIL: $*"
  exit 1
}
mounted=()
cleanup() { for m in "${mounted[@]}"; do umount "$m" 2>/dev/null; done; }
trap cleanup EXIT
# mount_fs NAME SIZE: a fresh tmpfs at $work/NAME.
mount_fs() {
  mkdir -p "$1"
  mount -t tmpfs -o "size=$2" tmpfs "$1" || fail "cannot mount a tmpfs at $1"
  mounted+=("$work/$1")
}
# fill DIR: files of 4 KiB (one tmpfs page each) until the disk is full; prints how many.
fill() {
  local k=0
  while head -c 4096 /dev/zero > "$1/filler$k" 2>/dev/null; do k=$((k + 1)); done
  rm -f "$1/filler$k"
  echo "$k"
}
# the log lines of RUN against the "ok" lines the writer printed: the same, byte for byte.
check_log() {
  local run=$1 oks=$2 what=$3
  "$bin" report "$run" --out "$work/report.html" > /dev/null 2> report.err ||
    fail "$what: mixprec report cannot read the folder: $(cat report.err)"
  cut -d' ' -f3- "$oks" > expected.jsonl
  cmp -s expected.jsonl "$run/log.jsonl" ||
    fail "$what: log.jsonl differs from the records that returned ($(wc -l < expected.jsonl) returned, $(wc -l < "$run/log.jsonl") lines)"
  if ls -A "$run" | grep -q '\.tmp-'; then fail "$what: a temporary is left: $(ls -A "$run")"; fi
}

# ---- 1. no space at creation
mount_fs full 16k
n=$(fill full)
"$writer" full/run 5 > create.txt 2>&1
rc=$?
[ "$rc" -eq 1 ] || fail "creation on a full disk: exit $rc, expected 1: $(cat create.txt)"
grep -q "create-fail .*No space left on device" create.txt || fail "creation: no ENOSPC named: $(cat create.txt)"
[ ! -e full/run/config.json ] || fail "creation on a full disk left a config.json"
if ls -A full/run 2>/dev/null | grep -q '\.tmp-'; then fail "creation left a temporary: $(ls -A full/run)"; fi
echo "1. creation on a full disk ($n pages of filler): refused, $(cut -c1-90 create.txt)"

# ---- 2. appends and summaries that fail, space coming back a page at a time
mount_fs fs 256k
n=$(fill fs)
rm -f fs/filler0 fs/filler1 fs/filler2  # room for config.json and a few lines
: > ok.txt
: > fails.txt
retries=0 freed=3 finished=0
coproc W { "$writer" fs/run 40 --finish-every 6 --wait-on-failure; }
wpid=$W_PID
exec {from_w}<&"${W[0]}" {to_w}>&"${W[1]}"  # bash unsets W and W_PID once the writer ends
while IFS= read -r line <&"$from_w"; do
  case $line in
    ok\ *) echo "$line" >> ok.txt ;;
    finished) finished=$((finished + 1)) ;;
    fail\ *|finish-fail\ *)
      echo "$line" >> fails.txt
      grep -q "No space left on device" <<< "$line" || fail "a failure that is not ENOSPC: $line"
      check_log fs/run ok.txt "after failure $(wc -l < fails.txt) ($line)"
      # The first failure of each fill is retried once without space (it fails again), then
      # one filler page is freed.
      if [ $retries -eq 0 ]; then
        retries=1
      else
        retries=0
        [ -e "fs/filler$freed" ] || fail "no filler left to free (the writer never got space back)"
        rm -f "fs/filler$freed"
        freed=$((freed + 1))
      fi
      echo go >&"$to_w"
      ;;
    create-fail*) fail "the writer could not create its folder: $line" ;;
  esac
done
wait "$wpid"
rc=$?
exec {from_w}<&- {to_w}>&-
[ "$rc" -eq 0 ] || fail "the writer exited $rc"
fails=$(wc -l < fails.txt)
oks=$(wc -l < ok.txt)
[ "$oks" -eq 40 ] || fail "$oks records returned, expected 40"
[ "$fails" -ge 4 ] || fail "only $fails calls failed: the disk never filled up (make the tmpfs smaller)"
grep -q '^fail ' fails.txt || fail "no record() failed"
check_log fs/run ok.txt "at the end"
steps=$(sed -n 's/^{"step":\([0-9]*\),.*/\1/p' fs/run/log.jsonl | tr '\n' ' ')
[ "$steps" = "$(seq -s ' ' 1 40) " ] || fail "the log's steps are not 1..40: $steps"
echo "2. $oks records returned and are in the log byte for byte; $fails calls failed with ENOSPC" \
     "($(grep -c '^fail ' fails.txt) record, $(grep -c '^finish-fail ' fails.txt) finish), each left a readable folder;" \
     "$((freed - 3)) pages freed; $finished summaries written"

# ---- 3. mixprec train on a full disk, then --resume with space back
mount_fs eng 2m
tiny=(--accum 1 --batch 2 --context 16 --channels 16 --layers 1 --heads 2 --corpus-tokens 20000 --vocab word:256
      --threads 1 --eval-windows 8 --warmup 0)
n=$(fill eng)
k=0
while [ $k -lt 28 ]; do rm -f "eng/filler$k"; k=$((k + 1)); done  # 112 KiB: config.json, some lines, about one checkpoint
"$bin" train "${tiny[@]}" --steps 40 --checkpoint-every 10 --keep-checkpoints 1 --out eng/run > train.txt 2>&1
rc=$?
[ "$rc" -eq 1 ] || fail "mixprec train on a full disk: exit $rc, expected 1 (make the tmpfs smaller?): $(tail -n 3 train.txt)"
grep -q "No space left on device" train.txt || fail "mixprec train did not name ENOSPC: $(tail -n 3 train.txt)"
if ls -A eng/run | grep -q '\.tmp-'; then fail "mixprec train left a temporary: $(ls -A eng/run)"; fi
"$bin" report eng/run --out "$work/eng.html" > /dev/null 2> report.err || fail "report after ENOSPC: $(cat report.err)"
logged=$(wc -l < eng/run/log.jsonl)
rm -f eng/filler*
timeout 300 "$bin" train --resume eng/run > resume.txt 2>&1 || fail "resume with space back: $(tail -n 3 resume.txt)"
"$bin" report eng/run --out "$work/eng.html" > /dev/null 2> report.err || fail "report after resume: $(cat report.err)"
[ "$(wc -l < eng/run/log.jsonl)" -eq 40 ] || fail "the resumed run's log has $(wc -l < eng/run/log.jsonl) lines"
echo "3. mixprec train stopped at ENOSPC with $logged lines logged ($(grep -m1 -o "[a-z]* '[^']*': [^:]*: No space left on device" train.txt | head -c 120));" \
     "--resume finished it to step 40"
echo "PASS"
