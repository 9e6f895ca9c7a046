// mlp_block.h — the dense SwiGLU MLP as a residual block:
//   h = RMSNorm(x);  y = x + W_down swiglu(W_gate_up h)
// With ctx.output_unused (the full-recompute forward) it stops after the activation (backward
// never reads W_down's output) and returns an undefined tensor.
// Parameters under `prefix` (e.g. "model.layers.0."): post_attention_layernorm.weight [H];
// mlp.gate_up_proj [2I, H] (Hugging Face gate_proj rows then up_proj rows); mlp.down_proj.weight
// [H, I]. Legend: T tokens, H hidden, I ffn dim.
#pragma once

#include "models/block.h"
#include "primitives/norm/rmsnorm.h"

namespace bb {

class MlpBlock final : public Block {
 public:
  MlpBlock(ParamStore& store, ParamUnit& unit, const std::string& prefix, int64_t hidden,
           int64_t ffn, double rms_norm_eps);
  const char* kind() const override { return "mlp"; }
  std::unique_ptr<BlockSaved> make_saved() const override;
  Tensor forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) override;
  Tensor backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) override;

 private:
  struct Saved;
  double eps_;
  Param *ln_ = nullptr, *gate_up_ = nullptr, *down_ = nullptr;
};

}  // namespace bb
