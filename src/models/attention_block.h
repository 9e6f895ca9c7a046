// attention_block.h — the full-attention token mixer as a residual block:
//   h = RMSNorm(x);  q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)
//   [q_norm / k_norm per head]  ->  RoPE on the first rotary_dim dims of each head
//   o = attention(q, k, v)  (the attention family's member: causal GQA over the packed sequences,
//                            context-parallel members across ranks; context_parallel.h)
//   [output gate: o *= sigmoid(g), g from q_proj's second half per head]
//   y = x + o Wo^T
// Parameters (Hugging Face names under `prefix`, e.g. "model.layers.3."):
//   input_layernorm.weight [H]; self_attn.{q,k,v,o}_proj.weight; q/k/v biases (qkv_bias);
//   self_attn.{q,k}_norm.weight [D] (qk_norm). With output_gate, q_proj is [Hq * 2D, H] and each
//   head's 2D outputs are [query (D), gate (D)] (the Qwen3-Next / Qwen3.5 layout: transformers
//   views q_proj's output as [T, Hq, 2D] and chunks the last dim; the gate is then flattened
//   [T, Hq * D] like the attention output it multiplies). With zero_centered_norm (Qwen3.5) the
//   input norm and the q/k norms scale by (1 + w), w initialised to 0.
// Legend: T tokens, H hidden, Hq / Hkv query / kv heads, D head dim.
#pragma once

#include "models/block.h"
#include "primitives/attention/context_parallel.h"
#include "primitives/norm/rmsnorm.h"

namespace bb {

struct AttentionBlockConfig {
  int64_t hidden = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool qkv_bias = false;
  bool qk_norm = true;
  bool output_gate = false;
  double rope_theta = 10000;
  int64_t rotary_dim = 0;  // 0 = the whole head dim
  double rms_norm_eps = 1e-6;
  bool zero_centered_norm = false;
};

class AttentionBlock final : public Block {
 public:
  // Declares the parameters in `unit` (the layer's dense unit). `attention` is the family's
  // member the block calls (null: sdpa).
  AttentionBlock(ParamStore& store, ParamUnit& unit, const std::string& prefix,
                 const AttentionBlockConfig& cfg, std::unique_ptr<SelfAttention> attention = nullptr);
  const char* kind() const override { return "attention"; }
  std::unique_ptr<BlockSaved> make_saved() const override;
  Tensor forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) override;
  Tensor backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) override;

  const AttentionBlockConfig& config() const { return cfg_; }

 private:
  struct Saved;
  // Selective recompute: rebuilds the attention inputs, output and o_proj input that the
  // forward dropped (recompute parts attention, core_attention).
  void rebuild(const BatchContext& ctx, BlockSaved& saved) const;
  AttentionBlockConfig cfg_;
  std::unique_ptr<SelfAttention> attn_;
  Param *ln_ = nullptr, *wq_ = nullptr, *wk_ = nullptr, *wv_ = nullptr, *wo_ = nullptr;
  Param *bq_ = nullptr, *bk_ = nullptr, *bv_ = nullptr;
  Param *q_norm_ = nullptr, *k_norm_ = nullptr;
};

}  // namespace bb
