#!/usr/bin/env bash
# The reliability defects seen from the command line: usage errors exit 2, a locked checkpoint
# root names its holder, export never overwrites or writes into checkpoints, a full disk stops
# the run, paired checks side B before side A runs, messages carry repo-relative source paths.
set -u
BB=${1:?usage: test_reliability.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'kill $holder 2>/dev/null; rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1
holder=
sed -e 's/"hidden_size": 128/"hidden_size": 64/' -e 's/"num_hidden_layers": 4/"num_hidden_layers": 2/' \
  configs/models/demo-tiny/config.json > "$TMP/config.json"
ARGS=(--config configs/demo.toml --set "model.config=\"$TMP/config.json\"" --set train.micro_batch_tokens=128
      --set data.demo_documents=50 --set "checkpoint.dir=\"$TMP/ckpt\"")
fail=0
bad() { echo "FAIL: $1"; [ -n "${2:-}" ] && cat "$2"; fail=1; }

# Usage and config errors exit 2 (not CLI11's 104-109); help exits 0.
"$BB" train > "$TMP/u1.txt" 2>&1;                     [ $? -eq 2 ] || bad "missing --config should exit 2" "$TMP/u1.txt"
"$BB" train --config configs/demo.toml --bogus > "$TMP/u2.txt" 2>&1; [ $? -eq 2 ] || bad "unknown option should exit 2" "$TMP/u2.txt"
"$BB" train --config configs/demo.toml --steps -1 > "$TMP/u3.txt" 2>&1; [ $? -eq 2 ] || bad "--steps -1 should exit 2" "$TMP/u3.txt"
"$BB" train --config configs/demo.toml --steps 99999999999999999999 > "$TMP/u4.txt" 2>&1
[ $? -eq 2 ] || bad "--steps out of range should exit 2" "$TMP/u4.txt"
"$BB" train --config configs/demo.toml --set train.lr=inf > "$TMP/u5.txt" 2>&1
[ $? -eq 2 ] && grep -q "must be a finite number" "$TMP/u5.txt" || bad "train.lr=inf should be refused" "$TMP/u5.txt"
"$BB" --help > /dev/null 2>&1 || bad "--help should exit 0"
# Messages name the source line relative to the repository, not the build machine's directories.
grep -q "\[src/runtime/run_config.cpp:[0-9]*\]" "$TMP/u5.txt" || bad "message lacks a repo-relative source path" "$TMP/u5.txt"
grep -qF "$(pwd)/src" "$TMP/u5.txt" && bad "message carries an absolute source path" "$TMP/u5.txt"

# A second run on a locked root exits 2 naming the holder's pid; a killed holder leaves it free.
"$BB" train "${ARGS[@]}" --steps 100000 > "$TMP/holder.txt" 2>&1 &
holder=$!
for _ in $(seq 100); do grep -q "^step" "$TMP/holder.txt" 2>/dev/null && break; sleep 0.1; done
"$BB" train "${ARGS[@]}" --steps 2 > "$TMP/l.txt" 2>&1
rc=$?
[ $rc -eq 2 ] && grep -q "is in use by another run (pid $holder on host" "$TMP/l.txt" || bad "locked root: rc $rc" "$TMP/l.txt"
kill -9 $holder; wait $holder 2>/dev/null; holder=
"$BB" train "${ARGS[@]}" --steps 2 > "$TMP/l2.txt" 2>&1 || bad "root should be free after kill -9" "$TMP/l2.txt"

# A save killed midway leaves a temporary directory; the next start removes it.
mkdir -p "$TMP/ckpt/.step_00000009.tmp.12345/shards" && head -c 100000 /dev/zero > "$TMP/ckpt/.step_00000009.tmp.12345/shards/x"
"$BB" train "${ARGS[@]}" --steps 3 --set 'checkpoint.resume="auto"' > "$TMP/t.txt" 2>&1 || bad "resume after a torn save" "$TMP/t.txt"
[ -e "$TMP/ckpt/.step_00000009.tmp.12345" ] && bad "stale temporary directory not removed"
grep -q "removed 1 temporary" "$TMP/t.txt" || bad "no log line for the removed temporary" "$TMP/t.txt"

# export: refuses a non-empty --out without --force, and never writes into a checkpoint root.
mkdir -p "$TMP/hf" && echo keep > "$TMP/hf/README"
"$BB" export --checkpoint "$TMP/ckpt" --out "$TMP/hf" > "$TMP/e1.txt" 2>&1
[ $? -eq 2 ] && grep -q "is not empty; pass --force" "$TMP/e1.txt" || bad "export into a non-empty dir" "$TMP/e1.txt"
[ "$(cat "$TMP/hf/README")" = keep ] || bad "export touched the non-empty --out"
"$BB" export --checkpoint "$TMP/ckpt" --out "$TMP/ckpt/step_00000003" --force > "$TMP/e2.txt" 2>&1
[ $? -eq 2 ] && grep -q "checkpoint directory" "$TMP/e2.txt" || bad "export into a step directory" "$TMP/e2.txt"
"$BB" export --checkpoint "$TMP/ckpt" --out "$TMP/ckpt/hf" > "$TMP/e3.txt" 2>&1
[ $? -eq 2 ] && grep -q "inside the checkpoint directory" "$TMP/e3.txt" || bad "export inside a root" "$TMP/e3.txt"
"$BB" export --checkpoint "$TMP/ckpt" --out "$TMP/hf" --force > "$TMP/e4.txt" 2>&1 || bad "export --force" "$TMP/e4.txt"
[ -f "$TMP/hf/model.safetensors" ] || bad "export --force wrote no model"

# A full disk under the metrics file stops the run with an error.
"$BB" train "${ARGS[@]}" --set 'checkpoint.dir=""' --set 'log.metrics="/dev/full"' --steps 2 > "$TMP/m.txt" 2>&1
[ $? -eq 2 ] && grep -q "cannot write log.metrics" "$TMP/m.txt" || bad "metrics write error not reported" "$TMP/m.txt"

# paired: a side B that cannot run is refused before side A trains.
"$BB" paired --config configs/demo.toml --set "model.config=\"$TMP/config.json\"" --set train.micro_batch_tokens=128 \
  --set data.demo_documents=50 --b parallel.ep=3 > "$TMP/p.txt" 2>&1
[ $? -eq 2 ] && grep -q "side B cannot run" "$TMP/p.txt" || bad "paired should refuse side B up front" "$TMP/p.txt"
grep -q "side A step" "$TMP/p.txt" && bad "paired ran side A before refusing side B" "$TMP/p.txt"

[ $fail -eq 0 ] && echo "ok: exit codes, lock, temporaries, export targets, metrics errors, paired checks"
exit $fail
