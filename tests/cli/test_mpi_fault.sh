#!/usr/bin/env bash
# A rank that dies (SIGKILL) or hangs (SIGSTOP) mid-run ends the whole 4-rank job: mpirun exits
# non-zero within 60 s of the fault, and the output names the operation the others were in and
# the rank.
set -u
BB=${1:?usage: test_mpi_fault.sh bumblebee-binary}
command -v mpirun > /dev/null || { echo "FAIL: mpirun not found"; exit 1; }
source "$(dirname "$0")/tiny_model.sh"  # $TMP, cleanup at exit, $TMP/config.json
ARGS=(train --config configs/demo.toml --set "model.config=\"$TMP/config.json\"" --set train.steps=100000
      --set train.micro_batch_tokens=256 --set data.demo_documents=50 --set 'checkpoint.dir=""'
      --set 'log.metrics=""' --set log.every=1 --set primitives.state='"fsdp"')
fail=0

run_case() {  # mode (kill | stop), timeout_s
  local mode=$1 out="$TMP/$1.txt"
  mpirun --allow-run-as-root --oversubscribe -np 4 "$BB" "${ARGS[@]}" --set "parallel.timeout_s=$2" > "$out" 2>&1 &
  local mp=$!
  for _ in $(seq 1 1200); do grep -q "step      3 |" "$out" && break; sleep 0.1; done
  grep -q "step      3 |" "$out" || { echo "FAIL($mode): the run did not reach step 3"; cat "$out"; fail=1; kill -9 $mp; return; }
  local victim=""
  for p in $(pgrep -f -- "$TMP/config.json"); do
    tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=2" && victim=$p
  done
  [ -n "$victim" ] || { echo "FAIL($mode): rank 2 not found"; fail=1; kill -9 $mp; return; }
  local t0=$(date +%s)
  if [ "$mode" = kill ]; then kill -KILL "$victim"; else kill -STOP "$victim"; fi
  # The job must end by itself; the watchdog only guards the test.
  ( sleep 120; kill -KILL $mp 2> /dev/null ) > /dev/null 2>&1 &
  local dog=$!
  wait $mp
  local rc=$? t1=$(date +%s)
  kill $dog 2> /dev/null
  echo "$mode: mpirun exited $rc after $((t1 - t0)) s"
  [ $rc -ne 0 ] || { echo "FAIL($mode): mpirun exited 0"; fail=1; }
  [ $((t1 - t0)) -lt 60 ] || { echo "FAIL($mode): the job took $((t1 - t0)) s to end"; fail=1; }
  for want in "${@:3}"; do
    grep -qE "$want" "$out" || { echo "FAIL($mode): output lacks /$want/"; tail -20 "$out"; fail=1; }
  done
}

# A dead rank: the launcher ends the job; the survivors say which operation they were in.
run_case kill 50 "rank 2" "\[rank [013]\] received SIGTERM while in [a-z_]+ on group"
# A hung rank: the survivors' collective times out, names itself, and aborts the job.
run_case stop 15 "communication timeout: [a-z_]+ on group '[a-z]+' \(4 ranks, operation #[0-9]+\) did not finish within 15 s"
[ $fail -eq 0 ] && echo "ok: a killed or hung rank ends the job within 60 s with a message naming the operation"
exit $fail
