// registry.cpp — the members of every primitive family. Adding a member: its folder, then one
// line in its family below.
#include "primitives/registry.h"

#include <sstream>

#include "core/error.h"

namespace bb {

const Family<LossHeadFactory>& loss_family() {
  static const Family<LossHeadFactory> f(
      "loss", "linear_ce",
      {{"full_ce", make_full_ce_head, "materialized [T, V] logits, then cross-entropy"},
       {"linear_ce", make_linear_ce_head, "logits streamed in chunks, never held whole"}});
  return f;
}

const Family<RecomputePolicy>& recompute_family() {
  static const Family<RecomputePolicy> f(
      "recompute", "none",
      {{"none", RecomputePolicy::none, "keep every layer's saved state until its backward"},
       {"full", RecomputePolicy::full, "keep each layer's input; rerun its forward in backward"}});
  return f;
}

const Family<RouterScore>& router_family() {
  static const Family<RouterScore> f(
      "router", "softmax_topk",
      {{"softmax_topk", RouterScore::softmax, "softmax scores, top-k"},
       {"sigmoid_topk", RouterScore::sigmoid, "sigmoid scores, top-k (DeepSeek-V3)"}});
  return f;
}

const Family<ExpertsImpl>& experts_family() {
  static const Family<ExpertsImpl> f(
      "experts", "sequential",
      {{"sequential", ExpertsImpl::sequential, "one GEMM per expert"},
       {"grouped", ExpertsImpl::grouped, "one grouped GEMM per projection for all experts"}});
  return f;
}

const Family<PermuteMode>& permute_family() {
  static const Family<PermuteMode> f(
      "permute", "standard",
      {{"standard", PermuteMode::standard, "probability applied at unpermute (after fc2)"},
       {"memory_efficient", PermuteMode::memory_efficient,
        "probability folded in before fc2; the expert output is not kept"}});
  return f;
}

const Family<AttentionKind>& attention_family() {
  static const Family<AttentionKind> f(
      "attention", "sdpa",
      {{"sdpa", AttentionKind::sdpa, "causal GQA attention over packed sequences"}});
  return f;
}

const Family<DispatcherFactory>& moe_dispatch_family() {
  static const Family<DispatcherFactory> f(
      "moe_dispatch", "allgather",
      {{"allgather", make_single_rank_dispatcher, "all-gather / reduce-scatter (one rank: local)"}});
  return f;
}

const Family<StateKind>& state_family() {
  static const Family<StateKind> f(
      "state", "replicated",
      {{"replicated", StateKind::replicated, "full parameters, gradients and optimizer state"}});
  return f;
}

const Family<OptimizerKind>& optimizer_family() {
  static const Family<OptimizerKind> f(
      "optimizer", "adamw",
      {{"adamw", OptimizerKind::adamw, "AdamW with fp32 master weights and moments"}});
  return f;
}

const std::vector<std::string>& PrimitiveSet::keys() {
  static const std::vector<std::string> k = {"loss",      "recompute",    "router",
                                             "experts",   "permute",      "attention",
                                             "moe_dispatch", "state",     "optimizer"};
  return k;
}

void PrimitiveSet::set(const std::string& key, const std::string& name, const std::string& where) {
  if (key == "loss") loss = loss_family().parse(name, where);
  else if (key == "recompute") recompute = recompute_family().parse(name, where);
  else if (key == "router") router = router_family().parse(name, where);
  else if (key == "experts") experts = experts_family().parse(name, where);
  else if (key == "permute") permute = permute_family().parse(name, where);
  else if (key == "attention") attention = attention_family().parse(name, where);
  else if (key == "moe_dispatch") moe_dispatch = moe_dispatch_family().parse(name, where);
  else if (key == "state") state = state_family().parse(name, where);
  else if (key == "optimizer") optimizer = optimizer_family().parse(name, where);
  else BB_FAIL("unknown primitive family '", key, "'");
}

const std::string& PrimitiveSet::name_of(const std::string& key) const {
  if (key == "loss") return loss.name;
  if (key == "recompute") return recompute.name;
  if (key == "router") return router.name;
  if (key == "experts") return experts.name;
  if (key == "permute") return permute.name;
  if (key == "attention") return attention.name;
  if (key == "moe_dispatch") return moe_dispatch.name;
  if (key == "state") return state.name;
  if (key == "optimizer") return optimizer.name;
  BB_FAIL("unknown primitive family '", key, "'");
}

void PrimitiveSet::validate(const std::string& where) const {
  const std::string in = where.empty() ? "" : " in " + where;
  BB_CHECK(loss_chunks.chunk_tokens > 0, "primitives.loss_chunk_tokens must be > 0", in, ", got ",
           loss_chunks.chunk_tokens);
  BB_CHECK(loss_chunks.chunk_vocab > 0, "primitives.loss_chunk_vocab must be > 0", in, ", got ",
           loss_chunks.chunk_vocab);
  BB_CHECK(loss_chunks.fused_chunk_tokens > 0, "primitives.loss_fused_chunk_tokens must be > 0",
           in, ", got ", loss_chunks.fused_chunk_tokens);
}

std::string PrimitiveSet::summary() const {
  std::ostringstream os;
  for (const std::string& k : keys()) os << (k == keys().front() ? "" : " ") << k << "=" << name_of(k);
  return os.str();
}

}  // namespace bb
