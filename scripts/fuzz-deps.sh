#!/usr/bin/env bash
# Installs what the fuzz targets need beyond scripts/deps.sh, and only what is missing:
# clang (libFuzzer comes with clang only), its sanitizer and libFuzzer runtimes
# (libclang-rt-14-dev), and LLVM's OpenMP (libomp-14-dev: omp.h and the runtime that
# clang's -fopenmp links). Debian 12 names (clang 14). Called by `make fuzz` and
# `make test`. Idempotent: a second run installs nothing and prints one line.
set -euo pipefail

packages=(clang libclang-rt-14-dev libomp-14-dev)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$status" = "installed" ] || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "fuzz-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "fuzz-deps: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "fuzz-deps: need root to install packages (run as root or: sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
