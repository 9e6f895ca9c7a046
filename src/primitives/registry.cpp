// registry.cpp — the members of every primitive family. Adding a member: its folder, then one
// line in its family below.
#include "primitives/registry.h"

#include <sstream>

#include "core/error.h"
#include "primitives/loss/policy.h"

namespace bb {

const Family<LossHeadFactory>& loss_family() {
  static const Family<LossHeadFactory> f(
      "loss", "linear_ce",
      {{"full_ce", make_full_ce_head, "materialized [T, V] logits, then cross-entropy"},
       {"linear_ce", make_linear_ce_head, "logits streamed in chunks, never held whole"},
       {"policy", make_policy_head,
        "RL policy objective (PPO / GRPO / GSPO, KL, entropy) on rollout data, streamed like linear_ce"}});
  return f;
}

const Family<RecomputePolicy>& recompute_family() {
  static const Family<RecomputePolicy> f(
      "recompute", "none",
      {{"none", RecomputePolicy::none, "keep every layer's saved state until its backward"},
       {"selective", RecomputePolicy::selective,
        "drop the named parts' internal activations; each block's backward rebuilds them"},
       {"full", RecomputePolicy::full, "keep each layer's input; rerun its forward in backward"}},
      {"selective", recompute_part_names(), recompute_default_parts()});
  return f;
}

static_assert(static_cast<size_t>(RecomputePart::count_) <= 32, "RecomputeParts holds 32 bits");

RecomputeParts recompute_parts(const Choice<RecomputePolicy>& c) {
  RecomputeParts p;
  if (c.value != RecomputePolicy::selective) return p;
  const std::vector<std::string>& names = recompute_part_names();
  for (const std::string& part : c.parts)
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == part) p.add(static_cast<RecomputePart>(i));
  return p;
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

const Family<SelfAttentionFactory>& attention_family() {
  static const Family<SelfAttentionFactory> f(
      "attention", "sdpa",
      {{"sdpa", make_sdpa_attention, "causal GQA attention over packed sequences (one rank's tokens)"},
       {"cp_ring", make_cp_ring_attention,
        "context parallel: KV blocks around the CP ring, partial outputs merged by log-sum-exp (any head count)"},
       {"cp_a2a", make_cp_a2a_attention,
        "context parallel: all-to-all to head-sharded q/k/v and back (heads % cp == 0; KV heads split or "
        "replicated)"}});
  return f;
}

const Family<GdnCpMode>& gdn_cp_family() {
  static const Family<GdnCpMode> f(
      "gdn_cp", "auto",
      {{"auto", GdnCpMode::automatic, "heads where cp divides the key and value head counts, else states"},
       {"heads", GdnCpMode::heads,
        "Gated DeltaNet layers under cp: all-to-all of the projections to heads and back (cp divides the heads)"},
       {"states", GdnCpMode::states,
        "Gated DeltaNet layers under cp: each rank runs its own tokens; only the conv halo and per-piece state "
        "summaries (K x K transition, K x V end state) cross ranks (any head count)"}});
  return f;
}

const Family<DispatcherFactory>& moe_dispatch_family() {
  static const Family<DispatcherFactory> f(
      "moe_dispatch", "allgather",
      {{"allgather", make_allgather_dispatcher,
        "all-gather the rows over the EP group, reduce-scatter the outputs back (one rank: nothing moves)"},
       {"alltoall", make_alltoall_dispatcher,
        "per-expert counts, then all-to-all-v of the rows; received rows sorted by local expert"},
       {"chunked_alltoall", make_chunked_alltoall_dispatcher,
        "alltoall in N chunks: one chunk's communication overlaps another chunk's expert GEMMs",
        kMaxDispatchChunks}});
  return f;
}

const Family<StateKind>& state_family() {
  static const Family<StateKind> f(
      "state", "replicated",
      {{"replicated", StateKind::replicated,
        "full parameters, gradients and optimizer state on every rank; gradients all-reduced"},
       {"zero1", StateKind::zero1,
        "optimizer state sharded; gradients reduce-scattered, parameters all-gathered after the step"},
       {"fsdp", StateKind::fsdp,
        "parameters, gradients and optimizer state sharded; units gathered around their use"}});
  return f;
}

const Family<OptimizerKind>& optimizer_family() {
  static const Family<OptimizerKind> f(
      "optimizer", "adamw",
      {{"adamw", OptimizerKind::adamw, "AdamW with fp32 master weights and moments (12 bytes per element)"},
       {"adamw_bf16_moments", OptimizerKind::adamw_bf16_moments,
        "AdamW with fp32 master weights, bf16 moments stochastically rounded (8 bytes per element)"},
       {"adamw_offload", OptimizerKind::adamw_offload,
        "AdamW's fp32 master and moments in host memory, updated by the host beside the backward and the next "
        "forward (no optimizer bytes on the device; 16 host bytes per element with the gradient's copy)"}});
  return f;
}

// Every family of a PrimitiveSet, in the order of the [primitives] table: the one list that
// keys(), set() and name_of() walk. f(choice, family) for each.
template <class Set, class F>
void for_each_family(Set& s, F&& f) {
  f(s.loss, loss_family());
  f(s.recompute, recompute_family());
  f(s.router, router_family());
  f(s.experts, experts_family());
  f(s.permute, permute_family());
  f(s.attention, attention_family());
  f(s.gdn_cp, gdn_cp_family());
  f(s.moe_dispatch, moe_dispatch_family());
  f(s.state, state_family());
  f(s.optimizer, optimizer_family());
}

const std::vector<std::string>& PrimitiveSet::keys() {
  static const std::vector<std::string> k = [] {
    std::vector<std::string> out;
    PrimitiveSet s;
    for_each_family(s, [&](auto&, const auto& fam) { out.push_back(fam.key()); });
    return out;
  }();
  return k;
}

void PrimitiveSet::set(const std::string& key, const std::string& name, const std::string& where) {
  bool found = false;
  for_each_family(*this, [&](auto& choice, const auto& fam) {
    if (fam.key() != key) return;
    choice = fam.parse(name, where);
    found = true;
  });
  BB_CHECK(found, "unknown primitive family '", key, "'");
}

const std::string& PrimitiveSet::name_of(const std::string& key) const {
  const std::string* name = nullptr;
  for_each_family(*this, [&](const auto& choice, const auto& fam) {
    if (fam.key() == key) name = &choice.name;
  });
  BB_CHECK(name, "unknown primitive family '", key, "'");
  return *name;
}

void PrimitiveSet::validate(const std::string& where) const {
  const std::string in = where.empty() ? "" : " in " + where;
  BB_CHECK(loss_chunks.chunk_tokens > 0, "primitives.loss_chunk_tokens must be > 0", in, ", got ",
           loss_chunks.chunk_tokens);
  BB_CHECK(loss_chunks.chunk_vocab > 0, "primitives.loss_chunk_vocab must be > 0", in, ", got ",
           loss_chunks.chunk_vocab);
  BB_CHECK(loss_chunks.fused_chunk_tokens > 0, "primitives.loss_fused_chunk_tokens must be > 0",
           in, ", got ", loss_chunks.fused_chunk_tokens);
  BB_CHECK(!loss_chunks.bf16_logits || name_of("loss") == "linear_ce",
           "primitives.loss_logits = \"bf16\" needs loss = \"linear_ce\"", in, " (loss is \"",
           name_of("loss"), "\"; full_ce keeps f32 logits)");
  validate_policy_config(loss_chunks.policy, in);
}

std::string PrimitiveSet::summary() const {
  std::ostringstream os;
  for (const std::string& k : keys()) os << (k == keys().front() ? "" : " ") << k << "=" << name_of(k);
  if (loss_chunks.bf16_logits) os << " loss_logits=bf16";
  if (router_replay) os << " router_replay=on";
  if (name_of("loss") == "policy") {
    const PolicyLossConfig& p = loss_chunks.policy;
    os << " policy(temperature=" << p.temperature << " clip=[" << p.clip_low << "," << p.clip_high << "]"
       << " dual_clip=" << p.dual_clip << " ratio=" << (p.ratio == PolicyRatio::token ? "token" : "sequence")
       << " aggregation="
       << (p.aggregation == PolicyAggregation::token_mean           ? "token_mean"
           : p.aggregation == PolicyAggregation::seq_mean_token_sum ? "seq_mean_token_sum"
                                                                    : "seq_mean_token_mean")
       << " kl=" << (p.kl == KlEstimator::k1 ? "k1" : "k3") << " kl_coef=" << p.kl_coef
       << " entropy_coef=" << p.entropy_coef << " max_log_ratio=" << p.max_log_ratio
       << " chunk_tokens=" << (p.chunk_tokens > 0 ? std::to_string(p.chunk_tokens) : std::string("auto"))
       << " blocks="
       << (p.blocks == PolicyBlocks::rows ? "rows" : p.blocks == PolicyBlocks::vocab ? "vocab" : "auto") << ")";
  }
  return os.str();
}

}  // namespace bb
