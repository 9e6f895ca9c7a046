// MoE token permutation on CUDA against the CPU path: the map (identical rows, slots and counts,
// zero-token experts, repeated experts, out-of-range ids), permute / permute_backward,
// unpermute forward and backward with and without topk_prob (f32 1e-4, bf16 1e-2), the prob
// scatter / gather (exact), exact round trips, determinism, and awkward sizes (T = 333, K = 8,
// E = 128, H = 229; a single token).
#include <gtest/gtest.h>

#include <cmath>

#include "common/gpu.h"
#include "common/testing.h"
#include "primitives/moe/permute.h"

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

// T tokens to K distinct experts drawn from the first `used` of E (the rest get no tokens).
std::vector<int32_t> routing(int64_t T, int64_t K, int64_t E, int64_t used, uint64_t seed) {
  std::vector<int32_t> idx;
  auto u = test::randu(T * K, seed, 0.f, 1.f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> taken(E, 0);
    for (int64_t k = 0; k < K; ++k) {
      int64_t e = static_cast<int64_t>(u[t * K + k] * used) % used;
      while (taken[e]) e = (e + 1) % used;
      taken[e] = 1;
      idx.push_back(static_cast<int32_t>(e));
    }
  }
  return idx;
}

// Values with 8 significant bits (bf16-representable), so sums of up to 8 copies scaled by
// powers of two are exact in f32.
std::vector<float> short_values(size_t n, uint64_t seed) {
  auto v = test::randn(n, seed);
  for (float& x : v) x = round_bf16(x);
  return v;
}

struct Case {
  const char* name;
  int64_t T, K, E, used, H;
  DType dt;
};

class PermuteGpu : public ::testing::TestWithParam<Case> {};

double tol(DType dt) { return dt == DType::f32 ? test::kTolF32 : test::kTolBf16; }

TEST_P(PermuteGpu, MapMatchesCpuExactly) {
  BB_REQUIRE_GPU();
  const Case c = GetParam();
  Tensor idx = Tensor::from_ints(routing(c.T, c.K, c.E, c.used, 1), {c.T, c.K});
  const PermuteMap mc = make_permute_map(idx, c.E);
  const PermuteMap mg = make_permute_map(idx.to(kGpu), c.E);
  EXPECT_EQ(mg.row_token.device(), kGpu);
  EXPECT_EQ(mg.slot_row.category(), MemCategory::moe);
  EXPECT_EQ(mg.num_tokens, c.T);
  EXPECT_EQ(mg.top_k, c.K);
  EXPECT_EQ(mg.tokens_per_expert, mc.tokens_per_expert);
  EXPECT_EQ(mg.row_token.to_ints(), mc.row_token.to_ints());
  EXPECT_EQ(mg.slot_row.to_ints(), mc.slot_row.to_ints());
  if (c.used < c.E) EXPECT_EQ(mg.tokens_per_expert[c.E - 1], 0);
}

TEST_P(PermuteGpu, ForwardAndBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  const Case c = GetParam();
  const int64_t N = c.T * c.K;
  Tensor idx = Tensor::from_ints(routing(c.T, c.K, c.E, c.used, 2), {c.T, c.K});
  const PermuteMap mc = make_permute_map(idx, c.E);
  const PermuteMap mg = make_permute_map(idx.to(kGpu), c.E);
  Tensor x = Tensor::from_floats(test::randn(c.T * c.H, 3), {c.T, c.H}, c.dt);
  Tensor yp = Tensor::from_floats(test::randn(N * c.H, 4), {N, c.H}, c.dt);
  Tensor dy = Tensor::from_floats(test::randn(c.T * c.H, 5), {c.T, c.H}, c.dt);
  Tensor prob = Tensor::from_floats(test::randu(N, 6, 0.1f, 1.0f), {c.T, c.K});
  Tensor xg = x.to(kGpu), ypg = yp.to(kGpu), dyg = dy.to(kGpu), probg = prob.to(kGpu);

  // permute: a bit copy, so exact in any dtype.
  Tensor xp = permute_forward(xg, mg);
  EXPECT_EQ(xp.dtype(), c.dt);
  EXPECT_EQ(xp.category(), MemCategory::moe);
  EXPECT_EQ(xp.to_floats(), permute_forward(x, mc).to_floats());
  Tensor dx = permute_backward(ypg, mg);
  EXPECT_EQ(dx.category(), MemCategory::activations);
  EXPECT_LT(test::rel_error(dx.to_floats(), permute_backward(yp, mc).to_floats()), tol(c.dt));
  // The unrounded f32 sum (what the MoE block continues with): against the CPU's f32 sum at f32
  // tolerance whatever the rows' dtype (the same rounded inputs, summed in the same k order).
  Tensor dx32 = permute_backward(ypg, mg, /*out_f32=*/true);
  EXPECT_EQ(dx32.dtype(), DType::f32);
  EXPECT_EQ(dx32.category(), MemCategory::activations);
  const Tensor dx32_cpu = permute_backward(yp, mc, /*out_f32=*/true);
  EXPECT_EQ(dx32_cpu.dtype(), DType::f32);
  EXPECT_LT(test::rel_error(dx32.to_floats(), dx32_cpu.to_floats()), test::kTolF32);
  EXPECT_EQ(dx.to_floats(), dx32.to_dtype(c.dt).to_floats()) << "the rows' dtype is the f32 sum rounded";

  for (bool with_prob : {true, false}) {
    SCOPED_TRACE(with_prob ? "standard (topk_prob)" : "memory_efficient (unit weights)");
    const Tensor pc = with_prob ? prob : Tensor(), pg = with_prob ? probg : Tensor();
    Tensor y = unpermute_forward(ypg, mg, pg, MemCategory::other);
    EXPECT_EQ(y.dtype(), c.dt);
    EXPECT_EQ(y.category(), MemCategory::other);
    EXPECT_LT(test::rel_error(y.to_floats(), unpermute_forward(yp, mc, pc).to_floats()), tol(c.dt));
    const UnpermuteGrads gc = unpermute_backward(dy, with_prob ? yp : Tensor(), mc, pc);
    const UnpermuteGrads gg = unpermute_backward(dyg, with_prob ? ypg : Tensor(), mg, pg);
    EXPECT_EQ(gg.d_y_perm.category(), MemCategory::moe);
    EXPECT_LT(test::rel_error(gg.d_y_perm.to_floats(), gc.d_y_perm.to_floats()), tol(c.dt));
    ASSERT_EQ(gg.d_topk_prob.defined(), with_prob);
    if (with_prob) {
      EXPECT_EQ(gg.d_topk_prob.category(), MemCategory::activations);
      // A dot over H products: rounding of 16-bit inputs is the same on both sides, so the
      // f32 tolerance holds even for bf16 storage.
      EXPECT_LT(test::rel_error(gg.d_topk_prob.to_floats(), gc.d_topk_prob.to_floats()),
                test::kTolF32);
    }
  }

  // Probability scatter / gather: pure moves, exact.
  Tensor rp = permute_probs(probg, mg);
  EXPECT_EQ(rp.to_floats(), permute_probs(prob, mc).to_floats());
  Tensor drp = Tensor::from_floats(test::randn(N, 7), {N});
  EXPECT_EQ(unpermute_probs_grad(drp.to(kGpu), mg).to_floats(),
            unpermute_probs_grad(drp, mc).to_floats());
}

TEST_P(PermuteGpu, RoundTripsAreExact) {
  BB_REQUIRE_GPU();
  const Case c = GetParam();
  if ((c.K & (c.K - 1)) != 0) GTEST_SKIP() << "exact 1/K weights need K a power of two";
  Tensor idx = Tensor::from_ints(routing(c.T, c.K, c.E, c.used, 8), {c.T, c.K});
  const PermuteMap m = make_permute_map(idx.to(kGpu), c.E);
  Tensor x = Tensor::from_floats(short_values(c.T * c.H, 9), {c.T, c.H}, c.dt).to(kGpu);
  const auto xv = x.to_floats();  // the stored values
  Tensor xp = permute_forward(x, m);
  // Every copy lands where the map says: x_perm[slot_row[t, k]] == x[t].
  const auto xpv = xp.to_floats();
  const auto slots = m.slot_row.to_ints();
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t k = 0; k < c.K; ++k)
      for (int64_t j = 0; j < c.H; ++j)
        ASSERT_EQ(xpv[slots[t * c.K + k] * c.H + j], xv[t * c.H + j]) << t << "," << k << "," << j;
  // Combining the K copies with weights 1/K gives x back bit for bit; unit weights give K * x.
  Tensor w = Tensor::from_floats(std::vector<float>(c.T * c.K, 1.0f / c.K), {c.T, c.K}).to(kGpu);
  EXPECT_EQ(unpermute_forward(xp, m, w).to_floats(), xv);
  auto kx = xv;
  for (float& v : kx) v *= static_cast<float>(c.K);
  EXPECT_EQ(unpermute_forward(xp, m, Tensor()).to_floats(), kx);
  EXPECT_EQ(permute_backward(xp, m).to_floats(), kx);
  // Probabilities: scatter then gather is the identity.
  Tensor p = Tensor::from_floats(test::randn(c.T * c.K, 10), {c.T, c.K});
  EXPECT_EQ(unpermute_probs_grad(permute_probs(p.to(kGpu), m), m).to_floats(), p.to_floats());
}

TEST_P(PermuteGpu, Deterministic) {
  BB_REQUIRE_GPU();
  const Case c = GetParam();
  const int64_t N = c.T * c.K;
  Tensor idx = Tensor::from_ints(routing(c.T, c.K, c.E, c.used, 11), {c.T, c.K}).to(kGpu);
  const PermuteMap m = make_permute_map(idx, c.E);
  Tensor yp = Tensor::from_floats(test::randn(N * c.H, 12), {N, c.H}, c.dt).to(kGpu);
  Tensor dy = Tensor::from_floats(test::randn(c.T * c.H, 13), {c.T, c.H}, c.dt).to(kGpu);
  Tensor p = Tensor::from_floats(test::randu(N, 14, 0.1f, 1.f), {c.T, c.K}).to(kGpu);
  const UnpermuteGrads a = unpermute_backward(dy, yp, m, p);
  const UnpermuteGrads b = unpermute_backward(dy, yp, m, p);
  EXPECT_EQ(a.d_topk_prob.to_floats(), b.d_topk_prob.to_floats());
  EXPECT_EQ(a.d_y_perm.to_floats(), b.d_y_perm.to_floats());
  EXPECT_EQ(unpermute_forward(yp, m, p).to_floats(), unpermute_forward(yp, m, p).to_floats());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PermuteGpu,
    ::testing::Values(Case{"T333_K8_E128_H229_f32", 333, 8, 128, 128, 229, DType::f32},
                      Case{"T333_K8_E128_H229_bf16", 333, 8, 128, 128, 229, DType::bf16},
                      Case{"T97_K8_E128_H2048_bf16_zero_token_experts", 97, 8, 128, 40, 2048,
                           DType::bf16},
                      Case{"T71_K2_E5_H256_f32_zero_token_experts", 71, 2, 5, 3, 256, DType::f32},
                      Case{"T50_K3_E7_H64_f16", 50, 3, 7, 7, 64, DType::f16},
                      Case{"T1_K1_E1_H1_f32", 1, 1, 1, 1, 1, DType::f32}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(PermuteGpuMap, RepeatedExpertsAndLargeT) {
  BB_REQUIRE_GPU();
  // A token may list an expert twice; T large enough for many histogram/sort blocks.
  const int64_t T = 20000, K = 4, E = 3;
  std::vector<int32_t> idx(T * K);
  auto u = test::randu(T * K, 15, 0.f, 1.f);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(u[i] * E) % E;
  Tensor t = Tensor::from_ints(idx, {T, K});
  const PermuteMap mc = make_permute_map(t, E);
  const PermuteMap mg = make_permute_map(t.to(kGpu), E);
  EXPECT_EQ(mg.tokens_per_expert, mc.tokens_per_expert);
  EXPECT_EQ(mg.row_token.to_ints(), mc.row_token.to_ints());
  EXPECT_EQ(mg.slot_row.to_ints(), mc.slot_row.to_ints());
  // With the router's counts given, the map is the same and no host synchronisation happens.
  const Tensor tg = t.to(kGpu);
#ifdef BB_WITH_CUDA
  const int64_t syncs0 = cuda::host_sync_count();
#endif
  const PermuteMap mk = make_permute_map(tg, E, &mc.tokens_per_expert);
#ifdef BB_WITH_CUDA
  EXPECT_EQ(cuda::host_sync_count(), syncs0);
#endif
  EXPECT_EQ(mk.tokens_per_expert, mc.tokens_per_expert);
  EXPECT_EQ(mk.row_token.to_ints(), mc.row_token.to_ints());
  EXPECT_EQ(mk.slot_row.to_ints(), mc.slot_row.to_ints());
  const std::vector<int64_t> short_counts(2, 0);
  test::expect_error_contains([&] { make_permute_map(tg, E, &short_counts); },
                              "make_permute_map: known_counts has 2 entries for 3 experts");
}

TEST(PermuteGpuMap, BadInputs) {
  BB_REQUIRE_GPU();
  Tensor bad = Tensor::from_ints({0, 1, 2, 3, 1, 0}, {3, 2}).to(kGpu);
  test::expect_error_contains([&] { make_permute_map(bad, 3); },
                              "make_permute_map: topk_idx[1, 1] = 3 is out of range [0, 3)");
  Tensor neg = Tensor::from_ints({0, 1, 2, 0, -1, 0}, {3, 2}).to(kGpu);
  test::expect_error_contains([&] { make_permute_map(neg, 3); }, "topk_idx[2, 0] = -1");
  const PermuteMap m = make_permute_map(Tensor::from_ints({0, 1, 2, 0}, {2, 2}).to(kGpu), 3);
  Tensor x_cpu = Tensor::from_floats({1, 2, 3, 4}, {2, 2});
  test::expect_error_contains([&] { permute_forward(x_cpu, m); },
                              "permute_forward: the PermuteMap is on cuda:0 but argument 'x' is on cpu");
  test::expect_error_contains([&] { permute_forward(x_cpu.narrow(0, 1).to(kGpu), m); },
                              "permute_forward: argument 'x' has shape [1, 2], expected [2, -1]");
}

}  // namespace
}  // namespace bb
