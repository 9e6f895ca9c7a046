// RoPE: against an independent complex-number formulation, FD gradients, partial rotary.
#include <gtest/gtest.h>

#include <complex>

#include "common/testing.h"
#include "primitives/rope/rope.h"
#include "primitives/rope/rope_ref.h"

namespace bb {
namespace {

using test::randn;

// Independent reference: pair (i, i+R/2) as the complex number x_i + i x_{i+R/2}, multiplied by
// e^{i a} with a = pos / theta^(2i/R), all in double.
std::vector<double> rope_complex(const std::vector<float>& x, const std::vector<int32_t>& pos,
                                 int64_t T, int64_t n, int64_t D, int64_t R, double theta) {
  std::vector<double> y(x.begin(), x.end());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < n; ++h)
      for (int64_t i = 0; i < R / 2; ++i) {
        const double a = pos[t] / std::pow(theta, 2.0 * i / R);
        const int64_t base = (t * n + h) * D;
        std::complex<double> z(x[base + i], x[base + i + R / 2]);
        z *= std::polar(1.0, a);
        y[base + i] = z.real();
        y[base + i + R / 2] = z.imag();
      }
  return y;
}

TEST(Rope, MatchesComplexRotation) {
  const int64_t T = 7, n = 3, D = 16;
  auto xv = randn(T * n * D, 1);
  std::vector<int32_t> pos = {0, 1, 2, 5, 0, 1, 300};
  Tensor x = Tensor::from_floats(xv, {T, n, D});
  Tensor p = Tensor::from_ints(pos, {T});
  for (int64_t R : {int64_t(16), int64_t(8)}) {  // full and partial rotary
    Tensor y = rope_forward(x, p, {10000.0, R == D ? 0 : R});
    auto ref = rope_complex(xv, pos, T, n, D, R, 10000.0);
    EXPECT_LT(test::rel_error(y.to_floats(), ref), 1e-5) << "R=" << R;
    // The pass-through tail is exact.
    auto yv = y.to_floats();
    for (int64_t j = R; j < D; ++j) EXPECT_EQ(yv[j], xv[j]);
  }
}

TEST(Rope, PositionZeroIsIdentityAndNormPreserved) {
  const int64_t T = 2, n = 2, D = 8;
  auto xv = randn(T * n * D, 3);
  Tensor y = rope_forward(Tensor::from_floats(xv, {T, n, D}), Tensor::from_ints({0, 1000}, {T}), {1e6, 0});
  auto yv = y.to_floats();
  for (int64_t i = 0; i < n * D; ++i) EXPECT_EQ(yv[i], xv[i]);
  double nx = 0, ny = 0;
  for (int64_t i = n * D; i < T * n * D; ++i) { nx += double(xv[i]) * xv[i]; ny += double(yv[i]) * yv[i]; }
  EXPECT_NEAR(nx, ny, 1e-4 * nx);
}

TEST(Rope, BackwardMatchesFiniteDifferences) {
  const int64_t T = 4, n = 2, D = 12, R = 8;
  auto xv = randn(T * n * D, 4), dyv = randn(T * n * D, 5);
  std::vector<int32_t> pos = {3, 0, 17, 2};
  Tensor dx = rope_backward(Tensor::from_floats(dyv, {T, n, D}), Tensor::from_ints(pos, {T}), {500.0, R});
  auto wt = test::cast<double>(dyv);
  auto g = test::finite_diff(
      [&](const std::vector<double>& xx) {
        std::vector<double> yy(xx.size());
        ref::rope_apply<double>(yy.data(), xx.data(), pos.data(), T, n, D, R, 500.0, +1);
        return test::weighted_sum(yy, wt);
      },
      test::cast<double>(xv));
  EXPECT_LT(test::rel_error(dx.to_floats(), g), test::kGradTol);
}

TEST(Rope, BadInput) {
  Tensor x = Tensor::zeros({2, 1, 6}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { rope_forward(x, Tensor::from_ints({0, 1}, {2}), {1e4, 5}); },
                              "must be even");
  test::expect_error_contains([&] { rope_forward(x, Tensor::from_ints({0, 1, 2}, {3}), {}); },
                              "argument 'positions' has shape [3], expected [2]");
  test::expect_error_contains([&] { rope_forward(x, Tensor::from_floats({0, 1}, {2}), {}); },
                              "argument 'positions' has dtype f32, expected i32");
}

}  // namespace
}  // namespace bb
