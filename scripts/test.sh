#!/usr/bin/env bash
# Runs the whole test suite (CPU unit tests, multi-rank tests under mpirun, CLI tests; GPU
# tests skip themselves without a GPU). Expects ./build from scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# OpenBLAS threads fight the test-level parallelism on small machines.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" "$@"
