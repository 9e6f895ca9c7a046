// router.cpp — boundary checks for the router, then the CPU reference (fp32 storage) or, for
// tensors on a CUDA device, the kernels of router_cuda.cu.
//
// On CUDA the forward makes exactly one device->host copy (aux, z and the expert counts, which
// RouterOutput holds on the host); the backward makes none.
#include "primitives/moe/router.h"

#include "core/trace.h"

#include <cstring>

#include "primitives/moe/router_ref.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#include "primitives/moe/router_cuda.h"
#endif

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

RouterReplay balanced_routing(int64_t tokens, int64_t num_experts, int64_t top_k, Device dev) {
  BB_CHECK(tokens >= 0 && num_experts >= 1 && top_k >= 1 && top_k <= num_experts, "balanced_routing: ", tokens,
           " tokens, ", num_experts, " experts, top-", top_k, " (needs 1 <= top_k <= experts)");
  BB_CHECK(tokens * top_k < (int64_t{1} << 31), "balanced_routing: ", tokens, " x ", top_k, " rows exceed int32");
  const int64_t stride = num_experts / top_k;
  std::vector<int32_t> idx(static_cast<size_t>(tokens * top_k));
  RouterReplay r;
  r.tokens_per_expert.assign(static_cast<size_t>(num_experts), 0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t e = (t + k * stride) % num_experts;
      idx[static_cast<size_t>(t * top_k + k)] = static_cast<int32_t>(e);
      ++r.tokens_per_expert[static_cast<size_t>(e)];
    }
  r.topk_idx = Tensor::from_ints(idx, {tokens, top_k});
  if (!dev.is_cpu()) r.topk_idx = r.topk_idx.to(dev, MemCategory::other);
  return r;
}

Tensor routing_logit_bias(const RouterReplay& r, int64_t num_experts, float magnitude, Device dev) {
  BB_CHECK(r.topk_idx.defined() && r.topk_idx.dim() == 2, "routing_logit_bias: no routing");
  const int64_t T = r.topk_idx.size(0), K = r.topk_idx.size(1);
  const std::vector<int32_t> idx = r.topk_idx.to_ints();
  std::vector<float> bias(static_cast<size_t>(T * num_experts), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[static_cast<size_t>(t * K + k)];
      BB_CHECK(e >= 0 && e < num_experts, "routing_logit_bias: expert ", e, " of token ", t, " outside [0, ",
               num_experts, ")");
      bias[static_cast<size_t>(t * num_experts + e)] = magnitude;
    }
  Tensor b = Tensor::from_floats(bias, {T, num_experts});
  return dev.is_cpu() ? b : b.to(dev, MemCategory::other);
}

namespace {
// CPU always; CUDA when this build has the CUDA backend.
void check_device(const Tensor& t, const char* op, const char* arg) {
#ifdef BB_WITH_CUDA
  if (t.device().is_cuda()) return;
#endif
  BB_CHECK(t.device().is_cpu(), op, ": not implemented on ", t.device().str(), " yet (argument '",
           arg, "')");
}

void check_logits(const Tensor& logits, const RouterConfig& cfg, const char* op) {
  check_dtype(logits, DType::f32, op, "logits");
  check_device(logits, op, "logits");
  BB_CHECK(logits.dim() == 2, op, ": argument 'logits' has shape ", shape_str(logits.shape()),
           ", expected [T, E = ", cfg.num_experts, "]");
  BB_CHECK(logits.size(0) > 0, op, ": empty batch (logits has T = 0 tokens)");
  check_shape(logits, {-1, cfg.num_experts}, op, "logits");
}

#ifdef BB_WITH_CUDA
RouterOutput router_forward_cuda(const Tensor& logits, const Tensor& expert_bias,
                                 const RouterConfig& cfg, RouterSaved* saved,
                                 const RouterReplay* replay) {
  const Device dev = logits.device();
  const int64_t T = logits.size(0), E = cfg.num_experts, K = cfg.top_k;
  RouterOutput out;
  Tensor scores;
  if (saved) scores = Tensor::empty({T, E}, DType::f32, dev, MemCategory::activations);
  out.topk_idx = replay ? replay->topk_idx
                        : Tensor::empty({T, K}, DType::i32, dev, MemCategory::activations);
  out.topk_prob = Tensor::empty({T, K}, DType::f32, dev, MemCategory::activations);
  const size_t stats_bytes = cuda::RouterStatsLayout::bytes(E);
  Tensor partials =
      Tensor::empty({static_cast<int64_t>(cuda::router_partials_bytes(T, cfg))}, DType::u8, dev,
                    MemCategory::workspace);
  Tensor stats =
      Tensor::empty({static_cast<int64_t>(stats_bytes)}, DType::u8, dev, MemCategory::workspace);
  cuda::router_forward(logits.data<float>(),
                       expert_bias.defined() ? expert_bias.data<float>() : nullptr,
                       saved ? scores.data<float>() : nullptr, out.topk_idx.data<int32_t>(),
                       out.topk_prob.data<float>(), partials.raw(), stats.raw(), T, cfg,
                       replay ? replay->topk_idx.data<int32_t>() : nullptr);
  if (replay) {  // the counts are known; no losses: nothing to read back
    out.tokens_per_expert = replay->tokens_per_expert;
    if (saved) {
      saved->scores = scores;
      saved->topk_idx = out.topk_idx;
    }
    return out;
  }
  // The forward's one host synchronisation: aux, z and the counts in one small copy
  // (cuda::memcpy waits for the stream and records it with cuda::note_host_sync()).
  std::vector<unsigned char> host(stats_bytes);
  cuda::memcpy(host.data(), Device::cpu(), stats.raw(), dev, stats_bytes);
  std::memcpy(&out.aux_loss, host.data() + cuda::RouterStatsLayout::kAuxOffset, sizeof(double));
  std::memcpy(&out.z_loss, host.data() + cuda::RouterStatsLayout::kZOffset, sizeof(double));
  out.tokens_per_expert.assign(E, 0);
  for (int64_t e = 0; e < E; ++e) {
    int32_t c = 0;
    std::memcpy(&c, host.data() + cuda::RouterStatsLayout::kCountsOffset + 4 * e, sizeof(c));
    out.tokens_per_expert[e] = c;
  }
  if (saved) {
    saved->scores = scores;
    saved->topk_idx = out.topk_idx;
  }
  return out;
}
#endif
}  // namespace

RouterOutput router_forward(const Tensor& logits, const Tensor& expert_bias,
                            const RouterConfig& cfg, RouterSaved* saved,
                            const RouterReplay* replay) {
  BB_RANGE("router_forward");
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
  if (replay) {
    check_dtype(replay->topk_idx, DType::i32, op, "replay.topk_idx");
    check_shape(replay->topk_idx, {T, K}, op, "replay.topk_idx");
    check_same_device(logits, replay->topk_idx, op);
    BB_CHECK(static_cast<int64_t>(replay->tokens_per_expert.size()) == E, op,
             ": replay.tokens_per_expert has ", replay->tokens_per_expert.size(),
             " entries for ", E, " experts");
  }
#ifdef BB_WITH_CUDA
  if (logits.device().is_cuda())
    return router_forward_cuda(logits, expert_bias, cfg, saved, replay);
#endif

  Tensor scores = Tensor::empty({T, E}, DType::f32, Device::cpu(),
                                saved ? MemCategory::activations : MemCategory::workspace);
  ref::router_scores(scores.data<float>(), logits.data<float>(), T, E, cfg.score);

  RouterOutput out;
  if (replay) {
    const int32_t* idx = replay->topk_idx.data<int32_t>();
    for (int64_t i = 0; i < T * K; ++i)
      BB_CHECK(idx[i] >= 0 && idx[i] < E, op, ": replay.topk_idx[", i / K, ", ", i % K, "] = ",
               idx[i], " is out of range [0, ", E, ")");
    out.topk_idx = replay->topk_idx;
  } else {
    out.topk_idx = Tensor::empty({T, K}, DType::i32, Device::cpu(), MemCategory::activations);
    ref::router_select(out.topk_idx.data<int32_t>(), scores.data<float>(), bias, T, cfg);
  }
  out.topk_prob = Tensor::empty({T, K}, DType::f32, Device::cpu(), MemCategory::activations);
  ref::router_weights(out.topk_prob.data<float>(), scores.data<float>(),
                      out.topk_idx.data<int32_t>(), T, E, K, cfg.norm_topk_prob,
                      cfg.routed_scaling);
  if (replay) {
    out.tokens_per_expert = replay->tokens_per_expert;
    if (saved) {
      saved->scores = scores;
      saved->topk_idx = out.topk_idx;
    }
    return out;
  }
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
  BB_RANGE("router_backward");
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
  check_same_device(logits, saved.topk_idx, op);
#ifdef BB_WITH_CUDA
  if (logits.device().is_cuda()) {
    const Device dev = logits.device();
    Tensor d_logits = Tensor::empty({T, E}, DType::f32, dev, MemCategory::activations);
    Tensor counts = Tensor::empty({E}, DType::i32, dev, MemCategory::workspace);
    cuda::router_backward(d_logits.data<float>(), dw, d_aux, d_z, logits.data<float>(),
                          saved.scores.data<float>(), saved.topk_idx.data<int32_t>(),
                          counts.data<int32_t>(), T, cfg);
    return d_logits;
  }
#endif
  Tensor d_logits = Tensor::empty({T, E}, DType::f32, Device::cpu(), MemCategory::activations);
  ref::router_backward(d_logits.data<float>(), dw, d_aux, d_z, logits.data<float>(),
                       saved.scores.data<float>(), saved.topk_idx.data<int32_t>(), T, cfg);
  return d_logits;
}

void update_expert_bias(Tensor& expert_bias, const std::vector<int64_t>& tokens_per_expert,
                        float rate) {
  const char* op = "update_expert_bias";
  check_dtype(expert_bias, DType::f32, op, "expert_bias");
  check_device(expert_bias, op, "expert_bias");
  const int64_t E = static_cast<int64_t>(tokens_per_expert.size());
  BB_CHECK(E >= 1, op, ": tokens_per_expert is empty");
  check_shape(expert_bias, {E}, op, "expert_bias");
  if (!expert_bias.device().is_cpu()) {
    // E floats once per step: update a host copy and write it back (two small copies).
    Tensor host = expert_bias.to(Device::cpu());
    ref::update_expert_bias(host.data<float>(), tokens_per_expert.data(), E, rate);
    expert_bias.copy_from(host);
    return;
  }
  ref::update_expert_bias(expert_bias.data<float>(), tokens_per_expert.data(), E, rate);
}

}  // namespace bb
