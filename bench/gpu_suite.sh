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
#   gdn          (not in the default list) bench_gdn: the chunked gated delta rule kernels at the
#                Qwen3.5 head shapes (32K, 8 x 4K packed, 128K, 256K)
#   qwen35       (not in the default list) bench_train_step on the 4-layer Qwen3.5-35B-A3B slice
#                (3 GDN + 1 gated attention layer) at 8K-128K, then 256K
#   hf35         (not in the default list) hf_train_step.py on the same slice (transformers'
#                PyTorch GDN fallback), with and without checkpointing, at HF35_SEQ (8K)
#   sanitize     (not in the default list) every binary of `tests` under compute-sanitizer, once
#                with --tool memcheck and once with --tool racecheck (--error-exitcode 99); logs
#                sanitize_memcheck.log / sanitize_racecheck.log, one summary line per binary and
#                tool with rc and the error count of its "ERROR SUMMARY: N errors" (memcheck) or
#                "RACECHECK SUMMARY: ... (N errors, M warnings)" line
# Environment: E2E_SEQ (override the e2e list), E2E_STEPS (default 3), PART_TIMEOUT (seconds per
# binary, default 300), SANITIZE_TIMEOUT (seconds per binary and tool under compute-sanitizer,
# default 900; it slows kernels 10-100x). compute-sanitizer is found on PATH, in $CUDA_HOME/bin or
# /usr/local/cuda/bin. Prints a summary of pass/fail per part at the end and exits 1 when any
# part failed. On the GPU machine a skipped GPU test is a failure (a GPU test skips itself only
# for lack of CUDA only when CUDA did not start or the build has no CUDA backend, which is what
# this suite must catch), and so is a test binary that ran no test.
set -u
BUILD=${1:?usage: gpu_suite.sh BUILD_DIR OUT_DIR [PART ...]}
OUT=${2:?usage: gpu_suite.sh BUILD_DIR OUT_DIR [PART ...]}
shift 2
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests kernels e2e paired hf)
TO=${PART_TIMEOUT:-300}
mkdir -p "$OUT"
summary=()
failed=0
note() { summary+=("$1"); echo "== $1"; }
run_logged() {  # run_logged <log name> <cmd...>
  local log="$OUT/$1"; shift
  local t0=$SECONDS
  timeout "$TO" "$@" >> "$log" 2>&1
  local rc=$?
  note "$(basename "$1") rc=$rc $((SECONDS - t0))s (log $(basename "$log"))"
  [ $rc -ne 0 ] && failed=1
  return $rc
}
for part in "${PARTS[@]}"; do
  case $part in
    tests)
      for t in "$BUILD"/tests/test_*_gpu "$BUILD"/tests/test_cuda_runtime; do
        [ -x "$t" ] || continue
        echo "### $(basename "$t")" >> "$OUT/tests.log"
        at=$(stat -c %s "$OUT/tests.log")
        run_logged tests.log "$t" --gtest_brief=1
        part_log=$(tail -c +$((at + 1)) "$OUT/tests.log")
        ran=$(echo "$part_log" | sed -n 's/.*\[==========\] \([0-9][0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' | tail -n 1)
        # Skips for lack of CUDA (BB_REQUIRE_GPU's reasons); others (a kernel for another compute
        # capability, a shape a case does not apply to) are reported by gtest as usual.
        skipped=$(echo "$part_log" | grep -cE "no usable CUDA device|this build has no CUDA backend")
        if [ -z "$ran" ] || [ "$ran" -eq 0 ]; then
          note "FAIL $(basename "$t"): ran no test"
          failed=1
        elif [ -n "$skipped" ] && [ "$skipped" -gt 0 ]; then
          note "FAIL $(basename "$t"): $skipped of $ran test(s) skipped on the GPU machine ($(echo "$part_log" | grep -m1 -oE 'no usable CUDA device[^]]*|this build has no CUDA backend[^]]*'))"
          failed=1
        fi
        echo "$part_log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|FAILED" | tail -n 3
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
    gdn)
      [ -x "$BUILD/bench/bench_gdn" ] && run_logged gdn.log "$BUILD/bench/bench_gdn" ;;
    qwen35)
      q35=configs/models/qwen3.5-35b-a3b-4layer/config.json
      run_logged qwen35.log "$BUILD/bench/bench_train_step" --config "$q35" \
        --seq "${Q35_SEQ:-8192,16384,32768,65536,131072}" --steps "${E2E_STEPS:-3}" --warmup 1
      run_logged qwen35.log "$BUILD/bench/bench_train_step" --config "$q35" --seq 262144 --steps 1 --warmup 1 ;;
    hf35)
      q35=configs/models/qwen3.5-35b-a3b-4layer/config.json
      PYTHONUNBUFFERED=1 run_logged hf35.log python3 bench/hf_train_step.py --config "$q35" \
        --seq "${HF35_SEQ:-8192}" --steps "${E2E_STEPS:-3}" --warmup 1
      PYTHONUNBUFFERED=1 run_logged hf35.log python3 bench/hf_train_step.py --config "$q35" \
        --seq "${HF35_SEQ:-8192}" --steps "${E2E_STEPS:-3}" --warmup 1 --no-checkpointing ;;
    sanitize)
      cs=$(command -v compute-sanitizer || true)
      for d in "${CUDA_HOME:-}" /usr/local/cuda; do
        [ -z "$cs" ] && [ -n "$d" ] && [ -x "$d/bin/compute-sanitizer" ] && cs="$d/bin/compute-sanitizer"
      done
      if [ -z "$cs" ]; then
        note "sanitize: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
        continue
      fi
      for t in "$BUILD"/tests/test_*_gpu "$BUILD"/tests/test_cuda_runtime; do
        [ -x "$t" ] || continue
        for tool in memcheck racecheck; do
          section="$OUT/.sanitize_section.log"
          t0=$SECONDS
          timeout "${SANITIZE_TIMEOUT:-900}" "$cs" --tool "$tool" --error-exitcode 99 "$t" --gtest_brief=1 \
            > "$section" 2>&1
          rc=$?
          # memcheck ends with "========= ERROR SUMMARY: 3 errors", racecheck with "=========
          # RACECHECK SUMMARY: 5 hazards displayed (3 errors, 2 warnings)"; neither line is there
          # when the timeout killed the binary.
          errors=$(sed -n -e 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' \
                          -e 's/.*RACECHECK SUMMARY: .*(\([0-9][0-9]*\) error.*/\1/p' "$section" | tail -n 1)
          # Reports inside cuDNN's or cuBLAS's own kernels (cudnn_*, nvjet_*, cutlass*, sm90_xmma*)
          # are counted apart: racecheck flags Hopper library kernels that synchronize through
          # mbarriers and async copies it does not model (docs/reliability.md).
          # (memcheck names the kernel on the "=========     at KERNEL+0x..." line of a report,
          # racecheck on its "Race reported ... at KERNEL+0x..." line.)
          in_lib=$(grep -v "^=========  *and " "$section" |
                   grep -c -E "^=========.* at (cudnn_|nvjet_|cutlass|sm90_xmma|cublas)" || true)
          { echo "### $(basename "$t") ($tool) rc=$rc"; cat "$section"; } >> "$OUT/sanitize_$tool.log"
          rm -f "$section"
          note "sanitize $tool $(basename "$t") rc=$rc errors=${errors:-unknown} (reports in cuDNN/cuBLAS kernels: $in_lib) $((SECONDS - t0))s (log sanitize_$tool.log)"
        done
      done ;;
    *) echo "unknown part '$part' (tests kernels e2e e2e_small paired hf sanitize)"; exit 2 ;;
  esac
done
echo
echo "summary:"
printf '  %s\n' "${summary[@]}"
exit $failed
