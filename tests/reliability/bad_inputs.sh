#!/usr/bin/env bash
# The bad-input catalogue of docs/bad_inputs.md, one case per ctest test
# (reliability.bad_input.CASE): each feeds mixprec one bad input and checks the exit code,
# a fragment of the message, that the process neither crashed nor hung (60 s), and that
# no file or folder was created or left partial (a run folder that existed is unchanged,
# byte for byte, with no temporary in it).
#
#   bad_inputs.sh MIXPREC_BIN CKPT_TOOL WORK_DIR CASE
#   bad_inputs.sh --list          the case names, one per line
#
# Exit 0 pass, 1 fail, 77 skipped (a case that needs privileges or their absence: a
# read-only folder cannot stop root; a full disk needs `mount -t tmpfs`).
set -uo pipefail

cases=(
  data_empty data_binary data_huge_line data_huge_line_words data_too_short data_latin1 data_utf16 data_directory
  data_unreadable
  lr_inf accum_zero context_zero beta1_one eps_negative weight_decay_nan threads_huge keep_zero val_fraction
  optimizer static_nan env_threads json_parent_missing
  growth_one backoff_zero backoff_one interval_zero init_scale_nan init_scale_inf init_scale_negative max_scale_zero
  config_truncated config_wrong_type config_array config_empty config_duplicate_key
  ckpt_truncated ckpt_bitflip ckpt_version ckpt_wrong_model ckpt_header_oversized ckpt_header_huge ckpt_empty
  resume_log_damaged resume_config_malformed resume_missing resume_changed_flag
  out_parent_is_file out_is_file out_readonly disk_full
  npy_nonfinite npy_all_nan
  fp8_format fp8_amax_history_zero fp8_amax_algo fp8_margin_range fp8_margin_text fp8_amax_epsilon fp8_power2_text
  mx_rounding fp8_flag_wrong_precision fp8_flag_wrong_recipe fp8_config_wrong_precision
  config_deep resume_config_deep report_config_deep simulate_config_deep log_deep ckpt_meta_deep
  diverged ckpt_header_tamper ckpt_header_key_renamed ckpt_v1_resumes
  static_reciprocal json_is_dir out_empty json_fifo json_symlink json_device report_out_special
  data_relative_resume data_non_utf8_name
  stdout_full sigterm_last_step report_log_cut config_overflow env_threads_train ckpt_newest_is_dir
  report_config_invalid report_out_is_log resume_json_is_log
  resume_config_deleted resume_fewer_steps data_utf32 steps_hex
  config_fifo advise_config_fifo report_summary_fifo report_log_fifo inspect_fifo data_fifo report_summary_number
  ckpt_meta_negative advise_budget_empty
  recipe_unknown_module recipe_pattern_none recipe_wrong_precision recipe_malformed recipe_missing recipe_fp8_option
  recipe_fraction_trains recipe_resume_changed recipe_resume_more_steps
)
if [ "${1:-}" = "--list" ]; then
  printf '%s\n' "${cases[@]}"
  exit 0
fi

bin=$1
tool=$2
work=$3
case_name=$4
umount "$work/disk" 2> /dev/null  # a tmpfs left mounted by an earlier disk_full that was killed
rm -rf "$work"
mkdir -p "$work"
cd "$work" || exit 1

fail() {
  echo "FAIL: $case_name: $*"
  exit 1
}
skip() {
  echo "SKIPPED: $case_name: $*"
  exit 77
}

# One thread and a tiny model; `--out` is added by the cases that need one. (A flag
# may be given once: `small` lacks --steps and --channels for the cases that set them.)
small=(--accum 1 --batch 2 --context 16 --layers 1 --heads 2 --corpus-tokens 20000 --vocab word:256 --threads 1
       --eval-windows 8)
tiny=("${small[@]}" --steps 2 --channels 16)

# expect CODE FRAGMENT CMD...: runs CMD (60 s at most), checks the exit code and that
# the output (stdout + stderr) contains FRAGMENT.
expect() {
  local code=$1 fragment=$2 rc
  shift 2
  timeout 60 "$@" > out.txt 2>&1
  rc=$?
  echo "\$ mixprec ${*:2}" | head -c 400
  echo
  tail -n 5 out.txt
  [ "$rc" -ne 124 ] || fail "hung (killed after 60 s)"
  [ "$rc" -lt 128 ] || fail "crashed: exit $rc (signal $((rc - 128)))"
  [ "$rc" -eq "$code" ] || fail "exit $rc, expected $code"
  grep -qF -- "$fragment" out.txt || fail "the output lacks '$fragment'"
}

also() {  # FRAGMENT: the last command's output contains it too
  grep -qF -- "$1" out.txt || fail "the output lacks '$1'"
}

absent() {  # PATH...: none of them exists
  local p
  for p in "$@"; do [ ! -e "$p" ] || fail "'$p' was created although the command failed"; done
}

# A fingerprint of a folder: every file (hidden ones too) with its size and hash.
snapshot() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }

# train_rejects CODE FRAGMENT ARGS...: `mixprec train ARGS --out run` fails, no run folder.
train_rejects() {
  local code=$1 fragment=$2
  shift 2
  expect "$code" "$fragment" "$bin" train "$@" --out run
  absent run
}

# make_run STEPS CHANNELS FOLDER: a tiny run with a checkpoint at each step.
make_run() {
  "$bin" train "${small[@]}" --steps "$1" --channels "$2" --checkpoint-every 1 --out "$3" > make_run.txt 2>&1 ||
    { cat make_run.txt; fail "setup run failed"; }
}

# resume_rejects CODE FRAGMENT: `mixprec train --resume run` fails and leaves run as it was.
resume_rejects() {
  local code=$1 fragment=$2 before
  shift 2
  before=$(snapshot run)
  expect "$code" "$fragment" "$bin" train --resume run "$@"
  [ "$(snapshot run)" = "$before" ] || fail "the run folder changed: $(diff <(echo "$before") <(snapshot run))"
}

# npy FILE HEX_DATA COUNT: a float32 .npy (version 1.0) of COUNT values.
npy() {
  local h="{'descr': '<f4', 'fortran_order': False, 'shape': ($3,), }" pad hl
  pad=$((64 - (10 + ${#h} + 1) % 64))
  [ "$pad" -eq 64 ] && pad=0
  hl=$((${#h} + pad + 1))
  {
    printf '\223NUMPY\001\000'
    printf "\\$(printf %03o $((hl % 256)))\\$(printf %03o $((hl / 256)))"
    printf '%s%*s\n' "$h" "$pad" ''
    printf "$2"
  } > "$1"
}

ckpt=run/ckpt-00000002.safetensors

# recipes FIELDS: r.json, a recipe file of FIELDS (after its format and version).
recipes() { printf '{"format": "mixprec.low_precision", "version": 1, %s}\n' "$1" > r.json; }

# deep N: a complete JSON object whose "lr" is an array nested N levels deep
# ({"lr":[[[...]]]}): a stack overflow (SIGSEGV) in the readers before issue 15.
deep() {
  printf '{"lr":'
  head -c "$1" /dev/zero | tr '\0' '['
  head -c "$1" /dev/zero | tr '\0' ']'
  printf '}'
}

case "$case_name" in
  # ---- data files (--data): exit 1, no run folder
  data_empty)
    : > text.txt
    train_rejects 1 "data file 'text.txt' is empty" "${tiny[@]}" --data text.txt ;;
  data_binary)
    printf 'some words\000 and a NUL byte' > text.txt
    train_rejects 1 "data file 'text.txt' is binary: NUL byte at offset 10" "${tiny[@]}" --data text.txt ;;
  data_huge_line)  # one 10 MB line without a word break: one token
    head -c 10000000 /dev/zero | tr '\0' 'a' > text.txt
    train_rejects 1 "data file 'text.txt' is too short: found 1 tokens with vocabulary word:256, need at least 170" \
      "${tiny[@]}" --data text.txt ;;
  data_huge_line_words)  # not an error: one 10 MB line of words trains
    yes 'the cat runs fast and the dog sleeps' | head -c 10000000 | tr '\n' ' ' > text.txt
    expect 0 "mixprec train: 1 steps (1 applied, 0 skipped)" "$bin" train "${small[@]}" --steps 1 --channels 16 --data text.txt ;;
  data_too_short)
    echo "hello world" > text.txt
    train_rejects 1 "data file 'text.txt' is too short: found 2 tokens" "${tiny[@]}" --data text.txt ;;
  data_latin1)
    printf 'caf\351 au lait\n' > text.txt
    train_rejects 1 "data file 'text.txt' is not valid UTF-8 text: byte 0x20 does not continue the character starting with 0xe9 at offset 4" \
      "${tiny[@]}" --data text.txt ;;
  data_utf16)
    printf '\377\376h\000i\000' > text.txt
    train_rejects 1 "data file 'text.txt' looks like UTF-16 (byte-order mark 0xff 0xfe at offset 0); convert it to UTF-8" \
      "${tiny[@]}" --data text.txt ;;
  data_directory)
    mkdir folder
    train_rejects 1 "data file 'folder' is a directory; expected a UTF-8 text file" "${tiny[@]}" --data folder ;;
  data_unreadable)
    [ "$(id -u)" -ne 0 ] || skip "root reads a file of mode 000"
    echo "text" > text.txt
    chmod 000 text.txt
    train_rejects 1 "data file 'text.txt' cannot be opened: Permission denied" "${tiny[@]}" --data text.txt ;;

  # ---- flag values: exit 2, no run folder
  lr_inf) train_rejects 2 "lr: expected a finite number > 0, found inf" "${tiny[@]}" --lr inf ;;
  accum_zero) train_rejects 2 "accum: expected an integer in [1, 1000000], found 0" --accum 0 ;;
  context_zero) train_rejects 2 "context: expected an integer in [2, 4096], found 0" --context 0 ;;
  beta1_one) train_rejects 2 "beta1: expected a number in [0, 1), found 1" --beta1 1 ;;
  eps_negative) train_rejects 2 "eps: expected a finite number > 0, found -1" --eps -1 ;;
  weight_decay_nan) train_rejects 2 "weight-decay: expected a finite number >= 0, found nan" --weight-decay nan ;;
  threads_huge) train_rejects 2 "threads: expected an integer in [0, 1024], found 100000" --threads 100000 ;;
  keep_zero) train_rejects 2 "keep-checkpoints: expected an integer >= 1, found 0" --keep-checkpoints 0 ;;
  val_fraction) train_rejects 2 "val-fraction: expected a number in (0, 0.5], found 0.9" --val-fraction 0.9 ;;
  fp8_format)
    train_rejects 2 "fp8-format: expected hybrid or e4m3, found 'e5m2'" --precision fp8-delayed --fp8-format e5m2 ;;
  fp8_amax_history_zero)
    train_rejects 2 "fp8-amax-history: expected an integer in [1, 1048576], found 0" --precision fp8-delayed \
      --fp8-amax-history 0 ;;
  fp8_amax_algo)
    train_rejects 2 "fp8-amax-algo: expected max or most_recent, found 'mean'" --precision fp8-delayed \
      --fp8-amax-algo mean ;;
  fp8_margin_range)
    train_rejects 2 "fp8-margin: expected an integer in [-64, 64], found 65" --precision fp8-delayed --fp8-margin 65 ;;
  fp8_margin_text)
    train_rejects 2 "fp8-margin: expected an integer in [-64, 64], found '1.5'" --precision fp8-delayed \
      --fp8-margin 1.5 ;;
  fp8_amax_epsilon)
    train_rejects 2 "fp8-amax-epsilon: expected a finite number >= 0, found -1" --precision fp8-current \
      --fp8-amax-epsilon -1 ;;
  fp8_power2_text)
    train_rejects 2 "fp8-power2-scales: expected true or false, found 'yes'" --precision fp8-current \
      --fp8-power2-scales yes ;;
  mx_rounding) train_rejects 2 "mx-rounding: expected te or ocp, found 'floor'" --precision mxfp8 --mx-rounding floor ;;
  fp8_flag_wrong_precision)
    train_rejects 2 "fp8-margin: applies to --precision fp8-delayed only, found --precision bf16" --precision bf16 \
      --fp8-margin 0 ;;
  fp8_flag_wrong_recipe)
    train_rejects 2 "mx-rounding: applies to --precision mxfp8 only, found --precision fp8-current" \
      --precision fp8-current --mx-rounding ocp ;;
  fp8_config_wrong_precision)
    printf '{"precision": "fp16", "fp8-amax-history": 16}\n' > fp8.json
    train_rejects 2 "fp8-amax-history: expected the default (1024) with --precision fp16; it applies to --precision fp8-delayed, found 16" \
      --config fp8.json ;;
  optimizer) train_rejects 2 "optimizer: expected adamw, adam or sgd, found 'lamb'" --optimizer lamb ;;
  static_nan) train_rejects 2 "loss-scale: expected static:S with S a number > 0 that float32 holds" --loss-scale static:nan ;;
  env_threads)  # the thread pool's environment variable, read by `mixprec inspect`
    npy values.npy '\000\000\200\077' 1
    MIXPREC_THREADS=abc expect 1 "MIXPREC_THREADS: expected an integer in [1, 1024], found 'abc'" "$bin" inspect values.npy ;;
  json_parent_missing)
    train_rejects 2 "json: folder 'nodir' does not exist" "${tiny[@]}" --json nodir/summary.json
    absent nodir ;;

  # ---- loss-scale settings (LossScaleConfig validation, through `scaler replay --set`): exit 2
  growth_one)
    expect 2 "growth_factor: expected a finite number > 1, found 1" "$bin" scaler replay --set growth_factor=1 --overflows 01 ;;
  backoff_zero)
    expect 2 "backoff_factor: expected a number in (0, 1), found 0" "$bin" scaler replay --preset torch --set backoff_factor=0 --overflows 01 ;;
  backoff_one)
    expect 2 "backoff_factor: expected a number in (0, 1), found 1" "$bin" scaler replay --preset torch --set backoff_factor=1 --overflows 01 ;;
  interval_zero)
    expect 2 "growth_interval: expected an integer in [1, 2147483647], found 0" "$bin" scaler replay --set growth_interval=0 --overflows 01 ;;
  init_scale_nan)
    expect 2 "init_scale: expected a finite number > 0, found nan" "$bin" scaler replay --set init_scale=nan --overflows 01 ;;
  init_scale_inf)
    expect 2 "init_scale: expected a finite number > 0, found inf" "$bin" scaler replay --set init_scale=inf --overflows 01 ;;
  init_scale_negative)
    expect 2 "init_scale: expected a finite number > 0, found -1" "$bin" scaler replay --set init_scale=-1 --overflows 01 ;;
  max_scale_zero)
    expect 2 "max_scale: expected a number > 0, inf or none, found 0" "$bin" scaler replay --set max_scale=0 --overflows 01 ;;

  # ---- JSON config files (--config): exit 2, no run folder
  config_truncated)
    printf '{"lr": 0.1' > config.json
    train_rejects 2 "config file 'config.json': malformed JSON: parse error at line 1, column 11" --config config.json ;;
  config_wrong_type)
    printf '{"steps": "ten"}' > config.json
    train_rejects 2 "config file 'config.json': steps: expected an integer in [1, 1000000000], found string \"ten\"" --config config.json ;;
  config_array)
    printf '[1, 2]' > config.json
    train_rejects 2 "config file 'config.json': expected a JSON object of settings (flag names without the dashes), found array" \
      --config config.json ;;
  config_empty)
    : > config.json
    train_rejects 2 "config file 'config.json': malformed JSON: parse error at line 1, column 1" --config config.json ;;
  config_duplicate_key)
    printf '{"lr": 0.1, "lr": 0.2}' > config.json
    train_rejects 2 "config file 'config.json': key 'lr' is given twice" --config config.json ;;

  # ---- checkpoints (the newest one of a run folder, through --resume): exit 1, the folder unchanged
  ckpt_truncated)
    make_run 2 16 run
    truncate -s "$(($(stat -c %s "$ckpt") / 2))" "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': tensor '"
    also "lies outside the data section" ;;
  ckpt_bitflip)  # one byte of the last tensor's data
    make_run 2 16 run
    printf '\125' | dd of="$ckpt" bs=1 seek=$(($(stat -c %s "$ckpt") - 100)) conv=notrunc status=none
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': tensor '"
    also "checksum mismatch: the metadata says"
    also "(the file is damaged)" ;;
  ckpt_version)
    make_run 2 16 run
    "$tool" set-meta "$ckpt" doctored.safetensors mixprec.version 3 && mv doctored.safetensors "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': format version: expected 1 or 2, found 3" ;;
  ckpt_wrong_model)  # the newest checkpoint comes from a model twice as wide
    make_run 2 16 run
    make_run 2 32 wide
    cp wide/ckpt-00000002.safetensors "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': written by a run with channels = 32; this run has 16" ;;
  ckpt_header_oversized)  # header length 1,000,000 in a file of ~100 kB
    make_run 2 16 run
    printf '\100\102\017\000\000\000\000\000' | dd of="$ckpt" bs=1 conv=notrunc status=none
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': the header length is 1000000 bytes, but the file has only" ;;
  ckpt_header_huge)  # header length 2^64 - 1
    make_run 2 16 run
    printf '\377\377\377\377\377\377\377\377' | dd of="$ckpt" bs=1 conv=notrunc status=none
    resume_rejects 1 "the header length is 18446744073709551615 bytes; the limit is 104857600" ;;
  ckpt_empty)
    make_run 2 16 run
    : > "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': the file is 0 bytes; expected at least 8" ;;

  # ---- run folders (--resume)
  resume_log_damaged)  # the log's step 2 rewritten as step 5
    make_run 2 16 run
    sed -i '2s/"step":2,/"step":5,/' run/log.jsonl
    resume_rejects 1 "'run/log.jsonl' ends at step 1 but the newest checkpoint is at step 2; the run folder is inconsistent" ;;
  resume_config_malformed)
    make_run 2 16 run
    echo '{' > run/config.json
    resume_rejects 2 "run config 'run/config.json': malformed JSON: parse error at line 2, column 1" ;;
  resume_missing)
    expect 2 "resume: 'nowhere' is not a folder" "$bin" train --resume nowhere
    absent nowhere ;;
  resume_changed_flag)
    make_run 2 16 run
    resume_rejects 2 "--lr: this run was started with 0.003; a resumed run keeps its configuration" --lr 0.5 ;;

  # ---- where the run folder goes (--out)
  out_parent_is_file)  # ENOTDIR, even for root
    echo "a file" > file
    expect 1 "cannot create run folder 'file/run': Not a directory" "$bin" train "${tiny[@]}" --out file/run
    [ "$(cat file)" = "a file" ] || fail "the file was changed" ;;
  out_is_file)
    echo "a file" > file
    expect 2 "out: 'file' exists and is not a folder" "$bin" train "${tiny[@]}" --out file
    [ "$(cat file)" = "a file" ] || fail "the file was changed" ;;
  out_readonly)
    [ "$(id -u)" -ne 0 ] || skip "root writes into a folder of mode 0500 (out_parent_is_file covers an uncreatable folder)"
    mkdir locked
    chmod 0500 locked
    expect 1 "cannot create run folder 'locked/run': Permission denied" "$bin" train "${tiny[@]}" --out locked/run
    absent locked/run ;;
  disk_full)
    # A tmpfs with room for the first checkpoint but not the second: the second write
    # fails with ENOSPC, the first checkpoint survives intact, no temporary is left,
    # and once there is room again the run resumes and ends as an uninterrupted run.
    make_run 3 16 reference
    size=$(stat -c %s reference/ckpt-00000001.safetensors)
    mkdir disk
    mount -t tmpfs -o size=$((size / 1024 + 48))k tmpfs disk 2> mount.txt ||
      skip "cannot mount a tmpfs to fill ($(cat mount.txt)); the writer's ENOSPC path is covered by test_checkpoint (fail_after_bytes)"
    trap 'umount disk 2>/dev/null' EXIT
    expect 1 "No space left on device" "$bin" train "${small[@]}" --steps 3 --channels 16 --checkpoint-every 1 --out disk/run
    ls -A disk/run
    [ -z "$(ls -A disk/run | grep '\.tmp-')" ] || fail "a temporary was left: $(ls -A disk/run)"
    [ -f disk/run/ckpt-00000001.safetensors ] || fail "the first checkpoint is missing"
    "$tool" compare reference/ckpt-00000001.safetensors disk/run/ckpt-00000001.safetensors ||
      fail "the surviving checkpoint differs from the reference's"
    mount -o remount,size=4m disk || fail "remount"
    expect 0 "mixprec train: 3 steps (3 applied, 0 skipped)" "$bin" train --resume disk/run
    "$tool" compare reference/ckpt-00000003.safetensors disk/run/ckpt-00000003.safetensors ||
      fail "the resumed run differs from the reference"
    "$tool" logs reference/log.jsonl disk/run/log.jsonl || fail "the resumed log differs from the reference's" ;;

  # ---- NaN / inf in input data. Token data cannot hold NaN; the numeric input is a
  # tensor for `mixprec inspect`, where NaN and inf are a finding, not an error: exit 0
  # with a warning, and they are left out of the analysis.
  npy_nonfinite)  # 1, NaN, +inf, 0.5
    npy values.npy '\000\000\200\077\000\000\300\177\000\000\200\177\000\000\000\077' 4
    expect 0 "warning: 2 of the values are NaN or inf (1 NaN, 1 inf); loss scaling cannot fix these" "$bin" inspect values.npy ;;
  npy_all_nan)
    npy values.npy '\000\000\300\177\000\000\300\177' 2
    expect 0 "no finite nonzero values: nothing to scale" "$bin" inspect values.npy ;;

  # ---- issue 15: JSON nested 100,000 levels deep, in every JSON reader
  config_deep)
    deep 100000 > deep.json
    train_rejects 2 "config file 'deep.json': JSON nested deeper than 256 levels (byte 261 opens level 257); the limit is 256" \
      --config deep.json ;;
  resume_config_deep)
    make_run 2 16 run
    deep 100000 > run/config.json
    resume_rejects 2 "run config 'run/config.json': JSON nested deeper than 256 levels" ;;
  report_config_deep)
    make_run 2 16 run
    deep 100000 > run/config.json
    expect 1 "'run/config.json': JSON nested deeper than 256 levels" "$bin" report run --out report.html
    absent report.html ;;
  simulate_config_deep)
    make_run 2 16 run
    deep 100000 > run/config.json
    expect 1 "run config 'run/config.json': JSON nested deeper than 256 levels" "$bin" scaler simulate run ;;
  log_deep)  # a log line (complete: with its newline), for report and for resume
    make_run 2 16 run
    { head -n 1 run/log.jsonl; deep 100000; echo; } > log.jsonl && mv log.jsonl run/log.jsonl
    expect 1 "run/log.jsonl:2: JSON nested deeper than 256 levels" "$bin" report run --out report.html
    absent report.html
    resume_rejects 1 "run/log.jsonl:2: JSON nested deeper than 256 levels" ;;
  ckpt_meta_deep)  # checkpoint metadata: the scaler state
    make_run 2 16 run
    "$tool" set-meta "$ckpt" doctored.safetensors mixprec.scaler "$(deep 60000)" && mv doctored.safetensors "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': scaler state: GradScaler state: JSON nested deeper than 256 levels" ;;

  # ---- issue 15: a run whose loss became non-finite
  diverged)
    expect 1 "the run diverged: the training loss of the last step (2) is " "$bin" train "${tiny[@]}" --precision fp32 \
      --loss-scale none --lr 1e30 --clip 0 --checkpoint-every 1 --out run
    [ -f run/summary.json ] || fail "no summary.json"
    also "nan and the validation loss is "
    expect 1 "the run diverged: the training loss of the last step (3) is " "$bin" train --resume run --steps 3
    also "resuming run at step 2 of 3"
    expect 0 "report: report.html (1 run, 3 steps)" "$bin" report run --out report.html ;;

  # ---- issue 15: the checkpoint header is covered by a checksum (format version 2)
  ckpt_header_tamper)  # one digit of the loss scale in the header
    make_run 2 16 run
    grep -aq '\\"scale\\":6' "$ckpt" || fail "no scale 6... in the header"
    perl -0777 -pi -e 's/(\\"scale\\":)6/${1}9/' "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': header checksum mismatch: the metadata says" ;;
  ckpt_header_key_renamed)  # a flip in the key's own name: no header checksum in a version 2 file
    make_run 2 16 run
    perl -0777 -pi -e 's/mixprec\.header_checksum/mixprec.header_checksun/' "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': format version 2: expected metadata 'mixprec.header_checksum' (the header checksum), found none" ;;
  ckpt_v1_resumes)  # a checkpoint of format version 1 (no header checksum) still loads
    make_run 2 16 run
    "$tool" set-meta "$ckpt" doctored.safetensors mixprec.version 1 && mv doctored.safetensors "$ckpt"
    grep -aq 'mixprec.header_checksum' "$ckpt" && fail "the version 1 file has a header checksum"
    expect 0 "mixprec train: 3 steps (3 applied, 0 skipped)" "$bin" train --resume run --steps 3 ;;

  # ---- issue 15: everything a run needs is checked before its first step
  static_reciprocal)
    train_rejects 2 "loss-scale: expected static:S with S a number > 0 that float32 holds, as it holds 1/S (the unscale factor): S in (2.9387359e-39, 3.4028235e+38], found 'static:1e-40'" \
      "${tiny[@]}" --loss-scale static:1e-40 ;;
  json_is_dir)
    mkdir folder
    train_rejects 2 "json: 'folder' is a folder; expected a new file name or a regular file" "${tiny[@]}" --json folder ;;
  out_empty)
    expect 2 "out: expected a folder, found ''" "$bin" train "${tiny[@]}" --out ""
    [ "$(ls -A)" = "out.txt" ] || fail "files were written: $(ls -A)" ;;

  # ---- issue 15: outputs that are not regular files are refused, never replaced
  json_fifo)
    mkfifo pipe
    train_rejects 2 "json: 'pipe' is a FIFO (named pipe); expected a new file name or a regular file" "${tiny[@]}" --json pipe
    [ -p pipe ] || fail "the FIFO was replaced" ;;
  json_symlink)
    echo "keep" > target
    ln -s target link
    train_rejects 2 "json: 'link' is a symbolic link; expected a new file name or a regular file" "${tiny[@]}" --json link
    [ -L link ] && [ "$(cat target)" = "keep" ] || fail "the link or its target was changed" ;;
  json_device)  # a private copy of /dev/null: a binary with the bug would replace the real one (as root)
    mknod null c 1 3 2> mknod.txt || skip "cannot make a device node ($(cat mknod.txt)); json_fifo covers a special file"
    train_rejects 2 "json: 'null' is a character device; expected a new file name or a regular file" "${tiny[@]}" \
      --json null
    [ -c null ] || fail "the device node was replaced" ;;
  report_out_special)
    make_run 2 16 run
    mkfifo pipe
    expect 1 "--out: 'pipe' is a FIFO (named pipe); expected a new file name or a regular file" "$bin" report run --out pipe
    [ -p pipe ] || fail "the FIFO was replaced"
    echo "keep" > target
    ln -s target link
    expect 1 "--out: 'link' is a symbolic link" "$bin" report run --out link
    [ -L link ] && [ "$(cat target)" = "keep" ] || fail "the link or its target was changed" ;;

  # ---- issue 15: the data file by any path, from any working directory
  data_relative_resume)
    mkdir sub
    yes 'the cat runs fast and the dog sleeps on the mat' | head -n 300 > sub/data.txt
    (cd sub && "$bin" train "${small[@]}" --steps 2 --channels 16 --checkpoint-every 1 --data data.txt --out ../run) \
      > setup.txt 2>&1 || { cat setup.txt; fail "setup run failed"; }
    grep -qF "\"data\": \"$PWD/sub/data.txt\"" run/config.json || fail "config.json lacks the absolute data path"
    expect 0 "mixprec train: 3 steps" "$bin" train --resume run --steps 3
    expect 0 "mixprec train: 4 steps" "$bin" train --resume run --steps 4 --data "$PWD/sub/data.txt"
    cp sub/data.txt moved.txt
    expect 0 "mixprec train: 5 steps" "$bin" train --resume run --steps 5 --data moved.txt
    yes 'a different text with other words in it' | head -n 300 > other.txt
    resume_rejects 1 "data fingerprint differs" --steps 6 --data other.txt ;;
  data_non_utf8_name)
    name=$(printf 'caf\351.txt')
    yes 'the cat runs fast and the dog sleeps on the mat' | head -n 300 > "$name"
    train_rejects 2 "data: the file name is not valid UTF-8 text" "${tiny[@]}" --data "$name"
    also "the run folder's JSON files hold UTF-8 names only" ;;

  # ---- issue 15, lower severity
  stdout_full)  # the summary cannot be printed: exit 1, it is still in summary.json
    timeout 60 "$bin" train "${tiny[@]}" --out run > /dev/full 2> out.txt
    rc=$?
    cat out.txt
    [ "$rc" -eq 1 ] || fail "exit $rc, expected 1"
    also "mixprec train: error: cannot write the summary to stdout: No space left on device; it is in run/summary.json"
    [ -f run/summary.json ] || fail "no summary.json" ;;
  sigterm_last_step)  # SIGTERM during the last step (its final evaluation: 100,000 validation tokens)
    last=(--accum 1 --batch 2 --context 16 --layers 1 --heads 2 --vocab word:256 --threads 1 --channels 16 --steps 2
          --corpus-tokens 200000 --val-fraction 0.5 --eval-windows 0 --out run)
    "$bin" train "${last[@]}" > out.txt 2>&1 &
    pid=$!
    for _ in $(seq 6000); do
      [ -s run/log.jsonl ] && break
      sleep 0.01
    done
    kill -TERM "$pid"
    wait "$pid"
    rc=$?
    tail -n 3 out.txt
    [ "$rc" -eq 143 ] || fail "exit $rc, expected 143"
    also "mixprec train: SIGTERM: stopped after step 2 of 2"
    [ ! -f run/summary.json ] || fail "a stopped run wrote summary.json"
    [ -f run/ckpt-00000002.safetensors ] || fail "no checkpoint of step 2"
    expect 0 "mixprec train: 2 steps (2 applied, 0 skipped)" "$bin" train --resume run
    [ -f run/summary.json ] || fail "no summary.json after the resume" ;;
  report_log_cut)  # the state a full disk leaves: the last line cut short
    make_run 2 16 run
    truncate -s -20 run/log.jsonl
    expect 0 "report: report.html (1 run, 1 steps)" "$bin" report run --out report.html ;;
  report_config_invalid)  # every reader checks config.json as simulate does (issue 30)
    make_run 2 16 run
    sed -i 's/"precision": "fp16"/"precision": "fp99"/' run/config.json
    grep -q fp99 run/config.json || fail "setup: no precision key to doctor"
    expect 1 "run config 'run/config.json': precision:" "$bin" report run --out report.html
    absent report.html ;;
  report_out_is_log)  # an output never lands on an input (issue 30)
    make_run 2 16 run
    before=$(snapshot run)
    expect 1 "--out: 'run/log.jsonl' is log.jsonl of the run folder 'run'" "$bin" report run --out run/log.jsonl
    ln -s run/summary.json link.html
    expect 1 "--out: 'link.html' is a symbolic link" "$bin" report run --out link.html
    [ "$(snapshot run)" = "$before" ] || fail "the run folder changed" ;;
  resume_json_is_log)
    make_run 2 16 run
    before=$(snapshot run)
    expect 2 "json: 'run/log.jsonl' is log.jsonl of the run folder 'run'" "$bin" train --resume run --steps 3 \
      --json run/log.jsonl
    [ "$(snapshot run)" = "$before" ] || fail "the run folder changed" ;;
  config_overflow)
    printf '{"lr": 1e400}' > config.json
    train_rejects 2 "config file 'config.json': malformed JSON: number overflow parsing '1e400'" --config config.json ;;
  env_threads_train)
    MIXPREC_THREADS=abc train_rejects 1 "MIXPREC_THREADS: expected an integer in [1, 1024], found 'abc'" --steps 2 --channels 16 ;;
  ckpt_newest_is_dir)
    make_run 2 16 run
    mkdir run/ckpt-00000003.safetensors
    resume_rejects 1 "checkpoint 'run/ckpt-00000003.safetensors' is not a regular file (a folder?); remove it" --steps 4 ;;
  resume_config_deleted)  # every checkpoint holds the configuration
    make_run 2 16 run
    rm run/config.json
    expect 0 "mixprec train: 3 steps (3 applied, 0 skipped)" "$bin" train --resume run --steps 3
    also "mixprec train: run has no config.json; using the configuration in run/ckpt-00000002.safetensors"
    [ -f run/config.json ] || fail "config.json was not written again" ;;
  resume_fewer_steps)
    make_run 3 16 run
    resume_rejects 2 "steps: the run in 'run' is at step 3; expected at least 3, found 2" --steps 2 ;;
  data_utf32)
    printf '\377\376\000\000h\000\000\000' > text.txt
    train_rejects 1 "data file 'text.txt' looks like UTF-32 (byte-order mark 0xff 0xfe 0x00 0x00 at offset 0); convert it to UTF-8" \
      "${tiny[@]}" --data text.txt ;;
  steps_hex)  # integers: decimal digits, or a whole number (2e6, 20.0); not hexadecimal
    train_rejects 2 "steps: expected an integer in [1, 1000000000], found '0x10' (integers are written in decimal: digits, or a whole number such as 2e6 or 20.0)" \
      --steps 0x10 ;;

  # ---- issue 42: every reader of user input refuses a FIFO before it would wait on it,
  # and names the key of a number out of range
  config_fifo)
    mkfifo pipe
    train_rejects 2 "config: 'pipe' is a FIFO (named pipe), not a regular file" "${tiny[@]}" --config pipe ;;
  advise_config_fifo)
    mkfifo pipe
    expect 2 "'pipe' is a FIFO (named pipe), not a regular file" "$bin" advise . --config pipe --out advice
    absent advice ;;
  report_summary_fifo)
    make_run 2 16 run
    rm run/summary.json && mkfifo run/summary.json
    expect 1 "'run/summary.json' is a FIFO (named pipe), not a regular file" "$bin" report run --out report.html
    absent report.html ;;
  report_log_fifo)
    make_run 2 16 run
    rm run/log.jsonl && mkfifo run/log.jsonl
    expect 1 "run log 'run/log.jsonl': 'run/log.jsonl' is a FIFO (named pipe), not a regular file" "$bin" report run \
      --out report.html
    absent report.html ;;
  inspect_fifo)
    mkfifo pipe.npy
    expect 1 "pipe.npy: is not a regular file; expected an .npy file" "$bin" inspect pipe.npy ;;
  data_fifo)
    mkfifo pipe
    train_rejects 1 "data file 'pipe' is not a regular file; expected a UTF-8 text file" "${tiny[@]}" --data pipe ;;
  report_summary_number)  # was: an alert's step of -1 shown as no step
    make_run 2 16 run
    echo '{"alerts": [{"id": "scale-collapse", "message": "m", "step": -1}]}' > run/summary.json
    expect 1 "'run/summary.json': alerts[0].step: expected an integer >= 0, found -1" "$bin" report run --out report.html
    absent report.html ;;
  advise_budget_empty)  # was: ignored (the config's budget used); an empty argument, which ctest's lists cannot pass
    expect 2 "--budget: expected a number in [0, 1e+300], found ''" "$bin" advise . --budget "" --out advice
    absent advice ;;
  ckpt_meta_negative)  # was: -1 read as 2^64 - 1
    make_run 2 16 run
    "$tool" set-meta "$ckpt" doctored.safetensors mixprec.sampler '{"seed": 1, "counter": -1}' && mv doctored.safetensors "$ckpt"
    resume_rejects 1 "checkpoint 'run/ckpt-00000002.safetensors': metadata 'mixprec.sampler': counter: expected an integer >= 0, found -1" ;;

  # ---- recipe files (--recipe-file, docs/low_precision.md): read and checked before anything starts
  recipe_unknown_module)
    recipes '"modules": {"h1.attn.qkv": "nvfp4"}'
    train_rejects 2 'recipe-file: r.json: recipe file: modules["h1.attn.qkv"]: expected a Linear of this model (h<L>.attn.qkv, h<L>.attn.proj, h<L>.mlp.fc or h<L>.mlp.proj with L from 0 to 0), found "h1.attn.qkv"' \
      "${tiny[@]}" --precision mxfp8 --recipe-file r.json ;;
  recipe_pattern_none)
    recipes '"modules": {}, "schedule": [{"from_step": 1, "modules": ["h*.attn.qk"], "recipe": "nvfp4"}]'
    train_rejects 2 'recipe-file: r.json: recipe file: schedule[0].modules[0]: expected a name or pattern matching a Linear of this model (h<L>.attn.qkv, h<L>.attn.proj, h<L>.mlp.fc or h<L>.mlp.proj with L from 0 to 0), found "h*.attn.qk", which matches none' \
      "${tiny[@]}" --precision mxfp8 --recipe-file r.json ;;
  recipe_wrong_precision)
    recipes '"default": "mxfp8", "modules": {}'
    train_rejects 2 "recipe-file: applies to --precision fp8-noscale, fp8-delayed, fp8-current, mxfp8, fp8-block, nvfp4, mxfp4 only, found --precision bf16" \
      "${tiny[@]}" --precision bf16 --recipe-file r.json ;;
  recipe_malformed)
    printf '{"format": "mixprec.low_precision", "version": 1, "modules": {' > r.json
    train_rejects 2 "recipe-file: r.json: recipe file: " "${tiny[@]}" --precision mxfp8 --recipe-file r.json ;;
  recipe_missing)
    train_rejects 2 "recipe-file: " "${tiny[@]}" --precision mxfp8 --recipe-file missing.json
    also "missing.json" ;;
  recipe_fp8_option)
    recipes '"default": "mxfp8", "modules": {}'
    train_rejects 2 'mx-rounding: expected the default ("te") with --recipe-file (the recipe file'"'"'s "options" and entries set its recipes'"'"' options), found "ocp"' \
      "${tiny[@]}" --precision mxfp8 --mx-rounding ocp --recipe-file r.json ;;
  recipe_fraction_trains)  # not an error: the engine knows the run's steps (ceil(0.5 * 4) = 2: the third step)
    recipes '"default": "mxfp8", "modules": {}, "schedule": [{"from_fraction": 0.5, "recipe": "mxfp4", "label": "half"}]'
    expect 0 "mixprec train: 4 steps" "$bin" train "${small[@]}" --steps 4 --channels 16 --precision mxfp8 \
      --recipe-file r.json --out run
    [ "$(grep -c '"recipe_phase"' run/log.jsonl)" = 1 ] || fail "expected one recipe_phase line"
    sed -n 3p run/log.jsonl | grep -qF '"recipe_phase":"half"' || fail "step 3 lacks the phase's label"
    grep -qF '"recipes": {' run/config.json || fail "config.json lacks the recipes" ;;
  recipe_resume_changed)
    recipes '"default": "mxfp8", "modules": {}'
    "$bin" train "${small[@]}" --steps 2 --channels 16 --precision mxfp8 --recipe-file r.json --checkpoint-every 1 \
      --out run > make_run.txt 2>&1 || { cat make_run.txt; fail "setup run failed"; }
    recipes '"default": "nvfp4", "modules": {}'
    resume_rejects 1 "recipes: the recipe file '$PWD/r.json' differs from the recipes the run was started with" --steps 3 ;;
  recipe_resume_more_steps)
    recipes '"default": "mxfp8", "modules": {}, "schedule": [{"from_fraction": 0.5, "recipe": "mxfp4"}]'
    "$bin" train "${small[@]}" --steps 2 --channels 16 --precision mxfp8 --recipe-file r.json --checkpoint-every 1 \
      --out run > make_run.txt 2>&1 || { cat make_run.txt; fail "setup run failed"; }
    resume_rejects 1 "steps: the recipe file places schedule[0] at a fraction of the run's steps (from_fraction); expected the run's 2 steps, found 3" \
      --steps 3 ;;

  *)
    echo "unknown case '$case_name'; cases: ${cases[*]}"
    exit 1 ;;
esac
echo "PASS: $case_name"
