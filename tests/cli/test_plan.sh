#!/usr/bin/env bash
# bumblebee plan --explain: a table per phase labelled PREDICTED, JSON whose state bytes are the
# measured ones of a one-step run of the same config, and clear errors for bad input (exit 2).
set -u
BB=${1:?usage: test_plan.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
out=$("$BB" plan --explain configs/demo.toml 2>&1) || { echo "FAIL: plan exited $?: $out"; fail=1; }
for want in "PREDICTED" "| startup |" "| head |" "peak per category" "[plan] peak"; do
  grep -qF "$want" <<< "$out" || { echo "FAIL: no '$want' in: $out"; fail=1; }
done
# The prediction's state and logits bytes equal what a step of the same run measures.
"$BB" plan --explain configs/demo.toml --json > "$TMP/plan.json" || { echo "FAIL: plan --json"; fail=1; }
"$BB" train --config configs/demo.toml --steps 1 --set 'checkpoint.dir=""' --set "log.metrics=\"$TMP/m.jsonl\"" \
  > "$TMP/train.log" 2>&1 || { echo "FAIL: train"; cat "$TMP/train.log"; fail=1; }
python3 - "$TMP/plan.json" "$TMP/m.jsonl" <<'PY' || fail=1
import json, sys
p = json.load(open(sys.argv[1]))["peak_bytes"]
m = json.loads(open(sys.argv[2]).read().splitlines()[-1])["peak_bytes"]
bad = [k for k in ("params", "grads", "optimizer", "logits", "moe", "comm") if p[k] != m[k]]
act = abs(p["activations"] - m["activations"]) / m["activations"]
if bad or act > 0.02:
    print("FAIL: predicted", {k: p[k] for k in p}, "measured", m, "differ in", bad, "activations rel", act)
    sys.exit(1)
PY
# Bad input: exit 2 with the reason.
"$BB" plan --explain /nonexistent.toml > "$TMP/e1" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "nonexistent" "$TMP/e1" || { echo "FAIL: missing config: rc $rc $(cat "$TMP/e1")"; fail=1; }
"$BB" plan --explain configs/demo.toml --ranks 3 --set parallel.ep=2 > "$TMP/e2" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "parallel.ep" "$TMP/e2" || { echo "FAIL: impossible layout: rc $rc $(cat "$TMP/e2")"; fail=1; }
# parallel = "auto": the layout the trainer would take, for --ranks; without --ranks an error.
out=$("$BB" plan --explain configs/demo.toml --set parallel.layout=auto --ranks 4 2>&1) || { echo "FAIL: plan auto: $out"; fail=1; }
grep -q "parallel = auto chose dp=" <<< "$out" || { echo "FAIL: no auto choice in: $out"; fail=1; }
"$BB" plan --explain configs/demo.toml --set parallel.layout=auto > "$TMP/e3" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "give the job's size with --ranks N" "$TMP/e3" || { echo "FAIL: auto without ranks: rc $rc $(cat "$TMP/e3")"; fail=1; }
# The time model: a GPU run's explain ends with its predicted step time; --calibrate --quick writes
# a calibration (small shapes on the CPU) that --calibration then uses; a bad file is refused.
out=$("$BB" plan --explain configs/qwen3-30b-a3b-4layer-gpu.toml 2>&1) || { echo "FAIL: explain gpu: $out"; fail=1; }
for want in "PREDICTED step time" "| expert GEMMs |" "| **step** |" "model TFLOP/s/GPU" "calibration: NVIDIA H100"; do
  grep -qF "$want" <<< "$out" || { echo "FAIL: no '$want' in: $out"; fail=1; }
done
"$BB" plan --calibrate --quick --out "$TMP/cal.json" > "$TMP/cal.log" 2>&1 || { echo "FAIL: calibrate --quick: $(cat "$TMP/cal.log")"; fail=1; }
grep -q "wrote $TMP/cal.json" "$TMP/cal.log" || { echo "FAIL: calibrate log: $(cat "$TMP/cal.log")"; fail=1; }
out=$("$BB" plan --explain configs/qwen3-30b-a3b-4layer-gpu.toml --calibration "$TMP/cal.json" 2>&1) || { echo "FAIL: explain with calibration: $out"; fail=1; }
grep -q "calibration: cpu" <<< "$out" || { echo "FAIL: the calibration file was not used: $out"; fail=1; }
echo '{"format": "bumblebee-calibration-1"}' > "$TMP/bad.json"
"$BB" plan --explain configs/qwen3-30b-a3b-4layer-gpu.toml --calibration "$TMP/bad.json" > "$TMP/e4" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "gemm_tflops" "$TMP/e4" || { echo "FAIL: bad calibration: rc $rc $(cat "$TMP/e4")"; fail=1; }
# The layout search ranks by predicted tokens/s per GPU and says why this CP and this EP.
out=$("$BB" plan --model configs/models/qwen3-30b-a3b --gpus 8 --seq 32768 --gpu-memory 139 2>/dev/null) || { echo "FAIL: plan --model: $out"; fail=1; }
for want in "tokens/s/GPU" "**chosen**" "CP " "EP "; do
  grep -qF -- "$want" <<< "$out" || { echo "FAIL: no '$want' in: $out"; fail=1; }
done
"$BB" plan --model configs/models/qwen3-30b-a3b --gpus 8 --seq 32768 --json 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)
fit = [c for c in j["candidates"] if c["fits"]]
best = max(fit, key=lambda c: c["time"]["tokens_per_s_per_gpu"])
assert best["chosen"], "the chosen layout is not the fastest predicted"
' || { echo "FAIL: plan --model --json"; fail=1; }
[ $fail -eq 0 ] && echo "PASS"
exit $fail
