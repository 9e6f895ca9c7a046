// MoE expert MLPs (sequential and grouped): gradients of x, weights and row_prob against double
// finite differences, sequential == grouped, zero-token experts, += weight gradients, bf16
// storage, bad input; and the full router -> permute -> experts -> unpermute chain, where the
// standard and memory_efficient permute variants must give the same output and gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "common/testing.h"
#include "primitives/moe/experts.h"
#include "primitives/moe/experts_ref.h"
#include "primitives/moe/permute.h"
#include "primitives/moe/permute_ref.h"
#include "primitives/moe/router.h"
#include "primitives/moe/router_ref.h"

namespace bb {
namespace {

Tensor f32(const std::vector<float>& v, const Shape& s) {
  return Tensor::from_floats(v, s);
}

int64_t total(const std::vector<int64_t>& c) {
  return std::accumulate(c.begin(), c.end(), 0LL);
}

const char* impl_name(ExpertsImpl i) {
  return i == ExpertsImpl::sequential ? "seq" : "grouped";
}

struct Problem {
  int64_t E, H, F, N;
  std::vector<int64_t> counts;
  std::vector<float> x, wgu, wd, prob, dy;
};

Problem make_problem(std::vector<int64_t> counts, int64_t H, int64_t F, uint64_t seed) {
  Problem p;
  p.E = static_cast<int64_t>(counts.size());
  p.H = H;
  p.F = F;
  p.N = total(counts);
  p.counts = counts;
  p.x = test::randn(p.N * H, seed);
  p.wgu = test::randn(p.E * 2 * F * H, seed + 1, 0.4f);
  p.wd = test::randn(p.E * H * F, seed + 2, 0.4f);
  p.prob = test::randu(p.N, seed + 3, 0.2f, 1.0f);
  p.dy = test::randn(p.N * H, seed + 4);
  return p;
}

// sum(dy * experts(x)) in double through the sequential reference.
double experts_loss(const Problem& p, const std::vector<double>& x, const std::vector<double>& wgu,
                    const std::vector<double>& wd, const std::vector<double>* prob) {
  std::vector<double> y(p.N * p.H), gu(p.N * 2 * p.F), act(p.N * p.F);
  ref::experts_forward_sequential(y.data(), gu.data(), act.data(), x.data(), p.counts.data(), p.E,
                                  wgu.data(), wd.data(), prob ? prob->data() : nullptr, p.H, p.F);
  return test::weighted_sum(y, test::cast<double>(p.dy));
}

struct GradCase {
  ExpertsImpl impl;
  bool with_prob;
};
void PrintTo(const GradCase& g, std::ostream* os) {
  *os << impl_name(g.impl) << (g.with_prob ? " with row_prob" : " without row_prob");
}

class ExpertsGrad : public ::testing::TestWithParam<GradCase> {};

TEST_P(ExpertsGrad, BackwardMatchesFiniteDifferences) {
  const GradCase g = GetParam();
  // Expert 1 gets no rows; expert 3 a single row.
  Problem p = make_problem({3, 0, 4, 1, 2}, 6, 5, 100);
  const Tensor prob = g.with_prob ? f32(p.prob, {p.N}) : Tensor();
  const Tensor x = f32(p.x, {p.N, p.H}), wgu = f32(p.wgu, {p.E, 2 * p.F, p.H}),
               wd = f32(p.wd, {p.E, p.H, p.F}), dy = f32(p.dy, {p.N, p.H});
  ExpertsSaved saved;
  Tensor y = experts_forward(g.impl, x, p.counts, wgu, wd, prob, &saved);
  EXPECT_EQ(y.shape(), (Shape{p.N, p.H}));
  EXPECT_EQ(y.category(), MemCategory::moe);
  EXPECT_EQ(saved.gate_up.shape(), (Shape{p.N, 2 * p.F}));
  EXPECT_EQ(saved.act.category(), MemCategory::activations);
  ExpertsDgrad dg = experts_backward_data(g.impl, dy, p.counts, wgu, wd, prob, saved);
  // Weight gradients accumulate: start from nonzero values and subtract them afterwards.
  auto gwgu0 = test::randn(p.wgu.size(), 7), gwd0 = test::randn(p.wd.size(), 8);
  Tensor gwgu = f32(gwgu0, {p.E, 2 * p.F, p.H}), gwd = f32(gwd0, {p.E, p.H, p.F});
  experts_backward_weight(g.impl, dy, x, p.counts, prob, saved, dg, gwgu, gwd);
  auto gwgu1 = gwgu.to_floats(), gwd1 = gwd.to_floats();
  std::vector<float> d_wgu(gwgu1.size()), d_wd(gwd1.size());
  for (size_t i = 0; i < d_wgu.size(); ++i) d_wgu[i] = gwgu1[i] - gwgu0[i];
  for (size_t i = 0; i < d_wd.size(); ++i) d_wd[i] = gwd1[i] - gwd0[i];
  // The zero-token expert's gradient slices are untouched, bit for bit.
  for (int64_t i = 0; i < 2 * p.F * p.H; ++i)
    EXPECT_EQ(gwgu1[2 * p.F * p.H + i], gwgu0[2 * p.F * p.H + i]);
  for (int64_t i = 0; i < p.H * p.F; ++i) EXPECT_EQ(gwd1[p.H * p.F + i], gwd0[p.H * p.F + i]);

  const auto xd = test::cast<double>(p.x), wgud = test::cast<double>(p.wgu),
             wdd = test::cast<double>(p.wd), pd = test::cast<double>(p.prob);
  const std::vector<double>* pp = g.with_prob ? &pd : nullptr;
  auto fd_x =
      test::finite_diff([&](const auto& v) { return experts_loss(p, v, wgud, wdd, pp); }, xd);
  auto fd_wgu =
      test::finite_diff([&](const auto& v) { return experts_loss(p, xd, v, wdd, pp); }, wgud);
  auto fd_wd =
      test::finite_diff([&](const auto& v) { return experts_loss(p, xd, wgud, v, pp); }, wdd);
  EXPECT_LT(test::rel_error(dg.d_x.to_floats(), fd_x), test::kGradTol);
  EXPECT_LT(test::rel_error(d_wgu, fd_wgu), test::kGradTol);
  EXPECT_LT(test::rel_error(d_wd, fd_wd), test::kGradTol);
  if (g.with_prob) {
    auto fd_p =
        test::finite_diff([&](const auto& v) { return experts_loss(p, xd, wgud, wdd, &v); }, pd);
    ASSERT_TRUE(dg.d_row_prob.defined());
    EXPECT_LT(test::rel_error(dg.d_row_prob.to_floats(), fd_p), test::kGradTol);
  } else {
    EXPECT_FALSE(dg.d_row_prob.defined());
  }
}

INSTANTIATE_TEST_SUITE_P(Experts, ExpertsGrad,
                         ::testing::Values(GradCase{ExpertsImpl::sequential, false},
                                           GradCase{ExpertsImpl::sequential, true},
                                           GradCase{ExpertsImpl::grouped, false},
                                           GradCase{ExpertsImpl::grouped, true}),
                         [](const ::testing::TestParamInfo<GradCase>& i) {
                           return std::string(impl_name(i.param.impl)) +
                                  (i.param.with_prob ? "_prob" : "_noprob");
                         });

struct AllOutputs {
  std::vector<float> y, d_x, d_row_prob, d_gate_up, d_wgu, d_wd, gate_up, act;
};

AllOutputs run_all(ExpertsImpl impl, const Problem& p, bool with_prob) {
  const Tensor prob = with_prob ? f32(p.prob, {p.N}) : Tensor();
  const Tensor x = f32(p.x, {p.N, p.H}), wgu = f32(p.wgu, {p.E, 2 * p.F, p.H}),
               wd = f32(p.wd, {p.E, p.H, p.F}), dy = f32(p.dy, {p.N, p.H});
  ExpertsSaved s;
  AllOutputs o;
  o.y = experts_forward(impl, x, p.counts, wgu, wd, prob, &s).to_floats();
  ExpertsDgrad dg = experts_backward_data(impl, dy, p.counts, wgu, wd, prob, s);
  Tensor gwgu = Tensor::zeros(wgu.shape(), DType::f32, Device::cpu(), MemCategory::grads);
  Tensor gwd = Tensor::zeros(wd.shape(), DType::f32, Device::cpu(), MemCategory::grads);
  experts_backward_weight(impl, dy, x, p.counts, prob, s, dg, gwgu, gwd);
  o.d_x = dg.d_x.to_floats();
  if (with_prob) o.d_row_prob = dg.d_row_prob.to_floats();
  o.d_gate_up = dg.d_gate_up.to_floats();
  o.d_wgu = gwgu.to_floats();
  o.d_wd = gwd.to_floats();
  o.gate_up = s.gate_up.to_floats();
  o.act = s.act.to_floats();
  return o;
}

TEST(Experts, SequentialEqualsGrouped) {
  Problem p = make_problem({7, 0, 3, 0, 11, 1}, 24, 20, 200);
  for (bool with_prob : {false, true}) {
    AllOutputs a = run_all(ExpertsImpl::sequential, p, with_prob);
    AllOutputs b = run_all(ExpertsImpl::grouped, p, with_prob);
    const double tol = 1e-5;  // fp32 rounding of different summation orders
    EXPECT_LT(test::rel_error(b.y, a.y), tol);
    EXPECT_LT(test::rel_error(b.gate_up, a.gate_up), tol);
    EXPECT_LT(test::rel_error(b.act, a.act), tol);
    EXPECT_LT(test::rel_error(b.d_x, a.d_x), tol);
    EXPECT_LT(test::rel_error(b.d_gate_up, a.d_gate_up), tol);
    EXPECT_LT(test::rel_error(b.d_wgu, a.d_wgu), tol);
    EXPECT_LT(test::rel_error(b.d_wd, a.d_wd), tol);
    if (with_prob) EXPECT_LT(test::rel_error(b.d_row_prob, a.d_row_prob), tol);
  }
}

TEST(Experts, RowProbScalesBeforeDownProjection) {
  // With a row probability p, y = W_down (p * act): linear in p for each row.
  Problem p = make_problem({2, 3}, 4, 3, 300);
  AllOutputs plain = run_all(ExpertsImpl::sequential, p, false);
  AllOutputs scaled = run_all(ExpertsImpl::sequential, p, true);
  for (int64_t n = 0; n < p.N; ++n)
    for (int64_t j = 0; j < p.H; ++j)
      EXPECT_NEAR(scaled.y[n * p.H + j], p.prob[n] * plain.y[n * p.H + j],
                  1e-5 * (1 + std::fabs(plain.y[n * p.H + j])));
  EXPECT_EQ(scaled.act, plain.act);  // the saved activation is unscaled
}

// experts_forward_saved (the recompute forward whose output is unused) fills exactly the saved
// tensors of experts_forward, without the down projection: f32 and bf16, with and without
// row_prob, an empty expert.
TEST(Experts, ForwardSavedEqualsTheForwardsSavedTensors) {
  Problem p = make_problem({3, 0, 5, 2}, 7, 6, 900);
  for (ExpertsImpl impl : {ExpertsImpl::sequential, ExpertsImpl::grouped})
    for (DType dt : {DType::f32, DType::bf16})
      for (bool with_prob : {false, true}) {
        SCOPED_TRACE(std::string(impl_name(impl)) + " " + dtype_name(dt) + (with_prob ? " +prob" : ""));
        const Tensor x = Tensor::from_floats(p.x, {p.N, p.H}, dt),
                     wgu = Tensor::from_floats(p.wgu, {p.E, 2 * p.F, p.H}, dt),
                     wd = Tensor::from_floats(p.wd, {p.E, p.H, p.F}, dt);
        const Tensor prob = with_prob ? f32(p.prob, {p.N}) : Tensor();
        ExpertsSaved full, only;
        experts_forward(impl, x, p.counts, wgu, wd, prob, &full);
        experts_forward_saved(impl, x, p.counts, wgu, wd, prob, only);
        EXPECT_EQ(only.gate_up.dtype(), full.gate_up.dtype());
        EXPECT_EQ(only.gate_up.shape(), full.gate_up.shape());
        EXPECT_EQ(only.gate_up.to_floats(), full.gate_up.to_floats());
        EXPECT_EQ(only.act.to_floats(), full.act.to_floats());
        EXPECT_EQ(only.act.category(), MemCategory::activations);
      }
  // The same boundary checks as the forward.
  const Tensor x = f32(p.x, {p.N, p.H}), wgu = f32(p.wgu, {p.E, 2 * p.F, p.H}), wd = f32(p.wd, {p.E, p.H, p.F});
  ExpertsSaved s;
  test::expect_error_contains([&] { experts_forward_saved(ExpertsImpl::sequential, x, {1, 2}, wgu, wd, Tensor(), s); },
                              "experts_forward_saved: tokens_per_expert has 2 entries");
}

// Weight gradients add (+=) by default; accumulate = false writes them: NaN in them before is
// ignored, the expert without rows gets zeros, and the result equals adding into zeros.
TEST(Experts, WeightGradientsAccumulateOrOverwrite) {
  Problem p = make_problem({2, 0, 3}, 5, 4, 400);
  for (ExpertsImpl impl : {ExpertsImpl::sequential, ExpertsImpl::grouped}) {
    const Tensor x = f32(p.x, {p.N, p.H}), wgu = f32(p.wgu, {p.E, 2 * p.F, p.H}),
                 wd = f32(p.wd, {p.E, p.H, p.F}), dy = f32(p.dy, {p.N, p.H});
    ExpertsSaved s;
    experts_forward(impl, x, p.counts, wgu, wd, Tensor(), &s);
    ExpertsDgrad dg = experts_backward_data(impl, dy, p.counts, wgu, wd, Tensor(), s);
    Tensor gwgu = Tensor::zeros(wgu.shape(), DType::f32, Device::cpu(), MemCategory::grads);
    Tensor gwd = Tensor::zeros(wd.shape(), DType::f32, Device::cpu(), MemCategory::grads);
    experts_backward_weight(impl, dy, x, p.counts, Tensor(), s, dg, gwgu, gwd);
    auto once = gwd.to_floats();
    const auto once_gu = gwgu.to_floats();
    experts_backward_weight(impl, dy, x, p.counts, Tensor(), s, dg, gwgu, gwd);
    auto twice = gwd.to_floats();
    for (size_t i = 0; i < once.size(); ++i) EXPECT_FLOAT_EQ(twice[i], 2 * once[i]);
    gwgu.fill_(std::nan(""));
    gwd.fill_(std::nan(""));
    experts_backward_weight(impl, dy, x, p.counts, Tensor(), s, dg, gwgu, gwd, /*accumulate=*/false);
    EXPECT_EQ(gwgu.to_floats(), once_gu);
    const std::vector<float> written = gwd.to_floats();
    EXPECT_EQ(written, once);
    for (int64_t i = 0; i < p.H * p.F; ++i) ASSERT_EQ(written[p.H * p.F + i], 0.0f);  // expert 1: no rows
    // All experts empty: the gradients become zeros.
    const std::vector<int64_t> none(p.E, 0);
    Tensor x0 = Tensor::empty({0, p.H}, DType::f32, Device::cpu(), MemCategory::moe);
    ExpertsSaved s0;
    experts_forward(impl, x0, none, wgu, wd, Tensor(), &s0);
    ExpertsDgrad dg0 = experts_backward_data(impl, x0, none, wgu, wd, Tensor(), s0);
    experts_backward_weight(impl, x0, x0, none, Tensor(), s0, dg0, gwgu, gwd, false);
    for (float v : gwgu.to_floats()) ASSERT_EQ(v, 0.0f);
  }
}

TEST(Experts, AllExpertsEmpty) {
  const int64_t E = 3, H = 4, F = 2;
  std::vector<int64_t> counts = {0, 0, 0};
  Tensor x = Tensor::empty({0, H}, DType::f32, Device::cpu(), MemCategory::moe);
  Tensor wgu = f32(test::randn(E * 2 * F * H, 1), {E, 2 * F, H});
  Tensor wd = f32(test::randn(E * H * F, 2), {E, H, F});
  for (ExpertsImpl impl : {ExpertsImpl::sequential, ExpertsImpl::grouped}) {
    ExpertsSaved s;
    Tensor y = experts_forward(impl, x, counts, wgu, wd, Tensor(), &s);
    EXPECT_EQ(y.shape(), (Shape{0, H}));
    ExpertsDgrad dg = experts_backward_data(impl, y, counts, wgu, wd, Tensor(), s);
    EXPECT_EQ(dg.d_x.shape(), (Shape{0, H}));
    Tensor gwgu = f32(std::vector<float>(E * 2 * F * H, 1.5f), {E, 2 * F, H});
    Tensor gwd = f32(std::vector<float>(E * H * F, 1.5f), {E, H, F});
    experts_backward_weight(impl, y, x, counts, Tensor(), s, dg, gwgu, gwd);
    for (float v : gwgu.to_floats()) EXPECT_EQ(v, 1.5f);
    for (float v : gwd.to_floats()) EXPECT_EQ(v, 1.5f);
  }
}

TEST(Experts, Bf16StorageComputesInF32) {
  Problem p = make_problem({3, 0, 5}, 8, 6, 500);
  // Round the inputs to bf16 so the f32 run sees the same values.
  auto rnd = [](std::vector<float>& v) {
    for (float& a : v) a = round_bf16(a);
  };
  rnd(p.x);
  rnd(p.wgu);
  rnd(p.wd);
  AllOutputs ref32 = run_all(ExpertsImpl::sequential, p, true);
  Tensor x = Tensor::from_floats(p.x, {p.N, p.H}, DType::bf16);
  Tensor wgu = Tensor::from_floats(p.wgu, {p.E, 2 * p.F, p.H}, DType::bf16);
  Tensor wd = Tensor::from_floats(p.wd, {p.E, p.H, p.F}, DType::bf16);
  for (ExpertsImpl impl : {ExpertsImpl::sequential, ExpertsImpl::grouped}) {
    ExpertsSaved s;
    Tensor y = experts_forward(impl, x, p.counts, wgu, wd, f32(p.prob, {p.N}), &s);
    EXPECT_EQ(y.dtype(), DType::bf16);
    EXPECT_EQ(s.act.dtype(), DType::bf16);
    EXPECT_LT(test::rel_error(y.to_floats(), ref32.y), 1e-2);
    // bf16 weight gradients accumulate through an f32 copy.
    Tensor dy = Tensor::from_floats(p.dy, {p.N, p.H}, DType::bf16);
    ExpertsDgrad dg = experts_backward_data(impl, dy, p.counts, wgu, wd, f32(p.prob, {p.N}), s);
    Tensor gwd = Tensor::zeros(wd.shape(), DType::bf16, Device::cpu(), MemCategory::grads);
    Tensor gwgu = Tensor::zeros(wgu.shape(), DType::f32, Device::cpu(), MemCategory::grads);
    experts_backward_weight(impl, dy, x, p.counts, f32(p.prob, {p.N}), s, dg, gwgu, gwd);
    EXPECT_LT(test::rel_error(gwd.to_floats(), ref32.d_wd), 2e-2);
    EXPECT_LT(test::rel_error(gwgu.to_floats(), ref32.d_wgu), 2e-2);
    EXPECT_LT(test::rel_error(dg.d_x.to_floats(), ref32.d_x), 2e-2);
  }
}

TEST(Experts, BadInputs) {
  Problem p = make_problem({2, 1}, 4, 3, 600);
  const Tensor x = f32(p.x, {p.N, p.H}), wgu = f32(p.wgu, {p.E, 2 * p.F, p.H}),
               wd = f32(p.wd, {p.E, p.H, p.F});
  auto fwd = [&](const std::vector<int64_t>& c, const Tensor& xx, const Tensor& a, const Tensor& b,
                 const Tensor& prob) {
    experts_forward(ExpertsImpl::sequential, xx, c, a, b, prob, nullptr);
  };
  test::expect_error_contains(
      [&] {
        fwd({2, 1, 0}, x, wgu, wd, Tensor());
      },
      "experts_forward: tokens_per_expert has 3 entries, expected E = 2");
  test::expect_error_contains(
      [&] {
        fwd({2, 2}, x, wgu, wd, Tensor());
      },
      "experts_forward: tokens_per_expert sums to 4 but x_perm has N = 3");
  test::expect_error_contains(
      [&] {
        fwd({4, -1}, x, wgu, wd, Tensor());
      },
      "tokens_per_expert[1] = -1 is negative");
  test::expect_error_contains(
      [&] {
        fwd({2, 1}, x, wgu, f32(p.wd, {p.E, p.F, p.H}), Tensor());
      },
      "experts_forward: argument 'w_down' has shape [2, 3, 4], expected [2, 4, 3]");
  test::expect_error_contains(
      [&] {
        fwd({2, 1}, f32(p.x, {p.N * 2, p.H / 2}), wgu, wd, Tensor());
      },
      "experts_forward: argument 'x_perm' has shape [6, 2], expected [-1, 4]");
  test::expect_error_contains(
      [&] {
        fwd({2, 1}, x, wgu, wd, f32({1, 1}, {2}));
      },
      "experts_forward: argument 'row_prob' has shape [2], expected [3]");
  test::expect_error_contains(
      [&] {
        fwd({2, 1}, x, wgu, wd, Tensor::from_floats({1, 1, 1}, {3}, DType::bf16));
      },
      "argument 'row_prob' has dtype bf16, expected f32");
  test::expect_error_contains(
      [&] {
        fwd({2, 1}, x, f32(p.wgu, {p.E, 2 * p.F * p.H}), wd, Tensor());
      },
      "argument 'w_gate_up' has shape [2, 24], expected [E, 2F, H]");
  test::expect_error_contains(
      [&] {
        experts_backward_data(ExpertsImpl::grouped, x, p.counts, wgu, wd, Tensor(), ExpertsSaved{});
      },
      "experts_backward_data: argument 'saved.gate_up' is undefined");
}

// ---- the whole MoE block ----------------------------------------------------------------------

struct ChainOut {
  std::vector<float> y, d_x, d_logits, d_wgu, d_wd;
  std::vector<int32_t> idx;
};

// router -> permute -> experts -> unpermute, then the backward in reverse, with loss
// sum(dy * y) + d_aux * aux.
ChainOut run_chain(bool mem_eff, ExpertsImpl impl, const RouterConfig& cfg, const Tensor& logits,
                   const Tensor& x, const Tensor& wgu, const Tensor& wd, const Tensor& dy,
                   double d_aux) {
  RouterSaved rs;
  RouterOutput r = router_forward(logits, Tensor(), cfg, &rs);
  PermuteMap m = make_permute_map(r.topk_idx, cfg.num_experts);
  Tensor xp = permute_forward(x, m);
  Tensor row_prob = mem_eff ? permute_probs(r.topk_prob, m) : Tensor();
  ExpertsSaved es;
  Tensor yp = experts_forward(impl, xp, m.tokens_per_expert, wgu, wd, row_prob, &es);
  const Tensor combine = mem_eff ? Tensor() : r.topk_prob;
  ChainOut o;
  o.y = unpermute_forward(yp, m, combine).to_floats();
  o.idx = r.topk_idx.to_ints();

  UnpermuteGrads ug = unpermute_backward(dy, mem_eff ? Tensor() : yp, m, combine);
  ExpertsDgrad eg =
      experts_backward_data(impl, ug.d_y_perm, m.tokens_per_expert, wgu, wd, row_prob, es);
  Tensor gwgu = Tensor::zeros(wgu.shape(), DType::f32, Device::cpu(), MemCategory::grads);
  Tensor gwd = Tensor::zeros(wd.shape(), DType::f32, Device::cpu(), MemCategory::grads);
  experts_backward_weight(impl, ug.d_y_perm, xp, m.tokens_per_expert, row_prob, es, eg, gwgu, gwd);
  Tensor d_prob = mem_eff ? unpermute_probs_grad(eg.d_row_prob, m) : ug.d_topk_prob;
  o.d_x = permute_backward(eg.d_x, m).to_floats();
  o.d_logits = router_backward(d_prob, d_aux, 0.0, logits, cfg, rs).to_floats();
  o.d_wgu = gwgu.to_floats();
  o.d_wd = gwd.to_floats();
  return o;
}

// The same chain in double with the selection fixed (for finite differences).
double chain_loss(const RouterConfig& cfg, const std::vector<int32_t>& idx, int64_t T, int64_t H,
                  int64_t F, const std::vector<double>& logits, const std::vector<double>& x,
                  const std::vector<double>& wgu, const std::vector<double>& wd,
                  const std::vector<double>& dy, double d_aux) {
  const int64_t E = cfg.num_experts, K = cfg.top_k, N = T * K;
  std::vector<double> s(T * E), prob(T * K);
  ref::router_scores(s.data(), logits.data(), T, E, cfg.score);
  ref::router_weights(prob.data(), s.data(), idx.data(), T, E, K, cfg.norm_topk_prob,
                      double(cfg.routed_scaling));
  std::vector<int32_t> row_token(N), slot_row(N);
  std::vector<int64_t> counts(E);
  ref::make_permute_map(row_token.data(), slot_row.data(), counts.data(), idx.data(), T, K, E);
  std::vector<double> xp(N * H), gu(N * 2 * F), act(N * F), yp(N * H), y(T * H);
  ref::permute_forward(xp.data(), x.data(), row_token.data(), N, H);
  ref::experts_forward_sequential(yp.data(), gu.data(), act.data(), xp.data(), counts.data(), E,
                                  wgu.data(), wd.data(), static_cast<const double*>(nullptr), H, F);
  ref::unpermute_forward(y.data(), yp.data(), slot_row.data(), prob.data(), T, K, H);
  return test::weighted_sum(y, dy) +
         d_aux * ref::router_aux_loss(s.data(), counts.data(), T, E, cfg.score);
}

struct ChainCase {
  RouterScore score;
};
void PrintTo(const ChainCase& c, std::ostream* os) {
  *os << (c.score == RouterScore::softmax ? "softmax" : "sigmoid");
}

class MoeChain : public ::testing::TestWithParam<ChainCase> {};

TEST_P(MoeChain, StandardAndMemoryEfficientAgreeAndMatchFiniteDifferences) {
  const int64_t T = 7, E = 5, K = 2, H = 6, F = 4;
  RouterConfig cfg;
  cfg.num_experts = E;
  cfg.top_k = K;
  cfg.score = GetParam().score;
  cfg.routed_scaling = cfg.score == RouterScore::sigmoid ? 2.0f : 1.0f;
  // Logits a ramp apart per token (shuffled by a per-token rotation) so FD keeps the selection;
  // expert 4 is never chosen (a zero-token expert inside the chain).
  std::vector<float> logits(T * E);
  auto noise = test::randn(T * E, 700, 0.05f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      logits[t * E + e] =
          (e == 4 ? -3.0f : 0.7f * static_cast<float>((e + t) % 4)) + noise[t * E + e];
  auto x = test::randn(T * H, 701), wgu = test::randn(E * 2 * F * H, 702, 0.4f),
       wd = test::randn(E * H * F, 703, 0.4f), dy = test::randn(T * H, 704);
  const double d_aux = 0.1;
  const Tensor lt = f32(logits, {T, E}), xt = f32(x, {T, H}), wgut = f32(wgu, {E, 2 * F, H}),
               wdt = f32(wd, {E, H, F}), dyt = f32(dy, {T, H});
  ChainOut base = run_chain(false, ExpertsImpl::sequential, cfg, lt, xt, wgut, wdt, dyt, d_aux);
  for (int32_t e : base.idx) EXPECT_NE(e, 4);
  for (bool mem_eff : {false, true})
    for (ExpertsImpl impl : {ExpertsImpl::sequential, ExpertsImpl::grouped}) {
      if (!mem_eff && impl == ExpertsImpl::sequential) continue;
      SCOPED_TRACE(std::string(mem_eff ? "memory_efficient " : "standard ") + impl_name(impl));
      ChainOut o = run_chain(mem_eff, impl, cfg, lt, xt, wgut, wdt, dyt, d_aux);
      EXPECT_EQ(o.idx, base.idx);
      EXPECT_LT(test::rel_error(o.y, base.y), 1e-5);
      EXPECT_LT(test::rel_error(o.d_x, base.d_x), 1e-5);
      EXPECT_LT(test::rel_error(o.d_logits, base.d_logits), 1e-5);
      EXPECT_LT(test::rel_error(o.d_wgu, base.d_wgu), 1e-5);
      EXPECT_LT(test::rel_error(o.d_wd, base.d_wd), 1e-5);
    }
  // Finite differences of the double chain (selection fixed) for every input.
  const auto ld = test::cast<double>(logits), xd = test::cast<double>(x),
             wgud = test::cast<double>(wgu), wdd = test::cast<double>(wd),
             dyd = test::cast<double>(dy);
  auto L = [&](const std::vector<double>& l, const std::vector<double>& xx,
               const std::vector<double>& a, const std::vector<double>& b) {
    return chain_loss(cfg, base.idx, T, H, F, l, xx, a, b, dyd, d_aux);
  };
  auto fd_l = test::finite_diff([&](const auto& v) { return L(v, xd, wgud, wdd); }, ld);
  auto fd_x = test::finite_diff([&](const auto& v) { return L(ld, v, wgud, wdd); }, xd);
  auto fd_wgu = test::finite_diff([&](const auto& v) { return L(ld, xd, v, wdd); }, wgud);
  auto fd_wd = test::finite_diff([&](const auto& v) { return L(ld, xd, wgud, v); }, wdd);
  EXPECT_LT(test::rel_error(base.d_logits, fd_l), test::kGradTol);
  EXPECT_LT(test::rel_error(base.d_x, fd_x), test::kGradTol);
  EXPECT_LT(test::rel_error(base.d_wgu, fd_wgu), test::kGradTol);
  EXPECT_LT(test::rel_error(base.d_wd, fd_wd), test::kGradTol);
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeChain,
                         ::testing::Values(ChainCase{RouterScore::softmax},
                                           ChainCase{RouterScore::sigmoid}),
                         [](const ::testing::TestParamInfo<ChainCase>& i) {
                           return std::string(i.param.score == RouterScore::softmax ? "softmax"
                                                                                    : "sigmoid");
                         });

}  // namespace
}  // namespace bb
