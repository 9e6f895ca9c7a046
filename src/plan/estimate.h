// estimate.h — the per-rank memory estimator (DESIGN.md sec. 5, skills/planner.md).
//
// Predicts, without allocating anything, the bytes a rank's allocator books per memory category
// (core/memory.h) at each moment of a training step, and from them the step's peak of every
// category and of the total: what `bumblebee train` reports after its step, and what the run
// needs from its device. Inputs are a run config (model, primitives, layout, micro-batch,
// grad_accum, dtypes, the [backend] keys that change memory) and the world size.
//
// What it counts and how exactly:
//   params, grads, optimizer  exact: the model's units are laid out (ModelOptions::defer_values,
//                             nothing allocated) over the layout's groups and summed with the
//                             state family's closed forms (runtime/state.h state_bytes), uneven
//                             shards included
//   comm                      exact for the state families' gathers and reductions (fsdp: the
//                             gathered units of two layers, whole f32 gradients until their
//                             reduce-scatter drains; zero1 / replicated: the reductions in flight)
//   activations, logits, moe  the tensors each block keeps for its backward and the temporaries
//                             of its forward and backward, per recompute policy, from formulas
//                             that mirror the blocks (skills/planner.md lists them); with
//                             balanced routing (every rank receives T x top_k expert rows) or
//                             EstimateOptions::expert_load (the busiest rank's rows / the mean)
//   workspace, other          the persistent GEMM workspaces and the known per-step buffers;
//                             library scratch (cuDNN, cuBLAS) is approximated (flagged)
// Moments: startup (the state), each layer's forward, the loss head, each layer's backward
// (with its recompute under recompute = full), the embedding backward and the optimizer update.
// A category's peak is its largest value over the moments; the total's peak is the largest sum
// at one moment (categories peak at different moments, so it is less than the sum of peaks).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/mesh.h"
#include "core/memory.h"
#include "plan/time_model.h"
#include "runtime/run_config.h"

namespace bb::plan {

// Bytes per memory category.
struct Bytes {
  std::array<int64_t, kNumMemCategories> v{};
  int64_t& operator[](MemCategory c) { return v[static_cast<size_t>(c)]; }
  int64_t operator[](MemCategory c) const { return v[static_cast<size_t>(c)]; }
  int64_t total() const;
  Bytes& operator+=(const Bytes& o);
  // Per category, the larger of the two.
  void max_with(const Bytes& o);
};

// One moment of the step: what is live then.
struct Moment {
  std::string name;  // "layer 47 backward (moe)", "head", ...
  Bytes live;
};

struct EstimateOptions {
  // The rank whose memory is predicted (ranks differ only by uneven shards, which every rank
  // allocates padded, and by routing); -1: the largest over ranks.
  int64_t rank = -1;
  // The busiest rank's expert rows over the mean (1: balanced routing). Rows received scale the
  // experts' activations and the dispatch buffers.
  double expert_load = 1.0;
  // Tokens of each micro-batch on this rank before context sharding (0: train.micro_batch_tokens).
  int64_t micro_batch_tokens = 0;
};

// The wire time of one step's collectives on this rank, by class, from the link model of
// [emulate] (comm/link_model.h) with nothing overlapped: an upper bound on what the schedule has to
// hide. Per micro-batch: every sharded unit gathered twice (forward, backward; the full
// recompute reuses the backward's gather) and its gradient reduce-scattered once; per MoE layer
// five all-to-alls of the routed rows (dispatch and combine forward, the recompute's dispatch,
// two backward); per attention layer with cp > 1 the ring's cp - 1 shifts of K and V forward and in
// the recompute, and of K, V and their f32 gradients backward; per Gated DeltaNet layer with cp > 1
// the head all-to-alls (gdn_cp heads) or the state summaries' all-gathers (states) of each forward
// and backward, one sequence per micro-batch taken.
struct CommEstimate {
  double param_gather_s = 0, grad_reduce_s = 0, ep_s = 0, cp_s = 0;
  int64_t param_gather_bytes = 0, grad_reduce_bytes = 0, ep_bytes = 0, cp_bytes = 0;
  double total_s() const { return param_gather_s + grad_reduce_s + ep_s + cp_s; }
  // One operation each, for the time model's overlaps (plan/time_model.h): per layer, one gather
  // of its units and one reduction of their gradients (index num_layers: the embedding's and the
  // head's); one all-to-all of a MoE layer's routed rows; one ring shift of K and V forward and
  // of K, V and their gradients backward; one forward (or backward) pass's Gated DeltaNet
  // exchange of one layer.
  std::vector<double> layer_gather_s, layer_reduce_s;
  double ep_one_s = 0, cp_shift_s = 0, cp_shift_bwd_s = 0, gdn_pass_s = 0;
};

struct MemoryEstimate {
  ParallelLayout layout;
  int64_t world = 1;
  Device device;
  int64_t tokens_local = 0;  // T: tokens of one micro-batch on this rank (after cp)
  Bytes persistent;          // params, grads, optimizer after startup (and the first step's backup)
  Bytes peak;                // per category: the largest value over the step's moments
  int64_t peak_total = 0;    // the largest total at one moment
  std::string peak_moment;   // where peak_total is reached
  std::vector<Moment> moments;
  // The allocator's reserved peak, modelled: the live peak plus the pool's growth from memory
  // freed on one stream and not yet reusable by another (skills/planner.md: fragmentation).
  int64_t reserved = 0;
  // primitives.optimizer = "adamw_offload": the host memory its state takes on this rank (f32
  // master, two f32 moments and the gradient's copy per owned element; not in the device's
  // categories when the device is a GPU).
  int64_t host_optimizer = 0;
  std::vector<std::string> notes;  // approximations that apply to this run
  CommEstimate comm;               // the step's collectives (not overlapped)

  // The breakdown as a table: one row per phase (the moment with the largest total of each
  // phase; every moment with all_moments) and the per-category peaks.
  std::string table(bool all_moments = false) const;
  // {"layout": ..., "peak_bytes": {category: bytes, "total": ...}, "peak_moment": ..., "moments": [...]}
  std::string json() const;
};

MemoryEstimate estimate_memory(const RunConfig& cfg, int64_t world_size, const EstimateOptions& opts = {});

// Whether a run fits `available` bytes per rank: the prediction, and when it does not, a message
// naming the largest categories and the nearest setting that fits (`--set` overrides, tried one
// at a time, then together: full recompute, linear_ce, fsdp, a larger ep or cp, fewer tokens
// per micro-batch with more accumulation).
struct FitCheck {
  bool fits = true;
  MemoryEstimate estimate;
  std::string message;  // empty when it fits
};
FitCheck check_fit(const RunConfig& cfg, int64_t world_size, int64_t rank, int64_t available);

// The recipe search of `bumblebee plan --gpus N` (DESIGN.md sec. 4): layouts of N GPUs for one
// sequence length under the default recipe (fsdp, full recompute, linear_ce, chunked_alltoall:2
// over EP > 1, cp_ring over CP > 1), each predicted and checked against the GPU's memory less a
// margin, and timed (estimate_time with the request's calibration). The choice: the layout that
// fits with the most predicted tokens/s per GPU.
struct PlanRequest {
  int64_t gpus = 8;
  int64_t gpus_per_node = 8;
  double gpu_memory_gib = 80;  // the card's memory, GiB
  double margin = 0.05;        // kept free: workspace scratch, fragmentation
  int64_t seq = 4096;          // tokens of one sequence (one per micro-batch)
  int64_t global_batch_tokens = 0;  // tokens of a step over all GPUs (0: one sequence per data rank)
  const Calibration* calibration = nullptr;  // the time model's rates (null: Calibration::builtin())
};
struct PlanCandidate {
  ParallelLayout layout;
  MemoryEstimate estimate;
  TimeEstimate time;
  bool fits = false;
  bool chosen = false;
};
struct PlanResult {
  std::vector<PlanCandidate> candidates;
  int64_t usable = 0;  // bytes per GPU a candidate may use
  std::string why;     // the recipe in words, for the chosen one (or why none fits)
};
// `base`: the run config whose model, dtypes and [backend] are kept; its layout and primitives are
// replaced by each candidate's. `progress(done, total)` is called after each candidate.
PlanResult plan_layouts(const RunConfig& base, const PlanRequest& req,
                        const std::function<void(int64_t, int64_t)>& progress = {});

// parallel = "auto" (or dp / cp / ep = "auto"): the degrees the run config leaves to the planner,
// for `world` ranks (pp 1), keeping every choice the config makes (primitives, the fixed
// degrees, micro-batch tokens, dtypes); cp > 1 with sdpa attention takes cp_ring. Candidates
// are every cp (a power of two dividing the ranks, at most half the micro-batch's tokens; only 1
// for GSPO, policy.ratio = "sequence", which needs whole sequences on a rank) and ep
// (dividing the experts and the ranks) the config leaves open; each is predicted
// (estimate_memory) and kept when its peak fits `available` bytes per rank (<= 0: no limit, CPU
// ranks). The choice on a GPU: the most predicted tokens/s per GPU (estimate_time with the
// built-in calibration); on CPU ranks (no calibration): the smallest CP that brings the
// micro-batch to 32K tokens per rank, then the least predicted wire time, then the smaller EP. Returns the
// config with the degrees set (auto flags cleared) and, in *why, the choice in words; throws
// when nothing fits, naming the closest candidate's peak and largest categories.
RunConfig choose_auto_layout(const RunConfig& cfg, int64_t world, int64_t available, std::string* why);

}  // namespace bb::plan
