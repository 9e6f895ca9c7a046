#!/usr/bin/env bash
# gpu_suite.sh — everything that needs a GPU, in one go, with a log per part: the GPU tests,
# the per-primitive benchmarks, the end-to-end training step, the paired swaps on the GPU and
# (where torch + transformers are installed) the PyTorch reference step.
#
#   bench/gpu_suite.sh BUILD_DIR OUT_DIR [PART ...]
# PARTs (default: all, in this order):
#   tests        every GPU test binary (BUILD_DIR/tests/test_*_gpu, test_cuda_runtime)
#   kernels      bench_ceilings, bench_attention, bench_pointwise, bench_moe_loss, bench_experts
#   e2e          bench_train_step at 8K/32K/64K/128K, then 256K (peak memory)
#   e2e_small    bench_train_step at 8K/16K/32K only
#   paired       bench/paired_gpu.sh (every swap at 8K tokens of the 4-layer slice)
#   hf           bench/hf_train_step.py at 8K/16K/32K/64K (PyTorch + transformers reference)
# Environment: E2E_SEQ (override the e2e list), E2E_STEPS (default 3), PART_TIMEOUT (seconds per
# binary, default 300). Prints a summary of pass/fail per part at the end.
set -u
BUILD=${1:?usage: gpu_suite.sh BUILD_DIR OUT_DIR [PART ...]}
OUT=${2:?usage: gpu_suite.sh BUILD_DIR OUT_DIR [PART ...]}
shift 2
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests kernels e2e paired hf)
TO=${PART_TIMEOUT:-300}
mkdir -p "$OUT"
summary=()
note() { summary+=("$1"); echo "== $1"; }
run_logged() {  # run_logged <log name> <cmd...>
  local log="$OUT/$1"; shift
  local t0=$SECONDS
  timeout "$TO" "$@" >> "$log" 2>&1
  local rc=$?
  note "$(basename "$1") rc=$rc $((SECONDS - t0))s (log $(basename "$log"))"
  return $rc
}
for part in "${PARTS[@]}"; do
  case $part in
    tests)
      for t in "$BUILD"/tests/test_*_gpu "$BUILD"/tests/test_cuda_runtime; do
        [ -x "$t" ] || continue
        echo "### $(basename "$t")" >> "$OUT/tests.log"
        run_logged tests.log "$t" --gtest_brief=1
        grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|FAILED" "$OUT/tests.log" | tail -n 3
      done ;;
    kernels)
      for b in bench_ceilings bench_attention bench_pointwise bench_moe_loss bench_experts; do
        [ -x "$BUILD/bench/$b" ] && run_logged kernels.log "$BUILD/bench/$b"
      done ;;
    e2e)
      run_logged e2e.log "$BUILD/bench/bench_train_step" --seq "${E2E_SEQ:-8192,32768,65536,131072}" \
        --steps "${E2E_STEPS:-3}" --warmup 1
      run_logged e2e.log "$BUILD/bench/bench_train_step" --seq 262144 --steps 1 --warmup 1 ;;
    e2e_small)
      run_logged e2e.log "$BUILD/bench/bench_train_step" --seq "${E2E_SEQ:-8192,16384,32768}" \
        --steps "${E2E_STEPS:-3}" --warmup 1 ;;
    paired)
      mkdir -p "$OUT/paired"
      PAIRED_OUT="$OUT/paired" run_logged paired.log bench/paired_gpu.sh "$BUILD/bumblebee" ;;
    hf)
      PYTHONUNBUFFERED=1 run_logged hf.log python3 bench/hf_train_step.py --seq "${HF_SEQ:-8192,16384,32768,65536}" \
        --steps "${E2E_STEPS:-3}" --warmup 1 ;;
    *) echo "unknown part '$part' (tests kernels e2e e2e_small paired hf)"; exit 2 ;;
  esac
done
echo
echo "summary:"
printf '  %s\n' "${summary[@]}"
