#!/usr/bin/env bash
# SIGTERM / SIGINT on `train`: the run stops after its current step, saves that step's checkpoint
# and exits 128 + signal; a second signal stops at once and the last checkpoint stays whole; the
# run resumes from the saved step. Under mpirun, a signal to every rank (as srun delivers
# SLURM's pre-kill SIGTERM) stops them all after the same step with one checkpoint.
set -u
BB=${1:?usage: test_signals.sh bumblebee-binary}
source "$(dirname "$0")/tiny_model.sh"  # $TMP, cleanup at exit, $TMP/config.json
ARGS=(train --config configs/demo.toml --set "model.config=\"$TMP/config.json\"" --set train.steps=100000
      --set train.micro_batch_tokens=256 --set data.demo_documents=50 --set log.every=1
      --set 'log.metrics=""' --set checkpoint.every=2 --set checkpoint.keep=0)
fail=0

wait_for() {  # wait_for <file> <pattern>: up to 60 s
  for _ in $(seq 1 600); do grep -q "$2" "$1" && return 0; sleep 0.1; done
  return 1
}

# 1. One signal: stop after the step, save it, exit 143, resume from it.
out="$TMP/one.txt"
"$BB" "${ARGS[@]}" --set "checkpoint.dir=\"$TMP/ck1\"" > "$out" 2>&1 &
pid=$!
wait_for "$out" "step      3 |" || { echo "FAIL(one): no step 3"; cat "$out"; fail=1; }
kill -TERM $pid
wait $pid
rc=$?
step=$(sed -n 's/.*\[stopped\] by signal 15 after step \([0-9]*\).*/\1/p' "$out")
if [ $rc -ne 143 ] || [ -z "$step" ]; then
  echo "FAIL(one): exit $rc (expected 143) or no [stopped] line"; tail -5 "$out"; fail=1
else
  name=$(printf 'step_%08d' "$step")
  [ "$(cat "$TMP/ck1/latest" 2> /dev/null)" = "$name" ] || { echo "FAIL(one): latest is not $name"; fail=1; }
  grep -q "received SIGTERM" "$out" || { echo "FAIL(one): no line about the signal"; fail=1; }
  "$BB" "${ARGS[@]}" --set "checkpoint.dir=\"$TMP/ck1\"" --set "train.steps=$((step + 2))" > "$TMP/resume.txt" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || ! grep -q "resumed from .*$name at step $step" "$TMP/resume.txt"; then
    echo "FAIL(one): the resume from step $step: exit $rc"; tail -5 "$TMP/resume.txt"; fail=1
  else
    echo "ok: SIGTERM after step $step: checkpoint $name, exit 143, resumed from it"
  fi
fi

# 2. Two signals: the process ends at once; the checkpoint `latest` names is complete.
out="$TMP/two.txt"
"$BB" "${ARGS[@]}" --set "checkpoint.dir=\"$TMP/ck2\"" > "$out" 2>&1 &
pid=$!
wait_for "$out" "step      5 |" || { echo "FAIL(two): no step 5"; cat "$out"; fail=1; }
# Both delivered at once (two signals of one kind would merge while pending): the process is
# stopped, gets SIGINT then SIGTERM, and continues.
kill -STOP $pid
kill -INT $pid
kill -TERM $pid
kill -CONT $pid
wait $pid
rc=$?
latest=$(cat "$TMP/ck2/latest" 2> /dev/null)
if [ $rc -ne 143 ] || ! grep -q "a second signal, stopping now" "$out" || grep -q "\[stopped\]" "$out" ||
   [ -z "$latest" ] || [ ! -f "$TMP/ck2/$latest/state.json" ] ||
   [ ! -f "$TMP/ck2/$latest/shards/rank_00000.safetensors" ]; then
  echo "FAIL(two): exit $rc (expected 143), latest '$latest'"; tail -5 "$out"; fail=1
else
  echo "ok: a second signal: exit 143 at once, latest ($latest) complete"
fi

# 3. Under mpirun: every rank signalled (as srun does), all stop after the same step, one checkpoint.
if command -v mpirun > /dev/null; then
  out="$TMP/mpi.txt"
  mpirun --allow-run-as-root --oversubscribe -np 2 "$BB" "${ARGS[@]}" --set "checkpoint.dir=\"$TMP/ck3\"" \
    --set primitives.state='"fsdp"' > "$out" 2>&1 &
  mp=$!
  wait_for "$out" "step      3 |" || { echo "FAIL(mpi): no step 3"; cat "$out"; fail=1; }
  for p in $(pgrep -f -- "$TMP/ck3"); do
    tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -q "^OMPI_COMM_WORLD_RANK=" && kill -TERM "$p"
  done
  ( sleep 120; kill -KILL $mp 2> /dev/null ) > /dev/null 2>&1 &
  dog=$!
  wait $mp
  rc=$?
  kill $dog 2> /dev/null
  step=$(sed -n 's/.*\[stopped\] by signal 15 after step \([0-9]*\).*/\1/p' "$out" | head -n 1)
  name=$(printf 'step_%08d' "${step:-0}")
  if [ $rc -eq 0 ] || [ -z "$step" ] || [ "$(cat "$TMP/ck3/latest" 2> /dev/null)" != "$name" ] ||
     [ ! -f "$TMP/ck3/$name/shards/rank_00001.safetensors" ]; then
    echo "FAIL(mpi): exit $rc, stopped after '$step', latest '$(cat "$TMP/ck3/latest" 2> /dev/null)'"; tail -8 "$out"; fail=1
  else
    echo "ok: SIGTERM to both ranks: both stopped after step $step with one checkpoint, mpirun exit $rc"
  fi
fi
exit $fail
