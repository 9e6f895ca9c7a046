#!/usr/bin/env bash
# emulated.sh — one rank of the multi-GPU jobs of issue 38, on one GPU, with emulated
# communication (parallel.comm = "emulated": real compute, memory and streams, modelled wire;
# skills/emulated-comm.md). Every table it prints is labelled EMULATED with the link model.
# The same cases run for real, one process per GPU over NCCL, with bench/multigpu.sh (parts moe,
# full) on a machine that has the GPUs.
#
#   bench/emulated.sh BUILD OUT PART...     BUILD: a CUDA build directory (build-dev)
#
#   n1      the N = 1 check: the 4-layer Qwen3-30B-A3B slice at 8K and 32K tokens, the plain
#           single-rank step against an emulated job of one rank (bench_train_step, alternating
#           A B A B); goal: within 3 %
#   moe     the seed's MoE-layer proxy: one Qwen3.5-35B-A3B MoE layer, EP 8 in one node, 4K-64K
#           tokens per rank, alltoall vs chunked_alltoall:2/3/4, with the timeline's hidden share
#             bench_moe_layer --emulate 8 --shape qwen3.5 --timeline OUT/moe
#   qwen3   one rank of the full Qwen3-30B-A3B (48 layers) on 8 GPUs with the recipe (fsdp, full
#           recompute, linear_ce, chunked_alltoall:2, EP 8, cp_ring): 4K x 8 sequences (cp 1),
#           32K (cp 2), 128K (cp 4); the same with the wire at zero time (the compute-only
#           step: what the rank would do with free communication); a timeline of each
#   qwen35  one rank of Qwen3.5-35B-A3B (40 layers) on 32 GPUs (4 nodes of 8) with the seed's
#           recipe (EP 8, CP 4, fsdp, full recompute, linear_ce, chunk2) at 128K; the wire at
#           zero time; the same under an 80 GB H100's memory (emulate.device_memory_gib = 79.6)
#   slowed  the slowed-communication tests (test_emulated_gpu): every overlapped path
#           bit-identical with the wire 500 x slower
#   all     the five in this order
#
# Environment: STEPS (3 timed steps after 1 warm-up), MAX_LAYERS_AHEAD (backend.max_layers_ahead of
# the full-model runs, 2 as in the recipe; 0 = no limit), PERMUTE (memory_efficient as in the
# recipe; standard re-runs fc2 and the combine in the recompute), EXPERT_WGRAD_STREAM
# (backend.expert_wgrad_stream, false), QWEN3_RUNS ("4096:1 32768:2 131072:4",
# tokens:cp), CAP_GIB (the pool's cap for the full-model runs, 120: with
# backend.pool_cross_stream_reuse the pool reuses side-stream memory only where it cannot grow;
# uncapped it fills the card and fails, bench/results/2026-12-05-h200-emulated.md sec. 3.1),
# MOE_TOKENS (4096,8192,16384,32768,65536), PART_TIMEOUT (seconds per command,
# default 900). NCCL_NVLS_ENABLE=0 always (no NCCL communicator is made here).
set -u
BUILD=${1:?usage: emulated.sh BUILD OUT PART... (n1 moe qwen3 qwen35 slowed all)}
OUT=${2:?usage: emulated.sh BUILD OUT PART...}
shift 2
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && { echo "name at least one part: n1 moe qwen3 qwen35 slowed all"; exit 2; }
case " ${PARTS[*]} " in *" all "*) PARTS=(n1 moe qwen3 qwen35 slowed) ;; esac
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
STEPS=${STEPS:-3}
BTS="$BUILD/bench/bench_train_step"
EMU8=(--set 'parallel.comm="emulated"' --set emulate.ranks=8)
EMU32=(--set 'parallel.comm="emulated"' --set emulate.ranks=32)
# The recipe of configs/qwen3-30b-a3b-8gpu.toml (bench_train_step adds linear_ce, full recompute
# and grouped experts itself).
RECIPE=(--set 'primitives.state="fsdp"' --set 'primitives.moe_dispatch="chunked_alltoall:2"'
        --set 'primitives.attention="cp_ring"' --set "primitives.permute=\"${PERMUTE:-memory_efficient}\"" --set parallel.ep=8
        --set backend.max_layers_ahead="${MAX_LAYERS_AHEAD:-2}" --set backend.expert_wgrad_stream="${EXPERT_WGRAD_STREAM:-false}"
        --set backend.pool_cross_stream_reuse=true --set emulate.device_memory_gib="${CAP_GIB:-120}"
        --set 'train.memory_check="warn"')
rows=()
fail=0
step() {  # step <label> <log> <cmd...>
  local label=$1 log="$OUT/$2"; shift 2
  local t0=$SECONDS
  echo "### $label: $*" >> "$log"
  timeout "${PART_TIMEOUT:-900}" "$@" >> "$log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && fail=1
  echo "== $label: rc=$rc $((SECONDS - t0))s"
  rows+=("| $label | $rc | $((SECONDS - t0)) s | $2 |")
}

for part in "${PARTS[@]}"; do
  case $part in
    n1)
      for i in 1 2; do
        step "n1 plain ($i)" n1.log "$BTS" --seq 8192,32768 --steps "$STEPS" --warmup 1
        step "n1 emulated N=1 ($i)" n1.log "$BTS" --seq 8192,32768 --steps "$STEPS" --warmup 1 \
          --set 'parallel.comm="emulated"' --set emulate.ranks=1
      done ;;
    moe)
      step "moe proxy qwen3.5 EP 8" moe.log "$BUILD/bench/bench_moe_layer" --emulate 8 --shape qwen3.5 \
        --tokens "${MOE_TOKENS:-4096,8192,16384,32768,65536}" --chunks 2,3,4 --steps 5 --warmup 2 \
        --timeline "$OUT/moe" ;;
    qwen3)
      for r in ${QWEN3_RUNS:-4096:1 32768:2 131072:4}; do
        S=${r%%:*} cp=${r##*:}
        step "qwen3-30b-a3b 8 GPUs, $S tokens, cp $cp" qwen3.log "$BTS" \
          --config configs/models/qwen3-30b-a3b/config.json --seq "$S" --steps "$STEPS" --warmup 1 \
          "${EMU8[@]}" "${RECIPE[@]}" --set "parallel.cp=$cp" --timeline "$OUT/qwen3"
        step "qwen3-30b-a3b 8 GPUs, $S tokens, cp $cp, wire x0" qwen3.log "$BTS" \
          --config configs/models/qwen3-30b-a3b/config.json --seq "$S" --steps "$STEPS" --warmup 1 \
          "${EMU8[@]}" "${RECIPE[@]}" --set "parallel.cp=$cp" --set emulate.wire_scale=0
      done ;;
    qwen35)
      step "qwen3.5-35b-a3b 32 GPUs, 128K, cp 4" qwen35.log "$BTS" \
        --config configs/models/qwen3.5-35b-a3b/config.json --seq 131072 --steps "$STEPS" --warmup 1 \
        "${EMU32[@]}" "${RECIPE[@]}" --set parallel.cp=4 --timeline "$OUT/qwen35"
      step "qwen3.5-35b-a3b 32 GPUs, 128K, cp 4, wire x0" qwen35.log "$BTS" \
        --config configs/models/qwen3.5-35b-a3b/config.json --seq 131072 --steps "$STEPS" --warmup 1 \
        "${EMU32[@]}" "${RECIPE[@]}" --set parallel.cp=4 --set emulate.wire_scale=0
      step "qwen3.5-35b-a3b 32 GPUs, 128K, cp 4, H100 80 GB" qwen35.log "$BTS" \
        --config configs/models/qwen3.5-35b-a3b/config.json --seq 131072 --steps 1 --warmup 1 \
        "${EMU32[@]}" "${RECIPE[@]}" --set parallel.cp=4 --set emulate.device_memory_gib=79.6 ;;
    slowed)
      step "slowed communication (test_emulated_gpu)" slowed.log "$BUILD/tests/test_emulated_gpu" ;;
    *) echo "unknown part $part (n1 moe qwen3 qwen35 slowed all)"; exit 2 ;;
  esac
done

{
  echo "## emulated.sh on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) ($(date -u +%F)): EMULATED"
  echo
  echo "| run | exit | time | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  for log in "$OUT"/*.log; do
    [ -e "$log" ] || continue
    echo
    echo "### $(basename "$log")"
    grep -aE '^EMULATED|^\| |^ *[0-9]+ \| |failed|^(communication|EMULATED communication)|^  tokens|modelled|^\[  (PASSED|FAILED) ' "$log"
  done
} | tee "$OUT/summary.md"
echo "overall: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
