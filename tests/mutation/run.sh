#!/usr/bin/env bash
# The mutation check (docs/testing.md): applies each small, realistic bug of
# tests/mutation/mutations.py to the source, one at a time, rebuilds the test
# programs that should notice, runs them, restores the file, and prints which
# mutations survived. Not part of `make test` (about 15-30 minutes on two cores).
#
#   tests/mutation/run.sh                 every mutation, build folder build/mutation
#   tests/mutation/run.sh --list          the mutations, one per line
#   tests/mutation/run.sh --only ID,ID    some of them
#   tests/mutation/run.sh --build DIR     another build folder (configured if needed)
#
# Exit 0: every mutation was caught; 1: some survived; 2: the list is stale (a
# mutation's original text is not in its file exactly once) or the unmutated tests fail.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 tests/mutation/mutate.py "$@"
