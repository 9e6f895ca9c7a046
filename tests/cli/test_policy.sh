#!/usr/bin/env bash
# bumblebee train with primitives.loss = "policy" on a rollout file (JSONL: tokens, loss_mask,
# advantages, old / ref log-probs, routing): it trains, prints the policy line, writes the policy
# metrics, replays the routing, and refuses data or settings it cannot use (exit 2, naming why).
set -u
BB=${1:?usage: test_policy.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
# 40 rollouts for the demo model (vocab 264, 3 MoE layers of 8 experts, top-2): a masked prompt,
# then a response; one advantage per rollout; log-probs near the untrained model's (-log 264).
python3 - "$TMP/rollouts.jsonl" <<'PY'
import json, random, sys
random.seed(3)
with open(sys.argv[1], "w") as f:
    for i in range(40):
        n = random.randint(20, 120)
        prompt = n // 3
        toks = [random.randrange(256) for _ in range(n)]
        routing = []
        for _ in range(n):
            layers = []
            for _ in range(3):
                a = random.randrange(8)
                layers.append([a, (a + 1 + random.randrange(7)) % 8])
            routing.append(layers)
        f.write(json.dumps({
            "id": f"r{i}", "tokens": toks, "loss_mask": [0] * prompt + [1] * (n - prompt),
            "advantages": random.uniform(-1, 1),
            "old_logprobs": [0.0] * prompt + [-5.58 + random.uniform(-0.3, 0.3) for _ in range(n - prompt)],
            "ref_logprobs": [0.0] * prompt + [-5.58 + random.uniform(-0.2, 0.2) for _ in range(n - prompt)],
            "routing": routing}) + "\n")
PY
common=(--config configs/demo.toml --steps 3 --set 'checkpoint.dir=""' --set "data.path=\"$TMP/rollouts.jsonl\""
        --set 'primitives.loss="policy"' --set train.micro_batch_tokens=256 --set train.grad_accum=2
        --set policy.kl_coef=0.01 --set policy.clip_high=0.28 --set log.every=1)
"$BB" train "${common[@]}" --set "log.metrics=\"$TMP/m.jsonl\"" --set primitives.router_replay=true \
  > "$TMP/train.log" 2>&1 || { echo "FAIL: policy train exited $?"; cat "$TMP/train.log"; fail=1; }
for want in "loss=policy" "router_replay=on" "policy(temperature=1" "data.packing = whole" "policy: clip" "[done] 3 steps"; do
  grep -qF "$want" "$TMP/train.log" || { echo "FAIL: no '$want' in the log"; cat "$TMP/train.log"; fail=1; }
done
python3 - "$TMP/m.jsonl" <<'PY' || fail=1
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 3, rows
for r in rows:
    p = r["policy"]
    for k in ("clip_frac", "dual_clip_frac", "approx_kl", "entropy", "ratio_mean", "ratio_max", "ref_kl", "sequences"):
        assert math.isfinite(p[k]), (k, p)
    assert 0 <= p["clip_frac"] <= 1 and p["entropy"] > 0 and p["sequences"] > 0, p
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
PY
# paired takes its first micro-batch the way the trainer packs (whole documents here).
"$BB" paired "${common[@]}" --a policy.entropy_coef=0 --b policy.entropy_coef=0 > "$TMP/p.log" 2>&1 ||
  { echo "FAIL: paired on rollouts: exit $?"; cat "$TMP/p.log"; fail=1; }
# Bad input: exit 2 with the reason.
"$BB" train --config configs/demo.toml --steps 1 --set 'checkpoint.dir=""' --set 'primitives.loss="policy"' \
  > "$TMP/e1" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q 'has no "advantages"' "$TMP/e1" || { echo "FAIL: demo data: rc $rc $(cat "$TMP/e1")"; fail=1; }
"$BB" train "${common[@]}" --set train.micro_batch_tokens=64 > "$TMP/e2" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "more than a micro-batch holds" "$TMP/e2" || { echo "FAIL: long rollout: rc $rc $(cat "$TMP/e2")"; fail=1; }
"$BB" train "${common[@]}" --set policy.dual_clip=0.5 > "$TMP/e3" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "policy.dual_clip must be 0 (off) or > 1" "$TMP/e3" || { echo "FAIL: dual clip: rc $rc $(cat "$TMP/e3")"; fail=1; }
[ $fail -eq 0 ] && echo "PASS"
exit $fail
