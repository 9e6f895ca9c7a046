// decoder.cpp — building a decoder from its config (units, blocks, initialisation), its embedding
// and head, and the Hugging Face view of its parameters (decoder.h).
#include "models/decoder.h"

#include "primitives/loss/policy.h"

#include <algorithm>
#include <cmath>

#include "core/rng.h"
#include "core/trace.h"
#include "models/attention_block.h"
#include "models/gdn_block.h"
#include "models/mlp_block.h"
#include "models/moe_block.h"
#include "primitives/embedding/embedding.h"
#include "primitives/loss/cross_entropy.h"
#include "primitives/norm/rmsnorm.h"

namespace bb {

void ModelOptions::validate() const {
  prims.validate("");
  BB_CHECK(is_floating(param_dtype), "model parameter dtype must be a float type");
  BB_CHECK(moe_token_chunks >= 1 && moe_token_chunks <= kMaxMoeTokenChunks, "moe_token_chunks = ", moe_token_chunks,
           " is not in [1, ", kMaxMoeTokenChunks, "]");
  BB_CHECK(std::isfinite(aux_loss_coef) && aux_loss_coef >= 0 && std::isfinite(z_loss_coef) &&
               z_loss_coef >= 0,
           "aux and z loss coefficients must be finite and >= 0, got ", aux_loss_coef, " and ",
           z_loss_coef);
}

Tensor HfTensor::value() const { return unit_slice(param->unit->value, *param, offset, shape); }

Tensor HfTensor::grad() const { return unit_slice(param->unit->grad, *param, offset, shape); }

DecoderModel::~DecoderModel() = default;

DecoderModel::DecoderModel(const ModelConfig& cfg, const ModelOptions& opts, uint64_t seed)
    : cfg_(cfg), opts_(opts) {
  cfg_.validate();
  opts_.validate();
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  num_moe_layers_ = cfg.num_moe_layers();
  ParamUnit& embed_unit = store_.add_unit("embed", UnitKind::embedding);
  embed_ = &store_.add(embed_unit, "model.embed_tokens.weight", {V, H}, true);

  AttentionBlockConfig ac;
  ac.hidden = H;
  ac.num_heads = cfg.num_heads;
  ac.num_kv_heads = cfg.num_kv_heads;
  ac.head_dim = cfg.head_dim;
  ac.qkv_bias = cfg.qkv_bias;
  ac.qk_norm = cfg.qk_norm;
  ac.output_gate = cfg.attn_output_gate;
  ac.rope_theta = cfg.rope_theta;
  ac.rotary_dim = cfg.rotary_dim() == cfg.head_dim ? 0 : cfg.rotary_dim();
  ac.rms_norm_eps = cfg.rms_norm_eps;
  ac.zero_centered_norm = cfg.zero_centered_norm;
  GdnBlockConfig gc;
  gc.hidden = H;
  gc.num_key_heads = cfg.linear_num_key_heads;
  gc.num_value_heads = cfg.linear_num_value_heads;
  gc.key_head_dim = cfg.linear_key_head_dim;
  gc.value_head_dim = cfg.linear_value_head_dim;
  gc.conv_kernel = cfg.linear_conv_kernel_dim;
  gc.rms_norm_eps = cfg.rms_norm_eps;
  gc.zero_centered_norm = cfg.zero_centered_norm;
  int64_t moe_index = 0;
  layers_.resize(static_cast<size_t>(cfg.num_layers));
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    L.index = l;
    L.type = cfg.layer_type(l);
    L.moe = cfg.is_moe_layer(l);
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    const std::string unit = "layers." + std::to_string(l) + ".";
    ParamUnit& dense = store_.add_unit(unit + "dense", UnitKind::dense, l);
    switch (L.type) {
      case LayerType::full_attention:
        L.blocks.push_back(std::make_unique<AttentionBlock>(
            store_, dense, prefix, ac, opts_.prims.attention.value(SelfAttentionConfig{opts_.cp_group})));
        L.blocks.back()->units = {&dense};
        break;
      case LayerType::linear_attention: {
        // A_log and dt_bias stay fp32 whatever the parameter dtype: their own unit.
        ParamUnit& f32 = store_.add_unit(unit + "dense_f32", UnitKind::dense, l, /*f32_values=*/true);
        L.blocks.push_back(std::make_unique<GdnBlock>(
            store_, dense, f32, prefix, gc,
            GdnContextParallel(opts_.cp_group, opts_.prims.gdn_cp.value, gc.num_key_heads, gc.num_value_heads,
                               gc.conv_kernel)));
        L.blocks.back()->units = {&dense, &f32};
        break;
      }
    }
    if (L.moe) {
      ParamUnit& experts = store_.add_unit(unit + "experts", UnitKind::experts, l);
      MoeBlockConfig mc;
      mc.hidden = H;
      mc.num_experts = cfg.num_experts;
      mc.top_k = cfg.top_k;
      mc.expert_ffn = cfg.moe_intermediate_size;
      mc.shared_ffn = cfg.shared_expert_intermediate_size;
      mc.norm_topk_prob = cfg.norm_topk_prob;
      mc.rms_norm_eps = cfg.rms_norm_eps;
      mc.router = opts_.prims.router.value;
      mc.experts = opts_.prims.experts.value;
      mc.permute = opts_.prims.permute.value;
      mc.moe_index = moe_index++;
      mc.num_moe_layers = num_moe_layers_;
      mc.zero_centered_norm = cfg.zero_centered_norm;
      mc.replay_routing = opts_.prims.router_replay;
      mc.token_chunks = opts_.moe_token_chunks;
      DispatcherConfig dc;
      dc.num_experts = cfg.num_experts;
      dc.group = opts_.ep_group;
      dc.num_chunks = std::max<int64_t>(1, opts_.prims.moe_dispatch.count);
      dc.wgrad_stream = opts_.expert_wgrad_stream;
      L.blocks.push_back(std::make_unique<MoeBlock>(store_, dense, experts, prefix, mc,
                                                    opts_.prims.moe_dispatch.value(dc)));
      L.blocks.back()->units = {&dense, &experts};
    } else {
      L.blocks.push_back(std::make_unique<MlpBlock>(store_, dense, prefix, H,
                                                    cfg.intermediate_size, cfg.rms_norm_eps));
      L.blocks.back()->units = {&dense};
    }
  }
  ParamUnit& head = store_.add_unit("head", UnitKind::head);
  final_norm_ = &store_.add(head, "model.norm.weight", {H}, false, HfSplit::none,
                            cfg.zero_centered_norm ? ParamInit::zeros : ParamInit::ones);
  lm_head_ = cfg.tie_word_embeddings ? embed_ : &store_.add(head, "lm_head.weight", {V, H}, true);
  // An untied head's gradients are zeroed lazily (params.h): the loss head's first write of a
  // step overwrites lm_head's [V, H] instead of adding to a memset buffer (one pass of V x H x 4
  // bytes less at the step's start, one read less in the first chunk); the norm's is cleared
  // when it is stale. A tied lm_head is the embedding's table, whose backward adds.
  if (!cfg.tie_word_embeddings) final_norm_->lazy_zero_grad = lm_head_->lazy_zero_grad = true;
  store_.allocate(opts_.device, opts_.param_dtype, /*materialize=*/!opts_.defer_values);

  // Initialisation: each parameter draws from its own Philox stream (offset = index << 40), in
  // the order the parameters were declared, element e at counter offset + e. A unit holding
  // experts first_expert.. of a layer (expert parallelism) starts at that expert's counter, so
  // every expert gets the values it has on one rank. With defer_values the state family
  // initialises what each rank holds later (init_unit_range): the same values.
  seed_ = seed;
  uint64_t index = 0;
  for (Param* p : store_.params()) param_index_[p] = index++;
  if (!opts_.defer_values)
    for (Param* p : store_.params()) {
      Tensor v = p->value.view({p->numel()});
      init_param_slice(*p, 0, v);
    }
  loss_ = opts_.prims.loss.value(opts_.prims.loss_chunks);
}

void DecoderModel::init_param_slice(const Param& p, int64_t from, Tensor& dst) const {
  const int64_t n = dst.numel();
  BB_CHECK(from >= 0 && from + n <= p.numel(), "init_param_slice: elements [", from, ", ", from + n, ") of ", p.name,
           " (", p.numel(), " elements)");
  if (n == 0) return;
  const uint64_t index = param_index_.at(&p);
  const bool expert_param = p.hf == HfSplit::experts_gate_up || p.hf == HfSplit::experts_down;
  const uint64_t skip = expert_param ? static_cast<uint64_t>(p.unit->first_expert * (p.numel() / p.shape[0])) : 0;
  const uint64_t at = static_cast<uint64_t>(from);
  switch (p.init) {
    case ParamInit::normal:
      fill_normal(dst, seed_, (index << 40) + skip + at, 0.0f, static_cast<float>(cfg_.init_std));
      break;
    case ParamInit::zeros:
      dst.fill_(0.0);
      break;
    case ParamInit::ones:
      dst.fill_(1.0);
      break;
    case ParamInit::gdn_a_log: {  // A = U(0.01, 16), stored as log(A)
      Tensor u = Tensor::empty({n}, DType::f32, Device::cpu(), MemCategory::other);
      fill_uniform(u, seed_, (index << 40) + at, 0.01f, 16.0f);
      std::vector<float> v = u.to_floats();
      for (float& x : v) x = std::log(x);
      dst.copy_from(Tensor::from_floats(v, {n}, dst.dtype()).to(dst.device()));
      break;
    }
  }
}

void DecoderModel::init_unit_range(const ParamUnit& u, int64_t lo, int64_t len, Tensor& out) const {
  BB_CHECK(lo >= 0 && len >= 0 && lo + len <= u.numel && out.numel() == len, "init_unit_range: elements [", lo,
           ", ", lo + len, ") of unit ", u.name, " (", u.numel, " elements) into ", out.str());
  out.zero_();  // the alignment padding between parameters
  for (const Param* p : u.params) {
    const int64_t a = std::max(lo, p->offset), b = std::min(lo + len, p->offset + p->numel());
    if (a >= b) continue;
    Tensor dst = out.narrow(a - lo, b - a);
    init_param_slice(*p, a - p->offset, dst);
  }
}

void DecoderModel::check_batch(const MicroBatch& mb) const {
  check_dtype(mb.tokens, DType::i32, "model forward", "tokens");
  check_dtype(mb.targets, DType::i32, "model forward", "targets");
  BB_CHECK(mb.tokens.numel() > 0, "model forward: empty micro-batch (0 tokens)");
  BB_CHECK(mb.targets.numel() == mb.tokens.numel() && mb.positions.numel() == mb.tokens.numel(),
           "model forward: tokens, targets and positions must have the same length");
}

Tensor DecoderModel::embed_forward(const MicroBatch& mb) {
  return embedding_forward(mb.tokens, embed_->value);
}

void DecoderModel::embed_backward(const Tensor& d_x, const MicroBatch& mb) {
  embedding_backward(d_x, mb.tokens, embed_->grad);
}

Tensor DecoderModel::head_train(const Tensor& x, const MicroBatch& mb, float loss_scale,
                                ForwardStats& st) {
  RMSNormSaved fn;
  Tensor h = rmsnorm_forward(x, final_norm_->value, cfg_.rms_norm_eps, &fn, MemCategory::activations,
                             cfg_.zero_centered_norm);
  Tensor d_h;
  {
    BB_RANGE("loss_head");
    const bool overwrite = lm_head_->grad_stale;  // the step's first write of a lazily zeroed head
    const LossResult r = loss_->train_batch(loss_scale, h, lm_head_->value, mb, d_h, lm_head_->grad, overwrite);
    lm_head_->grad_stale = false;
    st.loss_sum = r.loss_sum;
    st.num_valid = r.num_valid;
    st.policy = r.policy;
  }
  h = Tensor();
  if (final_norm_->grad_stale) {  // [H]: cleared, then the norm's backward adds
    final_norm_->grad.zero_();
    final_norm_->grad_stale = false;
  }
  return rmsnorm_backward(d_h, x, final_norm_->value, fn, final_norm_->grad, cfg_.zero_centered_norm);
}

void DecoderModel::head_eval(const Tensor& x, const MicroBatch& mb, ForwardStats& st,
                             Tensor* logits) {
  Tensor h = rmsnorm_forward(x, final_norm_->value, cfg_.rms_norm_eps, nullptr,
                             MemCategory::activations, cfg_.zero_centered_norm);
  if (logits) *logits = lm_head_logits(h, lm_head_->value);
  BB_RANGE("loss_head");
  const LossResult r = loss_->evaluate_batch(h, lm_head_->value, mb);
  st.loss_sum = r.loss_sum;
  st.num_valid = r.num_valid;
  st.policy = r.policy;
}

void DecoderModel::head_token_stats(const Tensor& x, const MicroBatch& mb, const LossHeadConfig& head, Tensor& logp,
                                    Tensor& entropy) {
  Tensor h = rmsnorm_forward(x, final_norm_->value, cfg_.rms_norm_eps, nullptr, MemCategory::activations,
                             cfg_.zero_centered_norm);
  BB_RANGE("loss_head");
  policy_token_stats(h, lm_head_->value, mb.targets, head, logp, entropy);
}

std::vector<HfTensor> DecoderModel::hf_tensors(HfExperts experts) {
  const bool fused = experts == HfExperts::fused ||
                     (experts == HfExperts::native && cfg_.hf_fused_experts());
  std::vector<HfTensor> out;
  auto whole = [](const std::string& name, Param* p, int64_t offset, const Shape& shape) {
    return HfTensor{name, p, offset, shape, 0, shape.at(0)};
  };
  auto strip = [](const std::string& name, const std::string& suffix) {
    BB_CHECK(name.size() >= suffix.size() &&
                 name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0,
             "hf_tensors: parameter ", name, " does not end in ", suffix);
    return name.substr(0, name.size() - suffix.size());
  };
  for (Param* p : store_.params()) {
    const bool expert_param = p->hf == HfSplit::experts_gate_up || p->hf == HfSplit::experts_down;
    if (expert_param && fused) {  // [E_l, ...]: rows first_expert.. of the HF [E, ...] tensor
      out.push_back({p->name, p, 0, p->shape, p->unit->first_expert, cfg_.num_experts});
      continue;
    }
    switch (p->hf) {
      case HfSplit::none:
        out.push_back(whole(p->name, p, 0, p->shape));
        break;
      case HfSplit::gate_up: {  // [2I, H] -> gate_proj [I, H], up_proj [I, H]
        const std::string base = strip(p->name, "gate_up_proj");
        const int64_t I = p->shape[0] / 2, H = p->shape[1];
        out.push_back(whole(base + "gate_proj.weight", p, 0, {I, H}));
        out.push_back(whole(base + "up_proj.weight", p, I * H, {I, H}));
        break;
      }
      case HfSplit::experts_gate_up: {  // [E_l, 2F, H] -> per expert gate_proj, up_proj [F, H]
        const std::string base = strip(p->name, "gate_up_proj");
        const int64_t F = p->shape[1] / 2, H = p->shape[2];
        for (int64_t e = 0; e < p->shape[0]; ++e) {
          const std::string pre = base + std::to_string(p->unit->first_expert + e) + ".";
          out.push_back(whole(pre + "gate_proj.weight", p, e * 2 * F * H, {F, H}));
          out.push_back(whole(pre + "up_proj.weight", p, e * 2 * F * H + F * H, {F, H}));
        }
        break;
      }
      case HfSplit::experts_down: {  // [E_l, H, F] -> per expert down_proj [H, F]
        const std::string base = strip(p->name, "down_proj");
        const int64_t Hd = p->shape[1], F = p->shape[2];
        for (int64_t e = 0; e < p->shape[0]; ++e)
          out.push_back(whole(base + std::to_string(p->unit->first_expert + e) + ".down_proj.weight",
                              p, e * Hd * F, {Hd, F}));
        break;
      }
    }
  }
  return out;
}

}  // namespace bb
