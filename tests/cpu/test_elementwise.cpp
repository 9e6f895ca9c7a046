// Element-wise ops between primitives: the sigmoid gate (attention output gate) against finite
// differences in double, and splitting / joining the halves of the last dimension.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "primitives/elementwise/elementwise.h"

namespace bb {
namespace {

TEST(SigmoidMul, ForwardAndBackwardMatchFiniteDifferences) {
  const int64_t R = 7, C = 13;
  const std::vector<float> x = test::randn(R * C, 1), z = test::randn(R * C, 2, 2.0f),
                           w = test::randn(R * C, 3);
  Tensor tx = Tensor::from_floats(x, {R, C}), tz = Tensor::from_floats(z, {R, C});
  const std::vector<float> y = sigmoid_mul(tx, tz, MemCategory::activations).to_floats();
  for (int64_t i = 0; i < R * C; ++i)
    EXPECT_NEAR(y[i], x[i] / (1.0 + std::exp(-double(z[i]))), 1e-6);
  auto [dx, dz] = sigmoid_mul_backward(Tensor::from_floats(w, {R, C}), tx, tz);
  EXPECT_EQ(dx.dtype(), DType::f32);
  EXPECT_EQ(dz.shape(), (Shape{R, C}));
  const std::vector<double> wd = test::cast<double>(w);
  auto loss = [&](const std::vector<double>& v) {  // v = [x, z]
    double s = 0;
    for (int64_t i = 0; i < R * C; ++i) s += wd[i] * v[i] / (1.0 + std::exp(-v[R * C + i]));
    return s;
  };
  std::vector<double> v = test::cast<double>(x);
  v.insert(v.end(), z.begin(), z.end());
  const std::vector<double> fd = test::finite_diff(loss, v);
  EXPECT_LT(test::rel_error(dx.to_floats(), std::vector<double>(fd.begin(), fd.begin() + R * C)), test::kGradTol);
  EXPECT_LT(test::rel_error(dz.to_floats(), std::vector<double>(fd.begin() + R * C, fd.end())), test::kGradTol);
  // bf16 storage: y in x's dtype.
  EXPECT_EQ(sigmoid_mul(tx.to_dtype(DType::bf16), tz, MemCategory::other).dtype(), DType::bf16);
  test::expect_error_contains([&] { sigmoid_mul(tx, Tensor::from_floats(z, {C, R}), MemCategory::other); },
                              "must have the same shape");
}

TEST(Halves, SplitThenJoinRoundTripsInEveryDtype) {
  const int64_t R = 5, C = 6;
  const std::vector<float> x = test::randn(R * 2 * C, 4);
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor t = Tensor::from_floats(x, {R, 2 * C}, dt);
    auto [a, b] = split_halves(t, MemCategory::activations);
    EXPECT_EQ(a.shape(), (Shape{R, C}));
    EXPECT_EQ(a.dtype(), dt);
    const std::vector<float> xt = t.to_floats(), av = a.to_floats(), bv = b.to_floats();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        EXPECT_EQ(av[r * C + c], xt[r * 2 * C + c]);
        EXPECT_EQ(bv[r * C + c], xt[r * 2 * C + C + c]);
      }
    EXPECT_EQ(join_halves(a, b, dt, MemCategory::other).to_floats(), xt);
    EXPECT_EQ(join_halves(a, b, DType::f32, MemCategory::other).to_floats(), xt);
  }
  test::expect_error_contains([] {
    split_halves(Tensor::from_floats({1, 2, 3}, {1, 3}), MemCategory::other);
  }, "must be [R, 2C]");
}

}  // namespace
}  // namespace bb
