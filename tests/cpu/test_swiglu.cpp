// SwiGLU: forward values, gradient against double finite differences, bf16 storage, bad input.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "primitives/activation/swiglu.h"
#include "primitives/activation/swiglu_ref.h"

namespace bb {
namespace {

TEST(Swiglu, ForwardMatchesFormula) {
  const int64_t N = 3, F = 4;
  auto gu = test::randn(N * 2 * F, 1, 2.0f);
  Tensor h = swiglu_forward(Tensor::from_floats(gu, {N, 2 * F}));
  EXPECT_EQ(h.shape(), (Shape{N, F}));
  EXPECT_EQ(h.dtype(), DType::f32);
  EXPECT_EQ(h.category(), MemCategory::activations);
  auto hv = h.to_floats();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) {
      const double g = gu[n * 2 * F + j], u = gu[n * 2 * F + F + j];
      EXPECT_NEAR(hv[n * F + j], g / (1 + std::exp(-g)) * u, 1e-6 * (1 + std::fabs(g * u)));
    }
  // silu is stable far from zero: no NaN or overflow for large |gate|.
  Tensor big = Tensor::from_floats({-200.f, 200.f, 3.f, 0.5f}, {1, 4});
  auto bv = swiglu_forward(big, MemCategory::workspace).to_floats();
  EXPECT_EQ(bv[0], 0.0f);  // silu(-200) underflows to (-)0
  EXPECT_FLOAT_EQ(bv[1], 100.f);
  EXPECT_EQ(swiglu_forward(big, MemCategory::workspace).category(), MemCategory::workspace);
}

TEST(Swiglu, BackwardMatchesFiniteDifferences) {
  const int64_t N = 5, F = 7;
  auto gu = test::randn(N * 2 * F, 2, 1.5f);
  auto w = test::randn(N * F, 3);
  const std::vector<double> wd = test::cast<double>(w);
  auto loss = [&](const std::vector<double>& x) {
    std::vector<double> h(N * F);
    ref::swiglu_forward(h.data(), x.data(), N, F);
    return test::weighted_sum(h, wd);
  };
  auto fd = test::finite_diff(loss, test::cast<double>(gu));
  Tensor d = swiglu_backward(Tensor::from_floats(w, {N, F}), Tensor::from_floats(gu, {N, 2 * F}));
  EXPECT_EQ(d.shape(), (Shape{N, 2 * F}));
  EXPECT_LT(test::rel_error(d.to_floats(), fd), test::kGradTol);
}

TEST(Swiglu, Bf16StorageComputesInF32) {
  const int64_t N = 4, F = 6;
  auto gu = test::randn(N * 2 * F, 4);
  Tensor gu16 = Tensor::from_floats(gu, {N, 2 * F}, DType::bf16);
  auto gr = gu16.to_floats();  // the bf16-rounded inputs
  Tensor h = swiglu_forward(gu16);
  EXPECT_EQ(h.dtype(), DType::bf16);
  std::vector<float> expect(N * F);
  ref::swiglu_forward(expect.data(), gr.data(), N, F);
  auto hv = h.to_floats();
  for (size_t i = 0; i < hv.size(); ++i) EXPECT_EQ(hv[i], round_bf16(expect[i]));
  auto dh = test::randn(N * F, 5);
  Tensor d = swiglu_backward(Tensor::from_floats(dh, {N, F}, DType::bf16), gu16);
  EXPECT_EQ(d.dtype(), DType::bf16);
  std::vector<float> d_expect(N * 2 * F);
  auto dhr = Tensor::from_floats(dh, {N, F}, DType::bf16).to_floats();
  ref::swiglu_backward(d_expect.data(), dhr.data(), gr.data(), N, F);
  auto dv = d.to_floats();
  for (size_t i = 0; i < dv.size(); ++i) EXPECT_EQ(dv[i], round_bf16(d_expect[i]));
}

TEST(Swiglu, BadInputs) {
  test::expect_error_contains(
      [] {
        swiglu_forward(Tensor::zeros({2, 5}, DType::f32, Device::cpu(), MemCategory::other));
      },
      "swiglu_forward: argument 'gate_up' has shape [2, 5], expected [N, 2F]");
  test::expect_error_contains(
      [] {
        swiglu_forward(Tensor::zeros({2, 4}, DType::i32, Device::cpu(), MemCategory::other));
      },
      "swiglu_forward: argument 'gate_up' has dtype i32");
  test::expect_error_contains(
      [] {
        swiglu_backward(Tensor::zeros({2, 3}, DType::f32, Device::cpu(), MemCategory::other),
                        Tensor::zeros({2, 4}, DType::f32, Device::cpu(), MemCategory::other));
      },
      "swiglu_backward: argument 'd_h' has shape [2, 3], expected [2, 2]");
}

}  // namespace
}  // namespace bb
