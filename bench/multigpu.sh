#!/usr/bin/env bash
# multigpu.sh — the multi-GPU measurements of issue 15 (skills/multigpu-bench.md), one command
# per part, one process per GPU over NCCL, logs under OUT and a pass/fail + table summary at the
# end (also written to OUT/summary.md; the logs are packed into OUT.tgz beside OUT).
#
#   bench/multigpu.sh BUILD OUT PART...     BUILD: a CUDA build directory (build-dev)
#
#   comm      bench_comm at 2 / 4 / 8 GPUs (those present): all_gather, reduce_scatter,
#             all_reduce, all_to_all through the comm layer, 1 MiB - 1 GiB, busbw vs the goal
#               mpirun -np N BUILD/bench/bench_comm --device cuda
#             (and NCCL's own all_reduce_perf etc. where NCCL_TESTS names their directory)
#   layouts   the 4-layer Qwen3-30B-A3B slice, 20 steps, `bumblebee paired` of one GPU
#             (grad_accum = dp of B, so the global batch is the same) against DP / EP / CP
#             (cp_ring, cp_a2a) / folded layouts on 2-8 GPUs, bf16 tolerances
#               mpirun -np N BUILD/bumblebee paired --a parallel.dp=1 --a train.grad_accum=G --b LAYOUT
#   fsdp      zero1 (A) vs fsdp (B) at dp = ep = N, 32K tokens per rank: peak memory per category
#             (max over ranks) and per rank, tokens/s per GPU, the closed forms of DESIGN sec. 5
#               mpirun -np N BUILD/bumblebee paired --a primitives.state=zero1 --b primitives.state=fsdp
#   moe       bench_moe_layer, EP = N GPUs, Qwen3 shape, 16K / 32K / 64K tokens per GPU,
#             alltoall vs chunked_alltoall:2/3/4 (dispatch / experts / combine split, hidden %)
#               mpirun -np N BUILD/bench/bench_moe_layer --device cuda --shape qwen3
#   full      the full 48-layer Qwen3-30B-A3B on 8 GPUs, configs/qwen3-30b-a3b-8gpu.toml (fsdp,
#             full recompute, linear_ce, chunked_alltoall:2, EP 8): 4K x 8 sequences (cp 1),
#             32K (cp 2), 128K (cp 4), on single-document micro-batches; tokens/s, model
#             TFLOP/s and peak memory per category per GPU
#               mpirun -np 8 BUILD/bumblebee train --config configs/qwen3-30b-a3b-8gpu.toml ...
#   scaling   tokens/s per GPU at 1, 2, 4, 8 GPUs, 16K tokens per GPU (dp = ep = N, fsdp)
#               mpirun -np N BUILD/bumblebee train --config configs/qwen3-30b-a3b-4layer-gpu.toml ...
#   torch     bench/hf_train_step.py --fsdp under torchrun (FSDP2 fully_shard per decoder
#             layer + root, no EP) on the slice at the scaling part's tokens per GPU, and on the
#             full model at 4K tokens per GPU when 8 GPUs are present
#               python3 -m torch.distributed.run --nproc_per_node N bench/hf_train_step.py --fsdp ...
#   all       the seven above in this order
#   dryrun    each part shrunk (2 processes sharing GPU 0 over the staged mpi backend, tiny
#             sizes, the demo model with head_dim 128 as bench/multirank_gpu.sh uses, 2 steps;
#             torch: 1 process, since NCCL refuses two ranks on one GPU): exercises the whole
#             script on one GPU. DRY_DEVICE=cpu runs it on CPU ranks (no GPU; torch skipped).
#
# Environment: GPUS (default: `nvidia-smi -L | wc -l`), PART_TIMEOUT (seconds per command,
# overrides every part's default), LAYOUT_STEPS (20), LAYOUT_TOKENS (8192), FSDP_NP (GPUS),
# FSDP_TOKENS (32768), FSDP_MODEL (the slice; the full config fits zero1 on 8 GPUs), FULL_RUNS
# ("4096:1 32768:2 131072:4", tokens:cp), FULL_STEPS (8), SCALE_TOKENS (16384), SCALE_STEPS
# (10), NCCL_TESTS (directory of nccl-tests binaries, optional). NCCL_NVLS_ENABLE=0 always.
# Each part takes up to about 10 minutes: run one part per command where jobs have a time limit
# (`dryrun` runs every part shrunk in about a minute).
set -u
BUILD=${1:?usage: multigpu.sh BUILD OUT PART... (comm layouts fsdp moe full scaling torch all dryrun)}
OUT=${2:?usage: multigpu.sh BUILD OUT PART...}
shift 2
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && { echo "name at least one part: comm layouts fsdp moe full scaling torch all dryrun"; exit 2; }
ALL=(comm layouts fsdp moe full scaling torch)
DRY=0
case " ${PARTS[*]} " in
  *" dryrun "*) DRY=1; PARTS=("${ALL[@]}") ;;
  *" all "*) PARTS=("${ALL[@]}") ;;
esac
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_MCA_rmaps_base_oversubscribe=1
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
BB="$BUILD/bumblebee"
DEV=cuda
SLICE=configs/models/qwen3-30b-a3b-4layer/config.json
FULL_MODEL=configs/models/qwen3-30b-a3b/config.json
# bf16 tolerances of DESIGN sec. 10 as bench/paired_gpu.sh and bench/multirank_gpu.sh use them.
TOLS=(--tol-loss 1e-2 --tol-grad-norm 5e-2 --tol-grad 5e-2 --tol-logits 0.25)
if [ $DRY = 1 ]; then
  DEV=${DRY_DEVICE:-cuda}
  # Two processes on one GPU: auto picks the staged mpi backend (local processes > GPUs).
  [ "$DEV" = cuda ] && export CUDA_VISIBLE_DEVICES=0
  GPUS=1
  NPS=(2)
  # The demo model with a head dim cuDNN attention supports (on the CPU: as it is).
  DEMO=$OUT/demo_gpu.json
  if [ "$DEV" = cuda ]; then
    sed -e 's/"head_dim": 32/"head_dim": 128/' configs/models/demo-tiny/config.json > "$DEMO"
  else
    cp configs/models/demo-tiny/config.json "$DEMO"
  fi
  SLICE=$DEMO
  FULL_MODEL=$DEMO
else
  GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  NPS=()
  for n in 2 4 8; do [ "$n" -le "$GPUS" ] && NPS+=("$n"); done
fi
NPMAX=1
[ ${#NPS[@]} -gt 0 ] && NPMAX=${NPS[${#NPS[@]}-1]}
[ ${#NPS[@]} -eq 0 ] && echo "note: $GPUS GPU(s) visible; the multi-GPU runs need at least 2 (try: dryrun)"

rows=()     # | part | run | exit | time | result |
tables=()   # per-part result tables, printed after the run list
fail=0
step() {  # step <part> <label> <log> <timeout> <cmd...>
  local part=$1 label=$2 log="$OUT/$3" to=$4; shift 4
  local t0=$SECONDS
  echo "### $label: $*" >> "$log"
  timeout "${PART_TIMEOUT:-$to}" "$@" >> "$log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && fail=1
  local res
  res=$(grep -aE "^PASS|^FAIL|^bench_comm: |^\[done\]|failed" "$log" | tail -n 1 | cut -c1-110)
  [ -z "$res" ] && [ $rc -eq 0 ] && res=ok
  [ $rc -eq 124 ] && res="timeout after ${PART_TIMEOUT:-$to} s"
  echo "== $part / $label: rc=$rc $((SECONDS - t0))s ${res}"
  rows+=("| $part | $label | $rc | $((SECONDS - t0)) s | ${res} |")
  return $rc
}
skip() { rows+=("| $1 | $2 | - | - | skipped: $3 |"); echo "== $1 / $2: skipped ($3)"; }

# Median tokens/s per GPU, model TFLOP/s per GPU and the largest peak per category (GiB, max
# over ranks and steps) of a log.metrics file, steps after the first SKIP.
metrics_row() {  # metrics_row <jsonl> <skip> -> "tok/s/GPU | TFLOP/s/GPU | peaks"
  [ -s "$1" ] || { echo "no metrics | | "; return; }
  awk -v skip="$2" '
    function num(key,   m) { if (match($0, "\"" key "\":[-0-9.eE+]+")) return substr($0, RSTART + length(key) + 3, RLENGTH - length(key) - 3) + 0; return 0 }
    function med(a, n,   i, j, t) { for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t } return n ? a[int((n + 1) / 2)] : 0 }
    { if (++line <= skip) next
      r = num("ranks"); if (r < 1) r = 1
      n++; tps[n] = num("tokens_per_s") / r; tf[n] = num("tflops")
      split("params grads optimizer activations logits moe comm workspace total", cats, " ")
      for (c = 1; c <= 9; c++) { v = num(cats[c]) / 2^30; if (v > pk[c]) pk[c] = v }
      res = num("reserved_peak_bytes") / 2^30; if (res > rpk) rpk = res }
    END { if (!n) { print "no steps after warm-up | | "; exit }
          printf "%.0f | %.4g | ", med(tps, n), med(tf, n)
          for (c = 1; c <= 9; c++) printf "%s %.2f ", cats[c], pk[c]
          printf "reserved %.2f\n", rpk }' "$1"
}

# Closed forms of DESIGN sec. 5 (GiB per rank) for a Qwen3-MoE config.json on N ranks with EP:
# n_expert = MoE layers x E x 3 H F, n_dense = the rest (attention, norms, routers, dense MLPs,
# embedding and head). fsdp: params 2n/N, grads 4n/N; zero1: params 2 n_dense + 2 n_expert/EP,
# grads 4 n_dense + 4 n_expert/EP; both: optimizer 12 n/N.
closed_form() {  # closed_form <config.json> <N> <EP>
  tr -d '\n' < "$1" | awk -v N="$2" -v EP="$3" '
    function key(k,   m) { if (match($0, "\"" k "\": *[-0-9.eE+]+")) { m = substr($0, RSTART, RLENGTH); sub(/.*: */, "", m); return m + 0 } return 0 }
    { h = key("hidden_size"); L = key("num_hidden_layers"); nq = key("num_attention_heads"); nkv = key("num_key_value_heads")
      d = key("head_dim"); if (!d) d = h / nq; E = key("num_experts"); F = key("moe_intermediate_size")
      I = key("intermediate_size"); V = key("vocab_size")
      dense_layers = 0
      if (match($0, /"mlp_only_layers": *\[[^]]*\]/)) { s = substr($0, RSTART, RLENGTH); sub(/.*\[/, "", s); sub(/\].*/, "", s); if (s ~ /[0-9]/) dense_layers = split(s, tmp, ",") }
      tied = ($0 ~ /"tie_word_embeddings": *true/)
      attn = h * nq * d + 2 * h * nkv * d + nq * d * h + 2 * d + 2 * h
      moe_l = L - dense_layers
      nexp = moe_l * E * 3 * h * F
      ndense = L * attn + moe_l * E * h + dense_layers * 3 * h * I + V * h * (tied ? 1 : 2) + h
      n = nexp + ndense; G = 2^30
      printf "closed form (DESIGN sec. 5; bf16 parameters, i.e. on GPUs), n = %.3f B (dense %.3f B, experts %.3f B), N = %d, EP = %d, GiB per rank:\n", n / 1e9, ndense / 1e9, nexp / 1e9, N, EP
      printf "  zero1: params %.2f  grads %.2f  optimizer %.2f\n", (2 * ndense + 2 * nexp / EP) / G, (4 * ndense + 4 * nexp / EP) / G, 12 * n / N / G
      printf "  fsdp:  params %.2f  grads %.2f  optimizer %.2f  (plus one or two gathered units in comm)\n", 2 * n / N / G, 4 * n / N / G, 12 * n / N / G }'
}

# JSON lines of `docs` documents of exactly `len` random tokens below `vocab`: with
# train.micro_batch_tokens = len every micro-batch is one whole sequence.
long_docs() {  # long_docs <file> <len> <docs> <vocab>
  [ -s "$1" ] && return
  awk -v S="$2" -v D="$3" -v V="$4" 'BEGIN { srand(7); for (d = 0; d < D; d++) { printf "{\"tokens\": ["
    for (i = 0; i < S; i++) printf "%s%d", (i ? "," : ""), int(rand() * V); print "]}" } }' > "$1"
}

vocab_of() { tr -d '\n' < "$1" | grep -oE '"vocab_size": *[0-9]+' | grep -oE '[0-9]+$'; }

launcher() {  # launcher <np>: the words that start np processes (none for a plain start)
  LAUNCH=()
  [ "$1" -gt 1 ] && LAUNCH=("${MPI[@]}" -np "$1")
}

part_comm() {
  local sizes=() t=()
  [ $DRY = 1 ] && sizes=(--sizes 1M,4M --iters 3 --warmup 1)
  for np in "${NPS[@]}"; do
    step comm "bench_comm $np ranks" "comm_np$np.log" 600 \
      env NCCL_DEBUG=VERSION "${MPI[@]}" -np "$np" "$BUILD/bench/bench_comm" --device "$DEV" "${sizes[@]}"
    # The table rows at the sizes of the goal (every row in a dry run) and the best busbw there.
    local pick='^\| [a-z_]+ \| (256 MiB|512 MiB|1 GiB) \||\| FAIL \|'
    [ $DRY = 1 ] && pick='^\| [a-z_]+ \| [0-9]'
    t+=("$np ranks:" "$(grep -aE "$pick" "$OUT/comm_np$np.log")" "$(grep -aE '^best busbw' "$OUT/comm_np$np.log")")
    if [ $DRY = 0 ] && [ -n "${NCCL_TESTS:-}" ]; then
      for b in all_gather_perf reduce_scatter_perf all_reduce_perf alltoall_perf; do
        [ -x "$NCCL_TESTS/$b" ] && step comm "nccl-tests $b $np GPUs" "nccl_tests_np$np.log" 600 \
          "$NCCL_TESTS/$b" -b 1M -e 1G -f 2 -g "$np"
      done
    fi
  done
  local ver
  ver=$(grep -aoE 'NCCL version [0-9.]+[^ ]*' "$OUT"/comm_np*.log 2>/dev/null | head -n 1 | sed 's/.*NCCL/NCCL/')
  tables+=("### comm (${ver:-NCCL version not printed}); goal: >= 85% of NCCL's own tests (~370 GB/s busbw on 8 H100/H200, i.e. >= ~315 GB/s) at >= 256 MiB
| op | bytes | elements per rank block | time us | max time us | algbw GB/s | busbw GB/s | check |
|---|---:|---:|---:|---:|---:|---:|---|
$(printf '%s\n' "${t[@]}")
(every size: comm_np*.log)")
}

# Layouts of N ranks against one rank: "label;grad_accum of A;B overrides".
layouts_for() {
  local ch='primitives.moe_dispatch="chunked_alltoall:2"' ring='primitives.attention="cp_ring"' a2a='primitives.attention="cp_a2a"'
  case $1 in
    2) printf '%s\n' "dp2;2;parallel.dp=2" "dp2 ep2;2;parallel.dp=2 parallel.ep=2 $ch" \
         "cp2 cp_ring;1;parallel.dp=1 parallel.cp=2 $ring" "cp2 cp_a2a;1;parallel.dp=1 parallel.cp=2 $a2a" \
         "cp2 ep2 (folded);1;parallel.dp=1 parallel.cp=2 parallel.ep=2 $ring $ch" ;;
    4) printf '%s\n' "dp4 ep4;4;parallel.dp=4 parallel.ep=4 $ch" "cp4 cp_ring;1;parallel.dp=1 parallel.cp=4 $ring" \
         "cp2 dp2 ep4 (folded);2;parallel.dp=2 parallel.cp=2 parallel.ep=4 $ring $ch" \
         "cp4 ep4 cp_a2a (folded);1;parallel.dp=1 parallel.cp=4 parallel.ep=4 $a2a $ch" ;;
    8) printf '%s\n' "dp8;8;parallel.dp=8" "dp8 ep8;8;parallel.dp=8 parallel.ep=8 $ch" \
         "cp2 dp4 ep8 (folded);4;parallel.dp=4 parallel.cp=2 parallel.ep=8 $ring $ch" \
         "cp4 dp2 ep8 cp_a2a (folded);2;parallel.dp=2 parallel.cp=4 parallel.ep=8 $a2a $ch" \
         "cp8 ep8 cp_ring (folded);1;parallel.dp=1 parallel.cp=8 parallel.ep=8 $ring $ch" ;;
  esac
}

part_layouts() {
  local steps=${LAYOUT_STEPS:-20} tokens=${LAYOUT_TOKENS:-8192} t=()
  [ $DRY = 1 ] && { steps=2; tokens=1024; }
  local common=(--config configs/demo.toml --steps "$steps" --warmup 0
                --set "model.config=\"$SLICE\"" --set "parallel.device=\"$DEV\"" --set "train.micro_batch_tokens=$tokens"
                --set train.warmup_steps=1 --set train.lr=1e-4 --set train.min_lr=1e-5 --set data.demo_documents=2000
                --set primitives.recompute=full --set primitives.experts=grouped --set primitives.loss=linear_ce
                --set 'primitives.state="fsdp"' --set parallel.timeout_s=600 "${TOLS[@]}")
  for np in "${NPS[@]}"; do
    # (read from fd 3: mpirun would swallow the rest of the list from stdin)
    while IFS=';' read -r -u 3 label ga over; do
      [ -z "$label" ] && continue
      local b=() o
      for o in $over; do b+=(--b "$o"); done
      local log
      log="layouts_np${np}_$(echo "$label" | tr -c 'a-zA-Z0-9' '_').log"
      step layouts "$np ranks: 1 rank x accum $ga vs $label" "$log" 900 \
        "${MPI[@]}" -np "$np" "$BB" paired "${common[@]}" --a parallel.dp=1 --a "train.grad_accum=$ga" "${b[@]}"
      t+=("| $np | $label | $(grep -aE '^(PASS|FAIL)' "$OUT/$log" | tail -n 1 | sed 's/|/\//g') |")
    done 3< <(layouts_for "$np")
  done
  tables+=("### layouts: $steps steps, $tokens tokens per micro-batch, bf16 tolerances (loss 1e-2, grad norm 5e-2, gradients 5e-2, logits 0.25)
| GPUs | layout (B; A = 1 GPU, same global batch) | verdict |
|---|---|---|
$(printf '%s\n' "${t[@]}")")
}

part_fsdp() {
  local np=${FSDP_NP:-$NPMAX} tokens=${FSDP_TOKENS:-32768} steps=8 warm=2 model=${FSDP_MODEL:-$SLICE}
  [ $DRY = 1 ] && { np=2; tokens=1024; steps=2; warm=0; model=$SLICE; }
  [ "$np" -lt 2 ] && { skip fsdp "zero1 vs fsdp" "needs 2 GPUs"; return; }
  local log="fsdp_np$np.log"
  step fsdp "zero1 (A) vs fsdp (B), dp = ep = $np, $tokens tokens per rank" "$log" 900 \
    "${MPI[@]}" -np "$np" "$BB" paired --config configs/demo.toml --steps "$steps" --warmup "$warm" \
    --set "model.config=\"$model\"" --set "parallel.device=\"$DEV\"" --set "train.micro_batch_tokens=$tokens" \
    --set train.warmup_steps=1 --set train.lr=1e-4 --set train.min_lr=1e-5 --set data.demo_documents=4000 \
    --set primitives.recompute=full --set primitives.experts=grouped --set primitives.loss=linear_ce \
    --set "parallel.dp=$np" --set "parallel.ep=$np" --set 'primitives.moe_dispatch="chunked_alltoall:2"' \
    --set parallel.timeout_s=600 "${TOLS[@]}" --a 'primitives.state="zero1"' --b 'primitives.state="fsdp"'
  local times tput
  times=$(grep -aE '^step time \(median\)' "$OUT/$log" | tail -n 1)
  # dp = np: every rank trains on its own micro-batch of `tokens` per step.
  tput=$(echo "$times" | awk -v T="$tokens" '{ for (i = 1; i <= NF; i++) { if ($i == "A") a = $(i + 1); if ($i == "B") b = $(i + 1) }
    sub(/s,?$/, "", a); sub(/s,?$/, "", b); if (a > 0 && b > 0) printf "tokens/s per GPU: zero1 %.0f, fsdp %.0f (fsdp / zero1 = %.3f; goal >= 0.97)", T / a, T / b, a / b }')
  tables+=("### fsdp vs zero1: $model, dp = ep = $np, $tokens tokens per rank, $steps steps ($warm warm-up)
$(sed -n '/^peak memory/,/^peak total per rank, B/p' "$OUT/$log")
${times}
${tput}
$(closed_form "$model" "$np" "$np")")
}

part_moe() {
  local np=$NPMAX args=(--shape qwen3 --tokens 16384,32768,65536 --chunks 2,3,4 --steps 5 --warmup 2)
  [ $DRY = 1 ] && { np=2; args=(--shape qwen3 --small --tokens 512 --chunks 2 --steps 2 --warmup 1); }
  [ "$np" -lt 2 ] && { skip moe "bench_moe_layer" "needs 2 GPUs"; return; }
  step moe "bench_moe_layer EP $np" "moe_np$np.log" 900 "${MPI[@]}" -np "$np" "$BUILD/bench/bench_moe_layer" --device "$DEV" "${args[@]}"
  tables+=("### moe: one Qwen3-30B-A3B MoE layer, EP = $np (seed on H100 at 16K: fwd 10.36 -> 7.88 ms, bwd 13.18 -> 11.77 ms; goal: chunk2 hides >= 60% at 32K, growing with length)
$(grep -aE '^\|' "$OUT/moe_np$np.log")")
}

part_full() {
  local np=8 runs=${FULL_RUNS:-4096:1 32768:2 131072:4} steps=${FULL_STEPS:-8} skipn=2 model=$FULL_MODEL extra=() t=()
  if [ $DRY = 1 ]; then
    np=2; runs="512:1 1024:2"; steps=2; skipn=0
    extra=(--set "model.config=\"$model\"" --set parallel.ep=2 --set "parallel.device=\"$DEV\"")
  elif [ "$GPUS" -lt 8 ]; then
    skip full "Qwen3-30B-A3B on 8 GPUs" "needs 8 GPUs, $GPUS visible"
    return
  fi
  local vocab
  vocab=$(vocab_of "$model")
  for r in $runs; do
    local S=${r%%:*} cp=${r##*:}
    local dp=$((np / cp))
    local data="$OUT/long_docs_$S.jsonl" mfile="$OUT/full_${S}.jsonl"
    long_docs "$data" "$S" $((steps * dp + 4)) "$vocab"
    rm -f "$mfile"
    step full "$S-token sequences, cp $cp x dp $dp, ep $([ $DRY = 1 ] && echo 2 || echo 8)" "full_$S.log" 1200 \
      "${MPI[@]}" -np "$np" "$BB" train --config configs/qwen3-30b-a3b-8gpu.toml --steps "$steps" "${extra[@]}" \
      --set "parallel.cp=$cp" --set "train.micro_batch_tokens=$S" --set "data.path=\"$data\"" \
      --set "log.metrics=\"$mfile\""
    t+=("| $S | $cp | $dp | $((S / cp)) | $(metrics_row "$mfile" "$skipn") |")
  done
  tables+=("### full: $model on $np GPUs, configs/qwen3-30b-a3b-8gpu.toml, $steps steps (median after $skipn); goal >= 300 model TFLOP/s per GPU at every length (NeMo Automodel, 8 H100, 4K: 277 TFLOP/s, 12,040 tokens/s per GPU)
| sequence | cp | dp | tokens per GPU | tokens/s per GPU | model TFLOP/s per GPU | peak GiB per category (max over ranks) |
|---|---|---|---|---|---|---|
$(printf '%s\n' "${t[@]}")")
}

part_scaling() {
  local tokens=${SCALE_TOKENS:-16384} steps=${SCALE_STEPS:-10} skipn=2 nps=(1 "${NPS[@]}") t=() base=""
  local extra=(--set "model.config=\"$SLICE\"" --set "parallel.device=\"$DEV\"")
  [ $DRY = 1 ] && { tokens=1024; steps=3; skipn=1; }
  for np in "${nps[@]}"; do
    local mfile="$OUT/scaling_np$np.jsonl"
    rm -f "$mfile"
    launcher "$np"
    step scaling "$np GPU(s), $tokens tokens per GPU" "scaling_np$np.log" 600 \
      "${LAUNCH[@]}" "$BB" train --config configs/qwen3-30b-a3b-4layer-gpu.toml --steps "$steps" "${extra[@]}" \
      --set "train.micro_batch_tokens=$tokens" --set "parallel.dp=$np" --set "parallel.ep=$np" \
      --set 'primitives.moe_dispatch="chunked_alltoall:2"' --set 'primitives.state="fsdp"' \
      --set parallel.timeout_s=600 --set "log.metrics=\"$mfile\""
    local row tps eff
    row=$(metrics_row "$mfile" "$skipn")
    tps=$(echo "$row" | awk -F'|' '{ print $1 + 0 }')
    [ -z "$base" ] && base=$tps
    eff=$(awk -v a="$tps" -v b="$base" 'BEGIN { if (b > 0) printf "%.1f %%", 100 * a / b; else print "?" }')
    t+=("| $np | $row | $eff |")
  done
  tables+=("### scaling: $SLICE, $tokens tokens per GPU, dp = ep = N, fsdp, chunked_alltoall:2, $steps steps (median after $skipn); goal >= 90% at 8
| GPUs | tokens/s per GPU | model TFLOP/s per GPU | peak GiB (max over ranks) | efficiency vs 1 GPU |
|---|---|---|---|---|
$(printf '%s\n' "${t[@]}")")
}

part_torch() {
  if [ "$DEV" != cuda ] || ! python3 -c "import torch, transformers" 2>/dev/null; then
    skip torch "hf_train_step.py --fsdp" "needs a GPU and python3 with torch + transformers"
    return
  fi
  local tokens=${SCALE_TOKENS:-16384} np=$NPMAX steps=5 warm=2
  [ $DRY = 1 ] && { tokens=1024; np=1; steps=2; warm=1; }  # NCCL refuses two ranks on one GPU
  [ "$np" -lt 1 ] && np=1
  local TR=(python3 -m torch.distributed.run --standalone --nproc_per_node)
  step torch "FSDP2 $SLICE, $np GPU(s), $tokens tokens per GPU" "torch_slice_np$np.log" 900 \
    env PYTHONUNBUFFERED=1 "${TR[@]}" "$np" bench/hf_train_step.py --fsdp --config "$SLICE" --seq "$tokens" \
    --steps "$steps" --warmup "$warm"
  local t
  t=$(grep -aA3 '^PyTorch + HF reference step' "$OUT/torch_slice_np$np.log")
  if [ $DRY = 0 ] && [ "$GPUS" -ge 8 ]; then
    step torch "FSDP2 full model, 8 GPUs, 4096 tokens per GPU" "torch_full_np8.log" 900 \
      env PYTHONUNBUFFERED=1 "${TR[@]}" 8 bench/hf_train_step.py --fsdp --config "$FULL_MODEL" --seq 4096 \
      --steps "$steps" --warmup "$warm"
    t+=$'\n'$(grep -aA3 '^PyTorch + HF reference step' "$OUT/torch_full_np8.log")
  fi
  tables+=("### torch: PyTorch + transformers under FSDP2 (no EP: every rank runs all experts on its own tokens); compare with the scaling and full tables
${t}")
}

card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo "multigpu.sh $(date -u +%Y-%m-%dT%H:%MZ): ${card:-no GPU} x $GPUS, parts: ${PARTS[*]}$([ $DRY = 1 ] && echo " (dry run: 2 processes on $DEV)")"
for part in "${PARTS[@]}"; do
  case $part in
    comm | layouts | fsdp | moe | full | scaling | torch)
      if [ $DRY = 0 ] && [ ${#NPS[@]} -eq 0 ] && [ "$part" != scaling ] && [ "$part" != torch ]; then
        skip "$part" "-" "needs at least 2 GPUs ($GPUS visible)"
        continue
      fi
      "part_$part" ;;
    *) echo "unknown part '$part' (comm layouts fsdp moe full scaling torch all dryrun)"; exit 2 ;;
  esac
done
{
  echo
  echo "## multigpu.sh on ${card:-no GPU} x $GPUS ($(date -u +%Y-%m-%d)), $([ $DRY = 1 ] && echo "DRY RUN (2 processes sharing one $DEV device; numbers mean nothing)" || echo "one process per GPU, NCCL_NVLS_ENABLE=0")"
  echo
  echo "| part | run | exit | time | result |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  printf '%s\n\n' "${tables[@]}"
  echo "overall: $([ $fail = 0 ] && echo PASS || echo FAIL) (logs in $OUT, packed in $OUT.tgz)"
} | tee "$OUT/summary.md"
tar czf "$OUT.tgz" -C "$OUT" . 2>/dev/null
exit $fail
