// The policy loss head (primitives/loss/policy.h).
//
// Oracles: the reference on materialised logits (policy_ref.h, written from the textbook
// formulas: -min(r A, clip(r) A), -sum p log p, GSPO's sequence mean) in double, for the values
// and, by central finite differences, for d_h and d_w; linear_ce_fused as the family baseline
// (advantage 1, on-policy, no KL or entropy: the policy gradient is cross-entropy's); the
// allocator's logits peak for the memory claim.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "primitives/loss/cross_entropy_ref.h"
#include "primitives/loss/linear_ce.h"
#include "primitives/loss/loss_head.h"
#include "primitives/loss/policy.h"
#include "primitives/loss/policy_ref.h"

namespace bb {
namespace {

// A policy problem: h [T, H], w [V, H], targets (some masked), two sequences [0, s1), [s1, T),
// advantages (per sequence or per token), old / ref log-probs near the current policy's.
struct Case {
  int64_t T, V, H;
  std::vector<float> h, w;
  std::vector<int32_t> targets, cu;
  std::vector<float> adv, old, ref, sw;
};

Case make_case(uint64_t seed, bool per_seq_adv, double old_spread = 0.6, int64_t T = 9, int64_t V = 13,
               int64_t H = 5) {
  Case c{T, V, H, test::randn(T * H, seed), test::randn(V * H, seed + 1, 0.5f), {}, {}, {}, {}, {}, {}};
  const int64_t s1 = T / 2;
  c.cu = {0, static_cast<int32_t>(s1), static_cast<int32_t>(T)};
  auto u = test::randu(T, seed + 2, 0.0f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    c.targets.push_back(std::min<int32_t>(static_cast<int32_t>(u[t] * V), static_cast<int32_t>(V - 1)));
    if (t % 4 == 2) c.targets[t] = -1;
  }
  // The current log-probs, so that old / ref sit around them (ratios on both sides of the clip).
  std::vector<double> logits(T * V), lp;
  std::vector<double> hd = test::cast<double>(c.h), wd = test::cast<double>(c.w);
  ref::lm_head_logits<double>(logits.data(), hd.data(), wd.data(), T, V, H);
  std::vector<float> zeros(T, 0.0f), ones(T, 1.0f);
  PolicyLossConfig pc;
  ref::policy_objective<double>(pc, logits.data(), T, V, c.targets.data(), zeros.data(), zeros.data(), nullptr,
                                ones.data(), c.cu.data(), 2, &lp);
  auto n1 = test::randn(T, seed + 3, static_cast<float>(old_spread)), n2 = test::randn(T, seed + 4, 0.3f);
  auto a = test::randn(T, seed + 5);
  for (int64_t t = 0; t < T; ++t) {
    c.old.push_back(static_cast<float>(std::min(-1e-3, lp[t] + n1[t])));
    c.ref.push_back(static_cast<float>(std::min(-1e-3, lp[t] + n2[t])));
    c.adv.push_back(per_seq_adv ? (t < s1 ? 0.8f : -1.3f) : a[t]);
  }
  for (int b = 0; b < 2; ++b) {
    int64_t n = 0;
    for (int64_t t = c.cu[b]; t < c.cu[b + 1]; ++t) n += c.targets[t] >= 0;
    for (int64_t t = c.cu[b]; t < c.cu[b + 1]; ++t) c.sw.push_back(c.targets[t] >= 0 ? 1.0f / n : 0.0f);
  }
  return c;
}

struct Inputs {
  Tensor h, w, tg;
  PolicyTokens in;
};

Inputs inputs(const Case& c, bool with_old = true) {
  Inputs x;
  x.h = Tensor::from_floats(c.h, {c.T, c.H});
  x.w = Tensor::from_floats(c.w, {c.V, c.H});
  x.tg = Tensor::from_ints(c.targets, {c.T});
  x.in.advantages = Tensor::from_floats(c.adv, {c.T});
  if (with_old) x.in.old_logprobs = Tensor::from_floats(c.old, {c.T});
  x.in.ref_logprobs = Tensor::from_floats(c.ref, {c.T});
  x.in.seq_weight = Tensor::from_floats(c.sw, {c.T});
  x.in.cu_seqlens = Tensor::from_ints(c.cu, {3});
  return x;
}

// The reference objective of (h, w) flattened, in double.
double ref_objective(const Case& c, const PolicyLossConfig& pc, const std::vector<double>& hw,
                     std::vector<double>* logp = nullptr, std::vector<double>* ent = nullptr) {
  std::vector<double> logits(c.T * c.V);
  ref::lm_head_logits<double>(logits.data(), hw.data(), hw.data() + c.T * c.H, c.T, c.V, c.H);
  return ref::policy_objective<double>(pc, logits.data(), c.T, c.V, c.targets.data(), c.adv.data(), c.old.data(),
                                       c.ref.data(), c.sw.data(), c.cu.data(), 2, logp, ent);
}

std::vector<double> flat(const Case& c) {
  std::vector<double> x = test::cast<double>(c.h);
  for (float v : c.w) x.push_back(v);
  return x;
}

LossHeadConfig head_cfg(const PolicyLossConfig& pc, int64_t chunk = 4) {
  LossHeadConfig cfg;
  cfg.fused_chunk_tokens = chunk;
  cfg.policy = pc;
  cfg.policy.chunk_tokens = chunk;
  return cfg;
}

struct Out {
  LossResult r;
  std::vector<float> d_h, d_w;
};

Out run(const Case& c, const Inputs& x, const LossHeadConfig& cfg, float scale, const std::vector<float>& dw0,
        DType dh_dtype = DType::f32) {
  Tensor d_h = Tensor::from_floats(test::randn(c.T * c.H, 77, 5.0f), {c.T, c.H}, dh_dtype);
  Tensor d_w = Tensor::from_floats(dw0, {c.V, c.H});
  Out o;
  o.r = policy_loss_train(scale, x.h, x.w, x.tg, x.in, cfg, d_h, d_w);
  o.d_h = d_h.to_floats();
  o.d_w = d_w.to_floats();
  for (size_t i = 0; i < o.d_w.size(); ++i) o.d_w[i] -= dw0[i];
  return o;
}

struct Named {
  const char* name;
  PolicyLossConfig pc;
  bool per_seq_adv;
};

std::vector<Named> objectives() {
  std::vector<Named> v;
  PolicyLossConfig ppo;  // clipped ratio, k3 KL, entropy bonus, a temperature
  ppo.temperature = 0.7;
  ppo.clip_low = 0.2;
  ppo.clip_high = 0.28;
  ppo.kl_coef = 0.05;
  ppo.entropy_coef = 0.01;
  v.push_back({"ppo_token_mean_k3", ppo, false});
  PolicyLossConfig dual = ppo;  // dual clip, k1, sequence mean of token means
  dual.dual_clip = 1.5;
  dual.kl = KlEstimator::k1;
  dual.temperature = 1.0;
  dual.aggregation = PolicyAggregation::seq_mean_token_mean;
  v.push_back({"dual_clip_k1_seq_mean_token_mean", dual, false});
  PolicyLossConfig sum = ppo;
  sum.aggregation = PolicyAggregation::seq_mean_token_sum;
  sum.kl_coef = 0;
  v.push_back({"seq_mean_token_sum", sum, false});
  PolicyLossConfig gspo;  // GSPO: sequence ratio, per-sequence advantages, sequence means
  gspo.ratio = PolicyRatio::sequence;
  gspo.clip_low = 0.3;  // wide: sequence ratios are means, nearer 1 than token ratios
  gspo.clip_high = 0.4;
  gspo.aggregation = PolicyAggregation::seq_mean_token_mean;
  gspo.entropy_coef = 0.02;
  v.push_back({"gspo", gspo, true});
  return v;
}

// A call's loss and gradients against the reference objective and its finite differences.
void expect_matches_reference(const Case& c, const PolicyLossConfig& pc, float scale, const Out& out) {
  const double want = ref_objective(c, pc, flat(c));
  EXPECT_NEAR(out.r.loss_sum, want, 1e-5 * (1 + std::abs(want)));
  EXPECT_EQ(out.r.num_valid, 7);
  auto fd = test::finite_diff([&](const std::vector<double>& hw) { return scale * ref_objective(c, pc, hw); }, flat(c));
  std::vector<double> fd_h(fd.begin(), fd.begin() + c.T * c.H), fd_w(fd.begin() + c.T * c.H, fd.end());
  EXPECT_LT(test::rel_error(out.d_h, fd_h), test::kGradTol);
  EXPECT_LT(test::rel_error(out.d_w, fd_w), test::kGradTol);
}

TEST(PolicyLoss, ValuesAndGradientsMatchReference) {
  for (const Named& o : objectives()) {
    for (int64_t chunk : {int64_t{1}, int64_t{4}, int64_t{100}}) {  // one row, not dividing T, clamped to T
      SCOPED_TRACE(std::string(o.name) + " chunk " + std::to_string(chunk));
      Case c = make_case(31, o.per_seq_adv);
      Inputs x = inputs(c);
      const float scale = 0.37f;
      auto dw0 = test::randn(c.V * c.H, 5);
      Out out = run(c, x, head_cfg(o.pc, chunk), scale, dw0);
      expect_matches_reference(c, o.pc, scale, out);
      for (int64_t t = 0; t < c.T; ++t)
        if (c.targets[t] < 0)
          for (int64_t k = 0; k < c.H; ++k) EXPECT_EQ(out.d_h[t * c.H + k], 0.0f);
    }
  }
}

// The metrics against the reference's own log-probs and entropies.
TEST(PolicyLoss, MetricsMatchReference) {
  Case c = make_case(41, false, 0.8);
  PolicyLossConfig pc;
  pc.dual_clip = 2.0;
  pc.kl = KlEstimator::k3;
  Inputs x = inputs(c);
  const LossResult r = policy_loss_forward(x.h, x.w, x.tg, x.in, head_cfg(pc));
  std::vector<double> lp, ent;
  ref_objective(c, pc, flat(c), &lp, &ent);
  int64_t clipped = 0, dual = 0;
  double ratio = 0, rmax = 0, akl = 0, h = 0, rkl = 0, seqs = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    if (c.targets[t] < 0) continue;
    const double rr = std::exp(lp[t] - c.old[t]), a = c.adv[t];
    const double rc = std::min(std::max(rr, 0.8), 1.2);
    const bool clip = -a * rc > -a * rr;
    clipped += clip;
    const double pg = std::max(-a * rr, -a * rc);
    dual += a < 0 && pg > -a * 2.0;
    ratio += rr;
    rmax = std::max(rmax, rr);
    akl += rr - 1 - std::log(rr);
    h += ent[t];
    const double d = c.ref[t] - lp[t];
    rkl += std::exp(d) - d - 1;
    seqs += c.sw[t];
  }
  EXPECT_GT(clipped, 0) << "the case should clip some tokens";
  EXPECT_LT(clipped, r.num_valid);
  EXPECT_EQ(r.policy.clipped, clipped);
  EXPECT_EQ(r.policy.dual_clipped, dual);
  EXPECT_NEAR(r.policy.ratio, ratio, 1e-5 * ratio);
  EXPECT_NEAR(r.policy.ratio_max, rmax, 1e-5 * rmax);
  EXPECT_NEAR(r.policy.approx_kl, akl, 1e-5 + 1e-5 * akl);
  EXPECT_NEAR(r.policy.entropy, h, 1e-5 * h);
  EXPECT_NEAR(r.policy.ref_kl, rkl, 1e-5 + 1e-5 * rkl);
  EXPECT_NEAR(r.policy.sequences, 2.0, 1e-6);
  EXPECT_NEAR(seqs, 2.0, 1e-6);
}

// The family baseline: advantage 1, on-policy, no KL, no entropy, token mean: the gradient of
// -sum logp, which is cross-entropy's gradient.
TEST(PolicyLoss, PairedWithLinearCe) {
  Case c = make_case(51, false);
  std::fill(c.adv.begin(), c.adv.end(), 1.0f);
  Inputs x = inputs(c, /*with_old=*/false);
  PolicyLossConfig pc;
  auto dw0 = test::randn(c.V * c.H, 6);
  const float scale = 1.0f / 7.0f;
  Out p = run(c, x, head_cfg(pc), scale, dw0);
  LossHeadConfig lc;
  lc.fused_chunk_tokens = 4;
  Tensor d_h, d_w = Tensor::from_floats(dw0, {c.V, c.H});
  const LossResult ce = linear_ce_fused(scale, x.h, x.w, x.tg, lc, d_h, d_w);
  std::vector<float> ce_dw = d_w.to_floats();
  for (size_t i = 0; i < ce_dw.size(); ++i) ce_dw[i] -= dw0[i];
  EXPECT_LT(test::rel_error(p.d_h, d_h.to_floats()), 1e-5);
  EXPECT_LT(test::rel_error(p.d_w, ce_dw), 1e-5);
  EXPECT_EQ(p.r.num_valid, ce.num_valid);
  EXPECT_NEAR(p.r.loss_sum, -static_cast<double>(ce.num_valid), 1e-9);  // sum of -A r with r = 1
  EXPECT_NEAR(p.r.policy.ratio, static_cast<double>(ce.num_valid), 1e-9);
}

// No old_logprobs is the on-policy update: the same as old = the current log-probs.
TEST(PolicyLoss, MissingOldLogprobsIsOnPolicy) {
  Case c = make_case(61, false);
  std::vector<double> lp;
  PolicyLossConfig pc;
  pc.kl_coef = 0.1;
  ref_objective(c, pc, flat(c), &lp);
  for (int64_t t = 0; t < c.T; ++t) c.old[t] = static_cast<float>(lp[t]);
  auto dw0 = test::randn(c.V * c.H, 7);
  Out with_old = run(c, inputs(c, true), head_cfg(pc), 0.5f, dw0);
  Out without = run(c, inputs(c, false), head_cfg(pc), 0.5f, dw0);
  EXPECT_LT(test::rel_error(without.d_h, with_old.d_h), 1e-5);
  EXPECT_LT(test::rel_error(without.d_w, with_old.d_w), 1e-5);
  EXPECT_EQ(without.r.policy.clipped, 0);
  EXPECT_NEAR(without.r.policy.ratio_max, 1.0, 1e-12);
}

// bf16 h and w (and a bf16 d_h) give what f32 inputs of the same values give.
TEST(PolicyLoss, Bf16InputsMatchF32OfTheSameValues) {
  Case c = make_case(71, false);
  for (float& v : c.h) v = round_bf16(v);
  for (float& v : c.w) v = round_bf16(v);
  PolicyLossConfig pc;
  pc.entropy_coef = 0.05;
  Inputs x = inputs(c);
  Inputs xb = x;
  xb.h = Tensor::from_floats(c.h, {c.T, c.H}, DType::bf16);
  xb.w = Tensor::from_floats(c.w, {c.V, c.H}, DType::bf16);
  auto dw0 = test::randn(c.V * c.H, 8);
  Out f = run(c, x, head_cfg(pc), 0.25f, dw0);
  Out b = run(c, xb, head_cfg(pc), 0.25f, dw0, DType::bf16);
  EXPECT_NEAR(b.r.loss_sum, f.r.loss_sum, 1e-6 * (1 + std::abs(f.r.loss_sum)));
  EXPECT_LT(test::rel_error(b.d_h, f.d_h), 1e-2);  // d_h stored in bf16
  EXPECT_LT(test::rel_error(b.d_w, f.d_w), 1e-6);
}

TEST(PolicyLoss, TokenStatsMatchReference) {
  Case c = make_case(81, false);
  LossHeadConfig cfg = head_cfg(PolicyLossConfig{}, 3);
  cfg.policy.temperature = 0.6;
  Inputs x = inputs(c);
  Tensor logp, ent;
  policy_token_stats(x.h, x.w, x.tg, cfg, logp, ent);
  std::vector<double> lp, en;
  ref_objective(c, cfg.policy, flat(c), &lp, &en);
  const auto l = logp.to_floats(), e = ent.to_floats();
  for (int64_t t = 0; t < c.T; ++t) {
    EXPECT_NEAR(l[t], c.targets[t] >= 0 ? lp[t] : 0.0, 1e-5);
    EXPECT_NEAR(e[t], c.targets[t] >= 0 ? en[t] : 0.0, 1e-5);
  }
}

TEST(PolicyLoss, LogitsPeakIsExactlyOneBlock) {
  Case c = make_case(91, false, 0.6, 40, 50, 6);
  Inputs x = inputs(c);
  Allocator& a = allocator_for(Device::cpu());
  for (int64_t ct : {8, 13, 1000}) {
    for (PolicyRatio ratio : {PolicyRatio::token, PolicyRatio::sequence}) {
      SCOPED_TRACE("fused_chunk_tokens " + std::to_string(ct));
      PolicyLossConfig pc;
      pc.ratio = ratio;
      const LossHeadConfig cfg = head_cfg(pc, ct);
      Tensor d_h, d_w = Tensor::zeros({c.V, c.H}, DType::f32, Device::cpu(), MemCategory::grads);
      a.reset_peak();
      policy_loss_train(1.0f, x.h, x.w, x.tg, x.in, cfg, d_h, d_w);
      EXPECT_EQ(a.stats().peak_of(MemCategory::logits), std::min<int64_t>(ct, c.T) * c.V * 4);
      EXPECT_EQ(a.stats().peak_of(MemCategory::logits), policy_logits_bytes(c.T, c.V, c.H, cfg));
      EXPECT_EQ(a.stats().live_of(MemCategory::logits), 0);
    }
  }
}

// The auto block (chunk_tokens 0): a power of two at or below T / 64 in [256, 2048], never over T;
// from 16K tokens up it holds at most 1/64 of the call's full f32 logits (the RL issue asks for
// <= 1/16), and a call's logits peak is that block.
TEST(PolicyLoss, AutoChunkFollowsTheCallsTokens) {
  PolicyLossConfig pc;
  ASSERT_EQ(pc.chunk_tokens, 0);
  const std::vector<std::pair<int64_t, int64_t>> want{{1, 1},         {100, 100},       {4096, 256},
                                                      {16383, 256},   {16384, 256},     {32768, 512},
                                                      {65536, 1024},  {131071, 1024},   {131072, 2048},
                                                      {1 << 20, 2048}};
  for (const auto& [T, rows] : want) {
    SCOPED_TRACE("T " + std::to_string(T));
    EXPECT_EQ(policy_chunk_rows(pc, T), rows);
    if (T >= 16384) EXPECT_LE(policy_chunk_rows(pc, T) * 64, T);
  }
  pc.chunk_tokens = 3000;  // an explicit size is taken as is, clamped to T
  EXPECT_EQ(policy_chunk_rows(pc, 131072), 3000);
  EXPECT_EQ(policy_chunk_rows(pc, 2000), 2000);
  LossHeadConfig cfg;
  EXPECT_EQ(policy_logits_bytes(65536, 248320, 2048, cfg), int64_t{1024} * 248320 * 4);
  // A run measures the block it predicts (T = 40 < 256: the block is the whole call).
  Case c = make_case(91, false, 0.6, 40, 50, 6);
  Inputs x = inputs(c);
  Allocator& a = allocator_for(Device::cpu());
  Tensor d_h, d_w = Tensor::zeros({c.V, c.H}, DType::f32, Device::cpu(), MemCategory::grads);
  a.reset_peak();
  policy_loss_train(1.0f, x.h, x.w, x.tg, x.in, cfg, d_h, d_w);
  EXPECT_EQ(a.stats().peak_of(MemCategory::logits), c.T * c.V * 4);
  cfg.policy.chunk_tokens = -1;
  test::expect_error_contains([&] { policy_loss_train(1.0f, x.h, x.w, x.tg, x.in, cfg, d_h, d_w); },
                              "primitives.loss_fused_chunk_tokens must be > 0 or \"auto\"");
}

// The vocab sweep (policy_blocks = "vocab"): the reference objective and its finite-difference
// gradients for every objective, through column blocks of 8 (five) and of 32 (two, the last of
// 8), and the row sweep's numbers to f32 rounding; a bf16 d_h goes through the f32 accumulator.
TEST(PolicyLoss, VocabSweepMatchesReferenceAndRowSweep) {
  for (const Named& o : objectives()) {
    for (int64_t chunk : {int64_t{4}, int64_t{100}}) {
      SCOPED_TRACE(std::string(o.name) + " chunk " + std::to_string(chunk));
      Case c = make_case(33, o.per_seq_adv, 0.6, 9, 40, 5);
      Inputs x = inputs(c);
      LossHeadConfig cfg = head_cfg(o.pc, chunk);
      cfg.policy.blocks = PolicyBlocks::vocab;
      ASSERT_EQ(policy_vocab_cols(cfg.policy, true, c.T, c.V, c.H), chunk == 4 ? 8 : 32);
      LossHeadConfig rows_cfg = cfg;
      rows_cfg.policy.blocks = PolicyBlocks::rows;
      const float scale = 0.37f;
      auto dw0 = test::randn(c.V * c.H, 5);
      Out v = run(c, x, cfg, scale, dw0);
      Out r = run(c, x, rows_cfg, scale, dw0);
      expect_matches_reference(c, o.pc, scale, v);
      EXPECT_LT(test::rel_error(v.d_h, test::cast<double>(r.d_h)), 1e-5);
      EXPECT_LT(test::rel_error(v.d_w, test::cast<double>(r.d_w)), 1e-5);
      EXPECT_NEAR(v.r.loss_sum, r.r.loss_sum, 1e-6 * (1 + std::abs(r.r.loss_sum)));
      const PolicyMetrics &a = v.r.policy, &b = r.r.policy;
      EXPECT_EQ(a.clipped, b.clipped);
      EXPECT_EQ(a.dual_clipped, b.dual_clipped);
      EXPECT_NEAR(a.entropy, b.entropy, 1e-9 * (1 + std::abs(b.entropy)));
      EXPECT_NEAR(a.ratio, b.ratio, 1e-9 * (1 + b.ratio));
      EXPECT_NEAR(a.ratio_max, b.ratio_max, 1e-9 * (1 + b.ratio_max));
      EXPECT_NEAR(a.approx_kl, b.approx_kl, 1e-9);
      EXPECT_NEAR(a.ref_kl, b.ref_kl, 1e-9 * (1 + std::abs(b.ref_kl)));
      EXPECT_DOUBLE_EQ(a.sequences, b.sequences);
      Out vb = run(c, x, cfg, scale, dw0, DType::bf16);
      EXPECT_LT(test::rel_error(vb.d_h, test::cast<double>(v.d_h)), 1e-2);  // d_h stored in bf16
      EXPECT_EQ(vb.d_w, v.d_w);
    }
  }
}

// Auto takes the vocab sweep only for training calls whose auto row block is small (<= 512 rows,
// T >= 4 rows) and whose columns stay wide (>= 1024), in the row sweep's memory; a call then
// measures the block it predicts and matches the row sweep.
TEST(PolicyLoss, AutoVocabSweepWhereRowBlocksAreSmall) {
  PolicyLossConfig pc;
  ASSERT_EQ(pc.blocks, PolicyBlocks::auto_);
  const int64_t V = 248320, H = 2048;
  const std::vector<std::pair<int64_t, int64_t>> want{{512, 0},      {1023, 0},     {1024, 60032},
                                                      {16384, 1792}, {32768, 1792}, {40000, 1024},
                                                      {50000, 0},    {65536, 0},    {131072, 0}};
  for (const auto& [T, cols] : want) {
    SCOPED_TRACE("T " + std::to_string(T));
    EXPECT_EQ(policy_vocab_cols(pc, true, T, V, H), cols);
    if (cols > 0) EXPECT_LE((cols + H) * T, policy_chunk_rows(pc, T) * V);  // the row sweep's memory
  }
  EXPECT_EQ(policy_vocab_cols(pc, false, 16384, V, H), 0);       // forward only: rows
  EXPECT_EQ(policy_vocab_cols(pc, true, 16384, 151936, H), 0);   // columns too narrow (326)
  PolicyLossConfig fixed = pc;
  fixed.chunk_tokens = 256;  // an explicit row block is taken as such
  EXPECT_EQ(policy_vocab_cols(fixed, true, 16384, V, H), 0);
  PolicyLossConfig rows = pc, vocab = pc;
  rows.blocks = PolicyBlocks::rows;
  vocab.blocks = PolicyBlocks::vocab;
  EXPECT_EQ(policy_vocab_cols(rows, true, 16384, V, H), 0);
  EXPECT_EQ(policy_vocab_cols(vocab, true, 65536, V, H), 1792);
  EXPECT_EQ(policy_vocab_cols(vocab, false, 65536, V, H), 0);
  LossHeadConfig cfg;
  EXPECT_EQ(policy_logits_bytes(16384, V, H, cfg), int64_t{16384} * 1792 * 4);
  EXPECT_EQ(policy_dh_accumulator_bytes(16384, V, H, cfg), int64_t{16384} * H * 4);
  EXPECT_EQ(policy_dh_accumulator_bytes(65536, V, H, cfg), 0);

  // T = 1024, V = 4200, H = 8: rows 256, cols 256 x 4200 / 1024 - 8 = 1042 -> 1024 (two blocks).
  Case c = make_case(97, false, 0.6, 1024, 4200, 8);
  Inputs x = inputs(c);
  ASSERT_EQ(policy_vocab_cols(cfg.policy, true, c.T, c.V, c.H), 1024);
  Allocator& a = allocator_for(Device::cpu());
  auto dw0 = test::randn(c.V * c.H, 6);
  a.reset_peak();
  Out v = run(c, x, cfg, 0.5f, dw0, DType::bf16);
  EXPECT_EQ(a.stats().peak_of(MemCategory::logits), c.T * 1024 * 4);
  EXPECT_EQ(a.stats().peak_of(MemCategory::logits), policy_logits_bytes(c.T, c.V, c.H, cfg));
  LossHeadConfig rows_cfg = cfg;
  rows_cfg.policy.blocks = PolicyBlocks::rows;
  a.reset_peak();
  Out r = run(c, x, rows_cfg, 0.5f, dw0, DType::bf16);
  EXPECT_EQ(a.stats().peak_of(MemCategory::logits), 256 * c.V * 4);
  EXPECT_NEAR(v.r.loss_sum, r.r.loss_sum, 1e-6 * (1 + std::abs(r.r.loss_sum)));
  EXPECT_LT(test::rel_error(v.d_w, test::cast<double>(r.d_w)), 1e-5);
  EXPECT_LT(test::rel_error(v.d_h, test::cast<double>(r.d_h)), 1e-2);  // both bf16
}

// A large stale log-ratio is clamped: finite loss, no gradient through that token's ratio.
TEST(PolicyLoss, StaleRolloutStaysFinite) {
  Case c = make_case(95, false);
  for (float& o : c.old) o = -200.0f;  // exp(logp + 200) would overflow
  PolicyLossConfig pc;
  pc.clip_high = 1e30;  // no clip: only the clamp keeps it finite
  auto dw0 = test::randn(c.V * c.H, 9);
  Out o = run(c, inputs(c), head_cfg(pc), 1.0f, dw0);
  EXPECT_TRUE(std::isfinite(o.r.loss_sum));
  EXPECT_NEAR(o.r.policy.ratio_max, std::exp(20.0), 1e-3 * std::exp(20.0));
  for (float v : o.d_h) EXPECT_EQ(v, 0.0f);  // every ratio clamped: no policy gradient
}

TEST(PolicyLoss, BadInputsRaiseClearErrors) {
  Case c = make_case(97, true);
  auto dw0 = test::randn(c.V * c.H, 10);
  PolicyLossConfig pc;
  {
    Inputs x = inputs(c);
    x.in.advantages = Tensor();
    test::expect_error_contains([&] { run(c, x, head_cfg(pc), 1.0f, dw0); }, "needs advantages");
  }
  {
    Inputs x = inputs(c);
    x.in.ref_logprobs = Tensor();
    PolicyLossConfig k = pc;
    k.kl_coef = 0.1;
    test::expect_error_contains([&] { run(c, x, head_cfg(k), 1.0f, dw0); }, "needs ref_logprobs");
  }
  {
    Inputs x = inputs(c);
    x.in.old_logprobs = Tensor::from_floats(std::vector<float>(3, 0.0f), {3});
    test::expect_error_contains([&] { run(c, x, head_cfg(pc), 1.0f, dw0); }, "old_logprobs must be f32 [9]");
  }
  {
    // GSPO over a sequence that holds only part of its document.
    Case d = c;
    for (float& s : d.sw) s *= 0.5f;
    Inputs x = inputs(d);
    PolicyLossConfig g = pc;
    g.ratio = PolicyRatio::sequence;
    test::expect_error_contains([&] { run(d, x, head_cfg(g), 1.0f, dw0); }, "holds a part of its document");
  }
  for (auto [field, value, needle] : {std::tuple{0, -1.0, "temperature"}, std::tuple{1, -0.1, "clip_low"},
                                      std::tuple{2, 0.5, "dual_clip"}, std::tuple{3, -1.0, "kl_coef"}}) {
    PolicyLossConfig b = pc;
    if (field == 0) b.temperature = value;
    if (field == 1) b.clip_low = value;
    if (field == 2) b.dual_clip = value;
    if (field == 3) b.kl_coef = value;
    Inputs x = inputs(c);
    test::expect_error_contains([&] { run(c, x, head_cfg(b), 1.0f, dw0); }, needle);
  }
}

// The head over a micro-batch reads the RL fields; its targets-only forms refuse.
TEST(PolicyLoss, HeadReadsTheMicroBatch) {
  Case c = make_case(99, false);
  Inputs x = inputs(c);
  PolicyLossConfig pc;
  pc.entropy_coef = 0.01;
  const LossHeadConfig cfg = head_cfg(pc);
  auto head = make_policy_head(cfg);
  MicroBatch mb;
  mb.targets = x.tg;
  mb.advantages = x.in.advantages;
  mb.old_logprobs = x.in.old_logprobs;
  mb.ref_logprobs = x.in.ref_logprobs;
  mb.seq_weight = x.in.seq_weight;
  mb.cu_seqlens = x.in.cu_seqlens;
  auto dw0 = test::randn(c.V * c.H, 11);
  Tensor d_h, d_w = Tensor::from_floats(dw0, {c.V, c.H});
  const LossResult r = head->train_batch(0.5f, x.h, x.w, mb, d_h, d_w, false);
  Out direct = run(c, x, cfg, 0.5f, dw0);
  EXPECT_EQ(r.loss_sum, direct.r.loss_sum);
  EXPECT_EQ(head->evaluate_batch(x.h, x.w, mb).loss_sum, direct.r.loss_sum);
  test::expect_error_contains([&] { head->evaluate(x.h, x.w, x.tg); }, "needs a micro-batch with rollout fields");
}

}  // namespace
}  // namespace bb
