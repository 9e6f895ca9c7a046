// GEMM / linear: every transpose combination against a double loop; linear backward vs FD.
#include <gtest/gtest.h>

#include "backend/cpu/gemm.h"
#include "common/testing.h"
#include "primitives/linear/linear.h"

namespace bb {
namespace {

using test::randn;

class MatmulTranspose : public ::testing::TestWithParam<std::tuple<bool, bool, DType>> {};

TEST_P(MatmulTranspose, MatchesDoubleLoop) {
  const auto [ta, tb, dt] = GetParam();
  const int64_t M = 13, N = 7, K = 29;  // sizes that divide nothing
  auto av = randn(M * K, 1), bv = randn(K * N, 2), cv = randn(M * N, 3);
  Tensor a = Tensor::from_floats(av, ta ? Shape{K, M} : Shape{M, K}, dt);
  Tensor b = Tensor::from_floats(bv, tb ? Shape{N, K} : Shape{K, N}, dt);
  Tensor c = Tensor::from_floats(cv, {M, N});
  matmul(a, ta, b, tb, c, 0.5f, 2.0f);
  auto ar = a.to_floats(), br = b.to_floats();
  std::vector<double> ref(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double x = ta ? ar[k * M + i] : ar[i * K + k];
        const double y = tb ? br[j * K + k] : br[k * N + j];
        s += x * y;
      }
      ref[i * N + j] = 0.5 * s + 2.0 * cv[i * N + j];
    }
  EXPECT_LT(test::rel_error(c.to_floats(), ref), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(AllCombos, MatmulTranspose,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(DType::f32, DType::bf16)));

TEST(Linear, BackwardMatchesFiniteDifferences) {
  const int64_t T = 5, in = 6, out = 4;
  auto xv = randn(T * in, 10), wv = randn(out * in, 11), bv = randn(out, 12), dyv = randn(T * out, 13);
  Tensor x = Tensor::from_floats(xv, {T, in}), w = Tensor::from_floats(wv, {out, in});
  Tensor b = Tensor::from_floats(bv, {out}), dy = Tensor::from_floats(dyv, {T, out});
  Tensor dx = linear_backward_data(dy, w);
  Tensor dw = Tensor::zeros({out, in}, DType::f32, Device::cpu(), MemCategory::grads);
  Tensor db = Tensor::zeros({out}, DType::f32, Device::cpu(), MemCategory::grads);
  linear_backward_weight(dy, x, dw, &db);
  const std::vector<double> wt = test::cast<double>(dyv);
  auto loss = [&](const std::vector<double>& X, const std::vector<double>& W,
                  const std::vector<double>& B) {
    std::vector<double> y(T * out, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) {
        double s = B[o];
        for (int64_t i = 0; i < in; ++i) s += X[t * in + i] * W[o * in + i];
        y[t * out + o] = s;
      }
    return test::weighted_sum(y, wt);
  };
  auto X = test::cast<double>(xv), W = test::cast<double>(wv), B = test::cast<double>(bv);
  auto gx = test::finite_diff([&](const std::vector<double>& v) { return loss(v, W, B); }, X);
  auto gw = test::finite_diff([&](const std::vector<double>& v) { return loss(X, v, B); }, W);
  auto gb = test::finite_diff([&](const std::vector<double>& v) { return loss(X, W, v); }, B);
  EXPECT_LT(test::rel_error(dx.to_floats(), gx), test::kGradTol);
  EXPECT_LT(test::rel_error(dw.to_floats(), gw), test::kGradTol);
  EXPECT_LT(test::rel_error(db.to_floats(), gb), test::kGradTol);
  // Asked for in bf16, d_x is the f32 one rounded once.
  {
    const Tensor dx16 = linear_backward_data(dy, w, DType::bf16);
    EXPECT_EQ(dx16.dtype(), DType::bf16);
    EXPECT_EQ(dx16.category(), MemCategory::activations);
    auto a = dx.to_floats(), b = dx16.to_floats();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(b[i], round_bf16(a[i]));
    test::expect_error_contains([&] { linear_backward_data(dy, w, DType::i32); },
                                "d_x can be f32 or bf16");
  }
  // The accumulating data gradient adds d_y w onto what is there: onto d_x it doubles it.
  linear_backward_data_acc(dy, w, dx);
  auto gx2 = gx;
  for (double& g : gx2) g *= 2;
  EXPECT_LT(test::rel_error(dx.to_floats(), gx2), test::kGradTol);
  Tensor wrong = Tensor::zeros({T, in + 1}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { linear_backward_data_acc(dy, w, wrong); }, "d_x");
  // Weight gradients accumulate: a second call doubles them.
  linear_backward_weight(dy, x, dw, &db);
  auto gw2 = gw;
  for (double& g : gw2) g *= 2;
  EXPECT_LT(test::rel_error(dw.to_floats(), gw2), test::kGradTol);
  // Forward agrees with the same double model.
  Tensor y = linear_forward(x, w, b);
  std::vector<double> yref(T * out);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double s = bv[o];
      for (int64_t i = 0; i < in; ++i) s += double(xv[t * in + i]) * wv[o * in + i];
      yref[t * out + o] = s;
    }
  EXPECT_LT(test::rel_error(y.to_floats(), yref), 1e-6);
}

TEST(Linear, BadShapesAreClearErrors) {
  Tensor x = Tensor::zeros({3, 4}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor w = Tensor::zeros({5, 6}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { linear_forward(x, w, Tensor()); }, "x has 4 input features");
  Tensor c = Tensor::zeros({3, 3}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { matmul(x, false, w, true, c); }, "inner dimensions differ");
  Tensor xi = Tensor::zeros({3, 4}, DType::i32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { linear_forward(xi, w, Tensor()); }, "expected a float type");
}

TEST(Gemm, DoubleInstantiationAndZeroK) {
  std::vector<double> a = {1, 2, 3, 4}, b = {5, 6, 7, 8}, c(4, 9.0);
  cpu::gemm<double>(false, false, 2, 2, 2, 1.0, a.data(), b.data(), 0.0, c.data());
  EXPECT_EQ(c, (std::vector<double>{19, 22, 43, 50}));
  std::vector<float> cf(4, 3.0f);
  cpu::gemm<float>(false, false, 2, 2, 0, 1.0f, nullptr, nullptr, 0.5f, cf.data());
  EXPECT_EQ(cf, (std::vector<float>{1.5f, 1.5f, 1.5f, 1.5f}));
}

}  // namespace
}  // namespace bb
