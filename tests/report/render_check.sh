#!/usr/bin/env bash
# Browser test of `mixprec report`: a tiny real comparison (fp32, fp16 without and with
# dynamic loss scaling, overflows injected at steps 5 and 17, histogram steps) writes
# its report.html;
# `mixprec report` writes the report of one of its runs; headless Chromium renders both
# (1280 px wide) to PNG screenshots and dumps the DOM it parsed; check_report.py then
# checks that the charts carry data and the screenshots are not blank.
#
#   render_check.sh MIXPREC_BIN WORK_DIR
#   render_check.sh MIXPREC_BIN WORK_DIR RUN_DIR STEPS
#
# The second form renders the report of a run folder written by another program (the
# libtorch example's Telemetry: STEPS logged steps, validation points, skipped steps, no
# histograms) instead of running the comparison.
#
# Exit 77 (ctest: skipped) after writing the reports when chromium is not installed;
# scripts/deps.sh test, run by `make test`, installs it. The screenshots stay in WORK_DIR
# (report.png, single.png).
set -euo pipefail
bin=$1
work=$2

here=$(cd "$(dirname "$0")" && pwd)
python=/usr/bin/python3  # Debian's, with python3-pil; not another python first on PATH
[ -x "$python" ] || python=python3

run_dir=${3:-}
run_steps=${4:-}

rm -rf "$work"
mkdir -p "$work"
has_loss_chart() {
  grep -q '<svg xmlns="http://www.w3.org/2000/svg" class="chart line-chart" data-chart="loss"' "$1" ||
    { echo "FAIL: $1 has no loss chart"; exit 1; }
}
if [ -n "$run_dir" ]; then
  "$bin" report "$run_dir" --out "$work/single.html" || { echo "FAIL: mixprec report $run_dir"; exit 1; }
  has_loss_chart "$work/single.html"
else
  tiny=(--steps 24 --accum 1 --batch 4 --context 16 --channels 16 --layers 1 --heads 2 --corpus-tokens 20000
        --vocab word:256 --threads 1 --eval-every 6 --histogram-every 6 --inject-overflow-at 5,17)
  "$bin" compare --only fp32,fp16-noscale,fp16-dynamic "${tiny[@]}" --out "$work/cmp" > "$work/compare.txt" 2>&1 ||
    { cat "$work/compare.txt"; echo "FAIL: mixprec compare"; exit 1; }
  grep -q "report: $work/cmp/report.html" "$work/compare.txt" ||
    { cat "$work/compare.txt"; echo "FAIL: mixprec compare did not print its report's path"; exit 1; }
  "$bin" report "$work/cmp/fp16-dynamic" --out "$work/single.html" || { echo "FAIL: mixprec report"; exit 1; }
  has_loss_chart "$work/cmp/report.html"
  has_loss_chart "$work/single.html"
fi

if ! command -v chromium >/dev/null 2>&1; then
  echo "SKIPPED: the reports were written, but chromium is not installed to render them" \
       "(bash scripts/deps.sh test installs it)"
  exit 77
fi

shoot() {  # HTML PNG DOM
  local profile="$work/chromium-profile"
  local flags=(--headless --disable-gpu --no-sandbox --disable-dev-shm-usage --hide-scrollbars --no-first-run
               --user-data-dir="$profile" --window-size=1280,4000)
  timeout 180 chromium "${flags[@]}" --screenshot="$2" "file://$1" > "$work/chromium.log" 2>&1 ||
    { tail -20 "$work/chromium.log"; echo "FAIL: chromium --screenshot $1"; exit 1; }
  timeout 180 chromium "${flags[@]}" --dump-dom "file://$1" > "$3" 2>> "$work/chromium.log" ||
    { tail -20 "$work/chromium.log"; echo "FAIL: chromium --dump-dom $1"; exit 1; }
}
if [ -n "$run_dir" ]; then
  shoot "$work/single.html" "$work/single.png" "$work/single.dom.html"
  "$python" "$here/check_report.py" --dom "$work/single.dom.html" --png "$work/single.png" --runs 1 \
    --steps "$run_steps" --histograms 0
  echo "screenshot: $work/single.png"
  exit 0
fi
shoot "$work/cmp/report.html" "$work/report.png" "$work/report.dom.html"
shoot "$work/single.html" "$work/single.png" "$work/single.dom.html"

"$python" "$here/check_report.py" --dom "$work/report.dom.html" --png "$work/report.png" --runs 3 \
  --steps 24 --histograms 1
"$python" "$here/check_report.py" --dom "$work/single.dom.html" --png "$work/single.png" --runs 1 \
  --steps 24 --histograms 1
echo "screenshots: $work/report.png $work/single.png"
