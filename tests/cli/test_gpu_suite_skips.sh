#!/usr/bin/env bash
# bench/gpu_suite.sh on a machine or build without a usable GPU: every GPU test skips itself, and
# the suite must report that as a failure (exit 1, "skipped on the GPU machine" per binary)
# instead of a pass: on the GPU machine a skip means CUDA did not start.
set -u
BB=${1:?usage: test_gpu_suite_skips.sh bumblebee-binary}
BUILD=$(dirname "$BB")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
ls "$BUILD"/tests/test_*_gpu > /dev/null 2>&1 || { echo "no GPU test binaries in $BUILD/tests"; exit 1; }
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi > /dev/null 2>&1; then
  echo "SKIP: this machine has a GPU (the suite's skip check needs a machine without one)"
  exit 0
fi
PART_TIMEOUT=120 bash bench/gpu_suite.sh "$BUILD" "$TMP/out" tests > "$TMP/log" 2>&1
rc=$?
[ $rc -eq 1 ] || { echo "FAIL: gpu_suite.sh exited $rc with every GPU test skipped, expected 1"; fail=1; }
n=$(ls "$BUILD"/tests/test_*_gpu | wc -l)
got=$(grep -c "skipped on the GPU machine" "$TMP/log")
[ "$got" -ge "$n" ] || { echo "FAIL: $got of $n GPU test binaries reported as skipped"; fail=1; }
grep -q "no CUDA backend\|no usable CUDA device" "$TMP/log" || { echo "FAIL: the reason is not in the summary"; fail=1; }
[ $fail -eq 0 ] && echo "PASS" || tail -n 30 "$TMP/log"
exit $fail
