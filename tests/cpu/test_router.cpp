// MoE router (softmax_topk and sigmoid_topk): selection order and tie-breaking, group-limited
// top-k, selection bias, losses against a naive double computation, gradients against double
// finite differences with the selection held fixed, expert-bias balancing, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/testing.h"
#include "primitives/moe/router.h"
#include "primitives/moe/router_ref.h"

namespace bb {
namespace {

// Logits whose per-token values are at least ~0.5 apart (a shuffled ramp plus small noise), so
// the finite-difference steps never change the top-k selection.
std::vector<float> separated_logits(int64_t T, int64_t E, uint64_t seed) {
  std::vector<float> v(T * E);
  auto noise = test::randn(T * E, seed, 0.05f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    // Fisher-Yates driven by philox uniforms: deterministic per (seed, t).
    auto u = test::randu(E, seed + 1000, 0.f, 1.f, t * E);
    for (int64_t i = E - 1; i > 0; --i)
      std::swap(perm[i], perm[std::min<int64_t>(i, static_cast<int64_t>(u[i] * (i + 1)))]);
    for (int64_t e = 0; e < E; ++e) v[t * E + e] = 0.6f * (perm[e] - E / 2.0f) + noise[t * E + e];
  }
  return v;
}

Tensor f32(const std::vector<float>& v, const Shape& s) {
  return Tensor::from_floats(v, s);
}

RouterConfig make_cfg(int E, int K, RouterScore score, bool norm, float scaling = 1.0f) {
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.score = score;
  c.norm_topk_prob = norm;
  c.routed_scaling = scaling;
  return c;
}

// Naive reference in double: scores, selection by sorting (stable on ties), losses.
struct Naive {
  std::vector<std::vector<int>> idx;
  std::vector<std::vector<double>> prob;
  std::vector<int64_t> counts;
  double aux = 0, z = 0;
};
Naive naive_router(const std::vector<float>& logits, int64_t T, const RouterConfig& c) {
  const int E = c.num_experts, K = c.top_k;
  Naive out;
  out.counts.assign(E, 0);
  std::vector<double> mean_p(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(E);
    double mx = -1e300, sum = 0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, double(logits[t * E + e]));
    for (int e = 0; e < E; ++e) sum += std::exp(double(logits[t * E + e]) - mx);
    const double lse = mx + std::log(sum);
    out.z += lse * lse / T;
    for (int e = 0; e < E; ++e)
      s[e] = c.score == RouterScore::softmax ? std::exp(logits[t * E + e] - lse)
                                             : 1.0 / (1.0 + std::exp(-double(logits[t * E + e])));
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return s[a] > s[b]; });
    order.resize(K);
    double denom = 0;
    for (int e : order) denom += s[e];
    std::vector<double> p;
    for (int e : order) p.push_back(c.routed_scaling * s[e] / (c.norm_topk_prob ? denom : 1.0));
    for (int e : order) ++out.counts[e];
    double ssum = std::accumulate(s.begin(), s.end(), 0.0);
    for (int e = 0; e < E; ++e)
      mean_p[e] += (c.score == RouterScore::softmax ? s[e] : s[e] / ssum) / T;
    out.idx.push_back(order);
    out.prob.push_back(p);
  }
  for (int e = 0; e < E; ++e) out.aux += E * (double(out.counts[e]) / T) * mean_p[e];
  return out;
}

TEST(Router, MatchesNaiveDoubleReference) {
  const int64_t T = 9;
  for (RouterScore score : {RouterScore::softmax, RouterScore::sigmoid}) {
    for (bool norm : {true, false}) {
      RouterConfig c = make_cfg(6, 3, score, norm, norm ? 1.0f : 2.5f);
      auto logits = test::randn(T * 6, 11, 1.5f);
      RouterSaved saved;
      RouterOutput r = router_forward(f32(logits, {T, 6}), Tensor(), c, &saved);
      Naive n = naive_router(logits, T, c);
      auto idx = r.topk_idx.to_ints();
      auto prob = r.topk_prob.to_floats();
      for (int64_t t = 0; t < T; ++t)
        for (int k = 0; k < 3; ++k) {
          EXPECT_EQ(idx[t * 3 + k], n.idx[t][k]) << "t=" << t << " k=" << k;
          EXPECT_NEAR(prob[t * 3 + k], n.prob[t][k], 1e-6 * (1 + n.prob[t][k]));
        }
      EXPECT_EQ(r.tokens_per_expert, n.counts);
      EXPECT_NEAR(r.aux_loss, n.aux, 1e-6 * n.aux);
      EXPECT_NEAR(r.z_loss, n.z, 1e-6 * n.z);
      EXPECT_EQ(saved.scores.shape(), (Shape{T, 6}));
      EXPECT_EQ(saved.scores.category(), MemCategory::activations);
      EXPECT_EQ(saved.topk_idx.to_ints(), idx);
    }
  }
}

TEST(Router, AuxLossIsTopKForUniformScores) {
  // Equal logits: p = 1/E for every expert, counts sum to T*K, so aux = E * sum_e c_e/T * 1/E = K.
  RouterConfig c = make_cfg(8, 2, RouterScore::softmax, true);
  RouterOutput r = router_forward(
      Tensor::zeros({5, 8}, DType::f32, Device::cpu(), MemCategory::other), Tensor(), c, nullptr);
  EXPECT_NEAR(r.aux_loss, 2.0, 1e-6);
  EXPECT_NEAR(r.z_loss, std::log(8.0) * std::log(8.0), 1e-5);
}

TEST(Router, TiesPickLowerExpertIdsInDecreasingOrder) {
  RouterConfig c = make_cfg(5, 3, RouterScore::softmax, true);
  // Token 0: all equal -> 0, 1, 2. Token 1: 1 < three equal 3's -> 1, 2, 4 (then 3 by value).
  Tensor logits = f32({0, 0, 0, 0, 0, 1, 3, 3, 2, 3}, {2, 5});
  RouterOutput r = router_forward(logits, Tensor(), c, nullptr);
  EXPECT_EQ(r.topk_idx.to_ints(), (std::vector<int32_t>{0, 1, 2, 1, 2, 4}));
  auto p = r.topk_prob.to_floats();
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(p[k], 1.0 / 3, 1e-6);
  EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{1, 2, 2, 0, 1}));
  // Sigmoid routing breaks ties the same way.
  c.score = RouterScore::sigmoid;
  EXPECT_EQ(router_forward(logits, Tensor(), c, nullptr).topk_idx.to_ints(),
            (std::vector<int32_t>{0, 1, 2, 1, 2, 4}));
}

TEST(Router, WeightsSumToScalingWhenNormalised) {
  const int64_t T = 7;
  auto logits = test::randn(T * 10, 21);
  for (RouterScore score : {RouterScore::softmax, RouterScore::sigmoid}) {
    RouterConfig c = make_cfg(10, 4, score, true, 2.5f);
    RouterOutput r = router_forward(f32(logits, {T, 10}), Tensor(), c, nullptr);
    auto p = r.topk_prob.to_floats();
    for (int64_t t = 0; t < T; ++t) {
      double s = 0;
      for (int k = 0; k < 4; ++k) {
        s += p[t * 4 + k];
        if (k) EXPECT_LE(p[t * 4 + k], p[t * 4 + k - 1]);  // decreasing (no bias: same order)
      }
      EXPECT_NEAR(s, 2.5, 1e-5);
    }
  }
}

TEST(Router, GroupTopKRestrictsSelectionToBestGroups) {
  RouterConfig c = make_cfg(8, 3, RouterScore::sigmoid, true);
  c.num_groups = 4;
  c.topk_groups = 2;
  // Groups {0,1} {2,3} {4,5} {6,7}. Expert 0 is the single best, but its group's top-2 sum
  // (0.993 + 0.007) loses to groups 1 (2 x 0.881) and 2 (2 x 0.818).
  Tensor one = f32({5, -5, 2, 2, 1.5f, 1.5f, -1, -1}, {1, 8});
  EXPECT_EQ(router_forward(one, Tensor(), c, nullptr).topk_idx.to_ints(),
            (std::vector<int32_t>{2, 3, 4}));
  RouterConfig flat = make_cfg(8, 3, RouterScore::sigmoid, true);
  EXPECT_EQ(router_forward(one, Tensor(), flat, nullptr).topk_idx.to_ints(),
            (std::vector<int32_t>{0, 2, 3}));

  // Random tokens: every selected expert lies in one of the two best groups (naive top-2 sums).
  const int64_t T = 40;
  auto logits = test::randn(T * 8, 31, 2.0f);
  auto idx = router_forward(f32(logits, {T, 8}), Tensor(), c, nullptr).topk_idx.to_ints();
  int restricted = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<double, int>> gs;
    for (int g = 0; g < 4; ++g) {
      double a = 1 / (1 + std::exp(-double(logits[t * 8 + 2 * g])));
      double b = 1 / (1 + std::exp(-double(logits[t * 8 + 2 * g + 1])));
      gs.push_back({-(a + b), g});
    }
    std::sort(gs.begin(), gs.end());
    std::vector<int> best = {gs[0].second, gs[1].second};
    for (int k = 0; k < 3; ++k) {
      const int g = idx[t * 3 + k] / 2;
      EXPECT_TRUE(g == best[0] || g == best[1]) << "token " << t << " expert " << idx[t * 3 + k];
    }
    auto all = naive_router(std::vector<float>(logits.begin() + t * 8, logits.begin() + t * 8 + 8),
                            1, flat);
    for (int e : all.idx[0]) restricted += (e / 2 != best[0] && e / 2 != best[1]);
  }
  EXPECT_GT(restricted, 0) << "the group restriction never mattered: the test proves nothing";
}

TEST(Router, BiasChangesSelectionNotWeights) {
  RouterConfig c = make_cfg(4, 2, RouterScore::sigmoid, true);
  Tensor logits = f32({2.0f, 1.0f, 0.0f, -1.0f}, {1, 4});
  Tensor bias = f32({0, 0, 0, 3}, {4});
  RouterOutput r = router_forward(logits, bias, c, nullptr);
  EXPECT_EQ(r.topk_idx.to_ints(), (std::vector<int32_t>{3, 0}));  // 3 + sig(-1) > sig(2)
  const double s3 = 1 / (1 + std::exp(1.0)), s0 = 1 / (1 + std::exp(-2.0));
  auto p = r.topk_prob.to_floats();
  EXPECT_NEAR(p[0], s3 / (s3 + s0), 1e-6);
  EXPECT_NEAR(p[1], s0 / (s3 + s0), 1e-6);
}

// Loss L = sum(d_prob * topk_prob) + d_aux * aux + d_z * z in double with the selection fixed.
double router_loss(const std::vector<double>& logits, const std::vector<int32_t>& idx, int64_t T,
                   const RouterConfig& c, const std::vector<double>& d_prob, double d_aux,
                   double d_z) {
  const int64_t E = c.num_experts, K = c.top_k;
  std::vector<double> s(T * E), p(T * K);
  ref::router_scores(s.data(), logits.data(), T, E, c.score);
  ref::router_weights(p.data(), s.data(), idx.data(), T, E, K, c.norm_topk_prob,
                      double(c.routed_scaling));
  std::vector<int64_t> counts(E);
  ref::router_counts(counts.data(), idx.data(), T, E, K);
  double L = d_prob.empty() ? 0.0 : test::weighted_sum(p, d_prob);
  L += d_aux * ref::router_aux_loss(s.data(), counts.data(), T, E, c.score);
  L += d_z * ref::router_z_loss(logits.data(), T, E);
  return L;
}

struct GradCase {
  RouterScore score;
  bool norm;
  float scaling;
  bool with_prob;
  double d_aux, d_z;
  int groups;
  const char* name;
};
void PrintTo(const GradCase& g, std::ostream* os) {
  *os << g.name;
}

class RouterGrad : public ::testing::TestWithParam<GradCase> {};

TEST_P(RouterGrad, BackwardMatchesFiniteDifferences) {
  const GradCase g = GetParam();
  const int64_t T = 6, E = 8, K = 3;
  RouterConfig c = make_cfg(E, K, g.score, g.norm, g.scaling);
  c.num_groups = g.groups;
  c.topk_groups = g.groups > 1 ? 2 : 1;
  auto logits = separated_logits(T, E, 41);
  RouterSaved saved;
  Tensor bias = g.groups > 1 ? f32(test::randn(E, 43, 0.1f), {E}) : Tensor();
  RouterOutput r = router_forward(f32(logits, {T, E}), bias, c, &saved);
  auto idx = r.topk_idx.to_ints();
  auto w = test::randn(T * K, 42);
  std::vector<double> wd = g.with_prob ? test::cast<double>(w) : std::vector<double>();
  auto fd = test::finite_diff(
      [&](const std::vector<double>& x) { return router_loss(x, idx, T, c, wd, g.d_aux, g.d_z); },
      test::cast<double>(logits));
  Tensor d_logits = router_backward(g.with_prob ? f32(w, {T, K}) : Tensor(), g.d_aux, g.d_z,
                                    f32(logits, {T, E}), c, saved);
  EXPECT_EQ(d_logits.shape(), (Shape{T, E}));
  EXPECT_EQ(d_logits.category(), MemCategory::activations);
  EXPECT_LT(test::rel_error(d_logits.to_floats(), fd), test::kGradTol);
}

INSTANTIATE_TEST_SUITE_P(
    Router, RouterGrad,
    ::testing::Values(GradCase{RouterScore::softmax, true, 1.0f, true, 0.3, 0.2, 1, "SoftmaxNorm"},
                      GradCase{RouterScore::softmax, false, 1.0f, true, 0.3, 0.2, 1, "Softmax"},
                      GradCase{RouterScore::sigmoid, true, 2.5f, true, 0.3, 0.2, 1, "SigmoidNorm"},
                      GradCase{RouterScore::sigmoid, false, 2.5f, true, 0.3, 0.2, 1, "Sigmoid"},
                      GradCase{RouterScore::sigmoid, true, 1.0f, true, 0, 0, 4,
                               "SigmoidGroupsBias"},
                      GradCase{RouterScore::softmax, true, 1.0f, false, 1, 0, 1, "SoftmaxAuxOnly"},
                      GradCase{RouterScore::sigmoid, true, 1.0f, false, 1, 0, 1, "SigmoidAuxOnly"},
                      GradCase{RouterScore::softmax, true, 1.0f, false, 0, 1, 1, "SoftmaxZOnly"},
                      GradCase{RouterScore::sigmoid, false, 1.0f, false, 0, 1, 1, "SigmoidZOnly"}),
    [](const ::testing::TestParamInfo<GradCase>& info) { return std::string(info.param.name); });

TEST(Router, UpdateExpertBiasMovesTowardBalance) {
  Tensor bias = f32({0.5f, 0, 0, 0}, {4});
  update_expert_bias(bias, {10, 2, 6, 6}, 0.25f);  // mean 6
  EXPECT_EQ(bias.to_floats(), (std::vector<float>{0.25f, 0.25f, 0, 0}));

  // Skewed logits: repeated updates shrink the load imbalance of sigmoid routing.
  const int64_t T = 256, E = 4;
  RouterConfig c = make_cfg(E, 1, RouterScore::sigmoid, true);
  auto noise = test::randn(T * E, 51);
  std::vector<float> logits(T * E);
  const float skew[4] = {1.0f, 0.5f, 0.0f, -0.5f};
  for (int64_t i = 0; i < T * E; ++i) logits[i] = noise[i] + skew[i % E];
  Tensor lt = f32(logits, {T, E});
  Tensor b = Tensor::zeros({E}, DType::f32, Device::cpu(), MemCategory::params);
  auto spread = [](const std::vector<int64_t>& n) {
    return *std::max_element(n.begin(), n.end()) - *std::min_element(n.begin(), n.end());
  };
  const int64_t before = spread(router_forward(lt, b, c, nullptr).tokens_per_expert);
  for (int it = 0; it < 200; ++it)
    update_expert_bias(b, router_forward(lt, b, c, nullptr).tokens_per_expert, 0.002f);
  const int64_t after = spread(router_forward(lt, b, c, nullptr).tokens_per_expert);
  EXPECT_GT(before, 100);
  EXPECT_LT(after, before / 4) << "before " << before << " after " << after;
  auto bv = b.to_floats();
  EXPECT_LT(bv[0], bv[3]);  // the favoured expert is pushed down, the starved one up
}

// A replayed selection (full recompute, RL router replay) gives the same weights and scores as
// the forward that chose it, takes the given counts, computes no losses, and is checked.
TEST(Router, ReplayReproducesTheForwardThatChoseTheSelection) {
  for (RouterScore score : {RouterScore::softmax, RouterScore::sigmoid}) {
    const RouterConfig cfg = make_cfg(12, 3, score, score == RouterScore::softmax);
    const int64_t T = 17;
    Tensor logits = f32(test::randn(T * 12, 41), {T, 12});
    RouterSaved s1, s2;
    const RouterOutput a = router_forward(logits, Tensor(), cfg, &s1);
    const RouterReplay replay{a.topk_idx, a.tokens_per_expert};
    const RouterOutput b = router_forward(logits, Tensor(), cfg, &s2, &replay);
    EXPECT_EQ(b.topk_idx.to_ints(), a.topk_idx.to_ints());
    EXPECT_EQ(b.topk_prob.to_floats(), a.topk_prob.to_floats());
    EXPECT_EQ(s2.scores.to_floats(), s1.scores.to_floats());
    EXPECT_EQ(b.tokens_per_expert, a.tokens_per_expert);
    EXPECT_EQ(b.aux_loss, 0.0);
    EXPECT_EQ(b.z_loss, 0.0);
    // Another selection replayed on the same logits: the weights follow the given experts.
    std::vector<int32_t> other(static_cast<size_t>(T * 3));
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < 3; ++k) other[t * 3 + k] = static_cast<int32_t>((t + 4 * k) % 12);
    const RouterReplay r2{Tensor::from_ints(other, {T, 3}), std::vector<int64_t>(12, 0)};
    const RouterOutput c = router_forward(logits, Tensor(), cfg, nullptr, &r2);
    const std::vector<float> sc = s1.scores.to_floats(), pc = c.topk_prob.to_floats();
    for (int64_t t = 0; t < T; ++t) {
      double denom = 0;
      for (int k = 0; k < 3; ++k) denom += sc[t * 12 + other[t * 3 + k]];
      for (int k = 0; k < 3; ++k)
        EXPECT_NEAR(pc[t * 3 + k], sc[t * 12 + other[t * 3 + k]] / (cfg.norm_topk_prob ? denom : 1.0), 1e-6);
    }
  }
  const RouterConfig cfg = make_cfg(4, 2, RouterScore::softmax, true);
  Tensor logits = f32(test::randn(3 * 4, 5), {3, 4});
  const RouterReplay bad{Tensor::from_ints({0, 1, 2, 4, 1, 0}, {3, 2}), {2, 2, 1, 1}};
  test::expect_error_contains([&] { router_forward(logits, Tensor(), cfg, nullptr, &bad); },
                              "replay.topk_idx[1, 1] = 4 is out of range [0, 4)");
  const RouterReplay short_counts{Tensor::from_ints({0, 1, 2, 3, 1, 0}, {3, 2}), {2, 2}};
  test::expect_error_contains([&] { router_forward(logits, Tensor(), cfg, nullptr, &short_counts); },
                              "replay.tokens_per_expert has 2 entries for 4 experts");
}

TEST(Router, BadInputs) {
  Tensor logits = Tensor::zeros({3, 4}, DType::f32, Device::cpu(), MemCategory::other);
  RouterConfig c = make_cfg(4, 5, RouterScore::softmax, true);
  test::expect_error_contains([&] { router_forward(logits, Tensor(), c, nullptr); },
                              "top_k (5) > num_experts (4)");
  c.top_k = 0;
  test::expect_error_contains([&] { router_forward(logits, Tensor(), c, nullptr); },
                              "top_k must be >= 1, got 0");
  c.top_k = 2;
  test::expect_error_contains(
      [&] { router_forward(logits.to_dtype(DType::bf16), Tensor(), c, nullptr); },
      "router_forward: argument 'logits' has dtype bf16, expected f32");
  test::expect_error_contains(
      [&] {
        router_forward(Tensor::zeros({3, 5}, DType::f32, Device::cpu(), MemCategory::other),
                       Tensor(), c, nullptr);
      },
      "router_forward: argument 'logits' has shape [3, 5], expected [-1, 4]");
  test::expect_error_contains(
      [&] {
        router_forward(Tensor::zeros({0, 4}, DType::f32, Device::cpu(), MemCategory::other),
                       Tensor(), c, nullptr);
      },
      "router_forward: empty batch");
  test::expect_error_contains(
      [&] {
        router_forward(logits, f32({0, 0, 0}, {3}), c, nullptr);
      },
      "router_forward: argument 'expert_bias' has shape [3], expected [4]");
  RouterConfig g = c;
  g.num_groups = 3;
  test::expect_error_contains([&] { g.validate(); }, "num_groups (3) must be >= 1 and divide");
  g.num_groups = 2;
  g.topk_groups = 3;
  test::expect_error_contains([&] { g.validate(); }, "topk_groups (3) must be in [1, num_groups");
  g.topk_groups = 1;
  g.top_k = 3;
  test::expect_error_contains([&] { g.validate(); }, "top_k (3) > experts in the 1 selected");
  RouterSaved saved;
  router_forward(logits, Tensor(), c, &saved);
  test::expect_error_contains(
      [&] {
        router_backward(f32({1, 2, 3}, {3, 1}), 0, 0, logits, c, saved);
      },
      "router_backward: argument 'd_topk_prob' has shape [3, 1], expected [3, 2]");
  test::expect_error_contains([&] { router_backward(Tensor(), 0, 0, logits, c, RouterSaved{}); },
                              "router_backward: argument 'saved.scores' is undefined");
  Tensor b = f32({0, 0}, {2});
  test::expect_error_contains(
      [&] {
        update_expert_bias(b, {1, 2, 3}, 0.1f);
      },
      "update_expert_bias: argument 'expert_bias' has shape [2], expected [3]");
}

}  // namespace
}  // namespace bb
