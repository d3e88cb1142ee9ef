#!/usr/bin/env bash
# Installs what the tests need beyond scripts/deps.sh, and only what is missing:
# Debian's chromium (headless screenshots of `mixprec report`, tests/report) and
# python3-pil (the screenshot check). Idempotent: a second run installs nothing and
# prints one line.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
/usr/bin/python3 -c 'import PIL' >/dev/null 2>&1 || missing+=(python3-pil)  # Debian's python, not another one on PATH

if [ ${#missing[@]} -eq 0 ]; then
  echo "test-deps: chromium and python3-pil present"
  exit 0
fi

echo "test-deps: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "test-deps: need root to install packages (run as root or: sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
