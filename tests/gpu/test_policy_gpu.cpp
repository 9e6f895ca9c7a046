// The policy loss head on CUDA (policy_cuda.cu) against its CPU path (which test_policy_loss
// checks against the reference and finite differences): loss, metrics, d_h and d_w, for f32 and
// bf16 operands (bf16: the gradient written over the f32 logits in place), chunks that do and do
// not divide T, a vocabulary that is no multiple of the block, masked rows, GSPO's two sweeps, a
// bad target, the per-token statistics, and the logits peak of one block; the same for the vocab
// sweep's column blocks (float4 and scalar kernels, a last block of any width). Skips without a
// GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/memory.h"
#include "primitives/loss/policy.h"

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

struct Case {
  int64_t T, V, H, chunk;
  DType dt;
  PolicyRatio ratio;
  PolicyAggregation agg;
  PolicyBlocks blocks = PolicyBlocks::rows;
};

struct Inputs {
  std::vector<float> h, w, adv, old, ref, sw;
  std::vector<int32_t> tg, cu;
};

Inputs make(const Case& c) {
  Inputs in{test::randn(c.T * c.H, 61), test::randn(c.V * c.H, 62, 0.3f), {}, {}, {}, {}, {}, {}};
  auto u = test::randu(c.T, 63, 0.0f, 1.0f), a = test::randn(c.T, 64), n1 = test::randn(c.T, 65, 0.5f),
       n2 = test::randn(c.T, 66, 0.3f);
  const int64_t s1 = c.T / 3;
  in.cu = {0, static_cast<int32_t>(s1), static_cast<int32_t>(c.T)};
  for (int64_t t = 0; t < c.T; ++t) {
    in.tg.push_back(t % 5 == 3 ? -1 : std::min<int32_t>(static_cast<int32_t>(u[t] * c.V), static_cast<int32_t>(c.V - 1)));
    in.adv.push_back(c.ratio == PolicyRatio::sequence ? (t < s1 ? 0.7f : -1.1f) : a[t]);
    // Near log(1/V): ratios on both sides of the clip.
    const float base = -std::log(static_cast<float>(c.V));
    in.old.push_back(std::min(-1e-3f, base + n1[t]));
    in.ref.push_back(std::min(-1e-3f, base + n2[t]));
  }
  for (int b = 0; b < 2; ++b) {
    int64_t n = 0;
    for (int64_t t = in.cu[b]; t < in.cu[b + 1]; ++t) n += in.tg[t] >= 0;
    for (int64_t t = in.cu[b]; t < in.cu[b + 1]; ++t) in.sw.push_back(in.tg[t] >= 0 ? 1.0f / n : 0.0f);
  }
  return in;
}

PolicyTokens tokens(const Inputs& in, int64_t T) {
  return PolicyTokens{Tensor::from_floats(in.adv, {T}), Tensor::from_floats(in.old, {T}),
                      Tensor::from_floats(in.ref, {T}), Tensor::from_floats(in.sw, {T}), Tensor::from_ints(in.cu, {3})};
}

class PolicyGpu : public ::testing::TestWithParam<Case> {};

TEST_P(PolicyGpu, MatchesCpu) {
  BB_REQUIRE_GPU();
  const Case c = GetParam();
  const Inputs in = make(c);
  LossHeadConfig cfg;
  cfg.policy.chunk_tokens = c.chunk;
  cfg.policy.temperature = 0.8;
  cfg.policy.clip_high = 0.28;
  cfg.policy.dual_clip = 2.0;
  cfg.policy.kl_coef = 0.05;
  cfg.policy.entropy_coef = 0.01;
  cfg.policy.ratio = c.ratio;
  cfg.policy.aggregation = c.agg;
  cfg.policy.blocks = c.blocks;
  const Tensor h = Tensor::from_floats(in.h, {c.T, c.H}, c.dt), w = Tensor::from_floats(in.w, {c.V, c.H}, c.dt);
  const Tensor tg = Tensor::from_ints(in.tg, {c.T});
  const PolicyTokens pt = tokens(in, c.T);
  const auto dw0 = test::randn(c.V * c.H, 67, 0.01f);
  const float scale = 0.5f / static_cast<float>(c.T);
  // CPU: f32 copies of the same (rounded) values.
  Tensor h32 = Tensor::from_floats(h.to_floats(), {c.T, c.H}), w32 = Tensor::from_floats(w.to_floats(), {c.V, c.H});
  Tensor dh_c, dw_c = Tensor::from_floats(dw0, {c.V, c.H});
  LossHeadConfig cpu_cfg = cfg;  // the CPU row sweep, whatever the GPU runs
  cpu_cfg.policy.blocks = PolicyBlocks::rows;
  const LossResult rc = policy_loss_train(scale, h32, w32, tg, pt, cpu_cfg, dh_c, dw_c);
  // GPU, device targets; d_h starts as NaN bytes (poisoned): every element must be written.
  Tensor d_h = Tensor::empty({c.T, c.H}, c.dt, kGpu, MemCategory::activations);
  Tensor d_w = Tensor::from_floats(dw0, {c.V, c.H}).to(kGpu, MemCategory::grads);
  const LossResult rg = policy_loss_train(scale, h.to(kGpu), w.to(kGpu), tg.to(kGpu), pt, cfg, d_h, d_w);
  const double tol = c.dt == DType::bf16 ? test::kTolBf16 : test::kTolF32;
  EXPECT_EQ(rg.num_valid, rc.num_valid);
  EXPECT_NEAR(rg.loss_sum, rc.loss_sum, tol * (1e-3 + std::abs(rc.loss_sum)));
  EXPECT_NEAR(rg.policy.entropy, rc.policy.entropy, 1e-4 * rc.policy.entropy);
  EXPECT_NEAR(rg.policy.ratio, rc.policy.ratio, 1e-4 * rc.policy.ratio);
  EXPECT_NEAR(rg.policy.ref_kl, rc.policy.ref_kl, 1e-4 * (1e-3 + std::abs(rc.policy.ref_kl)));
  EXPECT_NEAR(static_cast<double>(rg.policy.clipped), static_cast<double>(rc.policy.clipped), 1.0);  // a boundary token may flip
  EXPECT_NEAR(rg.policy.sequences, rc.policy.sequences, 1e-5);
  const auto dh = d_h.to_floats(), dw = d_w.to_floats(), dhc = dh_c.to_floats(), dwc = dw_c.to_floats();
  std::vector<double> inc(dw0.size()), inc_c(dw0.size());
  for (size_t i = 0; i < dw0.size(); ++i) {
    inc[i] = static_cast<double>(dw[i]) - dw0[i];
    inc_c[i] = static_cast<double>(dwc[i]) - dw0[i];
  }
  EXPECT_LT(test::rel_error(dh, dhc), tol);
  EXPECT_LT(test::rel_error(inc, inc_c), tol);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t k = 0; k < c.H; ++k) {
      ASSERT_TRUE(std::isfinite(dh[t * c.H + k])) << "row " << t;
      if (in.tg[t] < 0) ASSERT_EQ(dh[t * c.H + k], 0.0f) << "masked row " << t;
    }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PolicyGpu,
    ::testing::Values(Case{37, 1000, 64, 16, DType::f32, PolicyRatio::token, PolicyAggregation::token_mean},
                      Case{37, 1000, 64, 16, DType::bf16, PolicyRatio::token, PolicyAggregation::token_mean},
                      Case{64, 4099, 128, 64, DType::bf16, PolicyRatio::token, PolicyAggregation::seq_mean_token_mean},
                      Case{50, 777, 32, 7, DType::f32, PolicyRatio::sequence, PolicyAggregation::seq_mean_token_mean},
                      Case{50, 777, 32, 100, DType::bf16, PolicyRatio::sequence, PolicyAggregation::seq_mean_token_sum},
                      // The vocab sweep: columns 368 (float4; last block 264), 3968 (last 131,
                      // scalar), 72 (last 57), 744 (last 33).
                      Case{37, 1000, 64, 16, DType::f32, PolicyRatio::token, PolicyAggregation::token_mean,
                           PolicyBlocks::vocab},
                      Case{37, 1000, 64, 16, DType::bf16, PolicyRatio::token, PolicyAggregation::token_mean,
                           PolicyBlocks::vocab},
                      Case{64, 4099, 128, 64, DType::bf16, PolicyRatio::token, PolicyAggregation::seq_mean_token_mean,
                           PolicyBlocks::vocab},
                      Case{50, 777, 32, 7, DType::f32, PolicyRatio::sequence, PolicyAggregation::seq_mean_token_mean,
                           PolicyBlocks::vocab},
                      Case{50, 777, 32, 100, DType::bf16, PolicyRatio::sequence, PolicyAggregation::seq_mean_token_sum,
                           PolicyBlocks::vocab}));

TEST(PolicyGpuRuns, TokenStatsLogitsPeakAndBadTarget) {
  BB_REQUIRE_GPU();
  const Case c{40, 3001, 64, 16, DType::f32, PolicyRatio::token, PolicyAggregation::token_mean};
  Inputs in = make(c);
  LossHeadConfig cfg;
  cfg.policy.chunk_tokens = c.chunk;
  cfg.policy.temperature = 0.7;
  const Tensor h = Tensor::from_floats(in.h, {c.T, c.H}), w = Tensor::from_floats(in.w, {c.V, c.H});
  const Tensor tg = Tensor::from_ints(in.tg, {c.T});
  Tensor lc, ec, lg, eg;
  policy_token_stats(h, w, tg, cfg, lc, ec);
  policy_token_stats(h.to(kGpu), w.to(kGpu), tg.to(kGpu), cfg, lg, eg);
  EXPECT_LT(test::max_abs_diff(lg.to_floats(), lc.to_floats()), 1e-4);
  EXPECT_LT(test::max_abs_diff(eg.to_floats(), ec.to_floats()), 1e-4);
  // The logits category holds one [chunk, V] f32 block.
  Allocator& a = allocator_for(kGpu);
  const Tensor hg = h.to(kGpu), wg = w.to(kGpu), tgg = tg.to(kGpu);
  Tensor d_h, d_w = Tensor::zeros({c.V, c.H}, DType::f32, kGpu, MemCategory::grads);
  a.reset_peak();
  policy_loss_train(1.0f, hg, wg, tgg, tokens(in, c.T), cfg, d_h, d_w);
  EXPECT_EQ(a.stats().peak_of(MemCategory::logits), policy_logits_bytes(c.T, c.V, c.H, cfg));
  // The vocab sweep: one [T, cols] block in the logits category (cols 16 x 3001 / 40 - 64 = 1136,
  // rounded down to 1024).
  LossHeadConfig vcfg = cfg;
  vcfg.policy.blocks = PolicyBlocks::vocab;
  ASSERT_EQ(policy_vocab_cols(vcfg.policy, true, c.T, c.V, c.H), 1024);
  a.reset_peak();
  policy_loss_train(1.0f, hg, wg, tgg, tokens(in, c.T), vcfg, d_h, d_w);
  EXPECT_EQ(a.stats().peak_of(MemCategory::logits), c.T * 1024 * 4);
  EXPECT_EQ(a.stats().peak_of(MemCategory::logits), policy_logits_bytes(c.T, c.V, c.H, vcfg));
  // A target >= V is reported by both sweeps.
  in.tg[5] = static_cast<int32_t>(c.V);
  for (const LossHeadConfig* k : {&cfg, &vcfg})
    test::expect_error_contains(
        [&] { policy_loss_train(1.0f, hg, wg, Tensor::from_ints(in.tg, {c.T}).to(kGpu), tokens(in, c.T), *k, d_h, d_w); },
        "target at row 5 is outside the vocabulary; d_h and d_w are invalid");
}

}  // namespace
}  // namespace bb
