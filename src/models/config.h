// config.h — model shape from a Hugging Face config.json (Qwen3-MoE, Qwen2-MoE and the Qwen3.5
// hybrid MoE text model), and the parameter and FLOP counts derived from it.
//
// Parsing is strict on purpose: a key we do not understand could change the math (a different
// activation, RoPE scaling, sliding windows, biases), and silently training a different model
// than the checkpoint describes is the worst failure mode. So every key is either read,
// accepted as irrelevant to training math, or rejected with a message naming it and the file.
//
// Shape keys (vocab, hidden, layers, heads, ffn sizes, experts) are required: a wrong default
// would silently build a different model. Behavioural keys default as in transformers.
// skills/model-config.md lists every key and rule.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bb {

// Upper bounds validate() enforces on every ModelConfig (so also on every parsed config.json).
// They are far above any published model (Qwen3-235B-A22B: H 4096, 94 layers, 128 experts,
// vocab 151,936) and exist so that a crafted or corrupt config fails with a message naming the
// key instead of overflowing a count or asking for an absurd allocation. The derived counts
// (num_params, ...) are overflow-checked on top of this, since the bounds alone still allow
// products past int64.
inline constexpr int64_t kMaxModelDim = int64_t{1} << 20;  // hidden, ffn sizes, head_dim
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 24;
inline constexpr int64_t kMaxLayers = 1024;                 // also bounds decoder_sparse_step
inline constexpr int64_t kMaxExperts = 4096;                // also bounds num_experts_per_tok
inline constexpr int64_t kMaxHeads = 4096;                  // attention and key/value heads

// The token mixer of a decoder layer (Hugging Face `layer_types`).
enum class LayerType : uint8_t { full_attention, linear_attention };
const char* layer_type_name(LayerType t);

// model_type of the Qwen3.5 hybrid MoE text model (transformers Qwen3_5MoeTextConfig). Its
// released checkpoints wrap it in Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe,
// the text part under `text_config`); both parse to a ModelConfig of this model_type.
inline constexpr const char* kQwen35MoeText = "qwen3_5_moe_text";

struct ModelConfig {
  std::string model_type;  // "qwen3_moe", "qwen2_moe" or "qwen3_5_moe_text"
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0;
  int64_t head_dim = 0;                // defaults to hidden_size / num_heads when absent
  int64_t intermediate_size = 0;       // dense MLP ffn dim (layers that are not MoE)
  int64_t moe_intermediate_size = 0;   // per-expert ffn dim
  int64_t num_experts = 0, top_k = 0;  // num_experts == 0: every layer is dense
  bool norm_topk_prob = true;          // renormalize the top-k softmax probabilities to sum 1
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;  // layer indices forced dense
  // 0 = no shared expert. Qwen2-MoE has one per MoE layer, SwiGLU, scaled by a sigmoid gate
  // (a hidden -> 1 linear without bias).
  int64_t shared_expert_intermediate_size = 0;
  double rope_theta = 10000, rms_norm_eps = 1e-6, router_aux_loss_coef = 0;
  double init_std = 0.02;  // HF initializer_range: std of normal weight init
  // What parsing decided that a reader of the file could not tell (a precedence between two
  // spellings, say); the trainer prints them at startup. Not part of the model's identity: two
  // configs compare equal whatever their notes.
  struct Notes : std::vector<std::string> {
    bool operator==(const Notes&) const { return true; }
  } load_notes;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  int64_t bos_token_id = -1, eos_token_id = -1;  // -1 = none
  bool qk_norm = true;    // qwen3_moe, qwen3.5: per-head q/k RMSNorm (weights of size head_dim)
  bool qkv_bias = false;  // qwen2_moe: q/k/v projections have biases (o_proj has none)
  // Token mixer per layer; empty = every layer full_attention (qwen3_moe / qwen2_moe have no
  // other kind). Qwen3.5: 3 x linear_attention then 1 x full_attention, repeated.
  std::vector<LayerType> layer_types;

  // Qwen3.5 only (the other families keep the defaults; validate() checks it):
  // every RMSNorm (input, post-attention, final, q/k) is zero-centred: x / rms(x) * (1 + w),
  // w initialised to 0.
  bool zero_centered_norm = false;
  // Gated full attention: q_proj emits per head [query (D), gate (D)] and the attention output
  // is multiplied by sigmoid(gate) before o_proj.
  bool attn_output_gate = false;
  // RoPE rotates the first rotary_dim() = int(head_dim * partial_rotary_factor) dims of a head.
  double partial_rotary_factor = 1.0;
  // Gated DeltaNet (linear_attention) layers: Hk key heads of dim Dk, Hv value heads of dim Dv
  // (each key head serves Hv / Hk consecutive value heads), causal conv1d of this kernel width.
  int64_t linear_num_key_heads = 0, linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0, linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;

  // HF rule (modeling_qwen3_moe.py): layer `layer` (0-based) is an MoE layer iff it is not in
  // mlp_only_layers, num_experts > 0 and (layer + 1) % decoder_sparse_step == 0.
  bool is_moe_layer(int64_t layer) const;
  int64_t num_moe_layers() const;
  LayerType layer_type(int64_t layer) const;
  int64_t num_linear_attention_layers() const;
  int64_t rotary_dim() const;  // int(head_dim * partial_rotary_factor)
  bool is_qwen35() const { return model_type == kQwen35MoeText; }
  // Whether the family's native Hugging Face layout keeps the routed experts fused
  // (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F]): Qwen3.5 yes;
  // Qwen3-MoE / Qwen2-MoE checkpoints hold per-expert `mlp.experts.e.*_proj.weight`.
  bool hf_fused_experts() const { return is_qwen35(); }

  // Throws bb::Error naming the field when the config is inconsistent: sizes <= 0 or above the
  // kMax* bounds, heads not a multiple of kv heads, top_k not in [1, num_experts],
  // mlp_only_layers out of range or repeated, non-finite floats, token ids below -1, family
  // flags that do not match model_type (qwen3_moe: qk_norm, no qkv bias, no shared expert;
  // qwen2_moe: no qk_norm; qwen3.5: qk_norm, zero-centred norms, output gate, every layer MoE
  // with a shared expert, renormalised top-k, Gated DeltaNet shapes; the Qwen3.5 fields at
  // their defaults elsewhere).
  void validate() const;

  // A config.json that transformers loads as the same model (architectures, model_type,
  // torch_dtype "bfloat16", every shape and behaviour key). parse_hf_config(to_hf_json()) == *this.
  // Qwen3.5 writes the text-only form (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text).
  nlohmann::json to_hf_json() const;

  // Parameter counts in elements; each throws bb::Error when the count overflows int64 (only
  // possible near the kMax* bounds).
  //   attention per layer  = H*(heads*D)*(gate ? 2 : 1) + 2*H*(kv*D) + (heads*D)*H  (q, k, v, o)
  //                          + [qkv_bias] (heads + 2*kv)*D + [qk_norm] 2*D
  //   Gated DeltaNet layer = H*C + H*Hv*Dv + 2*H*Hv + Hv*Dv*H    (in_proj_qkv, _z, _b, _a, out)
  //                          + C*W (conv1d) + 2*Hv (A_log, dt_bias) + Dv (gated norm),
  //                          C = 2*Hk*Dk + Hv*Dv, W = linear_conv_kernel_dim
  //   dense MLP            = 3*H*intermediate_size                           (gate, up, down)
  //   MoE layer            = E*3*H*moe_ffn + E*H (router)
  //                          + [shared] 3*H*shared_ffn + H (sigmoid gate)
  //   norms per layer      = 2*H;  final norm H;  embedding V*H;  LM head V*H unless tied.
  int64_t num_params() const;
  // Routed expert weights only (E*3*H*moe_ffn per MoE layer): the part expert parallelism shards.
  int64_t num_expert_params() const;
  // Matmul parameters one token multiplies through in a forward: attention q (with the gate
  // half),k,v,o or the Gated DeltaNet projections (in_proj_qkv, _z, _b, _a, out_proj); dense
  // MLP or top_k routed experts + shared expert + its gate + router; LM head. Embedding lookup,
  // biases, norms, the depthwise conv1d and the A_log / dt_bias vectors excluded. This is the
  // "active parameters" term of model FLOPs.
  int64_t active_matmul_params_per_token() const;
  // What model cards call "activated parameters": active_matmul_params_per_token plus the
  // embedding table (V*H, counted even when tied, as the published numbers do). Reporting
  // only; never used for FLOPs.
  int64_t num_active_params() const;

  bool operator==(const ModelConfig&) const = default;
};

// Parses an HF config.json object. `source` names the file in error messages.
ModelConfig parse_hf_config(const nlohmann::json& j, const std::string& source);
// Reads a config.json file, or `<dir>/config.json` when given a directory.
ModelConfig load_hf_config(const std::string& path_or_dir);

// Model FLOPs of one training step over packed sequences of lengths seq_lens (DESIGN.md sec. 6):
//   forward = 2 * active_matmul_params_per_token * sum_i s_i
//           + full_attention_layers * 2 * 2 * sum_i (s_i^2 / 2) * num_heads * head_dim
//                                                          (causal QK^T, PV; full attention only)
//           + linear_attention_layers * 6 * Dk * Dv * Hv * sum_i s_i
//                 (the gated delta rule in its recurrent form: three K x V products per token
//                  and value head, prediction S^T k, update k d^T and read S^T q, 2 FLOPs each)
//   step    = 3 * forward  (backward = 2x forward; recompute not counted).
double model_flops(const ModelConfig& c, const std::vector<int64_t>& seq_lens);

}  // namespace bb
