// router.cpp — boundary checks for the router, then the CPU reference (fp32 storage).
#include "primitives/moe/router.h"

#include "primitives/moe/router_ref.h"

namespace bb {

void RouterConfig::validate() const {
  BB_CHECK(num_experts >= 1, "RouterConfig: num_experts must be >= 1, got ", num_experts);
  BB_CHECK(top_k >= 1, "RouterConfig: top_k must be >= 1, got ", top_k);
  BB_CHECK(top_k <= num_experts, "RouterConfig: top_k (", top_k, ") > num_experts (", num_experts,
           ")");
  BB_CHECK(num_groups >= 1 && num_experts % num_groups == 0, "RouterConfig: num_groups (",
           num_groups, ") must be >= 1 and divide num_experts (", num_experts, ")");
  BB_CHECK(topk_groups >= 1 && topk_groups <= num_groups, "RouterConfig: topk_groups (",
           topk_groups, ") must be in [1, num_groups = ", num_groups, "]");
  BB_CHECK(
      static_cast<int64_t>(top_k) <= static_cast<int64_t>(topk_groups) * (num_experts / num_groups),
      "RouterConfig: top_k (", top_k, ") > experts in the ", topk_groups, " selected groups (",
      topk_groups * (num_experts / num_groups), ")");
  BB_CHECK(routed_scaling > 0, "RouterConfig: routed_scaling must be > 0, got ", routed_scaling);
}

namespace {
void check_logits(const Tensor& logits, const RouterConfig& cfg, const char* op) {
  check_dtype(logits, DType::f32, op, "logits");
  BB_CHECK(logits.device().is_cpu(), op, ": not implemented on ", logits.device().str(), " yet");
  BB_CHECK(logits.dim() == 2, op, ": argument 'logits' has shape ", shape_str(logits.shape()),
           ", expected [T, E = ", cfg.num_experts, "]");
  BB_CHECK(logits.size(0) > 0, op, ": empty batch (logits has T = 0 tokens)");
  check_shape(logits, {-1, cfg.num_experts}, op, "logits");
}
}  // namespace

RouterOutput router_forward(const Tensor& logits, const Tensor& expert_bias,
                            const RouterConfig& cfg, RouterSaved* saved) {
  const char* op = "router_forward";
  cfg.validate();
  check_logits(logits, cfg, op);
  const int64_t T = logits.size(0), E = cfg.num_experts, K = cfg.top_k;
  const float* bias = nullptr;
  if (expert_bias.defined()) {
    check_dtype(expert_bias, DType::f32, op, "expert_bias");
    check_shape(expert_bias, {E}, op, "expert_bias");
    check_same_device(logits, expert_bias, op);
    bias = expert_bias.data<float>();
  }

  Tensor scores = Tensor::empty({T, E}, DType::f32, Device::cpu(),
                                saved ? MemCategory::activations : MemCategory::workspace);
  ref::router_scores(scores.data<float>(), logits.data<float>(), T, E, cfg.score);

  RouterOutput out;
  out.topk_idx = Tensor::empty({T, K}, DType::i32, Device::cpu(), MemCategory::activations);
  ref::router_select(out.topk_idx.data<int32_t>(), scores.data<float>(), bias, T, cfg);
  out.topk_prob = Tensor::empty({T, K}, DType::f32, Device::cpu(), MemCategory::activations);
  ref::router_weights(out.topk_prob.data<float>(), scores.data<float>(),
                      out.topk_idx.data<int32_t>(), T, E, K, cfg.norm_topk_prob,
                      cfg.routed_scaling);
  out.tokens_per_expert.assign(E, 0);
  ref::router_counts(out.tokens_per_expert.data(), out.topk_idx.data<int32_t>(), T, E, K);
  out.aux_loss =
      ref::router_aux_loss(scores.data<float>(), out.tokens_per_expert.data(), T, E, cfg.score);
  out.z_loss = ref::router_z_loss(logits.data<float>(), T, E);
  if (saved) {
    saved->scores = scores;
    saved->topk_idx = out.topk_idx;
  }
  return out;
}

Tensor router_backward(const Tensor& d_topk_prob, double d_aux, double d_z, const Tensor& logits,
                       const RouterConfig& cfg, const RouterSaved& saved) {
  const char* op = "router_backward";
  cfg.validate();
  check_logits(logits, cfg, op);
  const int64_t T = logits.size(0), E = cfg.num_experts, K = cfg.top_k;
  check_dtype(saved.scores, DType::f32, op, "saved.scores");
  check_shape(saved.scores, {T, E}, op, "saved.scores");
  check_dtype(saved.topk_idx, DType::i32, op, "saved.topk_idx");
  check_shape(saved.topk_idx, {T, K}, op, "saved.topk_idx");
  check_same_device(logits, saved.scores, op);
  const float* dw = nullptr;
  if (d_topk_prob.defined()) {
    check_dtype(d_topk_prob, DType::f32, op, "d_topk_prob");
    check_shape(d_topk_prob, {T, K}, op, "d_topk_prob");
    check_same_device(logits, d_topk_prob, op);
    dw = d_topk_prob.data<float>();
  }
  Tensor d_logits = Tensor::empty({T, E}, DType::f32, Device::cpu(), MemCategory::activations);
  ref::router_backward(d_logits.data<float>(), dw, d_aux, d_z, logits.data<float>(),
                       saved.scores.data<float>(), saved.topk_idx.data<int32_t>(), T, cfg);
  return d_logits;
}

void update_expert_bias(Tensor& expert_bias, const std::vector<int64_t>& tokens_per_expert,
                        float rate) {
  const char* op = "update_expert_bias";
  check_dtype(expert_bias, DType::f32, op, "expert_bias");
  BB_CHECK(expert_bias.device().is_cpu(), op, ": not implemented on ", expert_bias.device().str(),
           " yet");
  const int64_t E = static_cast<int64_t>(tokens_per_expert.size());
  BB_CHECK(E >= 1, op, ": tokens_per_expert is empty");
  check_shape(expert_bias, {E}, op, "expert_bias");
  ref::update_expert_bias(expert_bias.data<float>(), tokens_per_expert.data(), E, rate);
}

}  // namespace bb
