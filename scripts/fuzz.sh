#!/usr/bin/env bash
# Runs the libFuzzer harnesses (fuzz/fuzz_<name>.cpp) for a while each; docs/reliability.md.
#   scripts/fuzz.sh TARGET SECONDS [extra libFuzzer args...]
#   TARGET: safetensors | hf_config | run_config | jsonl | checkpoint_meta | all
# Configures and builds BUILD_DIR (default build-fuzz: clang, CPU only, ASan + UBSan, fuzzers)
# when it is missing, builds the targets, and runs each on its committed seeds
# (fuzz/corpus/<name>/, only read) plus a work corpus under BUILD_DIR/fuzz-work/<name>/ that
# keeps what earlier runs found. Prints the executions per target; exits non-zero when any
# target found a crash, leak, timeout or out-of-memory (the input is saved under
# BUILD_DIR/fuzz-work/<name>/artifacts/; rerun it with `BUILD_DIR/fuzz/fuzz_<name> FILE`).
# Environment: BUILD_DIR, JOBS (build), FUZZ_TIMEOUT (seconds per input, 10),
# FUZZ_RSS_MB (memory limit, 2048; a single allocation above it is a finding too).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: scripts/fuzz.sh TARGET SECONDS [libFuzzer args...]  (TARGET: all or one of: $*)" >&2; exit 2; }

mapfile -t all_targets < <(for f in fuzz/fuzz_*.cpp; do basename "$f" .cpp | sed 's/^fuzz_//'; done)
[ $# -ge 2 ] || usage "${all_targets[@]}"
target=$1 seconds=$2
shift 2
[[ "$seconds" =~ ^[0-9]+$ ]] || usage "${all_targets[@]}"
if [ "$target" = all ]; then
  targets=("${all_targets[@]}")
else
  [ -f "fuzz/fuzz_${target}.cpp" ] || usage "${all_targets[@]}"
  targets=("$target")
fi

BUILD_DIR=${BUILD_DIR:-build-fuzz}
JOBS=${JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  command -v clang++ >/dev/null || { echo "[fuzz] needs clang with libFuzzer: apt-get install clang libclang-rt-dev" >&2; exit 1; }
  echo "[fuzz] configuring $BUILD_DIR (clang, CPU only, ASan + UBSan, fuzzers)"
  CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DBUMBLEBEE_CUDA=OFF -DBUMBLEBEE_FUZZ=ON -DBUMBLEBEE_TESTS=OFF >/dev/null
elif ! grep -q '^BUMBLEBEE_FUZZ:BOOL=ON' "$BUILD_DIR/CMakeCache.txt"; then
  echo "[fuzz] $BUILD_DIR is not a fuzzing build (configure it with CC=clang CXX=clang++ -DBUMBLEBEE_CUDA=OFF -DBUMBLEBEE_FUZZ=ON, or pick another BUILD_DIR)" >&2
  exit 1
fi
echo "[fuzz] building ${targets[*]} in $BUILD_DIR"
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]/#/fuzz_}"

failed=()
summary=()
for t in "${targets[@]}"; do
  work="$BUILD_DIR/fuzz-work/$t"
  mkdir -p "$work/corpus" "$work/artifacts"
  log="$work/last.log"
  echo "[fuzz] $t for ${seconds}s (log $log)"
  rc=0
  # New inputs go to the first corpus directory only: the committed seeds are read, not grown.
  "$BUILD_DIR/fuzz/fuzz_$t" "$work/corpus" "fuzz/corpus/$t" -max_total_time="$seconds" \
    -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb="${FUZZ_RSS_MB:-2048}" -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/" "$@" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  inputs=$(find "$work/corpus" -type f | wc -l)
  line="$t: ${execs:-?} executions (${rate:-?}/s), work corpus ${inputs} inputs"
  if [ "$rc" -ne 0 ]; then
    line+=", FAILED (rc $rc)"
    failed+=("$t")
    echo "---- $t: the report (whole log: $log)"
    # From the first line of the report (a harness message, a sanitizer error, libFuzzer's own
    # deadly-signal / timeout / out-of-memory / leak line) on, without the shadow-byte table.
    awk '/==FUZZ==|ERROR: |runtime error:|deadly signal|ALARM: |out-of-memory|detected memory leaks/ {f = 1}
         /Shadow bytes around/ {f = 0}
         f && n < 60 {print; n++}' "$log"
    grep -E "Test unit written|^Base64" "$log" | tail -n 2 || true
    echo "---- reproduce: $BUILD_DIR/fuzz/fuzz_$t <that file>"
  fi
  summary+=("$line")
  echo "[fuzz] $line"
done
echo
echo "fuzz summary (${seconds}s per target):"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "[fuzz] findings in: ${failed[*]}" >&2
  exit 1
fi
