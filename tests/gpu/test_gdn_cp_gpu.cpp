// Context parallelism of the gated delta rule by state summaries on CUDA (skills/gdn-cp-states.md):
// the rule with start states and end-state gradients, the summaries (transition, end state from
// zero) and the start-state gradient against the CPU reference on the same (dtype-rounded)
// inputs, and the pieces of one sequence against the whole, both against double precision.
// Packed sequences of 0, 1, 63, 130 and 300 tokens; f32 and bf16; K = V = 128 (Qwen3.5)
// and K = 64 / V = 32 (padded in the kernels); the default workspace limit and one of a byte
// (every sequence in 64-token segments carrying its state, the start state entering the first
// and the end-state gradient the last).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/gdn/gated_delta_rule.h"
#include "primitives/gdn/gated_delta_rule_ref.h"

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

struct Case {
  int64_t Hk, Hv, K, V;
  DType dt;
  size_t limit;
};

TEST(GdnCpStatesGpu, StatesSummariesAndStartGradMatchCpu) {
  BB_REQUIRE_GPU();
  const std::vector<int32_t> cu = {0, 0, 1, 64, 194, 494};
  const int64_t T = cu.back(), n = static_cast<int64_t>(cu.size()) - 1;
  const Tensor cut = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  const std::vector<Case> cases = {{2, 4, 128, 128, DType::f32, size_t{4} << 30},
                                   {2, 4, 128, 128, DType::bf16, size_t{4} << 30},
                                   {1, 2, 64, 32, DType::f32, 1},
                                   {2, 4, 128, 128, DType::bf16, 1}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "Hk " << c.Hk << " Hv " << c.Hv << " K " << c.K << " V " << c.V << " "
                                    << dtype_name(c.dt) << " limit " << c.limit);
    // Inputs rounded to the dtype once; the CPU reference runs on the rounded values in f32.
    auto input = [&](size_t count, uint64_t seed, const Shape& sh, DType dt) {
      const Tensor host = Tensor::from_floats(test::randn(count, seed), sh, dt);
      return std::pair{host.to(kGpu), Tensor::from_floats(host.to_floats(), sh)};
    };
    const auto [q, qc] = input(static_cast<size_t>(T * c.Hk * c.K), 1, {T, c.Hk, c.K}, c.dt);
    const auto [k, kc] = input(static_cast<size_t>(T * c.Hk * c.K), 2, {T, c.Hk, c.K}, c.dt);
    const auto [v, vc] = input(static_cast<size_t>(T * c.Hv * c.V), 3, {T, c.Hv, c.V}, c.dt);
    const auto [d_o, doc] = input(static_cast<size_t>(T * c.Hv * c.V), 4, {T, c.Hv, c.V}, DType::f32);
    const Tensor gc = Tensor::from_floats(test::randu(static_cast<size_t>(T * c.Hv), 5, -0.3f, -0.01f), {T, c.Hv});
    const Tensor bc = Tensor::from_floats(test::randu(static_cast<size_t>(T * c.Hv), 6, 0.1f, 0.9f), {T, c.Hv});
    const Tensor g = gc.to(kGpu), b = bc.to(kGpu);
    const Shape st = {n, c.Hv, c.K, c.V};
    const Tensor s0c = Tensor::from_floats(test::randn(static_cast<size_t>(n * c.Hv * c.K * c.V), 7, 0.3f), st);
    const Tensor dsc = Tensor::from_floats(test::randn(static_cast<size_t>(n * c.Hv * c.K * c.V), 8, 0.3f), st);
    const Tensor s0 = s0c.to(kGpu), ds = dsc.to(kGpu);
    GatedDeltaOptions opts;
    opts.max_workspace_bytes = c.limit;
    const double tol = c.dt == DType::f32 ? test::kTolF32 : test::kTolBf16;

    const Tensor o = gated_delta_rule_forward(q, k, v, g, b, cut, opts, MemCategory::activations, nullptr, &s0);
    const Tensor oc = gated_delta_rule_forward(qc, kc, vc, gc, bc, cut, opts, MemCategory::activations, nullptr, &s0c);
    EXPECT_LT(test::rel_error(o.to_floats(), oc.to_floats()), tol) << "o";

    const GatedDeltaGrads gr = gated_delta_rule_backward(d_o, q, k, v, g, b, cut, opts, nullptr, &s0, &ds);
    const GatedDeltaGrads grc = gated_delta_rule_backward(doc, qc, kc, vc, gc, bc, cut, opts, nullptr, &s0c, &dsc);
    EXPECT_LT(test::rel_error(gr.d_q.to_floats(), grc.d_q.to_floats()), tol) << "d_q";
    EXPECT_LT(test::rel_error(gr.d_k.to_floats(), grc.d_k.to_floats()), tol) << "d_k";
    EXPECT_LT(test::rel_error(gr.d_v.to_floats(), grc.d_v.to_floats()), tol) << "d_v";
    EXPECT_LT(test::rel_error(gr.d_g.to_floats(), grc.d_g.to_floats()), tol) << "d_g";
    EXPECT_LT(test::rel_error(gr.d_beta.to_floats(), grc.d_beta.to_floats()), tol) << "d_beta";

    const GatedDeltaSummary sum = gated_delta_rule_summary(q, k, v, g, b, cut, opts);
    const GatedDeltaSummary sumc = gated_delta_rule_summary(qc, kc, vc, gc, bc, cut, opts);
    EXPECT_LT(test::rel_error(sum.transition.to_floats(), sumc.transition.to_floats()), tol) << "transition";
    EXPECT_LT(test::rel_error(sum.end_state.to_floats(), sumc.end_state.to_floats()), tol) << "end state";

    const Tensor D = gated_delta_rule_start_grad(d_o, q, k, v, g, b, cut, opts);
    const Tensor Dc = gated_delta_rule_start_grad(doc, qc, kc, vc, gc, bc, cut, opts);
    EXPECT_LT(test::rel_error(D.to_floats(), Dc.to_floats()), tol) << "start grad";
  }
}

// Is the states scheme as accurate as one rank? One bf16 sequence of 4,096 tokens (Qwen3.5-like
// inputs: L2-normalised q and k, decays in [-0.5, -0.005]) cut into 4 pieces at odd boundaries,
// as context parallelism cuts it: the pieces' summaries, the fold of the start states and of the
// end-state gradients (in f32, as the family does), then the rule with those states. Both that
// and the rule on the whole sequence are compared with the double-precision recurrent reference
// on the same rounded inputs; the states scheme may not be more than 1.5x further from it (plus
// 1e-3) in any output or gradient, nor in the per-head sums of d_g over the tokens (the
// reduction that gives the decay parameters' gradients, where cancellation magnifies rounding).
TEST(GdnCpStatesGpu, PiecesAreAsAccurateAsOneSequence) {
  BB_REQUIRE_GPU();
  const int64_t T = 4096, Hk = 2, Hv = 4, K = 128, V = 128;
  const std::vector<int32_t> whole = {0, static_cast<int32_t>(T)}, cuts = {0, 1000, 2050, 3100, static_cast<int32_t>(T)};
  const int64_t n = static_cast<int64_t>(cuts.size()) - 1;
  auto bf16_input = [&](size_t count, uint64_t seed, const Shape& sh) {
    const Tensor host = Tensor::from_floats(test::randn(count, seed), sh, DType::bf16);
    return std::pair{host.to(kGpu), host.to_floats()};
  };
  const auto [q, qh] = bf16_input(static_cast<size_t>(T * Hk * K), 11, {T, Hk, K});
  const auto [k, kh] = bf16_input(static_cast<size_t>(T * Hk * K), 12, {T, Hk, K});
  const auto [v, vh] = bf16_input(static_cast<size_t>(T * Hv * V), 13, {T, Hv, V});
  const std::vector<float> doh = test::randn(static_cast<size_t>(T * Hv * V), 14);
  const std::vector<float> gh = test::randu(static_cast<size_t>(T * Hv), 15, -0.5f, -0.005f);
  const std::vector<float> bh = test::randu(static_cast<size_t>(T * Hv), 16, 0.05f, 0.95f);
  const Tensor d_o = Tensor::from_floats(doh, {T, Hv, V}).to(kGpu);
  const Tensor g = Tensor::from_floats(gh, {T, Hv}).to(kGpu), b = Tensor::from_floats(bh, {T, Hv}).to(kGpu);
  const GatedDeltaOptions opts;

  // The double reference on the whole sequence.
  ref::GdnShape sh;
  sh.T = T, sh.Hk = Hk, sh.Hv = Hv, sh.K = K, sh.V = V, sh.scale = 1.0 / std::sqrt(static_cast<double>(K));
  const auto dbl = [](const std::vector<float>& x) { return test::cast<double>(x); };
  const std::vector<double> qd = dbl(qh), kd = dbl(kh), vd = dbl(vh), gd = dbl(gh), bd = dbl(bh), dod = dbl(doh);
  std::vector<double> o_ref(static_cast<size_t>(T * Hv * V)), dq_ref(qd.size()), dk_ref(kd.size()), dv_ref(vd.size()),
      dg_ref(gd.size()), db_ref(bd.size());
  ref::gated_delta_forward<double>(o_ref.data(), qd.data(), kd.data(), vd.data(), gd.data(), bd.data(), whole.data(), 1, sh);
  ref::gated_delta_backward<double>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dg_ref.data(), db_ref.data(), dod.data(),
                                    qd.data(), kd.data(), vd.data(), gd.data(), bd.data(), whole.data(), 1, sh);

  // One sequence on CUDA.
  const Tensor cw = Tensor::from_ints(whole, {2});
  const Tensor o1 = gated_delta_rule_forward(q, k, v, g, b, cw, opts);
  const GatedDeltaGrads g1 = gated_delta_rule_backward(d_o, q, k, v, g, b, cw, opts);

  // Four pieces: summaries, the fold (S_{i+1} = P_i S_i + E_i; dS_end_i = P_{i+1}^T dS_end_{i+1} + D_{i+1}).
  const Tensor cc = Tensor::from_ints(cuts, {n + 1});
  const GatedDeltaSummary sum = gated_delta_rule_summary(q, k, v, g, b, cc, opts);
  const std::vector<float> P = sum.transition.to_floats(), E = sum.end_state.to_floats();
  const std::vector<float> D = gated_delta_rule_start_grad(d_o, q, k, v, g, b, cc, opts).to_floats();
  const size_t KK = static_cast<size_t>(K * K), KV = static_cast<size_t>(K * V);
  std::vector<float> S(static_cast<size_t>(n) * Hv * KV, 0.0f), dS(S.size(), 0.0f);
  auto affine = [&](float* y, const float* M, bool transpose, const float* x, const float* add) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) {
        float acc = add[i * V + j];
        for (int64_t l = 0; l < K; ++l) acc += (transpose ? M[l * K + i] : M[i * K + l]) * x[l * V + j];
        y[i * V + j] = acc;
      }
  };
  for (int64_t i = 0; i + 1 < n; ++i)
    for (int64_t h = 0; h < Hv; ++h)
      affine(&S[((i + 1) * Hv + h) * KV], &P[(i * Hv + h) * KK], false, &S[(i * Hv + h) * KV], &E[(i * Hv + h) * KV]);
  for (int64_t i = n - 2; i >= 0; --i)
    for (int64_t h = 0; h < Hv; ++h)
      affine(&dS[(i * Hv + h) * KV], &P[((i + 1) * Hv + h) * KK], true, &dS[((i + 1) * Hv + h) * KV],
             &D[((i + 1) * Hv + h) * KV]);
  const Shape st = {n, Hv, K, V};
  const Tensor s0 = Tensor::from_floats(S, st).to(kGpu), ds = Tensor::from_floats(dS, st).to(kGpu);
  const Tensor o4 = gated_delta_rule_forward(q, k, v, g, b, cc, opts, MemCategory::activations, nullptr, &s0);
  const GatedDeltaGrads g4 = gated_delta_rule_backward(d_o, q, k, v, g, b, cc, opts, nullptr, &s0, &ds);

  auto head_sums = [&](const std::vector<float>& dg) {
    std::vector<double> r(static_cast<size_t>(Hv), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hv; ++h) r[static_cast<size_t>(h)] += dg[static_cast<size_t>(t * Hv + h)];
    return r;
  };
  std::vector<double> r_ref(static_cast<size_t>(Hv), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hv; ++h) r_ref[static_cast<size_t>(h)] += dg_ref[static_cast<size_t>(t * Hv + h)];
  struct Row {
    const char* name;
    std::vector<float> one, four;
    const std::vector<double>* ref;
  };
  const std::vector<Row> rows = {{"o", o1.to_floats(), o4.to_floats(), &o_ref},
                                 {"d_q", g1.d_q.to_floats(), g4.d_q.to_floats(), &dq_ref},
                                 {"d_k", g1.d_k.to_floats(), g4.d_k.to_floats(), &dk_ref},
                                 {"d_v", g1.d_v.to_floats(), g4.d_v.to_floats(), &dv_ref},
                                 {"d_g", g1.d_g.to_floats(), g4.d_g.to_floats(), &dg_ref},
                                 {"d_beta", g1.d_beta.to_floats(), g4.d_beta.to_floats(), &db_ref}};
  for (const Row& r : rows) {
    const double e1 = test::rel_error(r.one, *r.ref), e4 = test::rel_error(r.four, *r.ref);
    std::printf("%-7s error vs double: one sequence %.3e, 4 pieces %.3e, between them %.3e\n", r.name, e1, e4,
                test::rel_error(r.four, r.one));
    EXPECT_LT(e1, test::kTolBf16) << r.name;
    EXPECT_LE(e4, 1.5 * e1 + 1e-3) << r.name;
  }
  const std::vector<double> s1 = head_sums(g1.d_g.to_floats()), s4 = head_sums(g4.d_g.to_floats());
  for (int64_t h = 0; h < Hv; ++h) {
    const size_t i = static_cast<size_t>(h);
    const double e1 = std::fabs(s1[i] - r_ref[i]) / std::fabs(r_ref[i]), e4 = std::fabs(s4[i] - r_ref[i]) / std::fabs(r_ref[i]);
    std::printf("sum_t d_g head %lld: reference %.6e, error one sequence %.3e, 4 pieces %.3e\n",
                static_cast<long long>(h), r_ref[i], e1, e4);
    EXPECT_LE(e4, 1.5 * e1 + 1e-3) << "head " << h;
  }
}

}  // namespace
}  // namespace bb
