// Context parallelism of the gated delta rule by state summaries on CUDA (skills/gdn-cp-states.md):
// the rule with start states and end-state gradients, the summaries (transition, end state from
// zero) and the start-state gradient against the CPU reference on the same (dtype-rounded)
// inputs. Packed sequences of 0, 1, 63, 130 and 300 tokens; f32 and bf16; K = V = 128 (Qwen3.5)
// and K = 64 / V = 32 (padded in the kernels); the default workspace limit and one of a byte
// (every sequence in 64-token segments carrying its state, the start state entering the first
// and the end-state gradient the last).
#include <gtest/gtest.h>

#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/gdn/gated_delta_rule.h"

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

}  // namespace
}  // namespace bb
