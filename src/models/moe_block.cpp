// moe_block.cpp — the MoE residual block (moe_block.h). Backward convention as every block:
// d_x written; weight gradients (router, experts, shared expert) added now or queued (block.h);
// the norm weight's gradient fused with d_x.
#include "models/moe_block.h"

#include "core/trace.h"
#include "primitives/activation/swiglu.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/linear/linear.h"
#include "primitives/moe/aux_loss.h"
#include "primitives/norm/rmsnorm.h"

namespace bb {

struct MoeBlock::Chunk {
  PermuteMap map;          // this chunk's tokens' rows grouped by expert
  DispatchState dispatch;  // the experts' rows [M, H], probabilities [M], saved intermediates
  Tensor y_perm;           // [N_c, H] the combined expert outputs (standard permute only)
};

struct MoeBlock::Saved final : BlockSaved {
  Tensor x, h;  // block input, norm output [T, H]
  RMSNormSaved rms;
  Tensor logits;      // [T, E] f32 router logits
  RouterSaved router;
  Tensor topk_idx;    // [T, K] i32
  Tensor topk_prob;   // [T, K] f32
  // The routed rows, one entry per token chunk. Empty when rebuild_chunks: a token-chunked
  // full-recompute forward keeps none, and backward_data rebuilds each chunk before its backward.
  std::vector<Chunk> chunks;
  bool rebuild_chunks = false;
  // Per token chunk: its per-expert counts (host; empty = not known yet, read back by
  // make_permute_map) and its dispatch plan (null = not made yet).
  std::vector<std::vector<int64_t>> chunk_counts;
  std::vector<std::shared_ptr<const DispatchPlan>> chunk_plans;
  Tensor s_gate_up, s_act, s_out, s_gate;  // shared expert; s_gate = sigmoid(gate logit) [T]
};

MoeBlock::MoeBlock(ParamStore& store, ParamUnit& dense_unit, ParamUnit& expert_unit,
                   const std::string& prefix, const MoeBlockConfig& cfg,
                   std::unique_ptr<Dispatcher> dispatcher)
    : cfg_(cfg), dispatcher_(std::move(dispatcher)) {
  const int64_t H = cfg.hidden, E = cfg.num_experts, F = cfg.expert_ffn;
  BB_CHECK(dispatcher_, "MoeBlock: no dispatcher");
  BB_CHECK(H > 0 && E > 0 && F > 0 && cfg.top_k >= 1 && cfg.top_k <= E,
           "MoeBlock: bad shape (hidden ", H, ", experts ", E, ", top-k ", cfg.top_k, ", ffn ", F,
           ")");
  BB_CHECK(cfg.token_chunks >= 1 && cfg.token_chunks <= kMaxMoeTokenChunks, "MoeBlock: token_chunks = ",
           cfg.token_chunks, " is not in [1, ", kMaxMoeTokenChunks, "]");
  expert_unit.num_experts = dispatcher_->num_local_experts(E);
  expert_unit.first_expert = dispatcher_->first_local_expert(E);
  const int64_t El = expert_unit.num_experts;
  ln_ = &store.add(dense_unit, prefix + "post_attention_layernorm.weight", {H}, false,
                   HfSplit::none, cfg.zero_centered_norm ? ParamInit::zeros : ParamInit::ones);
  router_ = &store.add(dense_unit, prefix + "mlp.gate.weight", {E, H}, true);
  experts_gate_up_ = &store.add(expert_unit, prefix + "mlp.experts.gate_up_proj", {El, 2 * F, H},
                                true, HfSplit::experts_gate_up);
  experts_down_ = &store.add(expert_unit, prefix + "mlp.experts.down_proj", {El, H, F}, true,
                             HfSplit::experts_down);
  // The experts' backward writes every expert's slice on its first touch of a step.
  experts_gate_up_->lazy_zero_grad = experts_down_->lazy_zero_grad = true;
  if (cfg.shared_ffn > 0) {
    const int64_t S = cfg.shared_ffn;
    shared_gate_up_ = &store.add(dense_unit, prefix + "mlp.shared_expert.gate_up_proj", {2 * S, H},
                                 true, HfSplit::gate_up);
    shared_down_ = &store.add(dense_unit, prefix + "mlp.shared_expert.down_proj.weight", {H, S},
                              true);
    shared_gate_ = &store.add(dense_unit, prefix + "mlp.shared_expert_gate.weight", {1, H}, true);
  }
}

std::unique_ptr<BlockSaved> MoeBlock::make_saved() const { return std::make_unique<Saved>(); }

std::pair<int64_t, int64_t> MoeBlock::chunk_span(int64_t c, int64_t T) const {
  const int64_t C = cfg_.token_chunks;
  const int64_t first = c * T / C, last = (c + 1) * T / C;
  return {first, last - first};
}

bool MoeBlock::collective() const { return dispatcher_->num_local_experts(cfg_.num_experts) < cfg_.num_experts; }

Tensor MoeBlock::route_chunk(Saved& S, int64_t c, BatchContext& ctx, Chunk& ch, bool for_backward) {
  BB_RANGE("moe_token_chunk");
  const auto [t0, tc] = chunk_span(c, S.topk_idx.size(0));
  const int64_t H = cfg_.hidden, K = cfg_.top_k, E = cfg_.num_experts;
  const bool mem_eff = cfg_.permute == PermuteMode::memory_efficient;
  const Device dev = S.topk_idx.device();
  std::vector<int64_t>& counts = S.chunk_counts[static_cast<size_t>(c)];
  Tensor x_perm, row_prob;
  if (tc == 0) {  // no tokens of this rank in the chunk: its collectives with zero rows
    ch.map.num_tokens = 0;
    ch.map.top_k = K;
    ch.map.num_experts = E;
    ch.map.row_token = Tensor::empty({0}, DType::i32, dev, MemCategory::moe);
    ch.map.slot_row = Tensor::empty({0, K}, DType::i32, dev, MemCategory::moe);
    ch.map.tokens_per_expert.assign(static_cast<size_t>(E), 0);
    x_perm = Tensor::empty({0, H}, S.x.dtype(), dev, MemCategory::moe);
    if (mem_eff) row_prob = Tensor::empty({0}, DType::f32, dev, MemCategory::moe);
  } else {
    ch.map = make_permute_map(S.topk_idx.narrow(t0, tc), E, counts.empty() ? nullptr : &counts);
    x_perm = permute_forward(S.h.narrow(t0, tc), ch.map);
    if (mem_eff) row_prob = permute_probs(S.topk_prob.narrow(t0, tc), ch.map);
  }
  if (counts.empty()) counts = ch.map.tokens_per_expert;
  // A plan made for these rows earlier (the training forward's, for a recompute or a rebuild)
  // is reused: the counts are not exchanged again.
  ch.dispatch.plan = S.chunk_plans[static_cast<size_t>(c)];
  Tensor y_perm;
  if (for_backward && mem_eff)
    dispatcher_->forward_for_backward(x_perm, row_prob, ch.map.tokens_per_expert, expert_calls(ctx, S), ch.dispatch);
  else
    y_perm = dispatcher_->forward(x_perm, row_prob, ch.map.tokens_per_expert, expert_calls(ctx, S), ch.dispatch);
  S.chunk_plans[static_cast<size_t>(c)] = ch.dispatch.plan;
  return y_perm;
}

ExpertCalls MoeBlock::expert_calls(BatchContext& ctx, BlockSaved& saved) {
  // The weights are read when a call runs (state sharding rebinds them around the layer).
  const ExpertsImpl impl = cfg_.experts;
  ExpertCalls c;
  c.forward = [this, impl](const Tensor& rows, const Tensor& prob, const std::vector<int64_t>& counts,
                           ExpertsSaved* s) {
    return experts_forward(impl, rows, counts, experts_gate_up_->value, experts_down_->value, prob, s);
  };
  c.rebuild = [this, impl](const Tensor& rows, const Tensor& prob, const std::vector<int64_t>& counts,
                           ExpertsSaved* s) {
    experts_forward_saved(impl, rows, counts, experts_gate_up_->value, experts_down_->value, prob, *s);
  };
  c.backward_data = [this, impl](const Tensor& d_y, const Tensor& prob, const std::vector<int64_t>& counts,
                                 const ExpertsSaved& s) {
    return experts_backward_data(impl, d_y, counts, experts_gate_up_->value, experts_down_->value, prob, s);
  };
  c.backward_weight = [this, impl, &ctx, &saved](const Tensor& d_y, const Tensor& rows, const Tensor& prob,
                                                 const std::vector<int64_t>& counts, const ExpertsSaved& s,
                                                 const Tensor& d_gate_up) {
    ExpertsDgrad wg;  // only d_gate_up is read by the weight part
    wg.d_gate_up = d_gate_up;
    block::weight_grad(ctx, saved, [this, impl, d_y, rows, prob, counts, s, wg] {
      // The first write of a step overwrites the lazily zeroed gradients (no memset before the
      // step, no read of the old values); later ones (chunks, micro-batches) add.
      // (ParamStore::zero_grad marks the unit's parameters together.)
      const bool overwrite = experts_gate_up_->grad_stale;
      BB_CHECK(experts_down_->grad_stale == overwrite, "MoeBlock: the expert gradients of ", experts_down_->name,
               " and ", experts_gate_up_->name, " disagree on being zeroed");
      experts_backward_weight(impl, d_y, rows, counts, prob, s, wg, experts_gate_up_->grad, experts_down_->grad,
                              !overwrite);
      experts_gate_up_->grad_stale = experts_down_->grad_stale = false;
    });
  };
  return c;
}

RouterConfig MoeBlock::router_config() const {
  RouterConfig r;
  r.num_experts = static_cast<int>(cfg_.num_experts);
  r.top_k = static_cast<int>(cfg_.top_k);
  r.score = cfg_.router;
  r.norm_topk_prob = cfg_.norm_topk_prob;
  return r;
}

RouterReplay MoeBlock::routing_from_batch(const BatchContext& ctx, int64_t T, Device dev) const {
  const int64_t K = cfg_.top_k, E = cfg_.num_experts, L = cfg_.num_moe_layers;
  BB_CHECK(ctx.mb && ctx.mb->routing.defined(), "MoE layer ", cfg_.moe_index,
           ": primitives.router_replay is on but the micro-batch has no routing (give rollout records with "
           "\"routing\", or set primitives.router_replay = false)");
  const Tensor& all = ctx.mb->routing;
  BB_CHECK(all.device().is_cpu() && all.dtype() == DType::i32 && all.dim() == 2 && all.size(0) == T &&
               all.size(1) == L * K,
           "MoE layer ", cfg_.moe_index, ": the micro-batch's routing is ", all.str(), ", expected i32 [", T, ", ", L * K,
           "] on the host (", L, " MoE layers x top-k ", K, " per token)");
  const int32_t* src = all.data<int32_t>();
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  RouterReplay r;
  r.tokens_per_expert.assign(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* row = src + t * L * K + cfg_.moe_index * K;
    for (int64_t k = 0; k < K; ++k) {
      BB_CHECK(row[k] >= 0 && row[k] < E, "MoE layer ", cfg_.moe_index, ": the replayed routing sends token ", t,
               " to expert ", row[k], ", outside [0, ", E, ")");
      for (int64_t j = 0; j < k; ++j)
        BB_CHECK(row[j] != row[k], "MoE layer ", cfg_.moe_index, ": the replayed routing sends token ", t,
                 " to expert ", row[k], " twice");
      idx[static_cast<size_t>(t * K + k)] = row[k];
      ++r.tokens_per_expert[static_cast<size_t>(row[k])];
    }
  }
  r.topk_idx = Tensor::from_ints(idx, {T, K}, MemCategory::activations).to(dev, MemCategory::activations);
  return r;
}

Tensor MoeBlock::forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) {
  BB_RANGE("moe_block_forward");
  Saved local;
  Saved& S = saved ? static_cast<Saved&>(*saved) : local;
  const int64_t T = x.size(0), E = cfg_.num_experts;
  const RouterConfig rc = router_config();
  const bool mem_eff = cfg_.permute == PermuteMode::memory_efficient;
  // The caller discards the output (the full-recompute forward, ctx.output_unused): keep only
  // what backward_data reads. It reads the experts' rows, row_prob and gate_up/act (so the rows
  // are dispatched again and fc1 + activation run), y_perm with the standard permute (d_prob
  // = <d_out, y_perm>: fc2 and the combine must run there), and the shared expert's s_gate_up,
  // s_act, s_out and s_gate; it never reads the unpermuted sum, the gated shared output or the
  // block output. So with memory_efficient the routed path stops before fc2 (no combine), and
  // with either permute the unpermute, the shared expert's gating and the residual add are
  // skipped.
  const bool rebuild_only = saved && ctx.output_unused;
  S.x = x;
  S.h = rmsnorm_forward(x, ln_->value, cfg_.rms_norm_eps, &S.rms, MemCategory::activations,
                        cfg_.zero_centered_norm);

  // Route (once per micro-batch: a recompute replays the stashed selection).
  S.logits = Tensor::empty({T, E}, DType::f32, x.device(), MemCategory::activations);
  matmul(S.h, false, router_->value, true, S.logits);
  RoutingStash::Entry* slot = nullptr;
  if (ctx.routing) {
    BB_CHECK(cfg_.moe_index < static_cast<int64_t>(ctx.routing->layers.size()),
             "MoE block: routing stash has ", ctx.routing->layers.size(), " entries, layer needs ",
             cfg_.moe_index + 1);
    slot = &ctx.routing->layers[static_cast<size_t>(cfg_.moe_index)];
  }
  if (slot && slot->logit_bias.defined()) {
    BB_CHECK(slot->logit_bias.shape() == S.logits.shape(), "MoE block: the routing bias of MoE layer ",
             cfg_.moe_index, " is ", slot->logit_bias.str(), " for logits ", S.logits.str());
    add_inplace(S.logits, slot->logit_bias);
  }
  RouterOutput r;
  if (ctx.pass == Pass::recompute) {
    BB_CHECK(slot && slot->valid, "MoE block: a recompute pass needs the routing that the first "
             "forward of this micro-batch stashed, and there is none");
    const RouterReplay replay{slot->topk_idx, slot->tokens_per_expert};
    r = router_forward(S.logits, Tensor(), rc, &S.router, &replay);
    ++slot->replays;
  } else {
    // Replay in training; a forward-only pass (generation, log-probs) of a micro-batch without
    // routing routes itself (it is what records the routing for R2).
    if (cfg_.replay_routing && (ctx.pass == Pass::train || (ctx.mb && ctx.mb->routing.defined()))) {
      // Router replay: the data's experts for this layer; probabilities from this model's logits.
      const RouterReplay given = routing_from_batch(ctx, T, x.device());
      r = router_forward(S.logits, Tensor(), rc, &S.router, &given);
    } else {
      r = router_forward(S.logits, Tensor(), rc, &S.router);
    }
    if (slot) {
      slot->topk_idx = r.topk_idx;
      slot->tokens_per_expert = r.tokens_per_expert;
      slot->valid = true;
      slot->replays = 0;
    }
    if (ctx.aux) ctx.aux->add(S.router.scores, r.tokens_per_expert);
    if (ctx.stats) ctx.stats->z_loss += r.z_loss / static_cast<double>(cfg_.num_moe_layers);
  }
  S.topk_idx = r.topk_idx;
  S.topk_prob = r.topk_prob;

  // Permute -> dispatch -> experts -> combine -> unpermute, per token chunk (the dispatcher runs
  // the experts on the rows it brings, in as many chunks as it moves them).
  const int64_t C = cfg_.token_chunks;
  if (ctx.pass == Pass::recompute && slot && static_cast<int64_t>(slot->chunk_counts.size()) == C) {
    // A recompute moves the rows as the training forward did (the same replayed routing): the
    // forward's counts and dispatch plans are handed back, so nothing is read back or exchanged.
    S.chunk_counts = slot->chunk_counts;
    S.chunk_plans = slot->chunk_plans;
  } else {
    S.chunk_counts.assign(static_cast<size_t>(C), {});
    S.chunk_plans.assign(static_cast<size_t>(C), nullptr);
    if (C == 1) S.chunk_counts[0] = r.tokens_per_expert;
  }
  // Token-chunked under full recompute: keep no routed rows; backward_data rebuilds each chunk.
  S.rebuild_chunks = rebuild_only && C > 1;
  Tensor out;
  if (!S.rebuild_chunks) {
    S.chunks.clear();
    if (saved) S.chunks.resize(static_cast<size_t>(C));
    for (int64_t c = 0; c < C; ++c) {
      const auto [t0, tc] = chunk_span(c, T);
      if (tc == 0 && !collective()) continue;
      Chunk local_chunk;
      Chunk& ch = saved ? S.chunks[static_cast<size_t>(c)] : local_chunk;
      Tensor y_perm = route_chunk(S, c, ctx, ch, /*for_backward=*/rebuild_only);
      if (ctx.stats && ctx.pass != Pass::recompute) ctx.stats->moe_rows_received += ch.dispatch.num_rows();
      if (!rebuild_only && tc > 0) {
        Tensor o = unpermute_forward(y_perm, ch.map, mem_eff ? Tensor() : S.topk_prob.narrow(t0, tc));
        if (C == 1) {
          out = o;
        } else {
          if (!out.defined()) out = Tensor::empty({T, cfg_.hidden}, o.dtype(), x.device(), MemCategory::activations);
          Tensor rows = out.narrow(t0, tc);
          rows.copy_from(o);
        }
      }
      if (!mem_eff) ch.y_perm = y_perm;  // unpermute's backward needs it to form d_prob
      if (saved && ctx.recompute_drop.has(RecomputePart::moe_experts)) ch.dispatch.experts = ExpertsSaved{};
    }
  }
  if (ctx.pass == Pass::train && slot) {
    slot->chunk_counts = S.chunk_counts;
    slot->chunk_plans = S.chunk_plans;
  }

  if (shared_gate_up_) {
    S.s_gate_up = linear_forward(S.h, shared_gate_up_->value, Tensor());
    S.s_act = swiglu_forward(S.s_gate_up);
    S.s_out = linear_forward(S.s_act, shared_down_->value, Tensor());
    S.s_gate = sigmoid(linear_forward(S.h, shared_gate_->value, Tensor()), MemCategory::activations);
    if (!rebuild_only) {
      Tensor gated = scale_rows(S.s_out, S.s_gate, MemCategory::activations);
      Tensor mo = out.dtype() == DType::f32 ? out : out.to_dtype(DType::f32);
      add_inplace(mo, gated);
      out = mo;
    }
  }
  if (saved) {  // selective recompute: backward_data rebuilds what is dropped here
    const RecomputeParts& drop = ctx.recompute_drop;
    if (drop.has(RecomputePart::shared_expert)) S.s_gate_up = S.s_act = Tensor();
    if (drop.has(RecomputePart::norms)) S.h = Tensor();
  }
  if (rebuild_only) return Tensor();
  return block::as_dtype(add(x, out, MemCategory::activations), x.dtype());
}

Tensor MoeBlock::backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) {
  BB_RANGE("moe_block_backward");
  Saved& S = static_cast<Saved&>(saved);
  const RouterConfig rc = router_config();
  const bool mem_eff = cfg_.permute == PermuteMode::memory_efficient;

  const int64_t T = S.x.size(0), K = cfg_.top_k, C = cfg_.token_chunks;
  if (S.rebuild_chunks && !S.h.defined())
    S.h = rmsnorm_forward(S.x, ln_->value, cfg_.rms_norm_eps, nullptr, MemCategory::activations,
                          cfg_.zero_centered_norm);
  // Unpermute -> combine -> experts -> dispatch -> permute, backwards, per token chunk.
  Tensor d_out = block::as_dtype(d_y, S.x.dtype());
  Tensor d_h, d_topk_prob;  // [T, H] f32, [T, K] f32
  for (int64_t c = 0; c < C; ++c) {
    const auto [t0, tc] = chunk_span(c, T);
    if (tc == 0 && !collective()) continue;
    Chunk rebuilt;
    Chunk& ch = S.rebuild_chunks ? rebuilt : S.chunks[static_cast<size_t>(c)];
    if (S.rebuild_chunks) {  // this chunk's rows, as the training forward moved them
      Tensor y_perm = route_chunk(S, c, ctx, ch, /*for_backward=*/true);
      if (!mem_eff) ch.y_perm = y_perm;
    }
    // Selective recompute of `moe_experts`: the fc1 output and activation of the rows the
    // experts received, rebuilt without fc2 (its output would be discarded).
    if (!ch.dispatch.experts.gate_up.defined())
      experts_forward_saved(cfg_.experts, ch.dispatch.rows, ch.dispatch.tokens_per_local_expert,
                            experts_gate_up_->value, experts_down_->value, ch.dispatch.row_prob,
                            ch.dispatch.experts);
    if (tc == 0) {  // no rows of this rank: only the chunk's collectives, with zero rows
      dispatcher_->backward(Tensor::empty({0, cfg_.hidden}, d_out.dtype(), d_out.device(), MemCategory::moe),
                            expert_calls(ctx, S), ch.dispatch);
      ch = Chunk{};
      continue;
    }
    const Tensor prob = S.topk_prob.narrow(t0, tc);
    UnpermuteGrads ug = unpermute_backward(d_out.narrow(t0, tc), ch.y_perm, ch.map, mem_eff ? Tensor() : prob);
    ch.y_perm = Tensor();
    DispatchRows back = dispatcher_->backward(ug.d_y_perm, expert_calls(ctx, S), ch.dispatch);
    ch.dispatch = DispatchState{};
    ug.d_y_perm = Tensor();
    Tensor dp = mem_eff ? unpermute_probs_grad(back.row_prob, ch.map) : ug.d_topk_prob;
    // d_h continues in f32 (the router's and shared expert's data gradients add into it): the
    // gather writes the f32 sum itself instead of rounding it to the rows' dtype and widening.
    Tensor dh = permute_backward(back.rows, ch.map, /*out_f32=*/true);
    ch = Chunk{};
    if (C == 1) {
      d_h = dh;
      d_topk_prob = dp;
    } else {
      if (!d_h.defined()) {
        d_h = Tensor::empty({T, cfg_.hidden}, DType::f32, d_out.device(), MemCategory::activations);
        d_topk_prob = Tensor::empty({T, K}, DType::f32, d_out.device(), MemCategory::activations);
      }
      Tensor h_rows = d_h.narrow(t0, tc), p_rows = d_topk_prob.narrow(t0, tc);
      h_rows.copy_from(dh);
      p_rows.copy_from(dp);
    }
  }
  S.chunks.clear();
  d_out = Tensor();

  // Selective recompute of `norms` / `shared_expert`, rebuilt where they are first needed.
  if (!S.h.defined())
    S.h = rmsnorm_forward(S.x, ln_->value, cfg_.rms_norm_eps, nullptr, MemCategory::activations,
                          cfg_.zero_centered_norm);
  if (shared_gate_up_ && !S.s_act.defined()) {
    S.s_gate_up = linear_forward(S.h, shared_gate_up_->value, Tensor());
    S.s_act = swiglu_forward(S.s_gate_up);
  }

  // Route: the combine weights' gradient, the z-loss and the pooled aux loss.
  Tensor d_logits = router_backward(d_topk_prob, 0.0, ctx.z_grad, S.logits, rc, S.router);
  if (ctx.aux) ctx.aux->add_grad(d_logits, S.router.scores, ctx.aux_grad);
  block::linear_backward_acc(ctx, S, d_logits, S.h, router_, nullptr, d_h);

  if (shared_gate_up_) {
    // out += g * s_out, g = sigmoid(h . w_gate)
    Tensor d_sout = scale_rows(d_y, S.s_gate, MemCategory::activations);
    Tensor dgl = sigmoid_gate_backward(d_y, S.s_out, S.s_gate, MemCategory::activations);
    block::linear_backward_acc(ctx, S, dgl, S.h, shared_gate_, nullptr, d_h);
    Tensor d_sact = block::linear_backward(ctx, S, d_sout, S.s_act, shared_down_, nullptr);
    Tensor d_sgu = swiglu_backward(d_sact, S.s_gate_up);
    block::linear_backward_acc(ctx, S, d_sgu, S.h, shared_gate_up_, nullptr, d_h);
  }
  return block::norm_backward_with_skip(d_h, S.x, ln_, S.rms, cfg_.zero_centered_norm, d_y);
}

}  // namespace bb
