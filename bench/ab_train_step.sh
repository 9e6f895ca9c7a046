#!/usr/bin/env bash
# ab_train_step.sh — "is the new build slower?": bench_train_step of two builds (A = before,
# B = after) on the same card in one run, interleaved so that clock and thermal drift hit both
# sides alike, for recompute full and none. Prints one table: median step ms per build and size,
# both repetitions, and the ratio B/A of the means.
#
#   bench/ab_train_step.sh A_BENCH_TRAIN_STEP B_BENCH_TRAIN_STEP OUT_DIR [SEQS=8192,16384,32768] [REPS=2]
# Environment: STEPS (timed steps per size, default 5), WARMUP (default 2).
set -u
A=${1:?usage: ab_train_step.sh A_bin B_bin OUT_DIR [seqs] [reps]}
B=${2:?usage: ab_train_step.sh A_bin B_bin OUT_DIR [seqs] [reps]}
OUT=${3:?usage: ab_train_step.sh A_bin B_bin OUT_DIR [seqs] [reps]}
SEQS=${4:-8192,16384,32768}
REPS=${5:-2}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
mkdir -p "$OUT"
results="$OUT/ab_results.txt"
: > "$results"
run() {  # run <label A|B> <binary> <recompute> <rep>
  local log="$OUT/ab_$1_$3_rep$4.log"
  "$2" --seq "$SEQS" --steps "$STEPS" --warmup "$WARMUP" --set "primitives.recompute=\"$3\"" > "$log" 2>&1
  local rc=$?
  # Table rows: "   tokens |    step ms | ..."
  awk -v side="$1" -v rc="$3" -v rep="$4" '$1 ~ /^[0-9]+$/ && $2 == "|" && $4 == "|" {print side, rc, rep, $1, $3}' "$log" >> "$results"
  echo "[ab] $1 recompute=$3 rep $4: exit $rc ($(grep -cE '^ +[0-9]+ \|' "$log") sizes)"
}
for rep in $(seq 1 "$REPS"); do
  for rc in full none; do
    if [ $((rep % 2)) -eq 1 ]; then run A "$A" "$rc" "$rep"; run B "$B" "$rc" "$rep";
    else run B "$B" "$rc" "$rep"; run A "$A" "$rc" "$rep"; fi
  done
done
echo
echo "median step ms per run (A = before, B = after); ratio = mean B / mean A"
python3 - "$results" <<'PY'
import sys, collections
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    side, rc, rep, seq, ms = line.split()
    d[(rc, int(seq), side)].append(float(ms))
keys = sorted({(rc, s) for rc, s, _ in d})
print("| recompute | tokens | A runs (ms) | B runs (ms) | A mean | B mean | B/A |")
print("|---|---|---|---|---|---|---|")
for rc, s in keys:
    a, b = d.get((rc, s, "A"), []), d.get((rc, s, "B"), [])
    if not a or not b:
        print(f"| {rc} | {s} | {a} | {b} | - | - | - |"); continue
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    print(f"| {rc} | {s} | {' / '.join(f'{x:.1f}' for x in a)} | {' / '.join(f'{x:.1f}' for x in b)} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} |")
PY
