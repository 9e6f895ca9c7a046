#!/usr/bin/env bash
# `mpirun -np 2 bumblebee ...` end to end: one log line per step from rank 0 (every rank's with
# --log-all-ranks), the metrics file, a distributed checkpoint resumed on one process, export,
# paired across layouts, and an impossible layout refused before anything runs; expert and
# context parallelism.
set -u
BB=${1:?usage: test_mpi_train.sh bumblebee-binary}
command -v mpirun > /dev/null || { echo "FAIL: mpirun not found"; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1
MPI=(mpirun --allow-run-as-root --oversubscribe -np 2)
sed -e 's/"hidden_size": 128/"hidden_size": 64/' -e 's/"num_hidden_layers": 4/"num_hidden_layers": 2/' \
  configs/models/demo-tiny/config.json > "$TMP/config.json"
ARGS=(--config configs/demo.toml --set "model.config=\"$TMP/config.json\"" --set train.micro_batch_tokens=256
      --set data.demo_documents=50 --set "checkpoint.dir=\"$TMP/ckpt\"" --set checkpoint.every=4
      --set "log.metrics=\"$TMP/metrics.jsonl\"" --set log.every=1 --set primitives.state='"zero1"')
fail=0
"${MPI[@]}" "$BB" train "${ARGS[@]}" --steps 4 > "$TMP/a.txt" 2>&1 || { echo "FAIL: train exited $?"; cat "$TMP/a.txt"; fail=1; }
[ "$(grep -c "^step      4 | loss" "$TMP/a.txt")" -eq 1 ] || { echo "FAIL: expected one step-4 line (rank 0)"; cat "$TMP/a.txt"; fail=1; }
grep -q "parallel: 2 rank(s) over mpi (launcher mpirun), layout dp=2" "$TMP/a.txt" || { echo "FAIL: no parallel line"; fail=1; }
[ "$(wc -l < "$TMP/metrics.jsonl")" -eq 4 ] || { echo "FAIL: metrics.jsonl should have 4 lines"; fail=1; }
for r in 00000 00001; do
  [ -f "$TMP/ckpt/step_00000004/shards/rank_$r.safetensors" ] || { echo "FAIL: no shard of rank $r"; fail=1; }
done
[ "$(cat "$TMP/ckpt/latest")" = "step_00000004" ] || { echo "FAIL: latest"; fail=1; }
"${MPI[@]}" "$BB" train "${ARGS[@]}" --steps 1 --log-all-ranks --set 'checkpoint.dir=""' > "$TMP/b.txt" 2>&1 || { echo "FAIL: --log-all-ranks run"; fail=1; }
grep -q "^\[rank 1\] step      1 | loss" "$TMP/b.txt" || { echo "FAIL: --log-all-ranks shows no rank-1 line"; cat "$TMP/b.txt"; fail=1; }
# The 2-rank checkpoint continues on one process (dp 1 x grad_accum 2: the same global batch).
"$BB" train "${ARGS[@]}" --steps 5 --set train.grad_accum=2 --set 'checkpoint.resume="auto"' --set 'log.metrics=""' > "$TMP/c.txt" 2>&1 \
  || { echo "FAIL: 1-process resume exited $?"; cat "$TMP/c.txt"; fail=1; }
grep -q "resumed from .*step_00000004 at step 4" "$TMP/c.txt" && grep -q "^step      5 | loss" "$TMP/c.txt" || { echo "FAIL: resume on 1 rank"; cat "$TMP/c.txt"; fail=1; }
"$BB" export --checkpoint "$TMP/ckpt/step_00000004" --out "$TMP/hf" > "$TMP/d.txt" 2>&1 && [ -f "$TMP/hf/model.safetensors" ] || { echo "FAIL: export"; cat "$TMP/d.txt"; fail=1; }
"${MPI[@]}" "$BB" paired "${ARGS[@]}" --steps 2 --a parallel.dp=1 --a train.grad_accum=2 --b parallel.dp=2 \
  --b 'primitives.state="fsdp"' --tol-loss 1e-5 --tol-grad 1e-5 > "$TMP/e.txt" 2>&1 || { echo "FAIL: paired across layouts exited $?"; cat "$TMP/e.txt"; fail=1; }
grep -q "^PASS" "$TMP/e.txt" && grep -q "peak total per rank, B:" "$TMP/e.txt" || { echo "FAIL: paired output"; cat "$TMP/e.txt"; fail=1; }
"${MPI[@]}" "$BB" train "${ARGS[@]}" --steps 1 --set parallel.dp=3 > "$TMP/f.txt" 2>&1
[ $? -ne 0 ] && grep -q "dp x cp x pp = 3 but 2 rank(s) were launched" "$TMP/f.txt" || { echo "FAIL: bad layout not refused"; cat "$TMP/f.txt"; fail=1; }
# srun: the SLURM environment is read (here one task, MPI's singleton start); a launcher whose
# tasks MPI cannot see is refused instead of training independent copies.
SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=1 "$BB" train "${ARGS[@]}" --steps 1 --set 'checkpoint.dir=""' > "$TMP/g.txt" 2>&1 \
  && grep -q "launcher srun" "$TMP/g.txt" || { echo "FAIL: srun environment"; cat "$TMP/g.txt"; fail=1; }
SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=2 "$BB" train "${ARGS[@]}" --steps 1 --set 'checkpoint.dir=""' > "$TMP/h.txt" 2>&1
[ $? -ne 0 ] && grep -q "started 2 processes but MPI sees a world of 1" "$TMP/h.txt" || { echo "FAIL: srun without PMI not refused"; cat "$TMP/h.txt"; fail=1; }
# Expert parallelism (ep 2 over both ranks, chunked all-to-all): the step log reports the expert
# rows each rank received; its checkpoint resumes on one process; paired against the
# single-rank run, every gradient (the experts' gathered from both ranks) agrees.
EP=(--set parallel.ep=2 --set 'primitives.moe_dispatch="chunked_alltoall:2"')
"${MPI[@]}" "$BB" train "${ARGS[@]}" "${EP[@]}" --steps 2 --set "checkpoint.dir=\"$TMP/ckpt_ep\"" --set 'log.metrics=""' > "$TMP/i.txt" 2>&1 \
  || { echo "FAIL: ep train exited $?"; cat "$TMP/i.txt"; fail=1; }
grep -q "layout dp=2 cp=1 ep=2" "$TMP/i.txt" && grep -q "expert rows per rank: max .* mean .* (skew " "$TMP/i.txt" \
  || { echo "FAIL: ep run log (layout, expert rows per rank)"; cat "$TMP/i.txt"; fail=1; }
"$BB" train "${ARGS[@]}" --steps 3 --set train.grad_accum=2 --set "checkpoint.dir=\"$TMP/ckpt_ep\"" --set 'checkpoint.resume="auto"' \
  --set 'log.metrics=""' > "$TMP/j.txt" 2>&1 && grep -q "resumed from .*step_00000002 at step 2" "$TMP/j.txt" && grep -q "^step      3 | loss" "$TMP/j.txt" \
  || { echo "FAIL: ep checkpoint resumed on 1 rank"; cat "$TMP/j.txt"; fail=1; }
"${MPI[@]}" "$BB" paired "${ARGS[@]}" --steps 2 --a parallel.dp=1 --a train.grad_accum=2 --b parallel.ep=2 \
  --b 'primitives.moe_dispatch="chunked_alltoall:2"' --tol-loss 1e-5 --tol-grad 1e-5 > "$TMP/k.txt" 2>&1 && grep -q "^PASS" "$TMP/k.txt" \
  || { echo "FAIL: paired ep 2 vs one rank"; cat "$TMP/k.txt"; fail=1; }
"${MPI[@]}" "$BB" train "${ARGS[@]}" --steps 1 --set parallel.ep=3 > "$TMP/l.txt" 2>&1
[ $? -ne 0 ] && grep -q "parallel.ep = 3 does not divide the model's 8 routed experts" "$TMP/l.txt" || { echo "FAIL: bad ep not refused"; cat "$TMP/l.txt"; fail=1; }
# Context parallelism (cp 2: every sequence over both ranks): the checkpoint resumes on one
# process; paired against the single-rank run (logits gathered from both shards, every gradient);
# sdpa under cp 2 is refused naming the members to use.
CP=(--set parallel.cp=2 --set 'primitives.attention="cp_ring"')
"${MPI[@]}" "$BB" train "${ARGS[@]}" "${CP[@]}" --steps 2 --set "checkpoint.dir=\"$TMP/ckpt_cp\"" --set 'log.metrics=""' > "$TMP/m.txt" 2>&1 \
  && grep -q "layout dp=1 cp=2 ep=1" "$TMP/m.txt" || { echo "FAIL: cp train"; cat "$TMP/m.txt"; fail=1; }
"$BB" train "${ARGS[@]}" --steps 3 --set "checkpoint.dir=\"$TMP/ckpt_cp\"" --set 'checkpoint.resume="auto"' --set 'log.metrics=""' > "$TMP/n.txt" 2>&1 \
  && grep -q "resumed from .*step_00000002 at step 2" "$TMP/n.txt" && grep -q "^step      3 | loss" "$TMP/n.txt" \
  || { echo "FAIL: cp checkpoint resumed on 1 rank"; cat "$TMP/n.txt"; fail=1; }
for attn in cp_ring cp_a2a; do
  "${MPI[@]}" "$BB" paired "${ARGS[@]}" --steps 2 --a parallel.dp=1 --b parallel.cp=2 --b "primitives.attention=\"$attn\"" \
    --tol-loss 1e-5 --tol-grad 1e-5 > "$TMP/o.txt" 2>&1 && grep -q "^PASS" "$TMP/o.txt" \
    || { echo "FAIL: paired cp 2 ($attn) vs one rank"; cat "$TMP/o.txt"; fail=1; }
done
"${MPI[@]}" "$BB" train "${ARGS[@]}" --steps 1 --set parallel.cp=2 > "$TMP/p.txt" 2>&1
[ $? -ne 0 ] && grep -q 'set primitives.attention = "cp_ring"' "$TMP/p.txt" || { echo "FAIL: sdpa under cp 2 not refused"; cat "$TMP/p.txt"; fail=1; }
[ $fail -eq 0 ] && echo "ok: mpirun train, logs, metrics, distributed checkpoint, resume on 1 rank, export, paired, bad layout, srun, expert parallelism, context parallelism"
exit $fail
