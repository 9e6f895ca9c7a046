// moe_block.h — the sparse MoE MLP as a residual block, in explicit stages:
//   h = RMSNorm(x)
//   route      logits = h W_router^T (f32); top-k (router family) -> idx, prob, counts
//   permute    x_perm = rows of h grouped by expert
//   dispatch   rows to the ranks that hold their experts (Dispatcher; nothing moves on one rank)
//   experts    SwiGLU expert MLPs on the local rows (experts family), run by the dispatcher
//              on the rows it brought (per chunk for chunked_alltoall)
//   combine    expert outputs back in x_perm's order (Dispatcher)
//   unpermute  weighted sum of each token's K outputs (permute family)
//   [+ shared expert: sigmoid(h w_gate) * W_sd swiglu(W_sgu h)]
//   y = x + out
// Routing is decided once per micro-batch (the train or eval pass) and stashed in
// ctx.routing; the recompute pass replays it (router_forward with RouterReplay): the same
// selection and counts, no second top-k, no host read, one routing entry per layer. The aux loss
// pools over layers through ctx.aux (its gradient is added in backward_data). Selective
// recompute (ctx.recompute_drop) may drop h (`norms`), the experts' fc1 output and activation
// (`moe_experts`) and the shared expert's (`shared_expert`); backward_data rebuilds them.
// A forward whose output the caller discards (ctx.output_unused: the full-recompute forward)
// keeps only what backward_data reads: with the memory_efficient permute the dispatcher's
// forward_for_backward (rows dispatched, fc1 + activation, no fc2, no combine); with standard
// the combined y_perm is read by backward (d_prob), so fc2 and the combine still run; either way
// no unpermute, shared-expert gating or residual add. It returns an undefined tensor then.
// Token chunks (MoeBlockConfig::token_chunks = C > 1): chunk c is tokens [c T / C, (c+1) T / C);
// each runs permute -> dispatch -> experts -> combine -> unpermute alone and writes its rows of
// the routed output. Every token's rows, and so the output and d_x, are those of the unchunked
// layer; the experts' weight gradient is the sum of the chunks' (bit-identical where the
// experts' wgrad adds row by row in order, as the CPU grouped path does; on a GPU it is rounded
// per chunk). Under full recompute the recompute forward keeps no routed rows at all: the
// backward rebuilds each chunk just before that chunk's backward, so only one chunk's rows are
// alive. Every chunk is a dispatcher call, so with expert parallelism every rank runs all C
// (a chunk without tokens of this rank still joins its collectives with zero rows).
// Parameters under `prefix`: post_attention_layernorm.weight [H], mlp.gate.weight [E, H] and
// the shared expert's mlp.shared_expert.gate_up_proj [2S, H], .down_proj.weight [H, S],
// mlp.shared_expert_gate.weight [1, H] in the dense unit; mlp.experts.gate_up_proj
// [E_l, 2F, H] and mlp.experts.down_proj [E_l, H, F] in the expert unit.
// Legend: T tokens, H hidden, E experts (E_l local), K top-k, F expert ffn, S shared ffn,
// N = T K permuted rows.
#pragma once

#include "models/block.h"
#include "primitives/moe/dispatcher.h"
#include "primitives/moe/experts.h"
#include "primitives/moe/permute.h"
#include "primitives/moe/router.h"

namespace bb {

// The most token chunks a MoE layer accepts (MoeBlockConfig::token_chunks).
constexpr int64_t kMaxMoeTokenChunks = 4096;

struct MoeBlockConfig {
  int64_t hidden = 0, num_experts = 0, top_k = 0, expert_ffn = 0, shared_ffn = 0;
  bool norm_topk_prob = true;
  double rms_norm_eps = 1e-6;
  RouterScore router = RouterScore::softmax;
  ExpertsImpl experts = ExpertsImpl::sequential;
  PermuteMode permute = PermuteMode::standard;
  int64_t moe_index = 0;       // this layer's slot in the routing stash
  int64_t num_moe_layers = 1;  // the z-loss is the mean over MoE layers
  bool zero_centered_norm = false;  // post_attention_layernorm scales by (1 + w) (Qwen3.5)
  // Route by the micro-batch's routing (MicroBatch::routing, layer moe_index) instead of the
  // router's own top-k; probabilities from this model's logits (primitives.router_replay).
  // Training forwards need the routing; an evaluation forward without it routes itself.
  bool replay_routing = false;
  // Token-chunked MoE (ModelOptions::moe_token_chunks): the routed path (permute, dispatch,
  // experts, combine, unpermute) runs over the micro-batch's tokens in this many sequential
  // chunks of near-equal size, so that its buffers (category moe) hold one chunk's rows, not
  // the whole micro-batch's. Routing, the shared expert and the norm stay whole. 1 = off.
  int64_t token_chunks = 1;
};

class MoeBlock final : public Block {
 public:
  MoeBlock(ParamStore& store, ParamUnit& dense_unit, ParamUnit& expert_unit,
           const std::string& prefix, const MoeBlockConfig& cfg,
           std::unique_ptr<Dispatcher> dispatcher);
  const char* kind() const override { return "moe"; }
  std::unique_ptr<BlockSaved> make_saved() const override;
  Tensor forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) override;
  Tensor backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) override;

  const MoeBlockConfig& config() const { return cfg_; }
  Dispatcher& dispatcher() { return *dispatcher_; }

 private:
  // The micro-batch's routing of this layer ([T, K] on `dev`) and its per-expert counts.
  RouterReplay routing_from_batch(const BatchContext& ctx, int64_t T, Device dev) const;

  struct Saved;
  struct Chunk;
  RouterConfig router_config() const;
  // Tokens [first, first + count) of token chunk c of a T-token micro-batch.
  std::pair<int64_t, int64_t> chunk_span(int64_t c, int64_t T) const;
  // Whether a chunk must run even without tokens of this rank (its dispatcher moves rows over
  // ranks, so every rank makes every call).
  bool collective() const;
  // Permute -> dispatch -> experts of token chunk c into `ch` (forward_for_backward when
  // for_backward with the memory_efficient permute: no fc2, no combine); returns the combined
  // y_perm of the chunk, or undefined. Fills the chunk's counts and plan in S when unknown.
  Tensor route_chunk(Saved& S, int64_t c, BatchContext& ctx, Chunk& ch, bool for_backward);
  // The expert MLPs as the dispatcher calls them; wgrad goes through block::weight_grad(ctx,
  // saved), so ctx and saved must outlive the dispatcher call.
  ExpertCalls expert_calls(BatchContext& ctx, BlockSaved& saved);
  MoeBlockConfig cfg_;
  std::unique_ptr<Dispatcher> dispatcher_;
  Param *ln_ = nullptr, *router_ = nullptr, *experts_gate_up_ = nullptr, *experts_down_ = nullptr;
  Param *shared_gate_up_ = nullptr, *shared_down_ = nullptr, *shared_gate_ = nullptr;
};

}  // namespace bb
