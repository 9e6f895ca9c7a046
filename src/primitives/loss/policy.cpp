// policy.cpp — the policy loss head on the CPU (policy.h): BLAS for the block GEMMs, the row
// statistics, per-token objective and gradient rows here.
//
// NOTES: each block is [ct, V] f32 (ct = policy_chunk_rows(cfg.policy, T)), allocated once and reused;
// the gradient overwrites the logits in place, so the logits peak is exactly that block. The
// row statistics are one sweep over exp(z - max) (sum, and sum of p z for the entropy, in
// double); the gradient row a second. On CUDA the head refuses with a clear error: its kernels
// are not written yet (the CPU path is the reference they will be checked against).
#include "primitives/loss/policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/cpu/util.h"
#include "core/trace.h"
#include "primitives/loss/loss_head.h"
#include "primitives/loss/policy_terms.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/gemm.h"
#include "backend/cuda/runtime.h"
#include "primitives/loss/loss_cuda.h"
#include "primitives/loss/policy_cuda.h"
#endif

namespace bb {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One row's statistics over the tempered logits z = x * inv_temp.
struct RowStats {
  double lse = 0, logp = 0, entropy = 0;
};

RowStats row_stats(const float* x, int64_t V, double inv_temp, int32_t target) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(x[v]) * inv_temp);
  double s = 0, sz = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double z = static_cast<double>(x[v]) * inv_temp;
    const double e = std::exp(z - mx);
    s += e;
    sz += e * z;
  }
  RowStats r;
  r.lse = mx + std::log(s);
  r.entropy = r.lse - sz / s;  // -sum p log p = lse - E_p[z]
  if (target >= 0) r.logp = static_cast<double>(x[target]) * inv_temp - r.lse;
  return r;
}

using policy::TokenTerms;
using policy::token_terms;

// d x of one row (in place over x): inv_temp [g_lp (onehot - p) - g_H p (log p + H)].
void grad_row(float* x, int64_t V, double inv_temp, const RowStats& st, int32_t target, double g_lp,
              double g_h) {
  for (int64_t v = 0; v < V; ++v) {
    const double lp = static_cast<double>(x[v]) * inv_temp - st.lse;
    const double p = std::exp(lp);
    double d = -g_lp * p - g_h * p * (lp + st.entropy);
    if (v == target) d += g_lp;
    x[v] = static_cast<float>(d * inv_temp);
  }
}

const float* f32_or_null(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }

void check_token_field(const Tensor& t, int64_t T, const char* op, const char* name) {
  if (!t.defined()) return;
  BB_CHECK(t.device().is_cpu(), op, ": ", name, " must be a host tensor");
  BB_CHECK(t.dtype() == DType::f32 && t.dim() == 1 && t.size(0) == T, op, ": ", name,
           " must be f32 [", T, "] (one value per token), got ", dtype_name(t.dtype()), " ",
           shape_str(t.shape()));
}

void check_inputs(const PolicyTokens& in, const PolicyLossConfig& c, int64_t T, const char* op) {
  BB_CHECK(in.advantages.defined(), op,
           ": the policy loss needs advantages: give rollout records with \"advantages\" (data.path "
           "JSONL, see skills/rl-data.md), or choose primitives.loss = \"linear_ce\"");
  check_token_field(in.advantages, T, op, "advantages");
  check_token_field(in.old_logprobs, T, op, "old_logprobs");
  check_token_field(in.ref_logprobs, T, op, "ref_logprobs");
  check_token_field(in.seq_weight, T, op, "seq_weight");
  BB_CHECK(c.kl_coef == 0 || in.ref_logprobs.defined(), op, ": policy.kl_coef = ", c.kl_coef,
           " needs ref_logprobs in the rollout records (or set policy.kl_coef = 0)");
  const bool seq = c.aggregation != PolicyAggregation::token_mean || c.ratio == PolicyRatio::sequence;
  BB_CHECK(!seq || in.seq_weight.defined(), op,
           ": sequence aggregation and policy.ratio = \"sequence\" need seq_weight (the packer gives it with "
           "advantages)");
  if (c.ratio == PolicyRatio::sequence) {
    BB_CHECK(in.cu_seqlens.defined() && in.cu_seqlens.device().is_cpu() && in.cu_seqlens.dtype() == DType::i32,
             op, ": policy.ratio = \"sequence\" needs the host cu_seqlens of the micro-batch");
    const int32_t* cu = in.cu_seqlens.data<int32_t>();
    const int64_t B = in.cu_seqlens.numel() - 1;
    BB_CHECK(B >= 1 && cu[0] == 0 && cu[B] == T, op, ": cu_seqlens must run from 0 to T = ", T);
  }
}

// The sequence mean log-ratio of every row (ratio = sequence), from the rows' log-probs.
std::vector<double> sequence_log_ratios(const PolicyTokens& in, const std::vector<double>& logp,
                                        const int32_t* tg, const char* op) {
  const int32_t* cu = in.cu_seqlens.data<int32_t>();
  const int64_t B = in.cu_seqlens.numel() - 1;
  const float* sw = in.seq_weight.data<float>();
  const float* old = f32_or_null(in.old_logprobs);
  std::vector<double> out(logp.size(), kNaN);
  for (int64_t b = 0; b < B; ++b) {
    double m = 0, wsum = 0;
    bool any = false;
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
      if (tg[t] < 0) continue;
      any = true;
      wsum += sw[t];
      if (old) m += sw[t] * (logp[static_cast<size_t>(t)] - old[t]);
    }
    BB_CHECK(!any || std::abs(wsum - 1.0) < 1e-3, op, ": policy.ratio = \"sequence\" (GSPO) needs each ",
             "sequence whole in one micro-batch on one rank, but sequence ", b, " (tokens [", cu[b], ", ",
             cu[b + 1], ")) holds a part of its document (weights sum to ", wsum,
             "); use data.packing = \"whole\" and parallel.cp = 1");
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) out[static_cast<size_t>(t)] = m;
  }
  return out;
}

enum class Mode { train, forward };

// w_t of every row (f32 [T] host): seq_weight for seq_mean_token_mean, else none (1).
Tensor row_weights(const PolicyTokens& in, const PolicyLossConfig& c) {
  return c.aggregation == PolicyAggregation::seq_mean_token_mean ? in.seq_weight : Tensor();
}

// Sums of the per-row statistics (cuda::PolicyStat) into a LossResult, in double.
#ifdef BB_WITH_CUDA
LossResult sum_row_stats(const std::vector<float>& st, int64_t T, const PolicyTokens& in, const char* op,
                         const std::string& consequence) {
  LossResult r;
  PolicyMetrics& pm = r.policy;
  const float* sw = f32_or_null(in.seq_weight);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = st.data() + t * cuda::kPolicyStats;
    BB_CHECK(row[cuda::kStatBadTarget] == 0.0f, op, ": target at row ", t, " is outside the vocabulary", consequence);
    if (row[cuda::kStatValid] == 0.0f) continue;
    r.loss_sum += row[cuda::kStatLoss];
    ++r.num_valid;
    pm.clipped += row[cuda::kStatClipped] != 0.0f;
    pm.dual_clipped += row[cuda::kStatDual] != 0.0f;
    pm.approx_kl += row[cuda::kStatApproxKl];
    pm.entropy += row[cuda::kStatEntropy];
    pm.ratio += row[cuda::kStatRatio];
    pm.ratio_max = std::max(pm.ratio_max, static_cast<double>(row[cuda::kStatRatio]));
    pm.ref_kl += row[cuda::kStatRefKl];
    if (sw) pm.sequences += sw[t];
  }
  return r;
}

// The per-row inputs of the chunk starting at row t0 (the kernel indexes rows from 0).
cuda::PolicyRowInputs chunk_inputs(const cuda::PolicyRowInputs& in, int64_t t0) {
  auto at = [t0](const float* p) { return p ? p + t0 : nullptr; };
  return cuda::PolicyRowInputs{at(in.adv), at(in.old), at(in.ref), at(in.weight), at(in.seq_lr)};
}

// The CUDA path: the CPU path's blocks and order, with the row kernel (policy_cuda.cu) between
// the logits GEMM and the two gradient GEMMs; one read of the row statistics at the end (two
// with ratio = sequence: the log-probs for the sequence ratios).
LossResult policy_run_cuda(Mode mode, float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                           const PolicyTokens& in, const LossHeadConfig& cfg, Tensor* d_h, Tensor* d_w,
                           bool overwrite_dw, const detail::LossHeadDims& dims, const char* op,
                           std::vector<float>* stats_out = nullptr) {
  const PolicyLossConfig& c = cfg.policy;
  const Device dev = h.device();
  const int idx = dev.index;
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const int64_t ct = policy_chunk_rows(cfg.policy, T);
  const DType dt = h.dtype();  // GEMM operands; the gradient block has this dtype
  const int64_t ldd = cuda::ce_fused_grad_ld(V, DType::f32, dt);
  Tensor tg = detail::targets_on(targets, dev);
  const int32_t* tgp = tg.data<int32_t>();
  auto up = [&](const Tensor& t) { return t.defined() ? t.to(dev, MemCategory::workspace) : Tensor(); };
  const Tensor adv = up(in.advantages), old = up(in.old_logprobs), ref = up(in.ref_logprobs);
  const Tensor weight = up(row_weights(in, c));
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; };
  cuda::PolicyRowInputs ri{ptr(adv), ptr(old), ptr(ref), ptr(weight), nullptr};
  Tensor stats = Tensor::empty({T * cuda::kPolicyStats}, DType::f32, dev, MemCategory::workspace);
  Tensor block = Tensor::empty({ct * V}, DType::f32, dev, MemCategory::logits);
  auto logits = [&](int64_t t0, int64_t nt) {
    cuda::gemm(false, true, nt, V, H, 1.0f, h.narrow(t0, nt).raw(), dt, H, w.raw(), dt, H, 0.0f, block.raw(),
               DType::f32, V, idx);
  };
  Tensor seq_lr;
  if (c.ratio == PolicyRatio::sequence) {
    for (int64_t t0 = 0; t0 < T; t0 += ct) {
      const int64_t nt = std::min(ct, T - t0);
      logits(t0, nt);
      cuda::policy_rows(block.data<float>(), V, dt, false, tgp + t0, c, cuda::PolicyRowInputs{}, 0.0f, nt,
                        stats.data<float>() + t0 * cuda::kPolicyStats);
    }
    const std::vector<float> st = stats.to_floats();
    std::vector<double> logp(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) logp[static_cast<size_t>(t)] = st[t * cuda::kPolicyStats + cuda::kStatLogp];
    const Tensor host_tg = targets.device().is_cpu() ? targets : targets.to(Device::cpu(), MemCategory::workspace);
    const std::vector<double> lr = sequence_log_ratios(in, logp, host_tg.data<int32_t>(), op);
    std::vector<float> lrf(lr.begin(), lr.end());
    seq_lr = Tensor::from_floats(lrf, {T}, DType::f32, MemCategory::workspace).to(dev, MemCategory::workspace);
    ri.seq_lr = seq_lr.data<float>();
  }
  const bool train = mode == Mode::train;
  const bool dh_direct = train && (d_h->dtype() == DType::f32 || d_h->dtype() == dt);
  Tensor dh_acc = train && !dh_direct ? Tensor::empty({ct, H}, DType::f32, dev, MemCategory::workspace) : Tensor();
  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    logits(t0, nt);
    cuda::policy_rows(block.data<float>(), V, dt, train, tgp + t0, c, chunk_inputs(ri, t0), scale, nt,
                      stats.data<float>() + t0 * cuda::kPolicyStats);
    if (!train) continue;
    const void* hc = h.narrow(t0, nt).raw();
    Tensor dh_dst = d_h->narrow(t0, nt);
    cuda::gemm(false, false, nt, H, V, 1.0f, block.raw(), dt, ldd, w.raw(), dt, H, 0.0f,
               dh_direct ? dh_dst.raw() : dh_acc.raw(), dh_direct ? d_h->dtype() : DType::f32, H, idx);
    if (!dh_direct) cuda::convert(dh_dst.raw(), d_h->dtype(), dh_acc.raw(), DType::f32, nt * H);
    const float beta = overwrite_dw && t0 == 0 ? 0.0f : 1.0f;
    cuda::gemm(true, false, V, H, nt, 1.0f, block.raw(), dt, ldd, hc, dt, H, beta, d_w->raw(), DType::f32, H, idx);
  }
  std::vector<float> st = stats.to_floats();
  LossResult r = sum_row_stats(st, T, in, op, train ? "; d_h and d_w are invalid" : "");
  if (stats_out) *stats_out = std::move(st);
  return r;
}
#endif

LossResult policy_run(Mode mode, float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                      const PolicyTokens& in, const LossHeadConfig& cfg, Tensor* d_h, Tensor* d_w,
                      bool overwrite_dw, const char* op) {
  const PolicyLossConfig& c = cfg.policy;
  validate_policy_config(c, std::string(" (") + op + ")");
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  if (mode == Mode::train) detail::check_head_grad_args(dims, h, *d_h, *d_w, op);
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  check_inputs(in, c, T, op);
#ifdef BB_WITH_CUDA
  if (h.device().is_cuda()) {
    if (mode == Mode::train && overwrite_dw && T == 0) d_w->zero_();
    return policy_run_cuda(mode, scale, h, w, targets, in, cfg, d_h, d_w, overwrite_dw, dims, op);
  }
#endif
  if (mode == Mode::train && overwrite_dw) d_w->zero_();

  const int64_t ct = policy_chunk_rows(cfg.policy, T);
  const double inv_temp = 1.0 / c.temperature;
  Tensor wf = cpu::as_f32(w);
  Tensor block = Tensor::empty({ct * V}, DType::f32, Device::cpu(), MemCategory::logits);
  float* x = block.data<float>();
  const int32_t* tg = targets.data<int32_t>();
  const float* adv = in.advantages.data<float>();
  const float* old = f32_or_null(in.old_logprobs);
  const float* ref = f32_or_null(in.ref_logprobs);
  const float* sw = f32_or_null(in.seq_weight);

  // GSPO: a forward sweep for every row's log-prob, then each sequence's mean log-ratio.
  std::vector<double> seq_lr;
  if (c.ratio == PolicyRatio::sequence) {
    std::vector<double> logp(static_cast<size_t>(T), 0.0);
    for (int64_t t0 = 0; t0 < T; t0 += ct) {
      const int64_t nt = std::min(ct, T - t0);
      Tensor hc = cpu::as_f32(h.narrow(t0, nt));
      cpu::gemm<float>(false, true, nt, V, H, 1.0f, hc.data<float>(), wf.data<float>(), 0.0f, x);
      for (int64_t i = 0; i < nt; ++i)
        if (tg[t0 + i] >= 0) logp[static_cast<size_t>(t0 + i)] = row_stats(x + i * V, V, inv_temp, tg[t0 + i]).logp;
    }
    seq_lr = sequence_log_ratios(in, logp, tg, op);
  }

  const bool dh_direct = mode == Mode::train && d_h->dtype() == DType::f32;
  Tensor dh_acc = mode == Mode::train && !dh_direct ? cpu::empty_f32({ct, H}, MemCategory::workspace) : Tensor();
  LossResult r;
  PolicyMetrics& pm = r.policy;
  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    Tensor hc = cpu::as_f32(h.narrow(t0, nt));
    cpu::gemm<float>(false, true, nt, V, H, 1.0f, hc.data<float>(), wf.data<float>(), 0.0f, x);
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      float* row = x + i * V;
      if (tg[t] < 0) {
        if (mode == Mode::train) std::fill(row, row + V, 0.0f);
        continue;
      }
      const RowStats st = row_stats(row, V, inv_temp, tg[t]);
      const TokenTerms tt = token_terms(c, st.logp, st.entropy, adv[t], old ? old[t] : kNaN,
                                        ref ? ref[t] : kNaN, seq_lr.empty() ? kNaN : seq_lr[static_cast<size_t>(t)]);
      const double wt = c.aggregation == PolicyAggregation::seq_mean_token_mean ? sw[t] : 1.0;
      r.loss_sum += wt * tt.loss;
      ++r.num_valid;
      pm.clipped += tt.clipped;
      pm.dual_clipped += tt.dual_clipped;
      pm.approx_kl += tt.ratio - 1.0 - tt.log_ratio;
      pm.entropy += st.entropy;
      pm.ratio += tt.ratio;
      pm.ratio_max = std::max(pm.ratio_max, tt.ratio);
      pm.ref_kl += tt.ref_kl;
      if (sw) pm.sequences += sw[t];
      if (mode == Mode::train) {
        const double g = static_cast<double>(scale) * wt;
        grad_row(row, V, inv_temp, st, tg[t], g * tt.d_logp, g * tt.d_entropy);
      }
    }
    if (mode == Mode::forward) continue;
    float* dh = dh_direct ? d_h->data<float>() + t0 * H : dh_acc.data<float>();
    cpu::gemm<float>(false, false, nt, H, V, 1.0f, x, wf.data<float>(), 0.0f, dh);
    cpu::gemm<float>(true, false, V, H, nt, 1.0f, x, hc.data<float>(), 1.0f, d_w->data<float>());
    if (!dh_direct) {
      Tensor dst = d_h->narrow(t0, nt);
      cpu::store_f32(dst, dh_acc.narrow(0, nt));
    }
  }
  return r;
}

class PolicyHead final : public LossHead {
 public:
  explicit PolicyHead(const LossHeadConfig& cfg) : cfg_(cfg) {}
  LossResult train(float, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, bool) const override {
    BB_FAIL("primitives.loss = \"policy\" needs a micro-batch with rollout fields (advantages, ...); "
            "it has no targets-only form");
  }
  LossResult evaluate(const Tensor&, const Tensor&, const Tensor&) const override {
    BB_FAIL("primitives.loss = \"policy\" needs a micro-batch with rollout fields (advantages, ...); "
            "it has no targets-only form");
  }
  LossResult train_batch(float scale, const Tensor& h, const Tensor& w, const MicroBatch& mb, Tensor& d_h,
                         Tensor& d_w, bool overwrite_dw) const override {
    return policy_loss_train(scale, h, w, mb.targets, tokens_of(mb), cfg_, d_h, d_w, overwrite_dw);
  }
  LossResult evaluate_batch(const Tensor& h, const Tensor& w, const MicroBatch& mb) const override {
    // A forward for logits only (generation, log-probs): no target, nothing to evaluate.
    if (!mb.advantages.defined() && mb.num_valid == 0) return LossResult{};
    return policy_loss_forward(h, w, mb.targets, tokens_of(mb), cfg_);
  }

 private:
  static PolicyTokens tokens_of(const MicroBatch& mb) {
    return PolicyTokens{mb.advantages, mb.old_logprobs, mb.ref_logprobs, mb.seq_weight, mb.cu_seqlens};
  }
  LossHeadConfig cfg_;
};

}  // namespace

void validate_policy_config(const PolicyLossConfig& c, const std::string& where) {
  BB_CHECK(std::isfinite(c.temperature) && c.temperature > 0, "policy.temperature must be > 0", where, ", got ",
           c.temperature);
  BB_CHECK(c.clip_low >= 0 && c.clip_high >= 0, "policy.clip_low and policy.clip_high must be >= 0", where,
           ", got ", c.clip_low, " and ", c.clip_high, " (a large value turns that side of the clip off)");
  BB_CHECK(c.dual_clip == 0 || c.dual_clip > 1, "policy.dual_clip must be 0 (off) or > 1", where, ", got ",
           c.dual_clip);
  BB_CHECK(std::isfinite(c.kl_coef) && c.kl_coef >= 0, "policy.kl_coef must be >= 0", where, ", got ", c.kl_coef);
  BB_CHECK(std::isfinite(c.entropy_coef), "policy.entropy_coef must be finite", where, ", got ", c.entropy_coef);
  BB_CHECK(c.max_log_ratio > 0, "policy.max_log_ratio must be > 0", where, ", got ", c.max_log_ratio);
  BB_CHECK(c.chunk_tokens >= 0, "primitives.loss_fused_chunk_tokens must be > 0 or \"auto\"", where, ", got ",
           c.chunk_tokens);
}

LossResult policy_loss_train(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                             const PolicyTokens& in, const LossHeadConfig& cfg, Tensor& d_h, Tensor& d_w,
                             bool overwrite_dw) {
  BB_RANGE("policy_loss");
  return policy_run(Mode::train, scale, h, w, targets, in, cfg, &d_h, &d_w, overwrite_dw, "policy_loss_train");
}

LossResult policy_loss_forward(const Tensor& h, const Tensor& w, const Tensor& targets, const PolicyTokens& in,
                               const LossHeadConfig& cfg) {
  BB_RANGE("policy_loss_forward");
  return policy_run(Mode::forward, 0.0f, h, w, targets, in, cfg, nullptr, nullptr, false, "policy_loss_forward");
}

void policy_token_stats(const Tensor& h, const Tensor& w, const Tensor& targets, const LossHeadConfig& cfg,
                        Tensor& logp, Tensor& entropy) {
  BB_RANGE("policy_token_stats");
  const char* op = "policy_token_stats";
  validate_policy_config(cfg.policy, op);
  const detail::LossHeadDims dims = detail::check_loss_head_inputs(h, w, targets, op);
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
#ifdef BB_WITH_CUDA
  if (h.device().is_cuda()) {
    // The forward sweep with a zero advantage: only the row statistics are read.
    const Tensor adv = Tensor::zeros({T}, DType::f32, Device::cpu(), MemCategory::workspace);
    LossHeadConfig tc = cfg;
    tc.policy.ratio = PolicyRatio::token;
    tc.policy.aggregation = PolicyAggregation::token_mean;
    std::vector<float> st;
    policy_run_cuda(Mode::forward, 0.0f, h, w, targets, PolicyTokens{adv, {}, {}, {}, {}}, tc, nullptr, nullptr, false,
                    dims, op, &st);
    logp = Tensor::zeros({T}, DType::f32, Device::cpu(), MemCategory::other);
    entropy = Tensor::zeros({T}, DType::f32, Device::cpu(), MemCategory::other);
    for (int64_t t = 0; t < T; ++t) {
      logp.data<float>()[t] = st[t * cuda::kPolicyStats + cuda::kStatLogp];
      entropy.data<float>()[t] = st[t * cuda::kPolicyStats + cuda::kStatEntropy];
    }
    return;
  }
#endif
  const int64_t ct = policy_chunk_rows(cfg.policy, T);
  const double inv_temp = 1.0 / cfg.policy.temperature;
  Tensor wf = cpu::as_f32(w);
  Tensor block = Tensor::empty({ct * V}, DType::f32, Device::cpu(), MemCategory::logits);
  logp = Tensor::zeros({T}, DType::f32, Device::cpu(), MemCategory::other);
  entropy = Tensor::zeros({T}, DType::f32, Device::cpu(), MemCategory::other);
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    Tensor hc = cpu::as_f32(h.narrow(t0, nt));
    cpu::gemm<float>(false, true, nt, V, H, 1.0f, hc.data<float>(), wf.data<float>(), 0.0f, block.data<float>());
    for (int64_t i = 0; i < nt; ++i) {
      const RowStats st = row_stats(block.data<float>() + i * V, V, inv_temp, tg[t0 + i]);
      logp.data<float>()[t0 + i] = tg[t0 + i] >= 0 ? static_cast<float>(st.logp) : 0.0f;
      entropy.data<float>()[t0 + i] = tg[t0 + i] >= 0 ? static_cast<float>(st.entropy) : 0.0f;
    }
  }
}

int64_t policy_logits_bytes(int64_t num_tokens, int64_t vocab, const LossHeadConfig& cfg) {
  return policy_chunk_rows(cfg.policy, num_tokens) * vocab * 4;
}

std::unique_ptr<LossHead> make_policy_head(const LossHeadConfig& cfg) {
  return std::make_unique<PolicyHead>(cfg);
}

}  // namespace bb
