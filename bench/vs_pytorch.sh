#!/usr/bin/env bash
# vs_pytorch.sh — bumblebee's training step against the PyTorch + transformers step on the same
# card in one run, each side in its fastest setting that fits on one GPU: bumblebee with
# recompute none and no clipping (so the update runs during the backward), PyTorch with every
# decoder layer torch.compile'd and no checkpointing (bench/hf_train_step.py; it does not clip
# either). The two sides alternate REPS times so that clock and thermal drift hit both alike.
# Prints one table: tokens/s of each repetition, the means, and bumblebee / PyTorch.
#
#   bench/vs_pytorch.sh BENCH_TRAIN_STEP OUT_DIR [SEQS=8192,16384,32768] [REPS=2]
# Environment: CONFIG (model config.json, default the Qwen3-30B-A3B 4-layer slice), STEPS (timed
# steps per size, default 4), WARMUP (default 2), PYTHON (default python3), BB_EXTRA (more
# bench_train_step arguments, e.g. "--set primitives.optimizer=\"adamw_bf16_moments\""),
# BB_VARIANTS (several bumblebee settings against the same PyTorch runs: "label:args;label:args",
# each run every repetition, one table each; replaces BB_EXTRA).
set -u
BIN=${1:?usage: vs_pytorch.sh BENCH_TRAIN_STEP OUT_DIR [seqs] [reps]}
OUT=${2:?usage: vs_pytorch.sh BENCH_TRAIN_STEP OUT_DIR [seqs] [reps]}
SEQS=${3:-8192,16384,32768}
REPS=${4:-2}
CONFIG=${CONFIG:-configs/models/qwen3-30b-a3b-4layer/config.json}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-2}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" || exit 1
results="$OUT/vs_results.txt"
: > "$results"

# Both programs print table rows "  tokens |  step ms |  tokens/s | ...": keep tokens and tokens/s.
collect() {  # collect <side> <rep> <log>
  awk -v side="$1" -v rep="$2" '$1 ~ /^[0-9]+$/ && $2 == "|" && $4 == "|" && $6 == "|" {print side, rep, $1, $5}' "$3" >> "$results"
}
if [ -n "${BB_VARIANTS:-}" ]; then IFS=';' read -ra VARIANTS <<< "$BB_VARIANTS"; else VARIANTS=("bumblebee:${BB_EXTRA:-}"); fi
bumblebee() {
  local v label args log
  for v in "${VARIANTS[@]}"; do
    label=${v%%:*}
    args=${v#*:}
    log="$OUT/${label}_rep$1.log"
    # shellcheck disable=SC2086
    "$BIN" --config "$CONFIG" --seq "$SEQS" --steps "$STEPS" --warmup "$WARMUP" \
      --set 'primitives.recompute="none"' --set train.grad_clip=0 $args > "$log" 2>&1
    echo "[vs] $label rep $1: exit $? ($(grep -cE '^ +[0-9]+ \|' "$log") sizes)"
    collect "$label" "$1" "$log"
  done
}
pytorch() {
  local log="$OUT/pytorch_rep$1.log"
  "$PYTHON" "$HERE/hf_train_step.py" --config "$CONFIG" --seq "$SEQS" --steps "$STEPS" --warmup "$WARMUP" \
    --compile --no-checkpointing > "$log" 2>&1
  echo "[vs] pytorch rep $1: exit $? ($(grep -cE '^ +[0-9]+ \|' "$log") sizes)"
  collect pytorch "$1" "$log"
}
for rep in $(seq 1 "$REPS"); do
  if [ $((rep % 2)) -eq 1 ]; then bumblebee "$rep"; pytorch "$rep"; else pytorch "$rep"; bumblebee "$rep"; fi
done

status=0
for v in "${VARIANTS[@]}"; do
label=${v%%:*}
echo
echo "tokens/s, $CONFIG, $REPS repetitions (bumblebee: recompute none, no clipping; PyTorch: compiled layers, no checkpointing)"
[ "${#VARIANTS[@]}" -gt 1 ] && echo "bumblebee variant '$label': ${v#*:}"
awk -v bb="$label" '$1 == bb { $1 = "bumblebee"; print } $1 == "pytorch" { print }' "$results" | awk '
  { key = $3; v[$1, key] = v[$1, key] (v[$1, key] == "" ? "" : " / ") $4; s[$1, key] += $4; n[$1, key]++; seen[key] = 1 }
  END {
    printf "%8s | %-24s | %-24s | %s\n", "tokens", "bumblebee", "pytorch", "ratio of means"
    cnt = 0
    for (k in seen) keys[++cnt] = k + 0
    for (i = 1; i <= cnt; i++) for (j = i + 1; j <= cnt; j++) if (keys[j] < keys[i]) { t = keys[i]; keys[i] = keys[j]; keys[j] = t }
    bad = 0
    for (i = 1; i <= cnt; i++) {
      k = keys[i]
      if (n["bumblebee", k] == 0 || n["pytorch", k] == 0) {
        printf "%8d | %-24s | %-24s | missing (a side failed or did not fit; see its log)\n", k, v["bumblebee", k], v["pytorch", k]
        bad = 1
        continue
      }
      printf "%8d | %-24s | %-24s | %.3fx\n", k, v["bumblebee", k], v["pytorch", k], (s["bumblebee", k] / n["bumblebee", k]) / (s["pytorch", k] / n["pytorch", k])
    }
    if (cnt == 0) { print "no rows: both sides failed (see the logs)"; bad = 1 }
    exit bad
  }' || status=1
done
exit $status
