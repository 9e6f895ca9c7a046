#include "models/qwen3_moe.h"

#include <cmath>

#include "core/rng.h"
#include "core/trace.h"
#include "primitives/activation/swiglu.h"
#include "primitives/attention/attention.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/embedding/embedding.h"
#include "primitives/linear/linear.h"
#include "primitives/loss/cross_entropy.h"
#include "primitives/loss/linear_ce.h"
#include "primitives/moe/experts.h"
#include "primitives/moe/permute.h"
#include "primitives/moe/router.h"
#include "primitives/norm/rmsnorm.h"
#include "primitives/rope/rope.h"

namespace bb {

void ModelOptions::validate() const {
  BB_CHECK(loss == "full_ce" || loss == "linear_ce", "primitives.loss = '", loss,
           "' is not one of: full_ce, linear_ce");
  BB_CHECK(recompute == "none" || recompute == "full", "primitives.recompute = '", recompute,
           "' is not one of: none, full");
  BB_CHECK(router == "softmax_topk" || router == "sigmoid_topk", "primitives.router = '", router,
           "' is not one of: softmax_topk, sigmoid_topk");
  BB_CHECK(experts == "sequential" || experts == "grouped", "primitives.experts = '", experts,
           "' is not one of: sequential, grouped");
  BB_CHECK(permute == "standard" || permute == "memory_efficient", "primitives.permute = '",
           permute, "' is not one of: standard, memory_efficient");
  BB_CHECK(loss_chunk_tokens > 0 && loss_chunk_vocab > 0, "loss chunk sizes must be positive");
  BB_CHECK(is_floating(param_dtype), "model parameter dtype must be a float type");
}

// Weights of one decoder layer (pointers into params_) — null where the layer has none.
struct Qwen3MoeModel::Layer {
  int64_t index = 0;
  bool moe = false;
  Param *ln1 = nullptr, *ln2 = nullptr;
  Param *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  Param *bq = nullptr, *bk = nullptr, *bv = nullptr;
  Param *q_norm = nullptr, *k_norm = nullptr;
  Param *mlp_gate_up = nullptr, *mlp_down = nullptr;              // dense: [2I, H], [H, I]
  Param *router = nullptr;                                         // [E, H]
  Param *experts_gate_up = nullptr, *experts_down = nullptr;       // [E, 2F, H], [E, H, F]
  Param *shared_gate_up = nullptr, *shared_down = nullptr, *shared_gate = nullptr;  // [2S,H] [H,S] [1,H]
};

// What one layer's backward needs. With recompute = full only `x` survives the forward; the
// rest is rebuilt by running the layer forward again inside backward.
struct Qwen3MoeModel::LayerSaved {
  Tensor x;                 // [T, H] layer input
  Tensor h1;                // [T, H] norm1 output
  RMSNormSaved rms1, rms2, qn, kn;
  Tensor q_pre, k_pre, v;   // [T, Hq|Hkv, D] projections (before QK norm)
  Tensor q_rot, k_rot;      // after norm + RoPE: the attention inputs
  Tensor o;                 // [T, Hq, D] attention output
  AttentionSaved attn;
  Tensor x2;                // [T, H] after the attention residual
  Tensor h2;                // [T, H] norm2 output
  // dense MLP
  Tensor gate_up, act;
  // MoE
  Tensor router_logits;     // [T, E]
  RouterSaved router;
  Tensor topk_prob;         // [T, K]
  PermuteMap map;
  Tensor x_perm, y_perm, row_prob;
  ExpertsSaved experts;
  Tensor s_gate_up, s_act, s_out, s_gate;  // shared expert; s_gate = sigmoid(gate logit) [T]
};

namespace {

RouterConfig router_config(const ModelConfig& c, const ModelOptions& o) {
  RouterConfig r;
  r.num_experts = static_cast<int>(c.num_experts);
  r.top_k = static_cast<int>(c.top_k);
  r.score = o.router == "sigmoid_topk" ? RouterScore::sigmoid : RouterScore::softmax;
  r.norm_topk_prob = c.norm_topk_prob;
  return r;
}

ExpertsImpl experts_impl(const ModelOptions& o) {
  return o.experts == "grouped" ? ExpertsImpl::grouped : ExpertsImpl::sequential;
}

Tensor flat(const Tensor& t) { return t.view({t.size(0), -1}); }

// A host-built tensor on `dev` (no copy on the CPU).
Tensor on_device(const Tensor& host, Device dev) { return dev.is_cpu() ? host : host.to(dev); }

}  // namespace

Qwen3MoeModel::~Qwen3MoeModel() = default;

Param& Qwen3MoeModel::add_param(const std::string& name, const Shape& shape, bool decay) {
  Param p;
  p.name = name;
  p.value = Tensor::zeros(shape, opts_.param_dtype, opts_.device, MemCategory::params);
  p.grad = Tensor::zeros(shape, DType::f32, opts_.device, MemCategory::grads);
  p.decay = decay;
  params_.push_back(std::move(p));
  return params_.back();
}

Qwen3MoeModel::Qwen3MoeModel(const ModelConfig& cfg, const ModelOptions& opts, uint64_t seed)
    : cfg_(cfg), opts_(opts) {
  cfg_.validate();
  opts_.validate();
  const int64_t H = cfg.hidden_size, D = cfg.head_dim, Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
  embed_ = &add_param("model.embed_tokens.weight", {cfg.vocab_size, H}, true);
  layers_.resize(static_cast<size_t>(cfg.num_layers));
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    Layer& L = layers_[l];
    L.index = l;
    L.moe = cfg.is_moe_layer(l);
    const std::string p = "model.layers." + std::to_string(l) + ".";
    L.ln1 = &add_param(p + "input_layernorm.weight", {H}, false);
    L.wq = &add_param(p + "self_attn.q_proj.weight", {Hq * D, H}, true);
    L.wk = &add_param(p + "self_attn.k_proj.weight", {Hkv * D, H}, true);
    L.wv = &add_param(p + "self_attn.v_proj.weight", {Hkv * D, H}, true);
    L.wo = &add_param(p + "self_attn.o_proj.weight", {H, Hq * D}, true);
    if (cfg.qkv_bias) {
      L.bq = &add_param(p + "self_attn.q_proj.bias", {Hq * D}, false);
      L.bk = &add_param(p + "self_attn.k_proj.bias", {Hkv * D}, false);
      L.bv = &add_param(p + "self_attn.v_proj.bias", {Hkv * D}, false);
    }
    if (cfg.qk_norm) {
      L.q_norm = &add_param(p + "self_attn.q_norm.weight", {D}, false);
      L.k_norm = &add_param(p + "self_attn.k_norm.weight", {D}, false);
    }
    L.ln2 = &add_param(p + "post_attention_layernorm.weight", {H}, false);
    if (L.moe) {
      const int64_t E = cfg.num_experts, F = cfg.moe_intermediate_size;
      L.router = &add_param(p + "mlp.gate.weight", {E, H}, true);
      L.experts_gate_up = &add_param(p + "mlp.experts.gate_up_proj", {E, 2 * F, H}, true);
      L.experts_down = &add_param(p + "mlp.experts.down_proj", {E, H, F}, true);
      if (cfg.shared_expert_intermediate_size > 0) {
        const int64_t S = cfg.shared_expert_intermediate_size;
        L.shared_gate_up = &add_param(p + "mlp.shared_expert.gate_up_proj", {2 * S, H}, true);
        L.shared_down = &add_param(p + "mlp.shared_expert.down_proj.weight", {H, S}, true);
        L.shared_gate = &add_param(p + "mlp.shared_expert_gate.weight", {1, H}, true);
      }
    } else {
      const int64_t I = cfg.intermediate_size;
      L.mlp_gate_up = &add_param(p + "mlp.gate_up_proj", {2 * I, H}, true);
      L.mlp_down = &add_param(p + "mlp.down_proj.weight", {H, I}, true);
    }
  }
  final_norm_ = &add_param("model.norm.weight", {H}, false);
  lm_head_ = cfg.tie_word_embeddings ? embed_ : &add_param("lm_head.weight", {cfg.vocab_size, H}, true);

  // Initialisation: each parameter draws from its own Philox stream (offset = index << 40).
  uint64_t index = 0;
  for (Param& p : params_) {
    const bool is_norm = p.name.find("norm") != std::string::npos;
    const bool is_bias = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
    if (is_norm) p.value.fill_(1.0);
    else if (!is_bias) fill_normal(p.value, seed, index << 40, 0.0f, static_cast<float>(cfg.init_std));
    ++index;
  }
}

std::vector<Param*> Qwen3MoeModel::params() {
  std::vector<Param*> out;
  for (Param& p : params_) out.push_back(&p);
  return out;
}

Param* Qwen3MoeModel::find_param(const std::string& name) {
  for (Param& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

int64_t Qwen3MoeModel::num_params() const {
  int64_t n = 0;
  for (const Param& p : params_) n += p.value.numel();
  return n;
}

void Qwen3MoeModel::zero_grad() {
  for (Param& p : params_) p.grad.zero_();
}

std::vector<std::pair<std::string, Tensor>> Qwen3MoeModel::hf_tensors() {
  std::vector<std::pair<std::string, Tensor>> out;
  auto split2 = [&](const std::string& prefix, const Tensor& w) {  // [2F, H] -> gate, up
    const int64_t F = w.size(0) / 2;
    out.emplace_back(prefix + "gate_proj.weight", w.narrow(0, F));
    out.emplace_back(prefix + "up_proj.weight", w.narrow(F, F));
  };
  for (Param& p : params_) {
    const std::string& n = p.name;
    auto ends = [&](const std::string& s) {
      return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
    };
    if (ends("mlp.experts.gate_up_proj")) {
      const std::string base = n.substr(0, n.size() - std::string("gate_up_proj").size());
      for (int64_t e = 0; e < p.value.size(0); ++e) {
        Tensor we = p.value.narrow(e, 1).view({p.value.size(1), p.value.size(2)});
        split2(base + std::to_string(e) + ".", we);
      }
    } else if (ends("mlp.experts.down_proj")) {
      const std::string base = n.substr(0, n.size() - std::string("down_proj").size());
      for (int64_t e = 0; e < p.value.size(0); ++e)
        out.emplace_back(base + std::to_string(e) + ".down_proj.weight",
                         p.value.narrow(e, 1).view({p.value.size(1), p.value.size(2)}));
    } else if (ends("gate_up_proj")) {
      split2(n.substr(0, n.size() - std::string("gate_up_proj").size()), p.value);
    } else {
      out.emplace_back(n, p.value);
    }
  }
  return out;
}

Tensor Qwen3MoeModel::to_act(const Tensor& t) const {
  if (t.dtype() == opts_.param_dtype) return t;
  return t.to_dtype(opts_.param_dtype, MemCategory::activations);
}

Tensor Qwen3MoeModel::linear_backward(const Tensor& d_out, const Tensor& x, Param* w, Param* b) {
  const Tensor g = to_act(d_out);
  linear_backward_weight(g, x, w->grad, b ? &b->grad : nullptr);
  return linear_backward_data(g, w->value);
}

Tensor Qwen3MoeModel::layer_forward(Layer& L, const Tensor& x, const MicroBatch& mb, LayerSaved* s,
                                    ForwardStats& st) {
  const ModelConfig& c = cfg_;
  const int64_t T = x.size(0), D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads;
  const RopeConfig rope{c.rope_theta, 0};
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  LayerSaved local;
  LayerSaved& S = s ? *s : local;
  S.x = x;
  BB_RANGE(L.moe ? "moe_layer_forward" : "dense_layer_forward");

  // Attention block.
  S.h1 = rmsnorm_forward(x, L.ln1->value, c.rms_norm_eps, &S.rms1);
  S.q_pre = linear_forward(S.h1, L.wq->value, L.bq ? L.bq->value : Tensor()).view({T, Hq, D});
  S.k_pre = linear_forward(S.h1, L.wk->value, L.bk ? L.bk->value : Tensor()).view({T, Hkv, D});
  S.v = linear_forward(S.h1, L.wv->value, L.bv ? L.bv->value : Tensor()).view({T, Hkv, D});
  Tensor qn = L.q_norm ? qk_norm_forward(S.q_pre, L.q_norm->value, c.rms_norm_eps, &S.qn) : S.q_pre;
  Tensor kn = L.k_norm ? qk_norm_forward(S.k_pre, L.k_norm->value, c.rms_norm_eps, &S.kn) : S.k_pre;
  S.q_rot = rope_forward(qn, mb.positions, rope);
  S.k_rot = rope_forward(kn, mb.positions, rope);
  S.o = attention_forward(S.q_rot, S.k_rot, S.v, mb.cu_seqlens, scale, &S.attn);
  Tensor attn_out = linear_forward(flat(S.o), L.wo->value, Tensor());
  S.x2 = to_act(add(x, attn_out, MemCategory::activations));
  S.h2 = rmsnorm_forward(S.x2, L.ln2->value, c.rms_norm_eps, &S.rms2);

  // MLP block.
  Tensor mlp_out;
  if (!L.moe) {
    S.gate_up = linear_forward(S.h2, L.mlp_gate_up->value, Tensor());
    S.act = swiglu_forward(S.gate_up);
    mlp_out = linear_forward(S.act, L.mlp_down->value, Tensor());
  } else {
    const RouterConfig rc = router_config(c, opts_);
    const bool mem_eff = opts_.permute == "memory_efficient";
    const ExpertsImpl impl = experts_impl(opts_);
    // Router logits in f32 whatever the activation dtype (the router works in f32).
    S.router_logits = Tensor::empty({T, c.num_experts}, DType::f32, S.h2.device(), MemCategory::activations);
    matmul(S.h2, false, L.router->value, true, S.router_logits);
    RouterOutput r = router_forward(S.router_logits, Tensor(), rc, &S.router);
    if (aux_pooling_) pool_aux(S.router.scores, r.tokens_per_expert);
    st.z_loss += r.z_loss / static_cast<double>(c.num_moe_layers());
    last_routing_.push_back(r.topk_idx.clone(MemCategory::other));
    S.topk_prob = r.topk_prob;
    S.map = make_permute_map(r.topk_idx, c.num_experts, &r.tokens_per_expert);
    S.x_perm = permute_forward(S.h2, S.map);
    if (mem_eff) S.row_prob = permute_probs(r.topk_prob, S.map);
    S.y_perm = experts_forward(impl, S.x_perm, S.map.tokens_per_expert, L.experts_gate_up->value,
                               L.experts_down->value, S.row_prob, &S.experts);
    mlp_out = unpermute_forward(S.y_perm, S.map, mem_eff ? Tensor() : r.topk_prob);
    if (L.shared_gate_up) {
      S.s_gate_up = linear_forward(S.h2, L.shared_gate_up->value, Tensor());
      S.s_act = swiglu_forward(S.s_gate_up);
      S.s_out = linear_forward(S.s_act, L.shared_down->value, Tensor());
      S.s_gate = sigmoid(linear_forward(S.h2, L.shared_gate->value, Tensor()), MemCategory::activations);
      Tensor gated = scale_rows(S.s_out, S.s_gate, MemCategory::activations);
      Tensor mo = mlp_out.dtype() == DType::f32 ? mlp_out : mlp_out.to_dtype(DType::f32);
      add_inplace(mo, gated);
      mlp_out = mo;
    }
  }
  return to_act(add(S.x2, mlp_out, MemCategory::activations));
}

Tensor Qwen3MoeModel::layer_backward(Layer& L, const Tensor& d_y, const MicroBatch& mb,
                                     LayerSaved& S, double aux_grad, double z_grad) {
  BB_RANGE(L.moe ? "moe_layer_backward" : "dense_layer_backward");
  const ModelConfig& c = cfg_;
  const int64_t T = d_y.size(0), D = c.head_dim, Hq = c.num_heads;
  const RopeConfig rope{c.rope_theta, 0};
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  // MLP block: y = x2 + mlp(h2).
  Tensor d_h2;
  if (!L.moe) {
    Tensor d_act = linear_backward(d_y, S.act, L.mlp_down, nullptr);
    Tensor d_gu = swiglu_backward(d_act, S.gate_up);
    d_h2 = linear_backward(d_gu, S.h2, L.mlp_gate_up, nullptr);
  } else {
    const RouterConfig rc = router_config(c, opts_);
    const bool mem_eff = opts_.permute == "memory_efficient";
    const ExpertsImpl impl = experts_impl(opts_);
    UnpermuteGrads ug = unpermute_backward(to_act(d_y), S.y_perm, S.map, mem_eff ? Tensor() : S.topk_prob);
    ExpertsDgrad eg = experts_backward_data(impl, ug.d_y_perm, S.map.tokens_per_expert,
                                            L.experts_gate_up->value, L.experts_down->value,
                                            S.row_prob, S.experts);
    experts_backward_weight(impl, ug.d_y_perm, S.x_perm, S.map.tokens_per_expert, S.row_prob,
                            S.experts, eg, L.experts_gate_up->grad, L.experts_down->grad);
    Tensor d_topk_prob = mem_eff ? unpermute_probs_grad(eg.d_row_prob, S.map) : ug.d_topk_prob;
    d_h2 = permute_backward(eg.d_x, S.map);
    if (d_h2.dtype() != DType::f32) d_h2 = d_h2.to_dtype(DType::f32, MemCategory::activations);
    Tensor d_logits = router_backward(d_topk_prob, 0.0, z_grad, S.router_logits, rc, S.router);
    add_aux_grad(d_logits, S.router.scores, aux_grad);
    add_inplace(d_h2, linear_backward(d_logits, S.h2, L.router, nullptr));
    if (L.shared_gate_up) {
      // out += g * s_out, g = sigmoid(h2 . w_gate)
      Tensor d_sout = scale_rows(d_y, S.s_gate, MemCategory::activations);
      Tensor dgl = sigmoid_gate_backward(d_y, S.s_out, S.s_gate, MemCategory::activations);
      add_inplace(d_h2, linear_backward(dgl, S.h2, L.shared_gate, nullptr));
      Tensor d_sact = linear_backward(d_sout, S.s_act, L.shared_down, nullptr);
      Tensor d_sgu = swiglu_backward(d_sact, S.s_gate_up);
      add_inplace(d_h2, linear_backward(d_sgu, S.h2, L.shared_gate_up, nullptr));
    }
  }
  Tensor d_x2 = rmsnorm_backward(d_h2, S.x2, L.ln2->value, S.rms2, L.ln2->grad);
  add_inplace(d_x2, d_y);

  // Attention block: x2 = x + o_proj(attn(h1)).
  Tensor d_o = to_act(linear_backward(d_x2, flat(S.o), L.wo, nullptr)).view({T, Hq, D});
  AttentionGrads ag = attention_backward(d_o, S.q_rot, S.k_rot, S.v, S.o, mb.cu_seqlens, scale, S.attn);
  Tensor d_qn = rope_backward(ag.dq, mb.positions, rope);
  Tensor d_kn = rope_backward(ag.dk, mb.positions, rope);
  Tensor d_q = L.q_norm ? qk_norm_backward(d_qn, S.q_pre, L.q_norm->value, S.qn, L.q_norm->grad) : d_qn;
  Tensor d_k = L.k_norm ? qk_norm_backward(d_kn, S.k_pre, L.k_norm->value, S.kn, L.k_norm->grad) : d_kn;
  Tensor d_v = ag.dv;
  Tensor d_h1 = linear_backward(flat(d_q), S.h1, L.wq, L.bq);
  add_inplace(d_h1, linear_backward(flat(d_k), S.h1, L.wk, L.bk));
  add_inplace(d_h1, linear_backward(flat(d_v), S.h1, L.wv, L.bv));
  Tensor d_x = rmsnorm_backward(d_h1, S.x, L.ln1->value, S.rms1, L.ln1->grad);
  add_inplace(d_x, d_x2);
  return d_x;
}

ForwardStats Qwen3MoeModel::run(const MicroBatch& mb, bool backward, float loss_scale,
                                double aux_scale, Tensor* logits) {
  check_dtype(mb.tokens, DType::i32, "model forward", "tokens");
  check_dtype(mb.targets, DType::i32, "model forward", "targets");
  BB_CHECK(mb.tokens.numel() > 0, "model forward: empty micro-batch (0 tokens)");
  BB_CHECK(mb.targets.numel() == mb.tokens.numel() && mb.positions.numel() == mb.tokens.numel(),
           "model forward: tokens, targets and positions must have the same length");
  const ModelConfig& c = cfg_;
  const bool full = opts_.recompute == "full";
  ForwardStats st;
  last_routing_.clear();
  aux_counts_.assign(static_cast<size_t>(c.num_experts), 0.0);
  aux_rows_ = 0;
  if (c.num_moe_layers() > 0)
    aux_prob_sum_ = Tensor::zeros({1, c.num_experts}, DType::f32, opts_.device, MemCategory::other);
  aux_pooling_ = true;

  Tensor x = embedding_forward(mb.tokens, embed_->value);
  std::vector<LayerSaved> saved(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (backward && !full) {
      x = layer_forward(layers_[l], x, mb, &saved[l], st);
    } else {
      if (backward) saved[l].x = x;  // full recompute: keep only the layer input
      x = layer_forward(layers_[l], x, mb, nullptr, st);
    }
  }
  aux_pooling_ = false;
  if (aux_rows_ > 0) {
    const std::vector<float> prob_sum = aux_prob_sum_.to_floats();
    const double R = static_cast<double>(aux_rows_);
    for (int64_t e = 0; e < c.num_experts; ++e)
      st.aux_loss += (aux_counts_[e] / R) * (prob_sum[e] / R);
    st.aux_loss *= static_cast<double>(c.num_experts);
  }
  RMSNormSaved fn;
  Tensor h = rmsnorm_forward(x, final_norm_->value, c.rms_norm_eps, &fn);
  if (logits) *logits = lm_head_logits(h, lm_head_->value);

  LossHeadSaved ls;
  LossHeadConfig lc{opts_.loss_chunk_tokens, opts_.loss_chunk_vocab};
  lc.fused_chunk_tokens = opts_.loss_chunk_tokens;
  if (backward && opts_.loss == "linear_ce") {
    // Training: the loss scale is known up front, so linear_ce computes the loss and both
    // gradients in one pass over [chunk_tokens, V] blocks (no logits recompute).
    Tensor d_h;
    {
      BB_RANGE("loss_head_fused");
      const LossResult lr = linear_ce_fused(loss_scale, h, lm_head_->value, mb.targets, lc, d_h, lm_head_->grad);
      st.loss_sum = lr.loss_sum;
      st.num_valid = lr.num_valid;
    }
    return backward_layers(mb, st, x, fn, d_h, saved, aux_scale);
  }
  LossResult lr;
  {
    BB_RANGE("loss_head_forward");
    lr = opts_.loss == "full_ce" ? full_ce_forward(h, lm_head_->value, mb.targets, backward ? &ls : nullptr)
                                 : linear_ce_forward(h, lm_head_->value, mb.targets, lc, backward ? &ls : nullptr);
  }
  st.loss_sum = lr.loss_sum;
  st.num_valid = lr.num_valid;
  if (!backward) return st;

  Tensor d_h = Tensor::zeros(h.shape(), DType::f32, opts_.device, MemCategory::activations);
  {
    BB_RANGE("loss_head_backward");
    if (opts_.loss == "full_ce") full_ce_backward(loss_scale, h, lm_head_->value, mb.targets, ls, d_h, lm_head_->grad);
    else linear_ce_backward(loss_scale, h, lm_head_->value, mb.targets, lc, ls, d_h, lm_head_->grad);
  }
  ls = LossHeadSaved{};
  return backward_layers(mb, st, x, fn, d_h, saved, aux_scale);
}

ForwardStats Qwen3MoeModel::backward_layers(const MicroBatch& mb, ForwardStats st, Tensor& x,
                                            RMSNormSaved& fn, const Tensor& d_h,
                                            std::vector<LayerSaved>& saved, double aux_scale) {
  const ModelConfig& c = cfg_;
  const bool full = opts_.recompute == "full";
  Tensor d_x = rmsnorm_backward(d_h, x, final_norm_->value, fn, final_norm_->grad);
  fn = RMSNormSaved{};
  x = Tensor();

  const double n_moe = static_cast<double>(std::max<int64_t>(1, c.num_moe_layers()));
  const double aux_grad = aux_scale * opts_.aux_loss_coef;  // d objective / d (pooled) aux
  const double z_grad = aux_scale * opts_.z_loss_coef / n_moe;
  ForwardStats scratch;
  for (size_t i = layers_.size(); i-- > 0;) {
    if (full) {
      // Re-run this layer's forward to rebuild what its backward needs.
      BB_RANGE("layer_recompute");
      Tensor input = saved[i].x;
      saved[i] = LayerSaved{};
      layer_forward(layers_[i], input, mb, &saved[i], scratch);
    }
    d_x = layer_backward(layers_[i], d_x, mb, saved[i], aux_grad, z_grad);
    saved[i] = LayerSaved{};  // free this layer's activations before the next one
  }
  embedding_backward(d_x, mb.tokens, embed_->grad);
  return st;
}

void Qwen3MoeModel::pool_aux(const Tensor& scores, const std::vector<int64_t>& counts) {
  const int64_t T = scores.size(0), E = scores.size(1);
  for (int64_t e = 0; e < E; ++e) aux_counts_[e] += static_cast<double>(counts[e]);
  aux_rows_ += T;
  Tensor p = scores;
  if (opts_.router == "sigmoid_topk") {  // p = s / sum_e s, per token (host; sigmoid is rare here)
    std::vector<float> s = scores.to_floats();
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += s[t * E + e];
      for (int64_t e = 0; e < E; ++e) s[t * E + e] = static_cast<float>(s[t * E + e] / sum);
    }
    p = on_device(Tensor::from_floats(s, {T, E}, DType::f32, MemCategory::workspace),
                  scores.device());
  }
  // prob_sum[e] += sum_t p[t, e] as a [1, T] x [T, E] product (stays on the device). The
  // column of ones is uploaded once per micro-batch size, not per layer (an upload waits).
  if (aux_ones_.numel() != T || aux_ones_.device() != scores.device()) {
    const std::vector<float> one(static_cast<size_t>(T), 1.0f);
    aux_ones_ = on_device(Tensor::from_floats(one, {T, 1}, DType::f32, MemCategory::other),
                          scores.device());
  }
  matmul(aux_ones_, true, p, false, aux_prob_sum_, 1.0f, 1.0f);
}

void Qwen3MoeModel::add_aux_grad(Tensor& d_logits, const Tensor& scores, double d_aux) const {
  if (d_aux == 0 || aux_rows_ == 0) return;
  const int64_t T = scores.size(0), E = scores.size(1);
  const Device dev = scores.device();
  // d aux / d p_te = E * c_e / R^2 for every layer and token (the counts are constants).
  const double R = static_cast<double>(aux_rows_);
  std::vector<float> g(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) g[e] = static_cast<float>(d_aux * E * aux_counts_[e] / (R * R));
  if (opts_.router == "softmax_topk") {
    // Through p = softmax(l): d l_te = s_te * (g_e - sum_j g_j s_tj).
    // diag(g) [E, E] and g [E, 1] travel in one upload (each upload waits for the device).
    std::vector<float> both(static_cast<size_t>((E + 1) * E), 0.0f);
    for (int64_t e = 0; e < E; ++e) both[e * E + e] = g[e];
    std::copy(g.begin(), g.end(), both.begin() + E * E);
    const Tensor up =
        on_device(Tensor::from_floats(both, {E + 1, E}, DType::f32, MemCategory::workspace), dev);
    const Tensor G = up.narrow(0, E);
    const Tensor gcol = up.narrow(E, 1).view({E, 1});
    matmul(scores, false, G, false, d_logits, 1.0f, 1.0f);
    Tensor u = Tensor::empty({T, 1}, DType::f32, dev, MemCategory::workspace);
    matmul(scores, false, gcol, false, u);
    axpy_inplace(d_logits, -1.0f, scale_rows(scores, u.view({T}), MemCategory::workspace));
    return;
  }
  // Sigmoid: p = s / S (S = sum_e s), s = sigmoid(l): d s_j = (g_j - sum_e g_e p_e) / S,
  // d l_j = d s_j * s_j * (1 - s_j). Host loop (sigmoid routing with an aux loss is rare).
  const std::vector<float> s = scores.to_floats();
  std::vector<float> dl(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    const float* st = s.data() + t * E;
    double S = 0, dot = 0;
    for (int64_t e = 0; e < E; ++e) S += st[e];
    for (int64_t e = 0; e < E; ++e) dot += g[e] * st[e] / S;
    for (int64_t e = 0; e < E; ++e)
      dl[t * E + e] = static_cast<float>((g[e] - dot) / S * st[e] * (1.0 - st[e]));
  }
  add_inplace(d_logits,
              on_device(Tensor::from_floats(dl, {T, E}, DType::f32, MemCategory::workspace), dev));
}

ForwardStats Qwen3MoeModel::forward_backward(const MicroBatch& mb, float loss_scale, double aux_scale) {
  return run(mb, true, loss_scale, aux_scale, nullptr);
}

ForwardStats Qwen3MoeModel::forward(const MicroBatch& mb, Tensor* logits) {
  return run(mb, false, 0.0f, 0.0, logits);
}

}  // namespace bb
