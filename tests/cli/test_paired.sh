#!/usr/bin/env bash
# The paired tool passes for swaps that keep the math and fails for one that changes it.
# Usage: test_paired.sh PATH/TO/bumblebee   (run from the repository root)
set -u
BB=${1:?usage: test_paired.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1
# A smaller model than the demo so that each side runs in about a second.
sed -e 's/"hidden_size": 128/"hidden_size": 64/' -e 's/"num_hidden_layers": 4/"num_hidden_layers": 2/' \
  configs/models/demo-tiny/config.json > "$TMP/config.json"
COMMON=(--config configs/demo.toml --steps 3 --set "model.config=\"$TMP/config.json\""
        --set train.micro_batch_tokens=256 --set data.demo_documents=50)
fail=0
expect() {  # expect <exit code> <label> <args...>
  local want=$1 label=$2; shift 2
  "$BB" paired "${COMMON[@]}" "$@" > "$TMP/out.txt" 2>&1
  local got=$?
  if [ "$got" -ne "$want" ]; then
    echo "FAIL: $label: exit $got, expected $want"; cat "$TMP/out.txt"; fail=1
  else
    echo "ok: $label ($(tail -n 1 "$TMP/out.txt"))"
  fi
}
expect 0 "loss full_ce vs linear_ce" --a primitives.loss=full_ce --b primitives.loss=linear_ce \
  --set primitives.loss_chunk_tokens=100 --set primitives.loss_chunk_vocab=50 \
  --set primitives.loss_fused_chunk_tokens=100
expect 0 "recompute none vs full" --a primitives.recompute=none --b primitives.recompute=full
expect 0 "permute standard vs memory_efficient" --a primitives.permute=standard --b primitives.permute=memory_efficient
expect 0 "experts sequential vs grouped" --a primitives.experts=sequential --b primitives.experts=grouped
expect 1 "a different learning rate must fail" --a train.lr=3e-3 --b train.lr=6e-3
# A side whose loss turns NaN (skipped steps, so the side runs to the end) fails: a NaN difference
# is the largest there is. Step 1 is the same on both sides, so only the NaN steps differ.
expect 1 "a side with NaN losses must fail" --set 'train.on_nonfinite="skip_step"' --set train.warmup_steps=0 \
  --set train.grad_clip=0 --b train.lr=1e30
# Recompute reruns the same primitives: every logit and every gradient is bit-identical.
expect 0 "recompute: zero logits and gradient tolerance" --a primitives.recompute=none \
  --b primitives.recompute=full --tol-logits 0 --tol-grad 0
# The logits and per-gradient checks fail on their own when their tolerance is exceeded.
expect 1 "logits above --tol-logits must fail" --a primitives.permute=standard \
  --b primitives.permute=memory_efficient --tol-logits 0
expect 1 "a gradient above --tol-grad must fail" --a primitives.loss=full_ce \
  --b primitives.loss=linear_ce --set primitives.loss_fused_chunk_tokens=100 --tol-grad 0
# The table is there.
"$BB" paired "${COMMON[@]}" --a primitives.recompute=none --b primitives.recompute=full > "$TMP/t.txt" 2>&1
code=$?
[ $code -eq 0 ] || { echo "FAIL: the table's run: exit $code"; cat "$TMP/t.txt"; fail=1; }
for want in "max |logits A - logits B|" "gradients after step 1" "peak memory" "activations" \
            "ratio B/A" "gnorm A"; do
  grep -qF "$want" "$TMP/t.txt" || { echo "FAIL: paired output lacks '$want'"; fail=1; }
done
# An explicit warm-up runs untimed steps of each side first (the default on a GPU).
"$BB" paired "${COMMON[@]}" --warmup 1 --a primitives.recompute=none --b primitives.recompute=full > "$TMP/w.txt" 2>&1
code=$?
[ $code -eq 0 ] || { echo "FAIL: paired --warmup 1: exit $code"; cat "$TMP/w.txt"; fail=1; }
for want in "warm-up of side A: 1 untimed step" "warm-up of side B: 1 untimed step"; do
  grep -qF "$want" "$TMP/w.txt" || { echo "FAIL: paired --warmup 1 output lacks '$want'"; fail=1; }
done
# [backend] is settable per side: each side prints (and its trainer applies) its own table.
"$BB" paired "${COMMON[@]}" --b backend.grouped_gemm_streams=3 --b 'backend.gemm_heuristics="exact"' > "$TMP/b.txt" 2>&1
code=$?
if [ $code -ne 0 ] || ! grep -q "side A backend: .*grouped_gemm_streams=[^3].*gemm_heuristics=bucketed" "$TMP/b.txt" ||
   ! grep -q "side B backend: .*grouped_gemm_streams=3 .*gemm_heuristics=exact" "$TMP/b.txt"; then
  echo "FAIL: per-side [backend]: exit $code"; cat "$TMP/b.txt"; fail=1
fi
"$BB" paired "${COMMON[@]}" --b backend.grouped_gemm_streams=99 > "$TMP/e.txt" 2>&1
code=$?
if [ $code -ne 2 ] || ! grep -q "grouped_gemm_streams = 99.* is not in \[1, 16\]" "$TMP/e.txt"; then
  echo "FAIL: bad [backend] value on one side: exit $code"; cat "$TMP/e.txt"; fail=1
fi
# cuDNN is loaded once per process: sides that differ in backend.cudnn_library are refused.
"$BB" paired "${COMMON[@]}" --b 'backend.cudnn_library="/nonexistent/libcudnn.so.9"' > "$TMP/e.txt" 2>&1
code=$?
if [ $code -ne 2 ] || ! grep -q "backend.cudnn_library differs between the sides" "$TMP/e.txt"; then
  echo "FAIL: paired with two cuDNN libraries: exit $code"; cat "$TMP/e.txt"; fail=1
fi
# Side B's data is read before side A runs: a bad record, or a missing hf: directory, ends the
# run at once naming side B (it used to come after all of side A's steps).
printf '{"tokens": [1, 2, 3]}\n{"tokens": [1, 999]}\n' > "$TMP/bad.jsonl"
for b in "data.path=\"$TMP/bad.jsonl\"" "model.init=\"hf:$TMP/no_such_model\""; do
  "$BB" paired "${COMMON[@]}" --b "$b" > "$TMP/e.txt" 2>&1
  code=$?
  if [ $code -ne 2 ] || ! grep -q "side B cannot run" "$TMP/e.txt" || grep -q "side A step" "$TMP/e.txt"; then
    echo "FAIL: a bad side B ($b): exit $code"; cat "$TMP/e.txt"; fail=1
  fi
done
# --metrics: each side's steps as log.metrics rows, one file a side, which `report` overlays.
"$BB" paired "${COMMON[@]}" --metrics "$TMP/m/pair" --a primitives.recompute=none --b primitives.recompute=full > "$TMP/m.txt" 2>&1
code=$?
if [ $code -ne 0 ]; then echo "FAIL: paired --metrics: exit $code"; cat "$TMP/m.txt"; fail=1; fi
for side in a b; do
  f="$TMP/m/pair.$side.jsonl"
  rows=$(grep -c '"grad_norm"' "$f" 2>/dev/null)
  [ "${rows:-0}" -eq 3 ] || { echo "FAIL: paired --metrics: $f has ${rows:-no} rows, expected 3"; fail=1; }
done
ids=$(cat "$TMP/m/pair.a.jsonl" "$TMP/m/pair.b.jsonl" 2>/dev/null | grep -o '"run_id":"[^"]*"' | sort -u | wc -l)
[ "$ids" -eq 2 ] || { echo "FAIL: paired --metrics: $ids run ids across the sides, expected 2"; fail=1; }
"$BB" report "$TMP/m/pair.a.jsonl" "$TMP/m/pair.b.jsonl" --out "$TMP/m/r.html" > "$TMP/r.txt" 2>&1 ||
  { echo "FAIL: report of the paired metrics"; cat "$TMP/r.txt"; fail=1; }
"$BB" paired "${COMMON[@]}" --metrics /proc/no/such/dir/x --b primitives.recompute=full > "$TMP/e.txt" 2>&1
code=$?
if [ $code -ne 2 ] || ! grep -q "cannot write side A's metrics file" "$TMP/e.txt"; then
  echo "FAIL: paired --metrics into an unwritable place: exit $code"; cat "$TMP/e.txt"; fail=1
fi
# Bad usage is an error (exit 2) with a message.
"$BB" paired "${COMMON[@]}" --a primitives.loss=nope > "$TMP/e.txt" 2>&1
code=$?
if [ $code -ne 2 ] || ! grep -q "registered members: full_ce, linear_ce" "$TMP/e.txt"; then
  echo "FAIL: bad override: exit $code"; cat "$TMP/e.txt"; fail=1
fi
exit $fail
