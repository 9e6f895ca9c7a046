// tiny_models.h — the small model configs the tests share: a demo-tiny-shaped MoE for
// multi-rank runs, and the Qwen3.5 hybrid at test sizes.
#pragma once

#include <cstdint>

#include "models/config.h"

namespace bb::test {

// demo-tiny (configs/models/demo-tiny) shrunk for multi-rank tests: hidden 32, FFNs 48 / 24; the
// caller's layer count (layer 0 dense), experts and attention heads.
struct SmallMoe {
  int64_t layers = 3, experts = 8, top_k = 2, heads = 2, kv_heads = 1, head_dim = 16;
};
inline ModelConfig small_moe(const SmallMoe& s = {}) {
  ModelConfig c = load_hf_config("configs/models/demo-tiny/config.json");
  c.hidden_size = 32;
  c.num_layers = s.layers;
  c.num_heads = s.heads;
  c.num_kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.intermediate_size = 48;
  c.moe_intermediate_size = 24;
  c.num_experts = s.experts;
  c.top_k = s.top_k;
  return c;
}

// The Qwen3.5 text model at test sizes: zero-centred norms, gated attention with qk norm and
// partial RoPE, MoE with a shared expert in every layer, Gated DeltaNet layers. Layer pattern:
// 2 layers [linear_attention, full_attention]; otherwise 3 x linear then full, repeated (the
// Qwen3.5 pattern).
struct Qwen35Dims {
  int64_t vocab = 37, hidden = 16, layers = 2, heads = 4, kv_heads = 2, head_dim = 8;
  double rotary = 0.5;
  int64_t moe_ffn = 12, shared_ffn = 10, experts = 4, top_k = 2;
  int64_t lin_key_heads = 2, lin_value_heads = 4, lin_key_dim = 8, lin_value_dim = 6;
};
inline ModelConfig qwen35_config(const Qwen35Dims& d = {}) {
  ModelConfig c;
  c.model_type = "qwen3_5_moe_text";
  c.vocab_size = d.vocab;
  c.hidden_size = d.hidden;
  c.num_layers = d.layers;
  c.num_heads = d.heads;
  c.num_kv_heads = d.kv_heads;
  c.head_dim = d.head_dim;
  c.partial_rotary_factor = d.rotary;
  c.intermediate_size = 0;
  c.moe_intermediate_size = d.moe_ffn;
  c.shared_expert_intermediate_size = d.shared_ffn;
  c.num_experts = d.experts;
  c.top_k = d.top_k;
  c.norm_topk_prob = true;
  c.qk_norm = true;
  c.zero_centered_norm = true;
  c.attn_output_gate = true;
  c.linear_num_key_heads = d.lin_key_heads;
  c.linear_num_value_heads = d.lin_value_heads;
  c.linear_key_head_dim = d.lin_key_dim;
  c.linear_value_head_dim = d.lin_value_dim;
  c.linear_conv_kernel_dim = 4;
  for (int64_t l = 0; l < d.layers; ++l)
    c.layer_types.push_back((l + 1) % (d.layers == 2 ? 2 : 4) ? LayerType::linear_attention
                                                              : LayerType::full_attention);
  c.rope_theta = 10000;
  c.rms_norm_eps = 1e-6;
  c.router_aux_loss_coef = 0.01;
  return c;
}

}  // namespace bb::test
