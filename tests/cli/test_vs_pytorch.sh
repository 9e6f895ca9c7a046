#!/usr/bin/env bash
# shellcheck disable=SC2016  # the checks below are strings for eval
# bench/vs_pytorch.sh (bumblebee against the compiled PyTorch step, issue-style ratio table):
# with stand-in programs that print the two benches' table rows, the table holds each
# repetition's tokens/s and the ratio of the means, and a size one side did not report makes
# the script say so and exit 1. Usage: test_vs_pytorch.sh [bumblebee-binary, unused]
set -u
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
# bumblebee's bench: a different tokens/s each call (1000, then 1100), all three sizes.
cat > "$TMP/bench" <<'EOS'
#!/usr/bin/env bash
n=$(cat "$(dirname "$0")/calls" 2>/dev/null || echo 0); echo $((n + 1)) > "$(dirname "$0")/calls"
echo "  tokens |    step ms |     tokens/s | model TF/s |"
for s in 8192 16384 32768; do echo "   $s |       1.0 |        $((1000 + 100 * n)) |      1.0 |"; done
EOS
# The PyTorch script (run as "$PYTHON hf_train_step.py ..."): 800 tokens/s, 32K only when FIT=all.
cat > "$TMP/python" <<'EOS'
#!/usr/bin/env bash
echo "PyTorch + HF reference step"
echo "  tokens |   step ms |   tokens/s | model TF/s |  peak GiB"
echo "    8192 |     1.0 |      800 |      1.0 |     1.0"
echo "   16384 |     1.0 |      800 |      1.0 |     1.0"
[ "${FIT:-}" = all ] && echo "   32768 |     1.0 |      800 |      1.0 |     1.0"
exit 0
EOS
chmod +x "$TMP/bench" "$TMP/python"
check() {  # check <label> <condition>
  if ! eval "$2"; then echo "FAIL: $1"; cat "$TMP/out.txt"; fail=1; fi
}
FIT=all PYTHON="$TMP/python" bash bench/vs_pytorch.sh "$TMP/bench" "$TMP/a" 8192,16384,32768 2 > "$TMP/out.txt" 2>&1
rc=$?
check "exit 0 when every size has both sides (got $rc)" '[ $rc -eq 0 ]'
check "8K row: both repetitions and 1050/800" 'grep -qE "^ +8192 \| 1000 / 1100 +\| 800 / 800 +\| 1.312x" "$TMP/out.txt"'
check "32K row present" 'grep -qE "^ +32768 \| 1000 / 1100 .*1.312x" "$TMP/out.txt"'
check "sizes in ascending order" '[ "$(grep -oE "^ +[0-9]+ \|" "$TMP/out.txt" | tr -d " |" | tr "\n" ,)" = "8192,16384,32768," ]'
rm -f "$TMP/calls"
PYTHON="$TMP/python" bash bench/vs_pytorch.sh "$TMP/bench" "$TMP/b" 8192,16384,32768 1 > "$TMP/out.txt" 2>&1
rc=$?
check "exit 1 when a size is missing on one side (got $rc)" '[ $rc -eq 1 ]'
check "the missing size is named" 'grep -qE "^ +32768 \| 1000 .*missing" "$TMP/out.txt"'
check "the logs are kept" '[ -s "$TMP/b/bumblebee_rep1.log" ] && [ -s "$TMP/b/pytorch_rep1.log" ]'
# BB_VARIANTS: each variant runs every repetition against the same PyTorch runs, one table each.
rm -f "$TMP/calls"
FIT=all BB_VARIANTS='one:--set a=1;two:--set b=2' PYTHON="$TMP/python" bash bench/vs_pytorch.sh "$TMP/bench" "$TMP/c" \
  8192,16384,32768 2 > "$TMP/out.txt" 2>&1
rc=$?
check "variants: exit 0 (got $rc)" '[ $rc -eq 0 ]'
check "variants: one table each, named" '[ "$(grep -c "^bumblebee variant" "$TMP/out.txt")" -eq 2 ]'
check "variants: each rep runs both, in order (one: calls 1 and 3, two: 2 and 4)" 'grep -qE "^ +8192 \| 1000 / 1200 +\| 800 / 800 " "$TMP/out.txt" && grep -qE "^ +8192 \| 1100 / 1300 +\| 800 / 800 " "$TMP/out.txt"'
check "variants: the logs are named by label" '[ -s "$TMP/c/one_rep2.log" ] && [ -s "$TMP/c/two_rep1.log" ]'
[ $fail -eq 0 ] && echo "vs_pytorch.sh: all checks passed"
exit $fail
