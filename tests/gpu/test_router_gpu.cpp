// MoE router on CUDA against the CPU reference on the same fp32 logits: identical selection and
// counts, weights / scores / aux / z within 1e-5, d_logits within the f32 tolerance; softmax and
// sigmoid, group top-k with a selection bias, T not a multiple of any block size, more tokens
// than one grid pass, a single token, determinism, one host read per forward, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/gpu.h"
#include "common/testing.h"
#include "primitives/moe/router.h"

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

// Per token a shuffled ramp (step `step`) plus noise of 1% of the step: values never come
// closer than ~0.9 step, so f32 rounding cannot reorder them.
std::vector<float> separated_logits(int64_t T, int64_t E, uint64_t seed, float step) {
  std::vector<float> v(T * E);
  auto noise = test::randn(T * E, seed, 0.01f * step);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    auto u = test::randu(E, seed + 7, 0.f, 1.f, t * E);
    for (int64_t i = E - 1; i > 0; --i)
      std::swap(perm[i], perm[std::min<int64_t>(i, static_cast<int64_t>(u[i] * (i + 1)))]);
    for (int64_t e = 0; e < E; ++e)
      v[t * E + e] = step * (perm[e] - E / 2.0f) + noise[t * E + e];
  }
  return v;
}

struct Case {
  const char* name;
  int64_t T;
  int E, K;
  RouterScore score;
  bool norm;
  float scaling;
  int groups, topk_groups;
  bool bias;
};

RouterConfig config_of(const Case& c) {
  RouterConfig r;
  r.num_experts = c.E;
  r.top_k = c.K;
  r.score = c.score;
  r.norm_topk_prob = c.norm;
  r.routed_scaling = c.scaling;
  r.num_groups = c.groups;
  r.topk_groups = c.topk_groups;
  return r;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

class RouterGpu : public ::testing::TestWithParam<Case> {};

TEST_P(RouterGpu, ForwardMatchesCpuAndSelectionIsIdentical) {
  BB_REQUIRE_GPU();
  const Case c = GetParam();
  const RouterConfig cfg = config_of(c);
  // Softmax: a small step keeps the probabilities spread; sigmoid: stay in its steep part.
  const float step = c.score == RouterScore::softmax ? 0.05f : 4.0f / c.E;
  Tensor logits = Tensor::from_floats(separated_logits(c.T, c.E, 11, step), {c.T, c.E});
  // Integer bias levels (larger than the score range): the selection order is by level, then
  // by score, so score + bias never comes near a tie and the bias visibly changes the picks.
  Tensor bias;
  if (c.bias) {
    std::vector<float> b(c.E);
    for (int e = 0; e < c.E; ++e) b[e] = static_cast<float>((e * 7) % 5);
    bias = Tensor::from_floats(b, {c.E});
  }
  RouterSaved sc, sg;
  const RouterOutput rc = router_forward(logits, bias, cfg, &sc);
  const RouterOutput rg = router_forward(logits.to(kGpu), bias.defined() ? bias.to(kGpu) : Tensor(),
                                         cfg, &sg);
  ASSERT_EQ(rg.topk_idx.device(), kGpu);
  EXPECT_EQ(rg.topk_prob.device(), kGpu);
  EXPECT_EQ(sg.scores.device(), kGpu);
  EXPECT_EQ(rg.topk_idx.category(), MemCategory::activations);
  EXPECT_EQ(sg.scores.category(), MemCategory::activations);
  EXPECT_EQ(rg.topk_idx.to_ints(), rc.topk_idx.to_ints());
  EXPECT_EQ(sg.topk_idx.to_ints(), rc.topk_idx.to_ints());
  EXPECT_EQ(rg.tokens_per_expert, rc.tokens_per_expert);
  EXPECT_LT(test::rel_error(rg.topk_prob.to_floats(), rc.topk_prob.to_floats()), 1e-5);
  EXPECT_LT(test::rel_error(sg.scores.to_floats(), sc.scores.to_floats()), 1e-5);
  EXPECT_LT(rel(rg.aux_loss, rc.aux_loss), 1e-5) << rg.aux_loss << " vs " << rc.aux_loss;
  EXPECT_LT(rel(rg.z_loss, rc.z_loss), 1e-5) << rg.z_loss << " vs " << rc.z_loss;
}

TEST_P(RouterGpu, BackwardMatchesCpu) {
  BB_REQUIRE_GPU();
  const Case c = GetParam();
  const RouterConfig cfg = config_of(c);
  const float step = c.score == RouterScore::softmax ? 0.05f : 4.0f / c.E;
  Tensor logits = Tensor::from_floats(separated_logits(c.T, c.E, 12, step), {c.T, c.E});
  Tensor dw = Tensor::from_floats(test::randn(c.T * c.K, 13), {c.T, c.K});
  RouterSaved sc, sg;
  router_forward(logits, Tensor(), cfg, &sc);
  Tensor dlogits = logits.to(kGpu);
  router_forward(dlogits, Tensor(), cfg, &sg);
  for (int variant = 0; variant < 3; ++variant) {
    // all paths; aux + z only (no combine-weight gradient); combine weights only.
    const Tensor g = variant == 1 ? Tensor() : dw;
    const double d_aux = variant == 2 ? 0.0 : 0.7, d_z = variant == 2 ? 0.0 : 0.3;
    const Tensor ref = router_backward(g, d_aux, d_z, logits, cfg, sc);
    const Tensor got = router_backward(g.defined() ? g.to(kGpu) : Tensor(), d_aux, d_z, dlogits,
                                       cfg, sg);
    EXPECT_EQ(got.device(), kGpu);
    EXPECT_EQ(got.category(), MemCategory::activations);
    EXPECT_LT(test::rel_error(got.to_floats(), ref.to_floats()), test::kTolF32)
        << "variant " << variant;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RouterGpu,
    ::testing::Values(
        Case{"qwen3_T333_E128_K8", 333, 128, 8, RouterScore::softmax, true, 1.0f, 1, 1, false},
        Case{"softmax_nonorm_T71_E60_K6", 71, 60, 6, RouterScore::softmax, false, 2.5f, 1, 1, false},
        Case{"softmax_T5000_E128_K8_grid_loop", 5000, 128, 8, RouterScore::softmax, true, 1.0f, 1,
             1, false},
        Case{"deepseek_T200_E256_K8_groups", 200, 256, 8, RouterScore::sigmoid, true, 2.5f, 8, 4,
             true},
        Case{"sigmoid_nonorm_T97_E37_K3", 97, 37, 3, RouterScore::sigmoid, false, 1.0f, 1, 1, true},
        Case{"single_token_E5_K5", 1, 5, 5, RouterScore::softmax, true, 1.0f, 1, 1, false}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(RouterGpuRuns, DeterministicAndOneHostReadPerForward) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  RouterConfig cfg;
  cfg.num_experts = 128;
  cfg.top_k = 8;
  const int64_t T = 4099;
  Tensor logits = Tensor::from_floats(test::randn(T * 128, 21), {T, 128}).to(kGpu);
  RouterSaved s1, s2;
  const int64_t before = cuda::host_sync_count();
  const RouterOutput a = router_forward(logits, Tensor(), cfg, &s1);
  EXPECT_EQ(cuda::host_sync_count() - before, 1);
  const RouterOutput b = router_forward(logits, Tensor(), cfg, &s2);
  EXPECT_EQ(a.aux_loss, b.aux_loss);  // bitwise: the reduction order is fixed
  EXPECT_EQ(a.z_loss, b.z_loss);
  EXPECT_EQ(a.topk_prob.to_floats(), b.topk_prob.to_floats());
  Tensor dw = Tensor::from_floats(test::randn(T * 8, 22), {T, 8}).to(kGpu);
  const int64_t before_bwd = cuda::host_sync_count();
  Tensor g1 = router_backward(dw, 0.1, 0.01, logits, cfg, s1);
  Tensor g2 = router_backward(dw, 0.1, 0.01, logits, cfg, s2);
  EXPECT_EQ(cuda::host_sync_count(), before_bwd);  // the backward never waits
  EXPECT_EQ(g1.to_floats(), g2.to_floats());
  int64_t total = 0;
  for (int64_t n : a.tokens_per_expert) total += n;
  EXPECT_EQ(total, T * 8);
#endif
}

// A replayed selection on the GPU: the same weights and scores as the forward that chose it and
// as the CPU replay, and no host synchronisation (the counts are given, no losses are read).
TEST(RouterGpuRuns, ReplayMatchesAndNeverWaits) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  for (RouterScore score : {RouterScore::softmax, RouterScore::sigmoid}) {
    RouterConfig cfg;
    cfg.num_experts = 128;
    cfg.top_k = 8;
    cfg.score = score;
    const int64_t T = 777;
    const std::vector<float> lv = test::randn(T * 128, 31);
    Tensor logits = Tensor::from_floats(lv, {T, 128}).to(kGpu);
    RouterSaved s1, s2;
    const RouterOutput a = router_forward(logits, Tensor(), cfg, &s1);
    const RouterReplay replay{a.topk_idx, a.tokens_per_expert};
    const int64_t before = cuda::host_sync_count();
    const RouterOutput b = router_forward(logits, Tensor(), cfg, &s2, &replay);
    EXPECT_EQ(cuda::host_sync_count(), before) << "a replayed forward waited for the device";
    EXPECT_EQ(b.topk_prob.to_floats(), a.topk_prob.to_floats());
    EXPECT_EQ(s2.scores.to_floats(), s1.scores.to_floats());
    EXPECT_EQ(b.tokens_per_expert, a.tokens_per_expert);
    // The CPU replay of the same selection on the same logits.
    RouterSaved sc;
    const RouterReplay host_replay{a.topk_idx.to(Device::cpu()), a.tokens_per_expert};
    const RouterOutput c = router_forward(Tensor::from_floats(lv, {T, 128}), Tensor(), cfg, &sc, &host_replay);
    EXPECT_LT(test::rel_error(b.topk_prob.to_floats(), c.topk_prob.to_floats()), 1e-6);
    EXPECT_LT(test::rel_error(s2.scores.to_floats(), sc.scores.to_floats()), 1e-6);
  }
#endif
}

TEST(RouterGpuRuns, ExpertBiasUpdateOnDevice) {
  BB_REQUIRE_GPU();
  std::vector<float> b0 = {0.1f, -0.2f, 0.3f, 0.0f};
  Tensor cpu_bias = Tensor::from_floats(b0, {4});
  Tensor gpu_bias = cpu_bias.to(kGpu);
  const std::vector<int64_t> counts = {1, 9, 4, 2};
  update_expert_bias(cpu_bias, counts, 0.01f);
  update_expert_bias(gpu_bias, counts, 0.01f);
  EXPECT_EQ(gpu_bias.device(), kGpu);
  EXPECT_EQ(gpu_bias.to_floats(), cpu_bias.to_floats());
}

TEST(RouterGpuRuns, BadInputs) {
  BB_REQUIRE_GPU();
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.top_k = 2;
  Tensor logits = Tensor::from_floats(test::randn(12, 31), {3, 4}).to(kGpu);
  test::expect_error_contains(
      [&] { router_forward(logits, Tensor::from_floats({0, 0, 0, 0}, {4}), cfg, nullptr); },
      "router_forward: tensors on different devices (cuda:0 and cpu)");
  test::expect_error_contains(
      [&] { router_forward(logits.to_dtype(DType::bf16), Tensor(), cfg, nullptr); },
      "router_forward: argument 'logits' has dtype bf16, expected f32");
  RouterSaved s;
  router_forward(logits, Tensor(), cfg, &s);
  test::expect_error_contains(
      [&] { router_backward(Tensor::from_floats(test::randn(6, 1), {3, 2}), 0, 0, logits, cfg, s); },
      "router_backward: tensors on different devices (cuda:0 and cpu)");
}

}  // namespace
}  // namespace bb
