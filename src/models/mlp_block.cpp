// mlp_block.cpp — the dense MLP residual block (mlp_block.h). Backward convention as every
// block: d_x written, weight gradients added (now or queued, block.h).
#include "models/mlp_block.h"

#include "core/trace.h"
#include "primitives/activation/swiglu.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/linear/linear.h"

namespace bb {

struct MlpBlock::Saved final : BlockSaved {
  Tensor x, h;  // block input, norm output [T, H]
  RMSNormSaved rms;
  Tensor gate_up, act;  // [T, 2I], [T, I]
};

MlpBlock::MlpBlock(ParamStore& store, ParamUnit& unit, const std::string& prefix, int64_t hidden,
                   int64_t ffn, double rms_norm_eps)
    : eps_(rms_norm_eps) {
  ln_ = &store.add(unit, prefix + "post_attention_layernorm.weight", {hidden}, false,
                   HfSplit::none, ParamInit::ones);
  gate_up_ = &store.add(unit, prefix + "mlp.gate_up_proj", {2 * ffn, hidden}, true, HfSplit::gate_up);
  down_ = &store.add(unit, prefix + "mlp.down_proj.weight", {hidden, ffn}, true);
}

std::unique_ptr<BlockSaved> MlpBlock::make_saved() const { return std::make_unique<Saved>(); }

Tensor MlpBlock::forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) {
  BB_RANGE("mlp_block_forward");
  Saved local;
  Saved& S = saved ? static_cast<Saved&>(*saved) : local;
  S.x = x;
  S.h = rmsnorm_forward(x, ln_->value, eps_, &S.rms);
  S.gate_up = linear_forward(S.h, gate_up_->value, Tensor());
  S.act = swiglu_forward(S.gate_up);
  // Output discarded (the full-recompute forward): backward reads x, h, rms, gate_up and act,
  // never the down projection's output.
  if (saved && ctx.output_unused) return Tensor();
  Tensor out = linear_forward(S.act, down_->value, Tensor());
  if (saved) {  // selective recompute: backward_data rebuilds what is dropped here
    if (ctx.recompute_drop.has(RecomputePart::mlp)) S.gate_up = S.act = Tensor();
    if (ctx.recompute_drop.has(RecomputePart::norms)) S.h = Tensor();
  }
  return block::as_dtype(add(x, out, MemCategory::activations), x.dtype());
}

Tensor MlpBlock::backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) {
  BB_RANGE("mlp_block_backward");
  Saved& S = static_cast<Saved&>(saved);
  // Selective recompute: the forward's own calls on what it kept (bit-identical).
  if (!S.h.defined()) S.h = rmsnorm_forward(S.x, ln_->value, eps_, nullptr);
  if (!S.act.defined()) {
    S.gate_up = linear_forward(S.h, gate_up_->value, Tensor());
    S.act = swiglu_forward(S.gate_up);
  }
  Tensor d_act = block::linear_backward(ctx, S, d_y, S.act, down_, nullptr);
  Tensor d_gu = swiglu_backward(d_act, S.gate_up);
  Tensor d_h = block::linear_backward(ctx, S, d_gu, S.h, gate_up_, nullptr);
  return block::norm_backward_with_skip(d_h, S.x, ln_, S.rms, /*zero_centered=*/false, d_y);
}

}  // namespace bb
