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
[ $fail -eq 0 ] && echo "PASS"
exit $fail
