#!/usr/bin/env bash
# plan_validate.sh — the planner's time and memory model against measured steps on this GPU
# (skills/planner.md, validation; the tables in bench/results/).
#
#   bench/plan_validate.sh BUILD OUT
#
# 1. `bumblebee plan --calibrate` writes OUT/calibration.json (the rates of this GPU).
# 2. bench_train_step runs the Qwen3-30B-A3B and Qwen3.5-35B-A3B 4-layer slices at 8K-128K tokens
#    (full recompute, linear_ce, as the shipped GPU configs), the Qwen3 slice also without recompute
#    and with bf16 moments, each with --predict OUT/calibration.json: the measured step, the
#    predicted one and their error; live and reserved peaks beside the predicted peak; a profile
#    by category of the last step of each size.
# Environment: SEQS (8192,16384,32768,65536,131072), STEPS (4 timed after 1 warm-up).
set -u
BUILD=${1:?usage: plan_validate.sh BUILD OUT}
OUT=${2:?usage: plan_validate.sh BUILD OUT}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
SEQS=${SEQS:-8192,16384,32768,65536,131072}
STEPS=${STEPS:-4}
BTS="$BUILD/bench/bench_train_step"
fail=0
run() {  # run <log> <cmd...>
  local log="$OUT/$1"; shift
  local t0=$SECONDS
  echo "### $*" >> "$log"
  "$@" >> "$log" 2>"$log.err"
  local rc=$?
  [ $rc -ne 0 ] && fail=1
  echo "== $log: rc=$rc $((SECONDS - t0))s"
}
run calibrate.log "$BUILD/bumblebee" plan --calibrate --out "$OUT/calibration.json"
cat "$OUT/calibrate.log.err"
[ -f "$OUT/calibration.json" ] || { echo "no calibration written"; exit 1; }
run qwen3.log "$BTS" --seq "$SEQS" --steps "$STEPS" --warmup 1 --profile --predict "$OUT/calibration.json"
run qwen35.log "$BTS" --config configs/models/qwen3.5-35b-a3b-4layer/config.json --seq "$SEQS" --steps "$STEPS" \
  --warmup 1 --profile --predict "$OUT/calibration.json"
run qwen3-none.log "$BTS" --seq 8192,16384 --steps "$STEPS" --warmup 1 --set 'primitives.recompute="none"' \
  --predict "$OUT/calibration.json"
run qwen3-bf16m.log "$BTS" --seq 32768 --steps "$STEPS" --warmup 1 \
  --set 'primitives.optimizer="adamw_bf16_moments"' --predict "$OUT/calibration.json"
# The measured profiles by category (the last step of each size), then the tables.
for f in qwen3 qwen35; do
  echo; echo "######## $f: profile by category"
  grep -A10 "^category " "$OUT/$f.log" | grep -v "^--" | cut -c1-80
done
for f in qwen3 qwen35 qwen3-none qwen3-bf16m; do
  echo; echo "######## $f"
  sed -n '/^end-to-end training step/,/^at [0-9]* tokens:/p' "$OUT/$f.log" | grep -v "^backend:\|^at [0-9]* tokens:\|^primitives:"
done
exit $fail
