#!/usr/bin/env bash
# multirank_gpu.sh — the distributed layer on a machine with one GPU:
#   1. the NCCL path at world size 1: the multi-rank tests on GPU tensors (without a launcher and
#      under `mpirun -np 1`, which bootstraps NCCL over MPI), and a short `train` over nccl;
#   2. 2 and 4 processes sharing the GPU over the mpi backend (GPU tensors staged through host
#      memory): the same tests on GPU tensors;
#   3. `bumblebee paired` on the 4-layer Qwen3-30B-A3B slice (bf16, TOKENS tokens per
#      micro-batch): one process with grad_accum = N against N processes with dp = N for each state
#      family, with the bf16 tolerances of bench/paired_gpu.sh; per-rank peaks are in each log.
# The 4-layer slice holds ~3.1B parameters: replicated state is ~18 bytes per parameter per
# process (56 GB), zero1 ~9 (28 GB), fsdp ~4.5 (14 GB); at 4 processes on one 141 GB GPU only
# fsdp fits next to side A's single process, so the 4-process pairs are fsdp only.
#
#   bench/multirank_gpu.sh BUILD_DIR OUT_DIR [TOKENS=4096] [STEPS=2]
set -u
BUILD=${1:?usage: multirank_gpu.sh BUILD_DIR OUT_DIR [tokens] [steps]}
OUT=${2:?usage: multirank_gpu.sh BUILD_DIR OUT_DIR [tokens] [steps]}
TOKENS=${3:-4096}
STEPS=${4:-2}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_MCA_rmaps_base_oversubscribe=1
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
rows=()
fail=0
step() {  # step <label> <log> <cmd...>
  local label=$1 log="$OUT/$2"; shift 2
  local t0=$SECONDS
  timeout "${PART_TIMEOUT:-300}" "$@" > "$log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && fail=1
  local res
  res=$(grep -aE "^(\x1b\[[0-9;]*m)?\[  PASSED  \]|^PASS|^FAIL|tests? ran" "$log" | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g')
  echo "== $label: rc=$rc $((SECONDS - t0))s ${res}"
  rows+=("| $label | $rc | $((SECONDS - t0)) s | ${res} |")
}
# 1. NCCL, world size 1.
step "test_comm nccl 1 process" comm_nccl_1.log "$BUILD/tests/test_comm" --device=cuda --backend=nccl
step "test_comm nccl mpirun -np 1" comm_nccl_np1.log "${MPI[@]}" -np 1 "$BUILD/tests/test_comm" --device=cuda --backend=nccl
step "test_state nccl 1 process" state_nccl_1.log "$BUILD/tests/test_state" --device=cuda --backend=nccl
# The demo model with a head dim cuDNN attention supports.
sed -e 's/"head_dim": 32/"head_dim": 128/' configs/models/demo-tiny/config.json > /tmp/bb_demo_gpu.json
step "train over nccl (1 rank, fsdp)" train_nccl.log "$BUILD/bumblebee" train --config configs/demo.toml --steps 3 \
  --set 'model.config="/tmp/bb_demo_gpu.json"' --set 'parallel.device="cuda"' --set 'parallel.comm="nccl"' --set 'primitives.state="fsdp"' \
  --set 'checkpoint.dir=""' --set 'log.metrics=""' --set log.every=1
# 2. Processes sharing the GPU over mpi.
for np in 2 4; do
  step "test_comm mpi -np $np" comm_mpi_np$np.log "${MPI[@]}" -np $np "$BUILD/tests/test_comm" --device=cuda --backend=mpi
  step "test_state mpi -np $np" state_mpi_np$np.log "${MPI[@]}" -np $np "$BUILD/tests/test_state" --device=cuda --backend=mpi
done
# 3. paired on the 4-layer slice.
COMMON=(--config configs/demo.toml --steps "$STEPS" --warmup 0
        --set 'model.config="configs/models/qwen3-30b-a3b-4layer/config.json"'
        --set 'parallel.device="cuda"' --set "train.micro_batch_tokens=$TOKENS"
        --set train.warmup_steps=1 --set train.lr=1e-4 --set train.min_lr=1e-5
        --set data.demo_documents=400 --tol-loss 1e-2 --tol-grad-norm 5e-2 --tol-grad 5e-2 --tol-logits 0.25)
for np in 2 4; do
  for st in replicated zero1 fsdp; do
    # One GPU cannot hold 4 replicated processes (4 x 56 GB) or, after side A's 56 GB, 3 more
    # zero1 ones (28 GB each): at 4 processes only fsdp fits (the small-model tests cover the rest).
    [ "$np" = 4 ] && [ "$st" != fsdp ] && continue
    step "paired 1 rank x accum $np vs dp $np $st" "paired_np${np}_$st.log" "${MPI[@]}" -np $np "$BUILD/bumblebee" paired \
      "${COMMON[@]}" --a parallel.dp=1 --a "train.grad_accum=$np" --b "parallel.dp=$np" --b "primitives.state=\"$st\""
    grep -aE "^peak total per rank|^(params|grads|optimizer|comm|total) +\|" "$OUT/paired_np${np}_$st.log" | sed 's/^/      /'
  done
done
echo
echo "multi-rank on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), NCCL $(ls /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -n 1)"
echo "| run | exit | time | result |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
# At most a few files come back from some machines: one archive of the logs.
tar czf "$OUT/../multirank_logs.tgz" -C "$OUT" . && rm -rf "$OUT"
exit $fail
