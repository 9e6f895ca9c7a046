// attention_block.cpp — the attention residual block (attention_block.h). Backward convention:
// d_x WRITTEN; the norm weights' gradients added in backward_data (fused with d_x), the
// projection gradients through block::linear_backward (now or queued, block.h).
#include "models/attention_block.h"

#include <cmath>

#include "core/trace.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/linear/linear.h"
#include "primitives/rope/rope.h"

namespace bb {

struct AttentionBlock::Saved final : BlockSaved {
  Tensor x;               // [T, H] block input
  Tensor h1;              // [T, H] norm output
  RMSNormSaved rms, qn, kn;
  Tensor q_pre, k_pre, v;  // [T, Hq|Hkv, D] projections (before QK norm)
  Tensor gate;            // [T, Hq * D] output-gate logits (output_gate only)
  Tensor q_rot, k_rot;    // after norm + RoPE: the attention inputs
  Tensor o;               // [T, Hq, D] attention output
  Tensor o_gated;         // [T, Hq * D] o * sigmoid(gate), the o_proj input (output_gate only)
  AttentionSaved attn;
};

AttentionBlock::AttentionBlock(ParamStore& store, ParamUnit& unit, const std::string& prefix,
                               const AttentionBlockConfig& cfg, std::unique_ptr<SelfAttention> attention)
    : cfg_(cfg), attn_(attention ? std::move(attention) : make_sdpa_attention({})) {
  const int64_t H = cfg.hidden, D = cfg.head_dim, Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
  BB_CHECK(H > 0 && D > 0 && Hq > 0 && Hkv > 0 && Hq % Hkv == 0,
           "AttentionBlock: bad shape (hidden ", H, ", heads ", Hq, ", kv heads ", Hkv,
           ", head dim ", D, ")");
  BB_CHECK(cfg.rotary_dim >= 0 && cfg.rotary_dim <= D && cfg.rotary_dim % 2 == 0,
           "AttentionBlock: rotary_dim ", cfg.rotary_dim, " must be even and in [0, ", D, "]");
  const std::string a = prefix + "self_attn.";
  const ParamInit norm_init = cfg.zero_centered_norm ? ParamInit::zeros : ParamInit::ones;
  ln_ = &store.add(unit, prefix + "input_layernorm.weight", {H}, false, HfSplit::none, norm_init);
  wq_ = &store.add(unit, a + "q_proj.weight", {Hq * D * (cfg.output_gate ? 2 : 1), H}, true);
  wk_ = &store.add(unit, a + "k_proj.weight", {Hkv * D, H}, true);
  wv_ = &store.add(unit, a + "v_proj.weight", {Hkv * D, H}, true);
  wo_ = &store.add(unit, a + "o_proj.weight", {H, Hq * D}, true);
  if (cfg.qkv_bias) {
    bq_ = &store.add(unit, a + "q_proj.bias", {Hq * D * (cfg.output_gate ? 2 : 1)}, false,
                     HfSplit::none, ParamInit::zeros);
    bk_ = &store.add(unit, a + "k_proj.bias", {Hkv * D}, false, HfSplit::none, ParamInit::zeros);
    bv_ = &store.add(unit, a + "v_proj.bias", {Hkv * D}, false, HfSplit::none, ParamInit::zeros);
  }
  if (cfg.qk_norm) {
    q_norm_ = &store.add(unit, a + "q_norm.weight", {D}, false, HfSplit::none, norm_init);
    k_norm_ = &store.add(unit, a + "k_norm.weight", {D}, false, HfSplit::none, norm_init);
  }
}

std::unique_ptr<BlockSaved> AttentionBlock::make_saved() const {
  return std::make_unique<Saved>();
}

Tensor AttentionBlock::forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) {
  BB_RANGE("attention_block_forward");
  const int64_t T = x.size(0), D = cfg_.head_dim, Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
  const MicroBatch& mb = *ctx.mb;
  const RopeConfig rope{cfg_.rope_theta, cfg_.rotary_dim};
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  Saved local;
  Saved& S = saved ? static_cast<Saved&>(*saved) : local;
  S.x = x;
  const bool zc = cfg_.zero_centered_norm;
  S.h1 = rmsnorm_forward(x, ln_->value, cfg_.rms_norm_eps, &S.rms, MemCategory::activations, zc);
  Tensor q = linear_forward(S.h1, wq_->value, bq_ ? bq_->value : Tensor());
  if (cfg_.output_gate) {
    auto [qh, gh] = split_halves(q.view({T * Hq, 2 * D}), MemCategory::activations);
    S.q_pre = qh.view({T, Hq, D});
    S.gate = gh.view({T, Hq * D});
  } else {
    S.q_pre = q.view({T, Hq, D});
  }
  S.k_pre = linear_forward(S.h1, wk_->value, bk_ ? bk_->value : Tensor()).view({T, Hkv, D});
  S.v = linear_forward(S.h1, wv_->value, bv_ ? bv_->value : Tensor()).view({T, Hkv, D});
  Tensor qn = q_norm_ ? qk_norm_forward(S.q_pre, q_norm_->value, cfg_.rms_norm_eps, &S.qn,
                                       MemCategory::activations, zc)
                      : S.q_pre;
  Tensor kn = k_norm_ ? qk_norm_forward(S.k_pre, k_norm_->value, cfg_.rms_norm_eps, &S.kn,
                                       MemCategory::activations, zc)
                      : S.k_pre;
  S.q_rot = rope_forward(qn, mb.positions, rope);
  S.k_rot = rope_forward(kn, mb.positions, rope);
  S.o = attn_->forward(S.q_rot, S.k_rot, S.v, mb, scale, &S.attn);
  Tensor o_in = block::flat(S.o);
  if (cfg_.output_gate) {
    S.o_gated = sigmoid_mul(o_in, S.gate, MemCategory::activations);
    o_in = S.o_gated;
  }
  Tensor out = linear_forward(o_in, wo_->value, Tensor());
  o_in = Tensor();
  if (saved) {  // selective recompute: backward_data rebuilds what is dropped here
    const RecomputeParts& drop = ctx.recompute_drop;
    if (drop.has(RecomputePart::norms)) S.h1 = Tensor();
    if (drop.has(RecomputePart::attention)) S.q_rot = S.k_rot = S.o_gated = Tensor();
    if (drop.has(RecomputePart::core_attention)) {
      S.o = S.o_gated = Tensor();
      S.attn = AttentionSaved{};
    }
  }
  return block::as_dtype(add(x, out, MemCategory::activations), x.dtype());
}

void AttentionBlock::rebuild(const BatchContext& ctx, BlockSaved& saved) const {
  // The forward's own calls on the kept inputs: bit-identical to what it dropped.
  Saved& S = static_cast<Saved&>(saved);
  const MicroBatch& mb = *ctx.mb;
  const RopeConfig rope{cfg_.rope_theta, cfg_.rotary_dim};
  const bool zc = cfg_.zero_centered_norm;
  if (!S.q_rot.defined()) {
    RMSNormSaved qn, kn;
    S.q_rot = rope_forward(q_norm_ ? qk_norm_forward(S.q_pre, q_norm_->value, cfg_.rms_norm_eps,
                                                     &qn, MemCategory::activations, zc)
                                   : S.q_pre,
                           mb.positions, rope);
    S.k_rot = rope_forward(k_norm_ ? qk_norm_forward(S.k_pre, k_norm_->value, cfg_.rms_norm_eps,
                                                     &kn, MemCategory::activations, zc)
                                   : S.k_pre,
                           mb.positions, rope);
  }
  if (!S.o.defined()) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
    S.o = attn_->forward(S.q_rot, S.k_rot, S.v, mb, scale, &S.attn);
  }
  if (cfg_.output_gate && !S.o_gated.defined())
    S.o_gated = sigmoid_mul(block::flat(S.o), S.gate, MemCategory::activations);
}

Tensor AttentionBlock::backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) {
  BB_RANGE("attention_block_backward");
  Saved& S = static_cast<Saved&>(saved);
  rebuild(ctx, S);
  const MicroBatch& mb = *ctx.mb;
  const int64_t T = d_y.size(0), D = cfg_.head_dim, Hq = cfg_.num_heads;
  const RopeConfig rope{cfg_.rope_theta, cfg_.rotary_dim};
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const DType act = S.o.dtype();

  Tensor d_o;  // [T, Hq, D]
  Tensor d_gate;
  if (cfg_.output_gate) {
    Tensor d_in = block::linear_backward(ctx, S, d_y, S.o_gated, wo_, nullptr);
    auto [dx, dz] = sigmoid_mul_backward(d_in, block::flat(S.o), S.gate);
    d_o = block::as_dtype(dx, act).view({T, Hq, D});
    d_gate = dz;
  } else {
    d_o = block::linear_backward(ctx, S, d_y, block::flat(S.o), wo_, nullptr, act)
              .view({T, Hq, D});
  }
  AttentionGrads ag = attn_->backward(d_o, S.q_rot, S.k_rot, S.v, S.o, mb, scale, S.attn);
  Tensor d_qn = rope_backward(ag.dq, mb.positions, rope);
  Tensor d_kn = rope_backward(ag.dk, mb.positions, rope);
  const bool zc = cfg_.zero_centered_norm;
  // The projections take their data gradients in the weights' dtype: the norms write it directly
  // (one rounding of the same f32 values). With the output gate the query joins the gate's
  // gradient in f32 first.
  const DType dq_dtype = cfg_.output_gate ? DType::f32 : wq_->value.dtype();
  Tensor d_q = q_norm_ ? qk_norm_backward(d_qn, S.q_pre, q_norm_->value, S.qn, q_norm_->grad, zc,
                                          dq_dtype)
                       : d_qn;
  Tensor d_k = k_norm_ ? qk_norm_backward(d_kn, S.k_pre, k_norm_->value, S.kn, k_norm_->grad, zc,
                                          wk_->value.dtype())
                       : d_kn;
  if (cfg_.output_gate)  // back to q_proj's [T, Hq * 2D] (query, gate per head)
    d_q = join_halves(d_q.view({T * Hq, D}), d_gate.view({T * Hq, D}), DType::f32,
                      MemCategory::activations)
              .view({T, Hq * 2 * D});
  if (!S.h1.defined())  // selective recompute of `norms`: rebuilt where it is first needed
    S.h1 =
        rmsnorm_forward(S.x, ln_->value, cfg_.rms_norm_eps, nullptr, MemCategory::activations, zc);
  Tensor d_h1 = block::linear_backward(ctx, S, block::flat(d_q), S.h1, wq_, bq_);
  block::linear_backward_acc(ctx, S, block::flat(d_k), S.h1, wk_, bk_, d_h1);
  block::linear_backward_acc(ctx, S, block::flat(ag.dv), S.h1, wv_, bv_, d_h1);
  return block::norm_backward_with_skip(d_h1, S.x, ln_, S.rms, zc, d_y);
}

}  // namespace bb
