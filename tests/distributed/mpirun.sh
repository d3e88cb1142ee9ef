#!/usr/bin/env bash
# mpirun as the tests run it (docs/distributed.md, "Running"):
#
#   mpirun.sh NP PROGRAM [ARGS...]
#
# As root (containers): OMPI_ALLOW_RUN_AS_ROOT*. Up to 3 ranks on 2 cores:
# --oversubscribe, one OpenMP thread per rank, passive OpenMP waiters. Shared memory
# without the single-copy (CMA/ptrace) mechanism that containers often forbid. Leak
# checks skip OpenMPI's own allocations (lsan.supp).
set -euo pipefail
np=$1
shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
# Sanitizer builds: OpenMPI's own allocations that outlive MPI_Finalize are not ours.
here=$(cd "$(dirname "$0")" && pwd)
# OpenMPI's libraries have no frame pointers: the fast unwinder would cut their stacks
# short of the frames the suppressions name, so allocations unwind the slow way.
export LSAN_OPTIONS="${LSAN_OPTIONS:+$LSAN_OPTIONS:}suppressions=$here/lsan.supp:print_suppressions=0"
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0"
exec mpirun --oversubscribe --mca btl_vader_single_copy_mechanism none -np "$np" "$@"
