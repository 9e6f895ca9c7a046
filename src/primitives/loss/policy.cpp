// policy.cpp — the policy loss head (policy.h): the CPU path (BLAS for the block GEMMs, the row
// statistics, per-token objective and gradient rows here) and the CUDA path's host side (the
// GEMMs between the kernels of policy_cuda.cu).
//
// NOTES: row sweep: each block is [ct, V] f32 (ct = policy_chunk_rows(cfg.policy, T)), allocated
// once and reused; the gradient overwrites the logits in place, so the logits peak is exactly that
// block. The row statistics are one sweep over exp(z - max) (sum, and sum of p z for the entropy,
// in double); the gradient row a second. Vocab sweep (policy_vocab_cols): one [T, cols] f32 block,
// the row statistics merged over the column blocks in the shifted form (RowAcc), then the
// gradient block by block; both paths evaluate each token's objective with policy::token_terms.
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

// Row statistics merged over column blocks (the vocab sweep): the running max m of z, s = sum
// exp(z - m) and sz = sum exp(z - m) (z - m), in double, and the target's z.
struct RowAcc {
  double m = -std::numeric_limits<double>::infinity(), s = 0, sz = 0, zt = 0;
};

// Adds the n columns x[0, n) of one row (tempered by inv_temp) to a.
void acc_add_block(RowAcc& a, const float* x, int64_t n, double inv_temp) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < n; ++v) mx = std::max(mx, static_cast<double>(x[v]) * inv_temp);
  if (n == 0) return;
  double s = 0, sz = 0;
  for (int64_t v = 0; v < n; ++v) {
    const double d = static_cast<double>(x[v]) * inv_temp - mx;
    const double e = std::exp(d);
    s += e;
    sz += e * d;
  }
  policy::merge_shifted(a.m, a.s, a.sz, mx, s, sz);
}

RowStats acc_finish(const RowAcc& a) {
  RowStats r;
  r.lse = a.m + std::log(a.s);
  r.entropy = std::log(a.s) - a.sz / a.s;  // lse - E_p[z] = log s - E_p[z - m]
  r.logp = a.zt - r.lse;
  return r;
}

// Adds one valid token's terms to the call's sums.
void add_token(LossResult& r, const TokenTerms& tt, const RowStats& st, double wt, const float* sw, int64_t t) {
  PolicyMetrics& pm = r.policy;
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
}

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

// The per-row inputs of a CUDA call on the device (cuda::PolicyRowInputs over tensors kept
// here), the device targets and the row statistics buffer.
struct DeviceRows {
  Tensor tg, adv, old, ref, weight, seq_lr, stats;
  cuda::PolicyRowInputs ri;

  DeviceRows(const Tensor& targets, const PolicyTokens& in, const PolicyLossConfig& c, Device dev, int64_t T)
      : tg(detail::targets_on(targets, dev)) {
    auto up = [&](const Tensor& t) { return t.defined() ? t.to(dev, MemCategory::workspace) : Tensor(); };
    adv = up(in.advantages), old = up(in.old_logprobs), ref = up(in.ref_logprobs), weight = up(row_weights(in, c));
    auto ptr = [](const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; };
    ri = cuda::PolicyRowInputs{ptr(adv), ptr(old), ptr(ref), ptr(weight), nullptr};
    stats = Tensor::empty({T * cuda::kPolicyStats}, DType::f32, dev, MemCategory::workspace);
  }
  const int32_t* targets() const { return tg.data<int32_t>(); }
  float* stats_at(int64_t t0) { return stats.data<float>() + t0 * cuda::kPolicyStats; }
  // ratio = sequence: the sequences' mean log-ratios from the log-probs in `stats`, on the device.
  void set_sequence_ratios(const Tensor& targets, const PolicyTokens& in, const char* op) {
    const std::vector<float> st = stats.to_floats();
    const int64_t T = static_cast<int64_t>(st.size()) / cuda::kPolicyStats;
    std::vector<double> logp(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) logp[static_cast<size_t>(t)] = st[t * cuda::kPolicyStats + cuda::kStatLogp];
    const Tensor host_tg = targets.device().is_cpu() ? targets : targets.to(Device::cpu(), MemCategory::workspace);
    const std::vector<double> lr = sequence_log_ratios(in, logp, host_tg.data<int32_t>(), op);
    std::vector<float> lrf(lr.begin(), lr.end());
    seq_lr = Tensor::from_floats(lrf, {T}, DType::f32, MemCategory::workspace).to(stats.device(), MemCategory::workspace);
    ri.seq_lr = seq_lr.data<float>();
  }
};

// The vocab sweep on CUDA (policy_run_cpu_vocab's order): the column-statistics kernel after
// each logits GEMM, one row-terms kernel, then per block the gradient kernel and the two GEMMs
// (d_w's rows of the block written once; d_h accumulated over the blocks in f32).
LossResult policy_run_cuda_vocab(Mode mode, float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                                 const PolicyTokens& in, const PolicyLossConfig& c, Tensor* d_h, Tensor* d_w,
                                 bool overwrite_dw, const detail::LossHeadDims& dims, int64_t cols, const char* op) {
  const Device dev = h.device();
  const int idx = dev.index;
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const DType dt = h.dtype();
  DeviceRows rows(targets, in, c, dev, T);
  const int32_t* tgp = rows.targets();
  Tensor acc_buf = Tensor::empty({T * 8}, DType::f32, dev, MemCategory::workspace);  // f64 [T][4]
  double* acc = static_cast<double*>(acc_buf.raw());
  Tensor coef = Tensor::empty({T * 4}, DType::f32, dev, MemCategory::workspace);
  Tensor block = Tensor::empty({T * cols}, DType::f32, dev, MemCategory::logits);
  auto logits = [&](int64_t v0, int64_t nv) {
    cuda::gemm(false, true, T, nv, H, 1.0f, h.raw(), dt, H, w.narrow(v0, nv).raw(), dt, H, 0.0f, block.raw(),
               DType::f32, nv, idx);
  };
  for (int64_t v0 = 0; v0 < V; v0 += cols) {
    const int64_t nv = std::min(cols, V - v0);
    logits(v0, nv);
    cuda::policy_col_stats(block.data<float>(), nv, v0, V, tgp, c.temperature, v0 == 0, T, acc);
  }
  if (c.ratio == PolicyRatio::sequence) {  // the rows' log-probs first, then the sequences' ratios
    cuda::policy_row_terms(acc, V, tgp, c, cuda::PolicyRowInputs{}, 0.0f, T, rows.stats_at(0), coef.data<float>());
    rows.set_sequence_ratios(targets, in, op);
  }
  cuda::policy_row_terms(acc, V, tgp, c, rows.ri, scale, T, rows.stats_at(0), coef.data<float>());
  if (mode == Mode::train) {
    const bool dh_direct = d_h->dtype() == DType::f32;
    Tensor dh_acc = dh_direct ? Tensor() : Tensor::empty({T, H}, DType::f32, dev, MemCategory::workspace);
    void* dh = dh_direct ? d_h->raw() : dh_acc.raw();
    for (int64_t v0 = 0; v0 < V; v0 += cols) {
      const int64_t nv = std::min(cols, V - v0);
      const int64_t ldd = cuda::ce_fused_grad_ld(nv, DType::f32, dt);
      logits(v0, nv);
      cuda::policy_col_grad(block.data<float>(), nv, v0, tgp, c.temperature, coef.data<float>(), dt, T);
      cuda::gemm(false, false, T, H, nv, 1.0f, block.raw(), dt, ldd, w.narrow(v0, nv).raw(), dt, H,
                 v0 == 0 ? 0.0f : 1.0f, dh, DType::f32, H, idx);
      cuda::gemm(true, false, nv, H, T, 1.0f, block.raw(), dt, ldd, h.raw(), dt, H, overwrite_dw ? 0.0f : 1.0f,
                 d_w->narrow(v0, nv).raw(), DType::f32, H, idx);
    }
    if (!dh_direct) cuda::convert(d_h->raw(), d_h->dtype(), dh_acc.raw(), DType::f32, T * H);
  }
  return sum_row_stats(rows.stats.to_floats(), T, in, op, mode == Mode::train ? "; d_h and d_w are invalid" : "");
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
  if (const int64_t cols = policy_vocab_cols(c, mode == Mode::train, T, V, H); cols > 0 && !stats_out)
    return policy_run_cuda_vocab(mode, scale, h, w, targets, in, c, d_h, d_w, overwrite_dw, dims, cols, op);
  const int64_t ct = policy_chunk_rows(cfg.policy, T);
  const DType dt = h.dtype();  // GEMM operands; the gradient block has this dtype
  const int64_t ldd = cuda::ce_fused_grad_ld(V, DType::f32, dt);
  DeviceRows rows(targets, in, c, dev, T);
  const int32_t* tgp = rows.targets();
  Tensor block = Tensor::empty({ct * V}, DType::f32, dev, MemCategory::logits);
  auto logits = [&](int64_t t0, int64_t nt) {
    cuda::gemm(false, true, nt, V, H, 1.0f, h.narrow(t0, nt).raw(), dt, H, w.raw(), dt, H, 0.0f, block.raw(),
               DType::f32, V, idx);
  };
  if (c.ratio == PolicyRatio::sequence) {
    for (int64_t t0 = 0; t0 < T; t0 += ct) {
      const int64_t nt = std::min(ct, T - t0);
      logits(t0, nt);
      cuda::policy_rows(block.data<float>(), V, dt, false, tgp + t0, c, cuda::PolicyRowInputs{}, 0.0f, nt,
                        rows.stats_at(t0));
    }
    rows.set_sequence_ratios(targets, in, op);
  }
  const bool train = mode == Mode::train;
  const bool dh_direct = train && (d_h->dtype() == DType::f32 || d_h->dtype() == dt);
  Tensor dh_acc = train && !dh_direct ? Tensor::empty({ct, H}, DType::f32, dev, MemCategory::workspace) : Tensor();
  for (int64_t t0 = 0; t0 < T; t0 += ct) {
    const int64_t nt = std::min(ct, T - t0);
    logits(t0, nt);
    cuda::policy_rows(block.data<float>(), V, dt, train, tgp + t0, c, chunk_inputs(rows.ri, t0), scale, nt,
                      rows.stats_at(t0));
    if (!train) continue;
    const void* hc = h.narrow(t0, nt).raw();
    Tensor dh_dst = d_h->narrow(t0, nt);
    cuda::gemm(false, false, nt, H, V, 1.0f, block.raw(), dt, ldd, w.raw(), dt, H, 0.0f,
               dh_direct ? dh_dst.raw() : dh_acc.raw(), dh_direct ? d_h->dtype() : DType::f32, H, idx);
    if (!dh_direct) cuda::convert(dh_dst.raw(), d_h->dtype(), dh_acc.raw(), DType::f32, nt * H);
    const float beta = overwrite_dw && t0 == 0 ? 0.0f : 1.0f;
    cuda::gemm(true, false, V, H, nt, 1.0f, block.raw(), dt, ldd, hc, dt, H, beta, d_w->raw(), DType::f32, H, idx);
  }
  std::vector<float> st = rows.stats.to_floats();
  LossResult r = sum_row_stats(st, T, in, op, train ? "; d_h and d_w are invalid" : "");
  if (stats_out) *stats_out = std::move(st);
  return r;
}
#endif

// The vocab sweep on the CPU (policy_vocab_cols; the CUDA path's order): [T, cols] blocks,
// first the row statistics over every column block, then the rows' objectives, then the
// gradient block by block (d_w's rows of the block written once, d_h accumulated in f32).
LossResult policy_run_cpu_vocab(Mode mode, float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                                const PolicyTokens& in, const PolicyLossConfig& c, Tensor* d_h, Tensor* d_w,
                                const detail::LossHeadDims& dims, int64_t cols, const char* op) {
  const int64_t T = dims.num_tokens, V = dims.vocab, H = dims.hidden;
  const double inv_temp = 1.0 / c.temperature;
  const Tensor wf = cpu::as_f32(w), hf = cpu::as_f32(h);
  Tensor block = Tensor::empty({T * cols}, DType::f32, Device::cpu(), MemCategory::logits);
  float* x = block.data<float>();
  const int32_t* tg = targets.data<int32_t>();
  const float* sw = f32_or_null(in.seq_weight);
  auto logits = [&](int64_t v0, int64_t nv) {
    cpu::gemm<float>(false, true, T, nv, H, 1.0f, hf.data<float>(), H, wf.data<float>() + v0 * H, H, 0.0f, x, nv);
  };
  std::vector<RowAcc> acc(static_cast<size_t>(T));
  for (int64_t v0 = 0; v0 < V; v0 += cols) {
    const int64_t nv = std::min(cols, V - v0);
    logits(v0, nv);
    for (int64_t t = 0; t < T; ++t) {
      if (tg[t] < 0) continue;
      RowAcc& a = acc[static_cast<size_t>(t)];
      acc_add_block(a, x + t * nv, nv, inv_temp);
      if (tg[t] >= v0 && tg[t] < v0 + nv) a.zt = static_cast<double>(x[t * nv + tg[t] - v0]) * inv_temp;
    }
  }
  std::vector<RowStats> st(static_cast<size_t>(T));
  std::vector<double> logp(static_cast<size_t>(T), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] < 0) continue;
    st[static_cast<size_t>(t)] = acc_finish(acc[static_cast<size_t>(t)]);
    logp[static_cast<size_t>(t)] = st[static_cast<size_t>(t)].logp;
  }
  std::vector<double> seq_lr;
  if (c.ratio == PolicyRatio::sequence) seq_lr = sequence_log_ratios(in, logp, tg, op);
  const float* adv = in.advantages.data<float>();
  const float* old = f32_or_null(in.old_logprobs);
  const float* ref = f32_or_null(in.ref_logprobs);
  LossResult r;
  std::vector<double> g_lp(static_cast<size_t>(T), 0.0), g_h(static_cast<size_t>(T), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] < 0) continue;
    const size_t i = static_cast<size_t>(t);
    const TokenTerms tt = token_terms(c, st[i].logp, st[i].entropy, adv[t], old ? old[t] : kNaN, ref ? ref[t] : kNaN,
                                      seq_lr.empty() ? kNaN : seq_lr[i]);
    const double wt = c.aggregation == PolicyAggregation::seq_mean_token_mean ? sw[t] : 1.0;
    add_token(r, tt, st[i], wt, sw, t);
    g_lp[i] = static_cast<double>(scale) * wt * tt.d_logp;
    g_h[i] = static_cast<double>(scale) * wt * tt.d_entropy;
  }
  if (mode == Mode::forward) return r;
  const bool dh_direct = d_h->dtype() == DType::f32;
  Tensor dh_acc = dh_direct ? Tensor() : cpu::empty_f32({T, H}, MemCategory::workspace);
  float* dh = dh_direct ? d_h->data<float>() : dh_acc.data<float>();
  for (int64_t v0 = 0; v0 < V; v0 += cols) {
    const int64_t nv = std::min(cols, V - v0);
    logits(v0, nv);
    for (int64_t t = 0; t < T; ++t) {
      float* row = x + t * nv;
      if (tg[t] < 0) {
        std::fill(row, row + nv, 0.0f);
        continue;
      }
      const size_t i = static_cast<size_t>(t);
      grad_row(row, nv, inv_temp, st[i], tg[t] - static_cast<int32_t>(v0), g_lp[i], g_h[i]);
    }
    cpu::gemm<float>(false, false, T, H, nv, 1.0f, x, nv, wf.data<float>() + v0 * H, H, v0 == 0 ? 0.0f : 1.0f, dh, H);
    cpu::gemm<float>(true, false, nv, H, T, 1.0f, x, nv, hf.data<float>(), H, 1.0f, d_w->data<float>() + v0 * H, H);
  }
  if (!dh_direct) cpu::store_f32(*d_h, dh_acc);
  return r;
}

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
  if (const int64_t cols = policy_vocab_cols(c, mode == Mode::train, T, V, H); cols > 0)
    return policy_run_cpu_vocab(mode, scale, h, w, targets, in, c, d_h, d_w, dims, cols, op);

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
      add_token(r, tt, st, wt, sw, t);
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

int64_t policy_logits_bytes(int64_t num_tokens, int64_t vocab, int64_t hidden, const LossHeadConfig& cfg) {
  const int64_t cols = policy_vocab_cols(cfg.policy, true, num_tokens, vocab, hidden);
  return cols > 0 ? num_tokens * cols * 4 : std::min(policy_chunk_rows(cfg.policy, num_tokens), num_tokens) * vocab * 4;
}

int64_t policy_dh_accumulator_bytes(int64_t num_tokens, int64_t vocab, int64_t hidden, const LossHeadConfig& cfg) {
  return policy_vocab_cols(cfg.policy, true, num_tokens, vocab, hidden) > 0 ? num_tokens * hidden * 4 : 0;
}

std::unique_ptr<LossHead> make_policy_head(const LossHeadConfig& cfg) {
  return std::make_unique<PolicyHead>(cfg);
}

}  // namespace bb
