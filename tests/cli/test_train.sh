#!/usr/bin/env bash
# `bumblebee train` end to end on the demo: log lines, metrics file, checkpoint, resume, errors.
set -u
BB=${1:?usage: test_train.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1
sed -e 's/"hidden_size": 128/"hidden_size": 64/' -e 's/"num_hidden_layers": 4/"num_hidden_layers": 2/' \
  configs/models/demo-tiny/config.json > "$TMP/config.json"
ARGS=(--config configs/demo.toml --set "model.config=\"$TMP/config.json\"" --set train.micro_batch_tokens=256
      --set data.demo_documents=50 --set "checkpoint.dir=\"$TMP/ckpt\"" --set checkpoint.every=4
      --set "log.metrics=\"$TMP/metrics.jsonl\"" --set log.every=1)
fail=0
"$BB" train "${ARGS[@]}" --steps 4 > "$TMP/a.txt" 2>&1 || { echo "FAIL: train exited $?"; cat "$TMP/a.txt"; fail=1; }
for want in "step      4 | loss" "tok/s" "TFLOP/s" "peak MiB: act" "[checkpoint] saved" "[startup]"; do
  grep -qF "$want" "$TMP/a.txt" || { echo "FAIL: train output lacks '$want'"; cat "$TMP/a.txt"; fail=1; }
done
[ "$(wc -l < "$TMP/metrics.jsonl")" -eq 4 ] || { echo "FAIL: metrics.jsonl should have 4 lines"; fail=1; }
[ -f "$TMP/ckpt/step_00000004/shards/rank_00000.safetensors" ] || { echo "FAIL: no checkpoint"; fail=1; }
"$BB" train "${ARGS[@]}" --steps 6 --set 'checkpoint.resume="auto"' > "$TMP/b.txt" 2>&1 || { echo "FAIL: resume exited $?"; cat "$TMP/b.txt"; fail=1; }
grep -q "resumed from .*step_00000004 at step 4" "$TMP/b.txt" || { echo "FAIL: no resume line"; cat "$TMP/b.txt"; fail=1; }
grep -q "step      5 | loss" "$TMP/b.txt" || { echo "FAIL: resumed run did not continue at step 5"; fail=1; }
"$BB" train --config configs/demo.toml --set train.bogus=1 > "$TMP/c.txt" 2>&1
[ $? -eq 2 ] && grep -q "unknown key 'train.bogus'" "$TMP/c.txt" || { echo "FAIL: unknown key not reported"; cat "$TMP/c.txt"; fail=1; }
"$BB" train --help > "$TMP/h.txt" 2>&1
grep -q -- "--set" "$TMP/h.txt" && grep -q "docs/config.md" "$TMP/h.txt" || { echo "FAIL: help text"; fail=1; }
[ $fail -eq 0 ] && echo "ok: train, metrics, checkpoint, resume, errors, help"
exit $fail
