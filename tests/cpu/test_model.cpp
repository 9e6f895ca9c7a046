// Whole-model checks: gradients against finite differences, recompute equivalence and its
// memory effect, and primitive swaps that must not change the math.
#include <gtest/gtest.h>

#include "common/testing.h"
#include "models/qwen3_moe.h"

namespace bb {
namespace {

ModelConfig tiny_config(bool qwen2 = false) {
  ModelConfig c;
  c.model_type = qwen2 ? "qwen2_moe" : "qwen3_moe";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 24;
  c.moe_intermediate_size = 12;
  c.num_experts = 4;
  c.top_k = 2;
  c.norm_topk_prob = !qwen2;
  // qwen3: both layers MoE (exercises the aux loss pooled over layers); qwen2: a dense layer 0.
  if (qwen2) c.mlp_only_layers = {0};
  c.rope_theta = 10000;
  c.rms_norm_eps = 1e-6;
  c.router_aux_loss_coef = 0.01;
  c.init_std = 0.3;  // large enough that every path carries signal in a 2-layer model
  if (qwen2) {
    c.qk_norm = false;
    c.qkv_bias = true;
    c.shared_expert_intermediate_size = 10;
  }
  return c;
}

// Two packed sequences (lengths 7 and 5), a masked target, next-token targets.
MicroBatch tiny_batch(int64_t V, uint64_t seed) {
  const std::vector<int64_t> lens = {7, 5};
  std::vector<int32_t> tok, tgt, pos, cu = {0};
  uint64_t ctr = 0;
  for (int64_t L : lens) {
    std::vector<int32_t> doc;
    for (int64_t i = 0; i <= L; ++i) doc.push_back(static_cast<int32_t>(philox4x32_10(seed, ctr++).v[0] % V));
    for (int64_t i = 0; i < L; ++i) {
      tok.push_back(doc[i]);
      tgt.push_back(i == L - 1 ? -1 : doc[i + 1]);
      pos.push_back(static_cast<int32_t>(i));
    }
    cu.push_back(cu.back() + static_cast<int32_t>(L));
  }
  tgt[2] = -1;  // a loss-masked position
  MicroBatch mb;
  const int64_t T = static_cast<int64_t>(tok.size());
  mb.tokens = Tensor::from_ints(tok, {T});
  mb.targets = Tensor::from_ints(tgt, {T});
  mb.positions = Tensor::from_ints(pos, {T});
  mb.cu_seqlens = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  mb.num_valid = 0;
  for (int32_t t : tgt) mb.num_valid += t >= 0;
  return mb;
}

double objective(const ForwardStats& s, const ModelOptions& o) {
  return s.loss_sum + o.aux_loss_coef * s.aux_loss + o.z_loss_coef * s.z_loss;
}

void check_model_gradients(bool qwen2, const std::string& loss) {
  ModelOptions o;
  o.loss = loss;
  o.loss_chunk_tokens = 5;
  o.loss_chunk_vocab = 8;
  o.aux_loss_coef = 0.3;
  o.z_loss_coef = 0.05;
  Qwen3MoeModel m(tiny_config(qwen2), o, 7);
  MicroBatch mb = tiny_batch(37, 3);
  m.zero_grad();
  m.forward_backward(mb, 1.0f, 1.0);
  std::vector<Tensor> routing0 = m.last_routing();
  ASSERT_FALSE(routing0.empty());
  int checked = 0;
  uint64_t dir_seed = 100;
  for (Param* p : m.params()) {
    // Directional derivative along a random direction u: (L(w + h u) - L(w - h u)) / 2h vs <g, u>.
    const int64_t n = p->value.numel();
    auto u = test::randn(static_cast<size_t>(n), dir_seed++);
    auto w0 = p->value.to_floats();
    auto g = p->grad.to_floats();
    double analytic = 0;
    for (int64_t i = 0; i < n; ++i) analytic += static_cast<double>(g[i]) * u[i];
    const double h = 1e-3;
    auto eval = [&](double sgn) {
      std::vector<float> w(w0);
      for (int64_t i = 0; i < n; ++i) w[i] += static_cast<float>(sgn * h * u[i]);
      p->value.copy_from(Tensor::from_floats(w, p->value.shape()));
      const double L = objective(m.forward(mb, nullptr), o);
      // Finite differences are only valid while the top-k selection stays put.
      for (size_t l = 0; l < routing0.size(); ++l)
        EXPECT_EQ(m.last_routing()[l].to_ints(), routing0[l].to_ints())
            << p->name << ": routing changed under perturbation";
      return L;
    };
    const double fd = (eval(+1) - eval(-1)) / (2 * h);
    p->value.copy_from(Tensor::from_floats(w0, p->value.shape()));
    const double err = std::fabs(fd - analytic) / std::max(std::fabs(fd), 1e-2);
    if (std::getenv("BB_VERBOSE")) std::printf("%-55s fd %+.6e an %+.6e err %.1e\n", p->name.c_str(), fd, analytic, err);
    EXPECT_LT(err, 2e-2) << p->name << ": finite difference " << fd << " vs analytic " << analytic;
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

TEST(ModelGrad, Qwen3MoeMatchesFiniteDifferences) { check_model_gradients(false, "linear_ce"); }
TEST(ModelGrad, Qwen2MoeSharedExpertMatchesFiniteDifferences) { check_model_gradients(true, "full_ce"); }

std::vector<std::vector<float>> grads_of(Qwen3MoeModel& m) {
  std::vector<std::vector<float>> g;
  for (Param* p : m.params()) g.push_back(p->grad.to_floats());
  return g;
}

struct RunResult {
  ForwardStats stats;
  std::vector<std::vector<float>> grads;
  int64_t act_peak = 0;
};

RunResult run_once(const ModelOptions& o, bool qwen2 = false) {
  ModelConfig c = tiny_config(qwen2);
  c.num_layers = 4;
  Qwen3MoeModel m(c, o, 11);
  MicroBatch mb = tiny_batch(37, 5);
  m.zero_grad();
  Allocator& a = allocator_for(Device::cpu());
  a.reset_peak();
  const int64_t base = a.stats().live_of(MemCategory::activations);
  RunResult r;
  r.stats = m.forward_backward(mb, 1.0f / static_cast<float>(mb.num_valid), 1.0);
  r.act_peak = a.stats().peak_of(MemCategory::activations) - base;
  EXPECT_EQ(a.stats().live_of(MemCategory::activations), base) << "activations leaked past backward";
  r.grads = grads_of(m);
  return r;
}

void expect_same(const RunResult& a, const RunResult& b, double tol, const char* what) {
  EXPECT_NEAR(a.stats.loss_sum, b.stats.loss_sum, tol * std::fabs(a.stats.loss_sum)) << what;
  EXPECT_NEAR(a.stats.aux_loss, b.stats.aux_loss, tol * std::fabs(a.stats.aux_loss) + 1e-12) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    double na = 0;
    for (float x : a.grads[i]) na += double(x) * x;
    if (na == 0) continue;  // e.g. an unused embedding row block; compared below anyway
    EXPECT_LT(test::rel_error(b.grads[i], a.grads[i]), tol) << what << " param " << i;
  }
}

TEST(Recompute, FullGivesIdenticalGradientsAndSmallerActivationPeak) {
  ModelOptions none, full;
  none.aux_loss_coef = full.aux_loss_coef = 0.01;
  full.recompute = "full";
  RunResult a = run_once(none), b = run_once(full);
  // Same primitives in the same order: bit-identical.
  EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum);
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
  EXPECT_LT(b.act_peak, a.act_peak) << "full recompute should lower the activations peak";
  std::printf("activations peak: recompute=none %lld B, recompute=full %lld B\n",
              static_cast<long long>(a.act_peak), static_cast<long long>(b.act_peak));
}

TEST(PrimitiveSwap, LinearCeEqualsFullCe) {
  ModelOptions a, b;
  a.loss = "full_ce";
  b.loss = "linear_ce";
  b.loss_chunk_tokens = 5;
  b.loss_chunk_vocab = 7;
  expect_same(run_once(a), run_once(b), 1e-5, "full_ce vs linear_ce");
}

TEST(PrimitiveSwap, MemoryEfficientPermuteEqualsStandard) {
  ModelOptions a, b;
  b.permute = "memory_efficient";
  expect_same(run_once(a), run_once(b), 1e-5, "permute");
  expect_same(run_once(a, true), run_once(b, true), 1e-5, "permute (qwen2)");
}

TEST(PrimitiveSwap, GroupedExpertsEqualSequential) {
  ModelOptions a, b;
  b.experts = "grouped";
  expect_same(run_once(a), run_once(b), 1e-5, "experts");
}

TEST(Model, HfTensorsAreViewsWithHfNames) {
  Qwen3MoeModel m(tiny_config(true), ModelOptions{}, 1);  // qwen2 tiny: dense layer 0, shared expert
  auto ts = m.hf_tensors();
  std::map<std::string, Tensor> byname(ts.begin(), ts.end());
  ASSERT_TRUE(byname.count("model.layers.1.mlp.experts.3.down_proj.weight"));
  ASSERT_TRUE(byname.count("model.layers.1.mlp.experts.0.gate_proj.weight"));
  ASSERT_TRUE(byname.count("model.layers.0.mlp.up_proj.weight"));
  ASSERT_TRUE(byname.count("lm_head.weight"));
  EXPECT_EQ(byname["model.layers.1.mlp.experts.0.gate_proj.weight"].shape(), (Shape{12, 16}));
  // Writing through a view changes the fused parameter.
  Tensor up = byname["model.layers.1.mlp.experts.2.up_proj.weight"];
  up.fill_(5.0);
  auto fused = m.find_param("model.layers.1.mlp.experts.gate_up_proj")->value.to_floats();
  EXPECT_EQ(fused[(2 * 24 + 12) * 16], 5.0f);  // expert 2, row F (first up row)
  EXPECT_NE(fused[(2 * 24 + 11) * 16], 5.0f);  // last gate row untouched
  int64_t n = 0;
  for (auto& [k, t] : ts) n += t.numel();
  EXPECT_EQ(n, m.num_params());
  EXPECT_EQ(m.num_params(), tiny_config(true).num_params());
  ASSERT_TRUE(byname.count("model.layers.1.mlp.shared_expert.up_proj.weight"));
}

TEST(Model, BadBatchIsAClearError) {
  Qwen3MoeModel m(tiny_config(), ModelOptions{}, 1);
  MicroBatch mb = tiny_batch(37, 1);
  mb.tokens = Tensor::from_ints({}, {0});
  test::expect_error_contains([&] { m.forward(mb, nullptr); }, "empty micro-batch");
  MicroBatch mb2 = tiny_batch(37, 1);
  mb2.tokens = Tensor::from_ints(std::vector<int32_t>(12, 40), {12});
  test::expect_error_contains([&] { m.forward(mb2, nullptr); }, "outside the vocabulary");
}

}  // namespace
}  // namespace bb
