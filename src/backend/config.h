// config.h — the [backend] table of the run config: tuning knobs of the CUDA backend that
// change how work runs, never what it computes beyond rounding (docs/config.md). Parsed with
// the run config, printed at startup, saved in a checkpoint's state.json, settable per side in
// `paired`; applied process-wide when a Trainer is built (apply_backend_config in
// runtime/run_config.h). Environment variables do not change what runs.
//
// The defaults are those measured best on an H200 (bench/results/): they equal the built-in
// defaults of backend/cuda/gemm.h (a test checks that they stay equal).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace bb {

struct BackendConfig {
  // Grouped GEMM of same-dtype problems (the expert forward and dgrad): cublas | multi_stream | mma.
  std::string grouped_gemm_same_dtype = "mma";
  // Grouped GEMM of 16-bit inputs into f32 (the expert wgrad): multi_stream | wmma | mma.
  std::string grouped_gemm_widening = "multi_stream";
  // Side streams of the multi_stream grouped GEMM, 1..16.
  int64_t grouped_gemm_streams = 4;
  // Same-dtype grouped calls whose mean problem has at least this many FLOPs take multi_stream.
  double grouped_gemm_multi_stream_min_flops = 1.2e9;
  // multi_stream: enqueue the side streams from a pool of host threads (false: one thread).
  bool grouped_gemm_threaded_enqueue = true;
  // Forward, dgrad and wgrad grouped calls the TMA kernel takes (sm_90, bf16, the expert
  // layouts) run on it, before grouped_gemm_same_dtype / _widening and the FLOP line apply.
  bool grouped_gemm_tma = true;
  // cuBLASLt algorithm choice: bucketed (one heuristic query per size bucket, checked per size)
  // or exact (one query per new shape).
  std::string gemm_heuristics = "bucketed";
  // With train.grad_clip = 0 (nothing global needed before an update), units that one rank
  // holds whole get their AdamW step as soon as their gradient is final, on the copy stream
  // beside the backward of the layers below (the same bits as the update after the backward).
  bool optimizer_in_backward = true;
  // How AdamW holds the fp32 master of bf16 parameters: split (the bf16 value is the master's
  // upper half, rounded to nearest with ties away from zero, and a 16-bit remainder the rest: 2
  // optimizer bytes an element and 2 fewer moved by each update) or f32 (a separate fp32 copy,
  // the value rounded to nearest even). The same fp32 master either way; the values differ only
  // where a master sits exactly on a bf16 tie. f32 parameters always keep an fp32 master copy.
  std::string master_storage = "split";
  // The cuDNN library file for the attention path; "" = libcudnn.so.9 from the library path.
  std::string cudnn_library;
  // The host enqueues at most this many layers (of the forward or the backward) past what the
  // compute stream has finished, then waits for it (0: no limit). Memory that a side stream
  // used is freed behind the work queued before the free, so it is handed out again only once
  // the GPU got there: a host far ahead of the GPU makes the pool grow by everything freed in
  // between (measured: 59 -> 138 GiB reserved in two steps of one emulated rank of the full
  // Qwen3-30B-A3B at EP 8, bench/results/2026-12-04-h200-emulated.md). Experimental: off by
  // default until its effect is measured; the multi-GPU recipe sets 2.
  int64_t max_layers_ahead = 0;
  // The MoE experts' weight gradient runs on the wgrad stream: issued after the last chunk's
  // dgrad, it overlaps the dispatch-backward all-to-all and the compute stream's next work (the
  // layer's attention backward) instead of holding the compute stream; the gradient reduction
  // and the end of the micro-batch wait for it. Bit-identical gradients either way. Off until
  // its effect is measured on a GPU.
  bool expert_wgrad_stream = false;
  // The dtype gradients are reduced in across ranks: f32, or bf16 (each rank's f32 gradient
  // rounded to bf16, summed in bf16, widened back: half the bytes on the wire; the error
  // against f32 is in bench/results/2026-12-05-cpu-bf16-reduction.md).
  std::string grad_reduce_dtype = "f32";
  // When fsdp units reduce-scatter their gradients: after every micro-batch (micro_batch), or
  // once per step after the last (step: their whole f32 gradients stay allocated across the
  // step's micro-batches, 4 bytes an element more).
  std::string fsdp_reduce = "micro_batch";
  // Whether the GPU memory pool may hand memory freed on one stream to an allocation on another
  // before the GPU got past the free, by making the allocating stream wait for the freeing one
  // (cudaMemPoolReuseAllowInternalDependencies). false: such memory is reused only once the free
  // has completed, and the pool grows instead (measured: one emulated rank of the full
  // Qwen3-30B-A3B at EP 8, 61 GiB live, 105 -> 137 GiB reserved over three steps, then out of
  // memory; bench/results/2026-12-05-h200-emulated.md). true: the driver still prefers growing,
  // but where the pool cannot grow (the card's end, or emulate.device_memory_gib) it reuses: the
  // same rank then ran at the same speed inside a 79.6 GiB cap. Off until measured on a real job.
  bool pool_cross_stream_reuse = false;
  // Token-chunked MoE: every MoE layer runs its routed path (permute, dispatch, experts, combine,
  // unpermute) over at most this many tokens at a time, in ceil(tokens per rank / this)
  // sequential chunks (tokens per rank = train.micro_batch_tokens / cp), so that the moe buffers
  // hold one chunk's rows; under full recompute the backward rebuilds one chunk at a time.
  // The same outputs and data gradients; the experts' weight gradient is summed chunk by chunk
  // (rounding only). 0 = off (the whole micro-batch at once). skills/moe-token-chunks.md.
  int64_t moe_chunk_tokens = 0;
  // primitives.optimizer = "adamw_offload": the host threads that update the offloaded optimizer
  // state, each pinned to its own core (0 = every core the process may use, less one for the
  // thread that issues the device work). skills/optimizer-offload.md.
  int64_t offload_threads = 0;

  // Throws bb::Error naming the key (as `backend.<key>` in `where`) when a value is not allowed.
  void validate(const std::string& where) const;
  // "grouped_gemm_same_dtype=cublas ... gemm_heuristics=bucketed" for logs.
  std::string summary() const;
  bool operator==(const BackendConfig&) const = default;
};

void to_json(nlohmann::json& j, const BackendConfig& c);
// Missing keys keep their defaults; values are validated.
void from_json(const nlohmann::json& j, BackendConfig& c);

}  // namespace bb
