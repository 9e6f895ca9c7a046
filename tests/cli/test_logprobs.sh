#!/usr/bin/env bash
# bumblebee logprobs: scores a rollout file under a checkpoint and under its HF export (the same
# numbers), writes one line per record with the keys a rollout record takes, runs under mpirun
# with another layout to the same result, and refuses bad input (exit 2, naming it).
set -u
BB=${1:?usage: test_logprobs.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
"$BB" train --config configs/demo.toml --steps 2 --set "checkpoint.dir=\"$TMP/ck\"" --set checkpoint.every=0 \
  --set 'log.metrics=""' --set data.demo_documents=50 > "$TMP/train.log" 2>&1 || { echo "FAIL: train"; cat "$TMP/train.log"; fail=1; }
"$BB" export --checkpoint "$TMP/ck" --out "$TMP/hf" --dtype f32 > /dev/null 2>&1 || { echo "FAIL: export"; fail=1; }
python3 - "$TMP/r.jsonl" <<'PY'
import json, random, sys
random.seed(5)
with open(sys.argv[1], "w") as f:
    for i in range(6):
        n = random.randint(4, 90)
        f.write(json.dumps({"id": "r%d" % i, "tokens": [random.randrange(256) for _ in range(n)],
                            "advantages": 0.5, "loss_mask": [0] * 2 + [1] * (n - 2)}) + "\n")
PY
"$BB" logprobs --checkpoint "$TMP/ck" --data "$TMP/r.jsonl" --out "$TMP/a.jsonl" --routing > "$TMP/a.log" 2>&1 ||
  { echo "FAIL: logprobs (checkpoint)"; cat "$TMP/a.log"; fail=1; }
grep -q "grads 0 B, optimizer 0 B" "$TMP/a.log" || { echo "FAIL: no training state expected: $(cat "$TMP/a.log")"; fail=1; }
"$BB" logprobs --checkpoint "hf:$TMP/hf" --data "$TMP/r.jsonl" --out "$TMP/b.jsonl" --routing > "$TMP/b.log" 2>&1 ||
  { echo "FAIL: logprobs (hf)"; cat "$TMP/b.log"; fail=1; }
cmp -s "$TMP/a.jsonl" "$TMP/b.jsonl" || { echo "FAIL: checkpoint and HF export score differently"; fail=1; }
mpirun --oversubscribe -np 2 "$BB" logprobs --checkpoint "$TMP/ck" --data "$TMP/r.jsonl" --out "$TMP/c.jsonl" --routing \
  --set parallel.ep=2 > "$TMP/c.log" 2>&1 || { echo "FAIL: logprobs under mpirun"; cat "$TMP/c.log"; fail=1; }
python3 - "$TMP/a.jsonl" "$TMP/c.jsonl" "$TMP/r.jsonl" <<'PY' || fail=1
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
c = [json.loads(l) for l in open(sys.argv[2])]
r = [json.loads(l) for l in open(sys.argv[3])]
assert [x["id"] for x in a] == [x["id"] for x in r], "ids in the input's order"
for x, y, z in zip(a, c, r):
    n = len(z["tokens"])
    assert len(x["logprobs"]) == n and len(x["entropy"]) == n and len(x["routing"]) == n, x["id"]
    assert x["logprobs"][0] == 0 and all(v <= 0 for v in x["logprobs"]), x["id"]
    assert all(len(t) == 3 and all(len(l) == 2 for l in t) for t in x["routing"]), x["id"]
    assert x["routing"] == y["routing"], x["id"]
    assert max(abs(u - v) for u, v in zip(x["logprobs"], y["logprobs"])) < 1e-5, x["id"]
PY
# Bad input: exit 2 with the reason.
"$BB" logprobs --checkpoint "$TMP/nowhere" --data "$TMP/r.jsonl" --out "$TMP/x.jsonl" > "$TMP/e1" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "no checkpoint at" "$TMP/e1" || { echo "FAIL: missing checkpoint: rc $rc $(cat "$TMP/e1")"; fail=1; }
"$BB" logprobs --checkpoint "$TMP/ck" --data "$TMP/r.jsonl" --out "$TMP/x.jsonl" --set train.micro_batch_tokens=16 > "$TMP/e2" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "more than a micro-batch holds" "$TMP/e2" || { echo "FAIL: long record: rc $rc $(cat "$TMP/e2")"; fail=1; }
[ ! -e "$TMP/x.jsonl" ] || { echo "FAIL: an output was written for a failed run"; fail=1; }
"$BB" logprobs --checkpoint init --data "$TMP/r.jsonl" --out "$TMP/x.jsonl" > "$TMP/e3" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "init takes the model from --config" "$TMP/e3" || { echo "FAIL: init without config: rc $rc $(cat "$TMP/e3")"; fail=1; }
# init: the model's seeded initialisation (throughput checks); deterministic.
for o in i1 i2; do
  "$BB" logprobs --checkpoint init --config configs/demo.toml --data "$TMP/r.jsonl" --out "$TMP/$o.jsonl" > "$TMP/$o.log" 2>&1 ||
    { echo "FAIL: logprobs from init: $(cat "$TMP/$o.log")"; fail=1; }
done
cmp -s "$TMP/i1.jsonl" "$TMP/i2.jsonl" && ! cmp -s "$TMP/i1.jsonl" "$TMP/a.jsonl" || { echo "FAIL: init scores"; fail=1; }
[ $fail -eq 0 ] && echo "PASS"
exit $fail
