// MoE token permutation: map layout (grouped by expert, stable), exact round trips, gradients
// of permute / unpermute / prob scatter against double finite differences, bf16 storage,
// zero-token experts, bad input.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "primitives/moe/permute.h"
#include "primitives/moe/permute_ref.h"

namespace bb {
namespace {

Tensor f32(const std::vector<float>& v, const Shape& s) {
  return Tensor::from_floats(v, s);
}

// A routing of T tokens to K distinct experts among E, deterministic from the seed.
std::vector<int32_t> random_routing(int64_t T, int64_t K, int64_t E, uint64_t seed) {
  std::vector<int32_t> idx;
  auto u = test::randu(T * E, seed, 0.f, 1.f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> taken(E, 0);
    for (int64_t k = 0; k < K; ++k) {
      int64_t e = static_cast<int64_t>(u[t * E + k] * E) % E;
      while (taken[e]) e = (e + 1) % E;
      taken[e] = 1;
      idx.push_back(static_cast<int32_t>(e));
    }
  }
  return idx;
}

TEST(Permute, MapGroupsRowsByExpertInStableOrder) {
  const int64_t T = 11, K = 3, E = 6;
  auto idx = random_routing(T, K, E, 1);
  PermuteMap m = make_permute_map(Tensor::from_ints(idx, {T, K}), E);
  EXPECT_EQ(m.num_rows(), T * K);
  EXPECT_EQ(m.row_token.category(), MemCategory::moe);
  auto row_token = m.row_token.to_ints();
  auto slot_row = m.slot_row.to_ints();
  // Inverse: the copy (t, k) sits at row slot_row[t, k], whose token is t.
  std::vector<int> seen(T * K, 0);
  std::vector<int64_t> row_expert(T * K), row_slot(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = slot_row[t * K + k];
      ASSERT_GE(r, 0);
      ASSERT_LT(r, T * K);
      ++seen[r];
      EXPECT_EQ(row_token[r], t);
      row_expert[r] = idx[t * K + k];
      row_slot[r] = t * K + k;
    }
  for (int s : seen) EXPECT_EQ(s, 1);  // a permutation
  // Grouped by expert (non-decreasing), stable inside an expert (token-major, then k).
  for (int64_t r = 1; r < T * K; ++r) {
    EXPECT_LE(row_expert[r - 1], row_expert[r]);
    if (row_expert[r - 1] == row_expert[r]) EXPECT_LT(row_slot[r - 1], row_slot[r]);
  }
  std::vector<int64_t> counts(E, 0);
  for (int32_t e : idx) ++counts[e];
  EXPECT_EQ(m.tokens_per_expert, counts);
}

TEST(Permute, KnownSmallMap) {
  // Token 0 -> experts (2, 0), token 1 -> (0, 3), token 2 -> (2, 0); expert 1 gets no token.
  PermuteMap m = make_permute_map(Tensor::from_ints({2, 0, 0, 3, 2, 0}, {3, 2}), 4);
  EXPECT_EQ(m.tokens_per_expert, (std::vector<int64_t>{3, 0, 2, 1}));
  EXPECT_EQ(m.row_token.to_ints(), (std::vector<int32_t>{0, 1, 2, 0, 2, 1}));
  EXPECT_EQ(m.slot_row.to_ints(), (std::vector<int32_t>{3, 0, 1, 5, 4, 2}));
  Tensor x = f32({10, 11, 20, 21, 30, 31}, {3, 2});
  EXPECT_EQ(permute_forward(x, m).to_floats(),
            (std::vector<float>{10, 11, 20, 21, 30, 31, 10, 11, 30, 31, 20, 21}));
}

TEST(Permute, UnpermuteOfPermuteWithWeightsOneOverKIsExact) {
  const int64_t T = 9, H = 13, E = 8;
  for (int64_t K : {1, 2, 4, 8}) {
    auto idx = random_routing(T, K, E, 10 + K);
    PermuteMap m = make_permute_map(Tensor::from_ints(idx, {T, K}), E);
    // bf16-representable payloads (8 significant bits): every partial sum j * x / K is exact in
    // fp32, so any misrouted or dropped copy shows up as an inequality.
    auto xv = Tensor::from_floats(test::randn(T * H, 2), {T * H}, DType::bf16).to_floats();
    Tensor x = f32(xv, {T, H});
    Tensor w = Tensor::empty({T, K}, DType::f32, Device::cpu(), MemCategory::other);
    w.fill_(1.0 / K);
    Tensor y = unpermute_forward(permute_forward(x, m), m, w);
    EXPECT_EQ(y.to_floats(), xv) << "K = " << K;
    // Unit weights (the memory_efficient combine) give K * x.
    auto yk = unpermute_forward(permute_forward(x, m), m, Tensor()).to_floats();
    for (int64_t i = 0; i < T * H; ++i) EXPECT_EQ(yk[i], K * xv[i]);
  }
  // K = 3: 1/3 is not exact in binary; the round trip is exact to fp32 rounding.
  auto idx = random_routing(T, 3, E, 5);
  PermuteMap m = make_permute_map(Tensor::from_ints(idx, {T, 3}), E);
  auto xv = test::randn(T * H, 3);
  Tensor w = Tensor::empty({T, 3}, DType::f32, Device::cpu(), MemCategory::other);
  w.fill_(1.0 / 3);
  auto y = unpermute_forward(permute_forward(f32(xv, {T, H}), m), m, w).to_floats();
  EXPECT_LT(test::rel_error(y, xv), 1e-6);
}

TEST(Permute, PermuteBackwardMatchesFiniteDifferences) {
  const int64_t T = 5, K = 2, E = 4, H = 3;
  PermuteMap m = make_permute_map(Tensor::from_ints(random_routing(T, K, E, 7), {T, K}), E);
  auto row_token = m.row_token.to_ints();
  auto x = test::randn(T * H, 8);
  auto w = test::randn(T * K * H, 9);
  auto wd = test::cast<double>(w);
  auto fd = test::finite_diff(
      [&](const std::vector<double>& xd) {
        std::vector<double> xp(T * K * H);
        ref::permute_forward(xp.data(), xd.data(), row_token.data(), T * K, H);
        return test::weighted_sum(xp, wd);
      },
      test::cast<double>(x));
  Tensor d_x = permute_backward(f32(w, {T * K, H}), m);
  EXPECT_EQ(d_x.shape(), (Shape{T, H}));
  EXPECT_LT(test::rel_error(d_x.to_floats(), fd), test::kGradTol);
}

TEST(Permute, UnpermuteBackwardMatchesFiniteDifferences) {
  const int64_t T = 6, K = 3, E = 5, H = 4, N = T * K;
  PermuteMap m = make_permute_map(Tensor::from_ints(random_routing(T, K, E, 11), {T, K}), E);
  auto slot_row = m.slot_row.to_ints();
  auto yp = test::randn(N * H, 12);
  auto prob = test::randu(T * K, 13, 0.1f, 1.0f);
  auto w = test::randn(T * H, 14);
  auto wd = test::cast<double>(w);
  for (bool with_prob : {true, false}) {
    auto fwd = [&](const std::vector<double>& ypd, const std::vector<double>& pd) {
      std::vector<double> y(T * H);
      ref::unpermute_forward(y.data(), ypd.data(), slot_row.data(), with_prob ? pd.data() : nullptr,
                             T, K, H);
      return test::weighted_sum(y, wd);
    };
    const auto pd = test::cast<double>(prob);
    const auto ypd = test::cast<double>(yp);
    auto fd_y = test::finite_diff([&](const std::vector<double>& v) { return fwd(v, pd); }, ypd);
    Tensor p = with_prob ? f32(prob, {T, K}) : Tensor();
    UnpermuteGrads g = unpermute_backward(f32(w, {T, H}), f32(yp, {N, H}), m, p);
    EXPECT_EQ(g.d_y_perm.category(), MemCategory::moe);
    EXPECT_LT(test::rel_error(g.d_y_perm.to_floats(), fd_y), test::kGradTol);
    if (with_prob) {
      auto fd_p = test::finite_diff([&](const std::vector<double>& v) { return fwd(ypd, v); }, pd);
      ASSERT_TRUE(g.d_topk_prob.defined());
      EXPECT_LT(test::rel_error(g.d_topk_prob.to_floats(), fd_p), test::kGradTol);
    } else {
      EXPECT_FALSE(g.d_topk_prob.defined());
      // Without probabilities y_perm is not needed for the backward.
      UnpermuteGrads g2 = unpermute_backward(f32(w, {T, H}), Tensor(), m, Tensor());
      EXPECT_EQ(g2.d_y_perm.to_floats(), g.d_y_perm.to_floats());
    }
  }
}

TEST(Permute, ProbScatterAndItsGradient) {
  const int64_t T = 7, K = 2, E = 3, N = T * K;
  PermuteMap m = make_permute_map(Tensor::from_ints(random_routing(T, K, E, 21), {T, K}), E);
  auto prob = test::randu(T * K, 22, 0.1f, 1.0f);
  Tensor rp = permute_probs(f32(prob, {T, K}), m);
  EXPECT_EQ(rp.shape(), (Shape{N}));
  // Row n holds the probability of the copy it came from.
  auto slot_row = m.slot_row.to_ints();
  auto rv = rp.to_floats();
  for (int64_t i = 0; i < T * K; ++i) EXPECT_EQ(rv[slot_row[i]], prob[i]);
  EXPECT_EQ(unpermute_probs_grad(rp, m).to_floats(), prob);  // exact inverse
  auto w = test::randn(N, 23);
  auto wd = test::cast<double>(w);
  auto fd = test::finite_diff(
      [&](const std::vector<double>& p) {
        std::vector<double> r(N);
        ref::permute_probs(r.data(), p.data(), slot_row.data(), T, K);
        return test::weighted_sum(r, wd);
      },
      test::cast<double>(prob));
  Tensor d = unpermute_probs_grad(f32(w, {N}), m);
  EXPECT_EQ(d.shape(), (Shape{T, K}));
  EXPECT_LT(test::rel_error(d.to_floats(), fd), test::kGradTol);
}

TEST(Permute, Bf16StorageIsCopiedExactlyAndCombinedInF32) {
  const int64_t T = 8, K = 2, E = 4, H = 5, N = T * K;
  PermuteMap m = make_permute_map(Tensor::from_ints(random_routing(T, K, E, 31), {T, K}), E);
  Tensor x = Tensor::from_floats(test::randn(T * H, 32), {T, H}, DType::bf16);
  Tensor xp = permute_forward(x, m);
  EXPECT_EQ(xp.dtype(), DType::bf16);
  auto xv = x.to_floats(), xpv = xp.to_floats();
  auto row_token = m.row_token.to_ints();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < H; ++j) EXPECT_EQ(xpv[n * H + j], xv[row_token[n] * H + j]);
  // Combine: one rounding at the end (fp32 accumulation), not one per term.
  Tensor yp = Tensor::from_floats(test::randn(N * H, 33), {N, H}, DType::bf16);
  auto prob = test::randu(T * K, 34, 0.1f, 1.0f);
  Tensor y = unpermute_forward(yp, m, f32(prob, {T, K}));
  EXPECT_EQ(y.dtype(), DType::bf16);
  std::vector<float> expect(T * H);
  auto ypv = yp.to_floats();
  auto slot_row = m.slot_row.to_ints();
  ref::unpermute_forward(expect.data(), ypv.data(), slot_row.data(), prob.data(), T, K, H);
  auto yv = y.to_floats();
  for (int64_t i = 0; i < T * H; ++i) EXPECT_EQ(yv[i], round_bf16(expect[i]));
  Tensor dx = permute_backward(yp, m);
  EXPECT_EQ(dx.dtype(), DType::bf16);
  EXPECT_EQ(dx.shape(), (Shape{T, H}));
  // The f32 form keeps the sum unrounded: the same sum over the bf16 rows, rounded only in dx.
  Tensor dx32 = permute_backward(yp, m, /*out_f32=*/true);
  EXPECT_EQ(dx32.dtype(), DType::f32);
  EXPECT_EQ(dx32.category(), MemCategory::activations);
  std::vector<float> sum(T * H);
  ref::permute_backward(sum.data(), ypv.data(), slot_row.data(), T, K, H);
  EXPECT_EQ(dx32.to_floats(), sum);
  auto dxv = dx.to_floats();
  for (int64_t i = 0; i < T * H; ++i) EXPECT_EQ(dxv[i], round_bf16(sum[i]));
}

TEST(Permute, ZeroTokenExperts) {
  // Experts 0 and 3 receive nothing; their row ranges are empty.
  PermuteMap m = make_permute_map(Tensor::from_ints({1, 2, 4, 1, 2, 4}, {3, 2}), 5);
  EXPECT_EQ(m.tokens_per_expert, (std::vector<int64_t>{0, 2, 2, 0, 2}));
  auto xv = test::randn(3 * 4, 41);
  Tensor w = Tensor::empty({3, 2}, DType::f32, Device::cpu(), MemCategory::other);
  w.fill_(0.5);
  auto y = unpermute_forward(permute_forward(f32(xv, {3, 4}), m), m, w).to_floats();
  EXPECT_EQ(y, xv);
}

TEST(Permute, BadInputs) {
  Tensor idx = Tensor::from_ints({0, 1, 2, 3}, {2, 2});
  test::expect_error_contains(
      [] {
        make_permute_map(Tensor::from_floats({0, 1}, {1, 2}), 4);
      },
      "make_permute_map: argument 'topk_idx' has dtype f32, expected i32");
  test::expect_error_contains([&] { make_permute_map(idx, 3); },
                              "make_permute_map: topk_idx[1, 1] = 3 is out of range [0, 3)");
  test::expect_error_contains(
      [] {
        make_permute_map(Tensor::from_ints({0, -1}, {1, 2}), 3);
      },
      "topk_idx[0, 1] = -1 is out of range");
  test::expect_error_contains(
      [] {
        make_permute_map(Tensor::from_ints({}, {0, 2}), 3);
      },
      "make_permute_map: empty batch");
  PermuteMap m = make_permute_map(idx, 4);
  test::expect_error_contains(
      [&] {
        permute_forward(f32({1, 2, 3}, {3, 1}), m);
      },
      "permute_forward: argument 'x' has shape [3, 1], expected [2, -1]");
  test::expect_error_contains(
      [&] {
        unpermute_forward(f32({1, 2, 3, 4}, {4, 1}), m, f32({1, 2}, {2, 1}));
      },
      "unpermute_forward: argument 'topk_prob' has shape [2, 1], expected [2, 2]");
  test::expect_error_contains(
      [&] {
        unpermute_forward(f32({1, 2, 3, 4}, {4, 1}), m,
                          Tensor::from_floats({1, 2, 3, 4}, {2, 2}, DType::bf16));
      },
      "unpermute_forward: argument 'topk_prob' has dtype bf16, expected f32");
  test::expect_error_contains(
      [&] {
        unpermute_backward(f32({1, 2}, {2, 1}), Tensor(), m, f32({1, 2, 3, 4}, {2, 2}));
      },
      "unpermute_backward: argument 'y_perm' is undefined");
  test::expect_error_contains(
      [&] {
        unpermute_probs_grad(f32({1, 2, 3}, {3}), m);
      },
      "unpermute_probs_grad: argument 'd_row_prob' has shape [3], expected [4]");
  test::expect_error_contains(
      [&] {
        permute_forward(f32({1, 2}, {2, 1}), PermuteMap{});
      },
      "invalid PermuteMap");
}

}  // namespace
}  // namespace bb
