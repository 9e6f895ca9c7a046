#!/usr/bin/env bash
# primitives.optimizer: adamw vs adamw_bf16_moments, paired over 200 steps of the demo
# (configs/demo.toml, its model and training settings) on the CPU; then, with bf16 parameters,
# adamw's two master storages, [backend] master_storage = "f32" vs "split" (section 4).
#
# Per-step losses of two runs of this MoE model decorrelate after ~20 steps whatever the
# perturbation (top-k routing flips), so the criterion has two parts (skills/optimizer-adamw.md):
#   systematic  bf16 moments are stochastically rounded, unbiased, so the only systematic effect
#               is the curvature of 1/sqrt(v): E[(1 + d)^-1/2] - 1 = 3/8 E[d^2] <= 3/8 (2^-8)^2 /
#               (1 - b2^2) = 5.9e-5 of the step size (b2 = 0.95); on the loss at most that times
#               (L_1 - L_t) / L_t <= 3: SYS = 1.8e-4 relative.
#   chaos       the decorrelation floor of this model and config, measured here by a control pair
#               with no systematic difference at all: adamw vs adamw with adam_eps x (1 + 1e-4).
# Tolerance = SYS + 3 x the control's difference, on the per-step loss and grad norm (paired's
# --tol-loss / --tol-grad-norm) and on the loss averaged over windows of 20 steps (the sharp
# check: the mean over a window averages the decorrelated steps). The control is one draw of the
# floor and the bf16 pair another (measured: windows 0.85% and 1.19%); the factor 3 is the room
# between two such draws. The first micro-batch's logits
# and the step-1 gradients come before any update: they must be identical (tolerance 0).
# The test must be able to fail: a broken optimizer whose moments keep no history (beta1 = beta2
# = 0, so m = g and v = g^2 each step: what a kernel computes that never stores its moments, up
# to a constant factor of the step) must exceed the window tolerance.
# Usage: test_optimizer_paired.sh PATH/TO/bumblebee   (run from the repository root)
set -u
BB=${1:?usage: test_optimizer_paired.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1
STEPS=200
WINDOW=20
SYS=1.8e-4
fail=0
COMMON=(--config configs/demo.toml --steps "$STEPS")
TRAIN=(--config configs/demo.toml --set train.steps="$STEPS" --set 'checkpoint.dir=""' --set 'checkpoint.resume=""'
       --set log.every=1000)

# The loss column of a paired table: side A (col 3) or B (col 4), one value per line.
table_losses() { awk -v c="$2" '$2 == "|" && $1 ~ /^[0-9]+$/ { print $c }' "$1"; }
# The losses of a metrics file, one per line.
metrics_losses() { sed -E 's/.*"loss":([^,}]*).*/\1/' "$1"; }
# max over steps of |b - a| / |a|, and the max over windows of |mean b - mean a| / mean a.
compare() {  # compare FILE_A FILE_B -> "step_max window_max"
  paste "$1" "$2" | awk -v W="$WINDOW" '
    { d = ($2 - $1) / $1; if (d < 0) d = -d; if (d > m) m = d
      w = int((NR - 1) / W); sa[w] += $1; sb[w] += $2; nw = w + 1 }
    END { for (i = 0; i < nw; ++i) { r = (sb[i] - sa[i]) / sa[i]; if (r < 0) r = -r; if (r > wm) wm = r }
          printf "%.6g %.6g\n", m, wm }'
}
check_optimizer_ratio() {  # check_optimizer_ratio PAIR_FILE B_BYTES A_BYTES: the optimizer peaks' ratio B/A
  grep -E "^optimizer +\|" "$1"
  local a b
  a=$(awk '$1 == "optimizer" && $2 == "|" { print $3 }' "$1")
  b=$(awk '$1 == "optimizer" && $2 == "|" { print $5 }' "$1")
  awk -v a="$a" -v b="$b" -v w="$2" -v d="$3" 'BEGIN { q = b / a; e = w / d; exit !(q > e - 5e-4 && q < e + 5e-4) }' ||
    { echo "FAIL: optimizer peak B/A = $b / $a, expected $2/$3"; fail=1; }
}
verdict_field() {  # the relative difference after "max $2 rel diff" in a paired verdict line
  tail -n 1 "$1" | sed -E "s/.*max $2 rel diff ([0-9.e+-]+).*/\1/"
}

# 1. The control pair: the decorrelation floor (any tolerance passes: only the numbers are used).
"$BB" paired "${COMMON[@]}" --b train.adam_eps=1.0001e-8 --tol-loss 10 --tol-grad-norm 1000 > "$TMP/control.txt" 2>&1
if [ $? -ne 0 ]; then echo "FAIL: the control pair did not run"; cat "$TMP/control.txt"; exit 1; fi
table_losses "$TMP/control.txt" 3 > "$TMP/a.txt"
table_losses "$TMP/control.txt" 4 > "$TMP/c.txt"
[ "$(wc -l < "$TMP/a.txt")" -eq "$STEPS" ] || { echo "FAIL: the control table has no $STEPS steps"; cat "$TMP/control.txt"; exit 1; }
read -r c_step c_window < <(compare "$TMP/a.txt" "$TMP/c.txt")
c_gnorm=$(verdict_field "$TMP/control.txt" grad-norm)
tol_step=$(awk -v s="$SYS" -v c="$c_step" 'BEGIN { printf "%.3g", s + 3 * c }')
tol_window=$(awk -v s="$SYS" -v c="$c_window" 'BEGIN { printf "%.3g", s + 3 * c }')
tol_gnorm=$(awk -v c="$c_gnorm" 'BEGIN { printf "%.3g", 3 * c }')
echo "control (adam_eps x 1.0001): max per-step loss rel diff $c_step, max $WINDOW-step window $c_window," \
     "grad norm $c_gnorm"
echo "tolerances (SYS $SYS + 3 x control): per-step loss $tol_step, window loss $tol_window, grad norm $tol_gnorm"

# 2. The pair itself.
"$BB" paired "${COMMON[@]}" --a 'primitives.optimizer="adamw"' --b 'primitives.optimizer="adamw_bf16_moments"' \
  --tol-loss "$tol_step" --tol-grad-norm "$tol_gnorm" --tol-logits 0 --tol-grad 0 > "$TMP/pair.txt" 2>&1
code=$?
awk '$2 == "|" && $1 ~ /^[0-9]+$/ && ($1 <= 3 || $1 % 20 == 0)' "$TMP/pair.txt"
tail -n 1 "$TMP/pair.txt"
if [ $code -ne 0 ]; then echo "FAIL: paired adamw vs adamw_bf16_moments: exit $code"; cat "$TMP/pair.txt"; fail=1; fi
table_losses "$TMP/pair.txt" 3 > "$TMP/a2.txt"
table_losses "$TMP/pair.txt" 4 > "$TMP/b.txt"
cmp -s "$TMP/a.txt" "$TMP/a2.txt" || { echo "FAIL: side A (adamw) is not the same run in both pairs"; fail=1; }
read -r b_step b_window < <(compare "$TMP/a.txt" "$TMP/b.txt")
echo "adamw_bf16_moments: max per-step loss rel diff $b_step (tol $tol_step), max window $b_window (tol $tol_window)"
awk -v x="$b_window" -v t="$tol_window" 'BEGIN { exit !(x <= t) }' ||
  { echo "FAIL: the $WINDOW-step mean losses differ by $b_window > $tol_window"; fail=1; }
# The optimizer category shrinks from 12 to 8 bytes per parameter: 17.71 MiB -> 11.81 MiB here.
check_optimizer_ratio "$TMP/pair.txt" 8 12

# 3. The broken variant must fail the same criterion.
"$BB" train "${TRAIN[@]}" --set 'primitives.optimizer="adamw_bf16_moments"' --set train.beta1=0 --set train.beta2=0 \
  --set "log.metrics=\"$TMP/broken.jsonl\"" > "$TMP/broken.txt" 2>&1 ||
  { echo "FAIL: the broken-variant run did not run"; cat "$TMP/broken.txt"; exit 1; }
metrics_losses "$TMP/broken.jsonl" > "$TMP/d.txt"
read -r d_step d_window < <(compare "$TMP/a.txt" "$TMP/d.txt")
echo "broken (moments without history): max per-step loss rel diff $d_step, max window $d_window (tol $tol_window)"
awk -v x="$d_window" -v t="$tol_window" 'BEGIN { exit !(x > t) }' ||
  { echo "FAIL: the criterion does not reject moments without history ($d_window <= $tol_window)"; fail=1; }

# 4. The split master ([backend] master_storage = "split", the default for bf16 parameters),
# paired with the separate f32 master on bf16 parameters (model.dtype = "bf16"; the split master
# keeps its upper half in them). Its fp32 master follows the f32-master update bit for bit
# given the same values, and the values differ only where a master is exactly on a bf16 tie
# (2^-16 of the stores; one bf16 ulp, away from zero instead of to even): no systematic term,
# SYS = 0, so the tolerance is 3 x a bf16-parameter control pair's floor. Step 1 is identical.
BF=(--set 'model.dtype="bf16"')
"$BB" paired "${COMMON[@]}" "${BF[@]}" --set 'backend.master_storage="f32"' --b train.adam_eps=1.0001e-8 --tol-loss 10 --tol-grad-norm 1000 \
  > "$TMP/control16.txt" 2>&1 || { echo "FAIL: the bf16 control pair did not run"; cat "$TMP/control16.txt"; exit 1; }
table_losses "$TMP/control16.txt" 3 > "$TMP/a16.txt"
table_losses "$TMP/control16.txt" 4 > "$TMP/c16.txt"
read -r c16_step c16_window < <(compare "$TMP/a16.txt" "$TMP/c16.txt")
c16_gnorm=$(verdict_field "$TMP/control16.txt" grad-norm)
tol16_step=$(awk -v c="$c16_step" 'BEGIN { printf "%.3g", 3 * c }')
tol16_window=$(awk -v c="$c16_window" 'BEGIN { printf "%.3g", 3 * c }')
tol16_gnorm=$(awk -v c="$c16_gnorm" 'BEGIN { printf "%.3g", 3 * c }')
echo "bf16 control: max per-step loss rel diff $c16_step, window $c16_window, grad norm $c16_gnorm"
"$BB" paired "${COMMON[@]}" "${BF[@]}" --a 'backend.master_storage="f32"' --b 'backend.master_storage="split"' \
  --tol-loss "$tol16_step" --tol-grad-norm "$tol16_gnorm" --tol-logits 0 --tol-grad 0 > "$TMP/pair16.txt" 2>&1
code=$?
tail -n 1 "$TMP/pair16.txt"
if [ $code -ne 0 ]; then echo "FAIL: paired f32 vs split master: exit $code"; cat "$TMP/pair16.txt"; fail=1; fi
table_losses "$TMP/pair16.txt" 4 > "$TMP/s16.txt"
read -r s_step s_window < <(compare "$TMP/a16.txt" "$TMP/s16.txt")
echo "split master: max per-step loss rel diff $s_step (tol $tol16_step), max window $s_window (tol $tol16_window)"
awk -v x="$s_window" -v t="$tol16_window" 'BEGIN { exit !(x <= t) }' ||
  { echo "FAIL: the $WINDOW-step mean losses differ by $s_window > $tol16_window"; fail=1; }
# 12 -> 10 optimizer bytes per parameter.
check_optimizer_ratio "$TMP/pair16.txt" 10 12

[ $fail -eq 0 ] && echo "PASS: adamw_bf16_moments and the split master within the derived tolerances; the broken variant outside"
exit $fail
