#!/usr/bin/env bash
# paired_gpu.sh — `bumblebee paired` on a GPU for every swap the trainer offers, at a realistic
# size: the 4-layer slice of Qwen3-30B-A3B (hidden 2048, 128 experts top-8, vocab 151,936), one
# packed micro-batch of TOKENS tokens, STEPS steps per side, bf16 weights.
#
#   bench/paired_gpu.sh BUMBLEBEE_BINARY [TOKENS=8192] [STEPS=3]
#
# bf16 tolerances: two implementations of the same math round differently, so the per-step loss
# must agree within 1e-2 relative, the grad norm and every parameter's step-1 gradient within
# 5e-2, the first batch's logits within 0.25 absolute (the CPU test uses fp32 and 1e-4 / 1e-3).
# A learning-rate change must still be caught (exit 1). Prints one line per pair and a
# summary table; exits non-zero if any pair's verdict is not the expected one.
set -u
BB=${1:?usage: paired_gpu.sh bumblebee-binary [tokens] [steps]}
TOKENS=${2:-8192}
STEPS=${3:-3}
OUTDIR=${PAIRED_OUT:-$(mktemp -d)}
COMMON=(--config configs/demo.toml --steps "$STEPS"
        --set 'model.config="configs/models/qwen3-30b-a3b-4layer/config.json"'
        --set 'parallel.device="cuda"' --set "train.micro_batch_tokens=$TOKENS"
        --set train.warmup_steps=1 --set train.lr=1e-4 --set train.min_lr=1e-5
        --set data.demo_documents=400 --tol-loss 1e-2 --tol-grad-norm 5e-2 --tol-grad 5e-2
        --tol-logits 0.25)
fail=0
rows=()
pair() {  # pair <expected exit> <label> <args...>
  local want=$1 label=$2; shift 2
  local log="$OUTDIR/paired_$(echo "$label" | tr -c 'a-zA-Z0-9' '_').txt"
  "$BB" paired "${COMMON[@]}" "$@" > "$log" 2>&1
  local got=$?
  local verdict=ok
  [ "$got" -ne "$want" ] && { verdict=FAIL; fail=1; }
  local logits ratio
  logits=$(grep -oE 'max \|logits A - logits B\| on the first micro-batch: [0-9.e+-]+' "$log" | awk '{print $NF}')
  ratio=$(grep -iE 'ratio B/A' "$log" | tail -n 1 | grep -oE '[0-9]+\.[0-9]+' | tail -n 1)
  echo "[$verdict] $label: exit $got (expected $want); max |dlogits| ${logits:-?}; step time B/A ${ratio:-?}"
  rows+=("| $label | $got (want $want) | ${logits:-?} | ${ratio:-?} | $verdict |")
  [ "$verdict" = FAIL ] && tail -n 40 "$log"
}
pair 0 "loss full_ce vs linear_ce" --a primitives.loss=full_ce --b primitives.loss=linear_ce
pair 0 "recompute none vs full" --a primitives.recompute=none --b primitives.recompute=full
pair 0 "permute standard vs memory_efficient" --a primitives.permute=standard --b primitives.permute=memory_efficient
pair 0 "experts sequential vs grouped" --a primitives.experts=sequential --b primitives.experts=grouped
pair 1 "lr 1e-4 vs 1e-2 (must fail)" --a train.lr=1e-4 --b train.lr=1e-2
echo
echo "paired on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $TOKENS tokens, $STEPS steps per side"
echo "| pair | exit | max abs logits diff | step time B/A | verdict |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo "(full outputs in $OUTDIR)"
exit $fail
