#!/usr/bin/env bash
# `bumblebee report` on two short demo runs: exit codes, the page's content, inputs (files, a run
# directory, a file of two run ids, a torn last line), errors; then headless Chromium (the Debian
# package `chromium`, which scripts/setup.sh installs; missing is a failure) renders the page:
# no console message, every plot's series in the DOM, and the page parses as strict XHTML too.
set -u
BB=${1:?usage: test_report.sh bumblebee-binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1
sed -e 's/"hidden_size": 128/"hidden_size": 64/' -e 's/"num_hidden_layers": 4/"num_hidden_layers": 2/' \
  configs/models/demo-tiny/config.json > "$TMP/config.json"
ARGS=(--config configs/demo.toml --steps 3 --set "model.config=\"$TMP/config.json\"" --set train.micro_batch_tokens=256
      --set data.demo_documents=50 --set 'checkpoint.dir=""' --set 'checkpoint.resume=""')
fail=0
"$BB" train "${ARGS[@]}" --set "log.metrics=\"$TMP/a.jsonl\"" > "$TMP/a.log" 2>&1 || { echo "FAIL: train a"; cat "$TMP/a.log"; fail=1; }
"$BB" train "${ARGS[@]}" --set "log.metrics=\"$TMP/b.jsonl\"" --set train.lr=1e-2 > "$TMP/b.log" 2>&1 \
  || { echo "FAIL: train b"; cat "$TMP/b.log"; fail=1; }

# The series the page must draw, counted from the metrics files: 2 runs x (loss, grad norm, lr,
# tokens/s, TFLOP/s), and per run a memory series per category ever above zero, the total and
# the reserved peak when above zero.
want=$(python3 - "$TMP/a.jsonl" "$TMP/b.jsonl" <<'PY'
import json, sys
n = 0
for f in sys.argv[1:]:
    rows = [json.loads(l) for l in open(f)]
    cats = {k for r in rows for k, v in r["peak_bytes"].items() if k != "total" and v > 0}
    n += 5 + len(cats) + 1 + any(r["reserved_peak_bytes"] > 0 for r in rows)
print(n)
PY
)
out=$("$BB" report "$TMP/a.jsonl" "$TMP/b.jsonl" --out "$TMP/r.html" 2>&1); rc=$?
[ $rc -eq 0 ] || { echo "FAIL: report exited $rc: $out"; fail=1; }
grep -qF "[report] 2 run(s) (a: 3 steps, b: 3 steps), 7 plots, $want series -> $TMP/r.html" <<< "$out" \
  || { echo "FAIL: report line (want $want series): $out"; fail=1; }
page=$(cat "$TMP/r.html" 2>/dev/null)
for s in '<svg xmlns="http://www.w3.org/2000/svg" class="plot"' 'data-plot="loss" data-series="2"' \
         'data-plot="memory" data-run="a"' 'data-plot="memory" data-run="b"' '<path class="series" data-run="b"' \
         '<th>final loss</th>' '<th>median tokens/s</th>' '<th>peak memory</th>'; do
  grep -qF "$s" <<< "$page" || { echo "FAIL: the page lacks '$s'"; fail=1; }
done
# Self-contained: no script, nothing loaded from a URL or another file.
grep -qE '<script|<link|src=|href=|url\(|@import' <<< "$page" && { echo "FAIL: the page loads something"; fail=1; }
[ "$(grep -o 'class="series"' <<< "$page" | wc -l)" -eq "$want" ] || { echo "FAIL: want $want series in the page"; fail=1; }
ls "$TMP" | grep -q '\.tmp\.' && { echo "FAIL: a temporary file was left: $(ls "$TMP")"; fail=1; }

# A run directory; a file of two run ids (one series per id); a torn last line (warning, exit 0).
mkdir "$TMP/run_a" && cp "$TMP/a.jsonl" "$TMP/run_a/metrics.jsonl"
out=$("$BB" report "$TMP/run_a" --out "$TMP/dir.html" 2>&1) && grep -q 'data-run="run_a"' "$TMP/dir.html" \
  || { echo "FAIL: run directory: $out"; fail=1; }
cat "$TMP/a.jsonl" "$TMP/b.jsonl" > "$TMP/ab.jsonl"
id_b=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["run_id"])' "$TMP/b.jsonl")
out=$("$BB" report "$TMP/ab.jsonl" --out "$TMP/ab.html" 2>&1) && grep -q 'data-plot="loss" data-series="2"' "$TMP/ab.html" \
  && grep -qF "data-run=\"ab run $id_b\"" "$TMP/ab.html" || { echo "FAIL: two run ids in one file: $out"; fail=1; }
cp "$TMP/a.jsonl" "$TMP/torn.jsonl" && printf '{"step":4,"run_id":"x","lo' >> "$TMP/torn.jsonl"
out=$("$BB" report "$TMP/torn.jsonl" --out "$TMP/torn.html" 2>&1); rc=$?
[ $rc -eq 0 ] && grep -qF "[report] warning: $TMP/torn.jsonl:4: the last line is cut off" <<< "$out" \
  && grep -q "the last line is cut off" "$TMP/torn.html" || { echo "FAIL: torn last line: rc $rc $out"; fail=1; }

# Errors: exit 2 and the file (and line) named; the previous page stays as it was.
cp "$TMP/r.html" "$TMP/r.before"
{ head -1 "$TMP/a.jsonl"; echo "not json"; tail -1 "$TMP/a.jsonl"; } > "$TMP/bad.jsonl"
: > "$TMP/empty.jsonl"
check_error() {  # want, then the report arguments
  local want=$1; shift
  "$BB" report "$@" > "$TMP/e" 2>&1; local rc=$?
  [ $rc -eq 2 ] && grep -qF -- "$want" "$TMP/e" || { echo "FAIL: report $*: want exit 2 and '$want', got $rc: $(cat "$TMP/e")"; fail=1; }
}
check_error "$TMP/bad.jsonl:2: not a JSON object" "$TMP/a.jsonl" "$TMP/bad.jsonl" --out "$TMP/r.html"
check_error "'$TMP/empty.jsonl' has no metrics rows" "$TMP/empty.jsonl" --out "$TMP/r.html"
check_error "no metrics file or run directory '$TMP/nope.jsonl'" "$TMP/nope.jsonl" --out "$TMP/r.html"
check_error "has no metrics.jsonl" "$TMP" --out "$TMP/r.html"
check_error "it would overwrite the metrics" "$TMP/a.jsonl" --out "$TMP/a.jsonl"
check_error "--out is required" "$TMP/a.jsonl"
cmp -s "$TMP/r.html" "$TMP/r.before" || { echo "FAIL: a failed report changed the previous page"; fail=1; }
"$BB" report --help > "$TMP/h.txt" 2>&1
grep -q "paired writes no metrics files" "$TMP/h.txt" && grep -q -- "--label" "$TMP/h.txt" || { echo "FAIL: help text"; fail=1; }

# Headless Chromium. Every console message is a failure (the page has no script: one would be a
# blocked load or a malformed SVG attribute); the check itself is first shown to catch a script error.
CHROME=$(command -v chromium || command -v chromium-browser)
if [ -z "$CHROME" ]; then
  echo "FAIL: no chromium or chromium-browser to render the page (Debian package chromium; scripts/setup.sh installs it)"
  exit 1
fi
render() {  # page, what (--dump-dom | --screenshot=FILE); the DOM to $TMP/dom, Chromium's log to $TMP/chrome.log
  timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --enable-logging=stderr --v=0 --no-first-run \
    --user-data-dir="$TMP/chrome-profile" --window-size=1000,3000 "$2" "file://$1" > "$TMP/dom" 2> "$TMP/chrome.log"
}
console_errors() { grep -E 'CONSOLE|Uncaught|ERROR:.*console' "$TMP/chrome.log"; }
echo '<!DOCTYPE html><html><body><script>no_such_function();</script></body></html>' > "$TMP/bad.html"
render "$TMP/bad.html" --dump-dom
console_errors | grep -q "no_such_function" || { echo "FAIL: the console check misses a script error: $(cat "$TMP/chrome.log")"; fail=1; }
render "$TMP/r.html" --dump-dom || { echo "FAIL: $CHROME exited $?: $(cat "$TMP/chrome.log")"; fail=1; }
console_errors && { echo "FAIL: console messages while rendering the page"; fail=1; }
n=$(grep -o '<path class="series"' "$TMP/dom" | wc -l)
[ "$n" -eq "$want" ] || { echo "FAIL: the DOM has $n series paths, want $want"; fail=1; }
python3 - "$TMP/dom" <<'PY' || fail=1
import re, sys
dom = open(sys.argv[1]).read()
svgs = re.findall(r'<svg [^>]*data-plot="([^"]*)"[^>]*data-series="(\d+)"[^>]*>(.*?)</svg>', dom, re.S)
bad = [(p, int(n), s.count('class="series"')) for p, n, s in svgs if int(n) != s.count('class="series"')]
if len(svgs) != 7 or bad:
    print("FAIL: rendered plots", [p for p, _, _ in svgs], "declared vs drawn series differ:", bad)
    sys.exit(1)
PY
# As XHTML, an unclosed tag or a stray '&' is a parse error page instead of a silent repair.
cp "$TMP/r.html" "$TMP/r.xhtml"
render "$TMP/r.xhtml" --dump-dom
grep -q parsererror "$TMP/dom" && { echo "FAIL: the page is not well-formed XML: $(head -c 600 "$TMP/dom")"; fail=1; }
[ "$(grep -o 'class="series"' "$TMP/dom" | wc -l)" -eq "$want" ] || { echo "FAIL: series lost as XHTML"; fail=1; }
render "$TMP/r.html" --screenshot="$TMP/r.png"
[ -s "$TMP/r.png" ] || { echo "FAIL: no screenshot: $(cat "$TMP/chrome.log")"; fail=1; }
console_errors && { echo "FAIL: console messages while painting the page"; fail=1; }
[ $fail -eq 0 ] && echo "ok: report ($want series, $("$CHROME" --version 2>/dev/null | grep -o '[0-9][0-9.]*' | head -1 || true)), inputs, torn line, errors, Chromium render"
exit $fail
