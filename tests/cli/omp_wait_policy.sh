#!/usr/bin/env bash
# The OpenMP wait policy mixprec asks for takes effect in the image that runs the command:
# GNU libgomp, told to display its settings (OMP_DISPLAY_ENV=verbose, printed when the
# library loads), shows a spin count of 1000 last (tools/mixprec/main.cpp says why). A setenv
# in main() after the runtime loaded left it spinning 300000. A policy or spin count the user
# set is kept.
#   omp_wait_policy.sh MIXPREC
set -euo pipefail
bin=$1
last_spincount() { printf '%s\n' "$1" | grep "GOMP_SPINCOUNT" | tail -1 | sed "s/.*= *'\([0-9]*\)'.*/\1/"; }

out=$(env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT OMP_DISPLAY_ENV=verbose "$bin" --version 2>&1)
n=$(last_spincount "$out")
if [ "$n" != "1000" ]; then
  echo "FAIL: without OMP_WAIT_POLICY, expected libgomp's GOMP_SPINCOUNT '1000', found '$n'"; printf '%s\n' "$out"; exit 1
fi
out=$(env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=ACTIVE OMP_DISPLAY_ENV=verbose "$bin" --version 2>&1)
n=$(last_spincount "$out")
if [ -z "$n" ] || [ "$n" = "0" ]; then
  echo "FAIL: with OMP_WAIT_POLICY=ACTIVE, expected libgomp to spin (GOMP_SPINCOUNT > 0), found '$n'"; printf '%s\n' "$out"; exit 1
fi
out=$(env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=5 OMP_DISPLAY_ENV=verbose "$bin" --version 2>&1)
n2=$(last_spincount "$out")
if [ "$n2" != "5" ]; then
  echo "FAIL: with GOMP_SPINCOUNT=5, expected libgomp's spin count 5, found '$n2'"; printf '%s\n' "$out"; exit 1
fi
echo "ok: spin count 1000 by default, the user's ACTIVE kept (spin count $n), the user's GOMP_SPINCOUNT kept"
